"""The semantic cache through real gunicorn with the official ``openai`` SDK: paraphrase
hits, partition isolation, the false-hit gate, embedding failures, TTL and ``max_entries``
eviction, streamed replay (ending with a usage chunk), one entry for streamed and buffered
requests, a reload that keeps the index, metrics, admin stats/invalidate, and sharing across
workers via Redis.

The embedding backend is a fake upstream (``internal: true``) answering with the
simulator's deterministic embedder (64 dims): "How do I reset my password?" and "How can I
reset my password?" have a cosine of about 0.89, unrelated questions about 0.
"""

from __future__ import annotations

import math
import time
from typing import Any

import openai
import pytest
import requests
import yaml

from continuum.devtools.fleet import metric_sum
from continuum.devtools.procs import free_port

pytestmark = pytest.mark.e2e

Q = "How do I reset my password?"
PARA = "How can I reset my password?"
OTHER = "Explain how photosynthesis works in plants"
OTHER_PARA = "Explain how photosynthesis works in green plants"


def _config(up: Any, emb_url: str, **semantic: Any) -> dict[str, Any]:
    cache: dict[str, Any] = semantic.pop("cache", {})
    return {
        "backends": [{"name": up.name, "url": up.url, "models": ["m"]},
                     {"name": "emb", "url": emb_url, "models": ["embed-sim"],
                      "internal": True}],
        "response_cache": {"enabled": True, **cache, "semantic": {
            "enabled": True, "backend": "emb", "embedding_model": "embed-sim",
            "threshold": 0.85, **semantic}},
        "auth": {"keys": [{"key": "key-acme", "tenant": "acme"},
                          {"key": "key-globex", "tenant": "globex"}]},
        "health_check": {"interval_seconds": 30},
    }


def _ask(client: openai.OpenAI, text: str, **extra: Any) -> tuple[str, str | None, str]:
    raw = client.chat.completions.with_raw_response.create(
        model="m", messages=[*extra.pop("history", []), {"role": "user", "content": text}],
        temperature=0, **extra)
    return (raw.headers["x-cache"], raw.headers.get("x-cache-mode"),
            raw.parse().choices[0].message.content or "")


def _client(router: Any, key: str = "key-acme") -> openai.OpenAI:
    return openai.OpenAI(base_url=router.url + "/v1", api_key=key, max_retries=0)


def _stats(router: Any) -> dict[str, Any]:
    doc: dict[str, Any] = requests.get(router.url + "/admin/response-cache/stats",
                                       timeout=5).json()
    return doc


def test_paraphrase_hits_and_partitions_isolate(upstreams, router_factory) -> None:
    up, emb = upstreams("a"), upstreams("e")
    router = router_factory(_config(up, emb.url))
    with _client(router) as client:
        assert _ask(client, Q)[:2] == ("MISS", None)
        assert _ask(client, PARA) == ("HIT", "semantic", "hello from a")
        assert up.stats()["requests"] == 1
        # Same question, another partition each time: never served.
        assert _ask(client, PARA, history=[{"role": "system", "content": "Be terse."}])[0] \
            == "MISS"
        tool = {"type": "function", "function": {"name": "f", "parameters": {}}}
        assert _ask(client, PARA, tools=[tool])[0] == "MISS"
        assert _ask(client, PARA, seed=7)[0] == "MISS"
        # The false-hit gate: close vectors, opposite meaning.
        assert _ask(client, "How do I enable 2FA on my account?")[0] == "MISS"
        assert _ask(client, "How do I enable 2FA on my account, please?")[:2] == \
            ("HIT", "semantic")
    with _client(router, "key-globex") as other:
        assert _ask(other, PARA)[0] == "MISS"
        # The internal embedding backend is never routed client traffic.
        with pytest.raises(openai.NotFoundError):
            other.chat.completions.create(model="embed-sim", temperature=0,
                                          messages=[{"role": "user", "content": Q}])
    assert up.stats()["requests"] == 6
    text = router.metrics()
    assert metric_sum(text, "continuum_semantic_cache_requests_total", result="hit") == 2
    assert metric_sum(text, "continuum_semantic_cache_index_entries") == 6
    stats = _stats(router)["semantic"]
    assert stats["requests"]["hit"] == 2 and stats["index_entries"] == 6
    assert stats["config"]["threshold"] == 0.85
    # Invalidate covers the semantic space.
    cleared = requests.post(router.url + "/admin/response-cache/invalidate",
                            json={"clear_all": True}, timeout=5).json()
    assert cleared["cleared_semantic_index_entries"] == 6
    with _client(router) as client:
        assert _ask(client, PARA)[0] == "MISS"


