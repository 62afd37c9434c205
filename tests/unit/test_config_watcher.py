"""The config watcher of a worker: a change made while the worker boots (between reading
the config it starts with and starting its watcher) is still reloaded."""

from __future__ import annotations

import threading
import time
from pathlib import Path
from typing import Any

import pytest
import yaml

from continuum.config import load_config
from continuum.errors import ConfigError
from continuum.metrics import RouterMetrics
from continuum.registry import PluginRegistry
from continuum.service import RouterService
from continuum.web.reload import ConfigReloader, config_state


def _write(path: Path, *names: str) -> None:
    path.write_text(yaml.safe_dump({
        "backends": [{"name": n, "url": f"http://127.0.0.1:{9 + i}", "models": ["m"]}
                     for i, n in enumerate(names)],
        "health_check": {"enabled": False}}))


def _booted(path: Path) -> RouterService:
    """A worker's service, booted from the config file at ``path``."""
    registry = PluginRegistry()
    return RouterService(load_config(path, registry), registry=registry,
                         metrics=RouterMetrics())


def test_a_change_while_the_worker_boots_is_reloaded(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("CONTINUUM_RUNTIME_DIR", raising=False)
    path = tmp_path / "router.yaml"
    _write(path, "a")
    seen = config_state(path)
    service = _booted(path)
    try:
        _write(path, "a", "b")  # the change lands while this worker is still booting
        reloader = ConfigReloader(service, path, seen)
        report = reloader.check()
        assert report is not None and report.applied == ["backends.b"]
        assert [b.name for b in service.pool] == ["a", "b"]
        assert reloader.check() is None  # and only once
    finally:
        service.stop()


def test_reloads_in_one_worker_run_one_at_a_time_and_a_change_during_one_is_seen(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The admin endpoint, the watcher and a fleet action may each reload at once; a reload
    waits inside (the KV consumers' restart), so they take turns. A file changed while a
    reload runs is still a change for the watcher afterwards."""
    monkeypatch.delenv("CONTINUUM_RUNTIME_DIR", raising=False)
    path = tmp_path / "router.yaml"
    _write(path, "a")
    service = _booted(path)
    reloader = ConfigReloader(service, path)
    inside = []
    overlaps = []
    apply = service.reload

    def slow_reload(config: Any) -> Any:
        inside.append(1)
        overlaps.append(len(inside))
        time.sleep(0.2)  # as a consumer restart waits
        inside.pop()
        return apply(config)

    monkeypatch.setattr(service, "reload", slow_reload)
    try:
        _write(path, "a", "b")
        threads = [threading.Thread(target=reloader.reload), threading.Thread(
            target=reloader.check)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(10)
        assert max(overlaps) == 1, overlaps
        assert [b.name for b in service.pool] == ["a", "b"]
        assert reloader.check() is None  # both read the same file: nothing left

        def change_meanwhile(config: Any) -> Any:
            _write(path, "a", "b", "c")  # lands after the file was read
            return apply(config)

        monkeypatch.setattr(service, "reload", change_meanwhile)
        _write(path, "a", "b", "d")
        reloader.reload()
        monkeypatch.setattr(service, "reload", apply)
        report = reloader.check()
        assert report is not None and [b.name for b in service.pool] == ["a", "b", "c"]
    finally:
        service.stop()


@pytest.mark.parametrize("content", ["", "# truncated\n", "server:\n  workers: 2\n"])
def test_a_file_without_backends_never_empties_a_running_router(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, content: str) -> None:
    """An emptied or half-written file (``> router.yaml``, an editor mid-save) read by the
    admin endpoint or the watcher is refused: the router keeps its backends."""
    monkeypatch.delenv("CONTINUUM_RUNTIME_DIR", raising=False)
    path = tmp_path / "router.yaml"
    _write(path, "a", "b")
    service = _booted(path)
    reloader = ConfigReloader(service, path)
    try:
        path.write_text(content)
        with pytest.raises(ConfigError) as refused:
            reloader.reload()
        (issue,) = refused.value.issues
        assert issue.path == "backends"
        assert "runs 2 (a, b)" in issue.message and "running config stays" in issue.message
        assert reloader.check() is None  # the watcher logs it and keeps the config too
        assert [b.name for b in service.pool] == ["a", "b"]
        _write(path, "b")  # dropping some backends is a reload like any other
        report = reloader.check()
        assert report is not None and [b.name for b in service.pool] == ["b"]
    finally:
        service.stop()


def test_a_router_started_without_backends_may_reload_to_none(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("CONTINUUM_RUNTIME_DIR", raising=False)
    path = tmp_path / "router.yaml"
    path.write_text("health_check: {enabled: false}\n")
    service = _booted(path)
    try:
        path.write_text("health_check: {enabled: false}\nserver: {workers: 2}\n")
        assert ConfigReloader(service, path, ((0, 0), None)).reload() is not None
        assert list(service.pool) == []
    finally:
        service.stop()


def test_a_reload_collects_the_garbage_cycles_among_frozen_objects(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A serving worker has frozen its startup objects (the old config's among them); the
    reload that replaces them collects what they left in reference cycles, and freezes
    again what is still alive."""
    import gc
    import weakref

    monkeypatch.delenv("CONTINUUM_RUNTIME_DIR", raising=False)
    path = tmp_path / "router.yaml"
    _write(path, "a")
    service = _booted(path)
    reloader = ConfigReloader(service, path)

    class Node:
        peer: Any = None

    cycle = Node()
    cycle.peer = Node()
    cycle.peer.peer = cycle
    gone = weakref.ref(cycle)
    gc.freeze()
    try:
        del cycle
        gc.collect()
        assert gone() is not None  # frozen: no collection sees it
        _write(path, "a", "b")
        assert reloader.reload().applied == ["backends.b"]
        assert gone() is None
        assert gc.get_freeze_count() > 0  # the living are frozen again
    finally:
        gc.unfreeze()
        service.stop()
