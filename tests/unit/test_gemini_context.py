"""The context-cache manager's map on its own: the shared cap, expired refusals pruned before
any eviction, LRU eviction with a DELETE, invalidation; against the fake Gemini API (real
HTTP), with the manager's clock in the test's hands and its background calls run inline."""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from prometheus_client import CollectorRegistry

from continuum.caching.gemini_context import GeminiContextCache, entry_key, parse_expire_time
from continuum.config import BackendConfig, parse_config
from continuum.devtools.gemini_fake import FakeGeminiProcess
from continuum.metrics import RouterMetrics
from continuum.registry import PluginRegistry
from continuum.routing.backends import Backend
from continuum.routing.gemini_dispatch import GeminiMetrics
from continuum.service import RouterService

MODEL = "gemini-2.5-flash"
BASE = "Answer questions about the router from its manual, citing pages. " * 20


class Clock:
    def __init__(self) -> None:
        self.now = 1_000_000.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture(scope="module")
def fakes(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, FakeGeminiProcess]]:
    tmp = tmp_path_factory.mktemp("gemini")
    started = {"ok": FakeGeminiProcess(tmp, min_cache_tokens=100),
               "refuser": FakeGeminiProcess(tmp, min_cache_tokens=10**7)}
    yield started
    for fake in started.values():
        fake.stop()


def _inline(fn: Any, *args: Any) -> None:
    fn(*args)


def _manager(clock: Clock, backends: list[Backend], **settings: Any) -> GeminiContextCache:
    config = parse_config({"gemini_context_cache": {
        "enabled": True, "min_prefix_bytes": 1024, "max_entries": 10, **settings}})
    metrics = GeminiMetrics(RouterMetrics(CollectorRegistry()))
    manager = GeminiContextCache(config.gemini_context_cache, metrics, clock=clock,
                                 spawn=_inline)
    manager.register_backends(backends)
    return manager


def _backend(name: str, fake: FakeGeminiProcess) -> Backend:
    return Backend(BackendConfig(name=name, url=fake.url, type="gemini", models=(MODEL,)))


def test_expired_refusals_are_pruned_before_any_eviction(
        fakes: dict[str, FakeGeminiProcess]) -> None:
    for fake in fakes.values():
        fake.reset()
    clock = Clock()
    ok, refuser = _backend("ok", fakes["ok"]), _backend("refuser", fakes["refuser"])
    manager = _manager(clock, [ok, refuser], negative_ttl_seconds=60)
    for i in range(9):
        assert manager.reference(refuser, MODEL, f"{i} {BASE}") is None
    manager.reference(ok, MODEL, "kept " + BASE)
    assert manager.stats()["negative_entries"] == 9 and manager.stats()["entries"] == 1
    # within the negative TTL a refused prompt is not tried again
    assert manager.reference(refuser, MODEL, f"0 {BASE}") is None
    assert fakes["refuser"].stats()["refused"] == 9
    clock.now += 61
    manager.reference(ok, MODEL, "new " + BASE)  # 11 entries: the expired refusals go
    stats = manager.stats()
    assert stats["evictions"] == 0 and stats["entries"] == 2 and stats["negative_entries"] == 0
    assert fakes["ok"].stats()["deleted"] == 0

    for i in range(8):
        manager.reference(ok, MODEL, f"more {i} {BASE}")
    assert manager.stats()["entries"] == 10 and fakes["ok"].stats()["deleted"] == 0
    assert manager.reference(ok, MODEL, "kept " + BASE) is not None  # now most recent
    manager.reference(ok, MODEL, "eleventh " + BASE)
    assert manager.stats()["evictions"] == 1 and manager.stats()["entries"] == 10
    deleted = fakes["ok"].received("/cachedContents/", "DELETE")
    created = fakes["ok"].received("/cachedContents", "POST")
    assert len(deleted) == 1
    # the least recently used was "new", not the "kept" one that was just hit
    assert created[1]["body"]["systemInstruction"]["parts"][0]["text"].startswith("new")
    assert manager.reference(ok, MODEL, "kept " + BASE) is not None


