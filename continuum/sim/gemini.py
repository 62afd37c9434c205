"""A fake Google Generative Language API (Gemini) that speaks the real wire format.

``python -m continuum.sim.gemini --port 9100 [--api-key K]`` serves, under ``/v1beta``:

* ``models/{model}:countTokens`` (``contents``, or a ``generateContentRequest``);
* ``models/{model}:generateContent`` and ``models/{model}:streamGenerateContent?alt=sse``
  (``contents``, ``systemInstruction``, ``generationConfig``, ``tools``/``toolConfig``,
  ``cachedContent``; answers with ``candidates``, ``finishReason``, ``usageMetadata``
  including ``cachedContentTokenCount``, ``modelVersion``, ``responseId``);
* ``openai/chat/completions`` (the OpenAI-compatible surface; a cache is referenced with
  ``extra_body.google.cached_content``) and ``openai/models``;
* ``models`` and ``models/{model}``;
* the same native paths under ``/v1`` (the default of recent google-genai SDKs);
* ``cachedContents``: create (``POST``), list (``GET``, ``pageSize``/``pageToken``), get,
  ``PATCH`` (``updateMask=ttl`` or ``expireTime``) and ``DELETE``, with the behaviour of
  :mod:`continuum.sim.gemini_cache` (minimum sizes, TTL expiry, storage accounting);
* Gemini 3 models sign their function calls (``thoughtSignature`` beside each
  ``functionCall`` part) and, as Google does, refuse (400) a request whose current turn
  (the contents after the last user text) holds a model content whose first function call
  lacks its signature or carries one the fake never gave;
* ``generationConfig.thinkingConfig`` as Google checks it: ``thinkingLevel`` and
  ``thinkingBudget`` not together, a level only on models after 2.x (and not ``minimal`` on
  a Gemini 3 Pro), a budget of 0 not on a 2.5 Pro; a budget or a level makes the answer
  report ``thoughtsTokenCount`` (budget ÷ 128, or 4/8/64/192 by level), and
  ``includeThoughts`` puts a thought summary part (``thought: true``) before the answer;
* an ``inlineData`` or ``fileData`` part without its ``mimeType`` is refused (400);
* a prompt whose last text holds ``[blocked prompt]`` is blocked as Google blocks an unsafe
  one: ``promptFeedback.blockReason: SAFETY`` and no candidate (streamed: one record),
  unless ``safetySettings`` sets ``HARM_CATEGORY_DANGEROUS_CONTENT`` to ``BLOCK_NONE`` or
  ``OFF``; ``safetySettings`` is checked as Google checks it (an array of settings, each
  with a known ``category`` and ``threshold``), else a 400;
* ``cachedContent`` on the native surface is looked up as Google does (a missing or expired
  cache is a 403; another model's a 400);
* ``responseLogprobs`` (with ``logprobs`` top candidates, 0-20) gives each candidate a
  ``logprobsResult`` (per record when streamed) and ``avgLogprobs``;
* errors as ``{"error": {"code", "message", "status"}}``: a ``cachedContent`` together with
  ``systemInstruction``, ``tools`` or ``toolConfig`` is refused (400) as Google does, and so
  is a missing or expired cache (403, "CachedContent not found (or permission denied)");
* ``cached_contents_status`` (``--cached-contents-status 501``): every ``cachedContents``
  call answers that status, as a proxy or self-hosted endpoint that mimics the API without
  ``cachedContents`` would (501 Not Implemented, 404, 405…); generation still works;
* for tests: ``GET /_sim/received?n=N`` (requests with method, path, query, headers, body),
  ``GET /_sim/stats`` (cache counters, storage token-hours), ``POST /_sim/reset`` (which
  also restores the startup ``cached_contents_status``), ``POST /_sim/expire``
  (``{"name": "cachedContents/…"}``: end a cache now) and ``POST /_sim/cached-contents``
  (``{"status": 501}``, or ``null``: set ``cached_contents_status`` now).

With ``api_key`` set, ``x-goog-api-key`` (or ``?key=``; ``Authorization: Bearer`` on the
OpenAI surface) must match it. ``clock_offset`` shifts the fake's clock (its timestamps and
expiry) against the client's, as a skewed or long-running server would be.
"""

from __future__ import annotations

import argparse
import base64
import hashlib
import hmac
import json
import random
import secrets
import signal
import sys
import time
from collections import deque
from collections.abc import Iterator, Sequence
from typing import Any

import falcon

from continuum.sim.gemini_cache import (
    CachedContents,
    GeminiApiError,
    min_cache_tokens,
    parse_duration,
    parse_rfc3339,
)
from continuum.sim.tokenizer import SimTokenizer

DEFAULT_MODELS = ("gemini-2.5-flash", "gemini-2.5-pro", "gemini-3-pro-preview")
CACHE_CONFLICT = ("CachedContent can not be used with GenerateContent request setting "
                  "system_instruction, tools or tool_config.\n\nProposed fix: move those "
                  "values to CachedContent from GenerateContent request.")
_ROLES = ("user", "model")
#: The signatures Google documents for a function call the model did not make: it skips
#: checking that call.
_UNCHECKED = frozenset(("skip_thought_signature_validator",
                        "context_engineering_is_the_way_to_go"))
