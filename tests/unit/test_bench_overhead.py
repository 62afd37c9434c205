"""tools.bench.overhead: the PrefixAwareHash - RoundRobin goal from paired runs, and from
the two configurations when no pair ran."""

from __future__ import annotations

from tools.bench.overhead import GOAL_PAH_EXTRA_US, Phase, paired_differences, suite_goals


def _phase(config: str, conc: int, cpu: float | None) -> Phase:
    return Phase(mode="router", stream=False, concurrency=conc, config=config,
                 router_cpu_ms_per_req=cpu)


def test_pairs_give_each_difference_and_the_goal_their_median() -> None:
    phases = [_phase("pair0-rr", 32, 0.250), _phase("pair0-pah", 32, 0.262),
              _phase("pair1-pah", 32, 0.240), _phase("pair1-rr", 32, 0.245),
              _phase("pair2-rr", 32, 0.300), _phase("pair2-pah", 32, 0.330),
              _phase("pair0-rr", 1, 0.350), _phase("pair0-pah", 1, None),  # no CPU figure
              _phase("pair1-rr", 1, 0.340), _phase("pair1-pah", 1, 0.349),
              _phase("rr", 32, 0.100), _phase("pah", 32, 0.900)]  # not pairs: ignored
    diffs = paired_differences(phases)
    assert {c: [round(d, 3) for d in v] for c, v in diffs.items()} == \
        {32: [12.0, -5.0, 30.0], 1: [9.0]}
    goals = {g["goal"].split(",")[1].strip(): g for g in suite_goals(phases)
             if g["goal"].startswith("PrefixAwareHash - RoundRobin")}
    c32, c1 = goals["non-streaming c=32"], goals["non-streaming c=1"]
    assert GOAL_PAH_EXTRA_US == 10.0
    assert round(c32["value"], 3) == 12.0 and not c32["met"]
    assert round(c1["value"], 3) == 9.0 and c1["met"]


def test_without_pairs_the_goal_compares_the_two_configurations() -> None:
    goals = suite_goals([_phase("rr", 32, 0.250), _phase("pah", 32, 0.275)])
    extra = [g for g in goals if g["goal"].startswith("PrefixAwareHash - RoundRobin")]
    assert len(extra) == 1 and round(extra[0]["value"], 3) == 25.0 and not extra[0]["met"]