def test_invalidate_drops_the_entry_and_recreates(fakes: dict[str, FakeGeminiProcess]) -> None:
    fakes["ok"].reset()
    clock = Clock()
    ok = _backend("ok", fakes["ok"])
    manager = _manager(clock, [ok])
    manager.reference(ok, MODEL, BASE)
    name = manager.reference(ok, MODEL, BASE)
    assert name is not None
    manager.invalidate(ok, MODEL, BASE, name)
    replacement = manager.reference(ok, MODEL, BASE)
    assert replacement is not None and replacement != name
    assert fakes["ok"].stats()["created"] == 2
    assert entry_key("ok", MODEL, BASE) != entry_key("other", MODEL, BASE)
    assert entry_key("ok", MODEL, BASE) != entry_key("ok", "gemini-2.5-pro", BASE)
    # clear DELETEs what the map names; the invalidated one is not in it any more
    assert manager.clear() == 1 and fakes["ok"].stats()["deleted"] == 1


def test_short_prompts_are_ineligible(fakes: dict[str, FakeGeminiProcess]) -> None:
    fakes["ok"].reset()
    ok = _backend("ok", fakes["ok"])
    manager = _manager(Clock(), [ok])
    assert manager.reference(ok, MODEL, "x" * 1023) is None
    assert manager.reference(ok, MODEL, None) is None
    assert manager.stats()["ineligible"] == 2 and fakes["ok"].received() == []


def test_disabled_builds_nothing(tmp_path: Path) -> None:
    gemini = {"name": "g", "url": "http://127.0.0.1:9", "type": "gemini", "models": [MODEL]}
    off = RouterService(parse_config({"backends": [gemini]}), registry=PluginRegistry(),
                        metrics=RouterMetrics(CollectorRegistry()))
    assert off.gemini is not None and off.gemini_context is None
    assert off.gemini_context_stats() == {"enabled": False}
    assert off.clear_gemini_context() is None
    plain = {"name": "o", "url": "http://127.0.0.1:9", "models": ["m"]}
    none = RouterService(parse_config({"backends": [plain], "gemini_context_cache": {
        "enabled": True}}), registry=PluginRegistry(), metrics=RouterMetrics(CollectorRegistry()))
    assert none.gemini is None and none.gemini_context is None
    # the startup line names the manager's state only where there are gemini backends
    assert "gemini_context_cache=off" in off.summary()
    assert "gemini_context_cache" not in none.summary()
    on = RouterService(parse_config({"backends": [gemini], "gemini_context_cache": {
        "enabled": True}}), registry=PluginRegistry(), metrics=RouterMetrics(CollectorRegistry()))
    assert "gemini_context_cache=per-worker" in on.summary()


@pytest.mark.parametrize(("text", "epoch"), [
    ("1970-01-01T00:00:01Z", 1.0),
    ("1970-01-01T00:00:01.5Z", 1.5),
    ("1970-01-01T00:00:01.123456789Z", 1.123456789),
    ("1970-01-01T00:00:01.25z", 1.25),
    ("1970-01-01t00:00:01Z", 1.0),
    ("1970-01-01T02:00:01.5+02:00", 1.5),
    ("1969-12-31T19:00:01.000001-05:00", 1.000001),
])
def test_expire_time_keeps_its_offset_in_any_local_time_zone(
        text: str, epoch: float, monkeypatch: pytest.MonkeyPatch) -> None:
    """Google's expireTime in every form RFC 3339 allows. A fraction once made the parser
    drop the offset (the time was then read as local time) and, on Python 3.10, fail."""
    for zone in ("UTC", "America/New_York", "Asia/Kolkata"):
        with monkeypatch.context() as env:
            env.setenv("TZ", zone)
            time.tzset()
            try:
                assert parse_expire_time(text) == pytest.approx(epoch, abs=1e-9), zone
            finally:
                env.undo()
                time.tzset()


@pytest.mark.parametrize("text", [None, 5, "", "2026-12-06", "2026-12-06T01:50:00",
                                  "2026-12-06T01:50:00.Z", "2026-13-06T01:50:00Z",
                                  "2026-12-06T01:50:00.1234567890Z", " 2026-12-06T01:50:00Z"])
def test_anything_else_is_no_expire_time(text: object) -> None:
    assert parse_expire_time(text) is None
