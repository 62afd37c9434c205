"""``type: gemini`` backends and the context-cache manager through real gunicorn -k gevent,
driven by the official openai SDK, against the fake Gemini API in its own process (what the
router sent it is read back from ``/_sim/received``, its cache counters from
``/_sim/stats``)."""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import openai
import pytest
import requests

from continuum.devtools.fleet import metric_sum
from continuum.devtools.gemini_fake import FakeGeminiProcess
from continuum.devtools.procs import wait_until
from continuum.devtools.redis_server import unique_prefix
from continuum.routing import gemini

pytestmark = pytest.mark.e2e

KEY = "AIza-upstream-key"
MODEL = "gemini-2.5-flash"
LONG_SYSTEM = "You are the support assistant of the router; answer from its manual. " * 40
CHAT = "/v1beta/openai/chat/completions"


@pytest.fixture
def gemini_factory(tmp_path: Path) -> Iterator[Callable[..., FakeGeminiProcess]]:
    """Start fake Gemini APIs (``min_cache_tokens`` 100 unless given); stopped at the end."""
    started: list[FakeGeminiProcess] = []

    def start(**kwargs: Any) -> FakeGeminiProcess:
        kwargs.setdefault("min_cache_tokens", 100)
        fake = FakeGeminiProcess(tmp_path, api_key=KEY, **kwargs)
        started.append(fake)
        return fake

    yield start
    for fake in started:
        fake.stop()


def _config(fake: FakeGeminiProcess, **cache: Any) -> dict[str, Any]:
    return {
        "backends": [{"name": "gem", "url": fake.url, "type": "gemini", "api_key": KEY,
                      "models": [MODEL]}],
        "health_check": {"interval_seconds": 0.5},
        "gemini_context_cache": {"enabled": True, "min_prefix_bytes": 1024, **cache},
    }


def _client(router: Any) -> openai.OpenAI:
    """An SDK client of ``router`` (closed at the test's end: tests/integration/conftest.py)."""
    return openai.OpenAI(base_url=router.url + "/v1", api_key="client", max_retries=0)


def _ask(client: openai.OpenAI, question: str = "How do I clear the cache?",
         system: str = LONG_SYSTEM, **extra: Any) -> Any:
    return client.chat.completions.create(
        model=MODEL, messages=[{"role": "system", "content": system},
                               {"role": "user", "content": question}], **extra)


def _stats(router: Any) -> dict[str, Any]:
    return requests.get(router.url + "/admin/gemini-context-cache/stats", timeout=5).json()


def _wait_entries(router: Any, count: int, field: str = "entries") -> dict[str, Any]:
    return wait_until(lambda: (s := _stats(router))[field] == count and s["in_flight"] == 0
                      and s, f"{count} {field} in the Gemini cache map")


def _last_chat_body(fake: FakeGeminiProcess, part: str = CHAT) -> dict[str, Any]:
    return fake.received(part, "POST")[-1]["body"]  # type: ignore[no-any-return]


def test_first_request_is_unmodified_creation_single_flight_then_reference(
    gemini_factory: Callable[..., FakeGeminiProcess], router_factory: Callable[..., Any]
) -> None:
    fake = gemini_factory()
    router = router_factory(_config(fake))
    client = _client(router)
    with ThreadPoolExecutor(20) as pool:
        answers = list(pool.map(lambda i: _ask(client, f"Question {i}?"), range(20)))
    assert all(a.choices[0].message.content for a in answers)
    _wait_entries(router, 1)
    assert fake.stats()["created"] == 1  # single-flight under 20 concurrent first requests
    first = fake.received(CHAT, "POST")[0]
    assert first["body"]["messages"][0] == {"role": "system", "content": LONG_SYSTEM}
    assert "extra_body" not in first["body"]
    assert first["headers"]["x-goog-api-key"] == KEY
    assert "authorization" not in first["headers"]
    create = fake.received("/cachedContents", "POST")
    assert len(create) == 1
    assert create[0]["path"] == "/v1beta/cachedContents"
    assert create[0]["body"] == {"model": "models/" + MODEL, "ttl": "600s",
                                 "systemInstruction": {"parts": [{"text": LONG_SYSTEM}]}}

    later = _ask(client, "And how do I see its stats?")
    body = _last_chat_body(fake)
    name = body["extra_body"]["google"]["cached_content"]
    assert name.startswith("cachedContents/")
    assert [m["role"] for m in body["messages"]] == ["user"]
    assert later.usage is not None and later.usage.prompt_tokens_details is not None
    cached = later.usage.prompt_tokens_details.cached_tokens
    assert cached is not None and cached > 0
    assert later.usage.prompt_tokens > cached  # prompt_tokens stays the whole prompt

    chunks = list(_ask(client, "Streamed?", stream=True,
                       stream_options={"include_usage": True}))
    final = chunks[-1]
    assert final.usage is not None and final.usage.prompt_tokens_details is not None
    assert final.usage.prompt_tokens_details.cached_tokens == cached
    stats = _stats(router)
    # the 20 concurrent requests missed until the create finished, then hit
    assert stats["hits"] + stats["misses"] == 22 and stats["misses"] >= 1
    assert stats["hits"] >= 2 and stats["creates"] == 1
    assert stats["backends"]["gem"]["cached_tokens"] >= 2 * cached
    metrics = router.metrics()
    assert 'continuum_gemini_context_cache_requests_total{backend="gem",result="hit"} ' \
        f'{stats["hits"]}.0' in metrics
    assert 'continuum_gemini_context_cache_operations_total{backend="gem",' \
        'operation="create"} 1.0' in metrics
    assert 'continuum_gemini_cached_tokens_total{backend="gem"}' in metrics


