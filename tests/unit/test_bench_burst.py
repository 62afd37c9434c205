"""tools.bench.burst: the burst workload file for ``continuum-router demo --workload``."""

from __future__ import annotations

from collections import Counter
from pathlib import Path

import pytest

from continuum.sim.tokenizer import SimTokenizer
from continuum.sim.workload import read_jsonl
from tools.bench.burst import burst, main


def test_the_burst_arrives_within_its_window_over_its_prompts() -> None:
    workload = burst(4, sessions=40, prompts=5, prompt_tokens=600, turns=2, window=0.5)
    sessions = workload.sessions
    assert len(sessions) == 40 and workload.requests == 80
    assert all(0.0 <= s.arrival <= 0.5 for s in sessions)
    assert [s.arrival for s in sessions] == sorted(s.arrival for s in sessions)
    systems = Counter(s.system for s in sessions)
    assert len(systems) == 5  # 40 uniform draws over 5 prompts: all five (p ~ 1 - 3e-4)
    tokens = SimTokenizer()
    assert all(600 <= len(tokens.encode(s.system or "")) <= 700 for s in sessions)
    assert {s.group for s in sessions} == {f"sys-{i}" for i in range(5)}
    assert burst(4, sessions=40, prompts=5, prompt_tokens=600, turns=2, window=0.5) == workload


def test_the_file_it_writes_is_what_the_demo_reads(tmp_path: Path) -> None:
    out = tmp_path / "burst.jsonl"
    assert main(["--seed", "2", "--sessions", "6", "--out", str(out)]) == 0
    assert read_jsonl(out).sessions == burst(2, sessions=6).sessions


def test_counts_below_one_are_refused(tmp_path: Path) -> None:
    with pytest.raises(SystemExit) as caught:
        main(["--prompts", "0", "--out", str(tmp_path / "x.jsonl")])
    assert caught.value.code == 2
    assert not (tmp_path / "x.jsonl").exists()
