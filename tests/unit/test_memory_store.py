"""InMemoryCacheStore: the shared store contract, LRU order, TTLs on a fake clock, threads."""

from __future__ import annotations

import threading
from dataclasses import replace

import pytest
from prometheus_client import CollectorRegistry

from continuum.config import RouterConfig
from continuum.interfaces import CacheStore
from continuum.metrics import RouterMetrics
from continuum.registry import PluginRegistry
from continuum.testing.stores import CacheStoreCases
from stores.memory import InMemoryCacheStore
from stores.redis_store import RedisCacheStore


class FakeClock:
    """A monotonic clock that moves only when told to."""

    def __init__(self, now: float = 1000.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds


class TestInMemoryContract(CacheStoreCases):
    """The contract every store meets, on a fake clock (no sleeping); an in-memory store
    has no foreign keys and no backing service to break."""

    @pytest.fixture(autouse=True)
    def _clock(self) -> None:
        self.clock = FakeClock()

    def make_store(self) -> CacheStore:
        return InMemoryCacheStore(capacity=100, clock=self.clock)

    def advance(self, seconds: float) -> None:
        self.clock.advance(seconds)


@pytest.fixture
def clock() -> FakeClock:
    return FakeClock()


def test_registered_under_the_config_names() -> None:
    registry = PluginRegistry()
    assert registry.load("continuum.cache_stores", "memory") is InMemoryCacheStore
    assert registry.load("continuum.cache_stores", "redis") is RedisCacheStore


def test_from_config_uses_response_cache_capacity() -> None:
    config = RouterConfig()
    store = InMemoryCacheStore.from_config(config, resources=None, other="ignored")
    assert isinstance(store, InMemoryCacheStore)
    assert store.capacity == config.response_cache.capacity


def test_reload_resizes_in_place_and_keeps_the_store(clock: FakeClock) -> None:
    config = RouterConfig()
    store = InMemoryCacheStore(4, clock=clock)
    for key in "abcd":
        store.set(key, key.encode(), 60)
    store.get("a")  # the most recent now: kept by the shrink
    assert store.reconfigure(config) is None  # capacity 1000: grown, nothing replaced
    assert (store.capacity, store.stats().entries) == (1000, 4)
    smaller = replace(config, response_cache=replace(config.response_cache, capacity=2))
    assert store.reconfigure(smaller) is None
    assert store.capacity == 2
    assert [k for k in "abcd" if store.get(k) is not None] == ["a", "d"]


def test_least_recently_used_is_evicted_first(clock: FakeClock) -> None:
    store = InMemoryCacheStore(capacity=3, clock=clock)
    for key in "abc":
        store.set(key, key.encode(), 60)
    assert store.get("a") == b"a"  # a is now the most recent; b the least
    store.set("d", b"d", 60)
    assert store.keys_by_recency() == ["c", "a", "d"]
    assert store.get("b") is None
    assert store.stats().evictions == 1


def test_overwrite_refreshes_recency_without_evicting(clock: FakeClock) -> None:
    store = InMemoryCacheStore(capacity=2, clock=clock)
    store.set("a", b"1", 60)
    store.set("b", b"2", 60)
    store.set("a", b"3", 60)
    assert store.keys_by_recency() == ["b", "a"]
    assert store.stats().evictions == 0


def test_never_holds_more_than_capacity(clock: FakeClock) -> None:
    store = InMemoryCacheStore(capacity=5, clock=clock)
    for i in range(50):
        store.set(f"k{i}", b"x" * i, 60)
    stats = store.stats()
    assert stats.entries == 5
    assert stats.evictions == 45
    assert stats.size_bytes == sum(range(45, 50))
    assert store.keys_by_recency() == [f"k{i}" for i in range(45, 50)]


def test_expiry_is_exact_on_the_clock(clock: FakeClock) -> None:
    store = InMemoryCacheStore(capacity=10, clock=clock)
    store.set("k", b"v", 10)
    clock.advance(9.999)
    assert store.get("k") == b"v"
    clock.advance(0.001)
    assert store.get("k") is None
    stats = store.stats()
    assert stats.entries == 0
    assert stats.extra == {"expired": 1}


def test_expired_entries_go_before_any_live_one_is_evicted(clock: FakeClock) -> None:
    store = InMemoryCacheStore(capacity=3, clock=clock)
    store.set("old-live", b"1", 100)
    store.set("short-1", b"2", 1)
    store.set("short-2", b"3", 1)
    clock.advance(2)
    store.set("new", b"4", 100)
    # Both expired entries were dropped; the least recently used live one survived.
    assert store.keys_by_recency() == ["old-live", "new"]
    assert store.stats().evictions == 0
    assert store.stats().extra == {"expired": 2}


def test_stale_expiry_records_do_not_remove_refreshed_entries(clock: FakeClock) -> None:
    store = InMemoryCacheStore(capacity=2, clock=clock)
    store.set("a", b"1", 1)
    store.set("b", b"3", 100)
    store.set("a", b"2", 100)  # the first expiry record of "a" is now stale
    clock.advance(5)
    store.set("c", b"4", 100)  # full: purging must not take the refreshed "a"
    assert store.get("b") is None  # LRU took b instead
    assert store.get("a") == b"2"


def test_expiry_heap_stays_bounded(clock: FakeClock) -> None:
    store = InMemoryCacheStore(capacity=10, clock=clock)
    for i in range(10_000):
        store.set(f"k{i % 10}", b"v", 60)
    assert len(store._expiries) <= 2 * len(store) + 64


def test_max_ttl_caps_entries(clock: FakeClock) -> None:
    store = InMemoryCacheStore(capacity=10, max_ttl=5, clock=clock)
    store.set("k", b"v", 3600)
    clock.advance(5)
    assert store.get("k") is None


def test_size_bytes_follows_values(clock: FakeClock) -> None:
    store = InMemoryCacheStore(capacity=10, clock=clock)
    store.set("a", b"12345", 60)
    store.set("b", b"12", 60)
    store.set("a", b"1", 60)
    store.delete("b")
    assert store.stats().size_bytes == 1
    store.clear()
    assert store.stats().size_bytes == 0


def test_buffer_values_are_copied(clock: FakeClock) -> None:
    store = InMemoryCacheStore(capacity=10, clock=clock)
    buf = bytearray(b"abc")
    store.set("k", buf, 60)  # type: ignore[arg-type]
    buf[0] = ord("z")
    assert store.get("k") == b"abc"


def test_clear_counts_only_live_entries(clock: FakeClock) -> None:
    store = InMemoryCacheStore(capacity=10, clock=clock)
    store.set("short", b"1", 1)
    store.set("long", b"2", 100)
    clock.advance(2)
    assert store.clear() == 1
    assert len(store) == 0


@pytest.mark.parametrize(("capacity", "max_ttl"), [(0, None), (1, 0.0), (1, -1.0)])
def test_rejects_bad_settings(capacity: int, max_ttl: float | None) -> None:
    with pytest.raises(ValueError):
        InMemoryCacheStore(capacity=capacity, max_ttl=max_ttl)


def test_metrics_follow_entries_and_evictions(clock: FakeClock) -> None:
    metrics = RouterMetrics(CollectorRegistry())
    store = InMemoryCacheStore(capacity=2, clock=clock, metrics=metrics)

    def sample(name: str) -> float | None:
        return metrics.registry.get_sample_value(name)

    for key in "abc":
        store.set(key, b"v", 60)
    assert sample("continuum_response_cache_entries") == 2
    assert sample("continuum_response_cache_evictions_total") == 1
    store.delete("c")
    assert sample("continuum_response_cache_entries") == 1
    store.clear()
    assert sample("continuum_response_cache_entries") == 0


def test_threads_keep_the_invariants() -> None:
    capacity, threads, rounds = 50, 8, 2000
    store = InMemoryCacheStore(capacity=capacity)
    errors: list[BaseException] = []
    start = threading.Barrier(threads)

    def work(n: int) -> None:
        try:
            start.wait()
            for i in range(rounds):
                key = f"k{(i * 7 + n) % (capacity * 2)}"
                value = key.encode()
                store.set(key, value, 60)
                got = store.get(key)
                assert got is None or got == value  # never another key's value
                if i % 50 == 0:
                    store.delete(key)
        except BaseException as exc:  # surfaced below, in the test thread
            errors.append(exc)

    workers = [threading.Thread(target=work, args=(n,)) for n in range(threads)]
    for worker in workers:
        worker.start()
    for worker in workers:
        worker.join()
    assert errors == []
    stats = store.stats()
    assert stats.entries == len(store.keys_by_recency()) <= capacity
    assert stats.hits + stats.misses == threads * rounds
    assert stats.size_bytes == sum(len(store.get(key) or b"") for key in store.keys_by_recency())
    for key in store.keys_by_recency():
        assert store.get(key) == key.encode()
