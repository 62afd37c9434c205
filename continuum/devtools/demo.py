"""``continuum-router demo``: simulated engines + the router, one table per strategy.

Starts a fleet of simulated engines (``continuum-sim --fleet N``) and, for comparison, one
engine with the whole fleet's KV capacity and slots; when a scenario uses the KV cache
index (Tier 4), the fleet publishes its KV events over ZMQ to ``continuum-kv-listener``.
Then, for each scenario, the router runs under gunicorn with gevent workers and a config
built from :data:`DEFAULT_ROUTER_CONFIG`. Every scenario replays the same seeded workload
(:func:`demo_workload`) against fresh engine caches (and, with the listener, a listener and
router index that are verified empty) and reports requests/s, TTFT, the engines'
prefix-cache hit rate, the router's response-cache hits and the share of KV-aware routing
decisions. Every process started is stopped by its PID on the way out, also on Ctrl-C or
SIGTERM (:mod:`continuum.devtools.fleet`).

``--scenario`` picks the workload: ``default`` (the mixed one), ``rag`` (one system prompt,
documents with Zipf popularity inside the user turn), ``agent`` (long sessions growing with
tool outputs) or ``load`` (heavy multi-turn chat with skewed prompt popularity); ``--workload FILE``
replays the sessions of a file instead (:func:`continuum.sim.workload.read_jsonl`), and
``--save-workload FILE`` writes the one a run would replay. Each scenario has
the rows single engine, RoundRobin, PrefixAwareHash, the seed-literal KV index
(``match: seed``: the seed's system-prompt key and formula) and the KV index with its
default settings (chain of prefix keys, approximate entries, adaptive load guard).

Later tiers add a row by appending a :class:`Scenario` to :data:`SCENARIOS`.
"""

from __future__ import annotations

import argparse
import functools
import itertools
import json
import secrets
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from continuum.devtools.fleet import (
    KV_EVENT_RIVALS,
    MODEL,
    RIVAL_ROUTERS,
    RUN_ENV,
    Fleet,
    FleetShape,
    backend_names,
    demo_children,
    engine_stats,
    kv_index_stats,
    listener_stats,
    merge,
    metric_sum,
    reset_engines,
    rival_executable,
    signals_to_main,
    slug,
    start_fleet,
    start_rival,
    start_router,
    wait_listener_clear,
    wait_router_index_ready,
)
from continuum.devtools.procs import Child, ChildExited, Children, wait_until
from continuum.devtools.push import PushSetup
from continuum.devtools.scaleout import (
    cache_counts,
    kv_decisions,
    per_request,
    redis_command_calls,
    redis_round_trips,
    router_cpu_seconds,
    router_memory_mib,
    scale_config,
    subscribers,
)

if TYPE_CHECKING:
    import requests

    from continuum.sim.workload import Session, Workload