def test_native_surface_whole_and_streamed(
    gemini_factory: Callable[..., FakeGeminiProcess], router_factory: Callable[..., Any]
) -> None:
    fake = gemini_factory()
    router = router_factory(_config(fake, prefer_native_api=True))
    client = _client(router)
    first = _ask(client, max_tokens=64, temperature=0.0)
    body = _last_chat_body(fake, ":generateContent")
    assert body["systemInstruction"] == {"parts": [{"text": LONG_SYSTEM}]}
    assert body["contents"] == [{"role": "user",
                                 "parts": [{"text": "How do I clear the cache?"}]}]
    assert body["generationConfig"] == {"maxOutputTokens": 64, "temperature": 0.0}
    assert first.choices[0].finish_reason == "stop" and first.choices[0].message.content
    _wait_entries(router, 1)

    hit = _ask(client, max_tokens=64, temperature=0.0)
    body = _last_chat_body(fake, ":generateContent")
    assert body["cachedContent"].startswith("cachedContents/")
    assert "systemInstruction" not in body and "tools" not in body
    assert hit.choices[0].message.content == first.choices[0].message.content
    assert hit.usage is not None and hit.usage.prompt_tokens_details is not None
    cached = hit.usage.prompt_tokens_details.cached_tokens
    assert cached is not None and cached > 0
    assert hit.usage.prompt_tokens == first.usage.prompt_tokens  # type: ignore[union-attr]

    chunks = list(_ask(client, stream=True, max_tokens=64, temperature=0.0,
                       stream_options={"include_usage": True}))
    received = fake.received(":streamGenerateContent", "POST")[-1]
    assert received["query"] == "alt=sse" and "cachedContent" in received["body"]
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == first.choices[0].message.content
    reasons = [c.choices[0].finish_reason for c in chunks if c.choices]
    assert reasons[-1] == "stop"
    assert chunks[-1].choices == [] and chunks[-1].usage is not None
    assert chunks[-1].usage.prompt_tokens_details is not None
    assert chunks[-1].usage.prompt_tokens_details.cached_tokens == cached
    # unasked, the usage chunk is not sent (as OpenAI's), yet the metrics count the stream
    before = metric_sum(router.metrics(), "continuum_prompt_tokens_total")
    unasked = list(_ask(client, stream=True, max_tokens=64, temperature=0.0))
    assert all(c.choices for c in unasked) and all(c.usage is None for c in unasked)
    assert "".join(c.choices[0].delta.content or "" for c in unasked) == text
    after = metric_sum(router.metrics(), "continuum_prompt_tokens_total")
    assert after - before == hit.usage.prompt_tokens


def test_refusal_is_negative_cached(
    gemini_factory: Callable[..., FakeGeminiProcess], router_factory: Callable[..., Any]
) -> None:
    fake = gemini_factory(min_cache_tokens=1_000_000)
    router = router_factory(_config(fake))
    client = _client(router)
    _ask(client)
    _wait_entries(router, 1, "negative_entries")
    for i in range(3):
        assert _ask(client, f"Again {i}?").choices[0].message.content
    assert fake.stats()["refused"] == 1 and fake.stats()["created"] == 0
    stats = _stats(router)
    assert stats["negative"] == 3 and stats["create_failures"] == 1
    assert "extra_body" not in _last_chat_body(fake)


def test_lru_eviction_and_clear_send_delete(
    gemini_factory: Callable[..., FakeGeminiProcess], router_factory: Callable[..., Any]
) -> None:
    fake = gemini_factory()
    router = router_factory(_config(fake, max_entries=10))
    client = _client(router)
    for i in range(11):
        _ask(client, system=f"Prompt number {i}. " + LONG_SYSTEM)
        _wait_entries(router, min(i + 1, 10))
    wait_until(lambda: fake.stats()["deleted"] == 1, "the evicted cache's DELETE")
    deleted = fake.received("/cachedContents/", "DELETE")
    first = fake.received("/cachedContents", "POST")[0]
    assert len(deleted) == 1
    assert _stats(router)["evictions"] == 1
    assert fake.stats()["live"] == 10
    assert first["body"]["systemInstruction"]["parts"][0]["text"].startswith("Prompt number 0")

    cleared = requests.post(router.url + "/admin/gemini-context-cache/clear", timeout=15).json()
    assert cleared["success"] is True and cleared["cleared_entries"] == 10
    assert fake.stats()["live"] == 0 and fake.stats()["deleted"] == 11
    assert _stats(router)["entries"] == 0


