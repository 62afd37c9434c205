"""Scale-out through real gunicorn: admin actions reach every worker and every router, and
in-flight counts are the host's (docs/scale-out.md)."""

from __future__ import annotations

import http.client
import json
import time
from typing import Any

import pytest
import redis

from continuum.devtools.procs import wait_until
from continuum.devtools.redis_server import unique_prefix

pytestmark = pytest.mark.e2e

BODY = json.dumps({"model": "m", "temperature": 0,
                   "messages": [{"role": "user", "content": "What is 2+2?"}]}).encode()


def _config(up: Any, **cache: Any) -> dict[str, Any]:
    return {
        "backends": [{"name": up.name, "url": up.url, "models": ["m"]}],
        "response_cache": {"enabled": True, **cache},
        "health_check": {"interval_seconds": 30},
    }


class Conn:
    """One keep-alive connection, hence one gunicorn worker, with that worker's PID."""

    def __init__(self, url: str) -> None:
        host, port = url.removeprefix("http://").split(":")
        self.http = http.client.HTTPConnection(host, int(port), timeout=10)
        self.pid = self.get("/admin/backends")["worker_pid"]

    def get(self, path: str) -> dict[str, Any]:
        self.http.request("GET", path)
        resp = self.http.getresponse()
        return json.loads(resp.read())

    def post(self, path: str, body: bytes,
             timeout: float | None = None) -> tuple[int, dict[str, str], bytes]:
        """``timeout``: seconds to wait for this answer instead of the connection's 10."""
        self.http.request("POST", path, body=body,
                          headers={"Content-Type": "application/json"})
        if timeout is not None and self.http.sock is not None:
            self.http.sock.settimeout(timeout)
        try:
            resp = self.http.getresponse()
            return resp.status, {k.lower(): v for k, v in resp.getheaders()}, resp.read()
        finally:
            if timeout is not None and self.http.sock is not None:
                self.http.sock.settimeout(self.http.timeout)

    def chat(self) -> str:
        status, headers, _ = self.post("/v1/chat/completions", BODY)
        assert status == 200
        return headers["x-cache"]

    def close(self) -> None:
        self.http.close()


def _one_per_worker(url: str, workers: int, within: float = 30.0) -> list[Conn]:
    """Keep-alive connections, one on each worker (the kernel spreads new connections;
    the later workers may still be booting on a busy machine, so this tries for up to
    ``within`` seconds)."""
    found: dict[int, Conn] = {}
    spare: list[Conn] = []
    deadline = time.monotonic() + within
    while time.monotonic() < deadline:
        time.sleep(0.05)
        conn = Conn(url)
        if conn.pid in found:
            spare.append(conn)
        else:
            found[conn.pid] = conn
        if len(found) == workers:
            break
    for conn in spare:
        conn.close()
    assert len(found) == workers, f"only reached workers {sorted(found)}"
    return list(found.values())


def _question(n: int) -> bytes:
    return json.dumps({"model": "m", "temperature": 0,
                       "messages": [{"role": "user", "content": f"Question {n}?"}]}).encode()


def test_clear_all_misses_on_every_worker_memory_store(upstreams, router_factory) -> None:
    up = upstreams("a")
    router = router_factory(_config(up), workers=2)
    conns = _one_per_worker(router.url, 2)
    try:
        for conn in conns:  # each worker has its own memory store: warm each
            assert conn.chat() in ("MISS", "HIT")
            assert conn.chat() == "HIT"
        for n in range(3):  # three more entries, in the second worker's store only
            assert conns[1].post("/v1/chat/completions", _question(n))[0] == 200
        entries = [conn.get("/admin/response-cache/stats")["entries"] for conn in conns]
        assert entries == [1, 4]
        status, _, raw = conns[0].post("/admin/response-cache/invalidate",
                                       b'{"clear_all": true}')
        doc = json.loads(raw)
        assert status == 200 and doc["success"] is True
        assert doc["fleet"]["workers"] == 2 and doc["fleet"]["workers_applied"] == 2
        # The reply counts what every worker cleared, not only the one that answered.
        assert doc["cleared_entries"] == 5, doc
        assert [conn.get("/admin/response-cache/stats")["entries"] for conn in conns] == [0, 0]
        # Without the fleet bus only conns[0]'s worker would miss (issue 16: HIT HIT MISS).
        assert [conn.chat() for conn in conns] == ["MISS", "MISS"]
        assert [conn.chat() for conn in conns] == ["HIT", "HIT"]
    finally:
        for conn in conns:
            conn.close()


