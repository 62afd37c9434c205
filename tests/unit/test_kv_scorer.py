"""KvOverlapScorer: the seed's formula and worked rules, snapshots, tiers, the load guard."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import pytest

from continuum.config import parse_config
from continuum.errors import StoreError
from continuum.interfaces import (
    CACHE_CREATED,
    TIER_GPU_HOT,
    TIER_NONE,
    TIER_STORAGE_WARM,
    KvCacheIndex,
    KvHolding,
)
from continuum.kv.scorer import KvOverlapScorer
from continuum.metrics import RouterMetrics
from continuum.routing.selection import SelectionPipeline
from continuum.testing import ScorerContract, make_backends, make_context
from continuum.testing.scorers import PREFIX_HASH
from stores.kv_memory import InMemoryKvIndex
from strategies.round_robin import RoundRobin

PREFIX = bytes.fromhex("ab" * 32)


class FakeIndex(KvCacheIndex):
    name = "fake"

    def __init__(self) -> None:
        self.data: dict[str, list[KvHolding]] = {}
        self.queries = 0
        self.fail = False

    def hold(self, prefix: bytes, **holdings: tuple[int, str]) -> None:
        self.data[prefix.hex()] = [KvHolding(b, n, tier) for b, (n, tier) in holdings.items()]

    def apply(self, backend: str, event: str, prefix_hash: str, token_count: int = 0) -> None:
        raise NotImplementedError

    def query_backends(self, prefix_hash: str) -> Sequence[KvHolding]:
        self.queries += 1
        if self.fail:
            raise StoreError("down", store="fake", kind="connection")
        return sorted(self.data.get(prefix_hash, ()), key=lambda h: -h.token_count)

    def clear(self) -> int:
        return 0

    def stats(self) -> dict[str, Any]:
        return {}


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def make_scorer(index: FakeIndex, clock: Clock | None = None, **scoring: Any) -> KvOverlapScorer:
    cfg = parse_config({"kv_cache_index": {"scoring": scoring}}).kv_cache_index.scoring
    return KvOverlapScorer(index, cfg, RouterMetrics(), clock=clock or Clock())


def decisions(scorer: KvOverlapScorer, decision: str, tier: str) -> float:
    """``continuum_kv_index_routing_decisions_total{decision, tier}`` of ``scorer``."""
    assert scorer.metrics is not None
    value = scorer.metrics.registry.get_sample_value(
        "continuum_kv_index_routing_decisions_total", {"decision": decision, "tier": tier})
    return value or 0.0


def scores(scorer: KvOverlapScorer, backends: list, prefix: bytes = PREFIX) -> dict:  # type: ignore[type-arg]
    ctx = make_context(prefix=prefix)
    scorer.prepare(ctx, backends)
    return {b.name: scorer.score_with_tier(b, ctx) for b in backends}


def test_formula_exactly() -> None:
    index = FakeIndex()
    index.hold(PREFIX, b0=(2048, TIER_GPU_HOT), b1=(512, TIER_GPU_HOT))
    backends = make_backends(3)
    backends[0].in_flight, backends[1].in_flight, backends[2].in_flight = 2, 0, 4
    for _ in range(3):
        backends[1].record(False, None)  # success rate 0 for b1
    got = scores(make_scorer(index, min_overlap_threshold=0.2), backends)
    assert got["b0"] == (pytest.approx(0.6 * 1.0 + 0.3 * (1 - 2 / 4) + 0.1 * 1.0), TIER_GPU_HOT)
    assert got["b1"] == (pytest.approx(0.6 * 0.25 + 0.3 * 1.0 + 0.1 * 0.0), TIER_GPU_HOT)
    assert got["b2"] == (0.0, TIER_NONE)  # holds nothing


def test_idle_backend_holding_nothing_never_passes_threshold() -> None:
    index = FakeIndex()
    index.hold(PREFIX, b0=(1000, TIER_GPU_HOT))
    backends = make_backends(2)
    backends[0].in_flight = 50  # the holder is busy, b1 idle and perfectly healthy
    scorer = make_scorer(index)
    pipeline = SelectionPipeline(RoundRobin(), [scorer])
    assert scores(scorer, backends)["b1"] == (0.0, TIER_NONE)
    ctx = make_context(prefix=PREFIX)
    assert pipeline.select(backends, ctx).name == "b0"  # 0.6 + 0 + 0.1 = 0.7 > 0.3
    index.data.clear()
    scorer._snapshots.clear()
    ctx2 = make_context(prefix=PREFIX)
    pipeline.select(backends, ctx2)
    assert decisions(scorer, "fallback", TIER_NONE) == 1
    assert decisions(scorer, "kv_aware", TIER_GPU_HOT) == 1
    assert scorer.decisions == {"kv_aware": 1, "fallback": 1}


def test_storage_warm_below_threshold_is_excluded() -> None:
    index = FakeIndex()
    index.hold(PREFIX, b0=(1000, TIER_STORAGE_WARM), b1=(1000, TIER_GPU_HOT))
    backends = make_backends(2)
    got = scores(make_scorer(index, storage_tier_weight=0.2), backends)
    assert got["b0"] == (0.0, TIER_STORAGE_WARM)
    assert got["b1"][0] > 0.3
    warm_ok = scores(make_scorer(index), backends)  # default 0.6 >= 0.3 passes
    assert warm_ok["b0"][0] == pytest.approx(0.6 * 0.6 + 0.3 + 0.1)


def test_gpu_tier_weight_below_threshold_always_falls_back() -> None:
    index = FakeIndex()
    index.hold(PREFIX, b0=(4096, TIER_GPU_HOT))
    scorer = make_scorer(index, gpu_tier_weight=0.25)
    pipeline = SelectionPipeline(RoundRobin(), [scorer])
    for count in range(1, 6):
        ctx = make_context(prefix=PREFIX)
        pipeline.select(make_backends(3), ctx)
        assert decisions(scorer, "fallback", TIER_NONE) == count
    assert decisions(scorer, "kv_aware", TIER_GPU_HOT) == 0


def test_snapshot_cached_for_100ms_and_kept_per_request() -> None:
    index = FakeIndex()
    clock = Clock()
    index.hold(PREFIX, b0=(1000, TIER_GPU_HOT))
    scorer = make_scorer(index, clock)
    backends = make_backends(2)
    first = make_context(prefix=PREFIX)
    scorer.prepare(first, backends)
    scorer.prepare(make_context(prefix=PREFIX), backends)
    assert index.queries == 1
    # The index changes and the cache slot is replaced by a later request's prepare():
    index.hold(PREFIX, b1=(1000, TIER_STORAGE_WARM))
    clock.now += 0.2
    second = make_context(prefix=PREFIX)
    scorer.prepare(second, backends)
    assert index.queries == 2
    # Each request still reads the snapshot it prepared: tier labels cannot cross.
    assert scorer.score_with_tier(backends[0], first)[1] == TIER_GPU_HOT
    assert scorer.score_with_tier(backends[1], first) == (0.0, TIER_NONE)
    assert scorer.score_with_tier(backends[1], second)[1] == TIER_STORAGE_WARM
    pipeline = SelectionPipeline(RoundRobin(), [scorer])
    third = make_context(prefix=PREFIX)
    assert pipeline.select(backends, third).name == "b1"
    # The decision is labelled with the tier this request's own snapshot says b1 holds.
    assert decisions(scorer, "kv_aware", TIER_STORAGE_WARM) == 1
    assert decisions(scorer, "kv_aware", TIER_GPU_HOT) == 0


def test_load_can_make_another_holder_win() -> None:
    index = FakeIndex()
    index.hold(PREFIX, b0=(1000, TIER_GPU_HOT), b1=(900, TIER_GPU_HOT))
    backends = make_backends(2)
    backends[0].in_flight = 10
    scorer = make_scorer(index)
    chosen = SelectionPipeline(RoundRobin(), [scorer]).select(backends, make_context(
        prefix=PREFIX))
    # b0: 0.6 + 0 + 0.1 = 0.70; b1: 0.6*0.9 + 0.3 + 0.1 = 0.94
    assert chosen.name == "b1"


def test_load_guard_sends_overloaded_holder_traffic_to_the_strategy() -> None:
    index = FakeIndex()
    index.hold(PREFIX, b0=(1000, TIER_GPU_HOT))
    backends = make_backends(4)
    backends[0].in_flight = 6  # bound = max(4, ceil(1.25 * 7 / 4)) = 4
    unguarded = make_scorer(index)
    assert scores(unguarded, backends)["b0"][0] > 0.3
    guarded = make_scorer(index, load_guard={"enabled": True, "mode": "bound"})
    assert scores(guarded, backends)["b0"] == (0.0, TIER_GPU_HOT)
    backends[0].in_flight = 3
    bound = {"enabled": True, "mode": "bound"}
    assert scores(make_scorer(index, load_guard=bound), backends)["b0"][0] > 0.3


def test_failed_index_query_scores_empty_and_metrics_record() -> None:
    index = FakeIndex()
    index.fail = True
    scorer = make_scorer(index)
    assert scores(scorer, make_backends(2)) == {"b0": (0.0, TIER_NONE), "b1": (0.0, TIER_NONE)}
    assert scorer.query_errors == 1
    index.fail = False
    index.hold(PREFIX, b1=(10, TIER_GPU_HOT))
    scorer._snapshots.clear()
    SelectionPipeline(RoundRobin(), [scorer]).select(make_backends(2), make_context(
        prefix=PREFIX))
    sample = scorer.metrics.kv_decisions.labels("kv_aware", TIER_GPU_HOT)._value.get()  # type: ignore[union-attr]
    assert sample == 1


def test_load_guard_reads_live_in_flight_not_the_snapshot() -> None:
    index = FakeIndex()
    index.hold(PREFIX, b0=(1000, TIER_GPU_HOT))
    backends = make_backends(4)
    scorer = make_scorer(index, load_guard={"enabled": True, "mode": "bound"})
    first = make_context(prefix=PREFIX)
    scorer.prepare(first, backends)  # snapshot: everyone idle, bound 4
    assert scorer.score_with_tier(backends[0], first)[0] > 0.3
    backends[0].in_flight = 4  # a burst inside the 100 ms window
    burst = make_context(prefix=PREFIX)
    scorer.prepare(burst, backends)  # same cached snapshot
    assert scorer.score_with_tier(backends[0], burst) == (0.0, TIER_GPU_HOT)


class TestKvOverlapContract(ScorerContract):
    """The built-in scorer meets the shipped scorer contract, loaded by its config name."""

    scorer_name = "KvOverlap"

    def make_index(self) -> KvCacheIndex:
        index = InMemoryKvIndex()
        index.apply("b1", CACHE_CREATED, PREFIX_HASH, 400)
        index.apply("b2", CACHE_CREATED, PREFIX_HASH, 100)
        return index


def test_kv_overlap_declines_without_an_index() -> None:
    config = parse_config({"prefix_routing": {"enabled": True}})
    assert KvOverlapScorer.from_config(config, index=None, metrics=None) is None
    index = FakeIndex()
    scorer = KvOverlapScorer.from_config(config, index=index, metrics=None, resources=None)
    assert isinstance(scorer, KvOverlapScorer)
    assert scorer.index is index
    assert scorer.overlap_weight == config.kv_cache_index.scoring.overlap_weight
