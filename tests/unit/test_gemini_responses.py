"""The Responses API translated for Gemini backends (``continuum.routing.gemini_responses``):
requests to chat completions, chat answers and chunk streams back to responses."""

from __future__ import annotations

import json
from typing import Any

import pytest

from continuum.errors import RequestError
from continuum.routing import gemini
from continuum.routing.forwarder import openai_error_event
from continuum.routing.gemini_dispatch import ResponsesAdapter
from continuum.routing.gemini_responses import EventTranslator, chat_body, response_from_chat
from continuum.wire.responses_api import ResponseShape

MODEL = "gemini-2.5-flash"


def test_a_conversation_of_items_becomes_chat_messages() -> None:
    body = {
        "model": MODEL, "instructions": "Be brief.", "max_output_tokens": 50, "top_p": 0.5,
        "store": True, "metadata": {"k": "v"}, "user": "u1", "truncation": "auto",
        "reasoning": {"effort": "low"}, "parallel_tool_calls": False, "stream": True,
        "text": {"format": {"type": "json_schema", "name": "answer", "strict": True,
                            "schema": {"type": "object"}}},
        "tools": [{"type": "function", "name": "f", "parameters": {"type": "object"}}],
        "tool_choice": {"type": "function", "name": "f"},
        "input": [
            {"type": "message", "role": "developer", "content": "Use metric units."},
            {"role": "user", "content": [{"type": "input_text", "text": "Weather?"},
                                         {"type": "input_image",
                                          "image_url": "data:image/png;base64,AAAA"}]},
            {"type": "reasoning", "id": "rs_1", "summary": []},
            {"role": "assistant", "content": [{"type": "output_text", "text": "Checking."}]},
            {"type": "function_call", "call_id": "c1", "name": "f", "arguments": '{"x":1}',
             "extra_content": {"google": {"thought_signature": "c2ln"}}},
            {"type": "function_call", "call_id": "c2", "name": "f", "arguments": '{"x":2}'},
            {"type": "function_call_output", "call_id": "c1", "output": "ten"},
            {"type": "function_call_output", "call_id": "c2",
             "output": [{"type": "input_text", "text": "twelve"}]},
        ]}
    assert chat_body(body) == {
        "model": MODEL, "top_p": 0.5, "max_completion_tokens": 50, "reasoning_effort": "low",
        "response_format": {"type": "json_schema", "json_schema": {
            "name": "answer", "schema": {"type": "object"}, "strict": True}},
        "tools": [{"type": "function",
                   "function": {"name": "f", "parameters": {"type": "object"}}}],
        "tool_choice": {"type": "function", "function": {"name": "f"}},
        "messages": [
            {"role": "system", "content": "Be brief."},
            {"role": "system", "content": "Use metric units."},
            {"role": "user", "content": [
                {"type": "text", "text": "Weather?"},
                {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}]},
            {"role": "assistant", "content": [{"type": "text", "text": "Checking."}],
             "tool_calls": [
                 {"id": "c1", "type": "function",
                  "function": {"name": "f", "arguments": '{"x":1}'},
                  "extra_content": {"google": {"thought_signature": "c2ln"}}},
                 {"id": "c2", "type": "function",
                  "function": {"name": "f", "arguments": '{"x":2}'}}]},
            {"role": "tool", "tool_call_id": "c1", "content": "ten"},
            {"role": "tool", "tool_call_id": "c2", "content": "twelve"}]}


def test_a_string_input_is_one_user_message() -> None:
    assert chat_body({"model": MODEL, "input": "hi", "temperature": 0}) == {
        "model": MODEL, "temperature": 0, "messages": [{"role": "user", "content": "hi"}]}


@pytest.mark.parametrize(("extra", "param"), [
    ({"previous_response_id": "resp_1"}, "previous_response_id"),
    ({"conversation": "conv_1"}, "conversation"),
    ({"background": True}, "background"),
    ({"tools": [{"type": "file_search"}]}, "tools[0]"),
    ({"tools": {"type": "function", "name": "f"}}, "tools"),
    ({"tool_choice": {"type": "web_search_preview"}}, "tool_choice"),
    ({"text": {"format": {"type": "yaml"}}}, "text.format"),
    ({"input": [{"type": "item_reference", "id": "msg_1"}]}, "input[0]"),
    ({"input": [{"role": "tool", "content": "x"}]}, "input[0]"),
    ({"input": [{"role": "user", "content": 5}]}, "input[0].content"),
    ({"input": [{"role": "user", "content": [{"type": "input_file"}]}]},
     "input[0].content[0]"),
    ({"input": [{"role": "system", "content": "only rules"}]}, "input"),
    ({"reasoning": "high"}, "reasoning"),
])
def test_what_cannot_be_translated_is_refused_naming_the_field(
        extra: dict[str, Any], param: str) -> None:
    with pytest.raises(RequestError) as caught:
        chat_body({"model": MODEL, "input": "hi", **extra})
    assert caught.value.param == param


