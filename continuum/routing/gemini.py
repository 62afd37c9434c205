"""Gemini's native API in OpenAI terms: request, answer and stream translation.

With ``gemini_context_cache.prefer_native_api`` a chat completion for a ``type: gemini``
backend goes to ``models/{m}:generateContent`` (``:streamGenerateContent?alt=sse`` when
streamed); these functions translate both ways:

* messages → ``contents`` (``user``/``model`` turns; assistant ``tool_calls`` →
  ``functionCall`` parts, ``tool`` messages → ``functionResponse`` parts) and the system and
  developer messages → ``systemInstruction``;
* sampling parameters → ``generationConfig``; ``tools`` → ``functionDeclarations``;
  ``tool_choice`` → ``toolConfig.functionCallingConfig``;
* ``reasoning_effort`` → ``generationConfig.thinkingConfig`` (:func:`thinking_config`): a
  ``thinkingBudget`` for Gemini 2.x models, a ``thinkingLevel`` for later ones; or, as on
  Google's OpenAI-compatible surface, ``extra_body.google.thinking_config`` as it is given.
  Thought summaries (``includeThoughts``) come back as the message's ``reasoning_content``;
* the client's own ``extra_body.google.cached_content`` (a ``cachedContents/…`` name, the
  OpenAI-compatible way to reference a cache) → top-level ``cachedContent``, and
  ``extra_body.google.safety_settings`` → ``safetySettings`` (:func:`google_fields`); the
  request is otherwise translated as it is (its system messages still become
  ``systemInstruction``: a client that references its own cache leaves them out, as it
  would on Google's OpenAI-compatible surface);
* a function call's ``thoughtSignature`` (Gemini 3 signs its calls and refuses a
  conversation that does not give the signatures back) ↔ the tool call's
  ``extra_content.google.thought_signature``, where Google's OpenAI-compatible surface
  puts it, so a client written for that surface round-trips it unchanged; and, for the
  many clients that keep only a tool call's ``id`` (LangChain's ``ChatOpenAI`` rebuilds
  its calls from its own fields), inside the id itself (:func:`tool_call_id`). A function
  call that comes back with neither, one another model made say, goes to a model that
  checks signatures with the value Google documents for calls it did not make
  (:data:`UNSIGNED`), instead of failing the conversation;
* ``candidates`` → ``choices`` with their finish reasons (a prompt Google blocked, which
  has none, → one empty choice with ``content_filter``) and, asked for with ``logprobs``
  and ``top_logprobs``, their ``logprobsResult`` as ``logprobs.content`` (each chosen
  token with its step's top candidates); ``usageMetadata`` → ``usage``, where
  ``prompt_tokens`` stays the whole prompt (Google's ``promptTokenCount`` includes cached
  tokens) and ``prompt_tokens_details.cached_tokens`` is ``cachedContentTokenCount``, from a
  ``cachedContents`` hit or Gemini 2.5+'s implicit caching alike;
* ``alt=sse`` records → ``chat.completion.chunk`` events, then one usage chunk (which the
  service passes on only to a client that asked for it with
  ``stream_options.include_usage``) and ``[DONE]``; Google's error bodies → OpenAI's.

Everything else a client sends that has no native equivalent is dropped (``user``,
``store``, ``metadata``…); ``logit_bias`` has no meaning here.
"""

from __future__ import annotations

import json
import mimetypes
import re
import secrets
import time
from collections.abc import Iterator
from typing import Any

from continuum.errors import RequestError
from continuum.prefix import content_text
from continuum.wire.sse import SseParser

_SYSTEM_ROLES = ("system", "developer")
FINISH_REASONS = {
    "STOP": "stop", "MAX_TOKENS": "length", "SAFETY": "content_filter",
    "RECITATION": "content_filter", "BLOCKLIST": "content_filter",
    "PROHIBITED_CONTENT": "content_filter", "SPII": "content_filter",
    "IMAGE_SAFETY": "content_filter", "LANGUAGE": "content_filter",
}
_GENERATION_KEYS = (
    ("temperature", "temperature"), ("top_p", "topP"), ("n", "candidateCount"),
    ("presence_penalty", "presencePenalty"), ("frequency_penalty", "frequencyPenalty"),
    ("seed", "seed"), ("logprobs", "responseLogprobs"), ("top_logprobs", "logprobs"),
)
_TOOL_MODES = {"none": "NONE", "auto": "AUTO", "required": "ANY"}
#: ``reasoning_effort`` as a Gemini 2.x thinking budget: Google's OpenAI-compatible surface
#: maps low, medium and high to 1K, 8K and 24K tokens, and none to 0 (thinking off).
_BUDGETS = {"none": 0, "minimal": 1024, "low": 1024, "medium": 8192, "high": 24576,
            "xhigh": 24576, "max": 24576}
