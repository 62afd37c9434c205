"""Tier 4 through real gunicorn: an SSE event stream fills the index, the scorer routes."""

from __future__ import annotations

import json
import threading
import time
from typing import Any

import pytest
import requests

from continuum.devtools.procs import wait_until
from continuum.prefix import request_prefix_key
from continuum.prefix_chain import request_chain
from tests.integration.conftest import EventStreams
from tests.integration.kv_helpers import kv_router_config

pytestmark = pytest.mark.e2e

SYSTEM = "You are the routing test assistant. " * 20


def _body(system: str = SYSTEM) -> dict[str, Any]:
    return {"model": "m", "messages": [{"role": "system", "content": system},
                                       {"role": "user", "content": "hello"}]}


def _prefix(system: str = SYSTEM) -> str:
    key = request_prefix_key(_body(system), "m")
    assert key is not None
    return key.hex()


def _config(ups: list[Any], streams: EventStreams, **kv: Any) -> dict[str, Any]:
    return kv_router_config(ups, streams, {"selection_strategy": "RoundRobin"}, **kv)


def _wait_holders(router: Any, expected: int) -> None:
    stats: dict[str, Any] = {}

    def reached() -> bool:
        stats.update(requests.get(router.url + "/admin/kv-index/stats", timeout=5).json())
        return bool(stats["index"]["entry_count"] >= expected)

    wait_until(reached, lambda: f"the index to reach {expected} entries: {stats}", 15)
    time.sleep(0.15)  # let the scorer's 100 ms snapshot of the old state expire


def _backend(router: Any, body: dict[str, Any]) -> str:
    resp = requests.post(router.url + "/v1/chat/completions", json=body, timeout=10)
    assert resp.status_code == 200
    return resp.headers["X-Continuum-Backend"]


def test_requests_go_to_the_holder_with_most_tokens(upstreams, router_factory, streams) -> None:
    ups = [upstreams(n) for n in ("a", "b", "c")]
    router = router_factory(_config(ups, streams))
    # Index empty: the strategy (round robin) spreads requests.
    assert {_backend(router, _body()) for _ in range(6)} == {"a", "b", "c"}

    prefix = _prefix()
    streams.push("a", "cache_created", prefix, 512)
    streams.push("b", "cache_created", prefix, 2048)
    _wait_holders(router, 2)
    assert [_backend(router, _body()) for _ in range(8)] == ["b"] * 8

    explain = requests.post(router.url + "/admin/routing/explain", json=_body(),
                            timeout=5).json()
    assert explain["decision"]["decision"] == "kv_aware"
    assert explain["decision"]["backend"] == "b"
    rows = {row["backend"]: row for row in explain["kv_scores"]}
    assert rows["b"]["raw_overlap"] == 1.0 and rows["a"]["raw_overlap"] == 0.25
    assert rows["c"]["score"] == 0.0 and rows["c"]["tier"] == "none"

    # Another prefix nobody holds: the strategy decides again.
    other = {_backend(router, _body("Something else entirely.")) for _ in range(6)}
    assert other == {"a", "b", "c"}

    streams.push("b", "cache_evicted", prefix, 0)
    wait_until(lambda: _backend(router, _body()) == "a", "the eviction to reach routing", 10)
    assert _backend(router, _body()) == "a"  # a still holds 512 tokens

    stats = requests.get(router.url + "/admin/kv-index/stats", timeout=5).json()
    assert stats["routing_decisions"]["kv_aware"] >= 9
    assert stats["routing_decisions"]["fallback"] >= 6
    assert all(s["connected"] for s in stats["event_sources"])
    backends = requests.get(router.url + "/admin/kv-index/backends", timeout=5).json()
    by_name = {b["backend_name"]: b for b in backends["backends"]}
    assert by_name["b"]["events"] == {"received": 2, "dropped": 0, "malformed": 0,
                                      "index_created": 1, "index_evicted": 1}
    cleared = requests.post(router.url + "/admin/kv-index/clear", timeout=5).json()
    assert cleared["success"] is True and cleared["cleared_entries"] == 1
    text = router.metrics()
    assert 'continuum_kv_index_routing_decisions_total{decision="kv_aware",tier="gpu_hot"}' \
        in text


def test_load_can_move_traffic_off_the_best_holder(upstreams, router_factory, streams) -> None:
    ups = [upstreams(n) for n in ("a", "b")]
    router = router_factory(_config(ups, streams))
    prefix = _prefix()
    streams.push("a", "cache_created", prefix, 1000)
    streams.push("b", "cache_created", prefix, 950)
    _wait_holders(router, 2)
    assert _backend(router, _body()) == "a"
    # Keep `a` busy with a slow request: b then wins on load (0.57 + 0.3 > 0.6 + 0).
    slow = {**_body(), "x_test": {"hang": 1.5}}
    busy = threading.Thread(target=lambda: requests.post(
        router.url + "/v1/chat/completions", json=slow, timeout=10))
    busy.start()
    try:
        deadline = time.monotonic() + 5
        seen = set()
        while time.monotonic() < deadline and "b" not in seen:
            time.sleep(0.15)  # past the scorer's 100 ms snapshot
            seen.add(_backend(router, _body()))
        assert "b" in seen
    finally:
        busy.join(10)


