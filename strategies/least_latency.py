"""LeastLatency: the backend with the lowest latency EWMA."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, ClassVar

from continuum.errors import NoHealthyBackendError
from continuum.interfaces import SelectionStrategy

if TYPE_CHECKING:
    from continuum.config import RouterConfig
    from continuum.request import RequestContext
    from continuum.routing.backends import Backend

#: Sorts below every real latency, so backends with no sample yet are tried first.
_UNSAMPLED = -1.0


class LeastLatency(SelectionStrategy):
    """Picks the candidate whose latency EWMA is lowest.

    A backend with no completed request yet has no EWMA; it is picked before any sampled
    one so that new and recovered backends get measured instead of starved. Ties (equal
    EWMA, or several unsampled) go to the backend with fewer requests in flight, and then
    to the tied candidates in turn (a counter that advances on every tied call), so a tied
    group shares the load instead of the first in config order taking all of it.

    EWMAs are per worker (see :class:`continuum.routing.backends.Backend`).
    """

    name: ClassVar[str] = "LeastLatency"
    deterministic: ClassVar[bool] = True

    def __init__(self, config: RouterConfig | None = None, **collaborators: Any) -> None:
        super().__init__(config, **collaborators)
        self._counter = 0

    def select(self, candidates: Sequence[Backend], ctx: RequestContext) -> Backend:
        """Return the fastest candidate, or an unsampled one.

        Raises:
            NoHealthyBackendError: ``candidates`` is empty.
        """
        if not candidates:
            raise NoHealthyBackendError("no healthy backend to select from")
        # First pass: the best (latency, in-flight) pair and how many candidates share it.
        best_latency = 0.0
        best_in_flight = 0
        ties = 0
        for backend in candidates:
            latency = _UNSAMPLED if backend.latency_ewma is None else backend.latency_ewma
            in_flight = backend.in_flight
            if (
                ties == 0
                or latency < best_latency
                or (latency == best_latency and in_flight < best_in_flight)
            ):
                best_latency, best_in_flight, ties = latency, in_flight, 1
            elif latency == best_latency and in_flight == best_in_flight:
                ties += 1
        if ties == 1:
            wanted = 0
        else:
            wanted = self._counter % ties
            self._counter += 1
        # Second pass: the wanted-th tied candidate, so a tied group takes turns.
        for backend in candidates:
            latency = _UNSAMPLED if backend.latency_ewma is None else backend.latency_ewma
            if latency == best_latency and backend.in_flight == best_in_flight:
                if wanted == 0:
                    return backend
                wanted -= 1
        raise AssertionError("unreachable: the first pass found at least one candidate")