#: ... and as a thinking level for later models, of the four Gemini 3 defines (they
#: cannot turn thinking off: ``none`` asks for the least there is; OpenAI's levels above
#: ``high`` ask for the most). Which levels a model takes is Google's to say.
_LEVELS = {"none": "minimal", "minimal": "minimal", "low": "low", "medium": "medium",
           "high": "high", "xhigh": "high", "max": "high"}


def system_prompt(body: dict[str, Any]) -> str | None:
    """The whole system prompt of an OpenAI chat body: its leading system/developer
    messages' text joined with ``\\n``; None when it has none, when one of them is not
    plain text, or when a system message comes later in the conversation (it could not be
    moved into a cache without changing the conversation)."""
    messages = body.get("messages")
    if not isinstance(messages, list):
        return None
    texts: list[str] = []
    leading = True
    for message in messages:
        if not isinstance(message, dict):
            return None
        if message.get("role") in _SYSTEM_ROLES:
            if not leading:
                return None
            content = message.get("content")
            text = content_text(content)
            if text is None or (isinstance(content, list) and any(
                    not isinstance(p, dict) or p.get("type", "text") != "text"
                    for p in content)):
                return None
            texts.append(text)
        else:
            leading = False
    return "\n".join(texts) if texts else None


def without_system(body: dict[str, Any]) -> dict[str, Any]:
    """``body`` without its (leading) system and developer messages."""
    messages = [m for m in body.get("messages", [])
                if not (isinstance(m, dict) and m.get("role") in _SYSTEM_ROLES)]
    return {**body, "messages": messages}


def _parts(content: Any) -> list[dict[str, Any]]:
    if isinstance(content, str):
        return [{"text": content}] if content else []
    parts: list[dict[str, Any]] = []
    for part in content if isinstance(content, list) else []:
        if not isinstance(part, dict):
            continue
        kind = part.get("type", "text")
        if kind in ("text", "input_text") and isinstance(part.get("text"), str):
            parts.append({"text": part["text"]})
        elif kind == "image_url":
            url = part.get("image_url")
            url = url.get("url") if isinstance(url, dict) else url
            if isinstance(url, str) and url.startswith("data:") and ";base64," in url:
                mime, _, data = url[5:].partition(";base64,")
                parts.append({"inlineData": {"mimeType": mime, "data": data}})
            elif isinstance(url, str):
                parts.append({"fileData": _file_data(url)})
    return parts


def _file_data(url: str) -> dict[str, str]:
    """A ``fileData`` part's body for an image URL: Google's ``FileData`` requires a
    ``mimeType`` beside the ``fileUri``, read here off the URL's path (``image/jpeg`` when
    its extension names no image type)."""
    path = url.split("?", 1)[0].split("#", 1)[0]
    mime = mimetypes.guess_type(path)[0]
    if mime is None or not mime.startswith("image/"):
        mime = "image/jpeg"
    return {"mimeType": mime, "fileUri": url}


def _arguments(raw: Any) -> Any:
    if isinstance(raw, str):
        try:
            return json.loads(raw) if raw else {}
        except ValueError:
            return {"arguments": raw}
    return raw if isinstance(raw, dict) else {}


def thought_signature(call: Any) -> str | None:
    """The Gemini signature an OpenAI tool call carries
    (``extra_content.google.thought_signature``), or None."""
    extra = call.get("extra_content") if isinstance(call, dict) else None
    google = extra.get("google") if isinstance(extra, dict) else None
    signature = google.get("thought_signature") if isinstance(google, dict) else None
    return signature if isinstance(signature, str) else None


#: What follows this in a tool call's id is Gemini's signature of the call, in base64's
#: URL-safe alphabet without padding, so that the id stays ``[A-Za-z0-9_-]``.
_SIGNATURE_MARK = "__sig_"
#: Canonical base64 (padded, standard alphabet): what Google sends and what the id can
#: carry and give back unchanged.
_BASE64 = re.compile(r"(?:[A-Za-z0-9+/]{4})*(?:[A-Za-z0-9+/]{2}==|[A-Za-z0-9+/]{3}=)?")
_URLSAFE_TAIL = re.compile(r"[A-Za-z0-9_-]+")
#: The signature Google documents for a function call the model did not make (history
#: from another model, or a client that kept neither the signature nor the id): Gemini 3
#: then skips its check of that call instead of refusing the conversation.
UNSIGNED = "skip_thought_signature_validator"


