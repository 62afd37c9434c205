"""Anthropic's Messages API (``POST /v1/messages``, ``/v1/messages/count_tokens``) on the
simulated engine, as vLLM (>= 0.11.1) and SGLang serve it.

The engine translates a Messages request into its own chat request and runs that: the
top-level ``system`` (a string, or text blocks joined without a separator, as vLLM joins
them, skipping Claude Code's per-request ``x-anthropic-billing-header`` block) becomes the
system message; each message's string content, or its blocks, becomes a chat message
(``text`` blocks as text parts, ``image`` blocks as image parts, ``tool_use`` as the
assistant's call written out, ``tool_result`` in a user turn as a ``tool`` message of its
text; ``thinking`` blocks are dropped). So the prompt is rendered with the engine's chat
template, and prefix-cache hits, KV events and metrics are those of the chat path.
``max_tokens`` (required), ``stop_sequences`` and ``temperature`` map to sampling; other
fields (``top_p``, ``tools``, ``metadata`` and a stray ``cache_salt``) are ignored.

Answers are Anthropic's shapes: a ``message`` with one ``text`` block, ``stop_reason``
``end_turn`` (a stop string also ends the turn, as in vLLM) or ``max_tokens``, and
``usage`` whose ``input_tokens`` excludes the prompt tokens the prefix cache served, those
being ``cache_read_input_tokens`` (present when there are any). Streams are the typed
events ``message_start``, ``content_block_start``, ``content_block_delta``…,
``content_block_stop``, ``message_delta`` (stop reason and usage), ``message_stop``.
``count_tokens`` answers ``{"input_tokens": N}``, the rendered prompt's length.

This is the engine's own translation, written apart from the router's Anthropic code on
purpose: the simulator stands in for the engine, so the two sides must not share it.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Iterator
from typing import Any

from continuum.errors import RequestError
from continuum.sim.engine import Generation

#: vLLM's finish reasons → Anthropic's stop reasons.
_STOP_REASONS = {"stop": "end_turn", "length": "max_tokens"}
#: The first system block Claude Code sends holds a per-request hash; vLLM drops it so it
#: does not defeat prefix caching.
_BILLING_HEADER = "x-anthropic-billing-header"


def _system_text(system: Any) -> str | None:
    if system is None:
        return None
    if isinstance(system, str):
        return system or None
    if not isinstance(system, list):
        raise RequestError("'system' must be a string or an array of text blocks",
                           param="system")
    texts = []
    for i, block in enumerate(system):
        if not isinstance(block, dict) or block.get("type") != "text" or \
                not isinstance(block.get("text"), str):
            raise RequestError(f"'system[{i}]' must be a text block", param=f"system[{i}]")
        if not block["text"].startswith(_BILLING_HEADER):
            texts.append(block["text"])
    return "".join(texts) or None


def _block_text(content: Any) -> str:
    """The text of a ``tool_result``'s content: a string or text blocks."""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "\n".join(b["text"] for b in content
                         if isinstance(b, dict) and isinstance(b.get("text"), str))
    return ""


def _message(role: str, content: Any, where: str, out: list[dict[str, Any]]) -> None:
    """Append the chat message(s) one Messages ``message`` stands for to ``out``."""
    if isinstance(content, str):
        out.append({"role": role, "content": content})
        return
    if not isinstance(content, list):
        raise RequestError(f"'{where}.content' must be a string or an array of blocks",
                           param=f"{where}.content")
    parts: list[dict[str, Any]] = []
    for i, block in enumerate(content):
        kind = block.get("type") if isinstance(block, dict) else None
        if kind == "text" and isinstance(block.get("text"), str):
            parts.append({"type": "text", "text": block["text"]})
        elif kind == "image":
            parts.append({"type": "image_url", "image_url": {"url": "<image>"}})
        elif kind == "tool_use":
            call = {"name": block.get("name"), "input": block.get("input")}
            parts.append({"type": "text", "text": json.dumps(call)})
        elif kind == "tool_result" and role == "user":
            out.append({"role": "tool", "content": _block_text(block.get("content"))})
        elif kind not in ("thinking", "redacted_thinking"):
            raise RequestError(f"'{where}.content[{i}]' is not a block the engine takes "
                               "(text, image, tool_use, tool_result, thinking)",
                               param=f"{where}.content[{i}]")
    if parts:
        out.append({"role": role, "content": parts})


