"""The block-chain tracker of one source: blocks, their tiers, and the prefixes they hold.

Each block (keyed by ``(group_idx, hash)``) keeps only its own token segment, a reference to
its parent's key, its chain length, the media it is stored on and the prefix it is
attributed to. Chains are never copied: a chain's tokens are rebuilt by walking parents.

Invariants (``audit()`` recomputes them; the tests check them after every event):

* ``tracked_blocks == len(blocks) <= limits.max_tracked_blocks``.
* ``retained_tokens`` is exactly the number of token ids held by blocks, and is at most
  ``limits.max_retained_tokens``. Only unattributed blocks whose chain fits in
  ``limits.max_chain_tokens`` hold tokens, so it is also at most
  ``max_tracked_blocks * max_chain_tokens``. Room is made *before* a block is added, by
  pruning individual blocks oldest first (block count: oldest of all blocks; tokens: oldest
  token holder). Pruning never clears the backend.
* A prefix is held while at least one tracked block is attributed to it or *leads* to it,
  and each such block counts in exactly one tier bucket of the prefix: ``gpu`` when the
  block is on the GPU (medium ``GPU`` or unnamed), else ``offloaded`` (CPU, disk, remote
  storage…).
* A block *leads* to a prefix (``Block.leads``, at most :data:`MAX_LEADS` prefixes) when it
  is the unattributed parent of a block that decided that prefix on this backend: the
  leading tokens of the prefix's first message, which every later request of the prefix
  shares. It keeps the prefix held, at its own shorter chain length, while the blocks that
  decided it come and go. Without it, an engine that evicts its finished requests' blocks
  before its running requests' blocks are reported (the block where the first message ends
  differs in every request) reported the prefix evicted for that moment, though every
  request of it still finds the leading blocks cached there. A router-issued salt
  attributes a chain from its first block on, so salted chains never needed this.

Tier semantics (the router's ``KvCacheIndex`` transitions): the state of a prefix is
``gpu`` if any of its blocks is on the GPU, else ``offloaded`` if any block survives in
another medium, else gone; its token count is the longest chain among the blocks of that
tier. :meth:`BlockTracker.drain` turns state changes since the last drain into events:
``cache_created`` (now on the GPU, or its GPU token count changed), ``cache_offloaded`` (no
GPU copy left but an offloaded one, or its count changed), ``cache_evicted`` (the last
referencing block was removed or pruned). Changes inside one batch net out, so a block that
moves GPU → CPU within a batch yields one ``cache_offloaded``.

Chain keys (:mod:`listener.chain`) are held the same way: each is counted in the tier
bucket of every block its end lies in (``Block.chain``), so it is held while one of those
blocks is, and :meth:`BlockTracker.drain` attaches each changed key, as
``(event type, key, tokens)``, to an event of the prefix it was found under.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field, replace

from listener.config import LimitsConfig
from listener.model import (
    CACHE_CREATED,
    CACHE_EVICTED,
    CACHE_OFFLOADED,
    ChainChange,
    PrefixEvent,
)

#: A block's pool: the event's ``group_idx``, or ``(data-parallel rank, group_idx)`` for an
#: event that carries a rank from a source keyed per rank (TensorRT-LLM attention DP, a
#: vLLM/SGLang source with ``data_parallel_size`` > 1: each rank has its own cache).
GroupKey = int | tuple[int, int | None] | None
#: ``(group, block_hash)``: vLLM hashes are per request, so one hash can be stored by
#: several KV-cache groups (TensorRT-LLM: window pools, attention-DP ranks); keying by group
#: keeps their lifetimes apart.
BlockKey = tuple[GroupKey, int]

GPU_BIT = 1
ALL_MEDIA = -1
_GPU_MEDIA = (None, "GPU")
_MAX_MEDIA_BITS = 30

# Block flags.
TAINTED = 1
"""Mismatched or masked block: never attributed, nor are its descendants."""
NO_TEXT = 2
"""The chain's text cannot be rebuilt or never decides a key (descendants inherit this)."""
UNDECIDED = 4
"""The chain's text is known not to decide a key yet (a descendant may)."""
INHERITED_FLAGS = TAINTED | NO_TEXT

