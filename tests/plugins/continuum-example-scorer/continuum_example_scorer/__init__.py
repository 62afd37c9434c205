"""An example third-party backend scorer for Continuum Router."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, ClassVar

from continuum.config import RouterConfig
from continuum.interfaces import BackendScorer
from continuum.request import RequestContext
from continuum.routing.backends import Backend

__all__ = ["PreferWeight"]


class PreferWeight(BackendScorer):
    """Scores a backend ``weight / heaviest configured weight``, so the heaviest healthy
    candidate wins whenever that is above the pipeline's 0.3 threshold.

    The weights come from the config at start, so scoring keeps no per-request state. With
    every backend equally weighted there is nothing to prefer, and :meth:`from_config`
    declines (the router then simply does not use the scorer).
    """

    name: ClassVar[str] = "PreferWeight"

    def __init__(self, weights: dict[str, int]) -> None:
        self.weights = weights
        self.heaviest = max(weights.values(), default=1)

    @classmethod
    def from_config(cls, config: RouterConfig, **collaborators: Any) -> PreferWeight | None:
        """The scorer for ``config.backends``' weights; None when they are all equal."""
        weights = {b.name: b.weight for b in config.backends}
        if len(set(weights.values())) < 2:
            return None
        return cls(weights)

    def prepare(self, ctx: RequestContext, candidates: Sequence[Backend]) -> None:
        """Nothing to fetch: the weights are known."""

    def score(self, backend: Backend, ctx: RequestContext) -> float:
        """``weight / heaviest`` in (0, 1]."""
        return self.weights.get(backend.name, 0) / self.heaviest
