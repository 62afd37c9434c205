"""ChainOverlapScorer: tokens-based overlap, the adaptive guard, approximate weight."""

from __future__ import annotations

from typing import Any

import pytest

from continuum.config import BackendConfig, parse_config
from continuum.interfaces import CACHE_CREATED, TIER_GPU_HOT
from continuum.kv.chain_scorer import ChainOverlapScorer
from continuum.metrics import RouterMetrics
from continuum.prefix import request_prefix_key
from continuum.prefix_chain import request_chain
from continuum.routing.backends import WAIT_SAMPLES, Backend
from continuum.routing.selection import SelectionPipeline
from continuum.testing import make_backends, make_context
from stores.kv_memory import InMemoryKvIndex
from strategies.least_latency import LeastLatency
from strategies.prefix_aware_hash import PrefixAwareHash
from strategies.round_robin import RoundRobin

SYSTEM = "You are the assistant of the harbour office. " * 24  # ~1.1 KB
HISTORY = "A long conversation so far about ships and their cargo. " * 40  # ~2.2 KB


def scorer_for(index: InMemoryKvIndex, **kv: Any) -> ChainOverlapScorer:
    config = parse_config({"kv_cache_index": kv}).kv_cache_index
    return ChainOverlapScorer(index, config, RouterMetrics())


def request(*turns: str) -> Any:
    body = {"model": "m", "messages": [{"role": "system", "content": SYSTEM},
                                       *({"role": "user", "content": t} for t in turns)]}
    ctx = make_context()
    ctx.body = body
    ctx.prefix_key = request_prefix_key(body, "m")
    ctx.chain = request_chain(body, "m")
    return ctx


