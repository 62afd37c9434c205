"""One health prober per host (continuum.routing.shared_health): in-process monitors that
share a runtime directory, against real upstreams, then real gunicorn workers."""

from __future__ import annotations

import http.client
import json
import os
import signal
import time
from pathlib import Path
from typing import Any

import gevent
import pytest

from continuum.config import BackendConfig, HealthCheckConfig
from continuum.devtools.procs import http_get, wait_until
from continuum.routing.backends import Backend, BackendPool
from continuum.routing.health import HealthMonitor
from continuum.routing.shared_health import HISTORY, SharedProbes

CONFIG = HealthCheckConfig(interval_seconds=60, timeout_ms=2000)


def _worker(directory: Path, *backends: tuple[str, str, tuple[str, ...]],
            config: HealthCheckConfig = CONFIG) -> HealthMonitor:
    """One worker's monitor: its own pool of (name, url, models) on ``directory``."""
    pool = BackendPool(Backend(BackendConfig(name=n, url=u, models=m)) for n, u, m in backends)
    return HealthMonitor(pool, config, shared=SharedProbes(directory))


_BASE: dict[str, int] = {}


def _probes(up: Any) -> int:
    """Health probes ``up`` saw since :func:`_start` (its readiness wait probes too)."""
    return int(up.stats()["health_probes"]) - _BASE[up.url]


def _start(upstreams: Any, *names: str) -> list[Any]:
    ups = [upstreams(n) for n in names]
    for up in ups:
        _BASE[up.url] = int(up.stats()["health_probes"])
    return ups


def _set(up: Any, healthy: bool) -> None:
    assert http_get(up.url + ("/_test/well" if healthy else "/_test/sick"))[0] == 200


def test_one_worker_probes_and_the_others_take_every_result(upstreams, tmp_path) -> None:
    up, = _start(upstreams, "a")
    holder = _worker(tmp_path, ("a", up.url, ("m",)))
    follower = _worker(tmp_path, ("a", up.url, ("m",)))
    mine, theirs = holder.pool.get("a"), follower.pool.get("a")
    assert mine is not None and theirs is not None
    mine.probed = theirs.probed = False
    try:
        assert holder.shared.hold() and not follower.shared.hold()
        assert (holder.view(), follower.view()) == (
            {"shared": True, "prober": True}, {"shared": True, "prober": False})
        holder.probe_all()
        assert follower.follow() == 1
        assert (theirs.state, _probes(up)) == ("healthy", 1)
        assert follower.follow() == 0  # nothing new: the same result is not counted twice
        _set(up, healthy=False)
        holder.probe_all()
        holder.probe_all()
        # Both failures reach the follower's tracker: its threshold (2) takes it out.
        assert follower.follow() == 2
        assert (mine.healthy, theirs.healthy, _probes(up)) == (False, False, 3)
        _set(up, healthy=True)
        holder.probe_all()
        assert follower.follow() == 1 and not theirs.healthy  # one success of the two
        holder.probe_all()
        assert follower.follow() == 1 and theirs.healthy
        assert _probes(up) == 5
    finally:
        holder.stop()
        follower.stop()


def test_a_follower_that_missed_rounds_takes_the_latest_history(upstreams, tmp_path) -> None:
    up, = _start(upstreams, "a")
    holder = _worker(tmp_path, ("a", up.url, ("m",)))
    follower = _worker(tmp_path, ("a", up.url, ("m",)))
    try:
        assert holder.shared.hold()
        holder.probe_all()
        assert follower.follow() == 1
        for _ in range(HISTORY + 4):
            holder.probe_all()
        assert follower.follow() == HISTORY
        assert follower.follow() == 0
    finally:
        holder.stop()
        follower.stop()


def test_discovered_models_reach_the_followers(upstreams, tmp_path) -> None:
    up, = _start(upstreams, "a")
    holder = _worker(tmp_path, ("a", up.url, ()))
    follower = _worker(tmp_path, ("a", up.url, ()))
    try:
        assert holder.shared.hold()
        holder.probe_all()
        follower.follow()
        theirs = follower.pool.get("a")
        assert theirs is not None and theirs.discovered_models == frozenset({"m"})
        assert _probes(up) == 1
    finally:
        holder.stop()
        follower.stop()


def test_a_follower_probes_what_the_holder_does_not_report(upstreams, tmp_path) -> None:
    """A backend only the follower has (a reload not yet everywhere), one the holder knows
    at another URL, and one whose last result is stale: the follower probes them itself,
    once an interval."""
    a, b, c = _start(upstreams, "a", "b", "c")
    # A probe timeout a busy machine's upstream still answers within, and an interval that
    # the checks between the follower's first and second follow() fit in.
    config = HealthCheckConfig(interval_seconds=2.0, timeout_ms=1000)
    holder = _worker(tmp_path, ("a", a.url, ("m",)), ("b", b.url, ("m",)), config=config)
    follower = _worker(tmp_path, ("a", a.url, ("m",)), ("b", c.url, ("m",)),
                       ("new", c.url, ("m",)), config=config)
    try:
        assert holder.shared.hold()
        holder.probe_all()
        follower.follow()
        # the follower's own probes run in greenlets: let them (gevent.sleep) until done
        wait_until(lambda: (_probes(a), _probes(b), _probes(c)) == (1, 1, 2),
                   lambda: f"the follower's probes: {(_probes(a), _probes(b), _probes(c))}",
                   10, sleep=gevent.sleep)
        assert all(be.state == "healthy" for be in follower.pool)
        follower.follow()  # within the interval: no second probe of its own
        gevent.sleep(0.1)
        assert _probes(c) == 2
        # the holder's results grow stale (2 intervals + a timeout)
        time.sleep(2 * config.interval_seconds + config.timeout_ms / 1000 + 0.2)
        follower.follow()
        wait_until(lambda: (_probes(a), _probes(b), _probes(c)) == (2, 1, 4),
                   lambda: f"probes of stale results: {(_probes(a), _probes(b), _probes(c))}",
                   10, sleep=gevent.sleep)
        gevent.sleep(0.1)  # and no more than those
        assert (_probes(a), _probes(b), _probes(c)) == (2, 1, 4)
    finally:
        holder.stop()
        follower.stop()


