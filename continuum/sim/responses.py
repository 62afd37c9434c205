"""The OpenAI Responses API (``POST /v1/responses``) on the simulated engine.

vLLM serves ``/v1/responses`` over the same engine as chat completions: ``instructions``
becomes the system message, ``input`` (a string, or a list of message items whose
``content`` is a string or ``input_text``/``output_text`` parts) the conversation. The
answer is a ``response`` object with one ``message`` output item and ``usage`` in the
Responses shape (``input_tokens``, ``input_tokens_details.cached_tokens``,
``output_tokens``, ``total_tokens``). Streams are the typed SSE events
(``event: response.created`` … ``response.output_text.delta`` … ``response.completed``,
each with its ``sequence_number``); they end with ``response.completed``, no ``[DONE]``.

The engine-facing responder is in :mod:`continuum.sim.server`; this module holds the
shapes. The simulator keeps no responses: ``store`` is reported false and ``previous_response_id``
is refused (400) as a server without storage would.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Iterator
from typing import Any

from continuum.errors import RequestError
from continuum.sim.engine import Generation

_ROLES = {"user": "user", "assistant": "assistant", "system": "system", "developer": "system"}
_TEXT_PARTS = ("input_text", "output_text", "text")


def _text(content: Any, where: str) -> str:
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise RequestError(f"'{where}' must be a string or an array of content parts",
                           param=where)
    texts = []
    for i, part in enumerate(content):
        if not isinstance(part, dict) or part.get("type") not in _TEXT_PARTS or \
                not isinstance(part.get("text"), str):
            raise RequestError(f"'{where}[{i}]' must be a text part (input_text)",
                               param=f"{where}[{i}]")
        texts.append(part["text"])
    return "\n".join(texts)


def chat_messages(body: dict[str, Any]) -> list[dict[str, str]]:
    """The chat conversation a Responses request stands for.

    Raises:
        RequestError: ``input`` is missing or not a string or an array of message items.
    """
    messages: list[dict[str, str]] = []
    instructions = body.get("instructions")
    if instructions is not None:
        if not isinstance(instructions, str):
            raise RequestError("'instructions' must be a string", param="instructions")
        messages.append({"role": "system", "content": instructions})
    given = body.get("input")
    if isinstance(given, str):
        messages.append({"role": "user", "content": given})
    elif isinstance(given, list) and given:
        for i, item in enumerate(given):
            if not isinstance(item, dict) or item.get("type", "message") != "message" or \
                    item.get("role") not in _ROLES:
                raise RequestError(f"'input[{i}]' must be a message item with a role of "
                                   "user, assistant, system or developer",
                                   param=f"input[{i}]")
            messages.append({"role": _ROLES[item["role"]],
                             "content": _text(item.get("content"), f"input[{i}].content")})
    else:
        raise RequestError("'input' is required: a string or a non-empty array",
                           param="input")
    return messages


def usage_doc(gen: Generation) -> dict[str, Any]:
    """The Responses API's ``usage`` object."""
    return {"input_tokens": gen.prompt_tokens,
            "input_tokens_details": {"cached_tokens": gen.cached_tokens},
            "output_tokens": gen.completion_tokens,
            "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": gen.prompt_tokens + gen.completion_tokens}


class ResponseShape:
    """The ``response`` object of one request, whole or as stream events."""

    def __init__(self, model: str, body: dict[str, Any]) -> None:
        self.model = model
        self.body = body
        self.id = "resp_" + uuid.uuid4().hex
        self.item_id = "msg_" + uuid.uuid4().hex
        self.created_at = int(time.time())

    def _doc(self, status: str, output: list[dict[str, Any]],
             usage: dict[str, Any] | None) -> dict[str, Any]:
        body = self.body
        return {
            "id": self.id, "object": "response", "created_at": self.created_at,
            "status": status, "error": None, "incomplete_details": None,
            "instructions": body.get("instructions"),
            "max_output_tokens": body.get("max_output_tokens"), "model": self.model,
            "output": output, "parallel_tool_calls": True, "previous_response_id": None,
            "reasoning": {"effort": None, "summary": None}, "store": False,
            "temperature": body.get("temperature", 1.0),
            "text": {"format": {"type": "text"}}, "tool_choice": "auto", "tools": [],
            "top_p": body.get("top_p", 1.0), "truncation": "disabled", "usage": usage,
            "user": None, "metadata": body.get("metadata") or {},
        }

    def _part(self, text: str) -> dict[str, Any]:
        return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}

    def _item(self, status: str, content: list[dict[str, Any]]) -> dict[str, Any]:
        return {"id": self.item_id, "type": "message", "status": status,
                "role": "assistant", "content": content}

    def full(self, gen: Generation) -> dict[str, Any]:
        """The whole ``response`` object of a finished generation."""
        item = self._item("completed", [self._part(gen.text)])
        return self._doc("completed", [item], usage_doc(gen))

    def events(self, gen: Generation) -> Iterator[tuple[str, dict[str, Any]]]:
        """(event name, data) of the stream; closing it releases the engine's slot."""
        seq = 0

        def event(name: str, **fields: Any) -> tuple[str, dict[str, Any]]:
            nonlocal seq
            seq += 1
            return name, {"type": name, "sequence_number": seq - 1, **fields}

        where = {"item_id": self.item_id, "output_index": 0, "content_index": 0}
        yield event("response.created", response=self._doc("in_progress", [], None))
        yield event("response.in_progress", response=self._doc("in_progress", [], None))
        yield event("response.output_item.added", output_index=0,
                    item=self._item("in_progress", []))
        yield event("response.content_part.added", part=self._part(""), **where)
        steps = iter(gen)
        try:
            for step in steps:
                if step.text:
                    yield event("response.output_text.delta", delta=step.text, logprobs=[],
                                **where)
        finally:
            steps.close()  # type: ignore[attr-defined]
        text = gen.text
        yield event("response.output_text.done", text=text, logprobs=[], **where)
        yield event("response.content_part.done", part=self._part(text), **where)
        item = self._item("completed", [self._part(text)])
        yield event("response.output_item.done", output_index=0, item=item)
        yield event("response.completed", response=self._doc("completed", [item],
                                                             usage_doc(gen)))
