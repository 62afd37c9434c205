"""The selection pipeline: registered scorers first, then the configured strategy.

A scorer's verdict wins only when the best composite score is strictly greater than
:data:`SCORER_THRESHOLD` (the seed's ``DEFAULT_SCORER_THRESHOLD``); otherwise the
configured :class:`~continuum.interfaces.SelectionStrategy` decides. Every scorer is told
the outcome of the pass (:meth:`~continuum.interfaces.BackendScorer.observe`: the winner,
its score and the tier it holds, or None when the strategy took over); the KV scorer
labels ``continuum_kv_index_routing_decisions_total{decision,tier}`` with it.

When the KV scorer turned a holder down for its wait for a slot
(:attr:`RequestContext.spill_at_slots <continuum.request.RequestContext.spill_at_slots>`),
a strategy that does not spill by itself
(:attr:`SelectionStrategy.spills_at_slots <continuum.interfaces.SelectionStrategy.spills_at_slots>`
false: every built-in one but PrefixAwareHash, and third-party ones) chooses among the
candidates with a free slot, or among all of them when none has one.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

from continuum.errors import NoHealthyBackendError
from continuum.interfaces import SCORER_THRESHOLD, TIER_NONE

if TYPE_CHECKING:
    from continuum.interfaces import BackendScorer, SelectionStrategy
    from continuum.request import RequestContext
    from continuum.routing.backends import Backend

__all__ = ["KV_AWARE", "SCORER_THRESHOLD", "STRATEGY", "SelectionPipeline"]

#: Decisions :meth:`SelectionPipeline.decide` reports (the ``decision`` metric label).
KV_AWARE = "kv_aware"
STRATEGY = "strategy"


class SelectionPipeline:
    """Runs scorers, then the strategy; pure apart from what scorers fetch in ``prepare``."""

    def __init__(
        self,
        strategy: SelectionStrategy,
        scorers: Sequence[BackendScorer] = (),
        threshold: float = SCORER_THRESHOLD,
    ) -> None:
        self.strategy = strategy
        self.scorers = tuple(scorers)
        self.threshold = threshold

    def select(self, candidates: Sequence[Backend], ctx: RequestContext) -> Backend:
        """Pick the backend for ``ctx`` from ``candidates``.

        Raises:
            NoHealthyBackendError: ``candidates`` is empty.
        """
        return self.decide(candidates, ctx)[0]

    def decide(self, candidates: Sequence[Backend], ctx: RequestContext) -> tuple[Backend, str]:
        """:meth:`select`, and who decided: ``kv_aware`` (a scorer) or ``strategy``.

        Raises:
            NoHealthyBackendError: ``candidates`` is empty.
        """
        if not candidates:
            raise NoHealthyBackendError(f"no healthy backend for model '{ctx.model}'")
        if self.scorers and ctx.prefix_key is not None:
            chosen = self._score(candidates, ctx)
            if chosen is not None:
                return chosen, KV_AWARE
        strategy = self.strategy
        if ctx.spill_at_slots and not strategy.spills_at_slots:
            free = [b for b in candidates if b.slots is None or b.in_flight < b.slots]
            if free:
                candidates = free
        return strategy.select(candidates, ctx), STRATEGY

    def _score(self, candidates: Sequence[Backend], ctx: RequestContext) -> Backend | None:
        best: Backend | None = None
        best_score = self.threshold
        best_tier = TIER_NONE
        best_scorer = None
        for scorer in self.scorers:
            scorer.prepare(ctx, candidates)
            for backend in candidates:
                score, tier = scorer.score_with_tier(backend, ctx)
                if score > best_score:
                    best, best_score, best_tier, best_scorer = backend, score, tier, scorer
        for scorer in self.scorers:
            won = scorer is best_scorer
            scorer.observe(ctx, best if won else None, best_score if won else 0.0,
                           best_tier if won else TIER_NONE)
        return best
