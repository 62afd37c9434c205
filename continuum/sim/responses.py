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

from collections.abc import Iterator
from typing import Any

from continuum.errors import RequestError
from continuum.sim.engine import Generation
from continuum.wire import responses_api


def _text(content: Any, where: str) -> str:
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise RequestError(f"'{where}' must be a string or an array of content parts",
                           param=where)
    texts = []
    for i, part in enumerate(content):
        if not isinstance(part, dict) or part.get("type") not in responses_api.TEXT_PART_TYPES or \
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
            role = responses_api.input_role(item)
            if role is None or item.get("type", "message") != "message":
                raise RequestError(f"'input[{i}]' must be a message item with a role of "
                                   "user, assistant, system or developer",
                                   param=f"input[{i}]")
            messages.append({"role": role,
                             "content": _text(item.get("content"), f"input[{i}].content")})
    else:
        raise RequestError("'input' is required: a string or a non-empty array",
                           param="input")
    return messages


def usage_doc(gen: Generation) -> dict[str, Any]:
    """The Responses API's ``usage`` object."""
    return responses_api.usage_doc(gen.prompt_tokens, gen.cached_tokens, gen.completion_tokens)


class ResponseShape(responses_api.ResponseShape):
    """The ``response`` object of one generation, whole or as stream events."""

    def __init__(self, model: str, body: dict[str, Any]) -> None:
        super().__init__(model, body)
        self.item_id = responses_api.new_id("msg")

    def _item(self, status: str, text: str | None) -> dict[str, Any]:
        content = [] if text is None else [responses_api.text_part(text)]
        return responses_api.message_item(self.item_id, status, content)

    def full(self, gen: Generation) -> dict[str, Any]:
        """The whole ``response`` object of a finished generation."""
        return self.doc("completed", [self._item("completed", gen.text)], usage_doc(gen))

    def events(self, gen: Generation) -> Iterator[tuple[str, dict[str, Any]]]:
        """(event name, data) of the stream; closing it releases the engine's slot."""
        counter = responses_api.EventCounter()
        event = counter.event
        where = {"item_id": self.item_id, "output_index": 0, "content_index": 0}
        yield event("response.created", response=self.doc("in_progress", [], None))
        yield event("response.in_progress", response=self.doc("in_progress", [], None))
        yield event("response.output_item.added", output_index=0,
                    item=self._item("in_progress", None))
        yield event("response.content_part.added", part=responses_api.text_part(""), **where)
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
        yield event("response.content_part.done", part=responses_api.text_part(text), **where)
        item = self._item("completed", text)
        yield event("response.output_item.done", output_index=0, item=item)
        yield event("response.completed", response=self.doc("completed", [item],
                                                            usage_doc(gen)))
