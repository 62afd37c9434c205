"""PrefixAwareHash: consistent hashing with bounded loads (CHWBL) over prefix keys.

Requests with a prefix key go to the key's owner on the ring (multi-probe lookup, see
:meth:`continuum.routing.hashring.HashRing.lookup_probes`) while the owner carries
fewer than ``bound = ceil((1 + epsilon) * (in_flight_total + 1) / N)`` requests; a full
owner passes the request clockwise to the first backend under the bound. Requests
without a key hash the model name and take the first node with no bound (the
:class:`~strategies.consistent_hash.ConsistentHash` path).

With ``kv_cache_index.scoring.load_guard.slot_wait`` (the KV scorer sets
:attr:`~continuum.request.RequestContext.spill_at_slots`) an owner whose
``backends[].slots`` are full passes the request clockwise to the first backend under the
bound with a free slot, and only when none has one is the bound alone the test.

Decision labels (``continuum_prefix_routing_requests_total{strategy=...}``), recorded
once per ``select``:
  * ``prefix_hash``: the owner took it (including the all-full case, which keeps locality);
  * ``overflow``: the owner was full and a later backend on the ring took it;
  * ``fallback``: no prefix key; model-name hash, no bound.

Behind the KV scorer with ``kv_cache_index.match: chain`` the ring position comes from
:attr:`~continuum.request.RequestContext.route_key` (the chain key of a document in the user
turn, when the request has one) instead of the system-prompt key, so that new documents
behind one system prompt spread over the fleet.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import asdict
from typing import TYPE_CHECKING, Any, ClassVar

from continuum.cardinality import DistinctCounter
from continuum.config import PrefixRoutingConfig
from continuum.errors import NoHealthyBackendError
from continuum.interfaces import (
    PrefixRoutingDecisions,
    PrefixRoutingSettings,
    PrefixRoutingStats,
    rate_text,
)
from continuum.routing.backends import in_flight_of
from strategies.consistent_hash import ConsistentHash

if TYPE_CHECKING:
    from continuum.config import RouterConfig
    from continuum.metrics import RouterMetrics
    from continuum.request import RequestContext
    from continuum.routing.backends import Backend

PREFIX_HASH = "prefix_hash"
OVERFLOW = "overflow"
FALLBACK = "fallback"
_ONE_EACH = (1, 1)
#: Prefix keys remembered as counted in :attr:`PrefixAwareHash.prefixes`; more start over.
_MAX_COUNTED = 4096


def load_bound(candidates: Sequence[Backend], epsilon: float) -> int:
    """Most in-flight requests one backend may hold, counting the one being placed."""
    return _bound(in_flight_of(candidates), epsilon)


def _bound(loads: list[int], epsilon: float) -> int:
    """:func:`load_bound` of candidates carrying ``loads``."""
    return math.ceil((1.0 + epsilon) * (sum(loads) + 1) / len(loads))


class PrefixAwareHash(ConsistentHash):
    """Sticky prefix routing with bounded loads (the seed's Tier 1)."""

    name: ClassVar[str] = "PrefixAwareHash"
    deterministic: ClassVar[bool] = True
    sticky: ClassVar[bool] = True
    spills_at_slots: ClassVar[bool] = True  # along its ring, under the bound

    def __init__(
        self,
        config: RouterConfig | None = None,
        *,
        metrics: RouterMetrics | None = None,
        **collaborators: Any,
    ) -> None:
        settings = config.prefix_routing if config is not None else PrefixRoutingConfig()
        super().__init__(config, virtual_nodes=settings.virtual_nodes, **collaborators)
        self.settings = settings
        self.metrics = metrics
        self.decisions = {PREFIX_HASH: 0, OVERFLOW: 0, FALLBACK: 0}
        self.prefixes = DistinctCounter()
        #: Keys already given to :attr:`prefixes`: giving one again changes nothing, and
        #: a set lookup costs less than the estimator's register update.
        self._counted: set[bytes] = set()
        #: (decision, backend) -> the two counters' children (labels are bounded: three
        #: decisions times the configured backends).
        self._counters: dict[tuple[str, str], Callable[[tuple[float, ...]], None]] = {}

    def reconfigure(self, config: RouterConfig) -> list[str]:
        """Apply ``prefix_routing`` live: a new ``virtual_nodes`` rebuilds the rings
        (in-flight counts live on the backends and are kept)."""
        settings = config.prefix_routing
        if settings.virtual_nodes != self._virtual_nodes:
            self._virtual_nodes = settings.virtual_nodes
            self.forget_rings()
        self.settings = settings
        self.config = config
        return []

    def decide(
        self, candidates: Sequence[Backend], ctx: RequestContext
    ) -> tuple[Backend, str, int | None]:
        """The choice, its label and the load bound, without recording anything."""
        if not candidates:
            raise NoHealthyBackendError("no healthy backend to select from")
        key = ctx.route_key
        if key is None:
            return super().select(candidates, ctx), FALLBACK, None
        ring = self.ring(candidates)
        # Each candidate's load is read once: nothing else runs until the choice is made,
        # so a second read would give the same count.
        loads = in_flight_of(candidates)
        bound = _bound(loads, self.settings.load_factor_epsilon)
        start = ring.lookup_probes(key)
        first = ring.owners[start]
        owner = candidates[first]
        slots = owner.slots
        if loads[first] < bound and (slots is None or loads[first] < slots):
            return owner, PREFIX_HASH, bound  # the common case, without the walk
        if ctx.spill_at_slots:
            # The owner's slots are full (KV scorer with load_guard.slot_wait): the first
            # backend clockwise with a free slot under the bound, if any; an engine beyond
            # its slots queues however far under the bound it is.
            for index in ring.walk_indices_at(start):
                backend = candidates[index]
                limit = backend.slots
                if loads[index] < bound and (limit is None or loads[index] < limit):
                    return backend, (PREFIX_HASH if backend is owner else OVERFLOW), bound
        if loads[first] < bound:
            return owner, PREFIX_HASH, bound
        for index in ring.walk_indices_at(start):  # the owner first: it is full
            if loads[index] < bound:
                backend = candidates[index]
                return backend, (PREFIX_HASH if backend is owner else OVERFLOW), bound
        return owner, PREFIX_HASH, bound

    def select(self, candidates: Sequence[Backend], ctx: RequestContext) -> Backend:
        """Pick by prefix key with bounded loads (see the module docstring)."""
        backend, label, _limit = self.decide(candidates, ctx)
        self.decisions[label] += 1
        prefix = ctx.prefix_key
        if prefix is not None and prefix not in self._counted:
            self._count(prefix)
        metrics = self.metrics
        if metrics is not None:
            counters = self._counters.get((label, backend.name))
            if counters is None:
                counters = self._counters[(label, backend.name)] = metrics.joint((
                    metrics.adder(metrics.prefix_requests, label),
                    metrics.adder(metrics.prefix_distribution, backend.name)))
            counters(_ONE_EACH)
        return backend

    def _count(self, prefix: bytes) -> None:
        counted = self._counted
        if len(counted) >= _MAX_COUNTED:
            counted.clear()
        counted.add(prefix)
        self.prefixes.add(prefix)

    def explain(self, candidates: Sequence[Backend], ctx: RequestContext) -> dict[str, Any]:
        """What :meth:`select` would do for ``ctx`` and why, changing nothing."""
        backend, label, bound = self.decide(candidates, ctx)
        key = ctx.route_key
        if key is None:
            ring = self.ring(candidates)
            order = [candidates[i].name for i in ring.walk_indices(ctx.model.encode())]
            reason = "no prefix key: model-name hash, first backend clockwise, no load bound"
        else:
            ring = self.ring(candidates)
            start = ring.lookup_probes(key)
            owner = candidates[ring.owners[start]]
            order = [candidates[i].name for i in ring.walk_indices_at(start)]
            reason = {
                PREFIX_HASH: "the key's owner is under the load bound"
                if backend.in_flight < (bound or 0)
                else "every backend is at the bound; the owner keeps the request",
                OVERFLOW: f"the owner {order[0]} is at the load bound; next under it clockwise"
                if owner.in_flight >= (bound or 0)
                else f"the owner {order[0]} has no free slot; next with one clockwise",
            }[label]
        return {"decision": label, "backend": backend.name, "reason": reason,
                "load_bound": bound, "ring_order": order}

    def stats(self) -> dict[str, Any]:
        """:meth:`prefix_routing_stats` as a dict."""
        return asdict(self.prefix_routing_stats())

    def prefix_routing_stats(self) -> PrefixRoutingStats:
        """Decisions, overflow rate, unique prefixes and the live config."""
        total = sum(self.decisions.values())
        settings = self.settings
        overflow = self.decisions[OVERFLOW]
        return PrefixRoutingStats(
            config=PrefixRoutingSettings(
                max_prefix_length=settings.max_prefix_length,
                load_factor_epsilon=settings.load_factor_epsilon,
                virtual_nodes=self._virtual_nodes,
                anthropic_cache_control_injection=settings.anthropic_cache_control_injection,
            ),
            routing_decisions=PrefixRoutingDecisions(
                total=total, prefix_hash=self.decisions[PREFIX_HASH], overflow=overflow,
                fallback=self.decisions[FALLBACK],
                overflow_rate=rate_text(overflow, total),
            ),
            unique_prefixes=self.prefixes.count(),
        )