def test_expired_cache_retry_is_invisible(
    gemini_factory: Callable[..., FakeGeminiProcess], router_factory: Callable[..., Any]
) -> None:
    fake = gemini_factory()
    router = router_factory(_config(fake))
    client = _client(router)
    _ask(client)
    _wait_entries(router, 1)
    name = fake.received("/cachedContents", "POST")[0]
    listed = requests.get(fake.url + "/v1beta/cachedContents", timeout=5,
                          headers={"x-goog-api-key": KEY}).json()["cachedContents"]
    assert fake.expire(listed[0]["name"]) and name
    answer = _ask(client, "After expiry?")
    assert answer.choices[0].message.content
    last_two = fake.received(CHAT, "POST")[-2:]
    assert "extra_body" in last_two[0]["body"] and "extra_body" not in last_two[1]["body"]
    assert fake.stats()["uses_of_missing"] == 1
    assert 'operation="stale_retry"} 1.0' in router.metrics()
    _wait_entries(router, 1)  # the next miss created a new one
    assert fake.stats()["created"] == 2


def test_extend_on_hit_sends_patch(
    gemini_factory: Callable[..., FakeGeminiProcess], router_factory: Callable[..., Any]
) -> None:
    # The fake's clock runs 590 s behind: its resources expire, by our clock, 10 s after
    # creation, i.e. with under 20% of the 600 s TTL left at the first hit.
    fake = gemini_factory(clock_offset=-590)
    router = router_factory(_config(fake, extend_on_hit=True))
    client = _client(router)
    _ask(client)
    _wait_entries(router, 1)
    _ask(client, "A hit?")
    wait_until(lambda: fake.stats()["patched"] == 1, "the PATCH of the TTL")
    patch = fake.received("/cachedContents/", "PATCH")[0]
    assert patch["query"] == "updateMask=ttl" and patch["body"] == {"ttl": "600s"}
    assert 'operation="extend"} 1.0' in router.metrics()


def test_a_ttl_of_a_million_seconds_or_more_is_sent_as_decimal_seconds(
    gemini_factory: Callable[..., FakeGeminiProcess], router_factory: Callable[..., Any]
) -> None:
    """The longest TTL the config allows (30 days): created and extended. Written as
    ``"2.592e+06s"`` it was refused (a protobuf Duration is decimal seconds), and every
    eligible prompt went to the negative cache."""
    fake = gemini_factory(clock_offset=-(30 * 86400 - 10))  # under 20% left at the hit
    router = router_factory(_config(fake, ttl="30d", extend_on_hit=True))
    client = _client(router)
    _ask(client)
    _wait_entries(router, 1)
    create = fake.received("/cachedContents", "POST")
    assert [c["body"]["ttl"] for c in create] == ["2592000s"]
    assert fake.stats()["created"] == 1
    _ask(client, "A hit?")
    wait_until(lambda: fake.stats()["patched"] == 1, "the PATCH of the TTL")
    assert fake.received("/cachedContents/", "PATCH")[0]["body"] == {"ttl": "2592000s"}


def test_two_workers_with_redis_create_one_resource(
    gemini_factory: Callable[..., FakeGeminiProcess], router_factory: Callable[..., Any],
    redis_server: Any,
) -> None:
    fake = gemini_factory()
    cfg = _config(fake)
    cfg["response_cache"] = {"backend": "redis", "redis": {
        "url": redis_server.url, "key_prefix": unique_prefix()}}
    router = router_factory(cfg, workers=2)
    client = _client(router)
    with ThreadPoolExecutor(20) as pool:
        list(pool.map(lambda i: _ask(client, f"Question {i}?"), range(20)))
    wait_until(lambda: fake.stats()["created"] >= 1, "the cache to be created")
    for i in range(10):  # both workers now reuse the one resource
        _ask(client, f"Later {i}?")
    assert fake.stats()["created"] == 1
    refs = {r["body"].get("extra_body", {}).get("google", {}).get("cached_content")
            for r in fake.received(CHAT, "POST")[-6:]}
    assert len(refs) == 1 and None not in refs


