"""Operating the fleet under real gunicorn -k gevent with 2 workers: backends a reload adds
start unprobed and take no request until a health check passes; drain and undrain take a
backend out of rotation in every worker while its requests in flight finish. Upstreams are
real HTTP servers on 127.0.0.1; the official openai SDK is the client.
"""

from __future__ import annotations

import http.client
import json
import socket
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import openai
import pytest
import redis
import requests
import yaml

from continuum.devtools.fleet import metric_sum
from continuum.devtools.procs import refused_port, wait_until
from continuum.devtools.redis_server import unique_prefix
from continuum.devtools.servers import FakeUpstream, RouterProcess

pytestmark = pytest.mark.e2e

MESSAGES = [{"role": "user", "content": "hi"}]


@pytest.fixture
def ups(tmp_path: Path) -> Iterator[Callable[[str], FakeUpstream]]:
    started: list[FakeUpstream] = []

    def make(name: str) -> FakeUpstream:
        started.append(FakeUpstream(name, tmp_path))
        return started[-1]

    yield make
    for up in started:
        up.stop()


def _client(router: RouterProcess) -> openai.OpenAI:
    """An SDK client of ``router`` (closed at the test's end: tests/integration/conftest.py)."""
    return openai.OpenAI(base_url=router.url + "/v1", api_key="x", max_retries=0)


def _config(*backends: dict[str, Any], timeout_ms: int = 1500) -> dict[str, Any]:
    return {"backends": list(backends), "selection_strategy": "RoundRobin",
            "admin": {"allow_unauthenticated": True},
            "health_check": {"interval_seconds": 0.5, "timeout_ms": timeout_ms,
                             "unhealthy_threshold": 1, "healthy_threshold": 1}}


def _views(router: RouterProcess, rounds: int = 30) -> dict[int, dict[str, dict[str, Any]]]:
    """``/admin/backends`` per worker pid (several calls, to reach both workers; the kernel
    may still hand them all to one worker: a wait on every worker's view checks
    :func:`_every` of them)."""
    seen: dict[int, dict[str, dict[str, Any]]] = {}
    for _ in range(rounds):
        doc = requests.get(router.url + "/admin/backends", timeout=5,
                           headers={"Connection": "close"}).json()
        seen[doc["worker_pid"]] = {row["name"]: row for row in doc["backends"]}
    return seen


def _every(views: dict[int, dict[str, dict[str, Any]]], check: Callable[[Any], bool],
           workers: int = 2) -> bool:
    """``check`` holds for the view of each of the ``workers`` workers (all of them seen)."""
    return len(views) == workers and all(check(view) for view in views.values())


def _view_of(router: RouterProcess, pid: int, within: float) -> dict[str, dict[str, Any]]:
    """``/admin/backends`` as worker ``pid`` answers it, asked on fresh connections until
    that worker takes one (the kernel may hand a busy machine's connections to the other
    worker many times in a row) or ``within`` seconds pass."""
    deadline = time.monotonic() + within
    while True:
        doc = requests.get(router.url + "/admin/backends", timeout=5,
                           headers={"Connection": "close"}).json()
        if doc["worker_pid"] == pid:
            return {row["name"]: row for row in doc["backends"]}
        assert time.monotonic() < deadline, f"worker {pid} took no connection in {within} s"


def _state(view: dict[str, dict[str, Any]], name: str) -> str | None:
    row = view.get(name)
    return None if row is None else row["state"]  # type: ignore[no-any-return]


def _reload(router: RouterProcess, cfg: dict[str, Any]) -> dict[str, Any]:
    doc = dict(cfg)
    doc["server"] = {"bind": f"127.0.0.1:{router.port}", "workers": 2}
    router.config_path.write_text(yaml.safe_dump(doc))
    resp = requests.post(router.url + "/admin/config/reload", timeout=10)
    assert resp.status_code == 200, resp.text
    return resp.json()  # type: ignore[no-any-return]


def _backends_of(client: openai.OpenAI, n: int, **extra: Any) -> list[str]:
    names = []
    for _ in range(n):
        raw = client.chat.completions.with_raw_response.create(
            model="m", messages=MESSAGES, **extra)  # type: ignore[arg-type]
        names.append(raw.headers["x-continuum-backend"])
    return names


