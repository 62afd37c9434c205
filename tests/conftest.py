"""Shared fixtures: free ports, real processes started and stopped by PID."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import requests
import yaml

ROOT = Path(__file__).resolve().parent.parent
PYTHON = sys.executable


@pytest.fixture(autouse=True)
def _no_proxies(monkeypatch: pytest.MonkeyPatch) -> None:
    """Tests talk to 127.0.0.1 only; a proxy from the environment must not interfere."""
    for name in ("HTTP_PROXY", "HTTPS_PROXY", "ALL_PROXY", "http_proxy", "https_proxy",
                 "all_proxy"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("NO_PROXY", "127.0.0.1,localhost")


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on right now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def wait_http(
    url: str,
    timeout: float = 20.0,
    ok: Callable[[requests.Response], bool] | None = None,
    proc: subprocess.Popen[bytes] | None = None,
) -> None:
    """Poll ``url`` until it answers (and ``ok`` holds) or fail loudly after ``timeout``."""
    deadline = time.monotonic() + timeout
    last: Any = None
    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:
            raise RuntimeError(f"process for {url} exited with {proc.returncode}")
        try:
            resp = requests.get(url, timeout=1)
            if ok is None or ok(resp):
                return
            last = resp.status_code
        except requests.RequestException as exc:
            last = exc
        time.sleep(0.05)
    raise RuntimeError(f"{url} not ready after {timeout}s (last: {last})")


class Proc:
    """A child process we started; stopped by its PID only."""

    def __init__(self, argv: list[str], env: dict[str, str] | None = None,
                 log: Path | None = None) -> None:
        self.log = log
        if log is None:
            self.popen = subprocess.Popen(argv, env=env, stdout=subprocess.DEVNULL,
                                          stderr=subprocess.STDOUT, cwd=str(ROOT))
        else:
            with open(log, "wb") as out:  # the child keeps its own descriptor
                self.popen = subprocess.Popen(argv, env=env, stdout=out,
                                              stderr=subprocess.STDOUT, cwd=str(ROOT))
        self.pid = self.popen.pid

    def stop(self, sig: int = 15, timeout: float = 10) -> None:
        if self.popen.poll() is None:
            self.popen.send_signal(sig)
            try:
                self.popen.wait(timeout)
            except subprocess.TimeoutExpired:
                self.popen.kill()
                self.popen.wait(5)

    def output(self) -> str:
        return self.log.read_text(errors="replace") if self.log else ""


class Upstream:
    """A running tests/fake_upstream.py."""

    def __init__(self, name: str, tmp: Path) -> None:
        self.name = name
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.proc = Proc([PYTHON, str(ROOT / "tests" / "fake_upstream.py"), str(self.port), name],
                         log=tmp / f"upstream-{name}.log")
        wait_http(self.url + "/health", proc=self.proc.popen)

    def stats(self) -> dict[str, Any]:
        return requests.get(self.url + "/_test/stats", timeout=5).json()  # type: ignore[no-any-return]


@pytest.fixture
def upstreams(tmp_path: Path) -> Iterator[Callable[[str], Upstream]]:
    """Factory: start fake upstreams by name; all stopped at teardown."""
    started: list[Upstream] = []

    def start(name: str) -> Upstream:
        up = Upstream(name, tmp_path)
        started.append(up)
        return up

    yield start
    for up in started:
        up.proc.stop()


class Router:
    """The router under real gunicorn with gevent workers."""

    def __init__(self, config: dict[str, Any], tmp: Path, workers: int = 1,
                 env: dict[str, str] | None = None) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        config = dict(config)
        # /admin is closed without a token; tests that call it on 127.0.0.1 use the
        # development opt-out unless their config sets admin itself.
        config.setdefault("admin", {"allow_unauthenticated": True})
        config.setdefault("server", {})
        config["server"] = {**config["server"], "bind": f"127.0.0.1:{self.port}",
                            "workers": workers}
        self.config_path = tmp / f"router-{self.port}.yaml"
        self.config_path.write_text(yaml.safe_dump(config))
        metrics_dir = tmp / f"metrics-{self.port}"
        metrics_dir.mkdir()
        full_env = {**os.environ, "CONTINUUM_CONFIG": str(self.config_path),
                    "PROMETHEUS_MULTIPROC_DIR": str(metrics_dir), **(env or {})}
        argv = [PYTHON, "-m", "gunicorn", "-c", "python:continuum.gunicorn_conf",
                "continuum.app:get_app()"]
        self.proc = Proc(argv, env=full_env, log=tmp / f"router-{self.port}.log")
        try:
            wait_http(self.url + "/health", proc=self.proc.popen,
                      ok=lambda r: r.status_code in (200, 503))
        except RuntimeError:
            self.proc.stop()
            raise RuntimeError("router did not start:\n" + self.proc.output()) from None

    def metrics(self) -> str:
        return requests.get(self.url + "/metrics", timeout=5).text


@pytest.fixture
def router_factory(tmp_path: Path) -> Iterator[Callable[..., Router]]:
    """Factory: start routers under gunicorn; all stopped at teardown."""
    started: list[Router] = []

    def start(config: dict[str, Any], **kwargs: Any) -> Router:
        router = Router(config, tmp_path, **kwargs)
        started.append(router)
        return router

    yield start
    for router in started:
        # SIGQUIT is gunicorn's quick shutdown; SIGTERM would wait out idle keep-alive
        # connections of clients the test has not closed yet.
        router.proc.stop(signal.SIGQUIT)


def metric_value(text: str, name: str, **labels: str) -> float:
    """Sum of the samples of ``name`` whose labels include ``labels``."""
    total = 0.0
    for line in text.splitlines():
        if not line.startswith(name + "{") and not line.startswith(name + " "):
            continue
        head, _, value = line.rpartition(" ")
        if all(f'{k}="{v}"' in head for k, v in labels.items()):
            total += float(value)
    return total
