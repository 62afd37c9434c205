"""Token usage read from answers and streams (continuum/routing/usage.py)."""

from __future__ import annotations

import json
from typing import Any

import pytest

from continuum.metrics import RequestRecord
from continuum.routing.usage import (
    UsageStream,
    asks_for_usage,
    read_body,
    with_stream_usage,
)


def _record() -> RequestRecord:
    return RequestRecord("chat")


def _tokens(r: RequestRecord) -> tuple[Any, ...]:
    return (r.prompt_tokens, r.cached_tokens, r.cache_creation_tokens, r.completion_tokens)


def _sse(*docs: Any, event: str | None = None) -> list[bytes]:
    head = f"event: {event}\n".encode() if event else b""
    return [head + b"data: " + json.dumps(d).encode() + b"\n\n" for d in docs]


def test_openai_body() -> None:
    r = _record()
    read_body(r, json.dumps({"id": "x", "choices": [{"message": {"content": '"usage": 5'}}],
                             "usage": {"prompt_tokens": 120, "completion_tokens": 7,
                                       "prompt_tokens_details": {"cached_tokens": 96}}}).encode())
    assert _tokens(r) == (120, 96, None, 7)


def test_openai_body_without_details_counts_zero_cached() -> None:
    r = _record()
    read_body(r, b'{"usage": {"prompt_tokens": 3, "completion_tokens": 1}}')
    assert _tokens(r) == (3, 0, None, 1)


def test_anthropic_body_sums_the_three_input_parts() -> None:
    r = _record()
    read_body(r, json.dumps({"type": "message", "content": [], "usage": {
        "input_tokens": 10, "cache_read_input_tokens": 2000,
        "cache_creation_input_tokens": 300, "output_tokens": 12}}).encode())
    assert _tokens(r) == (2310, 2000, 300, 12)


def test_gemini_usage_metadata() -> None:
    r = _record()
    read_body(r, json.dumps({"candidates": [], "usageMetadata": {
        "promptTokenCount": 50, "cachedContentTokenCount": 32,
        "candidatesTokenCount": 4}}).encode())
    assert _tokens(r) == (50, 32, None, 4)


@pytest.mark.parametrize("body", [b"", b"{}", b'{"usage": null}', b'{"usage": {"x": 1}}',
                                  b'{"usage": {"prompt_tokens": "many"}}', b'{"usage": {',
                                  b"\xff\xfe", b'{"text": "the \\"usage\\": {}"}'])
def test_bodies_without_usable_usage_leave_the_record_alone(body: bytes) -> None:
    r = _record()
    read_body(r, body)
    assert r.prompt_tokens is None and r.completion_tokens is None


def _chunk(i: int, usage: Any = "absent") -> dict[str, Any]:
    doc: dict[str, Any] = {"id": "c", "choices": [{"index": 0, "delta": {"content": f"t{i}"}}]}
    if usage != "absent":
        doc["usage"] = usage
    return doc


USAGE = {"prompt_tokens": 40, "completion_tokens": 3,
         "prompt_tokens_details": {"cached_tokens": 32}}


def test_stream_usage_chunk_is_read_and_stripped() -> None:
    final = {"id": "c", "choices": [], "usage": USAGE}
    pieces = [*_sse(_chunk(0), _chunk(1), _chunk(2), final), b"data: [DONE]\n\n"]
    r = _record()
    out = b"".join(UsageStream(iter(pieces), r, strip=True))
    assert _tokens(r) == (40, 32, None, 3)
    assert b'"usage"' not in out
    assert out == b"".join(pieces[:3]) + b"data: [DONE]\n\n"


def test_stream_usage_chunk_kept_when_the_client_asked() -> None:
    pieces = _sse(_chunk(0, None), {"id": "c", "choices": [], "usage": USAGE})
    r = _record()
    assert b"".join(UsageStream(iter(pieces), r)) == b"".join(pieces)
    assert r.prompt_tokens == 40


