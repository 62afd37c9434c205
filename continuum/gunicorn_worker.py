"""The router's gunicorn worker: gunicorn's gevent worker with a deadline on request headers.

gunicorn's gevent worker reads each request's header under a single ``keepalive`` timer
(75 s here), the same one that bounds the idle wait between two requests of a kept-alive
connection. A client that sends its header a byte at a time therefore holds one of the
worker's ``worker_connections`` for that long, and enough of them shut every other client
out. This worker separates the two, like nginx's ``client_header_timeout`` and
``keepalive_timeout``: a kept-alive connection may stay idle for ``keepalive`` seconds, but
once the next request's first byte has arrived (for a connection's first request: once it
is accepted), its whole header, and whatever the previous request left unread of its body,
must arrive within ``server.client_header_timeout_seconds``. A slower client gets a 408
with a JSON error body and is closed. The body's own deadline is the application's
(:func:`continuum.web.http.read_body`, ``server.client_body_timeout_seconds``).

``continuum.gunicorn_conf`` selects this worker (``worker_class``), and puts it back when
``-k gevent`` on the command line asked for gunicorn's plain one.

A plain connection (TCP without TLS, PROXY protocol or cleartext HTTP/2, with keep-alive
on) is served by the worker's own keep-alive loop (:meth:`GeventWorker._serve_plain`) for
as long as its requests' heads are on the strict fast path of
:mod:`continuum.wire.request_head` with a plain ``Content-Length`` or none: the same
keep-alive wait, header deadline, environ, response, hooks, drain of an unread body and
error answers as gunicorn's loop, without gunicorn's parser, message and body objects
(:mod:`continuum.wire.plain`). The first request outside that path, and every later one on
the connection, goes to gunicorn's loop from its first byte, where request heads are read
by :class:`~continuum.wire.request_head.FastRequest` (the same fast path in front of
gunicorn's parser, which judges everything outside it).

With several workers, each one's server is a
:class:`~continuum.wire.accept_balance.BalancedStreamServer`: a worker holding more client
connections than its share leaves new ones to the others (``server.balance_connections``).

It also saves a send per answer: gunicorn writes a response head and its body with two
``sendall`` calls (two trips through the loopback TCP stack, about a tenth of the router's
CPU per small request). :class:`_CoalescingSocket` holds the head back until the body's
first write, which takes it along, or until the request's greenlet next waits for
something (a stream whose first piece is not there yet), whichever comes first: the head
is never delayed past the moment the worker would otherwise sit idle.
"""

from __future__ import annotations

import contextlib
import errno
import functools
import gc
import logging
import os
import socket
import sys
import time
import warnings
from collections.abc import Callable
from datetime import datetime
from types import TracebackType
from typing import TYPE_CHECKING, Any

import gevent
from gevent import get_hub
from gevent.socket import socket as GeventSocket
from gevent.socket import wait_read
from gunicorn import util as gunicorn_util
from gunicorn.config import PreRequest
from gunicorn.http import wsgi as gunicorn_wsgi
from gunicorn.http.parser import RequestParser
from gunicorn.workers import ggevent
from gunicorn.workers.ggevent import GeventWorker as _GunicornGeventWorker

from continuum.config import ServerConfig
from continuum.wire import request_head, wsgi_fast
from continuum.wire.plain import RECV_SIZE, HeldInput, PlainRequest, Replayed
from continuum.wire.request_head import FastRequest, HeadRules, head_rules, parse_head
from continuum.wire.waits import arm, timer_for, wait_watcher

if TYPE_CHECKING:  # imported where a gate is made: in a worker of several, not the master
    from continuum.wire.accept_balance import AcceptGate

log = logging.getLogger(__name__)

#: The Python path gunicorn loads this worker by (``worker_class``).
WORKER_CLASS = "continuum.gunicorn_worker.GeventWorker"

#: Longest the 408 answer to a timed-out client may take to write before it is dropped.
_ANSWER_SECONDS = 1.0


class _Connection:
    """What the header deadline needs to know about the connection one greenlet serves,
    and the two timers it reuses for every request on it (a request costs no allocation
    of watchers or timers: each is started and cancelled in place)."""

    __slots__ = ("addr", "buffered", "header_timer", "idle_timer", "requests", "sock")

    def __init__(self, sock: Any, addr: Any) -> None:
        self.sock = sock
        self.addr = addr
        self.requests = 0  # requests served so far on this connection
        self.buffered = False  # bytes of the next request already read (pipelining)
        # Made at first use, and again when their length changes (a reload): a gevent
        # Timeout's seconds are fixed when it is made (setting ``.seconds`` changes nothing).
        self.header_timer: gevent.Timeout | None = None
        self.idle_timer: gevent.Timeout | None = None


