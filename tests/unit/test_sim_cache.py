"""The simulated engine's paged prefix-cache model."""

from __future__ import annotations

from collections.abc import Sequence

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from continuum.kv_events import AllBlocksCleared, BlockRemoved, BlockStored, KvEvent
from continuum.sim.cache import PrefixCache, sha256_chain_hasher

BS = 4


class Sink:
    """Collects published batches."""

    def __init__(self) -> None:
        self.batches: list[list[KvEvent]] = []

    def publish(self, events: Sequence[KvEvent]) -> None:
        self.batches.append(list(events))

    def take(self) -> list[KvEvent]:
        events = [e for batch in self.batches for e in batch]
        self.batches.clear()
        return events


def seq(start: int, n: int) -> list[int]:
    return list(range(start, start + n))


def make(num_blocks: int = 64, cpu_blocks: int = 0) -> tuple[PrefixCache, Sink]:
    sink = Sink()
    return PrefixCache(num_blocks, BS, cpu_blocks=cpu_blocks, sink=sink), sink


def run(cache: PrefixCache, tokens: list[int], salt: str | None = None) -> int:
    """Admit and finish one request; return its cached tokens."""
    alloc = cache.allocate(tokens, salt)
    cache.release(alloc)
    return alloc.cached_tokens


# -- hashing ---------------------------------------------------------------------------------


def test_block_hashes_are_chained_and_cover_full_blocks_only() -> None:
    cache, _ = make()
    a = cache.block_hashes(seq(0, 10))
    assert len(a) == 2  # 10 tokens = 2 full blocks + a partial one that is never hashed
    assert a == cache.block_hashes(seq(0, 11))
    assert a[0] == sha256_chain_hasher(None, seq(0, 4), None)
    assert a[1] == sha256_chain_hasher(a[0], seq(4, 4), None)
    # same second block, different first block: the chain makes the second hash differ
    b = cache.block_hashes([99, 1, 2, 3, *seq(4, 4)])
    assert b[0] != a[0] and b[1] != a[1]


def test_salt_enters_only_the_first_block_hash() -> None:
    calls: list[tuple[object, tuple[int, ...], str | None]] = []

    def hasher(parent: object, tokens: Sequence[int], salt: str | None) -> int:
        calls.append((parent, tuple(tokens), salt))
        return sha256_chain_hasher(parent, tokens, salt)  # type: ignore[arg-type]

    cache = PrefixCache(8, BS, hasher=hasher)
    plain = cache.block_hashes(seq(0, 12))
    calls.clear()
    salted = cache.block_hashes(seq(0, 12), "tenant-a")
    assert [c[2] for c in calls] == ["tenant-a", None, None]
    assert all(
        s != p for s, p in zip(salted, plain, strict=True)
    )  # the salt changes the whole chain
    assert cache.block_hashes(seq(0, 12), "tenant-b")[0] != salted[0]


# -- accounting ------------------------------------------------------------------------------


def test_cached_tokens_for_a_scripted_sequence_match_the_hand_computed_values() -> None:
    cache, _ = make()
    # (prompt, expected cached tokens), block size 4. A hit is block-granular and at most
    # len(prompt) - 1 tokens are cached (the last token is always computed).
    script = [
        (seq(0, 10), 0),  # cold; stores blocks [0..3], [4..7]
        (seq(0, 10), 8),  # both full blocks hit (9 // 4 = 2 blocks may hit)
        (seq(0, 8), 4),  # 8 tokens: only (8 - 1) // 4 = 1 block may hit
        ([*seq(0, 4), 99, 98, 97, 96, 95, 94], 4),  # shares block 0 only
        (seq(50, 7), 0),  # unrelated
        (seq(0, 16), 8),  # blocks 0 and 1 hit; [8..11] was a partial block of prompt 1
        (seq(0, 16), 12),  # now [8..11] and [12..15] are cached; 15 // 4 = 3 may hit
    ]
    for prompt, expected in script:
        assert run(cache, prompt) == expected, prompt
    assert cache.stats.query_tokens == 10 + 10 + 8 + 10 + 7 + 16 + 16
    assert cache.stats.hit_tokens == 0 + 8 + 4 + 4 + 0 + 8 + 12


