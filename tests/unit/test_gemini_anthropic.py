"""The Anthropic Messages API translated for Gemini backends
(``continuum.routing.gemini_anthropic``): requests to chat completions and native requests,
count-tokens, answers, errors and streams back in Anthropic's shapes."""

from __future__ import annotations

import json
import re
from collections.abc import Iterable
from typing import Any, cast

import pytest
from anthropic.lib.streaming._messages import accumulate_event

from continuum.errors import RequestError
from continuum.routing import gemini
from continuum.routing.forwarder import anthropic_error_event
from continuum.routing.gemini_anthropic import (
    EventTranslator,
    chat_body,
    count_answer,
    count_request,
    error_body,
    message_from_chat,
    stop_reason,
    to_native,
)

MODEL = "gemini-2.5-flash"
SCHEMA = {"type": "object", "properties": {"q": {"type": "string"}},
          "required": ["q"], "additionalProperties": False,
          "$schema": "http://json-schema.org/draft-07/schema#"}


def _with_parsed_arguments(chat: dict[str, Any]) -> dict[str, Any]:
    """``chat`` with each tool call's JSON ``arguments`` decoded (their spacing is not the
    translation's contract, their value is)."""
    for message in chat["messages"]:
        for call in message.get("tool_calls") or []:
            call["function"]["arguments"] = json.loads(call["function"]["arguments"])
    return chat


# --- chat_body ---------------------------------------------------------------------------


