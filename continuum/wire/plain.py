"""The request and body objects of the worker's own keep-alive loop (plain connections).

The router's worker serves a plain connection (TCP, no TLS, no PROXY protocol, no HTTP/2)
with a loop of its own (:meth:`continuum.gunicorn_worker.GeventWorker.handle`) for as long
as each request's head is one the fast path of :mod:`continuum.wire.request_head` takes
with a plain ``Content-Length`` (or none). gunicorn's parser would build the same request
from such a head; the loop builds it without gunicorn's parser, message and body objects,
which cost more per request than parsing the head does. The first request outside that
path, and every later one on the connection, is gunicorn's, from its first byte.

:class:`PlainRequest` is what gunicorn's response, error handler, hooks and access log
read of a request; :class:`HeldInput` is ``wsgi.input``.
"""

from __future__ import annotations

from typing import Any

#: The most bytes one read of the socket asks for.
RECV_SIZE = 65536


class PlainRequest:
    """A request of the worker's own loop, with the attributes gunicorn's ``Request``
    has (and the same values for the same head)."""

    __slots__ = ("_close", "_expected_100_continue", "body", "cfg", "fragment", "headers",
                 "method", "must_close", "path", "peer_addr", "proxy_protocol_info", "query",
                 "remote_addr", "req_number", "scheme", "trailers", "uri", "version")

    def __init__(self, cfg: Any, addr: Any, number: int, method: str, uri: str, minor: int,
                 path: str, query: str, headers: list[tuple[str, str]], close: bool,
                 body: HeldInput) -> None:
        self.cfg = cfg
        self.peer_addr = self.remote_addr = addr
        self.req_number = number
        self.method = method
        self.uri = uri
        self.version = (1, minor)
        self.path = path
        self.query = query
        self.fragment = ""
        self.headers = headers
        self.trailers: list[tuple[str, str]] = []
        self.scheme = "http"
        self.must_close = False
        self.proxy_protocol_info = None
        self._close = close
        self._expected_100_continue = False  # an Expect field is gunicorn's to read
        self.body = body

    def should_close(self) -> bool:
        """gunicorn's answer: forced, or what the head says."""
        return self.must_close or self._close

    def force_close(self) -> None:
        self.must_close = True


class HeldInput:
    """``wsgi.input`` of a body of known length: the bytes of it that came with the head,
    then the rest from the socket as the application reads it (never a byte past the
    body). Reads behave as gunicorn's body reader's: ``read(n)`` returns ``n`` bytes
    unless the body ends first; the client closing early ends it short (and the
    connection is closed after the answer)."""

    __slots__ = ("_data", "_left", "_pos", "_sock", "ended_early")

    def __init__(self, data: bytes, left: int, sock: Any) -> None:
        self._data = data  # bytes of the body read from the socket
        self._pos = 0  # how many of them the application has read
        self._left = left  # bytes of the body still on the socket
        self._sock = sock
        self.ended_early = False

    def whole(self, length: int) -> bytes | None:
        """The whole body of ``length`` bytes when it came with the head and none of it has
        been read (the reader is then at its end); None otherwise."""
        if self._left or self._pos or len(self._data) != length:
            return None
        self._pos = length
        return self._data

    def _fill(self, want: int) -> None:
        """Read from the socket until ``want`` unread bytes are held or the body is all
        read (or ended early)."""
        data, pos = self._data, self._pos
        pieces = [data[pos:]]
        have = len(data) - pos
        while have < want and self._left:
            piece = self._sock.recv(min(self._left, RECV_SIZE))
            if not piece:
                self._left = 0
                self.ended_early = True
                break
            self._left -= len(piece)
            have += len(piece)
            pieces.append(piece)
        self._data, self._pos = b"".join(pieces), 0

    def read(self, size: int | None = None) -> bytes:
        if size is None or size < 0:
            size = len(self._data) - self._pos + self._left
        if size == 0:
            return b""
        if len(self._data) - self._pos < size and self._left:
            self._fill(size)
        pos = self._pos
        out = self._data[pos:pos + size]
        self._pos = pos + len(out)
        return out

    def readline(self, size: int | None = None) -> bytes:
        limit = -1 if size is None or size < 0 else size
        while True:
            data, pos = self._data, self._pos
            eol = data.find(b"\n", pos)
            if eol >= 0 or not self._left or (limit >= 0 and len(data) - pos >= limit):
                break
            self._fill(len(data) - pos + 1)
        stop = len(data) if eol < 0 else eol + 1
        if limit >= 0:
            stop = min(stop, pos + limit)
        self._pos = stop
        return data[pos:stop]

    def readlines(self, hint: int | None = None) -> list[bytes]:
        lines = []
        total = 0
        while line := self.readline():
            lines.append(line)
            total += len(line)
            if hint is not None and 0 < hint <= total:
                break
        return lines

    def __iter__(self) -> HeldInput:
        return self

    def __next__(self) -> bytes:
        line = self.readline()
        if not line:
            raise StopIteration
        return line

    def drain(self) -> bool:
        """Read and drop what the application left on the socket of the body, as gunicorn
        does before the next request; False when the client closed first."""
        self._data, self._pos = b"", 0
        while self._left:
            piece = self._sock.recv(min(self._left, RECV_SIZE))
            if not piece:
                self.ended_early = True
                return False
            self._left -= len(piece)
        return not self.ended_early


class Replayed:
    """A client socket handed from the worker's own loop to gunicorn's: ``recv`` gives the
    bytes the loop read but did not serve first, then reads the socket; everything else is
    the socket's."""

    __slots__ = ("_sock", "held")

    def __init__(self, sock: Any, held: bytes) -> None:
        self._sock = sock
        self.held = held

    def recv(self, size: int, *flags: Any) -> bytes:
        held = self.held
        if held and not flags:
            self.held = held[size:]
            return held[:size]
        return self._sock.recv(size, *flags)  # type: ignore[no-any-return]

    def __getattr__(self, name: str) -> Any:
        return getattr(self._sock, name)
