"""Prompt recovery: anchors in rendered prompts, learned templates, /detokenize discipline.

Rendered prompts come from the simulated engine's own templates and tokenizer, and the
``/tokenize``/``/detokenize`` calls go to the simulated engine's real Falcon app in-process
(``falcon.testing``), so what is parsed is what an engine sends back.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
from typing import Any
from urllib.parse import urlsplit

import falcon.testing
import pytest
import requests
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from continuum.cache_salt import make_salt
from continuum.kv_events import BlockRemoved, BlockStored, KvEventBatch
from continuum.prefix import SYSTEM_TAG, prefix_key_from_text, request_prefix_key
from continuum.sim.cache import sha256_chain_hasher
from continuum.sim.engine import EngineConfig, SimEngine
from continuum.sim.server import create_engine_app
from continuum.sim.templates import get_template
from continuum.sim.tokenizer import SimTokenizer
from listener.config import DetokenizeConfig, LimitsConfig, SourceConfig
from listener.model import CACHE_CREATED, CACHE_EVICTED, PrefixEvent
from listener.processor import DefaultSourceProcessor
from listener.recovery import PromptRecovery, RecoveryJob
from listener.templates import (
    BUILTIN_TEMPLATES,
    NEVER,
    PENDING,
    PROBE_SYSTEM_CHAT,
    PROBE_USER_CHAT,
    Anchor,
    TemplateError,
    find_anchor,
    learn_markers,
    tokenize_url,
)

TOK = SimTokenizer()
MODEL = "sim-model"
URL = "http://127.0.0.1:9/v1/detokenize"


def render(template: str, messages: list[dict[str, Any]], gen: bool = True) -> str:
    return get_template(template).render(messages, add_generation_prompt=gen)


def key_of(anchor: Anchor | str, max_len: int = 1024) -> str:
    assert isinstance(anchor, Anchor), anchor
    return prefix_key_from_text(MODEL, anchor.tag, anchor.text, max_len).hex()


# -- anchors ---------------------------------------------------------------------------------

@pytest.mark.parametrize("template", sorted(BUILTIN_TEMPLATES))
@pytest.mark.parametrize("messages", [
    [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}],
    [{"role": "developer", "content": "Dev rules"}, {"role": "user", "content": "Hi"}],
    [{"role": "user", "content": "Only a user"}],
    [{"role": "system", "content": ""}, {"role": "user", "content": "After an empty system"}],
    [{"role": "assistant", "content": "I start"}, {"role": "user", "content": "ok"}],
    [{"role": "system", "content": "Ünïcødé ✓ 🎉 prompt"}, {"role": "user", "content": "x"}],
])
def test_anchor_key_equals_the_routers(template: str, messages: list[dict[str, Any]]) -> None:
    markers = BUILTIN_TEMPLATES[template]
    anchor = find_anchor(render(template, messages), markers, 1024)
    assert key_of(anchor) == request_prefix_key({"messages": messages}, MODEL).hex()  # type: ignore[union-attr]


def test_texts_that_are_not_chat_prompts_never_decide() -> None:
    chatml = BUILTIN_TEMPLATES["chatml"]
    assert find_anchor("Once upon a time", chatml, 1024) == NEVER
    assert find_anchor("<|im_start|>" + "x" * 200, chatml, 1024) == NEVER  # no role header
    assert find_anchor("<|im_start|>user\n<|im_end|>\n<|im_start|>assistant\n", chatml,
                       1024) == NEVER  # an empty first message has no key, as in the router
    assert find_anchor("<|im_st", chatml, 1024) == PENDING


def test_a_cut_content_decides_only_once_it_holds_max_prefix_length_bytes() -> None:
    chatml = BUILTIN_TEMPLATES["chatml"]
    head = "<|im_start|>system\n"
    assert find_anchor(head + "abc", chatml, 4) == PENDING
    assert find_anchor(head + "abcd", chatml, 4) == Anchor(SYSTEM_TAG, "abcd")
    # An undecodable tail (a character split across blocks) and a started end marker do not
    # count as content.
    assert find_anchor(head + "abc\ufffd", chatml, 4) == PENDING
    assert find_anchor(head + "abc<|im_end|>\n", chatml, 4) == PENDING
    assert find_anchor(head + "abc<|im_end|>\n<|im_start|>", chatml, 4) == Anchor(
        SYSTEM_TAG, "abc")


texts = st.text(st.characters(exclude_categories=["Cs"], exclude_characters="<|>"),
                max_size=40).map(str.strip)


@settings(database=None, deadline=None, max_examples=120,
          suppress_health_check=[HealthCheck.too_slow])
@given(template=st.sampled_from(sorted(BUILTIN_TEMPLATES)), system=st.none() | texts,
       first=texts, max_len=st.integers(1, 48))
def test_every_cut_of_a_prompt_is_pending_or_right(
        template: str, system: str | None, first: str, max_len: int) -> None:
    """Along a chain, the answer goes PENDING → the router's key and never anything else."""
    messages = ([] if system is None else [{"role": "system", "content": system}]) + [
        {"role": "user", "content": first}]
    body = {"messages": messages}
    expected = request_prefix_key(body, MODEL, max_prefix_length=max_len)
    text = render(template, messages)
    decided = False
    for cut in range(len(text) + 1):
        anchor = find_anchor(text[:cut], BUILTIN_TEMPLATES[template], max_len)
        if isinstance(anchor, Anchor):
            assert expected is not None
            assert prefix_key_from_text(MODEL, anchor.tag, anchor.text, max_len) == expected
            decided = True
        elif anchor == NEVER:
            assert expected is None and not decided
        else:
            assert not decided
    assert decided == (expected is not None)


