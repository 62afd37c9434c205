"""Native Anthropic through real gunicorn -k gevent, driven by the official anthropic SDK.

The upstream is the fake Anthropic API (``python -m continuum.sim.anthropic``) in its own
process; what the router sent it is read back from ``GET /_sim/received``.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import anthropic
import openai
import pytest
import requests

from continuum.devtools.procs import Child, free_port, wait_http
from continuum.sim.tokenizer import SimTokenizer

pytestmark = pytest.mark.e2e

UPSTREAM_KEY = "sk-ant-upstream"
CLIENT_KEY = "sk-ant-client"
AUTO = "claude-sonnet-4-6"  # served by backend "auto" (anthropic_auto_cache_control: true)
MANUAL = "claude-opus-4-7"  # served by backend "manual" (anthropic_auto_cache_control: false)
EPHEMERAL = {"type": "ephemeral"}
USER: list[Any] = [{"role": "user", "content": "What does the router do?"}]
LONG_SYSTEM = "You answer questions about the model cache of the router. " * 150
MAX_CACHE_MESSAGE = "A maximum of 4 blocks with cache_control may be provided. Found 5."


class AnthropicUpstream:
    """A running fake Anthropic API that requires ``UPSTREAM_KEY``."""

    def __init__(self, tmp: Path) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        argv = [sys.executable, "-m", "continuum.sim.anthropic", "--port", str(self.port),
                "--api-key", UPSTREAM_KEY]
        self.proc = Child(argv, log=tmp / "anthropic-upstream.log")
        wait_http(self.url + "/health", children=[self.proc])

    def received(self) -> list[dict[str, Any]]:
        """Every ``POST /v1/messages`` since the last reset, oldest first."""
        doc = requests.get(self.url + "/_sim/received", timeout=5).json()
        return doc["received"]  # type: ignore[no-any-return]

    def last_body(self) -> dict[str, Any]:
        """The body of the last ``POST /v1/messages``."""
        return self.received()[-1]["body"]  # type: ignore[no-any-return]

    def reset(self) -> None:
        """Forget received requests and every cached prefix."""
        requests.post(self.url + "/_sim/reset", timeout=5).raise_for_status()


@pytest.fixture(scope="module")
def anthropic_up(tmp_path_factory: pytest.TempPathFactory) -> Iterator[AnthropicUpstream]:
    """One fake Anthropic API for the module (reset before every test)."""
    up = AnthropicUpstream(tmp_path_factory.mktemp("anthropic"))
    yield up
    up.proc.stop()


@pytest.fixture(autouse=True)
def _fresh_upstream(anthropic_up: AnthropicUpstream) -> None:
    anthropic_up.reset()


_CLIENTS: list[anthropic.Anthropic | openai.OpenAI] = []


@pytest.fixture(autouse=True)
def _close_clients() -> Iterator[None]:
    yield
    while _CLIENTS:
        _CLIENTS.pop().close()


def _client(router: Any) -> anthropic.Anthropic:
    client = anthropic.Anthropic(base_url=router.url + "/anthropic", api_key=CLIENT_KEY,
                                 max_retries=0)
    _CLIENTS.append(client)
    return client


def _backend(name: str, up: AnthropicUpstream, model: str, **extra: Any) -> dict[str, Any]:
    return {"name": name, "url": up.url, "type": "anthropic", "api_key": UPSTREAM_KEY,
            "models": [model], **extra}


def _config(up: AnthropicUpstream, *, global_injection: bool = False,
            **extra: Any) -> dict[str, Any]:
    cfg: dict[str, Any] = {
        "backends": [_backend("auto", up, AUTO),
                     _backend("manual", up, MANUAL, anthropic_auto_cache_control=False)],
        "prefix_routing": {"anthropic_cache_control_injection": global_injection},
        "health_check": {"interval_seconds": 0.5},
    }
    cfg.update(extra)
    return cfg


def _sse_event_names(raw: bytes) -> list[str]:
    return [line[len(b"event: "):].decode() for line in raw.splitlines()
            if line.startswith(b"event: ")]


def test_whole_and_streamed_answers_agree_and_keys_are_replaced(
    anthropic_up: AnthropicUpstream, router_factory: Callable[..., Any]
) -> None:
    router = router_factory(_config(anthropic_up))
    client = _client(router)
    args: dict[str, Any] = {"model": AUTO, "max_tokens": 256, "system": "Be brief.",
                            "messages": USER}

    whole = client.messages.create(**args)
    assert whole.type == "message" and whole.role == "assistant" and whole.model == AUTO
    assert whole.stop_reason == "end_turn"
    text = whole.content[0].text  # type: ignore[union-attr]
    assert text and whole.usage.output_tokens > 0
    assert whole._request_id is not None and whole._request_id.startswith("req_")

    with client.messages.stream(**args) as stream:
        streamed = "".join(stream.text_stream)
        final = stream.get_final_message()
    assert streamed == text
    assert final.usage.output_tokens == whole.usage.output_tokens
    assert final.stop_reason == "end_turn"

    events = client.messages.create(**args, stream=True)
    with events:
        kinds, deltas = [], []
        for event in events:
            kinds.append(event.type)
            if event.type == "content_block_delta" and event.delta.type == "text_delta":
                deltas.append(event.delta.text)
    assert "".join(deltas) == text
    assert kinds[:2] == ["message_start", "content_block_start"]
    assert kinds[-3:] == ["content_block_stop", "message_delta", "message_stop"]

    # The exact wire sequence, ping included (the SDK hides pings).
    raw = requests.post(router.url + "/anthropic/v1/messages", json={**args, "stream": True},
                        headers={"anthropic-version": "2023-06-01"}, timeout=10)
    assert raw.status_code == 200
    assert raw.headers["content-type"].startswith("text/event-stream")
    names = _sse_event_names(raw.content)
    n = len(deltas)
    assert names == ["message_start", "content_block_start", "ping",
                     *["content_block_delta"] * n,
                     "content_block_stop", "message_delta", "message_stop"]

    # No version from the client: the backend's configured default goes upstream.
    bare = requests.post(router.url + "/anthropic/v1/messages", json=args, timeout=10)
    assert bare.status_code == 200

    received = anthropic_up.received()
    assert len(received) == 5
    sdk_version = client.default_headers["anthropic-version"]
    versions = [record["headers"]["anthropic-version"] for record in received]
    # Oldest first: the SDK's three (its version wins), the raw one, the bare one.
    assert versions == [sdk_version, sdk_version, sdk_version, "2023-06-01", "2023-06-01"]
    for record in received:
        headers = record["headers"]
        assert headers["x-api-key"] == UPSTREAM_KEY  # the backend's key, not the client's
        assert "authorization" not in headers
        assert CLIENT_KEY not in json.dumps(headers)
        assert record["path"] == "/v1/messages"


def test_prompt_cache_usage_through_the_router(
    anthropic_up: AnthropicUpstream, router_factory: Callable[..., Any]
) -> None:
    system_tokens = len(SimTokenizer().encode(LONG_SYSTEM))
    assert system_tokens >= 1024  # above Sonnet's minimum cacheable prefix
    router = router_factory(_config(anthropic_up))
    client = _client(router)
    args: dict[str, Any] = {"model": AUTO, "max_tokens": 64, "system": LONG_SYSTEM,
                            "messages": USER}

    first = client.messages.create(**args)
    assert anthropic_up.last_body()["system"][-1]["cache_control"] == EPHEMERAL
    assert first.usage.cache_creation_input_tokens == system_tokens
    assert first.usage.cache_read_input_tokens == 0
    second = client.messages.create(**args)
    assert second.usage.cache_read_input_tokens == system_tokens
    assert second.usage.cache_creation_input_tokens == 0
    assert second.usage.input_tokens == first.usage.input_tokens > 0
    assert second.content[0].text == first.content[0].text  # type: ignore[union-attr]

    # Streaming carries the same numbers (message_start), and a new question still reads
    # the cached system prompt.
    other = [{"role": "user", "content": "And what does it cache?"}]
    with client.messages.stream(**{**args, "messages": other}) as stream:
        usage = stream.get_final_message().usage
    assert usage.cache_read_input_tokens == system_tokens
    assert usage.cache_creation_input_tokens == 0

    # A marked prefix below the minimum is not cached.
    short = client.messages.create(**{**args, "system": "Be brief."})
    assert anthropic_up.last_body()["system"][-1]["cache_control"] == EPHEMERAL
    assert short.usage.cache_creation_input_tokens == 0
    assert short.usage.cache_read_input_tokens == 0

    # No marker (backend with auto cache_control off): never cached.
    for _ in range(2):
        plain = client.messages.create(**{**args, "model": MANUAL})
        assert plain.usage.cache_read_input_tokens == 0
        assert plain.usage.cache_creation_input_tokens == 0
        assert plain.usage.input_tokens >= system_tokens
    assert anthropic_up.last_body()["system"] == LONG_SYSTEM


def test_rate_limit_headers_reach_the_client_whole_and_streamed(
    anthropic_up: AnthropicUpstream, router_factory: Callable[..., Any]
) -> None:
    """Every ``anthropic-ratelimit-*`` header of the upstream's answer, as the SDK's raw
    response shows them (a client pacing itself reads them)."""
    from continuum.sim.anthropic import RATE_LIMIT_HEADERS

    router = router_factory(_config(anthropic_up))
    client = _client(router)
    args: dict[str, Any] = {"model": AUTO, "max_tokens": 16, "messages": USER}
    whole = client.messages.with_raw_response.create(**args)
    with client.messages.with_streaming_response.create(**args, stream=True) as streamed:
        list(streamed.iter_lines())
    for raw in (whole, streamed):
        got = {name: value for name, value in raw.headers.items()
               if name.startswith("anthropic-ratelimit-")}
        assert got == RATE_LIMIT_HEADERS
        assert len(got) == 12


@pytest.mark.parametrize("global_injection", [False, True], ids=["global-off", "global-on"])
def test_injection_precedence(
    anthropic_up: AnthropicUpstream, router_factory: Callable[..., Any], global_injection: bool
) -> None:
    router = router_factory(_config(anthropic_up, global_injection=global_injection))
    client = _client(router)
    first = {"type": "text", "text": "You are terse."}
    last = {"type": "text", "text": "Answer in French."}
    marked_message = [{"role": "user", "content": [
        {"type": "text", "text": "A long document.", "cache_control": EPHEMERAL},
        {"type": "text", "text": "Summarise it."}]}]
    nested_four = [
        {"role": "user", "content": "Look the words up."},
        {"role": "assistant", "content": [
            {"type": "tool_use", "id": "toolu_1", "name": "lookup", "input": {"word": "a"}}]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_1",
                                      "content": [{"type": "text", "text": f"part {i}",
                                                   "cache_control": EPHEMERAL}
                                                  for i in range(4)]}]}]
    tool = {"name": "lookup", "description": "Look a word up.",
            "input_schema": {"type": "object", "properties": {"word": {"type": "string"}}},
            "cache_control": EPHEMERAL}

    def sent(model: str, **fields: Any) -> dict[str, Any]:
        body = {"model": model, "max_tokens": 32, "messages": USER, **fields}
        client.messages.create(**body)
        received = anthropic_up.last_body()
        assert received["model"] == model
        return received

    for model, backend_auto in ((AUTO, True), (MANUAL, False)):
        inject = global_injection or backend_auto
        case = f"global={global_injection} backend_auto={backend_auto}"

        body = sent(model, system="You are terse.")
        expected: Any = [{**first, "cache_control": EPHEMERAL}] if inject else "You are terse."
        assert body["system"] == expected, case

        body = sent(model, system=[first, last])
        expected = [first, {**last, "cache_control": EPHEMERAL}] if inject else [first, last]
        assert body["system"] == expected, case

        # The caller's own breakpoints win, wherever they are.
        own = [{**first, "cache_control": EPHEMERAL}, last]
        assert sent(model, system=own)["system"] == own, case
        body = sent(model, system="You are terse.", messages=marked_message)
        assert body["system"] == "You are terse." and body["messages"] == marked_message, case
        body = sent(model, system="You are terse.", tools=[tool])
        assert body["system"] == "You are terse." and body["tools"] == [tool], case
        # Four breakpoints inside a tool_result: a fifth on the system prompt would be a
        # 400 from Anthropic (and from the fake, which counts nested ones the same way).
        body = sent(model, system="You are terse.", messages=nested_four)
        assert body["system"] == "You are terse." and body["messages"] == nested_four, case

        assert "system" not in sent(model), case


def test_errors_are_anthropic_shaped(
    anthropic_up: AnthropicUpstream, router_factory: Callable[..., Any]
) -> None:
    router = router_factory(_config(anthropic_up, server={"max_body_bytes": 65536}))
    client = _client(router)
    url = router.url + "/anthropic/v1/messages"

    # The upstream's 400 for too many breakpoints, passed through (no marker added: 5).
    blocks: list[Any] = [{"type": "text", "text": f"part {i}", "cache_control": EPHEMERAL}
                         for i in range(5)]
    with pytest.raises(anthropic.BadRequestError) as too_many:
        client.messages.create(model=AUTO, max_tokens=32, system="Be brief.",
                               messages=[{"role": "user", "content": blocks}])
    assert too_many.value.body["type"] == "error"  # type: ignore[index]
    assert too_many.value.body["error"] == {  # type: ignore[index]
        "type": "invalid_request_error", "message": MAX_CACHE_MESSAGE}
    assert too_many.value.request_id is not None
    assert anthropic_up.last_body()["system"] == "Be brief."

    # The router's own 404: no backend serves the model.
    with pytest.raises(anthropic.NotFoundError) as unknown:
        client.messages.create(model="claude-unknown-9", max_tokens=32, messages=USER)
    assert unknown.value.body["type"] == "error"  # type: ignore[index]
    assert unknown.value.body["error"]["type"] == "not_found_error"  # type: ignore[index]

    # The router's own 413 and 400s.
    with pytest.raises(anthropic.APIStatusError) as too_big:
        client.messages.create(model=AUTO, max_tokens=32, system="x" * 70000, messages=USER)
    assert too_big.value.status_code == 413
    assert too_big.value.body["error"]["type"] == "request_too_large"  # type: ignore[index]
    bad = requests.post(url, data=b"{not json", timeout=5,
                        headers={"content-type": "application/json"})
    assert bad.status_code == 400
    assert bad.json()["type"] == "error"
    assert bad.json()["error"]["type"] == "invalid_request_error"
    no_route = requests.get(router.url + "/anthropic/v1/nothing-here", timeout=5)
    assert no_route.status_code == 404 and no_route.json()["type"] == "error"

    # Validation by the upstream passes through with its request-id.
    missing = requests.post(url, json={"model": AUTO, "messages": USER}, timeout=5)
    assert missing.status_code == 400
    assert missing.json()["error"] == {"type": "invalid_request_error",
                                       "message": "max_tokens: Field required"}
    assert missing.headers["request-id"].startswith("req_")


def test_upstream_authentication(
    anthropic_up: AnthropicUpstream, router_factory: Callable[..., Any]
) -> None:
    models = anthropic_up.url + "/v1/models"
    version = {"anthropic-version": "2023-06-01"}
    missing = requests.get(models, headers=version, timeout=5)
    assert missing.status_code == 401
    assert missing.json()["error"] == {"type": "authentication_error",
                                       "message": "x-api-key header is required"}
    wrong = requests.get(models, headers={**version, "x-api-key": "nope"}, timeout=5)
    assert wrong.json()["error"]["message"] == "invalid x-api-key"
    listed = requests.get(models, headers={**version, "x-api-key": UPSTREAM_KEY}, timeout=5)
    assert listed.status_code == 200
    assert {m["type"] for m in listed.json()["data"]} == {"model"}
    assert AUTO in {m["id"] for m in listed.json()["data"]}

    # A backend configured with the wrong key: the upstream's 401 reaches the client as is
    # (health checks off, or the failing probe would take the backend out first).
    cfg = {"backends": [{**_backend("auto", anthropic_up, AUTO), "api_key": "sk-wrong"}],
           "health_check": {"enabled": False}}
    with pytest.raises(anthropic.AuthenticationError) as denied:
        _client(router_factory(cfg)).messages.create(model=AUTO, max_tokens=32, messages=USER)
    assert denied.value.body["error"]["message"] == "invalid x-api-key"  # type: ignore[index]


def test_protocols_never_mix(
    anthropic_up: AnthropicUpstream,
    upstreams: Callable[[str], Any],
    router_factory: Callable[..., Any],
) -> None:
    oai = upstreams("oai")
    cfg = _config(anthropic_up)
    cfg["backends"] = [_backend("auto", anthropic_up, AUTO),
                       {"name": "oai", "url": oai.url, "models": ["m"]}]
    router = router_factory(cfg)
    claude = _client(router)
    gpt = openai.OpenAI(base_url=router.url + "/v1", api_key="sk-client", max_retries=0)
    _CLIENTS.append(gpt)

    with pytest.raises(anthropic.NotFoundError) as not_anthropic:
        claude.messages.create(model="m", max_tokens=32, messages=USER)
    assert not_anthropic.value.body["type"] == "error"  # type: ignore[index]
    # ... and says where the router serves it instead
    assert "served by this router's OpenAI endpoints" in \
        not_anthropic.value.body["error"]["message"]  # type: ignore[index]
    assert oai.stats()["requests"] == 0

    with pytest.raises(openai.NotFoundError) as not_openai:
        gpt.chat.completions.create(model=AUTO, messages=[{"role": "user", "content": "hi"}])
    assert not_openai.value.body["code"] == "model_not_found"  # type: ignore[index]
    assert "base_url at http://<router>/anthropic" in \
        not_openai.value.body["message"]  # type: ignore[index]
    assert anthropic_up.received() == []

    assert [m.id for m in gpt.models.list()] == ["m"]
    assert gpt.chat.completions.create(
        model="m", messages=[{"role": "user", "content": "hi"}]).choices
    assert claude.messages.create(model=AUTO, max_tokens=32, messages=USER).content
    assert len(anthropic_up.received()) == 1 and oai.stats()["requests"] == 1


def test_anthropic_beta_header_is_forwarded_and_top_level_cache_control_wins(
    anthropic_up: AnthropicUpstream, router_factory: Callable[..., Any]
) -> None:
    router = router_factory(_config(anthropic_up))
    body = {"model": AUTO, "max_tokens": 16, "system": "Be brief.", "messages": USER,
            "cache_control": {"type": "ephemeral"}}
    resp = requests.post(router.url + "/anthropic/v1/messages", json=body, timeout=10,
                         headers={"anthropic-beta": "extended-cache-ttl-2025-04-11"})
    assert resp.status_code == 200
    record = anthropic_up.received()[-1]
    assert record["headers"]["anthropic-beta"] == "extended-cache-ttl-2025-04-11"
    assert record["body"]["system"] == "Be brief."  # the caller's own caching choice stands
