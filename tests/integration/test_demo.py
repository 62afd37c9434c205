"""The demo end to end (``continuum-router demo --quick --json``), and the replay driver
against a real simulated engine."""

from __future__ import annotations

import itertools
import json
import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from continuum.devtools.demo import WORKLOADS
from continuum.devtools.procs import Child, free_port, wait_http
from continuum.sim.replay import replay
from continuum.sim.workload import multi_turn

ROOT = Path(__file__).resolve().parents[2]
BLOCK_SIZE = 16


def _processes_with(marker: bytes) -> list[str]:
    """Command lines of live processes whose environment contains ``marker``."""
    found = []
    for environ in Path("/proc").glob("[0-9]*/environ"):
        try:
            if marker in environ.read_bytes():
                cmdline = (environ.parent / "cmdline").read_bytes()
                found.append(cmdline.replace(b"\0", b" ").decode(errors="replace"))
        except OSError:  # gone meanwhile, or not ours to read
            continue
    return found


def _run_demo(*args: str, timeout: float) -> dict[str, Any]:
    proc = subprocess.run(
        [sys.executable, "-m", "continuum.cli", "demo", *args, "--json"],
        cwd=str(ROOT), capture_output=True, timeout=timeout, check=False,
    )
    stderr = proc.stderr.decode(errors="replace")
    assert proc.returncode == 0, stderr
    doc: dict[str, Any] = json.loads(proc.stdout)
    for row in doc["scenarios"]:
        assert row["errors"] == 0, row["error_samples"]
        # turns not started by --duration are skipped (an overloaded row under load)
        assert row["ok"] + row["skipped"] == doc["workload"]["requests"], row
        assert row["engine_prompt_tokens"] > 0
        assert row["engine_prefill_tokens"] == \
            row["engine_prompt_tokens"] - row["engine_cached_prompt_tokens"], row
    _assert_no_leftovers(doc)
    return doc


def _assert_no_leftovers(doc: dict[str, Any]) -> None:
    if not sys.platform.startswith("linux"):
        return
    marker = f"{doc['run_env']}={doc['run_id']}".encode()
    assert _processes_with(marker) == []
    for pid in doc["pids"]:  # each one exited (or its PID now belongs to a stranger)
        environ = Path(f"/proc/{pid}/environ")
        try:
            assert marker not in environ.read_bytes()
        except OSError:
            pass


def _assert_kv_row(row: dict[str, Any]) -> None:
    """A KV-index row started from an empty index and routed with it."""
    kv = row["kv_index"]
    assert kv["entry_count_at_start"] == 0, kv
    assert kv["events_received"] > 0 and kv["entry_count_at_end"] > 0, kv
    assert kv["reconnects"] == 0, kv
    decisions = kv["routing_decisions"]
    assert decisions["kv_aware"] > decisions["fallback"], kv
    assert row["kv_aware_share"] == pytest.approx(decisions["kv_aware"] / decisions["total"],
                                                  abs=1e-4)


