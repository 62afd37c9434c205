"""The processes of ``continuum-router demo``: engines, the KV listener and the router.

:func:`demo_children` starts every process (:class:`~continuum.devtools.procs.Children`)
with output to a log file in the demo's work directory and an environment marker
(:data:`RUN_ENV`), and stops each one by its PID; on Linux a child also gets SIGTERM when
the demo itself dies. The ``start_*`` functions return once the process serves; the
``wait_*`` functions poll an HTTP view until a condition holds and raise
:class:`RuntimeError` (with the log's tail) when it does not, or
:class:`~continuum.devtools.procs.ChildExited` at once when the child they wait on dies.

Topology with KV events (what ``conf/config.kv-listener.yaml.example`` describes for
vLLM): the listener binds one ZMQ endpoint per source on 127.0.0.1, each fleet engine
connects its PUB socket to its own endpoint (``--zmq-connect``, vLLM map format), and the
listener attributes blocks through the engine's ``/detokenize``; every router subscribes to
``/events/<backend>``.

``requests`` and ``gevent`` are imported inside functions only: the demo monkey-patches
the process first.
"""

from __future__ import annotations

import copy
import functools
import os
import re
import shutil
import signal
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import yaml

from continuum.devtools.procs import (
    Child,
    Children,
    WaitTimeout,
    child_env,
    free_port,
    free_port_block,
    http_status,
    wait_until,
)

if TYPE_CHECKING:
    import requests

RUN_ENV = "CONTINUUM_DEMO_RUN"
MODEL = "sim-model"
#: The wire profile of the fleet's KV events: vLLM's map-encoded events.
KV_FORMAT = "vllm-0.33"


@dataclass(frozen=True)
class FleetShape:
    """Engine knobs: scaled-down latencies, and a KV capacity per engine that holds a few
    of the workload's shared prefixes but not all of them, so locality matters."""

    engines: int = 4
    num_blocks: int = 480
    max_num_seqs: int = 4
    latency_scale: float = 0.5


@dataclass
class Fleet:
    """What every scenario runs against: the engines' URLs and the listener's, if any."""

    engines: list[str]
    single: list[str]
    listener: str | None = None
    #: Each engine's KV-event PUB endpoint when the engines bind it (``start_fleet``'s
    #: ``engines_bind``: a second subscriber, a rival router, can connect there too).
    kv_endpoints: list[str] | None = None


def backend_names(count: int) -> list[str]:
    """The router's (and the listener's) names of the fleet's engines."""
    return [f"engine-{i}" for i in range(count)]


@contextmanager
def signals_to_main() -> Iterator[None]:
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


def merge(base: dict[str, Any], overrides: dict[str, Any]) -> dict[str, Any]:
    """``base`` with ``overrides`` merged in, recursively for nested mappings."""
    out = copy.deepcopy(base)
    for key, value in overrides.items():
        if isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = merge(out[key], value)
        else:
            out[key] = copy.deepcopy(value)
    return out


def metric_sum(text: str, name: str, **labels: str) -> float:
    """Sum of the samples of ``name`` in a Prometheus exposition whose labels match."""
    total = 0.0
    for line in text.splitlines():
        if line.startswith((name + "{", name + " ")):
            head, _, value = line.rpartition(" ")
            if all(f'{k}="{v}"' in head for k, v in labels.items()):
                total += float(value)
    return total


def demo_children(workdir: Path, run_id: str) -> Children:
    """The demo's process group: logs in ``workdir``, every child marked with
    :data:`RUN_ENV` ``= run_id`` and told to die with the demo (Linux)."""
    return Children(workdir, child_env({RUN_ENV: run_id}), die_with_parent=True)


# -- engines ---------------------------------------------------------------------------------


