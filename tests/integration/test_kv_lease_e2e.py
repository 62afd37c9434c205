"""KV events consumed once per host (memory index) or per fleet (Redis index), under a
lease, through real gunicorn; a killed holder is replaced (docs/scale-out.md)."""

from __future__ import annotations

import json
import os
import signal
import time
from typing import Any

import pytest
import redis
import yaml

from continuum.devtools.procs import wait_until
from tests.integration.conftest import EventStreams
from tests.integration.kv_helpers import kv_router_config
from tests.integration.test_fleet_e2e import Conn, _one_per_worker

pytestmark = pytest.mark.e2e


def _config(ups: list[Any], streams: EventStreams, **kv: Any) -> dict[str, Any]:
    return kv_router_config(ups, streams, {"fleet": {"lease_ttl_ms": 900}}, **kv)


def _sources(conn: Conn) -> dict[str, dict[str, Any]]:
    return {s["backend_name"]: s for s in conn.get("/admin/kv-index/backends")["backends"]}


def _holders(conns: list[Conn], backend: str) -> list[Conn]:
    return [c for c in conns if _sources(c)[backend]["connection"]["connected"]]


def _consumed_by(conn: Conn, backend: str) -> tuple[Any, Any]:
    """``consumed_by`` of ``backend`` in the worker's two views (stats and backends)."""
    summary = {s["backend_name"]: s for s in conn.get("/admin/kv-index/stats")["event_sources"]}
    return summary[backend]["consumed_by"], _sources(conn)[backend]["consumed_by"]


def _entries(conn: Conn) -> int:
    return int(conn.get("/admin/kv-index/stats")["index"]["entry_count"])


def test_memory_index_one_consumer_per_host_relayed_and_taken_over(
        upstreams, router_factory, streams) -> None:
    ups = [upstreams("a"), upstreams("b")]
    router = router_factory(_config(ups, streams), workers=2)
    conns = _one_per_worker(router.url, 2)
    try:
        wait_until(lambda: streams.connections() == {"a": 1, "b": 1},
                   lambda: f"one stream per backend: {streams.connections()}", 10)
        time.sleep(1.0)  # the other worker keeps trying: still one each
        assert streams.connections() == {"a": 1, "b": 1}
        streams.push("a", "cache_created", "11" * 16)
        streams.push("b", "cache_created", "22" * 16)
        # The holder relays what it reads: every worker's memory index has both entries.
        wait_until(lambda: [_entries(c) for c in conns] == [2, 2],
                   lambda: f"both workers to index 2 entries: {[_entries(c) for c in conns]}",
                   10)
        holder = _holders(conns, "a")
        assert len(holder) == 1
        dead = holder[0].pid
        survivor = next(c for c in conns if c is not holder[0])
        # Both workers' views say who reads the stream (the other's shows it unconnected).
        assert _consumed_by(holder[0], "a") == ("this worker", "this worker")
        assert _consumed_by(survivor, "a") == (f"worker {holder[0].pid}",) * 2
        os.kill(holder[0].pid, signal.SIGKILL)  # a gunicorn worker this test started
        holder[0].close()
        conns = [survivor]
        # flock dies with its holder: another worker (the survivor, or the one gunicorn
        # starts in its place, whichever asks first) takes the stream within ttl/3 + connect.
        wait_until(lambda: streams.connections() == {"a": 1, "b": 1},
                   lambda: f"one stream per backend again: {streams.connections()}", 10)
        streams.push("a", "cache_created", "33" * 16)
        wait_until(lambda: _entries(survivor) == 3, "the new holder to index the event", 10)
        # the new holder, not the dead one, whose pid its lock file still names
        seen = _consumed_by(survivor, "a")[0]
        assert seen == "this worker" or (seen.startswith("worker ") and
                                         seen != f"worker {dead}"), seen
    finally:
        for conn in conns:
            conn.close()