@pytest.mark.slow
@pytest.mark.e2e
def test_demo_quick_prints_ordered_hit_rates_and_cleans_up() -> None:
    # Half the quick workload's arrival rate (24/s). At 24/s with the CPUs busy (three
    # busy loops on two CPUs; CI runs other tests beside this one), the engines queue more
    # and the default KV index's row fell 2-5 points below its quiet runs, under the seed
    # key's row; at 12/s under the same load it did not.
    doc = _run_demo("--quick", "--rate", "12", timeout=180)
    rows = {row["name"]: row for row in doc["scenarios"]}
    assert all(row["skipped"] == 0 for row in rows.values()), rows
    assert {"single engine", "RoundRobin", "PrefixAwareHash", "KV index",
            "KV index (seed key)"} <= set(rows)
    single = rows["single engine"]["prefix_hit_rate"]
    round_robin = rows["RoundRobin"]["prefix_hit_rate"]
    prefix_aware = rows["PrefixAwareHash"]["prefix_hit_rate"]
    kv_index = rows["KV index"]["prefix_hit_rate"]
    assert single > round_robin, rows
    assert prefix_aware > round_robin, rows
    # learning the actual holders does at least as well as the hash ring, and the chain
    # index (the default) as well as the seed's key. A quick run has about 100 requests
    # through the router and its hit rates move with how busy the machine is (a point or
    # two between runs, more on a loaded machine), so this is a floor for CI, 3 points
    # below the seed key; the README's table (full runs) is where the margin is measured.
    assert kv_index >= prefix_aware, rows
    # the engines' prefill work follows: what the KV index routes, they compute less of
    prefill = {name: rows[name]["engine_prefill_tokens"] for name in rows}
    assert prefill["KV index"] < prefill["PrefixAwareHash"] < prefill["RoundRobin"], prefill
    assert kv_index >= rows["KV index (seed key)"]["prefix_hit_rate"] - 0.03, rows
    for name in ("KV index", "KV index (seed key)"):
        _assert_kv_row(rows[name])
        # the first requests of each prefix precede its events: the strategy places them
        assert rows[name]["kv_index"]["routing_decisions"]["fallback"] > 0
        assert rows[name]["router_cache_hits"] > 0  # all four tiers: the response cache too
    listener = doc["kv_listener"]
    assert listener["events_in"] > 0 and listener["processor_events_out"] > 0, listener
    for counter in ("decode_errors", "processor_errors", "processor_detokenize_errors",
                    "rejected_publishers"):
        assert listener[counter] == 0, listener
    # The router spread RoundRobin evenly; the direct row never touched the fleet.
    assert len(rows["RoundRobin"]["engine_requests"]) == doc["engines"]
    assert min(rows["RoundRobin"]["engine_requests"]) > 0
    assert rows["PrefixAwareHash"]["kv_index"] is None


def _beside_rival(row: str, rival_name: str) -> tuple[dict[str, Any], dict[str, Any]]:
    """A quick demo of ``row`` and rival router ``rival_name`` (a test dependency,
    installed beside this interpreter): the rows by name, and the rival's row, every
    request of which went through it to the fleet (none answered from a cache of its
    own), with its CPU read from /proc like the router's."""
    bin_dir = str(Path(sys.executable).parent)
    doc = _run_demo("--quick", "--rate", "12", "--strategies", row, rival_name,
                    "--rivals-bin", bin_dir, timeout=180)
    rows = {r["name"]: r for r in doc["scenarios"]}
    rival = rows[rival_name]
    assert sum(rival["engine_requests"]) == doc["workload"]["requests"]
    assert len(rival["engine_requests"]) == doc["engines"]
    assert rival["router_cache_hits"] is None and rival["kv_index"] is None
    assert rival["scale_out"]["router_cpu_ms_per_request"] > 0
    return rows, rival


@pytest.mark.slow
@pytest.mark.e2e
def test_demo_runs_sglang_router_in_front_of_the_same_engines() -> None:
    rows, rival = _beside_rival("RoundRobin", "sglang-router cache_aware")
    # its cache-aware routing keeps sessions where their prefixes are, as RoundRobin cannot
    assert rival["prefix_hit_rate"] > rows["RoundRobin"]["prefix_hit_rate"] + 0.1, rows


@pytest.mark.slow
@pytest.mark.e2e
def test_demo_runs_vllm_routers_kv_aware_policy_on_the_engines_kv_events() -> None:
    """``vllm-router kv_aware`` subscribes to the engines' KV events itself: the engines
    then bind their PUB sockets, and the KV listener connects to them as vllm-router does,
    so the KV index row runs beside it on the same events."""
    rows, rival = _beside_rival("KV index", "vllm-router kv_aware")
    # routing on what the engines hold keeps sessions with their prefixes (RoundRobin
    # gets about 50 % on this workload; this row without the events got 55 %)
    assert rival["prefix_hit_rate"] > 0.75, rows
    # the listener, connecting to the engines' sockets, fed the router's index
    _assert_kv_row(rows["KV index"])
    assert rows["KV index"]["prefix_hit_rate"] > 0.75, rows


