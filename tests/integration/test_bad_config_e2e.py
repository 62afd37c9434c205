"""A config file with an error never takes a running router down (real gunicorn): a HUP
(``systemctl reload``) is refused with the error in the log while the workers keep
serving, and a worker gunicorn starts in place of one that died boots with the last config
the router loaded. Before, both made gunicorn's master shut the router down ("Worker failed
to boot")."""

from __future__ import annotations

import os
import signal
from pathlib import Path
from typing import Any

import pytest
import requests

from continuum.devtools.procs import wait_until
from continuum.registry import NameRegistry
from continuum.web import reload as reload_mod

pytestmark = pytest.mark.e2e


def _workers(master: int) -> set[int]:
    """The master's children (the gunicorn workers of the router this test started)."""
    found = set()
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    if int(f.read().rsplit(")", 1)[1].split()[1]) == master:
                        found.add(int(entry))
            except (OSError, ValueError, IndexError):
                continue
    return found


def _ask(url: str) -> tuple[int, int]:
    """(status, answering worker) of a chat and of /admin/backends on fresh connections."""
    chat = requests.post(url + "/v1/chat/completions", timeout=10, json={
        "model": "m", "messages": [{"role": "user", "content": "hi"}]})
    pid = requests.get(url + "/admin/backends", timeout=10).json()["worker_pid"]
    return chat.status_code, pid


def test_a_broken_file_is_refused_on_hup_and_a_new_worker_boots_with_the_last_good(
        upstreams: Any, router_factory: Any) -> None:
    up = upstreams("a")
    router = router_factory({"backends": [{"name": "a", "url": up.url, "models": ["m"]}],
                             "health_check": {"interval_seconds": 30}}, workers=2)
    master = router.proc.pid
    wait_until(lambda: len(_workers(master)) == 2, "two workers", 15)
    before = _workers(master)
    good = router.config_path.read_text()
    router.config_path.write_text(good + "\nselecton_strategy: RoundRobin\n")

    os.kill(master, signal.SIGHUP)
    wait_until(lambda: "HUP refused" in router.proc.log_text(), "the HUP to be refused", 10)
    log = router.proc.log_text()
    assert "selecton_strategy: unknown key; did you mean 'selection_strategy'?" in log
    assert router.proc.running() and _workers(master) == before  # nothing restarted
    assert _ask(router.url)[0] == 200

    victim = min(before)
    os.kill(victim, signal.SIGKILL)  # a worker of the router this test started
    wait_until(lambda: len(_workers(master) - before) == 1 and len(_workers(master)) == 2,
               "gunicorn to start a worker in the dead one's place", 20)
    (fresh,) = _workers(master) - before
    wait_until(lambda: "this worker starts with the last config this router loaded"
               in router.proc.log_text(), "the new worker to boot from the good copy", 20)
    assert router.proc.running()
    answered: list[tuple[int, int]] = []

    def fresh_answers() -> bool:  # the kernel spreads new connections over the workers
        answered.append(_ask(router.url))
        return answered[-1][1] == fresh

    wait_until(fresh_answers, lambda: f"the new worker to answer: {answered[-5:]}", 20,
               interval=0.05)
    assert {status for status, _ in answered} == {200}

    router.config_path.write_text(good)  # fixed: a HUP restarts every worker again
    os.kill(master, signal.SIGHUP)
    wait_until(lambda: not (_workers(master) & (before | {fresh})) and
               len(_workers(master)) == 2, "new workers after the fixed HUP", 30)
    assert router.proc.log_text().count("HUP refused") == 1
    assert _ask(router.url)[0] == 200


def test_boot_config_falls_back_only_to_a_copy_this_router_kept(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(reload_mod.RUNTIME_DIR_ENV, str(tmp_path))
    path = tmp_path / "config.yaml"
    path.write_text("backends: [{name: a, url: 'http://127.0.0.1:9', models: [m]}]\n")
    config, note = reload_mod.boot_config(path, NameRegistry())
    assert note is None and [b.name for b in config.config.backends] == ["a"]  # type: ignore[union-attr]
    copy = tmp_path / reload_mod.LAST_GOOD_FILE
    assert copy.read_bytes() == path.read_bytes() and copy.stat().st_mode & 0o777 == 0o600
    path.write_text("backends: [{name: b, url: 'nope'}]\n")
    config, note = reload_mod.boot_config(path, NameRegistry())
    assert [b.name for b in config.config.backends] == ["a"]  # type: ignore[union-attr]
    assert note is not None and "backends[0].url" in note and str(copy) in note
    assert copy.read_text().startswith("backends: [{name: a")  # a bad file is not kept
    copy.unlink()
    with pytest.raises(reload_mod.ConfigError, match=r"backends\[0\]\.url"):
        reload_mod.boot_config(path, NameRegistry())