#: A prompt whose last text holds this is blocked, as Google blocks an unsafe prompt.
BLOCKED_MARKER = "[blocked prompt]"
#: Thinking tokens the fake reports for each ``thinkingLevel``.
_LEVEL_THOUGHTS = {"minimal": 4, "low": 8, "medium": 64, "high": 192}
#: The ``HarmCategory`` values a Gemini model takes in ``safetySettings``.
HARM_CATEGORIES = frozenset(("HARM_CATEGORY_HARASSMENT", "HARM_CATEGORY_HATE_SPEECH",
                             "HARM_CATEGORY_SEXUALLY_EXPLICIT",
                             "HARM_CATEGORY_DANGEROUS_CONTENT",
                             "HARM_CATEGORY_CIVIC_INTEGRITY"))
#: The ``HarmBlockThreshold`` values.
HARM_THRESHOLDS = frozenset(("HARM_BLOCK_THRESHOLD_UNSPECIFIED", "BLOCK_LOW_AND_ABOVE",
                             "BLOCK_MEDIUM_AND_ABOVE", "BLOCK_ONLY_HIGH", "BLOCK_NONE",
                             "OFF"))
#: Thresholds that let through a prompt rated HIGH (what ``[blocked prompt]`` is).
_LETS_HIGH_THROUGH = frozenset(("BLOCK_NONE", "OFF"))
_SAFETY_TYPE = "type.googleapis.com/google.ai.generativelanguage.v1beta."


def _safety(settings: Any) -> dict[str, str]:
    """``safetySettings`` as category → threshold, refused (400) as Google refuses them."""
    if settings is None:
        return {}
    if not isinstance(settings, list):
        raise GeminiApiError(400, "Invalid JSON payload received. Unknown name "
                             "\"safetySettings\": Proto field is not repeating, cannot start "
                             "list.")
    out: dict[str, str] = {}
    for i, setting in enumerate(settings):
        if not isinstance(setting, dict):
            raise GeminiApiError(400, f"Invalid value at 'safety_settings[{i}]' "
                                 f"({_SAFETY_TYPE}SafetySetting)")
        category, threshold = setting.get("category"), setting.get("threshold")
        if category not in HARM_CATEGORIES:
            raise GeminiApiError(400, f"Invalid value at 'safety_settings[{i}].category' "
                                 f"({_SAFETY_TYPE}HarmCategory), {json.dumps(category)}")
        if threshold not in HARM_THRESHOLDS:
            raise GeminiApiError(400, f"Invalid value at 'safety_settings[{i}].threshold' "
                                 f"({_SAFETY_TYPE}SafetySetting.HarmBlockThreshold), "
                                 f"{json.dumps(threshold)}")
        out[category] = threshold
    return out


def _thinking(model: str, config: Any) -> tuple[int, bool]:
    """Thinking tokens to report and whether to include a thought summary, for a
    ``thinkingConfig`` (refused as Google refuses it)."""
    if config is None:
        return 0, False
    if not isinstance(config, dict):
        raise GeminiApiError(400, "Invalid value at 'generation_config.thinking_config'")
    level, budget = config.get("thinkingLevel"), config.get("thinkingBudget")
    bare = model.removeprefix("models/")
    if level is not None and budget is not None:
        raise GeminiApiError(400, "You can only set only one of thinking budget and "
                             "thinking level.")
    thoughts = 0
    if level is not None:
        if bare.startswith("gemini-2"):
            raise GeminiApiError(400, "Thinking level is not supported for this model.")
        if level not in _LEVEL_THOUGHTS or (level == "minimal" and "-pro" in bare):
            raise GeminiApiError(400, f"Invalid thinking level: {level}")
        thoughts = _LEVEL_THOUGHTS[level]
    elif budget is not None:
        if not isinstance(budget, int) or budget < -1:
            raise GeminiApiError(400, f"Invalid thinking budget: {budget}")
        if budget == 0 and bare.startswith("gemini-2.5-pro"):
            raise GeminiApiError(400, "Budget 0 is invalid. This model only works in "
                                 "thinking mode.")
        thoughts = 96 if budget == -1 else budget // 128
    return thoughts, bool(config.get("includeThoughts")) and thoughts > 0


def _logprobs_config(config: dict[str, Any]) -> int | None:
    """How many top candidates per token ``generationConfig`` asks for (0: the chosen
    token's only), or None when it asks for no log probabilities; refused as Google
    refuses it."""
    top = config.get("logprobs")
    if top is not None and (not isinstance(top, int) or not 0 <= top <= 20):
        raise GeminiApiError(400, f"logprobs must be between 0 and 20, got {top}")
    if not config.get("responseLogprobs"):
        if top is not None:
            raise GeminiApiError(400, "logprobs can only be set when responseLogprobs is "
                                 "true")
        return None
    return top or 0