def _window_requests(router: RouterProcess, n: int) -> list[tuple[str | None, int]]:
    """(backend, status) of ``n`` requests on fresh connections, 50 ms apart (so both
    workers answer some, and the window covers a worker's config watcher)."""
    seen = []
    for _ in range(n):
        resp = requests.post(router.url + "/v1/chat/completions", timeout=15,
                             json={"model": "m", "messages": MESSAGES},
                             headers={"Connection": "close"})
        seen.append((resp.headers.get("x-continuum-backend"), resp.status_code))
        time.sleep(0.05)
    return seen


@pytest.fixture
def dead_port() -> int:
    """A port that refuses connections and that no other process can take meanwhile
    (:func:`~continuum.devtools.procs.refused_port`)."""
    return refused_port()


@pytest.fixture
def silent_port() -> Iterator[int]:
    """A port that accepts connections and never answers: a probe there waits out its
    timeout, so the backend stays unprobed that long."""
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    sock.listen(64)
    yield sock.getsockname()[1]
    sock.close()


def test_backends_a_reload_adds_are_unprobed_until_a_check_passes(
        tmp_path: Path, ups: Callable[[str], FakeUpstream], silent_port: int,
        dead_port: int) -> None:
    a = ups("a")
    # The silent backend's probe waits out this timeout: it stays unprobed that long.
    probe_timeout_ms = 10000
    base = _config({"name": "a", "url": a.url, "models": ["m"]}, timeout_ms=probe_timeout_ms)
    router = RouterProcess(base, tmp_path, workers=2)
    try:
        client = _client(router)
        dead = f"http://127.0.0.1:{dead_port}"
        silent = f"http://127.0.0.1:{silent_port}"
        report = _reload(router, _config(
            {"name": "a", "url": a.url, "models": ["m"]},
            {"name": "dead", "url": dead, "models": ["m"]},
            # were a request sent there, it would fail in 5 s instead of hanging the test
            {"name": "silent", "url": silent, "models": ["m"], "request_timeout_ms": 5000},
            timeout_ms=probe_timeout_ms))
        assert report["applied"] == ["backends.dead", "backends.silent"]
        assert "backends" not in report["restart_required"]
        # The receiving worker: the silent one's first probe is still waiting.
        by_name = _view_of(router, report["worker_pid"], within=probe_timeout_ms / 2000)
        assert (by_name["silent"]["state"], by_name["silent"]["healthy"]) == ("unprobed", False)
        assert by_name["dead"]["healthy"] is False
        assert by_name["dead"]["state"] in ("unprobed", "unhealthy")
        # Meanwhile no request reaches them, in either worker (new connections spread over
        # both; the other worker may even boot with the new file: then it has not probed
        # any backend yet either).
        assert _window_requests(router, 40) == [("a", 200)] * 40
        # Then every worker has probed them: unhealthy, still never routed.
        # (the other worker reloads from its watcher: until then it has no such rows)
        wait_until(lambda: _every(_views(router), lambda v: (
            _state(v, "dead") == _state(v, "silent") == "unhealthy")),
            lambda: f"both workers probe the new backends: {_views(router)}", timeout=40)
        assert set(_backends_of(client, 12)) == {"a"}
        text = router.metrics()
        for name in ("dead", "silent"):
            assert metric_sum(text, "continuum_upstream_attempts_total", backend=name) == 0
            assert metric_sum(text, "continuum_backend_healthy", backend=name) == 0
    finally:
        router.stop()


def test_a_starting_worker_routes_nothing_to_a_backend_before_its_first_probe(
        tmp_path: Path, ups: Callable[[str], FakeUpstream], silent_port: int) -> None:
    """A worker that boots (or reboots) trusts no backend before probing it: the silent one
    (its probe waits 4 s) takes no request, the live one takes them all from the first."""
    a = ups("a")
    silent = f"http://127.0.0.1:{silent_port}"
    router = RouterProcess(_config({"name": "a", "url": a.url, "models": ["m"]},
                                   {"name": "silent", "url": silent, "models": ["m"],
                                    "request_timeout_ms": 5000}, timeout_ms=4000),
                           tmp_path, workers=2)
    try:
        views = _views(router, 10)
        assert all(_state(v, "silent") == "unprobed" for v in views.values()), views
        assert _window_requests(router, 30) == [("a", 200)] * 30
        text = router.metrics()
        assert metric_sum(text, "continuum_upstream_attempts_total", backend="silent") == 0
        assert metric_sum(text, "continuum_backend_healthy", backend="silent") == 0
    finally:
        router.stop()


