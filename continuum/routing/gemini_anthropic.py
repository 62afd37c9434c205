"""The Anthropic Messages API (``/anthropic/v1/messages`` and ``.../count_tokens``) on
``type: gemini`` backends.

An Anthropic SDK pointed at the router (``base_url=http://<router>/anthropic``) reaches the
models of ``type: gemini`` backends as well as those of ``type: anthropic`` ones. Google
has no Messages endpoint, so the gateway (:mod:`continuum.routing.gemini_dispatch`)
translates, through the native API (``generateContent``, ``streamGenerateContent?alt=sse``,
``countTokens``) whatever ``prefer_native_api`` says, by way of the chat completion the
request stands for: the chat translation (:mod:`continuum.routing.gemini`) does the rest,
and the context cache serves these requests as it serves chat completions.

* **The request** becomes a chat completion (:func:`chat_body`):

  - ``system`` (a string, or text blocks) → system messages, Claude Code's attribution
    block (``x-anthropic-billing-header: …``) left out; a ``system`` message inside
    ``messages`` (Claude Code adds them along a conversation) → user text where it stands,
    so the prompt's head stays the same from turn to turn; each ``user`` and
    ``assistant`` message's blocks: ``text``; ``image`` (``base64`` or ``url`` source) →
    an image part; ``document`` with a ``base64`` source (a PDF) → inline data, with a
    ``text`` source → text; ``tool_use`` → the assistant's ``tool_calls``;
    ``tool_result`` → a ``tool`` message (its text; ``is_error`` sends it as
    ``{"error": text}``, the shape Google documents for a failed call); ``thinking`` and
    ``redacted_thinking`` blocks are dropped (Gemini cannot take them back: Gemini 3's
    signatures travel in the tool-use ids, as on the chat surface).
  - ``max_tokens``, ``temperature``, ``top_p`` as they are; ``top_k`` → ``topK``;
    ``stop_sequences`` → ``stop``; custom ``tools`` (``name``, ``description``,
    ``input_schema``) → function declarations whose schema goes as
    ``parametersJsonSchema`` (JSON Schema as the client wrote it, ``additionalProperties``
    included, which ``parameters``' OpenAPI subset refuses); ``tool_choice``
    ``auto``/``any``/``tool``/``none`` → Gemini's ``AUTO``/``ANY``/one allowed
    name/``NONE``; ``thinking`` ``enabled`` → a ``thinkingBudget`` of its
    ``budget_tokens`` with thought summaries, ``adaptive`` → the model's own budget with
    thought summaries, ``disabled`` → the least thinking the model allows
    (:func:`least_thinking`);
    ``output_config.format`` (or the earlier ``output_format``) of type ``json_schema`` →
    a JSON answer to that schema. ``metadata``, ``service_tier`` and
    ``inference_geo`` are not sent.
  - What cannot be translated is a 400 naming the field: Anthropic's own tool types
    (``bash``, ``text_editor``, ``web_search``, ``computer``…), ``mcp_servers``,
    ``container``, images inside a ``tool_result``, ``url`` documents, other block types.

* **The answer** becomes a ``message`` (:func:`message_from_chat`): a thought summary as a
  ``thinking`` block (with an empty ``signature``: Google gives none for summaries), the
  text as a ``text`` block, each function call as a ``tool_use`` block; ``stop_reason``
  ``end_turn``, ``max_tokens``, ``tool_use`` or ``refusal`` (Google's safety stops).
  ``usage`` follows Anthropic's convention, as the spec asks: ``input_tokens`` excludes
  the cached ones, which are ``cache_read_input_tokens`` (Google's
  ``cachedContentTokenCount``, from the router's ``cachedContents`` or Gemini's implicit
  caching alike); ``cache_creation_input_tokens`` is 0 (a ``cachedContents`` is created
  apart from any request and billed as storage); thinking tokens count as output.

* **A stream** becomes Anthropic's events (:class:`EventTranslator`): ``message_start``
  (with the prompt's usage, once Google reported it), a ``content_block_start``,
  ``content_block_delta`` (``thinking_delta``, ``text_delta``, ``input_json_delta``) and
  ``content_block_stop`` per block, ``message_delta`` with the stop reason and the final
  usage, ``message_stop``. An error record (Google's, or the router's when the upstream
  broke off) becomes an ``error`` event, after which nothing more is sent.

* **Counting tokens** goes to ``models/{m}:countTokens`` with the translated request as its
  ``generateContentRequest``; ``totalTokens`` comes back as ``input_tokens``.

* **Errors** come back in Anthropic's error shape (:func:`error_body`).
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Iterator
from typing import Any

from continuum.errors import RequestError
from continuum.prefix import BILLING_HEADER
from continuum.routing import anthropic, gemini
from continuum.routing.gemini import as_dict

#: Chat finish reasons → Anthropic's stop reasons.
_STOP_REASONS = {"stop": "end_turn", "length": "max_tokens", "tool_calls": "tool_use",
                 "content_filter": "refusal"}
#: Google's error statuses → Anthropic's error types, for an error record in a stream (a
#: client that retries Anthropic's ``overloaded_error`` retries Google's ``UNAVAILABLE``).
_STREAM_ERRORS = {
    "UNAVAILABLE": "overloaded_error", "RESOURCE_EXHAUSTED": "rate_limit_error",
    "DEADLINE_EXCEEDED": "timeout_error", "INVALID_ARGUMENT": "invalid_request_error",
    "FAILED_PRECONDITION": "invalid_request_error", "NOT_FOUND": "not_found_error",
    "PERMISSION_DENIED": "permission_error", "UNAUTHENTICATED": "authentication_error",
}
#: Anthropic ``tool_choice`` types → chat's.
_TOOL_CHOICES = {"auto": "auto", "any": "required", "none": "none"}
#: Request fields with no Gemini equivalent that a request may carry: not sent.
_DROPPED = frozenset({"metadata", "service_tier", "inference_geo"})
#: Request fields for features that run on Anthropic's side: refused, with the reason.
_REFUSED = {
    "mcp_servers": "MCP servers are connected by Anthropic's API, not by Gemini",
    "container": "code-execution containers are Anthropic's, not Gemini's",
}


def _refuse(message: str, param: str, code: str = "invalid_value") -> RequestError:
    return RequestError(message, param=param, code=code)


def _text(block: dict[str, Any], where: str) -> str:
    text = block.get("text")
    if not isinstance(text, str):
        raise _refuse(f"'{where}.text' must be a string", f"{where}.text", "invalid_type")
    return text


def _source_url(block: dict[str, Any], where: str) -> str:
    """An image's (or a base64 document's) source as the URL a chat image part takes: a
    ``data:`` URL for base64 data, else the ``url`` itself."""
    source = block.get("source")
    if not isinstance(source, dict):
        raise _refuse(f"'{where}.source' must be an object", f"{where}.source", "invalid_type")
    kind = source.get("type")
    if kind == "base64":
        media, data = source.get("media_type"), source.get("data")
        if not isinstance(media, str) or not media or not isinstance(data, str):
            raise _refuse(f"'{where}.source' of type base64 needs 'media_type' and 'data' "
                          "strings", f"{where}.source")
        return f"data:{media};base64,{data}"
    if kind == "url" and block.get("type") == "image":
        url = source.get("url")
        if not isinstance(url, str) or not url:
            raise _refuse(f"'{where}.source.url' must be a string", f"{where}.source.url",
                          "invalid_type")
        return url
    raise _refuse(f"'{where}.source.type' {kind!r} cannot be sent to a Gemini backend "
                  "(base64" + (" or url" if block.get("type") == "image" else "") + " can)",
                  f"{where}.source.type")


def _document(block: dict[str, Any], where: str) -> dict[str, Any]:
    source = block.get("source")
    if isinstance(source, dict) and source.get("type") == "text":
        data = source.get("data")
        if not isinstance(data, str):
            raise _refuse(f"'{where}.source.data' must be a string", f"{where}.source.data",
                          "invalid_type")
        return {"type": "text", "text": data}
    return {"type": "image_url", "image_url": {"url": _source_url(block, where)}}


def _result_text(block: dict[str, Any], where: str) -> str:
    """A ``tool_result``'s content as the text of a ``tool`` message."""
    content = block.get("content")
    if content is None:
        text = ""
    elif isinstance(content, str):
        text = content
    elif isinstance(content, list):
        texts = []
        for k, part in enumerate(content):
            inner = f"{where}.content[{k}]"
            if not isinstance(part, dict) or part.get("type") != "text":
                raise _refuse(f"'{inner}' must be a text block: a tool result sent to a "
                              "Gemini backend can hold text only", inner)
            texts.append(_text(part, inner))
        text = "\n".join(texts)
    else:
        raise _refuse(f"'{where}.content' must be a string or an array of blocks",
                      f"{where}.content", "invalid_type")
    if block.get("is_error") is True:
        return json.dumps({"error": text})
    return text