def test_clear_all_misses_on_every_worker_of_two_routers(upstreams, router_factory,
                                                         redis_server) -> None:
    up = upstreams("a")
    cache = {"backend": "redis",
             "redis": {"url": redis_server.url, "key_prefix": unique_prefix("fleet")}}
    routers = [router_factory(_config(up, **cache), workers=2) for _ in range(2)]
    conns = [c for r in routers for c in _one_per_worker(r.url, 2)]
    try:
        for conn in conns:
            conn.chat()
            assert conn.chat() == "HIT"
        # The fleet members announce themselves when their worker starts; wait for all 4.
        client = redis.Redis.from_url(redis_server.url)
        members = cache["redis"]["key_prefix"].rstrip(":") + ".fleet:members"
        wait_until(lambda: client.zcard(members) == 4, "4 fleet members", 15)
        client.close()
        status, _, raw = conns[0].post("/admin/response-cache/invalidate",
                                       b'{"clear_all": true}')
        doc = json.loads(raw)
        assert status == 200, doc
        assert doc["fleet"]["routers"] == 2 and doc["fleet"]["routers_applied"] == 2, doc
        assert doc["fleet"]["workers_applied"] == 2 and doc["fleet"]["complete"] is True
        results = [conn.chat() for conn in conns]
        # Shared Redis store: the first request after the clear misses, the rest hit its
        # fresh entry; no worker serves the entry from before the clear.
        assert results[0] == "MISS" and results.count("MISS") == 1
        assert up.stats()["requests"] == 2
    finally:
        for conn in conns:
            conn.close()


def _two_routers_with_1_and_2_entries(upstreams: Any, router_factory: Any,
                                      redis_server: Any) -> list[Conn]:
    """Two one-worker routers with memory stores, joined by fleet.use_redis, holding one
    and two response-cache entries; a connection to each, once both are fleet members."""
    up = upstreams("a")
    redis_cfg = {"url": redis_server.url, "key_prefix": unique_prefix("fc")}
    config = {**_config(up, redis=redis_cfg), "fleet": {"use_redis": True}}
    first, second = router_factory(config), router_factory(config)
    conns = [Conn(first.url), Conn(second.url)]
    for n, conn in ((0, conns[0]), (1, conns[1]), (2, conns[1])):
        assert conn.post("/v1/chat/completions", _question(n))[0] == 200
    client = redis.Redis.from_url(redis_server.url)
    members = redis_cfg["key_prefix"].rstrip(":") + ".fleet:members"
    wait_until(lambda: client.zcard(members) == 2, "2 fleet members", 15)
    client.close()
    return conns


def test_clear_all_counts_what_every_router_cleared(upstreams, router_factory,
                                                   redis_server) -> None:
    """Two routers with memory stores, joined by fleet.use_redis: the reply's count is
    both routers' entries."""
    conns = _two_routers_with_1_and_2_entries(upstreams, router_factory, redis_server)
    try:
        status, _, raw = conns[0].post("/admin/response-cache/invalidate",
                                       b'{"clear_all": true}')
        doc = json.loads(raw)
        assert status == 200 and doc["fleet"]["routers_applied"] == 2, doc
        assert doc["cleared_entries"] == 3, doc
        assert [c.get("/admin/response-cache/stats")["entries"] for c in conns] == [0, 0]
    finally:
        for conn in conns:
            conn.close()


