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
    so no backend is favoured by a restart. Under gunicorn the host's workers share it
    (``host``, the host segment, with ``fleet.share_rotation``): each request takes the
    host's next turn, so four workers cycle as one router. With a counter per worker, each
    worker started its own cycle on the first backend, and requests that came in together
    on different workers went to the same backend: its queue, and the time to first token
    behind it, grew while the others idled. Routers that exchange their load through Redis
    also learn their place among each other, and each starts its cycle that share of the
    way round (:meth:`continuum.hostshm.HostSegment.take_turn`).
    """

    name: ClassVar[str] = "RoundRobin"
    deterministic: ClassVar[bool] = True

    def __init__(self, config: RouterConfig | None = None, **collaborators: Any) -> None:
        super().__init__(config, **collaborators)
        self._counter = 0
        host = collaborators.get("host")
        share = config is None or config.fleet.share_rotation
        self._take_turn = host.take_turn if host is not None and share else None

    def select(self, candidates: Sequence[Backend], ctx: RequestContext) -> Backend:
        """Return the next candidate in turn.

        Raises:
            NoHealthyBackendError: ``candidates`` is empty.
        """
        if not candidates:
            raise NoHealthyBackendError("no healthy backend to select from")
        counter = self._counter
        self._counter = counter + 1
        take_turn = self._take_turn
        if take_turn is not None:
            counter = take_turn(len(candidates))
        return candidates[counter % len(candidates)]

    def stats(self) -> dict[str, Any]:
        """Selections this worker made so far, and whether its host's workers share turns."""
        return {"selections": self._counter, "shared_turns": self._take_turn is not None}