__all__ = ["LOAD_SCENARIOS", "SCENARIOS", "STANDARD_SCENARIOS", "FleetShape", "Scenario",
           "main", "merge", "metric_sum"]

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
    the workload sent straight to the single big engine, with no router. ``kv_events``:
    the router consumes the listener's streams (``kv_cache_index.event_sources`` is filled
    in at run time)."""

    name: str
    overrides: dict[str, Any] = field(default_factory=dict)
    direct: bool = False
    kv_events: bool = False
    #: Not this router but another one (a key of :data:`RIVAL_ROUTERS`), in front of the
    #: same engines, so the table compares them on one workload.
    rival: str | None = None


#: All four tiers with the KV index's defaults (``match: chain``, approximate entries,
#: adaptive load guard): prefix keys with PrefixAwareHash (CHWBL) as the strategy the KV
#: scorer falls back to, the response cache, and the KV index fed by the listener.
KV_INDEX: dict[str, Any] = {
    "selection_strategy": "PrefixAwareHash",
    "prefix_routing": {"enabled": True},
    "response_cache": {"enabled": True, "backend": "memory"},
    "kv_cache_index": {"enabled": True},
}
#: The seed literally: its system-prompt key, its composite score, no guard.
KV_INDEX_SEED = merge(KV_INDEX, {"kv_cache_index": {
    "match": "seed", "approximate": {"enabled": False},
    "scoring": {"load_guard": {"enabled": False}}}})
#: The seed's key with the CHWBL-bound guard (``load_guard.mode: bound``).
KV_INDEX_SEED_GUARDED = merge(KV_INDEX_SEED, {"kv_cache_index": {"scoring": {"load_guard": {
    "enabled": True, "mode": "bound"}}}})

SINGLE = Scenario("single engine", direct=True)
ROUND_ROBIN = Scenario("RoundRobin", {"selection_strategy": "RoundRobin"})
PREFIX_AWARE = Scenario(
    "PrefixAwareHash",
    {"selection_strategy": "PrefixAwareHash", "prefix_routing": {"enabled": True}},
)
KV_SEED = Scenario("KV index (seed key)", KV_INDEX_SEED, kv_events=True)
KV_DEFAULT = Scenario("KV index", KV_INDEX, kv_events=True)

SCENARIOS: list[Scenario] = [
    SINGLE,
    ROUND_ROBIN,
    PREFIX_AWARE,
    Scenario(
        "PrefixAwareHash + response cache",
        {
            "selection_strategy": "PrefixAwareHash",
            "prefix_routing": {"enabled": True},
            "response_cache": {"enabled": True, "backend": "memory"},
        },
    ),
    KV_SEED,
    KV_DEFAULT,
]

#: ``--scenario rag`` / ``agent``: the five rows every scenario is judged on.
STANDARD_SCENARIOS: list[Scenario] = [SINGLE, ROUND_ROBIN, PREFIX_AWARE, KV_SEED, KV_DEFAULT]

#: ``--scenario load``: the five rows, and the seed's key with the CHWBL-bound guard.
LOAD_SCENARIOS: list[Scenario] = [
    SINGLE, ROUND_ROBIN, PREFIX_AWARE, KV_SEED,
    Scenario("KV index (seed key) + load guard", KV_INDEX_SEED_GUARDED, kv_events=True),
    KV_DEFAULT,
]

#: ``--rivals-bin``: the routers people run today, each in front of the same engines.
RIVAL_SCENARIOS: list[Scenario] = [Scenario(name, rival=name) for name in RIVAL_ROUTERS]

#: Every row any scenario has, by name (``--strategies`` picks among them).
ALL_SCENARIOS: list[Scenario] = [*SCENARIOS, LOAD_SCENARIOS[4], *RIVAL_SCENARIOS]


def demo_workload(seed: int, quick: bool, rate: float | None = None) -> Workload:
    """The built-in workload: users sharing 8 long system prompts, multi-turn
    conversations over the same prompts, RAG questions over 4 documents; 30% of the
    single questions repeat exactly (temperature 0)."""
    from continuum.sim.workload import mixed

    if quick:
        return mixed(seed, users=40, conversations=14, rag_questions=14, rate=rate or 24.0)
    return mixed(seed, users=110, conversations=40, rag_questions=40, rate=rate or 24.0)


#: ``--scenario load``'s workload (``--quick`` halves the conversations).
LOAD_WORKLOAD: dict[str, Any] = {"conversations": 180, "turns": (3, 6), "prompts": 8,
                                 "popularity_skew": 1.5, "think_seconds": 0.2, "rate": 7.0}
#: ``--scenario load``'s defaults: two slots per engine (the fleet serves ~40 requests/s
#: on 2 cores, the workload offers ~30) and sessions never wait for a replay worker.
LOAD_MAX_NUM_SEQS = 2
LOAD_CONCURRENCY = 512


def load_workload(seed: int, quick: bool, rate: float | None = None) -> Workload:
    """``--scenario load``: multi-turn chat only, conversations arriving faster than the
    fleet serves them, over 8 system prompts with Zipf popularity, so that the holders of
    the popular prompts are the busy engines."""
    from continuum.sim.workload import multi_turn

    options = dict(LOAD_WORKLOAD)
    if quick:
        options["conversations"] //= 2
    if rate:
        options["rate"] = rate
    return multi_turn(seed, **options)


def rag_workload(seed: int, quick: bool, rate: float | None = None) -> Workload:
    """``--scenario rag``: one shared system prompt, 24 documents of 600-1200 tokens with
    Zipf(1.0) popularity inside the user turn, every question distinct."""
    from continuum.sim.workload import rag_user_documents

    return rag_user_documents(seed, questions=90 if quick else 240, rate=rate or 12.0)


def agent_workload(seed: int, quick: bool, rate: float | None = None) -> Workload:
    """``--scenario agent``: sessions of 6-12 requests, each adding a 120-360 token tool
    output to the session's history, over two agent system prompts."""
    from continuum.sim.workload import agent

    return agent(seed, sessions=16 if quick else 40, rate=rate or 2.0)


#: ``--scenario`` → (workload maker, rows, engine slots, replay concurrency).
WORKLOADS: dict[str, Any] = {
    "default": (lambda seed, quick, rate: demo_workload(seed, quick, rate), SCENARIOS),
    "rag": (rag_workload, STANDARD_SCENARIOS),
    "agent": (agent_workload, STANDARD_SCENARIOS),
    "load": (load_workload, LOAD_SCENARIOS),
}


def warmup_workload(workload: Workload) -> Workload:
    """One short question per shared prefix, one after the other: the state a fleet is in
    when load rises, each prompt cached on one engine. (Not a turn of the workload: that
    would be a response-cache hit later.)"""
    from dataclasses import replace

    firsts: dict[str, Session] = {}
    for session in workload.sessions:
        firsts.setdefault(session.group, session)
    sessions = tuple(replace(s, id=f"warmup-{s.id}", turns=("Are you there?",), arrival=0.0,
                             think_seconds=0.0)
                     for s in firsts.values())
    return replace(workload, name=f"{workload.name} warm-up", sessions=sessions)


