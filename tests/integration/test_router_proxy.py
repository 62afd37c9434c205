"""The router under real gunicorn -k gevent, driven by the official openai SDK."""

from __future__ import annotations

import itertools
import json
import socket
import time

import openai
import pytest
import requests

from continuum.devtools.fleet import metric_sum
from continuum.devtools.procs import refused_port, wait_until

pytestmark = pytest.mark.e2e

MSG = [{"role": "user", "content": "hi"}]


def _config(*ups, **extra):  # type: ignore[no-untyped-def]
    cfg = {"backends": [{"name": u.name, "url": u.url, "models": ["m"]} for u in ups],
           "health_check": {"interval_seconds": 0.2, "unhealthy_threshold": 1,
                            "healthy_threshold": 1}}
    cfg.update(extra)
    return cfg


_CLIENTS: list[openai.OpenAI] = []


def _client(router, **kw) -> openai.OpenAI:  # type: ignore[no-untyped-def]
    client = openai.OpenAI(base_url=router.url + "/v1", api_key="sk-client", max_retries=0, **kw)
    _CLIENTS.append(client)
    return client


@pytest.fixture(autouse=True)
def _close_clients():  # type: ignore[no-untyped-def]
    yield
    while _CLIENTS:
        _CLIENTS.pop().close()


def test_chat_stream_models_and_key_replacement(upstreams, router_factory) -> None:
    a = upstreams("a")
    cfg = _config(a)
    cfg["backends"][0]["api_key"] = "sk-upstream"
    router = router_factory(cfg)
    client = _client(router)

    reply = client.chat.completions.create(model="m", messages=MSG)
    assert reply.choices[0].message.content == "hello from a"
    seen = a.stats()["last_headers"]
    assert seen["AUTHORIZATION"] == "Bearer sk-upstream"  # the client's key never leaves

    stream = client.chat.completions.create(model="m", messages=MSG, stream=True)
    text = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
    assert text == "t0 t1 t2 "

    assert [m.id for m in client.models.list()] == ["m"]
    completion = client.completions.create(model="m", prompt="x")
    assert completion.choices[0].text == "hello from a"
    emb = client.embeddings.create(model="m", input="x")
    assert emb.data[0].embedding == [0.1, 0.2]


def test_stream_chunks_arrive_as_upstream_sends_them(upstreams, router_factory) -> None:
    a = upstreams("a")
    router = router_factory(_config(a))
    client = _client(router)
    stream = client.chat.completions.create(
        model="m", messages=MSG, stream=True,
        extra_body={"x_test": {"chunks": 4, "delay": 0.4}},
    )
    arrivals = []
    for chunk in stream:
        if chunk.choices and chunk.choices[0].delta.content:
            arrivals.append(time.monotonic())
    assert len(arrivals) == 4
    gaps = [b - a for a, b in itertools.pairwise(arrivals)]
    # Buffering would deliver everything at once at the end (gaps near 0).
    assert all(gap > 0.25 for gap in gaps), gaps


def test_error_classes(upstreams, router_factory) -> None:
    a = upstreams("a")
    cfg = _config(a, server={"max_body_bytes": 2048})
    cfg["backends"][0]["request_timeout_ms"] = 500
    router = router_factory(cfg)
    client = _client(router)

    with pytest.raises(openai.BadRequestError):
        client.chat.completions.create(model="", messages=MSG)
    resp = requests.post(router.url + "/v1/chat/completions", data=b"{not json", timeout=5)
    assert resp.status_code == 400
    assert resp.json()["error"]["type"] == "invalid_request_error"

    with pytest.raises(openai.NotFoundError) as nf:
        client.chat.completions.create(model="nope", messages=MSG)
    assert nf.value.body["code"] == "model_not_found"

    big = [{"role": "user", "content": "x" * 5000}]
    with pytest.raises(openai.APIStatusError) as too_big:
        client.chat.completions.create(model="m", messages=big)
    assert too_big.value.status_code == 413

    with pytest.raises(openai.RateLimitError) as limited:
        client.chat.completions.create(model="m", messages=MSG,
                                       extra_body={"x_test": {"status": 429}})
    assert "scripted 429" in str(limited.value)

    with pytest.raises(openai.APIStatusError) as timed_out:
        client.chat.completions.create(model="m", messages=MSG,
                                       extra_body={"x_test": {"hang": 2}})
    assert timed_out.value.status_code == 504

    with pytest.raises(openai.APIError):
        stream = client.chat.completions.create(
            model="m", messages=MSG, stream=True,
            extra_body={"x_test": {"chunks": 5, "break_after": 2}})
        for _ in stream:
            pass


def test_connect_failure_retries_then_502(upstreams, router_factory) -> None:
    a = upstreams("a")
    dead = f"http://127.0.0.1:{refused_port()}"
    cfg = {"backends": [{"name": "dead", "url": dead, "models": ["m"]},
                        {"name": "a", "url": a.url, "models": ["m"]}],
           "health_check": {"enabled": False}, "pool": {"retry_connect_errors": True}}
    router = router_factory(cfg)
    client = _client(router)
    for _ in range(6):  # round robin hits "dead" half the time; every call must succeed
        assert client.chat.completions.create(model="m", messages=MSG).choices
    assert metric_sum(router.metrics(), "continuum_upstream_retries_total", backend="dead") >= 1

    only_dead = router_factory({"backends": [{"name": "dead", "url": dead, "models": ["m"]}],
                                "health_check": {"enabled": False}})
    with pytest.raises(openai.APIStatusError) as bad_gateway:
        _client(only_dead).chat.completions.create(model="m", messages=MSG)
    assert bad_gateway.value.status_code == 502


