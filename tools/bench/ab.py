"""Two versions of the router, A and B, up at once in front of one upstream, their phases
taking turns: what a change does to added latency and router CPU, on a machine whose speed
drifts by more than the change between two runs minutes apart.

Run::

    git worktree add /tmp/before HEAD~1
    python -m tools.bench.ab /tmp/before . [--rounds 6] [--strategy PrefixAwareHash]

or one tree under two interpreters (another build of CPython, say, in a venv with the
router's dependencies)::

    python -m tools.bench.ab . . --python-b /path/to/other-venv/bin/python

Each round measures the upstream direct at c=1, then each router non-streaming at c=1 and
at c=32 (A first in even rounds, B first in odd ones). It prints every round and, per
router, the median and the best of: added p50 at c=1 (router - direct), router CPU per
request at c=1 and at c=32 (``utime + stime`` of the worker from ``/proc``). Both routers
run ``tools.bench.overhead``'s one-backend config with one worker; each imports its
``continuum`` from its own tree (``--router-src``). Everything listens on 127.0.0.1 and is
stopped by PID at the end.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
from pathlib import Path

from continuum.devtools.procs import Child
from tools.bench import overhead as ob

METRICS = ("added_p50_c1_ms", "cpu_c1_ms", "cpu_c32_ms")
#: One round: router name -> metric -> value.
Round = dict[str, dict[str, float]]


def summarize(rounds: list[Round]) -> dict[str, dict[str, tuple[float, float]]]:
    """Per router, per metric: (median, best) over ``rounds`` (lower is better)."""
    out: dict[str, dict[str, tuple[float, float]]] = {}
    for name in rounds[0]:
        out[name] = {}
        for metric in METRICS:
            values = [r[name][metric] for r in rounds]
            out[name][metric] = (round(statistics.median(values), 3), round(min(values), 3))
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tools.bench.ab", description=__doc__)
    parser.add_argument("a", help="source tree A (its continuum/ is imported)")
    parser.add_argument("b", help="source tree B")
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--strategy", choices=["PrefixAwareHash", "RoundRobin"],
                        default="PrefixAwareHash")
    parser.add_argument("--requests-c1", type=int, default=2000)
    parser.add_argument("--requests-c32", type=int, default=6000)
    parser.add_argument("--python-a", default=ob.PYTHON,
                        help="the interpreter that runs router A (default: this one)")
    parser.add_argument("--python-b", default=ob.PYTHON,
                        help="the interpreter that runs router B (default: this one)")
    args = parser.parse_args(argv)
    if args.rounds < 1:
        parser.error("--rounds must be at least 1")
    extra = ob.PREFIX_ROUTING if args.strategy == "PrefixAwareHash" else None
    names = {"A": str(Path(args.a).resolve()), "B": str(Path(args.b).resolve())}
    pythons = {"A": args.python_a, "B": args.python_b}
    children: list[Child] = []
    rounds: list[Round] = []
    with tempfile.TemporaryDirectory(prefix="continuum-ab-") as tmp:
        try:
            upstream, up_port = ob.start_upstream(Path(tmp), 8, 0.0)
            children.append(upstream)
            routers = {}
            for name, src in names.items():
                sub = Path(tmp) / name
                sub.mkdir()
                router, port = ob.start_router(sub, up_port, 1, src, extra, pythons[name])
                children.append(router)
                routers[name] = (router, port)
            for k in range(args.rounds):
                order = ["A", "B"] if k % 2 == 0 else ["B", "A"]
                direct = ob.run_phase("direct", up_port, False, 1, args.requests_c1, 200, 60,
                                      None, upstream)
                row: Round = {name: {} for name in names}
                for name in order:
                    router, port = routers[name]
                    p = ob.run_phase("router", port, False, 1, args.requests_c1, 200, 60,
                                     router, upstream)
                    row[name]["added_p50_c1_ms"] = p.p50_ms - direct.p50_ms
                    row[name]["cpu_c1_ms"] = p.router_cpu_ms_per_req or 0.0
                for name in order:
                    router, port = routers[name]
                    p = ob.run_phase("router", port, False, 32, args.requests_c32, 200, 60,
                                     router, upstream)
                    row[name]["cpu_c32_ms"] = p.router_cpu_ms_per_req or 0.0
                rounds.append(row)
                print(f"round {k}: " + "  ".join(
                    f"{name} " + " ".join(f"{m}={row[name][m]:.3f}" for m in METRICS)
                    for name in names), flush=True)
        except (ob.BenchError, RuntimeError, OSError) as exc:
            return ob.failed(exc, children)
        finally:
            for child in reversed(children):
                child.stop()
    print(f"\n# {args.strategy}, {args.rounds} round(s) taking turns: median (best)")
    for name, metrics in summarize(rounds).items():
        print(f"{name} {names[name]} ({pythons[name]}): " + "  ".join(
            f"{m} {median:.3f} ({best:.3f})" for m, (median, best) in metrics.items()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