def test_new_blocks_are_published_as_one_chained_store_per_step() -> None:
    cache, sink = make()
    first = cache.allocate(seq(0, 9))
    [stored] = sink.take()
    assert stored == BlockStored(
        block_hashes=tuple(cache.block_hashes(seq(0, 8))),
        parent_block_hash=None,
        token_ids=tuple(seq(0, 8)),
        block_size=BS,
        medium="GPU",
    )
    cache.release(first)
    second = cache.allocate(seq(0, 13))
    [stored] = sink.take()
    hashes = cache.block_hashes(seq(0, 12))
    assert stored.block_hashes == (hashes[2],)
    assert stored.parent_block_hash == hashes[1]
    assert stored.token_ids == tuple(seq(8, 4))
    assert second.cached_tokens == 8
    cache.release(second)
    cache.allocate(seq(0, 13))
    assert sink.take() == []  # nothing new: no event


def test_extend_caches_blocks_filled_by_output_tokens() -> None:
    cache, sink = make()
    alloc = cache.allocate(seq(0, 6))
    sink.take()
    cache.extend(alloc, seq(0, 13))  # the prompt grew by 7 generated tokens
    [stored] = sink.take()
    hashes = cache.block_hashes(seq(0, 12))
    assert stored.block_hashes == (hashes[1], hashes[2])
    assert stored.parent_block_hash == hashes[0]
    cache.release(alloc)
    assert run(cache, seq(0, 14)) == 12  # a follow-up turn hits the answer too


def test_salted_requests_share_blocks_only_with_the_same_salt() -> None:
    cache, _ = make()
    run(cache, seq(0, 17))
    assert run(cache, seq(0, 17), salt="s1") == 0
    assert run(cache, seq(0, 17), salt="s2") == 0
    assert run(cache, seq(0, 17), salt="s1") == 16
    assert run(cache, seq(0, 17)) == 16
    assert cache.gpu_blocks_used == 12  # three separate 4-block chains


# -- eviction --------------------------------------------------------------------------------


def test_lru_eviction_takes_the_least_recently_used_chain_tail_first() -> None:
    cache, sink = make(num_blocks=4)
    a, b, c = seq(0, 8), seq(100, 8), seq(200, 8)
    ha, hb = cache.block_hashes(a), cache.block_hashes(b)
    run(cache, a)
    run(cache, b)
    run(cache, [*a, 1])  # touch a: b is now the least recently used
    sink.take()
    run(cache, c)
    events = sink.take()
    removed = [e.block_hashes[0] for e in events if isinstance(e, BlockRemoved)]
    assert removed == [hb[1], hb[0]]  # tail first, so a chain's prefix outlives its end
    assert all(e.medium == "GPU" for e in events if isinstance(e, BlockRemoved))
    assert all(cache.on_gpu(h) for h in ha)
    assert cache.stats.gpu_evictions == 2
    assert cache.gpu_blocks_used == 4


def test_blocks_referenced_by_running_requests_are_never_evicted() -> None:
    cache, _ = make(num_blocks=4)
    running = cache.allocate(seq(0, 12))  # holds 3 blocks
    held = list(running.hashes)
    other = cache.allocate(seq(100, 12))  # wants 3 more: only one free slot
    assert all(cache.on_gpu(h) and cache.refs(h) == 1 for h in held)
    assert len(other.hashes) == 1 and other.truncated
    assert cache.blocks_in_use == 4
    cache.release(other)
    third = cache.allocate(seq(200, 8))  # may take only the block `other` released
    assert len(third.hashes) == 1
    assert all(cache.on_gpu(h) for h in held)
    cache.release(third)
    cache.release(running)
    assert cache.blocks_in_use == 0
    assert len(cache.allocate(seq(300, 16)).hashes) == 4  # everything is evictable now


def test_shared_blocks_are_referenced_once_per_request() -> None:
    cache, _ = make()
    first = cache.allocate(seq(0, 9))
    second = cache.allocate(seq(0, 9))
    h0 = first.hashes[0]
    assert cache.refs(h0) == 2
    cache.release(first)
    cache.release(first)  # idempotent
    assert cache.refs(h0) == 1
    cache.release(second)
    assert cache.refs(h0) == 0 and cache.on_gpu(h0)


def test_gpu_eviction_offloads_to_the_cpu_tier_and_a_cpu_hit_counts_as_cached() -> None:
    cache, sink = make(num_blocks=2, cpu_blocks=4)
    a, b = seq(0, 9), seq(100, 9)
    ha = cache.block_hashes(a)
    run(cache, a)
    sink.take()
    run(cache, b)  # evicts a's two blocks to the CPU tier
    events = sink.take()
    offloaded = [e for e in events if isinstance(e, BlockStored) and e.medium == "CPU"]
    assert [e.block_hashes for e in offloaded] == [(ha[1],), (ha[0],)]
    assert offloaded[0].parent_block_hash == ha[0]
    assert offloaded[0].token_ids == tuple(seq(4, 4))
    assert [e.block_hashes[0] for e in events if isinstance(e, BlockRemoved)] == [ha[1], ha[0]]
    assert all(cache.on_cpu(h) and not cache.on_gpu(h) for h in ha)

    alloc = cache.allocate(a)  # both blocks come back from the CPU tier
    assert (alloc.cached_tokens, alloc.cpu_cached_tokens) == (8, 8)
    assert all(cache.on_gpu(h) for h in ha)
    reloaded = [e for e in sink.take() if isinstance(e, BlockStored) and e.medium == "GPU"]
    assert reloaded[-1].block_hashes == tuple(ha)
    assert reloaded[-1].parent_block_hash is None
    cache.release(alloc)
    assert cache.stats.cpu_hit_tokens == 8