def test_a_conversation_of_blocks_becomes_chat_messages() -> None:
    body: dict[str, Any] = {
        "model": MODEL, "system": "Be brief.", "max_tokens": 100, "temperature": 0.3,
        "top_p": 0.9, "top_k": 5, "stream": True, "stop_sequences": ["END", "STOP"],
        "metadata": {"user_id": "u1"}, "service_tier": "auto", "inference_geo": "us",
        "tools": [{"name": "lookup", "description": "Find a page", "input_schema": SCHEMA},
                  {"type": "custom", "name": "ping"}],
        "tool_choice": {"type": "tool", "name": "lookup"},
        "messages": [
            {"role": "user", "content": [
                {"type": "text", "text": "Look"},
                {"type": "image", "source": {"type": "base64", "media_type": "image/png",
                                             "data": "AAAA"}},
                {"type": "image", "source": {"type": "url", "url": "https://x.test/cat.png"}},
                {"type": "document", "source": {"type": "base64",
                                                "media_type": "application/pdf",
                                                "data": "JVBERi0x"}},
                {"type": "document", "source": {"type": "text", "media_type": "text/plain",
                                                "data": "plain notes"}}]},
            {"role": "assistant", "content": [
                {"type": "thinking", "thinking": "hmm", "signature": "sig"},
                {"type": "redacted_thinking", "data": "opaque"},
                {"type": "text", "text": "Checking."},
                {"type": "tool_use", "id": "toolu_1", "name": "lookup", "input": {"q": "x"}},
                {"type": "tool_use", "id": "toolu_2", "name": "ping", "input": {}}]},
            {"role": "user", "content": [
                {"type": "text", "text": "Also this"},
                {"type": "tool_result", "tool_use_id": "toolu_1", "content": "ten"},
                {"type": "tool_result", "tool_use_id": "toolu_2", "is_error": True,
                 "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}]},
            {"role": "assistant", "content": "Done."},
        ]}
    assert _with_parsed_arguments(chat_body(body)) == {
        "model": MODEL, "max_tokens": 100, "temperature": 0.3, "top_p": 0.9, "stream": True,
        "top_k": 5, "stop": ["END", "STOP"],
        "tools": [{"type": "function", "function": {"name": "lookup",
                                                    "description": "Find a page",
                                                    "parameters": SCHEMA}},
                  {"type": "function", "function": {"name": "ping"}}],
        "tool_choice": {"type": "function", "function": {"name": "lookup"}},
        "messages": [
            {"role": "system", "content": "Be brief."},
            {"role": "user", "content": [
                {"type": "text", "text": "Look"},
                {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}},
                {"type": "image_url", "image_url": {"url": "https://x.test/cat.png"}},
                {"type": "image_url",
                 "image_url": {"url": "data:application/pdf;base64,JVBERi0x"}},
                {"type": "text", "text": "plain notes"}]},
            {"role": "assistant", "content": [{"type": "text", "text": "Checking."}],
             "tool_calls": [
                 {"id": "toolu_1", "type": "function",
                  "function": {"name": "lookup", "arguments": {"q": "x"}}},
                 {"id": "toolu_2", "type": "function",
                  "function": {"name": "ping", "arguments": {}}}]},
            # the tool results come before the user's other parts
            {"role": "tool", "tool_call_id": "toolu_1", "content": "ten"},
            {"role": "tool", "tool_call_id": "toolu_2", "content": '{"error": "a\\nb"}'},
            {"role": "user", "content": [{"type": "text", "text": "Also this"}]},
            {"role": "assistant", "content": "Done."}]}


def test_system_text_blocks_are_system_messages_and_an_empty_system_is_none() -> None:
    chat = chat_body({"model": MODEL, "messages": [{"role": "user", "content": "hi"}],
                      "system": [{"type": "text", "text": "One."},
                                 {"type": "text", "text": "Two.",
                                  "cache_control": {"type": "ephemeral"}}]})
    assert chat["messages"] == [{"role": "system", "content": "One."},
                                {"role": "system", "content": "Two."},
                                {"role": "user", "content": "hi"}]
    empty = chat_body({"model": MODEL, "system": "",
                       "messages": [{"role": "user", "content": "hi"}]})
    assert empty == {"model": MODEL, "messages": [{"role": "user", "content": "hi"}]}


def test_an_assistant_turn_of_thinking_only_is_dropped_and_a_result_may_be_empty() -> None:
    chat = chat_body({"model": MODEL, "messages": [
        {"role": "user", "content": "hi"},
        {"role": "assistant", "content": [{"type": "thinking", "thinking": "t",
                                           "signature": "s"}]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t1"},
                                     {"type": "tool_result", "tool_use_id": "t2",
                                      "content": "[1, 2]"}]}]})
    assert chat["messages"] == [{"role": "user", "content": "hi"},
                                {"role": "tool", "tool_call_id": "t1", "content": ""},
                                {"role": "tool", "tool_call_id": "t2", "content": "[1, 2]"}]


def _refused(extra: dict[str, Any]) -> RequestError:
    body: dict[str, Any] = {"model": MODEL, "max_tokens": 10,
                            "messages": [{"role": "user", "content": "hi"}], **extra}
    with pytest.raises(RequestError) as caught:
        chat_body(body)
    return caught.value


def _user(*blocks: Any) -> dict[str, Any]:
    return {"messages": [{"role": "user", "content": list(blocks)}]}


IMAGE = {"type": "image", "source": {"type": "base64", "media_type": "image/png",
                                     "data": "AAAA"}}


@pytest.mark.parametrize(("extra", "param"), [
    ({"system": [{"type": "text", "text": "ok"}, IMAGE]}, "system[1]"),
    ({"system": ["plain string"]}, "system[0]"),
    ({"system": [{"type": "text", "text": 5}]}, "system[0].text"),
    (_user({"type": "document", "source": {"type": "url", "url": "https://x.test/a.pdf"}}),
     "messages[0].content[0].source.type"),
    (_user({"type": "text", "text": "x"},
           {"type": "image", "source": {"type": "file", "file_id": "file_1"}}),
     "messages[0].content[1].source.type"),
    (_user({"type": "image", "source": {"type": "base64", "data": "AAAA"}}),
     "messages[0].content[0].source"),
    (_user({"type": "image"}), "messages[0].content[0].source"),
    (_user({"type": "tool_result", "tool_use_id": "t1",
            "content": [{"type": "text", "text": "see"}, IMAGE]}),
     "messages[0].content[0].content[1]"),
    (_user({"type": "tool_result", "tool_use_id": "t1", "content": 5}),
     "messages[0].content[0].content"),
    (_user({"type": "tool_result", "content": "x"}), "messages[0].content[0].tool_use_id"),
    (_user({"type": "text", "text": "x"}, {"type": "server_tool_use", "id": "s"}),
     "messages[0].content[1].type"),
    (_user({"type": "tool_use", "id": "t", "name": "f", "input": {}}),
     "messages[0].content[0].type"),
    (_user({"type": "thinking", "thinking": "t", "signature": "s"}),
     "messages[0].content[0].type"),
    (_user("just a string"), "messages[0].content[0]"),
    ({"messages": [{"role": "user", "content": "hi"},
                   {"role": "assistant", "content": [{"type": "tool_result",
                                                      "tool_use_id": "t", "content": "x"}]}]},
     "messages[1].content[0].type"),
    ({"messages": [{"role": "user", "content": "hi"},
                   {"role": "assistant", "content": [{"type": "tool_use", "id": "t",
                                                      "name": "f", "input": [1]}]}]},
     "messages[1].content[0].input"),
    ({"messages": [{"role": "user", "content": "hi"},
                   {"role": "assistant", "content": [{"type": "tool_use", "id": "t"}]}]},
     "messages[1].content[0]"),
    ({"messages": [{"role": "tool", "content": "rules"}]}, "messages[0].role"),
    ({"messages": [{"role": "user", "content": "hi"}, {"role": "tool", "content": "x"}]},
     "messages[1].role"),
    ({"messages": [{"role": "user", "content": 5}]}, "messages[0].content"),
    ({"tools": [{"type": "bash_20250124", "name": "bash"}]}, "tools[0].type"),
    ({"tools": [{"name": "f"}, {"type": "web_search_20250305", "name": "web_search"}]},
     "tools[1].type"),
    ({"tools": [{"name": ""}]}, "tools[0].name"),
    ({"tools": [{"name": "f", "input_schema": "object"}]}, "tools[0].input_schema"),
    ({"tools": {"name": "f"}}, "tools"),
    ({"tool_choice": {"type": "tool"}}, "tool_choice"),
    ({"tool_choice": {"type": "required"}}, "tool_choice"),
    ({"tool_choice": "auto"}, "tool_choice"),
    ({"thinking": {"type": "enabled"}}, "thinking.budget_tokens"),
    ({"thinking": {"type": "enabled", "budget_tokens": -1}}, "thinking.budget_tokens"),
    ({"thinking": {"type": "enabled", "budget_tokens": "1024"}}, "thinking.budget_tokens"),
    ({"thinking": {"type": "enabled", "budget_tokens": True}}, "thinking.budget_tokens"),
    ({"thinking": {"type": "enabled", "budget_tokens": 1024.0}}, "thinking.budget_tokens"),
    ({"thinking": {"type": "on"}}, "thinking.type"),
    ({"thinking": "enabled"}, "thinking.type"),
    ({"output_config": {"format": {"type": "json_object"}}}, "output_config.format"),
    ({"output_config": {"format": {"type": "json_schema", "schema": "x"}}},
     "output_config.format"),
    ({"output_format": {"type": "json_schema"}}, "output_format"),
    ({"mcp_servers": [{"type": "url", "url": "https://mcp.test", "name": "m"}]},
     "mcp_servers"),
    ({"container": "container_1"}, "container"),
])
def test_what_cannot_be_translated_is_refused_naming_the_field(
        extra: dict[str, Any], param: str) -> None:
    assert _refused(extra).param == param


def test_an_anthropic_tool_type_is_refused_with_its_name_in_the_message() -> None:
    error = _refused({"tools": [{"type": "text_editor_20250728", "name": "x"}]})
    assert error.status == 400 and error.code == "invalid_value"
    assert "text_editor_20250728" in error.message


@pytest.mark.parametrize(("top_k", "sent"), [
    (40, True), (1, True), (0, False), (-1, False), (True, False), (3.0, False),
    ("5", False), (None, False)])
def test_top_k_goes_only_when_a_positive_integer(top_k: Any, sent: bool) -> None:
    chat = chat_body({"model": MODEL, "top_k": top_k,
                      "messages": [{"role": "user", "content": "hi"}]})
    assert ("top_k" in chat) is sent
    if sent:
        assert chat["top_k"] == top_k


def test_absent_and_null_sampling_fields_are_not_sent() -> None:
    chat = chat_body({"model": MODEL, "messages": [{"role": "user", "content": "hi"}],
                      "temperature": None, "top_p": None, "stop_sequences": [],
                      "tools": [], "tool_choice": None, "thinking": None,
                      "mcp_servers": [], "container": None})
    assert chat == {"model": MODEL, "messages": [{"role": "user", "content": "hi"}]}
    zero = chat_body({"model": MODEL, "messages": [], "temperature": 0, "max_tokens": 0,
                      "stream": False})
    assert zero == {"model": MODEL, "messages": [], "temperature": 0, "max_tokens": 0,
                    "stream": False}


@pytest.mark.parametrize(("choice", "expected"), [
    ({"type": "auto"}, "auto"),
    ({"type": "auto", "disable_parallel_tool_use": True}, "auto"),
    ({"type": "any"}, "required"),
    ({"type": "none"}, "none"),
    ({"type": "tool", "name": "lookup"}, {"type": "function", "function": {"name": "lookup"}}),
])
def test_tool_choice_becomes_chats(choice: dict[str, Any], expected: Any) -> None:
    chat = chat_body({"model": MODEL, "messages": [{"role": "user", "content": "hi"}],
                      "tools": [{"name": "lookup"}], "tool_choice": choice})
    assert chat["tool_choice"] == expected


@pytest.mark.parametrize(("thinking", "fields"), [
    ({"type": "enabled", "budget_tokens": 2048},
     {"extra_body": {"google": {"thinking_config": {"thinking_budget": 2048,
                                                    "include_thoughts": True}}}}),
    ({"type": "enabled", "budget_tokens": 0},
     {"extra_body": {"google": {"thinking_config": {"thinking_budget": 0,
                                                    "include_thoughts": True}}}}),
    ({"type": "adaptive"},
     {"extra_body": {"google": {"thinking_config": {"include_thoughts": True}}}}),
    ({"type": "disabled"},
     {"extra_body": {"google": {"thinking_config": {"thinking_budget": 0}}}}),
])
def test_thinking_becomes_a_gemini_thinking_config(thinking: dict[str, Any],
                                                   fields: dict[str, Any]) -> None:
    chat = chat_body({"model": MODEL, "messages": [{"role": "user", "content": "hi"}],
                      "thinking": thinking})
    assert chat == {"model": MODEL, "messages": [{"role": "user", "content": "hi"}],
                    **fields}


def test_a_json_schema_output_format_becomes_a_response_format() -> None:
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}}
    other = {"type": "object"}
    for extra in ({"output_config": {"format": {"type": "json_schema", "schema": schema}}},
                  {"output_format": {"type": "json_schema", "schema": schema}},
                  # output_config.format is the one that counts when both are given
                  {"output_config": {"format": {"type": "json_schema", "schema": schema}},
                   "output_format": {"type": "json_schema", "schema": other}},
                  # an output_config without a format leaves the earlier spelling
                  {"output_config": {"effort": "high"},
                   "output_format": {"type": "json_schema", "schema": schema}}):
        chat = chat_body({"model": MODEL, "messages": [{"role": "user", "content": "hi"}],
                          **extra})
        assert chat["response_format"] == {"type": "json_schema",
                                           "json_schema": {"schema": schema}}, extra
    bare = chat_body({"model": MODEL, "messages": [{"role": "user", "content": "hi"}],
                      "output_config": {"effort": "high"}})
    assert "response_format" not in bare


