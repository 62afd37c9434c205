"""OpenAI chat ↔ Gemini native translation, Google's errors, and the cache-miss verdict."""

from __future__ import annotations

import json
import re
from typing import Any

import pytest

from continuum.config import parse_config
from continuum.errors import ConfigError, RequestError
from continuum.routing import gemini
from continuum.routing.forwarder import openai_error_event
from continuum.routing.gemini_dispatch import is_missing_cache

TOOLS = [{"type": "function", "function": {"name": "lookup", "description": "Find a page",
                                           "parameters": {"type": "object"}}}]


def test_request_translation_maps_every_part() -> None:
    body: dict[str, Any] = {
        "model": "gemini-2.5-flash",
        "messages": [
            {"role": "system", "content": "Be brief."},
            {"role": "developer", "content": [{"type": "text", "text": "Cite pages."}]},
            {"role": "user", "content": [
                {"type": "text", "text": "What is this?"},
                {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}]},
            {"role": "assistant", "content": None, "tool_calls": [{
                "id": "call_1", "type": "function",
                "function": {"name": "lookup", "arguments": "{\"q\": \"x\"}"}}]},
            {"role": "tool", "tool_call_id": "call_1", "content": "{\"page\": 3}"},
            {"role": "user", "content": "Thanks"},
        ],
        "temperature": 0.2, "top_p": 0.9, "max_completion_tokens": 50, "stop": "END",
        "n": 1, "seed": 7, "presence_penalty": 0.1, "frequency_penalty": 0.3,
        "response_format": {"type": "json_schema", "json_schema": {"schema": {"type": "object"}}},
        "tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "lookup"}},
    }
    native = gemini.to_native(body)
    assert native["systemInstruction"] == {"parts": [{"text": "Be brief."},
                                                     {"text": "Cite pages."}]}
    assert native["contents"] == [
        {"role": "user", "parts": [{"text": "What is this?"},
                                   {"inlineData": {"mimeType": "image/png", "data": "AAAA"}}]},
        {"role": "model", "parts": [{"functionCall": {"name": "lookup", "args": {"q": "x"}}}]},
        {"role": "user", "parts": [{"functionResponse": {"name": "lookup",
                                                         "response": {"page": 3}}},
                                   {"text": "Thanks"}]},
    ]
    assert native["generationConfig"] == {
        "temperature": 0.2, "topP": 0.9, "candidateCount": 1, "presencePenalty": 0.1,
        "frequencyPenalty": 0.3, "seed": 7, "maxOutputTokens": 50, "stopSequences": ["END"],
        "responseMimeType": "application/json", "responseJsonSchema": {"type": "object"}}
    assert native["tools"] == [{"functionDeclarations": [{
        "name": "lookup", "description": "Find a page", "parameters": {"type": "object"}}]}]
    assert native["toolConfig"] == {"functionCallingConfig": {
        "mode": "ANY", "allowedFunctionNames": ["lookup"]}}


def test_cached_request_has_no_system_tools_or_tool_config() -> None:
    body = {"messages": [{"role": "system", "content": "S"}, {"role": "user", "content": "Q"}],
            "tools": TOOLS, "tool_choice": "required"}
    native = gemini.to_native(gemini.without_system(body), "cachedContents/abc")
    assert native == {"contents": [{"role": "user", "parts": [{"text": "Q"}]}],
                      "cachedContent": "cachedContents/abc"}
    assert gemini.to_native({"messages": [], "tool_choice": "none", "tools": TOOLS})[
        "toolConfig"] == {"functionCallingConfig": {"mode": "NONE"}}


@pytest.mark.parametrize(("google", "openai_reason", "calls"), [
    ("STOP", "stop", False), ("MAX_TOKENS", "length", False), ("SAFETY", "content_filter", False),
    ("RECITATION", "content_filter", False), ("STOP", "tool_calls", True),
    ("OTHER", "stop", False)])
