"""Router overhead benchmark: the router in front of a fast upstream vs the upstream direct.

Run::

    python -m tools.bench.overhead [--repeat 3] [--json] [--check]     # the goal suite, ~2-4 min
    python -m tools.bench.overhead --suite single [--strategy PrefixAwareHash] ...

The default ``--suite goals`` runs four router setups one after the other, each with its own
upstream: ``rr`` (RoundRobin) and ``pah`` (PrefixAwareHash with ``prefix_routing.enabled``),
non-streaming at concurrency 1 and 32 and streaming (8 records) at concurrency 1, each
against the upstream direct too; ``pah-long``, 200-record streams with 1 ms between
records (a token stream), at concurrency 1 and 32, reported as router CPU per relayed
record; ``pah-2w``, two workers, non-streaming at concurrency 32; ``pair``, a RoundRobin and a
PrefixAwareHash router side by side, their non-streaming phases taking turns (the
PrefixAwareHash - RoundRobin goal is the median of these pairs' differences: the
configurations a minute apart drift by more than the goal). With ``--repeat N`` every
phase runs N times and the best value of each column is kept (the machine is shared: the
quietest run is the truest). The summary prints each goal of issue 18 with ok/MISSED:
PrefixAwareHash - RoundRobin <= 10 us CPU per request; <= 0.15 ms router CPU per request at
c=32 (PrefixAwareHash); added p50 <= 0.3 ms at c=1; <= 20 us (c=32) and <= 40 us (c=1) of
router CPU per relayed chunk; added TTFC <= 0.5 ms; 2 workers >= 1.8x the req/s of one.

``--suite single`` is one setup (``--strategy``, ``--workers``, ``--chunks``) at
``--concurrency``, as below; ``--py-spy`` works there.

It starts ``tools.bench.upstream`` and the router (``gunicorn -c python:continuum.gunicorn_conf
'continuum.app:get_app()'``, gevent worker, one worker by default) as child processes on free
ports of 127.0.0.1, then, for non-streaming and streaming chat completions at concurrency 1
and 32, runs the same load against the upstream directly and through the router, and prints
both side by side:

* latency p50/p99 and requests/s as the client sees them;
* TTFC: time to the first ``data:`` bytes of a streamed answer, over a kept-alive connection;
* router CPU ms/request: utime+stime of the gunicorn worker process(es) from
  ``/proc/<pid>/stat`` before and after the phase, divided by the requests of the phase.
  This is the number that carries across machines; latencies depend on the machine.

The load generator is cheap on purpose: one gevent greenlet per connection, raw keep-alive
sockets with hand-parsed HTTP/1.1 (Content-Length and chunked), no HTTP library. It runs in
this process, so at concurrency 32 it competes with the router and the upstream for the
CPUs (its own CPU ms/request is printed too).

Every child process is stopped by PID on exit. ``--check`` exits 1 if the goals (router CPU
<= 0.5 ms/request, added p50 <= 0.5 ms at concurrency 1, added TTFC p50 <= 0.5 ms at
concurrency 1) are not met.
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import shutil
import signal
import socket as std_socket
import statistics
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import gevent
from gevent import socket as gsocket

from continuum.devtools.procs import Child, child_env, free_port, wait_http, wait_until

ROOT = Path(__file__).resolve().parents[2]
PYTHON = sys.executable
MODEL = "bench-model"
CLK_TCK = os.sysconf("SC_CLK_TCK")

#: Goals from the issue, in milliseconds.
GOAL_CPU_MS = 0.5
GOAL_ADDED_P50_MS = 0.5
GOAL_ADDED_TTFC_MS = 0.5

#: Reference points measured on a comparable 2-core machine (from the issue).
REFERENCES = [
    ("vllm-router (Rust)", "+0.23 ms p50 at c=1, 0.11-0.17 ms CPU/request"),
    ("naive Falcon+gevent+requests proxy", "+1.6 ms p50 at c=1, 1.3-1.6 ms CPU/request"),
    ("LiteLLM", "+17.5 ms p50 at c=1"),
]


# --------------------------------------------------------------------------- processes


def _stat_fields(pid: int) -> list[str]:
    with open(f"/proc/{pid}/stat") as f:
        data = f.read()
    # The command name (field 2) may contain spaces and parentheses: split after the last ")".
    return data[data.rindex(")") + 2:].split()


def cpu_seconds(pid: int) -> float:
    """utime + stime of ``pid`` in seconds (this thread group only, not its children)."""
    fields = _stat_fields(pid)
    return (int(fields[11]) + int(fields[12])) / CLK_TCK  # fields 14 and 15 of proc(5)


def machine_busy_seconds() -> float:
    """CPU seconds spent busy by the whole machine (all CPUs), from ``/proc/stat``."""
    with open("/proc/stat") as f:
        fields = f.readline().split()[1:]
    # user nice system idle iowait irq softirq steal ...: everything but idle and iowait.
    ticks = [int(x) for x in fields[:8]]
    return (sum(ticks) - ticks[3] - ticks[4]) / CLK_TCK


def children_of(ppid: int) -> list[int]:
    """PIDs whose parent is ``ppid``."""
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            if int(_stat_fields(int(entry))[1]) == ppid:
                found.append(int(entry))
        except (OSError, ValueError, IndexError):
            continue
    return sorted(found)


def pythonpath_env(pythonpath: str) -> dict[str, str]:
    """A local child's environment with ``pythonpath`` first on its module path."""
    path = os.pathsep.join(p for p in (pythonpath, os.environ.get("PYTHONPATH")) if p)
    return child_env({"PYTHONPATH": path, "PYTHONUNBUFFERED": "1"})


def start_upstream(tmp: Path, chunks: int, chunk_delay_ms: float) -> tuple[Child, int]:
    port = free_port()
    argv = [PYTHON, "-m", "tools.bench.upstream", "--port", str(port), "--model", MODEL,
            "--chunks", str(chunks), "--chunk-delay-ms", str(chunk_delay_ms)]
    child = Child(argv, tmp / "upstream.log", name="upstream", env=pythonpath_env(str(ROOT)),
                  cwd=tmp)
    wait_http(f"http://127.0.0.1:{port}/health", 20, children=[child])
    return child, port


