"""cache_control injection and Anthropic error shapes (continuum.routing.anthropic), no I/O."""

from __future__ import annotations

import copy
import json
from typing import Any

import pytest

from continuum.routing.anthropic import (
    error_document,
    has_cache_control,
    inject_cache_control,
    injected_body,
    should_inject,
)

EPHEMERAL = {"type": "ephemeral"}
USER = [{"role": "user", "content": "hi"}]


def _body(**fields: Any) -> dict[str, Any]:
    return {"model": "claude-sonnet-4-6", "max_tokens": 64, "messages": USER, **fields}


def test_string_system_becomes_one_marked_text_block() -> None:
    out = inject_cache_control(_body(system="You are terse."))
    assert out is not None
    assert out["system"] == [
        {"type": "text", "text": "You are terse.", "cache_control": EPHEMERAL}
    ]
    assert out["messages"] == USER


def test_list_system_marks_the_last_block_only() -> None:
    first = {"type": "text", "text": "You are terse."}
    last = {"type": "text", "text": "Answer in French."}
    body = _body(system=[first, last])
    original = copy.deepcopy(body)
    out = inject_cache_control(body)
    assert out is not None
    assert out["system"] == [first, {**last, "cache_control": EPHEMERAL}]
    assert "cache_control" not in out["system"][0]
    assert body == original  # the caller's body is not modified


def test_marker_is_a_fresh_copy_each_time() -> None:
    one = inject_cache_control(_body(system="a"))
    two = inject_cache_control(_body(system="a"))
    assert one is not None and two is not None
    one["system"][-1]["cache_control"]["ttl"] = "1h"
    assert two["system"][-1]["cache_control"] == EPHEMERAL


@pytest.mark.parametrize(
    "body",
    [
        _body(system=[{"type": "text", "text": "s", "cache_control": EPHEMERAL}]),
        _body(system=[{"type": "text", "text": "a", "cache_control": EPHEMERAL},
                      {"type": "text", "text": "b"}]),
        _body(system="s", messages=[{"role": "user", "content": [
            {"type": "text", "text": "doc", "cache_control": EPHEMERAL},
            {"type": "text", "text": "question"}]}]),
        _body(system="s", tools=[{"name": "get_weather", "input_schema": {"type": "object"},
                                  "cache_control": EPHEMERAL}]),
        # nested blocks count among Anthropic's four breakpoints too: a fifth would be a 400
        _body(system="s", messages=[{"role": "user", "content": [
            {"type": "tool_result", "tool_use_id": "t1", "content": [
                {"type": "text", "text": "result", "cache_control": EPHEMERAL}]}]}]),
        _body(system="s", messages=[{"role": "user", "content": [
            {"type": "document", "source": {"type": "content", "content": [
                {"type": "text", "text": "page", "cache_control": EPHEMERAL}]}}]}]),
    ],
    ids=["system", "earlier-system-block", "message-block", "tool", "tool-result-block",
         "document-content-block"],
)
def test_existing_cache_control_anywhere_means_no_injection(body: dict[str, Any]) -> None:
    assert has_cache_control(body)
    assert inject_cache_control(body) is None
    assert injected_body(body) is None


@pytest.mark.parametrize("system", [None, "", []], ids=["absent", "empty-string", "empty-list"])
def test_no_system_prompt_means_no_injection(system: Any) -> None:
    body = _body() if system is None else _body(system=system)
    assert not has_cache_control(body)
    assert inject_cache_control(body) is None


def test_messages_with_string_content_or_odd_shapes_have_no_cache_control() -> None:
    body = _body(system="s", messages=[{"role": "user", "content": "plain"}, "junk"],
                 tools="not a list")
    assert not has_cache_control(body)
    assert inject_cache_control(body) is not None


def test_injected_body_serialises_the_injected_request() -> None:
    raw = injected_body(_body(system="s"))
    assert raw is not None
    assert json.loads(raw)["system"] == [{"type": "text", "text": "s", "cache_control": EPHEMERAL}]


@pytest.mark.parametrize(
    ("global_injection", "backend_auto", "expected"),
    [(False, True, True), (False, False, False), (True, False, True), (True, True, True)],
)
def test_precedence(global_injection: bool, backend_auto: bool, expected: bool) -> None:
    assert should_inject(global_injection, backend_auto) is expected


@pytest.mark.parametrize(
    ("status", "error_type"),
    [
        (400, "invalid_request_error"),
        (401, "authentication_error"),
        (403, "permission_error"),
        (404, "not_found_error"),
        (413, "request_too_large"),
        (429, "rate_limit_error"),
        (405, "invalid_request_error"),  # other 4xx: the client's request, not Anthropic's 5xx
        (408, "invalid_request_error"),
        (414, "invalid_request_error"),
        (431, "invalid_request_error"),
        (500, "api_error"),
        (502, "api_error"),
        (503, "overloaded_error"),
        (504, "timeout_error"),
    ],
)
def test_error_document_shape(status: int, error_type: str) -> None:
    doc = json.loads(error_document(status, "something went wrong"))
    assert doc == {"type": "error",
                   "error": {"type": error_type, "message": "something went wrong"}}
