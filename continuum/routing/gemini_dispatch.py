"""Sending a request to a ``type: gemini`` backend, with or without a context cache.

One dispatch (:meth:`GeminiGateway.send`):

1. The path: ``/v1beta/openai/...`` (the OpenAI-compatible surface), or for a chat
   completion with ``prefer_native_api`` the native ``models/{m}:generateContent`` /
   ``:streamGenerateContent?alt=sse``. The key goes as ``x-goog-api-key`` (the forwarder).
2. For a chat completion without ``tools``, the context cache (when enabled) is asked for a
   ``cachedContents`` reference for the request's whole system prompt. With one, the system
   messages are stripped and the reference injected: ``extra_body.google.cached_content`` on
   the OpenAI surface, top-level ``cachedContent`` (and no ``systemInstruction``, ``tools``,
   ``toolConfig``) on the native one. Without one, the request goes as the client sent it
   (the cache creates the resource in the background). A request that references a cache
   of the client's own (``extra_body.google.cached_content``) is ``ineligible``: the
   client's reference wins, and the router neither adds its own, nor strips the system
   prompt, nor creates a resource for it (the request goes as the client sent it, or
   translated as it is on the native API, where the reference becomes ``cachedContent``).
3. When Google answers a request carrying a reference with "not found" (404, or 400/403 whose
   message names the cached content), the cache drops that entry and the request is sent
   once more without the reference: the client never sees that error.
4. The answer goes back through a :class:`ResponseAdapter` on the upstream: native answers
   and streams are translated to OpenAI's shapes, Google's errors to OpenAI's error body,
   and the cached tokens of every answer are counted (metrics and the cache's stats).

A Responses API request (``/v1/responses``), which Google has no endpoint for, is sent to
the native API as the chat completion it stands for, without a context-cache reference, and
its answer comes back in the Responses shapes (:mod:`continuum.routing.gemini_responses`).
An Anthropic Messages request (``/anthropic/v1/messages``) is sent to the native API as the
chat completion it stands for, through the context cache as a chat completion is, and its
answer comes back in Anthropic's shapes; a count-tokens request goes to ``countTokens``
(:mod:`continuum.routing.gemini_anthropic`). The client's ``anthropic-version`` and
``anthropic-beta`` headers are not sent to Google.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any, Protocol

from prometheus_client import Counter

from continuum.errors import RequestError
from continuum.request import (
    ANTHROPIC_COUNT_TOKENS,
    ANTHROPIC_MESSAGES,
    CHAT,
    COMPLETIONS,
    RESPONSES,
)
from continuum.routing import gemini, gemini_anthropic, gemini_responses
from continuum.wire.responses_api import ResponseShape

if TYPE_CHECKING:
    from continuum.config import GeminiContextCacheConfig
    from continuum.metrics import RouterMetrics
    from continuum.request import RequestContext
    from continuum.routing.backends import Backend
    from continuum.routing.forwarder import Forwarder, Upstream

log = logging.getLogger(__name__)

#: Statuses with which Google may say a referenced cache does not exist (any more).
_MISSING_STATUSES = (400, 403, 404)


class GeminiMetrics:
    """The Gemini counters, registered on the router's registry (multiprocess-safe)."""

    def __init__(self, metrics: RouterMetrics) -> None:
        self.metrics = metrics
        r = metrics.registry
        self.lookups = Counter(
            "continuum_gemini_context_cache_requests_total",
            "Gemini chat requests by context-cache result (hit, miss, ineligible, negative)",
            ["backend", "result"], registry=r)
        self.operations = Counter(
            "continuum_gemini_context_cache_operations_total",
            "cachedContents operations by kind (create, create_failure, eviction, extend, "
            "delete, stale_retry)", ["backend", "operation"], registry=r)
        self.cached_tokens = Counter(
            "continuum_gemini_cached_tokens_total",
            "Prompt tokens Gemini served from a cache (cachedContentTokenCount: explicit and "
            "implicit caching)", ["backend"], registry=r)

    def lookup(self, backend: str, result: str) -> None:
        """Count one context-cache lookup."""
        self.metrics.child(self.lookups, backend, result).inc()

    def operation(self, backend: str, operation: str) -> None:
        """Count one cachedContents operation."""
        self.metrics.child(self.operations, backend, operation).inc()

    def tokens(self, backend: str, count: int) -> None:
        """Count cached prompt tokens of one answer."""
        if count > 0:
            self.metrics.child(self.cached_tokens, backend).inc(count)


