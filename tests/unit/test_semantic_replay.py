"""A semantic hit in the shape the request asked for: streams always end with a usage chunk
the ``openai`` SDK's types accept, stored streams assemble into one body."""

from __future__ import annotations

import json
from typing import Any

import pytest
from openai.types.chat import ChatCompletion, ChatCompletionChunk

from continuum.caching.response_cache import CachedResponse
from continuum.caching.semantic_replay import JSON_TYPE, SSE_TYPE, adapt, estimate_tokens

MESSAGES = [{"role": "system", "content": "Be brief."},
            {"role": "user", "content": "How can I reset my password?"}]
PROMPT_TOKENS = estimate_tokens("Be brief.\nHow can I reset my password?")


def _sse(*docs: dict[str, Any]) -> bytes:
    return b"".join(b"data: " + json.dumps(d).encode() + b"\n\n" for d in docs) \
        + b"data: [DONE]\n\n"


def _chunk(**fields: Any) -> dict[str, Any]:
    return {"id": "chatcmpl-9", "object": "chat.completion.chunk", "created": 5,
            "model": "m", **fields}


def _body(usage: dict[str, int] | None = None, **message: Any) -> bytes:
    doc: dict[str, Any] = {"id": "chatcmpl-1", "object": "chat.completion", "created": 7,
                           "model": "m", "choices": [{"index": 0, "finish_reason": "stop",
                           "message": {"role": "assistant", **message}}]}
    if usage is not None:
        doc["usage"] = usage
    return json.dumps(doc).encode()


def _parse_stream(chunks: list[bytes]) -> list[ChatCompletionChunk]:
    """Every event, as the SDK's stream iterator reads it, and the [DONE] terminator."""
    text = b"".join(chunks).decode()
    events = [e for e in text.split("\n\n") if e]
    assert events[-1] == "data: [DONE]"
    assert all(e.startswith("data: ") for e in events)
    return [ChatCompletionChunk.model_validate(json.loads(e[6:])) for e in events[:-1]]


def _stream(entry: CachedResponse) -> list[ChatCompletionChunk]:
    adapted = adapt(entry, True, MESSAGES)
    assert adapted is not None
    content_type, body, stream = adapted
    assert body is None and stream is not None
    assert content_type.startswith("text/event-stream")
    return _parse_stream(list(stream))


def _text(chunks: list[ChatCompletionChunk]) -> str:
    return "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)


def test_stored_body_streams_with_its_own_usage() -> None:
    usage = {"prompt_tokens": 11, "completion_tokens": 4, "total_tokens": 15}
    chunks = _stream(CachedResponse("body", JSON_TYPE, _body(usage, content="Use the link.")))
    assert _text(chunks) == "Use the link."
    assert chunks[0].choices[0].delta.role == "assistant"
    finish = [c.choices[0].finish_reason for c in chunks if c.choices]
    assert finish[-1] == "stop" and finish[:-1] == [None] * (len(finish) - 1)
    last = chunks[-1]
    assert last.choices == [] and last.usage is not None
    assert last.usage.model_dump(exclude_none=True) == usage
    assert {c.id for c in chunks} == {"chatcmpl-1"}


def test_stored_body_without_usage_gets_a_synthesised_one() -> None:
    chunks = _stream(CachedResponse("body", JSON_TYPE, _body(content="x" * 10)))
    usage = chunks[-1].usage
    assert usage is not None
    assert (usage.prompt_tokens, usage.completion_tokens, usage.total_tokens) == \
        (PROMPT_TOKENS, 3, PROMPT_TOKENS + 3)


def test_stored_body_tool_calls_stream_as_deltas() -> None:
    call = {"id": "call_1", "type": "function",
            "function": {"name": "lookup", "arguments": "{\"q\": 1}"}}
    chunks = _stream(CachedResponse("body", JSON_TYPE, _body(content=None, tool_calls=[call])))
    deltas = [tc for c in chunks if c.choices for tc in c.choices[0].delta.tool_calls or []]
    assert len(deltas) == 1 and deltas[0].index == 0
    assert deltas[0].function is not None
    assert (deltas[0].id, deltas[0].function.name, deltas[0].function.arguments) == \
        ("call_1", "lookup", "{\"q\": 1}")


