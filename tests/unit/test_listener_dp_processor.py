"""Data-parallel ranks of one vLLM backend through the real processor, with ``/detokenize``.

Two simulated engines play two ranks of one backend (one tokenizer and template, so the same
prompt gives both the same block hashes, as vLLM's ranks do); their events go through the
wire encoder with their rank and the listener's decoder into one processor of a source with
``data_parallel_size: 2``. Unlike TensorRT-LLM (salts only), these chains are recovered
through ``/detokenize`` and get chain keys, so this checks that prompt recovery and chain keys
work on rank-keyed blocks, and that a prefix and its chain keys stay held while any rank
holds them.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from continuum.kv_events import AllBlocksCleared, BlockRemoved, KvEvent, KvEventBatch
from continuum.prefix import request_prefix_key
from continuum.sim.engine import EngineConfig, GenerationRequest, SimEngine
from continuum.sim.hashing import hasher_for
from continuum.sim.kv_wire import encode_zmq_payload
from continuum.sim.latency import LatencyModel
from listener.config import DetokenizeConfig, LimitsConfig, SourceConfig
from listener.decode import decode_zmq_payload
from listener.model import CACHE_CLEARED, CACHE_CREATED, CACHE_EVICTED, PrefixEvent
from listener.processor import DefaultSourceProcessor
from tests.unit.test_listener_processor import AppClient

MODEL = "sim-model"
BACKEND = "engine-dp"
PROFILE = "vllm-0.33"
BODY = {"messages": [
    {"role": "system", "content": "You are the Continuum data-parallel test assistant. "
     "Answer questions about caches, ranks and routers briefly."},
    {"role": "user", "content": "Which rank holds my prompt?"}]}


class RankSink:
    """One rank's event sink: each step encoded with the rank, decoded back."""

    def __init__(self, rank: int) -> None:
        self.rank = rank
        self.batches: list[KvEventBatch] = []

    def publish(self, events: Sequence[KvEvent]) -> None:
        payload = encode_zmq_payload(events, PROFILE, ts=0.0, dp_rank=self.rank)
        self.batches.append(decode_zmq_payload(payload))


class DpBackend:
    """Two simulated ranks feeding one processor (``data_parallel_size: 2``)."""

    def __init__(self) -> None:
        self.sinks = [RankSink(0), RankSink(1)]
        self.engines = [SimEngine(EngineConfig(engine="vllm", template="chatml", block_size=4,
                                               latency=LatencyModel.fast()),
                                  hasher=hasher_for(PROFILE), sink=sink, sleep=lambda s: None)
                        for sink in self.sinks]
        self.client = AppClient(self.engines[0])
        self.out: list[PrefixEvent] = []
        config = SourceConfig(
            backend_name=BACKEND, engine="vllm", model=MODEL, template="chatml",
            zmq_endpoint="tcp://127.0.0.1:5557", data_parallel_size=2,
            allowed_publishers=("127.0.0.1",), max_prefix_length=256,
            detokenize_endpoint="http://127.0.0.1:9/detokenize")
        self.processor = DefaultSourceProcessor(config, LimitsConfig(), DetokenizeConfig(),
                                                emit=self.out.append, salt_secret=None,
                                                client=self.client)

    def serve(self, rank: int, body: dict[str, Any]) -> list[PrefixEvent]:
        engine = self.engines[rank]
        ids = engine.chat_prompt(body["messages"])
        engine.start(GenerationRequest(model=MODEL, prompt_ids=tuple(ids), max_tokens=3,
                                       temperature=0.0)).run()
        return self.feed(rank)

    def reset(self, rank: int) -> list[PrefixEvent]:
        """The rank's prefix cache is reset (vLLM publishes ``AllBlocksCleared``)."""
        assert self.engines[rank].reset_prefix_cache()
        return self.feed(rank)

    def feed(self, rank: int) -> list[PrefixEvent]:
        start = len(self.out)
        sink = self.sinks[rank]
        batches, sink.batches = sink.batches, []
        for batch in batches:
            assert batch.data_parallel_rank == rank
            self.processor.handle_batch(batch)
        return self.out[start:]

    def ranks_held(self) -> set[int]:
        return {key[0][0] for key in self.processor.tracker.blocks
                if isinstance(key[0], tuple)}