def test_event_sources_reload_keeps_one_consumer_per_host(upstreams, router_factory,
                                                          streams) -> None:
    """A hot reload of ``kv_cache_index.event_sources`` rebuilds every worker's consumers
    under the same lease: still one stream per backend for the host, and the holder still
    relays what it reads to the other worker."""
    ups = [upstreams("a"), upstreams("b")]
    config = _config(ups, streams)
    router = router_factory(config, workers=2)
    conns = _one_per_worker(router.url, 2)
    try:
        wait_until(lambda: streams.connections() == {"a": 1, "b": 1},
                   lambda: f"one stream per backend: {streams.connections()}", 10)
        streams.push("a", "cache_created", "11" * 16)
        wait_until(lambda: [_entries(c) for c in conns] == [1, 1],
                   "both workers to index the first event", 10)
        opened = dict(streams.total)
        for source in config["kv_cache_index"]["event_sources"]:
            source["reconnect_interval_ms"] = 150  # a change that restarts the consumers
        router.config_path.write_text(yaml.safe_dump(
            {**yaml.safe_load(router.config_path.read_text()), **config}))
        # The reload answers once this worker's consumers have stopped (their joins are
        # bounded at 10 s and 5 s) and the other worker reported it: not a latency check.
        status, _, raw = conns[0].post("/admin/config/reload", b"", timeout=60)
        doc = json.loads(raw)
        assert status == 200 and "kv_cache_index.event_sources" in doc["applied"], doc
        assert doc["fleet"]["workers_applied"] == 2, doc
        # Each worker's old consumer is gone and one new stream per backend opens.
        wait_until(lambda: streams.connections() == {"a": 1, "b": 1}
                   and streams.total == {k: v + 1 for k, v in opened.items()},
                   lambda: f"one new stream per backend: open {streams.connections()}, "
                           f"opened {streams.total} (before the reload {opened})", 10)
        time.sleep(1.0)  # the other worker keeps trying for the lease: still one each
        assert streams.connections() == {"a": 1, "b": 1}
        assert streams.total == {k: v + 1 for k, v in opened.items()}
        streams.push("b", "cache_created", "22" * 16)
        wait_until(lambda: [_entries(c) for c in conns] == [2, 2],
                   lambda: f"both workers to index the event read after the reload: "
                           f"{[_entries(c) for c in conns]}", 10)
    finally:
        for conn in conns:
            conn.close()


def test_redis_index_one_consumer_per_fleet_and_lease_expiry(
        upstreams, router_factory, streams, redis_server) -> None:
    ups = [upstreams("a")]
    prefix = f"cr:kvlease:{time.monotonic_ns()}:"
    cfg = _config(ups, streams, backend="redis", redis_key_prefix=prefix)
    cfg["response_cache"] = {"redis": {"url": redis_server.url}}
    routers = [router_factory(cfg, workers=2) for _ in range(2)]
    by_router = [_one_per_worker(r.url, 2) for r in routers]
    conns = [c for group in by_router for c in group]
    client = redis.Redis.from_url(redis_server.url)
    try:
        wait_until(lambda: streams.connections() == {"a": 1},
                   lambda: f"one stream for the fleet: {streams.connections()}", 10)
        time.sleep(1.0)
        assert streams.connections() == {"a": 1}
        lease_key = prefix.rstrip(":") + ".lease:a"
        holder_member = client.get(lease_key).decode()
        holder = [c for c in conns if holder_member.endswith(f":{c.pid}")]
        assert len(holder) == 1 and _holders(conns, "a") == holder
        beside = next(group for group in by_router if holder[0] in group)
        for conn in conns:  # who reads the fleet's one stream, as each worker sees it
            seen = _consumed_by(conn, "a")[0]
            if conn is holder[0]:
                assert seen == "this worker"
            elif conn in beside:
                assert seen == f"worker {holder[0].pid}"
            else:
                assert seen.startswith("router ") and seen.endswith(f" worker {holder[0].pid}")
        writes_before = _writes(client)
        for i in range(10):
            streams.push("a", "cache_created", f"{i:032x}")
        # Every worker of both routers reads the one copy in Redis.
        wait_until(lambda: all(_entries(c) == -1 for c in conns) and
                   client.exists(prefix + f"{9:032x}") == 1, "the events in Redis", 10)
        # One holder writes: each event's write commands ran once, not once per worker.
        per_event = (_writes(client) - writes_before) / 10
        assert per_event < 8, per_event
        os.kill(holder[0].pid, signal.SIGKILL)
        holder[0].close()
        conns.remove(holder[0])
        # Nobody renews the dead holder's lease: it expires (900 ms) and another takes it.
        wait_until(lambda: client.get(lease_key) not in (None, holder_member.encode()),
                   "another worker to take the expired lease", 10)
        # (the new holder may be the worker gunicorn started in the dead one's place)
        wait_until(lambda: len(_holders(conns, "a")) <= 1 and streams.connections() == {"a": 1},
                   lambda: f"one new consumer: {streams.connections()}", 10)
        streams.push("a", "cache_created", "ff" * 16)
        wait_until(lambda: client.exists(prefix + "ff" * 16) == 1,
                   "the new holder to write the next event", 10)
    finally:
        client.close()
        for conn in conns:
            conn.close()


def _writes(client: Any) -> int:
    """Write commands Redis has run (ZADD, SET, HSET, EXPIRE, EVALSHA, ... from INFO)."""
    stats = client.info("commandstats")
    writes = ("cmdstat_zadd", "cmdstat_set", "cmdstat_hset", "cmdstat_expire",
              "cmdstat_evalsha", "cmdstat_zrem", "cmdstat_del", "cmdstat_unlink",
              "cmdstat_hdel", "cmdstat_sadd")
    return sum(int(stats.get(name, {}).get("calls", 0)) for name in writes)
