"""The simulated engine: generation, cache accounting through requests, latency model."""

from __future__ import annotations

import gevent
import pytest

from continuum.errors import ModelNotFoundError, RequestError
from continuum.kv_events import BlockStored
from continuum.sim.engine import EngineConfig, GenerationRequest, SimEngine, render_metrics
from continuum.sim.latency import LatencyModel

LATENCY = LatencyModel(
    prefill_base=0.01,
    prefill_per_token=0.001,
    cached_per_token=0.00001,
    cpu_load_per_token=0.0001,
    decode_per_token=0.02,
)


class Sleeps(list[float]):
    """Records the engine's sleeps instead of sleeping."""

    def __call__(self, seconds: float) -> None:
        self.append(seconds)


def make(**overrides: object) -> tuple[SimEngine, Sleeps]:
    sleeps = Sleeps()
    options: dict[str, object] = {"block_size": 4, "latency": LATENCY, **overrides}
    return SimEngine(EngineConfig(**options), sleep=sleeps), sleeps  # type: ignore[arg-type]


def request(prompt: list[int], **kw: object) -> GenerationRequest:
    params: dict[str, object] = {"temperature": 0.0, **kw}
    return GenerationRequest(model="sim-model", prompt_ids=tuple(prompt), **params)  # type: ignore[arg-type]


def complete(engine: SimEngine, text: str, **kw: object):  # type: ignore[no-untyped-def]
    return engine.start(request(engine.text_prompt(text), **kw)).run()


# -- output ----------------------------------------------------------------------------------


def test_output_is_a_function_of_the_prompt_at_temperature_zero() -> None:
    engine, _ = make()
    other, _ = make()
    a = complete(engine, "Tell me a story")
    assert (
        a.text
        == complete(engine, "Tell me a story").text
        == complete(other, "Tell me a story").text
    )
    assert a.text != complete(engine, "Tell me a poem").text
    assert a.steps[-1].finish_reason == "stop"
    assert a.completion_tokens == len(a.steps)  # the end-of-turn token is counted, not shown
    assert engine.tokenizer.decode(s.token_id for s in a.steps[:-1]) == a.text


def test_output_varies_at_positive_temperature_unless_seeded() -> None:
    engine, _ = make()
    texts = {complete(engine, "same prompt", temperature=0.8).text for _ in range(5)}
    assert len(texts) > 1
    seeded = {complete(engine, "same prompt", temperature=0.8, seed=7).text for _ in range(3)}
    assert len(seeded) == 1


def test_max_tokens_truncates_with_finish_reason_length() -> None:
    engine, _ = make()
    gen = complete(engine, "Write something", max_tokens=3)
    assert gen.completion_tokens == 3
    assert gen.steps[-1].finish_reason == "length"
    ignore = complete(engine, "Write something", max_tokens=60, ignore_eos=True)
    assert ignore.completion_tokens == 60 and ignore.steps[-1].finish_reason == "length"


def test_stop_strings_cut_the_output() -> None:
    engine, _ = make()
    full = complete(engine, "Write something").text
    stop = full.split()[2]
    gen = complete(engine, "Write something", stop=[stop])
    assert gen.text == full[: full.index(stop)]
    assert (gen.steps[-1].finish_reason, gen.steps[-1].stop_reason) == ("stop", stop)


# -- cache accounting through requests --------------------------------------------------------