@pytest.mark.redis
def test_two_routers_sharing_a_redis_index_agree(upstreams, router_factory, streams,
                                                 redis_server) -> None:
    ups = [upstreams(n) for n in ("a", "b", "c")]
    kv = {"backend": "redis",
          "redis_key_prefix": f"cr:kvtest:{time.monotonic_ns()}:"}
    cfg = _config(ups, streams, **kv)
    cfg["response_cache"] = {"redis": {"url": redis_server.url}}
    only_feeds = dict(cfg)
    # The second router consumes no streams: it sees only what the first wrote to Redis.
    only_feeds["kv_cache_index"] = {**cfg["kv_cache_index"], "event_sources": []}
    one, two = router_factory(cfg), router_factory(only_feeds)
    systems = [f"System prompt number {i}. " * 10 for i in range(3)]
    for i, system in enumerate(systems):
        streams.push(["a", "b", "c"][i], "cache_created", _prefix(system), 100 + i)
    wait_until(lambda: all(s["events"]["index_created"] == 1 for s in requests.get(
        one.url + "/admin/kv-index/backends", timeout=5).json()["backends"]),
        "the first router to index one entry per backend", 10)
    wait_until(lambda: [_backend(two, _body(s)) for s in systems] == ["a", "b", "c"],
               "the second router to route by the shared index", 10, interval=0.1)
    assert [_backend(one, _body(s)) for s in systems] == ["a", "b", "c"]
    assert [_backend(two, _body(s)) for s in systems] == ["a", "b", "c"]


DOC = "The shared document about harbours and ships. " * 60


def _rag(doc: str, question: str) -> dict[str, Any]:
    return {"model": "m", "messages": [{"role": "system", "content": "Answer briefly."},
                                       {"role": "user", "content": doc + question}]}


def _push_chain(streams: EventStreams, backend: str, body: dict[str, Any], depth: int,
                tokens_per_key: int = 100) -> None:
    """A listener event for ``body``'s seed key carrying its first ``depth`` chain keys."""
    chain = request_chain(body, "m")
    prefix = request_prefix_key(body, "m")
    assert chain is not None and prefix is not None
    entries = [[key, tokens_per_key * (i + 1)] for i, key in enumerate(chain.keys[:depth])]
    with streams.lock:
        queue = streams.queues.setdefault(backend, [])
        data = json.dumps({"prefix_hash": prefix.hex(), "token_count": 10,
                           "chain": {"cache_created": entries}})
        queue.append(f"id: {len(queue) + 1}\nevent: cache_created\ndata: {data}\n\n".encode())


def test_chain_routes_by_longest_match_of_the_document(upstreams, router_factory,
                                                       streams) -> None:
    ups = [upstreams(n) for n in ("a", "b", "c")]
    router = router_factory(_config(ups, streams, match="chain",
                                    approximate={"enabled": False}))
    asked = _rag(DOC, "What is a harbour?")
    chain = request_chain(asked, "m")
    assert chain is not None
    depth = len(chain.keys)
    # Every backend holds the system prompt's key (the seed key is the same for all);
    # only b holds the document, c holds its first part.
    _push_chain(streams, "a", _rag("Another document entirely. " * 90, "?"), 3)
    _push_chain(streams, "b", _rag(DOC, "An earlier question?"), depth - 1)
    _push_chain(streams, "c", _rag(DOC, "An earlier question?"), 2)
    _wait_holders(router, 3)
    assert [_backend(router, _rag(DOC, f"Question {i}?")) for i in range(5)] == ["b"] * 5

    explain = requests.post(router.url + "/admin/routing/explain", json=asked,
                            timeout=5).json()
    rows = {row["backend"]: row for row in explain["kv_scores"]}
    assert explain["kv_match"] == "chain" and explain["chain"]["depth"] == depth
    assert (rows["b"]["matched_depth"], rows["c"]["matched_depth"]) == (depth - 1, 2)
    assert rows["a"]["matched_depth"] == 1  # the system prompt's chunk only
    assert rows["b"]["matched_tokens"] == 100 * (depth - 1)
    assert rows["a"]["score"] == 0.0 and "min_overlap_threshold" in rows["a"]["why"]
    assert explain["decision"]["backend"] == "b"
    assert f"matches {depth - 1} of {depth} chain keys" in explain["decision"]["reason"]


def test_approximate_entries_give_locality_without_events(upstreams, router_factory,
                                                          streams) -> None:
    ups = [upstreams(n) for n in ("a", "b", "c", "d")]
    cfg = _config(ups, streams, match="chain", approximate={"enabled": True})
    cfg["selection_strategy"] = "PrefixAwareHash"
    router = router_factory(cfg)
    docs = [f"Document number {n} about a different topic. " * 60 for n in range(6)]
    first = {n: _backend(router, _rag(doc, "First?")) for n, doc in enumerate(docs)}
    assert len(set(first.values())) > 1  # new documents spread over the fleet
    for n, doc in enumerate(docs):  # later questions follow the recorded chain
        assert {_backend(router, _rag(doc, f"Follow-up {i}?")) for i in range(3)} == {first[n]}
    explain = requests.post(router.url + "/admin/routing/explain",
                            json=_rag(docs[0], "Why?"), timeout=5).json()
    row = {r["backend"]: r for r in explain["kv_scores"]}[first[0]]
    assert row["approximate"] is True and row["matched_depth"] >= 1
    stats = requests.get(router.url + "/admin/kv-index/stats", timeout=5).json()
    assert stats["index"]["chain_approximate_entries"] > 0