# --- to_native -----------------------------------------------------------------------------


def _conversation() -> dict[str, Any]:
    return {
        "model": MODEL, "max_tokens": 200, "temperature": 0.5, "top_k": 20,
        "stop_sequences": ["END"], "thinking": {"type": "enabled", "budget_tokens": 1024},
        "system": [{"type": "text", "text": "Be brief."}, {"type": "text", "text": "Cite."}],
        "tools": [{"name": "lookup", "description": "Find a page", "input_schema": SCHEMA},
                  {"name": "ping"}],
        "tool_choice": {"type": "any"},
        "messages": [
            {"role": "user", "content": "Hi"},
            {"role": "assistant", "content": [
                {"type": "thinking", "thinking": "t", "signature": "s"},
                {"type": "text", "text": "Let me look."},
                {"type": "tool_use", "id": "toolu_1", "name": "lookup", "input": {"q": "x"}},
                {"type": "tool_use", "id": "toolu_2", "name": "ping", "input": {}}]},
            {"role": "user", "content": [
                {"type": "text", "text": "Thanks"},
                {"type": "tool_result", "tool_use_id": "toolu_1", "content": '{"page": 3}'},
                {"type": "tool_result", "tool_use_id": "toolu_2", "content": "boom",
                 "is_error": True}]}]}


