"""The simulated engine: prompt → tokens → prefix cache → timed, deterministic generation.

One :class:`SimEngine` is one inference server (one GPU's worth of KV cache). It knows
nothing about HTTP; :mod:`continuum.sim.server` turns its results into vLLM's wire format.

Lifecycle of one request (:class:`Generation`): wait for one of ``max_num_seqs`` slots →
allocate the prompt in the prefix cache (hits counted, new blocks stored and published) →
sleep the modelled prefill → yield one output step per token, sleeping the decode cost
between steps → on completion store the blocks the output filled; always release the
request's block references and its slot (``finally``: also on client disconnect).
"""

from __future__ import annotations

import hashlib
import os
import random
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import gevent
from gevent.lock import BoundedSemaphore

from continuum.errors import ModelNotFoundError, RequestError
from continuum.kv_events import BlockHasher, KvEventSink
from continuum.sim import embedder
from continuum.sim.cache import Allocation, PrefixCache
from continuum.sim.latency import LatencyModel
from continuum.sim.templates import get_template
from continuum.sim.tokenizer import SimTokenizer

DEFAULT_MODEL = "sim-model"
ENGINES = ("vllm", "sglang", "trtllm")


@dataclass(frozen=True)
class EngineConfig:
    """Everything that shapes one simulated engine."""

    engine: str = "vllm"
    models: tuple[str, ...] = (DEFAULT_MODEL,)
    template: str = "chatml"
    block_size: int = 16
    num_blocks: int = 4096
    cpu_blocks: int = 0
    max_num_seqs: int = 64
    max_model_len: int = 32768
    latency: LatencyModel = field(default_factory=LatencyModel)
    embedding_dim: int = 256

    def __post_init__(self) -> None:
        if self.engine not in ENGINES:
            raise ValueError(f"engine must be one of {', '.join(ENGINES)} (got {self.engine!r})")
        if not self.models:
            raise ValueError("at least one model name is required")
        if self.max_num_seqs < 1 or self.max_model_len < 2 or self.embedding_dim < 1:
            raise ValueError("max_num_seqs, max_model_len and embedding_dim must be positive")
        get_template(self.template)


@dataclass(frozen=True)
class GenerationRequest:
    """What to generate: prompt token ids plus the sampling parameters the sim honours."""

    model: str
    prompt_ids: tuple[int, ...]
    max_tokens: int | None = None
    temperature: float = 1.0
    seed: int | None = None
    stop: tuple[str, ...] = ()
    cache_salt: str | None = None
    ignore_eos: bool = False
    min_tokens: int = 0


@dataclass(frozen=True)
class Step:
    """One generated token: its id, its text delta, and the finish reason on the last one."""

    token_id: int
    text: str
    finish_reason: str | None = None
    stop_reason: str | None = None


class Generation:
    """One admitted request. Iterate to run it; the attributes fill in as it runs."""

    def __init__(self, engine: SimEngine, request: GenerationRequest, steps: list[Step]):
        self.engine = engine
        self.request = request
        self.steps = steps
        self.prompt_tokens = len(request.prompt_ids)
        self.cached_tokens = 0
        self.cpu_cached_tokens = 0
        #: Modelled prefill seconds (TTFT minus queueing), known once admitted.
        self.prefill_seconds: float | None = None
        self.emitted = 0
        self.finished = False

    @property
    def completion_tokens(self) -> int:
        """Tokens generated so far (all of them once iteration completes)."""
        return self.emitted

    @property
    def text(self) -> str:
        """The full output text (independent of iteration)."""
        return "".join(step.text for step in self.steps)

    def __iter__(self) -> Iterator[Step]:
        engine = self.engine
        engine.waiting += 1
        try:
            engine.slots.acquire()
        finally:
            engine.waiting -= 1
        engine.running += 1
        alloc: Allocation | None = None
        try:
            alloc = engine.cache.allocate(self.request.prompt_ids, self.request.cache_salt)
            self.cached_tokens = alloc.cached_tokens
            self.cpu_cached_tokens = alloc.cpu_cached_tokens
            self.prefill_seconds = engine.latency.prefill(
                self.prompt_tokens, self.cached_tokens, self.cpu_cached_tokens
            )
            engine.sleep(self.prefill_seconds)
            for i, step in enumerate(self.steps):
                if i:
                    engine.sleep(engine.latency.decode_per_token)
                self.emitted += 1
                engine.generation_tokens += 1
                yield step
            self.finished = True
            # The last sampled token is never fed back, so its KV is never computed.
            grown = self.request.prompt_ids + tuple(s.token_id for s in self.steps[:-1])
            engine.cache.extend(alloc, grown)
        finally:
            if alloc is not None:
                engine.cache.release(alloc)
            engine.running -= 1
            engine.slots.release()
            reason = (self.steps[-1].finish_reason if self.finished else None) or "abort"
            engine.finished[reason] = engine.finished.get(reason, 0) + 1

    def run(self) -> Generation:
        """Run to completion (non-streaming use) and return ``self``."""
        for _ in self:
            pass
        return self


