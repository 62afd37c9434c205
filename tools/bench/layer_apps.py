"""The servers ``tools.bench.layers`` measures: each does one thing a proxy must do (take a
chat completion, send it to the upstream over a kept-alive connection, answer with the
upstream's body and ``X-Continuum-Backend``) on one more layer of the router's stack.

* ``python -m tools.bench.layer_apps --port P --upstream-port U``: a bare gevent
  ``StreamServer``, HTTP/1.1 heads split by hand, one upstream socket per client
  connection. Nothing a Python proxy on gevent can skip: the floor. It forks once and
  serves in the child, so that, as with gunicorn, the serving process is the child of the
  one started (the benchmark reads the child's CPU).
* ``python -m tools.bench.layer_apps --threads --port P --upstream-port U``: the same
  relay on the standard library's blocking sockets, a thread per client connection: no
  event loop, so a streamed record costs the kernel's wake-up and two syscalls only. What
  gevent's loop adds per wake-up is the difference from the one above.
* ``python -m tools.bench.layer_apps --exec CMD [ARG ...]``: runs another proxy (a Rust
  router ``tools.bench.layers`` compares against) as its child the same way, passing a
  stop on to it.
* ``tools.bench.layer_apps:wsgi``: a bare WSGI function, for gunicorn's worker or the
  router's.
* ``tools.bench.layer_apps:falcon_app``: a Falcon app with one resource, for the router's
  worker.

The WSGI and Falcon servers reach the upstream (``LAYER_UPSTREAM_PORT``) through the
router's own client, :mod:`continuum.wire.http_client`. Benchmark code only: it checks
nothing, answers every POST the same way, and listens on 127.0.0.1.
"""

from __future__ import annotations

import argparse
import os
import re
import signal
from collections.abc import Callable, Iterable
from typing import Any

import falcon

from continuum.devtools.procs import die_with_parent_hook
from continuum.wire.http_client import ConnectionPool

_HEALTH = b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok"
_CONTENT_LENGTH = re.compile(rb"\r\ncontent-length: *(\d+)", re.IGNORECASE)
_CHUNKED = re.compile(rb"\r\ntransfer-encoding: *chunked", re.IGNORECASE)
_STREAM = re.compile(rb'"stream"\s*:\s*true')
_pool: ConnectionPool | None = None


def _upstream() -> ConnectionPool:
    global _pool
    if _pool is None:
        _pool = ConnectionPool("127.0.0.1", int(os.environ["LAYER_UPSTREAM_PORT"]),
                               connect_timeout=5.0, read_timeout=30.0)
    return _pool


def _open(body: bytes) -> Any:
    return _upstream().request("POST", "/v1/chat/completions", body,
                               {"Content-Type": "application/json"})


def _streamed(body: bytes) -> bool:
    return _STREAM.search(body) is not None


def wsgi(environ: dict[str, Any], start_response: Callable[..., Any]) -> Iterable[bytes]:
    if environ["PATH_INFO"] == "/health":
        start_response("200 OK", [("Content-Length", "2")])
        return [b"ok"]
    body = environ["wsgi.input"].read(int(environ.get("CONTENT_LENGTH") or 0))
    response = _open(body)
    if _streamed(body):  # gunicorn frames it chunked, piece by piece as it comes
        start_response("200 OK", [("Content-Type", "text/event-stream"),
                                  ("X-Continuum-Backend", "layer")])
        pieces: Iterable[bytes] = response.stream()
        return pieces
    data = response.read()
    start_response("200 OK", [("Content-Type", "application/json"),
                              ("Content-Length", str(len(data))),
                              ("X-Continuum-Backend", "layer")])
    return [data]


class _Chat:
    def on_post(self, req: falcon.Request, resp: falcon.Response) -> None:
        body = req.bounded_stream.read()
        response = _open(body)
        resp.set_header("X-Continuum-Backend", "layer")
        if _streamed(body):
            resp.content_type = "text/event-stream"
            resp.stream = response.stream()
        else:
            resp.content_type = "application/json"
            resp.data = response.read()


