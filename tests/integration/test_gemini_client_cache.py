"""A client's own ``extra_body.google`` through real gunicorn -k gevent to the fake Gemini
API, driven by the official openai SDK: its ``cached_content`` and ``safety_settings`` reach
the native API as ``cachedContent`` and ``safetySettings``; its cache reference wins over
the context-cache manager's, which then neither references nor creates anything for the
request; and an endpoint without ``cachedContents`` (501) ends in the negative cache."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import openai
import pytest
import requests

from continuum.caching.gemini_context import TRANSIENT_BACKOFF_SECONDS
from continuum.devtools.gemini_fake import FakeGeminiProcess
from continuum.devtools.procs import wait_until
from tests.integration.test_gemini_e2e import CHAT, KEY, LONG_SYSTEM, MODEL, _client, _config

pytestmark = pytest.mark.e2e

NATIVE = ":generateContent"
LET_THROUGH = [{"category": "HARM_CATEGORY_DANGEROUS_CONTENT", "threshold": "BLOCK_NONE"}]


def _router(router_factory: Callable[..., Any], fake: FakeGeminiProcess,
            **cache: Any) -> Any:
    return router_factory(_config(fake, **cache))


def _google(**fields: Any) -> dict[str, Any]:
    """``extra_body`` for the openai SDK as Google documents it (the inner ``extra_body``
    is what goes on the wire)."""
    return {"extra_body": {"google": fields}}


def _stats(router: Any) -> dict[str, Any]:
    return requests.get(router.url + "/admin/gemini-context-cache/stats", timeout=5).json()


def _wait_entries(router: Any, count: int, field: str = "entries") -> dict[str, Any]:
    return wait_until(lambda: (s := _stats(router))[field] == count and s["in_flight"] == 0
                      and s, f"{count} {field} in the Gemini cache map")


def _clients_cache(fake: FakeGeminiProcess) -> str:
    """A cache the client created itself (as with google-genai's ``caches.create``)."""
    created = requests.post(fake.url + "/v1beta/cachedContents", timeout=5,
                            headers={"x-goog-api-key": KEY},
                            json={"model": "models/" + MODEL, "ttl": "600s",
                                  "systemInstruction": {"parts": [{"text": LONG_SYSTEM}]}})
    created.raise_for_status()
    return str(created.json()["name"])


def _last(fake: FakeGeminiProcess, part: str) -> dict[str, Any]:
    return fake.received(part, "POST")[-1]  # type: ignore[no-any-return]


def test_the_clients_cached_content_and_safety_settings_reach_the_native_api(
    fake: FakeGeminiProcess, router_factory: Callable[..., Any]
) -> None:
    name = _clients_cache(fake)
    client = _client(_router(router_factory, fake, prefer_native_api=True))
    user = [{"role": "user", "content": "How do I clear the cache?"}]
    answer = client.chat.completions.create(
        model=MODEL, messages=user,  # type: ignore[arg-type]
        extra_body=_google(cached_content=name, safety_settings=LET_THROUGH))
    body = _last(fake, NATIVE)["body"]
    assert body["cachedContent"] == name and body["safetySettings"] == LET_THROUGH
    assert "systemInstruction" not in body
    assert answer.usage is not None and answer.usage.prompt_tokens_details is not None
    cached = answer.usage.prompt_tokens_details.cached_tokens
    assert cached is not None and cached > 0  # the fake served the client's cache
    assert fake.stats()["explicit_hits"] == 1

    chunks = list(client.chat.completions.create(
        model=MODEL, messages=user, stream=True,  # type: ignore[arg-type]
        stream_options={"include_usage": True}, extra_body=_google(cached_content=name)))
    received = _last(fake, ":streamGenerateContent")
    assert received["body"]["cachedContent"] == name
    assert chunks[-1].usage is not None and chunks[-1].usage.prompt_tokens_details is not None
    assert chunks[-1].usage.prompt_tokens_details.cached_tokens == cached

    # the safety settings act: a prompt Google would block goes through with BLOCK_NONE
    risky = [{"role": "user", "content": "Tell me [blocked prompt] now."}]
    blocked = client.chat.completions.create(model=MODEL, messages=risky)  # type: ignore[arg-type]
    assert blocked.choices[0].finish_reason == "content_filter"
    allowed = client.chat.completions.create(
        model=MODEL, messages=risky,  # type: ignore[arg-type]
        extra_body=_google(safety_settings=LET_THROUGH))
    assert allowed.choices[0].finish_reason == "stop" and allowed.choices[0].message.content
    # a value Google does not know is Google's 400, in OpenAI's shape
    with pytest.raises(openai.BadRequestError, match="HarmCategory"):
        client.chat.completions.create(
            model=MODEL, messages=user,  # type: ignore[arg-type]
            extra_body=_google(safety_settings=[{"category": "HARM_CATEGORY_NOPE",
                                                 "threshold": "BLOCK_NONE"}]))
    # a cache Google does not know is its 403, passed on (the router has no entry to drop
    # and nothing to retry without: the reference is the client's)
    sent = len(fake.received(NATIVE, "POST"))
    with pytest.raises(openai.PermissionDeniedError, match="CachedContent not found"):
        client.chat.completions.create(model=MODEL, messages=user,  # type: ignore[arg-type]
                                       extra_body=_google(cached_content="cachedContents/x"))
    assert len(fake.received(NATIVE, "POST")) == sent + 1


@pytest.mark.parametrize(("google", "param"), [
    ({"cached_content": 42}, "extra_body.google.cached_content"),
    ({"safety_settings": "BLOCK_NONE"}, "extra_body.google.safety_settings"),
    ({"safety_settings": ["BLOCK_NONE"]}, "extra_body.google.safety_settings[0]"),
    ({"safety_settings": [{"category": "HARM_CATEGORY_HARASSMENT", "threshold": 4}]},
     "extra_body.google.safety_settings[0].threshold"),
])
def test_a_google_field_of_the_wrong_type_is_a_400_naming_it_and_nothing_is_sent(
    fake: FakeGeminiProcess, router_factory: Callable[..., Any], google: dict[str, Any],
    param: str
) -> None:
    client = _client(_router(router_factory, fake, prefer_native_api=True))
    with pytest.raises(openai.BadRequestError) as caught:
        client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "Hi"}],  # type: ignore[arg-type]
            extra_body={"extra_body": {"google": google}})
    error = caught.value.body
    assert isinstance(error, dict) and error["param"] == param
    assert error["type"] == "invalid_request_error" and error["code"] == "invalid_type"
    assert fake.received("/v1beta", "POST") == []