def test_when_the_holder_stops_a_follower_takes_over(upstreams, tmp_path) -> None:
    up, = _start(upstreams, "a")
    first = _worker(tmp_path, ("a", up.url, ("m",)))
    second = _worker(tmp_path, ("a", up.url, ("m",)))
    third = _worker(tmp_path, ("a", up.url, ("m",)))
    try:
        assert first.shared.hold() and not second.shared.hold()
        for _ in range(3):
            first.probe_all()
        assert third.follow() == 1
        first.stop()
        assert second.shared.hold() and not third.shared.hold()
        second.probe_all()  # a new holder counts from 1: the follower sees a new result
        assert third.follow() == 1
        assert json.loads((tmp_path / "health.json").read_text())["backends"]["a"]["seq"] == 1
    finally:
        for monitor in (first, second, third):
            monitor.stop()


def test_an_unreadable_file_makes_followers_probe_themselves(upstreams, tmp_path) -> None:
    up, = _start(upstreams, "a")
    follower = _worker(tmp_path, ("a", up.url, ("m",)))
    (tmp_path / "health.json").write_text("{not json")
    try:
        assert follower.shared.entries() == ("", {})
        follower.follow()
        wait_until(lambda: _probes(up) >= 1, "the follower's own probe", 10, sleep=gevent.sleep)
        gevent.sleep(0.1)
        assert _probes(up) == 1
    finally:
        follower.stop()


def _by_worker(url: str, workers: int, read: Any) -> dict[int, Any]:
    """``read(doc)`` of each worker's ``GET /admin/backends``, through fresh connections
    (the kernel spreads them over the workers)."""
    host, port = url.removeprefix("http://").split(":")
    seen: dict[int, Any] = {}
    for _ in range(200):
        conn = http.client.HTTPConnection(host, int(port), timeout=10)
        conn.request("GET", "/admin/backends")
        doc = json.loads(conn.getresponse().read())
        conn.close()
        seen[doc["worker_pid"]] = read(doc)
        if len(seen) == workers:
            break
        time.sleep(0.02)
    return seen


def _prober_pids(url: str, workers: int) -> dict[int, bool]:
    return _by_worker(url, workers, lambda doc: doc["health_checks"]["prober"])


def _healthy_by_worker(url: str, workers: int) -> dict[int, bool]:
    return _by_worker(url, workers, lambda doc: doc["backends"][0]["healthy"])


def _probe_rate(up: Any, seconds: float) -> float:
    start = _probes(up)
    time.sleep(seconds)
    return (_probes(up) - start) / seconds


@pytest.mark.e2e
def test_gunicorn_workers_share_one_prober(upstreams, router_factory) -> None:
    """Three workers: one probes (a third of the probes of unshared workers), every worker
    sees a sick backend go, and a killed prober's role passes to another worker."""
    up, = _start(upstreams, "a")
    config = {"backends": [{"name": "a", "url": up.url, "models": ["m"]}],
              "health_check": {"interval_seconds": 0.25, "unhealthy_threshold": 1}}
    unshared = router_factory({**config, "fleet": {"share_health_checks": False}}, workers=3)
    wait_until(lambda: len(_prober_pids(unshared.url, 3)) == 3, "3 unshared workers", 15)
    assert set(_prober_pids(unshared.url, 3).values()) == {True}
    before = _probe_rate(up, 2.0)
    unshared.stop()

    router = router_factory(config, workers=3)

    def all_three() -> dict[int, bool]:
        """Each worker's role, once a round of fresh connections reached all 3 (else {})."""
        found = _prober_pids(router.url, 3)
        return found if len(found) == 3 else {}

    roles = wait_until(all_three, "3 workers", 15)
    assert sorted(roles.values()) == [False, False, True], roles
    after = _probe_rate(up, 2.0)
    # 3 workers probing every 0.25 s make ~12 probes a second, one prober ~4.
    assert after <= 6 and before >= 2 * after, (before, after)

    _set(up, healthy=False)

    def states() -> set[bool]:
        return set(_healthy_by_worker(router.url, 3).values())

    wait_until(lambda: states() == {False}, "every worker to take the sick backend out", 20)
    _set(up, healthy=True)
    wait_until(lambda: states() == {True}, "every worker to put it back", 20)

    prober = next(pid for pid, probes in roles.items() if probes)
    os.kill(prober, signal.SIGKILL)  # a gunicorn worker this test started
    wait_until(lambda: sorted(r for p, r in _prober_pids(router.url, 3).items()
                              if p != prober) == [False, False, True],
               "another worker to take the prober's role", 15)
    assert _probe_rate(up, 1.0) >= 2  # probing goes on

