"""``DefaultSourceProcessor`` end to end: the simulated engine's real events in, the router's
prefix keys out.

In-process tests run :class:`~continuum.sim.engine.SimEngine` with each engine's block
hasher and pass its events through the wire encoder of a profile and the listener's decoder
(exactly the bytes a ZMQ source would see); ``/detokenize`` is answered by the simulated
engine's Falcon app. The last tests start ``python -m continuum.sim.cli`` as real processes
(ChatML and Llama-3) and take events off a real ZMQ socket and prompts over real HTTP, with
``template: auto``.
"""

from __future__ import annotations

import json
import logging
import sys
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import falcon.testing
import pytest
import requests
import zmq

from continuum.cache_salt import make_salt
from continuum.devtools.procs import Child, free_port, wait_http, wait_until
from continuum.kv_events import BlockRemoved, BlockStored, KvEvent, KvEventBatch
from continuum.prefix import request_prefix_key
from continuum.prefix_chain import request_chain
from continuum.sim.engine import EngineConfig, GenerationRequest, SimEngine
from continuum.sim.hashing import hasher_for
from continuum.sim.kv_publish import TrtllmEventQueue
from continuum.sim.kv_wire import encode_zmq_payload
from continuum.sim.latency import LatencyModel
from continuum.sim.server import create_engine_app
from listener.config import DetokenizeConfig, LimitsConfig, SourceConfig
from listener.decode import decode_trtllm_events, decode_zmq_frames, decode_zmq_payload
from listener.model import CACHE_CREATED, CACHE_EVICTED, PrefixEvent
from listener.processor import DefaultSourceProcessor

MODEL = "sim-model"
BACKEND = "engine-a"
SECRET = b"processor-test-secret"
SYSTEM = ("You are the Continuum test assistant. Answer questions about caches, tokens and "
          "routers briefly.")
BODIES: dict[str, dict[str, Any]] = {
    "system": {"messages": [{"role": "system", "content": SYSTEM},
                            {"role": "user", "content": "What is a prefix cache?"}]},
    "first message": {"messages": [{"role": "user", "content": "No system prompt: just me."},
                                   {"role": "assistant", "content": "Hello."},
                                   {"role": "user", "content": "Tell me more."}]},
    "long system": {"messages": [
        {"role": "system", "content": "Ünïcødé rules 🎉 and many words follow. " * 40},
        {"role": "user", "content": "Hi"}]},
}
MAX_PREFIX = 256  # < the long system prompt, > the others


def router_key(body: dict[str, Any]) -> str:
    key = request_prefix_key(body, MODEL, max_prefix_length=MAX_PREFIX)
    assert key is not None
    return key.hex()


def source(engine: str = "vllm", **overrides: Any) -> SourceConfig:
    options: dict[str, Any] = {
        "backend_name": BACKEND, "engine": engine, "model": MODEL, "template": "chatml",
        "allowed_publishers": ("127.0.0.1",), "max_prefix_length": MAX_PREFIX,
        "zmq_endpoint": "tcp://127.0.0.1:1",
        "detokenize_endpoint": "http://127.0.0.1:9/detokenize"}
    if engine == "trtllm":
        options.update(zmq_endpoint=None, detokenize_endpoint=None,
                       trtllm_endpoint="http://127.0.0.1:9/kv_cache_events")
    options.update(overrides)
    return SourceConfig(**options)


class Reply:
    def __init__(self, status: int, doc: Any) -> None:
        self.status_code = status
        self.doc = doc

    def json(self) -> Any:
        return self.doc


class AppClient:
    """``requests``-like client for a simulated engine's Falcon app; counts calls by path."""

    def __init__(self, engine: SimEngine) -> None:
        self.app = falcon.testing.TestClient(create_engine_app(engine))
        self.paths: list[str] = []

    def post(self, url: str, *, json: Any, timeout: float, allow_redirects: bool) -> Reply:
        path = urlsplit(url).path
        self.paths.append(path)
        result = self.app.simulate_post(path, json=json)
        return Reply(result.status_code, result.json)


