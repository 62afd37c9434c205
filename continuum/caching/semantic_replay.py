"""How a semantic hit is answered in the shape the request asked for.

The semantic partition does not include ``stream`` or ``stream_options`` (they change the
shape of an answer, not its content), so one stored answer serves both shapes:

* a ``stream: true`` request gets a valid OpenAI SSE stream: the stored stream's events as
  they were, or a stored JSON body cut into chunks (a role chunk, one content chunk per
  choice, tool calls, a finish chunk); either way it **always ends with a usage chunk**
  (``choices: []``, ``usage`` set: what ``stream_options.include_usage`` yields) and
  ``data: [DONE]``, so the official SDK's stream iterator gets the full text and a final
  usage chunk even when the stored answer was non-streamed or its stream had no usage;
* a non-streamed request gets the stored body, or the stored stream assembled into one
  ``chat.completion`` body.

Usage comes from the stored answer (its ``usage`` object or usage chunk). When the stored
answer has none it is *synthesised*: ``completion_tokens`` from the stored answer's text
and ``prompt_tokens`` from the request's message text, each as ``ceil(characters / 4)``
(the usual rough rate of English text; the router has no tokenizer for every model).

A stored answer that cannot be read as a chat completion (not JSON, no ``choices``) cannot
be converted: :func:`adapt` returns None and the lookup is a miss.
"""

from __future__ import annotations

import json
import math
import time
from collections.abc import Iterator
from typing import Any

from continuum.caching.response_cache import CachedResponse

SSE_TYPE = "text/event-stream"
JSON_TYPE = "application/json"
_DONE = b"data: [DONE]"


def estimate_tokens(text: str) -> int:
    """A token count for ``text`` without a tokenizer: one per four characters."""
    return math.ceil(len(text) / 4)


def prompt_text(messages: list[Any] | None) -> str:
    """The text of every message (string contents and text parts), for a usage estimate."""
    parts: list[str] = []
    for message in messages or []:
        if not isinstance(message, dict):
            continue
        content = message.get("content")
        if isinstance(content, str):
            parts.append(content)
        elif isinstance(content, list):
            parts.extend(p["text"] for p in content
                         if isinstance(p, dict) and isinstance(p.get("text"), str))
    return "\n".join(parts)


def _usage(prompt_tokens: int, completion_text: str) -> dict[str, int]:
    completion = estimate_tokens(completion_text)
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion,
            "total_tokens": prompt_tokens + completion}


def _event_data(event: bytes) -> bytes | None:
    """The ``data`` of one SSE event (lines joined by newlines), None without one."""
    lines = [line[5:].lstrip(b" ") for line in event.split(b"\n") if line.startswith(b"data:")]
    return b"\n".join(lines) if lines else None


def _chunk_bytes(doc: dict[str, Any]) -> bytes:
    return b"data: " + json.dumps(doc, separators=(",", ":")).encode() + b"\n\n"


def _sse_chunks(entry: CachedResponse) -> tuple[list[bytes], list[dict[str, Any] | None]]:
    """The stored stream's events and, per event, its decoded JSON chunk (None for
    ``[DONE]``, comments and anything that is not a JSON object)."""
    events = list(entry.events())
    docs: list[dict[str, Any] | None] = []
    for event in events:
        data = _event_data(event)
        doc = None
        if data is not None and data != b"[DONE]":
            try:
                parsed = json.loads(data)
            except ValueError:
                parsed = None
            doc = parsed if isinstance(parsed, dict) else None
        docs.append(doc)
    return events, docs


def _merge_tool_call(calls: dict[int, dict[str, Any]], delta: dict[str, Any]) -> None:
    index = delta.get("index", len(calls))
    call = calls.setdefault(index, {"id": None, "type": "function",
                                    "function": {"name": "", "arguments": ""}})
    if delta.get("id"):
        call["id"] = delta["id"]
    if delta.get("type"):
        call["type"] = delta["type"]
    function = delta.get("function") or {}
    if isinstance(function, dict):
        call["function"]["name"] += function.get("name") or ""
        call["function"]["arguments"] += function.get("arguments") or ""


