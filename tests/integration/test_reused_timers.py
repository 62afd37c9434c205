"""Timeouts that the worker and the upstream client arm again and again, under real gunicorn.

Each connection reuses its timers (one for the request header, one for the wait on the
upstream) instead of making new ones per request. A libev timer that is stopped and started
again keeps only what was left of it, so the waits of one kept-alive connection used to add
up: a client whose every header took most of ``client_header_timeout_seconds`` got a 408 on
its second request, and a pooled upstream connection (or a stream with gaps between its
chunks) timed out once its waits together passed the backend's ``request_timeout_ms``.
The keep-alive wait between two requests reuses a timer too (gunicorn's ``keepalive``), so
a connection whose idle gaps together passed it was closed while the client still used it.
Every wait must get the whole timeout again.
"""

from __future__ import annotations

import json
import socket
import time
from typing import Any

import pytest
import requests

from tests.integration.test_slow_clients import Responses

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

# Each wait below takes at most 0.4 of its timeout (so a busy machine's stall of a second
# or so does not end it), and the waits of one connection add up to well over it.
HEADER_TIMEOUT = 2  # seconds: client_header_timeout_seconds
READ_TIMEOUT_MS = 1500  # the backend's request_timeout_ms


def _config(upstream: Any) -> dict[str, Any]:
    return {
        "backends": [{"name": upstream.name, "url": upstream.url, "models": ["m"],
                      "request_timeout_ms": READ_TIMEOUT_MS}],
        "server": {"client_header_timeout_seconds": HEADER_TIMEOUT},
    }


def _chat(**x_test: Any) -> dict[str, Any]:
    return {"model": "m", "messages": [{"role": "user", "content": "hi"}], "x_test": x_test}


def test_every_request_on_a_kept_alive_connection_gets_the_whole_header_timeout(
    upstreams: Any, router_factory: Any
) -> None:
    router = router_factory(_config(upstreams("a")))
    head = b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\n"
    with socket.create_connection(("127.0.0.1", router.port), timeout=10) as sock:
        responses = Responses(sock)
        for _ in range(4):  # 3.2 s of header time in all, against a 2 s timeout
            sock.sendall(head)
            time.sleep(HEADER_TIMEOUT * 0.4)
            sock.sendall(b"\r\n")
            answer = responses.next()
            assert answer.startswith(b"HTTP/1.1 200 "), answer


def test_every_idle_gap_on_a_kept_alive_connection_gets_the_whole_keepalive(
    upstreams: Any, router_factory: Any
) -> None:
    keepalive = 2  # seconds (gunicorn's --keep-alive)
    router = router_factory(_config(upstreams("a")),
                            env={"GUNICORN_CMD_ARGS": f"--keep-alive {keepalive}"})
    request = b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n"
    with socket.create_connection(("127.0.0.1", router.port), timeout=10) as sock:
        responses = Responses(sock)
        for _ in range(5):  # 4 s of idle gaps in all, against a 2 s keep-alive
            sock.sendall(request)
            answer = responses.next()
            assert answer.startswith(b"HTTP/1.1 200 "), answer
            time.sleep(keepalive * 0.4)
        # and an idle connection is still closed after the keep-alive
        time.sleep(keepalive * 2)
        assert sock.recv(1) == b""


def test_waits_on_a_pooled_upstream_connection_do_not_add_up(
    upstreams: Any, router_factory: Any
) -> None:
    up = upstreams("a")
    router = router_factory(_config(up))
    with requests.Session() as http:
        for _ in range(5):  # 3 s of waiting on one pooled connection, timeout 1.5 s
            resp = http.post(router.url + "/v1/chat/completions", json=_chat(hang=0.6),
                             timeout=10)
            assert resp.status_code == 200, resp.text
            assert resp.json()["choices"][0]["message"]["content"] == "hello from a"


def test_a_stream_may_last_longer_than_the_read_timeout_in_small_gaps(
    upstreams: Any, router_factory: Any
) -> None:
    router = router_factory(_config(upstreams("a")))
    body = {**_chat(chunks=12, delay=0.3), "stream": True}  # 3.6 s in 0.3 s gaps
    with requests.post(router.url + "/v1/chat/completions", json=body, stream=True,
                       timeout=10) as resp:
        assert resp.status_code == 200
        records = [line for line in resp.iter_lines() if line.startswith(b"data: ")]
    assert records[-1] == b"data: [DONE]", records[-2:]
    contents = [json.loads(r[6:])["choices"][0]["delta"].get("content")
                for r in records[:-1]]
    assert contents == [f"t{i} " for i in range(12)]
