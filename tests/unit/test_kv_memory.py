"""InMemoryKvIndex: the KV index contract, capacity eviction, TTLs on a fake clock, threads."""

from __future__ import annotations

import random
import threading

import gevent
import pytest

from continuum.config import RouterConfig
from continuum.interfaces import (
    CACHE_CLEARED,
    CACHE_CREATED,
    CACHE_EVICTED,
    CACHE_OFFLOADED,
    TIER_GPU_HOT,
    TIER_STORAGE_WARM,
    KvCacheIndex,
)
from continuum.registry import PluginRegistry
from continuum.testing import KvIndexContract
from stores.kv_memory import EMPTY, InMemoryKvIndex
from stores.kv_redis import RedisKvIndex


class FakeClock:
    """A clock that moves only when told to."""

    def __init__(self, now: float = 1_700_000_000.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds


class TestInMemoryKvContract(KvIndexContract):
    """The contract every KV index meets, on a fake clock (no sleeping)."""

    @pytest.fixture(autouse=True)
    def _clock(self) -> None:
        self.clock = FakeClock()

    def make_index(self, *, storage_offloading: bool = False,
                   treat_eviction_as_offload: bool = True, ttl: int = 600) -> KvCacheIndex:
        return InMemoryKvIndex(1000, ttl, storage_offloading=storage_offloading,
                               treat_eviction_as_offload=treat_eviction_as_offload,
                               clock=self.clock)

    def advance(self, seconds: float) -> None:
        self.clock.advance(seconds)


@pytest.fixture
def clock() -> FakeClock:
    return FakeClock()


def prefix(i: int) -> str:
    return f"{i:064x}"


def check_invariants(index: InMemoryKvIndex) -> None:
    """The invariants of the module docstring, checked the slow way."""
    prefixes = index._prefixes
    assert len(prefixes) <= index.max_entries
    by_backend: dict[str, set[str]] = {}
    tiers = {TIER_GPU_HOT: 0, TIER_STORAGE_WARM: 0}
    entries = 0
    last_touched = float("-inf")
    for prefix_hash, entry in prefixes.items():
        assert entry.holdings, "no empty prefixes"
        assert entry.touched >= max(h.updated_at for h in entry.holdings.values())
        assert entry.touched >= last_touched
        last_touched = entry.touched
        for backend, holding in entry.holdings.items():
            assert holding.backend == backend
            by_backend.setdefault(backend, set()).add(prefix_hash)
            tiers[holding.tier] += 1
            entries += 1
        if entry.ranked is not None:
            assert set(entry.ranked) == set(entry.holdings.values())
    assert by_backend == index._by_backend
    assert tiers == index._tiers
    assert entries == index._entries


def test_registered_under_the_config_names() -> None:
    registry = PluginRegistry()
    assert registry.load("continuum.kv_indexes", "memory") is InMemoryKvIndex
    assert registry.load("continuum.kv_indexes", "redis") is RedisKvIndex


def test_from_config_uses_kv_cache_index() -> None:
    index = InMemoryKvIndex.from_config(RouterConfig(), resources=None, metrics=None, other=1)
    assert isinstance(index, InMemoryKvIndex)
    assert (index.max_entries, index.entry_ttl_seconds) == (100_000, 600)
    assert index.storage_offloading is False
    assert index.sweep_interval == 60


@pytest.mark.parametrize(("settings", "message"), [
    ({"max_entries": 0}, "max_entries"), ({"entry_ttl_seconds": 0}, "entry_ttl_seconds")])
def test_bad_settings_are_refused(settings: dict[str, int], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        InMemoryKvIndex(**settings)


def test_unknown_prefix_returns_the_shared_empty_tuple(clock: FakeClock) -> None:
    index = InMemoryKvIndex(clock=clock)
    assert index.query_backends(prefix(1)) is EMPTY
    index.apply("a", CACHE_CREATED, prefix(1), 10)
    index.apply("a", CACHE_EVICTED, prefix(1))
    assert index.query_backends(prefix(1)) is EMPTY
    index.apply("a", CACHE_CREATED, prefix(2), 10)
    clock.advance(601)
    assert index.query_backends(prefix(2)) is EMPTY  # expired on the way
    check_invariants(index)


def test_a_repeated_query_returns_the_same_ranking(clock: FakeClock) -> None:
    index = InMemoryKvIndex(clock=clock)
    for backend, tokens in [("a", 1), ("b", 3), ("c", 2)]:
        index.apply(backend, CACHE_CREATED, prefix(1), tokens)
    first = index.query_backends(prefix(1))
    assert index.query_backends(prefix(1)) is first  # cached until the next event
    index.apply("a", CACHE_CREATED, prefix(1), 9)
    assert [h.backend for h in index.query_backends(prefix(1))] == ["a", "b", "c"]


def test_full_index_evicts_the_least_recently_updated_tenth(clock: FakeClock) -> None:
    index = InMemoryKvIndex(max_entries=100, clock=clock)
    for i in range(100):
        index.apply("a", CACHE_CREATED, prefix(i), 10)
        if i < 5:
            index.apply("b", CACHE_CREATED, prefix(i), 10)
        clock.advance(1)
    index.apply("c", CACHE_CREATED, prefix(0), 20)  # an update makes prefix 0 the newest
    index.apply("a", CACHE_EVICTED, prefix(1))  # a removal does not refresh prefix 1
    index.query_backends(prefix(2))  # nor does a query refresh prefix 2
    index.apply("a", CACHE_CREATED, prefix(100), 10)
    assert len(index) == 91
    gone = [i for i in range(101) if not index.query_backends(prefix(i))]
    assert gone == list(range(1, 11))
    stats = index.stats()
    # prefix 1 held only b (1 entry), 2..4 held a and b (6), 5..10 held a (6)
    assert stats["total_evictions"] == 13
    assert stats["expired"] == 0
    check_invariants(index)


def test_tiny_index_still_evicts_one(clock: FakeClock) -> None:
    index = InMemoryKvIndex(max_entries=3, clock=clock)
    for i in range(5):
        index.apply("a", CACHE_CREATED, prefix(i), 1)
    assert [i for i in range(5) if index.query_backends(prefix(i))] == [2, 3, 4]


def test_expired_holders_are_dropped_lazily_by_a_query(clock: FakeClock) -> None:
    index = InMemoryKvIndex(entry_ttl_seconds=10, clock=clock)
    index.apply("old", CACHE_CREATED, prefix(1), 500)
    clock.advance(6)
    index.apply("new", CACHE_CREATED, prefix(1), 100)
    clock.advance(5)  # "old" is 11 s old, "new" 5 s
    assert index.stats()["entry_count"] == 2  # nothing happens until someone looks
    assert [h.backend for h in index.query_backends(prefix(1))] == ["new"]
    stats = index.stats()
    assert (stats["entry_count"], stats["expired"], stats["total_evictions"]) == (1, 1, 1)
    assert stats["total_hits"] == 1
    check_invariants(index)


def test_an_event_refreshes_only_its_own_entry(clock: FakeClock) -> None:
    index = InMemoryKvIndex(entry_ttl_seconds=10, storage_offloading=True, clock=clock)
    index.apply("a", CACHE_CREATED, prefix(1), 10)
    index.apply("b", CACHE_CREATED, prefix(1), 10)
    clock.advance(8)
    index.apply("a", CACHE_OFFLOADED, prefix(1))
    clock.advance(8)
    assert [(h.backend, h.tier) for h in index.query_backends(prefix(1))] == [
        ("a", TIER_STORAGE_WARM)]
    clock.advance(10)
    index.apply("a", CACHE_EVICTED, prefix(1))  # expired GpuHot? no: expired means absent
    assert index.query_backends(prefix(1)) is EMPTY
    check_invariants(index)


def test_cleanup_expired_sweeps_from_the_oldest_and_stops_at_a_fresh_prefix(
        clock: FakeClock) -> None:
    index = InMemoryKvIndex(entry_ttl_seconds=100, clock=clock)
    for i in range(2500):  # more than one sweep batch
        index.apply("a", CACHE_CREATED, prefix(i), 1)
        index.apply("b", CACHE_CREATED, prefix(i), 1)
    clock.advance(50)
    index.apply("a", CACHE_CREATED, prefix(5000), 1)
    index.apply("a", CACHE_CREATED, prefix(7), 1)  # refreshed: now the newest
    clock.advance(60)
    yields: list[None] = []
    assert index.cleanup_expired(yield_between=lambda: yields.append(None)) == 4998
    assert len(yields) == 2
    assert sorted(index._prefixes) == sorted([prefix(5000), prefix(7)])
    # prefix 7's "b" is expired but its prefix is fresh: left for a query to drop
    assert index.stats()["entry_count"] == 3
    assert [h.backend for h in index.query_backends(prefix(7))] == ["a"]
    assert index.stats()["expired"] == 4999
    assert index.cleanup_expired() == 0
    check_invariants(index)


def test_start_sweeps_in_the_background() -> None:
    clock = FakeClock()
    index = InMemoryKvIndex(entry_ttl_seconds=10, clock=clock, sweep_interval=0.01)
    index.apply("a", CACHE_CREATED, prefix(1), 1)
    index.start()
    try:
        clock.advance(11)
        for _ in range(500):
            if not len(index):
                break
            gevent.sleep(0.01)
        assert len(index) == 0
        assert index.stats()["expired"] == 1
    finally:
        index.close()
    assert index._greenlet is None


def test_cache_cleared_walks_only_that_backend(clock: FakeClock) -> None:
    index = InMemoryKvIndex(clock=clock)
    for i in range(50):
        index.apply("big", CACHE_CREATED, prefix(i), 1)
    index.apply("small", CACHE_CREATED, prefix(1), 1)
    index.apply("small", CACHE_CREATED, prefix(99), 1)
    index.apply("small", CACHE_CLEARED, "")
    assert "small" not in index._by_backend
    assert len(index) == 50
    assert index.stats()["events"] == {CACHE_CREATED: 52, CACHE_EVICTED: 0,
                                       CACHE_OFFLOADED: 0, CACHE_CLEARED: 1}
    check_invariants(index)


def test_stats_count_tiers(clock: FakeClock) -> None:
    index = InMemoryKvIndex(storage_offloading=True, clock=clock)
    index.apply("a", CACHE_CREATED, prefix(1), 1)
    index.apply("b", CACHE_CREATED, prefix(1), 1)
    index.apply("b", CACHE_EVICTED, prefix(1))
    index.apply("c", CACHE_OFFLOADED, prefix(2), 1)
    assert index.stats()["tiers"] == {TIER_GPU_HOT: 1, TIER_STORAGE_WARM: 2}
    assert index.clear() == 3
    assert index.stats()["tiers"] == {TIER_GPU_HOT: 0, TIER_STORAGE_WARM: 0}
    check_invariants(index)


def test_threads_applying_and_querying_keep_the_invariants() -> None:
    index = InMemoryKvIndex(max_entries=200, entry_ttl_seconds=3600, storage_offloading=True)
    events = [CACHE_CREATED] * 6 + [CACHE_EVICTED, CACHE_OFFLOADED]
    errors: list[BaseException] = []
    start = threading.Barrier(8)

    def writer(seed: int) -> None:
        rng = random.Random(seed)
        backend = f"backend-{seed}"
        try:
            start.wait()
            for n in range(4000):
                if n % 1000 == 999:
                    index.apply(backend, CACHE_CLEARED, "")
                else:
                    index.apply(backend, rng.choice(events), prefix(rng.randrange(400)),
                                rng.randrange(1, 4096))
        except BaseException as exc:  # pragma: no cover - reported below
            errors.append(exc)

    def reader(seed: int) -> None:
        rng = random.Random(seed)
        try:
            start.wait()
            for _ in range(8000):
                holdings = index.query_backends(prefix(rng.randrange(400)))
                ranks = [(-h.token_count, h.backend) for h in holdings]
                assert ranks == sorted(ranks)
                assert len({h.backend for h in holdings}) == len(holdings)
        except BaseException as exc:  # pragma: no cover - reported below
            errors.append(exc)

    threads = [threading.Thread(target=writer, args=(i,)) for i in range(5)]
    threads += [threading.Thread(target=reader, args=(100 + i,)) for i in range(3)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert errors == []
    check_invariants(index)
    stats = index.stats()
    assert sum(stats["events"].values()) == 5 * 4000
    assert stats["total_evictions"] > 0  # 400 prefixes into 200 slots
    assert index.clear() == stats["entry_count"]
