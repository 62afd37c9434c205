"""The admin views and the request flow, in-process (Falcon test client, real upstreams).

* ``/admin/prefix-routing/stats`` shows the decisions of whatever strategy reports them
  through ``SelectionStrategy.prefix_routing_stats()``, not of one strategy by name.
* The admin documents keep their exact shape (keys and their order).
* A request retried after a connect failure carries the body built for the backend that
  finally takes it (router-issued ``cache_salt``, Anthropic ``cache_control`` injection).
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from typing import Any, ClassVar

import falcon.testing
import pytest

from continuum.cache_salt import make_salt
from continuum.config import parse_config
from continuum.registry import PluginRegistry
from continuum.web.app import create_app
from strategies.prefix_aware_hash import PrefixAwareHash

TOKEN = {"Authorization": "Bearer tok"}
#: Nothing listens on the discard port: connecting is refused at once.
DEAD = "http://127.0.0.1:9"
SECRET = "flow-salt-secret"


class StickyPrefix(PrefixAwareHash):
    """A third-party strategy built on PrefixAwareHash, registered under its own name."""

    name: ClassVar[str] = "StickyPrefix"


@pytest.fixture
def client_of() -> Iterator[Callable[..., falcon.testing.TestClient]]:
    """Factory: an in-process app for a config; every service stopped at teardown."""
    apps: list[Any] = []

    def make(cfg: dict[str, Any], registry: PluginRegistry | None = None
             ) -> falcon.testing.TestClient:
        registry = registry or PluginRegistry()
        config = parse_config({"health_check": {"enabled": False}, "admin": {"token": "tok"},
                               **cfg}, registry=registry)
        apps.append(create_app(config, registry=registry))
        return falcon.testing.TestClient(apps[-1])

    yield make
    for app in apps:
        app.service.stop()


def _chat(system: str, **extra: Any) -> dict[str, Any]:
    return {"model": "m", "messages": [{"role": "system", "content": system},
                                       {"role": "user", "content": "hi"}], **extra}


def _retries(client: falcon.testing.TestClient, backend: str) -> float:
    """``continuum_upstream_retries_total{backend}`` of the app."""
    value = client.app.service.metrics.registry.get_sample_value(
        "continuum_upstream_retries_total", {"backend": backend})
    return float(value or 0.0)


def _admin(client: falcon.testing.TestClient, view: str) -> dict[str, Any]:
    resp = client.simulate_get(f"/admin/{view}", headers=TOKEN)
    assert resp.status_code == 200, resp.text
    doc: dict[str, Any] = resp.json
    return doc


def test_prefix_routing_stats_come_from_any_strategy_that_reports_them(
        upstreams: Callable[[str], Any], client_of: Callable[..., Any]) -> None:
    a, b = upstreams("a"), upstreams("b")
    registry = PluginRegistry(extra={"continuum.strategies": {"StickyPrefix": StickyPrefix}})
    client = client_of({
        "backends": [{"name": "a", "url": a.url, "models": ["m"]},
                     {"name": "b", "url": b.url, "models": ["m"]}],
        "selection_strategy": "StickyPrefix",
        "prefix_routing": {"enabled": True, "virtual_nodes": 40},
    }, registry)
    for i in range(3):
        resp = client.simulate_post("/v1/chat/completions", json=_chat(f"system {i % 2}"))
        assert resp.status_code == 200, resp.text
    resp = client.simulate_post("/v1/embeddings", json={"model": "m", "input": "x"})
    assert resp.status_code == 200, resp.text

    doc = _admin(client, "prefix-routing/stats")
    assert doc["selection_strategy"] == "StickyPrefix"
    assert doc["routing_decisions"] == {"total": 4, "prefix_hash": 3, "overflow": 0,
                                        "fallback": 1, "overflow_rate": "0.0000"}
    assert doc["unique_prefixes"] == 2
    assert doc["config"]["virtual_nodes"] == 40


def test_admin_documents_keep_their_shape(
        upstreams: Callable[[str], Any], client_of: Callable[..., Any]) -> None:
    a = upstreams("a")
    client = client_of({
        "backends": [{"name": "a", "url": a.url, "models": ["m"]},
                     {"name": "b", "url": DEAD, "models": ["m"], "enabled": False,
                      "slots": 8}],
        "selection_strategy": "PrefixAwareHash",
        "prefix_routing": {"enabled": True},
        # the seed's key: the entry applied below is one, and no routed chain is recorded
        "kv_cache_index": {"enabled": True, "match": "seed", "event_sources": [
            {"backend_name": "a", "endpoint": "http://127.0.0.1:9/events/a"}]},
    })
    service = client.app.service
    explained = client.simulate_post("/admin/routing/explain", json=_chat("held"),
                                     headers=TOKEN).json
    assert service.kv_index is not None
    service.kv_index.apply("a", "cache_created", explained["prefix_hash"], 512)
    assert service.kv_scorer is not None
    service.kv_scorer._snapshots.clear()  # the explain above cached an empty one
    for system in ("held", "not held"):
        resp = client.simulate_post("/v1/chat/completions", json=_chat(system))
        assert resp.status_code == 200, resp.text

    kv = _admin(client, "kv-index/stats")
    assert isinstance(kv.pop("worker_pid"), int)
    assert json.dumps(kv) == json.dumps({
        "enabled": True, "scorer_active": True,
        "config": {"backend": "memory", "max_entries": 100000, "entry_ttl_seconds": 600,
                   "event_sources_count": 1, "match": "seed",
                   "scoring": {"overlap_weight": 0.6, "load_weight": 0.3,
                               "health_weight": 0.1, "min_overlap_threshold": 0.3,
                               "gpu_tier_weight": 1.0, "storage_tier_weight": 0.6,
                               "load_guard": True, "load_guard_mode": "adaptive"}},
        "index": {"prefix_count": 1, "entry_count": 1, "total_hits": 1, "total_evictions": 0,
                  "chain_key_count": 0, "chain_entry_count": 0,
                  "chain_approximate_entries": 0},
        "event_sources": [{"backend_name": "a", "connected": False, "events_received": 0,
                           "events_dropped": 0, "last_event_at": None, "reconnect_count": 0,
                           "consumed_by": "this worker"}],
        "routing_decisions": {"kv_aware": 1, "fallback": 1, "total": 2},
        "query_latency_count": 3, "overlap_score_count": 1,
    })
    sources = _admin(client, "kv-index/backends")
    assert json.dumps(sources["backends"]) == json.dumps([{
        "backend_name": "a",
        "connection": {"connected": False, "reconnect_count": 0, "last_event_at": None},
        "events": {"received": 0, "dropped": 0, "malformed": 0, "index_created": 0,
                   "index_evicted": 0},
        "last_event_id": None, "consumed_by": "this worker"}])
    assert list(sources) == ["enabled", "backends", "worker_pid"]
    prefix = _admin(client, "prefix-routing/stats")
    assert list(prefix) == ["enabled", "selection_strategy", "config", "routing_decisions",
                            "backend_distribution", "unique_prefixes", "worker_pid"]
    assert prefix["routing_decisions"] == {"total": 1, "prefix_hash": 1, "overflow": 0,
                                           "fallback": 0, "overflow_rate": "0.0000"}
    assert prefix["backend_distribution"] == [{"backend": "a", "in_flight_requests": 0}]
    backends = _admin(client, "backends")["backends"]
    assert [list(row) for row in backends] == [[
        "name", "url", "type", "enabled", "internal", "healthy", "in_flight", "state",
        "draining", "latency_ewma_ms", "success_rate", "models", "weight", "slots",
        "slots_source"]] * 2
    assert [(row["name"], row["enabled"], row["models"], row["slots"], row["slots_source"])
            for row in backends] == [("a", True, ["m"], None, None),
                                     ("b", False, ["m"], 8, "configured")]
    strategies = _admin(client, "strategies")
    assert list(strategies) == ["selection_strategy", "available", "loaded", "worker_pid"]
    assert {"group": "continuum.strategies", "name": "PrefixAwareHash"}.items() <= \
        next(p for p in strategies["loaded"] if p["name"] == "PrefixAwareHash").items()

    cleared = client.simulate_post("/admin/kv-index/clear", headers=TOKEN).json
    assert (cleared["success"], cleared["entries_before_clear"], cleared["cleared_entries"]) \
        == (True, 1, 1)


def test_kv_index_clear_counts_chain_entries_before_and_after(
        upstreams: Callable[[str], Any], client_of: Callable[..., Any]) -> None:
    """With ``match: chain`` (the default) the router records each routed chain; the
    clear's ``entries_before_clear`` counts those entries as ``cleared_entries`` does."""
    a = upstreams("a")
    client = client_of({
        "backends": [{"name": "a", "url": a.url, "models": ["m"]}],
        "selection_strategy": "PrefixAwareHash",
        "prefix_routing": {"enabled": True},
        "kv_cache_index": {"enabled": True},
    })
    for system in ("first system prompt " * 80, "second system prompt " * 80):
        resp = client.simulate_post("/v1/chat/completions", json=_chat(system))
        assert resp.status_code == 200, resp.text
    held = _admin(client, "kv-index/stats")["index"]["chain_entry_count"]
    assert held >= 2
    cleared = client.simulate_post("/admin/kv-index/clear", headers=TOKEN).json
    assert (cleared["entries_before_clear"], cleared["cleared_entries"]) == (held, held)
    assert _admin(client, "kv-index/stats")["index"]["chain_entry_count"] == 0