def _system_blocks(system: Any, where: str) -> list[str]:
    """The texts of a ``system`` value (a string, or text blocks), Claude Code's attribution
    block left out (:data:`~continuum.prefix.BILLING_HEADER`: Anthropic reads it, a model
    would only be confused by it, and its hash, new with each conversation, would defeat
    Google's caches)."""
    if isinstance(system, str):
        return [system] if system else []
    if not isinstance(system, list):
        raise _refuse(f"'{where}' must be a string or an array of text blocks", where,
                      "invalid_type")
    texts = []
    for k, block in enumerate(system):
        inner = f"{where}[{k}]"
        if not isinstance(block, dict) or block.get("type") != "text":
            raise _refuse(f"'{inner}' must be a text block", inner)
        text = _text(block, inner)
        if text and not text.startswith(BILLING_HEADER):
            texts.append(text)
    return texts


def _messages(messages: list[Any]) -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = []
    for i, message in enumerate(messages):
        role = message.get("role")
        if role == "system":
            # Claude Code adds system messages along the conversation; moved up into
            # systemInstruction they would change the prompt's head at every turn (and make
            # the context cache ineligible): a user text where they stand keeps the prompt
            # an extension of the last one (the chat translation merges it into its turn)
            out += [{"role": "user", "content": [{"type": "text", "text": text}]}
                    for text in _system_blocks(message.get("content"),
                                               f"messages[{i}].content")]
            continue
        if role not in ("user", "assistant"):
            raise _refuse(f"'messages[{i}].role' must be 'user', 'assistant' or 'system'",
                          f"messages[{i}].role")
        content = message.get("content")
        if isinstance(content, str):
            out.append({"role": role, "content": content})
            continue
        if not isinstance(content, list):
            raise _refuse(f"'messages[{i}].content' must be a string or an array of blocks",
                          f"messages[{i}].content", "invalid_type")
        parts: list[dict[str, Any]] = []
        calls: list[dict[str, Any]] = []
        results: list[dict[str, Any]] = []
        for j, block in enumerate(content):
            where = f"messages[{i}].content[{j}]"
            if not isinstance(block, dict):
                raise _refuse(f"'{where}' must be an object", where, "invalid_type")
            kind = block.get("type")
            if kind == "text":
                parts.append({"type": "text", "text": _text(block, where)})
            elif kind == "image":
                parts.append({"type": "image_url", "image_url": {"url": _source_url(block,
                                                                                   where)}})
            elif kind == "document":
                parts.append(_document(block, where))
            elif kind == "tool_use" and role == "assistant":
                calls.append(_call(block, where))
            elif kind == "tool_result" and role == "user":
                call_id = block.get("tool_use_id")
                if not isinstance(call_id, str) or not call_id:
                    raise _refuse(f"'{where}.tool_use_id' must be a string",
                                  f"{where}.tool_use_id", "invalid_type")
                results.append({"role": "tool", "tool_call_id": call_id,
                                "content": _result_text(block, where)})
            elif kind in ("thinking", "redacted_thinking") and role == "assistant":
                continue
            else:
                raise _refuse(f"'{where}.type' {kind!r} cannot be sent to a Gemini backend "
                              f"in a {role} message", f"{where}.type")
        if role == "assistant":
            if parts or calls:
                turn: dict[str, Any] = {"role": "assistant", "content": parts or None}
                if calls:
                    turn["tool_calls"] = calls
                out.append(turn)
        else:
            out.extend(results)  # the answers to the calls come first, as Anthropic has them
            if parts:
                out.append({"role": "user", "content": parts})
    return out


