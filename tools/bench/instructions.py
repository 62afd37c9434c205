"""Instructions the router worker executes per request, under callgrind: a count that does
not move with what else runs on the machine (router CPU ms/request does, by +-10% or more on
a shared one), to compare two versions of the hot path.

Run::

    python -m tools.bench.instructions [--router-src DIR] [ns32 ns1 s1 long1 ...]
    python -m tools.bench.instructions --strategy RoundRobin --keep /tmp/rr ns1

Phases: ``ns<c>`` non-streaming at concurrency c, ``s<c>`` 8-record streams, ``long<c>``
200-record streams with 1 ms between records (reported per record; run these on their own:
the upstream is started for the phases' shape). The router (PrefixAwareHash, prefix
routing on, one worker; ``--strategy RoundRobin`` without prefix routing) runs under
``valgrind --tool=callgrind``; after a warm-up its counters are zeroed, the phase runs,
and the dumped total is divided by the requests. User space only: syscalls count as the
instructions that make them. Background greenlets (health, fleet poll) run by wall time,
so the long-stream figure moves a little between runs. Needs valgrind (``apt-get install
valgrind``); a few minutes per phase.
"""

from __future__ import annotations

import argparse
import glob
import json
import shutil
import subprocess
import tempfile
import time
from pathlib import Path

import requests

from continuum.devtools.procs import Child, free_port
from tools.bench import overhead as ob

COUNTS = {"ns": 2000, "s": 500, "long": 10}


def router_env(tmp: Path, port: int, up_port: int, strategy: str,
               router_src: str) -> dict[str, str]:
    """The environment of a one-worker router on ``port`` in front of the bench upstream on
    ``up_port`` (its config and metrics directory made in ``tmp``): PrefixAwareHash with
    prefix routing on, or RoundRobin without."""
    routing = ob.PREFIX_ROUTING if strategy == "PrefixAwareHash" else {
        "selection_strategy": "RoundRobin"}
    config = tmp / "router.yaml"
    config.write_text(json.dumps({
        "server": {"bind": f"127.0.0.1:{port}", "workers": 1, "log_level": "warning"},
        "health_check": {"enabled": True, "interval_seconds": 3600},
        "backends": [{"name": "bench", "url": f"http://127.0.0.1:{up_port}",
                      "models": [ob.MODEL]}],
        **routing}))
    (tmp / "metrics").mkdir(exist_ok=True)
    env = ob.pythonpath_env(router_src)
    env["CONTINUUM_CONFIG"] = str(config)
    env["PROMETHEUS_MULTIPROC_DIR"] = str(tmp / "metrics")
    return env


def wait_router(port: int, router: Child, seconds: float) -> None:
    """Wait until the router on ``port`` answers ``/health``.

    Raises:
        ob.BenchError: it did not within ``seconds`` (with the tail of its log).
    """
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        try:
            if requests.get(f"http://127.0.0.1:{port}/health", timeout=30).ok:
                return
        except requests.RequestException:
            pass
        time.sleep(0.5)
    raise ob.BenchError("the router did not come up:\n" + router.log_tail())


def _total(files: list[str]) -> int:
    total = 0
    for path in files:
        with open(path) as f:
            for line in f:
                if line.startswith(("summary:", "totals:")):
                    total = max(total, int(line.split()[1]))
    return total


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tools.bench.instructions")
    parser.add_argument("phases", nargs="*", default=["ns32"])
    parser.add_argument("--router-src", default=str(ob.ROOT))
    parser.add_argument("--strategy", choices=["PrefixAwareHash", "RoundRobin"],
                        default="PrefixAwareHash",
                        help="RoundRobin: without prefix routing, to count what it costs")
    parser.add_argument("--keep", metavar="DIR",
                        help="copy each phase's callgrind file to DIR/<phase>.callgrind "
                        "(for callgrind_annotate --inclusive=yes)")
    args = parser.parse_args(argv)
    tmp = Path(tempfile.mkdtemp(prefix="continuum-instr-"))
    long = any(p.startswith("long") for p in args.phases)
    chunks = 200 if long else 8
    children: list[Child] = []
    try:
        upstream, up_port = ob.start_upstream(tmp, chunks, 1.0 if long else 0.0)
        children.append(upstream)
        port = free_port()
        env = router_env(tmp, port, up_port, args.strategy, args.router_src)
        argv_ = ["valgrind", "--tool=callgrind", "--trace-children=yes",
                 f"--callgrind-out-file={tmp}/cg.%p", ob.PYTHON, "-m", "gunicorn", "-c",
                 "python:continuum.gunicorn_conf", "continuum.app:get_app()"]
        router = Child(argv_, tmp / "router.log", name="router", env=env, cwd=tmp)
        children.append(router)
        wait_router(port, router, 300)
        worker = ob.children_of(router.pid)[0]
        for phase in args.phases:
            kind = phase.rstrip("0123456789")
            stream, conc = kind != "ns", int(phase[len(kind):])
            conns = [ob.Conn(port, timeout=120) for _ in range(conc)]
            payload = ob.build_request(port, stream)
            ob.Load(conns, payload, stream, True).run(max(20, 5 * conc), 900)
            subprocess.run(["callgrind_control", "-z", str(worker)], capture_output=True,
                           check=True)
            load = ob.Load(conns, payload, stream, True)
            load.run(COUNTS[kind], 900)
            done = len(load.latencies) + load.errors
            for path in glob.glob(f"{tmp}/cg.{worker}*"):
                Path(path).unlink()
            subprocess.run(["callgrind_control", "-d", str(worker)], capture_output=True,
                           check=True)
            time.sleep(1)
            dumped = glob.glob(f"{tmp}/cg.{worker}*")
            per = _total(dumped) / done
            if args.keep and dumped:
                Path(args.keep).mkdir(parents=True, exist_ok=True)
                shutil.copy(max(dumped, key=lambda p: Path(p).stat().st_size),
                            Path(args.keep) / f"{phase}.callgrind")
            unit = "request"
            if kind == "long":
                per, unit = per / chunks, "record"
            print(f"{phase:<7} {done} requests ({load.errors} failed): "
                  f"{per / 1e3:.1f} k instructions per {unit}", flush=True)
            for c in conns:
                c.close()
    finally:
        for child in reversed(children):
            child.stop()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
