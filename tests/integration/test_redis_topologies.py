"""Redis Cluster and Sentinel: the store and KV index contracts on a real 3-master cluster,
SCAN clears on every master, hash-tagged index keys, and a killed master (fallback, then
back to Redis after the failover). Every process is a real redis-server started here."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import replace
from typing import Any

import pytest
import redis
import requests

from continuum.config import RedisConfig
from continuum.devtools.fleet import metric_sum
from continuum.devtools.procs import wait_until
from continuum.devtools.redis_server import unique_prefix
from continuum.devtools.redis_topologies import ClusterSet, SentinelSet
from continuum.interfaces import CACHE_CREATED, CacheStore, KvCacheIndex
from continuum.testing.kv_index import KvIndexCases, StartedIndexCases
from continuum.testing.stores import CacheStoreCases
from stores.kv_redis import RedisKvIndex
from stores.redis_link import RedisLink
from stores.redis_store import RedisCacheStore
from tests.integration.conftest import _need_redis_server

pytestmark = pytest.mark.redis


@pytest.fixture(scope="module")
def cluster() -> Iterator[ClusterSet]:
    """A 3-master cluster with one replica each, shared by the contract cases."""
    _need_redis_server()
    with ClusterSet() as c:
        yield c


@pytest.fixture
def own_cluster() -> Iterator[ClusterSet]:
    """A cluster of this test's own (it kills a master)."""
    _need_redis_server()
    with ClusterSet() as c:
        yield c


@pytest.fixture
def sentinels() -> Iterator[SentinelSet]:
    _need_redis_server()
    with SentinelSet() as s:
        yield s


def cluster_config(c: ClusterSet, **settings: Any) -> RedisConfig:
    return RedisConfig(url=f"redis://127.0.0.1:{c.servers[0].port}/0", mode="cluster",
                       nodes=tuple(c.nodes), **settings)


def sentinel_config(s: SentinelSet, **settings: Any) -> RedisConfig:
    return RedisConfig(url="redis://127.0.0.1:6379/0", mode="sentinel", nodes=tuple(s.nodes),
                       sentinel_master=s.master_name, **settings)


class _Links:
    def __init__(self) -> None:
        self.links: list[RedisLink] = []

    def link(self, config: RedisConfig) -> RedisLink:
        link = RedisLink(config)
        self.links.append(link)
        return link

    def close(self) -> None:
        for link in self.links:
            link.close()


@pytest.fixture
def links() -> Iterator[_Links]:
    made = _Links()
    yield made
    made.close()


class TestClusterStoreContract(CacheStoreCases):
    """The store contract on Redis Cluster (keys spread over the three masters)."""

    @pytest.fixture(autouse=True)
    def _cluster(self, cluster: ClusterSet, links: _Links) -> None:
        self.link = links.link(cluster_config(cluster))

    def make_store(self) -> CacheStore:
        return RedisCacheStore(self.link, replace(self.link.config,
                                                  key_prefix=unique_prefix("cl")))


class TestClusterKvContract(KvIndexCases):
    """The KV index contract on Redis Cluster: the Lua chain query and the multi-key
    writes run because every key of the index shares one hash tag."""

    counts_entries = False

    @pytest.fixture(autouse=True)
    def _cluster(self, cluster: ClusterSet, links: _Links) -> Iterator[None]:
        self.link = links.link(cluster_config(cluster))
        self.made: list[RedisKvIndex] = []
        yield
        for index in self.made:
            index.clear()
            index.close()

    def make_index(self, *, storage_offloading: bool = False,
                   treat_eviction_as_offload: bool = True, ttl: int = 600) -> KvCacheIndex:
        index = RedisKvIndex(self.link, key_prefix=unique_prefix("clkv"),
                             storage_offloading=storage_offloading,
                             treat_eviction_as_offload=treat_eviction_as_offload,
                             entry_ttl_seconds=ttl)
        self.made.append(index)
        return index


class TestStartedClusterKvContract(StartedIndexCases, TestClusterKvContract):
    """The same on started indexes (as in a worker): routed records go through the writer
    greenlet, one script call each (a cluster pipeline takes no scripts)."""