def _call(block: dict[str, Any], where: str) -> dict[str, Any]:
    call_id, name, given = block.get("id"), block.get("name"), block.get("input", {})
    if not isinstance(call_id, str) or not isinstance(name, str) or not name:
        raise _refuse(f"'{where}' must be a tool_use block with 'id' and 'name' strings",
                      where, "invalid_type")
    if not isinstance(given, dict):
        raise _refuse(f"'{where}.input' must be an object", f"{where}.input", "invalid_type")
    return {"id": call_id, "type": "function",
            "function": {"name": name, "arguments": json.dumps(given)}}


def _tools(tools: Any) -> list[dict[str, Any]]:
    if not isinstance(tools, list):
        raise _refuse("'tools' must be an array", "tools", "invalid_type")
    out = []
    for k, tool in enumerate(tools):
        where = f"tools[{k}]"
        if not isinstance(tool, dict):
            raise _refuse(f"'{where}' must be an object", where, "invalid_type")
        kind = tool.get("type")
        if kind not in (None, "custom"):
            raise _refuse(f"'{where}' is Anthropic's {kind!r} tool, which a Gemini backend "
                          "cannot run: only custom tools (name, description, input_schema) "
                          "are translated", f"{where}.type")
        name, schema = tool.get("name"), tool.get("input_schema")
        if not isinstance(name, str) or not name:
            raise _refuse(f"'{where}.name' must be a string", f"{where}.name", "invalid_type")
        if schema is not None and not isinstance(schema, dict):
            raise _refuse(f"'{where}.input_schema' must be an object",
                          f"{where}.input_schema", "invalid_type")
        function: dict[str, Any] = {"name": name}
        if isinstance(tool.get("description"), str):
            function["description"] = tool["description"]
        if schema is not None:
            function["parameters"] = schema
        out.append({"type": "function", "function": function})
    return out


