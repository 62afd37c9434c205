"""tools.bench.queues: each engine's load when each request was sent, from demo records."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tools.bench import queues


def _rec(backend: str, start: float, latency: float, ttft: float, **kw: object) -> dict:
    return {"session": "s", "turn": 0, "kind": "chat", "group": "g", "start": start,
            "ttft": ttft, "latency": latency, "status": 200, "error": None,
            "prompt_tokens": 100, "cached_tokens": 50, "completion_tokens": 5,
            "backend": backend, **kw}


RECORDS = [
    _rec("e0", 0.0, 10.0, 0.02),   # e0: 0 running
    _rec("e0", 1.0, 9.0, 0.03),    # e0: 1
    _rec("e0", 2.0, 3.0, 0.50),    # e0: 2 = full, while e1 is idle
    _rec("e1", 3.0, 1.0, 0.01),    # e1: 0
    _rec("e1", 3.5, 1.0, 0.04),    # e1: 1
    _rec("e1", 3.6, 1.0, 0.20),    # e1: 2 = full, e0 full (3) too
    _rec("e0", 5.0, 1.0, 0.30),    # e0: 2 (the one sent at 2.0 ended at 5.0)
    _rec("e1", 5.0, 1.0, 0.01, error="timeout"),  # failed: left out
]


def test_loads_are_the_requests_in_flight_when_each_was_sent() -> None:
    sent = queues.loads_at_send(RECORDS[:-1])
    assert [(s.backend, s.loads) for s in sent] == [
        ("e0", {"e0": 0, "e1": 0}),
        ("e0", {"e0": 1, "e1": 0}),
        ("e0", {"e0": 2, "e1": 0}),
        ("e1", {"e0": 3, "e1": 0}),
        ("e1", {"e0": 3, "e1": 1}),
        ("e1", {"e0": 3, "e1": 2}),
        ("e0", {"e0": 2, "e1": 0}),
    ]


def test_the_summary_tells_queued_requests_from_avoidable_ones(tmp_path: Path) -> None:
    path = tmp_path / "kv-index.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in RECORDS) + "\n")
    assert len(queues.load_records(path)) == 7  # the failed one is left out
    summary = queues.summarize(queues.loads_at_send(queues.load_records(path)), slots=2,
                               tail=2)
    assert summary["requests"] == 7
    assert summary["sent_to_full"] == round(3 / 7, 4)
    # at 3.6 s both engines were full: not avoidable; at 2.0 and 5.0 e1 had room
    assert summary["sent_to_full_with_a_free_slot_elsewhere"] == round(2 / 7, 4)
    assert summary["ttft_ms"]["full"] == {"p50": 300.0, "p99": 500.0}
    assert summary["ttft_ms"]["not_full"]["p99"] == 40.0
    assert summary["requests_per_engine"] == {"e0": 4, "e1": 3}
    assert [row["ttft_ms"] for row in summary["slowest"]] == [500.0, 300.0]
    assert summary["slowest"][0]["loads"] == {"e0": 2, "e1": 0}
    # with one slot per engine, more were sent to a full engine
    assert queues.summarize(queues.loads_at_send(RECORDS[:-1]), slots=1)["sent_to_full"] \
        == round(5 / 7, 4)


def test_main_reads_a_directory_and_refuses_a_missing_file(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    (tmp_path / "a.jsonl").write_text("".join(json.dumps(r) + "\n" for r in RECORDS))
    assert queues.main([str(tmp_path), "--json", "--tail", "1"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert list(out) == [str(tmp_path / "a.jsonl")]
    assert len(out[str(tmp_path / "a.jsonl")]["slowest"]) == 1
    assert queues.main([str(tmp_path / "nope.jsonl")]) == 2
    assert "no records file" in capsys.readouterr().err
