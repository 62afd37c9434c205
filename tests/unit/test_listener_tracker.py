"""The listener's block-chain tracker: memory bounds, pruning, tiers, references.

Salted chains (router-issued ``cache_salt``) are attributed without ``/detokenize``, so
these tests drive the real :class:`DefaultSourceProcessor` with no HTTP at all; the memory
bound test makes every chain unattributed (its fake ``/detokenize`` never decides a key),
so that blocks keep their token segments and the token limit is what prunes.
"""

from __future__ import annotations

import json
import random
from typing import Any

import pytest

from continuum.cache_salt import make_salt
from continuum.kv_events import AllBlocksCleared, BlockRemoved, BlockStored, KvEvent, KvEventBatch
from listener.config import DetokenizeConfig, LimitsConfig, SourceConfig
from listener.decode import decode_trtllm_events
from listener.model import (
    CACHE_CLEARED,
    CACHE_CREATED,
    CACHE_EVICTED,
    CACHE_OFFLOADED,
    PrefixEvent,
)
from listener.processor import DefaultSourceProcessor
from listener.tracker import ALL_MEDIA, GPU_BIT, MAX_LEADS, BlockTracker

SECRET = b"tracker-test-secret"
BACKEND = "gpu-1"
P1, P2 = "1" * 64, "2" * 64


def source(**overrides: Any) -> SourceConfig:
    options: dict[str, Any] = {
        "backend_name": BACKEND, "engine": "sglang", "model": "m",
        "zmq_endpoint": "tcp://127.0.0.1:1", "allowed_publishers": ("127.0.0.1",),
        "require_salt": True, **overrides}
    return SourceConfig(**options)


class Harness:
    """A processor plus everything it emitted."""

    def __init__(self, limits: LimitsConfig | None = None, client: Any = None,
                 **source_options: Any) -> None:
        self.out: list[PrefixEvent] = []
        self.processor = DefaultSourceProcessor(
            source(**source_options), limits or LimitsConfig(), DetokenizeConfig(),
            emit=self.out.append, salt_secret=SECRET, client=client)

    def feed(self, *events: KvEvent) -> list[PrefixEvent]:
        start = len(self.out)
        self.processor.handle_batch(KvEventBatch(ts=0.0, events=events))
        return self.out[start:]

    @property
    def tracker(self) -> BlockTracker:
        return self.processor.tracker


def salted(hashes: tuple[int, ...], parent: int | None, prefix: str | None,
           medium: str = "GPU", size: int = 2) -> BlockStored:
    salt = None if prefix is None else make_salt(SECRET, BACKEND, prefix)
    tokens = tuple(range(1, len(hashes) * size + 1))
    return BlockStored(hashes, parent, tokens, size, medium=medium, cache_salt=salt)


# -- memory bound ----------------------------------------------------------------------------

class NeverDecides:
    """A /detokenize that returns an empty prompt: every chain stays pending (keeps tokens)."""

    def __init__(self) -> None:
        self.calls = 0

    def post(self, url: str, *, json: Any, timeout: float, allow_redirects: bool) -> Any:
        self.calls += 1
        return _Reply({"prompt": ""})


class _Reply:
    status_code = 200

    def __init__(self, doc: Any) -> None:
        self.doc = doc

    def json(self) -> Any:
        return self.doc


@pytest.mark.parametrize(("chain", "blocks", "retained"), [
    (24, 20, 10),      # the token limit binds
    (8, 60, 50),
    (64, 5, 100000),   # max_tracked_blocks * max_chain_tokens binds
    (16, 3, 40),
    (64, 60, 400),
])
@pytest.mark.parametrize("seed", range(3))
def test_retained_tokens_never_exceed_the_bound(
        chain: int, blocks: int, retained: int, seed: int) -> None:
    rng = random.Random(seed)
    limits = LimitsConfig(max_chain_tokens=chain, max_tracked_blocks=blocks,
                          max_retained_tokens=retained)
    bound = min(retained, blocks * chain)
    peak = 0
    h = Harness(limits, client=NeverDecides(), engine="vllm", require_salt=False,
                detokenize_endpoint="http://127.0.0.1:9/detokenize", template="chatml")
    stored: list[int] = []
    next_hash = 1
    for _ in range(400):
        roll = rng.random()
        if roll < 0.7:
            n, size = rng.randint(1, 4), rng.choice([2, 4, 8])
            parent = rng.choice(stored) if stored and rng.random() < 0.7 else None
            hashes = tuple(range(next_hash, next_hash + n))
            next_hash += n
            stored.extend(hashes)
            event: KvEvent = BlockStored(hashes, parent, tuple(rng.randrange(1, 999)
                                                                for _ in range(n * size)), size)
        elif roll < 0.95 and stored:
            event = BlockRemoved((rng.choice(stored),))
        else:
            event = BlockStored((rng.choice(stored or [1]),), None, (1, 2), 2)  # duplicate
        h.feed(event)
        stats = h.processor.stats()
        assert stats["retained_tokens"] <= bound
        peak = max(peak, stats["retained_tokens"])
        assert stats["tracked_blocks"] <= limits.max_tracked_blocks
        assert h.tracker.audit() == (stats["tracked_blocks"], stats["retained_tokens"])
    assert h.processor.stats()["pruned_blocks"] > 0  # the limits were really exercised
    assert peak >= min(bound, chain) // 2  # and blocks really kept tokens


