"""Plain ``gunicorn -k gevent 'continuum.app:get_app()'``, without the router's gunicorn
settings: it serves, and every worker says in its log what is lost (nothing shared between
the workers, no header deadline, server.bind and workers unread) and how to get it back."""

from __future__ import annotations

import os
import signal
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml

from continuum.devtools.procs import Child, free_port, wait_http, wait_until
from continuum.web.app import WITHOUT_GUNICORN_CONF

pytestmark = pytest.mark.e2e


def test_plain_gunicorn_serves_and_says_what_it_lacks(upstreams: Any, router_factory: Any,
                                                       tmp_path: Path) -> None:
    up = upstreams("a")
    config = {"backends": [{"name": up.name, "url": up.url, "models": ["m"]}],
              "admin": {"allow_unauthenticated": True}}
    path = tmp_path / "router.yaml"
    path.write_text(yaml.safe_dump(config))
    port = free_port()
    env = {k: v for k, v in os.environ.items()
           if k not in ("CONTINUUM_RUNTIME_DIR", "PROMETHEUS_MULTIPROC_DIR")}
    env["CONTINUUM_CONFIG"] = str(path)
    plain = Child([sys.executable, "-m", "gunicorn", "-k", "gevent", "-w", "2", "-b",
                   f"127.0.0.1:{port}", "continuum.app:get_app()"], tmp_path / "plain.log",
                  env=env, stop_signal=signal.SIGQUIT)
    try:
        wait_http(f"http://127.0.0.1:{port}/health", 20, children=[plain])
        # once per worker (the second may still be booting when the first answers)
        wait_until(lambda: plain.log_text().count(WITHOUT_GUNICORN_CONF) == 2,
                   "both workers' warnings", 20, children=[plain])
        assert "-c python:continuum.gunicorn_conf" in WITHOUT_GUNICORN_CONF
    finally:
        plain.stop()
    served = router_factory(config)  # continuum.gunicorn_conf, as serve runs it
    assert WITHOUT_GUNICORN_CONF not in served.proc.log_text()