def test_cpu_tier_evicts_its_own_lru_blocks_with_a_cpu_removal() -> None:
    cache, sink = make(num_blocks=1, cpu_blocks=1)
    run(cache, seq(0, 5))
    run(cache, seq(100, 5))  # block of prompt 1 goes to the CPU
    h0 = cache.block_hashes(seq(0, 4))[0]
    sink.take()
    run(cache, seq(200, 5))  # block of prompt 2 goes to the CPU, pushing prompt 1's out
    events = sink.take()
    assert BlockRemoved((h0,), medium="CPU") in events
    assert not cache.on_cpu(h0) and cache.cpu_blocks_used == 1
    assert cache.stats.cpu_evictions == 1


def test_reset_clears_both_tiers_unless_blocks_are_in_use() -> None:
    cache, sink = make(num_blocks=2, cpu_blocks=2)
    running = cache.allocate(seq(0, 9))
    assert cache.reset() is False
    cache.release(running)
    run(cache, seq(100, 9))
    sink.take()
    assert cache.reset() is True
    assert sink.take() == [AllBlocksCleared()]
    assert (cache.gpu_blocks_used, cache.cpu_blocks_used) == (0, 0)
    assert run(cache, seq(0, 9)) == 0


def test_invalid_sizes_are_rejected() -> None:
    with pytest.raises(ValueError):
        PrefixCache(0)
    with pytest.raises(ValueError):
        PrefixCache(4, 0)


# -- invariants under arbitrary traffic ------------------------------------------------------

_PROMPTS = st.lists(st.integers(0, 3), min_size=1, max_size=24)  # few ids: many shared prefixes
_OPS = st.lists(
    st.tuples(
        st.sampled_from(["admit", "finish", "reset"]), _PROMPTS, st.sampled_from([None, "s"])
    ),
    max_size=40,
)


@settings(max_examples=150, deadline=None)
@given(_OPS, st.integers(1, 6), st.integers(0, 4))
def test_events_mirror_the_cache_and_capacity_holds(
    ops: list[tuple[str, list[int], str | None]], num_blocks: int, cpu_blocks: int
) -> None:
    sink = Sink()
    cache = PrefixCache(num_blocks, 2, cpu_blocks=cpu_blocks, sink=sink)
    running: list = []
    mirror: dict[str, set[object]] = {"GPU": set(), "CPU": set()}
    seen: set[object] = set()
    for op, prompt, salt in ops:
        if op == "admit":
            alloc = cache.allocate(prompt, salt)
            assert alloc.cached_tokens <= len(prompt) - 1
            assert alloc.cached_tokens % 2 == 0 and alloc.cpu_cached_tokens <= alloc.cached_tokens
            running.append((alloc, prompt))
        elif op == "finish" and running:
            alloc, grown = running.pop(0)
            cache.extend(alloc, grown + prompt)
            cache.release(alloc)
        elif op == "reset":
            assert cache.reset() is not any(alloc.hashes for alloc, _ in running)
        for event in sink.take():
            if isinstance(event, BlockStored):
                mirror[event.medium or "GPU"].update(event.block_hashes)
                seen.update(event.block_hashes)
            elif isinstance(event, BlockRemoved):
                mirror[event.medium or "GPU"].difference_update(event.block_hashes)
            else:
                mirror = {"GPU": set(), "CPU": set()}
        assert cache.gpu_blocks_used <= num_blocks and cache.cpu_blocks_used <= cpu_blocks
        assert mirror["GPU"] == {h for h in seen if cache.on_gpu(h)}
        assert mirror["CPU"] == {h for h in seen if cache.on_cpu(h)}
        for alloc, _ in running:  # what running requests hold is never evicted
            assert all(cache.on_gpu(h) and cache.refs(h) > 0 for h in alloc.hashes)
    for alloc, _ in running:
        cache.release(alloc)
    assert cache.blocks_in_use == 0