class SimEngine:
    """A simulated inference engine.

    Args:
        config: engine shape, cache size and latency model.
        hasher: block hasher of the engine being imitated (default: a sha256 chain).
        sink: where KV events go (a ZMQ publisher, TensorRT-LLM's event queue …).
        sleep: how to wait (``gevent.sleep``; tests may pass a recorder).
    """

    def __init__(
        self,
        config: EngineConfig | None = None,
        *,
        hasher: BlockHasher | None = None,
        sink: KvEventSink | None = None,
        sleep: Callable[[float], object] = gevent.sleep,
    ) -> None:
        self.config = config = config or EngineConfig()
        self.tokenizer = SimTokenizer()
        self.template = get_template(config.template)
        self.latency = config.latency
        self.cache = PrefixCache(
            config.num_blocks,
            config.block_size,
            cpu_blocks=config.cpu_blocks,
            hasher=hasher,
            sink=sink,
            cpu_medium="CPU_PINNED" if config.engine == "sglang" else "CPU",
        )
        self.sink = sink
        self.sleep = sleep
        self.slots = BoundedSemaphore(config.max_num_seqs)
        self.running = 0
        self.waiting = 0
        self.requests = 0
        self.generation_tokens = 0
        self.finished: dict[str, int] = {}
        spaced, capital = self.tokenizer.generation_lexicon()
        self._spaced, self._capital = spaced, capital
        self._spaced_capital = [
            tid
            for tid in (self.tokenizer.word_id(" " + self.tokenizer.token_str(i)) for i in capital)
            if tid is not None
        ]
        self._period = self.tokenizer.encode(".")[0]
        self._comma = self.tokenizer.encode(",")[0]
        self._eos = self.tokenizer.special_id(self.template.eos)

    # -- prompts ---------------------------------------------------------------------------

    def resolve_model(self, model: object) -> str:
        """The served model a request names (the first one when it names none).

        Raises:
            ModelNotFoundError: the engine does not serve ``model``.
        """
        if model is None:
            return self.config.models[0]
        if not isinstance(model, str) or model not in self.config.models:
            raise ModelNotFoundError(f"The model `{model}` does not exist.", param="model")
        return model

    def chat_prompt(
        self,
        messages: object,
        *,
        add_generation_prompt: bool = True,
        continue_final_message: bool = False,
        add_special_tokens: bool = False,
    ) -> list[int]:
        """Token ids of a chat conversation rendered with the engine's template."""
        if not isinstance(messages, list) or not messages:
            raise RequestError("'messages' must be a non-empty array", param="messages")
        text = self.template.render(
            messages,
            add_generation_prompt=add_generation_prompt,
            continue_final_message=continue_final_message,
        )
        return self.tokenizer.encode(text, bos=self.template.bos if add_special_tokens else None)

    def text_prompt(self, prompt: object, *, add_special_tokens: bool = True) -> list[int]:
        """Token ids of a completion prompt: a string, token ids, or a batch of one of them."""
        if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
            prompt = prompt[0]
        if isinstance(prompt, str):
            bos = self.template.bos if add_special_tokens else None
            ids = self.tokenizer.encode(prompt, bos=bos)
        elif isinstance(prompt, list) and all(
            isinstance(t, int) and not isinstance(t, bool) for t in prompt
        ):
            ids = list(prompt)
            self.tokenizer.decode(ids)  # validates every id
        else:
            raise RequestError(
                "'prompt' must be a string, a list of token ids, or a batch of one",
                param="prompt",
            )
        if not ids:
            raise RequestError("The prompt cannot be empty.", param="prompt")
        return ids

    def check_length(self, prompt_tokens: int, max_tokens: int | None) -> None:
        """Reject prompts that do not fit ``max_model_len`` (vLLM's 400)."""
        limit = self.config.max_model_len
        wanted = prompt_tokens + (max_tokens or 0)
        if prompt_tokens >= limit or wanted > limit:
            raise RequestError(
                f"This model's maximum context length is {limit} tokens. However, you "
                f"requested {wanted} tokens ({prompt_tokens} in the messages, "
                f"{max_tokens or 0} in the completion). Please reduce the length of the "
                "messages or completion.",
                param="max_tokens",
            )

    # -- generation ------------------------------------------------------------------------

    def start(self, request: GenerationRequest) -> Generation:
        """Plan the output of ``request`` and return it ready to run (nothing waits yet)."""
        self.check_length(len(request.prompt_ids), request.max_tokens)
        self.requests += 1
        return Generation(self, request, self.plan(request))

    def plan(self, request: GenerationRequest) -> list[Step]:
        """The output of ``request``: a function of the prompt at temperature 0 (or with a
        seed), random otherwise."""
        rng = random.Random(_seed(request))
        natural = max(rng.randint(8, 40), request.min_tokens)
        if request.ignore_eos:
            natural = request.max_tokens or natural
        ids = [rng.choice(self._capital)]
        while len(ids) < natural - 1:
            roll = rng.random()
            if ids[-1] not in (self._period, self._comma) and roll < 0.10:
                ids.append(self._period)
                ids.append(rng.choice(self._spaced_capital))
            elif ids[-1] != self._comma and roll < 0.14:
                ids.append(self._comma)
            else:
                ids.append(rng.choice(self._spaced))
        ids = ids[: max(natural - 1, 1)]
        if ids[-1] in (self._period, self._comma):
            ids[-1] = rng.choice(self._spaced)
        ids.append(self._period)
        limit = request.max_tokens
        if request.ignore_eos:
            ids = ids[:limit] if limit else ids
            steps = [Step(i, self.tokenizer.token_str(i)) for i in ids]
            return _apply_stop(_finish(steps, "length"), request.stop)
        if limit is not None and limit < len(ids) + 1:
            steps = [Step(i, self.tokenizer.token_str(i)) for i in ids[:limit]]
            return _apply_stop(_finish(steps, "length"), request.stop)
        steps = [Step(i, self.tokenizer.token_str(i)) for i in ids] + [Step(self._eos, "")]
        return _apply_stop(_finish(steps, "stop"), request.stop)

    def reset_prefix_cache(self) -> bool:
        """Drop every cached block (False while requests are running)."""
        return self.cache.reset()

    def stats(self) -> dict[str, object]:
        """Counters and gauges since start (``GET /sim/stats``, and ``/metrics``'s source)."""
        cache = self.cache
        return {
            "engine": self.config.engine,
            "models": list(self.config.models),
            "requests": self.requests,
            "running": self.running,
            "waiting": self.waiting,
            "finished": dict(self.finished),
            "prompt_tokens": cache.stats.query_tokens,
            "cached_prompt_tokens": cache.stats.hit_tokens,
            "cpu_cached_prompt_tokens": cache.stats.cpu_hit_tokens,
            "generation_tokens": self.generation_tokens,
            "block_size": cache.block_size,
            "blocks_in_use": cache.blocks_in_use,
            "gpu_blocks_cached": cache.gpu_blocks_used,
            "gpu_blocks_total": cache.num_blocks,
            "cpu_blocks_cached": cache.cpu_blocks_used,
            "cpu_blocks_total": cache.cpu_blocks,
            "stored_blocks": cache.stats.stored_blocks,
            "evictions": cache.stats.gpu_evictions,
            "cpu_evictions": cache.stats.cpu_evictions,
        }

    # -- embeddings ------------------------------------------------------------------------

    def embed(self, text: str, dimensions: int | None = None) -> list[float]:
        """A unit vector for ``text`` from :mod:`continuum.sim.embedder` (hashed words,
        word pairs and character trigrams), so paraphrases have a high cosine."""
        return embedder.embed(text, dimensions or self.config.embedding_dim)