def _logprobs_result(pieces: Sequence[str], top: int) -> dict[str, Any]:
    """A ``logprobsResult`` for the tokens ``pieces``: each chosen with log probability
    -0.1 * (its position modulo 5, plus 1), and ``top`` candidates per step, the chosen one
    first."""
    chosen: list[dict[str, Any]] = [
        {"token": piece, "tokenId": 1000 + i, "logProbability": -0.1 * (i % 5 + 1)}
        for i, piece in enumerate(pieces)]
    tops = [{"candidates": [pick, *({"token": f"alt{k}", "tokenId": k,
                                     "logProbability": pick["logProbability"] - k}
                                    for k in range(1, top))][:top]}
            for pick in chosen]
    return {"topCandidates": tops, "chosenCandidates": chosen,
            "logProbabilitySum": sum(c["logProbability"] for c in chosen)}


def _dumps(doc: Any) -> bytes:
    return json.dumps(doc, separators=(",", ":")).encode()


def _on_error(req: falcon.Request, resp: falcon.Response, ex: Exception, params: Any) -> None:
    assert isinstance(ex, GeminiApiError)
    resp.status = falcon.code_to_http_status(ex.code)
    resp.content_type = falcon.MEDIA_JSON
    resp.data = _dumps(ex.document())


def _serialize(req: falcon.Request, resp: falcon.Response, ex: falcon.HTTPError) -> None:
    resp.content_type = falcon.MEDIA_JSON
    resp.data = _dumps(GeminiApiError(ex.status_code, ex.description or ex.title or
                                      "error").document())


def _prompt_tokens(cached: int, cached_system: str | None, system: int, rest: int) -> int:
    """``promptTokenCount``: the whole prompt, cached part included, counted once. With a
    ``cachedContent`` the cache stands in for the system instruction (``cached`` tokens);
    without one the request's own system instruction is the prompt's start, whether or not
    implicit caching served it (``cached`` is then part of ``system``)."""
    return (cached if cached_system is not None else system) + rest


def _texts(content: Any, where: str) -> list[str]:
    """The text of a ``Content``'s parts (function calls and results as JSON).

    Raises:
        GeminiApiError: a malformed ``Content``.
    """
    if not isinstance(content, dict) or not isinstance(content.get("parts"), list):
        raise GeminiApiError(400, f"Invalid JSON payload received. {where}: a Content needs "
                             "'parts'")
    out = []
    for part in content["parts"]:
        if not isinstance(part, dict):
            raise GeminiApiError(400, f"Invalid JSON payload received. {where}.parts")
        if isinstance(part.get("text"), str):
            out.append(part["text"])
        elif "functionCall" in part or "functionResponse" in part:
            out.append(json.dumps(part, sort_keys=True))
        elif "inlineData" in part or "fileData" in part:
            media = part.get("inlineData") or part.get("fileData")
            if not isinstance(media, dict) or not media.get("mimeType"):
                raise GeminiApiError(400, f"* GenerateContentRequest.{where}.parts: "
                                     "mime_type is required")
            out.append("<media>")
    return out


def _model_name(model: str) -> str:
    return model if model.startswith("models/") else "models/" + model


