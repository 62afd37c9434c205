"""Push mode: the listener connects out to the router's event bus and pushes its streams.

One TLS connection (ALPN ``h2``) to ``event_bus.url`` carries everything:

1. stream 1, ``POST /bus/v1/session``: the request body starts with the hello
   (``{"type": "hello", "role": "kv_listener", "client_id", "sources"}``, every source of
   this listener); the response is ``welcome``, then ``subscribe`` / ``unsubscribe`` /
   ``forbidden`` lines (newline-delimited JSON).
2. for each ``subscribe`` (``stream``, ``source``, ``last_event_id``): ``POST
   /bus/v1/streams/<stream>`` whose body is :meth:`listener.hub.EventHub.stream` — the very
   generator behind ``GET /events/<backend>``, so the pushed bytes are the pull bytes.
3. on SIGTERM: ``{"type": "draining"}`` on the session (the bus stops offering it), then the
   hub's ``draining`` ends every pushed stream (the router resubscribes elsewhere at once),
   then the session closes after at most ``drain_deadline``.

Authentication: ``Authorization: Bearer <credential>`` when a credential is configured,
and/or a client certificate (mTLS). A refused or lost session is retried after
``reconnect_backoff`` (doubling from ``initial`` to ``max``; back to ``initial`` after a
welcome). HTTP/2 flow control paces each stream: a router that stops reading stops this
stream's generator, whose hub queue then overflows into ``buffer_overflow``.

Session states (``state``), changed only by the loop greenlet:

    ==========  =====================================  ===========
    state       event                                  next
    ==========  =====================================  ===========
    idle        start                                  connecting
    connecting  welcome                                open
    connecting  refused / connection lost              backoff
    open        forbidden / connection lost            backoff
    open        drain()                                draining
    backoff     delay over                             connecting
    (any)       stop()                                 stopped
    ==========  =====================================  ===========
"""

from __future__ import annotations

import contextlib
import json
import logging
import ssl as std_ssl
from dataclasses import dataclass, field
from typing import Any

import gevent
import h2.config
import h2.connection
import h2.errors
import h2.events
import h2.exceptions
import h2.settings
from gevent import socket, ssl  # cooperative even where nothing is monkey-patched
from gevent.event import Event
from gevent.lock import Semaphore

from listener.bus_config import BusClientConfig
from listener.hub import EventHub, SubscriberLimitError

__all__ = ["BusClient", "BusCounters"]

log = logging.getLogger(__name__)
# hpack logs every header it encodes at DEBUG, the bearer token included: never below INFO
for _name in ("hpack", "h2"):
    logging.getLogger(_name).setLevel(max(logging.getLogger(_name).level, logging.INFO))

SESSION_PATH = "/bus/v1/session"
STREAMS_PATH = "/bus/v1/streams/"
READ_SIZE = 64 * 1024
MAX_LINE = 64 * 1024
IDLE, CONNECTING, OPEN, DRAINING, BACKOFF, STOPPED = (
    "idle", "connecting", "open", "draining", "backoff", "stopped")


class SessionEnded(Exception):
    """The session ended; ``reason`` says why (for the log and the counters)."""

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


@dataclass
class BusCounters:
    """What the bus client counts (exported by the listener's ``/metrics``)."""

    sessions: dict[str, int] = field(default_factory=dict)  # by outcome
    streams: int = 0
    bytes_out: int = 0


