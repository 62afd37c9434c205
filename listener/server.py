"""The listener's HTTP side: ``/events/<backend>`` (SSE), ``/health`` and ``/metrics``.

A Falcon app served by ``gevent.pywsgi`` inside the listener process (no gunicorn: one
process owns the sockets, the processors and the streams). Responders are thin: the SSE
stream is :meth:`listener.hub.EventHub.stream`, a generator given to Falcon as
``resp.stream``; when the client goes away, pywsgi closes it and the subscription ends.

``/metrics`` reads every counter at scrape time from the sources, the hub and each
processor's ``stats()`` (one :class:`ListenerCollector`), so nothing on the event path
touches Prometheus objects. Nothing here exposes event contents, prompts, token ids or
salts.

With a token (``events_auth``), ``/events`` requires ``Authorization: Bearer <token>``,
compared in constant time; a missing or wrong one gets 401 before anything else is looked
at (so unknown backend names are not revealed). A backend with ``max_subscribers`` open
streams answers 503. ``/health`` and ``/metrics`` stay open: they carry counts only.
"""

from __future__ import annotations

import hmac
import json
import logging
import re
import socket
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import falcon
from gevent.pywsgi import WSGIHandler, WSGIServer
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from listener.hub import EventHub, SubscriberLimitError
from listener.sources import EventSource

__all__ = ["KEEPALIVE_SECONDS", "ListenerCollector", "create_app", "make_server", "parse_listen"]

log = logging.getLogger(__name__)

#: Seconds of silence on a stream before a ``: keepalive`` comment.
KEEPALIVE_SECONDS = 15.0
PREFIX = "continuum_kv_listener_"

#: Source counters: stats name → (metric name, help).
SOURCE_COUNTERS: dict[str, tuple[str, str]] = {
    "batches": ("batches_in", "Engine event batches applied, by source"),
    "events": ("events_in", "Engine KV events (stored/removed/cleared) applied, by source"),
    "skipped_events": ("skipped_events", "Engine events of unknown kinds skipped"),
    "decode_errors": ("decode_errors", "Malformed engine messages skipped"),
    "malformed_events": ("malformed_events", "Malformed engine events skipped, the rest of "
                         "their batch (or trtllm-serve reply) applied"),
    "sequence_gaps": ("sequence_gaps", "Lost engine batches detected (seq / event-id gaps)"),
    "duplicates": ("duplicates", "Engine batches dropped as already applied"),
    "restarts": ("engine_restarts", "Engine restarts detected (seq or ids going back)"),
    "resets": ("resets", "Times a backend's state was cleared (cache_cleared emitted)"),
    "replays": ("replays", "Replays requested from an engine's ROUTER socket"),
    "replay_failures": ("replay_failures", "Replays that got no complete answer"),
    "rejected_publishers": ("rejected_publishers",
                            "Publisher connections refused by allowed_publishers"),
    "processor_errors": ("processor_errors", "Batches the processor failed on"),
    "polls": ("polls", "trtllm-serve /kv_cache_events polls"),
    "publisher_disconnects": ("publisher_disconnects", "ZMQ publisher connections dropped "
                              "(a message over limits.max_message_bytes drops one too)"),
    "pruned_streams": ("pruned_sequence_streams", "(topic, rank) sequence counters (trtllm: "
                       "attention-DP ranks) dropped beyond limits.max_sequence_streams"),
}
#: Processor ``stats()`` keys exported as gauges (values held now); every other key counts
#: since start and is exported as a counter.
PROCESSOR_GAUGES = frozenset({"tracked_blocks", "retained_tokens", "attributed_prefixes",
                              "chain_keys"})
_METRIC_NAME = re.compile(r"[^a-z0-9_]")


def _json(resp: falcon.Response, doc: Any, status: str = falcon.HTTP_200) -> None:
    resp.status = status
    resp.content_type = falcon.MEDIA_JSON
    resp.data = json.dumps(doc, separators=(",", ":")).encode()


#: The ``type`` of the listener's JSON errors, by status (Falcon's own refusals: an unknown
#: path, a method a path does not take).
_ERROR_TYPES = {404: "not_found", 405: "method_not_allowed"}


def _serialize_error(req: falcon.Request, resp: falcon.Response,
                     exc: falcon.HTTPError) -> None:
    """Falcon's refusals in the shape of the listener's own errors (``{"error": {"message",
    "type"}}``), not Falcon's ``{"title": ...}``."""
    message = f"{exc.title}: {exc.description}" if exc.description else exc.title
    if exc.status_code == 404:
        message = f"no such path {req.path!r} (the listener serves /events/<backend>, " \
                  "/health and /metrics)"
    _json(resp, {"error": {"message": message,
                           "type": _ERROR_TYPES.get(exc.status_code, "invalid_request")}},
          str(falcon.code_to_http_status(exc.status_code)))