def start_engines(
    children: Children, name: str, count: int, blocks: int, slots: int, scale: float,
    zmq_endpoint: str | None = None, timeout: float = 20.0, zmq_bind: bool = False,
) -> tuple[Child, list[str]]:
    """Start ``continuum-sim --fleet count`` on free ports; return it and its URLs.

    With ``zmq_endpoint`` (``tcp://127.0.0.1:P``) member ``i`` connects its KV-event PUB
    socket to port ``P + i``, or binds it there with ``zmq_bind`` (vLLM's own default,
    which lets several subscribers connect).
    """
    argv = [
        sys.executable, "-m", "continuum.sim.cli", "--fleet", str(count), "--port", "0",
        "--num-blocks", str(blocks), "--max-num-seqs", str(slots),
        "--latency-scale", str(scale), "--model", MODEL,
    ]
    if zmq_endpoint:
        argv += ["--zmq-endpoint", zmq_endpoint, "--zmq-bind" if zmq_bind else "--zmq-connect",
                 "--kv-format", KV_FORMAT]
    log = f"{name}.log"
    proc = children.spawn(argv, log)
    urls: list[str] = []

    def started() -> bool:
        urls[:] = re.findall(r"^continuum-sim: engine \d+ .*?(http://\S+)",
                             proc.log_text(), re.MULTILINE)
        return len(urls) == count

    wait_until(started, "the simulated engines", timeout, children=[proc])
    return proc, urls


def engine_stats(http: requests.Session, urls: Sequence[str]) -> list[dict[str, Any]]:
    """``GET /sim/stats`` of each engine."""
    return [http.get(u + "/sim/stats", timeout=5).json() for u in urls]


def reset_engines(http: requests.Session, urls: Sequence[str], timeout: float = 10.0) -> None:
    """Drop every engine's prefix cache (retrying while requests still run). An engine
    with KV events publishes ``AllBlocksCleared``, which the listener turns into
    ``cache_cleared``."""
    for url in urls:
        wait_until(functools.partial(_resets, http, url), f"{url} to reset its prefix cache",
                   timeout, interval=0.1)


def _resets(http: requests.Session, url: str) -> bool:
    return http.post(url + "/reset_prefix_cache", timeout=5).status_code == 200


# -- the KV listener -------------------------------------------------------------------------


def engine_kv_endpoints(zmq_base: int, count: int) -> list[str]:
    """Engine ``i``'s KV-event endpoint, ``tcp://127.0.0.1:<zmq_base + i>``, for each of
    ``count`` engines (``continuum-sim --fleet`` offsets its members' ports the same way)."""
    return [f"tcp://127.0.0.1:{zmq_base + i}" for i in range(count)]


def listener_config(
    backends: Sequence[str], engines: Sequence[str], zmq_base: int,
    event_bus: dict[str, Any] | None = None, connect: bool = False,
) -> dict[str, Any]:
    """The listener config: one vLLM source per engine, bound at ``zmq_base + i`` (or
    connecting there with ``connect``, the engines binding), blocks attributed through the
    engine's ``/detokenize``; HTTP on a free port (logged)."""
    return {
        "listen": "127.0.0.1:0",
        "log_level": "info",
        **({"event_bus": event_bus} if event_bus else {}),
        "sources": [
            {
                "backend_name": backend,
                "engine": "vllm",
                "model": MODEL,
                "zmq_endpoint": endpoint,
                "zmq_mode": "connect" if connect else "bind",
                "detokenize_endpoint": f"{url}/detokenize",
                "allowed_publishers": ["127.0.0.1"],
            }
            for backend, url, endpoint in zip(
                backends, engines, engine_kv_endpoints(zmq_base, len(engines)), strict=True)
        ],
    }


