"""Hostile requests against the router under real gunicorn -k gevent: 400 in JSON, the same
worker keeps serving, and gunicorn's own HTML error pages are what the docs say."""

from __future__ import annotations

import socket
from collections.abc import Callable
from typing import Any

import pytest
import requests

from continuum.devtools.procs import free_port
from continuum.devtools.servers import FakeUpstream, RouterProcess

pytestmark = pytest.mark.e2e

BASE = '{"model":"m","messages":[{"role":"user","content":"x"}],'


def _worker_pid(router: RouterProcess) -> int:
    return int(requests.get(router.url + "/admin/backends", timeout=5).json()["worker_pid"])


def _raw_http(port: int, request: bytes) -> bytes:
    """Send raw bytes, read until the server closes (gunicorn closes after its error page)."""
    with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
        sock.sendall(request)
        received = b""
        while chunk := sock.recv(65536):
            received += chunk
    return received


def test_reported_inputs_get_400_and_the_worker_survives(
    upstreams: Callable[[str], FakeUpstream], router_factory: Callable[..., RouterProcess]
) -> None:
    up = upstreams("up")
    router = router_factory({"backends": [{"name": "up", "url": up.url, "models": ["m"]}],
                             "response_cache": {"enabled": True},
                             "health_check": {"enabled": False}})
    pid = _worker_pid(router)
    cases: list[tuple[bytes, Any]] = [
        (b"[" * 990 + b"]" * 990, None),
        ((BASE + '"temperature":1' + "0" * 400 + "}").encode(), "temperature"),
        ((BASE + '"top_p":1' + "0" * 400 + "}").encode(), "top_p"),
        ((BASE + f'"max_tokens":{2**63}}}').encode(), "max_tokens"),
    ]
    for body, param in cases:
        resp = requests.post(router.url + "/v1/chat/completions", data=body, timeout=10,
                             headers={"Content-Type": "application/json"})
        assert resp.status_code == 400, resp.text
        assert resp.headers["Content-Type"].startswith("application/json")
        assert resp.json()["error"]["param"] == param
        assert len(resp.headers["X-Request-Id"]) == 32
    ok = requests.post(router.url + "/v1/chat/completions", timeout=10,
                       json={"model": "m", "messages": [{"role": "user", "content": "x"}]})
    assert ok.status_code == 200 and ok.json()["choices"][0]["message"]["content"] == \
        "hello from up"
    assert _worker_pid(router) == pid
    assert "Traceback" not in router.proc.log_text()


def test_the_deepest_configurable_nesting_is_served_by_a_real_worker(
    upstreams: Callable[[str], FakeUpstream], router_factory: Callable[..., RouterProcess]
) -> None:
    """server.max_json_depth at its maximum: json.loads, the cache key and the salted body
    (json.dumps) all handle that depth inside a gevent worker."""
    up = upstreams("up")
    dead = f"http://127.0.0.1:{free_port()}"  # the KV stream is never served
    router = router_factory({
        "backends": [{"name": "up", "url": up.url, "models": ["m"]}],
        "server": {"max_json_depth": 512},
        "prefix_routing": {"enabled": True},
        "response_cache": {"enabled": True},
        "kv_cache_index": {"enabled": True, "cache_salt": {"enabled": True, "secret": "s"},
                           "event_sources": [{"backend_name": "up",
                                              "endpoint": f"{dead}/events/up"}]},
        "health_check": {"enabled": False}})

    def post(levels: int) -> requests.Response:
        nested = "[" * levels + "0" + "]" * levels
        return requests.post(router.url + "/v1/chat/completions", timeout=10,
                             data=(BASE + f'"temperature":0,"metadata":{nested}}}').encode())

    deepest = post(511)  # + the request object itself = 512 levels
    assert deepest.status_code == 200, deepest.text
    assert "cache_salt" in up.stats()["last_body"]
    too_deep = post(512)
    assert too_deep.status_code == 400
    assert "more than 512 levels deep" in too_deep.json()["error"]["message"]


def test_gunicorn_answers_malformed_http_itself_in_html(
    upstreams: Callable[[str], FakeUpstream], router_factory: Callable[..., RouterProcess]
) -> None:
    """What README and the man page document: these never reach the app, so they are
    gunicorn's HTML pages with Connection: close."""
    up = upstreams("up")
    router = router_factory({"backends": [{"name": "up", "url": up.url, "models": ["m"]}],
                             "health_check": {"enabled": False}})
    long_line = b"GET /" + b"a" * 5000 + b" HTTP/1.1\r\nHost: x\r\n\r\n"
    many_headers = b"GET /health HTTP/1.1\r\nHost: x\r\n" + b"".join(
        b"X-H%d: v\r\n" % i for i in range(101)) + b"\r\n"
    big_header = b"GET /health HTTP/1.1\r\nHost: x\r\nX-Big: " + b"v" * 9000 + b"\r\n\r\n"
    garbage = b"NOT HTTP AT ALL\r\n\r\n"
    for request, status in ((long_line, b"414"), (many_headers, b"431"),
                            (big_header, b"431"), (garbage, b"400")):
        answer = _raw_http(router.port, request)
        head = answer.split(b"\r\n\r\n", 1)[0]
        assert head.startswith(b"HTTP/1.1 " + status), answer[:200]
        assert b"Content-Type: text/html" in head and b"Connection: close" in head
    assert requests.get(router.url + "/health", timeout=5).status_code == 200
