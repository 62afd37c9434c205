"""ConsistentHash: a hash ring keyed by the model name."""

from __future__ import annotations

from collections.abc import Sequence
from operator import attrgetter
from typing import TYPE_CHECKING, Any, ClassVar

from continuum.errors import NoHealthyBackendError
from continuum.interfaces import SelectionStrategy
from continuum.routing.hashring import DEFAULT_VIRTUAL_NODES, HashRing, stable_hash

if TYPE_CHECKING:
    from continuum.config import RouterConfig
    from continuum.request import RequestContext
    from continuum.routing.backends import Backend

#: Distinct candidate sets remembered; more than this (a flapping fleet) starts over.
_MAX_RINGS = 64
#: Model-name hashes remembered; model names are few, but they come from clients.
_MAX_KEYS = 4096
_name = attrgetter("name")


class ConsistentHash(SelectionStrategy):
    """Sends every request for a model to the same backend, via a consistent-hash ring.

    The ring (see :class:`continuum.routing.hashring.HashRing`, 150 virtual nodes per backend)
    uses stable hashes, so every worker and every router instance agrees on the owner of
    a model, and removing one of N backends moves only about 1/N of the models. Rings are
    built once per distinct tuple of candidate names and cached, as are the model names'
    hashes, so ``select`` is two dict lookups and a bisect. Weights are ignored.
    """

    name: ClassVar[str] = "ConsistentHash"
    deterministic: ClassVar[bool] = True
    sticky: ClassVar[bool] = True

    def __init__(
        self,
        config: RouterConfig | None = None,
        *,
        virtual_nodes: int = DEFAULT_VIRTUAL_NODES,
        **collaborators: Any,
    ) -> None:
        super().__init__(config, **collaborators)
        self._virtual_nodes = virtual_nodes
        self._rings: dict[tuple[str, ...], HashRing] = {}
        #: The same rings by the candidates themselves (a tuple of backends hashes and
        #: compares by identity, without reading a name): the per-request lookup.
        self._rings_of: dict[tuple[Backend, ...], HashRing] = {}
        self._key_hashes: dict[str, int] = {}

    def select(self, candidates: Sequence[Backend], ctx: RequestContext) -> Backend:
        """Return the candidate that owns ``ctx.model`` on the ring of ``candidates``.

        Raises:
            NoHealthyBackendError: ``candidates`` is empty.
        """
        if not candidates:
            raise NoHealthyBackendError("no healthy backend to select from")
        ring = self.ring(candidates)
        model = ctx.model
        position = self._key_hashes.get(model)
        if position is None:
            if len(self._key_hashes) >= _MAX_KEYS:
                self._key_hashes.clear()
            position = self._key_hashes[model] = stable_hash(model.encode())
        return candidates[ring.owners[ring.lookup_position(position)]]

    def ring(self, candidates: Sequence[Backend]) -> HashRing:
        """The (cached) ring whose ``names`` are the candidates' names, in their order."""
        backends = tuple(candidates)
        ring = self._rings_of.get(backends)
        if ring is not None:
            return ring
        if len(self._rings_of) >= _MAX_RINGS:
            self._rings_of.clear()
        ring = self._rings_of[backends] = self._ring_of_names(candidates)
        return ring

    def _ring_of_names(self, candidates: Sequence[Backend]) -> HashRing:
        names = tuple(map(_name, candidates))
        ring = self._rings.get(names)
        if ring is None:
            if len(self._rings) >= _MAX_RINGS:
                self._rings.clear()
            ring = self._rings[names] = HashRing(names, self._virtual_nodes)
        return ring

    def forget_rings(self) -> None:
        """Drop every cached ring (their layout changed: ``virtual_nodes``)."""
        self._rings.clear()
        self._rings_of.clear()

    def stats(self) -> dict[str, Any]:
        """Ring parameters and how many candidate sets have a cached ring."""
        return {"virtual_nodes": self._virtual_nodes, "cached_rings": len(self._rings)}