def test_no_healthy_backend_is_503(upstreams, router_factory) -> None:
    a = upstreams("a")
    router = router_factory(_config(a))
    requests.get(a.url + "/_test/sick", timeout=5)
    wait_until(lambda: requests.get(router.url + "/health", timeout=5).status_code == 503,
               "the router to see no healthy backend", 10, interval=0.1)
    with pytest.raises(openai.InternalServerError) as unavailable:
        _client(router).chat.completions.create(model="m", messages=MSG)
    assert unavailable.value.status_code == 503
    assert unavailable.value.body["code"] == "no_healthy_backend"
    # when to try again: after the next health check (0.2 s here, in whole seconds)
    assert unavailable.value.response.headers["retry-after"] == "1"


def test_client_disconnect_closes_upstream_and_releases_in_flight(
    upstreams, router_factory
) -> None:
    a = upstreams("a")
    router = router_factory(_config(a))
    body = json.dumps({"model": "m", "messages": MSG, "stream": True,
                       "x_test": {"chunks": 200, "delay": 0.05}}).encode()
    sock = socket.create_connection(("127.0.0.1", router.port))
    sock.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: "
                 b"application/json\r\nContent-Length: %d\r\n\r\n" % len(body) + body)
    received = b""
    while received.count(b"data:") < 3:
        received += sock.recv(4096)
    assert metric_sum(router.metrics(), "continuum_backend_in_flight", backend="a") == 1
    sock.close()
    wait_until(lambda: a.stats()["streams_aborted"] >= 1, "the upstream stream to be aborted",
               10)
    stats = a.stats()
    assert stats["streams_aborted"] == 1 and stats["streams_finished"] == 0
    wait_until(lambda: metric_sum(router.metrics(), "continuum_backend_in_flight",
                                  backend="a") == 0, "in-flight to drop to 0", 5)


def test_health_checks_move_traffic_and_bring_backend_back(upstreams, router_factory) -> None:
    a, b = upstreams("a"), upstreams("b")
    router = router_factory(_config(a, b))
    client = _client(router)

    admin = router.url + "/admin/backends"

    def health() -> dict[str, bool]:
        return {x["name"]: x["healthy"] for x in requests.get(admin, timeout=5).json()["backends"]}

    requests.get(a.url + "/_test/sick", timeout=5)
    wait_until(lambda: not health()["a"], "a to be marked unhealthy", 10, interval=0.1)
    assert health() == {"a": False, "b": True}
    before = a.stats()["requests"]
    for _ in range(8):
        assert client.chat.completions.create(model="m", messages=MSG).choices[0].message.content \
            == "hello from b"
    assert a.stats()["requests"] == before

    requests.get(a.url + "/_test/well", timeout=5)
    wait_until(lambda: all(health().values()), "a to be healthy again", 10, interval=0.1)
    answers = {client.chat.completions.create(model="m", messages=MSG).choices[0].message.content
               for _ in range(6)}
    assert answers == {"hello from a", "hello from b"}


def test_metrics_aggregate_two_workers(upstreams, router_factory) -> None:
    a = upstreams("a")
    router = router_factory(_config(a), workers=2)
    import concurrent.futures

    # The router answered its first /health from one worker; the other may still be
    # booting: both serve the burst below only once both are up.
    wait_until(lambda: metric_sum(router.metrics(), "continuum_workers") == 2,
               "both workers to boot", 30)

    body = {"model": "m", "messages": MSG, "x_test": {"hang": 0.2}}

    def call(_: int) -> int:
        return requests.post(router.url + "/v1/chat/completions", json=body, timeout=10).status_code

    with concurrent.futures.ThreadPoolExecutor(16) as pool:
        statuses = list(pool.map(call, range(48)))
    assert statuses == [200] * 48
    text = router.metrics()
    # Both workers' samples are in one answer: each request once, each attempt once.
    assert metric_sum(text, "continuum_requests_total", endpoint="chat", status_class="2xx",
                      outcome="upstream") == 48
    assert metric_sum(text, "continuum_upstream_attempts_total", backend="a",
                      status="200") == 48
    assert metric_sum(text, "continuum_workers") == 2
    assert "pid=" not in text
    # One access-log line per request, written by the worker that served it (from the
    # hub, after the answer went out: the last lines may land a moment after it).
    def access_lines() -> list[str]:
        return [line for line in router.proc.log_text().splitlines()
                if " continuum.access: " in line]

    wait_until(lambda: len(access_lines()) >= 48,
               lambda: f"48 access-log lines (seen {len(access_lines())})", 20)
    lines = access_lines()
    assert len(lines) == 48
    assert len({line.split("request_id=")[1].split()[0] for line in lines}) == 48