def test_disabled_manager_and_models(
    gemini_factory: Callable[..., FakeGeminiProcess], router_factory: Callable[..., Any]
) -> None:
    fake = gemini_factory()
    cfg = _config(fake)
    cfg["gemini_context_cache"] = {"enabled": False}
    router = router_factory(cfg)
    assert _stats(router)["enabled"] is False
    cleared = requests.post(router.url + "/admin/gemini-context-cache/clear", timeout=5)
    assert cleared.status_code == 409  # an action on a tier that is off
    assert cleared.json()["error"]["code"] == "gemini_context_cache_disabled"
    client = _client(router)
    assert [m.id for m in client.models.list()] == [MODEL]
    _ask(client)
    _ask(client)
    assert fake.received("/cachedContents") == []
    assert "extra_body" not in _last_chat_body(fake)


# --- the Responses API, which Google serves no endpoint for: translated by the router ------

TOOL = {"type": "function", "name": "lookup", "description": "Find a page of the manual.",
        "parameters": {"type": "object", "properties": {"query": {"type": "string"}}}}


def _respond(client: openai.OpenAI, question: str = "How do I clear the cache?",
             **extra: Any) -> Any:
    extra.setdefault("max_output_tokens", 64)
    return client.responses.create(model=MODEL, instructions=LONG_SYSTEM, input=question,
                                   **extra)


def test_responses_go_to_the_native_api_and_come_back_as_responses(
    gemini_factory: Callable[..., FakeGeminiProcess], router_factory: Callable[..., Any]
) -> None:
    fake = gemini_factory()
    router = router_factory(_config(fake))  # prefer_native_api off: Responses go native
    client = _client(router)
    first = _respond(client, temperature=0.0)
    sent = fake.received(":generateContent", "POST")
    assert len(sent) == 1 and fake.received(CHAT) == [] and fake.received("/responses") == []
    assert sent[0]["path"] == f"/v1beta/models/{MODEL}:generateContent"
    assert sent[0]["body"] == {
        "systemInstruction": {"parts": [{"text": LONG_SYSTEM}]},
        "contents": [{"role": "user", "parts": [{"text": "How do I clear the cache?"}]}],
        "generationConfig": {"temperature": 0.0, "maxOutputTokens": 64}}
    assert first.object == "response" and first.status == "completed"
    assert first.id.startswith("resp_") and first.output[0].type == "message"
    assert first.output_text and first.instructions == LONG_SYSTEM
    assert first.usage is not None and first.usage.input_tokens > 0
    assert first.usage.input_tokens_details.cached_tokens == 0
    assert first.usage.total_tokens == first.usage.input_tokens + first.usage.output_tokens

    # Gemini's implicit cache now holds the instructions: reported as cached input tokens
    again = _respond(client, temperature=0.0)
    assert again.output_text == first.output_text
    assert again.usage is not None and again.usage.input_tokens == first.usage.input_tokens
    cached = again.usage.input_tokens_details.cached_tokens
    assert 0 < cached < again.usage.input_tokens

    events = list(_respond(client, stream=True, temperature=0.0))
    assert fake.received(":streamGenerateContent", "POST")[-1]["query"] == "alt=sse"
    types = [e.type for e in events]
    assert types[:2] == ["response.created", "response.in_progress"]
    assert types[-1] == "response.completed" and "error" not in types
    assert [e.sequence_number for e in events] == list(range(len(events)))
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert text == first.output_text
    done = events[-1].response
    assert done.output_text == text and done.usage.input_tokens_details.cached_tokens == cached
    # the SDK's own stream helper accumulates the events into the same response
    with client.responses.stream(model=MODEL, instructions=LONG_SYSTEM, temperature=0.0,
                                 input="How do I clear the cache?",
                                 max_output_tokens=64) as helper:
        final = helper.get_final_response()
    assert final.output_text == first.output_text and final.status == "completed"

    # the context cache serves chat completions only: no lookup, no cachedContents
    assert fake.received("/cachedContents") == []
    assert _stats(router)["hits"] + _stats(router)["misses"] == 0
    metrics = router.metrics()
    assert f'continuum_gemini_cached_tokens_total{{backend="gem"}} {3.0 * cached}' in metrics
    assert metric_sum(metrics, "continuum_requests_total", endpoint="responses",
                      outcome="upstream", status_class="2xx") == 4
    assert metric_sum(metrics, "continuum_cached_prompt_tokens_total") == 3 * cached

    short = _respond(client, max_output_tokens=2)
    assert short.status == "incomplete"
    assert short.incomplete_details is not None
    assert short.incomplete_details.reason == "max_output_tokens"