class _Health:
    def on_get(self, req: falcon.Request, resp: falcon.Response) -> None:
        resp.text = "ok"


falcon_app = falcon.App()
falcon_app.add_route("/v1/chat/completions", _Chat())
falcon_app.add_route("/health", _Health())


def _read_message(sock: Any, buf: bytes) -> tuple[bytes | None, bytes, bytes]:
    """``(head, body, rest)`` of the next HTTP/1.1 message on ``sock``: a Content-Length
    body whole, or of a chunked one what has arrived with the head; ``head`` None when the
    peer closed."""
    while (end := buf.find(b"\r\n\r\n")) < 0:
        data = sock.recv(65536)
        if not data:
            return None, b"", b""
        buf += data
    head, rest = buf[:end], buf[end + 4:]
    if _CHUNKED.search(head):
        return head, rest, b""
    match = _CONTENT_LENGTH.search(head)
    size = int(match.group(1)) if match else 0
    while len(rest) < size:
        data = sock.recv(65536)
        if not data:
            return None, b"", b""
        rest += data
    return head, rest[:size], rest[size:]


def _serve_floor(port: int, upstream_port: int, threads: bool = False) -> None:
    """The floor relay, on gevent; ``threads``: the same relay on the standard library's
    blocking sockets, one OS thread per client connection (no event loop at all)."""
    if threads:
        import socket
    else:
        from gevent import socket  # type: ignore[no-redef]

    def handle(client: Any, _addr: Any) -> None:
        client.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        upstream = None
        buf = up_buf = b""
        try:
            while True:
                head, body, buf = _read_message(client, buf)
                if head is None:
                    return
                if head.startswith(b"GET /health "):
                    client.sendall(_HEALTH)
                    continue
                if upstream is None:
                    upstream = socket.create_connection(("127.0.0.1", upstream_port))
                    upstream.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                upstream.sendall(head + b"\r\n\r\n" + body)
                up_head, up_body, up_buf = _read_message(upstream, up_buf)
                if up_head is None:
                    return
                client.sendall(up_head + b"\r\nX-Continuum-Backend: layer\r\n\r\n" + up_body)
                if _CHUNKED.search(up_head):
                    # Relay as it comes, framing and all, up to the last chunk (the bench
                    # upstream sends nothing after it and no trailers).
                    tail = up_body[-5:]
                    while tail != b"0\r\n\r\n":
                        data = upstream.recv(65536)
                        if not data:
                            return
                        client.sendall(data)
                        tail = (tail + data)[-5:]
        finally:
            if upstream is not None:
                upstream.close()

    if not threads:
        from gevent.server import StreamServer

        StreamServer(("127.0.0.1", port), handle).serve_forever()
        return
    import threading

    listener = socket.create_server(("127.0.0.1", port), backlog=1024)
    while True:
        client, addr = listener.accept()
        threading.Thread(target=handle, args=(client, addr), daemon=True).start()


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--port", type=int)
    parser.add_argument("--upstream-port", type=int)
    parser.add_argument("--threads", action="store_true",
                        help="the floor relay on blocking sockets, a thread per connection")
    parser.add_argument("--exec", dest="command", nargs=argparse.REMAINDER,
                        help="serve by running this command in the child instead")
    args = parser.parse_args(argv)
    if not args.command and (args.port is None or args.upstream_port is None):
        parser.error("--port and --upstream-port are required without --exec")
    child = os.fork()
    if not child:
        die_with_parent = die_with_parent_hook()
        if die_with_parent is not None:
            die_with_parent()
        if args.command:
            os.execvp(args.command[0], args.command)
        _serve_floor(args.port, args.upstream_port, args.threads)
        return

    def stop(signum: int, _frame: Any) -> None:  # the parent passes a stop on, as gunicorn's
        os.kill(child, signum)

    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)
    os.waitpid(child, 0)


if __name__ == "__main__":
    main()
