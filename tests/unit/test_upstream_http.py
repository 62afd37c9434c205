"""continuum.wire.http_client against small threaded servers on 127.0.0.1 that send hand-written
HTTP bytes (no HTTP library on the server side)."""

from __future__ import annotations

import socket
import ssl
import subprocess
import threading
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from continuum.devtools.procs import refused_port, wait_until
from continuum.wire import http_client as uh
from continuum.wire.http_client import ConnectionPool

OK = b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok"
WAIT = 10.0  # a safety bound for waits that should end at once, never a timing assertion


class Peer:
    """The server side of one accepted connection."""

    def __init__(self, sock: socket.socket, server: Server, index: int) -> None:
        self.sock = sock
        self.server = server
        self.index = index  # 1 for the first connection the server accepted
        self.buf = b""

    def request(self) -> bytes | None:
        """The next whole request (head and Content-Length body); None at EOF."""
        while b"\r\n\r\n" not in self.buf:
            data = self.sock.recv(65536)
            if not data:
                return None
            self.buf += data
        head, _, rest = self.buf.partition(b"\r\n\r\n")
        length = 0
        for line in head.split(b"\r\n")[1:]:
            name, _, value = line.partition(b":")
            if name.strip().lower() == b"content-length":
                length = int(value)
        while len(rest) < length:
            data = self.sock.recv(65536)
            if not data:
                return None
            rest += data
        self.buf = rest[length:]
        request = head + b"\r\n\r\n" + rest[:length]
        self.server.requests.append(request)
        return request

    def send(self, data: bytes) -> None:
        self.sock.sendall(data)


Handler = Callable[[Peer], None]


class Server:
    """Accepts connections and runs ``handler`` for each on its own thread."""

    def __init__(self, handler: Handler, tls: ssl.SSLContext | None = None) -> None:
        self.handler = handler
        self.tls = tls
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.port: int = self.listener.getsockname()[1]
        self.connections = 0
        self.requests: list[bytes] = []
        self.release = threading.Event()  # handlers that park wait on this
        self._stop = False
        self._threads: list[threading.Thread] = []
        self._accepter = threading.Thread(target=self._accept)
        self._accepter.start()

    def _accept(self) -> None:
        while True:
            sock, _ = self.listener.accept()
            if self._stop:
                sock.close()
                return
            self.connections += 1
            thread = threading.Thread(target=self._serve, args=(sock, self.connections))
            self._threads.append(thread)
            thread.start()

    def _serve(self, sock: socket.socket, index: int) -> None:
        sock.settimeout(WAIT)
        try:
            if self.tls is not None:
                sock = self.tls.wrap_socket(sock, server_side=True)
            self.handler(Peer(sock, self, index))
        except OSError:
            pass  # the client went away, or refused our certificate
        finally:
            sock.close()

    def close(self) -> None:
        self.release.set()
        self._stop = True
        socket.create_connection(("127.0.0.1", self.port)).close()
        self._accepter.join()
        self.listener.close()
        for thread in self._threads:
            thread.join()


def answer(*replies: bytes, close: bool = False) -> Handler:
    """A handler that answers successive requests on a connection with ``replies``."""

    def handle(peer: Peer) -> None:
        for reply in replies:
            if peer.request() is None:
                return
            peer.send(reply)
        if not close:
            while peer.request() is not None:
                peer.send(replies[-1])

    return handle


Serve = Callable[..., tuple[Server, ConnectionPool]]


@pytest.fixture
def serve() -> Iterator[Serve]:
    """``serve(handler, ...)``: a server and a client pool for it, both closed afterwards."""
    made: list[tuple[Server, ConnectionPool]] = []

    def make(handler: Handler, tls: ssl.SSLContext | None = None, read_timeout: float = WAIT,
             client_tls: ssl.SSLContext | None = None,
             maxsize: int = 64) -> tuple[Server, ConnectionPool]:
        server = Server(handler, tls)
        pool = ConnectionPool("127.0.0.1", server.port, connect_timeout=WAIT,
                              read_timeout=read_timeout, tls=client_tls, maxsize=maxsize)
        made.append((server, pool))
        return server, pool

    yield make
    for server, pool in made:
        pool.clear()
        server.close()