def test_responses_with_function_calls(
    gemini_factory: Callable[..., FakeGeminiProcess], router_factory: Callable[..., Any]
) -> None:
    fake = gemini_factory()
    router = router_factory(_config(fake))
    client = _client(router)
    ask = "Please lookup the page on clearing"
    called = _respond(client, ask, tools=[TOOL], tool_choice="auto")
    body = _last_chat_body(fake, ":generateContent")
    assert body["contents"] == [{"role": "user", "parts": [{"text": ask}]}]
    assert body["tools"] == [{"functionDeclarations": [
        {"name": "lookup", "description": TOOL["description"],
         "parameters": TOOL["parameters"]}]}]
    assert body["toolConfig"] == {"functionCallingConfig": {"mode": "AUTO"}}
    [call] = called.output
    assert call.type == "function_call" and call.name == "lookup"
    assert json.loads(call.arguments) == {"query": ask[:40]}

    # the call and its result go back as items: functionCall and functionResponse parts
    answer = client.responses.create(
        model=MODEL, instructions=LONG_SYSTEM, max_output_tokens=64, tools=[TOOL], input=[
            {"role": "user", "content": ask},
            {"type": "function_call", "call_id": call.call_id, "name": "lookup",
             "arguments": call.arguments},
            {"type": "function_call_output", "call_id": call.call_id,
             "output": '{"page": "Clearing: POST /admin/cache/clear"}'},
            {"role": "user", "content": [{"type": "input_text", "text": "Thanks, and?"}]}])
    contents = _last_chat_body(fake, ":generateContent")["contents"]
    assert contents == [
        {"role": "user", "parts": [{"text": ask}]},
        {"role": "model", "parts": [{"functionCall": {"name": "lookup",
                                                      "args": {"query": ask[:40]}}}]},
        {"role": "user", "parts": [
            {"functionResponse": {"name": "lookup", "response": {
                "page": "Clearing: POST /admin/cache/clear"}}},
            {"text": "Thanks, and?"}]}]
    assert answer.status == "completed" and answer.output_text
    assert answer.usage is not None and answer.usage.input_tokens_details.cached_tokens > 0

    events = list(_respond(client, ask, tools=[TOOL], stream=True))
    types = [e.type for e in events]
    assert types[-4:] == ["response.function_call_arguments.delta",
                          "response.function_call_arguments.done",
                          "response.output_item.done", "response.completed"]
    assert events[-1].response.output[0].arguments == call.arguments
    with client.responses.stream(model=MODEL, instructions=LONG_SYSTEM, input=ask,
                                 tools=[TOOL]) as helper:
        [streamed_call] = helper.get_final_response().output
    assert streamed_call.type == "function_call" and streamed_call.arguments == call.arguments


def test_what_a_gemini_backend_cannot_honour_is_a_400_naming_the_field(
    gemini_factory: Callable[..., FakeGeminiProcess], router_factory: Callable[..., Any]
) -> None:
    fake = gemini_factory()
    router = router_factory(_config(fake))
    client = _client(router)
    cases = [({"previous_response_id": "resp_123"}, "previous_response_id"),
             ({"tools": [{"type": "web_search"}]}, "tools[0]"),
             ({"input": [{"type": "input_file", "file_id": "file-1"}]}, "input[0]"),
             ({"input": [{"role": "user", "content": [
                 {"type": "input_image", "file_id": "file-1"}]}]}, "input[0].content[0]"),
             ({"text": {"format": {"type": "json_schema"}}}, "text.format")]
    for extra, param in cases:
        with pytest.raises(openai.BadRequestError) as caught:
            client.responses.create(**{"model": MODEL, "input": "hi", **extra})
        assert caught.value.status_code == 400
        error = caught.value.body
        assert isinstance(error, dict) and error["param"] == param, (extra, error)
        assert error["type"] == "invalid_request_error"
    # Google has no legacy completions either: said before anything is sent
    with pytest.raises(openai.BadRequestError) as caught:
        client.completions.create(model=MODEL, prompt="Once upon a time")
    assert isinstance(caught.value.body, dict)
    assert caught.value.body["code"] == "unsupported_endpoint"
    assert "/v1/chat/completions" in caught.value.body["message"]
    assert fake.received("/v1beta", "POST") == []


G3 = "gemini-3-pro-preview"  # signs its function calls and wants the signatures back


def _native_with_gemini_3(gemini_factory: Callable[..., FakeGeminiProcess],
                          router_factory: Callable[..., Any]) -> tuple[FakeGeminiProcess,
                                                                      openai.OpenAI]:
    """A fake Gemini API, and a client of a router sending chat to its native API, serving
    ``MODEL`` and ``G3``."""
    fake = gemini_factory()
    cfg = _config(fake, prefer_native_api=True)
    cfg["backends"][0]["models"] = [MODEL, G3]
    return fake, _client(router_factory(cfg))


def _signature(call: Any) -> Any:
    return (call.model_extra or {}).get("extra_content", {}).get("google", {}).get(
        "thought_signature")