@pytest.mark.slow
@pytest.mark.e2e
def test_demo_push_mode_routes_like_pull() -> None:
    """``--push``: engines -> listener -> TLS event bus -> router. The KV row routes with
    the index as in pull mode (pull measured 86.3-86.9 % hit, 85.7 % KV-aware on seed 0;
    push the same, docs/push-mode.md)."""
    doc = _run_demo("--quick", "--push", "--strategies", "KV index", timeout=120)
    assert doc["push"] is True
    (row,) = doc["scenarios"]
    kv = row["kv_index"]
    assert kv["entry_count_at_start"] == 0 and kv["events_received"] > 0, kv
    decisions = kv["routing_decisions"]
    assert decisions["kv_aware"] > decisions["fallback"], kv
    assert row["prefix_hit_rate"] >= 0.8, row


@pytest.mark.e2e
def test_demo_replays_a_hand_written_workload_file(tmp_path: Path) -> None:
    """``--workload FILE``: sessions written by hand (three long system prompts, two turns
    each) are replayed in place of the scenario's; the KV index row keeps them with their
    prompts' engines, where RoundRobin spreads them."""
    words = ["engine", "cache", "token", "prefix", "router", "prompt", "system", "answer"]
    prompts = [" ".join(words[(i + k) % len(words)] for k in range(700)) + f" {i}"
               for i in range(3)]
    path = tmp_path / "mine.jsonl"
    path.write_text("".join(json.dumps({
        "id": f"s{i}", "arrival": i * 0.15, "system": prompts[i % 3],
        "turns": [f"question {i}", f"and question {i} again"], "think_seconds": 0.1,
        "temperature": 0.7, "max_tokens": 12}) + "\n" for i in range(12)), encoding="utf-8")
    doc = _run_demo("--workload", str(path), "--strategies", "RoundRobin", "KV index",
                    timeout=120)
    assert doc["workload"] == {"name": "file mine.jsonl", "sessions": 12, "requests": 24,
                               "file": str(path)}
    assert doc["seed"] is None
    rows = {row["name"]: row for row in doc["scenarios"]}
    assert all(row["ok"] == 24 for row in rows.values()), rows
    _assert_kv_row(rows["KV index"])
    assert rows["KV index"]["engine_prefill_tokens"] < \
        0.6 * rows["RoundRobin"]["engine_prefill_tokens"], rows


@pytest.mark.slow
@pytest.mark.e2e
def test_demo_load_scenario_guard_keeps_tail_latency_down() -> None:
    """``--scenario load --quick`` (three rows, about 70 s on 2 cores): without a guard the seed
    scorer keeps sending the popular prompt to its one busy holder (p99 TTFT about 2 s);
    the default chain index's guard keeps the tail near the hash ring's or below it (about
    0.36-0.42 s against 0.41-0.49 s) at about the ring's hit rate (0.5-1.2 points above it
    in three runs, 0.3 below it in one CI run: slot_wait gives up some hits for the tail).
    On a machine about three times slower (stop 52's) the engines are busier for the same
    arrivals and the guard gives up more: 0.6-2.6 points below the ring in six runs (the
    most with other tests running beside it), so the row may give up three points (twelve
    requests). Its p99 against the ring's swung from 0.55x to 1.5x there: not compared."""
    assert [row.name for row in WORKLOADS["load"][1]] == [
        "single engine", "RoundRobin", "PrefixAwareHash", "KV index (seed key)",
        "KV index (seed key) + load guard", "KV index"]
    # the three rows compared (the whole scenario took twice as long in CI)
    doc = _run_demo("--scenario", "load", "--quick", "--strategies", "PrefixAwareHash",
                    "KV index (seed key)", "KV index", timeout=300)
    rows = {row["name"]: row for row in doc["scenarios"]}
    assert list(rows) == ["PrefixAwareHash", "KV index (seed key)", "KV index"]
    unguarded, adaptive = rows["KV index (seed key)"], rows["KV index"]
    for row in (unguarded, adaptive):
        _assert_kv_row(row)
    assert adaptive["ttft_ms_p99"] < unguarded["ttft_ms_p99"], rows
    assert max(adaptive["engine_requests"]) < max(unguarded["engine_requests"]), rows
    ring = rows["PrefixAwareHash"]
    # a quick run routes about 400 requests: a point of hits is four of them
    assert adaptive["prefix_hit_rate"] >= ring["prefix_hit_rate"] - 0.03, rows