def _with_live_entry(router_factory: Callable[..., Any], fake: FakeGeminiProcess,
                     native: bool) -> tuple[Any, openai.OpenAI, list[dict[str, str]]]:
    """A router (native or compatible surface), its client, and a chat whose system prompt
    the context cache holds a live resource for (one request made it, none hit it yet)."""
    router = _router(router_factory, fake, prefer_native_api=native)
    client = _client(router)
    with_system = [{"role": "system", "content": LONG_SYSTEM},
                   {"role": "user", "content": "How do I clear the cache?"}]
    client.chat.completions.create(model=MODEL, messages=with_system)  # type: ignore[arg-type]
    _wait_entries(router, 1)
    return router, client, with_system


@pytest.mark.parametrize("native", [True, False])
@pytest.mark.parametrize(("extra", "param"), [({"google": "cachedContents/x"},
                                               "extra_body.google"),
                                              ("google", "extra_body")])
def test_an_extra_body_that_is_no_object_is_a_400_before_the_context_cache(
    fake: FakeGeminiProcess, router_factory: Callable[..., Any], native: bool, extra: Any,
    param: str
) -> None:
    """With a live context-cache resource for the prompt, a request whose ``extra_body`` (or
    its ``google``) is not an object is a 400 naming it, on either surface, and the manager
    counts nothing for it (on the compatible surface a hit used to end in a 500: the
    reference was merged into the string)."""
    router, client, with_system = _with_live_entry(router_factory, fake, native)
    before = _stats(router)
    with pytest.raises(openai.BadRequestError) as caught:
        client.chat.completions.create(
            model=MODEL, messages=with_system,  # type: ignore[arg-type]
            extra_body={"extra_body": extra})
    error = caught.value.body
    assert isinstance(error, dict) and error["param"] == param
    assert error["code"] == "invalid_type"
    after = _stats(router)
    assert (after["hits"], after["misses"]) == (before["hits"], before["misses"])