def test_gemini_3_signatures_round_trip_through_chat_and_responses(
    gemini_factory: Callable[..., FakeGeminiProcess], router_factory: Callable[..., Any]
) -> None:
    fake, client = _native_with_gemini_3(gemini_factory, router_factory)
    ask = "Please lookup the page on clearing"
    chat_tool = {"type": "function", "function": {
        k: TOOL[k] for k in ("name", "description", "parameters")}}

    # chat completions on the native API: the signature comes as Google's compatible
    # surface gives it, and goes back beside the functionCall
    first = client.chat.completions.create(
        model=G3, tools=[chat_tool], messages=[{"role": "user", "content": ask}])
    [call] = first.choices[0].message.tool_calls or []
    signature = _signature(call)
    assert isinstance(signature, str) and signature
    history = [{"role": "user", "content": ask},
               {"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
               {"role": "tool", "tool_call_id": call.id, "content": '{"page": "POST /clear"}'}]
    answer = client.chat.completions.create(model=G3, tools=[chat_tool], messages=history)
    assert answer.choices[0].finish_reason in ("stop", "tool_calls")  # accepted
    sent = _last_chat_body(fake, ":generateContent")["contents"][1]["parts"][0]
    assert sent["thoughtSignature"] == signature
    # a client that kept only the call's id, name and arguments (as LangChain's ChatOpenAI
    # does): the signature comes back out of the id
    bare = {k: v for k, v in call.model_dump().items() if k != "extra_content"}
    answer = client.chat.completions.create(model=G3, tools=[chat_tool], messages=[
        history[0], {**history[1], "tool_calls": [bare]}, history[2]])
    assert answer.choices[0].finish_reason in ("stop", "tool_calls")
    assert _last_chat_body(fake, ":generateContent")["contents"][1]["parts"][0][
        "thoughtSignature"] == signature
    # a call Gemini never made (history another model began) goes as one Google lets
    # through unchecked, instead of failing the conversation
    foreign = {**bare, "id": "toolu_01A09q90qw90lq917835lq9"}
    answer = client.chat.completions.create(model=G3, tools=[chat_tool], messages=[
        history[0], {**history[1], "tool_calls": [foreign]},
        {**history[2], "tool_call_id": foreign["id"]}])
    assert answer.choices[0].finish_reason in ("stop", "tool_calls")
    assert _last_chat_body(fake, ":generateContent")["contents"][1]["parts"][0][
        "thoughtSignature"] == gemini.UNSIGNED
    # a signature that is not Gemini's is still Gemini's to refuse, and the client hears why
    forged = {**bare, "extra_content": {"google": {"thought_signature": "Zm9yZ2Vk"}}}
    with pytest.raises(openai.BadRequestError, match="Corrupted thought signature"):
        client.chat.completions.create(model=G3, tools=[chat_tool], messages=[
            history[0], {**history[1], "tool_calls": [forged]}, history[2]])

    # the Responses API: the function_call item carries it; sent back with the item
    called = client.responses.create(model=G3, input=ask, tools=[TOOL])
    [item] = called.output
    assert item.type == "function_call" and isinstance(_signature(item), str)
    output = {"type": "function_call_output", "call_id": item.call_id, "output": "POST /clear"}
    answer = client.responses.create(model=G3, tools=[TOOL], input=[
        {"role": "user", "content": ask}, *called.output, output])  # type: ignore[list-item]
    assert answer.status == "completed"  # accepted
    assert _last_chat_body(fake, ":generateContent")["contents"][1]["parts"][0][
        "thoughtSignature"] == _signature(item)
    # the item rebuilt from its call_id, name and arguments: the signature is in the call_id
    answer = client.responses.create(model=G3, tools=[TOOL], input=[
        {"role": "user", "content": ask},
        {"type": "function_call", "call_id": item.call_id, "name": item.name,
         "arguments": item.arguments}, output])
    assert answer.status == "completed"
    assert _last_chat_body(fake, ":generateContent")["contents"][1]["parts"][0][
        "thoughtSignature"] == _signature(item)
    # streamed, the item's signature comes in its events too
    events = list(client.responses.create(model=G3, input=ask, tools=[TOOL], stream=True))
    added = next(e for e in events if e.type == "response.output_item.added")
    assert isinstance(_signature(added.item), str)
    assert _signature(events[-1].response.output[0]) == _signature(added.item)


def test_reasoning_effort_and_thinking_config_reach_gemini_and_thoughts_come_back_apart(
    gemini_factory: Callable[..., FakeGeminiProcess], router_factory: Callable[..., Any]
) -> None:
    fake, client = _native_with_gemini_3(gemini_factory, router_factory)
    messages = [{"role": "user", "content": "What is two and two?"}]

    # Gemini 2.5 thinks by budget: low → 1,024 tokens (the fake reports budget ÷ 128)
    low = client.chat.completions.create(model=MODEL, messages=messages,  # type: ignore[arg-type]
                                         reasoning_effort="low")
    sent = _last_chat_body(fake, ":generateContent")["generationConfig"]
    assert sent == {"thinkingConfig": {"thinkingBudget": 1024}}
    assert low.usage is not None and low.usage.completion_tokens_details is not None
    assert low.usage.completion_tokens_details.reasoning_tokens == 8
    assert "reasoning_content" not in (low.choices[0].message.model_extra or {})

    # Gemini 3 by level; Google's own spelling, with thought summaries
    google = {"extra_body": {"google": {"thinking_config": {"thinking_level": "high",
                                                            "include_thoughts": True}}}}
    deep = client.chat.completions.create(model=G3, messages=messages,  # type: ignore[arg-type]
                                          extra_body=google)
    sent = _last_chat_body(fake, ":generateContent")["generationConfig"]
    assert sent == {"thinkingConfig": {"thinkingLevel": "high", "includeThoughts": True}}
    message = deep.choices[0].message
    thought = (message.model_extra or {})["reasoning_content"]
    assert thought.startswith("Thinking about:") and thought not in (message.content or "")
    assert deep.usage is not None and deep.usage.completion_tokens_details is not None
    assert deep.usage.completion_tokens_details.reasoning_tokens == 192
    chunks = list(client.chat.completions.create(
        model=G3, messages=messages, extra_body=google, stream=True))  # type: ignore[arg-type]
    deltas = [c.choices[0].delta for c in chunks if c.choices]
    assert (deltas[0].model_extra or {}).get("reasoning_content") == thought
    assert "".join(d.content or "" for d in deltas) == message.content

    # the Responses API: reasoning.effort the same way
    answer = client.responses.create(model=G3, input="What is two and two?",
                                     reasoning={"effort": "low"})
    assert _last_chat_body(fake, ":generateContent")["generationConfig"] == {
        "thinkingConfig": {"thinkingLevel": "low"}}
    assert answer.usage is not None and answer.usage.output_tokens_details.reasoning_tokens == 8

    # a level the model does not take is Google's 400, in OpenAI's shape; a value OpenAI
    # does not define is the router's, and nothing is sent
    with pytest.raises(openai.BadRequestError, match="Invalid thinking level: minimal"):
        client.chat.completions.create(model=G3, messages=messages,  # type: ignore[arg-type]
                                       reasoning_effort="minimal")
    before = len(fake.received(":generateContent", "POST"))
    with pytest.raises(openai.BadRequestError) as caught:
        client.chat.completions.create(model=G3, messages=messages,  # type: ignore[arg-type]
                                       extra_body={"reasoning_effort": "extreme"})
    assert caught.value.body["param"] == "reasoning_effort"  # type: ignore[index]
    assert len(fake.received(":generateContent", "POST")) == before


def test_an_image_by_url_reaches_the_native_api_with_its_mime_type(
    gemini_factory: Callable[..., FakeGeminiProcess], router_factory: Callable[..., Any]
) -> None:
    fake = gemini_factory()
    router = router_factory(_config(fake, prefer_native_api=True))
    client = _client(router)
    url = "https://example.com/diagram.png"
    answer = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": [
        {"type": "text", "text": "What does the diagram show?"},
        {"type": "image_url", "image_url": {"url": url}}]}])
    assert answer.choices[0].message.content  # the fake refuses a fileData without mimeType
    assert _last_chat_body(fake, ":generateContent")["contents"][0]["parts"][1] == {
        "fileData": {"mimeType": "image/png", "fileUri": url}}