def _chat(content: str | None, finish: str, calls: list[Any] | None = None) -> dict[str, Any]:
    message: dict[str, Any] = {"role": "assistant", "content": content}
    if calls:
        message["tool_calls"] = calls
    return {"id": "chatcmpl-1", "object": "chat.completion", "model": "gemini-2.5-flash-001",
            "choices": [{"index": 0, "message": message, "finish_reason": finish}],
            "usage": {"prompt_tokens": 100, "completion_tokens": 7, "total_tokens": 107,
                      "prompt_tokens_details": {"cached_tokens": 60},
                      "completion_tokens_details": {"reasoning_tokens": 3}}}


def test_a_chat_answer_becomes_a_response_with_its_usage() -> None:
    shape = ResponseShape(MODEL, {"model": MODEL, "input": "hi", "instructions": "Be brief."})
    doc = response_from_chat(_chat("Hello.", "stop"), shape)
    assert doc["object"] == "response" and doc["status"] == "completed"
    assert doc["model"] == "gemini-2.5-flash-001" and doc["instructions"] == "Be brief."
    [item] = doc["output"]
    assert item["type"] == "message" and item["content"][0]["text"] == "Hello."
    assert doc["usage"] == {"input_tokens": 100, "input_tokens_details": {"cached_tokens": 60},
                            "output_tokens": 7, "output_tokens_details": {"reasoning_tokens": 3},
                            "total_tokens": 107}
    assert doc["incomplete_details"] is None and doc["store"] is False

    cut = response_from_chat(_chat("Hel", "length"), shape)
    assert cut["status"] == "incomplete"
    assert cut["incomplete_details"] == {"reason": "max_output_tokens"}

    calls = [{"id": "call_9", "type": "function",
              "function": {"name": "f", "arguments": '{"x":1}'},
              "extra_content": {"google": {"thought_signature": "c2ln"}}}]
    called = response_from_chat(_chat(None, "tool_calls", calls), shape)
    [call] = called["output"]
    assert call["type"] == "function_call" and call["call_id"] == "call_9"
    assert call["name"] == "f" and call["arguments"] == '{"x":1}'
    assert call["extra_content"] == {"google": {"thought_signature": "c2ln"}}  # Gemini 3's
    assert called["status"] == "completed"


def _chunk(delta: dict[str, Any], finish: str | None = None) -> dict[str, Any]:
    return {"id": "c", "object": "chat.completion.chunk", "model": MODEL,
            "choices": [{"index": 0, "delta": delta, "finish_reason": finish}]}


def _events(raw: bytes) -> list[dict[str, Any]]:
    out = []
    for record in raw.split(b"\n\n"):
        if record:
            event, data = record.split(b"\n")
            doc = json.loads(data.removeprefix(b"data: "))
            assert event == b"event: " + doc["type"].encode()
            out.append(doc)
    return out


def test_a_chunk_stream_becomes_typed_events_text_then_calls() -> None:
    batches = [  # the chunks of each upstream read
        [_chunk({"role": "assistant", "content": "Let me "}), _chunk({"content": "look."})],
        [_chunk({"tool_calls": [{"index": 0, "id": "call_a", "type": "function",
                                 "function": {"name": "f", "arguments": '{"x"'}}]})],
        [],  # a read that completed no chunk
        [_chunk({"tool_calls": [{"index": 0, "function": {"arguments": ':1}'}}]}),
         _chunk({"tool_calls": [{"index": 1, "id": "call_b", "type": "function",
                                 "function": {"name": "g", "arguments": "{}"}}]}, "tool_calls")],
        [{"id": "c", "choices": [], "usage": {"prompt_tokens": 10, "completion_tokens": 4,
                                              "prompt_tokens_details": {"cached_tokens": 8}}}],
    ]
    translator = EventTranslator(ResponseShape(MODEL, {"model": MODEL, "input": "x"}))
    events = _events(b"".join(translator.translate(iter(batches), lambda: True)))
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    assert [e["type"] for e in events] == [
        "response.created", "response.in_progress",
        "response.output_item.added", "response.content_part.added",
        "response.output_text.delta", "response.output_text.delta",
        "response.output_text.done", "response.content_part.done", "response.output_item.done",
        "response.output_item.added", "response.function_call_arguments.delta",
        "response.function_call_arguments.delta",
        "response.output_item.added", "response.function_call_arguments.delta",
        "response.function_call_arguments.done", "response.output_item.done",
        "response.function_call_arguments.done", "response.output_item.done",
        "response.completed"]
    assert events[6]["text"] == "Let me look."
    assert [e["output_index"] for e in events if e["type"] == "response.output_item.added"] \
        == [0, 1, 2]
    done = events[-1]["response"]
    assert done["status"] == "completed"
    assert [(i["type"], i.get("arguments")) for i in done["output"]] == [
        ("message", None), ("function_call", '{"x":1}'), ("function_call", "{}")]
    assert done["usage"]["input_tokens_details"] == {"cached_tokens": 8}
    assert done["usage"]["output_tokens"] == 4


