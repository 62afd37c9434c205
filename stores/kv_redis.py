"""``redis``: the Tier 4 KV cache index on Redis/Valkey, shared by every router instance.

Keys, all under ``key_prefix`` (``cr:kvidx:`` by default), each with ``EXPIRE`` of
``entry_ttl_seconds`` refreshed by every event that writes it:

* ``<prefix><prefix_hash>`` — sorted set, ``backend -> token_count`` (``ZADD``).
* ``<prefix><prefix_hash>:tier`` — hash, ``backend -> "<tier>|<unix time>"``: the tier and
  the time of the entry's last event. A prefix key's TTL is refreshed by *any* backend's
  event, so queries drop entries whose own last event is older than the TTL — the same
  per-entry expiry as :class:`~stores.kv_memory.InMemoryKvIndex`. Such stale members stay
  in Redis until their key expires (a lazy ``ZREM`` could race a fresh write).
* ``<prefix>backend:<name>`` — sorted set, ``prefix_hash -> time of last event``: the
  prefixes a backend holds, so ``cache_cleared`` touches only that backend's entries
  (no keyspace SCAN). Each write trims members older than the TTL, which keeps it bounded
  by what the backend touched within one TTL even while the key itself never expires.

Writes: an upsert (``cache_created``; ``cache_offloaded`` with offloading on) or a removal
is one ``MULTI``/``EXEC`` pipeline. A ``cache_evicted`` that demotes GpuHot to StorageWarm
must read the current tier first, so it is a small Lua script (atomic, one round trip;
``EVALSHA``, loaded on first use). ``cache_cleared`` walks the backend's set with ``ZSCAN``
and removes its entries in pipelined batches. The scripts touch keys of different hash
slots: Redis Cluster is not supported (the shared :class:`~stores.redis_link.RedisLink`
is a plain client anyway).

Reads: ``query_backends`` pipelines ``ZREVRANGEBYSCORE key +inf -inf WITHSCORES`` and
``HGETALL key:tier`` in one round trip (no ``MULTI``: a holder caught without its tier
field is reported GpuHot), then orders ties by name.

``max_entries`` is not enforced in Redis: the TTL bounds the index (size it with
``maxmemory``; an entry costs roughly 200 bytes). ``stats`` never talks to Redis, so its
``prefix_count`` and ``entry_count`` are -1 (unknown).

Fallback: while the link is in fallback, ``apply``/``query_backends``/``clear`` use an
in-memory :class:`~stores.kv_memory.InMemoryKvIndex` with the same settings; both link
transitions empty it (what it holds Redis never saw; the listener streams rebuild the
index). Other Redis errors (an error reply, or a reply that cannot be parsed or has the wrong
shape) are raised as ``StoreError``: the consumer counts the event as dropped, the scorer
treats the query as empty.
"""

from __future__ import annotations

import math
import threading
import time
from collections.abc import Callable, Sequence
from functools import partial
from typing import TYPE_CHECKING, Any

from continuum.errors import StoreError
from continuum.interfaces import (
    KV_EVENT_TYPES,
    TIER_GPU_HOT,
    TIER_STORAGE_WARM,
    KvCacheIndex,
    KvHolding,
)
from stores.kv_memory import (
    DEMOTE,
    EMPTY,
    REMOVE,
    REMOVE_BACKEND,
    UPSERT_GPU_HOT,
    InMemoryKvIndex,
    action_for,
    rank_key,
    transition_table,
)
from stores.redis_link import lease_link
from stores.redis_store import SCAN_COUNT, UNREACHABLE, glob_escape

if TYPE_CHECKING:
    import redis

    from continuum.config import RouterConfig
    from continuum.metrics import RouterMetrics
    from continuum.resources import WorkerResources
    from stores.redis_link import RedisLink

Clock = Callable[[], float]

