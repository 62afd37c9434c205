"""Real servers for end-to-end tests: a scriptable upstream and the router under gunicorn.

Both are child processes on free ports of 127.0.0.1 with their output in a log file,
stopped by their PID (:class:`continuum.devtools.procs.Child`). A plugin's end-to-end test
puts the router with its plugin in front of fake upstreams::

    from continuum.devtools.servers import FakeUpstream, RouterProcess

    up = FakeUpstream("a", tmp_path)
    router = RouterProcess({"backends": [{"name": "a", "url": up.url}],
                            "selection_strategy": "MyStrategy"}, tmp_path)
    try:
        ...  # requests to router.url; up.stats() tells what the upstream saw
    finally:
        router.stop()
        up.stop()

pytest is not needed.
"""

from __future__ import annotations

import json
import os
import signal
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import yaml

from continuum.devtools.procs import Child, free_port, http_get, wait_http, wait_until


class FakeUpstream:
    """A running :mod:`continuum.devtools.fake_upstream` called ``name`` (its answers say
    "hello from <name>"), logging to ``tmp/upstream-<name>.log``."""

    def __init__(self, name: str, tmp: Path, timeout: float = 20.0) -> None:
        self.name = name
        for _ in range(3):
            self.port = free_port()
            self.url = f"http://127.0.0.1:{self.port}"
            self.proc = Child([sys.executable, "-m", "continuum.devtools.fake_upstream",
                               str(self.port), name], tmp / f"upstream-{name}.log")
            try:
                wait_http(self.url + "/health", timeout, children=[self.proc])
                status, body = http_get(self.url + "/health")
            except BaseException:
                self.stop()
                raise
            if status == 200 and json.loads(body).get("pid") == self.proc.popen.pid:
                return
            # Another server (another test's, started in parallel) took the free port
            # before this one bound it, and answered for it: try another port.
            self.stop()
        raise RuntimeError(f"fake upstream {name}: three free ports were taken by other "
                           "servers before it could bind them")

    def stats(self) -> dict[str, Any]:
        """What it saw (``GET /_test/stats``): request count, the last request's headers
        and body, streams started, finished and aborted."""
        status, body = http_get(self.url + "/_test/stats")
        if status != 200:
            raise RuntimeError(f"{self.url}/_test/stats answered {status}")
        doc: dict[str, Any] = json.loads(body)
        return doc

    def stop(self) -> None:
        """SIGTERM, SIGKILL after a timeout."""
        self.proc.stop()


class RouterProcess:
    """The router under real gunicorn with gevent workers, serving ``config``.

    ``server.bind`` (a free port) and ``server.workers`` are set over the config's; the
    config file, the Prometheus multiprocess directory and the log go to ``tmp``.
    ``env`` is added to the process's environment.

    Raises:
        RuntimeError: it did not answer ``/health`` (200 or 503) in time; with its log.
    """

    def __init__(self, config: Mapping[str, Any], tmp: Path, workers: int = 1,
                 env: Mapping[str, str] | None = None, timeout: float = 20.0) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        doc = dict(config)
        doc["server"] = {**doc.get("server", {}), "bind": f"127.0.0.1:{self.port}",
                         "workers": workers}
        self.config_path = tmp / f"router-{self.port}.yaml"
        self.config_path.write_text(yaml.safe_dump(doc))
        metrics_dir = tmp / f"metrics-{self.port}"
        metrics_dir.mkdir()
        full_env = {**os.environ, "CONTINUUM_CONFIG": str(self.config_path),
                    "PROMETHEUS_MULTIPROC_DIR": str(metrics_dir), **(env or {})}
        argv = [sys.executable, "-m", "gunicorn", "-c", "python:continuum.gunicorn_conf",
                "continuum.app:get_app()"]
        # SIGQUIT is gunicorn's quick shutdown; SIGTERM would wait out idle keep-alive
        # connections of clients a test has not closed yet.
        self.proc = Child(argv, tmp / f"router-{self.port}.log", env=full_env,
                          stop_signal=signal.SIGQUIT)
        try:
            wait_http(self.url + "/health", timeout, statuses=(200, 503),
                      children=[self.proc], tail=0)
        except RuntimeError:
            self.stop()
            raise RuntimeError("router did not start:\n" + self.proc.log_text()) from None

    def wait_healthy(self, timeout: float = 30.0) -> None:
        """Wait until ``/admin/backends`` (open to 127.0.0.1 without a token) shows every
        enabled backend healthy. A worker serves once its first health checks answered
        or a second passed; on a busy machine a backend may still be unprobed then, and a
        first request finds no healthy backend (503).

        Raises:
            as :func:`~continuum.devtools.procs.wait_until`: not all healthy within
            ``timeout`` (the last view seen in the message).
        """
        seen: list[Any] = [None]

        def healthy() -> bool:
            status, body = http_get(self.url + "/admin/backends")
            rows = json.loads(body)["backends"] if status == 200 else None
            seen[0] = rows if rows is not None else status
            return rows is not None and all(
                row["state"] in ("healthy", "disabled") for row in rows)

        wait_until(healthy, lambda: f"every backend healthy: {seen[0]}", timeout,
                   children=[self.proc])

    def metrics(self) -> str:
        """``GET /metrics``: the Prometheus exposition."""
        return http_get(self.url + "/metrics")[1].decode()

    def stop(self) -> None:
        """Gunicorn's quick shutdown (SIGQUIT), SIGKILL after a timeout."""
        self.proc.stop()
