"""The semantic cache over real stores, two "workers" at a time: entries shared through
Redis, the version in the partition directory (an entry rewritten after a clear is pulled
again), and a config reload that keeps the index.

Each worker is a :class:`SemanticCache` with its own metrics and store connection, as in a
gunicorn worker; embeddings come from a fake upstream (the simulator's embedder, 64 dims).
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from typing import Any

import pytest

from continuum.caching.semantic import SemanticCache
from continuum.config import RouterConfig, parse_config
from continuum.devtools.redis_server import unique_prefix
from continuum.metrics import RouterMetrics
from continuum.request import CHAT, RequestContext, parse_request
from continuum.resources import WorkerResources

Q = "How do I reset my password?"
PARA = "How can I reset my password?"


def _config(emb_url: str, redis_url: str | None = None, prefix: str = "",
            **semantic: Any) -> RouterConfig:
    cache: dict[str, Any] = {"enabled": True}
    if redis_url is not None:
        cache.update(backend="redis", redis={"url": redis_url, "key_prefix": prefix})
    return parse_config({
        "backends": [{"name": "a", "url": "http://127.0.0.1:9", "models": ["m"]},
                     {"name": "emb", "url": emb_url, "internal": True}],
        "response_cache": {**cache, "semantic": {
            "enabled": True, "backend": "emb", "embedding_model": "embed-sim",
            "threshold": 0.85, **semantic}}})


def _ctx(text: str, tenant: str = "acme", **body: Any) -> RequestContext:
    raw = json.dumps({"model": "m", "temperature": 0,
                      "messages": [{"role": "user", "content": text}], **body}).encode()
    return parse_request(raw, CHAT, tenant=tenant)


def _answer(text: str) -> bytes:
    return json.dumps({"id": "c", "object": "chat.completion", "created": 1, "model": "m",
                       "choices": [{"index": 0, "finish_reason": "stop",
                                    "message": {"role": "assistant", "content": text}}],
                       "usage": {"prompt_tokens": 1, "completion_tokens": 1,
                                 "total_tokens": 2}}).encode()


class Worker:
    """One worker's semantic cache on its own store connection."""

    def __init__(self, config: RouterConfig) -> None:
        from continuum.registry import PluginRegistry

        self.metrics = RouterMetrics()
        self.resources = WorkerResources()
        store_cls = PluginRegistry().load("continuum.cache_stores",
                                          config.response_cache.backend)
        self.store = store_cls.from_config(config, metrics=self.metrics,
                                           resources=self.resources)
        backend = next(b for b in config.backends if b.name == "emb")
        self.sem = SemanticCache(config.response_cache, backend, lambda: self.store,
                                 self.metrics)

    def ask(self, text: str, answer: str | None = None, **body: Any) -> str | None:
        """The served content on a hit; on a miss, stores ``answer`` (if given), None."""
        probe = self.sem.lookup(_ctx(text, **body))
        assert probe is not None
        if probe.entry is not None:
            _, payload, stream = self.sem.replay(probe)
            assert payload is not None and stream is None
            return str(json.loads(payload)["choices"][0]["message"]["content"])
        if answer is not None:
            self.sem.store_body(probe, 200, "application/json", _answer(answer))
        return None

    def gauge(self) -> float | None:
        return self.metrics.registry.get_sample_value("continuum_semantic_cache_index_entries")

    def close(self) -> None:
        self.sem.close()
        self.store.close()
        self.resources.close()


@pytest.fixture
def workers() -> Iterator[Callable[[RouterConfig], Worker]]:
    made: list[Worker] = []

    def make(config: RouterConfig) -> Worker:
        worker = Worker(config)
        made.append(worker)
        return worker

    yield make
    for worker in made:
        worker.close()


@pytest.mark.redis
def test_a_cleared_entry_written_again_reaches_the_other_worker(
        upstreams, redis_server, workers) -> None:
    emb = upstreams("e")
    config = _config(emb.url, redis_server.url, unique_prefix("sem"))
    a, b = workers(config), workers(config)
    assert a.ask(Q, "v1") is None
    assert b.ask(PARA) == "v1"  # pulled from the partition directory
    assert len(b.sem.index) == 1
    # Invalidate through A: the shared store is emptied; B's row now points at nothing.
    a.store.clear()
    a.sem.clear()
    assert b.ask(PARA) is None
    assert len(b.sem.index) == 0
    # A stores the same question again: B pulls the new version, not the remembered one.
    assert a.ask(Q, "v2") is None
    assert b.ask(PARA) == "v2"
    # Other tenants never see it, in either worker.
    assert b.ask(PARA, tenant="globex") is None and a.ask(PARA, tenant="globex") is None


@pytest.mark.redis
def test_streamed_and_buffered_requests_share_an_entry_across_workers(
        upstreams, redis_server, workers) -> None:
    emb = upstreams("e")
    config = _config(emb.url, redis_server.url, unique_prefix("sem"))
    a, b = workers(config), workers(config)
    assert a.ask(Q, "v1") is None
    probe = b.sem.lookup(_ctx(PARA, stream=True,
                              stream_options={"include_usage": True}))
    assert probe is not None and probe.entry is not None
    headers, body, stream = b.sem.replay(probe)
    assert body is None and stream is not None
    assert headers["Content-Type"] == "text/event-stream"
    events = b"".join(stream).decode().split("\n\n")
    assert events[-2:] == ["data: [DONE]", ""]
    usage = json.loads(events[-3][6:])["usage"]
    assert usage == {"prompt_tokens": 1, "completion_tokens": 1, "total_tokens": 2}


def test_a_reload_keeps_the_index_unless_the_embedding_model_changes(
        upstreams, workers) -> None:
    emb = upstreams("e")
    worker = workers(_config(emb.url))
    for i in range(3):
        assert worker.ask(f"How do I reset the password of account {i}?", f"a{i}") is None
    assert len(worker.sem.index) == 3 and worker.gauge() == 3
    old_client = worker.sem.client
    # Threshold and gate: applied in place, index kept, same embedding client.
    assert worker.sem.reconfigure(_config(emb.url, threshold=0.8, false_hit_gate=False))
    assert worker.sem.settings.threshold == 0.8 and worker.sem.client is old_client
    assert worker.ask("How can I reset the password of account 1?") == "a1"
    # A smaller max_entries evicts the oldest now; the gauge follows.
    assert worker.sem.reconfigure(_config(emb.url, threshold=0.8, max_entries=2))
    assert len(worker.sem.index) == 2 and worker.gauge() == 2
    assert worker.ask("How can I reset the password of account 0?") is None
    # A new timeout gets a new embedding client; the index stays.
    assert worker.sem.reconfigure(_config(emb.url, embedding_timeout_ms=500, max_entries=2))
    assert worker.sem.client is not old_client and len(worker.sem.index) == 2
    # Another embedding model (vectors not comparable) or the path off: rebuild.
    assert not worker.sem.reconfigure(_config(emb.url, embedding_model="embed-other"))
    assert not worker.sem.reconfigure(_config(emb.url, enabled=False))
    worker.sem.close()
    assert worker.gauge() == 0