class _HeaderDeadline:
    """The context gunicorn reads one request's header in (``with worker.timeout_ctx()``);
    one per connection, entered once per request.

    On a kept-alive connection it first waits up to ``keepalive`` seconds for the next
    request's first byte (none: ``StopIteration``, which gunicorn takes as "close quietly");
    then the header must be complete within the header timeout, else the 408 is sent and
    the timer's exception suppressed, which leaves gunicorn without a request: it closes.
    """

    __slots__ = ("conn", "seconds", "worker")

    def __init__(self, worker: GeventWorker, conn: _Connection) -> None:
        self.worker = worker
        self.conn = conn
        self.seconds = 0.0

    def __enter__(self) -> None:
        conn = self.conn
        if conn.requests and not conn.buffered:
            _wait_readable(conn, self.worker.cfg.keepalive)
        self.seconds = seconds = self.worker.header_timeout()
        timer = conn.header_timer = timer_for(conn.header_timer, seconds)
        arm(timer)  # timer.start()

    def __exit__(self, kind: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> bool:
        timer = self.conn.header_timer
        if timer is not None:
            timer.timer.stop()  # timer.cancel() (timer_for's timers are not one-shot)
        if timer is None or exc is not timer:
            return False
        self.worker.log.info("client %s: no complete request header within %g s; 408",
                             self.conn.addr, self.seconds)
        _answer_timeout(self.conn.sock, f"request header not received within "
                                        f"{self.seconds:g} s")
        return True


def _wait_readable(conn: _Connection, idle: float) -> None:
    """Wait up to ``idle`` seconds for the next request's first byte on a kept-alive
    connection; ``StopIteration`` when none comes. Waits on the gevent socket's own read
    watcher with the connection's reused timer (``wait_read`` would make a new watcher
    and a new timer for every request)."""
    sock = conn.sock
    watcher = getattr(sock, "_read_event", None)
    if watcher is None:  # not a gevent socket (tests, other servers): the public way
        try:
            wait_read(sock.fileno(), timeout=idle)
        except TimeoutError:
            raise StopIteration("keep-alive timeout") from None
        return
    timer = conn.idle_timer = timer_for(conn.idle_timer, idle)
    if not wait_watcher(watcher, timer):
        raise StopIteration("keep-alive timeout")


def _closing_answer(status: int, reason: str, body: bytes, request_id: str | None = None) -> bytes:
    """An answer the worker writes itself, outside the application: a JSON error ``body``
    (with ``X-Request-Id`` when given), after which the connection is closed."""
    extra = f"X-Request-Id: {request_id}\r\n" if request_id is not None else ""
    head = (f"HTTP/1.1 {status} {reason}\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(body)}\r\nConnection: close\r\n{extra}\r\n")
    return head.encode("latin-1") + body


def _answer_timeout(sock: Any, message: str) -> None:
    """Send a 408 with an OpenAI-shaped error body, without waiting on the client."""
    from continuum.web.http import error_body  # loaded in the worker by now; not in the master

    body = error_body(message, "invalid_request_error", "request_timeout")
    with contextlib.suppress(OSError), gevent.Timeout(_ANSWER_SECONDS, False):
        sock.sendall(_closing_answer(408, "Request Timeout", body))


#: The error ``code`` of each status gunicorn answers a request it refuses itself with.
_REFUSAL_CODES = {400: "bad_request", 403: "forbidden", 414: "request_line_too_long",
                  417: "expectation_failed", 431: "request_header_fields_too_large",
                  500: "internal_error", 501: "unsupported_transfer_coding"}


#: gevent's warning when ``ssl`` was imported before the worker patched it, when the only
#: module holding ssl's own ``SSLContext`` is redis-py's asyncio client (its package
#: imports it; the router uses the sync client, whose ssl use is patched).
_REDIS_ASYNCIO_SSL_WARNING = (
    r"Monkey-patching ssl after ssl has already been imported .*"
    r"Modules that had direct imports \(NOT patched\): "
    r"\['redis\.asyncio\.connection \([^)]*\)'\]\. $")


def _ignore_redis_asyncio_ssl_warning() -> None:
    """Silence gevent's ``MonkeyPatchWarning`` about patching ``ssl`` late when redis-py's
    unused asyncio client is the only module it names: ``continuum-router serve`` checks
    the config, and so imports a Redis store's module, in the process that becomes the
    master. With any other module named the warning shows as before."""
    from gevent.monkey import MonkeyPatchWarning

    warnings.filterwarnings("ignore", message=_REDIS_ASYNCIO_SSL_WARNING,
                            category=MonkeyPatchWarning)


class _AnthropicClient:
    """A client socket whose refusal is written in Anthropic's error shape (the request's
    path was read, and is under ``/anthropic/``)."""

    def __init__(self, sock: Any) -> None:
        self.sock = sock

    def __getattr__(self, name: str) -> Any:
        return getattr(self.sock, name)


def _write_refusal(sock: Any, status: int, reason: str, message: str) -> None:
    """gunicorn's ``util.write_error`` in this worker: the answer to a request gunicorn
    refuses before the application sees it (a request line over ``limit_request_line``,
    too many or too long headers, malformed HTTP, a bad chunk) in the JSON error shape
    every other answer has, with an ``X-Request-Id``, instead of an HTML page. The
    connection is closed after it, as gunicorn closes it."""
    from continuum.request import new_request_id  # loaded in the worker by now
    from continuum.routing import anthropic
    from continuum.web.http import error_body

    rid = new_request_id()
    if not message:  # an error of gunicorn's own, logged by it
        message = "internal error in the router (logged)"
    if status >= 500:
        message = f"{message} (request id {rid})"
    if isinstance(sock, _AnthropicClient):
        sock = sock.sock
        body = anthropic.error_document(status, message, rid)
    else:
        kind = "server_error" if status >= 500 else "invalid_request_error"
        body = error_body(message, kind, _REFUSAL_CODES.get(status, str(status)), None, rid)
    log.info("refused a request before reading it: %s %s: %s (request id %s)",
             status, reason, message, rid)
    gunicorn_util.write_nonblock(sock, _closing_answer(status, reason, body, rid))


class _CoalescingSocket:
    """The client socket as gunicorn's response writer sees it: its first ``sendall`` (the
    response head, or an interim 103) is held back and sent with the next one (the body),
    or from the hub as soon as the request's greenlet blocks, or when the request is done
    (:meth:`flush`); everything else goes straight to the socket, in order."""

    __slots__ = ("_first", "_pending", "_raw", "_sock")

    def __init__(self, sock: Any) -> None:
        self._sock = sock
        self._pending: bytes | None = None
        self._first = True
        # A plain gevent TCP socket's OS socket (non-blocking): its send is tried first,
        # without gevent's send wrapper around it; None for any other kind (TLS included).
        self._raw = sock._sock if type(sock) is GeventSocket else None

    def sendall(self, data: bytes) -> None:
        if self._first:
            self._first = False
            self._pending = bytes(data)
            get_hub().loop.run_callback(self._flush_from_hub)
            return
        pending = self._pending
        if pending is not None:
            self._pending = None
            data = pending + data
        # One send first: gevent's sendall asks the kernel for the buffer size each call.
        sock = self._sock
        raw = self._raw
        if raw is None:
            sent = sock.send(data)
        else:
            try:
                sent = raw.send(data)
            except BlockingIOError:  # the buffer is full: gevent's sendall waits
                sent = 0
        if sent < len(data):
            sock.sendall(memoryview(data)[sent:])

    def next_answer(self) -> None:
        """The next answer on the connection begins (its first write is held back again);
        the last one was flushed."""
        self._first = True

    def send_whole(self, data: bytes) -> None:
        """Send a whole answer (its head and all its body) at once: nothing to hold back."""
        self._first = False
        self.sendall(data)

    def _flush_from_hub(self) -> None:
        """Send what is held back without blocking (the hub must not wait): what the
        socket does not take now stays held for the next write or :meth:`flush`."""
        pending = self._pending
        if not pending:
            return
        try:
            sent = self._sock._sock.send(pending)  # the OS socket: non-blocking
        except (BlockingIOError, InterruptedError):
            return
        except OSError:
            self._pending = None  # the client is gone; gunicorn notices on its next write
            return
        self._pending = pending[sent:] or None

    def flush(self) -> None:
        """Send anything still held back (the request is over)."""
        pending, self._pending = self._pending, None
        if pending:
            with contextlib.suppress(OSError):
                self._sock.sendall(pending)

    def sendfile(self, *args: Any, **kwargs: Any) -> Any:
        self.flush()
        return self._sock.sendfile(*args, **kwargs)

    def shutdown(self, how: int) -> None:
        self.flush()
        self._sock.shutdown(how)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._sock, name)


