"""Engine KV-cache events, in one engine-neutral shape.

The simulated engine produces these and publishes them in each engine's wire format; the
listener's decoders turn every wire format back into exactly these structures. Field
meanings follow vLLM's ``BlockStored``/``BlockRemoved``/``AllBlocksCleared``
(``docs/kv-events.md`` §4, "Event fields per engine and release"; §12 there maps every
engine onto this model); fields an engine does not send stay ``None``.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Protocol

#: A block hash as it travels on the wire: an int (most engines) or raw bytes (vLLM ≥0.10.2
#: may send the full digest). The listener's decoders always hand out the *canonical* form,
#: an unsigned 64-bit int (see ``listener.decode.canonical_block_hash``), and
#: ``continuum.sim.hashing`` computes hashes in that same form, so the two compare equal.
BlockHash = int | bytes


@dataclass(frozen=True, slots=True)
class BlockStored:
    """Blocks newly stored in the KV cache by one request, chained to ``parent_block_hash``."""

    block_hashes: tuple[BlockHash, ...]
    parent_block_hash: BlockHash | None
    token_ids: tuple[int, ...]
    block_size: int
    lora_id: int | None = None
    medium: str | None = None
    lora_name: str | None = None
    cache_salt: str | None = None
    group_idx: int | None = None
    kv_cache_spec_kind: str | None = None
    kv_cache_spec_sliding_window: int | None = None
    #: vLLM ≥0.17: one entry per block hash, the block's hash extra keys (or None).
    #: TensorRT-LLM: per block, the ``(mm_hash, start_offset)`` pairs of its ``mm_keys``.
    extra_keys: tuple[tuple[object, ...] | None, ...] | None = None
    locality: str | None = None
    ownership: str | None = None
    session_id: str | None = None
    #: vLLM ≥0.33: the L tokens after each block that its hash also covers.
    lookahead_token_ids: tuple[tuple[int, ...], ...] | None = None
    #: SGLang EAGLE bigram mode: the wire's ``(token, next_token)`` pairs; ``token_ids`` then
    #: holds the first element of each pair.
    token_pairs: tuple[tuple[int, int], ...] | None = None
    #: TensorRT-LLM retention priority (0-100, default 35).
    priority: int | None = None


@dataclass(frozen=True, slots=True)
class BlockRemoved:
    """Blocks evicted from ``medium`` (None = the engine did not say; GPU)."""

    block_hashes: tuple[BlockHash, ...]
    medium: str | None = None
    group_idx: int | None = None
    locality: str | None = None
    ownership: str | None = None


@dataclass(frozen=True, slots=True)
class AllBlocksCleared:
    """The engine dropped its whole cache (or, from a decoder, state was lost)."""

    medium: str | None = None


KvEvent = BlockStored | BlockRemoved | AllBlocksCleared


@dataclass(frozen=True, slots=True)
class KvEventBatch:
    """One published batch: the events of one scheduler step."""

    ts: float
    events: tuple[KvEvent, ...]
    data_parallel_rank: int | None = 0
    #: ZMQ sequence number (or TensorRT-LLM event id of the first event); None when unknown.
    seq: int | None = None
    #: Events with a tag the decoder does not know, skipped rather than failing the batch.
    skipped: int = 0
    #: ZMQ topic frame the batch arrived with; None when not known (payload decoded alone).
    topic: bytes | None = None
    #: Events the decoder refused (bad fields), skipped likewise; where the first one was.
    malformed: int = 0
    malformed_at: str | None = None


class KvEventSink(Protocol):
    """Where an engine's cache model sends its events (a ZMQ publisher, an HTTP drain …)."""

    def publish(self, events: Sequence[KvEvent]) -> None:
        """Publish the events of one scheduler step as one batch."""


#: ``hasher(parent_hash, block_token_ids, cache_salt) -> block_hash``
BlockHasher = Callable[[BlockHash | None, Sequence[int], "str | None"], BlockHash]