def test_long_chains_keep_metadata_but_no_tokens() -> None:
    limits = LimitsConfig(max_chain_tokens=8)
    h = Harness(limits, client=NeverDecides(), engine="vllm", require_salt=False,
                detokenize_endpoint="http://127.0.0.1:9/detokenize", template="chatml")
    h.feed(BlockStored((1, 2, 3, 4, 5), None, tuple(range(10, 30)), 4))
    assert h.tracker.tracked_blocks == 5
    assert h.tracker.retained_tokens == 8  # blocks 1-2 fit in 8 tokens, 3-5 do not
    assert [h.tracker.blocks[(None, k)].end for k in (1, 5)] == [4, 20]


# -- pruning and references ------------------------------------------------------------------

def test_pruning_is_oldest_first_and_a_prefix_lives_until_its_last_block() -> None:
    h = Harness(LimitsConfig(max_tracked_blocks=3))
    assert h.feed(salted((1,), None, P1)) == [PrefixEvent(CACHE_CREATED, P1, 2)]
    assert h.feed(salted((2,), 1, None)) == [PrefixEvent(CACHE_CREATED, P1, 4)]  # inherited
    assert h.feed(salted((3,), None, P2)) == [PrefixEvent(CACHE_CREATED, P2, 2)]
    # Block 1 (oldest) is pruned; block 2 still references P1 (its longest chain is 4).
    assert h.feed(salted((4,), 3, None)) == [PrefixEvent(CACHE_CREATED, P2, 4)]
    assert list(h.tracker.blocks) == [(None, 2), (None, 3), (None, 4)]
    # Block 2, P1's last reference, is pruned: now P1 is gone. P2 is untouched.
    assert h.feed(salted((5,), 4, None)) == [
        PrefixEvent(CACHE_EVICTED, P1, 4), PrefixEvent(CACHE_CREATED, P2, 6)]
    assert h.processor.stats()["pruned_blocks"] == 2
    assert CACHE_CLEARED not in [e.type for e in h.out]


def test_removal_evicts_only_with_the_last_reference_and_token_count_follows() -> None:
    h = Harness()
    h.feed(salted((1, 2, 3), None, P1))
    h.feed(salted((4,), 1, P1))  # a branch off block 1 (SGLang salts every event)
    assert h.out[-1] == PrefixEvent(CACHE_CREATED, P1, 6)
    assert h.feed(BlockRemoved((3,), medium="GPU")) == [PrefixEvent(CACHE_CREATED, P1, 4)]
    assert h.feed(BlockRemoved((1, 2), medium="GPU")) == []  # block 4 still holds 4 tokens
    assert h.feed(BlockRemoved((4,), medium="GPU")) == [PrefixEvent(CACHE_EVICTED, P1, 4)]
    assert h.tracker.tracked_blocks == 0


def test_duplicates_are_idempotent_and_unknown_removals_ignored() -> None:
    h = Harness()
    h.feed(salted((1, 2), None, P1))
    assert h.feed(salted((1, 2), None, P1), BlockRemoved((99, 98))) == []
    assert h.tracker.tracked_blocks == 2
    assert h.processor.stats()["salt_rejected"] == 0


# -- tiers -----------------------------------------------------------------------------------

