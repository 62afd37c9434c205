"""A small HTTP/1.1 keep-alive client for the proxy hot path (in place of urllib3).

Per request: one ``sendall`` of head and body, one ``recv`` for a small answer, a head parsed
by hand, no liveness probe of pooled connections and no per-request policy objects. Under
gevent (monkey-patched ``socket``/``ssl``) every blocking call yields to the hub.

* :class:`ConnectionPool`: idle connections to one ``host:port`` (LIFO, bounded). A pooled
  connection found closed before any response byte (the server dropped an idle keep-alive
  connection; or it answered 408 first) is retried once on a fresh one, and the other idle
  connections are dropped.
* :class:`Response`: status, headers (lower-cased names, duplicates joined with ``", "``) and
  a body read with :meth:`Response.read` or :meth:`Response.stream` (Content-Length, chunked
  or until close). The connection goes back to the pool only after the whole body was read.

Errors: :class:`ConnectError` (:class:`ConnectTimeout`), :class:`ReadTimeout` (covers a stalled
send too) and :class:`ProtocolError` (malformed or over-limit answer, EOF or reset mid-message;
:class:`BodyTooLarge` when :meth:`Response.read` was given a ``limit`` and the body exceeds it).
"""

from __future__ import annotations

import select
import socket
import ssl
import time
from collections.abc import Generator, Iterator, Mapping
from typing import Any

import gevent
from gevent import get_hub, getcurrent

from continuum.wire.waits import expire, timer_for

#: Limits on a response head (and on chunk-size and trailer lines).
MAX_LINE = 64 * 1024
MAX_HEADERS = 200
MAX_HEAD = 256 * 1024
_MAX_INTERIM = 32  # 1xx answers skipped before giving up
_RECV = 65536
#: Idle seconds after which a pooled connection is checked for a close before reuse.
CHECK_AFTER = 1.0
_HEX = b"0123456789abcdefABCDEF"
_SIZE, _DATA, _CRLF, _TRAILER = range(4)  # chunked-decoder states


class HTTPClientError(Exception):
    """Base class of the errors raised here."""


class ConnectError(HTTPClientError):
    """No connection: refused, unreachable, unknown host, TLS handshake or verification."""


class ConnectTimeout(ConnectError):
    """The connection (or the TLS handshake) was not established within the connect timeout."""


class ReadTimeout(HTTPClientError):
    """The server took longer than the read timeout to send (or to take) the next bytes."""


class ProtocolError(HTTPClientError):
    """A malformed or over-limit response, or the connection ended before the message did."""


class BodyTooLarge(ProtocolError):
    """The body is larger than the ``limit`` given to :meth:`Response.read`.

    Raised before the body is read when ``Content-Length`` already says so, otherwise as soon
    as the bytes received go over the limit (at most one receive buffer past it); the
    connection is closed either way.
    """

    def __init__(self, limit: int) -> None:
        super().__init__(f"response body exceeds {limit} bytes")
        self.limit = limit


class _Stale(Exception):
    """A pooled connection turned out closed before any response byte."""


