"""Shared fixtures: real servers on free ports, started and stopped by PID.

The plumbing (ports, child processes, waits) is :mod:`continuum.devtools.procs`; the
servers are :mod:`continuum.devtools.servers`. Tests never import this module: they ask
for its fixtures.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from continuum.devtools.procs import PROXY_VARIABLES
from continuum.devtools.servers import FakeUpstream, RouterProcess


@pytest.fixture(autouse=True)
def _no_proxies(monkeypatch: pytest.MonkeyPatch) -> None:
    """Tests talk to 127.0.0.1 only; a proxy from the environment must not interfere."""
    for name in PROXY_VARIABLES:
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("NO_PROXY", "127.0.0.1,localhost")


@pytest.fixture
def upstreams(tmp_path: Path) -> Iterator[Callable[[str], FakeUpstream]]:
    """Factory: start fake upstreams by name; all stopped at teardown."""
    started: list[FakeUpstream] = []

    def start(name: str) -> FakeUpstream:
        up = FakeUpstream(name, tmp_path)
        started.append(up)
        return up

    yield start
    for up in started:
        up.stop()


@pytest.fixture
def router_factory(tmp_path: Path) -> Iterator[Callable[..., RouterProcess]]:
    """Factory: start routers under gunicorn (``router_factory(config, workers=..,
    env=..)``); all stopped at teardown.

    /admin is closed without a token; tests that call it on 127.0.0.1 get the development
    opt-out unless their config sets ``admin`` itself.
    """
    started: list[RouterProcess] = []

    def start(config: dict[str, Any], **kwargs: Any) -> RouterProcess:
        config = {"admin": {"allow_unauthenticated": True}, **config}
        router = RouterProcess(config, tmp_path, **kwargs)
        started.append(router)
        return router

    yield start
    for router in started:
        router.stop()