def _tool_choice(choice: Any) -> Any:
    kind = choice.get("type") if isinstance(choice, dict) else None
    if kind in _TOOL_CHOICES:
        return _TOOL_CHOICES[kind]
    if kind == "tool" and isinstance(choice.get("name"), str):
        return {"type": "function", "function": {"name": choice["name"]}}
    raise _refuse("'tool_choice' must be an object of type auto, any, none, or tool (with "
                  "a 'name')", "tool_choice")


def least_thinking(model: str) -> dict[str, Any] | None:
    """The ``thinking_config`` asking ``model`` for the least thinking it allows, or None
    for a model this does not know to think (nothing is sent: the model's own default).
    Gemini 2.5 models think by budget, 0 turning it off except on 2.5 Pro, whose least is
    128; later models by level, whose least is ``minimal`` except on Pro models (``low``).
    Google refuses the others (a budget of 0 on 2.5 Pro, ``minimal`` on 3 Pro)."""
    name = model.removeprefix("models/")
    if name.startswith("gemini-2.5-pro"):
        return {"thinking_budget": 128}
    if name.startswith("gemini-2.5"):
        return {"thinking_budget": 0}
    if not name.startswith("gemini-") or name.startswith(("gemini-1", "gemini-2")):
        return None
    return {"thinking_level": "low" if "-pro" in name else "minimal"}