def test_a_stream_cut_at_the_length_limit_is_incomplete() -> None:
    translator = EventTranslator(ResponseShape(MODEL, {"model": MODEL, "input": "x"}))
    raw = b"".join(translator.translate(iter([[_chunk({"content": "Hel"}, "length")]]),
                                        lambda: True))
    last = _events(raw)[-1]
    assert last["type"] == "response.incomplete"
    assert last["response"]["incomplete_details"] == {"reason": "max_output_tokens"}


def test_an_error_record_ends_the_stream_without_completing_it() -> None:
    batches = [[_chunk({"content": "Hel"})],
               [{"error": {"message": "upstream broke off", "type": "server_error",
                           "code": "upstream_error"}}]]
    translator = EventTranslator(ResponseShape(MODEL, {"model": MODEL, "input": "x"}))
    # the relay ended the broken stream with the error record: not completed
    events = _events(b"".join(translator.translate(iter(batches), lambda: False)))
    assert events[-1] == {"type": "error", "sequence_number": len(events) - 1,
                          "code": "upstream_error", "message": "upstream broke off",
                          "param": None}
    assert not any(e["type"].startswith("response.completed") for e in events)
    # an error record from Google on a stream that ended normally: nothing completes either
    translator = EventTranslator(ResponseShape(MODEL, {"model": MODEL, "input": "x"}))
    events = _events(b"".join(translator.translate(iter(batches), lambda: True)))
    assert events[-1]["type"] == "error"


def test_reasoning_settings_become_gemini_thinking_and_a_bad_summary_is_refused() -> None:
    chat = chat_body({"model": MODEL, "input": "hi",
                      "reasoning": {"effort": "high", "summary": "detailed"}})
    assert chat["reasoning_effort"] == "high"
    assert chat["extra_body"] == {"google": {"thinking_config": {"include_thoughts": True}}}
    assert "extra_body" not in chat_body({"model": MODEL, "input": "hi",
                                          "reasoning": {"effort": "low"}})
    with pytest.raises(RequestError) as caught:
        chat_body({"model": MODEL, "input": "hi", "reasoning": {"summary": "verbose"}})
    assert caught.value.param == "reasoning.summary"


def test_a_thought_summary_is_a_reasoning_item_before_the_message() -> None:
    doc = _chat("Four.", "stop")
    doc["choices"][0]["message"]["reasoning_content"] = "Adding two and two."
    shape = ResponseShape(MODEL, {"model": MODEL, "input": "x",
                                  "reasoning": {"effort": "low", "summary": "auto"}})
    response = response_from_chat(doc, shape)
    first, second = response["output"]
    assert first["type"] == "reasoning" and first["id"].startswith("rs_")
    assert first["summary"] == [{"type": "summary_text", "text": "Adding two and two."}]
    assert second["type"] == "message"
    assert response["reasoning"] == {"effort": "low", "summary": "auto"}


def test_a_streamed_thought_summary_is_closed_before_the_text_starts() -> None:
    batches = [[_chunk({"role": "assistant", "reasoning_content": "Adding "})],
               [_chunk({"reasoning_content": "two and two."})],
               [_chunk({"content": "Four."}, "stop")]]
    translator = EventTranslator(ResponseShape(MODEL, {"model": MODEL, "input": "x"}))
    events = _events(b"".join(translator.translate(iter(batches), lambda: True)))
    assert [e["type"] for e in events] == [
        "response.created", "response.in_progress",
        "response.output_item.added", "response.reasoning_summary_part.added",
        "response.reasoning_summary_text.delta", "response.reasoning_summary_text.delta",
        "response.reasoning_summary_text.done", "response.reasoning_summary_part.done",
        "response.output_item.done",
        "response.output_item.added", "response.content_part.added",
        "response.output_text.delta", "response.output_text.done",
        "response.content_part.done", "response.output_item.done", "response.completed"]
    assert events[6]["text"] == "Adding two and two." and events[6]["summary_index"] == 0
    assert [e["output_index"] for e in events if e["type"] == "response.output_item.added"] \
        == [0, 1]
    assert [i["type"] for i in events[-1]["response"]["output"]] == ["reasoning", "message"]


