"""The router's gunicorn worker serves WSGI through its own environ, response and parser
pieces (``continuum.wire.wsgi_fast``, ``request_head.finish_body``), and what an
application sees and sends through them is what gunicorn would give it: real gunicorn, a
probe app, raw requests on a kept-alive connection."""

from __future__ import annotations

import json
import signal
import socket
import sys
from pathlib import Path
from typing import Any

import pytest

from continuum.devtools.procs import Child, free_port, wait_http
from continuum.gunicorn_worker import WORKER_CLASS

pytestmark = pytest.mark.e2e

ROOT = Path(__file__).resolve().parents[2]


def _exchange(sock: socket.socket, request: bytes) -> tuple[bytes, dict[str, Any]]:
    """Send ``request``; the answer's head and its JSON body."""
    sock.sendall(request)
    data = b""
    while b"\r\n\r\n" not in data:
        data += sock.recv(65536)
    head, _, body = data.partition(b"\r\n\r\n")
    length = int(next(line.split(b":")[1] for line in head.split(b"\r\n")
                      if line.lower().startswith(b"content-length:")))
    while len(body) < length:
        body += sock.recv(65536)
    return head, json.loads(body)


def test_the_worker_serves_through_its_fast_pieces_as_gunicorn_would(tmp_path: Path) -> None:
    port = free_port()
    worker = Child([sys.executable, "-m", "gunicorn", "-k", WORKER_CLASS, "-w", "1", "-b",
                    f"127.0.0.1:{port}", "tests.integration.wsgi_probe:app"],
                   tmp_path / "worker.log", cwd=ROOT, stop_signal=signal.SIGQUIT)
    try:
        wait_http(f"http://127.0.0.1:{port}/health", 20, children=[worker])
        with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
            body = b'{"a":1}'
            # a plain request, its body in the same packet: the fast environ
            head, seen = _exchange(sock, b"POST /p%20q HTTP/1.1\r\nHost: h\r\nX-One: 1\r\n"
                                   b"Content-Length: 7\r\n\r\n" + body)
            assert seen["create"] == "continuum.wire.wsgi_fast.create"
            assert seen["finish_body"] == "continuum.wire.request_head"
            assert seen["response"] == "FastResponse"
            assert seen["fields"] == {"HTTP_X_ONE": "1"} and seen["path"] == "/p q"
            assert seen["body"] == '{"a":1}'
            assert head.startswith(b"HTTP/1.1 200 OK\r\nServer: gunicorn\r\n")
            assert b"\r\nConnection: keep-alive\r\n" in head and b"\r\nX-Probe: 1" in head
            # a repeated field takes gunicorn's environ (joined), on the same connection
            head, seen = _exchange(sock, b"GET /r HTTP/1.1\r\nX-Two: a\r\nX-Two: b\r\n\r\n")
            assert seen["fields"] == {"HTTP_X_TWO": "a,b"} and seen["response"] == "FastResponse"
            # a body the app leaves unread is drained: the next request starts after it
            head, seen = _exchange(sock, b"POST /unread HTTP/1.1\r\nContent-Length: 3\r\n"
                                   b"\r\nabc")
            assert seen["body"] == "" and seen["path"] == "/unread"
            head, seen = _exchange(sock, b"GET /t HTTP/1.1\r\nConnection: close\r\n\r\n")
            assert seen["path"] == "/t" and b"\r\nConnection: close\r\n" in head
    finally:
        worker.stop()