class _HttpDate:
    """``gunicorn.util.http_date`` with the current time's answer made once a second (the
    ``Date`` header has a resolution of one second; gunicorn formats it per response)."""

    __slots__ = ("_format", "_second", "_text")

    def __init__(self, format_date: Callable[..., str]) -> None:
        self._format = format_date
        self._second = -1
        self._text = ""

    def __call__(self, timestamp: float | None = None) -> str:
        if timestamp is not None:
            return self._format(timestamp)
        second = int(time.time())
        if second != self._second:
            self._text = self._format(second)
            self._second = second
        return self._text


class _SettledConfig:
    """The worker's gunicorn ``Config`` with each setting read once: gunicorn reads about
    16 settings per request through ``Config.__getattr__`` and ``Setting.get`` (two Python
    calls each); a worker's settings do not change while it lives (a reload of gunicorn's
    config starts new workers), so the first read of a name is kept as an attribute and
    later reads are plain lookups. Setting anything is refused, as ``Config`` refuses
    settings assigned as attributes; ``set`` goes to the config and forgets the name's
    value read before; everything else (methods) is the config's."""

    __slots__ = ("__dict__", "_cfg")

    def __init__(self, cfg: Any) -> None:
        object.__setattr__(self, "_cfg", cfg)

    def __getattr__(self, name: str) -> Any:
        value = getattr(self._cfg, name)
        if not name.startswith("__"):
            self.__dict__[name] = value
        return value

    def __setattr__(self, name: str, value: Any) -> None:
        raise AttributeError("Invalid access!")

    def set(self, name: str, value: Any) -> None:
        """``Config.set``; the name is read afresh afterwards."""
        self._cfg.set(name, value)
        self.__dict__.pop(name, None)


