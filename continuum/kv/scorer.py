"""Tier 4: ``KvOverlapScorer``, the composite score of backends that hold a prefix.

    final = overlap_weight * (raw_overlap * tier_multiplier)
          + load_weight    * (1 - load_ratio)
          + health_weight  * health

* ``raw_overlap`` = the backend's token count / the largest token count of any holder;
* ``tier_multiplier`` = ``gpu_tier_weight`` (GpuHot) or ``storage_tier_weight``
  (StorageWarm);
* ``load_ratio`` = the backend's in-flight / the largest in-flight among the candidates
  (0 when nobody is busy);
* ``health`` = the backend's recent success rate (a plain attribute read: never blocks).

Only holders are scored; a holder whose tier-weighted overlap is below
``min_overlap_threshold`` scores 0, like a non-holder. So an idle backend that holds
nothing never wins on load and health alone.

``prepare()`` does the only I/O: one index query and one in-flight snapshot, cached per
prefix for 100 ms so every candidate in one scoring pass (and every request for the same
prefix in that window) is compared against the same moment. ``score_with_tier()`` reads
score and tier from that one cached snapshot.

Load guard (``scoring.load_guard`` with ``mode: bound``, beyond the seed; the default
``mode: adaptive`` belongs to :mod:`continuum.kv.chain_scorer`, so with ``match: seed`` and
the default config this scorer runs the seed's formula unguarded): with the seed's
formula the best holder scores at least ``overlap_weight`` = 0.6 whatever its load, so
the pool's 0.3 threshold never sends a busy holder's traffic elsewhere. With the guard, a
holder only qualifies while its in-flight count is under the CHWBL bound
``max(floor, ceil((1 + epsilon) * (in_flight_total + 1) / N))``; otherwise the configured
strategy decides.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar, TypeVar

from continuum.errors import StoreError
from continuum.interfaces import (
    TIER_GPU_HOT,
    TIER_NONE,
    TIER_STORAGE_WARM,
    BackendScorer,
    KvCacheIndex,
    KvHolding,
)

if TYPE_CHECKING:
    from continuum.config import KvScoringConfig, RouterConfig
    from continuum.metrics import RouterMetrics
    from continuum.request import RequestContext
    from continuum.routing.backends import Backend

log = logging.getLogger(__name__)

SNAPSHOT_TTL = 0.1
_T = TypeVar("_T")
_MAX_SNAPSHOTS = 4096
_EMPTY: dict[str, KvHolding] = {}


@dataclass(frozen=True, slots=True)
class KvDecisions:
    """Scoring passes won by a holder (``kv_aware``) or left to the strategy."""

    kv_aware: int = 0
    fallback: int = 0
    total: int = 0


@dataclass(frozen=True, slots=True)
class KvScorerStats:
    """The scorer's counters (this worker's)."""

    routing_decisions: KvDecisions
    #: Index queries (one per ``prepare`` that missed the 100 ms snapshot).
    query_latency_count: int
    query_errors: int
    #: Scores recorded in the overlap histogram (one per ``kv_aware`` decision).
    overlap_score_count: int


class _Snapshot:
    """One prefix's holders and the in-flight counts, taken together."""

    __slots__ = ("bound", "holdings", "in_flight", "max_in_flight", "max_tokens", "taken_at")

    def __init__(self, holdings: Sequence[KvHolding], candidates: Sequence[Backend],
                 taken_at: float, epsilon: float, floor: int) -> None:
        self.holdings = {h.backend: h for h in holdings} if holdings else _EMPTY
        self.max_tokens = max((h.token_count for h in holdings), default=0)
        in_flight = {b.name: b.in_flight for b in candidates}
        self.in_flight = in_flight
        self.max_in_flight = max(in_flight.values(), default=0)
        total = sum(in_flight.values())
        count = max(len(in_flight), 1)
        self.bound = max(floor, math.ceil((1.0 + epsilon) * (total + 1) / count))
        self.taken_at = taken_at


