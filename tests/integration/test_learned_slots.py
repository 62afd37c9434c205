"""Slots learned from a real simulated engine's /metrics by the health probes
(``backends[].learn_slots``), shared with the host's other workers through the prober's
file; and a backend without an engine's gauges keeps none."""

from __future__ import annotations

import logging
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import requests

from continuum.config import BackendConfig, HealthCheckConfig
from continuum.devtools.fleet import MODEL, start_engines
from continuum.devtools.procs import Children, wait_until
from continuum.routing.backends import Backend, BackendPool
from continuum.routing.health import HealthMonitor
from continuum.routing.shared_health import SharedProbes

CONFIG = HealthCheckConfig(interval_seconds=60, timeout_ms=2000)
SLOTS = 3
TOKENS = 500


def _monitor(directory: Path, url: str) -> HealthMonitor:
    pool = BackendPool([Backend(BackendConfig(name="e", url=url, models=(MODEL,),
                                              learn_slots=True))])
    return HealthMonitor(pool, CONFIG, shared=SharedProbes(directory))


@pytest.fixture
def engine(tmp_path: Path) -> Iterator[str]:
    children = Children(tmp_path)
    try:
        _proc, urls = start_engines(children, "sim", 1, blocks=4096, slots=SLOTS, scale=0.5)
        yield urls[0]
    finally:
        children.stop_all()


class _Streams:
    """``count`` streaming completions of :data:`TOKENS` tokens each against ``url``, each
    read to its end in a thread (about 3 s apiece at the engine's speed here)."""

    def __init__(self, url: str, count: int) -> None:
        body = {"model": MODEL, "prompt": "Count slowly to a thousand. " * 4,
                "max_tokens": TOKENS, "ignore_eos": True, "stream": True}
        self.tokens: list[int] = []
        self.threads = [threading.Thread(target=self._read, args=(url, body), daemon=True)
                        for _ in range(count)]
        for thread in self.threads:
            thread.start()

    def _read(self, url: str, body: dict[str, Any]) -> None:
        with requests.post(url + "/v1/completions", json=body, stream=True,
                           timeout=60) as resp:
            self.tokens.append(sum(1 for line in resp.iter_lines()
                                   if line.startswith(b"data: {")))

    def join(self) -> list[int]:
        for thread in self.threads:
            thread.join(60)
        return self.tokens


def _queue(url: str) -> tuple[int, int]:
    stats = requests.get(url + "/sim/stats", timeout=5).json()
    return stats["running"], stats["waiting"]


def test_the_prober_learns_the_engines_slots_and_the_other_workers_take_them(
        engine: str, tmp_path: Path) -> None:
    holder, follower = _monitor(tmp_path, engine), _monitor(tmp_path, engine)
    mine, theirs = holder.pool.get("e"), follower.pool.get("e")
    assert mine is not None and theirs is not None
    try:
        assert holder.shared is not None and holder.shared.hold()
        holder.probe_all()
        assert mine.healthy and mine.slots is None  # idle: nothing waits, nothing learned
        streams = _Streams(engine, SLOTS + 2)
        wait_until(lambda: _queue(engine) == (SLOTS, 2), "the engine to queue two", 20)
        holder.probe_all()
        assert mine.slots is None  # one saturated probe is not enough
        follower.follow()
        assert theirs.slots is None
        holder.probe_all()
        assert mine.slots == SLOTS
        follower.follow()
        assert theirs.slots == SLOTS
        assert streams.join() == [TOKENS] * (SLOTS + 2)
        assert _queue(engine) == (0, 0)
        holder.probe_all()
        assert mine.slots == SLOTS  # an idle engine keeps the slots it showed
    finally:
        holder.stop()
        follower.stop()


def test_a_backend_without_engine_gauges_keeps_no_slots_and_stays_healthy(
        upstreams: Any, tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.WARNING, logger="continuum.routing.health")
    up = upstreams("plain")
    monitor = _monitor(tmp_path, up.url)
    backend = monitor.pool.get("e")
    assert backend is not None
    try:
        for _ in range(3):
            assert monitor.probe(backend)
        assert backend.healthy and backend.slots is None
        warnings = [r.getMessage() for r in caplog.records]
        assert len(warnings) == 1 and "has no vLLM or SGLang queue gauges" in warnings[0]
    finally:
        monitor.stop()


def _slots_by_worker(url: str, token: str, workers: int) -> dict[int, tuple[Any, Any]]:
    """``(slots, slots_source)`` of each worker's ``GET /admin/backends`` (fresh
    connections, which the kernel spreads over the workers)."""
    seen: dict[int, tuple[Any, Any]] = {}
    for _ in range(200):
        doc = requests.get(url + "/admin/backends", timeout=10,
                           headers={"Authorization": f"Bearer {token}",
                                    "Connection": "close"}).json()
        row = doc["backends"][0]
        seen[doc["worker_pid"]] = (row["slots"], row["slots_source"])
        if len(seen) == workers:
            break
    return seen


@pytest.mark.e2e
def test_every_gunicorn_worker_routes_with_the_learned_slots(
        engine: str, router_factory: Any) -> None:
    """Two workers, one prober: the slots it learns while the engine queues reach both
    workers' admin views."""
    token = "learned-slots-token"
    router = router_factory({
        "admin": {"token": token},
        "backends": [{"name": "e", "url": engine, "models": [MODEL], "learn_slots": True}],
        "health_check": {"interval_seconds": 0.2},
    }, workers=2)
    wait_until(lambda: len(_slots_by_worker(router.url, token, 2)) == 2, "2 workers", 15)
    assert set(_slots_by_worker(router.url, token, 2).values()) == {(None, "learned")}
    streams = _Streams(router.url, SLOTS + 2)  # through the router
    wait_until(lambda: set(_slots_by_worker(router.url, token, 2).values())
               == {(SLOTS, "learned")}, "both workers to learn the engine's slots", 10)
    assert streams.join() == [TOKENS] * (SLOTS + 2)
