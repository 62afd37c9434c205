"""What every KV-event source shares: its processor, counters, state and the reset rule.

The ZeroMQ sources (:mod:`listener.sources_zmq`) and the trtllm poller
(:mod:`listener.sources_trtllm`) derive from :class:`EventSource`.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field, fields
from typing import Any

import gevent

from continuum.kv_events import AllBlocksCleared, KvEventBatch
from listener.config import SourceConfig
from listener.model import SourceProcessor

__all__ = ["EventSource", "SourceStats"]

log = logging.getLogger(__name__)


@dataclass
class SourceStats:
    """Counters of one source, exported by ``/metrics`` (never reset while running)."""

    batches: int = 0
    events: int = 0
    skipped_events: int = 0
    malformed_events: int = 0
    decode_errors: int = 0
    sequence_gaps: int = 0
    duplicates: int = 0
    restarts: int = 0
    resets: int = 0
    replays: int = 0
    replay_failures: int = 0
    rejected_publishers: int = 0
    processor_errors: int = 0
    polls: int = 0
    publisher_disconnects: int = 0
    pruned_streams: int = 0
    poll_errors: dict[str, int] = field(default_factory=dict)

    def counters(self) -> dict[str, int]:
        """The integer counters by name (``poll_errors`` excluded)."""
        return {f.name: getattr(self, f.name) for f in fields(self) if f.name != "poll_errors"}


class EventSource:
    """What every source shares: its processor, counters, state and the reset rule.

    Subclasses run a loop in a greenlet between :meth:`start` and :meth:`stop`, call
    :meth:`_apply` for each batch in order and :meth:`_reset` when state was lost.
    """

    transport = "?"

    def __init__(self, config: SourceConfig, processor: SourceProcessor) -> None:
        self.config = config
        self.backend = config.backend_name
        self.processor = processor
        self.stats = SourceStats()
        self.state = "idle"
        self.last_event_at: float | None = None
        self._greenlets: list[gevent.Greenlet] = []
        self._stopping = False
        self._clean = False  # True right after a reset, until a batch is applied
        # Data-parallel ranks cleared since a batch of theirs was last applied
        self._clean_ranks: set[int | None] = set()
        self._warned: set[str] = set()

    @property
    def connected(self) -> bool:
        """Whether events can flow right now."""
        return self.state == "connected"

    def start(self) -> None:
        """Open sockets and start the loop greenlet(s)."""
        raise NotImplementedError

    def stop(self) -> None:
        """Stop the greenlets; subclasses then close what they opened. Idempotent."""
        self._stopping = True
        gevent.killall(self._greenlets, timeout=5)
        self._greenlets.clear()
        self.state = "stopped"

    def health(self) -> dict[str, Any]:
        """The ``/health`` view: no secrets, no event contents."""
        return {
            "engine": self.config.engine,
            "transport": self.transport,
            "state": self.state,
            "connected": self.connected,
            "last_event_at": self.last_event_at,
            "batches": self.stats.batches,
        }

    def _spawn(self, fn: Callable[[], None]) -> None:
        self._greenlets.append(gevent.spawn(fn))

    def _warn_once(self, key: str, message: str, *args: object) -> None:
        level = logging.DEBUG if key in self._warned else logging.WARNING
        self._warned.add(key)
        log.log(level, message, *args)

    def _apply(self, batch: KvEventBatch) -> None:
        self.stats.batches += 1
        self.stats.events += len(batch.events)
        self.stats.skipped_events += batch.skipped
        if batch.malformed:
            self._malformed(batch.malformed, batch.malformed_at, "batch")
        self.last_event_at = time.time()
        self._clean = False
        if self._clean_ranks:
            self._clean_ranks.discard(batch.data_parallel_rank)
        self._handle(batch, "a batch")

    def _handle(self, batch: KvEventBatch, what: str) -> None:
        """Give ``batch`` to the processor; a processor error resets the source's state."""
        try:
            self.processor.handle_batch(batch)
        except Exception as exc:  # a processor bug must not kill the source
            self.stats.processor_errors += 1
            # the type only: a message could quote event contents
            log.error("%s: processor failed on %s (%s); resetting", self.backend, what,
                      type(exc).__name__)
            self._reset(f"processor error ({type(exc).__name__})")

    def _malformed(self, count: int, where: str | None, unit: str) -> None:
        """Count ``count`` malformed events skipped in one ``unit`` (a batch, a reply) whose
        other events were applied; the first one's location is logged once."""
        self.stats.malformed_events += count
        # the location only: the reason could quote token values
        self._warn_once("malformed-event", "%s: skipping %d malformed event(s) of a %s, its "
                        "others applied (first at %s)", self.backend, count, unit, where)

    def _clear_rank(self, rank: int, reason: str) -> None:
        """One data-parallel rank's events were lost (or it restarted) while the other ranks'
        streams are intact: drop that rank's blocks only (a batch of that rank holding
        ``AllBlocksCleared``; the processor keys such a source's blocks per rank). Like
        resets, repeats collapse: a rank cleared with no batch of it applied since (one
        loss seen twice: a restart, then its first number above 0) is not cleared again."""
        if self._clean or rank in self._clean_ranks:  # nothing of the rank applied since
            log.info("%s: %s (state already clear)", self.backend, reason)
            return
        self._clean_ranks.add(rank)
        log.warning("%s: %s: clearing that rank's blocks", self.backend, reason)
        self._handle(KvEventBatch(ts=time.time(), events=(AllBlocksCleared(),),
                                  data_parallel_rank=rank), "a rank's clear")

    def _reset(self, reason: str) -> None:
        if self._clean:
            log.info("%s: %s (state already clear)", self.backend, reason)
            return
        self.stats.resets += 1
        log.warning("%s: %s: clearing the backend's prefixes", self.backend, reason)
        self._clean = True
        self._clean_ranks.clear()  # ``_clean`` covers every rank until a batch is applied
        try:
            self.processor.reset(reason)
        except Exception as exc:
            self.stats.processor_errors += 1
            log.error("%s: processor reset failed (%s)", self.backend, type(exc).__name__)
