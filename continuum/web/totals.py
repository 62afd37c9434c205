"""The ``total`` section of an admin view asked with ``?workers=all``: its per-worker
counters summed over every worker (and router) that answered, and its rates recomputed
from the sums.

Each gunicorn worker keeps its own counters, so a plain ``GET`` shows one worker's, and an
operator who wants the router's hit rate would otherwise add the workers' lists up by hand.
What is shared rather than per worker is not summed: the entries of a Redis response cache
(every worker counts the same keys) or of a Gemini context map shared through Redis.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from continuum.interfaces import rate_text

#: ``/admin/response-cache/stats``: always per worker.
RESPONSE_CACHE = ("requests.hit", "requests.miss", "requests.skip", "requests.total",
                  "semantic.requests.hit", "semantic.requests.miss", "semantic.requests.skip",
                  "semantic.requests.total", "semantic.index_entries", "semantic.evictions")
#: ... and the store's own counters when each worker has its own (``memory``).
RESPONSE_CACHE_OWN_STORE = ("entries", "evictions", "size_bytes")
#: ``/admin/prefix-routing/stats``.
PREFIX_ROUTING = ("routing_decisions.total", "routing_decisions.prefix_hash",
                  "routing_decisions.overflow", "routing_decisions.fallback")
#: ``/admin/kv-index/stats``: the scorer's decisions (the index itself may be shared).
KV_INDEX = ("routing_decisions.kv_aware", "routing_decisions.fallback",
            "routing_decisions.total", "query_latency_count", "overlap_score_count")
#: ``/admin/gemini-context-cache/stats``: the counters, and the creations in flight.
GEMINI_CONTEXT = ("hits", "misses", "ineligible", "negative", "creates", "create_failures",
                  "evictions", "cached_tokens", "in_flight")
#: ... and the map's entries when each worker has its own (``shared: false``).
GEMINI_CONTEXT_OWN_MAP = ("entries", "negative_entries")


def _at(doc: Any, path: str) -> Any:
    for key in path.split("."):
        if not isinstance(doc, dict):
            return None
        doc = doc.get(key)
    return doc


def _put(out: dict[str, Any], path: str, value: Any) -> None:
    *parents, leaf = path.split(".")
    for key in parents:
        out = out.setdefault(key, {})
    out[leaf] = value


def summed(views: Sequence[dict[str, Any]], paths: Sequence[str]) -> dict[str, Any]:
    """The sums over ``views`` of the numbers at each dotted path (a path no view has a
    number at is left out)."""
    out: dict[str, Any] = {}
    for path in paths:
        values = [v for v in (_at(view, path) for view in views)
                  if isinstance(v, (int, float)) and not isinstance(v, bool)]
        if values:
            _put(out, path, sum(values))
    return out


def response_cache(views: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """The ``total`` of ``/admin/response-cache/stats``."""
    paths: tuple[str, ...] = RESPONSE_CACHE
    if views and all(view.get("backend_type") == "memory" for view in views):
        paths = (*paths, *RESPONSE_CACHE_OWN_STORE)
    out = summed(views, paths)
    for section in (out, out.get("semantic")):
        if not isinstance(section, dict):
            continue
        requests = section.get("requests")
        if isinstance(requests, dict):
            hits = requests.get("hit", 0)
            section["hit_rate"] = rate_text(hits, hits + requests.get("miss", 0))
    return out


def prefix_routing(views: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """The ``total`` of ``/admin/prefix-routing/stats`` (its decisions: each worker's
    unique prefixes may overlap, so they are not summed)."""
    out = summed(views, PREFIX_ROUTING)
    decisions = out.get("routing_decisions")
    if isinstance(decisions, dict):
        decisions["overflow_rate"] = rate_text(decisions.get("overflow", 0),
                                          decisions.get("total", 0))
    return out


def kv_index(views: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """The ``total`` of ``/admin/kv-index/stats``."""
    return summed(views, KV_INDEX)


def gemini_context(views: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """The ``total`` of ``/admin/gemini-context-cache/stats``."""
    paths: tuple[str, ...] = GEMINI_CONTEXT
    if views and not any(view.get("shared") for view in views):
        paths = (*paths, *GEMINI_CONTEXT_OWN_MAP)
    return summed(views, paths)
