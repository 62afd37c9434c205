"""Workload generators (continuum.sim.workload) and the replay driver's request shapes."""

from __future__ import annotations

import dataclasses
import itertools
import random
import statistics
from collections import Counter
from typing import Any

import pytest
import requests

from continuum.sim import replay as replay_mod
from continuum.sim import workload as wl
from continuum.sim.tokenizer import SimTokenizer

GENERATORS = {
    "shared_system_prompt": lambda seed: wl.shared_system_prompt(seed, users=30),
    "multi_turn": lambda seed: wl.multi_turn(seed, conversations=12),
    "rag": lambda seed: wl.rag(seed, questions=20),
    "mixed": lambda seed: wl.mixed(seed, users=20, conversations=8, rag_questions=8),
    "rag_user_documents": lambda seed: wl.rag_user_documents(seed, questions=20),
    "agent": lambda seed: wl.agent(seed, sessions=6),
}


def test_rag_user_documents_share_the_system_prompt_and_vary_the_user_turn() -> None:
    workload = wl.rag_user_documents(3, questions=60, documents=12)
    assert {s.system for s in workload.sessions} == {wl.RAG_SYSTEM}
    groups = Counter(s.group for s in workload.sessions)
    assert groups.most_common(1)[0][1] >= 3 * groups.most_common()[-1][1]  # Zipf-skewed
    by_group: dict[str, set[str]] = {}
    for s in workload.sessions:
        by_group.setdefault(s.group, set()).add(s.turns[0].split("\n\nQuestion:")[0])
    assert all(len(docs) == 1 for docs in by_group.values())  # one document per group
    assert len({s.turns[0] for s in workload.sessions}) == len(workload.sessions)


def test_agent_sessions_grow_with_tool_outputs() -> None:
    workload = wl.agent(5, sessions=8, turns=(6, 9))
    tokenizer = SimTokenizer()
    for session in workload.sessions:
        assert 6 <= len(session.turns) <= 9
        assert session.turns[0].startswith("Task: ")
        assert all(t.startswith("Tool output (") for t in session.turns[1:])
        total = sum(len(tokenizer.encode(t)) for t in session.turns)
        assert total > 600  # the session's own history dwarfs any one turn


@pytest.mark.parametrize("name", sorted(GENERATORS))
def test_same_seed_same_workload(name: str) -> None:
    make = GENERATORS[name]
    assert make(7) == make(7)
    assert make(7) != make(8)


@pytest.mark.parametrize("name", sorted(GENERATORS))
def test_temperature_zero_by_default_and_arrivals_ordered(name: str) -> None:
    workload = GENERATORS[name](1)
    assert workload.sessions
    assert all(s.temperature == 0.0 for s in workload.sessions)
    arrivals = [s.arrival for s in workload.sessions]
    assert arrivals == sorted(arrivals)
    assert len({s.id for s in workload.sessions}) == len(workload.sessions)


def test_temperature_can_be_set() -> None:
    workload = wl.shared_system_prompt(0, users=5, temperature=0.7)
    assert {s.temperature for s in workload.sessions} == {0.7}


def test_poisson_mean_inter_arrival_is_one_over_rate() -> None:
    rate = 12.5
    offsets = wl.poisson_arrivals(random.Random(3), 20000, rate)
    gaps = [b - a for a, b in zip([0.0, *offsets], offsets, strict=False)]
    mean = statistics.fmean(gaps)
    assert mean == pytest.approx(1 / rate, rel=0.05)
    # Exponential gaps: the standard deviation equals the mean.
    assert statistics.pstdev(gaps) == pytest.approx(mean, rel=0.05)


def test_generator_arrivals_follow_the_rate() -> None:
    workload = wl.shared_system_prompt(5, users=4000, prompts=2, prompt_tokens=(50, 60), rate=4.0)
    last = workload.sessions[-1].arrival
    assert last / len(workload.sessions) == pytest.approx(0.25, rel=0.08)


def test_no_rate_means_all_at_once() -> None:
    assert wl.poisson_arrivals(random.Random(0), 3, None) == [0.0, 0.0, 0.0]
    workload = wl.multi_turn(0, conversations=4, rate=None)
    assert {s.arrival for s in workload.sessions} == {0.0}


def test_shared_system_prompts_are_long_shared_and_some_questions_repeat() -> None:
    workload = wl.shared_system_prompt(2, users=80, prompts=4, repeat_fraction=0.3)
    systems = Counter(s.system for s in workload.sessions)
    assert len(systems) == 4
    assert min(systems.values()) > 5  # every prompt is shared by many users
    assert {s.group for s in workload.sessions} == {f"sys-{k}" for k in range(4)}
    tokenizer = SimTokenizer()
    for text in systems:
        assert text is not None
        assert 900 <= len(tokenizer.encode(text)) <= 1900
    assert all(len(s.turns) == 1 for s in workload.sessions)
    requests_seen = Counter((s.system, s.turns[0]) for s in workload.sessions)
    assert max(requests_seen.values()) > 1  # exact repeats for a response cache


