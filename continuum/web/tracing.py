"""OpenTelemetry tracing: the optional ``otel`` extra (``pip install 'continuum-router[otel]'``).

Configured the usual OTel way, by environment variables, read when a worker builds its app:

* on when ``OTEL_TRACES_EXPORTER`` names an exporter (``otlp``, ``otlp_proto_http``,
  ``console``, or any installed ``opentelemetry_traces_exporter`` entry point), or when an
  OTLP endpoint is set (``OTEL_EXPORTER_OTLP_ENDPOINT``/``_TRACES_ENDPOINT``, exporter
  ``otlp``); off with ``OTEL_TRACES_EXPORTER=none``, ``OTEL_SDK_DISABLED=true`` or nothing
  set. The exporters' own variables (endpoint, headers, timeouts), ``OTEL_SERVICE_NAME``
  (default ``continuum-router``), ``OTEL_RESOURCE_ATTRIBUTES``, ``OTEL_TRACES_SAMPLER``,
  ``OTEL_BSP_*`` and ``OTEL_PROPAGATORS`` apply as in any OTel SDK. A tracer provider the
  process already registered (``opentelemetry-instrument``) is used as it is.
* Off, nothing here runs on a request: no middleware is added and nothing is wrapped, so
  tracing costs the hot path nothing (``tools/bench/overhead.py`` measures it).

Spans of one proxied request (API endpoints only; ``/metrics``, ``/health``, ``/admin``
are not traced)::

    POST /v1/chat/completions          SERVER, child of the client's ``traceparent``
    ├── continuum.cache_lookup         continuum.cache.hit
    ├── continuum.selection            continuum.decision, continuum.backend (one per try)
    ├── continuum.upstream             CLIENT; its context goes upstream as ``traceparent``;
    │                                  to the response head for streams, the body otherwise
    └── continuum.stream_relay         the streamed body, first to last byte

The ``continuum.upstream`` of a retried request appears twice, the first with an error
status. The instrumentation wraps the service's collaborators on the instance
(``response_cache.lookup``, ``pipeline.decide``, ``forwarder.send``/``read_all``/``relay``),
so the request path itself has no tracing branches.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import TYPE_CHECKING, Any, cast

import falcon

from continuum import __version__
from continuum.web.http import request_id_of

if TYPE_CHECKING:
    from continuum.request import RequestContext
    from continuum.routing.backends import Backend
    from continuum.routing.forwarder import Upstream
    from continuum.service import RouterService

log = logging.getLogger(__name__)

SERVICE_NAME = "continuum-router"
_SPAN_KEY = "_continuum_span"


def enabled_by_env(environ: Mapping[str, str] = os.environ) -> bool:
    """Whether the environment asks for traces (see the module docstring)."""
    if environ.get("OTEL_SDK_DISABLED", "").strip().lower() == "true":
        return False
    exporters = environ.get("OTEL_TRACES_EXPORTER")
    if exporters is not None:
        return exporters.strip().lower() not in ("", "none")
    return bool(environ.get("OTEL_EXPORTER_OTLP_ENDPOINT")
                or environ.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT"))


def provider_from_env(environ: Mapping[str, str] = os.environ) -> Any:
    """The process's tracer provider: one already registered, else an SDK provider with a
    batch processor per exporter named in ``OTEL_TRACES_EXPORTER``.

    Raises:
        ImportError: the ``otel`` extra is not installed.
        ValueError: an exporter name no installed package provides.
    """
    from importlib.metadata import entry_points

    from opentelemetry import trace
    from opentelemetry.sdk.resources import Resource
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor

    current = trace.get_tracer_provider()
    if not isinstance(current, trace.ProxyTracerProvider):
        return current
    attrs = {} if environ.get("OTEL_SERVICE_NAME") else {"service.name": SERVICE_NAME}
    provider = TracerProvider(resource=Resource.create(attrs))
    names = [n.strip() for n in environ.get("OTEL_TRACES_EXPORTER", "otlp").split(",")
             if n.strip()]
    found = {ep.name: ep for ep in entry_points(group="opentelemetry_traces_exporter")}
    for name in names:
        ep = found.get(name) or (found.get("otlp_proto_http") if name == "otlp" else None)
        if ep is None:
            raise ValueError(f"OTEL_TRACES_EXPORTER: no installed exporter '{name}' "
                             f"(installed: {', '.join(sorted(found)) or 'none'})")
        provider.add_span_processor(BatchSpanProcessor(ep.load()()))
    return provider


def install(app: falcon.App[Any, Any], service: RouterService,
            provider: Any = None) -> Tracing | None:
    """Trace ``app``'s proxied requests with ``provider`` (tests pass one), else with the
    environment's (when it asks for traces and the extra is installed); None when off."""
    if provider is None:
        if not enabled_by_env():
            return None
        try:
            provider = provider_from_env()
        except ImportError:
            log.warning("OTEL_* variables ask for traces but the otel extra is not "
                        "installed (pip install 'continuum-router[otel]'); tracing is off")
            return None
    tracing = Tracing(provider)
    tracing.instrument(service)
    app.add_middleware(tracing)
    return tracing


