"""The event bus's worker side: the loopback SSE relay every worker's consumer reads.

``GET /events/<backend>`` (with the token from ``bus-local.json``) picks a listener session
announcing the backend, sends it ``subscribe`` with the consumer's ``Last-Event-ID`` and
relays the pushed bytes unchanged as the response body (see
:mod:`continuum.kv.bus_server` for the listener side and the backpressure rule). 503 with
``X-Continuum-Bus: no_session`` when no session announces the backend; 504 with
``subscribe_timeout`` when the listener does not open the stream in time. Also holds the
bus process's metrics.
"""

from __future__ import annotations

import contextlib
import hmac
import json
import secrets
from collections import deque
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

import h2.exceptions
from gevent.event import Event
from prometheus_client import CollectorRegistry, Counter, Gauge

from continuum.kv.bus import REFUSALS, BusRegistry, Session

if TYPE_CHECKING:
    from continuum.kv.bus_server import BusConnection

NO_SESSION, SUBSCRIBE_TIMEOUT = "no_session", "subscribe_timeout"


class BusMetrics:
    """The bus process's metrics (multiprocess files: every worker's ``/metrics`` has them).

    ``sessions`` is the live sessions by role; ``refused`` counts sessions refused by
    reason (unauthenticated, wrong_role, unlisted_backend, bad_hello, tls); ``forbidden``
    counts sessions a hot reload ended; ``subscribes`` counts consumer requests by backend
    and outcome (opened, no_session, subscribe_timeout); ``bytes`` counts relayed bytes.
    """

    def __init__(self, registry: CollectorRegistry) -> None:
        self.sessions = Gauge("continuum_event_bus_sessions", "Live listener sessions on the "
                              "event bus", ["role"], multiprocess_mode="livesum",
                              registry=registry)
        self.refused = Counter("continuum_event_bus_sessions_refused_total", "Sessions the "
                               "event bus refused, by reason", ["reason"], registry=registry)
        self.forbidden = Counter("continuum_event_bus_sessions_forbidden_total", "Sessions "
                                 "ended with forbidden by a hot reload", registry=registry)
        self.subscribes = Counter("continuum_event_bus_subscribes_total", "Consumer stream "
                                  "requests by backend and outcome", ["backend", "outcome"],
                                  registry=registry)
        self.bytes = Counter("continuum_event_bus_relayed_bytes_total", "Pushed SSE bytes "
                             "relayed to consumers", ["backend"], registry=registry)
        self.sessions.labels("kv_listener").set(0)
        for reason in (*REFUSALS, "tls"):
            self.refused.labels(reason)


class Relay:
    """One pushed stream on its way from a listener's session to a worker's consumer."""

    def __init__(self, sid: str, backend: str, session: Session) -> None:
        self.sid = sid
        self.backend = backend
        self.session = session
        self.h2_stream: int | None = None
        self.chunks: deque[tuple[bytes, int]] = deque()
        self.wake = Event()
        self.opened = Event()
        self.ended = False

    def push(self, data: bytes, flow: int) -> None:
        self.chunks.append((data, flow))
        self.wake.set()

    def end(self) -> None:
        self.ended = True
        self.opened.set()
        self.wake.set()


def error_body(kind: str, message: str) -> dict[str, Any]:
    """The bus's JSON error body."""
    return {"error": {"type": kind, "message": message}}


class LocalRelay:
    """The WSGI app on the bus's loopback port (one per bus process)."""

    def __init__(self, registry: BusRegistry, metrics: BusMetrics, pending: dict[str, Relay],
                 subscribe_timeout: float, token: str) -> None:
        self.registry = registry
        self.metrics = metrics
        self.pending = pending
        self.subscribe_timeout = subscribe_timeout
        self.local_token = token

    def app(self, environ: dict[str, Any], start_response: Any) -> Any:
        path: str = environ.get("PATH_INFO", "")
        sent = environ.get("HTTP_AUTHORIZATION", "")
        if not hmac.compare_digest(sent.encode(), f"Bearer {self.local_token}".encode()):
            return _plain(start_response, "401 Unauthorized", error_body("unauthorized", "token"))
        if path == "/health":
            return _plain(start_response, "200 OK", {"announced": self.registry.announced(),
                                                     "sessions": len(self.registry.sessions)})
        if not path.startswith("/events/"):
            return _plain(start_response, "404 Not Found", error_body("not_found", path))
        backend = path[len("/events/"):]
        last_id = environ.get("HTTP_LAST_EVENT_ID") or None
        session = self.registry.pick(backend)
        if session is None:
            self.metrics.subscribes.labels(backend, NO_SESSION).inc()
            return _plain(start_response, "503 Service Unavailable",
                          error_body(NO_SESSION, f"no listener session announces {backend!r}"),
                          [("X-Continuum-Bus", NO_SESSION)])
        sid = secrets.token_hex(8)
        relay = Relay(sid, backend, session)
        self.pending[sid] = relay
        link: BusConnection = session.link
        try:
            link.send_line({"type": "subscribe", "stream": sid, "source": backend,
                            "last_event_id": last_id})
        except (OSError, ConnectionError, h2.exceptions.ProtocolError):
            relay.end()
        if not relay.opened.wait(self.subscribe_timeout) or relay.h2_stream is None:
            self.pending.pop(sid, None)
            self.metrics.subscribes.labels(backend, SUBSCRIBE_TIMEOUT).inc()
            return _plain(start_response, "504 Gateway Timeout",
                          error_body(SUBSCRIBE_TIMEOUT, f"the listener did not open {backend!r}"),
                          [("X-Continuum-Bus", SUBSCRIBE_TIMEOUT)])
        self.metrics.subscribes.labels(backend, "opened").inc()
        start_response("200 OK", [("Content-Type", "text/event-stream"),
                                  ("Cache-Control", "no-cache"), ("Connection", "close"),
                                  ("X-Continuum-Bus-Session", session.id)])
        return self._relay(relay, link)

    def _relay(self, relay: Relay, link: BusConnection) -> Iterator[bytes]:
        bytes_out = self.metrics.bytes.labels(relay.backend)
        stream = relay.h2_stream
        assert stream is not None
        try:
            while True:
                while relay.chunks:
                    data, flow = relay.chunks.popleft()
                    yield data  # written to the worker's socket before the credit returns
                    bytes_out.inc(len(data))
                    link.ack(stream, flow)
                if relay.ended:
                    return
                relay.wake.clear()
                relay.wake.wait()
        finally:
            if not relay.ended:  # the worker went away: stop the listener's pusher
                link.relays.pop(stream, None)
                relay.end()
                link.reset(stream)
                with contextlib.suppress(OSError, ConnectionError, h2.exceptions.ProtocolError):
                    link.send_line({"type": "unsubscribe", "stream": relay.sid})


def _plain(start_response: Any, status: str, body: dict[str, Any],
           headers: list[tuple[str, str]] | None = None) -> list[bytes]:
    data = json.dumps(body).encode()
    start_response(status, [("Content-Type", "application/json"),
                            ("Content-Length", str(len(data))), *(headers or [])])
    return [data]
