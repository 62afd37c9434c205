"""Scorers are plugins: loaded from ``continuum.scorers`` by the names in ``scorers``."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace
from typing import Any, ClassVar

import pytest
from prometheus_client import CollectorRegistry

from continuum.config import check_config, defaults_text, parse_config
from continuum.interfaces import BackendScorer
from continuum.kv.chain_scorer import ChainOverlapScorer
from continuum.kv.scorer import KvOverlapScorer
from continuum.metrics import RouterMetrics
from continuum.registry import PluginRegistry
from continuum.request import CHAT, RequestContext
from continuum.routing.backends import Backend
from continuum.service import RouterService
from continuum.testing import make_context

BACKENDS = [{"name": n, "url": "http://127.0.0.1:9", "models": ["m"]} for n in "abc"]


class PreferC(BackendScorer):
    """Scores backend ``c`` 1.0, the others 0; records what the router gave it."""

    name: ClassVar[str] = "PreferC"
    built: ClassVar[list[dict[str, Any]]] = []

    def __init__(self) -> None:
        self.events: list[str] = []

    @classmethod
    def from_config(cls, config: Any, **collaborators: Any) -> PreferC:
        cls.built.append(collaborators)
        return cls()

    def prepare(self, ctx: RequestContext, candidates: Sequence[Backend]) -> None:
        """Nothing to fetch."""

    def score(self, backend: Backend, ctx: RequestContext) -> float:
        return 1.0 if backend.name == "c" else 0.0

    def start(self) -> None:
        self.events.append("start")

    def close(self) -> None:
        self.events.append("close")


def registry() -> PluginRegistry:
    return PluginRegistry({"continuum.scorers": {"PreferC": PreferC}})


def service(registry: PluginRegistry | None = None, **config: Any) -> RouterService:
    registry = registry or PluginRegistry()
    data = {"backends": BACKENDS, "health_check": {"enabled": False}, **config}
    return RouterService(parse_config(data, registry=registry), registry=registry,
                         metrics=RouterMetrics(CollectorRegistry()))


def picks(svc: RouterService, n: int = 6) -> list[str]:
    candidates = list(svc.pool)
    return [svc.pipeline.select(candidates, make_context(prefix=b"p")).name for _ in range(n)]


def test_kv_overlap_is_registered_as_the_built_in_scorer() -> None:
    info = PluginRegistry().info("continuum.scorers", "KvOverlap")
    assert info.obj is ChainOverlapScorer
    assert info.distribution == "continuum-router"
    assert info.value == "continuum.kv.chain_scorer:ChainOverlapScorer"


@pytest.mark.parametrize(("match", "kind"), [("chain", ChainOverlapScorer),
                                             ("seed", KvOverlapScorer)])
def test_kv_overlap_matches_chains_or_the_seed_key_as_kv_cache_index_match_says(
    match: str, kind: type[KvOverlapScorer]
) -> None:
    svc = service(prefix_routing={"enabled": True},
                  kv_cache_index={"enabled": True, "match": match})
    assert [type(s) for s in svc.pipeline.scorers] == [kind]
    ctx = svc.admit(b'{"model": "m", "messages": [{"role": "system", "content": "s"}, '
                    b'{"role": "user", "content": "q"}]}', CHAT, "r1")
    assert ctx.prefix_key is not None
    assert (ctx.chain is not None) is (match == "chain")
    assert svc.explain(ctx)["kv_match"] == match


@pytest.mark.parametrize(("prefix", "kv", "active"), [
    (True, True, True), (True, False, False), (False, True, False), (False, False, False)])
def test_by_default_the_kv_scorer_runs_iff_prefix_routing_and_the_index_are_on(
    prefix: bool, kv: bool, active: bool
) -> None:
    svc = service(prefix_routing={"enabled": prefix}, kv_cache_index={"enabled": kv})
    assert svc.config.scorers == ("KvOverlap",)
    assert [type(s) for s in svc.pipeline.scorers] == ([ChainOverlapScorer] if active else [])
    assert (svc.kv_scorer is not None) is active
    if active:
        assert svc.kv_scorer is svc.pipeline.scorers[0]
        assert svc.kv_scorer.index is svc.kv_index


def test_an_empty_list_turns_the_kv_scorer_off_and_keeps_the_index() -> None:
    svc = service(scorers=[], prefix_routing={"enabled": True},
                  kv_cache_index={"enabled": True})
    assert svc.pipeline.scorers == ()
    assert svc.kv_scorer is None
    assert svc.kv_index is not None


def test_a_registered_scorer_is_built_by_name_and_changes_routing() -> None:
    plain = service(registry(), scorers=[], prefix_routing={"enabled": True})
    assert picks(plain) == ["a", "b", "c", "a", "b", "c"]  # RoundRobin decides

    PreferC.built.clear()
    svc = service(registry(), scorers=["PreferC"], prefix_routing={"enabled": True})
    [scorer] = svc.pipeline.scorers
    assert isinstance(scorer, PreferC)
    assert picks(svc) == ["c"] * 6
    [collaborators] = PreferC.built
    assert collaborators == {"metrics": svc.metrics, "resources": svc.resources,
                             "index": None}
    assert [p.name for p in svc.registry.loaded() if p.group == "continuum.scorers"] == [
        "PreferC"]


def test_scorers_run_in_the_listed_order_next_to_the_kv_scorer() -> None:
    svc = service(registry(), scorers=["PreferC", "KvOverlap"],
                  prefix_routing={"enabled": True}, kv_cache_index={"enabled": True})
    assert [type(s) for s in svc.pipeline.scorers] == [PreferC, ChainOverlapScorer]
    assert svc.kv_scorer is svc.pipeline.scorers[1]


def test_no_scorer_is_built_without_prefix_routing() -> None:
    PreferC.built.clear()
    svc = service(registry(), scorers=["PreferC"])
    assert svc.pipeline.scorers == ()
    assert PreferC.built == []


def test_scorers_start_and_close_with_the_worker() -> None:
    svc = service(registry(), scorers=["PreferC"], prefix_routing={"enabled": True})
    [scorer] = svc.pipeline.scorers
    assert isinstance(scorer, PreferC)
    svc.start()
    svc.stop()
    assert scorer.events == ["start", "close"]


def test_an_unknown_scorer_is_a_config_error_at_its_key_path() -> None:
    result = check_config({"scorers": ["KvOverlap", "KvOverlapp"]}, registry=PluginRegistry())
    assert result.config is None
    [issue] = result.errors
    assert issue.path == "scorers[1]"
    assert "unknown plugin 'KvOverlapp' in continuum.scorers" in issue.message
    assert "available: KvOverlap" in issue.message
    assert "did you mean 'KvOverlap'?" in issue.message


@pytest.mark.parametrize("enabled", [True, False])
@pytest.mark.parametrize(("tier", "group"), [("response_cache", "continuum.cache_stores"),
                                             ("kv_cache_index", "continuum.kv_indexes")])
def test_an_unknown_store_is_a_config_error_whether_or_not_its_tier_is_on(
        tier: str, group: str, enabled: bool) -> None:
    result = check_config({tier: {"enabled": enabled, "backend": "reddis"}},
                          registry=PluginRegistry())
    assert [issue.path for issue in result.errors] == [f"{tier}.backend"]
    assert f"unknown plugin 'reddis' in {group}" in result.errors[0].message
    assert "did you mean 'redis'?" in result.errors[0].message


def test_a_scorer_listed_twice_is_a_config_error() -> None:
    result = check_config({"scorers": ["KvOverlap", "KvOverlap"]})
    assert [(i.path, i.message) for i in result.errors] == [
        ("scorers[1]", "listed twice (also scorers[0])")]


def test_a_scorer_list_of_ones_own_without_prefix_keys_is_warned() -> None:
    def warned(data: dict[str, Any]) -> bool:
        return any(w.path == "scorers" for w in check_config(data).warnings)

    assert warned({"scorers": ["PreferC"]})
    assert not warned({"scorers": ["PreferC"], "prefix_routing": {"enabled": True}})
    assert not warned({})  # the default list is harmless without prefix keys
    assert not warned({"scorers": []})


def test_config_defaults_lists_the_default_scorers() -> None:
    text = defaults_text()
    assert '\nscorers: ["KvOverlap"]\n' in text


def test_changing_scorers_needs_a_restart() -> None:
    svc = service(prefix_routing={"enabled": True}, kv_cache_index={"enabled": True})
    report = svc.reload(replace(svc.config, scorers=()))
    assert report.restart_required == ["scorers"]
    assert svc.config.scorers == ("KvOverlap",)
    assert isinstance(svc.pipeline.scorers[0], KvOverlapScorer)
