"""``continuum-router demo --rounds N``: one row per scenario from N rounds of it, and
``--records`` writing every measured request."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from continuum.devtools.demo import median_row, parse_sets, render_table, write_records


def row(p99: float, hit: float, errors: int = 0, **more: Any) -> dict[str, Any]:
    return {"name": "KV index", "direct": False, "ttft_ms_p99": p99, "prefix_hit_rate": hit,
            "errors": errors, "skipped": 0, "engine_requests": [3, 1],
            "kv_aware_share": None, "error_samples": [f"e{p99}"] if errors else [], **more}


def demo(*args: str) -> subprocess.CompletedProcess[str]:
    """``continuum-router demo ARGS`` in a child interpreter, its output captured."""
    return subprocess.run([sys.executable, "-m", "continuum.cli", "demo", *args],
                          capture_output=True, text=True, timeout=60, check=False)


def test_one_round_is_the_row_itself() -> None:
    only = row(100.0, 0.9)
    assert median_row([only]) is only
    assert "rounds" not in only


def test_numbers_are_medians_errors_are_summed_and_the_rest_is_the_first_rounds() -> None:
    runs = [row(300.0, 0.95, errors=1), row(100.0, 0.97), row(200.0, 0.90, errors=2)]
    merged = median_row(runs)
    assert merged["ttft_ms_p99"] == 200.0
    assert merged["prefix_hit_rate"] == 0.95
    assert merged["errors"] == 3  # no failed request is hidden by a median
    assert merged["error_samples"] == ["e300.0", "e200.0"]
    assert merged["direct"] is False and merged["name"] == "KV index"
    assert merged["engine_requests"] == [3, 1] and merged["kv_aware_share"] is None
    assert merged["rounds"] == runs
    # a number some round lacks is not a median of the others: the first round's stays
    runs[1]["ttft_ms_p99"] = None
    assert median_row(runs)["ttft_ms_p99"] == 300.0


def test_the_table_shows_the_engines_prefill_work_beside_the_hit_rate() -> None:
    rows = [row(180.0, 0.934, engine_prefill_tokens=25632, requests_per_second=4.1,
                ttft_ms_mean=25.1, router_cache_hits=28),
            row(177.0, 0.944, name="sglang-router cache_aware", engine_prefill_tokens=23924,
                requests_per_second=4.1, ttft_ms_mean=27.7, router_cache_hits=None)]
    head, _rule, ours, theirs = render_table(rows).splitlines()
    titles = [t for t in head.split("  ") if t]
    assert titles[titles.index("prefix hit %") + 1].strip() == "prefill tokens"
    assert ours.split()[-5:-3] == ["93.4", "25632"]
    assert theirs.split()[-5:-3] == ["94.4", "23924"]
    assert theirs.split()[-3] == "-"  # a rival has no response cache


def test_records_are_one_json_line_per_request(tmp_path: Path) -> None:
    records = [{"session": "s", "turn": t, "ttft": 0.01 * t} for t in range(3)]
    path = write_records(tmp_path / "out", "KV index (seed key) + load guard", records)
    assert path.name == "kv-index-seed-key-load-guard.jsonl"
    assert [json.loads(line) for line in path.read_text().splitlines()] == records


@pytest.mark.parametrize(("option", "value", "says"), [
    ("--rounds", "0", "--rounds: must be a whole number >= 1 (got 0)"),
    ("--workers", "0", "--workers: must be a whole number >= 1 (got 0)"),
    ("--routers", "-2", "--routers: must be a whole number >= 1 (got -2)"),
    ("--requests", "0", "--requests: must be a whole number >= 1 (got 0)"),
    ("--engines", "x", "--engines: must be a whole number >= 1 (got x)"),
    ("--duration", "-5", "--duration: must be a number > 0 (got -5)"),
    ("--rate", "0", "--rate: must be a number > 0 (got 0)"),
    ("--request-timeout", "nan", "--request-timeout: must be a number > 0 (got nan)"),
    ("--latency-scale", "-1", "--latency-scale: must be a number >= 0 (got -1)"),
])
def test_out_of_range_options_are_refused_before_anything_starts(
        option: str, value: str, says: str) -> None:
    """Each one was once taken as its default (0 for --workers, --routers, --rate and
    --requests) or ran an empty replay (--duration -5) instead of being refused."""
    proc = demo(option, value)
    assert proc.returncode == 2, proc.stderr
    assert says in proc.stderr
    assert "starting" not in proc.stderr


def test_set_items_become_one_nested_router_override() -> None:
    assert parse_sets(["fleet.fleet_load_push_ms=5", "fleet.use_redis=true",
                       "selection_strategy=RoundRobin", "scorers=[\"KvOverlap\"]"]) == {
        "fleet": {"fleet_load_push_ms": 5, "use_redis": True},
        "selection_strategy": "RoundRobin", "scorers": ["KvOverlap"]}
    assert parse_sets([]) == {}
    for bad in ("fleet.fleet_load_push_ms", "=5", "fleet..x=1"):
        with pytest.raises(ValueError, match="PATH=VALUE"):
            parse_sets([bad])


def test_a_bad_set_item_is_refused_before_anything_starts() -> None:
    proc = demo("--set", "fleet")
    assert proc.returncode == 2, proc.stderr
    assert "expected PATH=VALUE" in proc.stderr


def test_the_demo_tells_the_router_its_engines_slots() -> None:
    """Each engine's ``--max-num-seqs`` goes into ``backends[].slots``, which the adaptive
    guard reads; a valid config with it, and without it when the slots are not known."""
    from continuum.config import check_config
    from continuum.devtools.demo import KV_DEFAULT, router_config

    engines = ["http://127.0.0.1:8001", "http://127.0.0.1:8002"]
    config = router_config(KV_DEFAULT, engines, "http://127.0.0.1:1", slots=2)
    assert [b["slots"] for b in config["backends"]] == [2, 2]
    result = check_config(config)
    assert result.config is not None and not result.errors
    assert [b.slots for b in result.config.backends] == [2, 2]
    unknown = router_config(KV_DEFAULT, engines, "http://127.0.0.1:1")
    assert all("slots" not in b and "learn_slots" not in b for b in unknown["backends"])
    learned = router_config(KV_DEFAULT, engines, "http://127.0.0.1:1", learn_slots=True)
    result = check_config(learned)
    assert result.config is not None and not result.errors
    assert [(b.slots, b.learn_slots) for b in result.config.backends] == [(None, True)] * 2
    assert result.config.health_check.enabled


def test_demo_slots_option() -> None:
    from continuum.devtools.demo import build_parser

    parser = build_parser()
    assert parser.parse_args([]).slots == "given"
    assert parser.parse_args(["--slots", "learned"]).slots == "learned"
    with pytest.raises(SystemExit):
        parser.parse_args(["--slots", "sometimes"])


def test_a_rival_router_not_installed_is_refused_before_anything_starts(tmp_path: Path) -> None:
    proc = demo("--rivals-bin", str(tmp_path))
    assert proc.returncode == 2, proc.stderr
    for name in ("sglang-router", "vllm-router"):
        assert f"{name} is not installed in {tmp_path}" in proc.stderr
    assert "pip install sglang-router vllm-router" in proc.stderr
    assert "replaying" not in proc.stderr


def test_a_rival_router_is_found_in_the_bin_directory_given(tmp_path: Path) -> None:
    from continuum.devtools.demo import RIVAL_SCENARIOS, check_scenarios, select_scenarios
    from continuum.devtools.fleet import rival_executable

    exe = tmp_path / "vllm-router"
    exe.write_text("#!/bin/sh\n")
    assert rival_executable("vllm-router cache_aware", str(tmp_path)) is None  # not executable
    exe.chmod(0o755)
    assert rival_executable("vllm-router cache_aware", str(tmp_path)) == str(exe)
    assert rival_executable("sglang-router cache_aware", str(tmp_path)) is None
    assert check_scenarios(RIVAL_SCENARIOS, str(tmp_path)) == [
        "sglang-router cache_aware: sglang-router is not installed in " + str(tmp_path)
        + " (pip install sglang-router vllm-router, in a venv of their own, and give its "
        "bin directory as --rivals-bin)"]
    # --strategies names them like the other rows
    [row] = select_scenarios(["vllm-router-cache_aware"])
    assert row.rival == "vllm-router cache_aware" and not row.direct


def test_the_kv_aware_rival_subscribes_to_every_engines_kv_events() -> None:
    """``vllm-router kv_aware`` reads the engines' KV events itself: its command line names
    each worker's PUB endpoint and the model they serve; the other rows name none, and
    starting it without the endpoints is refused before anything runs."""
    from continuum.devtools.fleet import (
        KV_EVENT_RIVALS,
        MODEL,
        RIVAL_ROUTERS,
        rival_argv,
        start_rival,
    )

    urls = ["http://127.0.0.1:8001", "http://127.0.0.1:8002"]
    endpoints = ["tcp://127.0.0.1:9001", "tcp://127.0.0.1:9002"]
    argv = rival_argv(RIVAL_ROUTERS["vllm-router kv_aware"], "/x/vllm-router", 1, urls, 2,
                      endpoints)
    assert argv[argv.index("--policy") + 1] == "kv_aware"
    sources = [argv[i + 1] for i, arg in enumerate(argv) if arg == "--kv-event-source"]
    assert sources == ["http://127.0.0.1:8001=tcp://127.0.0.1:9001",
                       "http://127.0.0.1:8002=tcp://127.0.0.1:9002"]
    assert argv[argv.index("--kv-event-model") + 1] == MODEL
    plain = rival_argv(RIVAL_ROUTERS["vllm-router cache_aware"], "/x/vllm-router", 1, urls, 2)
    assert "--kv-event-source" not in plain and "--kv-event-model" not in plain
    assert set(KV_EVENT_RIVALS) == {"vllm-router kv_aware"}
    with pytest.raises(ValueError, match="needs their endpoints"):
        start_rival(None, "vllm-router kv_aware", "/x/vllm-router", urls)  # type: ignore[arg-type]


def test_with_engines_binding_the_listener_connects_to_them() -> None:
    """The fleet a KV-reading rival needs: each engine binds its PUB socket and the
    listener connects to it (a config the listener accepts), so both can subscribe."""
    from continuum.devtools.fleet import listener_config
    from listener.app import listener_issues
    from listener.config import check_listener_config

    names, urls = ["engine-0", "engine-1"], ["http://127.0.0.1:8001", "http://127.0.0.1:8002"]
    for connect, mode in ((False, "bind"), (True, "connect")):
        doc = listener_config(names, urls, 9000, connect=connect)
        assert [s["zmq_mode"] for s in doc["sources"]] == [mode, mode]
        assert [s["zmq_endpoint"] for s in doc["sources"]] == ["tcp://127.0.0.1:9000",
                                                               "tcp://127.0.0.1:9001"]
        config, errors, _warnings = check_listener_config(doc)
        assert config is not None and not errors, errors
        assert [s.zmq_mode for s in config.sources] == [mode, mode]
        errors, _warnings = listener_issues(config)
        assert errors == []  # the engines' host is an allowed publisher


def test_save_workload_writes_the_scenarios_sessions_and_starts_nothing(tmp_path: Path) -> None:
    from continuum.devtools.demo import rag_workload
    from continuum.sim.workload import read_jsonl

    path = tmp_path / "rag.jsonl"
    proc = demo("--scenario", "rag", "--quick", "--seed", "2", "--requests", "40",
                "--save-workload", str(path))
    assert proc.returncode == 0, proc.stderr
    assert "starting" not in proc.stderr
    assert f"40 requests of workload 'rag' written to {path}" in proc.stderr
    assert read_jsonl(path).sessions == rag_workload(2, True).limit(40).sessions


def test_a_bad_workload_file_is_refused_before_anything_starts(tmp_path: Path) -> None:
    path = tmp_path / "mine.jsonl"
    path.write_text('{"turns": ["hello"]}\n{"turns": ["hi"], "arrival": "soon"}\n',
                    encoding="utf-8")
    proc = demo("--workload", str(path))
    assert proc.returncode == 2, proc.stderr
    assert f"{path} line 2: 'arrival' must be a number of at least 0" in proc.stderr
    assert "starting" not in proc.stderr


@pytest.mark.parametrize("shaping", [["--seed", "0"], ["--quick"], ["--rate", "5"]])
def test_options_that_shape_a_generated_workload_are_refused_with_a_file(
        shaping: list[str], tmp_path: Path) -> None:
    """They would be silently ignored: the file is replayed as written."""
    path = tmp_path / "mine.jsonl"
    path.write_text('{"turns": ["hello"]}\n', encoding="utf-8")
    proc = demo("--workload", str(path), *shaping)
    assert proc.returncode == 2, proc.stderr
    assert f"{shaping[0]} shape the generated workloads; --workload replays its file as " \
        "written" in proc.stderr
    assert "starting" not in proc.stderr
