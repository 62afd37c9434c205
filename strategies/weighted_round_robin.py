"""WeightedRoundRobin: nginx's smooth weighted round robin."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, ClassVar

from continuum.errors import NoHealthyBackendError
from continuum.interfaces import SelectionStrategy

if TYPE_CHECKING:
    from continuum.config import RouterConfig
    from continuum.request import RequestContext
    from continuum.routing.backends import Backend


class WeightedRoundRobin(SelectionStrategy):
    """Smooth weighted round robin, as nginx's upstream module does it.

    On every call each candidate's current weight grows by its configured weight; the
    candidate with the highest current weight wins (the first in list order on a tie) and
    loses the sum of all weights. Weights 5, 1, 1 give ``a a b a c a a``: the heavy backend
    gets its share without bursts. Deterministic.

    Current weights are kept by backend name, so a candidate list that changes between
    calls (a backend marked down, then back) keeps the others' positions. A returning
    backend resumes with the current weight it had, which is bounded by the weight sum.
    """

    name: ClassVar[str] = "WeightedRoundRobin"
    deterministic: ClassVar[bool] = True
    weighted: ClassVar[bool] = True

    def __init__(self, config: RouterConfig | None = None, **collaborators: Any) -> None:
        super().__init__(config, **collaborators)
        self._current: dict[str, int] = {}

    def select(self, candidates: Sequence[Backend], ctx: RequestContext) -> Backend:
        """Return the candidate with the highest current weight.

        Raises:
            NoHealthyBackendError: ``candidates`` is empty.
        """
        if not candidates:
            raise NoHealthyBackendError("no healthy backend to select from")
        current = self._current
        total = 0
        best = candidates[0]
        best_weight: int | None = None
        for backend in candidates:
            weight = backend.weight
            total += weight
            value = current.get(backend.name, 0) + weight
            current[backend.name] = value
            if best_weight is None or value > best_weight:
                best, best_weight = backend, value
        current[best.name] -= total
        return best

    def stats(self) -> dict[str, Any]:
        """Current weight of every backend seen so far."""
        return {"current_weights": dict(self._current)}
