"""Bounded upstream answers: ``server.max_upstream_response_bytes`` and
``server.max_stream_duration_seconds`` against a real HTTP upstream on 127.0.0.1.

The upstream is a thread in this process that sends an oversize body (sized or chunked) or
an SSE stream that never ends; it counts what it managed to send, so the tests see how far
the router read before it gave up.
"""

from __future__ import annotations

import json
import socket
import threading
import time
import tracemalloc
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import falcon.testing
import pytest
import requests

from continuum.config import parse_config
from continuum.devtools.fleet import metric_sum
from continuum.registry import PluginRegistry
from continuum.web.app import create_app

MIB = 1024 * 1024
PIECE = b"x" * 65536
#: Bytes the oversize upstream offers (far beyond any cap used here).
OFFERED = 256 * MIB
#: Longest any upstream handler keeps sending (a bound on the test, never reached).
HANDLER_SECONDS = 60.0
CHAT = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}


class BigUpstream(ThreadingHTTPServer):
    """Answers every POST by ``mode``: ``sized`` / ``chunked`` (OFFERED bytes of body), or
    ``forever`` (an SSE chunk every 20 ms until the client goes away)."""

    daemon_threads = True

    def __init__(self, mode: str) -> None:
        super().__init__(("127.0.0.1", 0), _Handler)
        self.mode = mode
        self.sent = 0
        self.client_gone = threading.Event()
        self.thread = threading.Thread(target=self.serve_forever, daemon=True)
        self.thread.start()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server_address[1]}"

    def stop(self) -> None:
        self.shutdown()
        self.server_close()


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    server: BigUpstream

    def log_message(self, format: str, *args: Any) -> None:
        pass

    def do_GET(self) -> None:  # health checks
        self._small(200, b'{"ok": true}')

    def do_POST(self) -> None:
        self.rfile.read(int(self.headers.get("Content-Length") or 0))
        mode = self.server.mode
        self.send_response(200)
        if mode == "sized":
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(OFFERED))
        else:
            self.send_header("Content-Type",
                             "text/event-stream" if mode == "forever" else "application/json")
            self.send_header("Transfer-Encoding", "chunked")
        self.end_headers()
        deadline = time.monotonic() + HANDLER_SECONDS
        try:
            while time.monotonic() < deadline and self.server.sent < OFFERED:
                if mode == "sized":
                    self.wfile.write(PIECE)
                    self.server.sent += len(PIECE)
                    continue
                data = PIECE if mode == "chunked" else (
                    b'data: {"choices": [{"index": 0, "delta": {"content": "t"}}]}\n\n')
                self.wfile.write(b"%x\r\n%s\r\n" % (len(data), data))
                self.wfile.flush()
                self.server.sent += len(data)
                if mode == "forever":
                    time.sleep(0.02)
        except OSError:
            self.server.client_gone.set()
        self.close_connection = True

    def _small(self, status: int, body: bytes) -> None:
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)


@pytest.fixture
def big_upstream() -> Iterator[Any]:
    servers: list[BigUpstream] = []

    def start(mode: str) -> BigUpstream:
        server = BigUpstream(mode)
        servers.append(server)
        return server

    yield start
    for server in servers:
        server.stop()


_APPS: list[Any] = []


@pytest.fixture(autouse=True)
def _close_apps() -> Iterator[None]:
    yield
    while _APPS:
        _APPS.pop().service.stop()  # closes the pooled upstream connections


def _client(cfg: dict[str, Any]) -> falcon.testing.TestClient:
    app = create_app(parse_config(cfg), registry=PluginRegistry())
    _APPS.append(app)
    return falcon.testing.TestClient(app)


def _app(url: str, **server: Any) -> falcon.testing.TestClient:
    return _client({"backends": [{"name": "big", "url": url, "models": ["m"]}],
                    "health_check": {"enabled": False}, "server": server})


@pytest.mark.parametrize("mode", ["sized", "chunked"])
def test_oversize_body_is_502_without_reading_it_into_memory(big_upstream: Any,
                                                             mode: str) -> None:
    up = big_upstream(mode)
    client = _app(up.url, max_upstream_response_bytes=MIB)
    tracemalloc.start()
    try:
        resp = client.simulate_post("/v1/chat/completions", json=CHAT)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert resp.status_code == 502
    error = resp.json["error"]
    assert error["code"] == "upstream_response_too_large"
    assert error["type"] == "bad_gateway"
    assert error["message"].startswith(
        "upstream response exceeded server.max_upstream_response_bytes (request id ")
    assert "127.0.0.1" not in resp.text and up.url not in resp.text
    # The cap, one receive buffer and the join of the kept pieces; never the offered body.
    assert peak < 4 * MIB, peak
    if mode == "sized":  # Content-Length over the cap: refused before reading the body
        assert peak < MIB, peak
    metrics = client.simulate_get("/metrics").text
    assert metric_sum(metrics, "continuum_upstream_errors_total", backend="big",
                        kind="too_large") == 1