def _thinking(thinking: Any, chat: dict[str, Any]) -> None:
    kind = thinking.get("type") if isinstance(thinking, dict) else None
    if kind == "disabled":
        least = least_thinking(str(chat.get("model") or ""))
        if least is not None:
            chat["extra_body"] = {"google": {"thinking_config": least}}
        return
    if kind == "adaptive":
        config: dict[str, Any] = {"include_thoughts": True}
    elif kind == "enabled":
        budget = thinking.get("budget_tokens")
        if type(budget) is not int or budget < 0:
            raise _refuse("'thinking.budget_tokens' must be a non-negative integer",
                          "thinking.budget_tokens", "invalid_type")
        config = {"thinking_budget": budget, "include_thoughts": True}
    else:
        raise _refuse("'thinking.type' must be enabled, adaptive or disabled",
                      "thinking.type")
    chat["extra_body"] = {"google": {"thinking_config": config}}


def _output_format(body: dict[str, Any]) -> tuple[Any, str] | None:
    config = body.get("output_config")
    if isinstance(config, dict) and config.get("format") is not None:
        return config["format"], "output_config.format"
    if body.get("output_format") is not None:
        return body["output_format"], "output_format"
    return None


def chat_body(body: dict[str, Any]) -> dict[str, Any]:
    """The chat completion an Anthropic Messages (or count-tokens) ``body`` stands for.

    Raises:
        RequestError: what cannot be translated, named by ``param`` (see the module doc).
    """
    for name, reason in _REFUSED.items():
        if body.get(name):
            raise _refuse(f"'{name}' cannot be used with a Gemini backend: {reason}", name)
    system = body.get("system")
    messages: list[dict[str, Any]] = [] if system is None else [
        {"role": "system", "content": text} for text in _system_blocks(system, "system")]
    messages += _messages(body.get("messages") or [])
    chat: dict[str, Any] = {"model": body.get("model"), "messages": messages}
    for name in ("max_tokens", "temperature", "top_p", "stream"):
        if body.get(name) is not None:
            chat[name] = body[name]
    top_k = body.get("top_k")
    if type(top_k) is int and top_k > 0:
        chat["top_k"] = top_k
    if body.get("stop_sequences"):
        chat["stop"] = body["stop_sequences"]
    if body.get("tools"):
        chat["tools"] = _tools(body["tools"])
    if body.get("tool_choice") is not None:
        chat["tool_choice"] = _tool_choice(body["tool_choice"])
    if body.get("thinking") is not None:
        _thinking(body["thinking"], chat)
    found = _output_format(body)
    if found is not None:
        fmt, where = found
        if not isinstance(fmt, dict) or fmt.get("type") != "json_schema" or \
                not isinstance(fmt.get("schema"), dict):
            raise _refuse(f"'{where}' must be of type json_schema with a 'schema' object",
                          where)
        chat["response_format"] = {"type": "json_schema",
                                   "json_schema": {"schema": fmt["schema"]}}
    return chat


def to_native(chat: dict[str, Any], cached_content: str | None = None) -> dict[str, Any]:
    """The ``GenerateContentRequest`` for a translated ``chat`` body: the chat translation's,
    with ``topK`` and each declaration's schema as ``parametersJsonSchema``.

    Raises:
        RequestError: as :func:`continuum.routing.gemini.to_native`.
    """
    native = gemini.to_native(chat, cached_content)
    if "top_k" in chat:
        native.setdefault("generationConfig", {})["topK"] = chat["top_k"]
    for tool in native.get("tools") or []:
        for declaration in tool.get("functionDeclarations") or []:
            if "parameters" in declaration:
                declaration["parametersJsonSchema"] = declaration.pop("parameters")
    return native


def count_request(chat: dict[str, Any], model: str) -> dict[str, Any]:
    """The ``countTokens`` body for a translated count-tokens ``chat`` body."""
    native = to_native(chat)
    native.pop("generationConfig", None)
    return {"generateContentRequest": {"model": "models/" + model.removeprefix("models/"),
                                       **native}}


def count_answer(doc: dict[str, Any]) -> dict[str, Any]:
    """Anthropic's count-tokens answer for Google's ``countTokens`` one."""
    return {"input_tokens": gemini.tokens(doc.get("totalTokens"))}


