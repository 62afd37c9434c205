"""One Redis/Valkey connection pool per worker, with the fallback state machine.

The client is standalone, Redis Cluster or Sentinel by ``response_cache.redis.mode``
(:mod:`continuum.redis_topology`); ``cluster`` tells users which keys must share a slot.
A cluster's ``CLUSTERDOWN``/``TRYAGAIN`` (slots without a master during a failover) count
as timeouts, so they enter fallback like an unreachable server.

The response cache (Tier 3) and the KV index (Tier 4) share the same :class:`RedisLink`,
so they reuse one pool and one credential set and agree on whether Redis is up: both lease
it from the worker's :class:`~continuum.resources.WorkerResources` with :func:`lease_link`,
keyed by the connection settings, and the last one to let go closes it.

States and transitions:

    ========  ======================================  ========
    state     event                                   next
    ========  ======================================  ========
    online    command ok                              online
    online    connection error or timeout             fallback
    online    other Redis error (error reply, …)      online
    online    unusable reply (too deep, malformed)    online
    fallback  background probe (PING) ok              online
    fallback  background probe fails                  fallback
    ========  ======================================  ========

Invariants: while in ``fallback`` no command is sent to Redis (callers get a
:class:`~continuum.errors.StoreError` of kind ``fallback`` at once and use their in-memory
fallback, or treat it as a miss); only the probe greenlet talks to Redis then, every
``probe_interval_seconds``; listeners hear every transition. Whatever a command raises (short
of the greenlet being killed) reaches the caller as a ``StoreError``: a reply that cannot be
parsed or used — nested deeper than the parser's recursion, say — is kind ``protocol``, so a
misbehaving server costs a cache miss, never a 500.
"""

from __future__ import annotations

import logging
import time
import weakref
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, TypeVar

import redis
from redis.exceptions import ClusterDownError, TryAgainError

from continuum.errors import StoreError
from continuum.redis_topology import is_cluster, make_client, pool_stats

if TYPE_CHECKING:
    from continuum.config import RedisConfig
    from continuum.metrics import RouterMetrics
    from continuum.resources import Lease, WorkerResources

log = logging.getLogger(__name__)

T = TypeVar("T")
Listener = Callable[[bool], None]


