"""The OpenAI Responses API's answer shapes: the ``response`` object, its output items,
its ``usage``, and its typed stream events.

Two producers share them: the simulated engine's ``/v1/responses``
(:mod:`continuum.sim.responses`) and the router's translation of Responses requests for
``type: gemini`` backends, which Google serves no Responses endpoint for
(:mod:`continuum.routing.gemini_responses`).

A stream is a sequence of SSE records ``event: <type>`` + ``data: {"type": <type>,
"sequence_number": n, ...}``, from ``response.created`` to ``response.completed`` (or
``response.incomplete``), with no ``[DONE]``.
"""

from __future__ import annotations

import json
import time
import uuid
from typing import Any

#: The roles of an input message item, and the chat role each stands for.
INPUT_ROLES = {"user": "user", "assistant": "assistant", "system": "system",
               "developer": "system"}
#: Content part types that carry text (``text`` beside the Responses API's own two).
TEXT_PART_TYPES = ("input_text", "output_text", "text")
#: The ``text`` setting of a response whose request set none.
PLAIN_TEXT = {"format": {"type": "text"}}


def input_role(item: Any) -> str | None:
    """The chat role an input message item's ``role`` stands for, or None when it names
    none (an unknown role, or one that is not a string)."""
    role = item.get("role") if isinstance(item, dict) else None
    return INPUT_ROLES.get(role) if isinstance(role, str) else None


def new_id(prefix: str) -> str:
    """A fresh id such as ``resp_…``, ``msg_…`` or ``fc_…``."""
    return prefix + "_" + uuid.uuid4().hex


def usage_doc(input_tokens: int, cached_tokens: int, output_tokens: int,
              reasoning_tokens: int = 0) -> dict[str, Any]:
    """The ``usage`` object: ``input_tokens`` counts the cached ones too."""
    return {"input_tokens": input_tokens,
            "input_tokens_details": {"cached_tokens": cached_tokens},
            "output_tokens": output_tokens,
            "output_tokens_details": {"reasoning_tokens": reasoning_tokens},
            "total_tokens": input_tokens + output_tokens}


def text_part(text: str, logprobs: list[Any] | None = None) -> dict[str, Any]:
    """An ``output_text`` content part (with its tokens' log probabilities, when asked)."""
    return {"type": "output_text", "text": text, "annotations": [],
            "logprobs": logprobs or []}


def message_item(item_id: str, status: str, content: list[dict[str, Any]]) -> dict[str, Any]:
    """An assistant ``message`` output item."""
    return {"id": item_id, "type": "message", "status": status, "role": "assistant",
            "content": content}


def function_call_item(item_id: str, call_id: str, name: str, arguments: str,
                       status: str) -> dict[str, Any]:
    """A ``function_call`` output item."""
    return {"id": item_id, "type": "function_call", "status": status, "call_id": call_id,
            "name": name, "arguments": arguments}


def summary_part(text: str) -> dict[str, Any]:
    """A ``summary_text`` part of a reasoning item's ``summary``."""
    return {"type": "summary_text", "text": text}


def reasoning_item(item_id: str, summary: list[dict[str, Any]]) -> dict[str, Any]:
    """A ``reasoning`` output item carrying the model's thought summary."""
    return {"id": item_id, "type": "reasoning", "summary": summary}


class ResponseShape:
    """The ``response`` object of one request: its id and creation time, and the request's
    settings it reports back (``instructions``, sampling, ``tools``, ``text``…)."""

    def __init__(self, model: str, body: dict[str, Any]) -> None:
        self.model = model
        self.body = body
        self.id = new_id("resp")
        self.created_at = int(time.time())

    def doc(self, status: str, output: list[dict[str, Any]], usage: dict[str, Any] | None,
            incomplete_reason: str | None = None) -> dict[str, Any]:
        """The object with ``status`` (``in_progress``, ``completed``, ``incomplete``)."""
        body = self.body
        return {
            "id": self.id, "object": "response", "created_at": self.created_at,
            "status": status, "error": None,
            "incomplete_details": None if incomplete_reason is None else
            {"reason": incomplete_reason},
            "instructions": body.get("instructions"),
            "max_output_tokens": body.get("max_output_tokens"), "model": self.model,
            "output": output, "parallel_tool_calls": body.get("parallel_tool_calls", True),
            "previous_response_id": None,
            "reasoning": _reasoning(body.get("reasoning")), "store": False,
            "temperature": body.get("temperature", 1.0),
            "text": body.get("text") or PLAIN_TEXT,
            "tool_choice": body.get("tool_choice", "auto"), "tools": body.get("tools") or [],
            "top_p": body.get("top_p", 1.0), "truncation": "disabled", "usage": usage,
            "user": None, "metadata": body.get("metadata") or {},
        }


def _reasoning(asked: Any) -> dict[str, Any]:
    """The ``reasoning`` settings a response reports: the request's, where it gave them."""
    asked = asked if isinstance(asked, dict) else {}
    return {"effort": asked.get("effort"), "summary": asked.get("summary")}


class EventCounter:
    """Numbers a stream's events (``sequence_number`` from 0)."""

    __slots__ = ("next",)

    def __init__(self) -> None:
        self.next = 0

    def event(self, name: str, **fields: Any) -> tuple[str, dict[str, Any]]:
        """``(type, data)`` of the next event."""
        seq = self.next
        self.next += 1
        return name, {"type": name, "sequence_number": seq, **fields}

    def record(self, name: str, **fields: Any) -> bytes:
        """The next event as an SSE record."""
        _, data = self.event(name, **fields)
        return encode(name, data)


def encode(name: str, data: dict[str, Any]) -> bytes:
    """One SSE record: ``event: name`` and its JSON ``data``."""
    return (b"event: " + name.encode() + b"\ndata: "
            + json.dumps(data, separators=(",", ":")).encode() + b"\n\n")