class WireSink:
    """The engine's event sink: encode each step for ``profile``, decode it back."""

    def __init__(self, profile: str) -> None:
        self.profile = profile
        self.batches: list[KvEventBatch] = []
        self.queue = TrtllmEventQueue(100_000) if profile == "trtllm" else None

    def publish(self, events: Sequence[KvEvent]) -> None:
        if self.queue is not None:
            self.queue.publish(events)
        else:
            payload = encode_zmq_payload(events, self.profile, ts=0.0)
            self.batches.append(decode_zmq_payload(payload))

    def take(self) -> list[KvEventBatch]:
        if self.queue is not None:
            decoded = decode_trtllm_events(json.dumps(self.queue.drain()).encode())
            self.batches = [KvEventBatch(ts=0.0, events=e.events) for e in decoded if e.events]
        batches, self.batches = self.batches, []
        return batches


class Setup:
    """A simulated engine wired to a processor through one wire profile."""

    def __init__(self, profile: str, template: str = "chatml", salts: bool = False,
                 block_size: int = 4, limits: LimitsConfig | None = None,
                 **source_options: Any) -> None:
        engine_kind = profile.split("-")[0]
        self.sink = WireSink(profile)
        self.engine = SimEngine(
            EngineConfig(engine=engine_kind, template=template, block_size=block_size,
                         latency=LatencyModel.fast()),
            hasher=hasher_for(profile if engine_kind != "trtllm" else "trtllm"),
            sink=self.sink, sleep=lambda s: None)
        self.salts = salts
        self.client = AppClient(self.engine)
        self.out: list[PrefixEvent] = []
        self.processor = DefaultSourceProcessor(
            source(engine_kind, template=template, **source_options), limits or LimitsConfig(),
            DetokenizeConfig(), emit=self.out.append, salt_secret=SECRET, client=self.client)

    def request(self, body: dict[str, Any], max_tokens: int = 3) -> list[PrefixEvent]:
        """Serve ``body`` (with a router-issued salt if enabled); feed the events."""
        salt = make_salt(SECRET, BACKEND, router_key(body)) if self.salts else None
        ids = self.engine.chat_prompt(body["messages"])
        self.engine.start(GenerationRequest(model=MODEL, prompt_ids=tuple(ids),
                                            max_tokens=max_tokens, temperature=0.0,
                                            cache_salt=salt)).run()
        start = len(self.out)
        for batch in self.sink.take():
            self.processor.handle_batch(batch)
        return self.out[start:]

    def detokenize_calls(self) -> int:
        return self.client.paths.count("/detokenize")


# -- the router's keys from the engine's events -------------------------------------------------

@pytest.mark.parametrize("profile", ["vllm-0.22", "vllm-0.33", "sglang-0.5.9", "sglang-0.5.22"])
@pytest.mark.parametrize("template", ["chatml", "llama3"])
def test_recovered_keys_equal_the_routers(profile: str, template: str) -> None:
    setup = Setup(profile, template)
    for name, body in BODIES.items():
        created = [e for e in setup.request(body) if e.type == CACHE_CREATED]
        assert created, name
        assert {e.prefix_hash for e in created} == {router_key(body)}, name
    assert setup.processor.stats()["attributed_prefixes"] == len(BODIES)


def test_chains_extending_an_attributed_parent_cost_no_call() -> None:
    """Without chain keys (``max_chain_text_bytes: 0``) the seed key costs no call for an
    extension; chain keys cost one call per stored event (tested below)."""
    setup = Setup("vllm-0.33", block_size=4, limits=LimitsConfig(max_chain_text_bytes=0))
    body = BODIES["system"]
    setup.request(body)
    calls = setup.detokenize_calls()
    assert calls >= 1
    follow_up = {"messages": [*body["messages"], {"role": "assistant", "content": "A cache."},
                              {"role": "user", "content": "And a KV cache?"}]}
    # Longer than the chains before it, so that the prefix's token count grows (an event).
    sibling = {"messages": [body["messages"][0],
                            {"role": "user", "content": "Another question, " * 12}]}
    for other in (follow_up, sibling):
        events = setup.request(other)
        assert events and [e.prefix_hash for e in events] == [router_key(body)] * len(events)
    assert setup.processor.stats()["unattributed_chains"] == 0
    assert setup.detokenize_calls() == calls
    assert setup.processor.stats()["detokenize_calls"] == calls


CHUNK = 64  # small chunks: many chain keys in short test prompts


def chain_of(body: dict[str, Any]) -> list[str]:
    chain = request_chain({"model": MODEL, **body}, MODEL, chunk_bytes=CHUNK)
    assert chain is not None
    return list(chain.keys)


def emitted_chain(events: Sequence[PrefixEvent], kind: str = CACHE_CREATED) -> list[str]:
    return [key for event in events for k, key, _ in event.chain if k == kind]


