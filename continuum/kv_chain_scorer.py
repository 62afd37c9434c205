"""Tier 4 with ``kv_cache_index.match: chain``: score backends by how far their cache goes
into the request's chain of prefix keys (:mod:`continuum.prefix_chain`).

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
  more than the queue it has beyond the least busy candidate::

      saved = matched tokens * tier weight * approximate weight * prefill_ms_per_1k_tokens / 1000
      extra = (in_flight - least in_flight among the candidates) * queue_ms_per_request

  A qualified holder scores ``threshold + (1 - threshold) * health * net`` where ``net`` =
  (saved - extra) ÷ the prefill of the whole prompt: holders are ranked by what they save
  net of their queue, and the pipeline's threshold is passed exactly when ``saved > extra``.
  An idle fleet has no extra queue anywhere, so the longest match always wins; under load
  a hot prefix's holder stops qualifying once its queue costs more than the prefill it
  saves, and the configured strategy (bounded-load hashing) takes the request.
* ``bound``: the seed's composite score (overlap, load, health weights) on the overlap
  above, and a holder qualifies only under the CHWBL bound, as with ``match: seed``.
* ``enabled: false``: the composite score alone.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, ClassVar

from continuum.errors import StoreError
from continuum.interfaces import TIER_NONE, ChainMatch, KvCacheIndex
from continuum.kv_scorer import SNAPSHOT_TTL, KvOverlapScorer, _Snapshot, log
from continuum.prefix_chain import BYTES_PER_TOKEN, PrefixChain
from continuum.selection import SCORER_THRESHOLD

if TYPE_CHECKING:
    from continuum.backends import Backend
    from continuum.config import KvCacheIndexConfig
    from continuum.metrics import RouterMetrics
    from continuum.request import RequestContext

_MAX_SNAPSHOTS = 4096


class _Credit:
    """What one backend's match is worth for one request (computed once per request)."""

    __slots__ = ("depth", "match", "overlap", "prompt_tokens", "saved_tokens", "tokens")

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
        self.tokens = tokens
        self.prompt_tokens = max(tokens, round(tokens * covered / max(matched_bytes, 1)))
        self.overlap = min(1.0, matched_bytes / covered) * weight
        self.saved_tokens = tokens * weight