def test_finish_reasons(google: str, openai_reason: str, calls: bool) -> None:
    assert gemini.finish_reason({"finishReason": google}, calls) == openai_reason


def test_answer_translation_with_cached_tokens_and_tool_calls() -> None:
    doc = {"candidates": [{"index": 0, "finishReason": "STOP", "content": {"role": "model",
           "parts": [{"text": "thinking", "thought": True}, {"text": "Hello"},
                     {"functionCall": {"name": "lookup", "args": {"q": 1}}}]}}],
           "usageMetadata": {"promptTokenCount": 5000, "cachedContentTokenCount": 4000,
                             "candidatesTokenCount": 7, "thoughtsTokenCount": 3,
                             "totalTokenCount": 5010},
           "modelVersion": "gemini-2.5-flash", "responseId": "r1"}
    answer = gemini.from_native(doc, "gemini-2.5-flash")
    assert answer["id"] == "chatcmpl-r1" and answer["object"] == "chat.completion"
    choice = answer["choices"][0]
    assert choice["message"]["content"] == "Hello" and choice["finish_reason"] == "tool_calls"
    [call] = choice["message"]["tool_calls"]
    assert call == {"id": call["id"], "type": "function", "function": {
        "name": "lookup", "arguments": "{\"q\": 1}"}}
    # a fresh id per call, never one an earlier turn of the conversation used
    assert re.fullmatch(r"call_[0-9a-f]{24}", call["id"])
    again = gemini.from_native(doc, "gemini-2.5-flash")["choices"][0]["message"]["tool_calls"]
    assert again[0]["id"] != call["id"]
    assert answer["usage"] == {"prompt_tokens": 5000, "completion_tokens": 10,
                               "total_tokens": 5010,
                               "prompt_tokens_details": {"cached_tokens": 4000},
                               "completion_tokens_details": {"reasoning_tokens": 3}}


def test_gemini_3_signatures_go_both_ways_as_googles_compatible_surface_carries_them() -> None:
    # parallel calls: Gemini signs the first one only
    answer = gemini.from_native({"candidates": [{"finishReason": "STOP", "content": {
        "role": "model", "parts": [
            {"functionCall": {"name": "f", "args": {"x": 1}}, "thoughtSignature": "c2ln"},
            {"functionCall": {"name": "g", "args": {}}}]}}]}, "gemini-3-pro-preview")
    first, second = answer["choices"][0]["message"]["tool_calls"]
    assert first["extra_content"] == {"google": {"thought_signature": "c2ln"}}
    assert "extra_content" not in second
    native = gemini.to_native({"messages": [
        {"role": "user", "content": "go"},
        {"role": "assistant", "content": None, "tool_calls": [first, second]},
        {"role": "tool", "tool_call_id": first["id"], "content": "1"},
        {"role": "tool", "tool_call_id": second["id"], "content": "2"}]})
    assert native["contents"][1]["parts"] == [
        {"functionCall": {"name": "f", "args": {"x": 1}}, "thoughtSignature": "c2ln"},
        {"functionCall": {"name": "g", "args": {}}}]
    # streamed, the chunk's tool call carries it too
    stream = gemini.NativeStream("gemini-3-pro-preview")
    [chunk] = stream.feed(b'data: {"candidates": [{"index": 0, "content": {"parts": [{'
                          b'"functionCall": {"name": "f", "args": {}}, '
                          b'"thoughtSignature": "c2ln"}]}}]}\r\n\r\n')
    delta = json.loads(chunk.removeprefix(b"data: "))["choices"][0]["delta"]
    assert delta["tool_calls"][0]["extra_content"]["google"]["thought_signature"] == "c2ln"


SIGNATURE = "ab+/Zm9v/+8="  # standard base64 with both of its URL-unsafe letters


def _history(call: dict[str, Any]) -> list[dict[str, Any]]:
    return [{"role": "user", "content": "go"},
            {"role": "assistant", "content": None, "tool_calls": [call]},
            {"role": "tool", "tool_call_id": call["id"], "content": "1"}]