def event_sources(listener: str, count: int) -> list[dict[str, Any]]:
    """``kv_cache_index.event_sources`` for ``count`` engines behind ``listener``."""
    return [{"backend_name": name, "endpoint": f"{listener}/events/{name}",
             "reconnect_interval_ms": 200} for name in backend_names(count)]


def router_config(
    scenario: Scenario, engines: Sequence[str], listener: str | None = None,
    push: PushSetup | None = None, slots: int | None = None, learn_slots: bool = False,
) -> dict[str, Any]:
    """The router config of ``scenario`` in front of ``engines`` (``server.bind`` unset);
    ``listener`` is the KV listener's URL for a ``kv_events`` scenario, ``push`` makes its
    sources ``transport: event_bus`` (``--push``), ``slots`` is each engine's
    ``--max-num-seqs`` (``backends[].slots``: what an operator knows of their engines);
    ``learn_slots`` has the router learn them from the engines' metrics instead
    (``backends[].learn_slots``, ``--slots learned``)."""
    told = {"learn_slots": True} if learn_slots else {"slots": slots} if slots else {}
    backends = [{"name": name, "url": url, "models": [MODEL], **told}
                for name, url in zip(backend_names(len(engines)), engines, strict=True)]
    config = merge({**DEFAULT_ROUTER_CONFIG, "backends": backends}, scenario.overrides)
    if scenario.kv_events and push is not None:
        config = merge(config, push.router_overrides(backend_names(len(engines))))
    elif scenario.kv_events and listener is not None:
        config = merge(config, {"kv_cache_index": {
            "event_sources": event_sources(listener, len(engines))}})
    return merge(config, {"admin": {"token": secrets.token_hex(16)}})


def parse_sets(items: Sequence[str]) -> dict[str, Any]:
    """``--set PATH=VALUE`` items as one nested override (``fleet.fleet_load_push_ms=5`` →
    ``{"fleet": {"fleet_load_push_ms": 5}}``); a VALUE that reads as JSON is taken as JSON,
    anything else as a string.

    Raises:
        ValueError: an item without ``=`` or with an empty key path.
    """
    out: dict[str, Any] = {}
    for item in items:
        path, sep, raw = item.partition("=")
        keys = path.split(".")
        if not sep or not all(keys):
            raise ValueError(f"--set {item!r}: expected PATH=VALUE, e.g. "
                             "fleet.fleet_load_push_ms=5")
        try:
            value: Any = json.loads(raw)
        except ValueError:
            value = raw
        for key in reversed(keys):
            value = {key: value}
        out = merge(out, value)
    return out


def check_scenarios(scenarios: Sequence[Scenario], rivals_bin: str | None = None) -> list[str]:
    """Every config error of the scenarios' router configs (unknown strategy, bad key …),
    and every rival router that is not installed, found before anything is started."""
    from continuum.config import check_config
    from continuum.registry import PluginRegistry

    registry = PluginRegistry()
    problems = []
    for scenario in scenarios:
        if scenario.rival is not None:
            if rival_executable(scenario.rival, rivals_bin) is None:
                problems.append(
                    f"{scenario.name}: {RIVAL_ROUTERS[scenario.rival][0]} is not installed "
                    + (f"in {rivals_bin}" if rivals_bin else "on PATH")
                    + " (pip install sglang-router vllm-router, in a venv of their own, "
                    "and give its bin directory as --rivals-bin)")
        elif not scenario.direct:
            config = router_config(scenario, ["http://127.0.0.1:8000"], "http://127.0.0.1:1")
            result = check_config(config, f"scenario {scenario.name!r}", registry)
            problems += [issue.render(result.source) for issue in result.errors]
    return problems