#: Most prefixes one block leads to (the first ones found): a block shared by many first
#: messages (a template's header, a common preamble) leads to none beyond these.
MAX_LEADS = 4

_GPU, _OFFLOADED = "gpu", "offloaded"


class Block:
    """One tracked block (see the module docstring)."""

    __slots__ = ("chain", "end", "flags", "leads", "media", "parent", "prefix", "tokens")

    def __init__(self, parent: BlockKey | None, tokens: tuple[int, ...] | None, end: int,
                 media: int, prefix: str | None, flags: int) -> None:
        self.parent = parent
        self.tokens = tokens
        self.end = end
        self.media = media
        self.prefix = prefix
        self.flags = flags
        #: chain keys (:mod:`listener.chain`) whose end lies in this block
        self.chain: tuple[str, ...] = ()
        #: prefixes this unattributed block leads to (see the module docstring)
        self.leads: tuple[str, ...] = ()

    @property
    def tier(self) -> str:
        """``"gpu"`` when the block is on the GPU, else ``"offloaded"``."""
        return _GPU if self.media & GPU_BIT else _OFFLOADED

    @property
    def holds(self) -> tuple[str, ...]:
        """The prefixes this block counts for: its own, or the ones it leads to (an
        attributed block leads to none)."""
        return self.leads if self.prefix is None else (self.prefix,)


@dataclass
class _Holding:
    """Blocks attributed to one prefix: per tier, chain length → number of blocks."""

    gpu: dict[int, int] = field(default_factory=dict)
    offloaded: dict[int, int] = field(default_factory=dict)
    emitted: tuple[str, int] | None = None

    def state(self) -> tuple[str, int] | None:
        if self.gpu:
            return _GPU, max(self.gpu)
        if self.offloaded:
            return _OFFLOADED, max(self.offloaded)
        return None


