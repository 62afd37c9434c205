"""tools.bench.ab: two router trees measured taking turns; the summary is each one's
median and best of every metric."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from tools.bench import ab

ROOT = Path(__file__).resolve().parents[2]


def test_summary_takes_the_median_and_the_best_of_each_metric() -> None:
    rounds = [{"A": {"added_p50_c1_ms": a, "cpu_c1_ms": 0.5, "cpu_c32_ms": c},
               "B": {"added_p50_c1_ms": a - 0.1, "cpu_c1_ms": 0.4, "cpu_c32_ms": c - 0.05}}
              for a, c in ((0.55, 0.48), (0.60, 0.45), (0.50, 0.47))]
    summary = ab.summarize(rounds)
    assert summary["A"] == {"added_p50_c1_ms": (0.55, 0.5), "cpu_c1_ms": (0.5, 0.5),
                            "cpu_c32_ms": (0.47, 0.45)}
    assert summary["B"]["added_p50_c1_ms"] == (0.45, 0.4)
    assert summary["B"]["cpu_c32_ms"] == (0.42, 0.4)


def test_a_short_run_of_one_tree_against_itself(capsys: pytest.CaptureFixture[str]) -> None:
    """The whole tool, small: two real routers of this tree, one round."""
    assert ab.main([str(ROOT), str(ROOT), "--rounds", "1", "--requests-c1", "50",
                    "--requests-c32", "200"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("round 0: A added_p50_c1_ms=")
    rows = [line for line in out.splitlines() if line.startswith(("A ", "B "))]
    assert len(rows) == 2 and all("cpu_c32_ms" in row for row in rows)
    for row in rows:  # every figure was measured (a router's CPU is more than nothing)
        figures = dict(re.findall(r"(\w+_ms) (-?[\d.]+) \(", row))
        assert set(figures) == set(ab.METRICS), row
        assert float(figures["cpu_c1_ms"]) > 0 and float(figures["cpu_c32_ms"]) > 0, row


def test_rounds_must_be_positive() -> None:
    with pytest.raises(SystemExit):
        ab.main([str(ROOT), str(ROOT), "--rounds", "0"])