def hold(index: InMemoryKvIndex, backend: str, ctx: Any, depth: int, **options: Any) -> None:
    chain = ctx.chain
    pairs = zip(chain.keys[:depth], chain.ends[:depth], strict=True)
    index.apply_chain(backend, CACHE_CREATED, [(k, end // 5) for k, end in pairs], **options)


def pick(scorer: ChainOverlapScorer, backends: list[Any], ctx: Any) -> tuple[str, str]:
    """The backend the pipeline picks and who picked it: ``scorer``, or the strategy
    (``scorer_fallback``), as the scorer's decision counters tell."""
    before = scorer.decisions["kv_aware"]
    chosen = SelectionPipeline(RoundRobin(), [scorer]).select(backends, ctx)
    return chosen.name, "scorer" if scorer.decisions["kv_aware"] > before else "scorer_fallback"


def test_overlap_is_matched_tokens_over_the_prompt_not_over_the_best_holder() -> None:
    index = InMemoryKvIndex()
    ctx = request(HISTORY * 2 + "Next?")
    hold(index, "b0", ctx, 1)  # only the first chunk of a ~5.6 KB prompt
    scorer = scorer_for(index)
    backends = make_backends(2)
    scorer.prepare(ctx, backends)
    row = {r["backend"]: r for r in scorer.explain(ctx, backends)}["b0"]
    chain = ctx.chain
    assert row["overlap"] == round(chain.ends[0] / chain.ends[-1], 4) < 0.2
    assert row["matched_depth"] == 1 and row["chain_depth"] == len(chain.keys)
    # the seed scorer would call it a full match (it is the only holder); here it is not
    assert scorer.score_with_tier(backends[0], ctx)[0] == 0.0
    assert pick(scorer, backends, ctx)[1] == "scorer_fallback"


def test_idle_fleet_the_longest_match_wins() -> None:
    index = InMemoryKvIndex()
    ctx = request(HISTORY + "Next?")
    hold(index, "b0", ctx, 2)  # the system prompt
    hold(index, "b1", ctx, len(ctx.chain.keys) - 1)  # the whole conversation
    assert pick(scorer_for(index), make_backends(3), ctx) == ("b1", "scorer")


def test_adaptive_guard_weighs_saved_prefill_against_extra_queue() -> None:
    index = InMemoryKvIndex()
    ctx = request(HISTORY + "Next?")
    depth = len(ctx.chain.keys)
    hold(index, "b1", ctx, depth)
    scorer = scorer_for(index, scoring={"load_guard": {
        "prefill_ms_per_1k_tokens": 100, "queue_ms_per_request": 20}})
    backends = make_backends(3)
    saved_ms = ctx.chain.ends[-1] // 5 * 0.1  # tokens held * 0.1 ms
    # in flight beyond the mean (n - n/3) at 20 ms each: below, then above the saving
    below = int(saved_ms / 20 * 1.5) - 1
    backends[1].in_flight = below
    assert (below - below / 3) * 20 < saved_ms
    assert pick(scorer, backends, ctx) == ("b1", "scorer")
    backends[1].in_flight = below + 3
    ctx2 = request(HISTORY + "Next?")
    assert pick(scorer, backends, ctx2)[1] == "scorer_fallback"
    scorer.prepare(ctx2, backends)
    row = {r["backend"]: r for r in scorer.explain(ctx2, backends)}["b1"]
    assert row["score"] == 0.0 and "more than the" in row["why"]
    # a saturated backend's own latency sets the price of its queue: 2 s over 4 in flight
    backends[1].in_flight = 4
    assert pick(scorer, backends, request(HISTORY + "Next?")) == ("b1", "scorer")
    backends[1].latency_ewma = 2.0
    assert pick(scorer, backends, request(HISTORY + "Next?"))[1] == "scorer_fallback"
    # the old guard stays available: with 2 in flight b1 is under the CHWBL floor of 4
    bound = scorer_for(index, scoring={"load_guard": {"mode": "bound"}})
    backends[1].in_flight = 2
    assert pick(bound, backends, request(HISTORY + "Next?")) == ("b1", "scorer")


def test_a_busier_holder_of_more_beats_an_idle_holder_of_less_until_it_costs_more() -> None:
    index = InMemoryKvIndex()
    ctx = request(HISTORY + "Next?")
    hold(index, "b0", ctx, 2)  # system prompt: ~230 tokens
    hold(index, "b1", ctx, len(ctx.chain.keys))  # everything: ~690 tokens
    scorer = scorer_for(index, scoring={"min_overlap_threshold": 0.0, "load_guard": {
        "prefill_ms_per_1k_tokens": 100, "queue_ms_per_request": 10}})
    backends = make_backends(2)
    backends[1].in_flight = 4  # 2 over the mean: 20 ms of queue for ~46 ms more saved
    assert pick(scorer, backends, ctx) == ("b1", "scorer")
    backends[1].in_flight = 12  # 6 over the mean: 60 ms, the idle holder of the prompt wins
    assert pick(scorer, backends, request(HISTORY + "Next?")) == ("b0", "scorer")


def test_under_the_load_bound_latency_does_not_price_the_queue_and_ties_go_to_the_idler(
) -> None:
    """A lightly loaded fleet (every backend under the CHWBL floor of 4) keeps the longest
    match even when its backend is slow: its latency prices the queue only at the bound.
    Equal matches go to the holder with fewer requests in flight."""
    index = InMemoryKvIndex()
    ctx = request(HISTORY + "Next?")
    depth = len(ctx.chain.keys)
    hold(index, "b1", ctx, depth)
    hold(index, "b2", ctx, depth)
    scorer = scorer_for(index)
    backends = make_backends(3)
    for backend in backends:
        backend.latency_ewma = 2.0  # long answers: 2 s each
    backends[1].in_flight, backends[2].in_flight = 2, 1
    assert pick(scorer, backends, ctx) == ("b2", "scorer")
    backends[1].in_flight, backends[2].in_flight = 1, 2
    assert pick(scorer, backends, request(HISTORY + "Next?")) == ("b1", "scorer")
    # b2 alone holds it, two over the mean but under the bound of 4: still b2
    index = InMemoryKvIndex()
    hold(index, "b2", ctx, depth)
    scorer = scorer_for(index)
    backends[1].in_flight = 0
    assert pick(scorer, backends, request(HISTORY + "Next?")) == ("b2", "scorer")
    # at the bound its 2 s latency over 4 in flight prices the queue far above the saving
    backends[2].in_flight = 4
    assert pick(scorer, backends, request(HISTORY + "Next?"))[1] == "scorer_fallback"


def test_a_holder_at_its_slots_is_priced_at_its_latency_under_the_load_bound() -> None:
    """``backends[].slots``: an engine queues the request beyond its slots however far
    under the CHWBL bound (never under 4) it is, so from its slots on its latency prices
    the queue: its wait for a slot (``slot_wait``, the default), or without it its queue
    beyond the mean. Unset, or above the bound, it changes nothing."""
    index = InMemoryKvIndex()
    ctx = request(HISTORY + "Next?")
    hold(index, "b1", ctx, len(ctx.chain.keys))  # ~690 tokens: ~69 ms of prefill saved

    def fleet(slots: int | None) -> list[Backend]:
        backends = [Backend(BackendConfig(name=f"b{i}", url="http://127.0.0.1:9",
                                          slots=slots)) for i in range(3)]
        for backend in backends:
            backend.latency_ewma = 0.3  # 300 ms answers
        backends[1].in_flight = 2  # full with two slots; the bound is 4
        return backends

    for scorer in (scorer_for(index), scorer_for(index, scoring={"load_guard": {
            "slot_wait": False}})):
        assert pick(scorer, fleet(None), request(HISTORY + "Next?")) == ("b1", "scorer")
        assert pick(scorer, fleet(8), request(HISTORY + "Next?")) == ("b1", "scorer")
        two = fleet(2)
        assert pick(scorer, two, request(HISTORY + "Next?"))[1] == "scorer_fallback"
        two[1].in_flight = 1  # a free slot: 10 ms a request over the mean, as without slots
        assert pick(scorer, two, request(HISTORY + "Next?")) == ("b1", "scorer")
    two = fleet(2)
    for scorer, says in (
            # its wait for one slot: 300 ms / 2 in flight
            (scorer_for(index), "its wait for a slot (2 in flight, 2 slots) beyond the "
             "least-waiting candidate's costs ~150 ms"),
            # 300 ms / 2 in flight, for the 1.33 requests over the mean
            (scorer_for(index, scoring={"load_guard": {"slot_wait": False}}),
             "bound 4, 2 slots) costs ~200 ms")):
        probe = request(HISTORY + "Next?")
        scorer.prepare(probe, two)
        row = {r["backend"]: r for r in scorer.explain(probe, two)}["b1"]
        assert row["score"] == 0.0 and says in row["why"], row


def test_a_holder_merely_full_in_an_idle_fleet_costs_one_slots_wait_not_its_queue() -> None:
    """Four slots, all busy, the rest of the fleet idle: the request waits for one of the
    four to finish (400 ms / 4 = 100 ms), less than the 110-130 ms of prefill the holder
    saves, so it stays, whether it continues a conversation (the guard) or starts one
    (placement). Priced as its queue beyond the candidates' mean at its latency (without
    ``slot_wait``), 2.75 requests cost ~275 ms and sent it away."""
    def fleet() -> list[Backend]:
        backends = [Backend(BackendConfig(name=f"b{i}", url="http://127.0.0.1:9", slots=4))
                    for i in range(4)]
        for backend, in_flight in zip(backends, (1, 4, 0, 0), strict=True):
            backend.latency_ewma = 0.4
            backend.in_flight = in_flight
        return backends

    # a conversation's next turn: b1 holds all of it (~1,100 tokens)
    index = InMemoryKvIndex()
    ctx = request(HISTORY * 2 + "Next?")
    hold(index, "b1", ctx, len(ctx.chain.keys))
    assert pick(scorer_for(index), fleet(), request(HISTORY * 2 + "Next?")) == ("b1", "scorer")
    off = scorer_for(index, scoring={"load_guard": {"slot_wait": False}})
    assert pick(off, fleet(), request(HISTORY * 2 + "Next?"))[1] == "scorer_fallback"

    # a new session: b1 holds its system prompt, which is all it shares with the others
    first = HISTORY * 3  # a long system prompt (~1,320 tokens), its prefill worth the wait
    index = InMemoryKvIndex()

    def new_session() -> Any:
        body = {"model": "m", "messages": [{"role": "system", "content": first},
                                           {"role": "user", "content": "Hello?"}]}
        ctx = make_context()
        ctx.body, ctx.chain = body, request_chain(body, "m")
        ctx.prefix_key = request_prefix_key(body, "m")
        return ctx

    probe = new_session()
    hold(index, "b1", probe, len(probe.chain.keys) - 1)  # the system prompt
    placer = scorer_for(index)
    backends = fleet()
    placer.prepare(probe, backends)
    assert probe.kv_snapshot.placed is not None and probe.kv_snapshot.placed[0] == "b1"
    off = scorer_for(index, scoring={"load_guard": {"slot_wait": False}})
    off.prepare(probe, backends)
    assert probe.kv_snapshot.placed[0] != "b1"


def test_a_new_session_stays_with_a_full_holder_when_every_engine_is_as_busy() -> None:
    """Placement moves a session for good, so it leaves a holder of its prompt only when
    both prices of its queue say so: beside engines as busy as it is (in flight 2 on two
    slots each, one with a slot free), the queue beyond the mean costs ~38 ms, under the
    prefill it saves, though its wait for a slot (150 ms) is more."""
    first = HISTORY * 2
    body = {"model": "m", "messages": [{"role": "system", "content": first},
                                       {"role": "user", "content": "Hello?"}]}
    probe = make_context()
    probe.body, probe.chain = body, request_chain(body, "m")
    probe.prefix_key = request_prefix_key(body, "m")
    index = InMemoryKvIndex()
    hold(index, "b1", probe, len(probe.chain.keys) - 1)
    backends = [Backend(BackendConfig(name=f"b{i}", url="http://127.0.0.1:9", slots=2))
                for i in range(4)]
    for backend, in_flight in zip(backends, (2, 2, 2, 1), strict=True):
        backend.latency_ewma = 0.3
        backend.in_flight = in_flight
    placer = scorer_for(index)
    placer.prepare(probe, backends)
    chosen, costs = probe.kv_snapshot.placed
    assert chosen == "b1", costs
    assert costs["b1"][2] == pytest.approx((2 - 7 / 4) * 150)


def test_slot_wait_turns_down_a_full_holder_and_the_ring_sends_it_to_a_free_slot() -> None:
    """``load_guard.slot_wait``: a holder with 3 in flight on 2 slots makes the request
    wait for two answers' share of its latency (2 x 300 ms / 3), more than the prefill it
    saves, while another backend has a free slot. The guard alone prices only its
    queue beyond the candidates' mean (1/3 x 100 ms) and keeps it there."""
    index = InMemoryKvIndex()
    ctx = request(HISTORY * 2 + "Next?")
    hold(index, "b1", ctx, len(ctx.chain.keys))  # ~1,380 tokens: ~138 ms saved

    def fleet() -> list[Backend]:
        backends = [Backend(BackendConfig(name=f"b{i}", url="http://127.0.0.1:9", slots=2))
                    for i in range(3)]
        for backend, in_flight in zip(backends, (5, 3, 0), strict=True):
            backend.latency_ewma = 0.3
            backend.in_flight = in_flight
        return backends

    off = scorer_for(index, scoring={"load_guard": {"slot_wait": False}})
    assert pick(off, fleet(), request(HISTORY * 2 + "Next?")) == ("b1", "scorer")
    on = scorer_for(index)  # on by default
    backends = fleet()
    probe = request(HISTORY * 2 + "Next?")
    chosen = SelectionPipeline(PrefixAwareHash(parse_config({})), [on]).select(backends, probe)
    assert chosen.name == "b2" and probe.spill_at_slots  # the only free slot
    assert on.decisions["fallback"] == 1
    row = {r["backend"]: r for r in on.explain(probe, backends)}["b1"]
    assert row["score"] == 0.0 and row["why"].startswith(
        "its wait for a slot (3 in flight, 2 slots) beyond the least-waiting candidate's "
        "costs ~200 ms"), row
    backends[1].in_flight = 1  # a free slot: no wait, the match wins
    assert pick(on, backends, request(HISTORY * 2 + "Next?")) == ("b1", "scorer")


def test_a_strategy_that_does_not_spill_itself_is_given_the_backends_with_a_free_slot() -> None:
    """Behind the KV scorer's slot wait, LeastLatency (which knows nothing of slots) is
    offered only the backends with a free slot: not b1, the fastest, which is full. With
    every slot full it chooses among all of them, as without slots."""
    index = InMemoryKvIndex()
    hold(index, "b0", request(HISTORY * 2 + "Next?"), len(request(HISTORY * 2 + "Next?")
                                                           .chain.keys))

    def fleet(free_b3: bool) -> list[Backend]:
        backends = [Backend(BackendConfig(name=f"b{i}", url="http://127.0.0.1:9", slots=2))
                    for i in range(4)]
        loads = (3, 2, 3, 1 if free_b3 else 2)
        for backend, in_flight, latency in zip(backends, loads, (0.3, 0.1, 0.2, 0.5),
                                               strict=True):
            backend.latency_ewma = latency
            backend.in_flight = in_flight
        return backends

    assert not LeastLatency.spills_at_slots and PrefixAwareHash.spills_at_slots
    scorer = scorer_for(index)
    pipeline = SelectionPipeline(LeastLatency(parse_config({})), [scorer])
    ctx = request(HISTORY * 2 + "Next?")
    assert pipeline.decide(fleet(free_b3=True), ctx)[0].name == "b3"
    assert ctx.spill_at_slots and scorer.decisions["fallback"] == 1
    # every slot full: the holder's wait is the least one, so the match wins again
    ctx = request(HISTORY * 2 + "Next?")
    backends = fleet(free_b3=False)
    backends[0].in_flight = 2
    assert pipeline.decide(backends, ctx) == (backends[0], "kv_aware")
    # and the strategy, when it decides with every slot full, sees every candidate
    ctx = request("a question of its own, held nowhere")
    assert pipeline.decide(fleet(free_b3=False), ctx)[0].name == "b1"
    assert ctx.spill_at_slots


def test_approximate_matches_count_less_and_events_confirm_them() -> None:
    index = InMemoryKvIndex()
    ctx = request(HISTORY + "Next?")
    depth = len(ctx.chain.keys)
    hold(index, "b0", ctx, depth, ttl=60)
    hold(index, "b1", ctx, depth)
    scorer = scorer_for(index, approximate={"weight": 0.5})
    backends = make_backends(2)
    scorer.prepare(ctx, backends)
    rows = {r["backend"]: r for r in scorer.explain(ctx, backends)}
    assert rows["b0"]["approximate"] and not rows["b1"]["approximate"]
    assert rows["b0"]["overlap"] == rows["b1"]["overlap"] / 2
    assert rows["b0"]["score"] < rows["b1"]["score"]
    assert rows["b1"]["tier"] == TIER_GPU_HOT


def test_recorded_chains_live_no_longer_than_index_entries() -> None:
    """With ``entry_ttl_seconds`` under the approximate TTL's 60 s and no
    ``approximate.ttl_seconds``, a routed chain is recorded for ``entry_ttl_seconds``."""
    now = [1000.0]
    # the index keeps confirmed entries longer: what expires the record is its own TTL
    index = InMemoryKvIndex(entry_ttl_seconds=600, clock=lambda: now[0])
    scorer = scorer_for(index, entry_ttl_seconds=20)
    ctx = request(HISTORY + "Next?")
    backends = make_backends(2)
    scorer.record_route(ctx, backends[1])
    held = {m.backend for m in index.query_chain(ctx.chain.keys)}
    now[0] += 19
    still = {m.backend for m in index.query_chain(ctx.chain.keys)}
    now[0] += 2
    assert (held, still) == ({"b1"}, {"b1"})
    assert list(index.query_chain(ctx.chain.keys)) == []


def _learn(backends: list[Any], slots: int, per_request: float) -> None:
    """What the forwarder would have taught each backend: first tokens in 10 ms while
    fewer than ``slots`` requests are in flight, ``per_request`` seconds more for each
    request beyond them."""
    for backend in backends:
        for level in range(8):
            for _ in range(WAIT_SAMPLES):
                backend.first_piece(level, 0.01 + max(0, level + 1 - slots) * per_request)


#: The adaptive guard with its learned waits (``learned_wait`` is off by default).
LEARNED = {"load_guard": {"learned_wait": True}}


def learned(index: InMemoryKvIndex) -> ChainOverlapScorer:
    return scorer_for(index, scoring=LEARNED)


def test_learned_wait_turns_down_a_holder_whose_slots_are_full_under_the_load_bound(
) -> None:
    """Engines with two slots queue the third request, far below the CHWBL floor of 4: the
    holder's learned wait for a first token, beyond the least-waiting candidate's, prices
    it, and the strategy takes the request."""
    index = InMemoryKvIndex()
    ctx = request(HISTORY + "Next?")
    hold(index, "b1", ctx, len(ctx.chain.keys))  # ~660 tokens: ~66 ms of prefill
    backends = make_backends(4)
    _learn(backends, 2, 0.1)  # a slot frees every 100 ms once both are taken
    backends[0].in_flight = 2  # full: the next one waits 100 ms
    backends[1].in_flight = 3  # 22 ms over the mean at 10 ms each; a 200 ms wait
    backends[2].in_flight = 1  # a free slot
    scorer = learned(index)
    assert pick(scorer, backends, ctx)[1] == "scorer_fallback"
    ctx = request(HISTORY + "Next?")
    scorer.prepare(ctx, backends)
    rows = {r["backend"]: r for r in scorer.explain(ctx, backends)}
    assert rows["b1"]["queue_wait_ms"] == 200.0 and rows["b0"]["queue_wait_ms"] == 100.0
    assert rows["b2"]["queue_wait_ms"] == 0.0
    assert rows["b1"]["score"] == 0.0 and "first token" in rows["b1"]["why"]
    # without learned waits (the default) the queue under the bound costs 10 ms a
    # request: b1 keeps it
    off = scorer_for(index)
    assert pick(off, backends, request(HISTORY + "Next?")) == ("b1", "scorer")


def test_learned_wait_counts_only_beyond_the_least_waiting_candidate() -> None:
    index = InMemoryKvIndex()
    ctx = request(HISTORY + "Next?")
    hold(index, "b1", ctx, len(ctx.chain.keys))
    backends = make_backends(3)
    _learn(backends, 2, 0.1)
    # every engine is as full: going elsewhere waits as long, the match still saves
    for backend in backends:
        backend.in_flight = 3
    assert pick(learned(index), backends, ctx) == ("b1", "scorer")
    # a free slot elsewhere: the holder's queue costs 200 ms over it
    backends[0].in_flight = 1
    assert pick(learned(index), backends, request(HISTORY + "Next?"))[1] == \
        "scorer_fallback"
    # faster slots: 50 ms beyond a free one is less than the ~66 ms saved, 100 ms more
    quick = make_backends(3)
    _learn(quick, 2, 0.05)
    quick[1].in_flight = 2
    assert pick(learned(index), quick, request(HISTORY + "Next?")) == ("b1", "scorer")
    quick[1].in_flight = 3
    assert pick(learned(index), quick, request(HISTORY + "Next?"))[1] == "scorer_fallback"
    # of two holders, the one whose wait costs less than its match saves wins
    hold(index, "b2", ctx, len(ctx.chain.keys))
    backends[2].in_flight = 1
    assert pick(learned(index), backends, request(HISTORY + "Next?")) == ("b2", "scorer")


def test_learned_wait_leaves_a_holder_under_its_slots_alone_however_long_its_answers(
) -> None:
    """A growing session stays on the engine holding its history while that engine's
    first tokens come as fast as at its least busy, however long its answers take (which
    pricing latency would not do)."""
    index = InMemoryKvIndex()
    ctx = request(HISTORY + "Next?")
    hold(index, "b1", ctx, len(ctx.chain.keys))
    backends = make_backends(4)
    _learn(backends, 4, 1.0)
    for backend in backends:
        backend.latency_ewma = 5.0
    backends[1].in_flight = 3  # the fourth slot is free
    assert pick(learned(index), backends, ctx) == ("b1", "scorer")
    # nothing learned yet: no wait priced
    backends = make_backends(4)
    backends[1].in_flight = 3
    assert pick(learned(index), backends, request(HISTORY + "Next?")) == ("b1", "scorer")