def test_content_length_headers_and_one_send(serve: Serve) -> None:
    reply = b"HTTP/1.1 201 Created\r\nContent-Length: 5\r\nX-A: 1\r\nx-a:  2 \r\n\r\nhello"
    server, pool = serve(answer(reply))
    resp = pool.request("POST", "/v1/x", b'{"a":1}', {"X-Request-Id": "r1"})
    assert (resp.status, resp.reason) == (201, "Created")
    assert resp.headers == {"content-length": "5", "x-a": "1, 2"}
    assert resp.read() == b"hello"
    request = server.requests[0]
    assert request.startswith(b"POST /v1/x HTTP/1.1\r\nHost: 127.0.0.1:%d\r\n" % server.port)
    assert b"\r\nContent-Length: 7\r\n" in request and b"\r\nX-Request-Id: r1\r\n" in request
    assert request.endswith(b'\r\n\r\n{"a":1}')
    assert pool.idle == 1


def test_chunked_with_extensions_and_trailers_then_reuse(serve: Serve) -> None:
    reply = (b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n"
             b"5;ext=1\r\nhello\r\n6 ; a=b;c\r\n world\r\nA\r\n0123456789\r\n"
             b"0;last\r\nX-Trailer: x\r\nX-Other: y\r\n\r\n")
    server, pool = serve(answer(reply))
    for _ in range(2):
        assert pool.request("POST", "/", b"").read() == b"hello world0123456789"
    assert server.connections == 1 and len(server.requests) == 2


def test_read_until_close_is_not_reused(serve: Serve) -> None:
    def handle(peer: Peer) -> None:
        peer.request()
        peer.send(b"HTTP/1.1 200 OK\r\nContent-Type: text/plain\r\n\r\nall of it")
        peer.send(b" and more")

    server, pool = serve(handle)
    for _ in range(2):
        assert pool.request("POST", "/").read() == b"all of it and more"
    assert server.connections == 2 and pool.idle == 0


def test_informational_responses_are_skipped(serve: Serve) -> None:
    reply = (b"HTTP/1.1 100 Continue\r\n\r\nHTTP/1.1 103 Early Hints\r\nLink: </a>\r\n\r\n"
             b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\nX-B: b\r\n\r\nok")
    server, pool = serve(answer(reply))
    resp = pool.request("POST", "/")
    assert resp.status == 200 and resp.headers == {"content-length": "2", "x-b": "b"}
    assert resp.read() == b"ok"
    assert pool.request("POST", "/").read() == b"ok" and server.connections == 1


def test_no_body_statuses(serve: Serve) -> None:
    server, pool = serve(answer(b"HTTP/1.1 204 No Content\r\n\r\n", OK))
    resp = pool.request("POST", "/")
    assert resp.status == 204 and resp.read() == b"" and pool.idle == 1
    assert pool.request("POST", "/").read() == b"ok" and server.connections == 1


@pytest.mark.parametrize("head", [
    b"HTTP/1.1 200 OK\r\n" + b"".join(b"X-%d: v\r\n" % i for i in range(201)),
    b"HTTP/1.1 200 OK\r\nX-Big: " + b"v" * (64 * 1024) + b"\r\n",
    b"HTTP/1.1 200 OK\r\n" + b"".join(b"X-%d: %s\r\n" % (i, b"v" * 60000) for i in range(5)),
    b"HTTP/1.1 200 " + b"O" * (300 * 1024),  # no end of the head in sight
    b"HTTP/1.1 2000 OK\r\n",
    b"HTTP/2 200 OK\r\n",
    b"HTTP/1.1 200 OK\r\nNo colon here\r\n",
    b"HTTP/1.1 200 OK\r\nX-Space : v\r\n",
    b"HTTP/1.1 200 OK\r\n X-Folded: v\r\n",
    b"HTTP/1.1 200 OK\r\nContent-Length: 2, 3\r\n",
    b"HTTP/1.1 200 OK\r\nContent-Length: -2\r\n",
    b"HTTP/1.1 101 Switching Protocols\r\n",
])
def test_malformed_or_oversized_heads_are_protocol_errors(serve: Serve, head: bytes) -> None:
    _, pool = serve(answer(head + b"\r\nok", close=True))
    with pytest.raises(uh.ProtocolError):
        pool.request("POST", "/")
    assert pool.idle == 0


def test_limits_are_inclusive(serve: Serve) -> None:
    head = b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n" + b"".join(
        b"X-%d: v\r\n" % i for i in range(199))
    big = b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\nX-Big: " + b"v" * (65536 - 7) + b"\r\n"
    _, pool = serve(answer(head + b"\r\nok", big + b"\r\nok"))
    first = pool.request("POST", "/")
    assert len(first.headers) == 200 and first.read() == b"ok"
    second = pool.request("POST", "/")
    assert len(second.headers["x-big"]) == 65536 - 7 and second.read() == b"ok"


