"""What Google answers is read defensively: an answer or stream record of any shape (wrong
types at every level, huge numbers, lone surrogates) becomes OpenAI's chat shapes and the
Responses API's without an exception, so a misbehaving upstream or proxy cannot turn into
a 500 or a stream cut by the router's own error (hypothesis)."""

from __future__ import annotations

import json
from typing import Any

from hypothesis import given, settings
from hypothesis import strategies as st

from continuum.routing import gemini, gemini_responses
from continuum.wire.responses_api import ResponseShape

#: The names the translation reads, so that generated objects hit its branches.
KEYS = ("candidates", "content", "parts", "text", "thought", "functionCall", "name", "args",
        "index", "finishReason", "usageMetadata", "promptTokenCount",
        "cachedContentTokenCount", "candidatesTokenCount", "thoughtsTokenCount",
        "totalTokenCount", "logprobsResult", "chosenCandidates", "topCandidates", "token",
        "logProbability", "promptFeedback", "blockReason", "responseId", "modelVersion",
        "error", "message", "status", "thoughtSignature", "id", "role")
LEAVES = st.one_of(st.none(), st.booleans(), st.integers(min_value=-(10**30),
                                                         max_value=10**400),
                   st.floats(allow_nan=False, allow_infinity=False),
                   st.sampled_from(["STOP", "SAFETY", "MAX_TOKENS", "x", "", "\ud800"]),
                   st.text(max_size=8))
VALUES = st.recursive(LEAVES, lambda inner: st.one_of(
    st.lists(inner, max_size=3),
    st.dictionaries(st.sampled_from(KEYS), inner, max_size=5)), max_leaves=25)
#: Mostly Google's shape, hostile below.
CANDIDATE = st.fixed_dictionaries({}, optional={
    "content": st.fixed_dictionaries({}, optional={"role": VALUES, "parts": st.one_of(
        st.lists(st.one_of(VALUES, st.fixed_dictionaries(
            {}, optional={"text": VALUES, "thought": VALUES, "functionCall": VALUES,
                          "thoughtSignature": VALUES})), max_size=3), VALUES)}),
    "index": VALUES, "finishReason": VALUES, "logprobsResult": VALUES})
ANSWER = st.one_of(VALUES, st.fixed_dictionaries({}, optional={
    "candidates": st.one_of(st.lists(st.one_of(CANDIDATE, VALUES), max_size=3), VALUES),
    "usageMetadata": VALUES, "promptFeedback": VALUES, "responseId": VALUES,
    "modelVersion": VALUES, "error": VALUES}))


def _record(doc: Any) -> bytes:
    return b"data: " + json.dumps(doc).encode() + b"\r\n\r\n"


@settings(max_examples=400, deadline=None)
@given(st.lists(ANSWER, min_size=1, max_size=4))
def test_any_answer_translates_without_an_exception(docs: list[Any]) -> None:
    shape = ResponseShape("m", {"model": "m"})
    for doc in docs:
        if isinstance(doc, dict):
            answer = gemini.from_native(doc, "m")
            json.dumps(answer)
            assert all(isinstance(c["index"], int) for c in answer["choices"])
            json.dumps(gemini_responses.response_from_chat(answer, shape))
    stream = gemini.NativeStream("m")
    raw = b"".join(map(_record, docs))
    chunks = [*stream.chunks(raw[:7]), *stream.chunks(raw[7:]), *stream.final_chunks()]
    events = [gemini._event(chunk) for chunk in chunks]
    assert all(event.startswith(b"data: ") for event in events)
    translator = gemini_responses.EventTranslator(ResponseShape("m", {"model": "m"}))
    out = b"".join(translator.translate(iter([chunks]), lambda: True))
    assert out.startswith(b"event: response.created") or b"event: error" in out