def test_a_signature_rides_in_the_tool_call_id_for_clients_that_keep_only_the_id() -> None:
    answer = gemini.from_native({"candidates": [{"content": {"parts": [
        {"functionCall": {"name": "f", "args": {}}, "thoughtSignature": SIGNATURE},
        {"functionCall": {"name": "g", "args": {}}}]}}]}, "gemini-3-pro-preview")
    first, second = answer["choices"][0]["message"]["tool_calls"]
    # the id stays in the letters any tool-call id may use, and gives the signature back
    assert re.fullmatch(r"[A-Za-z0-9_-]+", first["id"])
    assert gemini.id_signature(first["id"]) == SIGNATURE
    assert gemini.id_signature(second["id"]) is None
    # a client that rebuilt the call from its id, name and arguments (no extra_content)
    bare = {k: first[k] for k in ("id", "type", "function")}
    native = gemini.to_native({"model": "gemini-3-pro-preview", "messages": _history(bare)})
    assert native["contents"][1]["parts"][0]["thoughtSignature"] == SIGNATURE
    # extra_content, when the client kept it, is what goes
    kept = {**bare, "extra_content": {"google": {"thought_signature": "b3du"}}}
    native = gemini.to_native({"model": "gemini-3-pro-preview", "messages": _history(kept)})
    assert native["contents"][1]["parts"][0]["thoughtSignature"] == "b3du"


@pytest.mark.parametrize("signature", [SIGNATURE, "QQ==", "QUI=", "QUJD", "", "not base64!",
                                       "QQ=", "QUJD====", 7])
def test_only_a_signature_the_id_can_give_back_unchanged_goes_into_it(signature: Any) -> None:
    call_id = gemini.tool_call_id(None, signature)
    carried = gemini.id_signature(call_id)
    canonical = isinstance(signature, str) and signature in (SIGNATURE, "QQ==", "QUI=", "QUJD")
    assert carried == (signature if canonical else None)
    assert ("__sig_" in call_id) == canonical
    assert gemini.tool_call_id("fc-7", None) == "fc-7"  # Gemini's own id, when it gives one


@pytest.mark.parametrize("call_id", ["call_1", "call_x__sig_", "call_x__sig_Q", "call_x__sig_Q=",
                                     "call_x__sig_a+b", None, 3])
def test_an_id_without_a_readable_signature_carries_none(call_id: Any) -> None:
    assert gemini.id_signature(call_id) is None


def test_a_call_without_any_signature_goes_unchecked_only_to_models_that_check() -> None:
    # a conversation another model began: its tool calls carry no signature at all
    call = {"id": "toolu_01", "type": "function", "function": {"name": "f", "arguments": "{}"}}
    second = {"id": "toolu_02", "type": "function", "function": {"name": "g", "arguments": "{}"}}
    messages = [*_history(call), {"role": "assistant", "content": None,
                                  "tool_calls": [call, second]}]
    native = gemini.to_native({"model": "gemini-3-flash-preview", "messages": messages})
    assert [part.get("thoughtSignature") for content in native["contents"]
            for part in content["parts"] if "functionCall" in part] == [
        gemini.UNSIGNED, gemini.UNSIGNED, None]  # the first call of each model turn
    for model in ("gemini-2.5-flash", "models/gemini-2.0-flash", "gemma-3-27b-it", ""):
        native = gemini.to_native({"model": model, "messages": messages})
        assert all("thoughtSignature" not in part for content in native["contents"]
                   for part in content["parts"]), model