@pytest.mark.parametrize("profile", ["vllm-0.22", "vllm-0.33", "sglang-0.5.9", "sglang-0.5.22"])
@pytest.mark.parametrize("template", ["chatml", "llama3"])
def test_chain_keys_equal_the_routers(profile: str, template: str) -> None:
    setup = Setup(profile, template, chain_chunk_bytes=CHUNK)
    seen: dict[str, int] = {}
    for name, body in BODIES.items():
        events = setup.request(body)
        keys = emitted_chain(events)
        router = chain_of(body)
        assert keys and keys == router[:len(keys)], name  # the router's keys, in order
        assert len(keys) >= len(router) - 1, name  # all but a last chunk in a cut block
        assert {e.prefix_hash for e in events if e.chain} == {router_key(body)}, name
        for event in events:
            seen.update({key: tokens for _, key, tokens in event.chain})
    tokens = [seen[key] for key in chain_of(BODIES["long system"]) if key in seen]
    assert tokens == sorted(tokens) and tokens[0] > 0  # each key covers more tokens


def test_a_follow_up_extends_the_chain_with_one_call_per_stored_event() -> None:
    setup = Setup("vllm-0.33", chain_chunk_bytes=CHUNK)
    body = BODIES["system"]
    first = emitted_chain(setup.request(body, max_tokens=12))
    calls = setup.detokenize_calls()
    # branches off inside the first chain (its reply differs from what the engine wrote)
    follow_up = {"messages": [*body["messages"], {"role": "assistant", "content": "A cache."},
                              {"role": "user", "content": "And a KV cache? " * 6}]}
    more = emitted_chain(setup.request(follow_up))
    router = chain_of(follow_up)
    assert first == router[:len(first)]
    assert more == router[len(first):len(first) + len(more)] and len(more) >= 2
    # one call per stored event: the prompt's blocks, then the reply's; no prefix search
    assert setup.detokenize_calls() - calls == 2


def test_evicting_a_middle_block_evicts_exactly_its_chain_keys() -> None:
    setup = Setup("vllm-0.33", chain_chunk_bytes=CHUNK)
    body = BODIES["long system"]
    created = emitted_chain(setup.request(body))
    tracker = setup.processor.tracker
    middle = next(key for key, block in tracker.blocks.items()
                  if block.chain and created.index(block.chain[0]) >= 2)
    lost = list(tracker.blocks[middle].chain)
    setup.processor.handle_batch(KvEventBatch(ts=0.0, events=(
        BlockRemoved(block_hashes=(middle[1],), group_idx=middle[0]),)))
    events = setup.out[-1:]
    assert emitted_chain(events, "cache_evicted") == lost
    assert events[0].prefix_hash == router_key(body)
    assert events[0].type == CACHE_CREATED  # the prefix itself is still held
    held = {key for block in tracker.blocks.values() for key in block.chain}
    assert held == set(created) - set(lost)


def test_chain_keys_need_text_salted_trtllm_reports_the_seed_key_only() -> None:
    setup = Setup("trtllm", salts=True, require_salt=True, chain_chunk_bytes=CHUNK)
    for body in BODIES.values():
        events = setup.request(body)
        assert events and not any(e.chain for e in events)
    assert setup.processor.stats()["chain_keys"] == 0


@pytest.mark.parametrize("profile", ["vllm-0.22", "vllm-0.33", "sglang-0.5.18",
                                     "sglang-0.5.22", "trtllm"])
def test_router_issued_salts_attribute_without_detokenize(profile: str) -> None:
    setup = Setup(profile, salts=True, require_salt=True)
    for name, body in BODIES.items():
        created = [e for e in setup.request(body) if e.type == CACHE_CREATED]
        assert {e.prefix_hash for e in created} == {router_key(body)}, name
    stats = setup.processor.stats()
    assert setup.detokenize_calls() == 0 and stats["retained_tokens"] == 0
    assert stats["salt_rejected"] == 0


