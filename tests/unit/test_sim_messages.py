"""The simulated engine's Anthropic Messages API (continuum.sim.messages), over its own
Falcon app: the prompt is the chat path's, usage follows vLLM's Anthropic convention."""

from __future__ import annotations

import json
from typing import Any

import falcon.testing
import pytest

from continuum.sim.engine import EngineConfig, SimEngine
from continuum.sim.latency import LatencyModel
from continuum.sim.messages import chat_messages
from continuum.sim.server import create_engine_app

MODEL = "sim-model"
SYSTEM = "You answer questions about prefix caches and routers, briefly and exactly. " * 8


def _app(engine: str = "vllm") -> falcon.testing.TestClient:
    config = EngineConfig(engine=engine, latency=LatencyModel.fast())
    return falcon.testing.TestClient(create_engine_app(SimEngine(config)))


def _messages(question: str = "Which engine holds my prefix?", **fields: Any) -> dict[str, Any]:
    return {"model": MODEL, "max_tokens": 16, "temperature": 0, "system": SYSTEM,
            "messages": [{"role": "user", "content": question}], **fields}


def _chat(question: str = "Which engine holds my prefix?") -> dict[str, Any]:
    return {"model": MODEL, "max_tokens": 16, "temperature": 0, "messages": [
        {"role": "system", "content": SYSTEM}, {"role": "user", "content": question}]}


def _events(raw: bytes) -> list[tuple[str, dict[str, Any]]]:
    out = []
    for record in raw.decode().strip().split("\n\n"):
        name, data = record.split("\n")
        out.append((name.removeprefix("event: "), json.loads(data.removeprefix("data: "))))
    return out


def test_a_message_is_the_chat_answer_with_cached_tokens_outside_input_tokens() -> None:
    app = _app()
    first = app.simulate_post("/v1/messages", json=_messages()).json
    assert first["type"] == "message" and first["role"] == "assistant"
    assert first["model"] == MODEL and first["id"].startswith("msg_")
    assert first["stop_reason"] == "end_turn" and first["stop_sequence"] is None
    # a cold cache: every prompt token is input, and there is no cache-read count
    assert set(first["usage"]) == {"input_tokens", "output_tokens"}
    total = first["usage"]["input_tokens"]

    # the same conversation as a chat request: the same prompt (all but its last, partial
    # block cached by the first request) and the same answer
    chat = app.simulate_post("/v1/chat/completions", json=_chat()).json
    assert chat["usage"]["prompt_tokens"] == total
    assert chat["choices"][0]["message"]["content"] == first["content"][0]["text"]
    assert chat["usage"]["completion_tokens"] == first["usage"]["output_tokens"]
    cached = chat["usage"]["prompt_tokens_details"]["cached_tokens"]
    assert total - 16 < cached < total

    again = app.simulate_post("/v1/messages", json=_messages("Another question?")).json
    usage = again["usage"]
    assert usage["cache_read_input_tokens"] > len(SYSTEM) // 8  # the system prompt
    assert usage["input_tokens"] + usage["cache_read_input_tokens"] == app.simulate_post(
        "/v1/messages/count_tokens", json=_messages("Another question?")).json["input_tokens"]


def test_the_stream_carries_the_same_answer_in_anthropic_events() -> None:
    app = _app()
    whole = app.simulate_post("/v1/messages", json=_messages()).json
    result = app.simulate_post("/v1/messages", json=_messages(stream=True))
    assert result.headers["content-type"] == "text/event-stream"
    events = _events(result.content)
    names = [name for name, _ in events]
    assert names[:2] == ["message_start", "content_block_start"]
    assert names[-3:] == ["content_block_stop", "message_delta", "message_stop"]
    assert set(names[2:-3]) == {"content_block_delta"}
    assert all(doc["type"] == name for name, doc in events)
    text = "".join(doc["delta"]["text"] for name, doc in events
                   if name == "content_block_delta")
    assert text == whole["content"][0]["text"]
    start, delta = events[0][1]["message"], events[-2][1]
    assert start["content"] == [] and start["stop_reason"] is None
    assert start["usage"]["output_tokens"] == 0
    # the second run of the prompt: its cached part is known from message_start on
    assert start["usage"]["cache_read_input_tokens"] > 0
    assert delta["delta"] == {"stop_reason": "end_turn", "stop_sequence": None}
    assert delta["usage"] == {**start["usage"], "output_tokens": whole["usage"]["output_tokens"]}


