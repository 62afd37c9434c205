"""RedisCacheStore against a real redis-server: the store contract, namespacing, fallback."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import replace
from typing import Any

import pytest
import redis
from prometheus_client import CollectorRegistry

from continuum.config import RouterConfig, parse_config
from continuum.devtools.procs import refused_port, wait_until
from continuum.devtools.redis_server import RedisServer, unique_prefix
from continuum.errors import StoreError
from continuum.interfaces import CACHE_CREATED, CacheStore
from continuum.metrics import RouterMetrics
from continuum.registry import PluginRegistry
from continuum.resources import WorkerResources
from continuum.service import RouterService
from continuum.testing import CacheStoreContract
from stores.kv_redis import RedisKvIndex
from stores.redis_link import RedisLink
from stores.redis_store import RedisCacheStore, glob_escape

pytestmark = pytest.mark.redis


def store_on(link: RedisLink, prefix: str | None = None, **settings: Any) -> RedisCacheStore:
    prefix = unique_prefix() if prefix is None else prefix
    return RedisCacheStore(link, replace(link.config, key_prefix=prefix, **settings))


class TestRedisContract(CacheStoreContract):
    """The contract every store meets, on the session's redis-server."""

    @pytest.fixture(autouse=True)
    def _redis(self, redis_server: RedisServer, links: Any) -> Iterator[None]:
        self.links = links
        self.link = links.link(redis_server.url)
        self.raw = links.raw(redis_server.url)
        self.foreign: list[str] = []
        yield
        if self.foreign:
            self.raw.delete(*self.foreign)

    def make_store(self) -> CacheStore:
        return store_on(self.link)

    def put_foreign(self, key: str, value: bytes) -> None:
        key = unique_prefix("foreign") + key
        self.foreign.append(key)
        self.raw.set(key, value, ex=600)

    def get_foreign(self, key: str) -> bytes | None:
        matches = [k for k in self.foreign if k.endswith(key)]
        return self.raw.get(matches[-1]) if matches else None  # type: ignore[return-value]

    def make_broken_store(self) -> CacheStore:
        # Nothing listens there: every command is refused; without a memory fallback the
        # store degrades to misses and no-ops.
        dead = self.links.link(f"redis://127.0.0.1:{refused_port()}/0")
        return store_on(dead, fallback_to_memory=False)


class RecordingClient:
    """Stands in for ``redis.Redis`` inside a link: records calls, raises on demand."""

    def __init__(self, error: Exception | None = None) -> None:
        self.calls: list[tuple[str, tuple[Any, ...], dict[str, Any]]] = []
        self.error = error

    def __getattr__(self, name: str) -> Callable[..., Any]:
        def command(*args: Any, **kwargs: Any) -> Any:
            self.calls.append((name, args, kwargs))
            if self.error is not None:
                raise self.error
            return (0, []) if name == "scan" else None

        return command


@pytest.mark.parametrize(("ttl", "seconds"), [(0.2, 1), (1, 1), (1.01, 2), (59.5, 60)])
def test_set_uses_ex_rounded_up_to_whole_seconds(links: Any, ttl: float,
                                                  seconds: int) -> None:
    link = links.link("redis://127.0.0.1:1/0")  # never dialled: the client is replaced
    client = RecordingClient()
    link.client = client  # type: ignore[assignment]
    store = store_on(link, prefix="cr:resp:")
    store.set("abc", b"v", ttl)
    assert client.calls == [("set", ("cr:resp:abc", b"v"), {"ex": seconds})]


@pytest.mark.parametrize("error", [redis.ResponseError("WRONGTYPE"), redis.DataError("x"),
                                   redis.ConnectionError("gone"), redis.TimeoutError("slow")])
def test_no_redis_exception_escapes(links: Any, error: Exception) -> None:
    link = links.link("redis://127.0.0.1:1/0")
    link.client = RecordingClient(error)  # type: ignore[assignment]
    store = store_on(link)
    for operation in (lambda: store.get("k"), lambda: store.set("k", b"v", 5),
                      lambda: store.delete("k"), store.clear):
        try:
            operation()
        except StoreError as exc:
            assert exc.kind == "other"
            assert exc.__cause__ is None  # callers never see (or import) redis
    unreachable = isinstance(error, (redis.ConnectionError, redis.TimeoutError))
    assert link.fallback_active is unreachable