def test_system_prompts_differ_from_the_first_bytes() -> None:
    prompts = wl.system_prompts(random.Random(0), 8)
    assert len({p[:100] for p in prompts}) == 8


def test_multi_turn_conversations() -> None:
    workload = wl.multi_turn(4, conversations=30, turns=(2, 5), prompts=3, think_seconds=0.1)
    assert all(2 <= len(s.turns) <= 5 for s in workload.sessions)
    assert len({s.system for s in workload.sessions}) == 3
    assert any(s.think_seconds > 0 for s in workload.sessions)
    assert all(t.endswith("?") for s in workload.sessions for t in s.turns)


def test_rag_documents_are_shared_questions_short() -> None:
    workload = wl.rag(3, questions=40, documents=3)
    docs = Counter(s.system for s in workload.sessions)
    assert len(docs) == 3 and min(docs.values()) > 3
    tokenizer = SimTokenizer()
    for doc in docs:
        assert doc is not None and len(tokenizer.encode(doc)) >= 900
    for session in workload.sessions:
        assert session.kind == "rag" and len(session.turns) == 1
        assert len(tokenizer.encode(session.turns[0])) < 60


def test_mixed_shares_prompts_between_kinds() -> None:
    workload = wl.mixed(9, users=30, conversations=10, rag_questions=10, prompts=4)
    kinds = Counter(s.kind for s in workload.sessions)
    assert kinds == {"shared-system": 30, "multi-turn": 10, "rag": 10}
    by_kind: dict[str, set[str | None]] = {}
    for s in workload.sessions:
        by_kind.setdefault(s.kind, set()).add(s.system)
    assert by_kind["multi-turn"] <= by_kind["shared-system"]
    assert not by_kind["rag"] & by_kind["shared-system"]
    assert workload.requests == sum(len(s.turns) for s in workload.sessions)


def test_limit_caps_requests_in_arrival_order() -> None:
    workload = wl.multi_turn(0, conversations=10, turns=(3, 3))
    limited = workload.limit(7)
    assert limited.requests == 7
    assert [s.id for s in limited.sessions] == [s.id for s in workload.sessions[:3]]
    assert len(limited.sessions[-1].turns) == 1


def test_chat_body_streams_with_usage() -> None:
    session = wl.shared_system_prompt(0, users=1).sessions[0]
    body = replay_mod.chat_body(session, [{"role": "user", "content": "hi"}])
    assert body["stream"] is True
    assert body["stream_options"] == {"include_usage": True}
    assert body["temperature"] == 0.0
    assert "max_tokens" not in body


