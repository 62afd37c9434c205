"""Placement (``kv_cache_index.placement``): a request whose best match is its first
message at most goes where lost prefill + KV pressure + queue cost least."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import Any

from continuum.config import parse_config
from continuum.hostshm import HostSegment
from continuum.kv.chain_scorer import ChainOverlapScorer
from continuum.metrics import RouterMetrics
from continuum.prefix_chain import BYTES_PER_TOKEN
from continuum.testing import make_backends
from stores.kv_memory import InMemoryKvIndex
from tests.unit.test_kv_chain_scorer import HISTORY, hold, pick, request


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def placing(index: InMemoryKvIndex, clock: Clock | None = None, **kv: Any
            ) -> ChainOverlapScorer:
    config = parse_config({"kv_cache_index": kv}).kv_cache_index
    return ChainOverlapScorer(index, config, RouterMetrics(), clock=clock or Clock())


def placements(scorer: ChainOverlapScorer) -> dict[str, float]:
    """``continuum_kv_index_placements_total`` by outcome."""
    assert scorer.metrics is not None
    registry = scorer.metrics.registry
    return {outcome: registry.get_sample_value("continuum_kv_index_placements_total",
                                               {"outcome": outcome}) or 0.0
            for outcome in ("holder", "elsewhere")}


def first_turn(task: str = "Task: find the cargo manifest.") -> Any:
    """A new session: the shared system prompt and a short task (the system prompt is most
    of the prompt, so its holder's overlap is high)."""
    return request(task)


def fill(scorer: ChainOverlapScorer, backend: Any, tokens: int) -> None:
    """Route to ``backend`` a request that makes it store about ``tokens`` new tokens."""
    ctx = request(("Tool output: " + "x" * 60 + ". ") * (tokens * BYTES_PER_TOKEN // 75))
    scorer.record_route(ctx, backend)


def test_with_no_pressure_a_new_session_goes_to_its_system_prompts_holder() -> None:
    index = InMemoryKvIndex()
    ctx = first_turn()
    hold(index, "b2", ctx, 1)
    scorer = placing(index)
    assert pick(scorer, make_backends(4), ctx) == ("b2", "scorer")
    scorer.prepare(ctx, make_backends(4))
    rows = {r["backend"]: r for r in scorer.explain(ctx, make_backends(4))}
    assert rows["b2"]["placement"]["chosen"] and rows["b2"]["placement"]["cost_ms"] == 0.0
    # the others would redo the system prompt's prefill
    assert rows["b0"]["placement"]["lost_prefill_ms"] > 0 and not rows["b0"]["placement"][
        "chosen"]
    assert "placement" in rows["b0"]["why"] and "b2 costs less" in rows["b0"]["why"]
    # one pipeline pass counted (explain's own prepare is not)
    assert placements(scorer) == {"holder": 1.0, "elsewhere": 0.0}


def test_a_new_session_leaves_a_holder_whose_cache_is_filling_faster_than_it_saves() -> None:
    index = InMemoryKvIndex()
    backends = make_backends(3)
    ctx = first_turn()
    hold(index, "b0", ctx, 1)
    scorer = placing(index, placement={"weight": 0.1})
    saved_tokens = ctx.chain.anchor_end // 5  # hold() counts 5 bytes a token
    # pressure below saved / weight: the holder keeps the new session
    fill(scorer, backends[0], int(saved_tokens / 0.1 * 0.5))
    assert pick(scorer, backends, first_turn()) == ("b0", "scorer")
    # twice as much beyond the others: the least-filled candidate takes it
    fill(scorer, backends[0], int(saved_tokens / 0.1 * 1.5))
    fill(scorer, backends[2], 50)
    ctx = first_turn()
    assert pick(scorer, backends, ctx) == ("b1", "scorer")
    scorer.prepare(ctx, backends)
    rows = {r["backend"]: r for r in scorer.explain(ctx, backends)}
    assert rows["b1"]["placement"]["chosen"]
    assert rows["b0"]["placement"]["pressure_ms"] > rows["b1"]["placement"][
        "lost_prefill_ms"]
    assert rows["b0"]["kv_pressure_tokens"] > rows["b2"]["kv_pressure_tokens"] > 0
    assert placements(scorer) == {"holder": 1.0, "elsewhere": 1.0}


def test_pressure_is_what_a_backend_was_sent_beyond_its_match_and_decays() -> None:
    index = InMemoryKvIndex()
    clock = Clock()
    backends = make_backends(2)
    scorer = placing(index, clock, placement={"window_seconds": 10.0})
    ctx = request(HISTORY + "Next?")
    scorer.prepare(ctx, backends)  # nothing held: the whole prompt is new
    scorer.record_route(ctx, backends[0])
    whole = ctx.chain.total_bytes // BYTES_PER_TOKEN
    assert scorer.pressure("b0") == whole and scorer.pressure("b1") == 0.0
    # the same conversation again: b0 holds it (the record above), only the tail is new
    again = request(HISTORY + "Next?")
    scorer.prepare(again, backends)
    scorer.record_route(again, backends[0])
    tail = (again.chain.total_bytes - again.chain.ends[-1]) // BYTES_PER_TOKEN
    assert scorer.pressure("b0") == whole + tail
    clock.now += 10.0  # one time constant: 1/e of it is left
    assert abs(scorer.pressure("b0") - (whole + tail) / 2.718281828459045) < 1.0


def test_a_match_beyond_the_first_message_is_never_placed() -> None:
    """A session's later turn stays with the backend holding its history, however full
    that backend's cache is filling."""
    index = InMemoryKvIndex()
    backends = make_backends(3)
    ctx = request(HISTORY + "Next?")
    hold(index, "b0", ctx, len(ctx.chain.keys))
    scorer = placing(index)
    fill(scorer, backends[0], 100_000)
    assert pick(scorer, backends, ctx) == ("b0", "scorer")
    scorer.prepare(ctx, backends)
    assert all(r["placement"] is None for r in scorer.explain(ctx, backends))


def test_a_small_first_message_match_is_left_to_the_strategy() -> None:
    """A short system prompt in front of a long new document: its holder's overlap is below
    min_overlap_threshold, so the strategy spreads the document as before."""
    index = InMemoryKvIndex()
    ctx = request(HISTORY * 3 + "What does it say?")
    hold(index, "b0", ctx, 1)
    scorer = placing(index)
    assert pick(scorer, make_backends(3), ctx)[1] == "scorer_fallback"


def test_placement_off_keeps_the_holder_however_full() -> None:
    index = InMemoryKvIndex()
    backends = make_backends(3)
    ctx = first_turn()
    hold(index, "b0", ctx, 1)
    scorer = placing(index, placement={"enabled": False})
    fill(scorer, backends[0], 100_000)
    assert scorer.pressure("b0") == 0.0  # not even tracked
    assert pick(scorer, backends, ctx) == ("b0", "scorer")
    on = placing(index)
    fill(on, backends[0], 100_000)
    assert pick(on, backends, first_turn())[0] != "b0"


def test_the_queue_counts_in_a_placement() -> None:
    index = InMemoryKvIndex()
    backends = make_backends(3)
    ctx = first_turn()
    for name in ("b0", "b1"):
        hold(index, name, ctx, 1)
    scorer = placing(index)
    backends[0].in_flight = 3
    assert pick(scorer, backends, ctx) == ("b1", "scorer")


def test_the_workers_of_a_host_share_their_pressure_through_the_host_segment(
    tmp_path: Path,
) -> None:
    """Worker one filled b0; worker two, which sent b0 nothing, places away from it too.
    Each worker's part decays on its own clock reading; a dead worker's part is swept."""
    index = InMemoryKvIndex()
    clock = Clock()
    one, two = HostSegment(tmp_path), HostSegment(tmp_path, pid=1)
    first, second = placing(index, clock), placing(index, clock)
    first.share_pressure(one)
    second.share_pressure(two)
    backends = make_backends(3)
    ctx = first_turn()
    hold(index, "b0", ctx, 1)
    saved_tokens = ctx.chain.anchor_end // 5
    fill(first, backends[0], int(saved_tokens / 0.1 * 2))
    assert second.pressure("b0") == first.pressure("b0") > saved_tokens / 0.1
    assert pick(second, backends, first_turn())[0] != "b0"
    fill(second, backends[1], 1000)
    both = first.pressure("b1")
    assert both == second.pressure("b1") and both >= 1000
    clock.now += 8.0  # one time constant
    assert abs(first.pressure("b0") - second._own_pressure("b0", clock.now)
               - first._own_pressure("b0", clock.now)) < 1e-6
    assert second._own_pressure("b0", clock.now) == 0.0  # it never sent b0 anything
    # a worker that dies leaves no pressure behind once swept
    exited = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"],
                            capture_output=True, text=True, check=True)
    dead = HostSegment(tmp_path, pid=int(exited.stdout))
    dead.set_pressure(dead.column("b2"), 5000.0, clock.now)
    assert first.pressure("b2") == 5000.0
    assert one.sweep() == 1
    assert first.pressure("b2") == 0.0
    for segment in (one, two):
        segment.release()
        segment.close()


def test_sharing_starts_from_what_the_worker_already_sent(tmp_path: Path) -> None:
    clock = Clock()
    scorer = placing(InMemoryKvIndex(), clock)
    fill(scorer, make_backends(1)[0], 500)
    own = scorer.pressure("b0")
    segment = HostSegment(tmp_path)
    scorer.share_pressure(segment)
    assert scorer.pressure("b0") == own > 0
    segment.release()
    segment.close()


def test_a_holder_at_the_load_bound_prices_its_queue_at_its_latency() -> None:
    """The holder of a hot system prompt keeps new sessions while it is under the CHWBL
    bound (each request beyond the mean at queue_ms_per_request); at the bound its latency
    prices its queue, and the next new session goes elsewhere for one prefill of the
    prompt: its later turns would queue behind the holder."""
    index = InMemoryKvIndex()
    backends = make_backends(3)
    ctx = first_turn()
    hold(index, "b0", ctx, 1)
    scorer = placing(index)
    backends[0].in_flight = 2  # under the bound (the floor, 4)
    backends[0].record(True, 0.9)  # 900 ms a request at two in flight: 450 ms each
    assert pick(scorer, backends, ctx) == ("b0", "scorer")
    scorer.prepare(ctx, backends)
    rows = {r["backend"]: r["placement"] for r in scorer.explain(ctx, backends)}
    assert rows["b0"]["queue_ms"] == round((2 - 2 / 3) * 10.0, 1)
    backends[0].in_flight = 4  # at the bound: 225 ms a request
    ctx = first_turn()
    assert pick(scorer, backends, ctx)[0] in ("b1", "b2")
    scorer.prepare(ctx, backends)
    rows = {r["backend"]: r["placement"] for r in scorer.explain(ctx, backends)}
    assert rows["b0"]["queue_ms"] == round((4 - 4 / 3) * 225.0, 1)
    assert rows["b1"]["queue_ms"] == 0.0
    assert 0 < rows["b1"]["lost_prefill_ms"] < rows["b0"]["queue_ms"]
    # the same latency with the holder at the mean costs nothing: it keeps the session
    backends[1].in_flight = backends[2].in_flight = 4
    assert pick(scorer, backends, first_turn()) == ("b0", "scorer")


def test_a_session_that_leaves_its_holder_goes_to_the_least_busy_backend() -> None:
    """Whether a new session leaves a busy holder is priced against the mean; where it goes
    is priced against the least busy candidate, since its later turns follow it: of
    backends all under the mean, the idlest, not merely the first."""
    index = InMemoryKvIndex()
    backends = make_backends(4)
    ctx = first_turn()
    hold(index, "b0", ctx, 1)
    scorer = placing(index)
    for backend, in_flight in zip(backends, (4, 1, 0, 1), strict=True):
        backend.in_flight = in_flight
    backends[0].record(True, 0.9)  # 900 ms at four in flight: 225 ms a request
    assert pick(scorer, backends, ctx) == ("b2", "scorer")
    scorer.prepare(ctx, backends)
    rows = {r["backend"]: r["placement"] for r in scorer.explain(ctx, backends)}
    assert rows["b0"]["queue_ms"] == round((4 - 1.5) * 225.0, 1)  # against the mean
    # against the idlest: one request beyond it at queue_ms_per_request (no latency known)
    assert rows["b1"]["queue_ms"] == rows["b3"]["queue_ms"] == 10.0
    assert rows["b2"]["queue_ms"] == 0.0 and rows["b2"]["chosen"]
    assert rows["b1"]["lost_prefill_ms"] == rows["b2"]["lost_prefill_ms"] > 0
    # a holder no busier than the mean keeps its new session, however idle another is
    for backend, in_flight in zip(backends, (1, 2, 0, 3), strict=True):
        backend.in_flight = in_flight
    assert pick(scorer, backends, first_turn()) == ("b0", "scorer")


def test_a_backend_holding_most_of_the_prompt_counts_as_its_holder() -> None:
    """Placement's second step (the queues against the least busy candidate) is for a
    session that redoes its prompt wherever it goes. A backend holding most of the first
    message loses little, so staying with it is the first step's choice, however busy the
    least busy candidate makes it look."""
    index = InMemoryKvIndex()
    backends = make_backends(3)
    ctx = first_turn()
    anchored = [end for end in ctx.chain.ends if end <= ctx.chain.anchor_end]
    assert len(anchored) >= 2  # the system prompt spans more than one key
    hold(index, "b0", ctx, len(anchored))  # all of it
    hold(index, "b1", ctx, len(anchored) - 1)  # most of it
    scorer = placing(index)
    for backend, in_flight in zip(backends, (4, 1, 0), strict=True):
        backend.in_flight = in_flight
    backends[0].record(True, 0.9)
    backends[1].record(True, 0.5)  # priced against the idlest, b1 would cost 500 ms
    assert pick(scorer, backends, ctx) == ("b1", "scorer")
    scorer.prepare(ctx, backends)
    rows = {r["backend"]: r["placement"] for r in scorer.explain(ctx, backends)}
    assert 0 < rows["b1"]["lost_prefill_ms"] < rows["b2"]["lost_prefill_ms"] / 2
    assert rows["b1"]["queue_ms"] == 0.0  # under the mean, as the first step prices it
