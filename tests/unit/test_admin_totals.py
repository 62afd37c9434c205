"""The ``total`` section of ``?workers=all`` admin answers (``continuum.web.totals``)."""

from __future__ import annotations

from typing import Any

from continuum.web import totals


def _cache_view(backend: str, hit: int, miss: int, entries: int,
                semantic: dict[str, Any] | None = None) -> dict[str, Any]:
    return {"enabled": True, "backend_type": backend, "entries": entries, "capacity": 1000,
            "requests": {"hit": hit, "miss": miss, "skip": 1, "total": hit + miss + 1},
            "hit_rate": "ignored", "evictions": 2, "size_bytes": 100,
            "semantic": semantic or {"enabled": False}, "worker_pid": 1}


def test_response_cache_sums_lookups_and_recomputes_the_hit_rates() -> None:
    semantic = {"enabled": True, "index_entries": 5, "evictions": 0,
                "requests": {"hit": 1, "miss": 3, "skip": 0, "total": 4}}
    views = [_cache_view("memory", 3, 1, 4, semantic), _cache_view("memory", 0, 4, 4, semantic)]
    total = totals.response_cache(views)
    assert total["requests"] == {"hit": 3, "miss": 5, "skip": 2, "total": 10}
    assert total["hit_rate"] == "0.3750"
    # each worker's own memory store: its entries, evictions and bytes add up
    assert (total["entries"], total["evictions"], total["size_bytes"]) == (8, 4, 200)
    assert total["semantic"] == {"index_entries": 10, "evictions": 0, "hit_rate": "0.2500",
                                 "requests": {"hit": 2, "miss": 6, "skip": 0, "total": 8}}
    assert "capacity" not in total  # a setting, not a counter


def test_a_shared_store_is_not_counted_once_per_worker() -> None:
    total = totals.response_cache([_cache_view("redis", 1, 1, 7), _cache_view("redis", 1, 0, 7)])
    assert "entries" not in total and "evictions" not in total
    assert total["requests"]["hit"] == 2 and total["hit_rate"] == "0.6667"
    assert "semantic" not in total  # off: nothing to sum


def test_prefix_routing_sums_decisions_and_their_overflow_rate() -> None:
    views = [{"routing_decisions": {"total": 10, "prefix_hash": 8, "overflow": 1,
                                    "fallback": 1, "overflow_rate": "0.1000"},
              "unique_prefixes": 4},
             {"routing_decisions": {"total": 30, "prefix_hash": 21, "overflow": 9,
                                    "fallback": 0, "overflow_rate": "0.3000"},
              "unique_prefixes": 4}]
    assert totals.prefix_routing(views) == {"routing_decisions": {
        "total": 40, "prefix_hash": 29, "overflow": 10, "fallback": 1,
        "overflow_rate": "0.2500"}}


def test_kv_index_and_gemini_counters() -> None:
    kv = [{"routing_decisions": {"kv_aware": 3, "fallback": 1, "total": 4},
           "query_latency_count": 4, "overlap_score_count": 9, "index": {"entry_count": 50}}] * 2
    assert totals.kv_index(kv) == {
        "routing_decisions": {"kv_aware": 6, "fallback": 2, "total": 8},
        "query_latency_count": 8, "overlap_score_count": 18}
    own = {"enabled": True, "shared": False, "entries": 2, "negative_entries": 1, "hits": 5,
           "misses": 1, "cached_tokens": 900, "in_flight": 0, "creates": 1}
    assert totals.gemini_context([own, own]) == {
        "entries": 4, "negative_entries": 2, "hits": 10, "misses": 2, "cached_tokens": 1800,
        "in_flight": 0, "creates": 2}
    shared = {**own, "shared": True}
    assert "entries" not in totals.gemini_context([shared, shared])
    # a view that is off has nothing to sum
    assert totals.gemini_context([{"enabled": False}]) == {}