def usage(chat_usage: Any) -> dict[str, Any]:
    """Anthropic's ``usage`` for a chat ``usage``: cached tokens apart from the rest."""
    given = chat_usage if isinstance(chat_usage, dict) else {}
    prompt = gemini.tokens(given.get("prompt_tokens"))
    details = given.get("prompt_tokens_details")
    cached = min(gemini.tokens(details.get("cached_tokens")) if isinstance(details, dict)
                 else 0, prompt)
    return {"input_tokens": prompt - cached, "cache_creation_input_tokens": 0,
            "cache_read_input_tokens": cached,
            "output_tokens": gemini.tokens(given.get("completion_tokens"))}


def _message_id(chat_id: Any) -> str:
    text = str(chat_id or "")
    return "msg_" + (text.removeprefix("chatcmpl-") or str(int(time.time() * 1e6)))


def _input(arguments: Any) -> Any:
    try:
        value = json.loads(arguments) if isinstance(arguments, str) and arguments else {}
    except ValueError:
        return {"arguments": arguments}
    return value if isinstance(value, dict) else {"value": value}


def stop_reason(finish: Any) -> str:
    """Anthropic's ``stop_reason`` for a chat ``finish_reason``."""
    return _STOP_REASONS.get(finish, "end_turn") if isinstance(finish, str) else "end_turn"


def message_from_chat(answer: dict[str, Any], model: str) -> dict[str, Any]:
    """A Messages API ``message`` for a (translated) chat completion."""
    choices = answer.get("choices") or []
    choice = as_dict(choices[0]) if choices else {}
    message = as_dict(choice.get("message"))
    content: list[dict[str, Any]] = []
    if message.get("reasoning_content"):
        content.append({"type": "thinking", "thinking": message["reasoning_content"],
                        "signature": ""})
    if message.get("content"):
        content.append({"type": "text", "text": message["content"]})
    for call in message.get("tool_calls") or []:
        function = as_dict(call.get("function"))
        content.append({"type": "tool_use", "id": call.get("id", ""),
                        "name": function.get("name", ""),
                        "input": _input(function.get("arguments"))})
    return {"id": _message_id(answer.get("id")), "type": "message", "role": "assistant",
            "model": answer.get("model") or model, "content": content,
            "stop_reason": stop_reason(choice.get("finish_reason")), "stop_sequence": None,
            "usage": usage(answer.get("usage"))}


def error_body(status: int, data: bytes) -> bytes:
    """An Anthropic error document for a Google error answer (its message kept)."""
    error = gemini.google_error(data)
    message = "" if error is None else str(error.get("message", ""))
    if not message:
        message = data[:1024].decode("utf-8", "replace").strip() or f"upstream status {status}"
    return anthropic.error_document(status, message)


def _event(kind: str, doc: dict[str, Any]) -> bytes:
    return b"event: " + kind.encode() + b"\ndata: " + \
        json.dumps({"type": kind, **doc}, separators=(",", ":")).encode() + b"\n\n"