def test_offload_to_cpu_then_eviction_then_reload() -> None:
    h = Harness(engine="vllm")
    salt_event = BlockStored((1, 2), None, (1, 2, 3, 4), 2, medium="GPU",
                             extra_keys=((make_salt(SECRET, BACKEND, P1),), None))
    assert h.feed(salt_event) == [PrefixEvent(CACHE_CREATED, P1, 4)]
    # The engine copies both blocks to CPU and frees them on the GPU, in one step.
    offload = (BlockStored((1,), None, (1, 2), 2, medium="CPU"),
               BlockStored((2,), 1, (3, 4), 2, medium="CPU"),
               BlockRemoved((2,), medium="GPU"), BlockRemoved((1,), medium="GPU"))
    assert h.feed(*offload) == [PrefixEvent(CACHE_OFFLOADED, P1, 4)]
    # A CPU hit brings block 1 back to the GPU: the prefix is GPU-resident again.
    assert h.feed(BlockStored((1,), None, (1, 2), 2, medium="GPU")) == [
        PrefixEvent(CACHE_CREATED, P1, 2)]
    assert h.feed(BlockRemoved((1,), medium="GPU")) == [PrefixEvent(CACHE_OFFLOADED, P1, 4)]
    assert h.feed(BlockRemoved((1, 2), medium="CPU")) == [PrefixEvent(CACHE_EVICTED, P1, 4)]


def test_offloading_connector_placeholders_add_the_medium_to_known_blocks() -> None:
    """vLLM's OffloadingConnector names a block it copied to CPU by its hash alone
    (``token_ids=[]``, ``block_size=0``) when it kept nothing more: a tracked block gains
    the medium (so the GPU's removal offloads instead of evicting), an unknown one is
    skipped and counted, and the GPU store beside it in the batch is applied."""
    h = Harness(engine="vllm")
    salt_event = BlockStored((1, 2), None, (1, 2, 3, 4), 2, medium="GPU",
                             extra_keys=((make_salt(SECRET, BACKEND, P1),), None))
    assert h.feed(salt_event) == [PrefixEvent(CACHE_CREATED, P1, 4)]
    placeholders = (BlockStored((1,), None, (), 0, medium="CPU", group_idx=None),
                    BlockStored((2,), None, (), 0, medium="CPU"),
                    BlockStored((77,), None, (), 0, medium="CPU"))
    assert h.feed(*placeholders, BlockRemoved((2,), medium="GPU"),
                  BlockRemoved((1,), medium="GPU")) == [PrefixEvent(CACHE_OFFLOADED, P1, 4)]
    assert h.tracker.tracked_blocks == 2  # no block made for the unknown hash 77
    assert h.processor.stats()["placeholder_blocks"] == 1
    assert h.feed(BlockRemoved((1, 2), medium="CPU")) == [PrefixEvent(CACHE_EVICTED, P1, 4)]


def test_gpu_removal_without_an_offloaded_copy_evicts() -> None:
    h = Harness()
    h.feed(salted((1,), None, P1))
    assert h.feed(BlockRemoved((1,))) == [PrefixEvent(CACHE_EVICTED, P1, 2)]  # None = GPU


def test_trtllm_removal_drops_every_cache_level() -> None:
    h = Harness(engine="trtllm", trtllm_endpoint="http://127.0.0.1:1/kv_cache_events",
                zmq_endpoint=None)
    h.feed(salted((1,), None, P1), salted((1,), None, P1, medium="CPU"))
    assert h.feed(BlockRemoved((1,))) == [PrefixEvent(CACHE_EVICTED, P1, 2)]


def test_trtllm_window_pools_hold_their_blocks_apart() -> None:
    """A variable sliding-window model has a block pool per ``window_size``, each with
    events for the same hashes: the small window's removal leaves the block the large one
    holds (it used to evict the prefix), and the prefix goes when the last pool drops it."""
    h = Harness(engine="trtllm", trtllm_endpoint="http://127.0.0.1:1/kv_cache_events",
                zmq_endpoint=None)
    salt = make_salt(SECRET, BACKEND, P1)
    tokens = [{"type": "unique_token", "token_id": t, "token_extra_id": 0} for t in (1, 2)]

    def reply(event_id: int, window: int, data: dict[str, Any]) -> list[KvEvent]:
        (event,) = decode_trtllm_events(json.dumps(
            [{"event_id": event_id, "window_size": window, "data": data}]))
        return list(event.events)

    block = {"type": "stored_block", "block_hash": 1, "tokens": tokens, "cache_level": 0,
             "priority": 35, "cache_salt": salt}
    stored = {"type": "stored", "parent_hash": None, "blocks": [block]}
    removed = {"type": "removed", "block_hashes": [1]}
    assert h.feed(*reply(1, 512, stored), *reply(2, 4096, stored)) == [
        PrefixEvent(CACHE_CREATED, P1, 2)]
    assert h.feed(*reply(3, 512, removed)) == []
    assert h.tracker.tracked_blocks == 1
    assert h.feed(*reply(4, 4096, removed)) == [PrefixEvent(CACHE_EVICTED, P1, 2)]