def test_workers_all_lists_every_workers_view(upstreams, router_factory) -> None:
    """``?workers=all``: one answer with every worker's view, gathered through the bus."""
    up = upstreams("a")
    router = router_factory(_config(up), workers=2)
    conns = _one_per_worker(router.url, 2)
    try:
        for n in range(3):  # three entries in the second worker's store, one in the first's
            assert conns[1].post("/v1/chat/completions", _question(n))[0] == 200
        assert conns[0].post("/v1/chat/completions", _question(9))[0] == 200
        doc = conns[0].get("/admin/response-cache/stats?workers=all")
        assert doc["fleet"]["workers"] == 2 and doc["fleet"]["complete"] is True, doc
        rows = [(w["worker_pid"], w["entries"], w["requests"]["miss"]) for w in doc["workers"]]
        assert rows == [(conns[0].pid, 1, 1), (conns[1].pid, 3, 3)]  # the answering one first
        # the workers' counters summed (each worker has its own memory store: entries too)
        assert doc["total"]["requests"] == {"hit": 0, "miss": 4, "skip": 0, "total": 4}
        assert doc["total"]["entries"] == 4 and doc["total"]["hit_rate"] == "0.0000"
        assert conns[1].post("/v1/chat/completions", _question(0))[0] == 200  # a hit
        total = conns[1].get("/admin/response-cache/stats?workers=all")["total"]
        assert total["requests"]["hit"] == 1 and total["hit_rate"] == "0.2000"
        backends = conns[1].get("/admin/backends?workers=all")["workers"]
        assert [w["worker_pid"] for w in backends] == [conns[1].pid, conns[0].pid]
        assert all(w["backends"][0]["name"] == "a" for w in backends)
        conns[0].http.request("GET", "/admin/backends?workers=some")
        refused = conns[0].http.getresponse()
        error = json.loads(refused.read())["error"]
        assert refused.status == 400 and (error["param"], error["code"]) == (
            "workers", "invalid_value")
        # a plain GET is still the answering worker's own view
        assert conns[1].get("/admin/response-cache/stats")["entries"] == 3
    finally:
        for conn in conns:
            conn.close()


def test_workers_all_reaches_the_routers_sharing_redis(upstreams, router_factory,
                                                      redis_server) -> None:
    conns = _two_routers_with_1_and_2_entries(upstreams, router_factory, redis_server)
    try:
        doc = conns[1].get("/admin/response-cache/stats?workers=all")
        assert doc["fleet"]["routers_applied"] == 2, doc
        assert [(w["worker_pid"], w["entries"]) for w in doc["workers"]] == [
            (conns[1].pid, 2), (conns[0].pid, 1)]
        # the routers' memory stores and lookups, summed
        assert doc["total"]["entries"] == 3 and doc["total"]["requests"]["miss"] == 3
    finally:
        for conn in conns:
            conn.close()


def test_reload_and_kv_clear_reach_every_worker(upstreams, router_factory) -> None:
    up = upstreams("a")
    cfg = {**_config(up), "kv_cache_index": {"enabled": True}}
    router = router_factory(cfg, workers=2)
    conns = _one_per_worker(router.url, 2)
    try:
        status, _, raw = conns[1].post("/admin/kv-index/clear", b"")
        doc = json.loads(raw)
        assert status == 200 and doc["fleet"]["workers_applied"] == 2
        status, _, raw = conns[0].post("/admin/config/reload", b"")
        doc = json.loads(raw)
        assert status == 200 and doc["fleet"] == {
            "workers": 2, "workers_applied": 2, "routers": 1, "routers_applied": 1,
            "complete": True}
    finally:
        for conn in conns:
            conn.close()