class Connection:
    """A socket and its receive buffer: the unread bytes are ``buf[pos:]``.

    On a plain (not TLS) gevent socket, :meth:`recv` reads the OS socket itself and waits
    on the gevent socket's read watcher with one timer reused for every wait; gevent's
    ``recv`` makes a new timer each time it has to wait (once per streamed record).
    """

    __slots__ = ("_raw", "_timer", "buf", "idle_since", "pos", "sock")

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self.buf = bytearray()
        self.pos = 0
        self.idle_since = 0.0
        raw = getattr(sock, "_sock", None)
        plain = getattr(sock, "_read_event", None) is not None and \
            not isinstance(sock, ssl.SSLSocket)
        self._raw: socket.socket | None = raw if plain else None
        self._timer: gevent.Timeout | None = None

    def recv(self, size: int, wait_first: bool = False) -> bytes:
        """One receive of up to ``size`` bytes; ``wait_first``: wait until the socket is
        readable before trying (saves a receive that fails when nothing can have come yet).

        Raises:
            TimeoutError: nothing came within the socket's timeout.
        """
        raw = self._raw
        if raw is None:
            return self.sock.recv(size)
        if wait_first:
            self._wait_readable()
        while True:
            try:
                return raw.recv(size)
            except BlockingIOError:
                self._wait_readable()

    def _wait_readable(self) -> None:
        sock: Any = self.sock
        seconds = sock.timeout
        if seconds is None:
            get_hub().wait(sock._read_event)
            return
        timer = self._timer
        if timer is None or timer.seconds != seconds:
            timer = self._timer = timer_for(timer, seconds)
        # wait_watcher's wait, inline (once per streamed record), arm() inline too: again,
        # not start, or each wait would get only what the last one left of the timeout
        clock = timer.timer
        clock.again(expire, clock, getcurrent(), timer, update=True)
        try:
            get_hub().wait(sock._read_event)
        except gevent.Timeout as exc:
            if exc is not timer:
                raise
            raise TimeoutError("timed out") from None
        finally:
            clock.stop()

    def dropped(self) -> bool:
        """Whether the peer has closed (or written unasked): readable while idle."""
        try:
            readable, _, _ = select.select([self.sock], [], [], 0)
        except (OSError, ValueError):
            return True
        return bool(readable)

    def fill(self, wait_first: bool = False) -> bool:
        """Append one :meth:`recv` to the buffer (dropping consumed bytes first); False at
        EOF."""
        if self.pos:
            del self.buf[: self.pos]  # only an incomplete unit is left: bounded work
            self.pos = 0
        raw = self._raw
        if raw is not None and wait_first:  # recv(_RECV, True), inline (once per record)
            self._wait_readable()
            try:
                data = raw.recv(_RECV)
            except BlockingIOError:  # woken with nothing to read: recv waits again
                data = self.recv(_RECV)
        else:
            data = self.recv(_RECV, wait_first)
        self.buf += data
        return bool(data)

    def take(self, n: int) -> bytes:
        """Consume ``n`` buffered bytes."""
        p = self.pos
        self.pos = p + n
        return bytes(self.buf[p : p + n])

    def line(self) -> bytes | None:
        """Consume one CRLF-terminated line (without CRLF); None while it is incomplete."""
        end = self.buf.find(b"\r\n", self.pos)
        if (end if end >= 0 else len(self.buf)) - self.pos > MAX_LINE:
            raise ProtocolError("line too long")
        if end < 0:
            return None
        line = bytes(self.buf[self.pos : end])
        self.pos = end + 2
        return line

    def close(self) -> None:
        """Close the socket (idempotent)."""
        self.sock.close()
        timer, self._timer = self._timer, None
        if timer is not None:
            timer.close()