#: KEYS: entries zset, tier hash, backend zset. ARGV: backend, prefix_hash, now, ttl,
#: token_count, StorageWarm tier value, cutoff (now - ttl). Returns 1 if demoted.
DEMOTE_SCRIPT = f"""
local value = redis.call('HGET', KEYS[2], ARGV[1])
if value then
  local sep = string.find(value, '|', 1, true)
  local tier = sep and string.sub(value, 1, sep - 1) or value
  local at = sep and tonumber(string.sub(value, sep + 1)) or tonumber(ARGV[3])
  if tier == '{TIER_GPU_HOT}' and at > tonumber(ARGV[7]) then
    if tonumber(ARGV[5]) > 0 then redis.call('ZADD', KEYS[1], ARGV[5], ARGV[1]) end
    redis.call('HSET', KEYS[2], ARGV[1], ARGV[6])
    redis.call('EXPIRE', KEYS[1], ARGV[4])
    redis.call('EXPIRE', KEYS[2], ARGV[4])
    redis.call('ZADD', KEYS[3], ARGV[3], ARGV[2])
    redis.call('ZREMRANGEBYSCORE', KEYS[3], '-inf', ARGV[7])
    redis.call('EXPIRE', KEYS[3], ARGV[4])
    return 1
  end
end
redis.call('ZREM', KEYS[1], ARGV[1])
redis.call('HDEL', KEYS[2], ARGV[1])
redis.call('ZREM', KEYS[3], ARGV[2])
return 0
"""


def parse_tier(value: bytes | None) -> tuple[str, float]:
    """``(tier, updated_at)`` from a tier-hash value; unknown time is 0.0."""
    if value is None:
        return TIER_GPU_HOT, 0.0
    tier, _, at = value.decode().partition("|")
    try:
        return tier, float(at)
    except ValueError:
        return tier, 0.0


def _query(key: str, tier_key: str, client: redis.Redis) -> Any:
    pipe = client.pipeline(transaction=False)
    pipe.zrevrangebyscore(key, "+inf", "-inf", withscores=True)
    pipe.hgetall(tier_key)
    return pipe.execute()