class _Events:
    def __init__(self, hub: EventHub, keepalive: float, token: str | None) -> None:
        self.hub = hub
        self.keepalive = keepalive
        self._expected = f"Bearer {token}".encode() if token else None
        #: Requests refused for a missing or wrong token (exported by ``/metrics``).
        self.unauthorized = 0

    def _authorized(self, req: falcon.Request) -> bool:
        if self._expected is None:
            return True
        sent = (req.get_header("Authorization") or "").encode("utf-8", "surrogateescape")
        return hmac.compare_digest(sent, self._expected)

    def on_get(self, req: falcon.Request, resp: falcon.Response, backend: str) -> None:
        if not self._authorized(req):
            self.unauthorized += 1
            resp.set_header("WWW-Authenticate", "Bearer")
            _json(resp, {"error": {"message": "missing or wrong bearer token for /events",
                                   "type": "authentication_error"}}, falcon.HTTP_401)
            return
        if not self.hub.has_backend(backend):
            _json(resp, {"error": {"message": f"no event stream for backend {backend!r}",
                                   "type": "not_found", "backends": list(self.hub.backends)}},
                  falcon.HTTP_404)
            return
        last_id = req.get_header("Last-Event-ID") or req.get_param("last_event_id")
        resp.content_type = "text/event-stream"
        resp.set_header("Cache-Control", "no-cache")
        resp.set_header("X-Accel-Buffering", "no")
        # one stream per connection: when it ends (draining, overflow) the socket closes
        # too, so a shutdown does not wait for an idle keep-alive connection
        resp.set_header("Connection", "close")
        try:
            resp.stream = self.hub.stream(backend, last_id, self.keepalive)
        except SubscriberLimitError as exc:
            resp.set_header("Retry-After", "5")
            _json(resp, {"error": {"message": f"too many subscribers for backend {backend!r} "
                                   f"(max_subscribers: {exc.limit})",
                                   "type": "service_unavailable"}}, falcon.HTTP_503)


class _Health:
    def __init__(self, hub: EventHub, sources: Sequence[EventSource]) -> None:
        self.hub = hub
        self.sources = sources

    def on_get(self, req: falcon.Request, resp: falcon.Response) -> None:
        sources = {}
        for source in self.sources:
            doc = source.health()
            doc["subscribers"] = self.hub.subscribers(source.backend)
            doc["latest_event_id"] = self.hub.latest_id(source.backend)
            sources[source.backend] = doc
        healthy = all(source.connected for source in self.sources)
        _json(resp, {"status": "draining" if self.hub.closed else "ok" if healthy else
                     "degraded", "epoch": self.hub.epoch, "sources": sources})


class _Metrics:
    def __init__(self, registry: CollectorRegistry) -> None:
        self.registry = registry

    def on_get(self, req: falcon.Request, resp: falcon.Response) -> None:
        resp.content_type = CONTENT_TYPE_LATEST
        resp.data = generate_latest(self.registry)


