"""What each layer of the router's stack costs per request: the floor under issue 18's goals.

Run::

    python -m tools.bench.layers [--repeat 2] [--only floor worker-falcon router-pah] [--json]

Each layer is a server that does what a proxy must (take a chat completion, send it to the
upstream over a kept-alive connection, answer with the upstream's body), with one more
piece of the router's stack than the one before (:mod:`tools.bench.layer_apps`):

=================  ==========================================================================
``floor-threads``  the same relay on blocking sockets, a thread per connection: no event
                   loop (not a layer of the router's stack; what the kernel alone costs)
``floor``          a bare gevent ``StreamServer``, heads split by hand: what a Python proxy on
                   gevent cannot skip (loopback sends and receives, wake-ups, greenlets)
``gunicorn-wsgi``  gunicorn's own gevent worker (``-k gevent``) and a bare WSGI function
                   that calls the upstream with the router's HTTP client
``worker-wsgi``    the same function on the router's worker class
                   (``continuum.gunicorn_worker.GeventWorker``)
``worker-falcon``  a Falcon app with one resource on the router's worker class: the stack
                   the design fixes (Falcon on gunicorn's gevent workers) doing nothing else
``router-rr``      the router (``tools.bench.overhead``'s one-backend setup), RoundRobin
``router-pah``     the router with PrefixAwareHash and ``prefix_routing`` on
=================  ==========================================================================

Issue 18 sets its goals against the Rust routers. When their executables are installed
(``pip install vllm-router sglang-router``, in a venv of their own: they are not
dependencies; ``--rivals-bin DIR`` names its ``bin``, or they are looked up on ``PATH``),
the same phases run against them too, each with its defaults but for the policy:

=======================  ====================================================================
``vllm-router-rr``       ``vllm-router --policy round_robin``
``sglang-router-rr``     ``sglang-router launch --policy round_robin``
``sglang-router-cache``  ``sglang-router launch --policy cache_aware``: its prefix-aware
                         router (an approximate radix tree per worker), the counterpart of
                         ``router-pah``
=======================  ====================================================================

and the report puts the router's rows against theirs (the issue's title: within 2-3x of
them per request, at parity per streamed chunk). A rival that is not installed is left
out with a note; naming it in ``--only`` makes its absence an error.

For each it prints router CPU per request (utime+stime of the serving process from
``/proc``) non-streaming at concurrency 32 and 1, and the p50 latency added to the upstream
direct at concurrency 1, with the same load generator as ``tools.bench.overhead``. The
difference between ``worker-falcon`` and ``router-pah`` is what the router's own work
costs (parsing, routing, the lease, metrics, the access log, usage); the one between
``worker-falcon`` and a goal is what that goal leaves for it.

Every child process runs on 127.0.0.1, is bounded by the phases' request counts and time
limits, and is stopped by PID when the run ends.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from continuum.devtools.fleet import find_executable
from continuum.devtools.fleet import rival_argv as fleet_rival_argv
from continuum.devtools.procs import Child, free_port, wait_http, wait_until
from continuum.gunicorn_worker import WORKER_CLASS
from tools.bench.overhead import (
    GOAL_PAH_ADDED_P50_MS,
    GOAL_PAH_CPU_C32_MS,
    PREFIX_ROUTING,
    PYTHON,
    ROOT,
    BenchError,
    Phase,
    best_of,
    children_of,
    failed,
    figure,
    interpreter,
    pythonpath_env,
    run_phase,
    start_router,
    start_upstream,
)

LAYERS = ("floor-threads", "floor", "gunicorn-wsgi", "worker-wsgi", "worker-falcon", "router-rr",
          "router-pah")

#: Rust routers measured beside the router: layer -> (executable, arguments before the
#: common ``--host --port --worker-urls``, the policy arguments).
RIVALS: dict[str, tuple[str, tuple[str, ...], tuple[str, ...]]] = {
    "vllm-router-rr": ("vllm-router", (), ("--policy", "round_robin")),
    "sglang-router-rr": ("sglang-router", ("launch",), ("--policy", "round_robin")),
    "sglang-router-cache": ("sglang-router", ("launch",), ("--policy", "cache_aware")),
}
#: Which rival row each of the router's rows is read against in the report.
PAIRS = (("router-rr", "vllm-router-rr"), ("router-rr", "sglang-router-rr"),
         ("router-pah", "sglang-router-cache"))


def rival_executable(layer: str, bin_dir: str | None) -> str | None:
    """The path of ``layer``'s executable, in ``bin_dir`` or on ``PATH``; None when absent."""
    return find_executable(RIVALS[layer][0], bin_dir)