class ContextCache(Protocol):
    """What the dispatcher needs of the context-cache manager (in ``continuum.caching``)."""

    def reference(self, backend: Backend, model: str, system: str | None) -> str | None:
        """The ``cachedContents/…`` name to use for this prompt, or None (then the request
        goes unchanged; the manager may start creating one)."""

    def invalidate(self, backend: Backend, model: str, system: str, name: str) -> None:
        """Google said ``name`` does not exist: forget it."""

    def observe_cached_tokens(self, backend: str, count: int) -> None:
        """Cached tokens reported in one answer."""


def is_missing_cache(status: int, data: bytes) -> bool:
    """Whether an error answer to a request with a cache reference says the cache is gone
    (expired, deleted, or never visible to this key): 404, or a 400/403 whose message
    names the cached content."""
    if status == 404:
        return True
    if status not in _MISSING_STATUSES:
        return False
    text = data[:4096].decode("utf-8", "replace").lower()
    return ("cachedcontent" in text or "cached content" in text or "cached_content" in text) \
        and any(word in text for word in ("not found", "expired", "permission denied",
                                          "does not exist"))


def _json_object(data: bytes) -> dict[str, Any] | None:
    """``data`` decoded when it is a JSON object, else None (the answer then goes to the
    client as it came)."""
    try:
        doc = json.loads(data)
    except ValueError:
        return None
    return doc if isinstance(doc, dict) else None


class ResponseAdapter:
    """Reads or streams a Gemini answer back in OpenAI's shapes (see the module doc)."""

    def __init__(self, backend: str, model: str, native: bool, count: Callable[[str, int],
                                                                                 None],
                 prefetched: bytes | None = None) -> None:
        self.backend = backend
        self.model = model
        self.native = native
        self.count = count
        self.prefetched = prefetched

    def read(self, forwarder: Forwarder, upstream: Upstream) -> bytes:
        """The whole answer, translated (an error in OpenAI's error shape)."""
        data = self.prefetched if self.prefetched is not None else forwarder.read_all(upstream)
        if upstream.status >= 400:
            return gemini.openai_error(upstream.status, data)
        if not self.native:
            self._count_openai(data)
            return data
        doc = _json_object(data)
        if doc is None:
            return data
        answer = gemini.from_native(doc, self.model)
        self.count(self.backend, answer["usage"]["prompt_tokens_details"]["cached_tokens"])
        return json.dumps(self.reshape(answer)).encode()

    def reshape(self, answer: dict[str, Any]) -> dict[str, Any]:
        """The client's shape of a (translated) chat completion: itself."""
        return answer

    def _count_openai(self, data: bytes) -> None:
        if b'"cached_tokens"' not in data:
            return
        try:
            details = json.loads(data).get("usage", {}).get("prompt_tokens_details") or {}
            self.count(self.backend, int(details.get("cached_tokens") or 0))
        except (ValueError, AttributeError, TypeError):
            pass

    def stream(self, pieces: Iterator[bytes], upstream: Upstream) -> Iterator[bytes]:
        """The answer's SSE events, translated when native; cached tokens counted."""
        if not self.native:
            return self._watch_openai(pieces)
        translator = gemini.NativeStream(self.model)

        def run() -> Iterator[bytes]:
            yield from self.render(translator, pieces, lambda: upstream.completed)
            if translator.usage is not None:
                self.count(self.backend,
                           translator.usage["prompt_tokens_details"]["cached_tokens"])

        return run()

    def render(self, translator: gemini.NativeStream, pieces: Iterator[bytes],
               completed: Callable[[], bool]) -> Iterator[bytes]:
        """The client's stream of a native one: ``chat.completion.chunk`` events."""
        return translator.translate(pieces, completed)

    def _watch_openai(self, pieces: Iterator[bytes]) -> Iterator[bytes]:
        for piece in pieces:
            if piece.find(b'"cached_tokens"') >= 0:  # (``in`` first tries an integer)
                for line in piece.split(b"\n"):
                    if line.startswith(b"data: {") and line.find(b'"cached_tokens"') >= 0:
                        self._count_openai(line[6:])
            yield piece