@pytest.mark.slow
@pytest.mark.e2e
def test_demo_agent_sessions_are_placed_over_the_fleet_and_records_are_written(
    tmp_path: Path,
) -> None:
    """``--scenario agent --quick``: 16 sessions over two system prompts. Placement spreads
    the sessions' first requests over the engines (before it, they followed their system
    prompt's holder: two engines took them all), and each session's later requests stay
    where its history is. ``--records`` writes one line per measured request."""
    doc = _run_demo("--scenario", "agent", "--quick", "--strategies", "KV index",
                    "--records", str(tmp_path), timeout=180)
    (row,) = doc["scenarios"]
    lines = (tmp_path / "kv-index.jsonl").read_text().splitlines()
    records = [json.loads(line) for line in lines]
    assert len(records) == row["requests"] == doc["workload"]["requests"]
    assert {"session", "turn", "start", "ttft", "prompt_tokens", "cached_tokens",
            "backend"} <= set(records[0])
    sessions: dict[str, list[dict[str, Any]]] = {}
    for record in sorted(records, key=lambda r: (r["session"], r["turn"])):
        sessions.setdefault(record["session"], []).append(record)
    firsts = [turns[0]["backend"] for turns in sessions.values()]
    # Without placement two engines took them all. How soon the fleet's last engine gets
    # a session depends on the queues and KV pressure of the moment (the CI machine once
    # placed the 16 sessions over three engines), so at least three, none with over half.
    assert len(set(firsts)) >= doc["engines"] - 1, firsts
    assert max(firsts.count(b) for b in set(firsts)) <= len(firsts) // 2, firsts
    moved = sum(a["backend"] != b["backend"] for turns in sessions.values()
                for a, b in itertools.pairwise(turns))
    later = sum(len(turns) - 1 for turns in sessions.values())
    assert moved <= later * 0.1, (moved, later)
    assert row["prefix_hit_rate"] >= 0.7, row


@pytest.mark.slow
@pytest.mark.e2e
def test_demo_rag_chain_index_wins_where_the_seed_key_cannot_see() -> None:
    """``--scenario rag --quick``: the document in the user turn is invisible to the seed's
    key; the chain index finds its holder (quick runs measured 65-79% against 54-59% for
    the seed key and 51% for RoundRobin, 80% for the single engine; the 90 requests of a
    quick run are mostly documents' first requests, so the share of the single engine's
    rate is checked on the full run in the README, not here)."""
    doc = _run_demo("--scenario", "rag", "--quick", timeout=240)
    rows = {row["name"]: row["prefix_hit_rate"] for row in doc["scenarios"]}
    assert rows["KV index"] > rows["KV index (seed key)"] + 0.05, rows
    assert rows["KV index"] >= rows["RoundRobin"], rows