class ListenerCollector:
    """Prometheus collector over the sources, the hub and the processors, read at scrape.

    ``events`` (the ``/events`` responder) adds its count of unauthorized requests.
    """

    def __init__(self, hub: EventHub, sources: Sequence[EventSource],
                 events: _Events | None = None) -> None:
        self.hub = hub
        self.sources = sources
        self.events = events

    def collect(self) -> Iterator[Metric]:
        """Every listener metric, labelled by backend."""
        for stat, (name, doc) in SOURCE_COUNTERS.items():
            family = CounterMetricFamily(PREFIX + name, doc, labels=["backend"])
            for source in self.sources:
                family.add_metric([source.backend], getattr(source.stats, stat))
            yield family
        errors = CounterMetricFamily(PREFIX + "poll_errors", "trtllm-serve poll failures by "
                                     "kind (connect, redirect, status, read, decode)",
                                     labels=["backend", "kind"])
        connected = GaugeMetricFamily(PREFIX + "source_connected", "1 while the source has a "
                                      "live engine connection or polls successfully",
                                      labels=["backend"])
        for source in self.sources:
            for kind, count in sorted(source.stats.poll_errors.items()):
                errors.add_metric([source.backend, kind], count)
            connected.add_metric([source.backend], 1 if source.connected else 0)
        yield errors
        yield connected
        yield from self._hub()
        yield from self._processors()
        if self.events is not None:
            yield CounterMetricFamily(PREFIX + "unauthorized_requests", "/events requests "
                                      "refused for a missing or wrong bearer token",
                                      value=self.events.unauthorized)

    def _hub(self) -> Iterator[Metric]:
        out = CounterMetricFamily(PREFIX + "events_out", "Prefix events published on the "
                                  "streams, by backend and event type",
                                  labels=["backend", "event"])
        overflows = CounterMetricFamily(PREFIX + "buffer_overflows", "Slow subscribers closed "
                                        "with buffer_overflow", labels=["backend"])
        refused = CounterMetricFamily(PREFIX + "subscriptions_refused", "Subscriptions refused "
                                      "with 503 at max_subscribers", labels=["backend"])
        resumes = CounterMetricFamily(PREFIX + "subscriptions", "Subscriptions by how they "
                                      "started (history: resumed from Last-Event-ID; "
                                      "snapshot: cache_cleared + snapshot)",
                                      labels=["backend", "start"])
        subscribers = GaugeMetricFamily(PREFIX + "subscribers", "Open /events subscriptions",
                                        labels=["backend"])
        prefixes = GaugeMetricFamily(PREFIX + "prefixes", "Prefixes each backend holds "
                                     "according to its stream", labels=["backend"])
        for backend in self.hub.backends:
            counters = self.hub.counters(backend)
            for event, count in sorted(counters.events_out.items()):
                out.add_metric([backend, event], count)
            overflows.add_metric([backend], counters.overflows)
            refused.add_metric([backend], counters.refused)
            resumes.add_metric([backend, "history"], counters.resumes_history)
            resumes.add_metric([backend, "snapshot"], counters.resumes_snapshot)
            subscribers.add_metric([backend], self.hub.subscribers(backend))
            prefixes.add_metric([backend], self.hub.view_size(backend))
        yield from (out, overflows, refused, resumes, subscribers, prefixes)

    def _processors(self) -> Iterator[Metric]:
        families: dict[str, CounterMetricFamily | GaugeMetricFamily] = {}
        for source in self.sources:
            try:
                stats = source.processor.stats()
            except Exception as exc:  # a scrape must not fail because of one processor
                log.warning("%s: processor stats() failed (%s)", source.backend,
                            type(exc).__name__)
                continue
            for key, value in sorted(stats.items()):
                if isinstance(value, bool) or not isinstance(value, (int, float)):
                    continue
                stat = _METRIC_NAME.sub("_", str(key).lower())
                family = families.get(stat)
                if family is None:
                    doc = f"Processor stats() {stat!r}, by backend"
                    family = families[stat] = (
                        GaugeMetricFamily(PREFIX + "processor_" + stat, doc, labels=["backend"])
                        if stat in PROCESSOR_GAUGES else
                        CounterMetricFamily(PREFIX + "processor_" + stat, doc, labels=["backend"]))
                family.add_metric([source.backend], value)
        yield from families.values()


def create_app(
    hub: EventHub,
    sources: Sequence[EventSource],
    *,
    keepalive: float = KEEPALIVE_SECONDS,
    registry: CollectorRegistry | None = None,
    token: str | None = None,
) -> falcon.App[falcon.Request, falcon.Response]:
    """The listener's WSGI app.

    Args:
        hub: The event hub (one stream per backend).
        sources: The running sources (for ``/health`` and ``/metrics``).
        keepalive: Seconds of silence before a ``: keepalive`` comment on a stream.
        registry: Where :class:`ListenerCollector` is registered (default: a new one).
        token: The bearer token ``/events`` requires (None: open).
    """
    if registry is None:
        registry = CollectorRegistry(auto_describe=False)
    events = _Events(hub, keepalive, token)
    registry.register(ListenerCollector(hub, sources, events))
    app = falcon.App()
    app.set_error_serializer(_serialize_error)
    app.add_route("/events/{backend}", events)
    app.add_route("/health", _Health(hub, sources))
    app.add_route("/metrics", _Metrics(registry))
    return app


class _NoDelayHandler(WSGIHandler):  # type: ignore[misc]
    """Sends each SSE record at once: no Nagle delay on the response socket."""

    def handle(self) -> None:
        try:
            self.socket.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        except OSError:  # not a TCP socket
            pass
        super().handle()


def parse_listen(listen: str) -> tuple[str, int]:
    """``host:port`` (``[v6]:port`` too) → ``(host, port)``.

    Raises:
        ValueError: Not ``host:port``.
    """
    host, _, port = listen.rpartition(":")
    if not host or not port.isdigit():
        raise ValueError(f"listen must be host:port, got {listen!r}")
    if host.startswith("[") and host.endswith("]"):
        host = host[1:-1]
    return host, int(port)


def make_server(app: Callable[..., Any], listen: str) -> WSGIServer:
    """A gevent WSGI server for ``app`` on ``listen`` (not started; port 0 picks one)."""
    host, port = parse_listen(listen)
    return WSGIServer((host, port), app, handler_class=_NoDelayHandler, log=None)