def test_a_thought_after_text_starts_its_own_item_after_the_text() -> None:
    batches = [[_chunk({"role": "assistant", "content": "Four."})],
               [_chunk({"reasoning_content": "Checked again."}, "stop")]]
    translator = EventTranslator(ResponseShape(MODEL, {"model": MODEL, "input": "x"}))
    events = _events(b"".join(translator.translate(iter(batches), lambda: True)))
    assert [e["output_index"] for e in events if e["type"] == "response.output_item.added"] \
        == [0, 1]
    assert [i["type"] for i in events[-1]["response"]["output"]] == ["message", "reasoning"]


def test_an_input_item_whose_role_is_not_a_string_is_refused_naming_it() -> None:
    with pytest.raises(RequestError) as caught:
        chat_body({"model": MODEL, "input": [{"role": {"user": 1}, "content": "hi"}]})
    assert caught.value.param == "input[0]"


def test_output_text_logprobs_are_asked_for_and_come_back_whole_and_streamed() -> None:
    chat = chat_body({"model": MODEL, "input": "hi", "top_logprobs": 2,
                      "include": ["message.output_text.logprobs"]})
    assert chat["logprobs"] is True and chat["top_logprobs"] == 2
    assert "logprobs" not in chat_body({"model": MODEL, "input": "hi", "top_logprobs": 2})
    scored = [{"token": "Fo", "logprob": -0.1, "bytes": [70, 111], "top_logprobs": []},
              {"token": "ur.", "logprob": -0.2, "bytes": [117, 114, 46], "top_logprobs": []}]
    doc = _chat("Four.", "stop")
    doc["choices"][0]["logprobs"] = {"content": scored, "refusal": None}
    [message] = response_from_chat(doc, ResponseShape(MODEL, {"model": MODEL}))["output"]
    assert message["content"][0]["logprobs"] == scored
    first, second = _chunk({"content": "Fo"}), _chunk({"content": "ur."}, "stop")
    first["choices"][0]["logprobs"] = {"content": scored[:1]}
    second["choices"][0]["logprobs"] = {"content": scored[1:]}
    translator = EventTranslator(ResponseShape(MODEL, {"model": MODEL, "input": "x"}))
    events = _events(b"".join(translator.translate(iter([[first], [second]]), lambda: True)))
    deltas = [e["logprobs"] for e in events if e["type"] == "response.output_text.delta"]
    assert deltas == [scored[:1], scored[1:]]
    done = next(e for e in events if e["type"] == "response.output_text.done")
    assert done["logprobs"] == scored
    assert events[-1]["response"]["output"][0]["content"][0]["logprobs"] == scored


@pytest.mark.parametrize("cut", [0, 20])
def test_a_broken_stream_ends_with_an_error_event(cut: int) -> None:
    """After a record Google's connection cut in the middle, the relay's own error record
    would be read with it as one broken record: the typed events still end with an
    ``error`` event carrying the relay's message, and nothing is completed."""
    record = b"data: " + json.dumps({"candidates": [{"content": {
        "role": "model", "parts": [{"text": "Hel"}]}, "index": 0}]}).encode() + b"\r\n\r\n"
    relay = openai_error_event("the upstream stream broke off (request id r-3)")
    adapter = ResponsesAdapter("gem", MODEL, lambda backend, tokens: None,
                               ResponseShape(MODEL, {"model": MODEL, "input": "x"}))
    pieces = [record, *([record[:cut]] if cut else []), relay]
    events = _events(b"".join(adapter.render(gemini.NativeStream(MODEL), iter(pieces),
                                             lambda: False)))
    kinds = [e["type"] for e in events]
    assert kinds[0] == "response.created" and "response.output_text.delta" in kinds
    assert kinds[-1] == "error" and kinds.count("error") == 1
    assert "response.completed" not in kinds
    assert events[-1]["message"] == "the upstream stream broke off (request id r-3)"