def start_router(tmp: Path, upstream_port: int, workers: int, src: str,
                 extra_config: dict[str, Any] | None = None,
                 python: str = PYTHON) -> tuple[Child, int]:
    """gunicorn + gevent worker(s) with a one-backend config (plus ``extra_config``
    sections), run by the interpreter ``python`` (default: this one, which must have the
    router's dependencies); cwd is ``tmp`` so that the ``continuum`` imported is the one
    from ``src`` (default: this checkout)."""
    port = free_port()
    config = tmp / "router.yaml"
    # JSON is YAML: no PyYAML needed here.
    config.write_text(json.dumps({
        "server": {"bind": f"127.0.0.1:{port}", "workers": workers, "log_level": "warning"},
        "health_check": {"enabled": True, "interval_seconds": 3600},
        "backends": [{"name": "bench", "url": f"http://127.0.0.1:{upstream_port}",
                      "models": [MODEL]}],
        "admin": {"allow_unauthenticated": True},  # 127.0.0.1 only: serving_workers
        **(extra_config or {}),
    }, indent=2))
    metrics_dir = tmp / "metrics"
    metrics_dir.mkdir(exist_ok=True)
    env = pythonpath_env(src)
    env["CONTINUUM_CONFIG"] = str(config)
    env["PROMETHEUS_MULTIPROC_DIR"] = str(metrics_dir)
    argv = [python, "-m", "gunicorn", "-c", "python:continuum.gunicorn_conf",
            "continuum.app:get_app()"]
    child = Child(argv, tmp / "router.log", name="router", env=env, cwd=tmp)
    wait_http(f"http://127.0.0.1:{port}/health", 30, children=[child])
    wait_until(lambda: len(children_of(child.pid)) >= workers, "the router's workers", 20,
               children=[child])
    if workers > 1:
        # A worker still booting accepts nothing: connections opened meanwhile all stay
        # with the workers already serving (one run put every connection on one worker).
        wait_until(lambda: serving_workers(port, workers) == set(children_of(child.pid)),
                   "every router worker to serve", 30, children=[child])
    return child, port


def serving_workers(port: int, workers: int) -> set[int]:
    """The PIDs of the workers that answer ``2 * workers`` connections opened at once
    (``/admin/backends`` names the worker that answered; the bench's router config opens
    the admin endpoints to 127.0.0.1 without a token)."""
    conns = [http.client.HTTPConnection("127.0.0.1", port, timeout=10)
             for _ in range(2 * workers)]
    pids: set[int] = set()
    try:
        for conn in conns:
            conn.connect()  # all open before any is used
        for conn in conns:
            conn.request("GET", "/admin/backends")
            resp = conn.getresponse()
            body = resp.read()
            if resp.status == 200:
                pids.add(int(json.loads(body)["worker_pid"]))
    finally:
        for conn in conns:
            conn.close()
    return pids


def start_py_spy(out: str, pid: int, tmp: Path) -> Child:
    """Record ``pid`` with py-spy until stopped (SIGINT makes it write ``out``)."""
    exe = shutil.which("py-spy") or str(Path(PYTHON).parent / "py-spy")
    if not os.path.exists(exe):
        raise BenchError("--py-spy needs py-spy (pip install py-spy)")
    fmt = {".svg": "flamegraph", ".json": "speedscope"}.get(Path(out).suffix, "raw")
    argv = [exe, "record", "--pid", str(pid), "--rate", "500", "--nonblocking",
            "--format", fmt, "--output", str(Path(out).resolve())]
    child = Child(argv, tmp / "py-spy.log", name="py-spy", cwd=tmp)
    time.sleep(1.0)  # attach before the load starts
    if not child.running():
        raise BenchError("py-spy did not start:\n" + child.log_tail())
    return child


def stop_py_spy(child: Child) -> None:
    child.stop(signal.SIGINT, timeout=30)


# --------------------------------------------------------------------------- load


class BenchError(Exception):
    pass


def build_request(port: int, stream: bool) -> bytes:
    """A small, typical chat completion request as raw HTTP/1.1 bytes."""
    body = json.dumps({
        "model": MODEL,
        "messages": [{"role": "system", "content": "You are a helpful assistant."},
                     {"role": "user", "content": "Say hello in five words."}],
        "max_tokens": 16,
        "temperature": 0.0,
        "stream": stream,
    }).encode()
    head = (
        f"POST /v1/chat/completions HTTP/1.1\r\n"
        f"Host: 127.0.0.1:{port}\r\n"
        f"User-Agent: continuum-bench/1\r\n"
        f"Accept: {'text/event-stream' if stream else 'application/json'}\r\n"
        f"Authorization: Bearer sk-bench\r\n"
        f"Content-Type: application/json\r\n"
        f"Content-Length: {len(body)}\r\n\r\n"
    ).encode()
    return head + body