@pytest.mark.e2e
def test_follow_up_turns_hit_the_engine_cache(tmp_path: Path) -> None:
    port = free_port()
    sim = Child(
        [sys.executable, "-m", "continuum.sim.cli", "--port", str(port), "--fast"],
        log=tmp_path / "sim.log",
    )
    try:
        url = f"http://127.0.0.1:{port}"
        wait_http(url + "/health", children=[sim])
        workload = multi_turn(3, conversations=2, turns=(3, 3), prompts=2, rate=None,
                              think_seconds=0)
        result = replay(url, workload, concurrency=1, max_seconds=60, timeout=10)
    finally:
        sim.stop()
    assert result.summary()["errors"] == 0, result.error_samples()
    by_session: dict[str, list[Any]] = {}
    for record in result.records:
        by_session.setdefault(record.session, []).append(record)
    for records in by_session.values():
        records.sort(key=lambda r: r.turn)
        assert [r.turn for r in records] == [0, 1, 2]
        for previous, current in itertools.pairwise(records):
            # The previous prompt and the engine's own reply are cached, up to the last
            # full block.
            assert current.prompt_tokens > previous.prompt_tokens + previous.completion_tokens
            assert current.cached_tokens >= previous.prompt_tokens - BLOCK_SIZE
            assert current.ttft is not None


@pytest.mark.e2e
def test_demo_reports_why_a_child_died_instead_of_timing_out() -> None:
    """A router that cannot start (here: a worker class that does not exist, as when a
    dependency of gunicorn's gevent worker is missing) is reported with its exit status
    and its error at once, not after the start timeout as "timed out waiting"."""
    env = {**os.environ, "GUNICORN_CMD_ARGS": "--worker-class continuum.no_such_module.Worker"}
    proc = subprocess.run(
        [sys.executable, "-m", "continuum.cli", "demo", "--quick", "--strategies",
         "RoundRobin"],
        cwd=str(ROOT), capture_output=True, timeout=120, check=False, env=env,
    )
    stderr = proc.stderr.decode(errors="replace")
    assert proc.returncode == 3, stderr
    assert ("while waiting for the router (RoundRobin): router-roundrobin (pid "
            in stderr), stderr
    assert re.search(r"\) exited with status 1 after \d", stderr), stderr
    assert "No module named 'continuum.no_such_module'" in stderr, stderr
    assert "the end of router-roundrobin.log:" in stderr, stderr
    assert "timed out" not in stderr, stderr



@pytest.mark.slow
@pytest.mark.e2e
def test_demo_scale_out_two_routers_of_two_workers() -> None:
    """``--workers 2 --routers 2``: requests spread over both routers, the shared tiers on
    the demo's redis-server, one listener stream per backend for the whole fleet."""
    doc = _run_demo("--quick", "--workers", "2", "--routers", "2", "--requests", "40",
                    "--strategies", "KV index", "PrefixAwareHash + response cache",
                    timeout=240)
    assert doc["workers"] == 2 and doc["routers"] == 2 and doc["redis"] is True
    rows = {row["name"]: row for row in doc["scenarios"]}
    for row in rows.values():
        scale = row["scale_out"]
        assert scale["workers"] == 2 and scale["routers"] == 2, scale
        assert scale["router_memory_mib"] > 0 and scale["redis_ops_per_request"] > 0, scale
        assert scale["response_cache_hit_rate"] is not None, scale
    kv = rows["KV index"]
    # The Redis index's lease: one consumer per backend for 2 routers x 2 workers.
    assert set(kv["scale_out"]["listener_connections"].values()) == {1}, kv["scale_out"]
    # Routed by the shared index; the decisions are every worker's of both routers: one
    # per request that was not answered from the response cache.
    decisions = kv["kv_index"]["routing_decisions"]
    assert decisions["total"] == kv["ok"] - kv["scale_out"]["response_cache_hits"], kv
    assert kv["kv_aware_share"] is not None and kv["kv_aware_share"] > 0, kv["kv_index"]
    assert rows["PrefixAwareHash + response cache"]["scale_out"]["listener_connections"] \
        is None