class FakeGemini:
    """State and responders of one fake API."""

    def __init__(self, *, models: Sequence[str] = DEFAULT_MODELS, api_key: str | None = None,
                 min_cache_tokens_override: int | None = None, clock_offset: float = 0.0,
                 keep_received: int = 500, cached_contents_status: int | None = None) -> None:
        self.models = tuple(models)
        self.api_key = api_key
        self.clock_offset = clock_offset
        #: When set, every cachedContents call answers this status (an endpoint without
        #: cachedContents); ``/_sim/reset`` goes back to the startup value.
        self.cached_contents_status = self._startup_status = cached_contents_status
        override = min_cache_tokens_override

        def minimum(model: str) -> int:
            return override if override is not None else min_cache_tokens(model)

        self.caches = CachedContents(self.now, minimum)
        self.received: deque[dict[str, Any]] = deque(maxlen=keep_received)
        self.tokenizer = SimTokenizer()
        self._spaced, self._capital = self.tokenizer.generation_lexicon()
        self._signer = secrets.token_bytes(16)  # thoughtSignature of Gemini 3's calls

    def now(self) -> float:
        """The fake's wall clock (with its offset)."""
        return time.time() + self.clock_offset

    # --- plumbing ----------------------------------------------------------------------

    def _record(self, req: falcon.Request, body: Any) -> None:
        headers = {name.lower(): value for name, value in req.headers.items()}
        self.received.append({"method": req.method, "path": req.path,
                              "query": req.query_string, "headers": headers, "body": body})

    def _read(self, req: falcon.Request) -> Any:
        raw = req.bounded_stream.read()
        try:
            body = json.loads(raw) if raw else {}
        except (ValueError, UnicodeDecodeError):
            body = None
        self._record(req, body if body is not None else raw.decode("utf-8", "replace"))
        self._authorize(req)
        if not isinstance(body, dict):
            raise GeminiApiError(400, "Invalid JSON payload received. Expected an object.")
        try:  # a lone surrogate (\ud800) is valid JSON but no Unicode text: Google refuses it
            json.dumps(body, ensure_ascii=False).encode()
        except UnicodeEncodeError:
            raise GeminiApiError(400, "Invalid JSON payload received. Invalid \\u escape "
                                 "(a lone surrogate).") from None
        return body

    def _authorize(self, req: falcon.Request, *, bearer: bool = False) -> None:
        if self.api_key is None:
            return
        given = req.get_header("x-goog-api-key") or req.get_param("key")
        scheme, _, token = (req.get_header("Authorization") or "").partition(" ")
        if not given and bearer and scheme.lower() == "bearer":
            given = token.strip()
        if not given:
            raise GeminiApiError(403, "Method doesn't allow unregistered callers (callers "
                                 "without established identity). Please use API Key or "
                                 "other form of API consumer identity to call this API.")
        if not secrets.compare_digest(given.encode(), self.api_key.encode()):
            raise GeminiApiError(400, "API key not valid. Please pass a valid API key.")

    def _without_caches(self, req: falcon.Request) -> None:
        """With ``cached_contents_status``: record the call and answer that status, as an
        endpoint without ``cachedContents`` does (whatever the key).

        Raises:
            GeminiApiError: ``cached_contents_status``, when set.
        """
        status = self.cached_contents_status
        if status is None:
            return
        raw = req.bounded_stream.read()
        try:
            body: Any = json.loads(raw) if raw else None
        except (ValueError, UnicodeDecodeError):
            body = raw.decode("utf-8", "replace")
        self._record(req, body)
        message = {404: f"Not Found: {req.path}", 405: f"Method Not Allowed: {req.method}",
                   501: "Method not implemented: cachedContents is not supported by this "
                        "endpoint"}.get(status, f"cachedContents failed ({status})")
        raise GeminiApiError(status, message)

    def _check_model(self, model: str, method: str) -> str:
        bare = model.removeprefix("models/")
        if bare not in self.models:
            raise GeminiApiError(404, f"models/{bare} is not found for API version v1beta, "
                                 f"or is not supported for {method}. Call ListModels to see "
                                 "the list of available models and their supported methods.")
        return "models/" + bare

    def _signature(self, call: dict[str, Any]) -> str:
        mac = hmac.new(self._signer, json.dumps(call, sort_keys=True).encode(), "sha256")
        return base64.b64encode(mac.digest()).decode()

    def _check_signatures(self, contents: list[Any]) -> None:
        """Gemini 3's rule: in the current turn (after the last user text), each model
        content's first function call carries the signature it was answered with, or one of
        the values Google documents for calls the model did not make."""
        start = 0
        for i, content in enumerate(contents):
            if content.get("role", "user") == "user" and any(
                    isinstance(part.get("text"), str) for part in content["parts"]):
                start = i + 1
        for content in contents[start:]:
            if content.get("role") != "model":
                continue
            calls = [(j, part) for j, part in enumerate(content["parts"])
                     if isinstance(part.get("functionCall"), dict)]
            if not calls:
                continue
            position, part = calls[0]
            signature = part.get("thoughtSignature")
            if signature is None:
                raise GeminiApiError(
                    400, "Function call is missing a thought_signature in functionCall "
                    f"parts. function call `{part['functionCall'].get('name')}`, position "
                    f"{position + 1}. Please refer to "
                    "https://ai.google.dev/gemini-api/docs/thought-signatures")
            if isinstance(signature, str) and signature in _UNCHECKED:
                continue  # a call the model did not make, as Google lets a client say
            if not isinstance(signature, str) or not hmac.compare_digest(
                    signature, self._signature(part["functionCall"])):
                raise GeminiApiError(400, "Corrupted thought signature.")

    def _tokens(self, texts: Sequence[str]) -> int:
        return sum(len(self.tokenizer.encode(t)) for t in texts if t)

    # --- models ------------------------------------------------------------------------

    def _model_doc(self, model: str) -> dict[str, Any]:
        return {"name": "models/" + model, "version": "001",
                "displayName": model.replace("-", " ").title(),
                "inputTokenLimit": 1048576, "outputTokenLimit": 65536,
                "supportedGenerationMethods": ["generateContent", "countTokens",
                                               "createCachedContent"]}

    def on_get_models(self, req: falcon.Request, resp: falcon.Response) -> None:
        """``GET /v1beta/models``."""
        self._authorize(req)
        resp.media = {"models": [self._model_doc(m) for m in self.models]}

    def on_get_openai_models(self, req: falcon.Request, resp: falcon.Response) -> None:
        """``GET /v1beta/openai/models``."""
        self._authorize(req, bearer=True)
        resp.media = {"object": "list", "data": [
            {"id": "models/" + m, "object": "model", "owned_by": "google"}
            for m in self.models]}

    # --- cachedContents ----------------------------------------------------------------

    def on_post_caches(self, req: falcon.Request, resp: falcon.Response) -> None:
        """``POST /v1beta/cachedContents``."""
        self._without_caches(req)
        body = self._read(req)
        if not isinstance(body.get("model"), str):
            raise GeminiApiError(400, "* CreateCachedContentRequest.cached_content.model: "
                                 "model is required.")
        model = self._check_model(_model_name(body["model"]), "createCachedContent")
        system = body.get("systemInstruction")
        system_text = "\n".join(_texts(system, "systemInstruction")) if system else ""
        contents_text = "\n".join(
            t for i, c in enumerate(body.get("contents") or [])
            for t in _texts(c, f"contents[{i}]"))
        ttl = parse_duration(body["ttl"], "ttl") if "ttl" in body else None
        expire = self._expire_time(body)
        tokens = self._tokens([system_text, contents_text])
        entry = self.caches.create(model, str(body.get("displayName") or ""), system_text,
                                   contents_text, tokens, ttl, expire)
        resp.media = entry.document()

    def _expire_time(self, body: dict[str, Any]) -> float | None:
        if "expireTime" not in body:
            return None
        try:
            return parse_rfc3339(str(body["expireTime"]))
        except ValueError:
            raise GeminiApiError(400, "Invalid value at 'expire_time' (type.googleapis.com/"
                                 "google.protobuf.Timestamp)") from None

    def on_get_caches(self, req: falcon.Request, resp: falcon.Response) -> None:
        """``GET /v1beta/cachedContents?pageSize=&pageToken=``."""
        self._without_caches(req)
        self._authorize(req)
        size = req.get_param_as_int("pageSize") or 100
        resp.media = self.caches.list_page(max(1, min(size, 1000)),
                                           req.get_param("pageToken"))

    def on_get_cache(self, req: falcon.Request, resp: falcon.Response, cid: str) -> None:
        """``GET /v1beta/cachedContents/{id}``."""
        self._without_caches(req)
        self._authorize(req)
        resp.media = self.caches.get("cachedContents/" + cid).document()

    def on_patch_cache(self, req: falcon.Request, resp: falcon.Response, cid: str) -> None:
        """``PATCH /v1beta/cachedContents/{id}?updateMask=ttl``: only the expiry may change."""
        self._without_caches(req)
        body = self._read(req)
        mask = req.get_param("updateMask")
        fields = {f.strip() for f in mask.split(",")} if mask else \
            {k for k in body if k in ("ttl", "expireTime")}
        allowed = {"ttl", "expireTime", "expire_time"}
        if not fields or not fields <= allowed:
            raise GeminiApiError(400, f"Invalid update mask: {mask or '(empty)'}; only ttl "
                                 "or expire_time can be updated.")
        ttl = parse_duration(body.get("ttl"), "ttl") if "ttl" in fields else None
        expire = self._expire_time(body) if fields & {"expireTime", "expire_time"} else None
        if ttl is None and expire is None:
            raise GeminiApiError(400, "ttl or expire_time must be set.")
        resp.media = self.caches.update_expiry("cachedContents/" + cid, ttl, expire).document()

    def on_delete_cache(self, req: falcon.Request, resp: falcon.Response, cid: str) -> None:
        """``DELETE /v1beta/cachedContents/{id}``: an empty object."""
        self._without_caches(req)
        self._record(req, None)
        self._authorize(req)
        self.caches.delete("cachedContents/" + cid)
        resp.media = {}

    # --- native generation -------------------------------------------------------------

    def _count_tokens(self, model: str, body: dict[str, Any]) -> dict[str, Any]:
        """``POST /v1beta/models/{model}:countTokens``: ``contents``, or a whole
        ``generateContentRequest`` (its ``model`` required, its system instruction
        counted), never both, as Google has it; ``totalTokens`` is what ``generateContent``
        would report as ``promptTokenCount`` without a cache."""
        request = body.get("generateContentRequest")
        if request is not None and body.get("contents") is not None:
            raise GeminiApiError(400, "contents and generate_content_request cannot both be "
                                 "set")
        if request is not None:
            if not isinstance(request, dict) or not request.get("model"):
                raise GeminiApiError(400, "* CountTokensRequest.generate_content_request.model: "
                                     "unsupported model name format")
            if _model_name(str(request["model"])) != model:
                raise GeminiApiError(400, "generate_content_request.model must be the model "
                                     "of the request path")
        source = request if request is not None else body
        contents = source.get("contents")
        if not isinstance(contents, list) or not contents:
            raise GeminiApiError(400, "* CountTokensRequest.contents: contents is not "
                                 "specified")
        texts: list[str] = []
        for i, content in enumerate(contents):
            texts += _texts(content, f"contents[{i}]")
        system = source.get("systemInstruction")
        if system:
            texts += _texts(system, "systemInstruction")
        total = self._tokens(texts)
        return {"totalTokens": total,
                "promptTokensDetails": [{"modality": "TEXT", "tokenCount": total}]}

    def on_post_model(self, req: falcon.Request, resp: falcon.Response, action: str) -> None:
        """``POST /v1beta/models/{model}:generateContent`` or ``:streamGenerateContent``."""
        body = self._read(req)
        model, _, method = action.partition(":")
        if method == "countTokens":
            resp.media = self._count_tokens(self._check_model(model, method), body)
            return
        if method not in ("generateContent", "streamGenerateContent"):
            raise GeminiApiError(404, f"Method not found: {method or action}")
        model = self._check_model(model, method)
        contents = body.get("contents")
        if not isinstance(contents, list) or not contents:
            raise GeminiApiError(400, "* GenerateContentRequest.contents: contents is not "
                                 "specified")
        texts: list[str] = []
        for i, content in enumerate(contents):
            if isinstance(content, dict) and content.get("role", "user") not in _ROLES:
                raise GeminiApiError(400, f"Please use a valid role: user, model. "
                                     f"(contents[{i}].role)")
            texts += _texts(content, f"contents[{i}]")
        signs = model.startswith("models/gemini-3")
        if signs:
            self._check_signatures(contents)
        system = body.get("systemInstruction")
        system_text = "\n".join(_texts(system, "systemInstruction")) if system else ""
        declared = [f.get("name", "") for tool in body.get("tools") or []
                    for f in (tool.get("functionDeclarations") or [])]
        safety = _safety(body.get("safetySettings"))
        cached_tokens, cached_system = self._cache_use(
            body.get("cachedContent"), model, system is not None or "tools" in body
            or "toolConfig" in body)
        system_tokens = self._tokens([system_text])
        if cached_system is None:
            cached_tokens = self.caches.implicit(model, system_text, system_tokens)
        prompt_tokens = _prompt_tokens(cached_tokens, cached_system, system_tokens,
                                       self._tokens(texts))
        config = body.get("generationConfig") or {}
        thoughts, summary = _thinking(model, config.get("thinkingConfig"))
        top = _logprobs_config(config)
        seed = hashlib.sha256(((cached_system or system_text) + "\x00" +
                               "\x00".join(texts)).encode()).digest()
        rng = random.Random(seed if config.get("temperature", 0) in (0, None)
                            else secrets.token_bytes(16))
        last = texts[-1] if texts else ""
        call = next((n for n in declared if n and n in last), None)
        usage: dict[str, Any] = {"promptTokenCount": prompt_tokens}
        if cached_tokens:
            usage["cachedContentTokenCount"] = cached_tokens
        if BLOCKED_MARKER in last and safety.get("HARM_CATEGORY_DANGEROUS_CONTENT") \
                not in _LETS_HIGH_THROUGH:  # Google blocks the prompt: no candidate at all
            blocked = {"promptFeedback": {"blockReason": "SAFETY", "safetyRatings": [
                {"category": "HARM_CATEGORY_DANGEROUS_CONTENT", "probability": "HIGH"}]},
                "usageMetadata": {**usage, "totalTokenCount": prompt_tokens},
                "modelVersion": model.split("/", 1)[1],
                "responseId": secrets.token_urlsafe(16)}
            if method == "generateContent":
                resp.media = blocked
            else:
                resp.content_type = "text/event-stream"
                resp.data = b"data: " + _dumps(blocked) + b"\r\n\r\n"
            return
        if call is not None:
            function = {"name": call, "args": {"query": last[:40]}}
            parts: list[dict[str, Any]] = [{"functionCall": function}]
            if signs:
                parts[0]["thoughtSignature"] = self._signature(function)
            pieces: list[str] = []
            finish = "STOP"
            out_tokens = 8
        else:
            pieces, finish = self._generate(rng, int(config.get("maxOutputTokens") or 8192))
            parts = [{"text": "".join(pieces)}]
            out_tokens = len(pieces)
        usage["candidatesTokenCount"] = out_tokens
        if thoughts:
            usage["thoughtsTokenCount"] = thoughts
        usage["totalTokenCount"] = prompt_tokens + out_tokens + thoughts
        thought = [{"text": f"Thinking about: {last[:40]}", "thought": True}] if summary \
            else []
        parts = thought + parts
        response_id = secrets.token_urlsafe(16)
        scored = None if top is None else _logprobs_result(pieces, top)
        if method == "generateContent":
            candidate = {"content": {"role": "model", "parts": parts}, "finishReason": finish,
                         "index": 0}
            if scored is not None:
                candidate["logprobsResult"] = scored
                candidate["avgLogprobs"] = scored["logProbabilitySum"] / max(len(pieces), 1)
            resp.media = {"candidates": [candidate],
                          "usageMetadata": usage, "modelVersion": model.split("/", 1)[1],
                          "responseId": response_id}
            return
        if req.get_param("alt") != "sse":
            raise GeminiApiError(400, "this fake streams only with alt=sse")
        resp.content_type = "text/event-stream"
        resp.stream = _native_events(parts, pieces, finish, usage, model, response_id,
                                     thought, scored)

    def _cache_use(self, ref: Any, model: str, conflicting: bool) -> tuple[int, str | None]:
        """(cached tokens, cached system text) of a request's cache reference, if any."""
        if ref is None:
            return 0, None
        if not isinstance(ref, str) or not ref.startswith("cachedContents/"):
            raise GeminiApiError(400, "Invalid cached_content name: must be "
                                 "cachedContents/{id}")
        if conflicting:
            raise GeminiApiError(400, CACHE_CONFLICT)
        entry = self.caches.use(ref, model)
        return entry.tokens, "\n".join(t for t in (entry.system_text, entry.contents_text) if t)

    def _generate(self, rng: random.Random, max_tokens: int) -> tuple[list[str], str]:
        length = rng.randint(8, 24)
        ids = [rng.choice(self._capital)] + [rng.choice(self._spaced) for _ in range(length)]
        if max_tokens <= length:
            return self.tokenizer.token_strs(ids[:max_tokens]), "MAX_TOKENS"
        return [*self.tokenizer.token_strs(ids), "."], "STOP"

    # --- OpenAI-compatible surface -----------------------------------------------------

    def on_post_openai_chat(self, req: falcon.Request, resp: falcon.Response) -> None:
        """``POST /v1beta/openai/chat/completions``."""
        raw = req.bounded_stream.read()
        try:
            body = json.loads(raw)
        except (ValueError, UnicodeDecodeError):
            body = None
        self._record(req, body)
        self._authorize(req, bearer=True)
        if not isinstance(body, dict) or not isinstance(body.get("messages"), list):
            raise GeminiApiError(400, "Invalid JSON payload received: messages is required")
        model = self._check_model(_model_name(str(body.get("model", ""))), "generateContent")
        system: list[str] = []
        texts: list[str] = []
        for message in body["messages"]:
            content = message.get("content") if isinstance(message, dict) else None
            text = content if isinstance(content, str) else "\n".join(
                p.get("text", "") for p in content or [] if isinstance(p, dict))
            (system if message.get("role") in ("system", "developer") else texts).append(text)
        ref = ((body.get("extra_body") or {}).get("google") or {}).get("cached_content")
        cached_tokens, cached_system = self._cache_use(ref, model,
                                                       bool(system) or "tools" in body)
        system_text = "\n".join(system)
        system_tokens = self._tokens([system_text])
        if cached_system is None:
            cached_tokens = self.caches.implicit(model, system_text, system_tokens)
        prompt = _prompt_tokens(cached_tokens, cached_system, system_tokens,
                                self._tokens(texts))
        seed = hashlib.sha256(((cached_system or system_text) + "\x00" +
                               "\x00".join(texts)).encode()).digest()
        limit = body.get("max_completion_tokens") or body.get("max_tokens") or 8192
        pieces, finish = self._generate(random.Random(seed), int(limit))
        reason = "stop" if finish == "STOP" else "length"
        usage = {"prompt_tokens": prompt, "completion_tokens": len(pieces),
                 "total_tokens": prompt + len(pieces),
                 "prompt_tokens_details": {"cached_tokens": cached_tokens}}
        cid, created = "chatcmpl-" + secrets.token_hex(12), int(time.time())
        if not body.get("stream"):
            resp.media = {"id": cid, "object": "chat.completion", "created": created,
                          "model": body["model"], "choices": [{
                              "index": 0, "finish_reason": reason,
                              "message": {"role": "assistant", "content": "".join(pieces)}}],
                          "usage": usage}
            return
        include = bool((body.get("stream_options") or {}).get("include_usage"))
        resp.content_type = "text/event-stream"
        resp.stream = _openai_events(cid, created, body["model"], pieces, reason,
                                     usage if include else None)

    # --- test controls -----------------------------------------------------------------

    def on_get_received(self, req: falcon.Request, resp: falcon.Response) -> None:
        """``GET /_sim/received?n=N``."""
        n = req.get_param_as_int("n", min_value=1) or len(self.received)
        resp.media = {"received": list(self.received)[-n:] if self.received else []}

    def on_get_stats(self, req: falcon.Request, resp: falcon.Response) -> None:
        """``GET /_sim/stats``: cache counters and storage billed so far."""
        counters = self.caches.counters
        resp.media = {"created": counters.created, "refused": counters.refused,
                      "deleted": counters.deleted, "expired": counters.expired,
                      "patched": counters.patched, "explicit_hits": counters.explicit_hits,
                      "implicit_hits": counters.implicit_hits,
                      "cached_tokens": counters.cached_tokens,
                      "uses_of_missing": counters.uses_of_missing,
                      "live": self.caches.live_count(),
                      "storage_token_hours": self.caches.storage_token_seconds() / 3600}

    def on_post_reset(self, req: falcon.Request, resp: falcon.Response) -> None:
        """``POST /_sim/reset``."""
        self.received.clear()
        self.caches.reset()
        self.cached_contents_status = self._startup_status
        resp.media = {"reset": True}

    def on_post_caches_status(self, req: falcon.Request, resp: falcon.Response) -> None:
        """``POST /_sim/cached-contents`` with ``{"status": 501}`` (or ``null``)."""
        body = json.loads(req.bounded_stream.read() or b"{}")
        status = body.get("status") if isinstance(body, dict) else None
        if status is not None and (type(status) is not int or not 400 <= status <= 599):
            raise GeminiApiError(400, "status must be an HTTP error status (400-599) or null")
        self.cached_contents_status = status
        resp.media = {"status": status}

    def on_post_expire(self, req: falcon.Request, resp: falcon.Response) -> None:
        """``POST /_sim/expire`` with ``{"name": …}``."""
        body = json.loads(req.bounded_stream.read() or b"{}")
        resp.media = {"expired": self.caches.expire_now(str(body.get("name")))}