def test_stream_translation_ends_with_usage_and_done() -> None:
    records = [
        {"candidates": [{"content": {"role": "model", "parts": [{"text": "Hel"}]}, "index": 0}],
         "usageMetadata": {"promptTokenCount": 10}, "responseId": "x"},
        {"candidates": [{"content": {"role": "model", "parts": [{"text": "lo"}]}, "index": 0,
                         "finishReason": "MAX_TOKENS"}],
         "usageMetadata": {"promptTokenCount": 10, "cachedContentTokenCount": 6,
                           "candidatesTokenCount": 2, "totalTokenCount": 12}},
    ]
    raw = b"".join(b"data: " + json.dumps(r).encode() + b"\r\n\r\n" for r in records)
    translator = gemini.NativeStream("m")
    # split mid-record: the parser must hold the partial record
    out = [*translator.feed(raw[:25]), *translator.feed(raw[25:]), *translator.finish()]
    docs = [json.loads(o[len(b"data: "):]) for o in out[:-1]]
    assert out[-1] == b"data: [DONE]\n\n"
    assert [d["choices"][0]["delta"] for d in docs[:2]] == [
        {"role": "assistant", "content": "Hel"}, {"content": "lo"}]
    assert docs[1]["choices"][0]["finish_reason"] == "length"
    assert docs[2]["choices"] == [] and docs[2]["usage"]["prompt_tokens_details"] == {
        "cached_tokens": 6}
    assert {d["id"] for d in docs} == {"chatcmpl-x"}


def test_google_errors_become_openai_errors() -> None:
    google = json.dumps({"error": {"code": 400, "message": "bad", "status": "INVALID_ARGUMENT"}})
    doc = json.loads(gemini.openai_error(400, google.encode()))
    assert doc == {"error": {"message": "bad", "type": "invalid_request_error",
                             "code": "INVALID_ARGUMENT", "param": None}}
    listed = gemini.openai_error(503, ("[" + google + "]").encode())
    assert json.loads(listed)["error"]["type"] == "server_error"
    assert gemini.openai_error(500, b"not json") == b"not json"


@pytest.mark.parametrize(("status", "message", "missing"), [
    (403, "CachedContent not found (or permission denied)", True),
    (404, "anything", True),
    (400, "Cached content cachedContents/x has expired", True),
    (400, "CachedContent can not be used with GenerateContent request setting "
          "system_instruction, tools or tool_config.", False),
    (403, "API key not valid", False),
    (429, "cachedContent not found", False)])
def test_missing_cache_verdict(status: int, message: str, missing: bool) -> None:
    body = json.dumps({"error": {"code": status, "message": message}}).encode()
    assert is_missing_cache(status, body) is missing


def test_system_prompt_rules() -> None:
    assert gemini.system_prompt({"messages": [
        {"role": "system", "content": "A"}, {"role": "developer", "content": "B"},
        {"role": "user", "content": "Q"}]}) == "A\nB"
    # a later system message, or a non-text system part, cannot be moved into a cache
    assert gemini.system_prompt({"messages": [
        {"role": "system", "content": "A"}, {"role": "user", "content": "Q"},
        {"role": "system", "content": "C"}]}) is None
    assert gemini.system_prompt({"messages": [{"role": "system", "content": [
        {"type": "image_url", "image_url": {"url": "x"}}]}]}) is None
    assert gemini.system_prompt({"messages": [{"role": "user", "content": "Q"}]}) is None


@pytest.mark.parametrize(("key", "value", "message"), [
    ("min_prefix_bytes", 1023, "between 1024"), ("ttl", "59s", "between 60"),
    ("max_entries", 9, "between 10 and 1000000"), ("max_entries", 1_000_001, "between 10"),
    ("create_timeout_ms", 499, "between 500 and 60000"),
    ("create_timeout_ms", 60001, "between 500"), ("negative_ttl_seconds", 0, "between 1")])
def test_config_ranges_name_the_key(key: str, value: Any, message: str) -> None:
    with pytest.raises(ConfigError) as err:
        parse_config({"gemini_context_cache": {key: value}})
    assert f"gemini_context_cache.{key}" in str(err.value) and message in str(err.value)


