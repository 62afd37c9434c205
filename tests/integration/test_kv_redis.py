"""RedisKvIndex against a real redis-server: the KV index contract, key layout, fallback."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import pytest
import redis

from continuum.config import parse_config
from continuum.devtools.procs import free_port
from continuum.devtools.redis_server import RedisServer, unique_prefix
from continuum.errors import StoreError
from continuum.interfaces import (
    CACHE_CLEARED,
    CACHE_CREATED,
    CACHE_EVICTED,
    TIER_GPU_HOT,
    TIER_STORAGE_WARM,
    KvCacheIndex,
)
from continuum.resources import WorkerResources
from continuum.testing.kv_index import KvIndexCases, StartedIndexCases
from stores.kv_memory import EMPTY
from stores.kv_redis import RedisKvIndex
from stores.redis_link import RedisLink

pytestmark = pytest.mark.redis

P1, P2 = "a" * 64, "b" * 64


class FakeClock:
    """Wall time that moves only when told to (Redis's own TTLs still run in real time)."""

    def __init__(self, now: float = 1_700_000_000.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds


class TestRedisKvContract(KvIndexCases):
    """The contract every KV index meets, on the session's redis-server."""

    counts_entries = False  # stats() never SCANs Redis

    @pytest.fixture(autouse=True)
    def _redis(self, redis_server: RedisServer, links: Any) -> Iterator[None]:
        self.links = links
        self.link = links.link(redis_server.url)
        yield
        for index in links.closing:
            index.clear()

    def make_index(self, *, storage_offloading: bool = False,
                   treat_eviction_as_offload: bool = True, ttl: int = 600) -> KvCacheIndex:
        return self.links.index(self.link, storage_offloading=storage_offloading,
                                treat_eviction_as_offload=treat_eviction_as_offload,
                                entry_ttl_seconds=ttl)


def command_calls(raw: redis.Redis) -> dict[str, int]:
    """``INFO commandstats`` as ``{command: calls}`` (INFO itself left out)."""
    stats = raw.info("commandstats")
    return {name.removeprefix("cmdstat_"): int(value["calls"]) for name, value in stats.items()
            if name != "cmdstat_info"}


def delta(before: dict[str, int], after: dict[str, int]) -> dict[str, int]:
    return {k: n - before.get(k, 0) for k, n in after.items() if n != before.get(k, 0)}


def count_round_trips(link: RedisLink) -> list[str]:
    """Record the operation of every ``link.execute`` call (one call, one round trip here)."""
    calls: list[str] = []
    execute = link.execute

    def counting(operation: str, command: Callable[[redis.Redis], Any]) -> Any:
        calls.append(operation)
        return execute(operation, command)

    link.execute = counting  # type: ignore[method-assign]
    return calls


def test_a_query_is_one_round_trip_of_two_commands(redis_server: RedisServer,
                                                   links: Any) -> None:
    link, raw = links.link(redis_server.url), links.raw(redis_server.url)
    index = links.index(link)
    for backend, tokens in [("b", 5), ("a", 5), ("c", 9)]:
        index.apply(backend, CACHE_CREATED, P1, tokens)
    trips = count_round_trips(link)
    before = command_calls(raw)
    holdings = index.query_backends(P1)
    after = command_calls(raw)
    assert [(h.backend, h.token_count) for h in holdings] == [("c", 9), ("a", 5), ("b", 5)]
    assert trips == ["kv_query"]
    assert delta(before, after) == {"zrevrangebyscore": 1, "hgetall": 1}
    assert index.query_backends(P2) is EMPTY
    index.clear()


def test_an_upsert_is_one_transaction_and_sets_expire_on_every_key(
        redis_server: RedisServer, links: Any) -> None:
    link, raw = links.link(redis_server.url), links.raw(redis_server.url)
    prefix = unique_prefix()
    index = links.index(link, prefix, entry_ttl_seconds=120, clock=FakeClock(1000.5))
    trips = count_round_trips(link)
    before = command_calls(raw)
    index.apply("vllm-1", CACHE_CREATED, P1, 2048)
    after = command_calls(raw)
    assert trips == ["kv_apply"]
    calls = delta(before, after)
    assert (calls["multi"], calls["exec"], calls["zadd"], calls["expire"]) == (1, 1, 2, 3)
    assert raw.zrange(prefix + P1, 0, -1, withscores=True) == [(b"vllm-1", 2048.0)]
    assert raw.hgetall(prefix + P1 + ":tier") == {b"vllm-1": b"gpu_hot|1000.5"}
    assert raw.zrange(prefix + "backend:vllm-1", 0, -1) == [P1.encode()]
    for key in (P1, P1 + ":tier", "backend:vllm-1"):
        assert 0 < raw.ttl(prefix + key) <= 120, key
    index.clear()


def test_demotion_reads_the_tier_in_one_script(redis_server: RedisServer,
                                               links: Any) -> None:
    link, raw = links.link(redis_server.url), links.raw(redis_server.url)
    prefix = unique_prefix()
    index = links.index(link, prefix, storage_offloading=True)
    index.apply("a", CACHE_CREATED, P1, 64)
    raw.expire(prefix + P1, 5)  # the demotion refreshes the TTL
    trips = count_round_trips(link)
    index.apply("a", CACHE_EVICTED, P1)
    assert trips == ["kv_apply"]
    assert raw.hget(prefix + P1 + ":tier", "a").startswith(b"storage_warm|")
    assert raw.ttl(prefix + P1) > 5
    index.apply("a", CACHE_EVICTED, P1)
    assert raw.exists(prefix + P1, prefix + P1 + ":tier") == 0
    assert raw.zcard(prefix + "backend:a") == 0


def test_per_entry_expiry_and_backend_set_trimming(redis_server: RedisServer,
                                                   links: Any) -> None:
    link, raw = links.link(redis_server.url), links.raw(redis_server.url)
    clock = FakeClock()
    prefix = unique_prefix()
    index = links.index(link, prefix, entry_ttl_seconds=10, storage_offloading=True,
                        clock=clock)
    index.apply("old", CACHE_CREATED, P1, 500)
    clock.advance(8)
    index.apply("new", CACHE_CREATED, P1, 100)  # refreshes the key's TTL for both
    clock.advance(4)
    assert [h.backend for h in index.query_backends(P1)] == ["new"]
    index.apply("old", CACHE_EVICTED, P1)  # an expired GpuHot entry is not demoted
    assert raw.zrange(prefix + P1, 0, -1) == [b"new"]
    index.apply("new", CACHE_CREATED, P2, 1)
    clock.advance(20)
    index.apply("new", CACHE_CREATED, P1, 1)
    assert raw.zrange(prefix + "backend:new", 0, -1) == [P1.encode()]  # P2 was trimmed
    assert index.query_backends(P2) is EMPTY
    index.clear()


def test_clear_leaves_foreign_and_sibling_keys(redis_server: RedisServer,
                                               links: Any) -> None:
    link, raw = links.link(redis_server.url), links.raw(redis_server.url)
    base = unique_prefix()
    mine, sibling = links.index(link, base + "a:"), links.index(link, base + "ab:")
    foreign = base + "other:" + P1
    raw.zadd(foreign, {"x": 1})
    try:
        for i in range(600):  # > one SCAN batch: 600 entry sets, 600 tier hashes
            mine.apply("b1", CACHE_CREATED, f"{i:064x}", 1)
        mine.apply("b2", CACHE_CREATED, P1, 1)
        sibling.apply("b1", CACHE_CREATED, P1, 7)
        assert mine.clear() == 601
        assert list(raw.scan_iter(match=base + "a:*")) == []
        assert raw.zrange(foreign, 0, -1) == [b"x"]
        assert [h.token_count for h in sibling.query_backends(P1)] == [7]
    finally:
        sibling.clear()
        raw.delete(foreign)


def test_cache_cleared_touches_only_that_backend(redis_server: RedisServer,
                                                 links: Any) -> None:
    link, raw = links.link(redis_server.url), links.raw(redis_server.url)
    prefix = unique_prefix()
    index = links.index(link, prefix)
    for i in range(1200):  # > one ZSCAN batch
        index.apply("gone", CACHE_CREATED, f"{i:064x}", 1)
    index.apply("kept", CACHE_CREATED, f"{5:064x}", 3)
    index.apply("gone", CACHE_CLEARED, "")
    assert raw.exists(prefix + "backend:gone") == 0
    assert [h.backend for h in index.query_backends(f"{5:064x}")] == ["kept"]
    assert index.query_backends(f"{6:064x}") is EMPTY
    assert index.clear() == 1


def test_two_routers_on_one_redis_share_the_index(redis_server: RedisServer,
                                                  links: Any) -> None:
    prefix = unique_prefix()
    first = links.index(links.link(redis_server.url), prefix, storage_offloading=True)
    second = links.index(links.link(redis_server.url), prefix, storage_offloading=True)
    first.apply("a", CACHE_CREATED, P1, 100)
    second.apply("b", CACHE_CREATED, P1, 200)
    second.apply("a", CACHE_EVICTED, P1)  # demotes what the first router wrote
    for index in (first, second):
        assert [(h.backend, h.tier) for h in index.query_backends(P1)] == [
            ("b", TIER_GPU_HOT), ("a", TIER_STORAGE_WARM)]
    first.apply("b", CACHE_CLEARED, "")
    assert [h.backend for h in second.query_backends(P1)] == ["a"]
    assert second.clear() == 1
    assert first.query_backends(P1) is EMPTY


def test_error_reply_is_a_store_error_not_a_fallback(redis_server: RedisServer,
                                                     links: Any) -> None:
    link, raw = links.link(redis_server.url), links.raw(redis_server.url)
    index = links.index(link)
    raw.set(index.prefix_key(P1), b"not a sorted set")
    for operation in (lambda: index.query_backends(P1),
                      lambda: index.apply("a", CACHE_CREATED, P1, 1)):
        with pytest.raises(StoreError) as caught:
            operation()
        assert caught.value.kind == "other"
        assert caught.value.__cause__ is None
    assert link.fallback_active is False
    assert index.stats()["fallback_entries"] == 0
    assert index.clear() == 0  # the foreign value goes, but is not counted as an entry
    assert raw.exists(index.prefix_key(P1)) == 0


def test_fallback_while_redis_is_down(fresh_redis: RedisServer, links: Any) -> None:
    link = links.link(fresh_redis.url)
    index = links.index(link, storage_offloading=True)
    index.apply("a", CACHE_CREATED, P1, 100)

    fresh_redis.stop()
    assert index.query_backends(P1) is EMPTY  # refused → fallback, no exception
    assert link.fallback_active is True
    index.apply("b", CACHE_CREATED, P2, 300)
    index.apply("c", CACHE_CREATED, P2, 50)
    index.apply("b", CACHE_EVICTED, P2)  # transitions work in the fallback too
    assert [(h.backend, h.tier) for h in index.query_backends(P2)] == [
        ("b", TIER_STORAGE_WARM), ("c", TIER_GPU_HOT)]
    stats = index.stats()
    assert (stats["fallback_active"], stats["fallback_entries"]) == (True, 2)
    assert stats["total_hits"] == 1
    index.apply("c", CACHE_CLEARED, "")
    assert link.probe() is False

    fresh_redis.start()  # same port, empty (no persistence)
    assert link.probe() is True
    assert index.stats()["fallback_entries"] == 0  # dropped: Redis never saw it
    assert index.query_backends(P2) is EMPTY
    index.apply("b", CACHE_CREATED, P2, 10)
    raw = links.raw(fresh_redis.url)
    assert raw.zrange(index.prefix_key(P2), 0, -1, withscores=True) == [(b"b", 10.0)]
    assert index.clear() == 1


def test_a_refused_write_lands_in_the_fallback(fresh_redis: RedisServer,
                                              links: Any) -> None:
    link = links.link(fresh_redis.url)
    index = links.index(link)
    fresh_redis.stop()
    index.apply("a", CACHE_CREATED, P1, 7)  # the first refused command flips the link
    assert link.fallback_active is True
    assert [h.token_count for h in index.query_backends(P1)] == [7]
    assert index.clear() == 1


def test_closed_index_ignores_transitions(fresh_redis: RedisServer, links: Any) -> None:
    link = links.link(fresh_redis.url)
    index = links.index(link)
    index.close()
    fresh_redis.stop()
    index.apply("a", CACHE_CREATED, P1, 1)
    assert link.fallback_active is True
    fresh_redis.start()
    assert link.probe() is True
    assert index.stats()["fallback_entries"] == 1  # a closed index is not reset


def test_from_config(redis_server: RedisServer) -> None:
    config = parse_config({"response_cache": {"redis": {"url": redis_server.url}}})
    with pytest.raises(ValueError, match="no worker resources"):
        RedisKvIndex.from_config(config)
    resources = WorkerResources()
    index = RedisKvIndex.from_config(config, resources=resources, metrics=None,
                                     unknown="ignored")
    assert isinstance(index, RedisKvIndex)
    assert index.link.config == config.response_cache.redis  # response_cache.redis's link
    assert resources.users(("redis", config.response_cache.redis)) == 1
    index.close()
    assert len(resources) == 0  # the only user handed its link back: closed
    assert index.key_prefix == "cr:kvidx:"
    assert index.prefix_key("ab12") == "cr:kvidx:ab12"
    assert index.backend_key("vllm-1") == "cr:kvidx:backend:vllm-1"
    assert index.entry_ttl_seconds == 600


def test_empty_prefix_is_refused(links: Any) -> None:
    with pytest.raises(ValueError, match="key_prefix"):
        RedisKvIndex(links.link("redis://127.0.0.1:1/0"), key_prefix="")


def test_stats_never_talk_to_redis(links: Any) -> None:
    stats = links.index(links.link(f"redis://127.0.0.1:{free_port()}/0")).stats()
    assert stats["backend"] == "redis"
    assert (stats["prefix_count"], stats["entry_count"]) == (-1, -1)
    assert stats["errors"] == {"connection": 0, "timeout": 0, "protocol": 0, "other": 0}
    assert stats["fallback_active"] is False


def test_a_chain_query_is_one_round_trip_whatever_the_chain_length(
        redis_server: RedisServer, links: Any) -> None:
    link, raw = links.link(redis_server.url), links.raw(redis_server.url)
    index = links.index(link)
    chain = [f"{i:016x}" for i in range(128)]
    index.apply_chain("a", CACHE_CREATED, [(k, 16 * (i + 1)) for i, k in enumerate(chain)])
    index.apply_chain("b", CACHE_CREATED, [(k, 16 * (i + 1)) for i, k in enumerate(chain[:40])])
    index.apply("c", CACHE_CREATED, P1, 300)  # the seed key only
    index.query_chain(chain[:1])  # loads the script: EVALSHA from here on
    trips = count_round_trips(link)
    for length in (1, 16, 128):
        before = command_calls(raw)
        found = index.query_chain(chain[:length], P1)
        after = command_calls(raw)
        assert delta(before, after).get("evalsha") == 1
        expected = {"a": (length, 16 * length), "b": (min(length, 40), 16 * min(length, 40)),
                    "c": (0, 300)}
        assert {m.backend: (m.depth, m.token_count) for m in found} == expected
        assert [m.token_count for m in found] == sorted(
            (tokens for _, tokens in expected.values()), reverse=True)
    assert trips == ["kv_query"] * 3
    index.clear()


def test_an_event_with_its_chain_groups_is_one_round_trip(redis_server: RedisServer,
                                                          links: Any) -> None:
    link, raw = links.link(redis_server.url), links.raw(redis_server.url)
    index = links.index(link)
    chain = [f"{i:016x}" for i in range(6)]
    index.apply_chain("a", CACHE_CREATED, [(chain[0], 16)])  # loads the script
    trips = count_round_trips(link)
    before = command_calls(raw)
    index.apply_event("a", CACHE_CREATED, P1, 96, [
        (CACHE_CREATED, [(k, 16 * (i + 1)) for i, k in enumerate(chain)]),
        (CACHE_EVICTED, [(chain[5], 0)])])
    after = command_calls(raw)
    assert trips == ["kv_apply"]
    calls = delta(before, after)
    assert (calls["multi"], calls["exec"], calls["evalsha"]) == (1, 1, 2)
    assert [(m.backend, m.depth, m.token_count) for m in index.query_chain(chain, P1)] == [
        ("a", 5, 80)]
    assert [(h.backend, h.token_count) for h in index.query_backends(P1)] == [("a", 96)]
    # a seed key's demotion (offloading on) still takes its script: two round trips
    warm = links.index(link, storage_offloading=True)
    warm.apply("a", CACHE_CREATED, P2, 10)
    trips.clear()
    warm.apply_event("a", CACHE_EVICTED, P2, 0, [(CACHE_EVICTED, [(chain[0], 0)])])
    assert trips == ["kv_apply", "kv_apply"]
    assert [(h.backend, h.tier) for h in warm.query_backends(P2)] == [("a", TIER_STORAGE_WARM)]
    index.clear()
    warm.clear()


def test_an_event_after_a_script_flush_loads_the_script_and_loses_nothing(
        redis_server: RedisServer, links: Any) -> None:
    link, raw = links.link(redis_server.url), links.raw(redis_server.url)
    index = links.index(link)
    chain = [f"{i:016x}" for i in range(3)]
    index.apply_chain("a", CACHE_CREATED, [(chain[0], 16)])
    raw.script_flush()  # a restarted server, or SCRIPT FLUSH
    index.apply_event("b", CACHE_CREATED, P1, 48,
                      [(CACHE_CREATED, [(k, 16 * (i + 1)) for i, k in enumerate(chain)])])
    assert [(m.backend, m.depth) for m in index.query_chain(chain, P1)] == [
        ("b", 3), ("a", 1)]
    assert [h.backend for h in index.query_backends(P1)] == ["b"]
    index.clear()


def test_an_event_while_redis_is_down_lands_in_the_fallback(fresh_redis: RedisServer,
                                                            links: Any) -> None:
    link = links.link(fresh_redis.url)
    index = links.index(link)
    chain = [f"{i:016x}" for i in range(2)]
    fresh_redis.stop()
    index.apply_event("a", CACHE_CREATED, P1, 32, [(CACHE_CREATED, [(chain[0], 16),
                                                                    (chain[1], 32)])])
    assert link.fallback_active is True  # the refused transaction flipped the link
    assert [(m.backend, m.depth) for m in index.query_chain(chain, P1)] == [("a", 2)]
    assert [h.token_count for h in index.query_backends(P1)] == [32]
    assert index.stats()["events"][CACHE_CREATED] == 2  # the event and its one group
    assert index.clear() == 3


def test_a_bad_chain_group_refuses_the_whole_event(redis_server: RedisServer,
                                                  links: Any) -> None:
    index = links.index(links.link(redis_server.url))
    with pytest.raises(ValueError, match="token_count"):
        index.apply_event("a", CACHE_CREATED, P1, 10, [(CACHE_CREATED, [("0" * 16, -1)])])
    with pytest.raises(ValueError, match="event"):
        index.apply_event("a", CACHE_CREATED, P1, 10, [("cache_exploded", [])])
    assert index.query_backends(P1) is EMPTY  # the seed key was not written either
    assert index.stats()["events"][CACHE_CREATED] == 0


class TestStartedRedisKvContract(StartedIndexCases, TestRedisKvContract):
    """The same contract on a started index (as in a worker): approximate records go
    through the writer greenlet, and the index still answers as if written at once."""


def _routed(index: RedisKvIndex, backend: str, chain: list[str], ttl: float = 60) -> None:
    index.apply_chain(backend, CACHE_CREATED, [(k, 16 * (i + 1)) for i, k in enumerate(chain)],
                      ttl=ttl)


def test_routed_records_are_written_off_the_callers_path_in_one_pipeline(
        redis_server: RedisServer, links: Any) -> None:
    """A started index queues routed (approximate) records and writes them from a greenlet,
    all queued ones in one round trip; the other routers see them once it has run."""
    import gevent

    prefix = unique_prefix("apx")
    link = links.link(redis_server.url)
    index = links.index(link, prefix)
    other = links.index(links.link(redis_server.url), prefix)  # another worker or router
    index.start()
    chains = [[f"{c:02x}{i:014x}" for i in range(3)] for c in range(10)]
    trips = count_round_trips(link)
    for chain in chains:
        _routed(index, "a", chain)
    assert trips == []  # nothing on the caller's path
    assert index.stats()["approximate_pending"] == 10
    gevent.sleep(0)  # the hub runs the writer: the request would be waiting on its backend
    assert trips == ["kv_apply"]
    assert index.stats()["approximate_pending"] == 0
    for chain in chains:
        assert [(m.backend, m.depth, m.approximate) for m in other.query_chain(chain)] == [
            ("a", 3, True)]
    index.clear()


def test_own_queries_see_queued_records_and_repeats_are_not_resent(
        redis_server: RedisServer, links: Any) -> None:
    link, raw = links.link(redis_server.url), links.raw(redis_server.url)
    index = links.index(link)
    index.start()
    chain = [f"{i:016x}" for i in range(4)]
    raw.script_flush()  # a server that lost the scripts: loaded again on the way
    trips = count_round_trips(link)
    _routed(index, "a", chain[:2])
    # The query sends the queue first, in its own round trip: a worker always sees what
    # it recorded.
    assert [(m.backend, m.depth) for m in index.query_chain(chain)] == [("a", 2)]
    assert trips == ["kv_query"]
    before = command_calls(raw)
    _routed(index, "a", chain)  # the first two keys were recorded a moment ago
    index.flush()
    after = command_calls(raw)
    assert delta(before, after)["hget"] == 2  # the script read only the two new keys
    assert [(m.backend, m.depth) for m in index.query_chain(chain)] == [("a", 4)]
    _routed(index, "a", chain)  # nothing new: nothing queued
    assert index.stats()["approximate_pending"] == 0
    # An event on a key makes the next record of it go out again.
    index.apply_chain("a", CACHE_EVICTED, [(chain[3], 0)])
    assert [(m.backend, m.depth) for m in index.query_chain(chain)] == [("a", 3)]
    _routed(index, "a", chain)
    assert index.stats()["approximate_pending"] == 1
    assert [(m.backend, m.depth) for m in index.query_chain(chain)] == [("a", 4)]
    index.clear()


def test_queued_records_land_in_the_fallback_when_redis_goes(fresh_redis: RedisServer,
                                                             links: Any) -> None:
    link = links.link(fresh_redis.url, probe_interval_seconds=60)
    index = links.index(link)
    index.start()
    chain = [f"{i:016x}" for i in range(3)]
    _routed(index, "a", chain)
    fresh_redis.stop()
    index.flush()  # never raises: Redis is unreachable, the records go to the fallback
    assert link.fallback_active
    assert [(m.backend, m.depth, m.approximate) for m in index.query_chain(chain)] == [
        ("a", 3, True)]


def test_the_queue_is_bounded(redis_server: RedisServer, links: Any) -> None:
    """Records queued faster than the writer runs: the oldest go beyond ``MAX_PENDING``."""
    import gevent

    from stores.kv_redis import MAX_PENDING

    index = links.index(links.link(redis_server.url))
    index.start()
    for i in range(MAX_PENDING + 5):  # no hub switch meanwhile: the writer cannot run
        _routed(index, "a", [f"{i:016x}"])
    stats = index.stats()
    assert (stats["approximate_pending"], stats["approximate_dropped"]) == (MAX_PENDING, 5)
    gevent.sleep(0)
    assert index.stats()["approximate_pending"] == 0
    assert index.query_chain([f"{4:016x}"]) == ()  # dropped
    assert [m.depth for m in index.query_chain([f"{5:016x}"])] == [1]
    index.clear()