def tool_call_id(given: Any, signature: Any) -> str:
    """The OpenAI id of a Gemini function call: Gemini's own ``id`` when it gave one, else a
    new unique one, with the call's ``signature`` inside when it has a canonical one
    (:func:`id_signature` reads it back)."""
    base = given if isinstance(given, str) and given else "call_" + secrets.token_hex(12)
    if isinstance(signature, str) and signature and _BASE64.fullmatch(signature):
        base += _SIGNATURE_MARK + signature.rstrip("=").replace("+", "-").replace("/", "_")
    return base


def id_signature(call_id: Any) -> str | None:
    """The signature :func:`tool_call_id` put in ``call_id``, or None."""
    if not isinstance(call_id, str):
        return None
    tail = call_id.partition(_SIGNATURE_MARK)[2]
    if not tail or len(tail) % 4 == 1 or _URLSAFE_TAIL.fullmatch(tail) is None:
        return None
    signature = tail.replace("-", "+").replace("_", "/")
    return signature + "=" * (-len(signature) % 4)


def checks_signatures(model: str) -> bool:
    """Whether ``model`` refuses a function call without its signature: Gemini models
    after 2.x."""
    name = model.removeprefix("models/")
    return name.startswith("gemini-") and not name.startswith(("gemini-1", "gemini-2"))


def signed(signature: Any) -> dict[str, Any]:
    """The ``extra_content`` carrying a Gemini signature (empty without one)."""
    if not isinstance(signature, str):
        return {}
    return {"extra_content": {"google": {"thought_signature": signature}}}


def _calls(message: dict[str, Any], where: str) -> list[tuple[dict[str, Any],
                                                               dict[str, Any]]]:
    """An assistant message's tool calls with their functions.

    Raises:
        RequestError: ``tool_calls`` is not an array of calls with a ``function`` object.
    """
    calls = message.get("tool_calls") or []
    if not isinstance(calls, list):
        raise RequestError(f"'{where}.tool_calls' must be an array", param=f"{where}.tool_calls",
                           code="invalid_type")
    out = []
    for k, call in enumerate(calls):
        function = call.get("function") if isinstance(call, dict) else None
        if not isinstance(function, dict):
            raise RequestError(f"'{where}.tool_calls[{k}]' must be a tool call with a "
                               "'function' object", param=f"{where}.tool_calls[{k}]",
                               code="invalid_type")
        out.append((call, function))
    return out


def _contents(messages: list[Any], model: str) -> list[dict[str, Any]]:
    """The conversation as ``contents``; consecutive turns of one role are merged. A
    function call's signature is the one its ``extra_content`` carries, else the one in its
    id; for a ``model`` that checks signatures, the first call of a model turn that has
    neither (the one Gemini checks) is sent as :data:`UNSIGNED`.

    Raises:
        RequestError: an assistant message's ``tool_calls`` cannot be read (:func:`_calls`).
    """
    names: dict[str, str] = {}
    out: list[dict[str, Any]] = []
    for i, message in enumerate(messages):
        if not isinstance(message, dict) or message.get("role") in _SYSTEM_ROLES:
            continue
        role = message.get("role")
        if role == "assistant":
            turn, parts = "model", _parts(message.get("content"))
            for call, function in _calls(message, f"messages[{i}]"):
                name = str(function.get("name", ""))
                names[str(call.get("id", ""))] = name
                part: dict[str, Any] = {"functionCall": {
                    "name": name, "args": _arguments(function.get("arguments"))}}
                signature = thought_signature(call) or id_signature(call.get("id"))
                if signature is not None:
                    part["thoughtSignature"] = signature
                parts.append(part)
        elif role == "tool":
            turn = "user"
            name = names.get(str(message.get("tool_call_id", "")), message.get("name") or "")
            parts = [{"functionResponse": {"name": name, "response": tool_response(
                content_text(message.get("content")) or "")}}]
        else:
            turn, parts = "user", _parts(message.get("content"))
        if not parts:
            continue
        if out and out[-1]["role"] == turn:
            out[-1]["parts"].extend(parts)
        else:
            out.append({"role": turn, "parts": parts})
    if checks_signatures(model):
        for content in out:
            first = next((part for part in content["parts"] if "functionCall" in part), None)
            if first is not None and "thoughtSignature" not in first:
                first["thoughtSignature"] = UNSIGNED
    return out


def _no_constant(name: str) -> Any:
    raise ValueError(f"{name} is not JSON")


