"""``continuum-router demo``: simulated engines + the router, one table per strategy.

Starts a fleet of simulated engines (``continuum-sim --fleet N``) and, for comparison, one
engine with the whole fleet's KV capacity and slots; then, for each scenario, the router
under gunicorn with gevent workers and a config built from :data:`DEFAULT_ROUTER_CONFIG`.
Every scenario replays the same seeded workload (:func:`demo_workload`) against fresh
engine caches and reports requests/s, TTFT, the engines' prefix-cache hit rate and the
router's response-cache hits. Every process started is stopped by its PID on the way out,
also on Ctrl-C or SIGTERM.

Later tiers add a row by appending a :class:`Scenario` to :data:`SCENARIOS`.
"""

from __future__ import annotations

import argparse
import copy
import functools
import json
import os
import re
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import yaml

if TYPE_CHECKING:
    import requests

    from continuum.sim.workload import Workload

RUN_ENV = "CONTINUUM_DEMO_RUN"
MODEL = "sim-model"
CACHE_HIT_METRIC = "continuum_response_cache_requests_total"

#: The router config every scenario starts from; ``backends`` and ``server.bind`` are
#: filled in at run time, then the scenario's overrides are merged in.
DEFAULT_ROUTER_CONFIG: dict[str, Any] = {
    "server": {"workers": 1, "log_level": "warning", "watch_config": False},
    "selection_strategy": "RoundRobin",
    "health_check": {"enabled": True, "interval_seconds": 2.0},
    "prefix_routing": {"enabled": False},
}


@dataclass(frozen=True)
class Scenario:
    """One row of the table: a router config (overrides of the default), or ``direct``:
    the workload sent straight to the single big engine, with no router."""

    name: str
    overrides: dict[str, Any] = field(default_factory=dict)
    direct: bool = False


SCENARIOS: list[Scenario] = [
    Scenario("single engine", direct=True),
    Scenario("RoundRobin", {"selection_strategy": "RoundRobin"}),
    Scenario(
        "PrefixAwareHash",
        {"selection_strategy": "PrefixAwareHash", "prefix_routing": {"enabled": True}},
    ),
    Scenario(
        "PrefixAwareHash + response cache",
        {
            "selection_strategy": "PrefixAwareHash",
            "prefix_routing": {"enabled": True},
            "response_cache": {"enabled": True, "backend": "memory"},
        },
    ),
]


@dataclass(frozen=True)
class FleetShape:
    """Engine knobs: scaled-down latencies, and a KV capacity per engine that holds a few
    of the workload's shared prefixes but not all of them, so locality matters."""

    engines: int = 4
    num_blocks: int = 480
    max_num_seqs: int = 4
    latency_scale: float = 0.5


def demo_workload(seed: int, quick: bool, rate: float | None = None) -> Workload:
    """The built-in workload: users sharing 8 long system prompts, multi-turn
    conversations over the same prompts, RAG questions over 4 documents; 30% of the
    single questions repeat exactly (temperature 0)."""
    from continuum.sim.workload import mixed

    if quick:
        return mixed(seed, users=40, conversations=14, rag_questions=14, rate=rate or 24.0)
    return mixed(seed, users=110, conversations=40, rag_questions=40, rate=rate or 24.0)


def merge(base: dict[str, Any], overrides: dict[str, Any]) -> dict[str, Any]:
    """``base`` with ``overrides`` merged in, recursively for nested mappings."""
    out = copy.deepcopy(base)
    for key, value in overrides.items():
        if isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = merge(out[key], value)
        else:
            out[key] = copy.deepcopy(value)
    return out