def test_config_defaults_are_the_seeds() -> None:
    settings = parse_config({}).gemini_context_cache
    assert (settings.enabled, settings.min_prefix_bytes, settings.ttl, settings.extend_on_hit,
            settings.max_entries, settings.create_timeout_ms, settings.negative_ttl_seconds,
            settings.prefer_native_api) == (False, 16384, 600.0, False, 1000, 5000, 600, False)
    assert parse_config({"gemini_context_cache": {"ttl": "10m"}}).gemini_context_cache.ttl == 600


@pytest.mark.parametrize(("model", "effort", "thinking"), [
    ("gemini-2.5-flash", "none", {"thinkingBudget": 0}),
    ("gemini-2.5-flash", "low", {"thinkingBudget": 1024}),
    ("models/gemini-2.5-pro", "medium", {"thinkingBudget": 8192}),
    ("gemini-2.5-pro", "high", {"thinkingBudget": 24576}),
    ("gemini-3-pro-preview", "low", {"thinkingLevel": "low"}),
    ("gemini-3-flash-preview", "none", {"thinkingLevel": "minimal"}),
    ("gemini-3-flash-preview", "medium", {"thinkingLevel": "medium"}),
    ("gemini-3-pro-preview", "max", {"thinkingLevel": "high"}),
    ("gemini-2.5-flash", "xhigh", {"thinkingBudget": 24576}),
])
def test_reasoning_effort_becomes_a_budget_on_2x_models_and_a_level_after(
        model: str, effort: str, thinking: dict[str, Any]) -> None:
    body = {"model": model, "messages": [{"role": "user", "content": "Hi"}],
            "reasoning_effort": effort, "max_tokens": 9}
    assert gemini.to_native(body)["generationConfig"] == {"maxOutputTokens": 9,
                                                          "thinkingConfig": thinking}


def test_googles_thinking_config_goes_as_given_in_camel_case() -> None:
    body = {"model": "gemini-2.5-flash", "messages": [{"role": "user", "content": "Hi"}],
            "extra_body": {"google": {"thinking_config": {"thinking_budget": 300,
                                                          "include_thoughts": True}}}}
    assert gemini.to_native(body)["generationConfig"] == {
        "thinkingConfig": {"thinkingBudget": 300, "includeThoughts": True}}
    assert "generationConfig" not in gemini.to_native({"messages": body["messages"]})
    # thought summaries go with an effort; a budget does not
    body = {"model": "gemini-3-pro-preview", "messages": body["messages"],
            "reasoning_effort": "high",
            "extra_body": {"google": {"thinking_config": {"include_thoughts": True}}}}
    assert gemini.to_native(body)["generationConfig"] == {
        "thinkingConfig": {"thinkingLevel": "high", "includeThoughts": True}}


@pytest.mark.parametrize(("extra", "param"), [
    ({"reasoning_effort": "extreme"}, "reasoning_effort"),
    ({"reasoning_effort": 3}, "reasoning_effort"),
    ({"reasoning_effort": "low",
      "extra_body": {"google": {"thinking_config": {"thinking_budget": 1}}}},
     "reasoning_effort"),
    ({"extra_body": {"google": {"thinking_config": "high"}}},
     "extra_body.google.thinking_config"),
    ({"tools": -2}, "tools"),
    ({"tools": {"type": "function"}}, "tools"),
    ({"response_format": {"type": "json_schema", "json_schema": 5}},
     "response_format.json_schema"),
    ({"messages": [{"role": "user", "content": "hi"},
                   {"role": "assistant", "tool_calls": "abc"}]}, "messages[1].tool_calls"),
    ({"messages": [{"role": "user", "content": "hi"},
                   {"role": "assistant", "tool_calls": ["x"]}]}, "messages[1].tool_calls[0]"),
    ({"messages": [{"role": "user", "content": "hi"},
                   {"role": "assistant", "tool_calls": [{"id": "c", "function": "f"}]}]},
     "messages[1].tool_calls[0]"),
])
def test_what_the_native_api_cannot_take_is_a_400_naming_the_field(
        extra: dict[str, Any], param: str) -> None:
    body = {"model": "gemini-3-pro-preview", "messages": [{"role": "user", "content": "Hi"}],
            **extra}
    with pytest.raises(RequestError) as caught:
        gemini.to_native(body)
    assert caught.value.param == param and caught.value.status == 400