def median_row(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """``--rounds``: one row from every round's row of a scenario: the median of each
    number (the rounds themselves under ``rounds`` when there are several), everything
    else from the first round; errors and skipped turns are summed, so none is hidden."""
    if len(runs) == 1:
        return runs[0]
    row = dict(runs[0])
    for key, first in runs[0].items():
        values = [run.get(key) for run in runs]
        numbers = [v for v in values if isinstance(v, (int, float)) and not isinstance(v, bool)]
        if len(numbers) < len(values) or not isinstance(first, (int, float)):
            continue
        row[key] = sum(numbers) if key in ("errors", "skipped") else statistics.median(numbers)
    row["error_samples"] = [s for run in runs for s in run["error_samples"]][:5]
    row["rounds"] = runs
    return row


def write_records(directory: Path, row: str, records: list[dict[str, Any]]) -> Path:
    """``--records``: one JSON line per measured request of ``row``, in DIR/<row>.jsonl
    (``<row>-round<k>.jsonl`` with ``--rounds``)."""
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / f"{slug(row)}.jsonl"
    with path.open("w", encoding="utf-8") as out:
        for record in records:
            out.write(json.dumps(record, sort_keys=True) + "\n")
    return path


def run_scenario(
    scenario: Scenario, children: Children, http: requests.Session, workload: Workload,
    fleet: Fleet, args: argparse.Namespace, warmup: Workload | None = None,
) -> dict[str, Any]:
    """Replay ``workload`` through one scenario; return its row.

    Engine caches are reset first; with a listener, the scenario starts only once the
    listener has applied the resets and the new router's index is connected and empty.
    ``warmup`` is replayed one session at a time before the measured replay (and, with
    the KV index, until the index holds one entry per warm-up session).
    """
    from continuum.sim.replay import replay

    router = None
    routers: list[Any] = []
    targets: list[str] = []
    scale: dict[str, Any] | None = None
    redis_url = getattr(args, "redis_url", None)
    run_name = scenario.name + getattr(args, "round_suffix", "")  # this row's this round
    engines = fleet.single if scenario.direct else fleet.engines
    kv: dict[str, Any] | None = None
    start: dict[str, Any] = {}
    token = ""
    rival: Child | None = None  # a rival router: stopped like the routers, no /metrics
    if scenario.kv_events and fleet.listener is None:
        raise RuntimeError(f"scenario {scenario.name!r} needs the KV listener")
    try:
        reset_engines(http, engines)
        if fleet.listener is not None and not scenario.direct:
            wait_listener_clear(http, fleet.listener, backend_names(len(fleet.engines)))
        if scenario.direct:
            target = fleet.single[0]
        elif scenario.rival is not None:
            executable = rival_executable(scenario.rival, getattr(args, "rivals_bin", None))
            if executable is None:
                raise RuntimeError(f"{scenario.name}: {RIVAL_ROUTERS[scenario.rival][0]} "
                                   "is not installed")
            rival, target = start_rival(children, scenario.rival, executable, fleet.engines,
                                        kv_endpoints=fleet.kv_endpoints)
        else:
            told = getattr(args, "slots", "given")
            config = router_config(scenario, fleet.engines, fleet.listener,
                                   getattr(args, "push_setup", None),
                                   getattr(args, "max_num_seqs", None) if told == "given"
                                   else None, learn_slots=told == "learned")
            # each round its own Redis prefixes: a round must not find the last one's cache
            config = scale_config(config, args.workers or 1, redis_url, run_name,
                                  sharing=not args.no_sharing)
            config = merge(config, getattr(args, "overrides", None) or {})
            for i in range(args.routers or 1):
                name = scenario.name if i == 0 else f"{scenario.name} r{i + 1}"
                proc, url = start_router(children, http, config, name)
                routers.append(proc)
                targets.append(url)
            router, target = routers[0], targets[0]
            token = config["admin"]["token"]
            if scenario.kv_events and redis_url is not None:
                # One consumer per backend for the whole fleet (the Redis index's lease):
                # ready once the listener has one subscription per backend.
                names = backend_names(len(fleet.engines))
                wait_until(lambda: all(subscribers(http, fleet.listener or "").get(n, 0) >= 1
                                       for n in names),
                           "the fleet's lease holders to subscribe", 15, children=routers,
                           tail=0)
                start = kv_index_stats(http, target, token)
            elif scenario.kv_events:
                start = wait_router_index_ready(http, target, token, proc=router)
        if warmup is not None:
            done = replay(targets or target, warmup, concurrency=1, max_seconds=60,
                          timeout=30)
            if done.summary()["errors"]:
                log = children.log_tail(f"router-{slug(scenario.name)}.log")
                raise RuntimeError(f"warm-up failed: {done.error_samples()}\n{log}")
            if scenario.kv_events and redis_url is not None:
                time.sleep(1.0)  # the Redis index counts no entries: give the events time
            elif scenario.kv_events:
                wait_until(lambda: kv_index_stats(http, target, token)["index"][
                    "entry_count"] >= len(warmup.sessions), "the warm-up in the KV index", 10,
                    children=[router] if router else [], tail=0)
                time.sleep(0.2)  # past the scorer's 100 ms snapshots
        before = engine_stats(http, engines)
        texts_before = [http.get(t + "/metrics", timeout=5).text for t in targets]
        trips_before = redis_round_trips(texts_before)
        decisions_before = kv_decisions(texts_before)
        redis_before = redis_command_calls(redis_url)
        cpu_before = router_cpu_seconds([rival] if rival is not None else routers)
        result = replay(targets or target, workload, concurrency=args.concurrency,
                        max_seconds=args.duration, timeout=args.request_timeout)
        after = engine_stats(http, engines)
        if getattr(args, "records", None):
            write_records(Path(args.records), run_name, result.to_dicts())
        texts = [http.get(t + "/metrics", timeout=5).text for t in targets]
        metrics = texts[0] if texts else ""
        if rival is not None:
            requests_done = max(result.summary()["ok"] + result.summary()["errors"], 1)
            scale = {"workers": None, "routers": 1, "response_cache_hits": None,
                     "response_cache_hit_rate": None, "listener_connections": None,
                     "redis_ops_per_request": None, "redis_round_trips_per_request": None,
                     "redis_ops_by_command": None,
                     "router_memory_mib": router_memory_mib([rival]),
                     "router_cpu_ms_per_request": round(
                         (router_cpu_seconds([rival]) - cpu_before) * 1000 / requests_done,
                         2)}
        if routers:
            cpu = router_cpu_seconds(routers) - cpu_before
            redis_after = redis_command_calls(redis_url)
            hits, misses = cache_counts(texts)
            requests_done = max(result.summary()["ok"] + result.summary()["errors"], 1)
            scale = {
                "workers": args.workers or 1, "routers": len(routers),
                "response_cache_hits": hits,
                "response_cache_hit_rate": round(hits / (hits + misses), 4)
                if hits + misses else None,
                "listener_connections": subscribers(http, fleet.listener)
                if fleet.listener is not None and scenario.kv_events else None,
                "redis_ops_per_request": round(
                    (sum(redis_after.values()) - sum(redis_before.values())) / requests_done,
                    2) if redis_url else None,
                # the routers' own Redis calls (one round trip each) per request
                "redis_round_trips_per_request": round(
                    (redis_round_trips(texts) - trips_before) / requests_done, 2)
                if redis_url else None,
                # each command's share of the commands (--json)
                "redis_ops_by_command": per_request(redis_before, redis_after,
                                                    requests_done) if redis_url else None,
                "router_memory_mib": router_memory_mib(routers),
                "router_cpu_ms_per_request": round(cpu * 1000 / requests_done, 2),
            }
        if router is not None and scenario.kv_events:
            end = kv_index_stats(http, target, token)
            kv = {
                "entry_count_at_start": start["index"]["entry_count"],
                "entry_count_at_end": end["index"]["entry_count"],
                "events_received": sum(s["events_received"] for s in end["event_sources"]),
                "reconnects": sum(s["reconnect_count"] for s in end["event_sources"]),
                # the measured replay's decisions (a warm-up's are left out), of every
                # worker of every router (their /metrics; the admin stats are one worker's)
                "routing_decisions": {k: v - decisions_before[k]
                                      for k, v in kv_decisions(texts).items()},
            }
    finally:
        for proc in routers if rival is None else [rival]:
            children.stop(proc)
    pairs = list(zip(after, before, strict=True))
    prompt = sum(a["prompt_tokens"] - b["prompt_tokens"] for a, b in pairs)
    cached = sum(a["cached_prompt_tokens"] - b["cached_prompt_tokens"] for a, b in pairs)
    decisions = kv["routing_decisions"] if kv else {}
    return {
        "name": scenario.name,
        "direct": scenario.direct,
        "overrides": scenario.overrides,
        **result.summary(),
        "engine_prompt_tokens": prompt,
        "engine_cached_prompt_tokens": cached,
        "engine_prefill_tokens": prompt - cached,
        "prefix_hit_rate": round(cached / prompt, 4) if prompt else 0.0,
        "engine_requests": [a["requests"] - b["requests"] for a, b in pairs],
        "router_cache_hits": scale["response_cache_hits"] if scale else
        None if rival is not None else int(metric_sum(metrics, CACHE_HIT_METRIC, result="hit")),
        "scale_out": scale,
        "kv_aware_share": round(decisions["kv_aware"] / decisions["total"], 4)
        if decisions.get("total") else None,
        "kv_index": kv,
        "error_samples": result.error_samples(),
    }


COLUMNS = (
    ("scenario", "name", "{}"),
    ("req/s", "requests_per_second", "{:.1f}"),
    ("TTFT mean ms", "ttft_ms_mean", "{:.1f}"),
    ("TTFT p99 ms", "ttft_ms_p99", "{:.1f}"),
    ("prefix hit %", "prefix_hit_rate", "{:.1%}"),
    ("prefill tokens", "engine_prefill_tokens", "{:.0f}"),
    ("router cache hits", "router_cache_hits", "{}"),
    ("KV-aware %", "kv_aware_share", "{:.1%}"),
    ("errors", "errors", "{}"),
)


#: With ``--workers``/``--routers``: the scale-out measurements (docs/scale-out.md).
SCALE_COLUMNS = (
    ("resp-cache hit %", "response_cache_hit_rate", "{:.1%}"),
    ("listener conns", "listener_connections", "{}"),
    ("Redis ops/req", "redis_ops_per_request", "{:.1f}"),
    ("Redis trips/req", "redis_round_trips_per_request", "{:.1f}"),
    ("router CPU ms/req", "router_cpu_ms_per_request", "{:.1f}"),
    ("router MiB", "router_memory_mib", "{:.0f}"),
    ("requests per engine", "engine_requests", "{}"),
)


def _cell(row: dict[str, Any], key: str, fmt: str) -> str:
    scale = row.get("scale_out") or {}
    value = row[key] if key in row else scale.get(key)
    if isinstance(value, dict):  # listener connections: per backend
        value = "/".join(str(v) for v in value.values()) or None
    if isinstance(value, list):
        value = "/".join(str(v) for v in value)
    return "-" if value is None else fmt.format(value).rstrip("%")


def render_table(rows: Sequence[dict[str, Any]], scale_out: bool = False) -> str:
    """The result rows as an aligned text table (with the scale-out columns)."""
    columns = COLUMNS + SCALE_COLUMNS if scale_out else COLUMNS
    cells = [[title for title, _, _ in columns]]
    for row in rows:
        cells.append([_cell(row, key, fmt) for _, key, fmt in columns])
    widths = [max(len(line[i]) for line in cells) for i in range(len(columns))]
    lines = [
        "  ".join(c.ljust(w) if i == 0 else c.rjust(w)
                  for i, (c, w) in enumerate(zip(line, widths, strict=True)))
        for line in cells
    ]
    return "\n".join([lines[0], "-" * len(lines[0]), *lines[1:]])


def _count(text: str) -> int:
    """An argparse type: a whole number >= 1."""
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be a whole number >= 1 (got {text})")
    return value


def _number(text: str, *, zero_ok: bool) -> float:
    """An argparse type: a finite number > 0 (>= 0 with ``zero_ok``)."""
    try:
        value = float(text)
    except ValueError:
        value = float("nan")
    if not ((value >= 0) if zero_ok else (value > 0)) or value == float("inf"):
        raise argparse.ArgumentTypeError(
            f"must be a number {'>=' if zero_ok else '>'} 0 (got {text})")
    return value


#: Durations and rates (> 0), and the latency scale (>= 0: no simulated latency at all).
_seconds = functools.partial(_number, zero_ok=False)
_scale = functools.partial(_number, zero_ok=True)


def build_parser() -> argparse.ArgumentParser:
    """The ``continuum-router demo`` argument parser."""
    p = argparse.ArgumentParser(
        prog="continuum-router demo",
        description="Start simulated engines, the KV listener and the router; compare "
        "strategies on one seeded workload.",
    )
    p.add_argument("--scenario", choices=tuple(WORKLOADS), default="default",
                   help="default: the mixed workload; rag: one system prompt, documents "
                   "with Zipf popularity in the user turn; agent: long sessions growing "
                   "with tool outputs; load: heavy multi-turn chat with skewed prompt "
                   "popularity")
    p.add_argument("--engines", type=_count, default=4, help="simulated engines behind the router")
    p.add_argument("--num-blocks", type=_count, default=FleetShape.num_blocks,
                   help="KV capacity of each engine, in 16-token blocks")
    p.add_argument("--max-num-seqs", type=_count,
                   help=f"concurrent request slots of each engine (default "
                   f"{FleetShape.max_num_seqs}; {LOAD_MAX_NUM_SEQS} with --scenario load)")
    p.add_argument("--slots", choices=("given", "learned", "unknown"), default="given",
                   help="what the router knows of each engine's slots: given "
                   "(backends[].slots is --max-num-seqs), learned (backends[].learn_slots: "
                   "from the engines' /metrics by the health probes) or unknown")
    p.add_argument("--latency-scale", type=_scale, default=FleetShape.latency_scale,
                   help="multiplies every simulated latency")
    p.add_argument("--rate", type=_seconds, help="session arrivals per second (default: built-in)")
    p.add_argument("--requests", type=_count, help="cap on requests per scenario")
    p.add_argument("--duration", type=_seconds, default=30.0,
                   help="seconds after which a scenario starts no new request")
    p.add_argument("--request-timeout", type=_seconds, default=30.0,
                   help="seconds one request may take before it counts as an error")
    p.add_argument("--strategies", nargs="+", metavar="NAME",
                   help="scenarios to run (names from the table, or any strategy name); "
                   "default: all of the --scenario")
    p.add_argument("--seed", type=int, help="workload seed (default 0)")
    p.add_argument("--concurrency", type=_count,
                   help=f"sessions in flight at once (default 64; {LOAD_CONCURRENCY} with "
                   "--scenario load)")
    p.add_argument("--workers", type=_count, default=None,
                   help="gunicorn workers per router (default 1); with more than one worker "
                   "or router the response cache and KV index use a redis-server the demo "
                   "starts, and the table gets the scale-out columns (docs/scale-out.md)")
    p.add_argument("--routers", type=_count, default=None,
                   help="router instances, taking requests in turn (default 1)")
    p.add_argument("--redis", action="store_true",
                   help="put the response cache and KV index on a redis-server the demo "
                   "starts even with one worker and one router")
    p.add_argument("--no-sharing", action="store_true",
                   help="with --workers/--routers: workers keep their in-flight counts to "
                   "themselves and every worker consumes every KV event stream (the state "
                   "before docs/scale-out.md, for comparison)")
    p.add_argument("--quick", action="store_true", help="a smaller workload (CI)")
    p.add_argument("--push", action="store_true",
                   help="push mode: the listener connects out to the router's event bus "
                   "(TLS + HTTP/2, certificates made with openssl) instead of being pulled")
    p.add_argument("--set", action="append", default=[], metavar="PATH=VALUE",
                   dest="sets",
                   help="a router config key for every row, e.g. --set "
                   "fleet.fleet_load_push_ms=5 (VALUE is JSON, or else a string); repeatable")
    p.add_argument("--json", action="store_true", help="print the results as JSON")
    p.add_argument("--keep-logs", action="store_true",
                   help="keep the work directory with every process's log and config")
    p.add_argument("--rounds", type=_count, default=1, metavar="N",
                   help="replay every row N times, the rows taking turns (round 1 of every "
                   "row, then round 2, ...), and print each row's median of every number; "
                   "--json keeps every round's row under 'rounds'")
    p.add_argument("--rivals-bin", metavar="DIR",
                   help="the bin directory of a venv with sglang-router and vllm-router "
                   "(pip install sglang-router vllm-router): their cache_aware rows and "
                   "vllm-router's kv_aware row (on the engines' KV events) join the table, "
                   "each in front of the same engines (--strategies can also name them, "
                   "found then on PATH without --rivals-bin)")
    p.add_argument("--workload", metavar="FILE",
                   help="replay the sessions of a JSON Lines file instead of the "
                   "scenario's generated ones (one session per line: turns, and optionally "
                   "id, kind, group, arrival, system, think_seconds, temperature, "
                   "max_tokens); --scenario still picks the rows and the fleet")
    p.add_argument("--save-workload", metavar="FILE",
                   help="write the workload this run would replay (the scenario's, at "
                   "--seed, --quick, --rate and --requests) to FILE in --workload's format, "
                   "and exit without starting anything")
    p.add_argument("--records", metavar="DIR",
                   help="write every measured request of each row (session, turn, start, "
                   "TTFT, prompt and cached tokens, backend) to DIR/<row>.jsonl")
    return p


def select_scenarios(names: Sequence[str] | None, default: Sequence[Scenario] = SCENARIOS,
                     ) -> list[Scenario]:
    """The scenarios named (case-insensitive, ``single-engine`` or ``single`` for the first
    row); any other name becomes a row with that ``selection_strategy``."""
    if not names:
        return list(default)
    known = {slug(s.name): s for s in ALL_SCENARIOS}
    known.setdefault("single", SCENARIOS[0])
    wanted = [n.strip() for name in names for n in name.split(",") if n.strip()]
    return [known.get(slug(n)) or Scenario(n, {"selection_strategy": n}) for n in wanted]


def _print_results(doc: dict[str, Any], args: argparse.Namespace) -> None:
    if args.json:
        print(json.dumps(doc, indent=2))
        return
    workload = doc["workload"]
    print(f"\n{doc['engines']} simulated engines; single engine = one engine with their "
          f"combined KV capacity; workload {workload['name']!r} ("
          + ("" if args.workload else f"seed {args.seed}, ")
          + f"{workload['requests']} requests)\n")
    scale_out = args.workers is not None or args.routers is not None
    if scale_out:
        print(f"{args.routers or 1} router(s) x {args.workers or 1} worker(s)"
              + ("; shared tiers on Redis" if doc.get("redis") else "") + "\n")
    print(render_table(doc["scenarios"], scale_out))
    print("\nprefix hit % = cached prompt tokens / prompt tokens, from the engines' "
          "/sim/stats; prefill tokens = prompt tokens the engines computed, not served from "
          "their KV cache: their prefill work (a request the router's response cache "
          "answers does none, and is not in the hit rate either); KV-aware % = requests "
          "the KV scorer routed (the rest fell back to the strategy); finished in "
          f"{doc['wall_seconds']:.1f}s")
    if getattr(args, "rounds", 1) > 1:
        print(f"each number is the median of {args.rounds} rounds (errors: their sum; "
              "requests per engine: the first round's); --json has every round")


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
    try:
        args.overrides = parse_sets(args.sets)
    except ValueError as exc:
        print(f"continuum-router demo: {exc}", file=sys.stderr)
        return 2
    shaping = [name for name, given in (("--seed", args.seed is not None),
                                        ("--quick", args.quick),
                                        ("--rate", args.rate is not None)) if given]
    if args.workload and shaping:
        print(f"continuum-router demo: {' and '.join(shaping)} shape the generated "
              "workloads; --workload replays its file as written", file=sys.stderr)
        return 2
    if args.seed is None:
        args.seed = 0
    load = args.scenario == "load"
    if args.max_num_seqs is None:
        args.max_num_seqs = LOAD_MAX_NUM_SEQS if load else FleetShape.max_num_seqs
    if args.concurrency is None:
        args.concurrency = LOAD_CONCURRENCY if load else 64
    began = time.monotonic()

    def progress(message: str) -> None:
        print(f"demo [{time.monotonic() - began:5.1f}s] {message}", file=sys.stderr, flush=True)

    shape = FleetShape(args.engines, args.num_blocks, args.max_num_seqs, args.latency_scale)
    from continuum.sim.workload import WorkloadFileError, read_jsonl, write_jsonl

    make_workload, rows_of_scenario = WORKLOADS[args.scenario]
    try:
        workload = read_jsonl(args.workload) if args.workload else \
            make_workload(args.seed, args.quick, args.rate)
    except WorkloadFileError as exc:
        print(f"continuum-router demo: {exc}", file=sys.stderr)
        return 2
    if args.requests:
        workload = workload.limit(args.requests)
    if args.save_workload:
        try:
            write_jsonl(workload, args.save_workload)
        except OSError as exc:
            print(f"continuum-router demo: {exc}", file=sys.stderr)
            return 2
        print(f"continuum-router demo: {len(workload.sessions)} sessions, "
              f"{workload.requests} requests of workload {workload.name!r} written to "
              f"{args.save_workload}", file=sys.stderr)
        return 0
    warmup = warmup_workload(workload) if load else None
    scenarios = select_scenarios(args.strategies, rows_of_scenario)
    if args.rivals_bin is not None and not args.strategies:
        scenarios += RIVAL_SCENARIOS
    problems = check_scenarios(scenarios, args.rivals_bin)
    if problems:
        print("\n".join(f"continuum-router demo: {p}" for p in problems), file=sys.stderr)
        return 2
    run_id = secrets.token_hex(8)
    workdir = Path(tempfile.mkdtemp(prefix="continuum-demo-"))
    children = demo_children(workdir, run_id)
    rows: list[dict[str, Any]] = []
    listener: dict[str, int] | None = None
    redis_server = None
    args.redis_url = None
    try:
        if (args.workers or 1) > 1 or (args.routers or 1) > 1 or args.redis:
            from continuum.devtools.redis_server import RedisServer

            redis_server = RedisServer()
            args.redis_url = redis_server.url
            progress(f"redis-server on port {redis_server.port} for the shared tiers")
        with signals_to_main(), requests.Session() as http:
            http.trust_env = False
            args.push_setup = PushSetup.create(workdir) if args.push else None
            kv_rival = any(s.rival in KV_EVENT_RIVALS for s in scenarios)
            fleet = start_fleet(children, http, shape,
                                kv_rival or any(s.kv_events for s in scenarios),
                                progress, event_bus=args.push_setup.listener_section()
                                if args.push_setup else None, engines_bind=kv_rival)
            seeded = "" if args.workload else f" seed {args.seed}"
            progress(f"workload {workload.name!r}{seeded}: "
                     f"{len(workload.sessions)} sessions, {workload.requests} requests")
            rounds: list[list[dict[str, Any]]] = [[] for _ in scenarios]
            for number, (which_row, scenario) in itertools.product(range(args.rounds),
                                                                   enumerate(scenarios)):
                which = f" (round {number + 1} of {args.rounds})" if args.rounds > 1 else ""
                progress(f"{scenario.name}: replaying{which}")
                args.round_suffix = f"-round{number + 1}" if args.rounds > 1 else ""
                row = run_scenario(scenario, children, http, workload, fleet, args, warmup)
                rounds[which_row].append(row)
                progress(f"{scenario.name}: {row['ok']} ok, {row['errors']} errors, "
                         f"hit rate {row['prefix_hit_rate']:.1%}, "
                         f"{row['requests_per_second']} req/s")
                for sample in row["error_samples"]:
                    progress(f"  error: {sample}")
                if row["errors"] and not scenario.direct:
                    progress("  router log:\n" + children.log_tail(
                        f"router-{slug(scenario.name)}.log"))
            rows.extend(median_row(runs) for runs in rounds)
            if fleet.listener is not None:
                listener = listener_stats(http, fleet.listener)
    except (RuntimeError, OSError, subprocess.SubprocessError) as exc:
        # OSError: requests' errors, spawn failures
        print(f"continuum-router demo: {exc}", file=sys.stderr)
        reported = exc.child if isinstance(exc, ChildExited) else None
        for child in children.exited():  # whatever else died is likely the cause
            if child is not reported:
                print(f"continuum-router demo: {child.exit_report()}", file=sys.stderr)
        return 3
    except KeyboardInterrupt:
        print("continuum-router demo: interrupted", file=sys.stderr)
        return 130
    finally:
        children.stop_all()
        if redis_server is not None:
            redis_server.stop()
        if args.keep_logs:
            print(f"continuum-router demo: logs and configs in {workdir}", file=sys.stderr)
        else:
            shutil.rmtree(workdir, ignore_errors=True)
    doc = {
        "run_id": run_id, "run_env": RUN_ENV, "pids": children.pids,
        "seed": None if args.workload else args.seed,
        "quick": args.quick, "push": args.push, "scenario": args.scenario, "engines": shape.engines,
        "fleet_shape": asdict(shape),
        "workload": {"name": workload.name, "sessions": len(workload.sessions),
                     "requests": workload.requests, "file": args.workload},
        "wall_seconds": round(time.monotonic() - began, 2), "scenarios": rows,
        "kv_listener": listener, "workers": args.workers or 1, "routers": args.routers or 1,
        "redis": args.redis_url is not None,
    }
    _print_results(doc, args)
    return 1 if any(row["errors"] for row in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