def test_gate_refuses_negations_and_skips_are_counted(upstreams, router_factory) -> None:
    up, emb = upstreams("a"), upstreams("e")
    router = router_factory(_config(up, emb.url, threshold=0.5, max_input_bytes=64))
    with _client(router) as client:
        assert _ask(client, "How do I enable 2FA on my account?")[0] == "MISS"
        assert _ask(client, "How do I disable 2FA on my account?")[0] == "MISS"
        assert _ask(client, "x" * 65)[0] == "MISS"  # too long: skips the path
        client.chat.completions.create(model="m", messages=[
            {"role": "user", "content": Q}], temperature=0.5)
    stats = _stats(router)["semantic"]
    assert stats["gate_refusals"] == {"negation": 1}
    assert stats["skips"] == {"too_long": 1}
    assert stats["requests"] == {"hit": 0, "miss": 2, "skip": 1, "total": 3}
    assert emb.stats()["embeddings"] == 2
    text = router.metrics()
    assert metric_sum(text, "continuum_semantic_cache_skips_total", reason="too_long") == 1
    assert metric_sum(text, "continuum_semantic_cache_gate_refusals_total",
                      reason="negation") == 1
    assert metric_sum(text, "continuum_semantic_cache_requests_total", result="miss") == 2
    assert metric_sum(text, "continuum_semantic_cache_embedding_seconds_count") == 2
    assert metric_sum(text, "continuum_semantic_cache_embedding_errors_total") == 0
    assert metric_sum(text, "continuum_semantic_cache_index_entries") == 2


#: What the router's one warning says of each failure (two failures: one warning).
FAILURE_LOGGED = {
    "down": "failed: cannot connect",
    "slow": "failed: no answer within 200 ms (response_cache.semantic.embedding_timeout_ms)",
    "status": "failed: HTTP 404 (type invalid_request_error, code model_not_found); does the "
              "backend serve the model 'embed-sim' (response_cache.semantic.embedding_model)",
    # strings for numbers: before, a 500 (numpy's ValueError out of the lookup)
    "garbage": "failed: the embedding is not a list of finite numbers, or is empty or all "
               "zeros",
}


@pytest.mark.parametrize("failure", ["down", "slow", "status", "garbage"])
def test_embedding_failure_is_a_plain_miss(upstreams, router_factory, failure) -> None:
    up, emb = upstreams("a"), upstreams("e")
    emb_url = f"http://127.0.0.1:{free_port()}" if failure == "down" else emb.url
    if failure == "slow":
        requests.get(emb.url + "/_test/embed_delay?seconds=2", timeout=5)
    if failure == "status":
        requests.get(emb.url + "/_test/embed_status?code=404", timeout=5)
    if failure == "garbage":
        requests.get(emb.url + "/_test/embed_garbage?on=1", timeout=5)
    # 200 ms against the slow backend's 2 s; the other failures answer at once, but a busy
    # machine must not turn their answer into a timeout.
    timeout_ms = 200 if failure == "slow" else 5000
    router = router_factory(_config(up, emb_url, embedding_timeout_ms=timeout_ms))
    errors, caches = 0, []
    with _client(router) as client:
        for text in (Q, PARA, Q):
            try:
                cache, _mode, body = _ask(client, text)
            except openai.APIError:
                errors += 1
                continue
            caches.append(cache)
            assert body == "hello from a"
    assert errors == 0
    assert caches == ["MISS", "MISS", "HIT"]
    stats = _stats(router)["semantic"]
    assert stats["requests"]["hit"] == 0
    kind = {"down": "connect", "slow": "timeout", "status": "status",
            "garbage": "invalid"}[failure]
    # The third ask is an exact hit: only two reached the semantic path.
    assert stats["embedding_errors"] == {kind: 2}
    assert metric_sum(router.metrics(), "continuum_semantic_cache_embedding_errors_total",
                      kind=kind) == 2
    # An operator is told, once a minute at most, what failed and what to check; never
    # the text that was to be embedded.
    warnings = [line for line in router.proc.log_text().splitlines()
                if "semantic cache: embedding by backend emb (model embed-sim)" in line]
    assert len(warnings) == 1, warnings
    assert " WARNING " in warnings[0] and FAILURE_LOGGED[failure] in warnings[0]
    assert "went on as a plain miss" in warnings[0]
    assert Q not in warnings[0] and PARA not in warnings[0]


def test_ttl_and_max_entries_evict(upstreams, router_factory) -> None:
    up, emb = upstreams("a"), upstreams("e")
    # A ttl of a few seconds: each hit below must come within it of the miss that stored
    # its vector, even when a busy machine stalls a request.
    ttl = 4
    router = router_factory(_config(up, emb.url, max_entries=1, ttl=f"{ttl}s"))
    with _client(router) as client:
        assert _ask(client, Q)[0] == "MISS"
        assert _ask(client, OTHER)[0] == "MISS"  # evicts Q's vector (max_entries 1)
        assert _ask(client, OTHER_PARA)[:2] == ("HIT", "semantic")
        assert _ask(client, PARA)[0] == "MISS"  # indexed now, OTHER evicted
        assert _ask(client, "how can i reset my password")[:2] == ("HIT", "semantic")
        time.sleep(ttl + 0.2)  # past the semantic ttl; the exact entries live 300s
        assert _ask(client, "How can I reset my password")[0] == "MISS"
    assert _stats(router)["semantic"]["evictions"] >= 1