def test_keys_live_under_the_prefix(redis_server: RedisServer, links: Any) -> None:
    link, raw = links.link(redis_server.url), links.raw(redis_server.url)
    prefix = unique_prefix()
    store = store_on(link, prefix)
    store.set("abc", b"\xffgarbage\x00", 60)
    assert raw.get(prefix + "abc") == b"\xffgarbage\x00"
    assert 0 < raw.pttl(prefix + "abc") <= 60_000
    store.delete("abc")
    assert raw.exists(prefix + "abc") == 0


def test_clear_touches_only_its_own_prefix(redis_server: RedisServer, links: Any) -> None:
    link, raw = links.link(redis_server.url), links.raw(redis_server.url)
    base = unique_prefix()
    mine = store_on(link, base + "a:")
    sibling = store_on(link, base + "ab:")  # shares the leading text, not the namespace
    foreign = base + "other:key"
    raw.set(foreign, b"theirs", ex=600)
    for i in range(1234):  # more than one SCAN batch
        mine.set(f"k{i}", b"v", 600)
    sibling.set("k0", b"sibling", 600)
    try:
        assert mine.clear() == 1234
        assert raw.get(foreign) == b"theirs"
        assert sibling.get("k0") == b"sibling"
        assert list(raw.scan_iter(match=glob_escape(base + "a:") + "*")) == []
    finally:
        sibling.clear()
        raw.delete(foreign)


def test_glob_characters_in_the_prefix_match_only_themselves(redis_server: RedisServer,
                                                             links: Any) -> None:
    link, raw = links.link(redis_server.url), links.raw(redis_server.url)
    base = unique_prefix()
    store = store_on(link, base + "*?[x]\\:")
    lookalike = base + "zz:k"  # an unescaped "<base>*…" pattern would match this
    raw.set(lookalike, b"theirs", ex=600)
    try:
        store.set("k", b"mine", 600)
        assert store.clear() == 1
        assert raw.get(lookalike) == b"theirs"
    finally:
        raw.delete(lookalike)


def test_stores_on_one_link_share_its_pool(redis_server: RedisServer, links: Any) -> None:
    link = links.link(redis_server.url)
    first, second = store_on(link), store_on(link)
    assert first.link.pool is second.link.pool is link.pool
    for i in range(20):
        first.set(f"k{i}", b"1", 60)
        second.set(f"k{i}", b"2", 60)
        assert first.get(f"k{i}") == b"1"
    connections = first.stats().extra["connections"]  # type: ignore[index]
    assert connections == {"active": 0, "idle": 1}  # sequential use: one connection
    first.clear()
    second.clear()


def test_error_reply_is_a_store_error_not_a_fallback(redis_server: RedisServer,
                                                     links: Any) -> None:
    link, raw = links.link(redis_server.url), links.raw(redis_server.url)
    store = store_on(link)
    raw.lpush(store.full_key("list"), b"x")  # GET on a list: WRONGTYPE
    with pytest.raises(StoreError) as caught:
        store.get("list")
    assert caught.value.kind == "other"
    assert caught.value.store == "redis"
    assert link.errors == {"connection": 0, "timeout": 0, "protocol": 0, "other": 1}
    assert link.fallback_active is False
    assert store.clear() == 1


def test_fallback_while_redis_is_down(fresh_redis: RedisServer, links: Any) -> None:
    metrics = RouterMetrics(CollectorRegistry())
    link = links.link(fresh_redis.url, metrics)
    store = store_on(link)

    def fallback_gauge() -> float | None:
        return metrics.registry.get_sample_value("continuum_cache_fallback_active")

    store.set("before", b"in redis", 60)
    assert store.get("before") == b"in redis"
    assert fallback_gauge() == 0

    fresh_redis.stop()
    store.set("during", b"in memory", 60)  # refused: the link falls back, memory serves
    assert link.fallback_active is True
    assert fallback_gauge() == 1
    assert link.errors["connection"] == 1
    assert store.get("during") == b"in memory"
    assert store.get("before") is None  # Redis's entries are out of reach
    stats = store.stats()
    assert stats.extra is not None
    assert stats.extra["fallback_active"] is True
    assert stats.extra["fallback_entries"] == 1
    assert link.probe() is False

    fresh_redis.start()  # same port, empty (no persistence)
    assert link.probe() is True
    assert link.fallback_active is False
    assert fallback_gauge() == 0
    assert store.stats().extra["fallback_entries"] == 0  # type: ignore[index]
    assert store.get("during") is None  # Redis never saw it; the fallback was dropped
    store.set("after", b"in redis again", 60)
    assert links.raw(fresh_redis.url).get(store.full_key("after")) == b"in redis again"


