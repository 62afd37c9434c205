"""Tier 2: the exact and streaming response cache, over any :class:`CacheStore`.

A request is eligible when the cache is on, its temperature is 0 or omitted, it is not
streamed (or stream caching is on), and the client did not send ``Cache-Control:
no-store``/``no-cache``. Eligible requests are looked up under :func:`cache_key`; a miss is
proxied and its answer stored when it is a complete ``200`` within the size limits.

Stored values are an envelope, so a value that is not ours (garbage planted under a key, a
truncated write, another version's format) is a miss that gets replaced, never a 500::

    b"CRv1" ‖ u32 header length ‖ header JSON ‖ payload

with header ``{"kind": "body"|"sse", "content_type": …}``. A streamed answer is stored as
its SSE bytes and replayed event by event.

Invariants: only a response whose upstream finished normally is stored (no error event, no
client disconnect, no truncation); the store can fail at any time and the request still
succeeds (the failure counts as a miss or as an unstored response).
"""

from __future__ import annotations

import json
import logging
import struct
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from continuum.caching.cache_key import cache_key
from continuum.errors import StoreError
from continuum.interfaces import rate_text
from continuum.request import RESPONSES

if TYPE_CHECKING:
    from continuum.config import ResponseCacheConfig
    from continuum.interfaces import CacheStore
    from continuum.metrics import RouterMetrics
    from continuum.request import RequestContext

log = logging.getLogger(__name__)

HIT, MISS, BYPASS = "HIT", "MISS", "BYPASS"
_MAGIC = b"CRv1"
_HEADER = struct.Struct(">I")
#: What a complete stream ends with, per protocol.
_STREAM_END = {"openai": b"data: [DONE]", "anthropic": b"event: message_stop"}


@dataclass(frozen=True, slots=True)
class CachedResponse:
    """A decoded cache entry."""

    kind: str
    content_type: str
    payload: bytes

    def events(self) -> Iterator[bytes]:
        """The stored SSE stream, one event per chunk."""
        data = self.payload
        start = 0
        while start < len(data):
            end = data.find(b"\n\n", start)
            end = len(data) if end < 0 else end + 2
            yield data[start:end]
            start = end


def encode_entry(kind: str, content_type: str, payload: bytes) -> bytes:
    """Wrap a response in the cache envelope."""
    header = json.dumps({"kind": kind, "content_type": content_type}).encode()
    return _MAGIC + _HEADER.pack(len(header)) + header + payload


def decode_entry(value: bytes) -> CachedResponse | None:
    """Unwrap a cache envelope; None for anything that is not a valid entry."""
    if len(value) < 8 or value[:4] != _MAGIC:
        return None
    (length,) = _HEADER.unpack_from(value, 4)
    end = 8 + length
    if end > len(value):
        return None
    try:
        header = json.loads(value[8:end])
        kind, content_type = header["kind"], header["content_type"]
    except (ValueError, KeyError, TypeError):
        return None
    if kind not in ("body", "sse") or not isinstance(content_type, str):
        return None
    return CachedResponse(kind, content_type, value[end:])