@pytest.mark.parametrize("profile", ["vllm-0.33", "sglang-0.5.22", "trtllm"])
def test_per_tenant_salts_attribute_like_shared_ones(profile: str) -> None:
    """``cache_salt.per_tenant``: each tenant's salt keeps the engine from reusing another
    tenant's blocks, and the listener still attributes both chains to the prefix key."""
    setup = Setup(profile, require_salt=True)
    body = BODIES["system"]
    ids = tuple(setup.engine.chat_prompt(body["messages"]))
    for tenant, reuses in (("acme", False), ("globex", False), ("acme", True)):
        salt = make_salt(SECRET, BACKEND, router_key(body), tenant)
        cached = setup.engine.start(GenerationRequest(
            model=MODEL, prompt_ids=ids, max_tokens=3, temperature=0.0,
            cache_salt=salt)).run().cached_tokens
        assert (cached > 0) is reuses, tenant  # a tenant reuses its own blocks only
        for batch in setup.sink.take():
            setup.processor.handle_batch(batch)
    created = [e for e in setup.out if e.type == CACHE_CREATED]
    assert created and {e.prefix_hash for e in created} == {router_key(body)}
    stats = setup.processor.stats()
    assert stats["salt_rejected"] == 0 and stats["unattributed_chains"] == 0
    assert setup.detokenize_calls() == 0


def test_salts_of_vllm_ride_in_block_0_extra_keys() -> None:
    setup = Setup("vllm-0.33", salts=True)
    body = BODIES["system"]
    salt = make_salt(SECRET, BACKEND, router_key(body))
    setup.engine.start(GenerationRequest(
        model=MODEL, prompt_ids=tuple(setup.engine.chat_prompt(body["messages"])),
        max_tokens=3, temperature=0.0, cache_salt=salt)).run()
    stores = [e for b in setup.sink.take() for e in b.events if isinstance(e, BlockStored)]
    assert stores[0].parent_block_hash is None and stores[0].cache_salt is None
    assert stores[0].extra_keys == ((salt,), *([None] * (len(stores[0].block_hashes) - 1)))
    assert all(e.extra_keys is None for e in stores[1:])


@pytest.mark.parametrize(("salt_for", "required"), [
    ("other-backend", False), ("forged", False), (None, True), ("other-backend", True)])
def test_invalid_or_missing_salts_discard_the_chain(salt_for: str | None, required: bool) -> None:
    setup = Setup("sglang-0.5.22", require_salt=required)
    body = BODIES["system"]
    salt = None
    if salt_for == "other-backend":
        salt = make_salt(SECRET, "engine-b", router_key(body))
    elif salt_for == "forged":
        salt = make_salt(b"guessed secret", BACKEND, router_key(body))
    ids = setup.engine.chat_prompt(body["messages"])
    setup.engine.start(GenerationRequest(model=MODEL, prompt_ids=tuple(ids), max_tokens=3,
                                         temperature=0.0, cache_salt=salt)).run()
    for batch in setup.sink.take():
        setup.processor.handle_batch(batch)
    stats = setup.processor.stats()
    assert setup.out == [] and stats["tracked_blocks"] == 0
    assert stats["salt_rejected"] >= 1 and setup.detokenize_calls() == 0


def test_trtllm_sources_require_salts() -> None:
    setup = Setup("trtllm")
    assert setup.processor.source.salt_required
    # The queue's opening ``created`` clears rank 0 (TensorRT-LLM blocks are keyed per rank)
    # of an empty tracker: nothing to tell; the unsalted chain itself gives nothing either.
    assert setup.request(BODIES["system"]) == []
    assert setup.processor.stats()["salt_rejected"] >= 1


# -- engine rules ------------------------------------------------------------------------------

def feed(processor: DefaultSourceProcessor, *events: KvEvent) -> None:
    processor.handle_batch(KvEventBatch(ts=0.0, events=events))


def salted_processor(engine: str = "vllm", **overrides: Any) -> tuple[
        DefaultSourceProcessor, list[PrefixEvent]]:
    out: list[PrefixEvent] = []
    processor = DefaultSourceProcessor(
        source(engine, require_salt=True, detokenize_endpoint=None, **overrides), LimitsConfig(),
        DetokenizeConfig(),
        emit=out.append, salt_secret=SECRET)
    return processor, out


P = "ab" * 32


def vllm_salted(hashes: tuple[int, ...], tokens: int, size: int = 2, **kw: Any) -> BlockStored:
    extra = ((make_salt(SECRET, BACKEND, P),), *([None] * (len(hashes) - 1)))
    return BlockStored(hashes, None, tuple(range(tokens)), size, extra_keys=extra, **kw)