class BlockTracker:
    """Blocks and prefix holdings of one backend, within ``limits``."""

    def __init__(self, limits: LimitsConfig) -> None:
        self.limits = limits
        self.blocks: dict[BlockKey, Block] = {}  # insertion order = age, oldest first
        self._token_holders: dict[BlockKey, None] = {}  # oldest first
        self.retained_tokens = 0
        self.pruned_blocks = 0
        self._holdings: dict[str, _Holding] = {}
        self._touched: dict[str, None] = {}
        self._media: dict[str, int] = {}
        # Chain keys, held like prefixes (by the blocks their end lies in), each reported
        # under the prefix of the chain it was found in.
        self._chain: dict[str, _Holding] = {}
        self._chain_prefix: dict[str, str] = {}
        self._chain_touched: dict[str, None] = {}

    # -- reading ---------------------------------------------------------------------------

    @property
    def tracked_blocks(self) -> int:
        """Blocks tracked now."""
        return len(self.blocks)

    @property
    def held_prefixes(self) -> int:
        """Prefixes with at least one attributed block."""
        return sum(1 for h in self._holdings.values() if h.gpu or h.offloaded)

    def get(self, key: BlockKey | None) -> Block | None:
        """The block of ``key`` (None for an untracked key or None)."""
        return None if key is None else self.blocks.get(key)

    def lineage(self, key: BlockKey) -> Iterator[tuple[BlockKey, Block | None]]:
        """``key`` and its ancestors, tip first; ends with ``(key, None)`` at a missing one."""
        current: BlockKey | None = key
        while current is not None:
            block = self.blocks.get(current)
            yield current, block
            if block is None:
                return
            current = block.parent

    def medium_bit(self, medium: str | None) -> int:
        """The bit of a medium name (``None``/``"GPU"`` is the GPU)."""
        if medium in _GPU_MEDIA:
            return GPU_BIT
        bit = self._media.get(str(medium))
        if bit is None:
            bit = 1 << min(len(self._media) + 1, _MAX_MEDIA_BITS)
            self._media[str(medium)] = bit
        return bit

    def audit(self) -> tuple[int, int]:
        """Recount ``(blocks, token ids)`` from the blocks themselves (for tests)."""
        return len(self.blocks), sum(len(b.tokens) for b in self.blocks.values() if b.tokens)

    # -- changing --------------------------------------------------------------------------

    def add(self, key: BlockKey, parent: BlockKey | None, tokens: tuple[int, ...] | None,
            end: int, media: int, prefix: str | None, flags: int) -> Block:
        """Track a new block (``key`` must not be tracked); prunes first to stay in limits."""
        limits = self.limits
        while len(self.blocks) >= limits.max_tracked_blocks:
            self._prune(next(iter(self.blocks)))
        if tokens is not None:
            if prefix is not None or len(tokens) > limits.max_retained_tokens:
                tokens = None
            else:
                while self.retained_tokens + len(tokens) > limits.max_retained_tokens:
                    self._prune(next(iter(self._token_holders)))
        block = Block(parent, tokens, end, media, None, flags)
        self.blocks[key] = block
        if tokens is not None:
            self._token_holders[key] = None
            self.retained_tokens += len(tokens)
        if prefix is not None:
            self.attribute(key, prefix)
        return block

    def touch(self, key: BlockKey, media: int) -> None:
        """A duplicate store: add ``media`` and make the block the youngest."""
        block = self.blocks.pop(key)
        self.blocks[key] = block
        self._set_media(block, block.media | media)

    def attribute(self, key: BlockKey, prefix: str) -> None:
        """Attribute a tracked, unattributed block to ``prefix``; it no longer needs tokens."""
        block = self.blocks[key]
        if block.prefix is not None:
            return
        self.drop_tokens(key)
        block.prefix = prefix
        self._count(prefix, block.tier, block.end, 1)
        for lead in block.leads:  # attributed now: it counts for its own prefix only
            self._count(lead, block.tier, block.end, -1)
        block.leads = ()

    def lead(self, key: BlockKey, prefix: str) -> None:
        """Record that the unattributed block ``key`` leads to ``prefix`` (the parent of the
        block that decided it): ``prefix`` stays held, at this block's chain length, while
        the block is. No-op for an untracked or attributed block, a prefix already recorded,
        or a block that leads to :data:`MAX_LEADS` prefixes already."""
        block = self.blocks.get(key)
        if (block is None or block.prefix is not None or prefix in block.leads
                or len(block.leads) >= MAX_LEADS):
            return
        block.leads += (prefix,)
        self._count(prefix, block.tier, block.end, 1)

    def add_chain_key(self, key: BlockKey, chain_key: str, prefix: str) -> None:
        """Attribute ``chain_key`` (reported under ``prefix``) to the tracked block ``key``."""
        block = self.blocks[key]
        if chain_key in block.chain:
            return
        block.chain += (chain_key,)
        self._chain_prefix.setdefault(chain_key, prefix)
        self._count_chain(chain_key, block.tier, block.end, 1)

    @property
    def held_chain_keys(self) -> int:
        """Chain keys with at least one block."""
        return sum(1 for h in self._chain.values() if h.gpu or h.offloaded)

    def drop_tokens(self, key: BlockKey) -> None:
        """Release a tracked block's token segment, if it holds one."""
        block = self.blocks[key]
        if block.tokens is not None:
            self.retained_tokens -= len(block.tokens)
            del self._token_holders[key]
            block.tokens = None

    def remove(self, key: BlockKey, media: int) -> bool:
        """Remove a block from ``media`` (:data:`ALL_MEDIA`: every medium); False if unknown."""
        block = self.blocks.get(key)
        if block is None:
            return False
        remaining = block.media & ~media
        if remaining:
            self._set_media(block, remaining)
        else:
            self._delete(key)
        return True

    def remove_medium(self, media: int, rank: int | None = None) -> None:
        """Drop ``media`` from every block (an engine cleared one tier); with ``rank``, only
        from the blocks of that data-parallel rank (groups ``(rank, group_idx)``)."""
        if rank is None:
            keys = [k for k, b in self.blocks.items() if b.media & media]
        else:
            keys = [k for k, b in self.blocks.items() if b.media & media
                    and isinstance(k[0], tuple) and k[0][0] == rank]
        for key in keys:
            self.remove(key, media)

    def clear(self) -> None:
        """Forget everything (the caller emits ``cache_cleared``)."""
        self.blocks.clear()
        self._token_holders.clear()
        self.retained_tokens = 0
        self._holdings.clear()
        self._touched.clear()
        self._chain.clear()
        self._chain_prefix.clear()
        self._chain_touched.clear()

    def drain(self) -> list[PrefixEvent]:
        """Events for the prefixes whose state changed since the last drain, each carrying
        its chain keys' changes; a prefix whose chain keys alone changed gets an event that
        repeats its current state."""
        events = self._drain_prefixes()
        changes = self._drain_chain()
        if not changes:
            return events
        for i, event in enumerate(events):
            if event.prefix_hash in changes:
                events[i] = replace(event, chain=tuple(changes.pop(event.prefix_hash)))
        for prefix, chain in changes.items():
            holding = self._holdings.get(prefix)
            state = holding.emitted if holding is not None else None
            if state is None:
                events.append(PrefixEvent(CACHE_EVICTED, prefix, None, tuple(chain)))
            else:
                kind = CACHE_CREATED if state[0] == _GPU else CACHE_OFFLOADED
                events.append(PrefixEvent(kind, prefix, state[1], tuple(chain)))
        return events

    def _drain_chain(self) -> dict[str, list[ChainChange]]:
        """Chain keys whose state changed since the last drain, grouped by prefix."""
        changes: dict[str, list[ChainChange]] = {}
        for key in self._chain_touched:
            holding = self._chain[key]
            state = holding.state()
            if state != holding.emitted:
                if state is None:
                    change: ChainChange = (CACHE_EVICTED, key, 0)
                else:
                    change = (CACHE_CREATED if state[0] == _GPU else CACHE_OFFLOADED, key,
                              state[1])
                changes.setdefault(self._chain_prefix[key], []).append(change)
            if state is None:
                del self._chain[key]
                del self._chain_prefix[key]
            else:
                holding.emitted = state
        self._chain_touched.clear()
        return changes

    def _drain_prefixes(self) -> list[PrefixEvent]:
        events: list[PrefixEvent] = []
        for prefix in self._touched:
            holding = self._holdings[prefix]
            state = holding.state()
            if state != holding.emitted:
                if state is None:
                    assert holding.emitted is not None
                    events.append(PrefixEvent(CACHE_EVICTED, prefix, holding.emitted[1]))
                else:
                    kind = CACHE_CREATED if state[0] == _GPU else CACHE_OFFLOADED
                    events.append(PrefixEvent(kind, prefix, state[1]))
            if state is None:
                del self._holdings[prefix]
            else:
                holding.emitted = state
        self._touched.clear()
        return events

    # -- internals -------------------------------------------------------------------------

    def _prune(self, key: BlockKey) -> None:
        self.pruned_blocks += 1
        self._delete(key)

    def _delete(self, key: BlockKey) -> None:
        self.drop_tokens(key)
        block = self.blocks.pop(key)
        for prefix in block.holds:
            self._count(prefix, block.tier, block.end, -1)
        for chain_key in block.chain:
            self._count_chain(chain_key, block.tier, block.end, -1)

    def _set_media(self, block: Block, media: int) -> None:
        old_tier = block.tier
        block.media = media
        if block.tier == old_tier:
            return
        for prefix in block.holds:
            self._count(prefix, old_tier, block.end, -1)
            self._count(prefix, block.tier, block.end, 1)
        for chain_key in block.chain:
            self._count_chain(chain_key, old_tier, block.end, -1)
            self._count_chain(chain_key, block.tier, block.end, 1)

    def _count_chain(self, key: str, tier: str, end: int, delta: int) -> None:
        holding = self._chain.get(key)
        if holding is None:
            holding = self._chain[key] = _Holding()
        _bump(holding.gpu if tier == _GPU else holding.offloaded, end, delta)
        self._chain_touched[key] = None

    def _count(self, prefix: str, tier: str, end: int, delta: int) -> None:
        holding = self._holdings.get(prefix)
        if holding is None:
            holding = self._holdings[prefix] = _Holding()
        _bump(holding.gpu if tier == _GPU else holding.offloaded, end, delta)
        self._touched[prefix] = None


def _bump(bucket: dict[int, int], end: int, delta: int) -> None:
    """Add ``delta`` blocks of chain length ``end`` to a tier bucket."""
    count = bucket.get(end, 0) + delta
    if count:
        bucket[end] = count
    else:
        del bucket[end]
