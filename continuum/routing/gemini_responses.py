"""The OpenAI Responses API (``POST /v1/responses``) on ``type: gemini`` backends.

Google serves chat completions on its OpenAI-compatible surface, but no Responses endpoint,
so the gateway (:mod:`continuum.routing.gemini_dispatch`) translates, through the native
API (``generateContent``, ``streamGenerateContent?alt=sse``) whatever
``prefer_native_api`` says: it is Google's own, reports ``usageMetadata`` on every answer
and stream, and leaves nothing to how the compatible surface treats the fields it was
given. The context cache is not asked: it serves chat completions only.

* **The request** becomes a chat completion (:func:`chat_body`), then native
  (:func:`continuum.routing.gemini.to_native`).

  - ``instructions`` → a system message; ``input`` as a string → one user message;
    message items (a string, or ``input_text``/``output_text``/``input_image`` parts) →
    messages, ``developer`` as ``system``; ``function_call`` items → the assistant's
    ``tool_calls``; ``function_call_output`` items → ``tool`` messages; ``reasoning`` items
    are dropped (Gemini cannot take them back). A ``function_call`` item's
    ``extra_content.google.thought_signature`` goes back as its ``thoughtSignature``.
  - ``max_output_tokens`` → ``max_completion_tokens``; ``temperature`` and ``top_p`` as
    they are; function ``tools`` and ``tool_choice`` in chat's shapes; ``text.format``
    (``json_object``, ``json_schema``) → ``response_format``; ``reasoning.effort`` →
    ``reasoning_effort`` (Gemini's thinking budget or level, as for chat);
    ``reasoning.summary`` → Gemini's ``includeThoughts``; ``include`` of
    ``message.output_text.logprobs`` (with ``top_logprobs``) → chat's ``logprobs``, which
    come back on the output text. Other fields (``store``, ``metadata``, ``user``, the rest
    of ``include``, ``truncation``, ``parallel_tool_calls``…) are not sent; ``store`` is
    reported false.
  - What the translation cannot honour is a 400 naming the field: ``previous_response_id``
    and ``conversation`` (the router stores no responses), ``background``, tools other
    than functions, file inputs, other input items.

* **The answer** becomes a ``response`` object (:func:`response_from_chat`): Gemini's
  thought summary (when asked for) as a ``reasoning`` item first, the text as one
  ``message`` item, each tool call as a ``function_call`` item (with Gemini 3's
  signature in ``extra_content.google.thought_signature``, as Google's OpenAI-compatible
  surface gives it, for the client to send back with the item); a ``length`` finish as
  status ``incomplete`` (``max_output_tokens``), ``content_filter`` likewise; ``usage`` as
  ``input_tokens`` (the whole prompt), ``input_tokens_details.cached_tokens`` (Gemini's
  ``cachedContentTokenCount``, implicit caching included), ``output_tokens`` and
  ``output_tokens_details.reasoning_tokens``. Errors keep OpenAI's error body, which is
  the Responses API's too.

* **A stream** becomes the typed events (:class:`EventTranslator`), from
  ``response.created`` to ``response.completed`` or ``response.incomplete`` (a thought
  summary as ``response.reasoning_summary_text.delta`` events in its reasoning item); an
  error record (Google's, or the router's when the upstream broke off) becomes an ``error``
  event, after which nothing is completed.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

from continuum.errors import RequestError
from continuum.routing.gemini import as_dict, signed, thought_signature
from continuum.wire import responses_api
from continuum.wire.responses_api import ResponseShape

#: Responses fields that need state or features the translation has not.
_REFUSED = {
    "previous_response_id": "the router stores no responses: send the whole conversation "
                            "in 'input'",
    "conversation": "the router stores no conversations: send the whole conversation in "
                    "'input'",
    "background": "background responses need a stored response to poll",
}
_PASSED = ("model", "temperature", "top_p")
#: The ``include`` value asking for the output text's log probabilities.
LOGPROBS = "message.output_text.logprobs"
#: ``reasoning.summary`` values: each asks Gemini for its thought summaries.
_SUMMARIES = ("auto", "concise", "detailed")
#: Chat finish reasons that leave a response incomplete, with the Responses reason.
_INCOMPLETE = {"length": "max_output_tokens", "content_filter": "content_filter"}


def _part(part: Any, where: str) -> dict[str, Any]:
    kind = part.get("type") if isinstance(part, dict) else None
    if kind in responses_api.TEXT_PART_TYPES and isinstance(part.get("text"), str):
        return {"type": "text", "text": part["text"]}
    if kind == "input_image":
        url = part.get("image_url")
        if isinstance(url, str) and url:
            return {"type": "image_url", "image_url": {"url": url}}
        raise RequestError(f"'{where}': a Gemini backend takes images by 'image_url' (a URL "
                           "or a data: URL), not by file_id", param=where)
    raise RequestError(f"'{where}' must be an input_text, output_text or input_image part "
                       "on a Gemini backend", param=where)


def _content(content: Any, where: str) -> str | list[dict[str, Any]]:
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise RequestError(f"'{where}' must be a string or an array of content parts",
                           param=where)
    return [_part(part, f"{where}[{i}]") for i, part in enumerate(content)]


def _output_text(output: Any, where: str) -> str:
    """A ``function_call_output``'s ``output``: a string, or its text parts joined."""
    parts = _content(output, where)
    if isinstance(parts, str):
        return parts
    return "".join(part.get("text", "") for part in parts)