def test_a_retried_request_carries_the_salt_of_the_backend_that_took_it(
        upstreams: Callable[[str], Any], client_of: Callable[..., Any]) -> None:
    a = upstreams("a")
    client = client_of({
        "backends": [{"name": "dead", "url": DEAD, "models": ["m"]},
                     {"name": "a", "url": a.url, "models": ["m"]}],
        "selection_strategy": "RoundRobin",
        "prefix_routing": {"enabled": True},
        "kv_cache_index": {"cache_salt": {"enabled": True, "secret": SECRET},
                           "event_sources": [
                               {"backend_name": b, "endpoint": f"http://127.0.0.1:9/events/{b}"}
                               for b in ("dead", "a")]},
    })
    prefix_hash = client.simulate_post("/admin/routing/explain", json=_chat("salted"),
                                       headers=TOKEN).json["prefix_hash"]
    for _ in range(2):  # round robin: one of the two goes to "dead" first
        resp = client.simulate_post("/v1/chat/completions", json=_chat("salted"))
        assert resp.status_code == 200, resp.text
        assert resp.headers["X-Continuum-Backend"] == "a"
        assert a.stats()["last_body"]["cache_salt"] == \
            make_salt(SECRET.encode(), "a", prefix_hash, None)
    assert _retries(client, "dead") >= 1