def start_listener(
    children: Children, http: requests.Session, backends: Sequence[str],
    engines: Sequence[str], zmq_base: int, timeout: float = 30.0,
    event_bus: dict[str, Any] | None = None, connect: bool = False,
) -> tuple[Child, str]:
    """Start ``continuum-kv-listener`` for ``engines``; return it and its URL once every
    source has an engine connected and has applied one of its batches (a PUB socket drops
    what it publishes before the subscription arrives, so the engines' caches are reset
    until each source counts a batch)."""
    path = children.workdir / "kv-listener.yaml"
    path.write_text(yaml.safe_dump(listener_config(backends, engines, zmq_base, event_bus,
                                                   connect), sort_keys=False))
    log = "kv-listener.log"
    proc = children.spawn([sys.executable, "-m", "listener.cli", "--config", str(path)], log)
    found: list[str] = []

    def serving() -> bool:
        found[:] = re.findall(r"serving (http://\S+?)/events/", proc.log_text())
        return bool(found)

    try:
        wait_until(serving, "the KV listener", timeout, children=[proc])
        url = found[0]

        def sources() -> dict[str, Any]:
            doc: dict[str, Any] = http.get(url + "/health", timeout=2).json()["sources"]
            return doc

        wait_until(lambda: all(s["connected"] for s in sources().values()),
                   "the engines to connect to the KV listener", timeout, children=[proc])

        def subscribed() -> bool:
            pending = [u for b, u in zip(backends, engines, strict=True)
                       if not sources()[b]["batches"]]
            reset_engines(http, pending)
            return not pending

        wait_until(subscribed, "the KV listener's first event batches", timeout,
                   children=[proc], interval=0.2)
    except BaseException:
        children.stop(proc)
        raise
    return proc, url


def wait_listener_clear(
    http: requests.Session, url: str, backends: Sequence[str], timeout: float = 10.0,
) -> None:
    """Wait until the listener tracks no block and its streams hold no prefix (after the
    engines' ``AllBlocksCleared``)."""
    def clear() -> bool:
        text = http.get(url + "/metrics", timeout=5).text
        return all(
            metric_sum(text, "continuum_kv_listener_prefixes", backend=b) == 0
            and metric_sum(text, "continuum_kv_listener_processor_tracked_blocks",
                           backend=b) == 0
            for b in backends
        )

    wait_until(clear, "the KV listener to clear its state", timeout)


#: Listener counters the demo reports (``continuum_kv_listener_<name>``, summed over the
#: sources).
LISTENER_COUNTERS = (
    "events_in_total", "sequence_gaps_total", "decode_errors_total", "processor_errors_total",
    "resets_total", "rejected_publishers_total", "processor_detokenize_calls_total",
    "processor_detokenize_errors_total", "processor_unattributed_chains_total",
    "processor_mismatched_blocks_total", "processor_events_out_total",
)


def listener_stats(http: requests.Session, url: str) -> dict[str, int]:
    """The listener's :data:`LISTENER_COUNTERS`, summed over its sources."""
    text = http.get(url + "/metrics", timeout=5).text
    return {name.removesuffix("_total"): int(metric_sum(text, "continuum_kv_listener_" + name))
            for name in LISTENER_COUNTERS}


# -- the router ------------------------------------------------------------------------------


def slug(name: str) -> str:
    """``name`` as a file-name fragment."""
    return re.sub(r"\W+", "-", name).strip("-").lower()


def start_router(
    children: Children, http: requests.Session, config: dict[str, Any], name: str,
    timeout: float = 30.0, attempts: int = 3,
) -> tuple[Child, str]:
    """Start the router under gunicorn with ``config``; return it once ``/health`` is 200
    and ``/admin/backends`` (with the config's admin token) lists the config's backends —
    so a process that took the free port meanwhile is never mistaken for this router (the
    router is then started again on another port)."""
    tag = slug(name)
    path = children.workdir / f"router-{tag}.yaml"
    metrics_dir = children.workdir / f"metrics-{tag}"
    runtime_dir = children.workdir / f"runtime-{tag}"
    log = f"router-{tag}.log"
    token = config["admin"]["token"]
    wanted = sorted(b["url"] for b in config["backends"])
    for attempt in range(attempts):
        port = free_port()
        path.write_text(yaml.safe_dump(merge(config, {"server": {"bind": f"127.0.0.1:{port}"}}),
                                       sort_keys=False))
        for directory in (metrics_dir, runtime_dir):
            shutil.rmtree(directory, ignore_errors=True)
            directory.mkdir()
        argv = [sys.executable, "-m", "gunicorn", "-c", "python:continuum.gunicorn_conf",
                "continuum.app:get_app()"]
        env = {"CONTINUUM_CONFIG": str(path), "PROMETHEUS_MULTIPROC_DIR": str(metrics_dir),
               "CONTINUUM_RUNTIME_DIR": str(runtime_dir)}
        # SIGQUIT: gunicorn's quick shutdown (SIGTERM would wait out keep-alive connections).
        proc = children.spawn(argv, log, env, stop_signal=signal.SIGQUIT)
        url = f"http://127.0.0.1:{port}"
        try:
            wait_until(functools.partial(_answers, url + "/health"),
                       f"the router ({name})", timeout, children=[proc], interval=0.1)
            resp = http.get(url + "/admin/backends", timeout=5,
                            headers={"Authorization": f"Bearer {token}"})
            ours = resp.status_code == 200 and sorted(
                b["url"] for b in resp.json()["backends"]) == wanted
        except BaseException:
            children.stop(proc)
            raise
        if ours and proc.running():
            return proc, url
        children.stop(proc)
        if attempt + 1 == attempts:
            break
    raise RuntimeError(f"router ({name}): port 127.0.0.1:{port} answered for another "
                       f"process, {attempts} times")