def rival_argv(layer: str, executable: str, port: int, upstream_port: int,
               metrics_port: int) -> list[str]:
    """The command line of rival ``layer``: on 127.0.0.1, one worker (the upstream), its
    Prometheus exporter on a free port of 127.0.0.1."""
    return fleet_rival_argv(RIVALS[layer], executable, port,
                            [f"http://127.0.0.1:{upstream_port}"], metrics_port)


@dataclass
class LayerResult:
    layer: str
    cpu_c32_ms: float | None
    cpu_c1_ms: float | None
    added_p50_c1_ms: float | None
    rps_c32: float | None
    chunk_c32_us: float | None
    chunk_c1_us: float | None


def start_layer(layer: str, tmp: Path, upstream_port: int, src: str,
                rivals_bin: str | None = None) -> tuple[Child, int]:
    """The server of ``layer`` (not the router's) and its port, once it answers
    ``/health``."""
    port = free_port()
    env = pythonpath_env(os.pathsep.join((src, str(ROOT))))
    env["LAYER_UPSTREAM_PORT"] = str(upstream_port)
    if layer in RIVALS:
        executable = rival_executable(layer, rivals_bin)
        if executable is None:
            raise BenchError(f"{layer}: {RIVALS[layer][0]} is not installed "
                             "(pip install vllm-router sglang-router; --rivals-bin DIR)")
        # Run as the child of a Python parent, as gunicorn's worker and the floor are: the
        # phases read the serving child's CPU (all its threads).
        argv = [PYTHON, "-m", "tools.bench.layer_apps", "--exec",
                *rival_argv(layer, executable, port, upstream_port, free_port())]
    elif layer in ("floor", "floor-threads"):
        argv = [PYTHON, "-m", "tools.bench.layer_apps", "--port", str(port),
                "--upstream-port", str(upstream_port),
                *(["--threads"] if layer == "floor-threads" else [])]
    else:
        worker = "gevent" if layer == "gunicorn-wsgi" else WORKER_CLASS
        app = "falcon_app" if layer == "worker-falcon" else "wsgi"
        argv = [PYTHON, "-m", "gunicorn", "--bind", f"127.0.0.1:{port}", "--workers", "1",
                "--worker-class", worker, "--worker-connections", "1000",
                "--log-level", "warning", f"tools.bench.layer_apps:{app}"]
    child = Child(argv, tmp / f"{layer}.log", name=layer, env=env, cwd=tmp)
    wait_http(f"http://127.0.0.1:{port}/health", 30, children=[child])
    wait_until(lambda: len(children_of(child.pid)) == 1, f"the {layer} server's worker", 20,
               children=[child])
    return child, port