class _Link:
    """One TLS connection's HTTP/2 state; every frame goes out under ``lock``, in order."""

    def __init__(self, sock: Any) -> None:
        self.sock = sock
        self.conn = h2.connection.H2Connection(h2.config.H2Configuration(
            client_side=True, header_encoding="utf-8"))
        self.lock = Semaphore()
        self.window = Event()
        self.pushers: dict[int, gevent.Greenlet] = {}
        self.by_sid: dict[str, int] = {}

    def call(self, fn: Any, *args: Any, **kwargs: Any) -> Any:
        with self.lock:
            result = fn(*args, **kwargs)
            data = self.conn.data_to_send()
            if data:
                self.sock.sendall(data)
            return result

    def send(self, stream: int, data: bytes) -> None:
        """Send ``data`` on ``stream`` as the peer's flow-control window allows."""
        view = memoryview(data)
        while view:
            size = min(self.conn.local_flow_control_window(stream),
                       self.conn.max_outbound_frame_size, len(view))
            if size <= 0:
                self.window.clear()
                self.window.wait(1.0)
                continue
            self.call(self.conn.send_data, stream, view[:size].tobytes())
            view = view[size:]


def _status(headers: Any) -> int:
    """``:status`` of a response's headers (str with ``header_encoding``, else bytes)."""
    for name, value in headers or ():
        if name in (":status", b":status"):
            return int(value)
    return 0


