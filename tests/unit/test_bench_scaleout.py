"""tools.bench.scaleout: the row-by-row comparison against issue 16's acceptance."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tools.bench import scaleout


def _row(name: str, hits: list[float], p99s: list[float], cache: list[float | None],
         errors: int = 0, direct: bool = False) -> dict:
    rounds = [{"name": name, "prefix_hit_rate": h, "ttft_ms_p99": p, "errors": errors,
               "engine_requests": [3, 1], "scale_out": {"response_cache_hit_rate": c}}
              for h, p, c in zip(hits, p99s, cache, strict=True)]
    # as the demo's median row: top-level medians, the nested dict from round one
    return {**rounds[0], "direct": direct, "rounds": rounds if len(rounds) > 1 else None}


def _doc(*rows: dict) -> dict:
    return {"scenarios": list(rows)}


def test_medians_over_rounds_include_the_nested_cache_rate() -> None:
    numbers = scaleout.row_numbers(_row("KV", [0.8, 0.9, 0.7], [100, 300, 200],
                                        [0.1, 0.3, 0.2]))
    assert numbers["prefix_hit"] == 0.8
    assert numbers["p99"] == 200
    assert numbers["cache_hit"] == 0.2  # not round one's 0.1


def test_each_acceptance_bound_is_checked() -> None:
    single = _doc(_row("single engine", [0.9], [100], [None], direct=True),
                  _row("ok", [0.80], [100], [0.10]),
                  _row("low hit", [0.80], [100], [None]),
                  _row("slow", [0.80], [100], [None]),
                  _row("cache", [0.80], [100], [0.10]))
    scaled = _doc(_row("single engine", [0.1], [900], [None], direct=True),
                  _row("ok", [0.77], [119], [0.10]),
                  _row("low hit", [0.75], [100], [None]),
                  _row("slow", [0.80], [121], [None]),
                  _row("cache", [0.80], [100], [0.09]))
    rows = {r["row"]: r for r in scaleout.compare(single, scaled)}
    assert "single engine" not in rows  # no router to compare
    assert all(rows["ok"]["checks"].values())
    assert not rows["low hit"]["checks"]["prefix hit"]
    assert not rows["slow"]["checks"]["p99 TTFT"]
    assert rows["slow"]["checks"]["prefix hit"]
    assert not rows["cache"]["checks"]["resp-cache hit"]
    assert "resp-cache hit" not in rows["low hit"]["checks"]


def test_zero_rates_compare_equal_and_errors_fail() -> None:
    single = _doc(_row("r", [0.0], [100], [0.0]))
    scaled = _doc(_row("r", [0.0], [100], [0.0], errors=2))
    (row,) = scaleout.compare(single, scaled)
    assert row["checks"]["prefix hit"] and row["checks"]["resp-cache hit"]
    assert not row["checks"]["errors"]


def test_compare_only_reads_the_json_and_check_sets_the_exit_code(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    (tmp_path / "rag-1x1.json").write_text(json.dumps(_doc(_row("KV", [0.8], [100], [None]))))
    (tmp_path / "rag-4x2.json").write_text(json.dumps(_doc(_row("KV", [0.7], [100], [None]))))
    argv = ["--scenario", "rag", "--out", str(tmp_path), "--compare-only"]
    assert scaleout.main(argv) == 0
    assert scaleout.main([*argv, "--check"]) == 1
    out = capsys.readouterr().out
    assert "MISSED: prefix hit" in out and "rag KV" in out


def test_the_redis_baseline_is_its_own_file(tmp_path: Path,
                                            capsys: pytest.CaptureFixture[str]) -> None:
    (tmp_path / "rag-1x1.json").write_text(json.dumps(_doc(_row("KV", [0.9], [100], [None]))))
    (tmp_path / "rag-1x1-redis.json").write_text(
        json.dumps(_doc(_row("KV", [0.7], [300], [None]))))
    (tmp_path / "rag-4x2.json").write_text(json.dumps(_doc(_row("KV", [0.7], [300], [None]))))
    argv = ["--scenario", "rag", "--out", str(tmp_path), "--compare-only", "--check"]
    assert scaleout.main(argv) == 1  # against the memory baseline
    assert scaleout.main([*argv, "--redis-baseline"]) == 0
    assert "1x1-redis / 4x2" in capsys.readouterr().out


def test_rows_reach_the_demo_as_its_strategies() -> None:
    from continuum.devtools.demo import build_parser

    cmd = scaleout.demo_command("rag", 4, 2, 5, False, rows=["KV index (seed key)"])
    args = build_parser().parse_args(cmd[4:])  # after "python -m continuum.cli demo"
    assert (args.scenario, args.workers, args.routers, args.rounds) == ("rag", 4, 2, 5)
    assert args.strategies == ["KV index (seed key)"]
    assert not args.redis and not args.quick and args.sets == []
    pushed = scaleout.demo_command("rag", 4, 2, 1, False, sets=["fleet.fleet_load_push_ms=5"])
    assert build_parser().parse_args(pushed[4:]).sets == ["fleet.fleet_load_push_ms=5"]
    every_row = build_parser().parse_args(scaleout.demo_command("agent", 1, 1, 3, True,
                                                                redis=True)[4:])
    assert every_row.strategies is None and every_row.redis and every_row.quick


def test_interleaved_rounds_take_turns_and_merge_like_demo_rounds(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """``--interleave``: one round of each shape in turn; each shape's rounds become one
    document whose rows carry every round, so the medians are over all of them."""
    calls: list[tuple[int, int, bool, int, str]] = []
    p99s = iter([100, 300, 200, 500, 150, 400])  # 1x1, 4x2, 1x1, 4x2, ...

    sets_seen: list[tuple[str, ...]] = []

    def fake_run(scenario: str, workers: int, routers: int, rounds: int, quick: bool,
                 out: Path, redis: bool = False, rows: tuple[str, ...] = (),
                 suffix: str = "", sets: tuple[str, ...] = ()) -> Path:
        calls.append((workers, routers, redis, rounds, suffix))
        sets_seen.append(tuple(sets))
        path = scaleout.result_path(out, scenario,
                                    scaleout.shape_name(workers, routers, redis) + suffix)
        path.write_text(json.dumps(_doc(_row("KV", [0.8], [next(p99s)], [None]))))
        return path

    monkeypatch.setattr(scaleout, "run_demo", fake_run)
    assert scaleout.main(["--scenario", "rag", "--rounds", "3", "--interleave",
                          "--out", str(tmp_path), "--json",
                          "--set", "fleet.fleet_load_push_ms=5"]) == 0
    assert sets_seen == [("fleet.fleet_load_push_ms=5",)] * 6  # both shapes, every round
    assert calls == [(1, 1, False, 1, "-round1"), (4, 2, False, 1, "-round1"),
                     (1, 1, False, 1, "-round2"), (4, 2, False, 1, "-round2"),
                     (1, 1, False, 1, "-round3"), (4, 2, False, 1, "-round3")]
    single = json.loads((tmp_path / "rag-1x1.json").read_text())
    scaled = json.loads((tmp_path / "rag-4x2.json").read_text())
    (row,) = scaleout.compare(single, scaled)
    assert (row["single"]["p99"], row["scaled"]["p99"]) == (150, 400)
    assert len(single["scenarios"][0]["rounds"]) == 3


def test_merging_runs_with_different_rows_is_refused() -> None:
    with pytest.raises(ValueError, match="different rows"):
        scaleout.merge_rounds([_doc(_row("a", [0.8], [1], [None])),
                               _doc(_row("b", [0.8], [1], [None]))])
