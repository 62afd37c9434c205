"""Two router instances on one host, each under its own real gunicorn master.

gunicorn's control socket (``gunicornc``) defaults to one path per user; each router
instance must have its own, so that neither takes over nor deletes the other's.
"""

from __future__ import annotations

import re
import signal
from pathlib import Path
from typing import Any

import pytest
import requests
from gunicorn.ctl.client import ControlClient

from continuum.devtools.procs import wait_until

pytestmark = pytest.mark.e2e

LISTENING = re.compile(r"Control socket listening at (\S+)")


def _control_socket(router: Any, timeout: float = 20.0) -> str:
    """The control socket path the router's gunicorn master announced in its log."""
    found = wait_until(lambda: LISTENING.findall(router.proc.log_text()),
                       "the control socket announced in the router's log", timeout,
                       children=[router.proc])
    return str(found[-1])


def _listeners(path: str) -> list[str]:
    """The addresses the gunicorn master behind the control socket ``path`` listens on."""
    with ControlClient(path, timeout=5) as client:
        answer = client.send_command("show listeners")
    return [str(listener["address"]) for listener in answer["listeners"]]


def test_two_instances_keep_their_own_control_sockets(
    upstreams: Any, router_factory: Any, tmp_path: Path
) -> None:
    up = upstreams("a")
    config = {"backends": [{"name": up.name, "url": up.url, "models": ["m"]}]}
    # gunicorn's shared default would be $HOME/.gunicorn/gunicorn.ctl: keep it in tmp_path.
    home = tmp_path / "home"
    home.mkdir()
    env = {"HOME": str(home), "XDG_RUNTIME_DIR": ""}
    first, second = router_factory(config, env=env), router_factory(config, env=env)
    paths = [_control_socket(first), _control_socket(second)]
    assert paths[0] != paths[1]
    for router, path in zip((first, second), paths, strict=True):
        assert any(address.endswith(f":{router.port}") for address in _listeners(path)), path

    first.proc.stop(signal.SIGQUIT)
    assert not Path(paths[0]).exists()  # removed by its own master on the way out
    assert any(address.endswith(f":{second.port}") for address in _listeners(paths[1]))
    assert requests.get(second.url + "/health", timeout=5).status_code == 200