def test_mismatched_blocks_keep_their_length_and_warn_once_per_source(
        caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.WARNING, logger="listener.processor")
    processor, out = salted_processor()
    feed(processor, vllm_salted((1,), 2), BlockStored((2,), 1, (5, 6, 7), 2))  # 3 tokens ≠ 2
    feed(processor, BlockStored((3,), 2, (8, 9), 2), BlockStored((4,), 1, (1,), 2))
    feed(processor, BlockStored((5,), 3, (1, 2), 2))  # a descendant of a mismatched block
    stats = processor.stats()
    assert stats["mismatched_blocks"] == 2 and stats["retained_tokens"] == 0
    blocks = processor.tracker.blocks
    assert [blocks[(None, k)].end for k in (2, 3, 5)] == [5, 7, 9]
    assert [blocks[(None, k)].prefix for k in (1, 2, 3, 4, 5)] == [P, None, None, None, None]
    assert out == [PrefixEvent(CACHE_CREATED, P, 2)]
    other, _ = salted_processor(backend_name="engine-b")
    feed(other, BlockStored((9,), None, (1, 2, 3), 2))
    warnings = [r.getMessage() for r in caplog.records]
    assert len(warnings) == 2 and BACKEND in warnings[0] and "engine-b" in warnings[1]


def test_sglang_events_must_fill_every_page() -> None:
    processor, out = salted_processor("sglang")
    salt = make_salt(SECRET, BACKEND, P)
    feed(processor, BlockStored((1, 2), None, (1, 2, 3, 4), 2, cache_salt=salt),
         BlockStored((3, 4), 2, (5, 6, 7), 2, cache_salt=salt),   # 3 tokens for 2 pages
         BlockStored((5,), 2, (8,), 1, cache_salt=salt))           # a short last page: fine
    assert processor.stats()["mismatched_blocks"] == 1
    assert [processor.tracker.blocks[(None, k)].prefix for k in (2, 3, 4, 5)] == [
        P, None, None, P]
    assert out == [PrefixEvent(CACHE_CREATED, P, 5)]


def test_vllm_null_blocks_and_attention_groups() -> None:
    processor, out = salted_processor()
    # Full attention (group 0): a normal salted chain.
    feed(processor, vllm_salted((1, 2, 3), 6, group_idx=0, kv_cache_spec_kind="full_attention"))
    assert out == [PrefixEvent(CACHE_CREATED, P, 6)]
    # Sliding window (group 1): the same hashes, with a null block skipped (3 blocks of
    # tokens for 2 hashes). No prefix hits: not tracked, and group 0 is unaffected.
    feed(processor, vllm_salted((2, 3), 6, group_idx=1, kv_cache_spec_kind="sliding_window"),
         BlockRemoved((2, 3), medium="GPU", group_idx=1))
    # A later group-1 event without kind is still known to be sliding window.
    feed(processor, BlockStored((7,), 3, (1, 2), 2, group_idx=1))
    stats = processor.stats()
    assert stats["ignored_blocks"] == 3 and stats["tracked_blocks"] == 3
    # Group 2 never says its kind, and has null blocks: tracked but never attributed.
    feed(processor, vllm_salted((8, 9), 6, group_idx=2))
    feed(processor, BlockStored((10,), 9, (1, 2), 2, group_idx=2))
    blocks = processor.tracker.blocks
    assert processor.stats()["masked_blocks"] == 2
    assert [blocks[(2, k)].prefix for k in (8, 9, 10)] == [None, None, None]
    assert out == [PrefixEvent(CACHE_CREATED, P, 6)]
    feed(processor, BlockRemoved((1, 2, 3), medium="GPU", group_idx=0))
    assert out[-1].type == "cache_evicted"


def test_a_configured_block_size_caps_the_events_block_size() -> None:
    processor, _ = salted_processor(block_size=2)
    feed(processor, vllm_salted((1,), 4, size=4), vllm_salted((2,), 1, size=1))
    assert processor.stats()["mismatched_blocks"] == 1
    assert processor.tracker.blocks[(None, 2)].prefix == P  # vLLM partial entry: fine


# -- the real simulated engine over HTTP and ZMQ -----------------------------------------------