def test_in_flight_counts_are_the_hosts(upstreams, router_factory) -> None:
    """Requests held open through one worker count in every worker's load view."""
    up = upstreams("a")
    router = router_factory({**_config(up), "response_cache": {"enabled": False}}, workers=2)
    first, second = _one_per_worker(router.url, 2)
    held: list[Conn] = []
    try:
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:  # three more connections on the first worker
            conn = Conn(router.url)
            if conn.pid == first.pid:
                held.append(conn)
            else:
                conn.close()
            if len(held) == 3:
                break
        assert len(held) == 3
        # Held long enough that a busy machine still sees all three in flight at once.
        hang = 6
        body = json.dumps({"model": "m", "messages": [{"role": "user", "content": "x"}],
                           "x_test": {"hang": hang}}).encode()
        for conn in held:
            conn.http.request("POST", "/v1/chat/completions", body=body,
                              headers={"Content-Type": "application/json"})

        def seen_by(conn: Conn) -> int:
            doc = conn.get("/admin/backends")
            return next(b["in_flight"] for b in doc["backends"] if b["name"] == "a")

        wait_until(lambda: seen_by(second) == 3, "the other worker to see 3 in flight", hang)
        assert seen_by(first) == 3
        for conn in held:
            assert conn.http.getresponse().read()
        wait_until(lambda: seen_by(second) == 0, "the load to drop to 0", 20)
    finally:
        for conn in [first, second, *held]:
            conn.close()


def _held_through_one_seen_by_the_other(first: Any, second: Any, within: float) -> None:
    """Three requests held open (3 s) through ``first`` show as ``in_flight: 3`` on
    ``second`` within ``within`` seconds, and as 0 within ``within`` of their end."""
    held = [Conn(first.url) for _ in range(3)]
    watcher = Conn(second.url)
    try:
        body = json.dumps({"model": "m", "messages": [{"role": "user", "content": "x"}],
                           "x_test": {"hang": 3}}).encode()
        for conn in held:
            conn.http.request("POST", "/v1/chat/completions", body=body,
                              headers={"Content-Type": "application/json"})

        def seen_by(conn: Conn) -> int:
            doc = conn.get("/admin/backends")
            return int(next(b["in_flight"] for b in doc["backends"] if b["name"] == "a"))

        wait_until(lambda: seen_by(watcher) == 3, "the other router to see 3 in flight",
                   within)
        for conn in held:
            assert conn.http.getresponse().read()
        wait_until(lambda: seen_by(watcher) == 0, "the load to drop to 0", within)
    finally:
        for conn in [*held, watcher]:
            conn.close()


@pytest.mark.parametrize("shared", ["redis cache", "use_redis, no cache"])
def test_in_flight_counts_are_the_fleets_across_routers(upstreams, router_factory,
                                                        redis_server, shared: str) -> None:
    """Two routers on one Redis: requests held open through one count in the other's load
    view (one Redis exchange per host every fleet_load_interval_ms), and stop counting
    when they finish; also for routers with no Redis tier, through fleet.use_redis."""
    up = upstreams("a")
    redis = {"url": redis_server.url, "key_prefix": unique_prefix("fl")}
    if shared == "redis cache":
        config = {**_config(up, backend="redis", redis=redis),
                  "fleet": {"fleet_load_interval_ms": 100}}
    else:
        config = {**_config(up, enabled=False, redis=redis),
                  "fleet": {"fleet_load_interval_ms": 100, "use_redis": True}}
    first, second = router_factory(config), router_factory(config)
    _held_through_one_seen_by_the_other(first, second, within=5)