class Response:
    """One answer: ``status``, ``reason``, ``headers`` and a body read at most once."""

    __slots__ = ("_chunked", "_conn", "_left", "_pool", "_reuse", "headers", "reason", "status")

    def __init__(self, pool: ConnectionPool, conn: Connection, status: int, reason: str,
                 headers: dict[str, str], left: int | None, chunked: bool, reuse: bool) -> None:
        self._pool = pool
        self._conn: Connection | None = conn
        self.status = status
        self.reason = reason
        self.headers = headers
        self._left = left  # Content-Length bytes to go; None: chunked or until close
        self._chunked = chunked
        self._reuse = reuse
        if left == 0:
            self._finish()

    def read(self, limit: int | None = None) -> bytes:
        """The whole (rest of the) body; the connection is then pooled or closed.

        Args:
            limit: Largest body accepted, in bytes (None: no limit).

        Raises:
            BodyTooLarge: the body is over ``limit`` (the connection is closed; at most
                ``limit`` plus one receive buffer was read).
        """
        conn, left = self._conn, self._left
        if limit is not None and left is not None and left > limit:
            self.close()
            raise BodyTooLarge(limit)
        if conn is not None and left is not None and len(conn.buf) - conn.pos >= left:
            data = conn.take(left)  # the common case: the body came with the head
            self._left = 0
            self._finish()
            return data
        if limit is None:
            return b"".join(self.stream())
        parts: list[bytes] = []
        size = 0
        pieces = self.stream()
        for piece in pieces:
            size += len(piece)
            if size > limit:
                pieces.close()  # closes the connection: the rest is never read
                raise BodyTooLarge(limit)
            parts.append(piece)
        return b"".join(parts)

    def stream(self) -> Generator[bytes, None, None]:
        """Yield body bytes as they arrive, all that is buffered at once (chunked: decoded).

        Raises:
            ReadTimeout: the next bytes did not come within the read timeout.
            ProtocolError: broken framing, or EOF/reset before the end of the body.
        """
        conn = self._conn
        if conn is None:
            return
        done = False
        try:
            if self._chunked:
                yield from self._chunks(conn)
            elif self._left is None:
                yield from self._until_close(conn)
            else:
                yield from self._sized(conn)
            done = True
            self._finish()
        except TimeoutError:
            raise ReadTimeout("read timed out") from None
        except OSError as exc:
            raise ProtocolError(f"connection broke mid-body: {exc}") from exc
        finally:
            if not done:
                self.close()

    def _sized(self, conn: Connection) -> Iterator[bytes]:
        left = self._left or 0
        while left:
            avail = len(conn.buf) - conn.pos
            if avail:
                data = conn.take(min(avail, left))
            else:
                data = conn.recv(min(left, _RECV), True)
                if not data:
                    raise ProtocolError(f"connection closed with {left} body bytes to go")
            left -= len(data)
            self._left = left
            if not left:
                self._finish()  # pooled before the last piece is handed out
            yield data

    def _until_close(self, conn: Connection) -> Iterator[bytes]:
        if len(conn.buf) > conn.pos:
            yield conn.take(len(conn.buf) - conn.pos)
        while data := conn.recv(_RECV, True):
            yield data

    def _chunks(self, conn: Connection) -> Iterator[bytes]:
        state, left, trailers, size = _SIZE, 0, 0, 0
        while True:
            out: list[bytes] = []
            done = False
            if state == _SIZE:
                # The common case first: whole chunks (size line, data, CRLF) buffered, as
                # a token stream's records come, consumed here without the steps below;
                # anything else (a partial chunk, the last chunk, an over-long line) is
                # left where it starts, to them.
                buf, pos = conn.buf, conn.pos
                have = len(buf)
                while (end := buf.find(b"\r\n", pos)) >= 0 and end - pos <= MAX_LINE:
                    digits = buf[pos:end]
                    # plain hex digits (no extension, no blanks): what _chunk_size accepts
                    left = int(digits, 16) if 0 < len(digits) <= 16 and \
                        not digits.strip(_HEX) else _chunk_size(bytes(digits))
                    start = end + 2
                    stop = start + left
                    if not left or stop + 2 > have:
                        break
                    if buf[stop:stop + 2] != b"\r\n":
                        raise ProtocolError("chunk data not followed by CRLF")
                    out.append(bytes(buf[start:stop]))
                    pos = stop + 2
                conn.pos = pos
                idle = pos == have  # all that was buffered were whole chunks: wait
            else:
                idle = False
            while not idle:
                if state == _DATA:
                    avail = len(conn.buf) - conn.pos
                    if not avail:
                        break
                    out.append(conn.take(min(avail, left)))
                    left -= len(out[-1])
                    state = _DATA if left else _CRLF
                elif state == _CRLF:
                    if len(conn.buf) - conn.pos < 2:
                        break
                    if conn.take(2) != b"\r\n":
                        raise ProtocolError("chunk data not followed by CRLF")
                    state = _SIZE
                else:
                    line = conn.line()
                    if line is None:
                        break
                    if state == _SIZE:
                        left = _chunk_size(line)
                        state = _DATA if left else _TRAILER
                    elif not line:
                        done = True
                        break
                    else:  # a trailer field: ignored, within the limits of a head
                        trailers += 1
                        size += len(line) + 2
                        if trailers > MAX_HEADERS or size > MAX_HEAD:
                            raise ProtocolError("too many or too large trailer fields")
            if done:
                self._finish()
            if out:
                yield b"".join(out) if len(out) > 1 else out[0]
            if done:
                return
            # Nothing complete is buffered: the next bytes are still on their way (a
            # token stream's next record), so wait for them before reading.
            if not conn.fill(True):
                raise ProtocolError("connection closed inside a chunked body")

    def _finish(self) -> None:
        conn, self._conn = self._conn, None
        if conn is None:
            return
        if self._reuse and conn.pos == len(conn.buf):
            conn.buf.clear()
            conn.pos = 0
            self._pool.put(conn)
        else:  # anything after the body, or the server wants to close
            conn.close()

    def close(self) -> None:
        """Close the connection unless the body was read (unread data makes it unusable)."""
        conn, self._conn = self._conn, None
        if conn is not None:
            conn.close()


def _send_all(sock: socket.socket, data: bytes) -> None:
    """``sock.sendall(data)`` with one ``send`` first: gevent's ``sendall`` asks the kernel
    for the socket's buffer size on every call, an extra syscall per request when the
    whole payload fits (it nearly always does)."""
    sent = sock.send(data)
    if sent < len(data):
        sock.sendall(memoryview(data)[sent:])