def tool_response(text: str) -> dict[str, Any]:
    """A ``functionResponse.response`` for a tool's result ``text``: the object itself when
    the text is a JSON object (strict JSON: ``NaN`` and ``Infinity``, which would make the
    request invalid JSON, leave it text), else ``{"content": text}`` with the text as it is
    (a result of ``1.50`` or ``true`` is the tool's text, not a number to reformat)."""
    if text.startswith("{"):
        try:
            result = json.loads(text, parse_constant=_no_constant)
        except ValueError:
            result = None
        if isinstance(result, dict):
            return result
    return {"content": text}


def _generation_config(body: dict[str, Any]) -> dict[str, Any]:
    config: dict[str, Any] = {}
    for ours, theirs in _GENERATION_KEYS:
        if body.get(ours) is not None:
            config[theirs] = body[ours]
    limit = body.get("max_completion_tokens", body.get("max_tokens"))
    if limit is not None:
        config["maxOutputTokens"] = limit
    stop = body.get("stop")
    if stop is not None:
        config["stopSequences"] = [stop] if isinstance(stop, str) else list(stop)
    fmt = body.get("response_format")
    if isinstance(fmt, dict) and fmt.get("type") in ("json_object", "json_schema"):
        config["responseMimeType"] = "application/json"
        described = fmt.get("json_schema") or {}
        if not isinstance(described, dict):
            raise RequestError("'response_format.json_schema' must be an object",
                               param="response_format.json_schema", code="invalid_type")
        schema = described.get("schema")
        if schema is not None:
            config["responseJsonSchema"] = schema
    return config


def thinking_config(body: dict[str, Any], model: str) -> dict[str, Any] | None:
    """The ``thinkingConfig`` for a chat ``body`` to ``model``, or None (the model's own
    default).

    ``extra_body.google.thinking_config`` (Google's OpenAI-compatible spelling) goes as it
    is, its keys in the native API's camel case; ``reasoning_effort`` is mapped to a
    ``thinkingBudget`` for ``gemini-2…`` models, which think by budget, and to a
    ``thinkingLevel`` for the rest (beside the config's ``includeThoughts``).

    Raises:
        RequestError: ``reasoning_effort`` is not one of OpenAI's levels, or is given
            together with a ``thinking_config`` that sets a budget or a level (Google
            refuses the two together too; ``include_thoughts`` goes with either).
    """
    effort = body.get("reasoning_effort")
    extra = body.get("extra_body")
    google = extra.get("google") if isinstance(extra, dict) else None
    given = google.get("thinking_config") if isinstance(google, dict) else None
    if given is not None and not isinstance(given, dict):
        raise RequestError("extra_body.google.thinking_config must be an object",
                           param="extra_body.google.thinking_config")
    config = {_camel(key): value for key, value in (given or {}).items()}
    if effort is None:
        return config or None
    if "thinkingBudget" in config or "thinkingLevel" in config:
        raise RequestError("'reasoning_effort' and a thinking budget or level in "
                           "extra_body.google.thinking_config cannot be used together",
                           param="reasoning_effort")
    if not isinstance(effort, str) or effort not in _LEVELS:
        raise RequestError(f"'reasoning_effort' must be one of {', '.join(_LEVELS)}",
                           param="reasoning_effort", code="invalid_value")
    if model.removeprefix("models/").startswith("gemini-2"):
        return {"thinkingBudget": _BUDGETS[effort], **config}
    return {"thinkingLevel": _LEVELS[effort], **config}


def _google(body: dict[str, Any]) -> dict[str, Any]:
    """The client's ``extra_body.google`` (empty when it gave none).

    Raises:
        RequestError: ``extra_body`` or ``extra_body.google`` is given but is not an object.
    """
    extra = body.get("extra_body")
    if extra is not None and not isinstance(extra, dict):
        raise RequestError("extra_body must be an object", param="extra_body",
                           code="invalid_type")
    google = extra.get("google") if extra is not None else None
    if google is None:
        return {}
    if not isinstance(google, dict):
        raise RequestError("extra_body.google must be an object", param="extra_body.google",
                           code="invalid_type")
    return google


def client_cached_content(body: dict[str, Any]) -> Any:
    """The cache the client references itself (``extra_body.google.cached_content``, of any
    type), or None when it references none. A request with one is the client's to manage:
    the context-cache manager neither adds its own reference nor strips its system prompt.

    Raises:
        RequestError: ``extra_body`` or ``extra_body.google`` is given but is not an object
            (checked before the manager is asked: the reference it would inject goes in
            there).
    """
    return _google(body).get("cached_content")