def test_an_anthropic_request_becomes_a_native_request() -> None:
    native = to_native(chat_body(_conversation()))
    assert native == {
        "systemInstruction": {"parts": [{"text": "Be brief."}, {"text": "Cite."}]},
        "contents": [
            {"role": "user", "parts": [{"text": "Hi"}]},
            {"role": "model", "parts": [
                {"text": "Let me look."},
                {"functionCall": {"name": "lookup", "args": {"q": "x"}}},
                {"functionCall": {"name": "ping", "args": {}}}]},
            # each result's function name is the one its tool_use id had
            {"role": "user", "parts": [
                {"functionResponse": {"name": "lookup", "response": {"page": 3}}},
                {"functionResponse": {"name": "ping", "response": {"error": "boom"}}},
                {"text": "Thanks"}]}],
        "generationConfig": {
            "temperature": 0.5, "maxOutputTokens": 200, "stopSequences": ["END"],
            "thinkingConfig": {"thinkingBudget": 1024, "includeThoughts": True},
            "topK": 20},
        "tools": [{"functionDeclarations": [
            {"name": "lookup", "description": "Find a page", "parametersJsonSchema": SCHEMA},
            {"name": "ping"}]}],
        "toolConfig": {"functionCallingConfig": {"mode": "ANY"}}}
    assert "parameters" not in native["tools"][0]["functionDeclarations"][0]


@pytest.mark.parametrize(("model", "config"), [
    ("gemini-2.5-flash", {"thinkingBudget": 0}),
    ("models/gemini-2.5-flash-lite", {"thinkingBudget": 0}),
    ("gemini-2.5-pro", {"thinkingBudget": 128}),  # Google refuses 0 there
    ("gemini-3-flash-preview", {"thinkingLevel": "minimal"}),
    ("gemini-3-pro-preview", {"thinkingLevel": "low"}),  # and minimal there
])
def test_thinking_disabled_asks_for_the_least_thinking_the_model_allows(
        model: str, config: dict[str, Any]) -> None:
    body = {"model": model, "messages": [{"role": "user", "content": "hi"}],
            "thinking": {"type": "disabled"}}
    assert to_native(chat_body(body))["generationConfig"] == {"thinkingConfig": config}


@pytest.mark.parametrize("model", ["gemini-2.0-flash", "gemini-1.5-pro", "gemma-3-27b-it"])
def test_thinking_disabled_sends_nothing_to_a_model_not_known_to_think(model: str) -> None:
    body = {"model": model, "messages": [{"role": "user", "content": "hi"}],
            "thinking": {"type": "disabled"}}
    assert "generationConfig" not in to_native(chat_body(body))


def test_a_json_schema_output_goes_as_the_response_json_schema() -> None:
    schema = {"type": "object", "additionalProperties": False}
    native = to_native(chat_body({
        "model": MODEL, "messages": [{"role": "user", "content": "hi"}],
        "output_config": {"format": {"type": "json_schema", "schema": schema}}}))
    assert native["generationConfig"] == {"responseMimeType": "application/json",
                                          "responseJsonSchema": schema}


def test_with_a_cache_the_native_request_has_no_system_or_tools() -> None:
    native = to_native(chat_body(_conversation()), "cachedContents/abc")
    assert native["cachedContent"] == "cachedContents/abc"
    assert set(native) == {"contents", "generationConfig", "cachedContent"}
    assert native["generationConfig"]["topK"] == 20
    assert native["contents"][1]["parts"][1] == {
        "functionCall": {"name": "lookup", "args": {"q": "x"}}}


def test_a_request_without_top_k_or_generation_fields_has_no_generation_config() -> None:
    native = to_native(chat_body({"model": MODEL,
                                  "messages": [{"role": "user", "content": "hi"}]}))
    assert native == {"contents": [{"role": "user", "parts": [{"text": "hi"}]}]}


# --- count tokens ------------------------------------------------------------------------


@pytest.mark.parametrize("model", [MODEL, "models/" + MODEL])
def test_count_tokens_sends_the_request_without_its_generation_config(model: str) -> None:
    body = {"model": model, "system": "Be brief.", "max_tokens": 10, "top_k": 4,
            "thinking": {"type": "enabled", "budget_tokens": 1024},
            "tools": [{"name": "lookup", "input_schema": SCHEMA}],
            "messages": [{"role": "user", "content": "hi"}]}
    assert count_request(chat_body(body), model) == {"generateContentRequest": {
        "model": "models/" + MODEL,
        "contents": [{"role": "user", "parts": [{"text": "hi"}]}],
        "systemInstruction": {"parts": [{"text": "Be brief."}]},
        "tools": [{"functionDeclarations": [{"name": "lookup",
                                             "parametersJsonSchema": SCHEMA}]}]}}


@pytest.mark.parametrize(("doc", "tokens"), [
    ({"totalTokens": 31}, 31), ({"totalTokens": 0}, 0), ({}, 0), ({"totalTokens": -5}, 0),
    ({"totalTokens": "31"}, 0), ({"totalTokens": True}, 0), ({"totalTokens": 3.5}, 0),
    ({"totalTokens": 12, "cachedContentTokenCount": 10}, 12)])
def test_count_tokens_answer_is_the_total(doc: dict[str, Any], tokens: int) -> None:
    assert count_answer(doc) == {"input_tokens": tokens}


