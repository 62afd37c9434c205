"""``continuum_kv_consumer_connected`` when a KV lease moves: the worker that lost it to
another worker or router stops reading 0 once the other holds it, so the minimum over a
host's workers and a router's alert follow the holder's own sample.

Two workers are two real :class:`KvEventConsumerManager` (each with its own registry, as
two gunicorn workers have their own samples) under one real ``redis-server``, their
consumers reading a listener address where nothing listens (so the holder's own sample
stays 0: nothing is streamed anywhere).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import redis
from prometheus_client import CollectorRegistry

from continuum.config import parse_config
from continuum.devtools.procs import free_port, wait_until
from continuum.kv.consumer import KvEventConsumerManager
from continuum.kv.lease import LeasedConsumers, RedisLease
from stores.kv_memory import InMemoryKvIndex
from tests.integration.test_kv_lease_handover import _spawn

TTL_MS = 300
GAUGE = "continuum_kv_consumer_connected"


class _Worker:
    """One worker's consumer manager of backend ``a`` under its own lease name."""

    def __init__(self, client: redis.Redis, prefix: str, name: str, endpoint: str) -> None:
        sources = parse_config({"kv_cache_index": {"event_sources": [
            {"backend_name": "a", "endpoint": endpoint, "reconnect_interval_ms": 100}]}},
        ).kv_cache_index.event_sources
        self.registry = CollectorRegistry()
        self.leased = LeasedConsumers(RedisLease(client, prefix, f"host:{name}", TTL_MS),
                                      TTL_MS)
        self.manager = KvEventConsumerManager(sources, InMemoryKvIndex(), self.registry,
                                              spawn=_spawn, connect_timeout=0.2,
                                              lease=self.leased)

    def gauge(self) -> float | None:
        return self.registry.get_sample_value(GAUGE, {"backend": "a"})


@pytest.fixture
def workers(redis_server: Any) -> Iterator[Callable[[str], _Worker]]:
    client = redis.Redis.from_url(redis_server.url)
    prefix = f"test:lease-metrics:{time.monotonic_ns()}:"
    endpoint = f"http://127.0.0.1:{free_port()}/events/a"
    made: list[_Worker] = []

    def make(name: str) -> _Worker:
        made.append(_Worker(client, prefix, name, endpoint))
        return made[-1]

    yield make
    for worker in made:
        worker.manager.stop(timeout=5)
    client.close()


def test_a_worker_that_lost_the_lease_to_another_leaves_the_gauge_to_it(
        workers: Callable[[str], _Worker], redis_server: Any) -> None:
    first = workers("w1")
    first.manager.start()
    wait_until(lambda: first.leased.held == {"a"}, "w1 to hold the lease", 5)
    wait_until(lambda: first.gauge() == 0.0, "w1's consumer to report its stream down", 5)

    # The lease expires under w1 (as in a Redis outage longer than its TTL) and another
    # worker or router takes it; w1's next renewal fails and it gives the stream up.
    client = redis.Redis.from_url(redis_server.url)
    try:
        client.delete(first.leased.lease.key("a"))  # type: ignore[attr-defined]
    finally:
        client.close()
    second = workers("w2")
    second.manager.start()
    wait_until(lambda: second.leased.held == {"a"}, "w2 to hold the lease", 5)
    wait_until(lambda: first.gauge() == 1.0, "w1's sample to leave the gauge to w2", 5)
    assert first.leased.held == set()
    # The holder's own sample tells the truth: nothing streams, so the host's minimum is 0.
    assert second.gauge() == 0.0
    assert min(first.gauge() or 0.0, second.gauge() or 0.0) == 0.0

    # Once w2 gives the lease up (a plain stop), w1 takes it again and reports for itself.
    second.manager.stop(timeout=5)
    wait_until(lambda: first.leased.held == {"a"}, "w1 to hold the lease again", 5)
    wait_until(lambda: first.gauge() == 0.0, "w1's consumer to report its stream down", 5)