def google_fields(body: dict[str, Any]) -> dict[str, Any]:
    """The native request's fields from the client's ``extra_body.google``, Google's
    OpenAI-compatible spelling: ``cached_content`` → ``cachedContent`` (a
    ``cachedContents/…`` name) and ``safety_settings`` → ``safetySettings`` (each setting's
    keys in camel case: ``category``, ``threshold``, ``method``). Which categories and
    thresholds exist, and whether the cache exists, is Google's to say.

    Raises:
        RequestError: naming the field: ``cached_content`` is not a non-empty string,
            ``safety_settings`` is not an array of objects, or a setting's ``category`` or
            ``threshold`` is not a string.
    """
    google = _google(body)
    fields: dict[str, Any] = {}
    cached = google.get("cached_content")
    if cached is not None:
        if not isinstance(cached, str) or not cached:
            raise RequestError("extra_body.google.cached_content must be a string naming a "
                               "cache ('cachedContents/...')",
                               param="extra_body.google.cached_content", code="invalid_type")
        fields["cachedContent"] = cached
    settings = google.get("safety_settings")
    if settings is not None:
        where = "extra_body.google.safety_settings"
        if not isinstance(settings, list):
            raise RequestError(f"{where} must be an array of safety settings", param=where,
                               code="invalid_type")
        out = []
        for i, setting in enumerate(settings):
            if not isinstance(setting, dict):
                raise RequestError(f"{where}[{i}] must be an object with 'category' and "
                                   "'threshold'", param=f"{where}[{i}]", code="invalid_type")
            for key in ("category", "threshold"):
                if key in setting and not isinstance(setting[key], str):
                    raise RequestError(f"{where}[{i}].{key} must be a string",
                                       param=f"{where}[{i}].{key}", code="invalid_type")
            out.append({_camel(key): value for key, value in setting.items()})
        fields["safetySettings"] = out
    return fields


def _camel(key: str) -> str:
    head, *rest = key.split("_")
    return head + "".join(word.title() for word in rest)


def _tools(body: dict[str, Any]) -> tuple[list[dict[str, Any]] | None, dict[str, Any] | None]:
    """``functionDeclarations`` and ``toolConfig`` for a chat body's tools.

    Raises:
        RequestError: ``tools`` is not an array.
    """
    declarations = []
    tools_given = body.get("tools") or []
    if not isinstance(tools_given, list):
        raise RequestError("'tools' must be an array", param="tools", code="invalid_type")
    for tool in tools_given:
        function = tool.get("function") if isinstance(tool, dict) else None
        if isinstance(function, dict) and function.get("name"):
            decl = {"name": function["name"]}
            for key in ("description", "parameters"):
                if function.get(key) is not None:
                    decl[key] = function[key]
            declarations.append(decl)
    tools = [{"functionDeclarations": declarations}] if declarations else None
    choice = body.get("tool_choice")
    config: dict[str, Any] | None = None
    if isinstance(choice, str) and choice in _TOOL_MODES:
        config = {"functionCallingConfig": {"mode": _TOOL_MODES[choice]}}
    elif isinstance(choice, dict) and isinstance(choice.get("function"), dict):
        config = {"functionCallingConfig": {"mode": "ANY", "allowedFunctionNames": [
            choice["function"].get("name", "")]}}
    return tools, config


def to_native(body: dict[str, Any], cached_content: str | None = None) -> dict[str, Any]:
    """A ``GenerateContentRequest`` for an OpenAI chat ``body``.

    With ``cached_content`` (the context-cache manager's) the request references that cache
    and carries no ``systemInstruction``, ``tools`` or ``toolConfig`` (Google refuses them
    together); the caller only passes a cache whose system prompt is the request's, and
    only for a request that references no cache of the client's. The client's own
    ``extra_body.google.cached_content`` and ``safety_settings`` go as
    :func:`google_fields` says (the client's reference wins over ``cached_content``); the
    rest of a request with the client's reference is translated as it is.

    Raises:
        RequestError: what cannot be translated, named by ``param``: a ``reasoning_effort``
            that cannot be mapped (:func:`thinking_config`), ``tools`` or an assistant
            message's ``tool_calls`` that are not arrays of objects, a ``json_schema`` that
            is not one, ``extra_body.google`` fields of the wrong type
            (:func:`google_fields`).
    """
    model = str(body.get("model") or "")
    google = google_fields(body)
    native: dict[str, Any] = {"contents": _contents(body.get("messages") or [], model)}
    config = _generation_config(body)
    thinking = thinking_config(body, model)
    if thinking is not None:
        config["thinkingConfig"] = thinking
    if config:
        native["generationConfig"] = config
    if "safetySettings" in google:
        native["safetySettings"] = google["safetySettings"]
    if "cachedContent" in google:
        native["cachedContent"] = google["cachedContent"]
    elif cached_content is not None:
        native["cachedContent"] = cached_content
        return native
    system = [content_text(m.get("content")) for m in body.get("messages") or []
              if isinstance(m, dict) and m.get("role") in _SYSTEM_ROLES]
    texts = [t for t in system if t]
    if texts:
        native["systemInstruction"] = {"parts": [{"text": t} for t in texts]}
    tools, tool_config = _tools(body)
    if tools:
        native["tools"] = tools
    if tool_config:
        native["toolConfig"] = tool_config
    return native