def _native_events(parts: list[dict[str, Any]], pieces: list[str], finish: str,
                   usage: dict[str, Any], model: str, response_id: str,
                   thought: list[dict[str, Any]],
                   scored: dict[str, Any] | None) -> Iterator[bytes]:
    """``alt=sse`` records: the thought summary's (if any), then one
    ``GenerateContentResponse`` per piece (with that piece's ``logprobsResult`` when
    ``scored``), the last with ``finishReason`` and the full ``usageMetadata`` (records end
    in CRLF CRLF, as Google's)."""
    version = model.split("/", 1)[1]

    def record(doc: dict[str, Any]) -> bytes:
        return b"data: " + _dumps(doc) + b"\r\n\r\n"

    chunks: list[list[dict[str, Any]]] = [thought] if thought else []
    chunks += [[{"text": p}] for p in pieces] if pieces else [parts[len(thought):]]
    partial = {"promptTokenCount": usage["promptTokenCount"]}
    for i, chunk in enumerate(chunks):
        candidate: dict[str, Any] = {"content": {"role": "model", "parts": chunk}, "index": 0}
        step = i - len(chunks) + len(pieces)  # the piece's position, for text pieces
        if scored is not None and pieces and step >= 0:
            candidate["logprobsResult"] = {
                "topCandidates": scored["topCandidates"][step:step + 1],
                "chosenCandidates": scored["chosenCandidates"][step:step + 1]}
        last = i == len(chunks) - 1
        if last:
            candidate["finishReason"] = finish
        yield record({"candidates": [candidate], "usageMetadata": usage if last else partial,
                      "modelVersion": version, "responseId": response_id})