@pytest.mark.parametrize("body", [b"zz\r\nhello\r\n0\r\n\r\n", b"5\r\nhelloXX0\r\n\r\n",
                                  b"0x5\r\nhello\r\n0\r\n\r\n"])
def test_bad_chunk_framing(serve: Serve, body: bytes) -> None:
    _, pool = serve(answer(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n" + body))
    resp = pool.request("POST", "/")
    with pytest.raises(uh.ProtocolError):
        resp.read()
    assert pool.idle == 0


@pytest.mark.parametrize("chunked", [False, True])
def test_huge_body(serve: Serve, chunked: bool) -> None:
    body = bytes(range(256)) * (8 * 4096)  # 8 MiB
    if chunked:  # many chunks of varied sizes, so chunk boundaries straddle every recv
        sizes = [1, 7, 1000, 65536, 100_000, 3]
        parts, pos, i = [], 0, 0
        while pos < len(body):
            n = sizes[i % len(sizes)]
            parts.append(b"%x\r\n%s\r\n" % (len(body[pos:pos + n]), body[pos:pos + n]))
            pos, i = pos + n, i + 1
        payload = b"Transfer-Encoding: chunked\r\n\r\n" + b"".join(parts) + b"0\r\n\r\n"
    else:
        payload = b"Content-Length: %d\r\n\r\n" % len(body) + body
    server, pool = serve(answer(b"HTTP/1.1 200 OK\r\n" + payload))
    assert pool.request("POST", "/").read() == body
    pieces = list(pool.request("POST", "/").stream())
    # Each piece is what one recv brought (plus buffered leftovers): bounded, not one
    # growing buffer that is copied again for every recv.
    assert b"".join(pieces) == body and max(map(len, pieces)) <= 2 * 65536 + 100_000
    assert server.connections == 1


def test_connection_close_is_not_reused(serve: Serve) -> None:
    server, pool = serve(answer(
        b"HTTP/1.1 200 OK\r\nConnection: close\r\nContent-Length: 2\r\n\r\nok", close=True))
    for _ in range(2):
        assert pool.request("POST", "/").read() == b"ok"
    assert server.connections == 2 and pool.idle == 0


def test_http10_without_keep_alive_is_not_reused(serve: Serve) -> None:
    _, pool = serve(answer(b"HTTP/1.0 200 OK\r\nContent-Length: 2\r\n\r\nok", close=True))
    assert pool.request("POST", "/").read() == b"ok"
    assert pool.idle == 0


def test_stale_pooled_connection_is_retried_once_on_a_fresh_one(serve: Serve) -> None:
    closed = threading.Event()

    def handle(peer: Peer) -> None:
        peer.request()
        peer.send(OK)
        if peer.index == 1:  # the server drops the first connection once it is idle
            peer.sock.close()
            closed.set()
            return
        answer(OK)(peer)

    server, pool = serve(handle)
    assert pool.request("POST", "/").read() == b"ok" and pool.idle == 1
    assert closed.wait(WAIT)
    assert pool.request("POST", "/").read() == b"ok"
    assert server.connections == 2 and pool.idle == 1


def test_stale_then_failing_fresh_connection_is_an_error(serve: Serve) -> None:
    def handle(peer: Peer) -> None:
        if peer.index == 1:
            peer.request()
            peer.send(OK)
        else:
            peer.request()  # a real failure: read the request, close without a word
        peer.sock.close()

    server, pool = serve(handle)
    assert pool.request("POST", "/").read() == b"ok"
    with pytest.raises(uh.ProtocolError):
        pool.request("POST", "/")
    assert server.connections == 2


def test_408_on_a_pooled_connection_counts_as_stale(serve: Serve) -> None:
    server, pool = serve(answer(OK, b"HTTP/1.1 408 Request Timeout\r\nContent-Length: 0\r\n"
                                    b"Connection: close\r\n\r\n", close=True))
    assert pool.request("POST", "/").read() == b"ok"
    assert pool.request("POST", "/").read() == b"ok"
    assert server.connections == 2


def test_connect_refused_is_a_connect_error() -> None:
    pool = ConnectionPool("127.0.0.1", refused_port(), connect_timeout=WAIT,
                          read_timeout=WAIT)
    with pytest.raises(uh.ConnectError) as info:
        pool.request("POST", "/")
    assert not isinstance(info.value, uh.ConnectTimeout)


def test_connect_timeout_maps_to_connect_timeout(monkeypatch: pytest.MonkeyPatch) -> None:
    def stall(*args: object, **kwargs: object) -> socket.socket:
        raise TimeoutError("timed out")

    monkeypatch.setattr(socket, "create_connection", stall)
    pool = ConnectionPool("127.0.0.1", 9, connect_timeout=0.1, read_timeout=WAIT)
    with pytest.raises(uh.ConnectTimeout):
        pool.request("POST", "/")


def test_read_timeout_before_the_head_and_mid_body(serve: Serve) -> None:
    def handle(peer: Peer) -> None:
        peer.request()
        if peer.index == 2:
            peer.send(b"HTTP/1.1 200 OK\r\nContent-Length: 10\r\n\r\nhalf")
        peer.server.release.wait(WAIT)

    _, pool = serve(handle, read_timeout=0.2)
    with pytest.raises(uh.ReadTimeout):
        pool.request("POST", "/")
    resp = pool.request("POST", "/")
    with pytest.raises(uh.ReadTimeout):
        resp.read()
    assert pool.idle == 0


@pytest.mark.parametrize("reply", [
    b"HTTP/1.1 200 OK\r\nContent-Length: 10\r\n\r\nhalf",
    b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n5\r\nhello\r\n8\r\nhal",
    b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n5\r\nhello\r\n",
    b"HTTP/1.1 200 OK\r\nContent-Len",
])
def test_eof_mid_message_is_a_protocol_error(serve: Serve, reply: bytes) -> None:
    _, pool = serve(answer(reply, close=True))
    with pytest.raises(uh.ProtocolError):
        pool.request("POST", "/").read()
    assert pool.idle == 0


@pytest.mark.parametrize("chunked", [False, True])
def test_stream_yields_each_piece_as_it_arrives(serve: Serve, chunked: bool) -> None:
    acks = [threading.Event() for _ in range(3)]
    pieces = [b"data: one\n\n", b"data: two\n\n", b"data: [DONE]\n\n"]

    def handle(peer: Peer) -> None:
        peer.request()
        if chunked:
            peer.send(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n")
        else:
            total = sum(map(len, pieces))
            peer.send(b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\n\r\n" % total)
        for piece, ack in zip(pieces, acks, strict=True):
            peer.send(b"%x\r\n%s\r\n" % (len(piece), piece) if chunked else piece)
            ack.wait(WAIT)  # the next piece only after the client has the previous one
        if chunked:
            peer.send(b"0\r\n\r\n")
        answer(OK)(peer)

    server, pool = serve(handle)
    stream = pool.request("POST", "/").stream()
    for piece, ack in zip(pieces, acks, strict=True):
        assert next(stream) == piece
        ack.set()
    assert list(stream) == []
    assert pool.idle == 1 and pool.request("POST", "/").read() == b"ok"
    assert server.connections == 1


def test_stream_coalesces_what_is_buffered(serve: Serve) -> None:
    body = b"".join(b"%x\r\n%s\r\n" % (len(p), p) for p in (b"a", b"bb", b"ccc")) + b"0\r\n\r\n"
    _, pool = serve(answer(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n" + body))
    assert list(pool.request("POST", "/").stream()) == [b"abbccc"]


@pytest.mark.parametrize("how", ["close", "generator"])
def test_early_close_closes_the_connection(serve: Serve, how: str) -> None:
    gone = threading.Event()

    def handle(peer: Peer) -> None:
        peer.request()
        peer.send(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n5\r\nfirst\r\n")
        if peer.sock.recv(1) == b"":
            gone.set()

    _, pool = serve(handle)
    resp = pool.request("POST", "/")
    stream = resp.stream()
    assert next(stream) == b"first"
    if how == "close":
        resp.close()
    else:
        stream.close()
    assert gone.wait(WAIT)
    assert pool.idle == 0


def test_unread_response_close_then_new_connection(serve: Serve) -> None:
    server, pool = serve(answer(OK))
    pool.request("POST", "/").close()
    assert pool.request("POST", "/").read() == b"ok"
    assert server.connections == 2


def test_pool_size_is_bounded(serve: Serve) -> None:
    server, pool = serve(answer(OK), maxsize=2)
    responses = [pool.request("POST", "/") for _ in range(3)]
    assert server.connections == 3
    for resp in responses:
        assert resp.read() == b"ok"
    assert pool.idle == 2


def test_crlf_injection_is_refused(serve: Serve) -> None:
    _, pool = serve(answer(OK))
    for headers in ({"X-A": "v\r\nX-Evil: 1"}, {"X-A\n": "v"}):
        with pytest.raises(ValueError):
            pool.request("POST", "/", b"", headers)
    with pytest.raises(ValueError):
        pool.request("POST", "/ HTTP/1.1\r\nX-Evil: 1\r\n")


@pytest.fixture(scope="module")
def certificate(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """A self-signed certificate for 127.0.0.1 and localhost made with ``openssl req``."""
    tmp = tmp_path_factory.mktemp("tls")
    cert, key = tmp / "cert.pem", tmp / "key.pem"
    subprocess.run(
        ["openssl", "req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1",
         "-nodes", "-keyout", str(key), "-out", str(cert), "-days", "2", "-subj", "/CN=localhost",
         "-addext", "subjectAltName=IP:127.0.0.1,DNS:localhost"],
        check=True, capture_output=True,
    )
    return cert, key


def test_https_verifies_and_keeps_alive(serve: Serve, certificate: tuple[Path, Path]) -> None:
    cert, key = certificate
    server_ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    server_ctx.load_cert_chain(cert, key)
    trusting = ssl.create_default_context(cafile=str(cert))
    server, pool = serve(answer(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n"
                                b"2\r\nok\r\n0\r\n\r\n"), tls=server_ctx, client_tls=trusting)
    for _ in range(2):
        assert pool.request("POST", "/").read() == b"ok"
    assert server.connections == 1
    # The default context does not trust a self-signed certificate: no request is sent.
    _, strict = serve(answer(OK), tls=server_ctx, client_tls=ssl.create_default_context())
    with pytest.raises(uh.ConnectError):
        strict.request("POST", "/")



def test_idle_connection_closed_by_the_server_is_not_reused(
    serve: Serve, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A connection idle past CHECK_AFTER that the server closed is dropped before use:
    the request goes out once, on a fresh connection, with no stale retry."""
    import continuum.wire.http_client as uh

    monkeypatch.setattr(uh, "CHECK_AFTER", 0.0)
    ok = b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok"
    server, pool = serve(answer(ok, close=True))  # the server closes after one answer
    assert pool.request("GET", "/").read() == b"ok"
    assert pool.idle == 1
    wait_until(pool._idle[0].dropped, "the pool to see the server's close", 5, interval=0.01)
    assert pool.request("GET", "/").read() == b"ok"
    assert server.connections == 2
    assert len(server.requests) == 2  # never sent into the closed connection first


class _Splits(uh.Connection):
    """A connection whose receives hand out ``parts`` one by one (then EOF)."""

    def __init__(self, parts: list[bytes]) -> None:
        super().__init__(object())
        self.parts = parts

    def recv(self, size: int, wait_first: bool = False) -> bytes:
        return self.parts.pop(0) if self.parts else b""


def _decoded(parts: list[bytes]) -> tuple[list[bytes], str | None]:
    resp = uh.Response.__new__(uh.Response)
    resp._conn = None  # nothing to pool or close at the end
    pieces: list[bytes] = []
    try:
        for piece in resp._chunks(_Splits(parts)):
            pieces.append(piece)
    except uh.ProtocolError as exc:
        return pieces, str(exc)
    return pieces, None


def test_chunked_decoding_of_any_split_gives_the_body_or_the_framing_error() -> None:
    """However a chunked body is cut into receives, the pieces join to the body, no piece
    is held back once whole in the buffer, and bad framing raises the same error wherever
    it falls (after good chunks, inside one receive or across two)."""
    import random

    rng = random.Random(18)
    records = [b"data: %d %s\n\n" % (i, b"x" * rng.randrange(0, 40)) for i in range(40)]
    chunks = [b"%x\r\n%s\r\n" % (len(r), r) for r in records]
    good = b"".join(chunks) + b"1;ext=1\r\nz\r\n" + b"0\r\nTrailer: t\r\n\r\n"
    body = b"".join(records) + b"z"
    head, tail = b"".join(chunks[:7]), b"".join(chunks[7:])
    before = b"".join(records[:7])  # relayed before the framing breaks (with data as it came)
    bad = [(head + b"5\r\nhelloXX" + tail, "chunk data not followed by CRLF", b"hello"),
           (head + b"zz\r\n" + tail, "bad chunk size line b'zz'", b""),
           (head + b"f" * 20 + b"\r\n" + tail, "bad chunk size line b'" + "f" * 20 + "'", b""),
           (head + b"1" * (uh.MAX_LINE + 1) + b"\r\n" + tail, "line too long", b"")]
    for _ in range(300):
        cuts = sorted(rng.sample(range(1, len(good)), rng.randrange(0, 30)))
        parts = [good[a:b] for a, b in zip([0, *cuts], [*cuts, len(good)], strict=True)]
        pieces, error = _decoded(parts)
        assert error is None and b"".join(pieces) == body
        for data, message, partial in bad:
            cuts = sorted(rng.sample(range(1, len(data)), rng.randrange(0, 10)))
            parts = [data[a:b] for a, b in zip([0, *cuts], [*cuts, len(data)], strict=True)]
            pieces, error = _decoded(parts)
            assert error == message and (before + partial).startswith(b"".join(pieces))
    whole, _ = _decoded([good])
    assert whole == [body]  # everything buffered comes out as one piece