class Conn:
    """One keep-alive client connection with a minimal HTTP/1.1 response parser."""

    def __init__(self, port: int, timeout: float) -> None:
        self.port = port
        self.timeout = timeout
        self.sock: Any = None
        self.buf = b""
        self.connect()

    def connect(self) -> None:
        self.close()
        sock = gsocket.create_connection(("127.0.0.1", self.port), timeout=self.timeout)
        sock.setsockopt(std_socket.IPPROTO_TCP, std_socket.TCP_NODELAY, 1)
        self.sock = sock
        self.buf = b""

    def close(self) -> None:
        if self.sock is not None:
            self.sock.close()
            self.sock = None

    def _fill(self) -> None:
        data = self.sock.recv(65536)
        if not data:
            raise BenchError("connection closed by the server")
        self.buf += data

    def request(self, payload: bytes) -> tuple[int, dict[bytes, bytes], float | None]:
        """Send ``payload`` and read the whole answer.

        Returns (status, headers, perf_counter time of the first ``data:`` bytes or None).
        """
        self.sock.sendall(payload)
        end = self.buf.find(b"\r\n\r\n")
        while end < 0:
            self._fill()
            end = self.buf.find(b"\r\n\r\n")
        head, self.buf = self.buf[:end], self.buf[end + 4:]
        lines = head.split(b"\r\n")
        status = int(lines[0][9:12])
        headers = {}
        for line in lines[1:]:
            name, _, value = line.partition(b":")
            headers[name.strip().lower()] = value.strip()
        first_data = None
        if b"content-length" in headers:
            length = int(headers[b"content-length"])
            while len(self.buf) < length:
                self._fill()
            body, self.buf = self.buf[:length], self.buf[length:]
            if b"data:" in body:
                first_data = time.perf_counter()
        elif headers.get(b"transfer-encoding", b"").lower() == b"chunked":
            while True:
                nl = self.buf.find(b"\r\n")
                while nl < 0:
                    self._fill()
                    nl = self.buf.find(b"\r\n")
                size = int(self.buf[:nl].split(b";", 1)[0], 16)
                self.buf = self.buf[nl + 2:]
                if size == 0:
                    while True:  # trailers, then an empty line
                        nl = self.buf.find(b"\r\n")
                        while nl < 0:
                            self._fill()
                            nl = self.buf.find(b"\r\n")
                        line, self.buf = self.buf[:nl], self.buf[nl + 2:]
                        if not line:
                            break
                    break
                while len(self.buf) < size + 2:
                    self._fill()
                if first_data is None and b"data:" in self.buf[:size]:
                    first_data = time.perf_counter()
                self.buf = self.buf[size + 2:]
        else:
            raise BenchError("response has neither Content-Length nor chunked encoding")
        if headers.get(b"connection", b"").lower() == b"close":
            self.connect()
        return status, headers, first_data


@dataclass
class Phase:
    """One measured run: a target, streaming or not, at one concurrency."""

    mode: str
    stream: bool
    concurrency: int
    #: The suite configuration the phase ran in ("" outside ``--suite goals``).
    config: str = ""
    #: SSE records per streamed answer.
    chunks: int = 0
    requests: int = 0
    errors: int = 0
    seconds: float = 0.0
    rps: float = 0.0
    p50_ms: float = 0.0
    p99_ms: float = 0.0
    mean_ms: float = 0.0
    ttfc_p50_ms: float | None = None
    ttfc_p99_ms: float | None = None
    router_cpu_ms_per_req: float | None = None
    upstream_cpu_ms_per_req: float | None = None
    client_cpu_ms_per_req: float | None = None
    #: CPU used by processes other than the router, the upstream and this client during the
    #: phase, in % of one CPU: high values mean the machine was shared and latencies suffer.
    others_cpu_pct: float | None = None
    #: Clock ticks the router CPU figure rests on (its resolution is one tick).
    router_cpu_ticks: int | None = None
    #: With several router workers: each one's share of the router CPU of the phase.
    worker_cpu_shares: list[float] | None = None
    statuses: dict[str, int] = field(default_factory=dict)


def percentile(values: list[float], q: float) -> float:
    """Nearest-rank percentile of an already sorted list."""
    if not values:
        return float("nan")
    rank = max(1, min(len(values), int(q / 100 * len(values) + 0.999999)))
    return values[rank - 1]


class Load:
    """Runs ``count`` requests over ``conns`` in parallel, bounded in time."""

    def __init__(self, conns: list[Conn], payload: bytes, stream: bool, check_router: bool):
        self.conns = conns
        self.payload = payload
        self.stream = stream
        self.check_router = check_router
        self.latencies: list[float] = []
        self.ttfcs: list[float] = []
        self.errors = 0
        self.statuses: dict[str, int] = {}
        self.remaining = 0
        self.deadline = 0.0

    def _loop(self, conn: Conn) -> None:
        perf = time.perf_counter
        payload, stream = self.payload, self.stream
        while self.remaining > 0 and perf() < self.deadline:
            self.remaining -= 1  # greenlets switch only at I/O: no lock needed
            t0 = perf()
            try:
                status, headers, first = conn.request(payload)
            except (OSError, BenchError, ValueError) as exc:
                self.errors += 1
                self.statuses[type(exc).__name__] = self.statuses.get(type(exc).__name__, 0) + 1
                try:
                    conn.connect()
                except OSError:
                    return
                continue
            t1 = perf()
            key = str(status)
            self.statuses[key] = self.statuses.get(key, 0) + 1
            if status != 200:
                self.errors += 1
                continue
            if self.check_router and b"x-continuum-backend" not in headers:
                raise BenchError("answer did not come through the router")
            self.latencies.append(t1 - t0)
            if stream:
                if first is None:
                    self.errors += 1
                    continue
                self.ttfcs.append(first - t0)

    def run(self, count: int, max_seconds: float) -> float:
        self.remaining = count
        start = time.perf_counter()
        self.deadline = start + max_seconds
        greenlets = [gevent.spawn(self._loop, c) for c in self.conns]
        try:
            gevent.joinall(greenlets, raise_error=True)
        finally:
            gevent.killall(greenlets)
        return time.perf_counter() - start