def _openai_events(cid: str, created: int, model: str, pieces: list[str], reason: str,
                   usage: dict[str, Any] | None) -> Iterator[bytes]:
    def record(choices: list[dict[str, Any]], extra: dict[str, Any] | None = None) -> bytes:
        doc = {"id": cid, "object": "chat.completion.chunk", "created": created,
               "model": model, "choices": choices, **(extra or {})}
        return b"data: " + _dumps(doc) + b"\n\n"

    for i, piece in enumerate(pieces):
        delta = {"role": "assistant", "content": piece} if i == 0 else {"content": piece}
        yield record([{"index": 0, "delta": delta, "finish_reason": None}])
    yield record([{"index": 0, "delta": {}, "finish_reason": reason}])
    if usage is not None:
        yield record([], {"usage": usage})
    yield b"data: [DONE]\n\n"


def create_gemini_app(fake: FakeGemini | None = None) -> falcon.App[falcon.Request,
                                                                    falcon.Response]:
    """The fake API's WSGI app (with ``GET /health`` for the router's probes)."""
    from continuum.sim.server import create_app

    fake = fake or FakeGemini()
    app = create_app()
    app.add_error_handler(GeminiApiError, _on_error)
    app.set_error_serializer(_serialize)
    for version in ("v1beta", "v1"):  # the google-genai SDK 1.x+ defaults to v1
        app.add_route(f"/{version}/models", fake, suffix="models")
        app.add_route(f"/{version}/models/{{action}}", fake, suffix="model")
        app.add_route(f"/{version}/cachedContents", fake, suffix="caches")
        app.add_route(f"/{version}/cachedContents/{{cid}}", fake, suffix="cache")
    app.add_route("/v1beta/openai/chat/completions", fake, suffix="openai_chat")
    app.add_route("/v1beta/openai/models", fake, suffix="openai_models")
    app.add_route("/_sim/received", fake, suffix="received")
    app.add_route("/_sim/stats", fake, suffix="stats")
    app.add_route("/_sim/reset", fake, suffix="reset")
    app.add_route("/_sim/expire", fake, suffix="expire")
    app.add_route("/_sim/cached-contents", fake, suffix="caches_status")
    return app


