"""Hostile requests against the router under real gunicorn -k gevent: 400 in JSON, the same
worker keeps serving; what gunicorn refuses before the app sees it is answered in JSON
too; chunked request bodies are read to their last chunk under the same limits."""

from __future__ import annotations

import json
import socket
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import requests

from continuum.devtools.procs import refused_port
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
    dead = f"http://127.0.0.1:{refused_port()}"  # the KV stream is never served
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


def _split(answer: bytes) -> tuple[bytes, dict[str, str], Any]:
    head, _, body = answer.partition(b"\r\n\r\n")
    status, *lines = head.decode("latin-1").split("\r\n")
    headers = {k.lower(): v.strip() for k, _, v in (line.partition(":") for line in lines)}
    return status.encode(), headers, json.loads(body)


def test_what_gunicorn_refuses_itself_is_answered_in_json(
    upstreams: Callable[[str], FakeUpstream], router_factory: Callable[..., RouterProcess]
) -> None:
    """Requests refused before the app sees them (gunicorn's limits, malformed HTTP) get
    gunicorn's status and Connection: close, with the router's JSON error shape (Anthropic's
    when the path was read and is under /anthropic/) and an X-Request-Id; the worker goes
    on serving."""
    up = upstreams("up")
    router = router_factory({"backends": [{"name": "up", "url": up.url, "models": ["m"]}],
                             "health_check": {"enabled": False}})
    pid = _worker_pid(router)
    long_line = b"GET /" + b"a" * 5000 + b" HTTP/1.1\r\nHost: x\r\n\r\n"
    many_headers = b"GET /health HTTP/1.1\r\nHost: x\r\n" + b"".join(
        b"X-H%d: v\r\n" % i for i in range(101)) + b"\r\n"
    big_header = b"GET /health HTTP/1.1\r\nHost: x\r\nX-Big: " + b"v" * 9000 + b"\r\n\r\n"
    garbage = b"NOT HTTP AT ALL\r\n\r\n"
    for request, status, code in (
            (long_line, b"414", "request_line_too_long"),
            (many_headers, b"431", "request_header_fields_too_large"),
            (big_header, b"431", "request_header_fields_too_large"),
            (garbage, b"400", "bad_request")):
        line, headers, doc = _split(_raw_http(router.port, request))
        assert line.startswith(b"HTTP/1.1 " + status), (line, doc)
        assert headers["content-type"] == "application/json"
        assert headers["connection"] == "close"
        error = doc["error"]
        assert error["type"] == "invalid_request_error" and error["code"] == code, doc
        assert error["request_id"] == headers["x-request-id"] and len(error["request_id"]) == 32
    assert "Request Line is too large" in \
        _split(_raw_http(router.port, long_line))[2]["error"]["message"]
    # a transfer coding gunicorn does not accept, on a path it read: Anthropic's shape
    line, headers, doc = _split(_raw_http(
        router.port, b"POST /anthropic/v1/messages HTTP/1.1\r\nHost: x\r\n"
                     b"Transfer-Encoding: gzip\r\n\r\n"))
    assert line.startswith(b"HTTP/1.1 400"), doc
    assert doc["type"] == "error" and doc["error"]["type"] == "invalid_request_error", doc
    assert doc["request_id"] == headers["x-request-id"]
    # refused before the path was read (a line or headers over the limits), on /anthropic/:
    # Anthropic's shape too, from a look at the request line
    for request, status in (
            (b"POST /anthropic/v1/messages?" + b"q" * 5000 + b" HTTP/1.1\r\n\r\n", b"414"),
            (b"POST /anthropic/v1/messages HTTP/1.1\r\nX-Big: " + b"v" * 9000 + b"\r\n\r\n",
             b"431")):
        line, headers, doc = _split(_raw_http(router.port, request))
        assert line.startswith(b"HTTP/1.1 " + status), (line, doc)
        assert doc["type"] == "error" and doc["error"]["type"] == "invalid_request_error", doc
        assert doc["request_id"] == headers["x-request-id"]
    assert requests.get(router.url + "/health", timeout=5).status_code == 200
    assert _worker_pid(router) == pid
    assert "Traceback" not in router.proc.log_text()


def _pieces(body: bytes, size: int) -> Iterator[bytes]:
    """A generator body: requests sends it with Transfer-Encoding: chunked."""
    for start in range(0, len(body), size):
        yield body[start:start + size]


def test_a_chunked_request_body_is_read_to_its_last_chunk(
    upstreams: Callable[[str], FakeUpstream], router_factory: Callable[..., RouterProcess]
) -> None:
    """A body without Content-Length, in chunks (Go's and Node's clients with a streamed
    body), is routed like a sized one; beyond server.max_body_bytes it is a 413; a malformed
    or truncated chunk is a 400 and that connection is closed."""
    up = upstreams("up")
    router = router_factory({"backends": [{"name": "up", "url": up.url, "models": ["m"]}],
                             "server": {"max_body_bytes": 65536},
                             "health_check": {"enabled": False}})
    body = json.dumps({"model": "m", "messages": [
        {"role": "user", "content": "chunked " + "y" * 3000}]}).encode()
    resp = requests.post(router.url + "/v1/chat/completions", data=_pieces(body, 1000),
                         headers={"Content-Type": "application/json"}, timeout=10)
    assert resp.status_code == 200, resp.text
    assert resp.json()["choices"][0]["message"]["content"] == "hello from up"
    stats = up.stats()
    assert stats["requests"] == 1
    assert stats["last_body"]["messages"][0]["content"] == "chunked " + "y" * 3000
    too_big = requests.post(router.url + "/v1/chat/completions",
                            data=_pieces(b"z" * 70000, 10000),
                            headers={"Content-Type": "application/json"}, timeout=10)
    assert too_big.status_code == 413, too_big.text
    assert too_big.json()["error"]["code"] == "request_too_large"
    head = (b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\n"
            b"Content-Type: application/json\r\nTransfer-Encoding: chunked\r\n\r\n")
    for tail, why in ((b"zz\r\n", "Invalid chunk size"),
                      (b"5\r\n{\"mod\r\n", "ended before its last chunk")):
        with socket.create_connection(("127.0.0.1", router.port), timeout=10) as sock:
            sock.sendall(head + tail)
            if why.startswith("ended"):
                sock.shutdown(socket.SHUT_WR)
            answer = b""
            while chunk := sock.recv(65536):  # the router closes the connection
                answer += chunk
        line, _, doc = _split(answer)
        assert line.startswith(b"HTTP/1.1 400"), doc
        assert doc["error"]["code"] == "invalid_chunked_body" and why in \
            doc["error"]["message"], doc
    assert up.stats()["requests"] == 1  # nothing refused reached the upstream
    assert requests.get(router.url + "/health", timeout=5).status_code == 200