def test_responses_reasoning_summary_comes_back_as_a_reasoning_item_whole_and_streamed(
    gemini_factory: Callable[..., FakeGeminiProcess], router_factory: Callable[..., Any]
) -> None:
    fake, client = _native_with_gemini_3(gemini_factory, router_factory)
    asked = {"effort": "high", "summary": "auto"}
    answer = client.responses.create(model=G3, input="What is two and two?",
                                     reasoning=asked)  # type: ignore[arg-type]
    assert _last_chat_body(fake, ":generateContent")["generationConfig"] == {
        "thinkingConfig": {"thinkingLevel": "high", "includeThoughts": True}}
    thought, message = answer.output
    assert thought.type == "reasoning" and message.type == "message"
    assert thought.summary[0].text.startswith("Thinking about:")
    assert thought.summary[0].text not in answer.output_text
    assert answer.reasoning is not None and answer.reasoning.summary == "auto"

    with client.responses.stream(model=G3, input="What is two and two?",
                                 reasoning=asked) as stream:  # type: ignore[arg-type]
        types = [event.type for event in stream]
        final = stream.get_final_response()
    deltas = [t for t in types if t == "response.reasoning_summary_text.delta"]
    assert deltas and types.index("response.reasoning_summary_text.done") < types.index(
        "response.output_text.delta")
    assert [item.type for item in final.output] == ["reasoning", "message"]
    assert final.output[0].summary[0].text == thought.summary[0].text  # type: ignore[union-attr]
    assert final.output_text == answer.output_text


