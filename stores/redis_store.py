"""``redis``: the shared response cache store on Redis/Valkey (Tier 3).

Keys are ``<key_prefix><key>`` (``cr:resp:<hex>`` by default); values are stored as-is
with ``SET … EX``. Every command goes through the worker's shared
:class:`~stores.redis_link.RedisLink`, which times it, counts failures, wraps them in
:class:`~continuum.errors.StoreError` and owns the fallback flag. The store leases that link
from the worker's resources and hands it back when closed; new ``response_cache.redis``
settings on reload make :meth:`RedisCacheStore.reconfigure` build a replacement store on a
link for them.

Fallback: while the link is in fallback (set by the first connection error or timeout,
cleared by its probe), ``get``/``set``/``delete``/``clear`` use an in-memory
:class:`~stores.memory.InMemoryCacheStore` of ``fallback_capacity`` entries whose TTLs are
capped at ``fallback_ttl_seconds`` — or, with ``fallback_to_memory: false``, behave as a
miss and no-ops. Both transitions empty that store: it only holds what this worker wrote
during the outage, which Redis never saw, and dropping cache entries is always safe.
Writes and deletes made during an outage are not replayed to Redis.

Errors other than an unreachable Redis (an error reply, say) are raised as ``StoreError``;
the response cache above turns them into misses.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from functools import partial
from typing import TYPE_CHECKING, Any

from continuum.errors import StoreError
from continuum.interfaces import CacheStore, CacheStoreStats
from continuum.redis_topology import scan_nodes
from stores.memory import InMemoryCacheStore
from stores.redis_link import lease_link

if TYPE_CHECKING:
    import redis

    from continuum.config import RedisConfig, RouterConfig
    from continuum.metrics import RouterMetrics
    from continuum.resources import WorkerResources
    from stores.redis_link import RedisLink

#: ``StoreError`` kinds meaning "Redis is unreachable": the link is (now) in fallback.
UNREACHABLE = frozenset({"fallback", "connection", "timeout"})

#: Keys requested per SCAN step of :meth:`RedisCacheStore.clear` (and so per UNLINK).
SCAN_COUNT = 500

_GLOB_SPECIAL = frozenset("*?[]\\")


def glob_escape(text: str) -> str:
    """``text`` as a Redis glob pattern matching only itself."""
    return "".join("\\" + ch if ch in _GLOB_SPECIAL else ch for ch in text)


def _as_bytes(key: bytes | str) -> bytes:
    return key if isinstance(key, bytes) else key.encode()


def _scan_step(cursor: int, pattern: str, node: Any, _client: redis.Redis) -> Any:
    return node.scan(cursor, match=pattern, count=SCAN_COUNT)


def _unlink_all(keys: list[bytes | str], node: Any, cluster: bool, _client: redis.Redis) -> Any:
    if not cluster:
        return node.unlink(*keys)
    # A cluster refuses one command over keys of several slots: one UNLINK per key.
    pipe = node.pipeline(transaction=False)
    for key in keys:
        pipe.unlink(key)
    return sum(int(n) for n in pipe.execute())


class RedisCacheStore(CacheStore):
    """Response cache entries in Redis, shared by every router instance.

    Args:
        link: the worker's shared Redis link (one pool, one fallback flag).
        config: settings for this store — ``key_prefix`` and the ``fallback_*`` keys;
            defaults to ``link.config``.
        release: what :meth:`close` calls to hand the link back (:meth:`from_config`
            passes its lease's); a link the caller passed in itself stays open.

    Raises:
        ValueError: ``key_prefix`` is empty (``clear`` would match every key).
    """

    name = "redis"

    def __init__(self, link: RedisLink, config: RedisConfig | None = None, *,
                 release: Callable[[], None] | None = None) -> None:
        config = config if config is not None else link.config
        if not config.key_prefix:
            raise ValueError("RedisCacheStore needs a non-empty key_prefix")
        self._link = link
        self._config = config
        self._release = release
        self.key_prefix = config.key_prefix
        self._prefix_bytes = config.key_prefix.encode()
        self._pattern = glob_escape(config.key_prefix) + "*"
        self._fallback: InMemoryCacheStore | None = None
        if config.fallback_to_memory:
            self._fallback = InMemoryCacheStore(
                config.fallback_capacity, max_ttl=float(config.fallback_ttl_seconds)
            )
        self._hits = 0
        self._misses = 0
        self._closed = False
        link.add_listener(self._on_link_transition)

    @classmethod
    def from_config(
        cls,
        config: RouterConfig,
        *,
        resources: WorkerResources | None = None,
        metrics: RouterMetrics | None = None,
        **_: Any,
    ) -> RedisCacheStore:
        """The store for ``response_cache.redis``, on the link for those settings leased
        from the worker's ``resources`` (shared with a Redis KV index on the same settings).

        Raises:
            ValueError: no ``resources`` were passed (the service passes its own).
        """
        if resources is None:
            raise ValueError(
                "response_cache.backend is 'redis' but no worker resources were given: pass "
                "resources=WorkerResources() to RedisCacheStore.from_config"
            )
        settings = config.response_cache.redis
        lease = lease_link(resources, settings, metrics)
        try:
            return cls(lease.resource, settings, release=lease.release)
        except BaseException:
            lease.release()
            raise

    def reconfigure(self, config: RouterConfig, **collaborators: Any) -> CacheStore | None:
        """New ``response_cache.redis`` settings: a new store on a link for them (the
        service swaps it in and closes this one, which hands the old link back). Same
        settings: None, this store goes on."""
        if config.response_cache.redis == self._config:
            return None
        return self.from_config(config, **collaborators)

    @property
    def link(self) -> RedisLink:
        """The shared link this store talks through."""
        return self._link

    def full_key(self, key: str) -> str:
        """The Redis key holding ``key``."""
        return self.key_prefix + key

    def start(self) -> None:
        """Start the link's background probe (idempotent; call in the worker)."""
        self._link.start()

    def close(self) -> None:
        """Stop listening to the link, drop the fallback and hand the link back (a leased
        link closes once its last user is done; one passed in stays open)."""
        self._closed = True
        if self._fallback is not None:
            self._fallback.clear()
        release, self._release = self._release, None
        if release is not None:
            release()

    def get(self, key: str) -> bytes | None:
        """The value under ``key``, from Redis or, during an outage, from the fallback.

        Raises:
            StoreError: Redis answered with an error.
        """
        if self._link.fallback_active:
            return self._count(self._fallback.get(key) if self._fallback else None)
        full = self.full_key(key)
        try:
            value = self._run("get", lambda c: c.get(full))
        except StoreError as exc:
            if exc.kind not in UNREACHABLE:
                raise
            value = self._fallback.get(key) if self._fallback else None
        return self._count(value)

    def set(self, key: str, value: bytes, ttl: float) -> None:
        """``SET key value EX ceil(ttl)`` (at least one second).

        A non-positive ``ttl`` deletes ``key`` instead, so nothing stays stored.

        Raises:
            StoreError: Redis answered with an error.
        """
        if ttl <= 0:
            self.delete(key)
            return
        if not self._link.fallback_active:
            full, seconds = self.full_key(key), max(1, math.ceil(ttl))
            try:
                self._run("set", lambda c: c.set(full, value, ex=seconds))
                return
            except StoreError as exc:
                if exc.kind not in UNREACHABLE:
                    raise
        if self._fallback is not None:
            self._fallback.set(key, value, ttl)

    def add(self, key: str, value: bytes, ttl: float) -> bool:
        """``SET key value NX EX ceil(ttl)``: stored only when absent (atomic for every
        worker and router on this Redis); during an outage, in the fallback store only.

        Raises:
            StoreError: Redis answered with an error.
        """
        if not self._link.fallback_active:
            full, seconds = self.full_key(key), max(1, math.ceil(ttl))
            try:
                return bool(self._run("add", lambda c: c.set(full, value, ex=seconds, nx=True)))
            except StoreError as exc:
                if exc.kind not in UNREACHABLE:
                    raise
        if self._fallback is None:
            return True
        return self._fallback.add(key, value, ttl)

    def delete(self, key: str) -> None:
        """``UNLINK`` the key (and drop it from the fallback during an outage).

        Raises:
            StoreError: Redis answered with an error.
        """
        if not self._link.fallback_active:
            full = self.full_key(key)
            try:
                self._run("delete", lambda c: c.unlink(full))
                return
            except StoreError as exc:
                if exc.kind not in UNREACHABLE:
                    raise
        if self._fallback is not None:
            self._fallback.delete(key)

    def clear(self) -> int:
        """Remove every key under ``key_prefix``; return how many were removed.

        Walks the keyspace with ``SCAN MATCH <prefix>* COUNT 500`` (on every master of a
        Redis Cluster, unlinking key by key there) and ``UNLINK``\\ s each batch, so Redis
        is never blocked for long and keys outside the prefix are never touched (never
        ``FLUSHDB``). During an outage only the fallback is cleared.

        Raises:
            StoreError: Redis answered with an error.
        """
        removed = 0
        if not self._link.fallback_active:
            try:
                removed = self._clear_redis()
            except StoreError as exc:
                if exc.kind not in UNREACHABLE:
                    raise
            else:
                return removed
        return removed + (self._fallback.clear() if self._fallback is not None else 0)

    def stats(self) -> CacheStoreStats:
        """Counters; never talks to Redis.

        ``entries`` is -1 (unknown): counting the keys under a prefix needs a full SCAN of
        the database. ``extra`` has the pool's ``connections``, ``fallback_active``, the
        link's ``errors`` by kind and ``fallback_entries``.
        """
        fallback_entries = len(self._fallback) if self._fallback is not None else 0
        return CacheStoreStats(
            backend=self.name,
            entries=-1,
            capacity=None,
            hits=self._hits,
            misses=self._misses,
            extra={
                "key_prefix": self.key_prefix,
                "connections": self._link.connection_stats(),
                "fallback_active": self._link.fallback_active,
                "fallback_to_memory": self._fallback is not None,
                "errors": dict(self._link.errors),
                "fallback_entries": fallback_entries,
            },
        )

    # -- internals -------------------------------------------------------------------

    def _run(self, operation: str, command: Callable[[redis.Redis], Any]) -> Any:
        return self._link.execute(operation, command)

    def _count(self, value: bytes | None) -> bytes | None:
        if value is None:
            self._misses += 1
        else:
            self._hits += 1
        return value

    def _clear_redis(self) -> int:
        # SCAN walks one server's keyspace: with Redis Cluster, every master in turn.
        removed = 0
        cluster = self._link.cluster
        prefix = self._prefix_bytes
        for node in self._run("nodes", lambda c: list(scan_nodes(c))):
            cursor = 0
            while True:
                cursor, keys = self._run("scan", partial(_scan_step, cursor, self._pattern,
                                                         node))
                # MATCH is exact for an escaped prefix; the check is a second line of
                # defence against ever unlinking a key that is not ours.
                mine = [k for k in keys
                        if isinstance(k, (bytes, str)) and _as_bytes(k).startswith(prefix)]
                if mine:
                    removed += int(self._run("clear", partial(_unlink_all, mine, node,
                                                              cluster)))
                if cursor == 0:
                    break
        return removed

    def _on_link_transition(self, fallback_active: bool) -> None:
        if not self._closed:
            self._reset_fallback()

    def _reset_fallback(self) -> None:
        if self._fallback is not None:
            self._fallback.clear()