def build_parser() -> argparse.ArgumentParser:
    """The command line of ``python -m continuum.sim.gemini``."""
    p = argparse.ArgumentParser(prog="python -m continuum.sim.gemini",
                                description="A fake Google Gemini API.")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=9100)
    p.add_argument("--api-key", default=None, help="require this x-goog-api-key")
    p.add_argument("--models", default=",".join(DEFAULT_MODELS), help="comma-separated ids")
    p.add_argument("--min-cache-tokens", type=int, default=None,
                   help="smallest cachedContents for every model (default: per model)")
    p.add_argument("--clock-offset", type=float, default=0.0,
                   help="seconds added to the fake's clock (negative: behind the client)")
    p.add_argument("--cached-contents-status", type=int, default=None,
                   help="answer every cachedContents call with this HTTP status (e.g. 501: "
                        "an endpoint without cachedContents)")
    return p


def main(argv: Sequence[str] | None = None) -> int:
    """Serve the fake API until SIGTERM or SIGINT."""
    from gevent import monkey

    monkey.patch_all()
    import gevent
    from gevent.event import Event

    from continuum.sim.server import make_server

    args = build_parser().parse_args(argv)
    fake = FakeGemini(models=[m for m in args.models.split(",") if m], api_key=args.api_key,
                      min_cache_tokens_override=args.min_cache_tokens,
                      clock_offset=args.clock_offset,
                      cached_contents_status=args.cached_contents_status)
    server = make_server(create_gemini_app(fake), args.host, args.port)
    server.start()
    print(f"continuum-sim gemini: http://{args.host}:{server.server_port} "
          f"models={','.join(fake.models)}", flush=True)
    stop = Event()
    gevent.signal_handler(signal.SIGTERM, stop.set)
    gevent.signal_handler(signal.SIGINT, stop.set)
    stop.wait()
    server.stop(timeout=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