def test_clears_reset_or_drop_one_medium() -> None:
    h = Harness()
    h.feed(salted((1,), None, P1), salted((1,), None, P1, medium="CPU_PINNED"),
           salted((2,), None, P2))
    assert h.feed(AllBlocksCleared(medium="GPU")) == [
        PrefixEvent(CACHE_OFFLOADED, P1, 2), PrefixEvent(CACHE_EVICTED, P2, 2)]
    assert h.feed(AllBlocksCleared(medium="CPU_PINNED")) == [PrefixEvent(CACHE_CLEARED)]
    h.feed(salted((3,), None, P1))
    # Events before a clear in the same batch net out; later ones are reported.
    assert h.feed(salted((4,), 3, None), AllBlocksCleared(), salted((5,), None, P2)) == [
        PrefixEvent(CACHE_CLEARED), PrefixEvent(CACHE_CREATED, P2, 2)]
    h.processor.reset("sequence gap")
    assert h.out[-1] == PrefixEvent(CACHE_CLEARED)
    assert (h.tracker.tracked_blocks, h.tracker.retained_tokens) == (0, 0)
    assert h.processor.stats()["attributed_prefixes"] == 0


# -- blocks that lead to a prefix ----------------------------------------------------------------

def test_a_leading_block_holds_its_prefixes_at_its_length_across_tiers() -> None:
    tracker = BlockTracker(LimitsConfig())
    cpu = tracker.medium_bit("CPU")
    lead = tracker.add((None, 1), None, None, 8, GPU_BIT, None, 0)
    tracker.add((None, 2), (None, 1), None, 12, GPU_BIT, P1, 0)
    tracker.lead((None, 1), P1)
    tracker.lead((None, 1), P1)  # once only
    assert tracker.drain() == [PrefixEvent(CACHE_CREATED, P1, 12)]

    tracker.remove((None, 2), ALL_MEDIA)
    assert tracker.drain() == [PrefixEvent(CACHE_CREATED, P1, 8)]
    tracker.touch((None, 1), cpu)
    tracker.remove((None, 1), GPU_BIT)  # only the CPU copy is left
    assert tracker.drain() == [PrefixEvent(CACHE_OFFLOADED, P1, 8)]

    others = [str(n) * 64 for n in range(3, 3 + MAX_LEADS)]
    for prefix in others:
        tracker.lead((None, 1), prefix)
    assert lead.leads == (P1, *others[:MAX_LEADS - 1])  # the first ones found
    assert {e.prefix_hash for e in tracker.drain()} == set(others[:MAX_LEADS - 1])
    assert tracker.held_prefixes == MAX_LEADS

    # a block attributed later counts for its own prefix only
    tracker.attribute((None, 1), P2)
    assert lead.leads == ()
    events = {e.prefix_hash: e.type for e in tracker.drain()}
    assert events == {P2: CACHE_OFFLOADED, P1: CACHE_EVICTED,
                      **{p: CACHE_EVICTED for p in others[:MAX_LEADS - 1]}}
    tracker.remove((None, 1), ALL_MEDIA)
    assert tracker.drain() == [PrefixEvent(CACHE_EVICTED, P2, 8)]
    assert tracker.held_prefixes == 0


def test_leads_are_for_unattributed_tracked_blocks_only() -> None:
    tracker = BlockTracker(LimitsConfig())
    tracker.add((None, 1), None, None, 4, GPU_BIT, P1, 0)
    tracker.lead((None, 1), P2)  # attributed already
    tracker.lead((None, 9), P2)  # not tracked
    assert tracker.blocks[(None, 1)].leads == ()
    assert [e.prefix_hash for e in tracker.drain()] == [P1]