def native_path(model: str, stream: bool) -> str:
    """The native path for ``model``."""
    name = model.removeprefix("models/")
    return f"/v1beta/models/{name}:streamGenerateContent?alt=sse" if stream else \
        f"/v1beta/models/{name}:generateContent"


def tokens(value: Any) -> int:
    """A token count Google reported: a non-negative integer, anything else 0 (the
    answer's other fields still reach the client)."""
    return value if type(value) is int and value >= 0 else 0


def usage(metadata: Any) -> dict[str, Any]:
    """OpenAI ``usage`` from ``usageMetadata`` (thinking tokens count as completion)."""
    meta = metadata if isinstance(metadata, dict) else {}
    prompt = tokens(meta.get("promptTokenCount"))
    thoughts = tokens(meta.get("thoughtsTokenCount"))
    completion = tokens(meta.get("candidatesTokenCount")) + thoughts
    doc: dict[str, Any] = {
        "prompt_tokens": prompt, "completion_tokens": completion,
        "total_tokens": tokens(meta.get("totalTokenCount")) or prompt + completion,
        "prompt_tokens_details": {"cached_tokens": tokens(meta.get("cachedContentTokenCount"))},
    }
    if thoughts:
        doc["completion_tokens_details"] = {"reasoning_tokens": thoughts}
    return doc


def _message(candidate: dict[str, Any]) -> tuple[
        str | None, str | None, list[dict[str, Any]]]:
    """A candidate's text, thought summaries (parts marked ``thought``; None for either
    without a part of it) and tool calls, read in one pass over its parts."""
    content = candidate.get("content")
    parts = content.get("parts") if isinstance(content, dict) else None
    texts: list[str] = []
    thoughts: list[str] = []
    calls: list[dict[str, Any]] = []
    for part in parts if isinstance(parts, list) else []:
        if not isinstance(part, dict):
            continue
        if isinstance(part.get("text"), str):
            (thoughts if part.get("thought") else texts).append(part["text"])
        call = part.get("functionCall")
        if isinstance(call, dict):
            calls.append({"id": tool_call_id(call.get("id"), part.get("thoughtSignature")),
                          "type": "function",
                          "function": {"name": call.get("name", ""),
                                       "arguments": json.dumps(call.get("args") or {})},
                          **signed(part.get("thoughtSignature"))})
    return ("".join(texts) if texts else None), ("".join(thoughts) if thoughts else None), \
        calls


def _token_logprob(candidate: dict[str, Any]) -> dict[str, Any]:
    token = candidate.get("token")
    token = token if isinstance(token, str) else ""
    try:
        logprob = float(candidate.get("logProbability") or 0.0)
    except (TypeError, ValueError, OverflowError):  # not a number Google would send
        logprob = 0.0
    return {"token": token, "logprob": logprob,
            "bytes": list(token.encode("utf-8", "replace"))}


def logprobs(candidate: dict[str, Any]) -> dict[str, Any] | None:
    """OpenAI's ``logprobs`` of a choice from a candidate's ``logprobsResult`` (each chosen
    token with the top candidates of its step), or None when it has none."""
    result = candidate.get("logprobsResult")
    if not isinstance(result, dict):
        return None
    chosen = result.get("chosenCandidates")
    steps = result.get("topCandidates")
    steps = steps if isinstance(steps, list) else []
    content = []
    for i, pick in enumerate(chosen if isinstance(chosen, list) else []):
        if not isinstance(pick, dict):
            continue
        step = steps[i] if i < len(steps) and isinstance(steps[i], dict) else {}
        top = step.get("candidates")
        content.append({**_token_logprob(pick), "top_logprobs": [
            _token_logprob(c) for c in (top if isinstance(top, list) else [])
            if isinstance(c, dict)]})
    return {"content": content, "refusal": None}