def test_a_reloaded_live_backend_takes_traffic_once_probed(
        tmp_path: Path, ups: Callable[[str], FakeUpstream]) -> None:
    a, b = ups("a"), ups("b")
    router = RouterProcess(_config({"name": "a", "url": a.url, "models": ["m"]}), tmp_path,
                           workers=2)
    try:
        _reload(router, _config({"name": "a", "url": a.url, "models": ["m"]},
                                {"name": "b", "url": b.url, "models": ["m"]}))
        wait_until(lambda: _every(_views(router), lambda v: _state(v, "b") == "healthy"),
            lambda: f"both workers probe b: {_views(router)}", timeout=60)
        client = _client(router)
        assert "b" in _backends_of(client, 8)
    finally:
        router.stop()


def test_drain_stops_new_requests_in_every_worker_and_lets_in_flight_ones_finish(
        tmp_path: Path, ups: Callable[[str], FakeUpstream]) -> None:
    a, b = ups("a"), ups("b")
    router = RouterProcess(_config({"name": "a", "url": a.url, "models": ["m"]},
                                   {"name": "b", "url": b.url, "models": ["m"]},
                                   {"name": "off", "url": a.url, "models": ["m"],
                                    "enabled": False}),
                           tmp_path, workers=2)
    try:
        client = _client(router)
        # A slow stream in flight on one backend...
        slow = client.chat.completions.with_raw_response.create(
            model="m", messages=MESSAGES, stream=True,
            extra_body={"x_test": {"chunks": 12, "delay": 0.15}})
        held = slow.headers["x-continuum-backend"]
        other = "b" if held == "a" else "a"
        chunks = iter(slow.parse())
        first = next(chunks)
        # ...then that backend is drained.
        resp = requests.post(f"{router.url}/admin/backends/{held}/drain", timeout=5)
        assert resp.status_code == 200, resp.text
        assert resp.json()["draining"] is True
        wait_until(lambda: _every(_views(router), lambda v: v[held]["draining"]),
                   "every worker drains", timeout=30)
        assert set(_backends_of(client, 16)) == {other}
        text = router.metrics()
        assert metric_sum(text, "continuum_backend_draining", backend=held) == 1
        assert metric_sum(text, "continuum_backend_draining", backend=other) == 0
        # The stream that was in flight finishes whole.
        rest = list(chunks)
        assert first is not None and len([c for c in [first, *rest] if c.choices]) >= 12
        wait_until(lambda: metric_sum(router.metrics(), "continuum_backend_in_flight",
                                      backend=held) == 0, "the drained backend idles")
        # Undrain: back in rotation everywhere.
        resp = requests.post(f"{router.url}/admin/backends/{held}/undrain", timeout=5)
        assert resp.status_code == 200 and resp.json()["draining"] is False
        wait_until(lambda: _every(_views(router), lambda v: not v[held]["draining"]),
                   "every worker undrains", timeout=30)
        assert held in _backends_of(client, 8)
        assert metric_sum(router.metrics(), "continuum_backend_draining", backend=held) == 0
        # Errors: an unknown backend is 404, one that takes no traffic 409.
        missing = requests.post(f"{router.url}/admin/backends/nope/drain", timeout=5)
        assert missing.status_code == 404
        assert missing.json()["error"]["code"] == "backend_not_found"
        off = requests.post(f"{router.url}/admin/backends/off/drain", timeout=5)
        assert off.status_code == 409
        assert off.json()["error"]["code"] == "backend_not_routable"
    finally:
        router.stop()


