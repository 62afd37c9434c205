"""The event bus's two sockets: HTTP/2 over TLS for listeners, loopback SSE for the workers.

Runs inside the bus process (:mod:`continuum.kv.bus_process`), gevent-patched, one greenlet
per connection and one per relayed stream.

**Listener side** (``dynamo.event_bus.listen``, TLS only, ALPN ``h2``). One TLS connection
per listener carries its session and every stream it pushes:

* stream 1, ``POST /bus/v1/session``: the request body is newline-delimited JSON — the
  hello first, later ``{"type": "draining"}``; the response body is newline-delimited
  JSON too — ``welcome``, then a ``subscribe`` per consumer request (``stream``,
  ``source``, ``last_event_id``), ``unsubscribe`` when that consumer went away, and
  ``forbidden`` before the bus ends a session a hot reload no longer allows. A refused
  session gets 400/401/403 and a JSON error body (``{"error": {"type", "message"}}``).
* ``POST /bus/v1/streams/<id>``: the listener answers a ``subscribe`` with the exact SSE
  bytes of its ``GET /events/<backend>?last_event_id=…``. Only the connection that was
  sent that subscribe may open it.

**Worker side** (:mod:`continuum.kv.bus_local`): ``127.0.0.1``, a random port and a
random token, both written to ``bus-local.json`` in the runtime directory (mode 0600).
``GET /events/<backend>`` with the consumer's ``Last-Event-ID`` picks a session
(:meth:`BusRegistry.pick`), sends it ``subscribe`` and relays the pushed bytes unchanged
as the response body; the worker's ordinary SSE consumer (the pull-mode parser) reads
them. No session announces the backend: 503 with ``X-Continuum-Bus: no_session``. The
listener does not open the stream within ``subscribe_timeout``: 504 with
``X-Continuum-Bus: subscribe_timeout``.

**Backpressure.** The bus acknowledges a stream's HTTP/2 data (returns flow-control
credit) only after writing it to the worker's socket, so a slow worker stalls its own
stream, the listener's subscriber queue fills, and the listener closes the stream with
``buffer_overflow`` — the consumer resubscribes from its last id. Buffered data per stream
is bounded by the window (:data:`STREAM_WINDOW`).
"""

from __future__ import annotations

import contextlib
import json
import logging
import secrets
import socket
import ssl
import time
from collections.abc import Callable
from typing import Any
from urllib.parse import unquote

import h2.config
import h2.connection
import h2.errors
import h2.events
import h2.exceptions
import h2.settings
from gevent.event import Event
from gevent.lock import Semaphore
from gevent.pywsgi import WSGIServer
from gevent.server import StreamServer
from prometheus_client import CollectorRegistry

from continuum.config.event_bus import EventBusConfig
from continuum.kv.bus import BusRefused, BusRegistry, Hello, Session
from continuum.kv.bus_local import BusMetrics, LocalRelay, Relay, error_body

log = logging.getLogger(__name__)
# hpack logs every header it encodes at DEBUG, the bearer token included: never below INFO
for _name in ("hpack", "h2"):
    logging.getLogger(_name).setLevel(max(logging.getLogger(_name).level, logging.INFO))

SESSION_PATH = "/bus/v1/session"
STREAMS_PATH = "/bus/v1/streams/"
#: Flow-control window per stream: the most pushed bytes the bus buffers for one relay.
STREAM_WINDOW = 1 << 20
CONNECTION_WINDOW = (1 << 30) - 65535
#: Largest control line (hello, draining) accepted from a listener.
MAX_LINE = 64 * 1024
READ_SIZE = 64 * 1024
#: Seconds a new connection gets for the TLS handshake and its hello.
HELLO_TIMEOUT = 10.0