def test_a_body_within_the_cap_is_relayed(big_upstream: Any) -> None:
    up = big_upstream("sized")
    client = _app(up.url, max_upstream_response_bytes=OFFERED)
    resp = client.simulate_post("/v1/chat/completions", json=CHAT)
    assert resp.status_code == 200 and len(resp.content) == OFFERED


def test_anthropic_route_gets_the_anthropic_error_shape(big_upstream: Any) -> None:
    up = big_upstream("chunked")
    client = _client({
        "backends": [{"name": "big", "url": up.url, "models": ["m"], "type": "anthropic"}],
        "health_check": {"enabled": False}, "server": {"max_upstream_response_bytes": MIB}})
    resp = client.simulate_post("/anthropic/v1/messages", json={
        "model": "m", "max_tokens": 5, "messages": [{"role": "user", "content": "hi"}]})
    assert resp.status_code == 502
    assert resp.json["type"] == "error"
    assert "max_upstream_response_bytes" in resp.json["error"]["message"]


def test_never_ending_stream_ends_with_an_error_event(big_upstream: Any) -> None:
    up = big_upstream("forever")
    client = _app(up.url, max_stream_duration_seconds=0.5)
    resp = client.simulate_post("/v1/chat/completions", json={**CHAT, "stream": True})
    assert resp.status_code == 200
    records = [r for r in resp.text.split("\n\n") if r]
    assert len(records) >= 2
    last = json.loads(records[-1].removeprefix("data: "))
    assert last["error"]["message"] == (
        "upstream stream exceeded server.max_stream_duration_seconds")
    assert up.client_gone.wait(10)  # the router closed the upstream connection
    metrics = client.simulate_get("/metrics").text
    assert metric_sum(metrics, "continuum_upstream_errors_total", backend="big",
                        kind="stream_duration") == 1
    assert metric_sum(metrics, "continuum_backend_in_flight", backend="big") == 0


@pytest.mark.e2e
def test_limits_under_gunicorn(big_upstream: Any, router_factory: Any) -> None:
    sized, forever = big_upstream("sized"), big_upstream("forever")
    router = router_factory({
        "backends": [{"name": "sized", "url": sized.url, "models": ["big"]},
                     {"name": "forever", "url": forever.url, "models": ["endless"]}],
        "health_check": {"enabled": False},
        "server": {"max_upstream_response_bytes": MIB, "max_stream_duration_seconds": "1s"}})
    resp = requests.post(router.url + "/v1/chat/completions", json={**CHAT, "model": "big"},
                         timeout=30)
    assert resp.status_code == 502
    assert resp.json()["error"]["code"] == "upstream_response_too_large"
    assert sized.sent < OFFERED  # cut off, not drained

    with requests.post(router.url + "/v1/chat/completions", timeout=30, stream=True,
                       json={**CHAT, "model": "endless", "stream": True}) as stream:
        body = b"".join(stream.iter_content(None))
    last = json.loads(body.decode().strip().split("\n\n")[-1].removeprefix("data: "))
    assert last["error"]["message"] == (
        "upstream stream exceeded server.max_stream_duration_seconds")
    assert forever.client_gone.wait(10)


def test_body_too_large_from_the_client_itself() -> None:
    """``Response.read(limit)`` on a raw socket pair: a sized body over the limit is refused
    before any body byte is read, and the connection is closed."""
    from continuum.wire import http_client as upstream_http

    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(1)
    pool = upstream_http.ConnectionPool("127.0.0.1", server.getsockname()[1],
                                        connect_timeout=5, read_timeout=5)
    done = threading.Event()

    def answer() -> None:
        conn, _ = server.accept()
        with conn:
            conn.recv(65536)
            conn.sendall(b"HTTP/1.1 200 OK\r\nContent-Length: 5000\r\n\r\n" + b"y" * 100)
            done.wait(10)

    thread = threading.Thread(target=answer, daemon=True)
    thread.start()
    try:
        response = pool.request("POST", "/", b"{}")
        with pytest.raises(upstream_http.BodyTooLarge):
            response.read(4096)
        assert pool.idle == 0
    finally:
        done.set()
        thread.join(10)
        server.close()