def measure(layer: str, args: argparse.Namespace, tmp: Path, children: list[Child]
            ) -> LayerResult:
    sub = tmp / layer
    sub.mkdir()
    upstream, up_port = start_upstream(sub, args.long_chunks, args.long_chunk_delay_ms)
    children.append(upstream)
    if layer.startswith("router-"):
        extra = PREFIX_ROUTING if layer == "router-pah" else None
        server, port = start_router(sub, up_port, 1, args.router_src, extra)
    else:
        server, port = start_layer(layer, sub, up_port, args.router_src, args.rivals_bin)
    children.append(server)
    try:
        runs: dict[tuple[str, bool, int], list[Phase]] = {}
        phases = ((False, 32, args.requests_c32), (False, 1, args.requests_c1),
                  (True, 32, args.long_requests_c32), (True, 1, args.long_requests_c1))
        for _ in range(args.repeat):
            for stream, conc, count in phases:
                targets: list[tuple[str, int, Child | None]] = [("router", port, server)]
                if conc == 1 and not stream:
                    targets.insert(0, ("direct", up_port, None))
                for mode, p, rt in targets:
                    # Streams take a while (1 ms between records): few warm-up ones.
                    warmup = 2 * conc if stream else args.warmup
                    phase = run_phase(mode, p, stream, conc, count, warmup,
                                      args.max_seconds * (3 if stream else 1), rt, upstream,
                                      marked=layer not in RIVALS)
                    runs.setdefault((mode, stream, conc), []).append(phase)
        best = {key: best_of(repeats) for key, repeats in runs.items()}
    finally:
        for child in (server, upstream):
            child.stop()
            children.remove(child)
    r32, r1, d1 = (best[("router", False, 32)], best[("router", False, 1)],
                   best[("direct", False, 1)])
    s32, s1 = best[("router", True, 32)], best[("router", True, 1)]
    result = LayerResult(layer, r32.router_cpu_ms_per_req, r1.router_cpu_ms_per_req,
                         round(r1.p50_ms - d1.p50_ms, 3), r32.rps,
                         _per_chunk(s32, args.long_chunks), _per_chunk(s1, args.long_chunks))
    print(f"  done: {layer:<14} cpu c=32 {figure(result.cpu_c32_ms)}  "
          f"c=1 {figure(result.cpu_c1_ms)}  "
          f"added p50 c=1 {figure(result.added_p50_c1_ms)} ms  per chunk c=32 "
          f"{figure(result.chunk_c32_us, 1)} c=1 {figure(result.chunk_c1_us, 1)} us",
          file=sys.stderr, flush=True)
    return result


def _per_chunk(phase: Phase, chunks: int) -> float | None:
    cpu = phase.router_cpu_ms_per_req
    return None if cpu is None else round(cpu / chunks * 1e3, 1)


def report(results: list[LayerResult], info: dict[str, Any]) -> None:
    print(f"# what each layer costs per request  ({info['cpus']} CPUs, python "
          f"{info['python']}, best of {info['repeat']} run(s) per phase)\n")
    print("                   non-streaming                             "
          f"{info['chunks']}-record streams")
    print("layer                cpu ms/rq c=32  cpu ms/rq c=1  added p50 c=1 ms  req/s c=32"
          "  cpu us/record c=32  c=1")
    print("-" * 109)
    for r in results:
        print(f"{r.layer:<20} {figure(r.cpu_c32_ms):>14} {figure(r.cpu_c1_ms):>14} "
              f"{figure(r.added_p50_c1_ms):>17} {r.rps_c32 or 0:>11.0f} "
              f"{figure(r.chunk_c32_us, 1):>19} {figure(r.chunk_c1_us, 1):>4}")
    by = {r.layer: r for r in results}
    rival_ratios(by)
    base, full = by.get("worker-falcon"), by.get("router-pah")
    if base is None or base.cpu_c32_ms is None:
        return
    print("\n# what issue 18's goals leave for the router's own work, above worker-falcon")
    left_cpu = GOAL_PAH_CPU_C32_MS - base.cpu_c32_ms
    print(f"  router CPU <= {GOAL_PAH_CPU_C32_MS} ms at c=32: {left_cpu * 1e3:.0f} us left",
          end="")
    if full is not None and full.cpu_c32_ms is not None:
        print(f"; the router's own work takes {(full.cpu_c32_ms - base.cpu_c32_ms) * 1e3:.0f}"
              " us (router-pah - worker-falcon)")
    else:
        print()
    if base.added_p50_c1_ms is not None:
        left_p50 = GOAL_PAH_ADDED_P50_MS - base.added_p50_c1_ms
        print(f"  added p50 <= {GOAL_PAH_ADDED_P50_MS} ms at c=1: {left_p50 * 1e3:.0f} us left",
              end="")
        if full is not None and full.added_p50_c1_ms is not None:
            print(f"; the router's own work adds "
                  f"{(full.added_p50_c1_ms - base.added_p50_c1_ms) * 1e3:.0f} us")
        else:
            print()


