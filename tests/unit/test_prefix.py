"""Prefix keys: the exact byte layout, UTF-8-safe truncation, OpenAI and Anthropic shapes."""

from __future__ import annotations

import hashlib
from typing import Any

from hypothesis import given
from hypothesis import strategies as st

from continuum.prefix import (
    MESSAGE_TAG,
    SYSTEM_TAG,
    content_text,
    prefix_key_from_text,
    request_prefix_key,
    system_text,
    truncate_utf8,
)


def _expected(model: str, tag: bytes, data: bytes) -> bytes:
    return hashlib.sha256(model.encode() + b"\x00" + tag + data).digest()


def test_ascii_system_prompt_vector() -> None:
    body = {"messages": [{"role": "system", "content": "You are helpful."},
                         {"role": "user", "content": "hi"}]}
    key = request_prefix_key(body, "llama-3")
    assert key == _expected("llama-3", b"S", b"You are helpful.")
    assert key is not None and key.hex() == hashlib.sha256(
        b"llama-3\x00SYou are helpful.").hexdigest()


def test_truncation_never_splits_a_character() -> None:
    text = "가나다"  # three 3-byte characters
    assert truncate_utf8(text, 4) == "가".encode()
    assert truncate_utf8(text, 6) == "가나".encode()
    assert truncate_utf8(text, 2) == b""
    assert truncate_utf8("a\u00e9b", 2) == b"a"  # é is 2 bytes, cut at byte 2 drops it
    body = {"messages": [{"role": "system", "content": text}]}
    assert request_prefix_key(body, "m", max_prefix_length=4) == _expected("m", b"S", "가".encode())


@given(st.text(), st.integers(min_value=0, max_value=64))
def test_truncation_is_a_valid_utf8_prefix(text: str, limit: int) -> None:
    cut = truncate_utf8(text, limit)
    full = text.encode("utf-8", "surrogatepass")
    assert full.startswith(cut) and len(cut) <= limit
    cut.decode("utf-8", "surrogatepass")  # would raise on a split character
    assert len(cut) > limit - 4 or len(cut) == len(full)


def test_truncation_only_matters_up_to_the_limit() -> None:
    a = {"messages": [{"role": "system", "content": "x" * 1024 + "tail one"}]}
    b = {"messages": [{"role": "system", "content": "x" * 1024 + "tail two"}]}
    assert request_prefix_key(a, "m") == request_prefix_key(b, "m")
    assert request_prefix_key(a, "m", max_prefix_length=1030) != request_prefix_key(
        b, "m", max_prefix_length=1030)


def test_system_and_first_message_differ_for_same_text() -> None:
    system = {"messages": [{"role": "system", "content": "same"}]}
    first = {"messages": [{"role": "user", "content": "same"}]}
    assert request_prefix_key(first, "m") == _expected("m", b"M", b"same")
    assert request_prefix_key(system, "m") != request_prefix_key(first, "m")


def test_model_separator_prevents_ambiguity() -> None:
    assert prefix_key_from_text("ab", b"S", "c") != prefix_key_from_text("a", b"S", "bc")


def test_list_of_parts_and_developer_role() -> None:
    parts = {"messages": [{"role": "developer", "content": [
        {"type": "text", "text": "one"}, {"type": "image_url", "image_url": {"url": "x"}},
        {"type": "text", "text": "two"}]}]}
    assert request_prefix_key(parts, "m") == _expected("m", b"S", b"one\ntwo")
    assert content_text([{"type": "image_url"}]) is None


def test_anthropic_system_string_and_blocks() -> None:
    as_string = {"system": "Be brief.", "messages": [{"role": "user", "content": "q"}]}
    as_blocks = {"system": [{"type": "text", "text": "Be brief."}],
                 "messages": [{"role": "user", "content": [{"type": "text", "text": "q"}]}]}
    assert request_prefix_key(as_string, "claude") == _expected("claude", b"S", b"Be brief.")
    assert request_prefix_key(as_blocks, "claude") == request_prefix_key(as_string, "claude")
    no_system = {"messages": [{"role": "user", "content": [{"type": "text", "text": "q"}]}]}
    assert request_prefix_key(no_system, "claude") == _expected("claude", b"M", b"q")


def test_claude_codes_attribution_block_is_not_part_of_the_key() -> None:
    """Claude Code's first system block carries a hash that changes with each conversation:
    left out of the key (as vLLM leaves it out of the prompt), the blocks joined without a
    separator, as vLLM joins them."""
    def body(header: str) -> dict[str, Any]:
        return {"system": [{"type": "text", "text": header},
                           {"type": "text", "text": "You are Claude Code. "},
                           {"type": "text", "text": "Use the tools.", "cache_control": {}}],
                "messages": [{"role": "user", "content": "q"}]}

    first = body("x-anthropic-billing-header: cc_version=2.1.88.a3f; cch=00000;")
    other = body("x-anthropic-billing-header: cc_version=2.1.88.e91; cch=4873d;")
    expected = _expected("claude", b"S", b"You are Claude Code. Use the tools.")
    assert request_prefix_key(first, "claude") == request_prefix_key(other, "claude") == expected
    assert system_text(first["system"]) == "You are Claude Code. Use the tools."
    # a string system prompt is the client's own text, kept whole (vLLM keeps it too)
    assert system_text("x-anthropic-billing-header: a; You are here.") == \
        "x-anthropic-billing-header: a; You are here."
    assert system_text([{"type": "text", "text": "x-anthropic-billing-header: a;"}]) is None
    assert system_text([{"type": "image", "source": {}}, "text"]) is None