class _ErrorsWrapper(gunicorn_wsgi.WSGIErrorsWrapper):  # type: ignore[misc]
    """gunicorn's ``wsgi.errors`` stream, made for every request as gunicorn makes it, but
    from the ``gunicorn.error`` logger looked up once (``logging.getLogger`` takes the
    logging module's lock, which under gevent's monkey-patching is a Python-level lock),
    and its streams found when it is written to rather than when it is made (most
    requests never write to it): the handlers' streams of that moment, so a reopened log
    file (``USR1``) is the one written to."""

    _log = logging.getLogger("gunicorn.error")

    def __init__(self, cfg: Any) -> None:  # gunicorn's sets the streams; see ``streams``
        self._errorlog = cfg.errorlog

    @property
    def streams(self) -> list[Any]:
        """The streams gunicorn's ``__init__`` would find now."""
        handlers = self._log.handlers
        streams = []
        if self._errorlog == "-":
            streams.append(sys.stderr)
            handlers = handlers[1:]
        for handler in handlers:
            if hasattr(handler, "stream"):
                streams.append(handler.stream)
        return streams


#: The youngest generation's threshold while serving (CPython's default is 700): a request
#: leaves few objects behind, and one collection every 700 allocations walks the objects of
#: every request then in flight and promotes them, to be walked again by the older
#: generations' collections.
GC_YOUNG_THRESHOLD = 7000


def settle_garbage_collector() -> None:
    """Before the worker serves: everything alive now (modules, the app, its config, ring and
    stores) moves to the collector's permanent generation (``gc.freeze``), so no collection
    walks it again, and the youngest generation is collected 10 times less often. Garbage
    cycles are still collected; only the objects of startup are left out of it: one of them
    that later ends up unreachable in a reference cycle is collected at the next config
    reload (:mod:`continuum.web.reload`), not before. Applied once per worker process,
    after the app has loaded."""
    gc.collect()
    gc.freeze()
    _, middle, oldest = gc.get_threshold()
    gc.set_threshold(GC_YOUNG_THRESHOLD, middle, oldest)


def serves_plain(cfg: Any) -> bool:
    """Whether the worker's own loop may serve connections under ``cfg``: kept alive,
    plain TCP without TLS, PROXY protocol or cleartext HTTP/2 (gunicorn's loop handles
    those from a connection's first byte)."""
    return bool(cfg.keepalive) and not cfg.is_ssl \
        and getattr(cfg, "proxy_protocol", "off") in ("off", False, None) \
        and getattr(cfg, "http2_cleartext", "off") in ("off", False, None)