# --- message_from_chat ---------------------------------------------------------------------


def _answer(message: dict[str, Any], finish: Any = "stop",
            usage: Any = None, **extra: Any) -> dict[str, Any]:
    return {"id": "chatcmpl-abc", "object": "chat.completion", "model": "gemini-2.5-flash-001",
            "choices": [{"index": 0, "message": {"role": "assistant", **message},
                         "finish_reason": finish}],
            "usage": usage if usage is not None else {
                "prompt_tokens": 100, "completion_tokens": 7, "total_tokens": 107,
                "prompt_tokens_details": {"cached_tokens": 60},
                "completion_tokens_details": {"reasoning_tokens": 3}}, **extra}


def test_a_chat_answer_becomes_a_message() -> None:
    answer = _answer({
        "content": "Let me look.", "reasoning_content": "Planning.",
        "tool_calls": [
            {"id": "call_1", "type": "function",
             "function": {"name": "lookup", "arguments": '{"q": "x"}'}},
            {"id": "call_2", "type": "function",
             "function": {"name": "ping", "arguments": "not json"}},
            {"id": "call_3", "type": "function", "function": {"name": "n", "arguments": ""}},
            {"id": "call_4", "type": "function", "function": {"name": "v", "arguments": "[1]"}}]},
        "tool_calls")
    assert message_from_chat(answer, MODEL) == {
        "id": "msg_abc", "type": "message", "role": "assistant",
        "model": "gemini-2.5-flash-001",
        "content": [
            {"type": "thinking", "thinking": "Planning.", "signature": ""},
            {"type": "text", "text": "Let me look."},
            {"type": "tool_use", "id": "call_1", "name": "lookup", "input": {"q": "x"}},
            {"type": "tool_use", "id": "call_2", "name": "ping",
             "input": {"arguments": "not json"}},
            {"type": "tool_use", "id": "call_3", "name": "n", "input": {}},
            {"type": "tool_use", "id": "call_4", "name": "v", "input": {"value": [1]}}],
        "stop_reason": "tool_use", "stop_sequence": None,
        "usage": {"input_tokens": 40, "cache_creation_input_tokens": 0,
                  "cache_read_input_tokens": 60, "output_tokens": 7}}


def test_a_native_answer_reaches_a_message_through_the_chat_translation() -> None:
    chat = gemini.from_native({
        "responseId": "r9", "modelVersion": "gemini-2.5-flash-002",
        "candidates": [{"finishReason": "STOP", "content": {"role": "model", "parts": [
            {"text": "Weighing it.", "thought": True}, {"text": "Four."},
            {"functionCall": {"id": "fc_1", "name": "add", "args": {"a": 2}}}]}}],
        "usageMetadata": {"promptTokenCount": 30, "cachedContentTokenCount": 12,
                          "candidatesTokenCount": 5, "thoughtsTokenCount": 4}}, MODEL)
    message = message_from_chat(chat, MODEL)
    assert message["id"] == "msg_r9" and message["model"] == "gemini-2.5-flash-002"
    assert message["content"] == [
        {"type": "thinking", "thinking": "Weighing it.", "signature": ""},
        {"type": "text", "text": "Four."},
        {"type": "tool_use", "id": "fc_1", "name": "add", "input": {"a": 2}}]
    assert message["stop_reason"] == "tool_use"
    assert message["usage"] == {"input_tokens": 18, "cache_creation_input_tokens": 0,
                                "cache_read_input_tokens": 12, "output_tokens": 9}


@pytest.mark.parametrize(("finish", "reason"), [
    ("stop", "end_turn"), ("length", "max_tokens"), ("tool_calls", "tool_use"),
    ("content_filter", "refusal"), ("function_call", "end_turn"), ("weird", "end_turn"),
    (None, "end_turn"), (3, "end_turn")])
def test_stop_reasons(finish: Any, reason: str) -> None:
    assert stop_reason(finish) == reason
    assert message_from_chat(_answer({"content": "x"}, finish), MODEL)["stop_reason"] == reason


@pytest.mark.parametrize(("usage", "expected"), [
    ({"prompt_tokens": 100, "completion_tokens": 7,
      "prompt_tokens_details": {"cached_tokens": 150}}, (0, 100, 7)),
    ({"prompt_tokens": 100, "completion_tokens": 7}, (100, 0, 7)),
    ({"prompt_tokens": 100, "completion_tokens": 7, "prompt_tokens_details": None},
     (100, 0, 7)),
    ({"prompt_tokens": 100, "prompt_tokens_details": {"cached_tokens": -3}}, (100, 0, 0)),
    ({"prompt_tokens": -1, "completion_tokens": "7"}, (0, 0, 0)),
    ({}, (0, 0, 0)),
    ("nonsense", (0, 0, 0)),
])
def test_usage_splits_the_cached_tokens_off_the_input(usage: Any,
                                                      expected: tuple[int, int, int]) -> None:
    given, cached, output = expected
    assert message_from_chat(_answer({"content": "x"}, usage=usage), MODEL)["usage"] == {
        "input_tokens": given, "cache_creation_input_tokens": 0,
        "cache_read_input_tokens": cached, "output_tokens": output}


def test_an_answer_without_choices_or_id_is_an_empty_message() -> None:
    message = message_from_chat({"choices": [], "usage": None}, MODEL)
    assert re.fullmatch(r"msg_\d+", message["id"])
    assert message["model"] == MODEL and message["content"] == []
    assert message["stop_reason"] == "end_turn" and message["stop_sequence"] is None
    assert message["usage"] == {"input_tokens": 0, "cache_creation_input_tokens": 0,
                                "cache_read_input_tokens": 0, "output_tokens": 0}
    assert message_from_chat({"id": "resp-1", "choices": ["x"]}, MODEL)["id"] == "msg_resp-1"
    empty = message_from_chat(_answer({"content": None}), MODEL)
    assert empty["content"] == []


