"""Worker scaling with a load generator and an upstream that leave the CPUs to the router.

Run::

    python -m tools.bench.scaling [--rounds 3] [--seconds 10] [--concurrency 32] [--json]

Issue 18 asks that two workers on two cores give at least 1.8 x the requests per second of
one. ``tools.bench.overhead``'s ``pah-2w`` phase cannot show that on a 2-core machine: its
load generator and upstream are Python, and together they need about as much CPU per
request as the router, so the router never gets the second core. Here both are C:

* **upstream:** ``nginx`` (Debian's ``nginx-light``) on a free port of 127.0.0.1, one
  process (``master_process off``), answering ``POST /v1/chat/completions`` with the same
  prebuilt completion as ``tools.bench.upstream`` (``return 200``), ``/health`` and
  ``/v1/models``, keep-alive without a request limit;
* **load:** ``wrk`` (Debian's ``wrk``), one thread, ``--concurrency`` kept-alive
  connections, the same request as the goal suite (``tools.bench.overhead.build_request``).

The router is the goal suite's ``pah`` setup (PrefixAwareHash, ``prefix_routing`` on, one
backend), with one worker and then two, taking turns for ``--rounds`` rounds; each round
warms up for 2 s and then measures ``--seconds``. For each shape the table gives requests
per second, latency percentiles as wrk reports them, and CPU per request of the router's
workers, of nginx and of wrk (``/proc`` and ``wait4``), then the ratio of the medians.

It also prints the ceiling the machine sets: at the measured CPU per request of all three,
N CPUs serve at most ``N / (router + nginx + wrk)`` requests a second, so the ratio two
workers can reach is ``min(2, that ceiling / one worker's req/s)``.

Needs ``wrk`` and ``nginx`` on the ``PATH`` (``apt-get install wrk nginx-light``; the bench
starts its own nginx and never the system's). Every process is started on 127.0.0.1,
bounded by ``--seconds``, and stopped by PID at the end.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from continuum.devtools.procs import Child, free_port, wait_http
from tools.bench import overhead as ob
from tools.bench.upstream import Answers

NGINX_CONF = """\
daemon off;
master_process off;
worker_processes 1;
error_log {tmp}/nginx-error.log warn;
pid {tmp}/nginx.pid;
events {{ worker_connections 1024; }}
http {{
    access_log off;
    client_body_temp_path {tmp}/nginx-body;
    proxy_temp_path {tmp}/nginx-proxy;
    fastcgi_temp_path {tmp}/nginx-fastcgi;
    uwsgi_temp_path {tmp}/nginx-uwsgi;
    scgi_temp_path {tmp}/nginx-scgi;
    keepalive_requests 1000000000;
    keepalive_timeout 600s;
    default_type application/json;
    server {{
        listen 127.0.0.1:{port} backlog=1024;
        location = /health {{ return 200 '{{"status": "ok"}}'; }}
        location = /v1/models {{ return 200 '{models}'; }}
        location = /v1/chat/completions {{ return 200 '{completion}'; }}
        location / {{ return 404 '{{"error": {{"message": "not found"}}}}'; }}
    }}
}}
"""

WRK_SCRIPT = """\
wrk.method = "POST"
wrk.body = {body}
{headers}
"""


@dataclass
class Round:
    """One measured wrk run against one router shape."""

    workers: int
    rps: float
    requests: int
    errors: int
    latency_p50_ms: float
    latency_p99_ms: float
    router_cpu_ms: float         # per request, the router's workers (utime + stime)
    upstream_cpu_us: float       # per request, nginx
    client_cpu_us: float         # per request, wrk
    worker_shares: list[float]   # each worker's share of the router CPU


def _body_of(answer: bytes) -> str:
    """The body of one of :class:`tools.bench.upstream.Answers`' prebuilt responses."""
    return answer.split(b"\r\n\r\n", 1)[1].decode()


def nginx_binary() -> str | None:
    """Debian's nginx: on the ``PATH``, or in /usr/sbin, which a user's ``PATH`` may lack."""
    return shutil.which("nginx") or ("/usr/sbin/nginx" if Path("/usr/sbin/nginx").exists()
                                     else None)


def start_nginx(tmp: Path) -> tuple[Child, int]:
    """nginx, one process, on a free port, answering as ``tools.bench.upstream`` does."""
    nginx = nginx_binary()
    if nginx is None:
        raise ob.BenchError("nginx is not installed (apt-get install nginx-light)")
    answers = Answers(ob.MODEL, 8, 0.0)
    port = free_port()
    conf = tmp / "nginx.conf"
    conf.write_text(NGINX_CONF.format(tmp=tmp, port=port,
                                      models=_body_of(answers.models),
                                      completion=_body_of(answers.completion)))
    child = Child([nginx, "-p", str(tmp), "-c", str(conf), "-e", str(tmp / "nginx-error.log")],
                  tmp / "nginx.log", name="nginx", cwd=tmp)
    wait_http(f"http://127.0.0.1:{port}/health", 10, children=[child])
    return child, port


