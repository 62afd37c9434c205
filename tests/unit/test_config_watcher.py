"""The config watcher of a worker: a change made while the worker boots (between reading
the config it starts with and starting its watcher) is still reloaded."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from continuum.config import load_config
from continuum.metrics import RouterMetrics
from continuum.registry import PluginRegistry
from continuum.service import RouterService
from continuum.web.reload import ConfigReloader, config_state


def _write(path: Path, *names: str) -> None:
    path.write_text(yaml.safe_dump({
        "backends": [{"name": n, "url": f"http://127.0.0.1:{9 + i}", "models": ["m"]}
                     for i, n in enumerate(names)],
        "health_check": {"enabled": False}}))


def test_a_change_while_the_worker_boots_is_reloaded(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("CONTINUUM_RUNTIME_DIR", raising=False)
    path = tmp_path / "router.yaml"
    _write(path, "a")
    seen = config_state(path)
    registry = PluginRegistry()
    service = RouterService(load_config(path, registry), registry=registry,
                            metrics=RouterMetrics())
    try:
        _write(path, "a", "b")  # the change lands while this worker is still booting
        reloader = ConfigReloader(service, path, seen)
        report = reloader.check()
        assert report is not None and report.applied == ["backends.b"]
        assert [b.name for b in service.pool] == ["a", "b"]
        assert reloader.check() is None  # and only once
    finally:
        service.stop()
