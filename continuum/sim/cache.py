"""A paged prefix-cache model: hashed full blocks, refcounts, LRU eviction, a CPU tier.

Invariants (checked by tests/unit/test_sim_cache.py):

* Only full blocks are cached; block ``i``'s hash chains from block ``i-1``'s hash, and a
  request's ``cache_salt`` enters only block 0's hash (as vLLM does), so salted chains share
  nothing with unsalted ones or with other salts.
* ``len(gpu) <= num_blocks`` and ``len(cpu) <= cpu_blocks`` at all times.
* A block referenced by a running request (``refs > 0``) is never evicted; only blocks in
  the free queue are. The free queue is LRU; a finished request frees its chain tail-first
  so a chain's later blocks are evicted before its head.
* A GPU eviction moves the block to the CPU tier when there is one (the CPU keeps it until
  its own LRU evicts it, even after a CPU hit brings the block back to the GPU, as offload
  connectors keep their copy).
* Events: each step (``allocate``/``extend``/``reset``) publishes at most one batch:
  removals first (``BlockRemoved`` GPU, ``BlockStored`` CPU, ``BlockRemoved`` CPU), then one
  ``BlockStored`` (GPU) per contiguous run of blocks newly placed on the GPU, whose parent is
  the hash of the block before the run.
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field

from continuum.kv_events import (
    AllBlocksCleared,
    BlockHash,
    BlockHasher,
    BlockRemoved,
    BlockStored,
    KvEvent,
    KvEventSink,
)

GPU = "GPU"
CPU = "CPU"


def sha256_chain_hasher(
    parent: BlockHash | None, token_ids: Sequence[int], cache_salt: str | None
) -> BlockHash:
    """Default block hasher: 64 bits of ``sha256(parent ‖ tokens ‖ salt)``."""
    digest = hashlib.sha256()
    digest.update(b"root" if parent is None else repr(parent).encode())
    digest.update(b"|" + ",".join(map(str, token_ids)).encode())
    if cache_salt is not None:
        digest.update(b"|salt:" + cache_salt.encode("utf-8", "surrogatepass"))
    return int.from_bytes(digest.digest()[:8], "big")


@dataclass(slots=True)
class _Block:
    hash: BlockHash
    parent: BlockHash | None
    token_ids: tuple[int, ...]
    salt: str | None
    refs: int = 0


@dataclass(slots=True)
class Allocation:
    """The blocks one running request holds, and what its prompt found in the cache."""

    num_tokens: int
    cache_salt: str | None
    #: Hashes of the blocks the request references, in chain order (a prefix of its chain).
    hashes: list[BlockHash] = field(default_factory=list)
    cached_tokens: int = 0
    cpu_cached_tokens: int = 0
    #: Some full block could not be stored (GPU full of referenced blocks).
    truncated: bool = False
    released: bool = False


@dataclass(slots=True)
class CacheStats:
    """Counters since start; ``*_tokens`` count prompt tokens."""

    query_tokens: int = 0
    hit_tokens: int = 0
    cpu_hit_tokens: int = 0
    gpu_evictions: int = 0
    cpu_evictions: int = 0
    stored_blocks: int = 0


class PrefixCache:
    """Block-level prefix cache of one engine.

    Args:
        num_blocks: GPU capacity in blocks.
        block_size: tokens per block.
        cpu_blocks: capacity of the CPU offload tier (0: no tier).
        hasher: ``hasher(parent, block_token_ids, cache_salt)``; the salt is passed for
            block 0 only.
        sink: receives one batch of neutral KV events per step (optional).
        cpu_medium: the ``medium`` the engine names its CPU tier in events (vLLM ``"CPU"``,
            SGLang ``"CPU_PINNED"``).
    """

    def __init__(
        self,
        num_blocks: int,
        block_size: int = 16,
        *,
        cpu_blocks: int = 0,
        hasher: BlockHasher | None = None,
        sink: KvEventSink | None = None,
        cpu_medium: str = CPU,
    ) -> None:
        if num_blocks < 1 or block_size < 1 or cpu_blocks < 0:
            raise ValueError("num_blocks and block_size must be >= 1, cpu_blocks >= 0")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.cpu_blocks = cpu_blocks
        self.hasher: BlockHasher = hasher or sha256_chain_hasher
        self.sink = sink
        self.cpu_medium = cpu_medium
        self.stats = CacheStats()
        self._gpu: dict[BlockHash, _Block] = {}
        self._free: OrderedDict[BlockHash, None] = OrderedDict()  # LRU first
        self._cpu: OrderedDict[BlockHash, _Block] = OrderedDict()  # LRU first

    # -- queries ---------------------------------------------------------------------------

    def block_hashes(
        self, token_ids: Sequence[int], cache_salt: str | None = None
    ) -> list[BlockHash]:
        """Chained hashes of the full blocks of ``token_ids``."""
        hashes: list[BlockHash] = []
        parent: BlockHash | None = None
        for start in range(0, len(token_ids) - self.block_size + 1, self.block_size):
            block = token_ids[start : start + self.block_size]
            parent = self.hasher(parent, block, cache_salt if start == 0 else None)
            hashes.append(parent)
        return hashes

    @property
    def gpu_blocks_used(self) -> int:
        """Blocks held on the GPU (referenced or cached-free)."""
        return len(self._gpu)

    @property
    def blocks_in_use(self) -> int:
        """Blocks referenced by running requests."""
        return len(self._gpu) - len(self._free)

    @property
    def cpu_blocks_used(self) -> int:
        """Blocks held in the CPU tier."""
        return len(self._cpu)

    def on_gpu(self, block_hash: BlockHash) -> bool:
        """Whether ``block_hash`` is cached on the GPU."""
        return block_hash in self._gpu

    def on_cpu(self, block_hash: BlockHash) -> bool:
        """Whether ``block_hash`` is held in the CPU tier."""
        return block_hash in self._cpu

    def refs(self, block_hash: BlockHash) -> int:
        """How many running requests reference ``block_hash`` (0 when not on the GPU)."""
        block = self._gpu.get(block_hash)
        return 0 if block is None else block.refs

    # -- steps -----------------------------------------------------------------------------

    def allocate(self, token_ids: Sequence[int], cache_salt: str | None = None) -> Allocation:
        """Admit a prompt: count its cached prefix, reference it, store its new full blocks.

        At most ``len(token_ids) - 1`` tokens count as cached (the engine must compute at
        least one token), so a prompt that is entirely cached still recomputes its last
        block, as vLLM does.
        """
        alloc = Allocation(num_tokens=len(token_ids), cache_salt=cache_salt)
        hashes = self.block_hashes(token_ids, cache_salt)
        max_hit = max(len(token_ids) - 1, 0) // self.block_size
        events: list[KvEvent] = []
        placed: list[int] = []
        hit_blocks = cpu_hit_blocks = 0
        for i, block_hash in enumerate(hashes):
            hit = i < max_hit and i == hit_blocks
            if block_hash in self._gpu:
                self._ref(block_hash)
            else:
                from_cpu = block_hash in self._cpu
                if from_cpu:  # keep the block being loaded from becoming the CPU victim
                    self._cpu.move_to_end(block_hash)
                if not self._place(block_hash, hashes, token_ids, i, cache_salt, events):
                    alloc.truncated = True
                    break
                placed.append(i)
                hit = hit and from_cpu
                cpu_hit_blocks += hit
            alloc.hashes.append(block_hash)
            hit_blocks += hit
        alloc.cached_tokens = hit_blocks * self.block_size
        alloc.cpu_cached_tokens = cpu_hit_blocks * self.block_size
        self.stats.query_tokens += len(token_ids)
        self.stats.hit_tokens += alloc.cached_tokens
        self.stats.cpu_hit_tokens += alloc.cpu_cached_tokens
        self._publish(events, hashes, token_ids, placed, cache_salt)
        return alloc

    def extend(self, alloc: Allocation, token_ids: Sequence[int]) -> None:
        """Store the new full blocks of a running request whose sequence grew to ``token_ids``.

        Used when generation finishes: the blocks filled by output tokens become cacheable,
        which is what lets a follow-up turn of a conversation hit the previous answer.
        """
        if alloc.released or alloc.truncated:
            return  # a chain cut short for lack of space cannot grow
        hashes = self.block_hashes(token_ids, alloc.cache_salt)
        events: list[KvEvent] = []
        placed: list[int] = []
        for i in range(len(alloc.hashes), len(hashes)):
            block_hash = hashes[i]
            if block_hash in self._gpu:
                self._ref(block_hash)
            elif self._place(block_hash, hashes, token_ids, i, alloc.cache_salt, events):
                placed.append(i)
            else:
                alloc.truncated = True
                break
            alloc.hashes.append(block_hash)
        alloc.num_tokens = len(token_ids)
        self._publish(events, hashes, token_ids, placed, alloc.cache_salt)

    def release(self, alloc: Allocation) -> None:
        """Drop a finished request's references; its blocks stay cached until evicted."""
        if alloc.released:
            return
        alloc.released = True
        for block_hash in reversed(alloc.hashes):
            block = self._gpu[block_hash]
            block.refs -= 1
            if block.refs == 0:
                self._free[block_hash] = None

    def reset(self) -> bool:
        """Drop every cached block (both tiers) and publish ``AllBlocksCleared``.

        Returns:
            False, changing nothing, when running requests still reference blocks.
        """
        if self.blocks_in_use:
            return False
        self._gpu.clear()
        self._free.clear()
        self._cpu.clear()
        if self.sink is not None:
            self.sink.publish([AllBlocksCleared()])
        return True

    # -- internals -------------------------------------------------------------------------

    def _ref(self, block_hash: BlockHash) -> None:
        block = self._gpu[block_hash]
        if block.refs == 0:
            self._free.pop(block_hash, None)
        block.refs += 1

    def _place(
        self,
        block_hash: BlockHash,
        hashes: Sequence[BlockHash],
        token_ids: Sequence[int],
        index: int,
        salt: str | None,
        events: list[KvEvent],
    ) -> bool:
        """Put block ``index`` on the GPU with one reference, evicting if needed."""
        if len(self._gpu) >= self.num_blocks:
            if not self._free:
                return False
            self._evict_gpu(next(iter(self._free)), events)
        start = index * self.block_size
        self._gpu[block_hash] = _Block(
            hash=block_hash,
            parent=hashes[index - 1] if index else None,
            token_ids=tuple(token_ids[start : start + self.block_size]),
            salt=salt,
            refs=1,
        )
        self.stats.stored_blocks += 1
        return True

    def _evict_gpu(self, block_hash: BlockHash, events: list[KvEvent]) -> None:
        del self._free[block_hash]
        block = self._gpu.pop(block_hash)
        self.stats.gpu_evictions += 1
        if self.cpu_blocks:
            if block_hash in self._cpu:
                self._cpu.move_to_end(block_hash)
            else:
                if len(self._cpu) >= self.cpu_blocks:
                    old, _ = self._cpu.popitem(last=False)
                    self.stats.cpu_evictions += 1
                    events.append(BlockRemoved((old,), medium=self.cpu_medium))
                self._cpu[block_hash] = block
                events.append(self._stored([block], self.cpu_medium))
        events.append(BlockRemoved((block_hash,), medium=GPU))

    def _stored(self, blocks: list[_Block], medium: str) -> BlockStored:
        return BlockStored(
            block_hashes=tuple(b.hash for b in blocks),
            parent_block_hash=blocks[0].parent,
            token_ids=tuple(t for b in blocks for t in b.token_ids),
            block_size=self.block_size,
            medium=medium,
            cache_salt=blocks[0].salt,
        )

    def _publish(
        self,
        events: list[KvEvent],
        hashes: Sequence[BlockHash],
        token_ids: Sequence[int],
        placed: list[int],
        salt: str | None,
    ) -> None:
        runs: list[list[int]] = []
        for i in placed:
            if runs and runs[-1][-1] == i - 1:
                runs[-1].append(i)
            else:
                runs.append([i])
        for run in runs:
            events.append(self._stored([self._gpu[hashes[i]] for i in run], GPU))
        if events and self.sink is not None:
            self.sink.publish(events)