def test_ranks_recover_their_prompts_and_share_the_prefix_until_the_last_drops_it() -> None:
    key = request_prefix_key(BODY, MODEL, max_prefix_length=256)
    assert key is not None
    prefix = key.hex()
    backend = DpBackend()
    created = [e for e in backend.serve(0, BODY) if e.prefix_hash == prefix]
    assert created and created[0].type == CACHE_CREATED
    chain = {k for e in created for _kind, k, _tokens in e.chain}
    assert chain, "rank 0's chain got no chain keys"
    assert backend.ranks_held() == {0}
    stats = backend.processor.stats()
    assert stats["attributed_prefixes"] >= 1 and stats["chain_keys"] == len(chain)
    # rank 1 serves the same prompt: same hashes, its own blocks, nothing evicted
    assert backend.serve(1, BODY) == []  # already held, at the same length
    assert backend.ranks_held() == {0, 1}
    rank0 = {h for (g, h) in backend.processor.tracker.blocks if g == (0, None)}
    rank1 = {h for (g, h) in backend.processor.tracker.blocks if g == (1, None)}
    assert rank0 & rank1, "the ranks' chains should share their hashes"
    assert backend.processor.tracker.get(((1, None), min(rank0 & rank1))) is not None
    # rank 0's cache is reset: rank 1 still holds the prefix and its chain keys
    assert backend.reset(0) == []
    assert backend.ranks_held() == {1}
    assert backend.processor.stats()["chain_keys"] == len(chain)
    assert backend.processor.stats()["attributed_prefixes"] >= 1
    # rank 1's too: nothing is left on the backend, which is a reset
    assert backend.reset(1) == [PrefixEvent(CACHE_CLEARED)]
    assert backend.processor.tracker.tracked_blocks == 0
    assert backend.processor.stats()["chain_keys"] == 0
    # a rank's clear on the empty tracker (the same rank again, or the other one): nothing
    assert backend.reset(1) == [] and backend.reset(0) == []
    stats = backend.processor.stats()
    assert stats["events_out"] == len(backend.out)


def test_a_rank_clear_says_cache_cleared_only_when_it_empties_the_tracker() -> None:
    """``AllBlocksCleared`` of one rank (the engine's, or the source's for a lost rank)
    emits ``cache_cleared`` only when it removed the last blocks: not on a tracker that was
    empty already (a rank cleared twice used to say it twice), not when nothing of that
    rank was held (the other rank's blocks remain)."""
    backend = DpBackend()

    def clear(rank: int) -> list[PrefixEvent]:
        start = len(backend.out)
        backend.processor.handle_batch(KvEventBatch(ts=0.0, events=(AllBlocksCleared(),),
                                                    data_parallel_rank=rank))
        return backend.out[start:]

    assert clear(1) == []  # nothing stored yet
    created = backend.serve(0, BODY)
    assert created and backend.ranks_held() == {0}
    assert clear(1) == []  # rank 1 holds nothing; rank 0's blocks stay
    assert backend.ranks_held() == {0}
    assert clear(0) == [PrefixEvent(CACHE_CLEARED)]  # the last blocks: the backend is empty
    assert clear(0) == [] and clear(1) == []
    assert backend.processor.tracker.tracked_blocks == 0


def test_a_rank_clear_after_the_last_removal_in_its_batch_keeps_the_eviction() -> None:
    """One batch of a rank removes the tracker's last blocks, then clears the rank: the
    removal's ``cache_evicted`` still goes out (the clear, finding nothing left, used to
    wipe the queued eviction and say nothing, so the router kept the prefix for good)."""
    backend = DpBackend()
    assert backend.serve(0, BODY)
    blocks = list(backend.processor.tracker.blocks)
    removals = tuple(BlockRemoved((block_hash,), group_idx=group[1])
                     for group, block_hash in blocks)
    start = len(backend.out)
    backend.processor.handle_batch(KvEventBatch(
        ts=0.0, events=(*removals, AllBlocksCleared()), data_parallel_rank=0))
    out = backend.out[start:]
    assert backend.processor.tracker.tracked_blocks == 0
    assert [event.type for event in out] == [CACHE_EVICTED], out