class KvOverlapScorer(BackendScorer):
    """Scores holders of the request's prefix from the KV index (see module docstring).

    The seed's scorer: the built-in ``KvOverlap`` of ``continuum.scorers``
    (:class:`~continuum.kv.chain_scorer.ChainOverlapScorer`, which extends it) builds it with
    ``kv_cache_index.match: seed``.
    """

    name: ClassVar[str] = "KvOverlap"

    def __init__(
        self,
        index: KvCacheIndex,
        scoring: KvScoringConfig,
        metrics: RouterMetrics | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.index = index
        self.metrics = metrics
        self.clock = clock
        # Read once: kv_cache_index needs a restart to change (the seed's rule).
        self.overlap_weight = scoring.overlap_weight
        self.load_weight = scoring.load_weight
        self.health_weight = scoring.health_weight
        self.min_overlap = scoring.min_overlap_threshold
        self.tier_weights = {TIER_GPU_HOT: scoring.gpu_tier_weight,
                             TIER_STORAGE_WARM: scoring.storage_tier_weight}
        guard = scoring.load_guard
        self.guard = guard.enabled and guard.mode == "bound"
        self.guard_epsilon = guard.load_factor_epsilon
        self.guard_floor = guard.floor
        self._snapshots: dict[str, _Snapshot] = {}
        self.decisions = {"kv_aware": 0, "fallback": 0}
        self.query_count = 0
        self.query_errors = 0
        log.info(
            "KvOverlapScorer weights: overlap=%s load=%s health=%s min_overlap=%s "
            "gpu_tier=%s storage_tier=%s load_guard=%s",
            self.overlap_weight, self.load_weight, self.health_weight, self.min_overlap,
            scoring.gpu_tier_weight, scoring.storage_tier_weight,
            f"on (epsilon={guard.load_factor_epsilon}, floor={guard.floor})"
            if self.guard else "off",
        )

    @classmethod
    def from_config(
        cls,
        config: RouterConfig,
        *,
        index: KvCacheIndex | None = None,
        metrics: RouterMetrics | None = None,
        **_: Any,
    ) -> KvOverlapScorer | None:
        """The scorer with ``kv_cache_index.scoring``'s weights over the worker's
        ``index``; None without one (``kv_cache_index.enabled`` off): nothing to score."""
        if index is None:
            return None
        return cls(index, config.kv_cache_index.scoring, metrics)

    def prepare(self, ctx: RequestContext, candidates: Sequence[Backend]) -> None:
        """Query the index and snapshot in-flight counts (cached 100 ms per prefix)."""
        prefix = ctx.prefix_hash
        if prefix is None:
            return
        now = self.clock()
        snapshot = self._snapshots.get(prefix)
        if snapshot is not None and now - snapshot.taken_at < SNAPSHOT_TTL:
            ctx.kv_snapshot = snapshot
            return
        holdings = self._query(lambda: self.index.query_backends(prefix))
        snapshot = _Snapshot(holdings, candidates, now, self.guard_epsilon, self.guard_floor)
        if len(self._snapshots) >= _MAX_SNAPSHOTS:
            self._snapshots.clear()
        self._snapshots[prefix] = snapshot
        # Kept per request: a concurrent prepare() for the same prefix may replace the
        # shared slot before this request reads its scores or records its tier.
        ctx.kv_snapshot = snapshot

    def _query(self, fetch: Callable[[], Sequence[_T]]) -> Sequence[_T]:
        """One index query, timed and counted; a failing index answers empty (the request
        is routed without the index, never a 500)."""
        started = time.perf_counter()
        found: Sequence[_T]
        try:
            found = fetch()
        except StoreError as exc:
            log.debug("KV index query failed (%s); scoring as empty", exc.kind)
            self.query_errors += 1
            found = ()
        except Exception as exc:  # an index bug: route without the index, never a 500
            log.warning("KV index query failed (%s); scoring as empty", type(exc).__name__)
            self.query_errors += 1
            found = ()
        self.query_count += 1
        if self.metrics is not None:
            self.metrics.kv_query_latency.observe(time.perf_counter() - started)
        return found

    def score(self, backend: Backend, ctx: RequestContext) -> float:
        """The composite score of ``backend`` (0 for non-holders)."""
        return self.score_with_tier(backend, ctx)[0]

    def score_with_tier(self, backend: Backend, ctx: RequestContext) -> tuple[float, str]:
        """Score and held tier from the request's snapshot, in one read."""
        snapshot = ctx.kv_snapshot
        if not isinstance(snapshot, _Snapshot):
            return 0.0, TIER_NONE
        holding = snapshot.holdings.get(backend.name)
        if holding is None or snapshot.max_tokens <= 0:
            return 0.0, TIER_NONE
        tier = holding.tier
        overlap = holding.token_count / snapshot.max_tokens * self.tier_weights.get(tier, 0.0)
        if overlap < self.min_overlap:
            return 0.0, tier
        # The guard reads the live count: a burst for one prefix inside the 100 ms snapshot
        # window would otherwise all see the same stale load and pile onto one holder.
        if self.guard and backend.in_flight >= snapshot.bound:
            return 0.0, tier
        in_flight = snapshot.in_flight.get(backend.name, backend.in_flight)
        load_ratio = in_flight / snapshot.max_in_flight if snapshot.max_in_flight else 0.0
        score = (self.overlap_weight * overlap
                 + self.load_weight * (1.0 - load_ratio)
                 + self.health_weight * backend.success_rate)
        return score, tier

    def observe(self, ctx: RequestContext, chosen: Backend | None, score: float,
                tier: str) -> None:
        """Record one scoring pass: ``chosen`` is None when the strategy took over."""
        decision = "kv_aware" if chosen is not None else "fallback"
        self.decisions[decision] += 1
        metrics = self.metrics
        if metrics is not None:
            metrics.child(metrics.kv_decisions, decision,
                          tier if chosen is not None else TIER_NONE).inc()
            if chosen is not None:
                metrics.kv_overlap_score.observe(score)

    def explain(self, ctx: RequestContext, candidates: Sequence[Backend]) -> list[dict[str, Any]]:
        """Every candidate's inputs and composite score for ``ctx`` (after ``prepare``)."""
        snapshot = ctx.kv_snapshot if isinstance(ctx.kv_snapshot, _Snapshot) else None
        rows = []
        for backend in candidates:
            holding = snapshot.holdings.get(backend.name) if snapshot else None
            score, tier = self.score_with_tier(backend, ctx)
            max_tokens = snapshot.max_tokens if snapshot else 0
            rows.append({
                "backend": backend.name,
                "token_count": holding.token_count if holding else 0,
                "tier": tier,
                "raw_overlap": round(holding.token_count / max_tokens, 4)
                if holding and max_tokens else 0.0,
                "in_flight": backend.in_flight,
                "load_bound": snapshot.bound if snapshot and self.guard else None,
                "health": round(backend.success_rate, 4),
                "score": round(score, 4),
            })
        return rows

    def stats(self) -> KvScorerStats:
        """Decision and query counters for the admin API."""
        kv_aware, fallback = self.decisions["kv_aware"], self.decisions["fallback"]
        return KvScorerStats(
            routing_decisions=KvDecisions(kv_aware, fallback, kv_aware + fallback),
            query_latency_count=self.query_count, query_errors=self.query_errors,
            overlap_score_count=kv_aware)
