"""The simulated engine as a real process on 127.0.0.1, driven over HTTP and the openai SDK,
directly and through the router."""

from __future__ import annotations

import base64
import json
import struct
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import msgpack
import openai
import pytest
import requests
import zmq

from continuum.devtools.fleet import metric_sum
from continuum.devtools.procs import Child, free_port, wait_http, wait_until
from continuum.sim.hashing import block_hash_chain, hasher_for
from continuum.sim.templates import get_template

SIM = [sys.executable, "-m", "continuum.sim.cli"]
MODEL = "sim-model"
SYSTEM = (
    "You are a careful assistant for the Continuum test suite. Answer every question about "
    "caches, tokens and routers in one short paragraph, and never repeat the question."
)


class Sim:
    """A ``continuum-sim`` process; stopped by its PID only."""

    def __init__(self, tmp: Path, *args: str, count: int = 1, port: int = 0) -> None:
        self.log = tmp / f"sim-{time.monotonic_ns()}.log"
        self.proc = Child([*SIM, "--port", str(port), *args], log=self.log)
        try:
            self.urls = self._announced(count)
            for url in self.urls:
                wait_http(url + "/health", children=[self.proc])
        except BaseException:
            self.stop()
            raise
        self.url = self.urls[0]

    def _announced(self, count: int) -> list[str]:
        """The URLs of the first ``count`` engines the process announced."""
        def urls() -> list[str]:
            lines = [
                ln for ln in self.proc.log_text().splitlines() if ln.startswith("continuum-sim:")
            ]
            return [ln.split()[4] for ln in lines[:count]] if len(lines) >= count else []

        return wait_until(urls, "continuum-sim to announce its engines", children=[self.proc])

    def stop(self) -> int | None:
        self.proc.stop()
        return self.proc.returncode


@pytest.fixture(scope="module")
def sim(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Sim]:
    with pytest.MonkeyPatch.context() as mp:
        for name in ("HTTP_PROXY", "HTTPS_PROXY", "ALL_PROXY", "http_proxy", "https_proxy"):
            mp.delenv(name, raising=False)
        server = Sim(tmp_path_factory.mktemp("sim"), "--fast", port=free_port())
    yield server
    assert server.stop() == 0  # SIGTERM stops it cleanly


@pytest.fixture
def client(sim: Sim) -> Iterator[openai.OpenAI]:
    with openai.OpenAI(
        base_url=sim.url + "/v1",
        api_key="unused",
        max_retries=0,
        timeout=10,
    ) as c:
        yield c


def post(url: str, path: str, body: dict[str, Any]) -> Any:
    resp = requests.post(url + path, json=body, timeout=10)
    resp.raise_for_status()
    return resp.json()


def chat(question: str) -> list[dict[str, str]]:
    return [{"role": "system", "content": SYSTEM}, {"role": "user", "content": question}]


# -- OpenAI API --------------------------------------------------------------------------------


def test_openai_sdk_streams_the_same_content_as_non_streaming(client: openai.OpenAI) -> None:
    messages = chat("What does a prefix cache store? (stream test)")
    whole = client.chat.completions.create(model=MODEL, messages=messages, temperature=0)
    assert whole.usage is not None and whole.usage.prompt_tokens_details is not None
    assert whole.usage.prompt_tokens_details.cached_tokens == 0  # a new prompt
    pieces, usage, finish = [], None, None
    stream = client.chat.completions.create(
        model=MODEL,
        messages=messages,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
    )
    with stream:
        for chunk in stream:
            if chunk.choices:
                pieces.append(chunk.choices[0].delta.content or "")
                finish = chunk.choices[0].finish_reason or finish
            if chunk.usage is not None:
                usage = chunk.usage
    assert "".join(pieces) == whole.choices[0].message.content
    assert finish == whole.choices[0].finish_reason == "stop"
    assert usage is not None
    n = whole.usage.prompt_tokens
    assert (usage.prompt_tokens, usage.completion_tokens) == (n, whole.usage.completion_tokens)
    # the same prompt again: every full block but the one holding the last token is cached
    assert usage.prompt_tokens_details is not None
    assert usage.prompt_tokens_details.cached_tokens == (n - 1) // 16 * 16 > 0