def test_records_split_across_pieces_anywhere() -> None:
    whole = b"".join(_sse(_chunk(0), {"id": "c", "choices": [], "usage": USAGE})) + \
        b"data: [DONE]\n\n"
    expected = b"".join(_sse(_chunk(0))) + b"data: [DONE]\n\n"
    for cut in range(1, len(whole)):
        r = _record()
        out = b"".join(UsageStream(iter([whole[:cut], whole[cut:]]), r, strip=True))
        assert out == expected, cut
        assert r.prompt_tokens == 40, cut


def test_anthropic_stream_merges_start_and_last_delta() -> None:
    pieces = (
        _sse({"type": "message_start", "message": {"usage": {
            "input_tokens": 5, "cache_read_input_tokens": 900,
            "cache_creation_input_tokens": 0, "output_tokens": 1}}}, event="message_start")
        + _sse({"type": "content_block_delta", "delta": {"text": "hi"}},
               event="content_block_delta")
        + _sse({"type": "message_delta", "usage": {"output_tokens": 17}},
               event="message_delta"))
    r = _record()
    assert b"".join(UsageStream(iter(pieces), r, strip=True)) == b"".join(pieces)
    assert _tokens(r) == (905, 900, 0, 17)


def test_a_stream_without_blank_lines_is_passed_on_bounded() -> None:
    piece = b"x" * (1 << 19)
    out = list(UsageStream(iter([piece] * 3), _record()))
    assert b"".join(out) == piece * 3
    assert max(len(p) for p in out) <= 3 * len(piece)


def test_closing_the_usage_stream_closes_its_source() -> None:
    closed = []

    def source() -> Any:
        try:
            yield b"data: {}\n\n"
            yield b"data: {}\n\n"
        finally:
            closed.append(True)

    stream = iter(UsageStream(source(), _record()))
    next(stream)
    stream.close()  # type: ignore[attr-defined]
    assert closed == [True]


def test_include_usage_is_spliced_or_merged() -> None:
    body = {"model": "m", "stream": True}
    raw = json.dumps(body).encode() + b"  \n"
    assert json.loads(with_stream_usage(body, raw)) == {
        **body, "stream_options": {"include_usage": True}}
    body2 = {"model": "m", "stream_options": {"continuous_usage_stats": False}}
    assert json.loads(with_stream_usage(body2, json.dumps(body2).encode()))[
        "stream_options"] == {"continuous_usage_stats": False, "include_usage": True}
    body3 = {"model": "m", "stream_options": None}
    assert json.loads(with_stream_usage(body3, json.dumps(body3).encode()))[
        "stream_options"] == {"include_usage": True}
    assert asks_for_usage({"stream_options": {"include_usage": True}})
    assert not asks_for_usage({"stream_options": {"include_usage": False}})
    assert not asks_for_usage({})


RESPONSES_USAGE = {"input_tokens": 300, "input_tokens_details": {"cached_tokens": 256},
                   "output_tokens": 7, "output_tokens_details": {"reasoning_tokens": 0},
                   "total_tokens": 307}


def test_responses_api_body_counts_cached_tokens_inside_input_tokens() -> None:
    """The Responses API's ``input_tokens`` include the cached ones (unlike Anthropic's,
    which are only the uncached part): 300 prompt tokens, 256 of them cached."""
    record = _record()
    body = {"id": "resp_1", "object": "response", "output": [], "usage": RESPONSES_USAGE,
            "user": None, "metadata": {}}
    read_body(record, json.dumps(body).encode())
    assert _tokens(record) == (300, 256, None, 7)


def test_responses_api_stream_reads_response_completed_only() -> None:
    record = _record()
    head = {"id": "resp_1", "status": "in_progress", "usage": None}
    pieces = [*_sse({"type": "response.created", "response": head}, event="response.created"),
              *_sse({"type": "response.output_text.delta", "delta": "hi"},
                    event="response.output_text.delta"),
              *_sse({"type": "response.completed",
                     "response": {**head, "status": "completed", "usage": RESPONSES_USAGE}},
                    event="response.completed")]
    out = b"".join(UsageStream(iter(pieces), record))
    assert out == b"".join(pieces)  # nothing stripped from a Responses stream
    assert _tokens(record) == (300, 256, None, 7)
