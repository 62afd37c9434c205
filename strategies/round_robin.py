"""RoundRobin: each candidate in turn."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, ClassVar

from continuum.errors import NoHealthyBackendError
from continuum.interfaces import SelectionStrategy

if TYPE_CHECKING:
    from continuum.config import RouterConfig
    from continuum.request import RequestContext
    from continuum.routing.backends import Backend


class RoundRobin(SelectionStrategy):
    """Cycles through the candidates with one counter, ignoring weights and load.

    The counter is shared across models and candidate lists: when the list changes (a
    backend goes down) the rotation carries on over the new list rather than restarting,
    so no backend is favoured by a restart. One counter per worker process.
    """

    name: ClassVar[str] = "RoundRobin"
    deterministic: ClassVar[bool] = True

    def __init__(self, config: RouterConfig | None = None, **collaborators: Any) -> None:
        super().__init__(config, **collaborators)
        self._counter = 0

    def select(self, candidates: Sequence[Backend], ctx: RequestContext) -> Backend:
        """Return the next candidate in turn.

        Raises:
            NoHealthyBackendError: ``candidates`` is empty.
        """
        if not candidates:
            raise NoHealthyBackendError("no healthy backend to select from")
        counter = self._counter
        self._counter = counter + 1
        return candidates[counter % len(candidates)]

    def stats(self) -> dict[str, Any]:
        """Selections made so far."""
        return {"selections": self._counter}
