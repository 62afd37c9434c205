"""Slow clients against the router under real gunicorn with its gevent worker.

A client that sends its request header or body too slowly gets a 408 (JSON error body) and
is closed within ``server.client_header_timeout_seconds`` / ``client_body_timeout_seconds``,
so twice as many slow sockets as a worker has connections cannot lock normal clients out.
"""

from __future__ import annotations

import json
import socket
import threading
import time
from typing import Any

import pytest
import requests

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

WORKER_CONNECTIONS = 3
TIMEOUT = 2  # both client timeouts, in seconds
INTERVAL = 0.2  # between two bytes of a trickle
TRICKLE = 100  # bytes a slow client would send if never cut off: 20 s at INTERVAL
CHAT = b"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\n"
BODY = json.dumps({"model": "m", "messages": [{"role": "user", "content": "hi"}]}).encode()


def _config(upstream: Any, timeout: float = TIMEOUT) -> dict[str, Any]:
    return {
        "backends": [{"name": upstream.name, "url": upstream.url, "models": ["m"]}],
        "server": {"worker_connections": WORKER_CONNECTIONS,
                   "client_header_timeout_seconds": timeout,
                   "client_body_timeout_seconds": timeout},
    }


class SlowClient(threading.Thread):
    """Opens a connection (and, with ``first``, has that request answered on it first),
    sends ``head`` at once, then one byte of ``trickle`` every :data:`INTERVAL` until the
    server answers or closes, or the trickle runs out."""

    def __init__(self, port: int, head: bytes, trickle: bytes, first: bytes = b"") -> None:
        super().__init__(daemon=True)
        self.port = port
        self.head = head
        self.trickle = trickle
        self.first = first
        self.first_answer = b""
        self.sent = 0  # trickle bytes sent before the server answered or closed
        self.answer = b""
        self.outcome = "still sending"  # or "answered", "closed", "reset"

    def run(self) -> None:
        with socket.create_connection(("127.0.0.1", self.port), timeout=5) as sock:
            if self.first:
                sock.sendall(self.first)
                self.first_answer = Responses(sock).next()
            sock.sendall(self.head)
            sock.settimeout(INTERVAL)
            for byte in self.trickle:
                try:
                    if self._read(sock):
                        break
                    sock.send(bytes([byte]))
                    self.sent += 1
                except OSError:
                    self.outcome = "reset"
                    break
            if self.outcome == "answered":  # the server must also close it
                sock.settimeout(5)
                try:
                    while self._read(sock) and self.outcome == "answered":
                        pass
                except OSError:
                    self.outcome = "reset"

    def _read(self, sock: socket.socket) -> bool:
        """Whatever the server sent within one interval; True once it sent or closed."""
        try:
            chunk = sock.recv(65536)
        except TimeoutError:
            return False
        if not chunk:
            self.outcome = "closed"
            return True
        self.answer += chunk
        self.outcome = "answered"
        return True


class Responses:
    """HTTP responses with a Content-Length, read one by one off a socket (bounded by its
    timeout); bytes of the next response stay for the next call."""

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self.data = b""

    def next(self) -> bytes:
        while b"\r\n\r\n" not in self.data:
            self._fill()
        head = self.data.partition(b"\r\n\r\n")[0]
        length = next(int(line.split(b":")[1]) for line in head.split(b"\r\n")
                      if line.lower().startswith(b"content-length:"))
        size = len(head) + 4 + length
        while len(self.data) < size:
            self._fill()
        answer, self.data = self.data[:size], self.data[size:]
        return answer

    def _fill(self) -> None:
        chunk = self.sock.recv(65536)
        assert chunk, self.data
        self.data += chunk


def _slow_header(port: int) -> SlowClient:
    """A header sent a byte at a time (one endless header field)."""
    return SlowClient(port, CHAT + b"X-Slow: ", b"a" * TRICKLE)


def _slow_body(port: int) -> SlowClient:
    """A whole header at once, then part of the body, then the rest a byte at a time."""
    head = (CHAT + b"Content-Type: application/json\r\nContent-Length: "
            + str(len(BODY) + TRICKLE).encode() + b"\r\n\r\n" + BODY[:10])
    return SlowClient(port, head, b" " * TRICKLE)


def _kept_alive_then_slow(port: int) -> SlowClient:
    """One fast request on a kept-alive connection, then the next header a byte at a time:
    the deadline runs from the next request's first byte."""
    fast = b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n"
    return SlowClient(port, b"GET /health HTTP/1.1\r\nX-Slow: ", b"a" * TRICKLE, first=fast)