class TestSentinelStoreContract(CacheStoreCases):
    """The store contract through Sentinel."""

    @pytest.fixture(autouse=True)
    def _sentinel(self, sentinels: SentinelSet, links: _Links) -> None:
        self.link = links.link(sentinel_config(sentinels))

    def make_store(self) -> CacheStore:
        return RedisCacheStore(self.link, replace(self.link.config,
                                                  key_prefix=unique_prefix("sn")))


def _keys_per_master(c: ClusterSet, prefix: str) -> list[int]:
    counts = []
    for server in c.masters():
        client = redis.Redis(port=server.port)
        counts.append(sum(1 for _ in client.scan_iter(match=prefix + "*", count=500)))
        client.close()
    return counts


def test_cluster_clear_scans_every_master(cluster: ClusterSet, links: _Links) -> None:
    link = links.link(cluster_config(cluster))
    prefix = unique_prefix("clr")
    store = RedisCacheStore(link, replace(link.config, key_prefix=prefix))
    for i in range(60):
        store.set(f"k{i}", b"v", 600)
    before = _keys_per_master(cluster, prefix)
    assert len(before) == 3 and all(n > 0 for n in before) and sum(before) == 60
    assert store.clear() == 60
    assert _keys_per_master(cluster, prefix) == [0, 0, 0]
    assert store.get("k1") is None


def test_cluster_kv_index_keys_share_one_slot(cluster: ClusterSet, links: _Links) -> None:
    link = links.link(cluster_config(cluster))
    index = RedisKvIndex(link, key_prefix="t:kvtag:")
    try:
        assert index.key_prefix == "{t:kvtag}:"
        index.apply("a", CACHE_CREATED, "ab" * 32, 100)
        index.apply_chain("a", CACHE_CREATED, [("c1", 10), ("c2", 10)])
        slots = {link.client.keyslot(k) for k in link.client.scan_iter(match="{t:kvtag}:*")}
        assert len(slots) == 1
        assert index.query_chain(["c1", "c2", "c3"]) is not None
        assert index.clear() >= 1
    finally:
        index.clear()
        index.close()


def _fallback_then_back(link: RedisLink, store: RedisCacheStore, kill: Any) -> None:
    """Kill the master; every call still answers (a miss or the memory fallback, no
    exception); the probe brings the link back to Redis after the failover."""
    for i in range(30):
        store.set(f"k{i}", b"before", 600)
    kill()
    answers = [store.get(f"k{i}") for i in range(30)]  # never raises
    assert all(a in (None, b"before") for a in answers)
    store.set("during", b"x", 600)  # to Redis if it answers, else to the fallback
    assert store.get("during") == b"x"
    wait_until(lambda: link.probe() and not link.fallback_active,
               "the link to return to Redis after the failover", 30, interval=0.2)
    store.set("after", b"y", 600)
    assert store.get("after") == b"y"
    assert not link.fallback_active


def test_cluster_master_killed_fallback_then_recovery(own_cluster: ClusterSet,
                                                      links: _Links) -> None:
    link = links.link(cluster_config(own_cluster, probe_interval_seconds=0.2))
    prefix = unique_prefix("fo")
    store = RedisCacheStore(link, replace(link.config, key_prefix=prefix))
    victim = own_cluster.master_of(store.full_key("k1"))
    _fallback_then_back(link, store, lambda: own_cluster.kill(victim))
    # The keys the killed master held were replicated: its replica serves them now.
    assert store.get("k1") == b"before"


def test_sentinel_master_killed_fallback_then_recovery(sentinels: SentinelSet,
                                                       links: _Links) -> None:
    link = links.link(sentinel_config(sentinels, probe_interval_seconds=0.2))
    store = RedisCacheStore(link, replace(link.config, key_prefix=unique_prefix("sfo")))
    _fallback_then_back(link, store, sentinels.kill_master)
    assert sentinels.master_port() == sentinels.replica.port