class ResponsesAdapter(ResponseAdapter):
    """A Responses request's adapter: the native answer as a ``response`` object, the
    native stream as the typed events (:mod:`continuum.routing.gemini_responses`)."""

    def __init__(self, backend: str, model: str, count: Callable[[str, int], None],
                 shape: ResponseShape) -> None:
        super().__init__(backend, model, True, count)
        self.shape = shape

    def reshape(self, answer: dict[str, Any]) -> dict[str, Any]:
        return gemini_responses.response_from_chat(answer, self.shape)

    def render(self, translator: gemini.NativeStream, pieces: Iterator[bytes],
               completed: Callable[[], bool]) -> Iterator[bytes]:
        """The typed events, made from the chunk documents (never serialised in between);
        a broken stream's error as :meth:`~continuum.routing.gemini.NativeStream.translate`
        makes it."""
        def batches() -> Iterator[list[dict[str, Any]]]:
            for piece in pieces:
                yield translator.chunks(piece)
            yield translator.final_chunks() if completed() else translator.ended_early()

        return gemini_responses.EventTranslator(self.shape).translate(batches(), completed)


class AnthropicAdapter(ResponseAdapter):
    """An Anthropic Messages request's adapter: the native answer as a ``message``, the
    native stream as Anthropic's events, Google's errors in Anthropic's error shape
    (:mod:`continuum.routing.gemini_anthropic`)."""

    def __init__(self, backend: str, model: str, count: Callable[[str, int], None],
                 prefetched: bytes | None = None) -> None:
        super().__init__(backend, model, True, count, prefetched)

    def read(self, forwarder: Forwarder, upstream: Upstream) -> bytes:
        if upstream.status >= 400:
            data = self.prefetched if self.prefetched is not None else \
                forwarder.read_all(upstream)
            return gemini_anthropic.error_body(upstream.status, data)
        return super().read(forwarder, upstream)

    def reshape(self, answer: dict[str, Any]) -> dict[str, Any]:
        return gemini_anthropic.message_from_chat(answer, self.model)

    def stream(self, pieces: Iterator[bytes], upstream: Upstream) -> Iterator[bytes]:
        native = gemini.NativeStream(self.model)

        def run() -> Iterator[bytes]:
            yield from gemini_anthropic.EventTranslator(self.model).translate(
                pieces, native, lambda: upstream.completed)
            if native.usage is not None:
                self.count(self.backend, native.usage["prompt_tokens_details"]["cached_tokens"])

        return run()


class CountTokensAdapter(ResponseAdapter):
    """An Anthropic count-tokens request's adapter: ``totalTokens`` as ``input_tokens``."""

    def __init__(self, backend: str, model: str, count: Callable[[str, int], None]) -> None:
        super().__init__(backend, model, True, count)

    def read(self, forwarder: Forwarder, upstream: Upstream) -> bytes:
        data = forwarder.read_all(upstream)
        if upstream.status >= 400:
            return gemini_anthropic.error_body(upstream.status, data)
        doc = _json_object(data)
        return data if doc is None else json.dumps(gemini_anthropic.count_answer(doc)).encode()


