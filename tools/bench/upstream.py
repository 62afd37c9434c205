"""A minimal, fast OpenAI-compatible upstream for benchmarks (HTTP/1.1 keep-alive, 127.0.0.1).

Run: ``python -m tools.bench.upstream --port 8001 [--chunks 8] [--chunk-delay-ms 0]``.

It speaks HTTP/1.1 directly on a gevent :class:`~gevent.server.StreamServer` (no WSGI layer)
so that its own cost per request stays in the tens of microseconds and it is never the
bottleneck of a router benchmark. Every answer is prebuilt bytes:

* ``POST /v1/chat/completions`` (and ``/v1/completions``): a small fixed ``chat.completion``
  JSON document; with ``"stream": true`` in the body, ``--chunks`` SSE records then
  ``data: [DONE]``, in chunked transfer encoding, each record sent (flushed) on its own.
* ``GET /health``: ``{"status": "ok"}``; ``GET /v1/models``: one model (``--model``).

Accepted sockets get ``TCP_NODELAY`` so no record waits for an ACK (Nagle).
"""

from __future__ import annotations

import argparse
import json
import re
import socket
import sys

import gevent
from gevent.server import StreamServer

_STREAM_RE = re.compile(rb'"stream"\s*:\s*true')
_MAX_HEAD = 64 * 1024


def _response(status: str, body: bytes, content_type: bytes = b"application/json") -> bytes:
    return (
        b"HTTP/1.1 " + status.encode() + b"\r\nContent-Type: " + content_type
        + b"\r\nContent-Length: " + str(len(body)).encode() + b"\r\n\r\n" + body
    )


def _frame(data: bytes) -> bytes:
    """One chunk of chunked transfer encoding."""
    return b"%x\r\n%s\r\n" % (len(data), data)


class Answers:
    """The prebuilt responses."""

    def __init__(self, model: str, chunks: int, chunk_delay: float) -> None:
        self.chunk_delay = chunk_delay
        completion = {
            "id": "chatcmpl-bench", "object": "chat.completion", "created": 1700000000,
            "model": model,
            "choices": [{"index": 0, "finish_reason": "stop",
                         "message": {"role": "assistant", "content": "Hello from the bench."}}],
            "usage": {"prompt_tokens": 12, "completion_tokens": 6, "total_tokens": 18},
        }
        self.completion = _response("200 OK", json.dumps(completion).encode())
        self.health = _response("200 OK", b'{"status": "ok"}')
        models = {"object": "list",
                  "data": [{"id": model, "object": "model", "created": 0, "owned_by": "bench"}]}
        self.models = _response("200 OK", json.dumps(models).encode())
        self.not_found = _response(
            "404 Not Found",
            b'{"error": {"message": "not found", "type": "invalid_request_error", '
            b'"code": "404", "param": null}}',
        )
        self.stream_head = (
            b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\n"
            b"Cache-Control: no-cache\r\nTransfer-Encoding: chunked\r\n\r\n"
        )
        frames = []
        for i in range(chunks):
            delta = {"content": f"tok{i} "} if i else {"role": "assistant", "content": ""}
            record = {"id": "chatcmpl-bench", "object": "chat.completion.chunk",
                      "created": 1700000000, "model": model,
                      "choices": [{"index": 0, "delta": delta,
                                   "finish_reason": "stop" if i == chunks - 1 else None}]}
            frames.append(_frame(b"data: " + json.dumps(record).encode() + b"\n\n"))
        self.stream_frames = frames
        self.stream_tail = _frame(b"data: [DONE]\n\n") + b"0\r\n\r\n"


class _Closed(Exception):
    pass