# --- error_body ----------------------------------------------------------------------------


@pytest.mark.parametrize(("status", "google", "kind"), [
    (400, "INVALID_ARGUMENT", "invalid_request_error"),
    (403, "PERMISSION_DENIED", "permission_error"),
    (404, "NOT_FOUND", "not_found_error"),
    (429, "RESOURCE_EXHAUSTED", "rate_limit_error"),
    (500, "INTERNAL", "api_error"),
    (503, "UNAVAILABLE", "overloaded_error"),
])
def test_google_errors_become_anthropic_errors(status: int, google: str, kind: str) -> None:
    data = json.dumps({"error": {"code": status, "message": f"{google} happened",
                                 "status": google}}).encode()
    expected = {"type": "error", "error": {"type": kind, "message": f"{google} happened"}}
    assert json.loads(error_body(status, data)) == expected
    assert json.loads(error_body(status, b"[" + data + b"]")) == expected


@pytest.mark.parametrize(("status", "data", "kind", "message"), [
    (502, b"  Bad Gateway\n", "api_error", "Bad Gateway"),
    (500, b"", "api_error", "upstream status 500"),
    (400, b"   ", "invalid_request_error", "upstream status 400"),
    (500, b'{"error": {"code": 500}}', "api_error", '{"error": {"code": 500}}'),
    (429, b'{"error": "quota"}', "rate_limit_error", '{"error": "quota"}'),
    (503, b"[]", "overloaded_error", "[]"),
])
def test_other_error_bodies_keep_their_text(status: int, data: bytes, kind: str,
                                            message: str) -> None:
    assert json.loads(error_body(status, data)) == {
        "type": "error", "error": {"type": kind, "message": message}}


def test_a_long_text_error_is_cut() -> None:
    doc = json.loads(error_body(500, b"x" * 5000))
    assert doc["error"]["message"] == "x" * 1024


# --- EventTranslator -----------------------------------------------------------------------


def _record(doc: dict[str, Any]) -> bytes:
    return b"data: " + json.dumps(doc).encode() + b"\r\n\r\n"


def _candidate(parts: list[dict[str, Any]], finish: str | None = None,
               usage: dict[str, Any] | None = None) -> bytes:
    candidate: dict[str, Any] = {"content": {"role": "model", "parts": parts}, "index": 0}
    if finish is not None:
        candidate["finishReason"] = finish
    doc: dict[str, Any] = {"candidates": [candidate], "responseId": "abc",
                           "modelVersion": "gemini-2.5-flash-001",
                           "usageMetadata": usage or {"promptTokenCount": 50,
                                                      "cachedContentTokenCount": 40}}
    return _record(doc)


FINAL_USAGE = {"promptTokenCount": 50, "cachedContentTokenCount": 40,
               "candidatesTokenCount": 12, "thoughtsTokenCount": 3, "totalTokenCount": 65}


def _stream(pieces: Iterable[bytes], completed: bool = True) -> tuple[list[bytes],
                                                                      list[dict[str, Any]]]:
    """What the translator yields for Google's ``pieces``, and those bytes parsed as SSE
    (checking that each event's name is its ``type``)."""
    native = gemini.NativeStream(MODEL)
    yielded = list(EventTranslator(MODEL).translate(iter(pieces), native, lambda: completed))
    events = []
    for record in b"".join(yielded).split(b"\n\n"):
        if not record:
            continue
        event, data = record.split(b"\n")
        assert event.startswith(b"event: ") and data.startswith(b"data: ")
        doc = json.loads(data.removeprefix(b"data: "))
        assert event == b"event: " + doc["type"].encode()
        events.append(doc)
    return yielded, events


def _accumulate(events: list[dict[str, Any]]) -> Any:
    snapshot = None
    json_bufs: dict[int, bytes] = {}
    for event in events:
        snapshot = accumulate_event(event=cast(Any, event), current_snapshot=snapshot,
                                    json_bufs=json_bufs)
    return snapshot


START_USAGE = {"input_tokens": 10, "cache_creation_input_tokens": 0,
               "cache_read_input_tokens": 40, "output_tokens": 0}
END_USAGE = {"input_tokens": 10, "cache_creation_input_tokens": 0,
             "cache_read_input_tokens": 40, "output_tokens": 15}