class BusConnection:
    """One listener's TLS connection: its HTTP/2 state, session and relays."""

    def __init__(self, server: EventBus, sock: Any, cert_names: frozenset[str]) -> None:
        self.server = server
        self.sock = sock
        self.cert_names = cert_names
        self.conn = h2.connection.H2Connection(h2.config.H2Configuration(
            client_side=False, header_encoding="utf-8"))
        self.lock = Semaphore()
        self.session: Session | None = None
        self.session_stream: int | None = None
        self.hello_buffer = b""
        self.bearer: str | None = None
        self.relays: dict[int, Relay] = {}
        self.window = Event()
        self.closed = False

    # -- sending (every h2 call that produces bytes sends them under the lock, in order) --

    def _flush(self) -> None:
        data = self.conn.data_to_send()
        if data:
            self.sock.sendall(data)

    def call(self, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        with self.lock:
            result = fn(*args, **kwargs)
            self._flush()
            return result

    def send_line(self, doc: dict[str, Any], end: bool = False) -> None:
        """One control message on the session's response stream."""
        stream = self.session_stream
        if stream is None or self.closed:
            return
        data = json.dumps(doc, separators=(",", ":")).encode() + b"\n"
        while len(data) > self.conn.local_flow_control_window(stream):
            self.window.clear()
            if not self.window.wait(10):
                raise ConnectionError("the listener does not read its session stream")
        self.call(self.conn.send_data, stream, data, end_stream=end)

    def respond(self, stream: int, status: int, body: dict[str, Any] | None = None,
                content_type: str = "application/json", end: bool = True) -> None:
        headers = [(":status", str(status)), ("content-type", content_type)]
        with self.lock:
            if body is None:
                self.conn.send_headers(stream, headers, end_stream=end)
            else:
                self.conn.send_headers(stream, headers)
                self.conn.send_data(stream, json.dumps(body).encode(), end_stream=end)
            self._flush()

    def ack(self, stream: int, flow: int) -> None:
        """Return ``flow`` bytes of credit once the worker got them."""
        with contextlib.suppress(h2.exceptions.StreamClosedError, OSError,
                                 h2.exceptions.ProtocolError):
            self.call(self.conn.acknowledge_received_data, flow, stream)

    def reset(self, stream: int) -> None:
        with contextlib.suppress(h2.exceptions.StreamClosedError, OSError,
                                 h2.exceptions.ProtocolError):
            self.call(self.conn.reset_stream, stream, h2.errors.ErrorCodes.CANCEL)

    # -- the read loop ------------------------------------------------------------------

    def run(self) -> None:
        with self.lock:
            self.conn.initiate_connection()
            self.conn.update_settings({
                h2.settings.SettingCodes.INITIAL_WINDOW_SIZE: STREAM_WINDOW,
                h2.settings.SettingCodes.MAX_CONCURRENT_STREAMS: 4096})
            # credit for the whole connection well above every stream's window, so one
            # slow relay holds back only its own stream
            self.conn.increment_flow_control_window(CONNECTION_WINDOW)
            self._flush()
        self.sock.settimeout(HELLO_TIMEOUT)  # until the hello is admitted
        deadline = time.monotonic() + HELLO_TIMEOUT  # in total, not per read
        try:
            while not self.closed:
                if self.session is None and time.monotonic() > deadline:
                    log.warning("event bus: no admitted hello within %.0f s; closing",
                                HELLO_TIMEOUT)
                    return
                data = self.sock.recv(READ_SIZE)
                if not data:
                    return
                with self.lock:
                    events = self.conn.receive_data(data)
                    self._flush()
                for event in events:
                    self._event(event)
                if self.session is not None and self.sock.gettimeout() is not None:
                    self.sock.settimeout(None)
        except (OSError, h2.exceptions.ProtocolError, ssl.SSLError) as exc:
            log.info("event bus connection ended: %s", exc)
        finally:
            self.close()

    def _event(self, event: Any) -> None:
        if isinstance(event, h2.events.RequestReceived):
            self._request(event.stream_id, _text_headers(event.headers))
        elif isinstance(event, h2.events.DataReceived):
            self._data(event.stream_id, event.data, event.flow_controlled_length)
        elif isinstance(event, h2.events.StreamEnded):
            relay = self.relays.pop(event.stream_id, None)
            if relay is not None:
                relay.end()
            elif event.stream_id == self.session_stream:
                self.closed = True  # the listener ended its session
        elif isinstance(event, h2.events.StreamReset):
            relay = self.relays.pop(event.stream_id, None)
            if relay is not None:
                relay.end()
            elif event.stream_id == self.session_stream:
                self.closed = True
        elif isinstance(event, h2.events.WindowUpdated):
            self.window.set()
        elif isinstance(event, h2.events.ConnectionTerminated):
            self.closed = True

    def _request(self, stream: int, headers: dict[str, str]) -> None:
        method, path = headers.get(":method"), headers.get(":path", "")
        auth = headers.get("authorization", "")
        if method != "POST":
            self.respond(stream, 405, error_body("method_not_allowed", "POST only"))
        elif path == SESSION_PATH and self.session_stream is None:
            self.session_stream = stream
            self.bearer = auth[7:].strip() if auth[:7].lower() == "bearer " else None
        elif path.startswith(STREAMS_PATH) and self.session is not None:
            sid = unquote(path[len(STREAMS_PATH):])
            relay = self.server.pending.get(sid)
            if relay is None or relay.session is not self.session:
                self.respond(stream, 404, error_body("not_found", f"no subscribe {sid!r} for "
                                                 "this session"))
                return
            del self.server.pending[sid]
            relay.h2_stream = stream
            self.relays[stream] = relay
            self.respond(stream, 200, end=False, content_type="text/plain")
            relay.opened.set()
        else:
            self.respond(stream, 404, error_body("not_found", f"no such endpoint {path!r} "
                                             "(one session per connection)"))

    def _data(self, stream: int, data: bytes, flow: int) -> None:
        relay = self.relays.get(stream)
        if relay is not None:
            relay.push(data, flow)
            return
        self.ack(stream, flow)  # control lines: consumed here
        if stream != self.session_stream:
            return
        if self.session is None:
            self.hello_buffer += data
            if b"\n" not in self.hello_buffer:
                if len(self.hello_buffer) > MAX_LINE:
                    self._refuse(BusRefused(400, "bad_hello", "hello line too long"))
                return
            line, _, self.hello_buffer = self.hello_buffer.partition(b"\n")
            self._hello(line)
            data = b""
        self.hello_buffer += data
        while b"\n" in self.hello_buffer:
            line, _, self.hello_buffer = self.hello_buffer.partition(b"\n")
            self._control(line)
        if len(self.hello_buffer) > MAX_LINE:
            self.closed = True

    def _hello(self, line: bytes) -> None:
        try:
            try:
                doc = json.loads(line)
            except ValueError:
                raise BusRefused(400, "bad_hello", "hello is not JSON") from None
            hello = Hello.parse(doc)
            session = self.server.registry.admit(hello, self.bearer, self.cert_names, self)
        except BusRefused as exc:
            self._refuse(exc)
            return
        self.session = session
        assert self.session_stream is not None
        self.respond(self.session_stream, 200, content_type="application/x-ndjson",
                     end=False)
        self.send_line({"type": "welcome", "session": session.id,
                        "sources": list(session.sources)})
        self.server.metrics.sessions.labels(session.role).inc()
        log.info("event bus: session %s of %s opened (via %s), announcing %s", session.id,
                 session.broker_id, "token" if session.digest else "certificate",
                 ", ".join(session.sources) or "nothing")

    def _refuse(self, exc: BusRefused) -> None:
        self.server.metrics.refused.labels(exc.reason).inc()
        log.warning("event bus: session refused (%d %s): %s", exc.status, exc.reason,
                    exc.message)
        if self.session_stream is not None:
            self.respond(self.session_stream, exc.status, error_body(exc.reason, exc.message))
        self.closed = True

    def _control(self, line: bytes) -> None:
        try:
            doc = json.loads(line)
        except ValueError:
            return
        if isinstance(doc, dict) and doc.get("type") == "draining" and self.session:
            self.session.draining = True
            log.info("event bus: session %s of %s is draining", self.session.id,
                     self.session.broker_id)

    def forbid(self, reason: str) -> None:
        """End the session with ``forbidden`` (a hot reload no longer allows it)."""
        with contextlib.suppress(OSError, h2.exceptions.ProtocolError, ConnectionError):
            self.send_line({"type": "forbidden", "reason": reason}, end=True)
        self.close()

    def close(self) -> None:
        """Forget the session, end every relay and close the socket; idempotent."""
        self.closed = True
        session, self.session = self.session, None
        if session is not None:
            self.server.registry.remove(session)
            self.server.metrics.sessions.labels(session.role).dec()
            log.info("event bus: session %s of %s closed", session.id, session.broker_id)
            for sid, relay in list(self.server.pending.items()):
                if relay.session is session:
                    del self.server.pending[sid]
                    relay.end()
        for relay in self.relays.values():
            relay.end()
        self.relays.clear()
        with contextlib.suppress(OSError, h2.exceptions.ProtocolError):
            self.call(self.conn.close_connection)
        with contextlib.suppress(OSError):
            self.sock.close()


def _text_headers(headers: Any) -> dict[str, str]:
    """Request headers as text (h2 gives str with ``header_encoding``; bytes otherwise)."""
    return {(k.decode() if isinstance(k, bytes) else k): (v.decode("latin-1") if isinstance(
        v, bytes) else v) for k, v in headers or ()}


def _cert_names(sock: Any) -> frozenset[str]:
    cert = sock.getpeercert() or {}
    return frozenset(value for kind, value in cert.get("subjectAltName", ()) if kind == "DNS")


class EventBus:
    """The bus: the TLS server for listeners and the loopback relay for workers.

    Args:
        config: ``dynamo.event_bus``.
        registry: Where the metrics go (multiprocess files when that mode is on).
        local_token: The token workers must send on the loopback port (default: random).
    """

    def __init__(self, config: EventBusConfig, registry: CollectorRegistry | None = None,
                 local_token: str | None = None) -> None:
        self.config = config
        self.registry = BusRegistry(config.brokers)
        self.metrics = BusMetrics(registry or CollectorRegistry())
        self.pending: dict[str, Relay] = {}
        self.local_token = local_token or secrets.token_urlsafe(24)
        self.ssl_context = self._ssl_context(config)
        host, _, port = config.listen.rpartition(":")
        self.tls_server = StreamServer((host.strip("[]"), int(port)), self._accept)
        self.local = LocalRelay(self.registry, self.metrics, self.pending,
                                config.subscribe_timeout, self.local_token)
        self.local_server = WSGIServer(("127.0.0.1", 0), self.local.app, log=None)
        self.connections: set[BusConnection] = set()

    @staticmethod
    def _ssl_context(config: EventBusConfig) -> ssl.SSLContext:
        ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        ctx.minimum_version = ssl.TLSVersion.TLSv1_2
        assert config.tls.cert and config.tls.key
        ctx.load_cert_chain(config.tls.cert, config.tls.key)
        ctx.set_alpn_protocols(["h2"])
        if config.tls.client_ca:
            ctx.load_verify_locations(config.tls.client_ca)
            ctx.verify_mode = ssl.CERT_OPTIONAL
        return ctx

    @property
    def tls_address(self) -> tuple[str, int]:
        return self.tls_server.address[:2]  # type: ignore[no-any-return]

    @property
    def local_url(self) -> str:
        return f"http://127.0.0.1:{self.local_server.address[1]}"

    def start(self) -> None:
        self.tls_server.start()
        self.local_server.start()
        log.info("event bus: TLS on %s:%d, workers read %s/events/<backend>",
                 *self.tls_address, self.local_url)

    def stop(self) -> None:
        self.tls_server.stop(timeout=1)
        for connection in list(self.connections):
            connection.close()
        self.local_server.stop(timeout=1)

    def update_brokers(self, config: EventBusConfig) -> int:
        """Apply reloaded ``brokers``: end every session they refuse with ``forbidden``.

        Returns:
            How many sessions were ended.
        """
        ended = self.registry.update_brokers(config.brokers)
        for session, reason in ended:
            self.metrics.forbidden.inc()
            log.warning("event bus: ending session %s of %s with forbidden: %s", session.id,
                        session.broker_id, reason)
            if isinstance(session.link, BusConnection):
                session.link.forbid(reason)
        return len(ended)

    # -- listener side ------------------------------------------------------------------

    def _accept(self, raw: socket.socket, address: Any) -> None:
        raw.settimeout(HELLO_TIMEOUT)
        try:
            sock = self.ssl_context.wrap_socket(raw, server_side=True)
        except (ssl.SSLError, OSError) as exc:
            self.metrics.refused.labels("tls").inc()
            log.warning("event bus: TLS handshake with %s failed: %s", address[0], exc)
            raw.close()
            return
        if sock.selected_alpn_protocol() != "h2":
            self.metrics.refused.labels("tls").inc()
            log.warning("event bus: %s did not negotiate h2", address[0])
            sock.close()
            return
        sock.settimeout(None)
        with contextlib.suppress(OSError):
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        connection = BusConnection(self, sock, _cert_names(sock))
        self.connections.add(connection)
        try:
            connection.run()
        finally:
            self.connections.discard(connection)

    # -- worker side --------------------------------------------------------------------