@pytest.mark.parametrize(("dead_auto", "live_auto", "injected"), [(True, False, False),
                                                                   (False, True, True)])
def test_a_retried_anthropic_request_follows_the_injection_rule_of_its_backend(
        upstreams: Callable[[str], Any], client_of: Callable[..., Any], dead_auto: bool,
        live_auto: bool, injected: bool) -> None:
    up = upstreams("x")
    client = client_of({
        "backends": [
            {"name": "dead", "url": DEAD, "models": ["m"], "type": "anthropic",
             "anthropic_auto_cache_control": dead_auto},
            {"name": "x", "url": up.url, "models": ["m"], "type": "anthropic",
             "anthropic_auto_cache_control": live_auto}],
        "selection_strategy": "RoundRobin",
    })
    body = {"model": "m", "max_tokens": 8, "system": "be brief",
            "messages": [{"role": "user", "content": "hi"}]}
    for _ in range(2):  # round robin: one of the two goes to "dead" first
        resp = client.simulate_post("/anthropic/v1/messages", json=body)
        assert resp.status_code == 200, resp.text
        system = up.stats()["last_body"]["system"]
        if injected:
            assert system == [{"type": "text", "text": "be brief",
                               "cache_control": {"type": "ephemeral"}}]
        else:
            assert system == "be brief"
    assert _retries(client, "dead") >= 1


def test_clearing_a_disabled_kv_index_is_a_conflict(
        upstreams: Callable[[str], Any], client_of: Callable[..., Any]) -> None:
    a = upstreams("a")
    client = client_of({"backends": [{"name": "a", "url": a.url, "models": ["m"]}]})
    resp = client.simulate_post("/admin/kv-index/clear", headers=TOKEN)
    assert resp.status_code == 409
    error = resp.json["error"]
    assert error["code"] == "kv_index_disabled"
    assert "kv_cache_index.enabled" in error["message"]
    assert error["request_id"] == resp.headers["X-Request-Id"]
