"""The contract every backend scorer must meet, as a reusable pytest suite.

A plugin author runs it against their scorer in a few lines::

    from continuum.testing import ScorerContract

    class TestPreferWeight(ScorerContract):
        scorer_name = "PreferWeight"     # looked up through the entry points

The suite loads the scorer class through :class:`continuum.registry.PluginRegistry`, so it
also proves the entry point is registered, and builds it with ``from_config`` the way the
router does. Hooks a subclass may override:

* :meth:`~ScorerContract.make_config`: a config under which the scorer is on and can win
  (default: prefix routing and the KV index on, four backends weighted 1 to 4).
* :meth:`~ScorerContract.make_index`: the ``index`` collaborator (default None; a scorer
  that reads the KV index gets one holding :data:`PREFIX_HASH` here).

Every case scores the candidates built from the config's backends for one request whose
prefix key is :data:`PREFIX`. A case the scorer cannot meet is named in the class's
``unsupported`` mapping with the reason, and reported as skipped
(:mod:`continuum.testing.contract`).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, ClassVar

from prometheus_client import CollectorRegistry

from continuum.config import (
    BackendConfig,
    KvCacheIndexConfig,
    PrefixRoutingConfig,
    RouterConfig,
)
from continuum.interfaces import (
    TIER_GPU_HOT,
    TIER_NONE,
    TIER_STORAGE_WARM,
    BackendScorer,
    KvCacheIndex,
    SelectionStrategy,
)
from continuum.metrics import RouterMetrics
from continuum.registry import PluginRegistry
from continuum.request import RequestContext
from continuum.resources import WorkerResources
from continuum.routing.backends import Backend
from continuum.routing.selection import SCORER_THRESHOLD, SelectionPipeline
from continuum.testing.contract import Contract
from continuum.testing.strategies import make_context

SCORER_GROUP = "continuum.scorers"

#: The prefix key of the request every case scores, and its hash (the KV index's key).
PREFIX = bytes.fromhex("c0" * 32)
PREFIX_HASH = PREFIX.hex()

_TIERS = (TIER_NONE, TIER_GPU_HOT, TIER_STORAGE_WARM)


class _LastCandidate(SelectionStrategy):
    """The strategy behind the scorer: what the pipeline falls back to."""

    def select(self, candidates: Sequence[Backend], ctx: RequestContext) -> Backend:
        return candidates[-1]


class ScorerContract(Contract):
    """Subclass as ``Test<Something>`` and set ``scorer_name`` (or override a hook)."""

    #: Config name of the scorer under test, resolved through the entry points.
    scorer_name: ClassVar[str] = ""

    def make_config(self) -> RouterConfig:
        """A config under which the scorer is on and some candidate scores above the
        pipeline's threshold."""
        backends = tuple(BackendConfig(name=f"b{i}", url="http://127.0.0.1:9", weight=i + 1)
                         for i in range(4))
        return RouterConfig(backends=backends,
                            prefix_routing=PrefixRoutingConfig(enabled=True),
                            kv_cache_index=KvCacheIndexConfig(enabled=True))

    def make_index(self) -> KvCacheIndex | None:
        """The KV index the scorer is given (None: as with ``kv_cache_index`` off)."""
        return None

    def scorer_class(self) -> type[BackendScorer]:
        if not self.scorer_name:
            raise NotImplementedError("set scorer_name on the test class")
        loaded = PluginRegistry().load(SCORER_GROUP, self.scorer_name)
        assert issubclass(loaded, BackendScorer)
        return loaded

    def scorer_factory(self, **extra: Any) -> BackendScorer:
        """The scorer as the router builds it, with ``extra`` collaborators too."""
        scorer = self.scorer_class().from_config(
            self.make_config(), metrics=RouterMetrics(CollectorRegistry()),
            resources=WorkerResources(), index=self.make_index(), **extra)
        assert scorer is not None, f"{self.scorer_name} declined the config of make_config()"
        return scorer

    def candidates(self) -> list[Backend]:
        return [Backend(b) for b in self.make_config().backends]

    def scored(self, scorer: BackendScorer) -> tuple[list[Backend], list[tuple[float, str]]]:
        """Candidates and their (score, tier) for one request, prepared as the pipeline
        does."""
        candidates = self.candidates()
        ctx = make_context(prefix=PREFIX)
        scorer.prepare(ctx, candidates)
        return candidates, [scorer.score_with_tier(b, ctx) for b in candidates]

    # -- the cases --------------------------------------------------------------------

    def test_registered_under_its_config_name(self) -> None:
        assert self.scorer_class().name == self.scorer_name

    def test_built_from_config_ignoring_unknown_collaborators(self) -> None:
        scorer = self.scorer_factory(collaborator_from_a_newer_router=object())
        assert isinstance(scorer, self.scorer_class())

    def test_scores_are_in_the_unit_range_with_a_known_tier(self) -> None:
        _, scores = self.scored(self.scorer_factory())
        for score, tier in scores:
            assert 0.0 <= score <= 1.0
            assert tier in _TIERS

    def test_score_agrees_with_score_with_tier(self) -> None:
        scorer = self.scorer_factory()
        candidates = self.candidates()
        ctx = make_context(prefix=PREFIX)
        scorer.prepare(ctx, candidates)
        for backend in candidates:
            assert scorer.score(backend, ctx) == scorer.score_with_tier(backend, ctx)[0]

    def test_scoring_does_not_mutate_candidates(self) -> None:
        scorer = self.scorer_factory()
        candidates = self.candidates()
        before = list(candidates)
        ctx = make_context(prefix=PREFIX)
        scorer.prepare(ctx, candidates)
        for backend in candidates:
            scorer.score_with_tier(backend, ctx)
        assert candidates == before

    def test_the_best_score_above_the_threshold_routes_the_request(self) -> None:
        scorer = self.scorer_factory()
        candidates, scores = self.scored(scorer)
        best = max(range(len(scores)), key=lambda i: scores[i][0])
        assert scores[best][0] > SCORER_THRESHOLD, (
            "no candidate scores above the pipeline threshold under make_config(): the "
            "scorer can never change routing there")
        pipeline = SelectionPipeline(_LastCandidate(), [self.scorer_factory()])
        chosen = pipeline.select(candidates, make_context(prefix=PREFIX))
        assert chosen is candidates[best]


ScorerContract.full_contract = ScorerContract
