"""``memory``: the in-process KV cache index (Tier 4), one per worker.

``prefix_hash -> {backend -> KvHolding}``, bounded by ``max_entries`` prefixes and aged
out ``entry_ttl_seconds`` after an entry's last event. It is also the fallback of
:class:`stores.kv_redis.RedisKvIndex` while Redis is unreachable.

Transitions (:func:`transition_table`; the Redis index uses the same table):

    ===================  ===============  ==========================  ================
    event                offloading off   offloading on, evict→warm   on, evict→remove
    ===================  ===============  ==========================  ================
    cache_created        GpuHot           GpuHot                      GpuHot
    cache_offloaded      remove           StorageWarm                 StorageWarm
    cache_evicted        remove           GpuHot → StorageWarm,       remove
                                          else remove
    cache_cleared        remove all of the backend (``prefix_hash`` ignored)
    ===================  ===============  ==========================  ================

An upsert with ``token_count`` 0 (the event carried none) keeps the count already known.

Invariants (under ``_lock``):

* ``_prefixes`` is ordered by each prefix's last upsert, oldest first, and holds at most
  ``max_entries`` prefixes, none of them empty. ``touched`` of a prefix is the newest
  ``updated_at`` among its holdings, so a sweep from the front can stop at the first
  prefix that is still fresh: expiry costs ``O(expired)``, never a scan.
* ``_by_backend[b]`` is exactly the set of prefixes holding an entry of ``b``, so
  ``cache_cleared`` costs ``O(entries of b)``.
* ``_entries`` and ``_tiers`` count the holdings (in total and by tier).
* ``ranked`` of a prefix is None or its holdings sorted most tokens first, ties by name.
* Entries past their TTL may linger until a query meets them, the sweep reaches them, or
  capacity pushes them out; queries never return them.

Chain keys (:meth:`InMemoryKvIndex.apply_chain`, :mod:`continuum.prefix_chain`) live in a
second table with the same rules: ``_chain`` maps a key to its holders, ordered by last
upsert and bounded by ``max_entries`` keys; ``_chain_by_backend[b]`` is exactly the set of
keys holding an entry of ``b``. An entry expires ``entry_ttl_seconds`` after its last event,
or, when approximate (recorded by the router, not by an engine event), ``ttl`` seconds after
it was recorded (``ttl`` is at most ``entry_ttl_seconds``, so the sweep's early stop holds).
A query walks the chain from its deepest key and stops once every backend that holds any
chain key has been found: ``O(len(chain))`` dictionary reads at worst.
"""

from __future__ import annotations

import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

from continuum.interfaces import (
    CACHE_CLEARED,
    CACHE_CREATED,
    CACHE_EVICTED,
    CACHE_OFFLOADED,
    KV_EVENT_TYPES,
    TIER_GPU_HOT,
    TIER_STORAGE_WARM,
    ChainMatch,
    KvCacheIndex,
    KvHolding,
)

if TYPE_CHECKING:
    from continuum.config import RouterConfig
    from continuum.metrics import RouterMetrics

Clock = Callable[[], float]

#: What a query for an unknown prefix returns: one shared tuple, nothing allocated.
EMPTY: tuple[KvHolding, ...] = ()

#: Actions of :func:`transition_table`.
UPSERT_GPU_HOT = "upsert_gpu_hot"
UPSERT_STORAGE_WARM = "upsert_storage_warm"
DEMOTE = "demote"  # GpuHot → StorageWarm; anything else (StorageWarm, absent) is removed
REMOVE = "remove"
REMOVE_BACKEND = "remove_backend"

#: Prefixes dropped per lock acquisition by :meth:`InMemoryKvIndex.cleanup_expired`.
SWEEP_BATCH = 1000


def transition_table(storage_offloading: bool, treat_eviction_as_offload: bool) -> dict[str, str]:
    """``event -> action`` for the given ``kv_cache_index.storage_offloading`` settings."""
    if not storage_offloading:
        return {CACHE_CREATED: UPSERT_GPU_HOT, CACHE_OFFLOADED: REMOVE,
                CACHE_EVICTED: REMOVE, CACHE_CLEARED: REMOVE_BACKEND}
    return {CACHE_CREATED: UPSERT_GPU_HOT, CACHE_OFFLOADED: UPSERT_STORAGE_WARM,
            CACHE_EVICTED: DEMOTE if treat_eviction_as_offload else REMOVE,
            CACHE_CLEARED: REMOVE_BACKEND}