class RedisKvIndex(KvCacheIndex):
    """The Tier 4 index in Redis sorted sets, on the worker's shared link.

    Args:
        link: the shared Redis link (the response cache's pool and fallback flag).
        key_prefix: namespace of every key (``kv_cache_index.redis_key_prefix``).
        entry_ttl_seconds: lifetime of an entry without a new event (whole seconds in
            Redis, rounded up).
        max_entries: capacity of the in-memory fallback (Redis itself is bounded by TTL).
        storage_offloading: track StorageWarm entries.
        treat_eviction_as_offload: ``cache_evicted`` of a GpuHot entry demotes it.
        clock: wall-clock seconds, stored as ``updated_at`` (shared by routers, so not
            monotonic).
        release: what :meth:`close` calls to hand the link back (:meth:`from_config`
            passes its lease's); a link the caller passed in itself stays open.

    Raises:
        ValueError: empty ``key_prefix`` (``clear`` would match every key).
    """

    name = "redis"

    def __init__(
        self,
        link: RedisLink,
        *,
        key_prefix: str = "cr:kvidx:",
        entry_ttl_seconds: float = 600,
        max_entries: int = 100_000,
        storage_offloading: bool = False,
        treat_eviction_as_offload: bool = True,
        clock: Clock = time.time,
        release: Callable[[], None] | None = None,
    ) -> None:
        if not key_prefix:
            raise ValueError("RedisKvIndex needs a non-empty key_prefix")
        self._link = link
        self._release = release
        self.key_prefix = key_prefix
        self.entry_ttl_seconds = entry_ttl_seconds
        self._ttl = max(1, math.ceil(entry_ttl_seconds))
        self._prefix_bytes = key_prefix.encode()
        self._pattern = glob_escape(key_prefix) + "*"
        self._table = transition_table(storage_offloading, treat_eviction_as_offload)
        self._clock = clock
        self._demote = link.client.register_script(DEMOTE_SCRIPT)
        self._fallback = InMemoryKvIndex(
            max_entries, entry_ttl_seconds, storage_offloading=storage_offloading,
            treat_eviction_as_offload=treat_eviction_as_offload, clock=clock)
        self._counts_lock = threading.Lock()
        self._events = dict.fromkeys(KV_EVENT_TYPES, 0)
        self._hits = 0
        self._closed = False
        link.add_listener(self._on_link_transition)

    def _on_link_transition(self, fallback_active: bool) -> None:
        # Redis is authoritative again (or the outage starts): the fallback's entries would
        # only shadow it; the listener streams rebuild what matters.
        if not self._closed:
            self._fallback.clear()

    @classmethod
    def from_config(
        cls,
        config: RouterConfig,
        *,
        resources: WorkerResources | None = None,
        metrics: RouterMetrics | None = None,
        **_: Any,
    ) -> RedisKvIndex:
        """The index for ``config.kv_cache_index``, on the link for
        ``response_cache.redis`` leased from the worker's ``resources`` (the response
        cache's pool when it is on Redis too). It keeps that link until closed: a reload
        that gives the response cache new Redis settings leaves the index where it is.

        Raises:
            ValueError: no ``resources`` were passed (the service passes its own).
        """
        if resources is None:
            raise ValueError(
                "kv_cache_index.backend is 'redis' but no worker resources were given: pass "
                "resources=WorkerResources() to RedisKvIndex.from_config"
            )
        kv = config.kv_cache_index
        lease = lease_link(resources, config.response_cache.redis, metrics)
        try:
            return cls(lease.resource, key_prefix=kv.redis_key_prefix,
                       entry_ttl_seconds=kv.entry_ttl_seconds, max_entries=kv.max_entries,
                       storage_offloading=kv.storage_offloading.enabled,
                       treat_eviction_as_offload=kv.storage_offloading.treat_eviction_as_offload,
                       release=lease.release)
        except BaseException:
            lease.release()
            raise

    @property
    def link(self) -> RedisLink:
        """The shared link this index talks through."""
        return self._link

    def prefix_key(self, prefix_hash: str) -> str:
        """The sorted set of ``prefix_hash``'s holders (its tiers are under ``…:tier``)."""
        return self.key_prefix + prefix_hash

    def backend_key(self, backend: str) -> str:
        """The sorted set of the prefixes ``backend`` holds."""
        return f"{self.key_prefix}backend:{backend}"

    def start(self) -> None:
        """Start the link's probe and the fallback's sweep (idempotent; in the worker)."""
        self._link.start()
        self._fallback.start()

    def close(self) -> None:
        """Stop listening to the link, drop the fallback and hand the link back (a leased
        link closes once its last user is done; one passed in stays open)."""
        self._closed = True
        self._fallback.close()
        self._fallback.clear()
        release, self._release = self._release, None
        if release is not None:
            release()

    def apply(self, backend: str, event: str, prefix_hash: str, token_count: int = 0) -> None:
        """Apply one event from ``backend`` (transitions as in :mod:`stores.kv_memory`).

        Raises:
            ValueError: unknown event type or negative ``token_count``.
            StoreError: Redis answered with an error.
        """
        action = action_for(self._table, event, token_count)
        with self._counts_lock:
            self._events[event] += 1
        if not self._link.fallback_active:
            write = partial(self._write, action, backend, prefix_hash, token_count)
            try:
                self._link.execute("kv_apply", write)
                return
            except StoreError as exc:
                if exc.kind not in UNREACHABLE:
                    raise
        self._fallback.apply(backend, event, prefix_hash, token_count)

    def query_backends(self, prefix_hash: str) -> Sequence[KvHolding]:
        """Unexpired holders of ``prefix_hash``, most tokens first (ties by name).

        Raises:
            StoreError: Redis answered with an error.
        """
        if self._link.fallback_active:
            return self._fallback.query_backends(prefix_hash)
        key = self.prefix_key(prefix_hash)
        try:
            # Parsed inside execute(): a reply of the wrong shape is a StoreError too.
            holdings = self._link.execute("kv_query", partial(self._holdings, key))
        except StoreError as exc:
            if exc.kind not in UNREACHABLE:
                raise
            return self._fallback.query_backends(prefix_hash)
        if not holdings:
            return EMPTY
        with self._counts_lock:
            self._hits += 1
        return holdings

    def _holdings(self, key: str, client: redis.Redis) -> tuple[KvHolding, ...]:
        """Query ``key`` and its tiers; the unexpired holders, ranked."""
        ranked, tiers = _query(key, key + ":tier", client)
        if not ranked:
            return ()
        cutoff = self._clock() - self.entry_ttl_seconds
        holdings = []
        for member, score in ranked:
            tier, updated_at = parse_tier(tiers.get(member))
            if updated_at and updated_at <= cutoff:
                continue  # the key is fresh, this backend's entry is not
            holdings.append(KvHolding(member.decode(), int(score), tier, updated_at))
        holdings.sort(key=rank_key)
        return tuple(holdings)

    def clear(self) -> int:
        """Remove every key under ``key_prefix``; return how many entries went.

        ``SCAN MATCH <prefix>* COUNT 500`` and one ``ZCARD``…/``UNLINK`` pipeline per batch
        (never ``FLUSHDB``); the fallback is cleared too.

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
        return removed + self._fallback.clear()

    def stats(self) -> dict[str, Any]:
        """Counters; never talks to Redis (``prefix_count``/``entry_count`` are -1).

        ``total_evictions`` counts the fallback's: Redis expires keys silently.
        """
        fallback = self._fallback.stats()
        with self._counts_lock:
            hits, events = self._hits + fallback["total_hits"], dict(self._events)
        return {
            "backend": self.name,
            "prefix_count": -1,
            "entry_count": -1,
            "total_hits": hits,
            "total_evictions": fallback["total_evictions"],
            "events": events,
            "key_prefix": self.key_prefix,
            "entry_ttl_seconds": self.entry_ttl_seconds,
            "storage_offloading": fallback["storage_offloading"],
            "treat_eviction_as_offload": fallback["treat_eviction_as_offload"],
            "fallback_active": self._link.fallback_active,
            "fallback_entries": fallback["entry_count"],
            "errors": dict(self._link.errors),
            "connections": self._link.connection_stats(),
        }

    # -- internals -------------------------------------------------------------------

    def _write(self, action: str, backend: str, prefix_hash: str, token_count: int,
               client: redis.Redis) -> None:
        if action == REMOVE_BACKEND:
            self._remove_backend(backend, client)
            return
        now = self._clock()
        cutoff = now - self.entry_ttl_seconds
        key, backend_key = self.prefix_key(prefix_hash), self.backend_key(backend)
        tier_key = key + ":tier"
        if action == DEMOTE:
            args: list[str | int] = [backend, prefix_hash, repr(now), self._ttl, token_count,
                                     f"{TIER_STORAGE_WARM}|{now!r}", repr(cutoff)]
            self._demote(keys=[key, tier_key, backend_key], args=args, client=client)
            return
        pipe = client.pipeline(transaction=True)
        if action == REMOVE:
            pipe.zrem(key, backend)
            pipe.hdel(tier_key, backend)
            pipe.zrem(backend_key, prefix_hash)
        else:
            tier = TIER_GPU_HOT if action == UPSERT_GPU_HOT else TIER_STORAGE_WARM
            if token_count:
                pipe.zadd(key, {backend: token_count})
            else:  # the event carried no count: keep the one known
                pipe.zadd(key, {backend: 0}, nx=True)
            pipe.hset(tier_key, backend, f"{tier}|{now!r}")
            pipe.expire(key, self._ttl)
            pipe.expire(tier_key, self._ttl)
            pipe.zadd(backend_key, {prefix_hash: now})
            pipe.zremrangebyscore(backend_key, "-inf", cutoff)
            pipe.expire(backend_key, self._ttl)
        pipe.execute()

    def _remove_backend(self, backend: str, client: redis.Redis) -> None:
        backend_key, cursor = self.backend_key(backend), 0
        while True:
            # Removing members ZSCAN has returned is safe: the rest are still returned.
            cursor, members = client.zscan(backend_key, cursor, count=SCAN_COUNT)
            if members:
                pipe = client.pipeline(transaction=False)
                for member, _ in members:
                    name = member.decode() if isinstance(member, bytes) else str(member)
                    key = self.prefix_key(name)
                    pipe.zrem(key, backend)
                    pipe.hdel(key + ":tier", backend)
                pipe.zrem(backend_key, *(member for member, _ in members))
                pipe.execute()
            if cursor == 0:
                return

    def _clear_redis(self) -> int:
        removed, cursor = 0, 0
        prefix = self._prefix_bytes
        while True:
            cursor, keys = self._link.execute("kv_scan", partial(self._scan_step, cursor))
            # The prefix check is a second line of defence against unlinking a foreign key.
            mine = [k for k in keys if isinstance(k, bytes) and k.startswith(prefix)]
            if mine:
                removed += self._link.execute("kv_clear", partial(self._unlink_batch, mine))
            if cursor == 0:
                return removed

    def _scan_step(self, cursor: int, client: redis.Redis) -> Any:
        return client.scan(cursor, match=self._pattern, count=SCAN_COUNT)

    def _unlink_batch(self, keys: list[bytes], client: redis.Redis) -> int:
        prefix_len = len(self._prefix_bytes)
        entry_keys = [k for k in keys
                      if not k.endswith(b":tier") and not k[prefix_len:].startswith(b"backend:")]
        pipe = client.pipeline(transaction=False)
        for key in entry_keys:
            pipe.zcard(key)
        pipe.unlink(*keys)
        # A foreign value under our prefix (WRONGTYPE for ZCARD) is garbage: unlink it too.
        replies = pipe.execute(raise_on_error=False)
        if isinstance(replies[-1], Exception):
            raise replies[-1]
        return sum(size for size in replies[:-1] if isinstance(size, int))
