"""Client disconnects are no verdict on the backend (router under real gunicorn -k gevent).

Clients that give up mid-request or mid-stream used to be recorded as backend failures
(status 499), which lowered the backend's success rate, and with it the KV scorer's health
term, for something the backend did not do. A real upstream failure must still count.
"""

from __future__ import annotations

import json
import socket
from collections.abc import Callable
from typing import Any

import pytest
import requests

from continuum.devtools.fleet import metric_sum
from continuum.devtools.procs import wait_until
from continuum.devtools.servers import FakeUpstream, RouterProcess

pytestmark = pytest.mark.e2e

MSG = [{"role": "user", "content": "hi"}]
STREAM_ABORTS = 30
REQUEST_ABORTS = 5
BROKEN_STREAMS = 3


def _post_raw(router: RouterProcess, body: dict[str, Any]) -> socket.socket:
    """Send a chat request on a raw socket (so the test decides when the client leaves)."""
    data = json.dumps(body).encode()
    sock = socket.create_connection(("127.0.0.1", router.port), timeout=10)
    sock.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: "
                 b"application/json\r\nContent-Length: %d\r\n\r\n" % len(data) + data)
    return sock


def _backend(router: RouterProcess, name: str) -> dict[str, Any]:
    rows = requests.get(router.url + "/admin/backends", timeout=5).json()["backends"]
    return next(row for row in rows if row["name"] == name)  # type: ignore[no-any-return]


def _count(router: RouterProcess, status: str) -> float:
    return metric_sum(router.metrics(), "continuum_upstream_attempts_total", backend="a",
                      status=status)


def test_disconnects_leave_backend_health_alone_but_upstream_failures_count(
    upstreams: Callable[[str], FakeUpstream], router_factory: Callable[..., RouterProcess]
) -> None:
    a = upstreams("a")
    router = router_factory({
        "backends": [{"name": "a", "url": a.url, "models": ["m"]}],
        "health_check": {"interval_seconds": 0.2, "unhealthy_threshold": 1,
                         "healthy_threshold": 1},
    })

    # Mid-request: the client leaves while the backend is still working on a plain answer.
    # The backend does answer, so these are real successes with real latencies.
    for _ in range(REQUEST_ABORTS):
        _post_raw(router, {"model": "m", "messages": MSG, "x_test": {"hang": 0.2}}).close()
    wait_until(lambda: _count(router, "200") == REQUEST_ABORTS,
               "the abandoned requests to finish upstream")
    before = _backend(router, "a")
    assert before["success_rate"] == 1.0 and before["latency_ewma_ms"] is not None

    # Mid-stream: the client reads the first event and leaves.
    for _ in range(STREAM_ABORTS):
        sock = _post_raw(router, {"model": "m", "messages": MSG, "stream": True,
                                  "x_test": {"chunks": 200, "delay": 0.02}})
        received = b""
        while b"data:" not in received:
            chunk = sock.recv(4096)
            assert chunk, "router closed the stream before the first event"
            received += chunk
        sock.close()
    wait_until(lambda: _count(router, "499") == STREAM_ABORTS,
               "the router to notice every disconnect")
    wait_until(lambda: _backend(router, "a")["in_flight"] == 0, "in-flight to drop to 0")
    wait_until(lambda: a.stats()["streams_aborted"] == STREAM_ABORTS,  # closed upstream too
               "the upstream to see the streams go")

    after = _backend(router, "a")
    assert after["success_rate"] == 1.0
    assert after["healthy"] is True
    assert after["latency_ewma_ms"] == before["latency_ewma_ms"]  # no truncated sample
    assert metric_sum(router.metrics(), "continuum_backend_health_transitions_total",
                      backend="a") == 0

    # A real upstream failure (the backend drops the stream midway) still counts.
    for _ in range(BROKEN_STREAMS):
        resp = requests.post(router.url + "/v1/chat/completions", timeout=10, json={
            "model": "m", "messages": MSG, "stream": True,
            "x_test": {"chunks": 5, "break_after": 1}})
        assert b"broke" in resp.content
    wait_until(lambda: _count(router, "502") == BROKEN_STREAMS,
               "the broken streams to be recorded")
    rate = _backend(router, "a")["success_rate"]
    assert rate == round(REQUEST_ABORTS / (REQUEST_ABORTS + BROKEN_STREAMS), 4)