class ResponseCache:
    """Eligibility, lookup and storing for one worker; the store may be shared (Redis)."""

    def __init__(
        self, config: ResponseCacheConfig, store: CacheStore, metrics: RouterMetrics
    ) -> None:
        self.config = config
        self.store = store
        self.metrics = metrics
        self.counts = {"hit": 0, "miss": 0, "skip": 0}

    def reconfigure(self, config: ResponseCacheConfig, store: CacheStore | None = None) -> None:
        """Apply a reloaded ``response_cache`` section; ``store`` (what the old store's
        :meth:`~continuum.interfaces.CacheStore.reconfigure` built) replaces the old one,
        which is closed."""
        self.config = config
        if store is not None:
            old, self.store = self.store, store
            old.close()

    def _count(self, result: str) -> None:
        self.counts[result] += 1
        self.metrics.adder(self.metrics.response_cache, result)(1)

    def eligible(self, ctx: RequestContext, cache_control: str | None) -> bool:
        """Whether ``ctx`` may be answered from and stored in the cache (counts a skip).
        Responses API requests never are: each answer has its own id, and the backend may
        store it for a later ``previous_response_id``."""
        config = self.config
        ok = (
            config.enabled
            and ctx.endpoint != RESPONSES
            and (ctx.temperature is None or ctx.temperature == 0)
            and (not ctx.stream or config.cache_streaming)
            and not (cache_control and ("no-store" in cache_control
                                        or "no-cache" in cache_control))
        )
        if not ok:
            self._count("skip")
        return ok

    def lookup(self, ctx: RequestContext) -> CachedResponse | None:
        """The cached answer for ``ctx``; counts hit or miss."""
        key = _key_of(ctx)
        try:
            value = self.store.get(key)
        except StoreError as exc:
            log.debug("cache get failed (%s): treated as a miss", exc.kind)
            value = None
        except Exception as exc:  # a store bug is a miss too, never a 500
            log.warning("cache get failed (%s): treated as a miss", type(exc).__name__)
            value = None
        entry = None if value is None else decode_entry(value)
        expected = "sse" if ctx.stream else "body"
        if entry is None or entry.kind != expected:
            if value is not None:
                log.warning("cache entry %s is not a valid %s entry; replacing it",
                            key[:16], expected)
                self._delete(key)
            self._count("miss")
            return None
        self._count("hit")
        return entry

    def _delete(self, key: str) -> None:
        try:
            self.store.delete(key)
        except Exception:  # StoreError or a store bug: the entry is replaced or expires
            log.debug("cache delete failed", exc_info=True)

    def _store(self, key: str, value: bytes) -> None:
        try:
            self.store.set(key, value, self.config.ttl)
        except Exception as exc:  # StoreError or a store bug: the answer is still served
            log.debug("cache set failed (%s); response not cached",
                      exc.kind if isinstance(exc, StoreError) else type(exc).__name__)
            self.metrics.child(self.metrics.response_cache_stores, "error").inc()
            return
        self.metrics.child(self.metrics.response_cache_stores, "stored").inc()

    def store_body(self, ctx: RequestContext, status: int, content_type: str,
                   body: bytes) -> None:
        """Store a non-streamed answer if it is a 200 within ``max_response_size``."""
        if status != 200:
            return
        if len(body) > self.config.max_response_size:
            self.metrics.child(self.metrics.response_cache_stores, "too_large").inc()
            return
        self._store(_key_of(ctx), encode_entry("body", content_type, body))

    def tee_stream(
        self,
        ctx: RequestContext,
        stream: Iterator[bytes],
        content_type: str,
        completed: Callable[[], bool],
        on_complete: Callable[[bytes], None] | None = None,
    ) -> Iterator[bytes]:
        """Pass ``stream`` through unchanged while buffering it; store it at the end when
        ``completed()`` says the upstream finished normally, the stream carries its end
        marker and it fit in ``max_stream_buffer_size`` (then ``on_complete`` gets it too:
        the semantic cache indexes it)."""
        limit = self.config.max_stream_buffer_size
        buffer: bytearray | None = bytearray()
        finished = False
        try:
            for chunk in stream:
                if buffer is not None:
                    if len(buffer) + len(chunk) > limit:
                        buffer = None
                        self.metrics.child(self.metrics.response_cache_stores, "too_large").inc()
                    else:
                        buffer += chunk
                yield chunk
            finished = True
        finally:
            close = getattr(stream, "close", None)
            if close is not None:
                close()  # releases the upstream lease on every path
            if buffer is not None and finished and completed():
                marker = _STREAM_END[ctx.protocol]
                if marker in buffer[-256:]:
                    payload = bytes(buffer)
                    self._store(_key_of(ctx), encode_entry("sse", content_type, payload))
                    if on_complete is not None:
                        on_complete(payload)
                else:
                    self.metrics.child(self.metrics.response_cache_stores, "incomplete").inc()
            elif buffer is not None:
                self.metrics.child(self.metrics.response_cache_stores, "incomplete").inc()

    def clear(self) -> int:
        """Drop every entry of this router's store.

        Raises:
            StoreError: the store could not be cleared.
        """
        return self.store.clear()

    def stats(self) -> dict[str, Any]:
        """The seed's ``/admin/response-cache/stats`` document (this worker's counters)."""
        config = self.config
        try:
            store_stats = self.store.stats()
        except StoreError:
            store_stats = None
        counts = self.counts
        looked_up = counts["hit"] + counts["miss"]
        doc: dict[str, Any] = {
            "enabled": config.enabled,
            "backend_type": config.backend,
            "entries": store_stats.entries if store_stats else None,
            "capacity": config.capacity,
            "requests": {**counts, "total": looked_up + counts["skip"]},
            "hit_rate": rate_text(counts["hit"], looked_up),
            "evictions": store_stats.evictions if store_stats else 0,
            "size_bytes": store_stats.size_bytes if store_stats else 0,
            "config": {
                "backend": config.backend,
                "ttl": _duration(config.ttl),
                "capacity": config.capacity,
                "max_response_size": config.max_response_size,
                "max_stream_buffer_size": config.max_stream_buffer_size,
            },
        }
        extra = (store_stats.extra or {}) if store_stats else {}
        if store_stats and "connections" in extra:
            # A store with a connection pool (Redis) gets a section under its own name.
            doc[store_stats.backend] = {
                "connections": extra.get("connections", {"active": 0, "idle": 0}),
                "fallback_active": bool(extra.get("fallback_active", False)),
                # what the in-memory fallback holds (it serves while Redis is away)
                "fallback_entries": int(extra.get("fallback_entries", 0)),
                "errors": extra.get("errors", {"connection": 0, "timeout": 0, "protocol": 0,
                                              "other": 0}),
            }
        return doc


def _key_of(ctx: RequestContext) -> str:
    """``ctx.cache_key`` (derived when the request was admitted), else computed and kept."""
    key = ctx.cache_key
    if key is None:
        key = ctx.cache_key = cache_key(ctx)
    return key


def _duration(seconds: float) -> str:
    from continuum.config.fields import format_duration

    return format_duration(seconds)
