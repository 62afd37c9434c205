"""The Tier 1 prefix key: one 32-byte SHA-256 digest that names a request's stable prefix.

    SHA256(model ++ 0x00 ++ "S" ++ system[:max_prefix_length])   with a system prompt
    SHA256(model ++ 0x00 ++ "M" ++ first_msg[:max_prefix_length]) without one

``max_prefix_length`` counts UTF-8 bytes and the cut never splits a character. The 0x00
separator keeps ``("ab", "c…")`` and ``("a", "bc…")`` apart; the tag byte keeps the same
text as a system prompt and as a first message apart.

This is the only implementation: the KV listener imports :func:`prefix_key_from_text` to
turn a recovered prompt into the key the router computes from the request.
"""

from __future__ import annotations

import hashlib
from typing import Any

SYSTEM_TAG = b"S"
MESSAGE_TAG = b"M"
DEFAULT_MAX_PREFIX_LENGTH = 1024
_SYSTEM_ROLES = ("system", "developer")


def truncate_utf8(text: str, max_bytes: int) -> bytes:
    """``text`` encoded as UTF-8 and cut to at most ``max_bytes`` on a character boundary."""
    # A character is at least one byte, so slicing characters first bounds the encoding work
    # for very long prompts without changing the result.
    return _cut_utf8(text[:max_bytes].encode("utf-8", "surrogatepass"), max_bytes)


def _cut_utf8(data: bytes, max_bytes: int) -> bytes:
    """UTF-8 ``data`` cut to at most ``max_bytes`` on a character boundary."""
    if len(data) <= max_bytes:
        return data
    cut = max_bytes
    # Back off over continuation bytes (0b10xxxxxx) to the start of the split character.
    while cut > 0 and (data[cut] & 0xC0) == 0x80:
        cut -= 1
    return data[:cut]


def content_text(content: Any) -> str | None:
    """Text of an OpenAI or Anthropic ``content`` value: a string, or the text parts of a
    list joined with ``\\n``. None when there is no text."""
    if isinstance(content, str):
        return content or None
    if isinstance(content, list):
        parts = [
            part["text"]
            for part in content
            if isinstance(part, dict) and isinstance(part.get("text"), str)
            and part.get("type", "text") in ("text", "input_text")
        ]
        return "\n".join(parts) or None
    return None


#: The start of Claude Code's first system block: an attribution line whose hash changes
#: with each conversation (``x-anthropic-billing-header: cc_version=…; cch=…;``).
BILLING_HEADER = "x-anthropic-billing-header"


def system_text(system: Any) -> str | None:
    """Text of Anthropic's top-level ``system``: a string, or its text blocks joined without
    a separator (as vLLM's Messages API renders them, so the engine's prompt and the key
    agree), Claude Code's attribution block (:data:`BILLING_HEADER`) left out, as vLLM
    leaves it out: it would give each conversation a key, and an engine, of its own. None
    when there is no text."""
    if isinstance(system, str):
        return system or None
    if isinstance(system, list):
        return "".join(
            block["text"] for block in system
            if isinstance(block, dict) and isinstance(block.get("text"), str)
            and block.get("type", "text") == "text"
            and not block["text"].startswith(BILLING_HEADER)) or None
    return None


#: Models whose ``SHA256(model ++ 0x00)`` state is kept; names come from clients: bounded.
_MAX_MODELS = 256
_model_states: dict[str, Any] = {}

#: Keys computed lately, by (model, tag, max_prefix_length, the text's first
#: max_prefix_length characters: the key depends on nothing else, a character being at
#: least one byte). Prefixes repeat by design, and a hit costs hashing and comparing that
#: text, a third to a tenth of what a new SHA-256 context costs for short and 1 KiB texts.
_recent: dict[tuple[str, bytes, int, str], bytes] = {}
#: Characters held in :data:`_recent` keys; past :data:`_MAX_RECENT_CHARS` it starts over.
_recent_chars = [0]
_MAX_RECENT_CHARS = 1 << 22


def prefix_key_from_text(
    model: str, tag: bytes, text: str, max_prefix_length: int = DEFAULT_MAX_PREFIX_LENGTH
) -> bytes:
    """The prefix key of ``text`` in role ``tag`` (:data:`SYSTEM_TAG` or :data:`MESSAGE_TAG`).

    Keys are remembered (:data:`_recent`). A new one starts from the hash state after
    ``model ++ 0x00``, kept per model and copied (a copy costs less than a new OpenSSL
    context); the digest is the same."""
    head = text if len(text) <= max_prefix_length else text[:max_prefix_length]
    memo = (model, tag, max_prefix_length, head)
    key = _recent.get(memo)
    if key is not None:
        return key
    state = _model_states.get(model)
    if state is None:
        if len(_model_states) >= _MAX_MODELS:
            _model_states.clear()
        state = _model_states[model] = hashlib.sha256(
            model.encode("utf-8", "surrogatepass") + b"\x00")
    digest = state.copy()
    digest.update(tag + _cut_utf8(head.encode("utf-8", "surrogatepass"), max_prefix_length))
    key = digest.digest()
    size = len(head) + len(model)
    if _recent_chars[0] + size > _MAX_RECENT_CHARS:
        _recent.clear()
        _recent_chars[0] = 0
    _recent[memo] = key
    _recent_chars[0] += size
    return key


def anchor_text(body: dict[str, Any]) -> tuple[bytes, str] | None:
    """The (tag, text) a request's key is computed from, or None when it has no text.

    OpenAI shape: the first of the leading ``system``/``developer`` messages with text, else
    the first other message. Anthropic shape: the top-level ``system``
    (:func:`system_text`), else as for OpenAI's. A system message *after* the first other
    message is no system prompt: it stands where it is in the prompt (Claude Code adds them
    along a conversation, and engines leave them there), so the key stays the first turn's,
    as the KV listener reads it from the engine's prompt.
    """
    system = body.get("system")
    if system is not None:  # system_text(None) is None
        text = system_text(system)
        if text is not None:
            return SYSTEM_TAG, text
    messages = body.get("messages")
    if not isinstance(messages, list):
        return None
    first_other = None
    for message in messages:
        if not isinstance(message, dict):
            continue
        if message.get("role") not in _SYSTEM_ROLES:
            first_other = message
            break
        content = message.get("content")
        # content_text, with its common case (a non-empty string) inline
        text = content if type(content) is str and content else content_text(content)
        if text is not None:
            return SYSTEM_TAG, text
    if first_other is None:
        return None
    content = first_other.get("content")
    text = content if type(content) is str and content else content_text(content)
    return None if text is None else (MESSAGE_TAG, text)


def request_prefix_key(
    body: dict[str, Any],
    model: str,
    *,
    enabled: bool = True,
    max_prefix_length: int = DEFAULT_MAX_PREFIX_LENGTH,
) -> bytes | None:
    """The prefix key of a parsed request body; None when disabled or there is no text."""
    if not enabled:
        return None
    anchor = anchor_text(body)
    if anchor is None:
        return None
    tag, text = anchor
    return prefix_key_from_text(model, tag, text, max_prefix_length)