def test_cached_tokens_through_the_engine_match_the_hand_computed_values() -> None:
    engine, _ = make()
    # Token-id prompts and max_tokens=1: the single output token is never fed back, so only
    # prompt blocks get cached. Block size 4; at most len - 1 prompt tokens can be cached.
    script = [
        (list(range(100, 110)), 0),  # cold
        (list(range(100, 110)), 8),  # 2 full blocks
        (list(range(100, 118)), 8),  # blocks [100..107] hit, [108..111] was partial
        (list(range(100, 118)), 16),  # 17 // 4 = 4 blocks
        ([*range(100, 104), 7, 7, 7, 7, 7], 4),  # shares one block
    ]
    for prompt, expected in script:
        gen = engine.start(request(prompt, max_tokens=1)).run()
        assert (gen.prompt_tokens, gen.cached_tokens) == (len(prompt), expected)
    stats = engine.stats()
    assert stats["prompt_tokens"] == 10 + 10 + 18 + 18 + 9
    assert stats["cached_prompt_tokens"] == 0 + 8 + 8 + 16 + 4
    assert stats["requests"] == 5 and stats["blocks_in_use"] == 0


def test_a_follow_up_chat_turn_hits_the_previous_prompt_and_answer() -> None:
    engine, _ = make()
    turn1 = [
        {"role": "system", "content": "You answer questions."},
        {"role": "user", "content": "Why?"},
    ]
    prompt1 = engine.chat_prompt(turn1)
    first = engine.start(request(prompt1)).run()
    turn2 = [
        *turn1,
        {"role": "assistant", "content": first.text},
        {"role": "user", "content": "Ok"},
    ]
    prompt2 = engine.chat_prompt(turn2)
    answer_ids = [s.token_id for s in first.steps[:-1]]
    assert prompt2[: len(prompt1) + len(answer_ids)] == prompt1 + answer_ids
    second = engine.start(request(prompt2)).run()
    assert second.cached_tokens == (len(prompt1) + len(answer_ids)) // 4 * 4


def test_salted_requests_share_blocks_only_with_the_same_salt() -> None:
    engine, _ = make()
    prompt = list(range(200, 221))

    def cached(salt: str | None) -> int:
        return engine.start(request(prompt, max_tokens=1, cache_salt=salt)).run().cached_tokens

    assert cached(None) == 0
    assert cached("alice") == 0
    assert cached("bob") == 0
    assert cached("alice") == 20
    assert cached(None) == 20


# -- latency ---------------------------------------------------------------------------------


def test_latency_model_prices_cached_tokens_below_computed_ones() -> None:
    cold = LATENCY.ttft(1024, 0)
    warm = LATENCY.ttft(1024, 768)
    from_cpu = LATENCY.ttft(1024, 768, 768)
    assert cold == pytest.approx(0.01 + 1024 * 0.001)
    assert warm == pytest.approx(0.01 + 256 * 0.001 + 768 * 0.00001)
    assert warm < from_cpu < cold
    assert LATENCY.ttft(10, queued=2.0) == pytest.approx(2.0 + LATENCY.ttft(10))
    assert LATENCY.decode(5) == pytest.approx(4 * 0.02)
    fast = LatencyModel.fast()
    assert fast.ttft(1000, 512) < fast.ttft(1000, 0)
    with pytest.raises(ValueError):
        LATENCY.ttft(10, 11)
    with pytest.raises(ValueError):
        LatencyModel(decode_per_token=-1)


def test_a_cached_prefix_shortens_the_modelled_ttft_of_a_request() -> None:
    engine, sleeps = make()
    prompt = list(range(300, 400))
    cold = engine.start(request(prompt, max_tokens=3)).run()
    first_sleeps = list(sleeps)
    warm = engine.start(request(prompt, max_tokens=3)).run()
    assert cold.cached_tokens == 0 and warm.cached_tokens == 96
    assert cold.prefill_seconds == pytest.approx(LATENCY.prefill(100, 0))
    assert warm.prefill_seconds == pytest.approx(LATENCY.prefill(100, 96))
    assert warm.prefill_seconds < cold.prefill_seconds
    # the engine sleeps exactly the modelled prefill, then the decode cost between tokens
    assert first_sleeps == [cold.prefill_seconds, 0.02, 0.02]


# -- concurrency and lifecycle ---------------------------------------------------------------