class GeminiGateway:
    """Sends requests to ``type: gemini`` backends (see the module doc)."""

    def __init__(self, forwarder: Forwarder, settings: GeminiContextCacheConfig,
                 metrics: GeminiMetrics, contexts: ContextCache | None = None) -> None:
        self.forwarder = forwarder
        self.settings = settings
        self.metrics = metrics
        self.contexts = contexts

    def _count(self, backend: str, tokens: int) -> None:
        self.metrics.tokens(backend, tokens)
        if self.contexts is not None and tokens > 0:
            self.contexts.observe_cached_tokens(backend, tokens)

    def send(self, backend: Backend, ctx: RequestContext, path: str,
             headers: dict[str, str] | None) -> Upstream:
        """Send ``ctx`` to ``backend``; the upstream carries its :class:`ResponseAdapter`.

        Raises:
            RequestError: a legacy completion (Google serves none), or a Responses or
                Anthropic request the translation cannot honour.
            UpstreamConnectError, UpstreamTimeoutError: as :meth:`Forwarder.send`.
        """
        if ctx.endpoint == COMPLETIONS:
            raise RequestError(
                f"backend '{backend.name}' is a Gemini API, which serves no legacy "
                "completions (/v1/completions): use /v1/chat/completions or /v1/responses",
                code="unsupported_endpoint")
        if ctx.endpoint == RESPONSES:
            return self._send_responses(backend, ctx, headers)
        if ctx.endpoint == ANTHROPIC_COUNT_TOKENS:
            return self._count_tokens(backend, ctx)
        anthropic = ctx.endpoint == ANTHROPIC_MESSAGES
        chat = ctx.endpoint == CHAT or anthropic
        body = gemini_anthropic.chat_body(ctx.body) if anthropic else ctx.body
        if anthropic:
            headers = None  # anthropic-version and anthropic-beta are not Google's
        native = anthropic or (chat and self.settings.prefer_native_api)
        target = gemini.native_path(ctx.model, ctx.stream) if native else \
            "/v1beta/openai" + path.removeprefix("/v1")
        system: str | None = None
        name: str | None = None
        if chat and self.contexts is not None:
            # tools would have to be in the cache; a cache of the client's own is its to
            # manage: both are ineligible (the manager is asked with no prompt)
            system = None if body.get("tools") or \
                gemini.client_cached_content(body) is not None \
                else gemini.system_prompt(body)
            name = self.contexts.reference(backend, ctx.model, system)
        upstream = self.forwarder.send(backend, ctx, target,
                                       self._body(ctx, body, native, name, anthropic), headers)
        prefetched = None
        if name is not None and upstream.status in _MISSING_STATUSES:
            data = self.forwarder.read_all(upstream)
            if is_missing_cache(upstream.status, data):
                assert self.contexts is not None and system is not None
                log.info("request %s: %s answered %d for %s; sending it without the cache",
                         ctx.request_id, backend.name, upstream.status, name)
                self.contexts.invalidate(backend, ctx.model, system, name)
                self.metrics.operation(backend.name, "stale_retry")
                upstream = self.forwarder.send(backend, ctx, target,
                                               self._body(ctx, body, native, None, anthropic),
                                               headers)
            else:
                prefetched = data
        upstream.adapter = AnthropicAdapter(backend.name, ctx.model, self._count, prefetched) \
            if anthropic else ResponseAdapter(backend.name, ctx.model, native, self._count,
                                              prefetched)
        return upstream

    def _count_tokens(self, backend: Backend, ctx: RequestContext) -> Upstream:
        """An Anthropic count-tokens request, sent to ``countTokens``."""
        request = gemini_anthropic.count_request(gemini_anthropic.chat_body(ctx.body),
                                                 ctx.model)
        path = f"/v1beta/models/{ctx.model.removeprefix('models/')}:countTokens"
        upstream = self.forwarder.send(backend, ctx, path, json.dumps(request).encode(), None)
        upstream.adapter = CountTokensAdapter(backend.name, ctx.model, self._count)
        return upstream

    def _send_responses(self, backend: Backend, ctx: RequestContext,
                        headers: dict[str, str] | None) -> Upstream:
        """A Responses request, sent to the native API as its chat completion (see
        :mod:`continuum.routing.gemini_responses`)."""
        native = gemini.to_native(gemini_responses.chat_body(ctx.body))
        upstream = self.forwarder.send(backend, ctx, gemini.native_path(ctx.model, ctx.stream),
                                       json.dumps(native).encode(), headers)
        upstream.adapter = ResponsesAdapter(backend.name, ctx.model, self._count,
                                            ResponseShape(ctx.model, ctx.body))
        return upstream

    @staticmethod
    def _body(ctx: RequestContext, body: dict[str, Any], native: bool, name: str | None,
              anthropic: bool = False) -> bytes:
        """The bytes to send for ``body`` (``ctx.body``, or the chat completion an Anthropic
        request stands for), with the context cache's reference ``name`` if any."""
        if native:
            sent = gemini.without_system(body) if name is not None else body
            translate = gemini_anthropic.to_native if anthropic else gemini.to_native
            return json.dumps(translate(sent, name)).encode()
        if name is None:
            return ctx.raw
        stripped = gemini.without_system(body)
        extra = dict(stripped.get("extra_body") or {})
        extra["google"] = {**(extra.get("google") or {}), "cached_content": name}
        return json.dumps({**stripped, "extra_body": extra}).encode()


def upstream_adapter(upstream: Upstream) -> Any:
    """The adapter a gateway attached to ``upstream``, or None."""
    return getattr(upstream, "adapter", None)