def test_replay_sends_each_turn_with_the_previous_replies(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    bodies: list[dict[str, Any]] = []

    def fake_send(
        http: requests.Session, url: str, body: dict[str, Any],
        record: replay_mod.RequestRecord, timeout: float,
    ) -> str:
        bodies.append({"messages": list(body["messages"])})
        record.ttft = 0.01
        record.prompt_tokens = 100
        record.cached_tokens = 50
        return f"reply {record.session} {record.turn}"

    monkeypatch.setattr(replay_mod, "send_streaming", fake_send)
    workload = wl.multi_turn(1, conversations=3, turns=(3, 3), rate=None, think_seconds=0)
    result = replay_mod.replay("http://127.0.0.1:9", workload, concurrency=2, max_seconds=30)
    assert len(result.records) == 9 and result.skipped == 0
    by_session: dict[str, list[list[dict[str, str]]]] = {}
    for body in bodies:
        system = body["messages"][0]["content"]
        by_session.setdefault(system + body["messages"][1]["content"], []).append(
            body["messages"]
        )
    for turns in by_session.values():
        turns.sort(key=len)
        assert [len(m) for m in turns] == [2, 4, 6]
        for previous, current in itertools.pairwise(turns):
            assert current[: len(previous)] == previous  # a follow-up extends the prompt
            assert current[len(previous)]["role"] == "assistant"
            assert current[len(previous)]["content"].startswith("reply ")
    summary = result.summary()
    assert summary["ok"] == 9 and summary["errors"] == 0
    assert summary["client_hit_rate"] == 0.5
    assert summary["ttft_ms_p99"] == 10.0


def test_replay_skips_turns_after_a_failure(monkeypatch: pytest.MonkeyPatch) -> None:
    def failing(
        http: requests.Session, url: str, body: dict[str, Any],
        record: replay_mod.RequestRecord, timeout: float,
    ) -> str:
        record.error = "HTTP 503: no backend"
        return ""

    monkeypatch.setattr(replay_mod, "send_streaming", failing)
    workload = wl.multi_turn(1, conversations=2, turns=(3, 3), rate=None, think_seconds=0)
    result = replay_mod.replay("http://127.0.0.1:9", workload, concurrency=1, max_seconds=30)
    assert result.summary()["errors"] == 2
    assert result.skipped == 4
    assert result.error_samples() == ["HTTP 503: no backend"]


def test_percentile_is_nearest_rank() -> None:
    values = [float(v) for v in range(1, 101)]
    assert replay_mod.percentile(values, 99) == 99.0
    assert replay_mod.percentile(values, 50) == 50.0
    assert replay_mod.percentile([5.0], 99) == 5.0
    assert replay_mod.percentile([], 99) is None


# -- workload files (continuum-router demo --workload / --save-workload) ---------------------


@pytest.mark.parametrize("name", sorted(GENERATORS))
def test_a_saved_workload_reads_back_as_the_same_sessions(name: str, tmp_path: Any) -> None:
    workload = GENERATORS[name](5)
    path = tmp_path / "w.jsonl"
    wl.write_jsonl(workload, path)
    back = wl.read_jsonl(path)
    assert back.sessions == workload.sessions
    assert back.requests == workload.requests
    assert back.name == "file w.jsonl"
    assert len(path.read_text(encoding="utf-8").splitlines()) == len(workload.sessions)


def test_a_file_line_holds_every_session_field_but_the_model() -> None:
    fields = {f.name for f in dataclasses.fields(wl.Session)}
    assert set(wl.FILE_FIELDS) == fields - {"model"}


def test_a_hand_written_file_takes_defaults_and_is_replayed_in_arrival_order(
        tmp_path: Any) -> None:
    path = tmp_path / "mine.jsonl"
    path.write_text(
        '{"turns": ["late"], "arrival": 2.5}\n'
        "\n"
        '{"turns": ["first", "second"], "system": "You are terse. Answer in one line."}\n'
        '{"id": "x", "turns": ["also at 0"], "temperature": 0.7, "max_tokens": 9,'
        ' "think_seconds": 0.25, "kind": "chat", "group": "g"}\n', encoding="utf-8")
    sessions = wl.read_jsonl(path).sessions
    assert [s.id for s in sessions] == ["line-3", "x", "line-1"]  # ties keep file order
    first, second, late = sessions
    assert first.turns == ("first", "second") and first.arrival == 0.0
    assert first.group == "You are terse. Answer in one line."[:40] and first.kind == "file"
    assert late.system is None and late.group == "-" and late.arrival == 2.5
    assert (second.temperature, second.max_tokens, second.think_seconds) == (0.7, 9, 0.25)
    assert (second.kind, second.group) == ("chat", "g")
    assert all(s.model == wl.DEFAULT_MODEL and s.temperature in (0.0, 0.7) for s in sessions)


@pytest.mark.parametrize(("line", "says"), [
    ("not json", "line 2: not JSON"),
    ("[1, 2]", "line 2: a session is a JSON object, not list"),
    ('{"turn": ["typo"]}', "line 2: unknown field 'turn'"),
    ('{"turns": []}', "line 2: 'turns' must be a non-empty list"),
    ('{"turns": "hi"}', "line 2: 'turns' must be a non-empty list"),
    ('{"turns": ["ok", ""]}', "line 2: 'turns' must be a non-empty list"),
    ('{"turns": ["hi"], "system": 3}', "line 2: 'system' must be a string or null"),
    ('{"turns": ["hi"], "id": ""}', "line 2: 'id' must be a non-empty string"),
    ('{"turns": ["hi"], "arrival": -1}', "line 2: 'arrival' must be a number of at least 0"),
    ('{"turns": ["hi"], "think_seconds": "1"}', "line 2: 'think_seconds' must be a number"),
    ('{"turns": ["hi"], "arrival": true}', "line 2: 'arrival' must be a number"),
    ('{"turns": ["hi"], "temperature": 2.5}', "line 2: 'temperature' must be at most 2"),
    ('{"turns": ["hi"], "max_tokens": 0}', "line 2: 'max_tokens' must be an integer"),
    ('{"turns": ["hi"], "max_tokens": 1.5}', "line 2: 'max_tokens' must be an integer"),
    ('{"turns": ["hi"], "id": "a"}', "line 2: id 'a' is also the id of line 1"),
])
def test_a_bad_line_is_refused_with_its_number_and_field(line: str, says: str,
                                                         tmp_path: Any) -> None:
    path = tmp_path / "bad.jsonl"
    path.write_text('{"id": "a", "turns": ["fine"]}\n' + line + "\n", encoding="utf-8")
    with pytest.raises(wl.WorkloadFileError) as caught:
        wl.read_jsonl(path)
    assert str(caught.value).startswith(f"{path} {says}"), caught.value


@pytest.mark.parametrize("content", [b"", b"\n  \n", b"\xff\xfe not utf-8\n"])
def test_an_empty_or_unreadable_file_is_refused(content: bytes, tmp_path: Any) -> None:
    path = tmp_path / "w.jsonl"
    path.write_bytes(content)
    with pytest.raises(wl.WorkloadFileError, match=str(path)):
        wl.read_jsonl(path)
    with pytest.raises(wl.WorkloadFileError, match="No such file"):
        wl.read_jsonl(tmp_path / "missing.jsonl")