class Children:
    """The processes the demo started, stopped by PID (quick-shutdown signal, then KILL)."""

    def __init__(self, workdir: Path, run_id: str) -> None:
        self.workdir = workdir
        self.env = {**os.environ, RUN_ENV: run_id}
        for name in ("HTTP_PROXY", "HTTPS_PROXY", "ALL_PROXY", "http_proxy", "https_proxy"):
            self.env.pop(name, None)
        self.procs: list[tuple[subprocess.Popen[bytes], int]] = []
        self.pids: list[int] = []
        self.preexec = _die_with_parent()

    def spawn(
        self, argv: list[str], log: str, env: dict[str, str] | None = None, stop_signal: int = 15
    ) -> subprocess.Popen[bytes]:
        """Start ``argv`` with output to ``workdir/log``."""
        with open(self.workdir / log, "wb") as out:  # the child keeps its own descriptor
            proc = subprocess.Popen(
                argv, stdout=out, stderr=subprocess.STDOUT, env={**self.env, **(env or {})},
                stdin=subprocess.DEVNULL,
                preexec_fn=self.preexec,
            )
        self.procs.append((proc, stop_signal))
        self.pids.append(proc.pid)
        return proc

    def stop(self, proc: subprocess.Popen[bytes], timeout: float = 10.0) -> None:
        """Stop one child and wait for it."""
        sig = next((s for p, s in self.procs if p is proc), signal.SIGTERM)
        if proc.poll() is None:
            proc.send_signal(sig)
            try:
                proc.wait(timeout)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(5)
        self.procs = [(p, s) for p, s in self.procs if p is not proc]

    def stop_all(self) -> None:
        """Stop every child still running, newest first."""
        for proc, _ in reversed(list(self.procs)):
            self.stop(proc)

    def log_tail(self, log: str, lines: int = 20) -> str:
        """The end of a child's log, for error messages."""
        try:
            text = (self.workdir / log).read_text(errors="replace")
        except OSError:
            return ""
        return "\n".join(text.splitlines()[-lines:])


def _die_with_parent() -> Callable[[], None] | None:
    """A ``preexec_fn`` asking Linux to SIGTERM the child when the demo dies, so even a
    SIGKILLed demo leaves nothing behind; None elsewhere. Resolved here, in the parent: the
    child between fork and exec must not import anything."""
    if not sys.platform.startswith("linux"):
        return None
    import ctypes

    try:
        prctl = ctypes.CDLL(None, use_errno=True).prctl
    except (OSError, AttributeError):
        return None
    return functools.partial(prctl, 1, signal.SIGTERM)  # PR_SET_PDEATHSIG


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def start_engines(
    children: Children, name: str, count: int, blocks: int, slots: int, scale: float,
    timeout: float = 20.0,
) -> tuple[subprocess.Popen[bytes], list[str]]:
    """Start ``continuum-sim --fleet count`` on free ports; return it and its URLs."""
    argv = [
        sys.executable, "-m", "continuum.sim.cli", "--fleet", str(count), "--port", "0",
        "--num-blocks", str(blocks), "--max-num-seqs", str(slots),
        "--latency-scale", str(scale), "--model", MODEL,
    ]
    log = f"{name}.log"
    proc = children.spawn(argv, log)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        text = (children.workdir / log).read_text(errors="replace")
        urls = re.findall(r"^continuum-sim: engine \d+ .*?(http://\S+)", text, re.MULTILINE)
        if len(urls) == count:
            return proc, urls
        if proc.poll() is not None:
            break
        time.sleep(0.05)
    raise RuntimeError(f"simulated engines did not start:\n{children.log_tail(log)}")


def start_router(
    children: Children, http: requests.Session, config: dict[str, Any], name: str,
    timeout: float = 30.0,
) -> tuple[subprocess.Popen[bytes], str]:
    """Start the router under gunicorn with ``config``; return it once ``/health`` is 200."""
    port = _free_port()
    config = merge(config, {"server": {"bind": f"127.0.0.1:{port}"}})
    slug = _slug(name)
    path = children.workdir / f"router-{slug}.yaml"
    path.write_text(yaml.safe_dump(config, sort_keys=False))
    metrics_dir = children.workdir / f"metrics-{slug}"
    metrics_dir.mkdir()
    argv = [sys.executable, "-m", "gunicorn", "-c", "python:continuum.gunicorn_conf",
            "continuum.app:get_app()"]
    runtime_dir = children.workdir / f"runtime-{slug}"
    runtime_dir.mkdir()
    env = {"CONTINUUM_CONFIG": str(path), "PROMETHEUS_MULTIPROC_DIR": str(metrics_dir),
           "CONTINUUM_RUNTIME_DIR": str(runtime_dir)}
    log = f"router-{slug}.log"
    # SIGQUIT: gunicorn's quick shutdown (SIGTERM would wait out keep-alive connections).
    proc = children.spawn(argv, log, env, stop_signal=signal.SIGQUIT)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and proc.poll() is None:
        try:
            if http.get(url + "/health", timeout=1).status_code == 200:
                return proc, url
        except OSError:  # requests' errors are OSErrors: not listening yet
            pass
        time.sleep(0.1)
    children.stop(proc)
    raise RuntimeError(f"router ({name}) did not start:\n{children.log_tail(log)}")