def _chunk_size(line: bytes) -> int:
    size = line.split(b";", 1)[0].strip(b" \t")
    if not size or len(size) > 16 or size.strip(_HEX):
        raise ProtocolError(f"bad chunk size line {line[:40]!r}")
    return int(size, 16)


class ConnectionPool:
    """Keep-alive connections to one backend; ``tls`` (a context) makes it HTTPS.

    Args:
        host: Name or address to connect to (also the SNI name and ``Host``).
        port: TCP port.
        connect_timeout: Seconds for the TCP connect and the TLS handshake.
        read_timeout: Seconds any single send or receive may take once connected.
        tls: ``ssl.create_default_context()`` (verifying) or another context; None for HTTP.
        maxsize: Idle connections kept; more are closed when released.
    """

    def __init__(self, host: str, port: int, *, connect_timeout: float, read_timeout: float,
                 tls: ssl.SSLContext | None = None, maxsize: int = 64) -> None:
        self.host, self.port, self.tls, self.maxsize = host, port, tls, maxsize
        self.connect_timeout, self.read_timeout = connect_timeout, read_timeout
        name = f"[{host}]" if ":" in host else host
        self._host = name if port == (443 if tls else 80) else f"{name}:{port}"
        self._idle: list[Connection] = []

    def request(self, method: str, path: str, body: bytes = b"",
                headers: Mapping[str, str] | None = None) -> Response:
        """Send one request and read the response head (the body is left to the caller).

        Raises:
            ConnectError: a new connection could not be made (ConnectTimeout on timeout).
            ReadTimeout: the send or the response head stalled past the read timeout.
            ProtocolError: a malformed or over-limit head, or the connection closed first.
            ValueError: CR or LF inside the path or a header.
        """
        lines = [f"{method} {path} HTTP/1.1\r\nHost: {self._host}\r\n"
                 f"Content-Length: {len(body)}\r\nAccept-Encoding: identity\r\n"]
        lines += [f"{name}: {value}\r\n" for name, value in (headers or {}).items()]
        head = "".join(lines)
        if head.count("\n") != len(lines) + 3 or head.count("\r") != len(lines) + 3:
            raise ValueError("CR or LF inside the request line or a header")
        payload = head.encode("latin-1") + b"\r\n" + body
        conn = self._take_idle()
        if conn is not None:
            try:
                return self._exchange(conn, method, payload, pooled=True)
            except _Stale:
                conn.close()
                self.clear()  # idle longer than this one: most likely closed as well
        return self._exchange(self._connect(), method, payload, pooled=False)

    def _take_idle(self) -> Connection | None:
        """The most recently used idle connection that still looks open.

        A connection idle for more than :data:`CHECK_AFTER` seconds is checked with a
        zero-timeout ``select`` first (servers close idle keep-alive connections, uvicorn
        after 5 s): sending into one we know is closed would cost a round trip and a
        retry. Recently used ones skip the syscall; the stale retry still covers them.
        """
        idle = self._idle
        now = time.monotonic()
        while idle:
            conn = idle.pop()
            if now - conn.idle_since <= CHECK_AFTER or not conn.dropped():
                return conn
            conn.close()
        return None

    @property
    def idle(self) -> int:
        """How many idle connections are kept."""
        return len(self._idle)

    def put(self, conn: Connection) -> None:
        """Keep an idle connection (or close it when the pool is full)."""
        if len(self._idle) < self.maxsize:
            conn.idle_since = time.monotonic()
            self._idle.append(conn)
        else:
            conn.close()

    def clear(self) -> None:
        """Close every idle connection."""
        idle, self._idle = self._idle, []
        for conn in idle:
            conn.close()

    def _connect(self) -> Connection:
        where = f"{self.host}:{self.port}"
        try:
            sock = socket.create_connection((self.host, self.port), self.connect_timeout)
        except TimeoutError:
            raise ConnectTimeout(f"connect to {where} timed out") from None
        except OSError as exc:
            raise ConnectError(f"connect to {where} failed: {exc}") from exc
        try:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
            if self.tls is not None:
                sock = self.tls.wrap_socket(sock, server_hostname=self.host)
            sock.settimeout(self.read_timeout)
        except BaseException as exc:
            sock.close()
            if isinstance(exc, TimeoutError):
                raise ConnectTimeout(f"TLS handshake with {where} timed out") from None
            if isinstance(exc, OSError):
                raise ConnectError(f"TLS with {where} failed: {exc}") from exc
            raise
        return Connection(sock)

    def _exchange(self, conn: Connection, method: str, payload: bytes,
                  pooled: bool) -> Response:
        try:
            try:
                _send_all(conn.sock, payload)
            except (BrokenPipeError, ConnectionResetError, ConnectionAbortedError,
                    ssl.SSLEOFError):
                if pooled:
                    raise _Stale from None
                raise
            for _ in range(_MAX_INTERIM):
                status, reason, headers, http11 = _read_head(conn, pooled)
                if pooled and status == 408:  # sent by some servers as they drop idle ones
                    raise _Stale
                if status >= 200:
                    return self._response(conn, method, status, reason, headers, http11)
                if status == 101:
                    raise ProtocolError("unexpected 101 Switching Protocols")
                pooled = False  # a 1xx came: the connection is alive
            raise ProtocolError("too many 1xx responses")
        except _Stale:
            raise
        except TimeoutError:
            conn.close()
            raise ReadTimeout("timed out waiting for the response head") from None
        except BaseException as exc:
            conn.close()
            if isinstance(exc, OSError):
                raise ProtocolError(f"connection broke before the response: {exc}") from exc
            raise

    def _response(self, conn: Connection, method: str, status: int, reason: str,
                  headers: dict[str, str], http11: bool) -> Response:
        connection = headers.get("connection")
        if connection is None:
            reuse = http11
        else:
            tokens = {t.strip().lower() for t in connection.split(",")}
            reuse = "close" not in tokens and (http11 or "keep-alive" in tokens)
        te, cl = headers.get("transfer-encoding"), headers.get("content-length")
        left: int | None = None
        chunked = False
        if method == "HEAD" or status in (204, 304):
            left = 0
        elif te is not None:
            chunked = te.rsplit(",", 1)[-1].strip().lower() == "chunked"
            reuse = reuse and chunked and cl is None
        elif cl is not None:
            values = {v.strip() for v in cl.split(",")} if "," in cl else set()
            value = values.pop() if values else cl.strip()
            if values or not (value.isascii() and value.isdigit()) or len(value) > 18:
                raise ProtocolError(f"bad Content-Length {cl[:40]!r}")
            left = int(value)
        return Response(self, conn, status, reason, headers, left, chunked,
                        reuse and (left is not None or chunked))