class EventTranslator:
    """``chat.completion.chunk`` documents in (as :class:`~continuum.routing.gemini.NativeStream`
    makes them from Google's records), Anthropic's stream events out."""

    def __init__(self, model: str) -> None:
        self.model = model
        self.id = _message_id(None)
        self.started = False
        self.failed = False
        self.index = -1  #: the open block's index
        self.open: str | None = None  #: its type: thinking, text or tool_use
        self.finish: str | None = None

    def _start(self, prompt_usage: dict[str, Any] | None, out: list[bytes]) -> None:
        if self.started:
            return
        self.started = True
        start_usage = usage(prompt_usage)
        start_usage["output_tokens"] = 0
        out.append(_event("message_start", {"message": {
            "id": self.id, "type": "message", "role": "assistant", "model": self.model,
            "content": [], "stop_reason": None, "stop_sequence": None,
            "usage": start_usage}}))

    def _open(self, kind: str, block: dict[str, Any], out: list[bytes]) -> None:
        self._close(out)
        self.index += 1
        self.open = kind
        out.append(_event("content_block_start", {"index": self.index,
                                                  "content_block": block}))

    def _close(self, out: list[bytes]) -> None:
        if self.open is not None:
            out.append(_event("content_block_stop", {"index": self.index}))
            self.open = None

    def _delta(self, delta: dict[str, Any], out: list[bytes]) -> None:
        out.append(_event("content_block_delta", {"index": self.index, "delta": delta}))

    def feed(self, chunks: list[dict[str, Any]], prompt_usage: dict[str, Any] | None
             ) -> list[bytes]:
        """The events ``chunks`` make; ``prompt_usage`` is the last chat ``usage`` Google
        reported (``message_start`` carries its prompt counts)."""
        out: list[bytes] = []
        for doc in chunks:
            if self.failed:
                break
            error = doc.get("error")
            if error is not None:
                self.failed = True
                error = error if isinstance(error, dict) else {"message": error}
                out.append(_event("error", {"error": {
                    "type": _STREAM_ERRORS.get(str(error.get("code")), "api_error"),
                    "message": str(error.get("message") or "")}}))
                break
            if not self.started:  # the message's id and model are those of its first record
                self.id = _message_id(doc.get("id"))
                if isinstance(doc.get("model"), str):
                    self.model = doc["model"]
                self._start(prompt_usage, out)
            for choice in doc.get("choices") or []:
                if isinstance(choice, dict) and choice.get("index", 0) == 0:
                    self._choice(choice, out)
        return out

    def _choice(self, choice: dict[str, Any], out: list[bytes]) -> None:
        delta = as_dict(choice.get("delta"))
        thoughts = delta.get("reasoning_content")
        if isinstance(thoughts, str) and thoughts:
            if self.open != "thinking":
                self._open("thinking", {"type": "thinking", "thinking": "", "signature": ""},
                           out)
            self._delta({"type": "thinking_delta", "thinking": thoughts}, out)
        text = delta.get("content")
        if isinstance(text, str) and text:
            if self.open != "text":
                self._open("text", {"type": "text", "text": ""}, out)
            self._delta({"type": "text_delta", "text": text}, out)
        for call in delta.get("tool_calls") or []:  # Gemini sends each call whole
            if not isinstance(call, dict):
                continue
            function = as_dict(call.get("function"))
            self._open("tool_use", {"type": "tool_use", "id": str(call.get("id") or ""),
                                    "name": str(function.get("name") or ""), "input": {}},
                       out)
            arguments = function.get("arguments")
            self._delta({"type": "input_json_delta", "partial_json":
                         arguments if isinstance(arguments, str) else ""}, out)
        if choice.get("finish_reason"):
            self.finish = choice["finish_reason"]

    def end(self, final_usage: dict[str, Any] | None) -> list[bytes]:
        """The events that close the message, after the upstream ended normally."""
        out: list[bytes] = []
        if self.failed:
            return out
        self._start(final_usage, out)
        self._close(out)
        out.append(_event("message_delta", {
            "delta": {"stop_reason": stop_reason(self.finish), "stop_sequence": None},
            "usage": usage(final_usage)}))
        out.append(_event("message_stop", {}))
        return out

    def translate(self, pieces: Iterator[bytes], native: gemini.NativeStream,
                  completed: Callable[[], bool]) -> Iterator[bytes]:
        """Translate Google's records in ``pieces`` (the events of one upstream read go out
        together); the closing events follow only when ``completed()`` says the upstream
        ended normally; a broken stream ends with an error event (the router's own, when
        it did not come through Google's records: :func:`~continuum.routing.gemini.broken_off`)."""
        for piece in pieces:
            events = self.feed(native.chunks(piece), native.usage)
            if events:
                yield b"".join(events)
        events = self.end(native.usage) if completed() else \
            self.feed(native.ended_early(), None)
        if events:
            yield b"".join(events)