def wrk_script(tmp: Path, port: int) -> Path:
    """A wrk script sending :func:`tools.bench.overhead.build_request`'s request."""
    raw = ob.build_request(port, stream=False)
    head, body = raw.split(b"\r\n\r\n", 1)
    headers = []
    for line in head.decode().split("\r\n")[1:]:
        name, value = line.split(": ", 1)
        if name.lower() in ("host", "content-length"):
            continue  # wrk sets both
        headers.append(f"wrk.headers[{json.dumps(name)}] = {json.dumps(value)}")
    path = tmp / "post.lua"
    path.write_text(WRK_SCRIPT.format(body=json.dumps(body.decode()),
                                      headers="\n".join(headers)))
    return path


_LATENCY = re.compile(r"^\s+(50|99)(?:\.000)?%\s+([\d.]+)(us|ms|s)\s*$", re.M)
_REQUESTS = re.compile(r"^\s*(\d+) requests in ([\d.]+)(us|ms|s|m),", re.M)
_ERRORS = re.compile(r"Non-2xx or 3xx responses: (\d+)|Socket errors: connect (\d+), "
                     r"read (\d+), write (\d+), timeout (\d+)")
_SCALE = {"us": 1e-3, "ms": 1.0, "s": 1e3}


def run_wrk(port: int, script: Path, concurrency: int, seconds: int) -> tuple[str, float]:
    """Run wrk; its output and its CPU seconds (from ``wait4``)."""
    wrk = shutil.which("wrk")
    if wrk is None:
        raise ob.BenchError("wrk is not installed (apt-get install wrk)")
    argv = [wrk, "-t1", f"-c{concurrency}", f"-d{seconds}s", "--latency", "--timeout", "10s",
            "-s", str(script), f"http://127.0.0.1:{port}/v1/chat/completions"]
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    assert proc.stdout is not None
    out = proc.stdout.read().decode(errors="replace")
    _, status, usage = os.wait4(proc.pid, 0)
    proc.returncode = os.waitstatus_to_exitcode(status)
    if proc.returncode != 0:
        raise ob.BenchError(f"wrk exited with {proc.returncode}:\n{out}")
    return out, usage.ru_utime + usage.ru_stime


def parse_wrk(out: str) -> tuple[int, float, int, float, float]:
    """Requests, the seconds they took, errors (non-2xx answers and socket errors), and
    p50 and p99 latency in ms, from wrk's ``--latency`` output."""
    found = _REQUESTS.search(out)
    if found is None:
        raise ob.BenchError(f"no request count in wrk's output:\n{out}")
    requests = int(found.group(1))
    seconds = float(found.group(2)) * {"us": 1e-6, "ms": 1e-3, "s": 1.0, "m": 60.0}[
        found.group(3)]
    errors = 0
    for match in _ERRORS.finditer(out):
        errors += sum(int(g) for g in match.groups() if g)
    latency = {q: float(v) * _SCALE[unit] for q, v, unit in _LATENCY.findall(out)}
    return (requests, seconds, errors, latency.get("50", float("nan")),
            latency.get("99", float("nan")))


def measure(workers: int, nginx: Child, nginx_port: int, tmp: Path, args: argparse.Namespace,
            children: list[Child]) -> Round:
    """Start the router with ``workers``, warm it up, measure one wrk run, stop it."""
    sub = tmp / f"router-{workers}w-{time.monotonic_ns()}"
    sub.mkdir()
    router, port = ob.start_router(sub, nginx_port, workers, args.router_src,
                                   ob.PREFIX_ROUTING)
    children.append(router)
    try:
        script = wrk_script(sub, port)
        run_wrk(port, script, args.concurrency, 2)  # warm-up: connections, imports, memo
        pids = ob.children_of(router.pid)
        if len(pids) != workers:
            raise ob.BenchError(f"expected {workers} router workers, found {len(pids)}")
        w0 = [ob.cpu_seconds(p) for p in pids]
        n0 = ob.cpu_seconds(nginx.pid)
        out, wrk_cpu = run_wrk(port, script, args.concurrency, args.seconds)
        w1 = [ob.cpu_seconds(p) for p in pids]
        n1 = ob.cpu_seconds(nginx.pid)
        if ob.children_of(router.pid) != pids:
            raise ob.BenchError("a router worker was replaced during the run:\n"
                                + router.log_tail())
    finally:
        router.stop()
        children.remove(router)
    requests, seconds, errors, p50, p99 = parse_wrk(out)
    if requests == 0:
        raise ob.BenchError(f"wrk completed no request:\n{out}")
    spent = [b - a for a, b in zip(w0, w1, strict=True)]
    total = sum(spent)
    return Round(workers=workers, rps=requests / seconds, requests=requests,
                 errors=errors, latency_p50_ms=p50, latency_p99_ms=p99,
                 router_cpu_ms=total / requests * 1e3,
                 upstream_cpu_us=(n1 - n0) / requests * 1e6,
                 client_cpu_us=wrk_cpu / requests * 1e6,
                 worker_shares=[s / total for s in spent] if total > 0 else [])