def test_a_stream_of_thoughts_and_text_becomes_anthropic_events() -> None:
    last = _candidate([{"text": "!"}], "STOP", FINAL_USAGE)
    pieces = [
        _candidate([{"text": "Planning.", "thought": True}],
                   usage={"promptTokenCount": 50, "cachedContentTokenCount": 40,
                          "candidatesTokenCount": 2}),
        _candidate([{"text": "Hel"}]) + _candidate([{"text": "lo."}]),
        last[:30], last[30:],  # a record split across reads
    ]
    yielded, events = _stream(pieces)
    assert events == [
        {"type": "message_start", "message": {
            "id": "msg_abc", "type": "message", "role": "assistant",
            "model": "gemini-2.5-flash-001", "content": [], "stop_reason": None,
            "stop_sequence": None, "usage": START_USAGE}},
        {"type": "content_block_start", "index": 0,
         "content_block": {"type": "thinking", "thinking": "", "signature": ""}},
        {"type": "content_block_delta", "index": 0,
         "delta": {"type": "thinking_delta", "thinking": "Planning."}},
        {"type": "content_block_stop", "index": 0},
        {"type": "content_block_start", "index": 1,
         "content_block": {"type": "text", "text": ""}},
        {"type": "content_block_delta", "index": 1,
         "delta": {"type": "text_delta", "text": "Hel"}},
        {"type": "content_block_delta", "index": 1,
         "delta": {"type": "text_delta", "text": "lo."}},
        {"type": "content_block_delta", "index": 1,
         "delta": {"type": "text_delta", "text": "!"}},
        {"type": "content_block_stop", "index": 1},
        {"type": "message_delta", "delta": {"stop_reason": "end_turn", "stop_sequence": None},
         "usage": END_USAGE},
        {"type": "message_stop"}]
    # the events of one upstream read go out together; a read that completes no record
    # sends nothing
    assert len([piece for piece in yielded if piece]) == 4

    message = _accumulate(events)
    assert [block.type for block in message.content] == ["thinking", "text"]
    assert message.content[0].thinking == "Planning."
    assert message.content[1].text == "Hello.!"
    assert message.stop_reason == "end_turn" and message.id == "msg_abc"
    assert (message.usage.input_tokens, message.usage.cache_read_input_tokens,
            message.usage.output_tokens) == (10, 40, 15)


def test_a_thought_and_text_in_one_record_are_two_blocks_thinking_first() -> None:
    _, events = _stream([_candidate([{"text": "Hmm.", "thought": True}, {"text": "Yes."}],
                                    "STOP", FINAL_USAGE)])
    assert [(e["type"], e.get("index")) for e in events] == [
        ("message_start", None), ("content_block_start", 0), ("content_block_delta", 0),
        ("content_block_stop", 0), ("content_block_start", 1), ("content_block_delta", 1),
        ("content_block_stop", 1), ("message_delta", None), ("message_stop", None)]
    assert [e["content_block"]["type"] for e in events if e["type"] == "content_block_start"] \
        == ["thinking", "text"]


def test_function_calls_become_tool_use_blocks() -> None:
    pieces = [
        _candidate([{"text": "Let me look."}]),
        _candidate([{"functionCall": {"id": "fc_1", "name": "lookup", "args": {"q": "x"}}},
                    {"functionCall": {"name": "ping", "args": {}}}], "STOP", FINAL_USAGE)]
    _, events = _stream(pieces)
    assert [(e["type"], e.get("index")) for e in events] == [
        ("message_start", None),
        ("content_block_start", 0), ("content_block_delta", 0), ("content_block_stop", 0),
        ("content_block_start", 1), ("content_block_delta", 1), ("content_block_stop", 1),
        ("content_block_start", 2), ("content_block_delta", 2), ("content_block_stop", 2),
        ("message_delta", None), ("message_stop", None)]
    assert events[4]["content_block"] == {"type": "tool_use", "id": "fc_1", "name": "lookup",
                                          "input": {}}
    assert events[5]["delta"]["type"] == "input_json_delta"
    assert json.loads(events[5]["delta"]["partial_json"]) == {"q": "x"}
    second = events[7]["content_block"]
    assert second["type"] == "tool_use" and second["name"] == "ping"
    assert re.fullmatch(r"call_[0-9a-f]{24}", second["id"])
    assert json.loads(events[8]["delta"]["partial_json"]) == {}
    assert events[-2]["delta"]["stop_reason"] == "tool_use"

    message = _accumulate(events)
    assert [block.type for block in message.content] == ["text", "tool_use", "tool_use"]
    assert message.content[1].input == {"q": "x"} and message.content[1].id == "fc_1"
    assert message.content[2].input == {} and message.content[2].name == "ping"
    assert message.stop_reason == "tool_use"
    assert message.usage.output_tokens == 15


@pytest.mark.parametrize(("finish", "reason"), [
    ("STOP", "end_turn"), ("MAX_TOKENS", "max_tokens"), ("SAFETY", "refusal"),
    ("RECITATION", "refusal"), ("OTHER", "end_turn")])
def test_the_stream_stop_reason(finish: str, reason: str) -> None:
    _, events = _stream([_candidate([{"text": "Hel"}], finish, FINAL_USAGE)])
    assert events[-2] == {"type": "message_delta",
                          "delta": {"stop_reason": reason, "stop_sequence": None},
                          "usage": END_USAGE}
    assert events[-1] == {"type": "message_stop"}
    assert _accumulate(events).stop_reason == reason


def test_a_stream_that_did_not_complete_is_not_closed_but_ends_with_an_error() -> None:
    pieces = [_candidate([{"text": "Hel"}]), _candidate([{"text": "lo"}], "STOP")]
    _, events = _stream(pieces, completed=False)
    assert [e["type"] for e in events] == [
        "message_start", "content_block_start", "content_block_delta", "content_block_delta",
        "error"]
    assert events[-1]["error"] == {"type": "api_error", "message": gemini.BROKEN_OFF}


@pytest.mark.parametrize("cut", [0, 17, -3])
def test_the_relays_error_after_a_record_cut_short_still_reaches_the_client(cut: int) -> None:
    """The relay ends a broken stream with the router's own error record: glued to a record
    Google's connection cut in the middle (``cut`` bytes of it), Google's parser reads one
    broken record; the client still gets that error, and nothing after it."""
    relay = anthropic_error_event("the upstream stream broke off (request id r-1)")
    cut_short = [_candidate([{"text": "lo"}])[:cut]] if cut else []
    _, events = _stream([_candidate([{"text": "Hel"}]), *cut_short, relay], completed=False)
    assert [e["type"] for e in events] == [
        "message_start", "content_block_start", "content_block_delta", "error"]
    assert events[-1]["error"] == {
        "type": "api_error", "message": "the upstream stream broke off (request id r-1)"}