# -- templates -------------------------------------------------------------------------------

def probe_texts(template: str) -> tuple[str, str]:
    return (render(template, list(PROBE_SYSTEM_CHAT), gen=False),
            render(template, list(PROBE_USER_CHAT), gen=False))


@pytest.mark.parametrize("template", sorted(BUILTIN_TEMPLATES))
def test_learned_markers_equal_the_built_in_ones(template: str) -> None:
    learned = learn_markers(*probe_texts(template))
    builtin = BUILTIN_TEMPLATES[template]
    assert (learned.first, learned.post, learned.sep) == (builtin.first, builtin.post,
                                                          builtin.sep)


def test_a_template_that_folds_the_system_prompt_cannot_be_learned() -> None:
    with pytest.raises(TemplateError):
        learn_markers(*probe_texts("mistral"))
    with pytest.raises(TemplateError):
        learn_markers("no probes here", "none")


def test_tokenize_url() -> None:
    assert tokenize_url("http://e:8000/detokenize") == "http://e:8000/tokenize"
    assert tokenize_url("http://e/v1/detokenize/") == "http://e/v1/tokenize"
    assert tokenize_url("http://e/decode") is None


# -- HTTP: an in-process simulated engine ----------------------------------------------------

class Reply:
    def __init__(self, status: int, doc: Any) -> None:
        self.status_code = status
        self.doc = doc

    def json(self) -> Any:
        return self.doc


class SimClient:
    """``requests``-like client answering from the simulated engine's Falcon app."""

    def __init__(self, template: str = "chatml") -> None:
        self.engine = SimEngine(EngineConfig(template=template), sleep=lambda s: None)
        self.app = falcon.testing.TestClient(create_engine_app(self.engine))
        self.paths: list[str] = []
        self.fail: BaseException | int | None = None
        self.lock = threading.Lock()

    def post(self, url: str, *, json: Any, timeout: float, allow_redirects: bool) -> Reply:
        assert timeout > 0 and allow_redirects is False
        path = urlsplit(url).path.removeprefix("/v1")
        with self.lock:
            self.paths.append(path)
        if isinstance(self.fail, BaseException):
            raise self.fail
        if isinstance(self.fail, int):
            return Reply(self.fail, {"error": {"message": "boom " + repr(json)}})
        result = self.app.simulate_post(path, json=json)
        return Reply(result.status_code, result.json)

    def count(self, path: str) -> int:
        return self.paths.count(path)