def assemble(entry: CachedResponse, prompt_tokens: int) -> bytes | None:
    """A stored stream as one ``chat.completion`` body (None when it is not an OpenAI chat
    stream)."""
    _events, docs = _sse_chunks(entry)
    first = next((d for d in docs if d is not None and "choices" in d), None)
    if first is None:
        return None
    texts: dict[int, list[str]] = {}
    roles: dict[int, str] = {}
    finish: dict[int, str | None] = {}
    tools: dict[int, dict[int, dict[str, Any]]] = {}
    usage: dict[str, Any] | None = None
    for doc in docs:
        if doc is None:
            continue
        if isinstance(doc.get("usage"), dict):
            usage = doc["usage"]
        for choice in doc.get("choices") or []:
            if not isinstance(choice, dict):
                continue
            index = int(choice.get("index", 0))
            delta = choice.get("delta") or {}
            texts.setdefault(index, [])
            if isinstance(delta, dict):
                if isinstance(delta.get("role"), str):
                    roles[index] = delta["role"]
                if isinstance(delta.get("content"), str):
                    texts[index].append(delta["content"])
                for call in delta.get("tool_calls") or []:
                    if isinstance(call, dict):
                        _merge_tool_call(tools.setdefault(index, {}), call)
            if choice.get("finish_reason") is not None:
                finish[index] = choice["finish_reason"]
    choices = []
    for index in sorted(texts):
        message: dict[str, Any] = {"role": roles.get(index, "assistant"),
                                   "content": "".join(texts[index])}
        if index in tools:
            message["tool_calls"] = [tools[index][i] for i in sorted(tools[index])]
        choices.append({"index": index, "message": message,
                        "finish_reason": finish.get(index, "stop"), "logprobs": None})
    if usage is None:
        usage = _usage(prompt_tokens, "".join("".join(t) for t in texts.values()))
    body = {"id": first.get("id", "chatcmpl-semantic"), "object": "chat.completion",
            "created": first.get("created", int(time.time())),
            "model": first.get("model", ""), "choices": choices, "usage": usage}
    return json.dumps(body, separators=(",", ":")).encode()


def _completion_text(choices: list[Any]) -> str:
    out = []
    for choice in choices:
        message = choice.get("message") if isinstance(choice, dict) else None
        if isinstance(message, dict) and isinstance(message.get("content"), str):
            out.append(message["content"])
    return "".join(out)


def _stream_from_body(body: dict[str, Any], prompt_tokens: int) -> list[bytes]:
    """A stored ``chat.completion`` body as SSE chunks, ending with usage and ``[DONE]``."""
    base = {"id": body.get("id", "chatcmpl-semantic"), "object": "chat.completion.chunk",
            "created": body.get("created", int(time.time())), "model": body.get("model", "")}
    out: list[bytes] = []
    choices = body["choices"]
    for choice in choices:
        index = choice.get("index", 0)
        message = choice.get("message") or {}
        role = message.get("role", "assistant")
        out.append(_chunk_bytes({**base, "choices": [
            {"index": index, "delta": {"role": role, "content": ""}, "finish_reason": None}]}))
        content = message.get("content")
        if isinstance(content, str) and content:
            out.append(_chunk_bytes({**base, "choices": [
                {"index": index, "delta": {"content": content}, "finish_reason": None}]}))
        calls = message.get("tool_calls")
        if isinstance(calls, list) and calls:
            deltas = [{**call, "index": i} for i, call in enumerate(calls)
                      if isinstance(call, dict)]
            out.append(_chunk_bytes({**base, "choices": [
                {"index": index, "delta": {"tool_calls": deltas}, "finish_reason": None}]}))
        out.append(_chunk_bytes({**base, "choices": [
            {"index": index, "delta": {}, "finish_reason": choice.get("finish_reason", "stop")}]}))
    usage = body.get("usage")
    if not isinstance(usage, dict):
        usage = _usage(prompt_tokens, _completion_text(choices))
    out.append(_chunk_bytes({**base, "choices": [], "usage": usage}))
    out.append(_DONE + b"\n\n")
    return out


def _stream_from_sse(entry: CachedResponse, prompt_tokens: int) -> list[bytes] | None:
    """The stored stream's events, with a usage chunk before ``[DONE]`` when it had none."""
    events, docs = _sse_chunks(entry)
    first = next((d for d in docs if d is not None and "choices" in d), None)
    if first is None:
        return None
    kept = [e for e in events if _event_data(e) != b"[DONE]"]
    if any(d is not None and isinstance(d.get("usage"), dict) for d in docs):
        return [*kept, _DONE + b"\n\n"]
    text = []
    for doc in docs:
        for choice in (doc or {}).get("choices") or []:
            delta = choice.get("delta") if isinstance(choice, dict) else None
            if isinstance(delta, dict) and isinstance(delta.get("content"), str):
                text.append(delta["content"])
    usage = _chunk_bytes({"id": first.get("id", "chatcmpl-semantic"),
                          "object": "chat.completion.chunk",
                          "created": first.get("created", int(time.time())),
                          "model": first.get("model", ""), "choices": [],
                          "usage": _usage(prompt_tokens, "".join(text))})
    return [*kept, usage, _DONE + b"\n\n"]


def adapt(entry: CachedResponse, stream: bool, messages: list[Any] | None,
          ) -> tuple[str, bytes | None, Iterator[bytes] | None] | None:
    """A stored answer in the shape the request asked for: (content type, body, stream),
    one of body and stream set; None when the stored answer cannot be converted."""
    prompt_tokens = estimate_tokens(prompt_text(messages))
    if entry.kind == "sse":
        if stream:
            events = _stream_from_sse(entry, prompt_tokens)
            return None if events is None else (entry.content_type, None, iter(events))
        body = assemble(entry, prompt_tokens)
        return None if body is None else (JSON_TYPE, body, None)
    try:
        doc = json.loads(entry.payload)
    except ValueError:
        return None
    if not isinstance(doc, dict) or not isinstance(doc.get("choices"), list):
        return None
    if not stream:
        return entry.content_type, entry.payload, None
    return SSE_TYPE, None, iter(_stream_from_body(doc, prompt_tokens))
