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
and removes its entries in pipelined batches. An engine event as the consumer hands it over
(:meth:`RedisKvIndex.apply_event`: the seed key and the event's chain groups) is one
``MULTI``/``EXEC`` round trip, the chain scripts inside it, unless it demotes the seed key
or clears the backend (and in Redis Cluster, whose pipelines take no scripts). The scripts
and transactions touch several keys: in Redis Cluster every key of the index carries one
hash tag (``key_prefix`` wrapped in ``{}``), so they all live in one slot.

Reads: ``query_backends`` pipelines ``ZREVRANGEBYSCORE key +inf -inf WITHSCORES`` and
``HGETALL key:tier`` in one round trip (no ``MULTI``: a holder caught without its tier
field is reported GpuHot), then orders ties by name.

Chain keys (:meth:`RedisKvIndex.apply_chain`, :mod:`continuum.prefix_chain`):

* ``<prefix>c:<chain key>`` — hash, ``backend -> "<tokens>|<tier>|<time>|<expires>|<0/1>"``
  (the last field: approximate), ``EXPIRE`` ``entry_ttl_seconds`` refreshed by every write.
  An entry's own ``expires`` (``entry_ttl_seconds`` after its last event, or the
  approximate ``ttl``) is what queries check.
* ``<prefix>cb:<name>`` — sorted set, ``chain key -> time of last write``: the chain keys a
  backend holds, for ``cache_cleared``; trimmed like ``backend:<name>``.

``apply_chain`` is one Lua script whatever the number of keys (it must read each entry to
keep a confirmed entry from being overwritten by an approximate one, and to demote).

Approximate records (``apply_chain`` with ``ttl``: the router's record of where it sent a
request) are taken off the request path once the index is started (in a worker): the call
queues the record (at most ``MAX_PENDING``; the oldest goes when full, counted in
``stats()["approximate_dropped"]``) and returns; a greenlet writes every queued record in one
pipeline at the next hub switch, while the request waits for its backend. This index's
own queries send the queue first, so a worker always sees its own records; the others see
them a moment later, as they see engine events. A key this index recorded for a backend
less than a quarter of ``ttl`` ago (and no event or clear has touched since) is not sent
again: rewriting it would change only its expiry by a few seconds.
``query_chain`` is one Lua script too: it walks the chain from its first key with
``HGETALL`` until no backend holds the next key, and reads the seed key's holders in the
same call, so a query costs one round trip whatever the chain's length.

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

import logging
import math
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from functools import partial
from typing import TYPE_CHECKING, Any

from redis.exceptions import NoScriptError