def engine_stats(http: requests.Session, urls: Sequence[str]) -> list[dict[str, Any]]:
    """``GET /sim/stats`` of each engine."""
    return [http.get(u + "/sim/stats", timeout=5).json() for u in urls]


def reset_engines(http: requests.Session, urls: Sequence[str], timeout: float = 10.0) -> None:
    """Drop every engine's prefix cache (retrying while requests still run)."""
    for url in urls:
        deadline = time.monotonic() + timeout
        while http.post(url + "/reset_prefix_cache", timeout=5).status_code != 200:
            if time.monotonic() > deadline:
                raise RuntimeError(f"{url}: prefix cache reset refused for {timeout}s")
            time.sleep(0.1)


def metric_sum(text: str, name: str, **labels: str) -> float:
    """Sum of the samples of ``name`` in a Prometheus exposition whose labels match."""
    total = 0.0
    for line in text.splitlines():
        if line.startswith((name + "{", name + " ")):
            head, _, value = line.rpartition(" ")
            if all(f'{k}="{v}"' in head for k, v in labels.items()):
                total += float(value)
    return total


def router_config(scenario: Scenario, engines: Sequence[str]) -> dict[str, Any]:
    """The router config of ``scenario`` in front of ``engines`` (``server.bind`` unset)."""
    backends = [{"name": f"engine-{i}", "url": u, "models": [MODEL]} for i, u in enumerate(engines)]
    config = merge({**DEFAULT_ROUTER_CONFIG, "backends": backends}, scenario.overrides)
    return merge(config, {"admin": {"token": secrets.token_hex(16)}})


def check_scenarios(scenarios: Sequence[Scenario]) -> list[str]:
    """Every config error of the scenarios' router configs (unknown strategy, bad key …),
    found before anything is started."""
    from continuum.config import check_config
    from continuum.registry import PluginRegistry

    registry = PluginRegistry()
    problems = []
    for scenario in scenarios:
        if not scenario.direct:
            config = router_config(scenario, ["http://127.0.0.1:8000"])
            result = check_config(config, f"scenario {scenario.name!r}", registry)
            problems += [issue.render(result.source) for issue in result.errors]
    return problems


def run_scenario(
    scenario: Scenario, children: Children, http: requests.Session, workload: Workload,
    fleet: list[str], single: list[str], args: argparse.Namespace,
) -> dict[str, Any]:
    """Replay ``workload`` through one scenario; return its row."""
    from continuum.sim.replay import replay

    router = None
    engines = single if scenario.direct else fleet
    try:
        if scenario.direct:
            target = single[0]
        else:
            config = router_config(scenario, fleet)
            router, target = start_router(children, http, config, scenario.name)
        reset_engines(http, engines)
        before = engine_stats(http, engines)
        result = replay(target, workload, concurrency=args.concurrency,
                        max_seconds=args.duration, timeout=30.0)
        after = engine_stats(http, engines)
        metrics = http.get(target + "/metrics", timeout=5).text if router else ""
    finally:
        if router is not None:
            children.stop(router)
    pairs = list(zip(after, before, strict=True))
    prompt = sum(a["prompt_tokens"] - b["prompt_tokens"] for a, b in pairs)
    cached = sum(a["cached_prompt_tokens"] - b["cached_prompt_tokens"] for a, b in pairs)
    return {
        "name": scenario.name,
        "direct": scenario.direct,
        "overrides": scenario.overrides,
        **result.summary(),
        "engine_prompt_tokens": prompt,
        "engine_cached_prompt_tokens": cached,
        "prefix_hit_rate": round(cached / prompt, 4) if prompt else 0.0,
        "engine_requests": [a["requests"] - b["requests"] for a, b in pairs],
        "router_cache_hits": int(metric_sum(metrics, CACHE_HIT_METRIC, result="hit")),
        "error_samples": result.error_samples(),
    }