def test_completions_stream_and_whole_agree(client: openai.OpenAI) -> None:
    prompt = "Once upon a time, in a cache far away"
    whole = client.completions.create(model=MODEL, prompt=prompt, temperature=0, max_tokens=7)
    assert whole.choices[0].finish_reason == "length"
    with client.completions.create(
        model=MODEL, prompt=prompt, temperature=0, max_tokens=7, stream=True
    ) as stream:
        text = "".join(chunk.choices[0].text for chunk in stream if chunk.choices)
    assert text == whole.choices[0].text
    assert whole.usage is not None and whole.usage.completion_tokens == 7


def test_sse_framing_is_vllms(sim: Sim) -> None:
    body = {
        "model": MODEL,
        "messages": chat("Framing?"),
        "temperature": 0,
        "max_tokens": 3,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    with requests.post(sim.url + "/v1/chat/completions", json=body, stream=True, timeout=10) as r:
        assert r.headers["content-type"].startswith("text/event-stream")
        raw = b"".join(r.iter_content(None))
    events = raw.split(b"\n\n")
    assert events[-2:] == [b"data: [DONE]", b""]
    docs = [json.loads(e.removeprefix(b"data: ")) for e in events[:-2]]
    assert all(e.startswith(b'data: {"id":"chatcmpl-') for e in events[:-2])
    assert docs[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert [d["choices"][0]["finish_reason"] for d in docs[1:4]] == [None, None, "length"]
    assert docs[-1]["choices"] == [] and docs[-1]["usage"]["completion_tokens"] == 3
    assert {d["object"] for d in docs} == {"chat.completion.chunk"}


def test_cache_salt_isolates_prefixes(client: openai.OpenAI) -> None:
    # no shared system prompt: nothing else on this server starts like this
    messages = [{"role": "user", "content": "Salted question about tenant isolation? " * 4}]

    def cached(salt: str | None) -> int:
        extra = {"cache_salt": salt} if salt else None
        out = client.chat.completions.create(
            model=MODEL, messages=messages, temperature=0, max_tokens=1, extra_body=extra
        )
        assert out.usage is not None and out.usage.prompt_tokens_details is not None
        return out.usage.prompt_tokens_details.cached_tokens or 0

    assert cached(None) == 0
    assert cached("tenant-a") == 0
    assert cached("tenant-a") > 0
    assert cached("tenant-b") == 0


def test_models_embeddings_and_errors(client: openai.OpenAI) -> None:
    assert [m.id for m in client.models.list()] == [MODEL]
    # the SDK asks for base64 by default and decodes it
    out = client.embeddings.create(
        model=MODEL,
        input=[
            "the router sends requests to the warm engine",
            "the router sends requests to a warm engine",
            "bananas are yellow",
        ],
    )
    a, b, c = (d.embedding for d in out.data)
    assert len(a) == 256
    dot = lambda x, y: sum(p * q for p, q in zip(x, y, strict=True))  # noqa: E731
    assert dot(a, b) > 0.7 > dot(a, c)
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="nope", messages=chat("hi"))
    with pytest.raises(openai.BadRequestError):
        client.chat.completions.create(model=MODEL, messages=[])


def test_float_embeddings_over_http(sim: Sim) -> None:
    doc = post(sim.url, "/v1/embeddings", {"input": "hi there", "encoding_format": "float"})
    floats = doc["data"][0]["embedding"]
    packed = post(sim.url, "/v1/embeddings", {"input": "hi there", "encoding_format": "base64"})
    decoded = struct.unpack("<256f", base64.b64decode(packed["data"][0]["embedding"]))
    assert floats == pytest.approx(decoded, abs=1e-6)


# -- tokenizer endpoints ------------------------------------------------------------------------


@pytest.mark.parametrize(
    "text",
    ["", "hello world", "héllo 😀 \n\t  <|im_start|>x", "中文 and emoji 🤖🤖", "a\u0301\r\n\x00"],
)
def test_detokenize_inverts_tokenize(sim: Sim, text: str) -> None:
    tok = post(sim.url, "/tokenize", {"model": MODEL, "prompt": text})
    assert tok["count"] == len(tok["tokens"]) and tok["max_model_len"] == 32768
    assert tok["token_strs"] is None
    assert post(sim.url, "/detokenize", {"model": MODEL, "tokens": tok["tokens"]}) == {
        "prompt": text
    }


def test_chat_tokenize_renders_the_template(sim: Sim) -> None:
    messages = chat("Which template?")
    tok = post(sim.url, "/tokenize", {"messages": messages, "return_token_strs": True})
    expected = get_template("chatml").render(messages, add_generation_prompt=True)
    assert "".join(tok["token_strs"]) == expected
    assert post(sim.url, "/detokenize", {"tokens": tok["tokens"]})["prompt"] == expected
    bare = post(sim.url, "/tokenize", {"messages": messages, "add_generation_prompt": False})
    assert bare["count"] < tok["count"]
    resp = requests.post(sim.url + "/detokenize", json={"tokens": [-1]}, timeout=10)
    assert resp.status_code == 400 and "error" in resp.json()


# -- stats and metrics --------------------------------------------------------------------------


def test_metrics_and_stats_move_with_requests(client: openai.OpenAI, sim: Sim) -> None:
    labels = {"model_name": MODEL}
    before = requests.get(sim.url + "/metrics", timeout=10).text
    stats0 = requests.get(sim.url + "/sim/stats", timeout=10).json()
    messages = chat("Metrics question, asked twice?")
    usages = [
        client.chat.completions.create(model=MODEL, messages=messages, temperature=0).usage
        for _ in range(2)
    ]
    after = requests.get(sim.url + "/metrics", timeout=10).text
    stats1 = requests.get(sim.url + "/sim/stats", timeout=10).json()
    prompt = sum(u.prompt_tokens for u in usages if u)
    cached = sum(
        u.prompt_tokens_details.cached_tokens or 0 for u in usages if u and u.prompt_tokens_details
    )
    assert cached > 0

    def delta(name: str, **extra: str) -> float:
        return metric_sum(after, name, **labels, **extra) - metric_sum(
            before, name, **labels, **extra
        )

    assert delta("vllm:prefix_cache_queries_total") == prompt
    assert delta("vllm:prefix_cache_hits_total") == cached
    assert delta("vllm:request_success_total", finished_reason="stop") == 2
    assert stats1["requests"] - stats0["requests"] == 2
    assert stats1["prompt_tokens"] - stats0["prompt_tokens"] == prompt
    assert stats1["cached_prompt_tokens"] - stats0["cached_prompt_tokens"] == cached
    assert stats1["blocks_in_use"] == 0 and stats1["gpu_blocks_cached"] > 0
    assert {"evictions", "running", "waiting", "cpu_blocks_cached"} <= set(stats1)


# -- fleets, disconnects, KV events -------------------------------------------------------------


def test_a_fleet_runs_independent_engines_from_one_command(tmp_path: Path) -> None:
    fleet = Sim(tmp_path, "--fast", "--fleet", "2", count=2)
    try:
        body = {"prompt": "A fleet of engines, each with its own cache. " * 4, "max_tokens": 1}
        first = [post(fleet.urls[0], "/v1/completions", body) for _ in range(2)]
        other = post(fleet.urls[1], "/v1/completions", body)
        cached = [d["usage"]["prompt_tokens_details"]["cached_tokens"] for d in [*first, other]]
        assert cached[0] == 0 and cached[1] > 0 and cached[2] == 0
    finally:
        assert fleet.stop() == 0


def test_a_client_disconnect_releases_the_slot_and_blocks(tmp_path: Path) -> None:
    slow = Sim(tmp_path, "--fast", "--decode-per-token", "0.01", "--max-num-seqs", "1")
    try:
        body = {
            "prompt": "Stream for a while " * 8,
            "max_tokens": 500,
            "ignore_eos": True,
            "stream": True,
        }
        with requests.post(slow.url + "/v1/completions", json=body, stream=True, timeout=10) as r:
            lines = r.iter_lines()
            assert next(lines).startswith(b"data: ")

        def aborted() -> dict[str, Any] | None:
            stats: dict[str, Any] = requests.get(slow.url + "/sim/stats", timeout=10).json()
            return stats if stats["finished"].get("abort") else None

        stats = wait_until(aborted, "the engine to count the abort", 15)
        assert stats["finished"] == {"abort": 1}
        assert (stats["running"], stats["blocks_in_use"]) == (0, 0)
        # the only slot is free again
        post(slow.url, "/v1/completions", {"prompt": "next", "max_tokens": 2})
    finally:
        slow.stop()


def test_vllm_zmq_events_carry_the_engines_block_hashes(tmp_path: Path) -> None:
    port = free_port()
    endpoint = f"tcp://127.0.0.1:{port}"
    sim = Sim(
        tmp_path, "--fast", "--zmq-endpoint", endpoint, "--zmq-bind", "--kv-format", "vllm-0.33"
    )
    ctx = zmq.Context()
    sub = ctx.socket(zmq.SUB)
    try:
        sub.setsockopt(zmq.SUBSCRIBE, b"")
        sub.connect(endpoint)
        deadline = time.monotonic() + 15
        stored: dict[str, Any] | None = None
        prompt = ""
        while stored is None and time.monotonic() < deadline:
            # a fresh prompt each round: the subscription may take a moment to reach the PUB
            prompt = f"Round {time.monotonic_ns()}: " + "tell me about block hashes " * 3
            post(sim.url, "/v1/completions", {"prompt": prompt, "max_tokens": 1})
            if sub.poll(200):
                topic, seq, payload = sub.recv_multipart()
                _ts, events, _rank = msgpack.unpackb(payload)
                stored = next(e for e in events if e["type"] == "BlockStored")
        assert stored is not None, "no KV event arrived"
        tokens = post(sim.url, "/tokenize", {"prompt": prompt})["tokens"]
        n = len(tokens) // 16 * 16
        assert stored["token_ids"] == tokens[:n]
        assert stored["parent_block_hash"] is None and stored["medium"] == "GPU"
        assert stored["block_hashes"] == block_hash_chain(hasher_for("vllm"), tokens, 16)
        assert (topic, len(seq)) == (b"", 8)
    finally:
        sub.close(linger=0)
        ctx.term()
        sim.stop()


def test_trtllm_engine_serves_kv_cache_events_as_a_destructive_drain(tmp_path: Path) -> None:
    sim = Sim(tmp_path, "--fast", "--engine", "trtllm", "--num-blocks", "64")
    try:
        created = requests.post(sim.url + "/kv_cache_events", timeout=10).json()
        assert created == [
            {"event_id": 0, "data": {"type": "created", "num_blocks_per_cache_level": [64, 0]}}
        ]
        post(sim.url, "/v1/completions", {"prompt": "TensorRT events " * 10, "max_tokens": 1})
        events = requests.get(sim.url + "/kv_cache_events", timeout=10).json()
        assert events and events[0]["event_id"] == 1
        assert events[0]["data"]["type"] == "stored"
        assert requests.post(sim.url + "/kv_cache_events", timeout=10).json() == []
        # like trtllm-serve, no public /detokenize: the listener must use the cache salt
        resp = requests.post(sim.url + "/detokenize", json={"tokens": [1]}, timeout=10)
        assert resp.status_code == 404
    finally:
        sim.stop()


def test_importing_the_cli_imports_nothing_network_related() -> None:
    code = (
        "import sys, continuum.sim.cli\n"
        "bad = {'gevent', 'zmq', 'falcon', 'requests', 'socket'} & set(sys.modules)\n"
        "assert not bad, bad\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=30)


# -- through the router ------------------------------------------------------------------------


@pytest.fixture
def fleet(tmp_path: Path) -> Iterator[Sim]:
    # Port 0: each engine binds a port of its own choosing. A single free port would make
    # the second engine assume that the next port is free too (it was once taken).
    sims = Sim(tmp_path, "--fast", "--fleet", "2", count=2, port=0)
    yield sims
    sims.stop()


@pytest.mark.e2e
def test_openai_sdk_streams_from_engines_through_the_router(
    fleet: Sim, router_factory: Any
) -> None:
    """The official openai SDK through the router to simulated engines (no fake
    upstreams)."""
    router = router_factory({
        "backends": [{"name": f"sim-{i}", "url": url} for i, url in enumerate(fleet.urls)],
        "selection_strategy": "PrefixAwareHash",
        "prefix_routing": {"enabled": True},
        "health_check": {"interval_seconds": 30, "path": "/v1/models"},
    })
    messages = [{"role": "system", "content": SYSTEM},
                {"role": "user", "content": "What does a prefix cache store?"}]
    with openai.OpenAI(base_url=router.url + "/v1", api_key="x", max_retries=0) as client:
        assert [m.id for m in client.models.list()] == [MODEL]  # discovered from the engines
        whole = client.chat.completions.create(model=MODEL, messages=messages, temperature=0)
        chunks = list(client.chat.completions.create(
            model=MODEL, messages=messages, temperature=0, stream=True,
            stream_options={"include_usage": True}))
        streamed = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        assert streamed == whole.choices[0].message.content and streamed
        usage = chunks[-1].usage
        assert usage is not None and usage.prompt_tokens == whole.usage.prompt_tokens
        # Same system prompt, same engine (sticky): the second request hits its prefix cache.
        assert usage.prompt_tokens_details.cached_tokens > 0
