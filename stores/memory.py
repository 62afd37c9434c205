"""``memory``: the in-process response cache store (LRU by entry count, per-entry TTL).

The default store, and the in-memory fallback of :class:`stores.redis_store.RedisCacheStore`
while Redis is unreachable.

Invariants (under ``_lock``):

* ``_data`` holds ``key -> (value, expires_at)`` in recency order, least recent first;
  ``len(_data) <= capacity``.
* ``_size`` is the sum of ``len(value)`` over ``_data``.
* Every entry has an item ``(expires_at, key)`` in the ``_expiries`` heap. Items whose entry
  has since been overwritten, deleted or evicted stay behind (stale) until popped or the
  heap is rebuilt, which happens once it is more than twice the size of ``_data``; so
  purging expired entries costs ``O(expired · log n)``, never a scan.
* Expired entries are removed lazily: by ``get`` when it meets one, and all at once when a
  new key arrives at a full store, before any live entry is evicted by LRU.
"""

from __future__ import annotations

import heapq
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from continuum.interfaces import CacheStore, CacheStoreStats

if TYPE_CHECKING:
    from continuum.config import RouterConfig
    from continuum.metrics import RouterMetrics

Clock = Callable[[], float]


class InMemoryCacheStore(CacheStore):
    """An LRU cache of byte values with per-entry TTLs, safe under threads and greenlets.

    Args:
        capacity: entries kept before the least recently used one is evicted.
        max_ttl: upper bound on any entry's TTL in seconds (the Redis fallback caps its
            entries at ``fallback_ttl_seconds``); None for no bound.
        clock: monotonic clock in seconds; tests inject a fake one.
        metrics: when given, ``cache_entries`` and ``cache_evictions`` follow this store.

    A ``threading.Lock`` guards every access; under gevent's monkey patching it is a
    cooperative lock, and no code path yields while holding it.
    """

    name = "memory"

    def __init__(
        self,
        capacity: int = 1000,
        *,
        max_ttl: float | None = None,
        clock: Clock = time.monotonic,
        metrics: RouterMetrics | None = None,
    ) -> None:
        if capacity < 1:
            raise ValueError(f"capacity must be at least 1 (got {capacity})")
        if max_ttl is not None and max_ttl <= 0:
            raise ValueError(f"max_ttl must be positive (got {max_ttl})")
        self.capacity = capacity
        self.max_ttl = max_ttl
        self._clock = clock
        self._metrics = metrics
        self._lock = threading.Lock()
        self._data: OrderedDict[str, tuple[bytes, float]] = OrderedDict()
        self._expiries: list[tuple[float, str]] = []
        self._size = 0
        self._hits = 0
        self._misses = 0
        self._evictions = 0
        self._expired = 0

    @classmethod
    def from_config(
        cls, config: RouterConfig, *, metrics: RouterMetrics | None = None, **_: Any
    ) -> InMemoryCacheStore:
        """The store for ``response_cache.capacity``, reporting to ``metrics`` if given."""
        return cls(config.response_cache.capacity, metrics=metrics)

    def reconfigure(self, config: RouterConfig, **_: Any) -> None:
        """A reloaded ``response_cache.capacity`` resizes this store in place (entries
        kept); nothing to replace."""
        if config.response_cache.capacity != self.capacity:
            self.resize(config.response_cache.capacity)

    def get(self, key: str) -> bytes | None:
        """The value under ``key``; None when absent or expired (an expired one is dropped)."""
        with self._lock:
            entry = self._data.get(key)
            if entry is not None:
                if entry[1] > self._clock():
                    self._data.move_to_end(key)
                    self._hits += 1
                    return entry[0]
                del self._data[key]
                self._size -= len(entry[0])
                self._expired += 1
                self._publish_entries()
            self._misses += 1
            return None

    def set(self, key: str, value: bytes, ttl: float) -> None:
        """Store ``value`` for ``ttl`` seconds (capped at ``max_ttl``).

        A non-positive ``ttl`` leaves nothing stored: an existing entry under ``key`` is
        removed, as a Redis entry would be.
        """
        if type(value) is not bytes:
            value = bytes(value)  # bytearray/memoryview: never keep a view of caller memory
        if ttl <= 0:
            self.delete(key)
            return
        if self.max_ttl is not None and ttl > self.max_ttl:
            ttl = self.max_ttl
        with self._lock:
            now = self._clock()
            expires_at = now + ttl
            old = self._data.pop(key, None)
            if old is not None:
                self._size -= len(old[0])
            elif len(self._data) >= self.capacity:
                self._make_room(now)
            self._data[key] = (value, expires_at)
            self._size += len(value)
            heapq.heappush(self._expiries, (expires_at, key))
            if len(self._expiries) > 2 * len(self._data) + 64:
                self._rebuild_expiries()
            self._publish_entries()

    def resize(self, capacity: int) -> None:
        """Change ``capacity`` (hot reload); a smaller one evicts least recently used
        entries at once, so ``len <= capacity`` holds again immediately."""
        if capacity < 1:
            raise ValueError(f"capacity must be at least 1 (got {capacity})")
        with self._lock:
            self.capacity = capacity
            now = self._clock()
            while len(self._data) > capacity:
                self._make_room(now)
            self._publish_entries()

    def delete(self, key: str) -> None:
        """Remove ``key`` if present."""
        with self._lock:
            old = self._data.pop(key, None)
            if old is not None:
                self._size -= len(old[0])
                self._publish_entries()

    def clear(self) -> int:
        """Drop every entry; return how many unexpired entries there were."""
        with self._lock:
            now = self._clock()
            live = sum(1 for _, expires_at in self._data.values() if expires_at > now)
            self._data.clear()
            self._expiries.clear()
            self._size = 0
            self._publish_entries()
            return live

    def stats(self) -> CacheStoreStats:
        """Counters; ``entries`` may include expired entries not yet dropped."""
        with self._lock:
            return CacheStoreStats(
                backend=self.name,
                entries=len(self._data),
                capacity=self.capacity,
                hits=self._hits,
                misses=self._misses,
                evictions=self._evictions,
                size_bytes=self._size,
                extra={"expired": self._expired},
            )

    def __len__(self) -> int:
        """Entries held, expired or not."""
        return len(self._data)

    def keys_by_recency(self) -> list[str]:
        """Keys held, least recently used first (for tests and debugging)."""
        with self._lock:
            return list(self._data)

    # -- internals, called with the lock held ----------------------------------------

    def _make_room(self, now: float) -> None:
        """Free one slot: drop every expired entry, or else the least recently used one."""
        expiries = self._expiries
        while expiries and expiries[0][0] <= now:
            expires_at, key = heapq.heappop(expiries)
            entry = self._data.get(key)
            if entry is not None and entry[1] == expires_at:
                del self._data[key]
                self._size -= len(entry[0])
                self._expired += 1
        if self._data and len(self._data) >= self.capacity:
            _, (value, _) = self._data.popitem(last=False)
            self._size -= len(value)
            self._evictions += 1
            if self._metrics is not None:
                self._metrics.cache_evictions.inc()

    def _rebuild_expiries(self) -> None:
        self._expiries = [(expires_at, key) for key, (_, expires_at) in self._data.items()]
        heapq.heapify(self._expiries)

    def _publish_entries(self) -> None:
        if self._metrics is not None:
            self._metrics.cache_entries.set(len(self._data))