def action_for(table: dict[str, str], event: str, token_count: int) -> str:
    """The action for ``event``.

    Raises:
        ValueError: unknown event type or negative ``token_count``.
    """
    action = table.get(event)
    if action is None:
        raise ValueError(f"unknown KV event type {event!r}; expected one of "
                         f"{', '.join(KV_EVENT_TYPES)}")
    if token_count < 0:
        raise ValueError(f"token_count must not be negative (got {token_count})")
    return action


def rank_key(holding: KvHolding | ChainMatch) -> tuple[int, str]:
    """Sort key: most tokens first, ties by backend name."""
    return -holding.token_count, holding.backend


def check_chain(event: str, entries: Sequence[tuple[str, int]], ttl: float | None) -> None:
    """Refuse what :meth:`KvCacheIndex.apply_chain` must refuse, before anything changes.

    Raises:
        ValueError: a negative token count, or ``ttl`` with an event that is not
            ``cache_created`` (only routed requests are recorded approximately).
    """
    if ttl is not None and (event != CACHE_CREATED or ttl <= 0):
        raise ValueError(f"approximate chain entries are cache_created with a positive ttl "
                         f"(got {event!r}, ttl={ttl})")
    for _, tokens in entries:
        if tokens < 0:
            raise ValueError(f"token_count must not be negative (got {tokens})")


class _ChainEntry:
    """One backend's holding of one chain key (mutated only under the index lock)."""

    __slots__ = ("approximate", "at", "expires", "tier", "tokens")

    def __init__(self, tokens: int, tier: str, at: float, expires: float,
                 approximate: bool) -> None:
        self.tokens = tokens
        self.tier = tier
        self.at = at
        self.expires = expires
        self.approximate = approximate


class _Prefix:
    """The holdings of one prefix (mutated only under the index lock)."""

    __slots__ = ("holdings", "ranked", "touched")

    def __init__(self) -> None:
        self.holdings: dict[str, KvHolding] = {}
        self.ranked: tuple[KvHolding, ...] | None = None
        self.touched = 0.0