def test_stored_stream_without_usage_gains_a_final_usage_chunk() -> None:
    payload = _sse(*(_chunk(choices=[{"index": 0, "delta": {"content": f"t{i} "},
                                      "finish_reason": None}]) for i in range(3)))
    chunks = _stream(CachedResponse("sse", SSE_TYPE, payload))
    assert _text(chunks) == "t0 t1 t2 "
    assert len(chunks) == 4  # the three stored chunks, then the usage chunk
    usage = chunks[-1].usage
    assert chunks[-1].choices == [] and usage is not None
    assert usage.completion_tokens == estimate_tokens("t0 t1 t2 ") == 3
    assert usage.prompt_tokens == PROMPT_TOKENS


def test_stored_stream_with_usage_is_replayed_as_it_was() -> None:
    usage = {"prompt_tokens": 9, "completion_tokens": 2, "total_tokens": 11}
    payload = _sse(_chunk(choices=[{"index": 0, "delta": {"role": "assistant",
                                                          "content": "hi"},
                                    "finish_reason": "stop"}]),
                   _chunk(choices=[], usage=usage))
    adapted = adapt(CachedResponse("sse", SSE_TYPE, payload), True, MESSAGES)
    assert adapted is not None and adapted[2] is not None
    assert b"".join(adapted[2]) == payload
    chunks = _stream(CachedResponse("sse", SSE_TYPE, payload))
    assert [c.usage is not None for c in chunks] == [False, True]


def test_stored_stream_assembles_into_one_body() -> None:
    payload = _sse(
        _chunk(choices=[{"index": 0, "delta": {"role": "assistant", "content": ""},
                         "finish_reason": None}]),
        _chunk(choices=[{"index": 0, "delta": {"content": "Hel"}, "finish_reason": None}]),
        _chunk(choices=[{"index": 0, "delta": {"content": "lo", "tool_calls": [
            {"index": 0, "id": "c1", "type": "function",
             "function": {"name": "f", "arguments": "{\"a\""}}]}, "finish_reason": None}]),
        _chunk(choices=[{"index": 0, "delta": {"tool_calls": [
            {"index": 0, "function": {"arguments": ": 2}"}}]}, "finish_reason": "tool_calls"}]),
    )
    adapted = adapt(CachedResponse("sse", SSE_TYPE, payload), False, MESSAGES)
    assert adapted is not None
    content_type, body, stream = adapted
    assert content_type == JSON_TYPE and stream is None and body is not None
    completion = ChatCompletion.model_validate_json(body)
    choice = completion.choices[0]
    assert choice.message.content == "Hello" and choice.finish_reason == "tool_calls"
    assert choice.message.tool_calls is not None
    call = choice.message.tool_calls[0]
    assert call.id == "c1" and call.function.arguments == "{\"a\": 2}"  # type: ignore[union-attr]
    assert completion.usage is not None and completion.usage.completion_tokens == 2


def test_stored_body_is_served_unchanged_to_a_buffered_request() -> None:
    body = _body(None, content="same bytes")
    assert adapt(CachedResponse("body", JSON_TYPE, body), False, MESSAGES) == \
        (JSON_TYPE, body, None)


@pytest.mark.parametrize(("kind", "payload"), [
    ("body", b"not json"), ("body", b"{\"error\": 1}"),
    ("sse", b"data: [DONE]\n\n"), ("sse", b"data: nonsense\n\n"),
])
@pytest.mark.parametrize("stream", [True, False])
def test_an_answer_that_is_no_chat_completion_is_a_miss(kind: str, payload: bytes,
                                                        stream: bool) -> None:
    entry = CachedResponse(kind, SSE_TYPE if kind == "sse" else JSON_TYPE, payload)
    assert adapt(entry, stream, MESSAGES) is None
