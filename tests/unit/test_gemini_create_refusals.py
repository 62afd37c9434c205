"""Which failed ``cachedContents`` creates are refusals (a negative entry for
``negative_ttl_seconds``: no second create within it) and which are transient (a 10 s
back-off), against the fake Gemini API answering as an endpoint without
``cachedContents`` would (``POST /_sim/cached-contents``), with the manager's clock in the
test's hands and its background calls run inline."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
import requests
from prometheus_client import CollectorRegistry

from continuum.caching.gemini_context import TRANSIENT_BACKOFF_SECONDS, GeminiContextCache
from continuum.config import BackendConfig, parse_config
from continuum.devtools.gemini_fake import FakeGeminiProcess
from continuum.metrics import RouterMetrics
from continuum.routing.backends import Backend
from continuum.routing.gemini_dispatch import GeminiMetrics
from continuum.sim.gemini import build_parser
from tests.unit.test_gemini_context import Clock

MODEL = "gemini-2.5-flash"
PROMPT = "Answer questions about the router from its manual, citing pages. " * 20
NEGATIVE_TTL = 300


@pytest.fixture(scope="module")
def fake(tmp_path_factory: pytest.TempPathFactory) -> Iterator[FakeGeminiProcess]:
    started = FakeGeminiProcess(tmp_path_factory.mktemp("gemini"), min_cache_tokens=100)
    yield started
    started.stop()


def _answer_caches_with(fake: FakeGeminiProcess, status: int | None) -> None:
    fake.reset()
    requests.post(fake.url + "/_sim/cached-contents", json={"status": status},
                  timeout=5).raise_for_status()


def _manager(clock: Clock, fake: FakeGeminiProcess) -> tuple[GeminiContextCache, Backend]:
    config = parse_config({"gemini_context_cache": {
        "enabled": True, "min_prefix_bytes": 1024, "negative_ttl_seconds": NEGATIVE_TTL}})
    backend = Backend(BackendConfig(name="proxy", url=fake.url, type="gemini",
                                    models=(MODEL,)))
    manager = GeminiContextCache(config.gemini_context_cache,
                                 GeminiMetrics(RouterMetrics(CollectorRegistry())),
                                 clock=clock, spawn=lambda fn, *args: fn(*args))
    manager.register_backends([backend])
    return manager, backend


def _creates(fake: FakeGeminiProcess) -> list[dict[str, Any]]:
    return fake.received("/cachedContents", "POST")


@pytest.mark.parametrize("status", [501, 404, 405, 403])
def test_a_create_that_can_never_succeed_is_negative_cached_for_the_negative_ttl(
        fake: FakeGeminiProcess, status: int) -> None:
    """501 Not Implemented, 404 and 405 (an endpoint that mimics the Generative Language API
    without cachedContents) and 403 PERMISSION_DENIED (a key or project that may not create
    caches): one create, then none until ``negative_ttl_seconds`` have passed."""
    _answer_caches_with(fake, status)
    clock = Clock()
    manager, backend = _manager(clock, fake)
    assert manager.reference(backend, MODEL, PROMPT) is None  # a miss: one create, refused
    [create] = _creates(fake)
    assert create["path"] == "/v1beta/cachedContents"
    stats = manager.stats()
    assert stats["negative_entries"] == 1 and stats["entries"] == 0
    assert stats["misses"] == 1 and stats["create_failures"] == 1
    # long past a transient back-off, still within the negative TTL: no second create
    for seconds in (1, TRANSIENT_BACKOFF_SECONDS + 1, NEGATIVE_TTL - 1):
        clock.now = 1_000_000.0 + seconds
        assert manager.reference(backend, MODEL, PROMPT) is None
    assert len(_creates(fake)) == 1
    stats = manager.stats()
    assert stats["negative"] == 3 and stats["negative_entries"] == 1
    assert stats["create_failures"] == 1
    # after it, the prompt is tried once more
    clock.now = 1_000_000.0 + NEGATIVE_TTL + 1
    assert manager.reference(backend, MODEL, PROMPT) is None
    assert len(_creates(fake)) == 2 and manager.stats()["misses"] == 2


@pytest.mark.parametrize("status", [500, 502, 503, 504, 429, 401])
def test_an_outage_backs_off_only_briefly(fake: FakeGeminiProcess, status: int) -> None:
    _answer_caches_with(fake, status)
    clock = Clock()
    manager, backend = _manager(clock, fake)
    manager.reference(backend, MODEL, PROMPT)
    assert manager.stats()["negative_entries"] == 1  # backing off
    clock.now += TRANSIENT_BACKOFF_SECONDS - 1
    manager.reference(backend, MODEL, PROMPT)
    assert len(_creates(fake)) == 1
    clock.now += 2
    manager.reference(backend, MODEL, PROMPT)
    assert len(_creates(fake)) == 2


def test_the_fake_answers_every_cached_contents_call_with_the_status_until_reset(
        fake: FakeGeminiProcess) -> None:
    _answer_caches_with(fake, 501)
    url = fake.url + "/v1beta/cachedContents"
    doc = {"model": "models/" + MODEL, "systemInstruction": {"parts": [{"text": PROMPT}]}}
    created = requests.post(url, json=doc, timeout=5)
    assert created.status_code == 501
    assert created.json()["error"]["status"] == "UNIMPLEMENTED"
    assert requests.get(url, timeout=5).status_code == 501
    assert requests.delete(url + "/abc", timeout=5).status_code == 501
    # generation still works: only cachedContents is missing
    answer = requests.post(fake.url + f"/v1beta/models/{MODEL}:generateContent", timeout=5,
                           json={"contents": [{"role": "user", "parts": [{"text": "Hi"}]}]})
    assert answer.status_code == 200 and answer.json()["candidates"]
    fake.reset()  # back to the startup behaviour
    assert requests.post(url, json=doc, timeout=5).status_code == 200
    # or so from the start, on the command line
    assert build_parser().parse_args(["--cached-contents-status", "501"]) \
        .cached_contents_status == 501