COLUMNS = (
    ("scenario", "name", "{}"),
    ("req/s", "requests_per_second", "{:.1f}"),
    ("TTFT mean ms", "ttft_ms_mean", "{:.1f}"),
    ("TTFT p99 ms", "ttft_ms_p99", "{:.1f}"),
    ("prefix hit %", "prefix_hit_rate", "{:.1%}"),
    ("router cache hits", "router_cache_hits", "{}"),
    ("errors", "errors", "{}"),
)


def render_table(rows: Sequence[dict[str, Any]]) -> str:
    """The result rows as an aligned text table."""
    cells = [[title for title, _, _ in COLUMNS]]
    for row in rows:
        cells.append(["-" if row[key] is None else fmt.format(row[key]).rstrip("%")
                      for _, key, fmt in COLUMNS])
    widths = [max(len(line[i]) for line in cells) for i in range(len(COLUMNS))]
    lines = [
        "  ".join(c.ljust(w) if i == 0 else c.rjust(w)
                  for i, (c, w) in enumerate(zip(line, widths, strict=True)))
        for line in cells
    ]
    return "\n".join([lines[0], "-" * len(lines[0]), *lines[1:]])


def build_parser() -> argparse.ArgumentParser:
    """The ``continuum-router demo`` argument parser."""
    p = argparse.ArgumentParser(
        prog="continuum-router demo",
        description="Start simulated engines and the router; compare strategies on one "
        "seeded workload.",
    )
    p.add_argument("--engines", type=int, default=4, help="simulated engines behind the router")
    p.add_argument("--num-blocks", type=int, default=FleetShape.num_blocks,
                   help="KV capacity of each engine, in 16-token blocks")
    p.add_argument("--max-num-seqs", type=int, default=FleetShape.max_num_seqs,
                   help="concurrent request slots of each engine")
    p.add_argument("--latency-scale", type=float, default=FleetShape.latency_scale,
                   help="multiplies every simulated latency")
    p.add_argument("--rate", type=float, help="session arrivals per second (default: built-in)")
    p.add_argument("--requests", type=int, help="cap on requests per scenario")
    p.add_argument("--duration", type=float, default=30.0,
                   help="seconds after which a scenario starts no new request")
    p.add_argument("--strategies", nargs="+", metavar="NAME",
                   help="scenarios to run (names from the table, or any strategy name); "
                   "default: all")
    p.add_argument("--seed", type=int, default=0, help="workload seed")
    p.add_argument("--concurrency", type=int, default=64, help="sessions in flight at once")
    p.add_argument("--quick", action="store_true", help="a smaller workload (CI)")
    p.add_argument("--json", action="store_true", help="print the results as JSON")
    return p


def _slug(name: str) -> str:
    return re.sub(r"\W+", "-", name).strip("-").lower()


def select_scenarios(names: Sequence[str] | None) -> list[Scenario]:
    """The scenarios named (case-insensitive, ``single-engine`` or ``single`` for the first
    row); any other name becomes a row with that ``selection_strategy``."""
    if not names:
        return list(SCENARIOS)
    known = {_slug(s.name): s for s in SCENARIOS}
    known.setdefault("single", SCENARIOS[0])
    wanted = [n.strip() for name in names for n in name.split(",") if n.strip()]
    return [known.get(_slug(n)) or Scenario(n, {"selection_strategy": n}) for n in wanted]


@contextmanager
def _signals_to_main() -> Iterator[None]:
    """Raise SIGINT as KeyboardInterrupt and SIGTERM as SystemExit in the main greenlet, so
    its ``finally`` blocks stop the children (and gevent's hub prints no traceback)."""
    import gevent

    main = gevent.getcurrent()
    handlers = [
        gevent.signal_handler(signal.SIGINT, lambda: gevent.kill(main, KeyboardInterrupt)),
        gevent.signal_handler(signal.SIGTERM, lambda: gevent.kill(main, SystemExit(143))),
    ]
    try:
        yield
    finally:
        for handler in handlers:
            handler.cancel()