def _read_head(conn: Connection, pooled: bool) -> tuple[int, str, dict[str, str], bool]:
    """Read and parse one response head; raises :class:`_Stale` if ``pooled`` and no byte
    came at all."""
    scan = 0  # offset from conn.pos up to which no head end was found
    while (end := conn.buf.find(b"\r\n\r\n", conn.pos + scan)) < 0:
        have = len(conn.buf) - conn.pos
        if have > MAX_HEAD:
            raise ProtocolError("response head too large")
        scan = max(have - 3, 0)
        try:
            alive = conn.fill()
        except (ConnectionResetError, ConnectionAbortedError):
            if pooled and not have:
                raise _Stale from None
            raise
        if not alive:
            if pooled and not have:
                raise _Stale
            raise ProtocolError("connection closed before the end of the response head")
    if end - conn.pos > MAX_HEAD:
        raise ProtocolError("response head too large")
    lines = conn.buf[conn.pos : end].decode("latin-1").split("\r\n")
    conn.pos = end + 4
    if len(lines) > MAX_HEADERS + 1 or max(map(len, lines)) > MAX_LINE:
        raise ProtocolError("too many or too long header lines")
    version, _, rest = lines[0].partition(" ")
    code, _, reason = rest.partition(" ")
    if version not in ("HTTP/1.1", "HTTP/1.0") or len(code) != 3 or not code.isdigit() \
            or not code.isascii():
        raise ProtocolError(f"bad status line {lines[0][:80]!r}")
    headers: dict[str, str] = {}
    for line in lines[1:]:
        name, sep, value = line.partition(":")
        if not sep or not name or name != name.strip():
            raise ProtocolError(f"bad header line {line[:80]!r}")
        key, value = name.lower(), value.strip(" \t")
        headers[key] = f"{headers[key]}, {value}" if key in headers else value
    return int(code), reason, headers, version == "HTTP/1.1"