class BusClient:
    """The push-mode client of one listener.

    Args:
        config: The listener's ``event_bus`` section.
        hub: The hub whose streams are pushed.
        keepalive: Seconds of silence before a ``: keepalive`` comment (as on ``/events``).
    """

    def __init__(self, config: BusClientConfig, hub: EventHub, keepalive: float) -> None:
        self.config = config
        self.hub = hub
        self.keepalive = keepalive
        self.state = IDLE
        self.session_id: str | None = None
        self.counters = BusCounters()
        self._stop = Event()
        self._link: _Link | None = None
        self._greenlet: gevent.Greenlet | None = None
        self._ssl = self._ssl_context(config)

    @staticmethod
    def _ssl_context(config: BusClientConfig) -> ssl.SSLContext:
        ctx = ssl.SSLContext(std_ssl.PROTOCOL_TLS_CLIENT)  # gevent's: cooperative sockets
        if config.ca_file:
            ctx.load_verify_locations(config.ca_file)
        else:
            ctx.load_default_certs()
        ctx.minimum_version = std_ssl.TLSVersion.TLSv1_2
        ctx.set_alpn_protocols(["h2"])
        if config.client_cert_file and config.client_key_file:
            ctx.load_cert_chain(config.client_cert_file, config.client_key_file)
        return ctx

    @property
    def connected(self) -> bool:
        """True while a session is open (welcomed, not yet draining)."""
        return self.state == OPEN

    def start(self) -> None:
        """Run the session loop in a greenlet."""
        self.state = CONNECTING
        self._greenlet = gevent.spawn(self._run)

    def _count(self, outcome: str) -> None:
        self.counters.sessions[outcome] = self.counters.sessions.get(outcome, 0) + 1

    def _run(self) -> None:
        backoff = self.config.reconnect_backoff
        delay = backoff.initial
        while not self._stop.is_set():
            self.state = CONNECTING
            welcomed = False
            try:
                welcomed = self._session()
                reason = "closed by the router"
            except SessionEnded as exc:
                reason = exc.reason
            except (OSError, ssl.SSLError, h2.exceptions.ProtocolError) as exc:
                reason = f"{type(exc).__name__}: {exc}"
            finally:
                self._drop_link()
            if self._stop.is_set() or self.state == DRAINING:
                break
            if welcomed:
                delay = backoff.initial
            self.state = BACKOFF
            log.warning("event bus session ended (%s); reconnecting in %.1f s", reason, delay)
            self._stop.wait(delay)
            delay = min(delay * 2, backoff.max)
        if self.state != DRAINING:
            self.state = STOPPED

    def _connect(self) -> _Link:
        host, port = self.config.address
        timeout = self.config.connect_timeout
        raw = socket.create_connection((host, port), timeout=timeout)
        try:
            raw.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            sock = self._ssl.wrap_socket(raw, server_hostname=self.config.tls_server_name
                                         or host)
        except BaseException:
            raw.close()
            raise
        if sock.selected_alpn_protocol() != "h2":
            sock.close()
            raise SessionEnded("the event bus did not negotiate h2")
        return _Link(sock)

    def _session(self) -> bool:
        """One connection and session; returns whether it was welcomed."""
        link = self._link = self._connect()
        host, port = self.config.address
        authority = f"{host}:{port}"
        with link.lock:
            link.conn.initiate_connection()
            link.conn.update_settings({h2.settings.SettingCodes.ENABLE_PUSH: 0})
        headers = [(":method", "POST"), (":scheme", "https"), (":authority", authority),
                   (":path", SESSION_PATH), ("content-type", "application/x-ndjson")]
        token = self.config.resolved_credential()
        if token:
            headers.append(("authorization", f"Bearer {token}"))
        hello = {"type": "hello", "role": "kv_listener", "client_id": self.config.client_id,
                 "sources": list(self.hub.backends)}
        link.call(link.conn.send_headers, 1, headers)
        link.call(link.conn.send_data, 1, json.dumps(hello).encode() + b"\n")
        link.sock.settimeout(self.config.connect_timeout)  # until the welcome
        status: int | None = None
        body = b""
        welcomed = False
        while not self._stop.is_set():
            data = link.sock.recv(READ_SIZE)
            if not data:
                raise SessionEnded("connection closed by the router")
            with link.lock:
                events = link.conn.receive_data(data)
                out = link.conn.data_to_send()
                if out:
                    link.sock.sendall(out)
            for event in events:
                if isinstance(event, h2.events.ResponseReceived):
                    code = _status(event.headers)
                    if event.stream_id == 1:
                        status = code
                    elif code != 200:
                        self._kill_pusher(link, event.stream_id)
                elif isinstance(event, h2.events.DataReceived):
                    link.call(link.conn.acknowledge_received_data,
                              event.flow_controlled_length, event.stream_id)
                    if event.stream_id != 1:
                        continue
                    body += event.data
                    if status != 200:
                        continue
                    while b"\n" in body:
                        line, _, body = body.partition(b"\n")
                        if self._control(link, line):
                            welcomed = True
                            link.sock.settimeout(None)
                    if len(body) > MAX_LINE:
                        raise SessionEnded("control line too long")
                elif isinstance(event, h2.events.StreamEnded) and event.stream_id == 1:
                    if status != 200:
                        self._count("refused")
                        raise SessionEnded(f"refused with {status}: "
                                           f"{body[:500].decode(errors='replace')}")
                    raise SessionEnded("the router ended the session")
                elif isinstance(event, h2.events.StreamReset):
                    if event.stream_id == 1:
                        raise SessionEnded("the router reset the session")
                    self._kill_pusher(link, event.stream_id)
                elif isinstance(event, h2.events.WindowUpdated):
                    link.window.set()
                elif isinstance(event, h2.events.ConnectionTerminated):
                    raise SessionEnded(f"the router closed the connection "
                                       f"({event.error_code!r})")
        return welcomed

    def _control(self, link: _Link, line: bytes) -> bool:
        """Handle one control line; True for the welcome."""
        try:
            doc = json.loads(line)
        except ValueError:
            return False
        kind = doc.get("type") if isinstance(doc, dict) else None
        if kind == "welcome":
            self.session_id = str(doc.get("session"))
            self.state = OPEN
            self._count("welcomed")
            log.info("event bus session %s open on %s as %s, announcing %s", self.session_id,
                     self.config.url, self.config.client_id, ", ".join(self.hub.backends))
            return True
        if kind == "subscribe":
            sid, source = str(doc.get("stream", "")), str(doc.get("source", ""))
            last = doc.get("last_event_id")
            self._push(link, sid, source, last if isinstance(last, str) else None)
        elif kind == "unsubscribe":
            stream = link.by_sid.get(str(doc.get("stream", "")))
            if stream is not None:
                self._kill_pusher(link, stream)
        elif kind == "forbidden":
            self._count("forbidden")
            log.error("event bus: session %s ended with forbidden: %s", self.session_id,
                      doc.get("reason"))
            raise SessionEnded(f"forbidden: {doc.get('reason')}")
        return False

    def _push(self, link: _Link, sid: str, source: str, last_id: str | None) -> None:
        host, port = self.config.address
        headers = [(":method", "POST"), (":scheme", "https"), (":authority", f"{host}:{port}"),
                   (":path", STREAMS_PATH + sid), ("content-type", "text/event-stream")]
        # Allocate the stream id and open it in one step under the lock: an id is only
        # taken once its HEADERS are out, and ids must go out in increasing order.
        with link.lock:
            stream = link.conn.get_next_available_stream_id()
            link.conn.send_headers(stream, headers)
            link.sock.sendall(link.conn.data_to_send())
        link.by_sid[sid] = stream
        link.pushers[stream] = gevent.spawn(self._pusher, link, stream, sid, source, last_id)

    def _pusher(self, link: _Link, stream: int, sid: str, source: str,
                last_id: str | None) -> None:
        try:
            try:
                generator = self.hub.stream(source, last_id, self.keepalive)
            except (KeyError, SubscriberLimitError) as exc:
                log.warning("event bus: cannot push %s: %s", source, exc)
                link.call(link.conn.reset_stream, stream, h2.errors.ErrorCodes.REFUSED_STREAM)
                return
            self.counters.streams += 1
            log.info("event bus: pushing %s on stream %s (resume id %s)", source, sid, last_id)
            try:
                for chunk in generator:
                    link.send(stream, chunk)
                    self.counters.bytes_out += len(chunk)
                link.call(link.conn.end_stream, stream)
            finally:
                generator.close()
        except (OSError, h2.exceptions.StreamClosedError, h2.exceptions.ProtocolError):
            pass
        finally:
            link.pushers.pop(stream, None)
            link.by_sid.pop(sid, None)

    def _kill_pusher(self, link: _Link, stream: int) -> None:
        greenlet = link.pushers.pop(stream, None)
        if greenlet is not None and greenlet is not gevent.getcurrent():
            greenlet.kill(block=False)
        with contextlib.suppress(OSError, h2.exceptions.StreamClosedError,
                                 h2.exceptions.ProtocolError):
            link.call(link.conn.reset_stream, stream, h2.errors.ErrorCodes.CANCEL)

    def _drop_link(self) -> None:
        link, self._link = self._link, None
        if link is None:
            return
        for greenlet in list(link.pushers.values()):
            greenlet.kill(block=False)
        link.pushers.clear()
        with contextlib.suppress(OSError, h2.exceptions.ProtocolError):
            link.call(link.conn.close_connection)
        with contextlib.suppress(OSError):
            link.sock.close()

    def drain(self) -> None:
        """Tell the router this session is going away (before the hub sends ``draining``)."""
        link = self._link
        if link is None or self.state != OPEN:
            return
        self.state = DRAINING
        with contextlib.suppress(OSError, h2.exceptions.ProtocolError):
            link.call(link.conn.send_data, 1, b'{"type":"draining"}\n')
        log.info("event bus: session %s draining", self.session_id)

    def stop(self, deadline: float | None = None) -> None:
        """Let the pushed streams finish (up to ``deadline``, default ``drain_deadline``),
        then close the session and the loop; idempotent."""
        deadline = self.config.drain_deadline if deadline is None else deadline
        link = self._link
        if link is not None and link.pushers:
            gevent.joinall(list(link.pushers.values()), timeout=deadline)
        self._stop.set()
        if link is not None:
            with contextlib.suppress(OSError, h2.exceptions.ProtocolError):
                link.call(link.conn.end_stream, 1)
        self._drop_link()
        if self._greenlet is not None:
            self._greenlet.join(timeout=5)
        self.state = STOPPED