def test_logprobs_come_back_from_the_native_api_whole_and_streamed(
    gemini_factory: Callable[..., FakeGeminiProcess], router_factory: Callable[..., Any]
) -> None:
    fake = gemini_factory()
    client = _client(router_factory(_config(fake, prefer_native_api=True)))
    messages = [{"role": "user", "content": "Say something."}]
    answer = client.chat.completions.create(model=MODEL, messages=messages,  # type: ignore[arg-type]
                                            logprobs=True, top_logprobs=2)
    assert _last_chat_body(fake, ":generateContent")["generationConfig"] == {
        "responseLogprobs": True, "logprobs": 2}
    choice = answer.choices[0]
    assert choice.logprobs is not None and choice.logprobs.content
    assert "".join(t.token for t in choice.logprobs.content) == choice.message.content
    assert all(len(t.top_logprobs) == 2 and t.top_logprobs[0].token == t.token
               and t.logprob < 0 for t in choice.logprobs.content)

    chunks = list(client.chat.completions.create(
        model=MODEL, messages=messages, logprobs=True, stream=True))  # type: ignore[arg-type]
    tokens = [t.token for c in chunks if c.choices and c.choices[0].logprobs
              for t in c.choices[0].logprobs.content or []]
    assert "".join(tokens) == choice.message.content

    # without logprobs, none come back; top_logprobs alone is Google's 400
    plain = client.chat.completions.create(model=MODEL, messages=messages)  # type: ignore[arg-type]
    assert plain.choices[0].logprobs is None
    with pytest.raises(openai.BadRequestError, match="responseLogprobs"):
        client.chat.completions.create(model=MODEL, messages=messages,  # type: ignore[arg-type]
                                       top_logprobs=2)


def test_a_prompt_google_blocks_is_a_content_filter_finish_not_an_empty_answer(
    gemini_factory: Callable[..., FakeGeminiProcess], router_factory: Callable[..., Any]
) -> None:
    fake = gemini_factory()
    client = _client(router_factory(_config(fake, prefer_native_api=True)))
    messages = [{"role": "user", "content": "Tell me [blocked prompt] now."}]
    answer = client.chat.completions.create(model=MODEL, messages=messages)  # type: ignore[arg-type]
    [choice] = answer.choices
    assert choice.finish_reason == "content_filter" and choice.message.content is None
    chunks = list(client.chat.completions.create(model=MODEL, messages=messages,  # type: ignore[arg-type]
                                                 stream=True))
    assert [c.choices[0].finish_reason for c in chunks if c.choices] == ["content_filter"]
    response = client.responses.create(model=MODEL, input="Tell me [blocked prompt] now.")
    assert response.status == "incomplete"
    assert response.incomplete_details is not None
    assert response.incomplete_details.reason == "content_filter"


def test_a_body_the_native_api_cannot_take_is_a_400_naming_the_field_and_nothing_is_sent(
    gemini_factory: Callable[..., FakeGeminiProcess], router_factory: Callable[..., Any]
) -> None:
    fake = gemini_factory()
    router = router_factory(_config(fake, prefer_native_api=True))
    body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"},
                                         {"role": "assistant", "tool_calls": ["x"]},
                                         {"role": "user", "content": "and?"}]}
    answer = requests.post(router.url + "/v1/chat/completions", json=body, timeout=10)
    assert answer.status_code == 400
    error = answer.json()["error"]
    assert error["param"] == "messages[1].tool_calls[0]"
    assert error["type"] == "invalid_request_error"
    assert fake.received(":generateContent", "POST") == []


def test_responses_output_text_logprobs_from_the_native_api(
    gemini_factory: Callable[..., FakeGeminiProcess], router_factory: Callable[..., Any]
) -> None:
    fake = gemini_factory()
    client = _client(router_factory(_config(fake)))
    answer = client.responses.create(model=MODEL, input="Say something.", top_logprobs=2,
                                     include=["message.output_text.logprobs"])
    assert _last_chat_body(fake, ":generateContent")["generationConfig"] == {
        "responseLogprobs": True, "logprobs": 2}
    text = answer.output[0].content[0]  # type: ignore[union-attr]
    assert text.logprobs and "".join(t.token for t in text.logprobs) == answer.output_text
    assert all(len(t.top_logprobs) == 2 for t in text.logprobs)
    events = list(client.responses.create(model=MODEL, input="Say something.", stream=True,
                                          include=["message.output_text.logprobs"]))
    tokens = [t.token for e in events if e.type == "response.output_text.delta"
              for t in e.logprobs]
    assert "".join(tokens) == answer.output_text