class _WorkerConn:
    """One kept-alive connection, hence one gunicorn worker."""

    def __init__(self, router: RouterProcess) -> None:
        self.http = http.client.HTTPConnection("127.0.0.1", router.port, timeout=10)
        self.http.request("GET", "/admin/backends")
        self.pid = json.loads(self.http.getresponse().read())["worker_pid"]

    def backend(self) -> str:
        self.http.request("POST", "/v1/chat/completions",
                          body=json.dumps({"model": "m", "messages": MESSAGES}),
                          headers={"Content-Type": "application/json"})
        resp = self.http.getresponse()
        resp.read()
        assert resp.status == 200
        return resp.getheader("X-Continuum-Backend") or ""


def _a_conn_per_worker(router: RouterProcess, workers: int) -> list[_WorkerConn]:
    found: dict[int, _WorkerConn] = {}
    deadline = time.monotonic() + 30  # a busy machine may boot a worker late
    while time.monotonic() < deadline:
        conn = _WorkerConn(router)
        if conn.pid in found:
            conn.http.close()
        else:
            found[conn.pid] = conn
        if len(found) == workers:
            return list(found.values())
        time.sleep(0.05)
    raise AssertionError(f"reached only workers {sorted(found)}")


def test_once_a_drain_answers_no_worker_sends_the_backend_a_new_request(
        tmp_path: Path, ups: Callable[[str], FakeUpstream]) -> None:
    """The drain reaches every worker of the host before the reply (the fleet bus), not
    within the drain file's poll: requests sent right after it, through either worker,
    all go to the other backend; the undrain is as immediate."""
    a, b = ups("a"), ups("b")
    router = RouterProcess(_config({"name": "a", "url": a.url, "models": ["m"]},
                                   {"name": "b", "url": b.url, "models": ["m"]}),
                           tmp_path, workers=2)
    conns: list[_WorkerConn] = []
    try:
        conns = _a_conn_per_worker(router, 2)
        assert {c.backend() for c in conns for _ in range(2)} == {"a", "b"}
        resp = requests.post(f"{router.url}/admin/backends/a/drain", timeout=5)
        assert resp.status_code == 200
        assert resp.json()["fleet"]["workers_applied"] == 2, resp.json()
        assert [c.backend() for c in conns for _ in range(4)] == ["b"] * 8
        resp = requests.post(f"{router.url}/admin/backends/a/undrain", timeout=5)
        assert resp.status_code == 200 and resp.json()["draining"] is False
        assert "a" in {c.backend() for c in conns for _ in range(2)}
    finally:
        for conn in conns:
            conn.http.close()
        router.stop()


def test_a_drain_reaches_the_other_routers_sharing_redis(
        tmp_path: Path, ups: Callable[[str], FakeUpstream], redis_server: Any) -> None:
    """Routers joined by fleet.use_redis drain together: the other router routes nothing
    new to the backend once the first one answers, and undrains with it."""
    a, b = ups("a"), ups("b")
    config = {**_config({"name": "a", "url": a.url, "models": ["m"]},
                        {"name": "b", "url": b.url, "models": ["m"]}),
              "fleet": {"use_redis": True},
              "response_cache": {"enabled": False, "redis": {
                  "url": redis_server.url, "key_prefix": unique_prefix("drain")}}}
    first, second = RouterProcess(config, tmp_path), RouterProcess(config, tmp_path)
    try:
        members = config["response_cache"]["redis"]["key_prefix"].rstrip(":") + ".fleet:members"
        with redis.Redis.from_url(redis_server.url) as client:
            wait_until(lambda: client.zcard(members) == 2, "2 fleet members", 15)
        resp = requests.post(f"{first.url}/admin/backends/a/drain", timeout=5)
        assert resp.status_code == 200 and resp.json()["fleet"]["routers_applied"] == 2
        view = requests.get(second.url + "/admin/backends", timeout=5).json()
        assert {row["name"]: row["draining"] for row in view["backends"]} == \
            {"a": True, "b": False}
        conn = _WorkerConn(second)
        assert [conn.backend() for _ in range(4)] == ["b"] * 4
        conn.http.close()
        assert requests.post(f"{first.url}/admin/backends/a/undrain",
                             timeout=5).status_code == 200
        view = requests.get(second.url + "/admin/backends", timeout=5).json()
        assert not any(row["draining"] for row in view["backends"])
    finally:
        first.stop()
        second.stop()