def finish_reason(candidate: dict[str, Any], has_calls: bool) -> str | None:
    """OpenAI's ``finish_reason`` for a candidate (None while it is not finished)."""
    reason = candidate.get("finishReason")
    if reason is None:
        return None
    if has_calls and reason == "STOP":
        return "tool_calls"
    return FINISH_REASONS.get(reason, "stop") if isinstance(reason, str) else "stop"


def _candidates(doc: dict[str, Any]) -> list[tuple[int, dict[str, Any]]]:
    """A response's candidates with their indexes (each one's ``index``, else its
    position); for a prompt Google blocked (``promptFeedback.blockReason``, and no candidate
    at all) one empty candidate finished for that reason, so that an OpenAI client gets its
    one choice, ``finish_reason: content_filter``. What is not a candidate is left out."""
    candidates = doc.get("candidates")
    if candidates:
        return [(c["index"] if type(c.get("index")) is int else i, c)
                for i, c in enumerate(candidates if isinstance(candidates, list) else [])
                if isinstance(c, dict)]
    feedback = doc.get("promptFeedback")
    reason = feedback.get("blockReason") if isinstance(feedback, dict) else None
    if not reason:
        return []
    return [(0, {"content": {"role": "model", "parts": []},
                 "finishReason": reason if isinstance(reason, str) and reason in FINISH_REASONS
                 else "SAFETY"})]


def from_native(doc: dict[str, Any], model: str) -> dict[str, Any]:
    """A ``chat.completion`` for a ``GenerateContentResponse``."""
    choices = []
    for index, candidate in _candidates(doc):
        text, thoughts, calls = _message(candidate)
        message: dict[str, Any] = {"role": "assistant", "content": text}
        if thoughts is not None:
            message["reasoning_content"] = thoughts
        if calls:
            message["tool_calls"] = calls
        choices.append({"index": index, "message": message,
                        "logprobs": logprobs(candidate),
                        "finish_reason": finish_reason(candidate, bool(calls)) or "stop"})
    return {"id": "chatcmpl-" + str(doc.get("responseId") or int(time.time() * 1e6)),
            "object": "chat.completion", "created": int(time.time()),
            "model": doc.get("modelVersion") or model, "choices": choices,
            "usage": usage(doc.get("usageMetadata"))}


def as_dict(value: Any) -> dict[str, Any]:
    """``value`` when it is an object, else an empty one (for fields read from answers)."""
    return value if isinstance(value, dict) else {}


def google_error(data: bytes) -> dict[str, Any] | None:
    """The ``error`` object of a Google error body (``{"error": {code, message, status}}``,
    or a list of them as the OpenAI-compatible surface sometimes sends), or None."""
    try:
        doc = json.loads(data)
    except ValueError:
        return None
    if isinstance(doc, list) and doc and isinstance(doc[0], dict):
        doc = doc[0]
    error = doc.get("error") if isinstance(doc, dict) else None
    return error if isinstance(error, dict) else None


def openai_error(status: int, data: bytes) -> bytes:
    """An OpenAI error body for a Google one (:func:`google_error`); other bodies, and ones
    already in OpenAI's shape, as they are."""
    error = google_error(data)
    if error is None or "type" in error:
        return data
    kind = "invalid_request_error" if 400 <= status < 500 else "server_error"
    return json.dumps({"error": {"message": str(error.get("message", "")), "type": kind,
                                 "code": error.get("status") or str(status),
                                 "param": None}}).encode()


#: A broken stream's message when the router's own record cannot be read.
BROKEN_OFF = "the upstream stream broke off"


def broken_off(piece: bytes | None) -> dict[str, Any]:
    """The error chunk for a stream that broke off: the message of the router's own error
    record, which the relay sends as the stream's last piece. Google's parser may not see
    that record: glued to a record the upstream cut in the middle, it reads as that
    record's broken JSON."""
    message = BROKEN_OFF
    for line in (piece or b"").split(b"\n"):
        if not line.startswith(b"data: "):
            continue
        try:
            doc = json.loads(line[6:])
        except ValueError:
            continue
        error = doc.get("error") if isinstance(doc, dict) else None
        if isinstance(error, dict) and isinstance(error.get("message"), str):
            message = error["message"]
    return {"error": {"message": message, "type": "server_error", "code": "upstream_error"}}


def _event(doc: dict[str, Any]) -> bytes:
    """A chunk (compact JSON) or an error (as the forwarder writes its own) as an SSE event."""
    data = json.dumps(doc) if "error" in doc else json.dumps(doc, separators=(",", ":"))
    return b"data: " + data.encode() + b"\n\n"