def run_phase(mode: str, port: int, stream: bool, concurrency: int, count: int, warmup: int,
              max_seconds: float, router: Child | None, upstream: Child, *,
              marked: bool = True) -> Phase:
    """One measured phase; ``marked``: the router's answers carry ``X-Continuum-Backend``
    (checked on each; False for another proxy measured the same way)."""
    conns = [Conn(port, timeout=30) for _ in range(concurrency)]
    try:
        payload = build_request(port, stream)
        is_router = mode == "router" and marked
        Load(conns, payload, stream, is_router).run(max(warmup, 5 * concurrency), max_seconds)
        workers = children_of(router.pid) if router is not None else []
        if router is not None and not workers:
            raise BenchError("router has no worker process")
        ours = [upstream.pid, *([router.pid, *workers] if router is not None else [])]
        m0 = machine_busy_seconds()
        o0 = sum(cpu_seconds(p) for p in ours)
        w0 = [cpu_seconds(p) for p in workers]
        r0 = sum(w0)
        u0 = cpu_seconds(upstream.pid)
        c0 = time.process_time()
        load = Load(conns, payload, stream, is_router)
        seconds = load.run(count, max_seconds)
        c1 = time.process_time()
        m1 = machine_busy_seconds()
        o1 = sum(cpu_seconds(p) for p in ours)
        u1 = cpu_seconds(upstream.pid)
        if router is not None:
            if children_of(router.pid) != workers:
                raise BenchError("a router worker restarted during the phase")
            w1 = [cpu_seconds(p) for p in workers]
            r1 = sum(w1)
    finally:
        for c in conns:
            c.close()
    lat = sorted(load.latencies)
    ttfc = sorted(load.ttfcs)
    n = len(lat)
    if n == 0:
        raise BenchError(f"{mode} stream={stream} c={concurrency}: no successful request "
                         f"({load.statuses})")
    done = n + load.errors
    phase = Phase(
        mode=mode, stream=stream, concurrency=concurrency, requests=n, errors=load.errors,
        seconds=round(seconds, 3), rps=round(n / seconds, 1),
        p50_ms=percentile(lat, 50) * 1e3, p99_ms=percentile(lat, 99) * 1e3,
        mean_ms=sum(lat) / n * 1e3,
        upstream_cpu_ms_per_req=(u1 - u0) / done * 1e3,
        client_cpu_ms_per_req=(c1 - c0) / done * 1e3,
        # Clock-tick resolution makes this meaningless for very short phases.
        others_cpu_pct=(max(0.0, (m1 - m0) - (o1 - o0) - (c1 - c0)) / seconds * 100
                        if seconds >= 1.0 else None),
        statuses=load.statuses,
    )
    if stream:
        phase.ttfc_p50_ms = percentile(ttfc, 50) * 1e3
        phase.ttfc_p99_ms = percentile(ttfc, 99) * 1e3
    if router is not None:
        phase.router_cpu_ms_per_req = (r1 - r0) / done * 1e3
        phase.router_cpu_ticks = round((r1 - r0) * CLK_TCK)
        if len(workers) > 1 and r1 > r0:
            phase.worker_cpu_shares = [round((b - a) / (r1 - r0), 3)
                                       for a, b in zip(w0, w1, strict=True)]
    return phase


# --------------------------------------------------------------------------- report


def figure(value: float | None, digits: int = 3) -> str:
    """``value`` with ``digits`` decimals for a table, ``-`` when there is none."""
    return "-" if value is None else f"{value:.{digits}f}"


def compare(phases: list[Phase]) -> list[dict[str, Any]]:
    """Router minus direct for every (stream, concurrency)."""
    by_key = {(p.mode, p.stream, p.concurrency): p for p in phases}
    rows = []
    for p in phases:
        if p.mode != "router":
            continue
        d = by_key.get(("direct", p.stream, p.concurrency))
        if d is None:
            continue
        rows.append({
            "stream": p.stream,
            "concurrency": p.concurrency,
            "added_p50_ms": p.p50_ms - d.p50_ms,
            "added_p99_ms": p.p99_ms - d.p99_ms,
            "added_ttfc_p50_ms": (None if p.ttfc_p50_ms is None or d.ttfc_p50_ms is None
                                  else p.ttfc_p50_ms - d.ttfc_p50_ms),
            "added_ttfc_p99_ms": (None if p.ttfc_p99_ms is None or d.ttfc_p99_ms is None
                                  else p.ttfc_p99_ms - d.ttfc_p99_ms),
            "router_cpu_ms_per_req": p.router_cpu_ms_per_req,
            "direct_rps": d.rps,
            "router_rps": p.rps,
        })
    return rows


