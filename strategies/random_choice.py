"""Random: a weight-proportional random pick."""

from __future__ import annotations

import random
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, ClassVar

from continuum.errors import NoHealthyBackendError
from continuum.interfaces import SelectionStrategy

if TYPE_CHECKING:
    from continuum.config import RouterConfig
    from continuum.request import RequestContext
    from continuum.routing.backends import Backend


class RandomChoice(SelectionStrategy):
    """Picks a candidate at random, each with probability proportional to its weight.

    Uses its own :class:`random.Random`, never the module-level generator, so a ``seed``
    collaborator makes the sequence reproducible (tests, simulations) and nothing else in
    the process can disturb it.

    Args:
        config: the router config.
        seed: seed for this instance's generator; None seeds from the OS.
    """

    name: ClassVar[str] = "Random"
    weighted: ClassVar[bool] = True

    def __init__(
        self, config: RouterConfig | None = None, *, seed: int | None = None, **collaborators: Any
    ) -> None:
        super().__init__(config, **collaborators)
        self._random = random.Random(seed)

    def select(self, candidates: Sequence[Backend], ctx: RequestContext) -> Backend:
        """Return a random candidate, weighted by ``Backend.weight``.

        Raises:
            NoHealthyBackendError: ``candidates`` is empty.
        """
        if not candidates:
            raise NoHealthyBackendError("no healthy backend to select from")
        if len(candidates) == 1:
            return candidates[0]
        total = 0
        for backend in candidates:
            total += backend.weight
        # Walking the cumulative weights avoids the two lists random.choices() would build.
        point = self._random.random() * total
        for backend in candidates:
            point -= backend.weight
            if point < 0:
                return backend
        return candidates[-1]  # float rounding can leave point at exactly 0.0
