"""Tier 1 through real gunicorn: stickiness, explain, stats, hot reload under load."""

from __future__ import annotations

import threading
import time

import pytest
import requests
import yaml

from continuum.devtools.procs import wait_until

pytestmark = pytest.mark.e2e


def _chat(system: str, user: str = "hi") -> dict:
    return {"model": "m", "messages": [{"role": "system", "content": system},
                                       {"role": "user", "content": user}]}


def _config(ups, **prefix_routing):  # type: ignore[no-untyped-def]
    return {
        "backends": [{"name": u.name, "url": u.url, "models": ["m"]} for u in ups],
        "selection_strategy": "PrefixAwareHash",
        "prefix_routing": {"enabled": True, **prefix_routing},
        "health_check": {"interval_seconds": 30},
        "server": {"watch_interval_seconds": 0.2},
    }


def test_shared_system_prompt_sticks_to_one_backend(upstreams, router_factory) -> None:
    ups = [upstreams(n) for n in ("a", "b", "c", "d")]
    router = router_factory(_config(ups))
    owners = {}
    for prompt in ("You are a pirate.", "You are a lawyer.", "You answer in French."):
        seen = {requests.post(router.url + "/v1/chat/completions", json=_chat(prompt, f"q{i}"),
                              timeout=10).headers["X-Continuum-Backend"] for i in range(12)}
        assert len(seen) == 1, (prompt, seen)  # sequential requests: always under the bound
        owners[prompt] = seen.pop()
    explain = requests.post(router.url + "/admin/routing/explain",
                            json=_chat("You are a pirate."), timeout=10).json()
    assert explain["decision"]["backend"] == owners["You are a pirate."]
    assert explain["decision"]["decision"] == "prefix_hash"
    assert len(explain["prefix_hash"]) == 64
    assert [c["backend"] for c in explain["candidates"]] == ["a", "b", "c", "d"]
    stats = requests.get(router.url + "/admin/prefix-routing/stats", timeout=10).json()
    assert stats["routing_decisions"]["prefix_hash"] == 36
    assert stats["unique_prefixes"] == 3
    assert stats["config"]["virtual_nodes"] == 150


def test_reload_changes_virtual_nodes_live_without_failures(upstreams, router_factory) -> None:
    ups = [upstreams(n) for n in ("a", "b", "c")]
    router = router_factory(_config(ups), workers=2)
    failures: list[object] = []
    done = threading.Event()
    sent = [0]

    def load() -> None:
        session = requests.Session()
        deadline = time.monotonic() + 30
        while not done.is_set() and time.monotonic() < deadline and sent[0] < 5000:
            try:
                resp = session.post(router.url + "/v1/chat/completions",
                                    json=_chat(f"prompt {sent[0] % 17}"), timeout=10)
                if resp.status_code != 200:
                    failures.append(resp.status_code)
            except requests.RequestException as exc:
                failures.append(exc)
            sent[0] += 1
        session.close()

    threads = [threading.Thread(target=load) for _ in range(4)]
    for t in threads:
        t.start()
    time.sleep(0.5)
    config = yaml.safe_load(router.config_path.read_text())
    config["prefix_routing"]["virtual_nodes"] = 40
    config["server"]["workers"] = 3  # needs a restart: reported, not applied
    router.config_path.write_text(yaml.safe_dump(config))
    reply = requests.post(router.url + "/admin/config/reload", timeout=10).json()
    assert reply["success"] is True
    assert "prefix_routing.virtual_nodes" in reply["applied"]
    assert reply["restart_required"] == ["server.workers"]
    # The other worker picks the change up from its watcher (every 0.2 s); each worker's
    # latest answer counts, both must have answered (fresh connections spread over them).
    pids_seen: dict[int, int] = {}

    def converged() -> bool:
        stats = requests.get(router.url + "/admin/prefix-routing/stats", timeout=10).json()
        pids_seen[stats["worker_pid"]] = stats["config"]["virtual_nodes"]
        return len(pids_seen) == 2 and set(pids_seen.values()) == {40}

    try:
        wait_until(converged, lambda: f"both workers at 40 virtual nodes: {pids_seen}",
                   timeout=15)
    finally:
        done.set()
        for t in threads:
            t.join(30)
    assert failures == [] and sent[0] > 50


def test_reload_with_errors_keeps_running_config(upstreams, router_factory) -> None:
    ups = [upstreams("a")]
    router = router_factory(_config(ups))
    config = yaml.safe_load(router.config_path.read_text())
    config["prefix_routing"]["load_factor_epsilon"] = 99
    router.config_path.write_text(yaml.safe_dump(config))
    resp = requests.post(router.url + "/admin/config/reload", timeout=10)
    assert resp.status_code == 400
    assert "prefix_routing.load_factor_epsilon: must be between 0.01 and 10" in \
        resp.json()["errors"][0]
    stats = requests.get(router.url + "/admin/prefix-routing/stats", timeout=10).json()
    assert stats["config"]["load_factor_epsilon"] == 0.25


def test_config_file_watcher_reloads_without_an_admin_call(upstreams, router_factory) -> None:
    ups = [upstreams("a")]
    router = router_factory(_config(ups))
    config = yaml.safe_load(router.config_path.read_text())
    config["prefix_routing"]["load_factor_epsilon"] = 0.5
    router.config_path.write_text(yaml.safe_dump(config))

    def epsilon() -> float:
        stats = requests.get(router.url + "/admin/prefix-routing/stats", timeout=10).json()
        return float(stats["config"]["load_factor_epsilon"])

    wait_until(lambda: epsilon() == 0.5, lambda: f"the watcher's reload (epsilon {epsilon()})",
               10, interval=0.1)
