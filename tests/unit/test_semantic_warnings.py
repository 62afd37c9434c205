"""What the router logs when the semantic cache's embeddings fail: the status and the
error's type and code (never the backend's message, which could quote the text), a hint of
what to check, and at most one warning a minute."""

from __future__ import annotations

import json
import logging
from typing import Any

import pytest

from continuum.caching import semantic
from continuum.caching.semantic import EmbeddingError, SemanticCache, _status_detail


def test_a_404_names_the_model_and_the_key_to_check() -> None:
    body = json.dumps({"object": "error", "message": "The model `bge` does not exist.",
                       "type": "NotFoundError", "param": None, "code": 404}).encode()
    detail = _status_detail(404, "bge", body)  # vLLM's error shape
    assert detail.startswith("HTTP 404 (type NotFoundError, code 404); does the backend "
                             "serve the model 'bge' (response_cache.semantic.embedding_model)")
    assert "does not exist" not in detail  # the backend's own message is not logged


def test_other_statuses_and_bodies() -> None:
    assert _status_detail(401, "m", b"not json") == \
        "HTTP 401; check the backend's api_key_env"
    assert _status_detail(500, "m", json.dumps(
        {"error": {"type": "x" * 65, "code": "overloaded"}}).encode()) == \
        "HTTP 500 (code overloaded)"  # an overlong field is left out
    assert _status_detail(503, "m", b"[1, 2]") == "HTTP 503"


class _Cache:
    """The part of SemanticCache its warnings use."""

    def __init__(self) -> None:
        self._warn_after = 0.0
        self._unwarned = 0
        self.backend = type("B", (), {"name": "emb"})()
        self.client = type("C", (), {"model": "bge"})()


def test_one_warning_a_minute_counting_the_failures_between(
        monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    clock = [1000.0]
    monkeypatch.setattr(semantic.time, "monotonic", lambda: clock[0])
    cache: Any = _Cache()
    caplog.set_level(logging.WARNING, logger=semantic.__name__)
    for _ in range(3):
        SemanticCache._warn(cache, EmbeddingError("connect", "cannot connect: refused"))
    clock[0] += semantic.EMBEDDING_WARNING_SECONDS
    SemanticCache._warn(cache, EmbeddingError("timeout", "no answer within 200 ms"))
    lines = [r.getMessage() for r in caplog.records]
    assert lines == [
        "semantic cache: embedding by backend emb (model bge) failed: cannot connect: "
        "refused; the request went on as a plain miss",
        "semantic cache: embedding by backend emb (model bge) failed: no answer within "
        "200 ms; the request went on as a plain miss (3 failures since the last warning)",
    ]