class GeventWorker(_GunicornGeventWorker):  # type: ignore[misc]
    """gunicorn's gevent worker, with ``server.client_header_timeout_seconds``."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._connections: dict[Any, _Connection] = {}
        self._deadlines: dict[Any, _HeaderDeadline] = {}
        self._router: Any = None  # the RouterApp served, once known (None: not yet looked)
        self.accept_gate: AcceptGate | None = None  # with several workers: see run()
        #: gunicorn's head limits when the worker serves plain connections itself
        #: (:meth:`_serve_plain`); None when the config leaves every connection to gunicorn.
        self.plain_rules: HeadRules | None = None
        #: The config's ``pre_request`` hook, or None while it is gunicorn's own and would
        #: only write a debug line the error log's level drops.
        self.pre_request: Callable[..., Any] | None = None

    def init_process(self) -> None:
        """In the worker process: HTTP/1 request heads are read by
        :class:`~continuum.wire.request_head.FastRequest` (gunicorn's own request class
        with a strict fast path in front of its parser; anything outside that path is
        gunicorn's to parse, as before). gunicorn's parser makes its requests from the
        ``mesg_class`` of its class; there is no per-worker hook for it.

        Six more changes to gunicorn's module state, in this worker process only (the
        master and other worker classes keep gunicorn as it is): the parser's
        ``finish_body`` is :func:`continuum.wire.request_head.finish_body` (no drain of a
        body read to its end); ``wsgi.create`` is
        :func:`continuum.wire.wsgi_fast.create` (the same environ and response with less
        work per request); ``util.write_error`` is
        :func:`_write_refusal` (the requests gunicorn refuses itself are answered in JSON,
        not HTML); ``util.http_date`` is
        :class:`_HttpDate` (the same text, made once a second instead of per response);
        ``wsgi.errors`` is :class:`_ErrorsWrapper` (the same streams, without a
        ``logging.getLogger`` per request); and ``SCRIPT_NAME`` is set empty in the
        environment when unset: gunicorn looks it up there for every request, and an unset
        name raises and catches a ``KeyError`` each time; empty and unset mean the same to
        it (no script name). The worker's config reads each setting once
        (:class:`_SettledConfig`)."""
        RequestParser.mesg_class = FastRequest
        RequestParser.finish_body = request_head.finish_body
        gunicorn_wsgi.create = wsgi_fast.create
        gunicorn_wsgi.WSGIErrorsWrapper = _ErrorsWrapper
        gunicorn_util.write_error = _write_refusal
        _ignore_redis_asyncio_ssl_warning()  # before gunicorn's worker patches ssl
        if not isinstance(gunicorn_util.http_date, _HttpDate):
            gunicorn_util.http_date = _HttpDate(gunicorn_util.http_date)
        os.environ.setdefault("SCRIPT_NAME", "")
        cfg: Any = getattr(self, "cfg")  # noqa: B009 (gunicorn's base class is untyped)
        if not isinstance(cfg, _SettledConfig):
            self.cfg = cfg = _SettledConfig(cfg)
        if serves_plain(cfg):
            self.plain_rules = head_rules(cfg)
        super().init_process()

    def run(self) -> None:
        """gunicorn's serving loop; with several workers sharing a host segment and
        ``server.balance_connections`` on, each listener's server balances its accepts
        against the other workers' (:mod:`continuum.wire.accept_balance`). The access lines
        of the router's requests are written from the hub once their answer is
        (:class:`~continuum.web.observe.Observer`)."""
        gate = self.accept_gate = self._make_accept_gate()
        hook = self.cfg.pre_request
        error_log = getattr(self.log, "error_log", None)
        if hook is not PreRequest.default or error_log is None \
                or error_log.isEnabledFor(logging.DEBUG):
            self.pre_request = hook
        router = self.router()
        if router is not None:  # access lines are written once the answer is
            router.observer.log_after_sending(get_hub().loop.run_callback)
        if gate is not None:
            from continuum.wire.accept_balance import BalancedStreamServer

            # gunicorn's run() builds its servers from this module name (worker process only)
            ggevent.StreamServer = functools.partial(BalancedStreamServer, gate=gate)
        settle_garbage_collector()
        super().run()

    def _make_accept_gate(self) -> AcceptGate | None:
        router = self.router()
        if router is None or self.cfg.workers < 2:
            return None
        service = router.service
        if service.host is None or not service.config.server.balance_connections:
            return None
        from continuum.wire.accept_balance import AcceptGate

        return AcceptGate(service.host)

    def handle(self, listener: Any, client: Any, addr: Any) -> None:
        """Serve one connection (in its own greenlet), remembering it for
        :meth:`timeout_ctx` and counting it for the accept gate: a plain one with the
        worker's own loop (:meth:`_serve_plain`) while its requests allow, the rest with
        gunicorn's."""
        me = gevent.getcurrent()
        conn = self._connections[me] = _Connection(client, addr)
        self._deadlines[me] = _HeaderDeadline(self, conn)
        gate = self.accept_gate
        if gate is not None:
            gate.opened()
        try:
            rules = self.plain_rules
            if rules is not None and type(client) is GeventSocket and type(addr) is tuple \
                    and not os.environ.get("SCRIPT_NAME"):
                held = self._serve_plain(rules, listener, client, addr, self._deadlines[me])
                if held is None:
                    return
                conn.buffered = True
                client = Replayed(client, held)
            super().handle(listener, client, addr)
        finally:
            del self._connections[me]
            del self._deadlines[me]
            if gate is not None:
                gate.closed()

    def _serve_plain(self, rules: HeadRules, listener: Any, sock: Any, addr: tuple[Any, ...],
                     deadline: _HeaderDeadline) -> bytes | None:
        """Serve the connection's requests while each head is one
        :func:`~continuum.wire.request_head.parse_head` takes with a plain body length
        (see :mod:`continuum.wire.plain`), as gunicorn's loop would serve them: the same
        keep-alive wait, header deadline, environ, response, hooks, drain of an unread body
        and error answers. Returns the bytes read of the first request it leaves to
        gunicorn (from that request's first byte; the socket stays open), or None when the
        connection is over (the socket closed)."""
        conn = deadline.conn
        req: PlainRequest | None = None
        handed: bytes | None = None
        try:
            sock.setblocking(1)  # as gunicorn's gevent worker does
            out = _CoalescingSocket(sock)  # the answers' writer, one answer at a time
            server = listener.getsockname()
            cfg = self.cfg
            buf = b""  # bytes read of requests not yet served
            body: HeldInput | None = None  # the previous request's, if it left some unread
            while True:
                req = None
                conn.buffered = bool(buf)
                end = -1
                # the keep-alive wait (StopIteration: no request came), then the header
                # deadline, the unread body's drain included (a 408 when it passes)
                with deadline:
                    if body is not None and not body.drain():
                        return None  # the client closed within the body
                    while (end := buf.find(b"\r\n\r\n")) < 0:
                        # too long, or a line ending gunicorn may read differently
                        if len(buf) > rules.max_head or buf.count(b"\n") != buf.count(b"\r\n"):
                            handed = buf
                            return handed
                        data = sock.recv(RECV_SIZE)
                        if not data:
                            return None  # the client closed (within a head: as gunicorn)
                        buf += data
                if end < 0:
                    return None  # no whole head in time: the deadline answered 408
                head = parse_head(buf, end, rules)
                if head is None:
                    handed = buf  # gunicorn judges it
                    return handed
                method, uri, minor, path, query, headers, close, length = head
                if length is None:
                    handed = buf  # a Content-Length gunicorn judges
                    return handed
                start = end + 4
                stop = start + length
                if len(buf) >= stop:
                    body = HeldInput(buf[start:stop], 0, sock)
                    buf = buf[stop:]
                else:  # the rest of the body is still on the socket
                    body = HeldInput(buf[start:], stop - len(buf), sock)
                    buf = b""
                conn.requests += 1
                req = PlainRequest(cfg, addr, conn.requests, method, uri, minor, path, query,
                                   headers, close, body)
                out.next_answer()
                if not self._serve_one(req, sock, out, addr, server) or body.ended_early:
                    return None
        except StopIteration as exc:
            self.log.debug("Closing connection. %s", exc)
        except OSError as exc:
            if exc.errno in (errno.EPIPE, errno.ECONNRESET, errno.ENOTCONN):
                self.log.debug("Ignoring %s", errno.errorcode[exc.errno])
            else:
                self.log.exception("Socket error processing request.")
        except BaseException as exc:  # gunicorn's loop answers these too
            self.handle_error(req, sock, addr, exc)
        finally:
            if handed is None:
                gunicorn_util.close(sock)
        return None

    def _serve_one(self, req: PlainRequest, sock: Any, out: _CoalescingSocket,
                   addr: tuple[Any, ...], server: tuple[Any, ...]) -> bool:
        """One request of :meth:`_serve_plain`, as gunicorn's ``handle_request`` serves it;
        whether the connection stays open. An error before the answer began is raised
        (the caller answers it and closes)."""
        cfg, log = self.cfg, self.log
        started = datetime.now() if getattr(log, "access_log_enabled", True) else None
        environ: dict[str, Any] = {}
        resp = None
        try:
            pre_request = self.pre_request
            if pre_request is not None:
                pre_request(self, req)
            resp, environ = wsgi_fast.create_plain(req, out, addr, server, cfg)
            self.nr += 1
            if self.nr >= self.max_requests and self.alive:  # type: ignore[has-type]
                log.info("Autorestarting worker after current request.")
                self.alive = False
            if not self.alive:
                resp.force_close()
            respiter = self.wsgi(environ, resp.start_response)
            if self.is_already_handled(respiter):
                return True
            try:
                if isinstance(respiter, environ["wsgi.file_wrapper"]):
                    resp.write_file(respiter)
                else:
                    for item in respiter:
                        resp.write(item)
                resp.close()
            finally:
                if started is not None:
                    log.access(resp, req, environ, datetime.now() - started)
                close = getattr(respiter, "close", None)
                if close is not None:
                    close()
            return not resp.should_close()
        except OSError:
            raise
        except (gevent.GreenletExit, SystemExit):
            return False  # the worker is stopping this greenlet
        except Exception:
            if resp is None or not resp.headers_sent:
                raise
            log.exception("Error handling request")  # too late for an error answer
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)
                sock.close()
            return False
        finally:
            try:
                cfg.post_request(self, req, environ, resp)
            except Exception:
                log.exception("Exception in post_request hook")
            out.flush()

    def handle_request(self, listener_name: Any, req: Any, sock: Any, addr: Any) -> Any:
        """Serve one request; then note whether the next one has already begun arriving."""
        conn = self._connections.get(gevent.getcurrent())
        out = _CoalescingSocket(sock)
        try:
            return super().handle_request(listener_name, req, out, addr)
        finally:
            out.flush()
            if conn is not None:
                conn.requests += 1
                buf = getattr(getattr(req, "unreader", None), "buf", None)
                # The unread bytes: seek to the end reports their count without copying
                # them (the unreader seeks there itself before every read).
                conn.buffered = buf is None or buf.seek(0, os.SEEK_END) > 0 \
                    or bool(getattr(sock, "held", None))  # a Replayed socket's bytes

    def handle_error(self, req: Any, client: Any, addr: Any, exc: BaseException) -> None:
        """gunicorn's answer to an error (its log lines and access record included),
        written by :func:`_write_refusal`: in Anthropic's shape when the request's path,
        read or only peeked at (a request line over the limit), is under ``/anthropic/``."""
        path = getattr(req if req is not None else getattr(exc, "req", None), "path", None)
        anthropic = path.startswith("/anthropic/") if isinstance(path, str) else \
            getattr(exc, "continuum_anthropic", False)  # FastRequest.parse peeked at the line
        if anthropic:
            client = _AnthropicClient(client)
        super().handle_error(req, client, addr, exc)

    def timeout_ctx(self) -> Any:
        """The deadline for reading the next request's header (see the module doc)."""
        deadline = self._deadlines.get(gevent.getcurrent())
        if deadline is None:  # not a connection of handle(): gunicorn's own keep-alive timer
            return super().timeout_ctx()
        return deadline

    def header_timeout(self) -> float:
        """``server.client_header_timeout_seconds`` of the running config (reloads
        included), or its default when the worker serves some other application."""
        router = self.router()
        if router is None:
            return ServerConfig.client_header_timeout_seconds
        seconds: float = router.service.config.server.client_header_timeout_seconds
        return seconds

    def router(self) -> Any:
        """The :class:`~continuum.web.app.RouterApp` this worker serves, or None when it
        serves some other application."""
        router = self._router
        if router is None:
            from continuum.web.app import RouterApp

            router = self._router = self.wsgi if isinstance(self.wsgi, RouterApp) else False
        return router or None