class _HeaderGetter:
    """Reads W3C headers from a Falcon request (whose header names are upper-cased)."""

    def get(self, carrier: falcon.Request, key: str) -> list[str] | None:
        value = carrier.get_header(key)
        return None if value is None else [value]

    def keys(self, carrier: falcon.Request) -> list[str]:
        return list(carrier.headers)


class Tracing:
    """The server span (a Falcon middleware) and the wrappers of the service's stages."""

    def __init__(self, provider: Any) -> None:
        from opentelemetry import context, propagate, trace

        self.provider = provider
        self.tracer = provider.get_tracer("continuum.router", __version__)
        self._trace, self._context, self._propagate = trace, context, propagate
        self._getter = _HeaderGetter()

    # --- the server span ------------------------------------------------------------------

    def process_resource(self, req: falcon.Request, resp: falcon.Response, resource: Any,
                         params: dict[str, Any]) -> None:
        if not getattr(resource, "traced", False):
            return
        trace = self._trace
        parent = self._propagate.extract(req, getter=cast(Any, self._getter))
        span = self.tracer.start_span(
            f"{req.method} {req.path}", context=parent, kind=trace.SpanKind.SERVER,
            attributes={"http.request.method": req.method, "url.path": req.path,
                        "continuum.request_id": request_id_of(req)})
        token = self._context.attach(trace.set_span_in_context(span))
        req.context[_SPAN_KEY] = (span, token)

    def process_response(self, req: falcon.Request, resp: falcon.Response, resource: Any,
                         req_succeeded: bool) -> None:
        held = req.context.get(_SPAN_KEY)
        if held is None:
            return
        span, token = held
        self._context.detach(token)
        status = resp.status_code
        span.set_attribute("http.response.status_code", status)
        if status >= 500:
            span.set_status(self._trace.Status(self._trace.StatusCode.ERROR))
        for header, name in (("X-Continuum-Backend", "continuum.backend"),
                             ("X-Cache", "continuum.cache")):
            value = resp.get_header(header)
            if value is not None:
                span.set_attribute(name, value)
        stream = resp.stream
        if stream is not None and not hasattr(stream, "read"):
            resp.stream = _ending(stream, span.end)
        else:
            span.end()

    # --- the stages -----------------------------------------------------------------------

    def instrument(self, service: RouterService) -> None:
        """Wrap the service's stages on the instance (the classes stay untouched)."""
        cache, pipeline, forwarder = service.response_cache, service.pipeline, service.forwarder
        cache.lookup = self._lookup(cache.lookup)  # type: ignore[method-assign]
        pipeline.decide = self._decide(pipeline.decide)  # type: ignore[method-assign]
        forwarder.send = self._send(forwarder.send)  # type: ignore[method-assign]
        forwarder.read_all = self._read_all(  # type: ignore[method-assign,assignment]
            forwarder.read_all)
        forwarder.relay = self._relay(forwarder.relay)  # type: ignore[method-assign]

    def _lookup(self, lookup: Callable[[RequestContext], Any]) -> Callable[..., Any]:
        tracer = self.tracer

        def traced(ctx: RequestContext) -> Any:
            with tracer.start_as_current_span("continuum.cache_lookup") as span:
                entry = lookup(ctx)
                span.set_attribute("continuum.cache.hit", entry is not None)
                return entry

        return traced

    def _decide(self, decide: Callable[..., tuple[Backend, str]]) -> Callable[..., Any]:
        tracer = self.tracer

        def traced(candidates: list[Backend], ctx: RequestContext) -> tuple[Backend, str]:
            with tracer.start_as_current_span("continuum.selection") as span:
                span.set_attribute("continuum.candidates", len(candidates))
                if ctx.prefix_key is not None:
                    span.set_attribute("continuum.prefix_hash", ctx.prefix_key.hex()[:16])
                backend, decision = decide(candidates, ctx)
                span.set_attribute("continuum.decision", decision)
                span.set_attribute("continuum.backend", backend.name)
                return backend, decision

        return traced

    def _send(self, send: Callable[..., Upstream]) -> Callable[..., Upstream]:
        tracer, trace, propagate = self.tracer, self._trace, self._propagate

        def traced(backend: Backend, ctx: RequestContext, path: str, body: bytes,
                   extra_headers: dict[str, str] | None = None) -> Upstream:
            span = tracer.start_span(
                "continuum.upstream", kind=trace.SpanKind.CLIENT,
                attributes={"continuum.backend": backend.name, "url.path": path,
                            "server.address": backend.url})
            headers = dict(extra_headers or {})
            propagate.inject(headers, context=trace.set_span_in_context(span))
            try:
                upstream = send(backend, ctx, path, body, headers)
            except BaseException as exc:
                span.record_exception(exc)
                span.set_status(trace.Status(trace.StatusCode.ERROR, type(exc).__name__))
                span.end()
                raise
            span.set_attribute("http.response.status_code", upstream.status)
            if upstream.status >= 500:
                span.set_status(trace.Status(trace.StatusCode.ERROR))
            if ctx.stream and upstream.status == 200:
                span.end()  # the body is the relay's span
            else:
                upstream.__dict__[_SPAN_KEY] = span  # a dataclass instance: no slots
            return upstream

        return traced

    def _read_all(self, read_all: Callable[[Upstream], bytes]) -> Callable[[Upstream], bytes]:
        def traced(upstream: Upstream) -> bytes:
            span = upstream.__dict__.pop(_SPAN_KEY, None)
            try:
                return read_all(upstream)
            finally:
                if span is not None:
                    span.end()

        return traced

    def _relay(self, relay: Callable[..., Iterator[bytes]]) -> Callable[..., Iterator[bytes]]:
        tracer = self.tracer

        def traced(upstream: Upstream, error_event: Callable[[str], bytes]) -> Iterator[bytes]:
            # Started now, while the server span is current; the pieces are pulled later,
            # by the WSGI server, when no span is.
            span = tracer.start_span("continuum.stream_relay",
                                     attributes={"continuum.backend": upstream.backend.name})
            return _relayed(relay(upstream, error_event), upstream, span)

        return traced


def _relayed(pieces: Iterator[bytes], upstream: Upstream, span: Any) -> Iterator[bytes]:
    count = 0
    try:
        for piece in pieces:
            count += 1
            yield piece
    finally:
        close = getattr(pieces, "close", None)
        if close is not None:
            close()  # releases the lease: its status is then known
        span.set_attribute("continuum.stream.pieces", count)
        span.set_attribute("continuum.stream.completed", upstream.completed)
        status = upstream.lease.status
        if status is not None:
            span.set_attribute("http.response.status_code", status)
        span.end()


def _ending(stream: Iterable[bytes], end: Callable[[], None]) -> Iterator[bytes]:
    """``stream``, calling ``end`` once it is finished or closed."""
    try:
        yield from stream
    finally:
        close = getattr(stream, "close", None)
        if close is not None:
            close()
        end()