class ChainOverlapScorer(KvOverlapScorer):
    """Scores backends by their longest match of the request's chain (module docstring)."""

    name: ClassVar[str] = "ChainOverlapScorer"

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
        self.approximate_weight = kv.approximate.weight
        self.threshold = threshold
        self._matches: dict[str, tuple[float, Sequence[ChainMatch]]] = {}

    def prepare(self, ctx: RequestContext, candidates: Sequence[Backend]) -> None:
        """Query the index for the request's chain (cached 100 ms per chain) and work out
        each holder's credit; the queue is read live when scoring."""
        chain: PrefixChain | None = ctx.state.get("chain")
        if chain is None or not chain.keys:
            return
        now = self.clock()
        tip = chain.keys[-1]
        cached = self._matches.get(tip)
        if cached is not None and now - cached[0] < SNAPSHOT_TTL:
            matches = cached[1]
        else:
            started = time.perf_counter()
            try:
                matches = self.index.query_chain(chain.keys, ctx.prefix_hash)
            except StoreError as exc:
                log.debug("KV index chain query failed (%s); scoring as empty", exc.kind)
                self.query_errors += 1
                matches = ()
            self.query_count += 1
            if self.metrics is not None:
                self.metrics.kv_query_latency.observe(time.perf_counter() - started)
            if len(self._matches) >= _MAX_SNAPSHOTS:
                self._matches.clear()
            self._matches[tip] = (now, matches)
        credits = {}
        for match in matches:
            weight = self.tier_weights.get(match.tier, 0.0)
            if match.approximate:
                weight *= self.approximate_weight
            credits[match.backend] = _Credit(match, chain, weight)
        ctx.state["kv_credits"] = credits
        ctx.state["kv_mean_in_flight"] = (sum(b.in_flight for b in candidates)
                                          / max(len(candidates), 1))
        if not self.adaptive:  # the composite score and the CHWBL bound read the load
            ctx.state["kv_snapshot"] = _Snapshot((), candidates, now, self.guard_epsilon,
                                                 self.guard_floor)

    def score_with_tier(self, backend: Backend, ctx: RequestContext) -> tuple[float, str]:
        """Score and held tier of ``backend`` (0 for non-holders and unqualified holders)."""
        score, tier, _why = self._verdict(backend, ctx)
        return score, tier

    def _verdict(self, backend: Backend, ctx: RequestContext) -> tuple[float, str, str]:
        """``(score, tier, why)`` of ``backend`` for ``ctx``."""
        credits: dict[str, _Credit] | None = ctx.state.get("kv_credits")
        credit = credits.get(backend.name) if credits else None
        if credit is None:
            return 0.0, TIER_NONE, "holds no key of this request's chain"
        tier = credit.match.tier
        if credit.overlap < self.min_overlap:
            return 0.0, tier, (f"overlap {credit.overlap:.3f} is below "
                               f"min_overlap_threshold {self.min_overlap}")
        if self.adaptive:
            in_flight = backend.in_flight
            extra = max(0.0, in_flight - ctx.state.get("kv_mean_in_flight", 0.0))
            per_request = self.queue_ms
            if backend.latency_ewma is not None:
                per_request = max(per_request, backend.latency_ewma * 1000.0 / max(in_flight, 1))
            extra_ms = extra * per_request
            saved_ms = credit.saved_tokens * self.prefill_ms_per_token
            if saved_ms <= extra_ms:
                return 0.0, tier, (f"its queue ({extra:.1f} in flight over the mean) costs "
                                   f"~{extra_ms:.0f} ms, more than the ~{saved_ms:.0f} ms of "
                                   "prefill it saves")
            full_ms = max(credit.prompt_tokens * self.prefill_ms_per_token, 1e-9)
            net = min(1.0, (saved_ms - extra_ms) / full_ms)
            score = self.threshold + (1.0 - self.threshold) * backend.success_rate * net
            return score, tier, (f"saves ~{saved_ms:.0f} ms of prefill for ~{extra_ms:.0f} "
                                 f"ms of extra queue")
        snapshot = ctx.state.get("kv_snapshot")
        if self.guard and snapshot is not None and backend.in_flight >= snapshot.bound:
            return 0.0, tier, f"at the load bound {snapshot.bound}"
        max_in_flight = snapshot.max_in_flight if snapshot is not None else 0
        load_ratio = backend.in_flight / max_in_flight if max_in_flight else 0.0
        score = (self.overlap_weight * credit.overlap
                 + self.load_weight * (1.0 - min(load_ratio, 1.0))
                 + self.health_weight * backend.success_rate)
        return score, tier, "composite of overlap, load and health"

    def explain(self, ctx: RequestContext, candidates: Sequence[Backend]) -> list[dict[str, Any]]:
        """Every candidate's match, queue, verdict and score for ``ctx`` (after ``prepare``)."""
        chain: PrefixChain | None = ctx.state.get("chain")
        credits: dict[str, _Credit] = ctx.state.get("kv_credits") or {}
        rows = []
        for backend in candidates:
            credit = credits.get(backend.name)
            score, tier, why = self._verdict(backend, ctx)
            rows.append({
                "backend": backend.name,
                "matched_depth": credit.depth if credit else 0,
                "chain_depth": len(chain.keys) if chain else 0,
                "matched_tokens": credit.tokens if credit else 0,
                "prompt_tokens_estimate": credit.prompt_tokens if credit else None,
                "overlap": round(credit.overlap, 4) if credit else 0.0,
                "approximate": credit.match.approximate if credit else False,
                "seed_key_only": credit is not None and credit.depth == 0,
                "token_count": credit.tokens if credit else 0,
                "tier": tier,
                "in_flight": backend.in_flight,
                "health": round(backend.success_rate, 4),
                "score": round(score, 4),
                "why": why,
            })
        return rows