def test_router_on_a_cluster_hits_and_survives_a_master(upstreams, router_factory,
                                                        own_cluster: ClusterSet) -> None:
    up = upstreams("a")
    redis_cfg = {"url": f"redis://127.0.0.1:{own_cluster.servers[0].port}/0",
                 "mode": "cluster", "nodes": own_cluster.nodes, "probe_interval_seconds": 0.2,
                 "key_prefix": unique_prefix("rt")}
    router = router_factory({
        "backends": [{"name": "a", "url": up.url, "models": ["m"]}],
        "response_cache": {"enabled": True, "backend": "redis", "redis": redis_cfg},
        "health_check": {"interval_seconds": 30}}, workers=2)
    bodies = [{"model": "m", "temperature": 0,
               "messages": [{"role": "user", "content": f"question {i}"}]} for i in range(12)]

    def caches() -> list[str]:
        out = []
        for body in bodies:
            resp = requests.post(router.url + "/v1/chat/completions", json=body, timeout=10)
            assert resp.status_code == 200  # never an error: at worst a miss
            out.append(resp.headers["X-Cache"])
        return out

    assert caches() == ["MISS"] * 12
    assert caches() == ["HIT"] * 12
    own_cluster.kill(own_cluster.masters()[0])
    caches()  # through the failover: 200s, hits or misses
    wait_until(lambda: caches() == ["HIT"] * 12, "every answer from Redis again", 30,
               interval=0.3)


def test_routers_through_sentinel_fail_over_and_share_again(upstreams, router_factory
                                                            ) -> None:
    """Two routers on one Sentinel-managed Redis: a response cached through one is a HIT
    through the other. The master dies while its replica is held, so no failover can
    happen yet: every request still succeeds (a MISS, or a hit from the memory fallback)
    and the routers are in fallback. The replica is let go and promoted; then an answer
    cached through one router is a HIT through the other again: both are back on Redis."""
    _need_redis_server()
    up = upstreams("a")
    prefix = unique_prefix("sent")
    with SentinelSet(failover_timeout_ms=1500) as sentinels:
        redis_cfg = {"url": "redis://127.0.0.1:6379/0", "mode": "sentinel",
                     "nodes": sentinels.nodes, "sentinel_master": sentinels.master_name,
                     "probe_interval_seconds": 0.2, "key_prefix": prefix}
        config = {"backends": [{"name": "a", "url": up.url, "models": ["m"]}],
                  "response_cache": {"enabled": True, "backend": "redis", "redis": redis_cfg},
                  "health_check": {"interval_seconds": 30}}
        routers = router_factory(config), router_factory(config)
        first, second = routers

        def ask(router: Any, question: str) -> str:
            body = {"model": "m", "temperature": 0,
                    "messages": [{"role": "user", "content": question}]}
            resp = requests.post(router.url + "/v1/chat/completions", json=body, timeout=10)
            assert resp.status_code == 200, resp.text  # never an error: at worst a miss
            return str(resp.headers["X-Cache"])

        def fleet_metric(name: str, **labels: str) -> float:
            return sum(metric_sum(r.metrics(), name, **labels) for r in routers)

        questions = [f"question {i}" for i in range(6)]
        assert [ask(first, q) for q in questions] == ["MISS"] * 6
        assert [ask(second, q) for q in questions] == ["HIT"] * 6  # from the shared Redis
        replica = redis.Redis(port=sentinels.replica.port)
        try:  # the replica has every entry before its master goes
            wait_until(lambda: sum(1 for _ in replica.scan_iter(match=prefix + "*")) >= 6,
                       "the replica to hold the cached entries", 10, interval=0.05)
        finally:
            replica.close()

        with sentinels.replica_paused():
            sentinels.stop_master()
            answers = {ask(router, q) for router in routers for q in questions}
            assert answers <= {"HIT", "MISS"}
            assert fleet_metric("continuum_cache_redis_errors_total", kind="connection") >= 1
            assert fleet_metric("continuum_cache_fallback_active") >= 1
        sentinels.wait_promoted()

        attempt = iter(range(1000))

        def shared_again() -> bool:
            question = f"after the failover {next(attempt)}"
            return ask(first, question) == "MISS" and ask(second, question) == "HIT"

        wait_until(shared_again, "an answer cached through one router to hit through the "
                   "other", 30, interval=0.2)
        # What was cached before the master died was replicated: the new master serves it.
        assert [ask(second, q) for q in questions] == ["HIT"] * 6
        assert fleet_metric("continuum_cache_fallback_active") == 0
