"""The client's ``extra_body.google`` on the native API: ``cached_content`` →
``cachedContent`` and ``safety_settings`` → ``safetySettings``, checked for their types
(a 400 naming the field), and the client's cache reference winning over the router's."""

from __future__ import annotations

from typing import Any

import pytest

from continuum.errors import RequestError
from continuum.routing import gemini

MODEL = "gemini-2.5-flash"
SAFETY = [{"category": "HARM_CATEGORY_DANGEROUS_CONTENT", "threshold": "BLOCK_NONE"},
          {"category": "HARM_CATEGORY_HARASSMENT", "threshold": "BLOCK_ONLY_HIGH",
           "method": "SEVERITY"}]


def _body(google: Any, *, system: str | None = "Be brief.", **extra: Any) -> dict[str, Any]:
    messages = [{"role": "system", "content": system}] if system is not None else []
    messages.append({"role": "user", "content": "Hi"})
    return {"model": MODEL, "messages": messages, "extra_body": {"google": google}, **extra}


def test_the_clients_cached_content_and_safety_settings_reach_the_native_request() -> None:
    native = gemini.to_native(_body({"cached_content": "cachedContents/abc",
                                     "safety_settings": SAFETY}, system=None))
    assert native == {"contents": [{"role": "user", "parts": [{"text": "Hi"}]}],
                      "cachedContent": "cachedContents/abc", "safetySettings": SAFETY}
    # snake-case keys of a setting go in the native API's camel case
    snake = gemini.to_native(_body({"safety_settings": [
        {"category": "HARM_CATEGORY_HATE_SPEECH", "threshold": "OFF",
         "method": "PROBABILITY"}]}))
    assert snake["safetySettings"] == [{"category": "HARM_CATEGORY_HATE_SPEECH",
                                        "threshold": "OFF", "method": "PROBABILITY"}]
    # beside the other google fields, which keep their own mapping
    both = gemini.to_native(_body({"safety_settings": SAFETY,
                                   "thinking_config": {"include_thoughts": True}}))
    assert both["safetySettings"] == SAFETY
    assert both["generationConfig"] == {"thinkingConfig": {"includeThoughts": True}}
    assert both["systemInstruction"] == {"parts": [{"text": "Be brief."}]}
    assert "cachedContent" not in both
    # nothing of it without extra_body.google
    plain = gemini.to_native({"model": MODEL, "messages": [{"role": "user", "content": "Hi"}]})
    assert "safetySettings" not in plain and "cachedContent" not in plain


def test_the_clients_reference_wins_and_its_request_is_translated_as_it_is() -> None:
    body = _body({"cached_content": "cachedContents/client"},
                 tools=[{"type": "function", "function": {"name": "lookup"}}])
    assert gemini.client_cached_content(body) == "cachedContents/client"
    native = gemini.to_native(body, "cachedContents/router")
    assert native["cachedContent"] == "cachedContents/client"
    # nothing of the client's is dropped: Google says whether its cache goes with them
    assert native["systemInstruction"] == {"parts": [{"text": "Be brief."}]}
    assert native["tools"] == [{"functionDeclarations": [{"name": "lookup"}]}]
    # the router's own reference still strips them when the client gave none
    mine = gemini.to_native(gemini.without_system(_body({})), "cachedContents/router")
    assert mine["cachedContent"] == "cachedContents/router"
    assert "systemInstruction" not in mine
    assert gemini.client_cached_content(_body({})) is None
    for extra, param in (("x", "extra_body"), ({"google": "x"}, "extra_body.google")):
        with pytest.raises(RequestError) as caught:  # checked before the manager is asked
            gemini.client_cached_content({"model": MODEL, "extra_body": extra})
        assert caught.value.param == param


@pytest.mark.parametrize(("google", "param"), [
    ({"cached_content": 5}, "extra_body.google.cached_content"),
    ({"cached_content": ""}, "extra_body.google.cached_content"),
    ({"cached_content": {"name": "cachedContents/abc"}}, "extra_body.google.cached_content"),
    ({"safety_settings": "BLOCK_NONE"}, "extra_body.google.safety_settings"),
    ({"safety_settings": {"category": "HARM_CATEGORY_HARASSMENT"}},
     "extra_body.google.safety_settings"),
    ({"safety_settings": [SAFETY[0], "BLOCK_NONE"]}, "extra_body.google.safety_settings[1]"),
    ({"safety_settings": [{"category": 7, "threshold": "OFF"}]},
     "extra_body.google.safety_settings[0].category"),
    ({"safety_settings": [{"category": "HARM_CATEGORY_HARASSMENT", "threshold": None}]},
     "extra_body.google.safety_settings[0].threshold"),
    ("not an object", "extra_body.google"),
])
def test_a_google_field_of_the_wrong_type_is_a_400_naming_it(google: Any, param: str) -> None:
    with pytest.raises(RequestError) as caught:
        gemini.to_native(_body(google))
    assert caught.value.param == param and caught.value.status == 400
    assert caught.value.code == "invalid_type"