class InMemoryKvIndex(KvCacheIndex):
    """The Tier 4 index in a dict, safe under threads and greenlets.

    Args:
        max_entries: prefixes kept; when full, the least recently updated 10% are evicted.
        entry_ttl_seconds: an entry without a new event for this long is expired.
        storage_offloading: track StorageWarm entries (``storage_offloading.enabled``).
        treat_eviction_as_offload: ``cache_evicted`` of a GpuHot entry demotes it.
        clock: seconds; wall time by default, so ``updated_at`` means the same here as in
            the Redis index. Tests inject a fake one.
        sweep_interval: seconds between background sweeps after :meth:`start`; default
            ``min(60, entry_ttl_seconds / 2)``.

    One ``threading.Lock`` guards every mutation (cooperative under gevent's patching; no
    code path yields while holding it). A query for an unknown prefix takes no lock.
    """

    name = "memory"

    def __init__(
        self,
        max_entries: int = 100_000,
        entry_ttl_seconds: float = 600,
        *,
        storage_offloading: bool = False,
        treat_eviction_as_offload: bool = True,
        clock: Clock = time.time,
        sweep_interval: float | None = None,
    ) -> None:
        if max_entries < 1:
            raise ValueError(f"max_entries must be at least 1 (got {max_entries})")
        if entry_ttl_seconds <= 0:
            raise ValueError(f"entry_ttl_seconds must be positive (got {entry_ttl_seconds})")
        self.max_entries = max_entries
        self.entry_ttl_seconds = entry_ttl_seconds
        self.storage_offloading = storage_offloading
        self.treat_eviction_as_offload = treat_eviction_as_offload
        self.sweep_interval = (sweep_interval if sweep_interval is not None
                               else min(60.0, entry_ttl_seconds / 2))
        self._table = transition_table(storage_offloading, treat_eviction_as_offload)
        self._clock = clock
        self._lock = threading.Lock()
        self._prefixes: OrderedDict[str, _Prefix] = OrderedDict()
        self._by_backend: dict[str, set[str]] = {}
        self._entries = 0
        self._tiers = {TIER_GPU_HOT: 0, TIER_STORAGE_WARM: 0}
        self._events = dict.fromkeys(KV_EVENT_TYPES, 0)
        self._hits = 0
        self._evicted = 0
        self._expired = 0
        self._greenlet: Any = None
        self._chain: OrderedDict[str, dict[str, _ChainEntry]] = OrderedDict()
        self._chain_touched: dict[str, float] = {}
        self._chain_by_backend: dict[str, set[str]] = {}
        self._chain_entries = 0
        self._chain_approximate = 0
        self._chain_hits = 0

    @classmethod
    def from_config(
        cls, config: RouterConfig, *, metrics: RouterMetrics | None = None, **_: Any
    ) -> InMemoryKvIndex:
        """The index for ``config.kv_cache_index`` (``metrics`` is accepted, not used)."""
        kv = config.kv_cache_index
        return cls(kv.max_entries, kv.entry_ttl_seconds,
                   storage_offloading=kv.storage_offloading.enabled,
                   treat_eviction_as_offload=kv.storage_offloading.treat_eviction_as_offload)

    def start(self) -> None:
        """Start the expiry sweep greenlet (idempotent; call in the worker)."""
        if self._greenlet is not None:
            return
        import gevent

        def sweep() -> None:
            while True:
                gevent.sleep(self.sweep_interval)
                self.cleanup_expired(yield_between=gevent.sleep)

        self._greenlet = gevent.spawn(sweep)

    def close(self) -> None:
        """Stop the sweep greenlet; the entries stay."""
        greenlet, self._greenlet = self._greenlet, None
        if greenlet is not None:
            greenlet.kill(block=False)

    def apply(self, backend: str, event: str, prefix_hash: str, token_count: int = 0) -> None:
        """Apply one event from ``backend`` (see the module's transition table).

        Raises:
            ValueError: unknown event type or negative ``token_count``.
        """
        action = action_for(self._table, event, token_count)
        with self._lock:
            self._events[event] += 1
            if action == REMOVE_BACKEND:
                for held in tuple(self._by_backend.get(backend, ())):
                    self._drop(held, backend)
                for key in tuple(self._chain_by_backend.get(backend, ())):
                    self._chain_drop(key, backend)
                return
            now = self._clock()
            prefix = self._prefixes.get(prefix_hash)
            old = prefix.holdings.get(backend) if prefix is not None else None
            if old is not None and now - old.updated_at >= self.entry_ttl_seconds:
                self._drop(prefix_hash, backend)  # expired: the event meets no entry
                self._expired += 1
                old = None
            if action == UPSERT_GPU_HOT:
                self._put(prefix_hash, backend, token_count, TIER_GPU_HOT, old, now)
            elif action == UPSERT_STORAGE_WARM or (
                action == DEMOTE and old is not None and old.tier == TIER_GPU_HOT
            ):
                self._put(prefix_hash, backend, token_count, TIER_STORAGE_WARM, old, now)
            elif old is not None:  # REMOVE, or DEMOTE of a StorageWarm entry
                self._drop(prefix_hash, backend)

    def query_backends(self, prefix_hash: str) -> Sequence[KvHolding]:
        """Unexpired holders of ``prefix_hash``, most tokens first (ties by name).

        Expired holdings met here are removed. An unknown prefix returns :data:`EMPTY`.
        """
        if prefix_hash not in self._prefixes:  # one atomic dict read: no lock needed
            return EMPTY
        with self._lock:
            prefix = self._prefixes.get(prefix_hash)
            if prefix is None:
                return EMPTY
            ranked = prefix.ranked
            if ranked is None:
                ranked = prefix.ranked = tuple(sorted(prefix.holdings.values(), key=rank_key))
            cutoff = self._clock() - self.entry_ttl_seconds
            for holding in ranked:
                if holding.updated_at <= cutoff:
                    return self._expire_in(prefix_hash, prefix, cutoff)
            self._hits += 1
            return ranked

    def apply_chain(self, backend: str, event: str, entries: Sequence[tuple[str, int]],
                    *, ttl: float | None = None) -> None:
        """Apply one event to ``backend``'s chain keys (see
        :meth:`~continuum.interfaces.KvCacheIndex.apply_chain`).

        Raises:
            ValueError: unknown event type, negative token count, bad ``ttl``.
        """
        action = action_for(self._table, event, 0)
        check_chain(event, entries, ttl)
        with self._lock:
            self._events[event] += 1
            if action == REMOVE_BACKEND:
                for key in tuple(self._chain_by_backend.get(backend, ())):
                    self._chain_drop(key, backend)
                return
            now = self._clock()
            for key, tokens in entries:
                self._chain_apply(action, backend, key, tokens, now, ttl)

    def query_chain(self, keys: Sequence[str],
                    prefix_hash: str | None = None) -> Sequence[ChainMatch]:
        """Each backend's longest run of ``keys`` held from the first, most tokens first
        (ties by name); seed-only holders of ``prefix_hash`` at depth 0 (see
        :meth:`~continuum.interfaces.KvCacheIndex.query_chain`)."""
        found: dict[str, ChainMatch] = {}
        if self._chain and keys and keys[0] in self._chain:
            with self._lock:
                self._walk_chain(keys, found)
        if prefix_hash is not None:
            for holding in self.query_backends(prefix_hash):
                if holding.backend not in found:
                    found[holding.backend] = ChainMatch(
                        holding.backend, 0, holding.token_count, holding.tier, False,
                        holding.updated_at)
        if not found:
            return ()
        return tuple(sorted(found.values(), key=rank_key))

    def cleanup_expired(self, yield_between: Callable[[], Any] | None = None) -> int:
        """Drop prefixes whose every entry is past its TTL; return how many entries went.

        Walks from the least recently updated prefix and stops at the first fresh one. The
        lock is released every :data:`SWEEP_BATCH` prefixes (``yield_between`` is called
        then, so the background greenlet lets others run).
        """
        removed = 0
        while True:
            with self._lock:
                cutoff = self._clock() - self.entry_ttl_seconds
                prefixes = self._prefixes
                for _ in range(SWEEP_BATCH):
                    chain = self._chain
                    if chain:
                        key = next(iter(chain))
                        if self._chain_touched[key] <= cutoff:
                            for backend in tuple(chain[key]):
                                self._chain_drop(key, backend)
                                removed += 1
                                self._expired += 1
                            continue
                    if not prefixes:
                        return removed
                    prefix_hash, prefix = next(iter(prefixes.items()))
                    if prefix.touched > cutoff:
                        return removed
                    for backend in tuple(prefix.holdings):
                        self._drop(prefix_hash, backend)
                        removed += 1
                        self._expired += 1
            if yield_between is not None:
                yield_between()

    def clear(self) -> int:
        """Drop every entry; return how many there were (expired ones not yet swept too)."""
        with self._lock:
            removed = self._entries + self._chain_entries
            self._prefixes.clear()
            self._by_backend.clear()
            self._entries = 0
            self._tiers = dict.fromkeys(self._tiers, 0)
            self._chain.clear()
            self._chain_touched.clear()
            self._chain_by_backend.clear()
            self._chain_entries = self._chain_approximate = 0
            return removed

    def stats(self) -> dict[str, Any]:
        """Counters: sizes, ``total_hits`` (queries that found a holder), ``total_evictions``
        (entries evicted by capacity or TTL, ``expired`` of them by TTL), ``events`` by type,
        ``tiers`` (entries by tier) and the settings."""
        with self._lock:
            return {
                "backend": self.name,
                "prefix_count": len(self._prefixes),
                "entry_count": self._entries,
                "total_hits": self._hits,
                "total_evictions": self._evicted + self._expired,
                "expired": self._expired,
                "events": dict(self._events),
                "tiers": dict(self._tiers),
                "chain_key_count": len(self._chain),
                "chain_entry_count": self._chain_entries,
                "chain_approximate_entries": self._chain_approximate,
                "chain_hits": self._chain_hits,
                "backends": len(self._by_backend.keys() | self._chain_by_backend.keys()),
                "max_entries": self.max_entries,
                "entry_ttl_seconds": self.entry_ttl_seconds,
                "storage_offloading": self.storage_offloading,
                "treat_eviction_as_offload": self.treat_eviction_as_offload,
            }

    def __len__(self) -> int:
        """Prefixes held, expired or not."""
        return len(self._prefixes)

    # -- internals, called with the lock held ----------------------------------------

    def _put(self, prefix_hash: str, backend: str, token_count: int, tier: str,
             old: KvHolding | None, now: float) -> None:
        prefix = self._prefixes.get(prefix_hash)
        if prefix is None:
            if len(self._prefixes) >= self.max_entries:
                self._evict_oldest()
            prefix = self._prefixes[prefix_hash] = _Prefix()
        else:
            self._prefixes.move_to_end(prefix_hash)
        if old is None:
            self._entries += 1
            self._by_backend.setdefault(backend, set()).add(prefix_hash)
        else:
            self._tiers[old.tier] -= 1
            if not token_count:
                token_count = old.token_count
        self._tiers[tier] += 1
        prefix.holdings[backend] = KvHolding(backend, token_count, tier, now)
        prefix.ranked = None
        prefix.touched = now

    def _drop(self, prefix_hash: str, backend: str) -> None:
        prefix = self._prefixes[prefix_hash]
        holding = prefix.holdings.pop(backend)
        self._entries -= 1
        self._tiers[holding.tier] -= 1
        prefix.ranked = None
        held = self._by_backend[backend]
        held.discard(prefix_hash)
        if not held:
            del self._by_backend[backend]
        if not prefix.holdings:
            del self._prefixes[prefix_hash]

    def _expire_in(self, prefix_hash: str, prefix: _Prefix, cutoff: float) -> Sequence[KvHolding]:
        for backend, holding in tuple(prefix.holdings.items()):
            if holding.updated_at <= cutoff:
                self._drop(prefix_hash, backend)
                self._expired += 1
        if not prefix.holdings:
            return EMPTY
        ranked = prefix.ranked = tuple(sorted(prefix.holdings.values(), key=rank_key))
        self._hits += 1
        return ranked

    def _evict_oldest(self) -> None:
        prefixes = self._prefixes
        for _ in range(max(1, self.max_entries // 10)):
            if not prefixes:
                return
            prefix_hash, prefix = next(iter(prefixes.items()))
            for backend in tuple(prefix.holdings):
                self._drop(prefix_hash, backend)
                self._evicted += 1

    def _chain_apply(self, action: str, backend: str, key: str, tokens: int, now: float,
                     ttl: float | None) -> None:
        holders = self._chain.get(key)
        old = holders.get(backend) if holders is not None else None
        if old is not None and old.expires <= now:
            self._chain_drop(key, backend)  # expired: the event meets no entry
            self._expired += 1
            old = None
        if ttl is not None:  # approximate: never over an entry an event confirmed
            if old is None or old.approximate:
                self._chain_put(key, backend, tokens, TIER_GPU_HOT, now, now + ttl, True, old)
        elif action == UPSERT_GPU_HOT:
            self._chain_put(key, backend, tokens, TIER_GPU_HOT, now,
                            now + self.entry_ttl_seconds, False, old)
        elif action == UPSERT_STORAGE_WARM or (
            action == DEMOTE and old is not None and old.tier == TIER_GPU_HOT
            and not old.approximate
        ):
            self._chain_put(key, backend, tokens, TIER_STORAGE_WARM, now,
                            now + self.entry_ttl_seconds, False, old)
        elif old is not None:  # REMOVE, or DEMOTE of a warm or approximate entry
            self._chain_drop(key, backend)

    def _chain_put(self, key: str, backend: str, tokens: int, tier: str, now: float,
                   expires: float, approximate: bool, old: _ChainEntry | None) -> None:
        holders = self._chain.get(key)
        if holders is None:
            if len(self._chain) >= self.max_entries:
                self._chain_evict_oldest()
            holders = self._chain[key] = {}
        else:
            self._chain.move_to_end(key)
        if old is None:
            self._chain_entries += 1
            self._chain_by_backend.setdefault(backend, set()).add(key)
        else:
            self._chain_approximate -= old.approximate
            if not tokens:
                tokens = old.tokens
        self._chain_approximate += approximate
        holders[backend] = _ChainEntry(tokens, tier, now, expires, approximate)
        self._chain_touched[key] = now

    def _chain_drop(self, key: str, backend: str) -> None:
        holders = self._chain[key]
        entry = holders.pop(backend)
        self._chain_entries -= 1
        self._chain_approximate -= entry.approximate
        held = self._chain_by_backend[backend]
        held.discard(key)
        if not held:
            del self._chain_by_backend[backend]
        if not holders:
            del self._chain[key]
            del self._chain_touched[key]

    def _chain_evict_oldest(self) -> None:
        chain = self._chain
        for _ in range(max(1, self.max_entries // 10)):
            if not chain:
                return
            key = next(iter(chain))
            for backend in tuple(chain[key]):
                self._chain_drop(key, backend)
                self._evicted += 1

    def _walk_chain(self, keys: Sequence[str], found: dict[str, ChainMatch]) -> None:
        """Fill ``found`` with each backend's longest unexpired run of ``keys``."""
        chain = self._chain
        now = self._clock()
        alive: set[str] | None = None
        last: dict[str, tuple[int, _ChainEntry]] = {}
        for depth, key in enumerate(keys, 1):
            holders = chain.get(key)
            if holders is None:
                break
            expired = [b for b, e in holders.items() if e.expires <= now]
            for backend in expired:  # an expired entry is a gap in the run
                self._chain_drop(key, backend)
                self._expired += 1
            held = holders.keys() if key in chain else set()
            alive = set(held) if alive is None else alive & held
            if not alive:
                break
            for backend in alive:
                last[backend] = (depth, holders[backend])
        for backend, (depth, entry) in last.items():
            found[backend] = ChainMatch(backend, depth, entry.tokens, entry.tier,
                                        entry.approximate, entry.at)
        if found:
            self._chain_hits += 1