def _messages(body: dict[str, Any]) -> list[dict[str, Any]]:
    messages: list[dict[str, Any]] = []
    instructions = body.get("instructions")
    if isinstance(instructions, str) and instructions:
        messages.append({"role": "system", "content": instructions})
    given = body.get("input")
    if isinstance(given, str):
        messages.append({"role": "user", "content": given})
        return messages
    for i, item in enumerate(given if isinstance(given, list) else []):
        where = f"input[{i}]"
        kind = item.get("type", "message") if isinstance(item, dict) else None
        role = responses_api.input_role(item)
        if kind == "message" and role is not None:
            messages.append({"role": role,
                             "content": _content(item.get("content"), where + ".content")})
        elif kind == "function_call" and isinstance(item.get("name"), str):
            arguments = item.get("arguments")
            call = {"id": str(item.get("call_id") or item.get("id") or f"call_{i}"),
                    "type": "function",
                    "function": {"name": item["name"], "arguments":
                                 arguments if isinstance(arguments, str) else "{}"},
                    **signed(thought_signature(item))}
            last = messages[-1] if messages else None
            if last is not None and last["role"] == "assistant":
                last.setdefault("tool_calls", []).append(call)
            else:
                messages.append({"role": "assistant", "content": None, "tool_calls": [call]})
        elif kind == "function_call_output" and isinstance(item.get("call_id"), str):
            messages.append({"role": "tool", "tool_call_id": item["call_id"],
                             "content": _output_text(item.get("output", ""),
                                                     where + ".output")})
        elif kind == "reasoning":
            continue
        else:
            raise RequestError(f"'{where}' must be a message item (role user, assistant, "
                               "system or developer), a function_call or a "
                               "function_call_output on a Gemini backend", param=where)
    if not any(m["role"] != "system" for m in messages):
        raise RequestError("'input' must hold at least one message that is not a system "
                           "message", param="input")
    return messages


def _tools(tools: Any) -> list[dict[str, Any]]:
    if tools is not None and not isinstance(tools, list):
        raise RequestError("'tools' must be an array", param="tools")
    out = []
    for i, tool in enumerate(tools or []):
        if not isinstance(tool, dict) or tool.get("type") != "function" or \
                not isinstance(tool.get("name"), str):
            raise RequestError(f"'tools[{i}]': a Gemini backend takes function tools only "
                               "(type function, with a name)", param=f"tools[{i}]")
        function = {"name": tool["name"]}
        for key in ("description", "parameters"):
            if tool.get(key) is not None:
                function[key] = tool[key]
        out.append({"type": "function", "function": function})
    return out


def _tool_choice(choice: Any) -> Any:
    if choice in ("none", "auto", "required"):
        return choice
    if isinstance(choice, dict) and choice.get("type") == "function" and \
            isinstance(choice.get("name"), str):
        return {"type": "function", "function": {"name": choice["name"]}}
    raise RequestError("'tool_choice' must be none, auto, required or a function "
                       "({\"type\": \"function\", \"name\": ...}) on a Gemini backend",
                       param="tool_choice")


def _response_format(text: Any) -> dict[str, Any] | None:
    fmt = text.get("format") if isinstance(text, dict) else None
    kind = fmt.get("type") if isinstance(fmt, dict) else None
    if fmt is None or kind == "text":
        return None
    if kind == "json_object":
        return {"type": "json_object"}
    if kind == "json_schema" and isinstance(fmt.get("schema"), dict):
        schema = {"name": fmt.get("name", "response"), "schema": fmt["schema"]}
        if fmt.get("strict") is not None:
            schema["strict"] = fmt["strict"]
        return {"type": "json_schema", "json_schema": schema}
    raise RequestError("'text.format' must be text, json_object or json_schema (with a "
                       "schema)", param="text.format")


