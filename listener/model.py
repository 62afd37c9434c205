"""What flows inside the listener: engine batches in, prefix events out.

    source (ZMQ / trtllm poll) --KvEventBatch--> SourceProcessor --PrefixEvent--> EventHub
                                                  (tracker, recovery)            (SSE /events)

A source owns one :class:`SourceProcessor` and calls it from a single greenlet, in order;
the processor may block on ``/detokenize`` (gevent-friendly I/O). When a source loses state
(a sequence gap without replay, a trtllm restart) it calls :meth:`SourceProcessor.reset`,
which forgets every block of that backend and emits ``cache_cleared``.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

from continuum.kv_events import KvEventBatch

#: Event types published on ``/events/<backend>`` (the router's contract).
CACHE_CREATED = "cache_created"
CACHE_EVICTED = "cache_evicted"
CACHE_OFFLOADED = "cache_offloaded"
CACHE_CLEARED = "cache_cleared"


#: A chain key's change carried by a :class:`PrefixEvent`: ``(event type, key hex, tokens)``.
ChainChange = tuple[str, str, int]


@dataclass(frozen=True, slots=True)
class PrefixEvent:
    """One event for the router: a prefix appeared, moved or disappeared on the backend.

    ``prefix_hash`` is the router's prefix key (lowercase hex, 64 characters); it is None
    only for ``cache_cleared``. ``token_count`` is how many tokens of that prefix's chains
    the backend holds (the longest attributed chain), when known. ``chain``: the chain keys
    (:mod:`continuum.prefix_chain`) of that prefix whose state changed, each with the
    tokens the backend holds up to the key's end; a change of chain keys alone is sent on
    a ``cache_created``/``cache_offloaded`` that repeats the prefix's current state.
    """

    type: str
    prefix_hash: str | None = None
    token_count: int | None = None
    chain: tuple[ChainChange, ...] = ()


Emit = Callable[[PrefixEvent], None]


class SourceProcessor(Protocol):
    """Turns one backend's engine events into prefix events."""

    def handle_batch(self, batch: KvEventBatch) -> None:
        """Apply one decoded batch (events in order); emit what changed."""

    def reset(self, reason: str) -> None:
        """Forget all state of this backend and emit ``cache_cleared``."""

    def stats(self) -> dict[str, int]:
        """Counters: tracked_blocks, retained_tokens, mismatched_blocks, detokenize_calls,
        attributed_prefixes, unattributed_chains, salt_rejected, …"""