class NativeStream:
    """Translates one ``alt=sse`` stream into ``chat.completion.chunk`` events.

    Each Google record gives one chunk per candidate (the first with the assistant role);
    after the upstream ends, one chunk with empty ``choices`` and the ``usage`` of the last
    ``usageMetadata`` seen, then ``data: [DONE]``. An ``{"error": …}`` record becomes an
    OpenAI error event.
    """

    def __init__(self, model: str) -> None:
        self.model = model
        self.usage: dict[str, Any] | None = None
        self._parser = SseParser()
        self._id = "chatcmpl-" + str(int(time.time() * 1e6))
        self._created = int(time.time())
        self._started: set[int] = set()
        self._calls: dict[int, int] = {}
        #: An error chunk was made (Google's record, or the router's for a broken stream).
        self.failed = False
        self._last: bytes | None = None  # the last piece fed (see ended_early)

    def _chunk(self, choices: list[dict[str, Any]], **extra: Any) -> dict[str, Any]:
        return {"id": self._id, "object": "chat.completion.chunk", "created": self._created,
                "model": self.model, "choices": choices, **extra}

    def chunks(self, piece: bytes) -> list[dict[str, Any]]:
        """The chunks ``piece`` completes, as documents (an error as ``{"error": …}``)."""
        self._last = piece
        out = []
        for record in self._parser.feed(piece):
            if not record.data:
                continue
            try:
                doc = json.loads(record.data)
            except ValueError:
                continue
            if not isinstance(doc, dict):
                continue
            if "error" in doc:
                error = doc["error"] if isinstance(doc["error"], dict) else {}
                out += self.errors({"error": {
                    "message": str(error.get("message", "upstream error")),
                    "type": "server_error", "code": error.get("status")}})
                continue
            if doc.get("responseId"):
                self._id = "chatcmpl-" + str(doc["responseId"])
            if doc.get("modelVersion"):
                self.model = str(doc["modelVersion"])
            if doc.get("usageMetadata"):
                self.usage = usage(doc["usageMetadata"])
            for index, candidate in _candidates(doc):
                out.append(self._candidate_chunk(index, candidate))
        return out

    def final_chunks(self) -> list[dict[str, Any]]:
        """After the upstream ended normally: the usage chunk, if any usage was seen."""
        return [self._chunk([], usage=self.usage)] if self.usage is not None else []

    def feed(self, piece: bytes) -> list[bytes]:
        """The chunks ``piece`` completes, as SSE events."""
        return [_event(doc) for doc in self.chunks(piece)]

    def _candidate_chunk(self, index: int, candidate: dict[str, Any]) -> dict[str, Any]:
        base = self._calls.get(index, 0)
        text, thoughts, calls = _message(candidate)
        delta: dict[str, Any] = {}
        if index not in self._started:
            self._started.add(index)
            delta["role"] = "assistant"
        if thoughts:
            delta["reasoning_content"] = thoughts
        if text:
            delta["content"] = text
        if calls:
            delta["tool_calls"] = [{"index": base + k, **call} for k, call in enumerate(calls)]
            self._calls[index] = base + len(calls)
        reason = finish_reason(candidate, self._calls.get(index, 0) > 0)
        choice = {"index": index, "delta": delta, "finish_reason": reason}
        scored = logprobs(candidate)
        if scored is not None:
            choice["logprobs"] = scored
        return self._chunk([choice])

    def finish(self) -> list[bytes]:
        """The usage chunk and the end marker."""
        return [*map(_event, self.final_chunks()), b"data: [DONE]\n\n"]

    def translate(self, pieces: Iterator[bytes], completed: Any) -> Iterator[bytes]:
        """Translate ``pieces``; the end chunks follow only when ``completed()`` says the
        upstream ended normally. A broken stream ends with an error event: the router's
        own, which the relay sent last, when it did not come through Google's records
        (:func:`broken_off`)."""
        for piece in pieces:
            yield from self.feed(piece)
        if completed():
            yield from self.finish()
        else:
            yield from map(_event, self.ended_early())

    def ended_early(self) -> list[dict[str, Any]]:
        """After the upstream broke off: its error chunk, unless one was made already
        (:func:`broken_off` of the last piece fed, the relay's own error record)."""
        return self.errors(broken_off(self._last))

    def errors(self, doc: dict[str, Any]) -> list[dict[str, Any]]:
        """The error chunk for ``doc`` (``{"error": …}``), once: none after an error."""
        if self.failed:
            return []
        self.failed = True
        return [doc]