def chat_body(body: dict[str, Any]) -> dict[str, Any]:
    """The chat completion a Responses request ``body`` stands for (the module doc).

    Raises:
        RequestError: a field the translation cannot honour (``param`` names it).
    """
    for name, why in _REFUSED.items():
        if body.get(name) not in (None, False):
            raise RequestError(f"'{name}' is not supported on a Gemini backend: {why}",
                               param=name)
    chat: dict[str, Any] = {key: body[key] for key in _PASSED if body.get(key) is not None}
    chat["messages"] = _messages(body)
    if body.get("max_output_tokens") is not None:
        chat["max_completion_tokens"] = body["max_output_tokens"]
    tools = _tools(body.get("tools"))
    if tools:
        chat["tools"] = tools
    if body.get("tool_choice") is not None:
        chat["tool_choice"] = _tool_choice(body["tool_choice"])
    fmt = _response_format(body.get("text"))
    if fmt is not None:
        chat["response_format"] = fmt
    reasoning = body.get("reasoning")
    if reasoning is not None and not isinstance(reasoning, dict):
        raise RequestError("'reasoning' must be an object", param="reasoning")
    reasoning = reasoning or {}
    if reasoning.get("effort") is not None:
        chat["reasoning_effort"] = reasoning["effort"]
    summary = reasoning.get("summary")
    if summary is not None and summary not in _SUMMARIES:
        raise RequestError(f"'reasoning.summary' must be one of {', '.join(_SUMMARIES)}",
                           param="reasoning.summary", code="invalid_value")
    if summary is not None:  # Gemini's thought summaries, as a reasoning item
        chat["extra_body"] = {"google": {"thinking_config": {"include_thoughts": True}}}
    include = body.get("include")
    if isinstance(include, list) and LOGPROBS in include:
        chat["logprobs"] = True
        if body.get("top_logprobs") is not None:
            chat["top_logprobs"] = body["top_logprobs"]
    return chat


def _usage(usage: Any) -> dict[str, Any] | None:
    if not isinstance(usage, dict):
        return None
    details = usage.get("prompt_tokens_details")
    cached = details.get("cached_tokens") if isinstance(details, dict) else None
    output = usage.get("completion_tokens_details")
    reasoning = output.get("reasoning_tokens") if isinstance(output, dict) else None
    return responses_api.usage_doc(int(usage.get("prompt_tokens") or 0), int(cached or 0),
                                   int(usage.get("completion_tokens") or 0),
                                   int(reasoning or 0))


def _logprobs(choice: dict[str, Any]) -> list[Any]:
    """A chat choice's (or chunk choice's) token log probabilities, in the shape the
    Responses API's output text takes them (the same entries: token, logprob, bytes,
    top_logprobs)."""
    scored = choice.get("logprobs")
    content = scored.get("content") if isinstance(scored, dict) else None
    return content if isinstance(content, list) else []


def response_from_chat(doc: dict[str, Any], shape: ResponseShape) -> dict[str, Any]:
    """The ``response`` object for a ``chat.completion`` ``doc``."""
    choices = doc.get("choices")
    choice = as_dict(choices[0] if isinstance(choices, list) and choices else None)
    message = as_dict(choice.get("message"))
    output: list[dict[str, Any]] = []
    thoughts = message.get("reasoning_content")
    if isinstance(thoughts, str) and thoughts:
        output.append(responses_api.reasoning_item(
            responses_api.new_id("rs"), [responses_api.summary_part(thoughts)]))
    text = message.get("content")
    calls = message.get("tool_calls")
    calls = calls if isinstance(calls, list) else []
    if (isinstance(text, str) and text) or not calls:
        output.append(responses_api.message_item(
            responses_api.new_id("msg"), "completed",
            [responses_api.text_part(text if isinstance(text, str) else "",
                                     _logprobs(choice))]))
    for call in calls:
        function = call.get("function") if isinstance(call, dict) else None
        if isinstance(function, dict):
            output.append({**responses_api.function_call_item(
                responses_api.new_id("fc"), str(call.get("id") or ""),
                str(function.get("name") or ""), str(function.get("arguments") or "{}"),
                "completed"), **signed(thought_signature(call))})
    if isinstance(doc.get("model"), str):
        shape.model = doc["model"]
    reason = _INCOMPLETE.get(str(choice.get("finish_reason")))
    return shape.doc("incomplete" if reason else "completed", output, _usage(doc.get("usage")),
                     reason)