def test_thought_summaries_are_reasoning_content_never_content() -> None:
    parts = [{"text": "Let me think.", "thought": True}, {"text": "Four."}]
    doc = {"candidates": [{"content": {"role": "model", "parts": parts},
                           "finishReason": "STOP"}],
           "usageMetadata": {"promptTokenCount": 5, "candidatesTokenCount": 2,
                             "thoughtsTokenCount": 30, "totalTokenCount": 37}}
    message = gemini.from_native(doc, "m")["choices"][0]["message"]
    assert message == {"role": "assistant", "content": "Four.",
                       "reasoning_content": "Let me think."}
    assert gemini.from_native(doc, "m")["usage"]["completion_tokens"] == 32
    stream = gemini.NativeStream("m")
    first = {"candidates": [{"content": {"role": "model", "parts": parts[:1]}, "index": 0}]}
    second = {"candidates": [{"content": {"role": "model", "parts": parts[1:]}, "index": 0,
                              "finishReason": "STOP"}]}
    deltas = [c["choices"][0]["delta"] for r in (first, second)
              for c in stream.chunks(b"data: " + json.dumps(r).encode() + b"\r\n\r\n")]
    assert deltas == [{"role": "assistant", "reasoning_content": "Let me think."},
                      {"content": "Four."}]


@pytest.mark.parametrize(("url", "mime"), [
    ("https://example.com/cat.png?size=large#top", "image/png"),
    ("https://example.com/photos/cat.JPG", "image/jpeg"),
    ("https://example.com/render?id=7", "image/jpeg"),
    ("https://example.com/readme.txt", "image/jpeg"),
])
def test_an_image_by_url_goes_as_file_data_with_the_mime_type_google_requires(
        url: str, mime: str) -> None:
    body = {"messages": [{"role": "user", "content": [
        {"type": "text", "text": "What is this?"},
        {"type": "image_url", "image_url": {"url": url}}]}]}
    assert gemini.to_native(body)["contents"][0]["parts"][1] == {
        "fileData": {"mimeType": mime, "fileUri": url}}


def test_log_probabilities_become_openai_logprobs_whole_and_streamed() -> None:
    scored = {"chosenCandidates": [{"token": "Hi", "tokenId": 5, "logProbability": -0.25},
                                   {"token": "é", "tokenId": 6, "logProbability": -1.5}],
              "topCandidates": [{"candidates": [
                  {"token": "Hi", "tokenId": 5, "logProbability": -0.25},
                  {"token": "Hey", "tokenId": 7, "logProbability": -2.0}]}]}
    doc = {"candidates": [{"content": {"role": "model", "parts": [{"text": "Hié"}]},
                           "finishReason": "STOP", "logprobsResult": scored}]}
    choice = gemini.from_native(doc, "m")["choices"][0]
    assert choice["logprobs"] == {"refusal": None, "content": [
        {"token": "Hi", "logprob": -0.25, "bytes": [72, 105], "top_logprobs": [
            {"token": "Hi", "logprob": -0.25, "bytes": [72, 105]},
            {"token": "Hey", "logprob": -2.0, "bytes": [72, 101, 121]}]},
        {"token": "é", "logprob": -1.5, "bytes": [195, 169], "top_logprobs": []}]}
    del doc["candidates"][0]["logprobsResult"]
    assert gemini.from_native(doc, "m")["choices"][0]["logprobs"] is None
    stream = gemini.NativeStream("m")
    record = {"candidates": [{"content": {"role": "model", "parts": [{"text": "Hi"}]},
                              "logprobsResult": {"chosenCandidates": scored[
                                  "chosenCandidates"][:1]}}]}
    [chunk] = stream.chunks(b"data: " + json.dumps(record).encode() + b"\r\n\r\n")
    assert chunk["choices"][0]["logprobs"]["content"] == [
        {"token": "Hi", "logprob": -0.25, "bytes": [72, 105], "top_logprobs": []}]