def _stream(client: openai.OpenAI, text: str) -> tuple[tuple[str, str | None], str, Any]:
    """(X-Cache, X-Cache-Mode), the streamed text and the last chunk's usage."""
    raw = client.chat.completions.with_raw_response.create(
        model="m", messages=[{"role": "user", "content": text}], temperature=0,
        stream=True, stream_options={"include_usage": True})
    chunks = list(raw.parse())
    return ((raw.headers["x-cache"], raw.headers.get("x-cache-mode")),
            "".join(c.choices[0].delta.content or "" for c in chunks if c.choices),
            chunks[-1].usage)


def test_streamed_answer_is_replayed_through_the_sdk(upstreams, router_factory) -> None:
    """The fake upstream's stream has no usage chunk: the replay ends with one anyway,
    estimated from the stored text (a quarter token per character)."""
    up, emb = upstreams("a"), upstreams("e")
    router = router_factory(_config(up, emb.url))
    with _client(router) as client:
        miss = _stream(client, Q)
        hit = _stream(client, PARA)
    assert miss[:2] == (("MISS", None), "t0 t1 t2 ") and miss[2] is None
    assert hit[:2] == (("HIT", "semantic"), "t0 t1 t2 ")
    assert hit[2] is not None
    assert (hit[2].prompt_tokens, hit[2].completion_tokens) == \
        (math.ceil(len(PARA) / 4), math.ceil(len("t0 t1 t2 ") / 4))
    assert up.stats()["requests"] == 1


def test_one_entry_serves_streamed_and_buffered_requests(upstreams, router_factory) -> None:
    """A buffered answer replays as a stream with the stored usage; a streamed one is
    served to a buffered request as one body."""
    up, emb = upstreams("a"), upstreams("e")
    router = router_factory(_config(up, emb.url))
    with _client(router) as client:
        assert _ask(client, Q)[0] == "MISS"
        cache, text, usage = _stream(client, PARA)
        assert (cache, text) == (("HIT", "semantic"), "hello from a")
        assert usage is not None
        assert (usage.prompt_tokens, usage.completion_tokens, usage.total_tokens) == (3, 2, 5)
        assert _stream(client, OTHER)[0] == ("MISS", None)
        assert _ask(client, OTHER_PARA) == ("HIT", "semantic", "t0 t1 t2 ")
    assert up.stats()["requests"] == 2


def test_reload_keeps_the_index_unless_the_embedding_model_changes(
        upstreams, router_factory) -> None:
    up, emb = upstreams("a"), upstreams("e")
    router = router_factory(_config(up, emb.url))

    def reload(**semantic: Any) -> None:
        doc = yaml.safe_load(router.config_path.read_text())
        doc["response_cache"]["semantic"].update(semantic)
        router.config_path.write_text(yaml.safe_dump(doc))
        reply = requests.post(router.url + "/admin/config/reload", timeout=10).json()
        assert reply["success"] is True, reply

    with _client(router) as client:
        assert _ask(client, Q)[0] == "MISS"
        reload(threshold=0.86)
        stats = _stats(router)["semantic"]
        assert stats["config"]["threshold"] == 0.86 and stats["index_entries"] == 1
        assert _ask(client, PARA)[:2] == ("HIT", "semantic")
        reload(embedding_model="embed-sim-2")  # other vectors: the index starts empty
        assert _stats(router)["semantic"]["index_entries"] == 0
        assert _ask(client, "how can i reset my password")[0] == "MISS"
    assert metric_sum(router.metrics(), "continuum_semantic_cache_index_entries") == 1


@pytest.mark.redis
@pytest.mark.parametrize("workers", [1, 2])
def test_workers_share_entries_through_redis(upstreams, router_factory, redis_server,
                                             workers) -> None:
    """Every paraphrase hits with 2 workers as with 1: a worker that did not index an
    entry pulls it from the partition directory in Redis on a local miss."""
    up, emb = upstreams("a"), upstreams("e")
    prefix = f"cr:sem{workers}:{time.monotonic_ns()}:"
    router = router_factory(_config(up, emb.url, cache={
        "backend": "redis", "redis": {"url": redis_server.url, "key_prefix": prefix}}),
        workers=workers)
    questions = [f"How do I reset the password of account number {i}?" for i in range(8)]
    hits = 0
    with _client(router) as client:
        for q in questions:
            assert _ask(client, q)[0] == "MISS"
        for q in questions:
            # New connections, so that with 2 workers both get some of them.
            with _client(router) as fresh:
                cache, mode, _ = _ask(fresh, q.replace("How do I", "How can I"))
            hits += cache == "HIT" and mode == "semantic"
    assert hits == len(questions)