def test_first_failed_get_serves_from_the_fallback(fresh_redis: RedisServer,
                                                   links: Any) -> None:
    link = links.link(fresh_redis.url)
    store = store_on(link)
    fresh_redis.stop()
    assert store.get("k") is None  # refused → fallback → a miss, not an error
    assert link.fallback_active is True
    store.delete("k")
    assert store.clear() == 0
    assert store.stats().misses == 1


def test_without_memory_fallback_an_outage_is_misses_and_no_ops(fresh_redis: RedisServer,
                                                                links: Any) -> None:
    link = links.link(fresh_redis.url)
    store = store_on(link, fallback_to_memory=False)
    fresh_redis.stop()
    store.set("k", b"v", 60)
    assert link.fallback_active is True
    assert store.get("k") is None
    store.delete("k")
    assert store.clear() == 0
    assert store.stats().extra["fallback_entries"] == 0  # type: ignore[index]


def test_a_timeout_counts_as_unreachable(fresh_redis: RedisServer, links: Any) -> None:
    link = links.link(fresh_redis.url, command_timeout_ms=100)
    store = store_on(link)
    store.set("k", b"v", 60)
    links.raw(fresh_redis.url).execute_command("CLIENT", "PAUSE", 1000, "ALL")
    assert store.get("k") is None  # the GET outwaits its 100 ms timeout
    assert link.errors["timeout"] == 1
    assert link.fallback_active is True
    wait_until(link.probe, "Redis to come back from CLIENT PAUSE", 10)
    assert store.get("k") == b"v"


def test_fallback_entries_are_capped_by_fallback_settings(fresh_redis: RedisServer,
                                                          links: Any) -> None:
    link = links.link(fresh_redis.url)
    store = store_on(link, fallback_capacity=2, fallback_ttl_seconds=7)
    fresh_redis.stop()
    for key in "abc":
        store.set(key, b"v", 3600)
    assert store.stats().extra["fallback_entries"] == 2  # type: ignore[index]
    assert store._fallback is not None
    assert store._fallback.max_ttl == 7


def test_from_config(redis_server: RedisServer) -> None:
    config = parse_config({"response_cache": {"backend": "redis",
                                              "redis": {"url": redis_server.url}}})
    with pytest.raises(ValueError, match="no worker resources"):
        RedisCacheStore.from_config(config)
    resources = WorkerResources()
    store = RedisCacheStore.from_config(config, resources=resources, metrics=None,
                                        unknown="ignored")
    assert isinstance(store, RedisCacheStore)
    assert store.key_prefix == "cr:resp:"
    assert store.full_key("ab12") == "cr:resp:ab12"
    assert store.reconfigure(config, resources=resources) is None  # same settings: kept
    store.close()
    assert len(resources) == 0


def connected_clients(raw: redis.Redis) -> int:
    return int(raw.info("clients")["connected_clients"])


def wait_for_clients(raw: redis.Redis, count: int) -> None:
    """Until the server counts ``count`` clients (it notices a closed socket on its next
    event-loop pass)."""
    wait_until(lambda: connected_clients(raw) == count,
               lambda: f"{count} Redis clients (now {connected_clients(raw)})", 5, interval=0.02)


def on_redis(url: str, *, kv_index: bool = True) -> dict[str, Any]:
    """A config with the response cache (and a KV index) on the Redis at ``url``."""
    return {
        "response_cache": {"backend": "redis",
                           "redis": {"url": url, "key_prefix": unique_prefix()}},
        "kv_cache_index": {"enabled": kv_index, "backend": "redis",
                           "redis_key_prefix": unique_prefix("kv")},
    }