def source(**overrides: Any) -> SourceConfig:
    options: dict[str, Any] = {
        "backend_name": "vllm-1", "engine": "vllm", "model": MODEL, "template": "chatml",
        "zmq_endpoint": "tcp://127.0.0.1:1", "allowed_publishers": ("127.0.0.1",),
        "detokenize_endpoint": URL, **overrides}
    return SourceConfig(**options)


def stored(ids: list[int], size: int = 4, parent: int | None = None,
           salt: str | None = None) -> BlockStored:
    """A vLLM-style store of the full blocks of ``ids`` (hashes chained like the sim's)."""
    full = len(ids) // size * size
    hashes: list[int] = []
    prev = parent
    for i in range(0, full, size):
        prev = int(sha256_chain_hasher(prev, ids[i:i + size], salt if i == 0 else None))
        hashes.append(prev)
    extra = None if salt is None else ((salt,), *([None] * (len(hashes) - 1)))
    return BlockStored(tuple(hashes), parent, tuple(ids[:full]), size, medium="GPU",
                       extra_keys=extra)


def chat_ids(system: str | None, user: str, template: str = "chatml") -> list[int]:
    messages = ([] if system is None else [{"role": "system", "content": system}]) + [
        {"role": "user", "content": user}]
    return TOK.encode(render(template, messages))


class Run:
    def __init__(self, client: SimClient, detok: DetokenizeConfig | None = None,
                 clock: Any = None, limits: LimitsConfig | None = None,
                 **source_options: Any) -> None:
        self.out: list[PrefixEvent] = []
        extra = {} if clock is None else {"clock": clock}
        # These tests pin the seed key's recovery and its calls: no chain keys (those are
        # tested in test_listener_processor).
        limits = dataclasses.replace(limits or LimitsConfig(), max_chain_text_bytes=0)
        self.processor = DefaultSourceProcessor(
            source(**source_options), limits, detok or DetokenizeConfig(),
            emit=self.out.append, salt_secret=b"s3cret", client=client, **extra)

    def feed(self, *events: Any) -> list[PrefixEvent]:
        start = len(self.out)
        self.processor.handle_batch(KvEventBatch(ts=0.0, events=events))
        return self.out[start:]


def test_recovered_outcomes_are_cached_by_the_chain_tip() -> None:
    client = SimClient()
    run = Run(client)
    event = stored(chat_ids("Cache me if you can.", "Hello there"))
    key = request_prefix_key({"system": "Cache me if you can."}, MODEL)
    assert key is not None
    assert run.feed(event) == [PrefixEvent(CACHE_CREATED, key.hex(), len(event.token_ids))]
    calls = client.count("/detokenize")
    assert calls >= 1
    assert run.feed(BlockRemoved(event.block_hashes)) == [
        PrefixEvent(CACHE_EVICTED, key.hex(), len(event.token_ids))]
    assert run.feed(event)[0].prefix_hash == key.hex()
    stats = run.processor.stats()
    assert client.count("/detokenize") == calls and stats["detokenize_calls"] == calls
    assert stats["detokenize_cache_hits"] >= 1


def test_chains_longer_than_max_chain_tokens_are_not_recovered() -> None:
    client = SimClient()
    run = Run(client, limits=LimitsConfig(max_chain_tokens=24))
    ids = chat_ids("Short.", "A question that goes on and on " * 4)
    assert len(ids) > 40
    assert run.feed(stored(ids)) == []
    stats = run.processor.stats()
    assert stats["unattributed_chains"] == 1 and stats["detokenize_calls"] == 0
    assert stats["retained_tokens"] == 24  # the blocks within the limit keep theirs
    key = request_prefix_key({"system": "Short."}, MODEL)
    assert key is not None
    # A chain within the limit over the same blocks is recovered from those tokens.
    assert run.feed(stored(ids[:24])) == [PrefixEvent(CACHE_CREATED, key.hex(), 24)]


