"""Tier 4 with ``kv_cache_index.match: chain``: score backends by how far their cache goes
into the request's chain of prefix keys (:mod:`continuum.prefix_chain`).

This is the built-in scorer registered as ``KvOverlap`` in ``continuum.scorers``: with
``match: chain`` (the default) :meth:`ChainOverlapScorer.from_config` builds it, with
``match: seed`` the seed's :class:`~continuum.kv.scorer.KvOverlapScorer` it extends. The
service asks it for each request's chain (:meth:`~ChainOverlapScorer.request_chain`, kept
in :attr:`RequestContext.chain <continuum.request.RequestContext.chain>`) and tells it where
each request went (:meth:`~ChainOverlapScorer.record_route`: approximate mode). A request
without a chain (a scorer built outside the service, say) is scored as with ``match: seed``.

For each candidate the index gives its longest match (:meth:`KvCacheIndex.query_chain`):
``depth`` keys, ``token_count`` tokens; a backend known only through the seed key (engines
whose prompts cannot be recovered) is credited the first message. Then:

* ``overlap`` = matched tokens ÷ prompt tokens, the prompt's tokens estimated from its
  canonical bytes at the match's own tokens per byte (so a holder of 2% of a long prompt
  scores 0.02, never like a full match), times the tier weight, times
  ``approximate.weight`` for a match the router recorded but no engine event confirmed;
* a holder whose ``overlap`` is below ``min_overlap_threshold`` scores 0, like a
  non-holder.

Load guard (``scoring.load_guard``):

* ``adaptive`` (default): a holder qualifies while the prefill its match saves is worth
  more than the queue it has beyond the candidates' mean::

      saved = matched tokens * tier weight * approximate weight * prefill_ms_per_1k_tokens / 1000
      extra = (in_flight - mean in_flight of the candidates) * per_request
      per_request = queue_ms_per_request                    under the CHWBL load bound
                  = max(queue_ms_per_request, latency EWMA / in_flight)   at the bound

  A backend with ``backends[].slots`` (the requests the engine runs at once) is at its
  bound from its slots on: beyond them it queues, however far under the CHWBL bound
  (never under ``floor``, 4) it is. On the ``load`` demo with eight engines of two slots
  this took the KV row's mean TTFT from 58-72 ms to 30-31 ms (PrefixAwareHash: 33) at
  the same prefix hit rate, where unused engines had sat idle beside holders queueing two.

  With ``learned_wait`` (off by default) ``extra`` is at least the wait for a first token the
  holder would make the request do beyond the least-waiting candidate's
  (:meth:`Backend.queue_wait <continuum.routing.backends.Backend.queue_wait>`): for each
  in-flight count a request was sent at, the router keeps how long streams took to
  their first body piece (EWMA; a count counts from 5 samples), and the wait at a count
  is how much longer than at the fastest count that took (never less than at a smaller
  count; 0 until learned). Engines batch up to their slots, where the counts cost about
  the same, and queue beyond them wherever the CHWBL bound is: an engine with two slots
  queues the third request, however far below the bound (the floor alone is 4). Only
  the wait beyond the least-waiting candidate's counts, so when every engine is as full
  the match still wins, and a holder under its slots pays nothing however long its
  answers are (a growing session stays with its history). A holder turned down leaves
  the request to the configured strategy as before. (Sending it instead to the
  candidate with the shortest learned wait was tried: on a contended machine the misses
  it made slowed the engines, which raised the waits, which made more misses, and the
  ``load`` demo's hit rate fell to 87% and its p99 TTFT to seconds.)

  With ``slot_wait`` (on by default) and a holder's slots known (``backends[].slots`` or
  ``learn_slots``), ``extra`` is ``queue_ms_per_request`` for each request beyond the
  mean, and at least its wait for a slot beyond the least-waiting candidate's: the
  requests beyond its slots, counting this one, times its latency EWMA / its in-flight
  count (at least ``queue_ms_per_request``), where a backend with a free slot waits 0.
  Its latency does not price its queue beyond the mean at its slots then: a holder that is
  merely full in an idle fleet makes the request wait for one slot, not for every request
  it runs beyond the mean (four slots busy with a mean of 1.25 once cost 2.75 shares of its
  latency and sent sessions of the light ``default`` demo away from their prompt for no
  shorter TTFT: 1.5-3.6 points of prefix hits there). Placement, which moves a session for
  good, takes the lesser of this price and the one beyond the mean at its latency, so a
  new session stays with a full holder when every engine is as busy. The request a full
  holder is turned down for then goes to the strategy
  with :attr:`RequestContext.spill_at_slots <continuum.request.RequestContext.spill_at_slots>`
  set, and PrefixAwareHash passes over owners whose slots are full to the next backend on
  the ring with a free one (any other strategy chooses among the backends with a free
  slot: :mod:`continuum.routing.selection`). The guard alone compares a holder with the
  candidates' mean, and PrefixAwareHash alone with the CHWBL bound, so on engines of two
  slots a holder running four took the request while another ran one (the ``load`` demo:
  about a third of all requests).

  Under the bound a request more costs little otherwise, so a lightly loaded fleet keeps
  its longest match; at the bound a backend's own latency prices its queue, so a
  saturated holder is recognised even before its waits are learned. A qualified holder scores
  ``threshold + (1 - threshold) * health * net`` where ``net`` = (saved - extra) ÷ the
  prefill of the whole prompt: holders are ranked by what they save net of their queue
  (equal matches go to the less busy holder, whose ``extra`` is lower), and the
  pipeline's threshold is passed exactly when ``saved > extra``. A hot prefix's holder
  stops qualifying once its queue costs more than the prefill it saves, and the
  configured strategy (bounded-load hashing) takes the request.
* placement (``kv_cache_index.placement``, adaptive mode): a request whose best match
  is its first message at most (a new session over a shared system prompt), with an
  overlap worth scoring, goes to the candidate whose cost is least::

      cost = (best holder's saved tokens - its saved tokens) * prefill_ms_per_token
           + weight * (its pressure - the least pressure of the candidates) * prefill_ms_per_token
           + its queue beyond the mean, priced as the adaptive guard prices it

  where a backend's pressure is the prompt tokens beyond their match the router sent it
  to store, decayed over ``window_seconds`` (summed over the host's workers through the
  host segment when there is one, see :meth:`ChainOverlapScorer.share_pressure`, and
  over the other routers' with :mod:`continuum.routing.fleet_load`).
  Sessions that will grow then spread over the fleet's KV capacity instead of following
  their system prompt's first holder, whose cache they would overrun (``agent`` demo:
  about 75% prefix hits without it). When that cost sends the request away from the
  holders of its prompt (to a backend losing more than half the best holder's saving),
  it redoes the prompt's prefill wherever it goes and its session's later turns follow
  it, so the destination is chosen again among those backends with each queue priced
  beyond the *least busy* candidate's, at its latency EWMA / its in-flight count (at
  least ``queue_ms_per_request``) however far under the bound: the second home of a hot
  system prompt is the idlest engine, not whichever engine under the mean comes first.
  On the ``load`` demo (two slots per engine) one engine had been left with the small
  prompts and a quarter of the others' queue; choosing the idlest brought the KV row's
  p99 TTFT there under the other rows' in one three-round run (505 ms against 527 and
  584), though not in another (1.28x the bound guard's: the README's ``load``
  paragraph). Pricing the queue at the latency under the bound in the first step too (a
  busy holder handing its next session away before it reaches the bound) cost a point
  of prefix hits on ``default`` (92.0% against 93.0%) and 0.2 on ``load``, for a
  ``load`` tail no better beyond noise (513 against 535 ms, three rounds of the KV row
  alone) once the second step existed.
* ``bound``: the seed's composite score (overlap, load, health weights) on the overlap
  above, and a holder qualifies only under the CHWBL bound, as with ``match: seed``.
* ``enabled: false``: the composite score alone.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, ClassVar

from continuum.errors import StoreError
from continuum.interfaces import (
    CACHE_CREATED,
    SCORER_THRESHOLD,
    TIER_NONE,
    ChainMatch,
    KvCacheIndex,
)
from continuum.kv.scorer import SNAPSHOT_TTL, KvOverlapScorer, _Snapshot, log
from continuum.prefix_chain import BYTES_PER_TOKEN, PrefixChain, request_chain

if TYPE_CHECKING:
    from continuum.config import KvCacheIndexConfig, RouterConfig
    from continuum.hostshm import HostSegment
    from continuum.metrics import RouterMetrics
    from continuum.request import RequestContext
    from continuum.routing.backends import Backend

_MAX_SNAPSHOTS = 4096

#: Costs of one placement candidate, in ms: (lost prefill, KV pressure, queue).
Costs = tuple[float, float, float]
#: A placement: the chosen backend's name and every candidate's costs.
Placed = tuple[str, dict[str, Costs]]
_NO_COSTS: Costs = (0.0, 0.0, 0.0)


class _Credit:
    """What one backend's match is worth for one request (computed once per request)."""

    __slots__ = ("depth", "match", "matched_bytes", "overlap", "prompt_tokens", "saved_tokens",
                 "tokens")

    def __init__(self, match: ChainMatch, chain: PrefixChain, weight: float) -> None:
        covered = chain.ends[-1] if chain.ends else 1
        if match.depth > 0:
            matched_bytes = chain.ends[min(match.depth, len(chain.ends)) - 1]
        else:  # the seed key: the first message, what every chain of that prefix shares
            matched_bytes = min(chain.anchor_end, covered)
        estimate = max(1, matched_bytes // BYTES_PER_TOKEN)
        tokens = match.token_count or estimate
        if match.depth == 0:
            tokens = min(tokens, estimate)
        self.match = match
        self.depth = match.depth
        self.matched_bytes = matched_bytes
        self.tokens = tokens
        self.prompt_tokens = max(tokens, round(tokens * covered / max(matched_bytes, 1)))
        self.overlap = min(1.0, matched_bytes / covered) * weight
        self.saved_tokens = tokens * weight


def _held_ms(backend: Backend, in_flight: int, queue_ms: float) -> float:
    """What ``backend``'s latency says one request holds its queue for (latency EWMA /
    ``in_flight``), at least ``queue_ms``; ``queue_ms`` before any latency is known."""
    ewma = backend.latency_ewma
    if ewma is None:
        return queue_ms
    return max(queue_ms, ewma * 1000.0 / max(in_flight, 1))


def _slot_wait_ms(backend: Backend, queue_ms: float) -> float:
    """``load_guard.slot_wait``: how long a request sent to ``backend`` now waits for a
    slot: the requests beyond its slots (counting this one) times :func:`_held_ms`; 0 with
    a free slot or unknown slots."""
    in_flight = backend.in_flight
    slots = backend.slots
    if slots is None or in_flight < slots:
        return 0.0
    return (in_flight - slots + 1) * _held_ms(backend, in_flight, queue_ms)


def _queue_bound(backend: Backend, bound: int) -> int:
    """Where ``backend`` starts to queue: the CHWBL ``bound``, or its ``backends[].slots``
    when fewer (beyond them it queues, however far under the bound it is)."""
    slots = backend.slots
    return slots if slots is not None and slots < bound else bound


class _ChainSnapshot:
    """What one request's scoring reads (kept in ``ctx.kv_snapshot``): each holder's
    credit, the candidates' mean in-flight count, and for the composite score the seed
    scorer's in-flight snapshot (None in adaptive mode, which reads the queue live)."""

    __slots__ = ("bound", "chain", "credits", "least_slot_wait", "least_wait", "load",
                 "mean_in_flight", "placed")

    def __init__(self, chain: PrefixChain, credits: dict[str, _Credit], bound: int,
                 mean_in_flight: float, load: _Snapshot | None, least_wait: float = 0.0) -> None:
        self.chain = chain
        self.credits = credits
        self.bound = bound
        self.mean_in_flight = mean_in_flight
        self.load = load
        #: The shortest learned wait for a first token among the candidates (seconds).
        self.least_wait = least_wait
        #: ``load_guard.slot_wait``: the shortest wait for a slot among the candidates (ms).
        self.least_slot_wait = 0.0
        #: With placement: the backend a first-message match goes to, and each
        #: candidate's cost (lost prefill, pressure, queue, in ms).
        self.placed: Placed | None = None


class ChainOverlapScorer(KvOverlapScorer):
    """Scores backends by their longest match of the request's chain (module docstring)."""

    name: ClassVar[str] = "KvOverlap"

    def __init__(
        self,
        index: KvCacheIndex,
        kv: KvCacheIndexConfig,
        metrics: RouterMetrics | None = None,
        clock: Callable[[], float] = time.monotonic,
        threshold: float = SCORER_THRESHOLD,
    ) -> None:
        super().__init__(index, kv.scoring, metrics, clock)
        guard = kv.scoring.load_guard
        self.adaptive = guard.enabled and guard.mode == "adaptive"
        self.guard = guard.enabled and guard.mode == "bound"
        self.prefill_ms_per_token = guard.prefill_ms_per_1k_tokens / 1000.0
        self.queue_ms = guard.queue_ms_per_request
        self.learned_wait = self.adaptive and guard.learned_wait
        self.slot_wait = self.adaptive and guard.slot_wait
        self.approximate_weight = kv.approximate.weight
        self.approximate_ttl = kv.approximate_ttl if kv.approximate.enabled else None
        self.chunk_bytes = kv.chain.chunk_bytes
        self.max_keys = kv.chain.max_keys
        self.threshold = threshold
        self._matches: dict[str, tuple[float, Sequence[ChainMatch]]] = {}
        placement = kv.placement
        self.placement = kv.adaptive_placement
        self.pressure_window = placement.window_seconds
        self.pressure_weight = placement.weight
        #: backend name -> [tokens this worker sent it to store, decayed to the time beside it]
        self._pressure: dict[str, list[float]] = {}
        #: The host segment the workers share their pressure through (None: this worker's).
        self._host: HostSegment | None = None

    def share_pressure(self, segment: HostSegment | None) -> None:
        """Publish this worker's KV pressure in ``segment`` and read the host's from it, so
        that every worker of a host places new sessions on the same picture (None: each
        worker's own)."""
        self._host = segment
        if segment is not None:
            for name, (value, at) in self._pressure.items():
                segment.set_pressure(segment.column(name), value, at)

    @classmethod
    def from_config(
        cls,
        config: RouterConfig,
        *,
        index: KvCacheIndex | None = None,
        metrics: RouterMetrics | None = None,
        **_: Any,
    ) -> KvOverlapScorer | None:
        """The chain scorer over the worker's ``index`` with ``kv_cache_index.match:
        chain``, the seed's scorer with ``match: seed``; None without an index
        (``kv_cache_index.enabled`` off): nothing to score."""
        if index is None:
            return None
        kv = config.kv_cache_index
        if kv.match == "seed":
            return KvOverlapScorer(index, kv.scoring, metrics)
        return cls(index, kv, metrics)

    def request_chain(self, ctx: RequestContext) -> PrefixChain | None:
        """``ctx``'s chain of prefix keys at this scorer's chunk size and depth (None when
        the request has no messages to key)."""
        return request_chain(ctx.keyed_body, ctx.model, chunk_bytes=self.chunk_bytes,
                             max_keys=self.max_keys)

    def record_route(self, ctx: RequestContext, backend: Backend) -> None:
        """Approximate mode (``kv_cache_index.approximate``): record ``ctx``'s chain for
        the ``backend`` it was sent to, with its own TTL, token counts estimated from the
        bytes. A failing index costs the record, never the request."""
        chain, ttl = ctx.chain, self.approximate_ttl
        if chain is None or not chain.keys:
            return
        if self.placement:
            self._add_pressure(backend.name, ctx, chain)
        if ttl is None:
            return
        self._matches.pop(chain.keys[-1], None)  # the next query of this chain sees it
        entries = [(key, end // BYTES_PER_TOKEN)
                   for key, end in zip(chain.keys, chain.ends, strict=True)]
        try:
            self.index.apply_chain(backend.name, CACHE_CREATED, entries, ttl=ttl)
        except StoreError as exc:
            log.debug("KV index: recording a routed chain failed (%s)", exc.kind)

    def pressure(self, name: str, now: float | None = None) -> float:
        """Tokens the router sent backend ``name`` to store (prompt tokens beyond its
        match), decayed over ``placement.window_seconds``: how hard the router is filling
        that backend's KV cache. With a host segment, the sum over the host's workers."""
        at = self.clock() if now is None else now
        host = self._host
        if host is not None:
            return host.host_pressure(host.column(name), at, self.pressure_window)
        return self._own_pressure(name, at)

    def _own_pressure(self, name: str, now: float) -> float:
        entry = self._pressure.get(name)
        if entry is None:
            return 0.0
        return entry[0] * math.exp(-max(0.0, now - entry[1]) / self.pressure_window)

    def _add_pressure(self, name: str, ctx: RequestContext, chain: PrefixChain) -> None:
        snapshot = ctx.kv_snapshot
        credit = snapshot.credits.get(name) if isinstance(snapshot, _ChainSnapshot) else None
        matched = credit.matched_bytes if credit is not None else 0
        new_tokens = max(0, chain.total_bytes - matched) // BYTES_PER_TOKEN
        now = self.clock()
        value = self._own_pressure(name, now) + new_tokens
        self._pressure[name] = [value, now]
        host = self._host
        if host is not None:
            host.set_pressure(host.column(name), value, now)

    def _place(self, credits: dict[str, _Credit], chain: PrefixChain,
               candidates: Sequence[Backend], mean_in_flight: float, bound: int,
               now: float, least_slot_wait: float) -> Placed | None:
        """Placement (``kv_cache_index.placement``): when the best match covers the
        request's first message at most and is worth scoring (``min_overlap_threshold``),
        the candidate whose lost prefill + pressure + queue costs least, and every
        candidate's three costs; None otherwise (a longer match, or a small one: a new
        document behind a short system prompt is left to the strategy, which spreads it
        by its first chunk).

        Two steps. Whether the request stays with a holder of its prompt (one that loses
        less than half the best holder's saving) prices each queue as the guard does:
        beyond the candidates' mean, at the backend's latency once it is at the CHWBL
        ``bound``. A request that leaves them redoes the prompt's prefill wherever it
        goes, and its session's later turns follow it, so among the others each queue is
        priced beyond the least busy candidate's, at the backend's latency however far
        under the bound: the second home of a hot prompt is the idlest engine, not
        whichever engine under the mean comes first."""
        best = max(credits.values(), key=lambda c: c.saved_tokens, default=None)
        if not candidates or best is None or best.matched_bytes > chain.anchor_end \
                or best.overlap < self.min_overlap:
            return None
        per_token = self.prefill_ms_per_token
        pressures = {b.name: self.pressure(b.name, now) for b in candidates}
        least = min(pressures.values())
        costs: dict[str, Costs] = {}
        for backend in candidates:
            credit = credits.get(backend.name)
            saved = credit.saved_tokens if credit is not None else 0.0
            queue = self._queue_ms(backend, mean_in_flight, bound)
            if self.slot_wait and backend.slots is not None:
                # A session placed away from its prompt's holders stays away for good: it
                # leaves only when both prices of the queue say so (the one beyond the
                # mean is small when every engine is as busy; the wait for a slot, when
                # the holder is merely full in an idle fleet).
                queue = min(queue, self._slots_queue_ms(backend, mean_in_flight,
                                                        least_slot_wait))
            costs[backend.name] = (
                (best.saved_tokens - saved) * per_token,
                self.pressure_weight * (pressures[backend.name] - least) * per_token,
                queue,
            )
        chosen = min(costs, key=lambda name: sum(costs[name]))
        half = best.saved_tokens * per_token / 2.0
        if costs[chosen][0] > half:  # it leaves the prompt's holders: the idlest of the rest
            idlest = min(b.in_flight for b in candidates)
            leaving = [b for b in candidates if costs[b.name][0] > half]
            for backend in leaving:
                lost_ms, pressure_ms, _ = costs[backend.name]
                costs[backend.name] = (lost_ms, pressure_ms,
                                       self._queue_ms(backend, idlest, bound=0))
            chosen = min((b.name for b in leaving), key=lambda name: sum(costs[name]))
        return chosen, costs

    def _queue_ms(self, backend: Backend, reference: float, bound: int) -> float:
        """The price of ``backend``'s queue beyond ``reference`` in-flight requests (the
        candidates' mean, or for placement's second step the least busy candidate's): each
        request beyond it costs ``queue_ms_per_request``, or, once ``backend`` is at
        ``bound``, what its latency says one request holds it for (latency EWMA /
        in-flight) when that is more. The adaptive guard and placement's first step pass
        the CHWBL bound; placement's second step passes 0, so the latency prices every
        queue there."""
        in_flight = backend.in_flight
        per_request = self.queue_ms
        if in_flight + 1 > _queue_bound(backend, bound):
            per_request = _held_ms(backend, in_flight, per_request)
        return max(0.0, in_flight - reference) * per_request

    def _slots_queue_ms(self, backend: Backend, reference: float,
                        least_slot_wait: float) -> float:
        """With ``slot_wait``, the price of the queue of a ``backend`` whose slots are known:
        ``queue_ms_per_request`` for each request beyond ``reference`` (the candidates'
        mean), and at least its wait for a slot beyond the least-waiting candidate's. Its
        latency does not price the queue beyond the mean at its slots, as
        :meth:`_queue_ms` does without known slots: a holder that is full while the fleet
        is idle makes a request wait for one slot, one request's share of its latency,
        not for every request it runs beyond the mean (four slots full, a mean of 1.25:
        about 1 share, where that price said 2.75)."""
        queue = max(0.0, backend.in_flight - reference) * self.queue_ms
        return max(queue, _slot_wait_ms(backend, self.queue_ms) - least_slot_wait)

    def prepare(self, ctx: RequestContext, candidates: Sequence[Backend]) -> None:
        """Query the index for the request's chain (cached 100 ms per chain) and work out
        each holder's credit; the queue is read live when scoring. Without a chain: the
        seed's scoring."""
        chain = ctx.chain
        if chain is None or not chain.keys:
            super().prepare(ctx, candidates)
            return
        now = self.clock()
        tip = chain.keys[-1]
        cached = self._matches.get(tip)
        if cached is not None and now - cached[0] < SNAPSHOT_TTL:
            matches = cached[1]
        else:
            keys, prefix_hash = chain.keys, ctx.prefix_hash
            matches = self._query(lambda: self.index.query_chain(keys, prefix_hash))
            if len(self._matches) >= _MAX_SNAPSHOTS:
                self._matches.clear()
            self._matches[tip] = (now, matches)
        credits = {}
        for match in matches:
            weight = self.tier_weights.get(match.tier, 0.0)
            if match.approximate:
                weight *= self.approximate_weight
            credits[match.backend] = _Credit(match, chain, weight)
        total = sum(b.in_flight for b in candidates)
        bound = max(self.guard_floor, math.ceil(
            (1.0 + self.guard_epsilon) * (total + 1) / max(len(candidates), 1)))
        # the composite score and the CHWBL bound read the load as of now
        load = None if self.adaptive else _Snapshot((), candidates, now, self.guard_epsilon,
                                                    self.guard_floor)
        least_wait = min((b.queue_wait() for b in candidates), default=0.0) \
            if self.learned_wait else 0.0
        mean_in_flight = total / max(len(candidates), 1)
        snapshot = _ChainSnapshot(chain, credits, bound, mean_in_flight, load, least_wait)
        if self.slot_wait and any(b.slots is not None for b in candidates):
            # Without known slots every wait is 0 and the spill walks the ring as the
            # bound does: neither is worth its work on the request's path.
            snapshot.least_slot_wait = min(_slot_wait_ms(b, self.queue_ms) for b in candidates)
            ctx.spill_at_slots = True
        if self.placement:
            snapshot.placed = self._place(credits, chain, candidates, mean_in_flight, bound,
                                          now, snapshot.least_slot_wait)
        ctx.kv_snapshot = snapshot

    def observe(self, ctx: RequestContext, chosen: Backend | None, score: float,
                tier: str) -> None:
        """The seed scorer's decision counts, and with placement
        ``continuum_kv_index_placements_total``: whether a placed request went to the best
        holder of its first message or elsewhere."""
        super().observe(ctx, chosen, score, tier)
        snapshot = ctx.kv_snapshot
        if (chosen is None or self.metrics is None or not isinstance(snapshot, _ChainSnapshot)
                or snapshot.placed is None):
            return
        credits = snapshot.credits
        best = max(credits.values(), key=lambda c: c.saved_tokens)
        outcome = "holder" if credits.get(chosen.name) is best else "elsewhere"
        self.metrics.child(self.metrics.kv_placements, outcome).inc()

    def score_with_tier(self, backend: Backend, ctx: RequestContext) -> tuple[float, str]:
        """Score and held tier of ``backend`` (0 for non-holders and unqualified holders)."""
        snapshot = ctx.kv_snapshot
        if not isinstance(snapshot, _ChainSnapshot):
            return super().score_with_tier(backend, ctx)
        score, tier, _why = self._verdict(backend, snapshot)
        return score, tier

    def _verdict(self, backend: Backend, snapshot: _ChainSnapshot) -> tuple[float, str, str]:
        """``(score, tier, why)`` of ``backend`` for the request ``snapshot`` was taken for."""
        credit = snapshot.credits.get(backend.name)
        if snapshot.placed is not None:
            return self._placement_verdict(backend, credit, snapshot.placed)
        if credit is None:
            return 0.0, TIER_NONE, "holds no key of this request's chain"
        tier = credit.match.tier
        if credit.overlap < self.min_overlap:
            return 0.0, tier, (f"overlap {credit.overlap:.3f} is below "
                               f"min_overlap_threshold {self.min_overlap}")
        if self.adaptive:
            score, why = self._adaptive(backend, credit, snapshot)
            return score, tier, why
        load = snapshot.load
        if self.guard and load is not None and backend.in_flight >= load.bound:
            return 0.0, tier, f"at the load bound {load.bound}"
        max_in_flight = load.max_in_flight if load is not None else 0
        load_ratio = backend.in_flight / max_in_flight if max_in_flight else 0.0
        score = (self.overlap_weight * credit.overlap
                 + self.load_weight * (1.0 - min(load_ratio, 1.0))
                 + self.health_weight * backend.success_rate)
        return score, tier, "composite of overlap, load and health"

    def _placement_verdict(
        self, backend: Backend, credit: _Credit | None,
        placed: Placed,
    ) -> tuple[float, str, str]:
        chosen, costs = placed
        tier = credit.match.tier if credit is not None else TIER_NONE
        lost_ms, pressure_ms, queue_ms = costs.get(backend.name, _NO_COSTS)
        why = (f"placement (the best match is the first message at most): redoes "
               f"~{lost_ms:.0f} ms of prefill beyond the best holder's, KV pressure "
               f"~{pressure_ms:.0f} ms, queue ~{queue_ms:.0f} ms")
        if backend.name != chosen:
            return 0.0, tier, why + f"; {chosen} costs less"
        score = self.threshold + (1.0 - self.threshold) * backend.success_rate * 0.5
        return score, tier, why + "; the least cost"

    def _adaptive(self, backend: Backend, credit: _Credit,
                  snapshot: _ChainSnapshot) -> tuple[float, str]:
        """The adaptive guard's ``(score, why)`` for holder ``backend``."""
        in_flight = backend.in_flight
        # Each request beyond the candidates' mean costs queue_ms_per_request, so of
        # equal matches the less busy holder wins; at the CHWBL bound, where engines
        # queue, it costs what the backend's latency says one request holds the queue
        # for (latency EWMA / in-flight) when that is more. Fewer than the mean earns
        # nothing: a bonus would move a growing session off the engine holding its
        # history to one holding a little less of it (5 points of hit rate on `agent`).
        extra = max(0.0, in_flight - snapshot.mean_in_flight)
        queue = f"its queue ({extra:.1f} in flight over the mean, load bound {snapshot.bound}"
        if self.slot_wait and backend.slots is not None:
            extra_ms = self._slots_queue_ms(backend, snapshot.mean_in_flight,
                                            snapshot.least_slot_wait)
            if extra_ms > extra * self.queue_ms:  # the wait for a slot sets the price
                queue = (f"its wait for a slot ({backend.in_flight} in flight, "
                         f"{backend.slots} slots) beyond the least-waiting candidate's")
            else:
                queue += ")"
        else:
            extra_ms = self._queue_ms(backend, snapshot.mean_in_flight, snapshot.bound)
            limit = _queue_bound(backend, snapshot.bound)
            queue += f", {limit} slots)" if limit < snapshot.bound else ")"
        if self.learned_wait:
            # An engine batches up to its slots and queues beyond them, wherever the
            # CHWBL bound is: the learned wait here beyond the least-waiting
            # candidate's is what sending the request here costs over the best other.
            wait_ms = (backend.queue_wait() - snapshot.least_wait) * 1000.0
            if wait_ms > extra_ms:
                extra_ms = wait_ms
                queue = (f"its wait for a first token at {backend.in_flight} in flight "
                         f"(learned)")
        saved_ms = credit.saved_tokens * self.prefill_ms_per_token
        if saved_ms <= extra_ms:
            return 0.0, (f"{queue} costs ~{extra_ms:.0f} ms, "
                         f"more than the ~{saved_ms:.0f} ms of prefill it saves")
        full_ms = max(credit.prompt_tokens * self.prefill_ms_per_token, 1e-9)
        net = min(1.0, (saved_ms - extra_ms) / full_ms)
        score = self.threshold + (1.0 - self.threshold) * backend.success_rate * net
        return score, (f"saves ~{saved_ms:.0f} ms of prefill for ~{extra_ms:.0f} "
                       f"ms of extra queue")

    @staticmethod
    def _placement_row(backend: Backend, snapshot: _ChainSnapshot) -> dict[str, Any] | None:
        """``explain``'s placement costs of ``backend`` (None: the request was not placed)."""
        if snapshot.placed is None:
            return None
        chosen, costs = snapshot.placed
        lost_ms, pressure_ms, queue_ms = costs.get(backend.name, _NO_COSTS)
        return {"chosen": backend.name == chosen, "lost_prefill_ms": round(lost_ms, 1),
                "pressure_ms": round(pressure_ms, 1), "queue_ms": round(queue_ms, 1),
                "cost_ms": round(lost_ms + pressure_ms + queue_ms, 1)}

    def explain(self, ctx: RequestContext, candidates: Sequence[Backend]) -> list[dict[str, Any]]:
        """Every candidate's match, queue, verdict and score for ``ctx`` (after ``prepare``);
        the seed scorer's rows for a request without a chain."""
        snapshot = ctx.kv_snapshot
        if not isinstance(snapshot, _ChainSnapshot):
            return super().explain(ctx, candidates)
        chain = snapshot.chain
        rows = []
        for backend in candidates:
            credit = snapshot.credits.get(backend.name)
            score, tier, why = self._verdict(backend, snapshot)
            rows.append({
                "backend": backend.name,
                "matched_depth": credit.depth if credit else 0,
                "chain_depth": len(chain.keys),
                "matched_tokens": credit.tokens if credit else 0,
                "prompt_tokens_estimate": credit.prompt_tokens if credit else None,
                "overlap": round(credit.overlap, 4) if credit else 0.0,
                "approximate": credit.match.approximate if credit else False,
                "seed_key_only": credit is not None and credit.depth == 0,
                "token_count": credit.tokens if credit else 0,
                "tier": tier,
                "in_flight": backend.in_flight,
                "queue_wait_ms": round(backend.queue_wait() * 1000.0, 1),
                "kv_pressure_tokens": round(self.pressure(backend.name)),
                "placement": self._placement_row(backend, snapshot),
                "health": round(backend.success_rate, 4),
                "score": round(score, 4),
                "why": why,
            })
        return rows