def goals(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The issue's goals, each with the measured value and whether it is met."""
    out = []
    worst_cpu = max((r["router_cpu_ms_per_req"] for r in rows), default=None)
    if worst_cpu is not None:
        out.append({"goal": f"router CPU <= {GOAL_CPU_MS} ms/request (worst phase)",
                    "value_ms": worst_cpu, "met": worst_cpu <= GOAL_CPU_MS})
    for r in rows:
        if r["concurrency"] != 1:
            continue
        if not r["stream"]:
            out.append({"goal": f"added p50 <= {GOAL_ADDED_P50_MS} ms at c=1 (non-streaming)",
                        "value_ms": r["added_p50_ms"],
                        "met": r["added_p50_ms"] <= GOAL_ADDED_P50_MS})
        elif r["added_ttfc_p50_ms"] is not None:
            out.append({"goal": f"added TTFC p50 <= {GOAL_ADDED_TTFC_MS} ms at c=1 (streaming, "
                                "reused connection)",
                        "value_ms": r["added_ttfc_p50_ms"],
                        "met": r["added_ttfc_p50_ms"] <= GOAL_ADDED_TTFC_MS})
    return out


def interpreter() -> str:
    """This interpreter's version and path, for the reports (the routers and layers they
    start run on it): builds of one version differ by 20 % in router CPU here (see
    tools/bench/README.md, seventh round)."""
    return f"{sys.version.split()[0]} ({sys.executable})"


def print_report(phases: list[Phase], rows: list[dict[str, Any]], checks: list[dict[str, Any]],
                 info: dict[str, Any]) -> None:
    print(f"# continuum router overhead  ({info['cpus']} CPUs, python {info['python']}, "
          f"{info['workers']} gevent worker(s), {info['chunks']} SSE chunks/stream)")
    print()
    head = (f"{'mode':<7}{'stream':>7}{'conc':>6}{'reqs':>7}{'err':>5}{'req/s':>9}"
            f"{'p50 ms':>9}{'p99 ms':>9}{'ttfc50':>9}{'ttfc99':>9}"
            f"{'router':>10}{'upstr':>10}{'client':>10}{'others':>8}")
    print(head)
    print(f"{'':<7}{'':>7}{'':>6}{'':>7}{'':>5}{'':>9}{'':>9}{'':>9}{'ms':>9}{'ms':>9}"
          f"{'cpu ms/rq':>10}{'cpu ms/rq':>10}{'cpu ms/rq':>10}{'cpu %':>8}")
    print("-" * len(head))
    for p in phases:
        print(f"{p.mode:<7}{'yes' if p.stream else 'no':>7}{p.concurrency:>6}{p.requests:>7}"
              f"{p.errors:>5}{p.rps:>9.0f}{p.p50_ms:>9.3f}{p.p99_ms:>9.3f}"
              f"{figure(p.ttfc_p50_ms):>9}{figure(p.ttfc_p99_ms):>9}"
              f"{figure(p.router_cpu_ms_per_req):>10}{figure(p.upstream_cpu_ms_per_req):>10}"
              f"{figure(p.client_cpu_ms_per_req):>10}{figure(p.others_cpu_pct, 0):>8}")
    print()
    print("# added by the router (router - direct)")
    head = (f"{'stream':<7}{'conc':>6}{'+p50 ms':>10}{'+p99 ms':>10}{'+ttfc50':>10}"
            f"{'+ttfc99':>10}{'cpu ms/req':>12}{'req/s direct':>14}{'req/s router':>14}")
    print(head)
    print("-" * len(head))
    for r in rows:
        print(f"{'yes' if r['stream'] else 'no':<7}{r['concurrency']:>6}"
              f"{r['added_p50_ms']:>10.3f}{r['added_p99_ms']:>10.3f}"
              f"{figure(r['added_ttfc_p50_ms']):>10}{figure(r['added_ttfc_p99_ms']):>10}"
              f"{figure(r['router_cpu_ms_per_req']):>12}{r['direct_rps']:>14.0f}"
              f"{r['router_rps']:>14.0f}")
    coarse = [p for p in phases if p.router_cpu_ticks is not None and p.router_cpu_ticks < 100]
    busy = [p for p in phases if (p.others_cpu_pct or 0) > 20]
    if coarse:
        print(f"  note: some router CPU figures rest on < 100 clock ticks ({1000 / CLK_TCK:.0f} ms "
              "each): raise --requests-* for precision")
    if busy:
        print("  note: other processes used > 20% of a CPU during some phases: latencies and "
              "req/s are disturbed (CPU ms/request much less so)")
    print()
    print("# goals")
    for g in checks:
        print(f"  [{'ok' if g['met'] else 'MISSED'}] {g['goal']}: {g['value_ms']:.3f} ms")
    print("# reference points (same kind of machine)")
    for name, text in REFERENCES:
        print(f"  {name}: {text}")


# --------------------------------------------------------------------------- goal suite

#: The issue's goals (issue 18).
GOAL_PAH_EXTRA_US = 10.0       # PrefixAwareHash minus RoundRobin, router CPU per request
GOAL_PAH_CPU_C32_MS = 0.15     # non-streaming, c=32, PrefixAwareHash
GOAL_PAH_ADDED_P50_MS = 0.3    # non-streaming, c=1, PrefixAwareHash
GOAL_CHUNK_C32_US = 20.0       # 200-chunk streams, router CPU per relayed chunk, c=32
GOAL_CHUNK_C1_US = 40.0        # the same at c=1
GOAL_TTFC_MS = 0.5             # added time to first chunk, c=1
GOAL_SCALE = 1.8               # req/s of 2 workers over 1 (non-streaming, c=32)

PREFIX_ROUTING = {"selection_strategy": "PrefixAwareHash", "prefix_routing": {"enabled": True}}


@dataclass
class SuiteConfig:
    """One router setup of the goal suite and the phases measured against it."""

    name: str
    extra: dict[str, Any]
    workers: int
    chunks: int
    #: (stream, concurrency, requests, with a direct phase alongside)
    phases: list[tuple[bool, int, int, bool]]
    chunk_delay_ms: float = 0.0


def suite_configs(args: argparse.Namespace) -> list[SuiteConfig]:
    n1, n32, s1, l1, l32 = (args.requests_c1, args.requests_c32, args.stream_requests_c1,
                            args.long_requests_c1, args.long_requests_c32)
    short = [(False, 1, n1, True), (False, 32, n32, True), (True, 1, s1, True)]
    return [
        SuiteConfig("rr", {}, 1, args.chunks, short),
        SuiteConfig("pah", PREFIX_ROUTING, 1, args.chunks, short),
        SuiteConfig("pah-long", PREFIX_ROUTING, 1, args.long_chunks,
                    [(True, 1, l1, False), (True, 32, l32, False)],
                    args.long_chunk_delay_ms),
        SuiteConfig("pah-2w", PREFIX_ROUTING, 2, args.chunks, [(False, 32, n32, False)]),
    ]


def best_of(runs: list[Phase]) -> Phase:
    """The fieldwise best of repeated runs of one phase: the least CPU, latency and TTFC
    and the most req/s (on a shared machine the quietest run is the truest one)."""
    best = Phase(**{**asdict(runs[0]), "statuses": dict(runs[0].statuses)})
    for p in runs[1:]:
        best.rps = max(best.rps, p.rps)
        best.requests += p.requests
        best.errors += p.errors
        for name in ("p50_ms", "p99_ms", "mean_ms", "ttfc_p50_ms", "ttfc_p99_ms",
                     "router_cpu_ms_per_req", "upstream_cpu_ms_per_req",
                     "client_cpu_ms_per_req", "others_cpu_pct"):
            a, b = getattr(best, name), getattr(p, name)
            if b is not None and (a is None or b < a):
                setattr(best, name, b)
    return best


def run_suite(args: argparse.Namespace, tmp: Path, children: list[Child]) -> list[Phase]:
    """Every configuration of the suite, each with its own upstream and router, every
    phase ``--repeat`` times (alternating direct and router), best run kept."""
    phases: list[Phase] = []
    for cfg in suite_configs(args):
        if args.only and cfg.name not in args.only:
            continue
        sub = tmp / cfg.name
        sub.mkdir()
        delay = cfg.chunk_delay_ms if cfg.name == "pah-long" else args.chunk_delay_ms
        upstream, up_port = start_upstream(sub, cfg.chunks, delay)
        children.append(upstream)
        router, router_port = start_router(sub, up_port, cfg.workers, args.router_src,
                                           cfg.extra)
        children.append(router)
        try:
            for stream, conc, count, direct in cfg.phases:
                targets = ([("direct", up_port, None)] if direct else []) + \
                    [("router", router_port, router)]
                runs: dict[str, list[Phase]] = {}
                for _ in range(args.repeat):
                    for mode, port, rt in targets:
                        phase = run_phase(mode, port, stream, conc, count, args.warmup,
                                          args.max_seconds, rt, upstream)
                        runs.setdefault(mode, []).append(phase)
                        print(f"  done: {cfg.name:<8} {mode:<6} stream="
                              f"{'yes' if stream else 'no ':<3} c={conc:<3} "
                              f"{phase.requests} requests in {phase.seconds:.1f}s, router cpu "
                              f"{figure(phase.router_cpu_ms_per_req)} ms/rq",
                              file=sys.stderr, flush=True)
                for mode, _port, _rt in targets:
                    best = best_of(runs[mode])
                    best.config, best.chunks = cfg.name, cfg.chunks
                    phases.append(best)
        finally:
            for child in (router, upstream):
                child.stop()
                children.remove(child)
    return phases


#: The routers :func:`run_pairs` runs side by side.
PAIRED = (("rr", None), ("pah", PREFIX_ROUTING))


def run_pairs(args: argparse.Namespace, tmp: Path, children: list[Child]) -> list[Phase]:
    """PrefixAwareHash - RoundRobin measured in pairs: a RoundRobin and a PrefixAwareHash
    router up at once in front of one upstream, their non-streaming phases (c=32, then
    c=1) taking turns, the first of each pair alternating, ``--repeat`` pairs of each. The
    ``rr`` and ``pah`` configurations run a minute apart, and this machine's speed drifts
    by more than the 10 us goal in a minute; two runs seconds apart drift less. Phases
    are labelled ``pair<i>-rr`` and ``pair<i>-pah`` (:func:`paired_differences`)."""
    sub = tmp / "pair"
    sub.mkdir()
    upstream, up_port = start_upstream(sub, args.chunks, args.chunk_delay_ms)
    children.append(upstream)
    routers: list[tuple[str, Child, int]] = []
    phases: list[Phase] = []
    try:
        for name, extra in PAIRED:
            (sub / name).mkdir()
            router, port = start_router(sub / name, up_port, 1, args.router_src, extra)
            children.append(router)
            routers.append((name, router, port))
        for i in range(args.repeat):
            for conc, count in ((32, args.requests_c32), (1, args.requests_c1)):
                for name, router, port in routers if i % 2 == 0 else routers[::-1]:
                    phase = run_phase("router", port, False, conc, count, args.warmup,
                                      args.max_seconds, router, upstream)
                    phase.config = f"pair{i}-{name}"
                    phases.append(phase)
                    print(f"  done: pair {i} {name:<3} c={conc:<3} {phase.requests} requests, "
                          f"router cpu {figure(phase.router_cpu_ms_per_req)} ms/rq",
                          file=sys.stderr, flush=True)
    finally:
        for _name, router, _port in routers:
            router.stop()
            children.remove(router)
        upstream.stop()
        children.remove(upstream)
    return phases


def paired_differences(phases: list[Phase]) -> dict[int, list[float]]:
    """Concurrency -> PrefixAwareHash - RoundRobin router CPU per request of each pair
    :func:`run_pairs` ran, in microseconds."""
    cpu: dict[tuple[str, int], float] = {}
    for p in phases:
        if p.config.startswith("pair") and p.router_cpu_ms_per_req is not None:
            cpu[(p.config, p.concurrency)] = p.router_cpu_ms_per_req
    out: dict[int, list[float]] = {}
    for (config, conc), value in sorted(cpu.items()):
        pair, _, name = config.rpartition("-")
        if name == "pah" and (f"{pair}-rr", conc) in cpu:
            out.setdefault(conc, []).append((value - cpu[(f"{pair}-rr", conc)]) * 1e3)
    return out


def suite_goals(phases: list[Phase]) -> list[dict[str, Any]]:
    """Each goal of the issue with its measured value, unit and verdict (missing phases
    are left out)."""
    by = {(p.config, p.mode, p.stream, p.concurrency): p for p in phases}

    def get(config: str, mode: str, stream: bool, conc: int) -> Phase | None:
        return by.get((config, mode, stream, conc))

    out: list[dict[str, Any]] = []

    def add(goal: str, value: float | None, limit: float, unit: str,
            higher_is_better: bool = False) -> None:
        if value is None:
            return
        met = value >= limit if higher_is_better else value <= limit
        out.append({"goal": goal, "value": value, "limit": limit, "unit": unit, "met": met})

    pairs = paired_differences(phases)
    for conc in (32, 1):
        diffs = pairs.get(conc)
        if diffs:  # the paired figure when there is one (run_pairs)
            add(f"PrefixAwareHash - RoundRobin router CPU/request, non-streaming c={conc}, "
                f"median of {len(diffs)} pairs ({', '.join(f'{d:.0f}' for d in diffs)})",
                statistics.median(diffs), GOAL_PAH_EXTRA_US, "us")
            continue
        rr, pah = get("rr", "router", False, conc), get("pah", "router", False, conc)
        if rr and pah and rr.router_cpu_ms_per_req is not None \
                and pah.router_cpu_ms_per_req is not None:
            add(f"PrefixAwareHash - RoundRobin router CPU/request, non-streaming c={conc}",
                (pah.router_cpu_ms_per_req - rr.router_cpu_ms_per_req) * 1e3,
                GOAL_PAH_EXTRA_US, "us")
    pah32 = get("pah", "router", False, 32)
    if pah32:
        add("router CPU/request, PrefixAwareHash, non-streaming c=32",
            pah32.router_cpu_ms_per_req, GOAL_PAH_CPU_C32_MS, "ms")
    for config in ("pah", "rr"):
        r, d = get(config, "router", False, 1), get(config, "direct", False, 1)
        if r and d:
            add(f"added p50, {config}, non-streaming c=1", r.p50_ms - d.p50_ms,
                GOAL_PAH_ADDED_P50_MS, "ms")
    for conc, limit in ((32, GOAL_CHUNK_C32_US), (1, GOAL_CHUNK_C1_US)):
        p = get("pah-long", "router", True, conc)
        if p and p.router_cpu_ms_per_req is not None and p.chunks:
            add(f"router CPU per relayed chunk, {p.chunks}-chunk streams, c={conc}",
                p.router_cpu_ms_per_req / p.chunks * 1e3, limit, "us")
    for config in ("pah", "rr"):
        r, d = get(config, "router", True, 1), get(config, "direct", True, 1)
        if r and d and r.ttfc_p50_ms is not None and d.ttfc_p50_ms is not None:
            add(f"added TTFC p50, {config}, streaming c=1", r.ttfc_p50_ms - d.ttfc_p50_ms,
                GOAL_TTFC_MS, "ms")
    one, two = get("pah", "router", False, 32), get("pah-2w", "router", False, 32)
    if one and two:
        add("req/s 2 workers / 1 worker, PrefixAwareHash, non-streaming c=32 (Python load "
            "and upstream on the same CPUs)", two.rps / one.rps, GOAL_SCALE, "x",
            higher_is_better=True)
    return out


def scaling_goal(args: argparse.Namespace, children: list[Child]) -> dict[str, Any] | None:
    """The 2-worker goal again with ``wrk`` and ``nginx`` as load and upstream
    (:mod:`tools.bench.scaling`, one round of each shape), when both are installed: the
    Python ones leave the second worker no core on a 2-CPU machine. None without them."""
    from tools.bench import scaling

    if not (shutil.which("wrk") and scaling.nginx_binary()):
        print("  (wrk or nginx missing: no 2-worker run with C load; apt-get install wrk "
              "nginx-light)", file=sys.stderr)
        return None
    tmp = Path(tempfile.mkdtemp(prefix="continuum-scaling-"))
    try:
        nginx, port = scaling.start_nginx(tmp)
        children.append(nginx)
        opts = argparse.Namespace(router_src=args.router_src, concurrency=32, seconds=10)
        rounds = [scaling.measure(workers, nginx, port, tmp, opts, children)
                  for _ in range(args.repeat) for workers in (1, 2)]
        nginx.stop()
        children.remove(nginx)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    summary = scaling.summarize(rounds, os.cpu_count() or 1)
    value = summary["ratio"]
    return {"goal": "req/s 2 workers / 1 worker, PrefixAwareHash, non-streaming c=32, wrk + "
                    f"nginx (CPU ceiling here {summary['ceiling_ratio']:.2f} x)",
            "value": value, "limit": GOAL_SCALE, "unit": "x", "met": value >= GOAL_SCALE}


def print_suite(phases: list[Phase], checks: list[dict[str, Any]], info: dict[str, Any]) -> None:
    print(f"# continuum router overhead, goal suite  ({info['cpus']} CPUs, python "
          f"{info['python']}, best of {info['repeat']} run(s) per phase)")
    print()
    head = (f"{'config':<10}{'mode':<7}{'stream':>7}{'chunks':>7}{'conc':>6}{'reqs':>7}"
            f"{'err':>5}{'req/s':>9}{'p50 ms':>9}{'ttfc50':>9}{'router':>10}{'per chunk':>10}"
            f"{'others':>8}")
    print(head)
    print(f"{'':<10}{'':<7}{'':>7}{'':>7}{'':>6}{'':>7}{'':>5}{'':>9}{'':>9}{'ms':>9}"
          f"{'cpu ms/rq':>10}{'cpu us':>10}{'cpu %':>8}")
    print("-" * len(head))
    for p in phases:
        per_chunk = (p.router_cpu_ms_per_req / p.chunks * 1e3
                     if p.stream and p.router_cpu_ms_per_req is not None and p.chunks else None)
        print(f"{p.config:<10}{p.mode:<7}{'yes' if p.stream else 'no':>7}"
              f"{p.chunks if p.stream else '':>7}{p.concurrency:>6}{p.requests:>7}"
              f"{p.errors:>5}{p.rps:>9.0f}{p.p50_ms:>9.3f}{figure(p.ttfc_p50_ms):>9}"
              f"{figure(p.router_cpu_ms_per_req):>10}{figure(per_chunk, 1):>10}"
              f"{figure(p.others_cpu_pct, 0):>8}")
    for p in phases:
        if p.worker_cpu_shares and p.router_cpu_ms_per_req is not None:
            shares = "/".join(f"{share:.0%}" for share in p.worker_cpu_shares)
            spent = (p.router_cpu_ms_per_req + (p.upstream_cpu_ms_per_req or 0.0)
                     + (p.client_cpu_ms_per_req or 0.0))
            ceiling = info["cpus"] * 1e3 / spent  # spent > 0: the workers used CPU
            print(f"{p.config or 'router'} c={p.concurrency}: worker CPU shares {shares}; "
                  f"at {spent:.3f} ms of CPU per request (router, upstream and client), "
                  f"{info['cpus']} CPUs allow at most {ceiling:.0f} req/s, measured "
                  f"{p.rps:.0f} ({p.rps / ceiling:.0%})")
    print()
    print("# goals (issue 18)")
    for g in checks:
        digits = {"us": 1, "x": 2}.get(g["unit"], 3)
        cmp = ">=" if g["unit"] == "x" else "<="
        print(f"  [{'ok' if g['met'] else 'MISSED'}] {g['goal']}: "
              f"{g['value']:.{digits}f} {g['unit']} ({cmp} {g['limit']} {g['unit']})")


# --------------------------------------------------------------------------- main


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m tools.bench.overhead",
        description="router vs direct: added latency, TTFC and router CPU per request",
    )
    parser.add_argument("--suite", choices=["goals", "single"], default="goals",
                        help="goals: RoundRobin, PrefixAwareHash, 200-chunk streams and 2 "
                             "workers, checked against the issue's goals; single: one router "
                             "config (--strategy, --workers, --chunks) at --concurrency")
    parser.add_argument("--repeat", type=int, default=1,
                        help="goals suite: run every phase this many times, keep the best")
    parser.add_argument("--only", nargs="+", choices=["rr", "pah", "pah-long", "pah-2w", "pair"],
                        help="goals suite: only these configurations")
    parser.add_argument("--strategy", choices=["RoundRobin", "PrefixAwareHash"],
                        default="RoundRobin",
                        help="single: the router's strategy (PrefixAwareHash turns "
                             "prefix_routing on)")
    parser.add_argument("--stream-requests-c1", type=int, default=2000,
                        help="goals suite: streamed requests per phase at concurrency 1")
    parser.add_argument("--long-chunks", type=int, default=200,
                        help="goals suite: SSE records per long stream")
    parser.add_argument("--long-chunk-delay-ms", type=float, default=1.0,
                        help="goals suite: pause between the long streams' records, as a "
                             "token stream has (0: back to back, mostly read in batches)")
    parser.add_argument("--long-requests-c1", type=int, default=50,
                        help="goals suite: long streams per phase at concurrency 1")
    parser.add_argument("--long-requests-c32", type=int, default=320,
                        help="goals suite: long streams per phase at concurrency 32")
    parser.add_argument("--requests-c1", type=int, default=5000,
                        help="measured requests per phase at concurrency 1")
    parser.add_argument("--requests-c32", type=int, default=10000,
                        help="measured requests per phase at the high concurrency")
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 32],
                        help="concurrency levels (the first is 'c=1' for the goals)")
    parser.add_argument("--warmup", type=int, default=200,
                        help="unmeasured requests before each phase (at least 5 per connection)")
    parser.add_argument("--max-seconds", type=float, default=15.0,
                        help="time limit of each measured phase")
    parser.add_argument("--stream", choices=["both", "yes", "no"], default="both")
    parser.add_argument("--chunks", type=int, default=8, help="SSE records per streamed answer")
    parser.add_argument("--chunk-delay-ms", type=float, default=0.0)
    parser.add_argument("--workers", type=int, default=1, help="router gunicorn workers")
    parser.add_argument("--router-src", default=str(ROOT),
                        help="directory put first on the router's PYTHONPATH (default: this "
                             "checkout); point it at a modified copy to compare")
    parser.add_argument("--py-spy", metavar="FILE",
                        help="profile the router worker with py-spy for the whole run; "
                             "FILE.svg = flame graph, FILE.json = speedscope, else raw stacks")
    parser.add_argument("--json", action="store_true", help="print JSON instead of tables")
    parser.add_argument("--check", action="store_true", help="exit 1 when a goal is missed")
    parser.add_argument("--keep-logs", action="store_true",
                        help="keep the temp dir with the child processes' logs")
    args = parser.parse_args(argv)
    if args.requests_c1 < 1 or args.requests_c32 < 1 or min(args.concurrency) < 1 \
            or args.repeat < 1 or args.long_chunks < 1:
        parser.error("request counts and concurrency must be positive")
    return args