def _answers(url: str) -> bool:
    return http_status(url) == 200


# -- the routers people run today -------------------------------------------------------------

#: The Rust routers in front of vLLM and SGLang fleets that the demo can run beside the
#: router on the same engines and workload (they are not dependencies: ``pip install
#: sglang-router vllm-router``, in a venv of their own). Row name -> (executable, its
#: arguments before the common ones, the policy). Each runs its prefix-aware default,
#: ``cache_aware``: an approximate radix tree of the text each worker was sent, and load
#: balancing once the workers' loads differ by enough.
RIVAL_ROUTERS: dict[str, tuple[str, tuple[str, ...], tuple[str, ...]]] = {
    "sglang-router cache_aware": ("sglang-router", ("launch",), ("--policy", "cache_aware")),
    "vllm-router cache_aware": ("vllm-router", (), ("--policy", "cache_aware")),
    "vllm-router kv_aware": ("vllm-router", (), ("--policy", "kv_aware")),
}

#: The rival rows that subscribe to the engines' KV events themselves (the engines must
#: bind their PUB sockets: ``start_fleet``'s ``engines_bind``).
KV_EVENT_RIVALS = frozenset({"vllm-router kv_aware"})


def find_executable(name: str, bin_dir: str | None) -> str | None:
    """The path of executable ``name``, in ``bin_dir`` or else on ``PATH``; None when it is
    not installed there."""
    if bin_dir is not None:
        path = Path(bin_dir) / name
        return str(path) if path.is_file() and os.access(path, os.X_OK) else None
    return shutil.which(name)


def rival_executable(row: str, bin_dir: str | None) -> str | None:
    """The path of ``row``'s router executable (:func:`find_executable`)."""
    return find_executable(RIVAL_ROUTERS[row][0], bin_dir)


def rival_argv(spec: tuple[str, tuple[str, ...], tuple[str, ...]], executable: str,
               port: int, worker_urls: Sequence[str], metrics_port: int,
               kv_endpoints: Sequence[str] = ()) -> list[str]:
    """The command line of a Rust router (``spec`` as in :data:`RIVAL_ROUTERS`) on
    127.0.0.1 in front of ``worker_urls``, its Prometheus exporter on ``metrics_port`` of
    127.0.0.1; with ``kv_endpoints`` (one per worker), vllm-router's static KV event
    sources, the workers serving :data:`MODEL`."""
    _, before, policy = spec
    sources = [arg for url, endpoint in zip(worker_urls, kv_endpoints, strict=True)
               for arg in ("--kv-event-source", f"{url}={endpoint}")] if kv_endpoints else []
    return [executable, *before, "--host", "127.0.0.1", "--port", str(port),
            "--worker-urls", *worker_urls, *policy, *sources,
            *(("--kv-event-model", MODEL) if kv_endpoints else ()),
            "--prometheus-host", "127.0.0.1", "--prometheus-port", str(metrics_port)]