def summarize(rounds: list[Round], cpus: int) -> dict[str, Any]:
    """Medians per shape, the ratio, and the ceiling the CPUs set."""
    shapes: dict[int, dict[str, float]] = {}
    for workers in sorted({r.workers for r in rounds}):
        mine = [r for r in rounds if r.workers == workers]
        shapes[workers] = {
            key: statistics.median(getattr(r, key) for r in mine)
            for key in ("rps", "latency_p50_ms", "latency_p99_ms", "router_cpu_ms",
                        "upstream_cpu_us", "client_cpu_us")}
    out: dict[str, Any] = {"shapes": shapes}
    if 1 in shapes and 2 in shapes:
        two = shapes[2]
        per_request_ms = (two["router_cpu_ms"] + two["upstream_cpu_us"] / 1e3
                          + two["client_cpu_us"] / 1e3)
        ceiling = cpus * 1e3 / per_request_ms
        out["ratio"] = two["rps"] / shapes[1]["rps"]
        out["ceiling_rps"] = ceiling
        out["ceiling_ratio"] = min(2.0, ceiling / shapes[1]["rps"])
    return out


def print_table(rounds: list[Round], summary: dict[str, Any], cpus: int,
                concurrency: int) -> None:
    print(f"# worker scaling: PrefixAwareHash router, nginx upstream, wrk at c={concurrency} "
          f"({cpus} CPUs, python {ob.interpreter()})")
    print()
    print("| workers | round | req/s | p50 ms | p99 ms | router CPU ms/req | nginx µs/req "
          "| wrk µs/req | worker shares | errors |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    seen: dict[int, int] = {}
    for r in rounds:
        seen[r.workers] = seen.get(r.workers, 0) + 1
        shares = "/".join(f"{s:.0%}" for s in r.worker_shares)
        print(f"| {r.workers} | {seen[r.workers]} | {r.rps:,.0f} | {r.latency_p50_ms:.2f} "
              f"| {r.latency_p99_ms:.2f} | {r.router_cpu_ms:.3f} | {r.upstream_cpu_us:.1f} "
              f"| {r.client_cpu_us:.1f} | {shares} | {r.errors} |")
    print()
    for workers, med in summary["shapes"].items():
        print(f"median, {workers} worker(s): {med['rps']:,.0f} req/s, router CPU "
              f"{med['router_cpu_ms']:.3f} ms/req, nginx {med['upstream_cpu_us']:.1f} µs/req, "
              f"wrk {med['client_cpu_us']:.1f} µs/req")
    if "ratio" in summary:
        print(f"2 workers / 1 worker: {summary['ratio']:.2f} x (goal >= {ob.GOAL_SCALE} x); "
              f"at 2 workers' CPU per request (router + nginx + wrk) {cpus} CPUs allow "
              f"{summary['ceiling_rps']:,.0f} req/s, so at most "
              f"{summary['ceiling_ratio']:.2f} x here")
        met = summary["ratio"] >= ob.GOAL_SCALE
        print(f"  [{'ok' if met else 'MISSED'}] req/s 2 workers / 1 worker, PrefixAwareHash, "
              f"non-streaming c={concurrency}: {summary['ratio']:.2f} x (>= {ob.GOAL_SCALE} x)")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tools.bench.scaling",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=3, help="rounds of each shape (3)")
    parser.add_argument("--seconds", type=int, default=10,
                        help="measured seconds per round (10)")
    parser.add_argument("--concurrency", type=int, default=32, help="connections (32)")
    parser.add_argument("--workers", type=int, nargs="+", default=[1, 2],
                        help="router worker counts, taking turns (1 2)")
    parser.add_argument("--router-src", default=str(ob.ROOT),
                        help="the checkout whose continuum runs (this one)")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)
    if args.rounds < 1 or args.seconds <= 0 or args.concurrency < 1:
        parser.error("--rounds, --seconds and --concurrency must be positive")
    tmp = Path(tempfile.mkdtemp(prefix="continuum-scaling-"))
    children: list[Child] = []
    rounds: list[Round] = []
    try:
        nginx, nginx_port = start_nginx(tmp)
        children.append(nginx)
        for _ in range(args.rounds):
            for workers in args.workers:
                rounds.append(measure(workers, nginx, nginx_port, tmp, args, children))
                if not args.json:
                    r = rounds[-1]
                    print(f"  done: {workers} worker(s), {r.rps:,.0f} req/s, "
                          f"{r.router_cpu_ms:.3f} ms router CPU/req", file=sys.stderr,
                          flush=True)
    except (ob.BenchError, RuntimeError, OSError) as exc:
        return ob.failed(exc, children)
    finally:
        for child in reversed(children):
            child.stop()
        shutil.rmtree(tmp, ignore_errors=True)
    cpus = os.cpu_count() or 1
    summary = summarize(rounds, cpus)
    if args.json:
        print(json.dumps({"rounds": [asdict(r) for r in rounds], "summary": summary},
                         indent=2))
    else:
        print_table(rounds, summary, cpus, args.concurrency)
    return 0


if __name__ == "__main__":
    sys.exit(main())