def test_a_system_message_after_the_first_turn_is_no_system_prompt() -> None:
    """Claude Code adds ``system`` messages along a conversation (with no top-level system
    prompt, or one of its attribution block alone): the key stays the first turn's, as the
    engine renders them where they stand and the KV listener reads the first turn."""
    turn_1 = {"system": [{"type": "text", "text": "x-anthropic-billing-header: cch=1;"}],
              "messages": [{"role": "user", "content": "Fix the bug"}]}
    turn_2 = {**turn_1, "messages": [*turn_1["messages"],
                                     {"role": "assistant", "content": "Which one?"},
                                     {"role": "system", "content": "<system-reminder>"},
                                     {"role": "user", "content": "The parser"}]}
    assert request_prefix_key(turn_2, "m") == request_prefix_key(turn_1, "m") == \
        _expected("m", b"M", b"Fix the bug")
    openai = {"messages": [{"role": "user", "content": "q"},
                           {"role": "system", "content": "late"}]}
    assert request_prefix_key(openai, "m") == _expected("m", b"M", b"q")
    leading = {"messages": [{"role": "system", "content": ""},
                            {"role": "developer", "content": "rules"},
                            {"role": "user", "content": "q"}]}
    assert request_prefix_key(leading, "m") == _expected("m", b"S", b"rules")


def test_no_text_or_disabled_gives_no_key() -> None:
    assert request_prefix_key({}, "m") is None
    assert request_prefix_key({"messages": []}, "m") is None
    assert request_prefix_key({"system": "", "messages": [{"role": "user", "content": ""}]},
                              "m") is None
    body = {"messages": [{"role": "user", "content": "x"}]}
    assert request_prefix_key(body, "m", enabled=False) is None


def test_empty_system_falls_back_to_first_message() -> None:
    body = {"messages": [{"role": "system", "content": ""}, {"role": "user", "content": "u"}]}
    assert request_prefix_key(body, "m") == _expected("m", b"M", b"u")


def test_prefix_key_is_the_documented_sha256_for_any_model_and_length() -> None:
    """SHA256(model ++ 0x00 ++ tag ++ text cut to max_prefix_length UTF-8 bytes), also past
    the kept per-model hash states and for texts longer than the cut, multibyte at it."""
    from continuum import prefix

    texts = ["", "short", "가나다" * 400, "x" * 1023 + "가", "\ud800 lone", "é" * 600]
    for i in range(prefix._MAX_MODELS + 5):
        model = f"model-{i % (prefix._MAX_MODELS + 3)}-ü"
        for text in texts if i < 3 or i > prefix._MAX_MODELS else texts[:2]:
            for tag in (SYSTEM_TAG, MESSAGE_TAG):
                for limit in (1024, 7):
                    cut = truncate_utf8(text, limit)
                    expected = hashlib.sha256(
                        model.encode("utf-8", "surrogatepass") + b"\x00" + tag + cut).digest()
                    assert prefix_key_from_text(model, tag, text, limit) == expected


@given(st.text(), st.text(), st.integers(min_value=0, max_value=48),
       st.sampled_from([SYSTEM_TAG, MESSAGE_TAG]))
def test_remembered_keys_are_the_documented_sha256(head: str, tail: str, limit: int,
                                                   tag: bytes) -> None:
    """A key asked for again (remembered) is the documented digest, and so are the keys of
    a text that differs from it only past the cut and of one that differs before it."""
    text = head + tail
    expected = _expected("m", tag, truncate_utf8(text, limit))
    assert prefix_key_from_text("m", tag, text, limit) == expected
    assert prefix_key_from_text("m", tag, text, limit) == expected
    long = text + "x" * limit  # at least ``limit`` bytes: the cut falls inside it
    cut = _expected("m", tag, truncate_utf8(long, limit))
    assert prefix_key_from_text("m", tag, long, limit) == cut
    assert prefix_key_from_text("m", tag, long[:limit] + "~tail", limit) == cut
    other = "~" + text
    assert prefix_key_from_text("m", tag, other, limit) == _expected(
        "m", tag, truncate_utf8(other, limit))


def test_remembered_keys_are_bounded_by_characters(monkeypatch) -> None:
    from continuum import prefix

    monkeypatch.setattr(prefix, "_recent", {})
    monkeypatch.setattr(prefix, "_recent_chars", [0])
    monkeypatch.setattr(prefix, "_MAX_RECENT_CHARS", 5000)
    for i in range(40):
        text = f"{i:04d}" + "y" * 2000  # 1024 characters kept per key, plus the model's 1
        assert prefix_key_from_text("m", SYSTEM_TAG, text) == _expected(
            "m", SYSTEM_TAG, text[:1024].encode())
        assert prefix._recent_chars[0] == sum(len(k[0]) + len(k[3]) for k in prefix._recent)
        assert prefix._recent_chars[0] <= 5000
        assert len(prefix._recent) == i % 4 + 1