def main(argv: Sequence[str] | None = None) -> int:
    """Run the demo; 0 when every scenario completed without request errors."""
    from gevent import monkey

    if not monkey.is_module_patched("socket"):
        monkey.patch_all()
    import requests

    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["--"]:  # ``continuum-router demo -- --quick``
        argv = argv[1:]
    args = build_parser().parse_args(argv)
    if args.engines < 1 or args.concurrency < 1:
        print("continuum-router demo: --engines and --concurrency must be >= 1", file=sys.stderr)
        return 2
    began = time.monotonic()

    def progress(message: str) -> None:
        print(f"demo [{time.monotonic() - began:5.1f}s] {message}", file=sys.stderr, flush=True)

    shape = FleetShape(args.engines, args.num_blocks, args.max_num_seqs, args.latency_scale)
    workload = demo_workload(args.seed, args.quick, args.rate)
    if args.requests:
        workload = workload.limit(args.requests)
    scenarios = select_scenarios(args.strategies)
    problems = check_scenarios(scenarios)
    if problems:
        print("\n".join(f"continuum-router demo: {p}" for p in problems), file=sys.stderr)
        return 2
    run_id = secrets.token_hex(8)
    workdir = Path(tempfile.mkdtemp(prefix="continuum-demo-"))
    children = Children(workdir, run_id)
    rows: list[dict[str, Any]] = []
    try:
        with _signals_to_main(), requests.Session() as http:
            http.trust_env = False
            progress(f"starting {shape.engines} simulated engines and one with "
                     f"{shape.engines}x their KV capacity")
            _, fleet = start_engines(children, "fleet", shape.engines, shape.num_blocks,
                                     shape.max_num_seqs, shape.latency_scale)
            _, single = start_engines(children, "single", 1, shape.num_blocks * shape.engines,
                                      shape.max_num_seqs * shape.engines, shape.latency_scale)
            progress(f"workload {workload.name!r} seed {args.seed}: "
                     f"{len(workload.sessions)} sessions, {workload.requests} requests")
            for scenario in scenarios:
                progress(f"{scenario.name}: replaying")
                row = run_scenario(scenario, children, http, workload, fleet, single, args)
                rows.append(row)
                progress(f"{scenario.name}: {row['ok']} ok, {row['errors']} errors, "
                         f"hit rate {row['prefix_hit_rate']:.1%}, "
                         f"{row['requests_per_second']} req/s")
                for sample in row["error_samples"]:
                    progress(f"  error: {sample}")
    except (RuntimeError, OSError) as exc:  # OSError: requests' errors, spawn failures
        print(f"continuum-router demo: {exc}", file=sys.stderr)
        return 3
    except KeyboardInterrupt:
        print("continuum-router demo: interrupted", file=sys.stderr)
        return 130
    finally:
        children.stop_all()
        shutil.rmtree(workdir, ignore_errors=True)
    wall = time.monotonic() - began
    if args.json:
        doc = {
            "run_id": run_id, "run_env": RUN_ENV, "pids": children.pids, "seed": args.seed,
            "quick": args.quick, "engines": shape.engines, "fleet_shape": asdict(shape),
            "workload": {"name": workload.name, "sessions": len(workload.sessions),
                         "requests": workload.requests},
            "wall_seconds": round(wall, 2), "scenarios": rows,
        }
        print(json.dumps(doc, indent=2))
    else:
        print(f"\n{shape.engines} simulated engines; single engine = one engine with their "
              f"combined KV capacity; workload {workload.name!r} (seed {args.seed}, "
              f"{workload.requests} requests)\n")
        print(render_table(rows))
        print("\nprefix hit % = cached prompt tokens / prompt tokens, from the engines' "
              f"/sim/stats; finished in {wall:.1f}s")
    return 1 if any(row["errors"] for row in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