#: (column, LayerResult field) of the ratios against the Rust routers.
_RATIO_COLUMNS = (("cpu c=32", "cpu_c32_ms"), ("cpu c=1", "cpu_c1_ms"),
                  ("added p50 c=1", "added_p50_c1_ms"), ("cpu/record c=32", "chunk_c32_us"),
                  ("cpu/record c=1", "chunk_c1_us"))


def _ratio(ours: float | None, theirs: float | None) -> str:
    if ours is None or theirs is None or theirs <= 0:
        return "-"
    return f"{ours / theirs:.2f}x"


def rival_ratios(by: dict[str, LayerResult]) -> None:
    """The router's rows divided by the Rust routers' (issue 18's title: within 2-3x per
    request, parity per streamed record), for every pair measured in this run."""
    pairs = [(ours, theirs) for ours, theirs in PAIRS if ours in by and theirs in by]
    if not pairs:
        return
    print("\n# the router against the Rust routers, same machine and run (ours / theirs; "
          "issue 18: <= 2-3x per request, ~1x per record)")
    print(f"{'pair':<38}" + "".join(f"{name:>16}" for name, _ in _RATIO_COLUMNS))
    for ours, theirs in pairs:
        print(f"{ours + ' / ' + theirs:<38}" + "".join(
            f"{_ratio(getattr(by[ours], field), getattr(by[theirs], field)):>16}"
            for _, field in _RATIO_COLUMNS))


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m tools.bench.layers",
        description="Router CPU per request and added latency, layer by layer of the stack.")
    parser.add_argument("--only", nargs="+", choices=LAYERS + tuple(RIVALS),
                        help="layers to run (default: all, the Rust routers when installed)")
    parser.add_argument("--rivals-bin", metavar="DIR",
                        help="the bin directory holding vllm-router and sglang-router "
                        "(default: look them up on PATH)")
    parser.add_argument("--repeat", type=int, default=1,
                        help="runs per phase, the best kept (default 1)")
    parser.add_argument("--requests-c1", type=int, default=3000)
    parser.add_argument("--requests-c32", type=int, default=8000)
    parser.add_argument("--long-requests-c1", type=int, default=50)
    parser.add_argument("--long-requests-c32", type=int, default=320)
    parser.add_argument("--long-chunks", type=int, default=200,
                        help="records per stream (default 200, as in the goal suite)")
    parser.add_argument("--long-chunk-delay-ms", type=float, default=1.0)
    parser.add_argument("--warmup", type=int, default=200)
    parser.add_argument("--max-seconds", type=float, default=15.0)
    parser.add_argument("--router-src", default=str(ROOT),
                        help="put first on the servers' PYTHONPATH (a modified continuum/)")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)
    if args.repeat < 1:
        parser.error("--repeat must be at least 1")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    chosen = [layer for layer in LAYERS + tuple(RIVALS) if not args.only or layer in args.only]
    if not args.only:
        missing = [layer for layer in RIVALS if rival_executable(layer, args.rivals_bin) is None]
        for layer in missing:
            print(f"  skipped: {layer} ({RIVALS[layer][0]} not found"
                  f"{' in ' + args.rivals_bin if args.rivals_bin else ' on PATH'})",
                  file=sys.stderr, flush=True)
        chosen = [layer for layer in chosen if layer not in missing]
    children: list[Child] = []
    with tempfile.TemporaryDirectory(prefix="continuum-layers-") as tmp:
        try:
            results = [measure(layer, args, Path(tmp), children) for layer in chosen]
        except (BenchError, RuntimeError, OSError) as exc:
            return failed(exc, children)
        finally:
            for child in reversed(children):
                child.stop()
    info = {"cpus": os.cpu_count(), "python": interpreter(), "repeat": args.repeat,
            "chunks": args.long_chunks}
    if args.json:
        print(json.dumps({"info": info, "layers": [r.__dict__ for r in results]}, indent=2))
    else:
        report(results, info)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