def _read_chunked(sock: socket.socket, buf: bytes) -> tuple[bytes, bytes]:
    """Read a chunked request body; return (body, rest of the buffer)."""
    body: list[bytes] = []
    while True:
        while b"\r\n" not in buf:
            data = sock.recv(65536)
            if not data:
                raise _Closed
            buf += data
        line, _, buf = buf.partition(b"\r\n")
        size = int(line.split(b";", 1)[0], 16)
        if size == 0:
            while True:  # optional trailer lines, then an empty line
                while b"\r\n" not in buf:
                    data = sock.recv(65536)
                    if not data:
                        raise _Closed
                    buf += data
                line, _, buf = buf.partition(b"\r\n")
                if not line:
                    return b"".join(body), buf
        while len(buf) < size + 2:
            data = sock.recv(65536)
            if not data:
                raise _Closed
            buf += data
        body.append(buf[:size])
        buf = buf[size + 2:]


def make_handler(answers: Answers):  # type: ignore[no-untyped-def]
    """The connection handler: a keep-alive loop of parse request, send prebuilt answer."""

    def handle(sock: socket.socket, address: object) -> None:
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        recv, sendall = sock.recv, sock.sendall
        buf = b""
        try:
            while True:
                end = buf.find(b"\r\n\r\n")
                while end < 0:
                    if len(buf) > _MAX_HEAD:
                        return
                    data = recv(65536)
                    if not data:
                        return
                    buf += data
                    end = buf.find(b"\r\n\r\n")
                head, buf = buf[:end], buf[end + 4:]
                lines = head.split(b"\r\n")
                parts = lines[0].split(b" ")
                if len(parts) != 3:
                    return
                method, target, version = parts
                length = 0
                chunked = False
                close = version != b"HTTP/1.1"
                for line in lines[1:]:
                    name, _, value = line.partition(b":")
                    name = name.strip().lower()
                    if name == b"content-length":
                        length = int(value)
                    elif name == b"transfer-encoding":
                        chunked = b"chunked" in value.lower()
                    elif name == b"connection":
                        token = value.strip().lower()
                        close = token == b"close" or (close and token != b"keep-alive")
                if chunked:
                    body, buf = _read_chunked(sock, buf)
                else:
                    while len(buf) < length:
                        data = recv(65536)
                        if not data:
                            return
                        buf += data
                    body, buf = buf[:length], buf[length:]
                path = target.split(b"?", 1)[0]
                if method == b"POST" and path in (b"/v1/chat/completions", b"/v1/completions"):
                    if _STREAM_RE.search(body):
                        sendall(answers.stream_head)
                        delay = answers.chunk_delay
                        for frame in answers.stream_frames:
                            sendall(frame)
                            if delay:
                                gevent.sleep(delay)
                        sendall(answers.stream_tail)
                    else:
                        sendall(answers.completion)
                elif method == b"GET" and path == b"/health":
                    sendall(answers.health)
                elif method == b"GET" and path == b"/v1/models":
                    sendall(answers.models)
                else:
                    sendall(answers.not_found)
                if close:
                    return
        except (_Closed, OSError, ValueError):
            return
        finally:
            sock.close()

    return handle


def serve(host: str, port: int, answers: Answers, backlog: int = 1024) -> StreamServer:
    """Start the server (not blocking); ``.serve_forever()`` or ``.stop()`` it."""
    server = StreamServer((host, port), make_handler(answers), backlog=backlog)
    server.start()
    return server


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m tools.bench.upstream", description="fast OpenAI-compatible upstream"
    )
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--model", default="bench-model")
    parser.add_argument("--chunks", type=int, default=8, help="SSE records per stream")
    parser.add_argument("--chunk-delay-ms", type=float, default=0.0,
                        help="pause between SSE records")
    args = parser.parse_args(argv)
    if args.chunks < 1:
        parser.error("--chunks must be at least 1")
    answers = Answers(args.model, args.chunks, args.chunk_delay_ms / 1000)
    server = serve(args.host, args.port, answers)
    print(f"bench upstream listening on {args.host}:{args.port}", file=sys.stderr, flush=True)
    try:
        server.serve_forever()
    except KeyboardInterrupt:
        pass
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