_METRICS = (
    # (name, type, help, stats key or callable)
    ("vllm:num_requests_running", "gauge", "Number of requests in model execution batches."),
    ("vllm:num_requests_waiting", "gauge", "Number of requests waiting to be processed."),
    ("vllm:kv_cache_usage_perc", "gauge", "KV-cache usage. 1 means 100 percent usage."),
    ("vllm:prefix_cache_queries_total", "counter", "Prefix cache queries, in queried tokens."),
    ("vllm:prefix_cache_hits_total", "counter", "Prefix cache hits, in cached tokens."),
    ("vllm:prompt_tokens_total", "counter", "Number of prefill tokens processed."),
    ("vllm:generation_tokens_total", "counter", "Number of generation tokens processed."),
    ("vllm:request_success_total", "counter", "Count of finished requests by finish reason."),
    ("continuum_sim_requests_total", "counter", "Requests admitted by the simulated engine."),
    ("continuum_sim_cpu_prefix_cache_hits_total", "counter", "Cached tokens from the CPU tier."),
    ("continuum_sim_evictions_total", "counter", "Blocks evicted, by tier."),
    ("continuum_sim_blocks", "gauge", "Blocks held, by tier and state."),
)


def render_metrics(engine: SimEngine) -> str:
    """Prometheus text exposition of ``engine.stats()`` under vLLM's metric names."""
    s: dict[str, Any] = engine.stats()
    labels = f'engine="0",model_name="{engine.config.models[0]}"'
    usage = s["blocks_in_use"] / s["gpu_blocks_total"]
    samples: dict[str, list[tuple[str, float]]] = {
        "vllm:num_requests_running": [("", s["running"])],
        "vllm:num_requests_waiting": [("", s["waiting"])],
        "vllm:kv_cache_usage_perc": [("", usage)],
        "vllm:prefix_cache_queries_total": [("", s["prompt_tokens"])],
        "vllm:prefix_cache_hits_total": [("", s["cached_prompt_tokens"])],
        "vllm:prompt_tokens_total": [("", s["prompt_tokens"])],
        "vllm:generation_tokens_total": [("", s["generation_tokens"])],
        "vllm:request_success_total": [
            (f',finished_reason="{r}"', s["finished"].get(r, 0))
            for r in ("stop", "length", "abort")
        ],
        "continuum_sim_requests_total": [("", s["requests"])],
        "continuum_sim_cpu_prefix_cache_hits_total": [("", s["cpu_cached_prompt_tokens"])],
        "continuum_sim_evictions_total": [
            (',medium="GPU"', s["evictions"]),
            (',medium="CPU"', s["cpu_evictions"]),
        ],
        "continuum_sim_blocks": [
            (',medium="GPU",state="in_use"', s["blocks_in_use"]),
            (',medium="GPU",state="cached"', s["gpu_blocks_cached"]),
            (',medium="CPU",state="cached"', s["cpu_blocks_cached"]),
        ],
    }
    lines = []
    for name, kind, help_text in _METRICS:
        lines.append(f"# HELP {name} {help_text}")
        lines.append(f"# TYPE {name} {kind}")
        lines.extend(f"{name}{{{labels}{extra}}} {float(v)}" for extra, v in samples[name])
    return "\n".join(lines) + "\n"


def _finish(steps: list[Step], reason: str) -> list[Step]:
    last = steps[-1]
    steps[-1] = Step(last.token_id, last.text, reason, None)
    return steps


def _apply_stop(steps: list[Step], stops: Sequence[str]) -> list[Step]:
    """Cut the output where a stop string first appears (the stop string is not output)."""
    if not stops:
        return steps
    text = ""
    for k, step in enumerate(steps):
        new = text + step.text
        found = [(new.find(s), s) for s in stops if s and s in new]
        if found:
            index, stop = min(found)
            delta = new[len(text) : index] if index > len(text) else ""
            return [*steps[:k], Step(step.token_id, delta, "stop", stop)]
        text = new
    return steps


def _seed(request: GenerationRequest) -> int:
    digest = hashlib.sha256(b"continuum-sim|")
    digest.update(",".join(map(str, request.prompt_ids)).encode())
    if request.temperature > 0:
        if request.seed is None:
            return int.from_bytes(os.urandom(8), "big")
        digest.update(f"|seed={request.seed}|t={request.temperature}".encode())
    return int.from_bytes(digest.digest()[:8], "big")