class SimProcess:
    """``continuum-sim`` publishing to our SUB socket; stopped by PID."""

    def __init__(self, tmp: Path, template: str, ctx: zmq.Context[Any]) -> None:
        self.sub: zmq.Socket[Any] = ctx.socket(zmq.SUB)
        self.sub.setsockopt(zmq.SUBSCRIBE, b"")
        zmq_port, port = free_port(), free_port()
        self.sub.bind(f"tcp://127.0.0.1:{zmq_port}")
        self.url = f"http://127.0.0.1:{port}"
        self.proc = Child([sys.executable, "-m", "continuum.sim.cli", "--port", str(port),
                           "--fast", "--template", template, "--block-size", "8",
                           "--zmq-endpoint", f"tcp://127.0.0.1:{zmq_port}"],
                          log=tmp / f"sim-{template}.log")
        wait_http(self.url + "/health", children=[self.proc])
        self.http = requests.Session()

    def chat(self, body: dict[str, Any]) -> None:
        resp = self.http.post(self.url + "/v1/chat/completions", timeout=10,
                              json={"model": MODEL, "max_tokens": 2, **body})
        assert resp.status_code == 200, resp.text

    def batches(self, timeout_ms: int = 200) -> Iterator[KvEventBatch]:
        while self.sub.poll(timeout_ms):
            yield decode_zmq_frames(self.sub.recv_multipart())

    def close(self) -> None:
        self.http.close()
        self.proc.stop()
        self.sub.close(linger=0)


@pytest.fixture
def zmq_ctx() -> Iterator[zmq.Context[Any]]:
    ctx: zmq.Context[Any] = zmq.Context()
    yield ctx
    ctx.destroy(linger=0)


@pytest.mark.parametrize("template", ["chatml", "llama3"])
def test_template_learned_from_a_real_engine(
        template: str, tmp_path: Path, zmq_ctx: zmq.Context[Any]) -> None:
    sim = SimProcess(tmp_path, template, zmq_ctx)
    out: list[PrefixEvent] = []
    processor = DefaultSourceProcessor(
        source(template="auto", detokenize_endpoint=sim.url + "/detokenize"), LimitsConfig(),
        DetokenizeConfig(), emit=out.append, salt_secret=None)
    try:
        # PUB drops messages until our subscription reaches it: probe until one arrives.
        for attempt in range(100):
            sim.chat({"messages": [{"role": "user", "content": f"warm-up {attempt}"}]})
            if any(True for _ in sim.batches()):
                break
        else:
            raise AssertionError("no KV events from the simulated engine")
        for name, body in BODIES.items():
            sim.chat(body)

            def learned(body: dict[str, Any] = body) -> bool:
                for batch in sim.batches():
                    processor.handle_batch(batch)
                return router_key(body) in {e.prefix_hash for e in out}

            wait_until(learned, f"the router's key of {name} among the prefix events", 20,
                       children=[sim.proc], interval=0.01)
        assert processor.stats()["detokenize_errors"] == 0
    finally:
        processor.close()
        sim.close()


# -- leading blocks keep a prefix held ------------------------------------------------------------

def remove(setup: Setup, keys: Sequence[tuple[int | None, int]]) -> list[PrefixEvent]:
    start = len(setup.out)
    setup.processor.handle_batch(KvEventBatch(ts=0.0, events=tuple(
        BlockRemoved(block_hashes=(key[1],), group_idx=key[0]) for key in keys)))
    return setup.out[start:]


@pytest.mark.parametrize("profile", ["vllm-0.33", "sglang-0.5.22"])
def test_the_first_messages_leading_blocks_keep_its_prefix_held(profile: str) -> None:
    """An engine that evicts the blocks of its finished requests still holds the system
    prompt's leading blocks, which the next request of the prefix finds cached: the prefix
    stays held at their length until they go too (before, it was reported evicted, and
    created again once a running request's blocks were reported)."""
    setup = Setup(profile)
    key = router_key(BODIES["system"])
    setup.request(BODIES["system"])
    tracker = setup.processor.tracker
    decided = sorted((k for k, block in tracker.blocks.items() if block.prefix == key),
                     key=lambda k: -tracker.blocks[k].end)
    leading = [k for k, block in tracker.blocks.items() if key in block.leads]
    assert len(leading) == 1 and tracker.blocks[leading[0]].prefix is None
    lead_end = tracker.blocks[leading[0]].end
    assert 0 < lead_end < min(tracker.blocks[k].end for k in decided)

    # every block that decided the prefix (and their descendants) evicted, tip first
    events = remove(setup, decided)
    assert [(e.type, e.prefix_hash, e.token_count) for e in events] == [
        (CACHE_CREATED, key, lead_end)]
    assert setup.processor.stats()["attributed_prefixes"] == 1

    # the leading block's own eviction ends the holdings it alone kept
    events = remove(setup, leading)
    assert [(e.type, e.prefix_hash) for e in events] == [(CACHE_EVICTED, key)]
    assert setup.processor.stats()["attributed_prefixes"] == 0