from continuum.errors import StoreError
from continuum.interfaces import (
    CACHE_CLEARED,
    CACHE_CREATED,
    KV_EVENT_TYPES,
    TIER_GPU_HOT,
    TIER_STORAGE_WARM,
    ChainMatch,
    KvCacheIndex,
    KvHolding,
)
from continuum.redis_topology import hash_tagged
from stores.kv_memory import (
    DEMOTE,
    EMPTY,
    REMOVE,
    REMOVE_BACKEND,
    UPSERT_GPU_HOT,
    UPSERT_STORAGE_WARM,
    InMemoryKvIndex,
    action_for,
    check_chain,
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

log = logging.getLogger(__name__)

Clock = Callable[[], float]

#: Approximate records queued for the writer at most (the oldest are dropped beyond).
MAX_PENDING = 1024

#: Keys remembered as recently recorded (the memory is emptied when it grows past this).
MAX_RECENT = 65536

#: A recorded key is sent again once this share of its ``ttl`` has passed.
REFRESH_SHARE = 0.25

#: One queued approximate record: backend, ``(chain key, tokens)`` entries, ttl.
_Pending = tuple[str, Sequence[tuple[str, int]], float]

#: KEYS and ARGV of one script call.
_ScriptCall = tuple[list[str], list[str | int | float]]

#: What a chain query that matched nothing returns.
EMPTY_MATCHES: tuple[ChainMatch, ...] = ()

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


#: KEYS: the chain keys' hashes, then the backend's chain set. ARGV: action (gpu, warm,
#: demote, remove), backend, now, key EXPIRE seconds, approximate ttl (0: an event),
#: entry ttl, then one token count per key, then one chain key name per key.
CHAIN_WRITE_SCRIPT = f"""
local action, backend = ARGV[1], ARGV[2]
local now, expire = tonumber(ARGV[3]), tonumber(ARGV[4])
local approx_ttl, entry_ttl = tonumber(ARGV[5]), tonumber(ARGV[6])
local n = #KEYS - 1
local bkey = KEYS[n + 1]
for i = 1, n do
  local key, tokens, name = KEYS[i], tonumber(ARGV[6 + i]), ARGV[6 + n + i]
  local old = redis.call('HGET', key, backend)
  local otok, otier, oapprox, stale = 0, '', '0', false
  if old then
    local f = {{}}
    for part in string.gmatch(old, '[^|]+') do f[#f + 1] = part end
    otok, otier, oapprox = tonumber(f[1]) or 0, f[2] or '', f[5] or '0'
    if (tonumber(f[4]) or 0) <= now then old, otok, stale = nil, 0, true end
  end
  local tier, expires, approx = nil, now + entry_ttl, '0'
  if approx_ttl > 0 then
    if (not old) or oapprox == '1' then
      tier, expires, approx = '{TIER_GPU_HOT}', now + approx_ttl, '1'
    end
  elseif action == 'gpu' then tier = '{TIER_GPU_HOT}'
  elseif action == 'warm' or (action == 'demote' and old and otier == '{TIER_GPU_HOT}'
                               and oapprox == '0') then tier = '{TIER_STORAGE_WARM}'
  elseif old then tier = 'del' end
  if tier == 'del' then
    redis.call('HDEL', key, backend)
    redis.call('ZREM', bkey, name)
  elseif tier then
    if tokens == 0 then tokens = otok end
    redis.call('HSET', key, backend, string.format('%d|%s|%s|%.3f|%s', tokens, tier, ARGV[3],
                                                     expires, approx))
    redis.call('EXPIRE', key, expire)
    redis.call('ZADD', bkey, now, name)
  elseif stale then
    redis.call('HDEL', key, backend)
  end
end
if n > 0 then
  redis.call('ZREMRANGEBYSCORE', bkey, '-inf', now - entry_ttl)
  redis.call('EXPIRE', bkey, expire)
end
return 0
"""

#: KEYS: the chain keys' hashes (ARGV[2] of them), then optionally the seed key's holder
#: set and tier hash. ARGV: now, chain length. Returns flat rows ``backend, depth, value,
#: seed tier``: depth > 0 with the chain entry's value, or depth 0 with the seed holder's
#: token count and tier value.
CHAIN_QUERY_SCRIPT = """
local now, n = tonumber(ARGV[1]), tonumber(ARGV[2])
local alive, last = nil, {}
for d = 1, n do
  local flat = redis.call('HGETALL', KEYS[d])
  local here, any = {}, false
  for i = 1, #flat, 2 do
    local b, v = flat[i], flat[i + 1]
    local expires = tonumber(string.match(v, '^[^|]*|[^|]*|[^|]*|([^|]*)'))
    if expires and expires > now and (alive == nil or alive[b]) then
      here[b], any = v, true
    end
  end
  if not any then break end
  for b, v in pairs(here) do last[b] = {d, v} end
  alive = here
end
local out = {}
for b, dv in pairs(last) do
  out[#out + 1] = b; out[#out + 1] = dv[1]; out[#out + 1] = dv[2]; out[#out + 1] = ''
end
if #KEYS > n then
  local ranked = redis.call('ZRANGE', KEYS[n + 1], 0, -1, 'WITHSCORES')
  for i = 1, #ranked, 2 do
    local b = ranked[i]
    if last[b] == nil then
      out[#out + 1] = b; out[#out + 1] = 0; out[#out + 1] = ranked[i + 1]
      out[#out + 1] = redis.call('HGET', KEYS[n + 2], b) or ''
    end
  end
end
return out
"""

#: ``transition_table`` action -> the chain write script's action.
_CHAIN_ACTIONS = {UPSERT_GPU_HOT: "gpu", UPSERT_STORAGE_WARM: "warm", DEMOTE: "demote",
                  REMOVE: "remove"}


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
        if link.cluster:
            # The Lua chain query, the MULTI writes and the batched UNLINKs touch several
            # keys at once: in Redis Cluster every key of the index shares one hash slot.
            key_prefix = hash_tagged(key_prefix)
        self.key_prefix = key_prefix
        self.entry_ttl_seconds = entry_ttl_seconds
        self._ttl = max(1, math.ceil(entry_ttl_seconds))
        self._prefix_bytes = key_prefix.encode()
        self._pattern = glob_escape(key_prefix) + "*"
        self._table = transition_table(storage_offloading, treat_eviction_as_offload)
        self._clock = clock
        self._demote = link.client.register_script(DEMOTE_SCRIPT)
        self._chain_write = link.client.register_script(CHAIN_WRITE_SCRIPT)
        self._chain_query = link.client.register_script(CHAIN_QUERY_SCRIPT)
        self._fallback = InMemoryKvIndex(
            max_entries, entry_ttl_seconds, storage_offloading=storage_offloading,
            treat_eviction_as_offload=treat_eviction_as_offload, clock=clock)
        self._counts_lock = threading.Lock()
        self._events = dict.fromkeys(KV_EVENT_TYPES, 0)
        self._hits = 0
        self._closed = False
        #: Approximate records waiting for the writer greenlet (only once started).
        self._pending: deque[_Pending] = deque()
        self._writer: Any = None
        self._spawn: Callable[[Callable[[], None]], Any] | None = None
        self._approximate_dropped = 0
        #: (backend, chain key) -> monotonic time this index last recorded it approximately.
        self._recent: dict[tuple[str, str], float] = {}
        link.add_listener(self._on_link_transition)

    def _on_link_transition(self, fallback_active: bool) -> None:
        # Redis is authoritative again (or the outage starts): the fallback's entries would
        # only shadow it; the listener streams rebuild what matters.
        if not self._closed:
            self._fallback.clear()
            self._recent.clear()  # Redis may have lost what was recorded (a failover)

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

    def chain_key(self, key: str) -> str:
        """The hash of ``key``'s holders (a chain key, :mod:`continuum.prefix_chain`)."""
        return f"{self.key_prefix}c:{key}"

    def chain_backend_key(self, backend: str) -> str:
        """The sorted set of the chain keys ``backend`` holds."""
        return f"{self.key_prefix}cb:{backend}"

    def start(self) -> None:
        """Start the link's probe and the fallback's sweep, and from now on write
        approximate records from a greenlet (idempotent; in the worker)."""
        self._link.start()
        self._fallback.start()
        if self._spawn is None:
            import gevent

            self._spawn = gevent.spawn

    def close(self) -> None:
        """Stop listening to the link, drop the fallback and hand the link back (a leased
        link closes once its last user is done; one passed in stays open)."""
        self._closed = True
        self._spawn = None
        writer, self._writer = self._writer, None
        if writer is not None:
            writer.kill(block=False)
        self._pending.clear()
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
        self.flush()  # the records queued before this event are older: written first
        with self._counts_lock:
            self._events[event] += 1
        if action == REMOVE_BACKEND:
            self._forget(backend)
        if self._written(partial(self._write, action, backend, prefix_hash, token_count)):
            return
        self._fallback.apply(backend, event, prefix_hash, token_count)

    def _written(self, write: Callable[[Any], None]) -> bool:
        """Run ``write`` on Redis: False when the link is (or just went) into fallback, so
        the caller applies the event to the fallback instead.

        Raises:
            StoreError: Redis answered with an error.
        """
        if self._link.fallback_active:
            return False
        try:
            self._link.execute("kv_apply", write)
        except StoreError as exc:
            if exc.kind not in UNREACHABLE:
                raise
            return False
        return True

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

    def apply_chain(self, backend: str, event: str, entries: Sequence[tuple[str, int]],
                    *, ttl: float | None = None) -> None:
        """Apply one event to ``backend``'s chain keys: one script call (see the module
        docstring; ``cache_cleared`` goes through :meth:`apply`).

        Raises:
            ValueError: unknown event type, negative token count, bad ``ttl``.
            StoreError: Redis answered with an error.
        """
        action = action_for(self._table, event, 0)
        check_chain(event, entries, ttl)
        if action == REMOVE_BACKEND:
            self.apply(backend, CACHE_CLEARED, "")
            return
        with self._counts_lock:
            self._events[event] += 1
        if not entries:
            return
        if ttl is None:
            self.flush()  # the records queued before this event are older: written first
            self._forget(backend, entries)  # and the next record of its keys is sent
        elif self._spawn is not None and not self._link.fallback_active:
            self._queue(backend, entries, ttl)
            return
        if self._written(partial(self._write_chain, _CHAIN_ACTIONS[action], backend, entries,
                                 ttl)):
            return
        self._fallback.apply_chain(backend, event, entries, ttl=ttl)

    def apply_event(self, backend: str, event: str, prefix_hash: str, token_count: int = 0,
                    chain: Sequence[tuple[str, Sequence[tuple[str, int]]]] = ()) -> None:
        """One engine event, its seed key and every chain group, in one ``MULTI``/``EXEC``
        round trip (the seed key's commands, then one ``EVALSHA`` per group) instead of one
        per call; the same result as :meth:`apply` then :meth:`apply_chain` per group, which
        is what a demotion of the seed key, a ``cache_cleared``, a Redis Cluster or a link
        in fallback still take.

        Raises:
            ValueError: unknown event type, negative token count.
            StoreError: Redis answered with an error.
        """
        action = action_for(self._table, event, token_count)
        groups = [(kind, action_for(self._table, kind, 0), entries) for kind, entries in chain]
        for kind, _action, entries in groups:
            check_chain(kind, entries, None)
        if (action in (DEMOTE, REMOVE_BACKEND) or self._link.cluster
                or self._link.fallback_active
                or any(chain_action == REMOVE_BACKEND for _, chain_action, _ in groups)):
            super().apply_event(backend, event, prefix_hash, token_count, chain)
            return
        self.flush()  # the records queued before this event are older: written first
        with self._counts_lock:
            self._events[event] += 1
            for kind, _action, _entries in groups:
                self._events[kind] += 1
        writes = [(_CHAIN_ACTIONS[chain_action], entries)
                  for _kind, chain_action, entries in groups if entries]
        for _action, entries in writes:
            self._forget(backend, entries)  # the next record of its keys is sent
        if self._written(partial(self._write_event, action, backend, prefix_hash, token_count,
                                 writes)):
            return
        self._fallback.apply_event(backend, event, prefix_hash, token_count, chain)

    def flush(self) -> None:
        """Write the queued approximate records now (in one pipeline); those Redis cannot
        take go to the fallback. A failing write costs the records, never the caller."""
        batch = self._take_pending()
        if not batch:
            return
        if not self._link.fallback_active:
            try:
                self._link.execute("kv_apply", partial(self._write_records, batch))
                return
            except StoreError as exc:
                if exc.kind not in UNREACHABLE:
                    log.debug("KV index: approximate records not written (%s)", exc.kind)
                    for backend, entries, _ttl in batch:
                        self._forget(backend, entries)  # so the next record is sent
                    return
        self._records_to_fallback(batch)

    def _take_pending(self) -> list[_Pending]:
        """Every queued record, the queue emptied."""
        batch = list(self._pending)
        self._pending.clear()
        return batch

    def _records_to_fallback(self, records: Sequence[_Pending]) -> None:
        for backend, entries, ttl in records:
            self._fallback.apply_chain(backend, CACHE_CREATED, entries, ttl=ttl)

    def _queue(self, backend: str, entries: Sequence[tuple[str, int]], ttl: float) -> None:
        """Queue an approximate record for the writer, leaving out the keys recorded for
        ``backend`` within the last ``REFRESH_SHARE`` of ``ttl``."""
        now = time.monotonic()
        fresh_after = now - ttl * REFRESH_SHARE
        recent = self._recent
        if len(recent) > MAX_RECENT:
            recent.clear()
        due = [(key, tokens) for key, tokens in entries
               if recent.get((backend, key), -math.inf) <= fresh_after]
        if not due:
            return
        for key, _tokens in due:
            recent[(backend, key)] = now
        if len(self._pending) >= MAX_PENDING:
            self._pending.popleft()
            self._approximate_dropped += 1
        self._pending.append((backend, due, ttl))
        if self._writer is None and self._spawn is not None:
            self._writer = self._spawn(self._write_pending)

    def _write_pending(self) -> None:
        """The writer greenlet: flush until the queue is empty, then end."""
        try:
            while self._pending and not self._closed:
                self.flush()
        except Exception:  # the records are best effort; the next record spawns anew
            log.exception("KV index: approximate writer failed")
        finally:
            self._writer = None

    def _forget(self, backend: str, entries: Sequence[tuple[str, int]] | None = None) -> None:
        """Drop the memory of recent records of ``backend`` (of ``entries``' keys only, if
        given): an event or a clear touched them, so the next record is sent."""
        if entries is None:
            for pair in [p for p in self._recent if p[0] == backend]:
                del self._recent[pair]
            return
        for key, _tokens in entries:
            self._recent.pop((backend, key), None)

    def query_chain(self, keys: Sequence[str],
                    prefix_hash: str | None = None) -> Sequence[ChainMatch]:
        """Each backend's longest run of ``keys``, and seed-only holders of
        ``prefix_hash`` at depth 0: one script call.

        Raises:
            StoreError: Redis answered with an error.
        """
        # This worker's own queued records go first, in the same round trip (a cluster's
        # pipelines take no scripts: written before), so it always sees them.
        records: list[_Pending] = []
        if self._link.cluster:
            self.flush()
        else:
            records = self._take_pending()
        if self._link.fallback_active:
            self._records_to_fallback(records)
            return self._fallback.query_chain(keys, prefix_hash)
        try:
            # Parsed inside execute(): a reply of the wrong shape is a StoreError too.
            found = self._link.execute("kv_query", partial(self._chain_matches, keys,
                                                           prefix_hash, records))
        except StoreError as exc:
            if exc.kind not in UNREACHABLE:
                for backend, entries, _ttl in records:
                    self._forget(backend, entries)  # perhaps not written: sent again
                raise
            self._records_to_fallback(records)
            return self._fallback.query_chain(keys, prefix_hash)
        if not found:
            return EMPTY_MATCHES
        found.sort(key=rank_key)
        with self._counts_lock:
            self._hits += 1
        return tuple(found)

    def clear(self) -> int:
        """Remove every key under ``key_prefix``; return how many entries went.

        ``SCAN MATCH <prefix>* COUNT 500`` and one ``ZCARD``…/``UNLINK`` pipeline per batch
        (never ``FLUSHDB``); the fallback is cleared too.

        Raises:
            StoreError: Redis answered with an error.
        """
        removed = 0
        self._pending.clear()
        self._recent.clear()
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
            "approximate_pending": len(self._pending),
            "approximate_dropped": self._approximate_dropped,
            "errors": dict(self._link.errors),
            "connections": self._link.connection_stats(),
        }

    # -- internals -------------------------------------------------------------------

    def _chain_call(self, action: str, backend: str, entries: Sequence[tuple[str, int]],
                    ttl: float | None) -> tuple[list[str], list[str | int | float]]:
        """KEYS and ARGV of the chain write script for one write."""
        keys = [self.chain_key(key) for key, _ in entries]
        keys.append(self.chain_backend_key(backend))
        args: list[str | int | float] = [action, backend, repr(self._clock()), self._ttl,
                                         repr(ttl or 0), repr(self.entry_ttl_seconds)]
        args.extend(tokens for _, tokens in entries)
        args.extend(key for key, _ in entries)
        return keys, args

    def _write_chain(self, action: str, backend: str, entries: Sequence[tuple[str, int]],
                     ttl: float | None, client: redis.Redis) -> None:
        keys, args = self._chain_call(action, backend, entries, ttl)
        self._chain_write(keys=keys, args=args, client=client)

    def _write_records(self, batch: Sequence[_Pending], client: Any) -> None:
        """Approximate records: one pipeline of script calls (a cluster's index is in one
        slot, but its pipelines do not take scripts: one call each there)."""
        if self._link.cluster:
            for backend, entries, ttl in batch:
                self._write_chain("gpu", backend, entries, ttl, client)
            return
        self._run_scripts(client, [self._chain_call("gpu", backend, entries, ttl)
                                   for backend, entries, ttl in batch])

    def _run_scripts(self, client: Any, writes: list[_ScriptCall],
                     query: _ScriptCall | None = None) -> Any:
        r"""Chain write script calls, then optionally the chain query, in one pipeline of
        ``EVALSHA``\ s (a server that lost the scripts gets them loaded and the failed
        calls once more); the query's reply (None without one)."""
        for attempt in range(2):
            pipe = client.pipeline(transaction=False)
            for keys, args in writes:
                pipe.evalsha(self._chain_write.sha, len(keys), *keys, *args)
            if query is not None:
                pipe.evalsha(self._chain_query.sha, len(query[0]), *query[0], *query[1])
            replies = pipe.execute(raise_on_error=False)
            failed = [r for r in replies if isinstance(r, Exception)]
            if not failed:
                return replies[-1] if query is not None else None
            if attempt == 0 and all(isinstance(r, NoScriptError) for r in failed):
                for script in (CHAIN_WRITE_SCRIPT, CHAIN_QUERY_SCRIPT):
                    client.script_load(script)  # a restarted or flushed server
                writes = [call for call, r in zip(writes, replies[:len(writes)], strict=True)
                          if isinstance(r, Exception)]
                continue
            raise failed[0]
        raise AssertionError("unreachable")  # the second attempt returns or raises

    def _read_chain(self, keys: Sequence[str], prefix_hash: str | None,
                    records: Sequence[_Pending], client: redis.Redis) -> Any:
        names = [self.chain_key(key) for key in keys]
        if prefix_hash is not None:
            seed = self.prefix_key(prefix_hash)
            names += [seed, seed + ":tier"]
        args: list[str | int | float] = [repr(self._clock()), len(keys)]
        if not records:
            return self._chain_query(keys=names, args=args, client=client)
        return self._run_scripts(client, [self._chain_call("gpu", backend, entries, ttl)
                                          for backend, entries, ttl in records],
                                 (names, args))

    def _chain_matches(self, keys: Sequence[str], prefix_hash: str | None,
                       records: Sequence[_Pending], client: redis.Redis) -> list[ChainMatch]:
        """Write ``records``, query the chain and parse its rows (one round trip);
        unranked."""
        rows = self._read_chain(keys, prefix_hash, records, client)
        found = []
        cutoff = self._clock() - self.entry_ttl_seconds
        for i in range(0, len(rows), 4):
            backend = rows[i].decode()
            depth = int(rows[i + 1])
            if depth:
                tokens, tier, at, _expires, approximate = rows[i + 2].decode().split("|")
                found.append(ChainMatch(backend, depth, int(tokens), tier, approximate == "1",
                                        float(at)))
                continue
            tier, updated_at = parse_tier(rows[i + 3] or None)
            if updated_at and updated_at <= cutoff:
                continue  # the seed key is fresh, this backend's entry is not
            found.append(ChainMatch(backend, 0, int(float(rows[i + 2])), tier, False,
                                    updated_at))
        return found

    def _write(self, action: str, backend: str, prefix_hash: str, token_count: int,
               client: redis.Redis) -> None:
        if action == REMOVE_BACKEND:
            self._remove_backend(backend, client)
            return
        if action == DEMOTE:
            now = self._clock()
            key, backend_key = self.prefix_key(prefix_hash), self.backend_key(backend)
            args: list[str | int] = [backend, prefix_hash, repr(now), self._ttl, token_count,
                                     f"{TIER_STORAGE_WARM}|{now!r}",
                                     repr(now - self.entry_ttl_seconds)]
            self._demote(keys=[key, key + ":tier", backend_key], args=args, client=client)
            return
        pipe = client.pipeline(transaction=True)
        self._seed_commands(pipe, action, backend, prefix_hash, token_count)
        pipe.execute()

    def _seed_commands(self, pipe: Any, action: str, backend: str, prefix_hash: str,
                       token_count: int) -> None:
        """Queue the seed key's commands of an upsert or a removal on ``pipe``."""
        now = self._clock()
        key, backend_key = self.prefix_key(prefix_hash), self.backend_key(backend)
        tier_key = key + ":tier"
        if action == REMOVE:
            pipe.zrem(key, backend)
            pipe.hdel(tier_key, backend)
            pipe.zrem(backend_key, prefix_hash)
            return
        tier = TIER_GPU_HOT if action == UPSERT_GPU_HOT else TIER_STORAGE_WARM
        if token_count:
            pipe.zadd(key, {backend: token_count})
        else:  # the event carried no count: keep the one known
            pipe.zadd(key, {backend: 0}, nx=True)
        pipe.hset(tier_key, backend, f"{tier}|{now!r}")
        pipe.expire(key, self._ttl)
        pipe.expire(tier_key, self._ttl)
        pipe.zadd(backend_key, {prefix_hash: now})
        pipe.zremrangebyscore(backend_key, "-inf", now - self.entry_ttl_seconds)
        pipe.expire(backend_key, self._ttl)

    def _write_event(self, action: str, backend: str, prefix_hash: str, token_count: int,
                     writes: Sequence[tuple[str, Sequence[tuple[str, int]]]],
                     client: redis.Redis) -> None:
        """The seed key's commands and the chain write script per group, in one
        ``MULTI``/``EXEC``; the scripts a server lost are loaded and their calls sent again
        (the rest of the transaction has run)."""
        pipe = client.pipeline(transaction=True)
        self._seed_commands(pipe, action, backend, prefix_hash, token_count)
        calls = [self._chain_call(chain_action, backend, entries, None)
                 for chain_action, entries in writes]
        for keys, args in calls:
            pipe.evalsha(self._chain_write.sha, len(keys), *keys, *args)
        replies = pipe.execute(raise_on_error=False)
        failed = [i for i, reply in enumerate(replies) if isinstance(reply, Exception)]
        if not failed:
            return
        first = len(replies) - len(calls)
        if any(i < first or not isinstance(replies[i], NoScriptError) for i in failed):
            raise next(replies[i] for i in failed)
        self._run_scripts(client, [calls[i - first] for i in failed])

    def _remove_backend(self, backend: str, client: redis.Redis) -> None:
        def seed_entry(pipe: Any, name: str) -> None:
            key = self.prefix_key(name)
            pipe.zrem(key, backend)
            pipe.hdel(key + ":tier", backend)

        def chain_entry(pipe: Any, name: str) -> None:
            pipe.hdel(self.chain_key(name), backend)

        _drain_set(client, self.backend_key(backend), seed_entry)
        _drain_set(client, self.chain_backend_key(backend), chain_entry)

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

    def _slot_master(self, client: Any) -> Any:
        """The client of the master holding the index (Redis Cluster: every key is in
        the hash tag's slot), else ``client``."""
        if not self._link.cluster:
            return client
        return client.get_redis_connection(client.get_node_from_key(self.key_prefix))

    def _scan_step(self, cursor: int, client: redis.Redis) -> Any:
        client = self._slot_master(client)
        return client.scan(cursor, match=self._pattern, count=SCAN_COUNT)

    def _unlink_batch(self, keys: list[bytes], client: redis.Redis) -> int:
        client = self._slot_master(client)
        prefix_len = len(self._prefix_bytes)
        pipe = client.pipeline(transaction=False)
        for key in keys:
            rest = key[prefix_len:]
            if rest.startswith(b"c:"):
                pipe.hlen(key)
            elif not (key.endswith(b":tier") or rest.startswith((b"backend:", b"cb:"))):
                pipe.zcard(key)
        pipe.unlink(*keys)
        # A foreign value under our prefix (WRONGTYPE for ZCARD) is garbage: unlink it too.
        replies = pipe.execute(raise_on_error=False)
        if isinstance(replies[-1], Exception):
            raise replies[-1]
        return sum(size for size in replies[:-1] if isinstance(size, int))


def _drain_set(client: redis.Redis, set_key: str, drop: Callable[[Any, str], None]) -> None:
    """Empty the sorted set ``set_key``, calling ``drop(pipeline, member)`` for each member
    in pipelined batches (removing members ZSCAN has returned is safe: the rest are still
    returned)."""
    cursor = 0
    while True:
        cursor, members = client.zscan(set_key, cursor, count=SCAN_COUNT)
        if members:
            pipe = client.pipeline(transaction=False)
            for member, _ in members:
                drop(pipe, member.decode() if isinstance(member, bytes) else str(member))
            pipe.zrem(set_key, *(member for member, _ in members))
            pipe.execute()
        if cursor == 0:
            return