def test_failed_calls_are_counted_not_cached_paused_and_retried() -> None:
    client = SimClient()
    now = [0.0]
    run = Run(client, clock=lambda: now[0])
    event = stored(chat_ids("Retry me.", "Hi"))
    for failure in (503, requests.Timeout("slow")):
        client.fail = failure
        assert run.feed(event) == []
        now[0] += 0.6  # past the first pause (0.5 s), not the second (1 s)
    stats = run.processor.stats()
    assert stats["detokenize_errors"] == 2 and stats["unattributed_chains"] == 2
    assert stats["detokenize_calls"] == 2  # the first failure of each search stops it
    client.fail = None
    assert run.feed(event) == []  # still paused: no call at all
    assert run.processor.stats()["detokenize_calls"] == 2 == len(client.paths)
    now[0] += 1
    assert [e.type for e in run.feed(event)] == [CACHE_CREATED]  # a re-store retries


def test_detokenize_calls_are_bounded_by_a_semaphore() -> None:
    client = SimClient()
    recovery = PromptRecovery(source(), DetokenizeConfig(max_concurrent=3), Gate(client, 3))
    threads = [threading.Thread(target=recovery.detokenize, args=([70, 71], MODEL))
               for _ in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert recovery.calls == 8 and recovery.errors == 0
    assert recovery.client.peak == 3  # type: ignore[attr-defined]


class Gate:
    """Wraps a client: holds each call until ``width`` are in flight (bounded wait), and
    records the peak. Once the peak is reached, calls pass straight through."""

    def __init__(self, client: SimClient, width: int) -> None:
        self.client = client
        self.width = width
        self.cond = threading.Condition()
        self.in_flight = self.peak = 0
        self.opened = False

    def post(self, url: str, **kwargs: Any) -> Reply:
        with self.cond:
            self.in_flight += 1
            self.peak = max(self.peak, self.in_flight)
            if self.in_flight >= self.width:
                self.opened = True
                self.cond.notify_all()
            self.cond.wait_for(lambda: self.opened, timeout=10)
        try:
            return self.client.post(url, **kwargs)
        finally:
            with self.cond:
                self.in_flight -= 1


def test_chains_of_one_batch_are_recovered_concurrently_within_the_bound() -> None:
    client = SimClient()
    gate = Gate(client, 2)
    out: list[PrefixEvent] = []
    processor = DefaultSourceProcessor(
        source(), LimitsConfig(), DetokenizeConfig(max_concurrent=2), emit=out.append,
        salt_secret=None, client=gate)
    # Different first words: different first blocks, so six independent chains.
    systems = [f"{word} is the topic of this system prompt." for word in
               ("Water", "Fire", "Earth", "Light", "Music", "Paper")]
    events = tuple(stored(chat_ids(s, "Question?")) for s in systems)
    processor.handle_batch(KvEventBatch(ts=0.0, events=events))
    assert gate.peak == 2
    expected = [request_prefix_key({"system": s}, MODEL) for s in systems]
    assert [e.prefix_hash for e in out] == [k.hex() for k in expected if k is not None]


def test_auto_template_is_learned_once_and_failures_retry_later() -> None:
    client = SimClient("llama3")
    run = Run(client, template="auto")
    run.feed(stored(chat_ids("Learn me.", "Hi", "llama3")))
    run.feed(stored(chat_ids("Learn me too.", "Hi", "llama3")))
    assert client.count("/tokenize") == 2  # two probes, once
    assert [e.prefix_hash for e in run.out] == [
        request_prefix_key({"system": s}, MODEL).hex()  # type: ignore[union-attr]
        for s in ("Learn me.", "Learn me too.")]

    now = [0.0]
    mistral = SimClient("mistral")
    run = Run(mistral, template="auto", clock=lambda: now[0])
    ids = TOK.encode(render("mistral", [{"role": "system", "content": "S"},
                                        {"role": "user", "content": "U" * 40}]))
    assert run.feed(stored(ids)) == [] and mistral.count("/tokenize") == 2
    assert run.feed(stored(ids[:-4])) == [] and mistral.count("/tokenize") == 2  # not yet
    now[0] += 61
    run.feed(stored(ids[:-8]))
    assert mistral.count("/tokenize") == 4


def test_no_prompt_token_or_salt_reaches_the_logs(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.DEBUG)
    secret_prompt = "TOPSECRET system instructions"
    salt = make_salt(b"s3cret", "other-backend", "ab" * 32)  # valid, but not for us
    client = SimClient()
    now = [0.0]
    run = Run(client, template="auto", clock=lambda: now[0])
    ids = chat_ids(secret_prompt, "hello")
    client.fail = 500  # the error body echoes the request
    run.feed(stored(ids), BlockStored((1,), None, (1, 2, 3), 2))  # + a mismatched block
    now[0] += 100
    client.fail = requests.ConnectionError(f"refused {ids}")
    run.feed(stored(ids[:-4]))
    now[0] += 100
    client.fail = None
    run.feed(stored(ids), stored(ids, salt=salt))
    assert run.out and run.processor.stats()["salt_rejected"] == 1
    logged = caplog.text + repr([r.args for r in caplog.records])
    assert caplog.records
    for needle in ("TOPSECRET", salt, "ab" * 32, str(ids[:4])[1:-1], "boom"):
        assert needle not in logged


words = st.lists(st.sampled_from(["cache", "token", "Ünï", "🎉", "router", "a", "the", "x"]),
                 max_size=60).map(" ".join)


@settings(database=None, deadline=None, max_examples=60,
          suppress_health_check=[HealthCheck.too_slow])
@given(system=st.none() | words, first=words, size=st.integers(1, 9),
       max_len=st.integers(1, 200), lo_frac=st.floats(0, 1))
def test_search_finds_the_shallowest_deciding_block(
        system: str | None, first: str, size: int, max_len: int, lo_frac: float) -> None:
    messages = ([] if system is None else [{"role": "system", "content": system}]) + [
        {"role": "user", "content": first}]
    ids = TOK.encode(render("chatml", messages))
    ends = tuple(range(size, len(ids) + 1, size))
    if not ends:
        return
    markers = BUILTIN_TEMPLATES["chatml"]
    truth = [find_anchor(TOK.decode(ids[:end]), markers, max_len) for end in ends]
    decided = [i for i, a in enumerate(truth) if isinstance(a, Anchor)]
    # Blocks before ``lo`` must be known undecided, as the processor guarantees.
    lo = min(int(lo_frac * len(ends)), decided[0] if decided else len(ends) - 1)
    recovery = PromptRecovery(source(max_prefix_length=max_len), DetokenizeConfig(),
                              SimClient())
    job = RecoveryJob(tuple(range(len(ends))), ends, ids, lo, MODEL)
    result = recovery.search(job, markers)
    assert not result.failed
    if decided:
        assert result.decided_at == decided[0]
        assert result.prefix_hash == key_of(truth[decided[0]], max_len)
        assert result.pending_upto == decided[0] - 1
    else:
        assert result.decided_at is None
        assert result.pending_upto < len(ends)
        if result.never_from is not None:
            assert truth[result.never_from] == NEVER
    assert not any(isinstance(truth[i], Anchor) for i in range(result.pending_upto + 1))
    assert recovery.calls <= 3 + len(ends).bit_length()