def test_store_and_index_share_one_link_until_the_last_lets_go(fresh_redis: RedisServer,
                                                                links: Any) -> None:
    config = parse_config(on_redis(fresh_redis.url))
    resources = WorkerResources()
    store = RedisCacheStore.from_config(config, resources=resources)
    index = RedisKvIndex.from_config(config, resources=resources)
    assert store.link is index.link
    raw = links.raw(fresh_redis.url)
    store.set("k", b"v", 60)
    index.apply("a", CACHE_CREATED, "a" * 64, 10)
    wait_for_clients(raw, 2)  # this client and the one shared pool connection
    store.close()
    assert [h.backend for h in index.query_backends("a" * 64)] == ["a"]  # still open
    index.close()
    wait_for_clients(raw, 1)  # the last user closed the pool


def redis_service(data: dict[str, Any]) -> RouterService:
    """A worker's service for ``data``, its plugins loaded through the entry points."""
    registry = PluginRegistry()
    return RouterService(parse_config(data, registry=registry), registry=registry,
                         metrics=RouterMetrics(CollectorRegistry()))


def new_redis_url(config: RouterConfig, url: str) -> RouterConfig:
    """``config`` with ``response_cache.redis.url`` changed (a hot-reloadable key)."""
    cache = config.response_cache
    return replace(config, response_cache=replace(cache, redis=replace(cache.redis, url=url)))


def test_reload_moves_the_cache_to_new_redis_settings_and_the_index_stays(
    fresh_redis: RedisServer, redis_server: RedisServer, links: Any
) -> None:
    service = redis_service(on_redis(fresh_redis.url))
    try:
        store, index = service.response_cache.store, service.kv_index
        assert isinstance(store, RedisCacheStore) and isinstance(index, RedisKvIndex)
        old_link = store.link
        assert index.link is old_link

        service.reload(replace(service.config, response_cache=replace(
            service.config.response_cache, ttl=60.0)))
        assert service.response_cache.store is store  # same Redis settings: same store

        report = service.reload(new_redis_url(service.config, redis_server.url))
        assert report.applied == ["response_cache.redis.url"]
        new_store = service.response_cache.store
        assert isinstance(new_store, RedisCacheStore)
        assert new_store.link is not old_link
        assert new_store.link.config.url == redis_server.url
        new_store.set("k", b"v", 60)
        assert links.raw(redis_server.url).get(new_store.full_key("k")) == b"v"
        # The index keeps the link it started with, open, on the first server.
        assert service.kv_index is index and index.link is old_link
        index.apply("a", CACHE_CREATED, "b" * 64, 10)
        assert links.raw(fresh_redis.url).exists(index.prefix_key("b" * 64)) == 1
        assert len(service.resources) == 2
    finally:
        service.stop()
    assert len(service.resources) == 0


def test_reload_closes_the_old_link_when_nothing_else_uses_it(
    fresh_redis: RedisServer, redis_server: RedisServer, links: Any
) -> None:
    service = redis_service(on_redis(fresh_redis.url, kv_index=False))
    try:
        raw = links.raw(fresh_redis.url)
        service.response_cache.store.set("k", b"v", 60)
        wait_for_clients(raw, 2)
        service.reload(new_redis_url(service.config, redis_server.url))
        wait_for_clients(raw, 1)  # the old pool is gone at once
        assert len(service.resources) == 1
    finally:
        service.stop()


def test_empty_prefix_is_refused(links: Any) -> None:
    with pytest.raises(ValueError, match="key_prefix"):
        store_on(links.link("redis://127.0.0.1:1/0"), prefix="")


def test_stats_never_talk_to_redis(links: Any) -> None:
    link = links.link(f"redis://127.0.0.1:{refused_port()}/0")
    stats = store_on(link).stats()
    assert stats.backend == "redis"
    assert stats.entries == -1
    assert stats.capacity is None
    assert stats.extra is not None
    assert stats.extra["errors"] == {"connection": 0, "timeout": 0, "protocol": 0, "other": 0}
    assert stats.extra["connections"] == {"active": 0, "idle": 0}


def test_closed_store_ignores_transitions(fresh_redis: RedisServer, links: Any) -> None:
    link = links.link(fresh_redis.url)
    store = store_on(link)
    store.close()
    fresh_redis.stop()
    store.set("k", b"v", 60)  # flips the link; the listener of the closed store is quiet
    assert link.fallback_active is True
    fresh_redis.start()
    assert link.probe() is True


def test_start_starts_the_link_probe_once(links: Any) -> None:
    link = links.link("redis://127.0.0.1:1/0")
    store = store_on(link)
    store.start()
    probe = link._greenlet
    assert probe is not None
    store.start()
    assert link._greenlet is probe