def failed(exc: Exception, children: list[Child]) -> int:
    """Say why a run failed, with the end of each child's log; the exit status (2)."""
    print(f"benchmark failed: {exc}", file=sys.stderr)
    for child in children:
        print(f"--- {child.name} log (tail)\n{child.log_tail()}", file=sys.stderr)
    return 2


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    tmp = Path(tempfile.mkdtemp(prefix="continuum-bench-"))
    children: list[Child] = []
    streams = {"both": [False, True], "yes": [True], "no": [False]}[args.stream]
    phases: list[Phase] = []
    if args.suite == "goals":
        return main_suite(args, tmp)
    try:
        upstream, up_port = start_upstream(tmp, args.chunks, args.chunk_delay_ms)
        children.append(upstream)
        extra = PREFIX_ROUTING if args.strategy == "PrefixAwareHash" else None
        router, router_port = start_router(tmp, up_port, args.workers, args.router_src, extra)
        children.append(router)
        if args.py_spy:
            spy = start_py_spy(args.py_spy, children_of(router.pid)[0], tmp)
            children.append(spy)
        for stream in streams:
            for conc in args.concurrency:
                count = args.requests_c1 if conc == 1 else args.requests_c32
                for mode, port, rt in (("direct", up_port, None),
                                       ("router", router_port, router)):
                    phase = run_phase(mode, port, stream, conc, count, args.warmup,
                                      args.max_seconds, rt, upstream)
                    phases.append(phase)
                    if not args.json:
                        print(f"  done: {mode:<6} stream={'yes' if stream else 'no ':<3} "
                              f"c={conc:<3} {phase.requests} requests in {phase.seconds:.1f}s",
                              file=sys.stderr, flush=True)
    except (BenchError, RuntimeError, OSError) as exc:
        return failed(exc, children)
    finally:
        for child in reversed(children):
            if child.name == "py-spy":
                stop_py_spy(child)
            else:
                child.stop()
        if args.keep_logs:
            print(f"logs kept in {tmp}", file=sys.stderr)
        else:
            shutil.rmtree(tmp, ignore_errors=True)

    rows = compare(phases)
    checks = goals(rows)
    info = {"cpus": os.cpu_count(), "python": interpreter(), "workers": args.workers,
            "chunks": args.chunks, "router_src": args.router_src}
    if args.json:
        print(json.dumps({"info": info, "phases": [asdict(p) for p in phases],
                          "added": rows, "goals": checks}, indent=2))
    else:
        print_report(phases, rows, checks, info)
    if args.check and not all(g["met"] for g in checks):
        return 1
    return 0


def main_suite(args: argparse.Namespace, tmp: Path) -> int:
    children: list[Child] = []
    try:
        phases = run_suite(args, tmp, children)
        if not args.only or "pair" in args.only:
            phases += run_pairs(args, tmp, children)
        scaled = scaling_goal(args, children) if not args.only or "pah-2w" in args.only \
            else None
    except (BenchError, RuntimeError, OSError) as exc:
        return failed(exc, children)
    finally:
        for child in reversed(children):
            child.stop()
        if args.keep_logs:
            print(f"logs kept in {tmp}", file=sys.stderr)
        else:
            shutil.rmtree(tmp, ignore_errors=True)
    checks = suite_goals(phases)
    if scaled is not None:
        checks.append(scaled)
    info = {"cpus": os.cpu_count(), "python": interpreter(), "repeat": args.repeat,
            "chunks": args.chunks, "long_chunks": args.long_chunks,
            "router_src": args.router_src}
    if args.json:
        print(json.dumps({"info": info, "phases": [asdict(p) for p in phases],
                          "goals": checks}, indent=2))
    else:
        print_suite(phases, checks, info)
    if args.check and not all(g["met"] for g in checks):
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