def start_rival(children: Children, row: str, executable: str, engines: Sequence[str],
                timeout: float = 30.0, kv_endpoints: Sequence[str] | None = None,
                ) -> tuple[Child, str]:
    """Start rival router ``row`` on 127.0.0.1 in front of ``engines`` (its Prometheus
    exporter on another free port of 127.0.0.1); return it once ``/health`` is 200 and,
    for a row of :data:`KV_EVENT_RIVALS`, once it has subscribed to every engine's
    ``kv_endpoints``."""
    kv = row in KV_EVENT_RIVALS
    if kv and not kv_endpoints:
        raise ValueError(f"{row} reads the engines' KV events: it needs their endpoints")
    port = free_port()
    argv = rival_argv(RIVAL_ROUTERS[row], executable, port, engines, free_port(),
                      kv_endpoints if kv and kv_endpoints else ())
    proc = children.spawn(argv, f"router-{slug(row)}.log")
    url = f"http://127.0.0.1:{port}"
    try:
        wait_until(functools.partial(_answers, url + "/health"), f"the router ({row})",
                   timeout, children=[proc], interval=0.1)
        if kv:
            # vllm-router logs each subscriber it starts; its /health does not wait for them
            # (a PUB socket drops what it publishes before the subscription arrives).
            wait_until(lambda: proc.log_text().count("kv_index subscriber for") >= len(engines),
                       f"the router ({row}) to subscribe to the engines' KV events", timeout,
                       children=[proc], interval=0.1)
            time.sleep(0.5)  # the subscription's own handshake, which it does not log
    except BaseException:
        children.stop(proc)
        raise
    return proc, url


def kv_index_stats(http: requests.Session, url: str, token: str) -> dict[str, Any]:
    """The router's ``GET /admin/kv-index/stats``."""
    resp = http.get(url + "/admin/kv-index/stats", timeout=5,
                    headers={"Authorization": f"Bearer {token}"})
    resp.raise_for_status()
    doc: dict[str, Any] = resp.json()
    return doc


def wait_router_index_ready(
    http: requests.Session, url: str, token: str, timeout: float = 15.0,
    proc: Child | None = None,
) -> dict[str, Any]:
    """Wait until every event source of the router streams and its index is empty (a
    fresh subscription starts with ``cache_cleared`` and the listener's snapshot, which is
    empty after the engines' reset); return the stats."""
    stats: dict[str, Any] = {}

    def ready() -> bool:
        stats.update(kv_index_stats(http, url, token))
        return (all(s["connected"] for s in stats["event_sources"])
                and stats["index"]["entry_count"] == 0)

    try:
        wait_until(ready, "the router's KV index to be connected and empty", timeout,
                   children=[proc] if proc else [], tail=0)
    except WaitTimeout as exc:
        raise RuntimeError(f"{exc}: {stats.get('index')}, {stats.get('event_sources')}") \
            from None
    return stats


# -- everything ------------------------------------------------------------------------------


def start_fleet(
    children: Children, http: requests.Session, shape: FleetShape, kv_events: bool,
    progress: Callable[[str], None], event_bus: dict[str, Any] | None = None,
    engines_bind: bool = False,
) -> Fleet:
    """The engines, the single big engine and, with ``kv_events``, the KV listener; with
    ``engines_bind`` the engines bind their KV-event PUB sockets and the listener connects
    (so that another subscriber can connect too: :data:`KV_EVENT_RIVALS`)."""
    zmq_base = free_port_block(shape.engines) if kv_events else None
    progress(f"starting {shape.engines} simulated engines and one with "
             f"{shape.engines}x their KV capacity")
    _, engines = start_engines(
        children, "fleet", shape.engines, shape.num_blocks, shape.max_num_seqs,
        shape.latency_scale, zmq_endpoint=f"tcp://127.0.0.1:{zmq_base}" if zmq_base else None,
        zmq_bind=engines_bind)
    _, single = start_engines(children, "single", 1, shape.num_blocks * shape.engines,
                              shape.max_num_seqs * shape.engines, shape.latency_scale)
    fleet = Fleet(engines, single)
    if zmq_base is not None:
        if engines_bind:
            fleet.kv_endpoints = engine_kv_endpoints(zmq_base, shape.engines)
        progress("starting the KV listener (engines publish KV events over ZMQ)")
        _, fleet.listener = start_listener(children, http, backend_names(shape.engines),
                                           engines, zmq_base, event_bus=event_bus,
                                           connect=engines_bind)
    return fleet
