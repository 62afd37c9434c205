"""The Anthropic Messages API on ``type: gemini`` backends, through real gunicorn -k gevent,
driven by the official anthropic SDK, against the fake Gemini API in its own process (what
the router sent it is read back from ``/_sim/received``)."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import anthropic
import pytest
import requests

from continuum.devtools.fleet import metric_sum
from continuum.devtools.gemini_fake import FakeGeminiProcess
from continuum.devtools.procs import wait_until
from tests.integration.conftest import GEMINI_KEY as KEY

pytestmark = pytest.mark.e2e

MODEL = "gemini-2.5-flash"
SIGNING = "gemini-3-pro-preview"  # signs its function calls, refuses unsigned history
PRO = "gemini-2.5-pro"  # cannot turn thinking off: Google refuses a budget of 0
LONG_SYSTEM = "You are the support assistant of the router; answer from its manual. " * 40
NATIVE = ":generateContent"
LOOKUP = {"name": "lookup", "description": "Look a term up in the manual",
          "input_schema": {"type": "object", "properties": {"query": {"type": "string"}},
                           "required": ["query"], "additionalProperties": False}}


def _router(router_factory: Callable[..., Any], fake: FakeGeminiProcess,
            **cache: Any) -> Any:
    router = router_factory({
        "backends": [{"name": "gem", "url": fake.url, "type": "gemini", "api_key": KEY,
                      "models": [MODEL, SIGNING, PRO]}],
        "health_check": {"interval_seconds": 0.5},
        "gemini_context_cache": {"enabled": True, "min_prefix_bytes": 1024, **cache},
    })
    router.wait_healthy()
    return router


@pytest.fixture
def connect() -> Iterator[Callable[[Any], anthropic.Anthropic]]:
    """Anthropic SDK clients of a router, closed at the end (their kept-alive sockets
    with them)."""
    made: list[anthropic.Anthropic] = []

    def make(router: Any) -> anthropic.Anthropic:
        made.append(anthropic.Anthropic(base_url=router.url + "/anthropic", api_key="client",
                                        max_retries=0))
        return made[-1]

    yield make
    for client in made:
        client.close()


def _ask(client: anthropic.Anthropic, question: str, **extra: Any) -> Any:
    extra.setdefault("system", LONG_SYSTEM)
    return client.messages.create(model=MODEL, max_tokens=64,
                                  messages=[{"role": "user", "content": question}], **extra)


def _last(fake: FakeGeminiProcess, part: str = NATIVE) -> dict[str, Any]:
    return fake.received(part, "POST")[-1]


def _wait_entry(router: Any) -> None:
    def ready() -> bool:
        stats = requests.get(router.url + "/admin/gemini-context-cache/stats",
                             timeout=5).json()
        return bool(stats["entries"] == 1 and stats["in_flight"] == 0)
    wait_until(ready, "the context cache's entry")


def test_messages_reach_gemini_through_the_context_cache_with_anthropic_usage(
    fake: FakeGeminiProcess, router_factory: Callable[..., Any],
    connect: Callable[[Any], anthropic.Anthropic]
) -> None:
    router = _router(router_factory, fake)
    client = connect(router)
    first = _ask(client, "How do I clear the cache?")
    sent = _last(fake)
    assert sent["path"] == f"/v1beta/models/{MODEL}:generateContent"
    assert sent["headers"]["x-goog-api-key"] == KEY
    assert "anthropic-version" not in sent["headers"] and "x-api-key" not in sent["headers"]
    assert sent["body"]["systemInstruction"] == {"parts": [{"text": LONG_SYSTEM}]}
    assert sent["body"]["contents"] == [{"role": "user", "parts": [
        {"text": "How do I clear the cache?"}]}]
    assert sent["body"]["generationConfig"] == {"maxOutputTokens": 64}
    assert first.type == "message" and first.role == "assistant" and first.model == MODEL
    assert first.stop_reason == "end_turn" and first.content[0].type == "text"
    assert first.content[0].text
    assert first.usage.cache_read_input_tokens == 0 and first.usage.input_tokens > 800

    _wait_entry(router)  # the router created a cachedContents for the system prompt
    hit = _ask(client, "How do I clear the cache?")
    sent = _last(fake)["body"]
    assert sent["cachedContent"].startswith("cachedContents/")
    assert "systemInstruction" not in sent
    assert hit.content[0].text == first.content[0].text
    # Anthropic's convention: cache reads apart from the input tokens, the whole prompt
    # being their sum
    cached = hit.usage.cache_read_input_tokens
    assert cached is not None and cached > 800
    assert hit.usage.input_tokens + cached == first.usage.input_tokens
    assert hit.usage.cache_creation_input_tokens == 0

    with client.messages.stream(model=MODEL, max_tokens=64, extra_body={"top_k": 40},
                                system=LONG_SYSTEM, messages=[
                                    {"role": "user", "content": "How do I clear the cache?"}]
                                ) as stream:
        kinds = [event.type for event in stream]
        streamed = stream.get_final_message()
    received = _last(fake, ":streamGenerateContent")
    assert received["query"] == "alt=sse" and "cachedContent" in received["body"]
    assert received["body"]["generationConfig"] == {"maxOutputTokens": 64, "topK": 40}
    assert kinds[0] == "message_start" and kinds[-1] == "message_stop"
    assert "content_block_start" in kinds and "message_delta" in kinds
    assert streamed.content[0].type == "text"
    assert streamed.content[0].text == first.content[0].text
    assert streamed.stop_reason == "end_turn"
    assert streamed.usage.cache_read_input_tokens == cached
    assert streamed.usage.input_tokens == hit.usage.input_tokens
    assert streamed.usage.output_tokens == hit.usage.output_tokens

    metrics = router.metrics()
    # the router's token metrics count the whole prompt, cached part included, of all three
    assert metric_sum(metrics, "continuum_prompt_tokens_total") == \
        3 * first.usage.input_tokens
    assert metric_sum(metrics, "continuum_cached_prompt_tokens_total") == 2 * cached
    assert metric_sum(metrics, "continuum_gemini_cached_tokens_total", backend="gem") == \
        2 * cached
    assert metric_sum(metrics, "continuum_gemini_context_cache_requests_total",
                      result="hit") == 2


def test_tools_thinking_and_a_tool_result_round_trip(
    fake: FakeGeminiProcess, router_factory: Callable[..., Any],
    connect: Callable[[Any], anthropic.Anthropic]
) -> None:
    client = connect(_router(router_factory, fake))
    ask = "Please lookup the retention setting"
    called = client.messages.create(
        model=MODEL, max_tokens=256, tools=[LOOKUP], tool_choice={"type": "auto"},
        thinking={"type": "enabled", "budget_tokens": 1024},
        messages=[{"role": "user", "content": ask}])
    sent = _last(fake)["body"]
    assert sent["tools"] == [{"functionDeclarations": [{
        "name": "lookup", "description": "Look a term up in the manual",
        "parametersJsonSchema": LOOKUP["input_schema"]}]}]
    assert sent["toolConfig"] == {"functionCallingConfig": {"mode": "AUTO"}}
    assert sent["generationConfig"]["thinkingConfig"] == {"thinkingBudget": 1024,
                                                          "includeThoughts": True}
    assert [block.type for block in called.content] == ["thinking", "tool_use"]
    assert called.content[0].thinking.startswith("Thinking about:")
    use = called.content[1]
    assert use.name == "lookup" and use.input == {"query": ask[:40]}
    assert called.stop_reason == "tool_use"
    assert called.usage.output_tokens > 8  # thinking tokens count as output

    answered = client.messages.create(
        model=MODEL, max_tokens=256, tools=[LOOKUP],
        messages=[{"role": "user", "content": ask},
                  {"role": "assistant", "content": called.content},
                  {"role": "user", "content": [
                      {"type": "tool_result", "tool_use_id": use.id, "content": "30 days"},
                      {"type": "text", "text": "Summarise that."}]}])
    sent = _last(fake)["body"]
    assert sent["contents"] == [
        {"role": "user", "parts": [{"text": ask}]},
        {"role": "model", "parts": [{"functionCall": {"name": "lookup",
                                                      "args": {"query": ask[:40]}}}]},
        {"role": "user", "parts": [
            {"functionResponse": {"name": "lookup", "response": {"content": "30 days"}}},
            {"text": "Summarise that."}]}]
    assert answered.stop_reason == "end_turn" and answered.content[0].type == "text"


def test_gemini_3_signatures_ride_in_the_tool_use_ids(
    fake: FakeGeminiProcess, router_factory: Callable[..., Any],
    connect: Callable[[Any], anthropic.Anthropic]
) -> None:
    """Gemini 3 refuses history whose function call lacks the signature it gave: the
    tool_use id carries it, so an Anthropic client that sends back only its blocks keeps
    the conversation going (streamed here, as agents run)."""
    client = connect(_router(router_factory, fake))
    ask = "Please lookup the retention setting"
    with client.messages.stream(model=SIGNING, max_tokens=256, tools=[LOOKUP],
                                messages=[{"role": "user", "content": ask}]) as stream:
        called = stream.get_final_message()
    assert called.stop_reason == "tool_use"
    use = called.content[-1]
    assert use.type == "tool_use" and "__sig_" in use.id
    assert use.input == {"query": ask[:40]}
    client.messages.create(
        model=SIGNING, max_tokens=256, tools=[LOOKUP],
        messages=[{"role": "user", "content": ask},
                  {"role": "assistant", "content": called.content},
                  {"role": "user", "content": [
                      {"type": "tool_result", "tool_use_id": use.id, "content": "30 days"}]}])
    part = _last(fake)["body"]["contents"][1]["parts"][0]
    assert part["thoughtSignature"] != "skip_thought_signature_validator"
    assert "functionCall" in part


def test_thinking_disabled_is_the_least_each_model_takes(
    fake: FakeGeminiProcess, router_factory: Callable[..., Any],
    connect: Callable[[Any], anthropic.Anthropic]
) -> None:
    """Google refuses a thinking budget of 0 on 2.5 Pro and level ``minimal`` on 3 Pro (the
    fake as well): a client that turns thinking off gets an answer from each."""
    client = connect(_router(router_factory, fake))
    for model, config in ((MODEL, {"thinkingBudget": 0}), (PRO, {"thinkingBudget": 128}),
                          (SIGNING, {"thinkingLevel": "low"})):
        answer = client.messages.create(model=model, max_tokens=64,
                                        thinking={"type": "disabled"},
                                        messages=[{"role": "user", "content": "Hi"}])
        assert answer.stop_reason == "end_turn" and answer.content[0].type == "text"
        assert _last(fake)["body"]["generationConfig"]["thinkingConfig"] == config


def test_count_tokens_goes_to_count_tokens(
    fake: FakeGeminiProcess, router_factory: Callable[..., Any],
    connect: Callable[[Any], anthropic.Anthropic]
) -> None:
    client = connect(_router(router_factory, fake))
    counted = client.messages.count_tokens(
        model=MODEL, system=LONG_SYSTEM, tools=[LOOKUP],
        messages=[{"role": "user", "content": "How do I clear the cache?"}])
    sent = _last(fake, ":countTokens")
    assert sent["path"] == f"/v1beta/models/{MODEL}:countTokens"
    request = sent["body"]["generateContentRequest"]
    assert request["model"] == "models/" + MODEL
    assert request["systemInstruction"] == {"parts": [{"text": LONG_SYSTEM}]}
    assert request["tools"][0]["functionDeclarations"][0]["name"] == "lookup"
    answered = _ask(client, "How do I clear the cache?")
    # the count is the prompt generateContent reports for the same request (no cache yet)
    assert counted.input_tokens == answered.usage.input_tokens > 800


def test_what_gemini_cannot_take_is_a_400_in_anthropics_shape(
    fake: FakeGeminiProcess, router_factory: Callable[..., Any],
    connect: Callable[[Any], anthropic.Anthropic]
) -> None:
    router = _router(router_factory, fake)
    client = connect(router)
    before = len(fake.received("", "POST"))
    with pytest.raises(anthropic.BadRequestError) as refused:
        client.messages.create(model=MODEL, max_tokens=64,
                               tools=[{"type": "bash_20250124", "name": "bash"}],
                               messages=[{"role": "user", "content": "ls"}])
    body = refused.value.body
    assert isinstance(body, dict) and body["type"] == "error"
    assert body["error"]["type"] == "invalid_request_error"
    assert "tools[0]" in body["error"]["message"]
    reply = requests.post(router.url + "/anthropic/v1/messages", timeout=10, json={
        "model": MODEL, "max_tokens": 64, "messages": [{"role": "user", "content": "hi"}],
        "thinking": {"type": "enabled", "budget_tokens": -5}})
    assert reply.status_code == 400
    assert reply.json()["error"] == {
        "type": "invalid_request_error",
        "message": "'thinking.budget_tokens' must be a non-negative integer"}
    assert len(fake.received("", "POST")) == before  # nothing reached Google


def test_googles_errors_come_back_in_anthropics_shape(
    fake: FakeGeminiProcess, router_factory: Callable[..., Any],
    connect: Callable[[Any], anthropic.Anthropic]
) -> None:
    router = router_factory({
        "backends": [{"name": "gem", "url": fake.url, "type": "gemini", "api_key": KEY,
                      "models": [MODEL, "gemini-9-unserved"]}],
        "health_check": {"interval_seconds": 0.5}})
    router.wait_healthy()
    client = connect(router)
    assert [model.id for model in client.models.list()] == [MODEL, "gemini-9-unserved"]
    with pytest.raises(anthropic.NotFoundError) as missing:
        client.messages.create(model="gemini-9-unserved", max_tokens=64,
                               messages=[{"role": "user", "content": "hi"}])
    body = missing.value.body
    assert isinstance(body, dict) and body["type"] == "error"
    assert body["error"]["type"] == "not_found_error"
    assert body["error"]["message"].startswith("models/gemini-9-unserved is not found")
    with pytest.raises(anthropic.NotFoundError), client.messages.stream(
            model="gemini-9-unserved", max_tokens=64,
            messages=[{"role": "user", "content": "hi"}]) as stream:
        stream.get_final_message()