def test_a_blocked_prompt_is_one_empty_choice_finished_by_the_content_filter() -> None:
    blocked = {"promptFeedback": {"blockReason": "PROHIBITED_CONTENT"},
               "usageMetadata": {"promptTokenCount": 9, "totalTokenCount": 9}}
    answer = gemini.from_native(blocked, "m")
    assert answer["choices"] == [{"index": 0, "logprobs": None,
                                  "message": {"role": "assistant", "content": None},
                                  "finish_reason": "content_filter"}]
    assert answer["usage"]["prompt_tokens"] == 9
    [chunk] = gemini.NativeStream("m").chunks(
        b"data: " + json.dumps(blocked).encode() + b"\r\n\r\n")
    assert chunk["choices"] == [{"index": 0, "delta": {"role": "assistant"},
                                 "finish_reason": "content_filter"}]
    # no candidates and no verdict: nothing to answer with
    assert gemini.from_native({"usageMetadata": {}}, "m")["choices"] == []


def _google_record(text: str) -> bytes:
    return b"data: " + json.dumps({"candidates": [{"content": {
        "role": "model", "parts": [{"text": text}]}, "index": 0}]}).encode() + b"\r\n\r\n"


@pytest.mark.parametrize("cut", [0, 20])
def test_a_broken_native_stream_ends_with_the_routers_error(cut: int) -> None:
    """The relay ends a broken stream with its own error record; after a record Google's
    connection cut in the middle, Google's parser would read the two as one broken record:
    the client still gets the relay's error (once), and no [DONE]."""
    relay = openai_error_event("the upstream stream broke off (request id r-2)")
    pieces = [_google_record("Hel"), *([_google_record("lo")[:cut]] if cut else []), relay]
    out = list(gemini.NativeStream("m").translate(iter(pieces), lambda: False))
    docs = [json.loads(o.removeprefix(b"data: ")) for o in out]
    assert docs[0]["choices"][0]["delta"]["content"] == "Hel"
    assert [d["error"]["message"] for d in docs if "error" in d] == [
        "the upstream stream broke off (request id r-2)"]
    assert "error" in docs[-1] and b"data: [DONE]\n\n" not in out


def test_a_stream_that_ends_early_without_the_relays_record_still_ends_with_an_error() -> None:
    out = list(gemini.NativeStream("m").translate(iter([_google_record("Hel")]), lambda: False))
    assert json.loads(out[-1].removeprefix(b"data: "))["error"]["message"] == gemini.BROKEN_OFF


@pytest.mark.parametrize(("text", "response"), [
    ('{"rows": 2}', {"rows": 2}),
    ("NaN", {"content": "NaN"}),  # json.loads reads it as a float: not JSON Google takes
    ("-Infinity", {"content": "-Infinity"}),
    ('{"a": NaN}', {"content": '{"a": NaN}'}),
    ("1.50", {"content": "1.50"}),  # the tool's text, not a number to reformat
    ("true", {"content": "true"}),
    ("[1, 2]", {"content": "[1, 2]"}),
    ("12345678901234567890", {"content": "12345678901234567890"}),
    ("done", {"content": "done"}),
    ("", {"content": ""}),
])
def test_a_tool_result_is_its_object_or_its_text_unchanged(text: str,
                                                           response: dict[str, Any]) -> None:
    body = {"model": "m", "messages": [
        {"role": "user", "content": "go"},
        {"role": "assistant", "tool_calls": [{"id": "c1", "type": "function",
                                              "function": {"name": "f", "arguments": "{}"}}]},
        {"role": "tool", "tool_call_id": "c1", "content": text}]}
    native = gemini.to_native(body)
    assert native["contents"][-1] == {"role": "user", "parts": [
        {"functionResponse": {"name": "f", "response": response}}]}
    json.loads(json.dumps(native), parse_constant=lambda name: pytest.fail(name))