class RedisLink:
    """The shared Redis client of one worker, its error counters and fallback flag."""

    def __init__(self, config: RedisConfig, metrics: RouterMetrics | None = None) -> None:
        self.config = config
        self.metrics = metrics
        # standalone, cluster (RedisCluster) or sentinel (Sentinel.master_for): see
        # continuum.redis_topology; all three offer the same commands.
        self.client: Any = make_client(config)
        self.cluster = is_cluster(self.client)
        #: The connection pool (standalone, sentinel); a cluster keeps one per node.
        self.pool: Any = None if self.cluster else self.client.connection_pool
        self._cluster_client: Any = self.client if self.cluster else None
        self.fallback_active = False
        self.errors = {"connection": 0, "timeout": 0, "protocol": 0, "other": 0}
        self._listeners: list[weakref.WeakMethod[Listener]] = []
        self._greenlet: Any = None
        self._publish_state()

    def add_listener(self, listener: Listener) -> None:
        """Call the bound method ``listener(fallback_active)`` on every transition.

        Held by weak reference: the link is the app's and outlives stores and indexes, so a
        dropped store is collected and stops listening without unregistering.
        """
        self._listeners = [ref for ref in self._listeners if ref() is not None]
        self._listeners.append(weakref.WeakMethod(listener))

    def execute(self, operation: str, command: Callable[[redis.Redis], T]) -> T:
        """Run ``command(client)``, timing it and classifying failures.

        Raises:
            StoreError: Redis is in fallback (kind ``fallback``), unreachable
                (``connection``), too slow (``timeout``), answered an error (``other``) or
                something that could not be read or used (``protocol``).
        """
        if self.fallback_active:
            raise StoreError("Redis is unavailable (fallback active)", store="redis",
                             kind="fallback")
        started = time.perf_counter()
        try:
            return command(self.client)
        except (redis.TimeoutError, ClusterDownError, TryAgainError) as exc:
            self._failed("timeout", exc, operation)
            raise StoreError(f"Redis {operation} timed out", store="redis",
                             kind="timeout") from None
        except redis.ConnectionError as exc:
            self._failed("connection", exc, operation)
            raise StoreError(f"Redis {operation} failed: {exc}", store="redis",
                             kind="connection") from None
        except redis.RedisError as exc:
            self._count("other")
            raise StoreError(f"Redis {operation} failed: {exc}", store="redis",
                             kind="other") from None
        except Exception as exc:  # the parser or a reply callback choked on the reply
            # redis-py drops a connection whose read failed: no half-read reply is reused.
            self._count("protocol")
            log.debug("Redis %s: unusable reply (%s)", operation, type(exc).__name__)
            raise StoreError(f"Redis {operation}: unusable reply ({type(exc).__name__})",
                             store="redis", kind="protocol") from None
        finally:
            if self.metrics is not None:
                self.metrics.child(self.metrics.redis_latency, operation).observe(
                    time.perf_counter() - started)

    def _count(self, kind: str) -> None:
        self.errors[kind] += 1
        if self.metrics is not None:
            self.metrics.child(self.metrics.redis_errors, kind).inc()

    def _failed(self, kind: str, exc: Exception, operation: str) -> None:
        self._count(kind)
        if not self.fallback_active:
            log.warning("Redis %s failed (%s: %s); switching to fallback", operation, kind, exc)
            self._set_fallback(True)

    def _set_fallback(self, active: bool) -> None:
        self.fallback_active = active
        if not active:
            # Connections from before the outage are dead; start clean.
            self._reset_connections()
        self._publish_state()
        for ref in self._listeners:
            listener = ref()
            if listener is None:
                continue
            try:
                listener(active)
            except Exception:  # one listener must not stop the others
                log.exception("Redis fallback listener failed")

    def _reset_connections(self) -> None:
        if self._cluster_client is not None:
            # Forget the slot map too: after a failover the old master may be gone.
            self._cluster_client.close()
            try:
                self._cluster_client.nodes_manager.initialize()
            except Exception as exc:  # still partly down: the next command retries
                log.debug("Redis cluster slot refresh failed: %s", exc)
        else:
            self.pool.disconnect(inuse_connections=False)

    def _publish_state(self) -> None:
        if self.metrics is not None:
            self.metrics.fallback_active.set(1 if self.fallback_active else 0)

    def probe(self) -> bool:
        """PING Redis directly (even in fallback); leave fallback when it answers."""
        try:
            ok = bool(self.client.ping())
        except Exception as exc:  # a Redis error or an unusable reply alike
            log.debug("Redis probe failed: %s", exc)
            ok = False
        if ok and self.fallback_active:
            log.warning("Redis is reachable again; leaving fallback")
            self._set_fallback(False)
        return ok

    def start(self) -> None:
        """Start the probe greenlet (call in the worker, after the fork)."""
        if self._greenlet is not None:
            return
        import gevent

        def loop() -> None:
            while True:
                gevent.sleep(self.config.probe_interval_seconds)
                if self.fallback_active:
                    self.probe()

        self._greenlet = gevent.spawn(loop)

    def close(self) -> None:
        """Stop probing and close every connection."""
        if self._greenlet is not None:
            self._greenlet.kill(block=False)
            self._greenlet = None
        if self._cluster_client is not None:
            self._cluster_client.close()
        else:
            self.pool.disconnect()

    def connection_stats(self) -> dict[str, int]:
        """Connections in use and idle in the pool (summed over a cluster's nodes)."""
        return pool_stats(self._cluster_client or self.pool)


def lease_link(
    resources: WorkerResources, config: RedisConfig, metrics: RouterMetrics | None = None
) -> Lease[RedisLink]:
    """The worker's :class:`RedisLink` for ``config``, shared by every plugin that asks with
    the same settings (created by the first, closed after the last lease is released).

    Keyed by every ``response_cache.redis`` setting, so a reload that changes any of them
    gets a pool of its own while a user of the old settings (a Redis KV index) keeps its.
    """
    return resources.acquire(("redis", config), lambda: RedisLink(config, metrics))