def test_in_flight_counts_are_pushed_to_the_other_router_between_exchanges(
        upstreams, router_factory, redis_server) -> None:
    """With exchanges 10 s apart, requests held open through one router count in the
    other's load view while they hang (3 s, well before the second router's next
    exchange), and stop counting when they finish: the exchanging worker publishes each
    change (fleet.fleet_load_push_ms) and the other router's takes it from the channel.
    With fleet_load_push_ms: 0 the first wait times out."""
    up = upstreams("a")
    redis = {"url": redis_server.url, "key_prefix": unique_prefix("fl")}
    config = {**_config(up, backend="redis", redis=redis),
              "fleet": {"fleet_load_interval_ms": 10000, "fleet_load_push_ms": 5}}
    first = router_factory(config)
    second = router_factory(config)  # its first exchange finds the first; then it idles
    _held_through_one_seen_by_the_other(first, second, within=3)


def test_kv_pressure_is_the_fleets_across_routers(upstreams, router_factory,
                                                  redis_server) -> None:
    """Two routers on one Redis with KV placement: the prompt tokens one router sends a
    backend to store show in the other router's placement view (``kv_pressure_tokens``
    of explain), through the same exchange as the in-flight counts."""
    ups = [upstreams(name) for name in ("a", "b")]
    config = {
        "backends": [{"name": up.name, "url": up.url, "models": ["m"]} for up in ups],
        "selection_strategy": "PrefixAwareHash",
        "prefix_routing": {"enabled": True},
        "response_cache": {"enabled": False, "backend": "redis",
                           "redis": {"url": redis_server.url,
                                     "key_prefix": unique_prefix("fp")}},
        "kv_cache_index": {"enabled": True, "backend": "redis"},
        "health_check": {"interval_seconds": 30},
        "fleet": {"fleet_load_interval_ms": 100},
    }
    first, second = router_factory(config), router_factory(config)

    def chat(router: Any, n: int) -> dict[str, Any]:
        return {"model": "m", "messages": [
            {"role": "system", "content": "You are a careful assistant. " * 40},
            {"role": "user", "content": f"Question {n}: " + "tell me more. " * 200}]}

    def pressure(router: Any) -> dict[str, int]:
        conn = Conn(router.url)
        try:
            status, _, raw = conn.post("/admin/routing/explain",
                                       json.dumps(chat(router, 999)).encode())
        finally:
            conn.close()
        assert status == 200, raw
        return {row["backend"]: row["kv_pressure_tokens"]
                for row in json.loads(raw)["kv_scores"]}

    assert pressure(second) == {"a": 0, "b": 0}
    sent = Conn(first.url)
    try:
        for n in range(4):
            status, _, _ = sent.post("/v1/chat/completions",
                                     json.dumps(chat(first, n)).encode())
            assert status == 200
    finally:
        sent.close()
    own = pressure(first)
    assert sum(own.values()) > 4 * 500  # each request stored its ~900 new tokens somewhere
    wait_until(lambda: all(pressure(second)[name] > 0.9 * own[name] for name in own
                           if own[name]), "the other router to see the pressure", 5)
    seen = pressure(second)
    assert all(seen[name] <= own[name] + 1 for name in own)


def test_round_robin_cycles_once_for_the_hosts_workers(upstreams, router_factory) -> None:
    """Requests taking turns between two workers still go round the backends in order:
    the workers share one rotation (fleet.share_rotation). With a counter each, the two
    workers' cycles both start on the first backend and each backend gets two in a row."""
    ups = [upstreams(name) for name in "abcd"]
    config = {
        "backends": [{"name": up.name, "url": up.url, "models": ["m"]} for up in ups],
        "selection_strategy": "RoundRobin",
        "response_cache": {"enabled": False},
        "health_check": {"interval_seconds": 30},
    }
    router = router_factory(config, workers=2)
    conns = _one_per_worker(router.url, 2)
    try:
        served = []
        for i in range(12):
            status, headers, _ = conns[i % 2].post("/v1/chat/completions", BODY)
            assert status == 200
            served.append(headers["x-continuum-backend"])
        first = "abcd".index(served[0])
        assert served == ["abcd"[(first + i) % 4] for i in range(12)]
    finally:
        for conn in conns:
            conn.close()