def test_blocks_render_like_strings_and_max_tokens_stops_the_turn() -> None:
    app = _app()
    blocks = _messages(
        system=[{"type": "text", "text": "x-anthropic-billing-header: cc_version=1; cch=9;"},
                {"type": "text", "text": SYSTEM[:100]}, {"type": "text", "text": SYSTEM[100:]}],
        messages=[{"role": "user", "content": [
            {"type": "text", "text": "Which engine holds my prefix?"}]}])
    count = app.simulate_post("/v1/messages/count_tokens", json=blocks).json
    assert count == app.simulate_post("/v1/messages/count_tokens", json=_messages()).json
    short = app.simulate_post("/v1/messages", json=_messages(max_tokens=3)).json
    assert short["stop_reason"] == "max_tokens" and short["usage"]["output_tokens"] == 3


@pytest.mark.parametrize(("body", "status", "kind", "message"), [
    ({"model": "nope", "max_tokens": 4, "messages": [{"role": "user", "content": "hi"}]},
     404, "NotFoundError", "The model `nope` does not exist."),
    ({"model": MODEL, "messages": [{"role": "user", "content": "hi"}]},
     400, "BadRequestError", "'max_tokens' is required: an integer >= 1"),
    ({"model": MODEL, "max_tokens": 4, "messages": []},
     400, "BadRequestError", "'messages' must be a non-empty array"),
    ({"model": MODEL, "max_tokens": 4, "messages": [{"role": "user", "content": [
        {"type": "document", "source": {}}]}]},
     400, "BadRequestError", "'messages[0].content[0]' is not a block the engine takes "
                             "(text, image, tool_use, tool_result, thinking)"),
])
def test_errors_take_anthropics_shape_with_vllms_types(
        body: dict[str, Any], status: int, kind: str, message: str) -> None:
    result = _app().simulate_post("/v1/messages", json=body)
    assert result.status_code == status
    assert result.json == {"type": "error", "error": {"type": kind, "message": message}}


def test_chat_errors_keep_the_openai_shape_and_trtllm_has_no_messages_api() -> None:
    app = _app()
    chat = app.simulate_post("/v1/chat/completions", json={"model": "nope", "messages": []})
    assert chat.json["error"]["type"] == "NotFoundError"
    assert _app("trtllm").simulate_post("/v1/messages", json=_messages()).status_code == 404


def test_received_records_the_last_bodies_with_their_headers() -> None:
    app = _app()
    app.simulate_post("/v1/messages", json=_messages(cache_salt="s"),
                      headers={"anthropic-version": "2023-06-01", "Authorization": "Bearer k"})
    app.simulate_post("/v1/messages/count_tokens", json={"model": MODEL})  # refused: kept
    (salted, count) = app.simulate_get("/sim/received", params={"n": "2"}).json["received"]
    assert salted == {"path": "/v1/messages", "body": _messages(cache_salt="s"), "headers": {
        "anthropic-version": "2023-06-01", "authorization": "Bearer k"}}
    assert count["path"] == "/v1/messages/count_tokens" and count["headers"] == {}


def test_a_system_message_along_the_conversation_is_folded_where_it_stands() -> None:
    """vLLM takes Claude Code's ``system`` messages inside ``messages`` without moving them
    to the head of the prompt; the engine keeps them where they stand too."""
    chat = chat_messages({"system": "Rules.", "messages": [
        {"role": "user", "content": "Hi"},
        {"role": "system", "content": [{"type": "text", "text": "Reminder."}]},
        {"role": "assistant", "content": "Hello"}]})
    assert chat == [{"role": "system", "content": "Rules."},
                    {"role": "user", "content": "Hi"},
                    {"role": "user", "content": "Reminder."},
                    {"role": "assistant", "content": "Hello"}]