class _Call:
    """A function call being streamed: its item and the arguments so far."""

    __slots__ = ("arguments", "call_id", "index", "item_id", "name", "signature")

    def __init__(self, index: int, call_id: str, name: str) -> None:
        self.index = index
        self.item_id = responses_api.new_id("fc")
        self.call_id = call_id
        self.name = name
        self.arguments: list[str] = []
        self.signature: str | None = None

    def item(self, arguments: str, status: str) -> dict[str, Any]:
        """Its ``function_call`` item (with Gemini's signature, when it has one)."""
        return {**responses_api.function_call_item(self.item_id, self.call_id, self.name,
                                                   arguments, status),
                **signed(self.signature)}


class EventTranslator:
    """``chat.completion.chunk`` documents in (as :class:`~continuum.routing.gemini.NativeStream`
    makes them from Google's records), the Responses API's typed events out."""

    def __init__(self, shape: ResponseShape) -> None:
        self.shape = shape
        self.counter = responses_api.EventCounter()
        self.started = False
        self.failed = False
        self.items: list[dict[str, Any]] = []
        self.text: list[str] | None = None
        self.text_logprobs: list[Any] = []
        self.text_id = ""
        self.text_index = 0
        self.thoughts: list[str] | None = None
        self.thoughts_id = ""
        self.thoughts_index = 0
        self.calls: dict[int, _Call] = {}
        self.open_calls: list[_Call] = []
        self.finish_reason: str | None = None
        self.usage: dict[str, Any] | None = None

    def _start(self, out: list[bytes]) -> None:
        if not self.started:
            self.started = True
            doc = self.shape.doc("in_progress", [], None)
            out.append(self.counter.record("response.created", response=doc))
            out.append(self.counter.record("response.in_progress", response=doc))

    def feed(self, chunks: list[dict[str, Any]]) -> list[bytes]:
        """The events ``chunks`` (``chat.completion.chunk`` documents, or an error
        ``{"error": …}``) make."""
        out: list[bytes] = []
        for doc in chunks:
            if not self.failed:
                self._chunk(doc, out)
        return out

    def _chunk(self, doc: dict[str, Any], out: list[bytes]) -> None:
        error = doc.get("error")
        if error is not None:
            error = error if isinstance(error, dict) else {"message": str(error)}
            self.failed = True
            out.append(self.counter.record(
                "error", code=error.get("code"), message=str(error.get("message", "")),
                param=error.get("param")))
            return
        self._start(out)
        if isinstance(doc.get("model"), str):
            self.shape.model = doc["model"]
        if doc.get("usage") is not None:
            self.usage = _usage(doc["usage"])
        for choice in doc.get("choices") or []:
            if not isinstance(choice, dict) or choice.get("index", 0) != 0:
                continue
            delta = as_dict(choice.get("delta"))
            thoughts = delta.get("reasoning_content")
            if isinstance(thoughts, str) and thoughts:
                self._thought_delta(thoughts, out)
            text = delta.get("content")
            if isinstance(text, str) and text:
                self._text_delta(text, _logprobs(choice), out)
            for call in delta.get("tool_calls") or []:
                if isinstance(call, dict):
                    self._call_delta(call, out)
            if choice.get("finish_reason"):
                self.finish_reason = choice["finish_reason"]

    def _thought_delta(self, text: str, out: list[bytes]) -> None:
        if self.thoughts is None:
            self._close_text(out)  # thoughts come first; should text precede, it ends
            self.thoughts = []
            self.thoughts_id = responses_api.new_id("rs")
            self.thoughts_index = len(self.items) + len(self.open_calls)
            out.append(self.counter.record(
                "response.output_item.added", output_index=self.thoughts_index,
                item=responses_api.reasoning_item(self.thoughts_id, [])))
            out.append(self.counter.record(
                "response.reasoning_summary_part.added", item_id=self.thoughts_id,
                output_index=self.thoughts_index, summary_index=0,
                part=responses_api.summary_part("")))
        self.thoughts.append(text)
        out.append(self.counter.record(
            "response.reasoning_summary_text.delta", item_id=self.thoughts_id,
            output_index=self.thoughts_index, summary_index=0, delta=text))

    def _close_thoughts(self, out: list[bytes]) -> None:
        if self.thoughts is None:
            return
        text, self.thoughts = "".join(self.thoughts), None
        where = {"item_id": self.thoughts_id, "output_index": self.thoughts_index,
                 "summary_index": 0}
        part = responses_api.summary_part(text)
        out.append(self.counter.record("response.reasoning_summary_text.done", text=text,
                                       **where))
        out.append(self.counter.record("response.reasoning_summary_part.done", part=part,
                                       **where))
        item = responses_api.reasoning_item(self.thoughts_id, [part])
        out.append(self.counter.record("response.output_item.done",
                                       output_index=self.thoughts_index, item=item))
        self.items.append(item)

    def _text_delta(self, text: str, logprobs: list[Any], out: list[bytes]) -> None:
        if self.text is None:
            self._close_thoughts(out)
            self.text = []
            self.text_id = responses_api.new_id("msg")
            self.text_index = len(self.items) + len(self.open_calls)
            out.append(self.counter.record(
                "response.output_item.added", output_index=self.text_index,
                item=responses_api.message_item(self.text_id, "in_progress", [])))
            out.append(self.counter.record(
                "response.content_part.added", item_id=self.text_id,
                output_index=self.text_index, content_index=0,
                part=responses_api.text_part("")))
        self.text.append(text)
        self.text_logprobs += logprobs
        out.append(self.counter.record(
            "response.output_text.delta", item_id=self.text_id, output_index=self.text_index,
            content_index=0, delta=text, logprobs=logprobs))

    def _call_delta(self, delta: dict[str, Any], out: list[bytes]) -> None:
        index = delta.get("index", 0)
        function = as_dict(delta.get("function"))
        call = self.calls.get(index)
        if call is None:
            self._close_thoughts(out)
            self._close_text(out)
            call = _Call(len(self.items) + len(self.open_calls),
                         str(delta.get("id") or f"call_{index}"), str(function.get("name")
                                                                     or ""))
            call.signature = thought_signature(delta)
            self.calls[index] = call
            self.open_calls.append(call)
            out.append(self.counter.record("response.output_item.added",
                                           output_index=call.index,
                                           item=call.item("", "in_progress")))
        arguments = function.get("arguments")
        if isinstance(arguments, str) and arguments:
            call.arguments.append(arguments)
            out.append(self.counter.record(
                "response.function_call_arguments.delta", item_id=call.item_id,
                output_index=call.index, delta=arguments))

    def _close_text(self, out: list[bytes]) -> None:
        if self.text is None:
            return
        text, self.text = "".join(self.text), None
        logprobs, self.text_logprobs = self.text_logprobs, []
        where = {"item_id": self.text_id, "output_index": self.text_index, "content_index": 0}
        part = responses_api.text_part(text, logprobs)
        out.append(self.counter.record("response.output_text.done", text=text,
                                       logprobs=logprobs, **where))
        out.append(self.counter.record("response.content_part.done", part=part, **where))
        item = responses_api.message_item(self.text_id, "completed", [part])
        out.append(self.counter.record("response.output_item.done",
                                       output_index=self.text_index, item=item))
        self.items.append(item)

    def finish(self) -> list[bytes]:
        """The events that close the response, after the upstream ended normally."""
        out: list[bytes] = []
        if self.failed:
            return out
        self._start(out)
        self._close_thoughts(out)
        self._close_text(out)
        for call in self.open_calls:
            arguments = "".join(call.arguments) or "{}"
            out.append(self.counter.record(
                "response.function_call_arguments.done", item_id=call.item_id,
                output_index=call.index, arguments=arguments))
            item = call.item(arguments, "completed")
            out.append(self.counter.record("response.output_item.done",
                                           output_index=call.index, item=item))
            self.items.append(item)
        self.open_calls = []
        reason = _INCOMPLETE.get(self.finish_reason or "")
        status = "incomplete" if reason else "completed"
        doc = self.shape.doc(status, self.items, self.usage, reason)
        out.append(self.counter.record(f"response.{status}", response=doc))
        return out

    def translate(self, batches: Iterator[list[dict[str, Any]]],
                  completed: Callable[[], bool]) -> Iterator[bytes]:
        """Translate ``batches`` of chunks (those of one upstream read each, whose events
        go out together); the closing events follow only when ``completed()`` says the
        upstream ended normally (a broken stream ended with an error)."""
        for chunks in batches:
            events = self.feed(chunks)
            if events:
                yield b"".join(events)
        if completed():
            yield b"".join(self.finish())