def chat_messages(body: dict[str, Any]) -> list[dict[str, Any]]:
    """The chat conversation a Messages (or count_tokens) request stands for.

    Raises:
        RequestError: ``messages`` is missing or malformed, or ``system`` is not text.
    """
    chat: list[dict[str, Any]] = []
    system = _system_text(body.get("system"))
    if system is not None:
        chat.append({"role": "system", "content": system})
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise RequestError("'messages' must be a non-empty array", param="messages")
    for i, message in enumerate(messages):
        role = message.get("role") if isinstance(message, dict) else None
        if role == "system":  # one along the conversation: folded in where it stands
            text = _system_text(message.get("content"))
            if text is not None:
                chat.append({"role": "user", "content": text})
            continue
        if role not in ("user", "assistant"):
            raise RequestError(f"'messages[{i}].role' must be 'user', 'assistant' or "
                               "'system'", param=f"messages[{i}].role")
        _message(role, message.get("content"), f"messages[{i}]", chat)
    return chat


def sampling(body: dict[str, Any]) -> dict[str, Any]:
    """The chat sampling fields of a Messages request (``max_tokens`` is required)."""
    max_tokens = body.get("max_tokens")
    if isinstance(max_tokens, bool) or not isinstance(max_tokens, int) or max_tokens < 1:
        raise RequestError("'max_tokens' is required: an integer >= 1", param="max_tokens")
    out: dict[str, Any] = {"max_tokens": max_tokens}
    if body.get("stop_sequences") is not None:
        out["stop"] = body["stop_sequences"]
    if body.get("temperature") is not None:
        out["temperature"] = body["temperature"]
    return out


def usage_doc(gen: Generation, *, output: bool = True) -> dict[str, Any]:
    """Anthropic's ``usage``: ``input_tokens`` without the cached ones, which are
    ``cache_read_input_tokens`` when there are any."""
    usage: dict[str, Any] = {"input_tokens": gen.prompt_tokens - gen.cached_tokens}
    if gen.cached_tokens:
        usage["cache_read_input_tokens"] = gen.cached_tokens
    usage["output_tokens"] = gen.completion_tokens if output else 0
    return usage


def _stop_reason(gen: Generation) -> str | None:
    reason = gen.steps[-1].finish_reason if gen.steps else None
    return _STOP_REASONS.get(reason or "stop", "end_turn")


def _event(name: str, doc: dict[str, Any]) -> bytes:
    data = json.dumps({"type": name, **doc}, separators=(",", ":"), ensure_ascii=False)
    return b"event: " + name.encode() + b"\ndata: " + data.encode("utf-8", "replace") + \
        b"\n\n"


class MessageShape:
    """The ``message`` of one generation, whole or as stream events."""

    def __init__(self, model: str) -> None:
        self.model = model
        self.id = "msg_" + uuid.uuid4().hex

    def _doc(self, content: list[dict[str, Any]], stop_reason: str | None,
             usage: dict[str, Any]) -> dict[str, Any]:
        return {"id": self.id, "type": "message", "role": "assistant", "content": content,
                "model": self.model, "stop_reason": stop_reason, "stop_sequence": None,
                "usage": usage}

    def full(self, gen: Generation) -> dict[str, Any]:
        """The whole ``message`` of a finished generation."""
        text = gen.text
        content = [{"type": "text", "text": text}] if text else []
        return self._doc(content, _stop_reason(gen), usage_doc(gen))

    def events(self, gen: Generation) -> Iterator[bytes]:
        """The SSE byte stream; ``message_start`` waits for the first token (the prompt's
        cached part is known once the engine admitted it). Closing it releases the
        engine's slot."""
        steps = iter(gen)
        started = False
        try:
            for step in steps:
                if not started:
                    started = True
                    yield _event("message_start", {"message": self._doc(
                        [], None, usage_doc(gen, output=False))})
                    yield _event("content_block_start", {
                        "index": 0, "content_block": {"type": "text", "text": ""}})
                if step.text:
                    yield _event("content_block_delta", {
                        "index": 0, "delta": {"type": "text_delta", "text": step.text}})
        finally:
            steps.close()  # type: ignore[attr-defined]
        if not started:  # nothing generated (cannot happen with max_tokens >= 1)
            return
        yield _event("content_block_stop", {"index": 0})
        yield _event("message_delta", {"delta": {"stop_reason": _stop_reason(gen),
                                                 "stop_sequence": None},
                                       "usage": usage_doc(gen)})
        yield _event("message_stop", {})
