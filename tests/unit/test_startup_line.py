"""The startup line names every configured backend as the router will treat it: a disabled
one (``enabled: false``, which the example config carries) and an internal one (the
semantic cache's embedder) say so, rather than reading like one that takes traffic."""

from __future__ import annotations

from prometheus_client import CollectorRegistry

from continuum.config import parse_config
from continuum.metrics import RouterMetrics
from continuum.registry import PluginRegistry
from continuum.service import RouterService


def test_the_startup_line_marks_disabled_and_internal_backends() -> None:
    config = parse_config({"backends": [
        {"name": "live", "url": "http://127.0.0.1:9", "models": ["m"]},
        {"name": "off", "url": "http://user:pw@127.0.0.1:10", "enabled": False},
        {"name": "emb", "url": "http://127.0.0.1:11", "models": ["e"], "internal": True},
    ]})
    service = RouterService(config, registry=PluginRegistry(),
                            metrics=RouterMetrics(CollectorRegistry()))
    try:
        line = service.summary()
    finally:
        service.stop()
    assert line.startswith(
        "backends: live=http://127.0.0.1:9 (openai; m), "
        "off=http://127.0.0.1:10 (openai; discovered; disabled), "
        "emb=http://127.0.0.1:11 (openai; e; internal); strategy: ")