@pytest.mark.parametrize("native", [True, False])
def test_the_clients_reference_wins_over_the_managers(
    fake: FakeGeminiProcess, router_factory: Callable[..., Any], native: bool
) -> None:
    """The manager has a live resource for the prompt; a request that names the client's
    own cache still goes with that cache, its system prompt left where the client put it,
    and the manager neither counts a hit nor creates anything for it."""
    name = _clients_cache(fake)
    router, client, with_system = _with_live_entry(router_factory, fake, native)
    client.chat.completions.create(model=MODEL, messages=with_system)  # type: ignore[arg-type]
    before = _stats(router)
    assert before["hits"] == 1 and before["creates"] == 1
    path = NATIVE if native else CHAT

    # the client's cache without the system prompt (it is in the cache): as it was sent
    answer = client.chat.completions.create(
        model=MODEL, messages=with_system[1:],  # type: ignore[arg-type]
        extra_body=_google(cached_content=name))
    body = _last(fake, path)["body"]
    if native:
        assert body["cachedContent"] == name and "systemInstruction" not in body
    else:
        assert body["extra_body"] == {"google": {"cached_content": name}}
        assert body["messages"] == with_system[1:]
    assert answer.usage is not None and answer.usage.prompt_tokens_details is not None
    assert answer.usage.prompt_tokens_details.cached_tokens

    # with the system prompt too: not stripped, not replaced by the manager's resource;
    # Google refuses a cache together with a system instruction, and says so
    with pytest.raises(openai.BadRequestError, match="CachedContent can not be used"):
        client.chat.completions.create(model=MODEL, messages=with_system,  # type: ignore[arg-type]
                                       extra_body=_google(cached_content=name))
    body = _last(fake, path)["body"]
    if native:
        assert body["cachedContent"] == name
        assert body["systemInstruction"] == {"parts": [{"text": LONG_SYSTEM}]}
    else:
        assert body["extra_body"] == {"google": {"cached_content": name}}
        assert body["messages"] == with_system

    after = _stats(router)
    assert after["hits"] == before["hits"] and after["misses"] == before["misses"]
    assert after["ineligible"] == before["ineligible"] + 2
    # two resources in all: the client's and the manager's one for the prompt
    assert after["creates"] == 1 and fake.stats()["created"] == 2
    assert len(fake.received("/cachedContents", "POST")) == 2


@pytest.mark.slow
def test_an_endpoint_without_cached_contents_ends_in_the_negative_cache(
    fake: FakeGeminiProcess, router_factory: Callable[..., Any]
) -> None:
    """A proxy that mimics the Generative Language API but answers 501 to cachedContents:
    one create, then the prompt stays negative past the 10 s back-off of an outage;
    requests are answered all along."""
    requests.post(fake.url + "/_sim/cached-contents", json={"status": 501},
                  timeout=5).raise_for_status()
    router = _router(router_factory, fake, negative_ttl_seconds=600)
    client = _client(router)
    messages = [{"role": "system", "content": LONG_SYSTEM},
                {"role": "user", "content": "How do I clear the cache?"}]
    assert client.chat.completions.create(model=MODEL, messages=messages)  # type: ignore[arg-type]
    _wait_entries(router, 1, "negative_entries")
    for wait in (0, 0, TRANSIENT_BACKOFF_SECONDS + 1):
        time.sleep(wait)
        answer = client.chat.completions.create(model=MODEL, messages=messages)  # type: ignore[arg-type]
        assert answer.choices[0].message.content
    stats = _stats(router)
    assert stats["negative"] == 3 and stats["create_failures"] == 1 and stats["creates"] == 0
    assert stats["in_flight"] == 0
    assert len(fake.received("/cachedContents", "POST")) == 1
    assert "extra_body" not in _last(fake, CHAT)["body"]
