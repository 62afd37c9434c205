"""Scale-out check (issue 16): every demo scenario on one worker x one router against
``--workers`` x ``--routers`` (4 x 2), compared row by row against the issue's acceptance.

Run::

    python -m tools.bench.scaleout                      # all scenarios, 3 rounds, ~60 min
    python -m tools.bench.scaleout --quick --rounds 1   # a smaller workload, ~12 min
    python -m tools.bench.scaleout --compare-only --out DIR   # an earlier run's JSON again
    python -m tools.bench.scaleout --scenario rag --rows 'KV index (seed key)' --rounds 7
    python -m tools.bench.scaleout --scenario rag --rows 'KV index' --rounds 6 --interleave

For each scenario it runs ``continuum-router demo --scenario S --json --rounds N`` first as
``--workers 1 --routers 1`` and then as ``--workers W --routers M`` (so the two shapes of a
scenario run minutes apart, on the same machine state), keeps both JSON documents in
``--out`` (``<scenario>-<w>x<m>.json``), and prints, per row (the single-engine row is
left out: it has no router):

* prefix hit rate, 1 x 1 and W x M, and their ratio (acceptance: ≥ 0.95);
* p99 TTFT, and the ratio (acceptance: ≤ 1.2);
* response-cache hit rate (acceptance: ≥ 0.95 of 1 x 1; equal zeros pass);
* the requests each engine served, for the spill-over comparison.

``--redis-baseline`` runs the 1 x 1 side with ``--redis`` (``<scenario>-1x1-redis.json``):
its response cache and KV index on Redis as in the scaled run, so that only the number of
workers and routers differs.

Each number is the median over the rounds (the demo's own ``--rounds`` median, recomputed
here for the nested response-cache rate, which the demo takes from the first round).
``--check`` exits 1 when a check is missed. Only ``127.0.0.1`` is used: the demo starts
every process it talks to and stops them by PID.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from continuum.devtools.demo import WORKLOADS

SCENARIOS = tuple(WORKLOADS)
HIT_RATIO = 0.95
P99_RATIO = 1.2


def shape_name(workers: int, routers: int, redis: bool = False) -> str:
    return f"{workers}x{routers}" + ("-redis" if redis else "")


def result_path(out: Path, scenario: str, shape: str) -> Path:
    """Where the demo JSON of ``scenario`` at ``shape`` (:func:`shape_name`) is kept."""
    return out / f"{scenario}-{shape}.json"


def demo_command(scenario: str, workers: int, routers: int, rounds: int, quick: bool,
                 redis: bool = False, rows: Sequence[str] = (),
                 sets: Sequence[str] = ()) -> list[str]:
    """The demo's command line for one run (``rows``: only these rows, ``--strategies``;
    ``sets``: ``--set PATH=VALUE`` router config keys)."""
    return [sys.executable, "-m", "continuum.cli", "demo", "--scenario", scenario,
            "--workers", str(workers), "--routers", str(routers), "--rounds", str(rounds),
            "--json", *(["--quick"] if quick else []), *(["--redis"] if redis else []),
            *(["--strategies", *rows] if rows else []),
            *(arg for item in sets for arg in ("--set", item))]


def run_demo(scenario: str, workers: int, routers: int, rounds: int, quick: bool,
             out: Path, redis: bool = False, rows: Sequence[str] = (),
             suffix: str = "", sets: Sequence[str] = ()) -> Path:
    """One demo run; its JSON in ``out`` (``suffix`` after the shape in its name). Raises
    on a failed run (its stderr is kept)."""
    path = result_path(out, scenario, shape_name(workers, routers, redis) + suffix)
    cmd = demo_command(scenario, workers, routers, rounds, quick, redis, rows, sets)
    started = time.monotonic()
    print(f"  {' '.join(cmd[3:])}", flush=True)
    with path.open("w") as stdout, (out / f"{path.stem}.err").open("w") as stderr:
        rc = subprocess.call(cmd, stdout=stdout, stderr=stderr)
    print(f"    rc {rc} in {time.monotonic() - started:.0f} s", flush=True)
    if rc not in (0, 1):  # 1: some request failed, the rows still say which
        raise SystemExit(f"demo failed (rc {rc}): see {out / (path.stem + '.err')}")
    return path


def merge_rounds(docs: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """One demo document from single-round runs of the same rows (``--interleave``): each
    row as the first run's, with every run's row under ``rounds``, as ``--rounds`` gives.

    Raises:
        ValueError: the runs do not have the same rows in the same order.
    """
    names = [[row["name"] for row in doc["scenarios"]] for doc in docs]
    if any(n != names[0] for n in names):
        raise ValueError(f"the runs have different rows: {names}")
    rows = []
    for i, first in enumerate(docs[0]["scenarios"]):
        runs = [doc["scenarios"][i] for doc in docs]
        rows.append({**first, "rounds": runs} if len(runs) > 1 else first)
    return {**docs[0], "scenarios": rows}


def run_interleaved(scenario: str, shapes: Sequence[tuple[int, int, bool]], rounds: int,
                    quick: bool, out: Path, rows: Sequence[str],
                    sets: Sequence[str] = ()) -> None:
    """``--interleave``: one round of each shape in turn, ``rounds`` times, so both
    shapes meet the machine in the same states; each shape's rounds merged into its usual
    file (:func:`result_path`)."""
    runs: dict[tuple[int, int, bool], list[dict[str, Any]]] = {s: [] for s in shapes}
    for k in range(rounds):
        for workers, routers, redis in shapes:
            path = run_demo(scenario, workers, routers, 1, quick, out, redis, rows,
                            suffix=f"-round{k + 1}", sets=sets)
            runs[(workers, routers, redis)].append(json.loads(path.read_text()))
    for (workers, routers, redis), docs in runs.items():
        result_path(out, scenario, shape_name(workers, routers, redis)).write_text(
            json.dumps(merge_rounds(docs)))


def _median(values: list[float | None]) -> float | None:
    numbers = [v for v in values if v is not None]
    return statistics.median(numbers) if numbers else None


def row_numbers(row: dict[str, Any]) -> dict[str, Any]:
    """The compared numbers of one demo row, medians over its rounds."""
    runs = row.get("rounds") or [row]
    cache = [(r.get("scale_out") or {}).get("response_cache_hit_rate") for r in runs]
    return {"prefix_hit": _median([r["prefix_hit_rate"] for r in runs]),
            "p99": _median([r["ttft_ms_p99"] for r in runs]),
            "cache_hit": _median(cache),
            "errors": sum(r.get("errors", 0) for r in runs),
            "engines": [r["engine_requests"] for r in runs]}


def ratio(a: float | None, b: float | None) -> float | None:
    if a is None or b is None:
        return None
    if a == 0:
        return 1.0 if b == 0 else None
    return b / a


def compare(single: dict[str, Any], scaled: dict[str, Any]) -> list[dict[str, Any]]:
    """One dict per router row present in both documents, with the checks."""
    out = []
    scaled_rows = {r["name"]: r for r in scaled["scenarios"]}
    for row in single["scenarios"]:
        if row.get("direct") or row["name"] not in scaled_rows:
            continue
        a, b = row_numbers(row), row_numbers(scaled_rows[row["name"]])
        hit, p99 = ratio(a["prefix_hit"], b["prefix_hit"]), ratio(a["p99"], b["p99"])
        cache = ratio(a["cache_hit"], b["cache_hit"]) if a["cache_hit"] is not None else None
        checks = {"prefix hit": hit is not None and hit >= HIT_RATIO,
                  "p99 TTFT": p99 is not None and p99 <= P99_RATIO,
                  "errors": b["errors"] == 0 and a["errors"] == 0}
        if a["cache_hit"] is not None:
            checks["resp-cache hit"] = cache is not None and cache >= HIT_RATIO
        out.append({"row": row["name"], "single": a, "scaled": b, "hit_ratio": hit,
                    "p99_ratio": p99, "cache_ratio": cache, "checks": checks})
    return out


def _f(value: float | None, fmt: str) -> str:
    return "-" if value is None else format(value, fmt)


def print_scenario(name: str, base: str, shape: str, rows: list[dict[str, Any]]) -> None:
    print(f"\n--scenario {name}: {base} / {shape} (medians over the rounds)")
    head = ("row", "prefix hit", "ratio", "p99 TTFT ms", "ratio", "resp-cache hit",
            "requests per engine (1st round)", "")
    lines = [head]
    for r in rows:
        a, b = r["single"], r["scaled"]
        missed = [k for k, ok in r["checks"].items() if not ok]
        lines.append((
            r["row"],
            f"{_f(a['prefix_hit'], '.3f')} / {_f(b['prefix_hit'], '.3f')}",
            _f(r["hit_ratio"], ".3f"),
            f"{_f(a['p99'], '.0f')} / {_f(b['p99'], '.0f')}",
            _f(r["p99_ratio"], ".2f"),
            f"{_f(a['cache_hit'], '.3f')} / {_f(b['cache_hit'], '.3f')}",
            f"{'/'.join(map(str, a['engines'][0]))} · {'/'.join(map(str, b['engines'][0]))}",
            "ok" if not missed else "MISSED: " + ", ".join(missed)))
    widths = [max(len(str(line[i])) for line in lines) for i in range(len(head))]
    for line in lines:
        print("  ".join(str(c).ljust(w) for c, w in zip(line, widths, strict=True)).rstrip())


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m tools.bench.scaleout", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--scenario", nargs="+", choices=SCENARIOS, default=list(SCENARIOS))
    p.add_argument("--workers", type=int, default=4)
    p.add_argument("--routers", type=int, default=2)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--quick", action="store_true", help="the demo's smaller workloads")
    p.add_argument("--rows", nargs="+", metavar="NAME", default=[],
                   help="only these rows of each scenario (the demo's --strategies names, "
                   "e.g. 'KV index (seed key)'); default: every row")
    p.add_argument("--set", action="append", default=[], metavar="PATH=VALUE", dest="sets",
                   help="passed to every demo run (both shapes): a router config key, e.g. "
                   "fleet.fleet_load_push_ms=5")
    p.add_argument("--redis-baseline", action="store_true",
                   help="run the 1 x 1 baseline with --redis (its tiers on Redis as in the "
                   "scaled run), so the comparison is of the scale-out alone")
    p.add_argument("--interleave", action="store_true",
                   help="run the rounds one at a time, the two shapes taking turns (1 x 1, "
                   "W x M, 1 x 1, ...), so a machine that slows down or speeds up meets "
                   "both alike; slower (a fleet start per round)")
    p.add_argument("--out", type=Path, default=Path("scaleout-results"),
                   help="where the JSON goes (default ./scaleout-results)")
    p.add_argument("--compare-only", action="store_true",
                   help="compare the JSON already in --out, run nothing")
    p.add_argument("--json", action="store_true", help="print the comparison as JSON")
    p.add_argument("--check", action="store_true", help="exit 1 when a check is missed")
    args = p.parse_args(argv)
    if args.workers < 1 or args.routers < 1 or args.rounds < 1:
        p.error("--workers, --routers and --rounds must be >= 1")
    args.out.mkdir(parents=True, exist_ok=True)
    shape = shape_name(args.workers, args.routers)
    base = shape_name(1, 1, args.redis_baseline)
    results: dict[str, list[dict[str, Any]]] = {}
    for scenario in args.scenario:
        if not args.compare_only and args.interleave:
            print(f"{scenario}:", flush=True)
            run_interleaved(scenario, [(1, 1, args.redis_baseline),
                                       (args.workers, args.routers, False)],
                            args.rounds, args.quick, args.out, args.rows, args.sets)
        elif not args.compare_only:
            print(f"{scenario}:", flush=True)
            run_demo(scenario, 1, 1, args.rounds, args.quick, args.out, args.redis_baseline,
                     args.rows, sets=args.sets)
            run_demo(scenario, args.workers, args.routers, args.rounds, args.quick, args.out,
                     rows=args.rows, sets=args.sets)
        docs = [json.loads(result_path(args.out, scenario, s).read_text())
                for s in (base, shape)]
        results[scenario] = compare(*docs)
    if args.json:
        print(json.dumps(results, indent=2))
    else:
        for scenario, rows in results.items():
            print_scenario(scenario, base, shape, rows)
    missed = [(s, r["row"]) for s, rows in results.items() for r in rows
              if not all(r["checks"].values())]
    if not args.json:
        print(f"\n{len(missed)} row(s) missed a check" + (": " + "; ".join(
            f"{s} {row}" for s, row in missed) if missed else ""))
    return 1 if args.check and missed else 0


if __name__ == "__main__":
    sys.exit(main())