def test_slots_limit_concurrency_and_an_aborted_stream_releases_everything() -> None:
    engine, _ = make(max_num_seqs=1)
    first = iter(engine.start(request(list(range(40)))))
    next(first)  # admitted: holds the only slot and its blocks
    assert engine.running == 1 and engine.cache.blocks_in_use == 10
    second = gevent.spawn(engine.start(request(list(range(500, 540)))).run)
    gevent.sleep(0)
    assert engine.waiting == 1 and not second.ready()
    first.close()  # the client went away
    second.join(timeout=5)
    assert second.successful()
    stats = engine.stats()
    assert (stats["running"], stats["waiting"], stats["blocks_in_use"]) == (0, 0, 0)
    assert stats["finished"] == {"abort": 1, "stop": 1}


def test_prompt_validation() -> None:
    engine, _ = make(max_model_len=64)
    assert engine.resolve_model(None) == "sim-model"
    with pytest.raises(ModelNotFoundError):
        engine.resolve_model("other")
    with pytest.raises(RequestError, match="maximum context length is 64"):
        engine.start(request(list(range(60)), max_tokens=10))
    with pytest.raises(RequestError):
        engine.text_prompt("")
    with pytest.raises(RequestError):
        engine.text_prompt([1, -5])
    with pytest.raises(RequestError):
        engine.chat_prompt([])
    assert engine.text_prompt(["hello"]) == engine.text_prompt("hello")
    llama, _ = make(template="llama3")
    assert llama.text_prompt("hi")[0] == llama.tokenizer.special_id("<|begin_of_text|>")
    with pytest.raises(ValueError):
        EngineConfig(engine="tgi")
    with pytest.raises(ValueError):
        EngineConfig(template="nope")


# -- embeddings, stats and metrics -----------------------------------------------------------


def cosine(a: list[float], b: list[float]) -> float:
    return sum(x * y for x, y in zip(a, b, strict=True))


def test_embeddings_are_deterministic_unit_vectors_close_for_shared_words() -> None:
    engine, _ = make()
    base = engine.embed("the quick brown fox jumps over the lazy dog")
    near = engine.embed("the quick brown fox jumped over the lazy dog")
    far = engine.embed("completely unrelated sentence about databases")
    assert base == engine.embed("the quick brown fox jumps over the lazy dog")
    assert cosine(base, base) == pytest.approx(1.0)
    assert cosine(base, near) > 0.8 > 0.3 > abs(cosine(base, far))
    assert len(engine.embed("x", 64)) == 64


def test_metrics_expose_vllm_prefix_cache_counters() -> None:
    engine, _ = make()
    for _ in range(2):
        engine.start(request(list(range(17)), max_tokens=1)).run()
    text = render_metrics(engine)
    labels = '{engine="0",model_name="sim-model"}'
    assert f"vllm:prefix_cache_queries_total{labels} 34.0" in text
    assert f"vllm:prefix_cache_hits_total{labels} 16.0" in text
    assert "# TYPE vllm:prefix_cache_hits_total counter" in text
    assert (
        'vllm:request_success_total{engine="0",model_name="sim-model",finished_reason="length"} 2.0'
        in text
    )


class EventList(list[object]):
    """A KV-event sink that keeps every event."""

    def publish(self, batch: object) -> None:
        self.extend(batch)  # type: ignore[arg-type]


@pytest.mark.parametrize(("engine_name", "medium"), [("vllm", "CPU"), ("sglang", "CPU_PINNED")])
def test_offload_events_name_the_cpu_tier_as_the_engine_does(engine_name: str, medium: str) -> None:
    events = EventList()
    config = EngineConfig(engine=engine_name, block_size=4, num_blocks=2, cpu_blocks=2)
    engine = SimEngine(config, sink=events, sleep=Sleeps())
    for start in (0, 100):  # the second prompt pushes the first one's blocks to the CPU
        engine.start(request(list(range(start, start + 9)), max_tokens=1)).run()
    offloaded = {e.medium for e in events if isinstance(e, BlockStored)} - {"GPU"}
    assert offloaded == {medium}
