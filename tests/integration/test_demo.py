"""The demo end to end (``continuum-router demo --quick --json``), and the replay driver
against a real simulated engine."""

from __future__ import annotations

import itertools
import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from continuum.sim.replay import replay
from continuum.sim.workload import multi_turn
from tests.conftest import ROOT, Proc, free_port, wait_http

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


@pytest.mark.slow
@pytest.mark.e2e
def test_demo_quick_prints_ordered_hit_rates_and_cleans_up() -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "continuum.cli", "demo", "--quick", "--json"],
        cwd=str(ROOT), capture_output=True, timeout=120, check=False,
    )
    stderr = proc.stderr.decode(errors="replace")
    assert proc.returncode == 0, stderr
    doc: dict[str, Any] = json.loads(proc.stdout)
    rows = {row["name"]: row for row in doc["scenarios"]}
    assert {"single engine", "RoundRobin", "PrefixAwareHash"} <= set(rows)
    for row in rows.values():
        assert row["errors"] == 0, row["error_samples"]
        assert row["ok"] == doc["workload"]["requests"]
        assert row["engine_prompt_tokens"] > 0
    single = rows["single engine"]["prefix_hit_rate"]
    round_robin = rows["RoundRobin"]["prefix_hit_rate"]
    prefix_aware = rows["PrefixAwareHash"]["prefix_hit_rate"]
    assert single > round_robin, rows
    assert prefix_aware > round_robin, rows
    # The router spread RoundRobin evenly; the direct row never touched the fleet.
    assert len(rows["RoundRobin"]["engine_requests"]) == doc["engines"]
    assert min(rows["RoundRobin"]["engine_requests"]) > 0
    if sys.platform.startswith("linux"):
        marker = f"{doc['run_env']}={doc['run_id']}".encode()
        assert _processes_with(marker) == []
        for pid in doc["pids"]:  # each one exited (or its PID now belongs to a stranger)
            environ = Path(f"/proc/{pid}/environ")
            try:
                assert marker not in environ.read_bytes()
            except OSError:
                pass


@pytest.mark.e2e
def test_follow_up_turns_hit_the_engine_cache(tmp_path: Path) -> None:
    port = free_port()
    sim = Proc(
        [sys.executable, "-m", "continuum.sim.cli", "--port", str(port), "--fast"],
        log=tmp_path / "sim.log",
    )
    try:
        url = f"http://127.0.0.1:{port}"
        wait_http(url + "/health", proc=sim.popen)
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