def test_an_error_record_is_an_error_event_and_the_last_one() -> None:
    error = _record({"error": {"code": 503, "message": "The model is overloaded.",
                               "status": "UNAVAILABLE"}})
    pieces = [_candidate([{"text": "Hel"}]),
              error + _candidate([{"text": "lo"}]),
              _candidate([{"text": "!"}], "STOP", FINAL_USAGE)]
    for completed in (True, False):
        yielded, events = _stream(pieces, completed)
        assert [e["type"] for e in events] == [
            "message_start", "content_block_start", "content_block_delta", "error"]
        assert events[-1] == {"type": "error", "error": {
            "type": "overloaded_error", "message": "The model is overloaded."}}
        assert b"".join(yielded).endswith(b"\n\n") and \
            b"".join(yielded).count(b"event: error") == 1


def test_an_error_before_anything_is_only_an_error() -> None:
    error = _record({"error": {"code": 429, "message": "Quota exceeded",
                               "status": "RESOURCE_EXHAUSTED"}})
    _, events = _stream([error], completed=True)
    assert events == [{"type": "error", "error": {"type": "rate_limit_error",
                                                  "message": "Quota exceeded"}}]


def test_a_stream_of_usage_only_still_opens_and_closes_the_message() -> None:
    usage_only = _record({"usageMetadata": {"promptTokenCount": 7, "totalTokenCount": 7},
                          "modelVersion": "gemini-2.5-flash-001", "responseId": "r1"})
    _, events = _stream([usage_only])
    assert [e["type"] for e in events] == ["message_start", "message_delta", "message_stop"]
    usage = {"input_tokens": 7, "cache_creation_input_tokens": 0,
             "cache_read_input_tokens": 0, "output_tokens": 0}
    assert events[0]["message"]["usage"] == usage and events[0]["message"]["content"] == []
    assert events[0]["message"]["id"].startswith("msg_")
    assert events[1] == {"type": "message_delta",
                         "delta": {"stop_reason": "end_turn", "stop_sequence": None},
                         "usage": usage}
    message = _accumulate(events)
    assert message.content == [] and message.stop_reason == "end_turn"


def test_a_candidate_with_no_parts_opens_no_block() -> None:
    _, events = _stream([_candidate([], "STOP", FINAL_USAGE)])
    assert events == [
        {"type": "message_start", "message": {
            "id": "msg_abc", "type": "message", "role": "assistant",
            "model": "gemini-2.5-flash-001", "content": [], "stop_reason": None,
            "stop_sequence": None, "usage": START_USAGE}},
        {"type": "message_delta", "delta": {"stop_reason": "end_turn", "stop_sequence": None},
         "usage": END_USAGE},
        {"type": "message_stop"}]


def test_an_empty_stream_that_completed_is_an_empty_message() -> None:
    _, events = _stream([])
    assert [e["type"] for e in events] == ["message_start", "message_delta", "message_stop"]
    zero = {"input_tokens": 0, "cache_creation_input_tokens": 0,
            "cache_read_input_tokens": 0, "output_tokens": 0}
    assert events[0]["message"]["usage"] == zero and events[1]["usage"] == zero
    assert events[0]["message"]["model"] == MODEL


def test_claude_codes_attribution_block_is_not_sent_to_gemini() -> None:
    chat = chat_body({"model": MODEL, "messages": [{"role": "user", "content": "hi"}],
                      "system": [{"type": "text", "text": "x-anthropic-billing-header: "
                                  "cc_version=2.1.88.a3f; cc_entrypoint=cli; cch=00000;"},
                                 {"type": "text", "text": "You are Claude Code."}]})
    assert chat["messages"][0] == {"role": "system", "content": "You are Claude Code."}
    assert to_native(chat)["systemInstruction"] == {"parts": [{"text": "You are Claude Code."}]}


def test_system_messages_along_the_conversation_stay_where_they_are() -> None:
    """Claude Code adds ``system`` messages inside ``messages``: sent where they stand, as
    user text merged into the turn around them, the prompt's head (systemInstruction and
    the earlier turns) stays what the last request sent, and the context cache still
    sees one leading system prompt."""
    body = {"model": MODEL, "system": "Rules.", "messages": [
        {"role": "user", "content": "Read a.py"},
        {"role": "assistant", "content": [{"type": "tool_use", "id": "t1", "name": "read",
                                           "input": {"path": "a.py"}}]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t1",
                                      "content": "print(1)"}]},
        {"role": "system", "content": [{"type": "text", "text": "Reminder: be brief."}]},
        {"role": "assistant", "content": "Done."},
        {"role": "system", "content": "Note."},
        {"role": "user", "content": "Thanks"}]}
    chat = chat_body(body)
    native = to_native(chat)
    assert native["systemInstruction"] == {"parts": [{"text": "Rules."}]}
    assert native["contents"][2:] == [
        {"role": "user", "parts": [
            {"functionResponse": {"name": "read", "response": {"content": "print(1)"}}},
            {"text": "Reminder: be brief."}]},
        {"role": "model", "parts": [{"text": "Done."}]},
        {"role": "user", "parts": [{"text": "Note."}, {"text": "Thanks"}]}]
    assert gemini.system_prompt(chat) == "Rules."  # the context cache's key: unchanged
    with pytest.raises(RequestError) as caught:
        chat_body({**body, "messages": [{"role": "system", "content": [{"type": "image"}]}]})
    assert caught.value.param == "messages[0].content[0]"