def _assert_timed_out(client: SlowClient) -> None:
    """Cut off long before its trickle ran out, with a 408 JSON answer (or at least closed:
    a reset may overtake an answer already on its way)."""
    assert client.sent < TRICKLE, client.outcome
    assert client.outcome in ("closed", "reset"), (client.outcome, client.answer)
    if client.answer:
        last = client.answer.rfind(b"HTTP/1.1 ")
        head, _, body = client.answer[last:].partition(b"\r\n\r\n")
        assert head.startswith(b"HTTP/1.1 408 "), client.answer
        error = json.loads(body)["error"]
        assert error["code"] == "request_timeout" and error["type"] == "invalid_request_error"


def test_slow_clients_get_408_and_cannot_lock_normal_clients_out(
    upstreams: Any, router_factory: Any
) -> None:
    up = upstreams("a")
    router = router_factory(_config(up))
    kinds = (_slow_header, _slow_body, _kept_alive_then_slow)
    slow = [kinds[i % len(kinds)](router.port) for i in range(2 * WORKER_CONNECTIONS)]
    for client in slow:
        client.start()
    time.sleep(2 * INTERVAL)  # every slow client connected and sending
    assert all(client.outcome == "still sending" for client in slow)

    # Normal clients wait behind the slow ones (queued for accept) and are then served.
    with requests.Session() as http:
        for _ in range(3):
            resp = http.post(router.url + "/v1/chat/completions", data=BODY, timeout=20,
                             headers={"Content-Type": "application/json"})
            assert resp.status_code == 200, resp.text
            assert resp.json()["choices"][0]["message"]["content"] == "hello from a"

    for client in slow:
        client.join(timeout=30)
        assert not client.is_alive()
    for client in slow:
        _assert_timed_out(client)
    # The first request of the kept-alive connections was answered normally.
    for client in slow[2::3]:
        assert client.first_answer.startswith(b"HTTP/1.1 200 "), client.first_answer


def test_an_idle_kept_alive_connection_outlives_the_header_timeout(
    upstreams: Any, router_factory: Any
) -> None:
    """The header deadline does not cut the wait between requests (that is ``keepalive``)."""
    router = router_factory(_config(upstreams("a")))
    request = b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n"
    with socket.create_connection(("127.0.0.1", router.port), timeout=10) as sock:
        responses = Responses(sock)
        sock.sendall(request)
        assert responses.next().startswith(b"HTTP/1.1 200 ")
        time.sleep(TIMEOUT + 1)  # idle, longer than the header timeout
        sock.sendall(request)
        assert responses.next().startswith(b"HTTP/1.1 200 ")


def test_pipelined_requests_are_answered_without_waiting(
    upstreams: Any, router_factory: Any
) -> None:
    """A request that arrived with the previous one is read at once, not after an idle
    wait for bytes that are already there."""
    router = router_factory(_config(upstreams("a")))
    request = b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n"
    with socket.create_connection(("127.0.0.1", router.port), timeout=10) as sock:
        sock.sendall(request * 3)
        responses = Responses(sock)
        for _ in range(3):
            assert responses.next().startswith(b"HTTP/1.1 200 ")


def test_k_gevent_gets_the_router_worker_and_other_classes_are_warned_about(
    upstreams: Any, router_factory: Any
) -> None:
    """``-k gevent`` (how operators run gevent apps) would bring back gunicorn's worker
    without the header timeout: the router's is put back, and slow headers still get 408.
    A class that is no gevent worker at all is kept, with a warning."""
    router = router_factory(_config(upstreams("a")), env={"GUNICORN_CMD_ARGS": "-k gevent"})
    with socket.create_connection(("127.0.0.1", router.port), timeout=10) as sock:
        sock.sendall(b"POST /v1/chat/completions HTTP/1.1\r\n")  # and then nothing
        sock.settimeout(TIMEOUT + 10)
        answer = sock.recv(4096)
    assert answer.startswith(b"HTTP/1.1 408 "), answer
    log = router.proc.log_text()
    assert "-k gevent: using continuum.gunicorn_worker.GeventWorker" in log, log
    assert "has no client_header_timeout_seconds" not in log, log
    default = router_factory(_config(upstreams("b")))
    assert "client_header_timeout_seconds" not in default.proc.log_text()


def test_a_header_within_the_configured_timeout_is_served(
    upstreams: Any, router_factory: Any
) -> None:
    """The header deadline is the configured one: a header that takes longer than a second
    but less than ``client_header_timeout_seconds`` is served (the reused timer once kept
    the length it was made with, 1 s)."""
    # A header timeout well above the pause, so that a busy machine's stall after the
    # pause cannot push the header past it.
    timeout = 6
    router = router_factory(_config(upstreams("a"), timeout=timeout))
    head = b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\n"
    with socket.create_connection(("127.0.0.1", router.port), timeout=timeout + 10) as sock:
        sock.sendall(head)
        time.sleep(1.4)  # past 1 s, well within the header timeout
        sock.sendall(b"\r\n")
        assert Responses(sock).next().startswith(b"HTTP/1.1 200 ")
