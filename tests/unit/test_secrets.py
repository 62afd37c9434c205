"""Nothing secret is ever printed.

Distinct strings are planted in every secret field of a router and a listener config
(``api_key``, ``admin.token``, client keys, cache-salt secrets, passwords in backend, Redis
and event-source URLs, the listener's endpoints); then every path that prints config is
driven — type errors, bad URLs, YAML syntax errors, duplicate keys, ``config validate``,
``config defaults``, ``serve`` refusing a bad file, the listener's ``--check`` and
``--print-defaults``, ``POST /admin/config/reload`` (refused and applied), the watcher's
log, every admin view, ``repr`` of the config — and all of it is searched for the plants.
"""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
from pathlib import Path

import falcon.testing
import pytest

from continuum.config import check_config_file, load_config
from continuum.errors import ConfigError
from continuum.metrics import RouterMetrics
from continuum.registry import PluginRegistry
from continuum.service import RouterService
from continuum.web.app import create_app
from continuum.web.reload import ConfigReloader

ROOT = Path(__file__).resolve().parents[2]

# Each one planted once; none may ever appear in any output.
PLANTS = {
    name: f"plant-{name}-{i:02d}x" for i, name in enumerate([
        "api-key", "admin-token", "client-key", "salt", "redis-pw", "backend-pw",
        "endpoint-pw", "api-key-2", "admin-token-2", "client-key-2", "salt-2", "redis-pw-2",
        "backend-pw-2", "endpoint-pw-2", "yaml-broken", "dup-key", "section",
        "listener-salt", "trtllm-pw", "detok-pw", "backend-pw-3", "listener-detok-ok",
        "redis-query", "pasted-api-key", "pasted-client-key", "pasted-salt", "pasted-token",
        "pasted-listener-salt"])
}
NUMBER_PLANTS = {"api-key-int": "8675309123456", "admin-token-int": "3141592653589",
                 "client-key-int": "2718281828459"}
P = PLANTS


def _good(version: str) -> str:
    """A valid router config with a secret in every secret field."""
    s = "" if version == "1" else "-2"
    return f"""
server: {{watch_config: false}}
backends:
  - name: a
    url: "http://user:{P['backend-pw' + s]}@127.0.0.1:9"
    models: [m]
    api_key: "{P['api-key' + s]}"
health_check: {{enabled: false}}
response_cache:
  redis: {{url: "redis://:{P['redis-pw' + s]}@127.0.0.1:6399/0"}}
auth:
  keys: [{{key: "{P['client-key' + s]}", tenant: t1}}]
kv_cache_index:
  cache_salt: {{secret: "{P['salt' + s]}"}}
  event_sources:
    - {{backend_name: a, endpoint: "http://u:{P['endpoint-pw' + s]}@127.0.0.1:7817/events/a"}}
admin: {{token: "{P['admin-token' + s]}"}}
"""


BAD = f"""
backends:
  - name: a
    url: "http://u:{P['backend-pw-3']}@127.0.0.1:99999"
    api_key: {NUMBER_PLANTS['api-key-int']}
  - name: b
    url: "ftp://u:{P['backend-pw-3']}@h"
    api_key: ["{P['api-key-2']}"]
  - name: c
    url: "http://u:{P['backend-pw-3']}@my host:1"
    api_key: {{k: "{P['api-key-2']}"}}
response_cache:
  redis: {{url: "redis://:{P['redis-pw-2']}@127.0.0.1:99999/0?password={P['redis-query']}"}}
auth:
  keys:
    - {{key: {NUMBER_PLANTS['client-key-int']}, tenant: t}}
    - {{key: ["{P['client-key-2']}"], tenant: u}}
kv_cache_index:
  cache_salt: {{enabled: true, secret: {{s: "{P['salt-2']}"}}}}
  event_sources:
    - {{backend_name: a, endpoint: "ftp://u:{P['endpoint-pw-2']}@h:0/x"}}
admin: {{token: {NUMBER_PLANTS['admin-token-int']}}}
"""

BROKEN_YAML = f'backends: []\nadmin:\n  token: "{P["yaml-broken"]}\n  other: [\n'
DUPLICATE = f'admin:\n  token: "{P["dup-key"]}"\n  token: "{P["dup-key"]}"\n'
SECTION_AS_STRING = f'admin: "{P["section"]}"\nauth: ["{P["section"]}"]\n'

# Secrets pasted where the name of an environment variable belongs.
PASTED = f"""
backends: [{{name: a, url: "http://127.0.0.1:9", api_key_env: "{P['pasted-api-key']}"}}]
auth: {{keys: [{{key_env: "{P['pasted-client-key']}", tenant: t}}]}}
kv_cache_index: {{cache_salt: {{enabled: true, secret_env: "{P['pasted-salt']}"}}}}
admin: {{token_env: "{P['pasted-token']}"}}
"""
LISTENER_PASTED = f'cache_salt: {{secret_env: "{P["pasted-listener-salt"]}"}}\n'

LISTENER_BAD = f"""
cache_salt: {{secret: ["{P['listener-salt']}"]}}
sources:
  - backend_name: t1
    engine: trtllm
    model: m
    trtllm_endpoint: "http://u:{P['trtllm-pw']}@127.0.0.1:70000/kv_cache_events"
    allowed_publishers: [127.0.0.1]
  - backend_name: v1
    engine: vllm
    model: m
    zmq_endpoint: "tcp://127.0.0.1:5557"
    detokenize_endpoint: "ftp://u:{P['detok-pw']}@127.0.0.1:8000/detokenize"
    allowed_publishers: [127.0.0.1]
"""
LISTENER_GOOD = f"""
listen: 127.0.0.1:0
cache_salt: {{secret: "{P['listener-salt']}"}}
sources:
  - backend_name: v1
    engine: vllm
    model: m
    zmq_endpoint: "tcp://127.0.0.1:5557"
    detokenize_endpoint: "http://u:{P['listener-detok-ok']}@127.0.0.1:8000/detokenize"
    allowed_publishers: [127.0.0.1]
"""


def _run(*argv: str) -> str:
    done = subprocess.run([sys.executable, *argv], capture_output=True, text=True, cwd=ROOT,
                          timeout=60, env={k: v for k, v in os.environ.items()
                                           if k != "CONTINUUM_CONFIG"})
    return done.stdout + done.stderr


def _leaks(texts: list[str]) -> list[str]:
    everything = "\n".join(texts)
    return [plant for plant in [*PLANTS.values(), *NUMBER_PLANTS.values()]
            if plant in everything]


def test_no_planted_secret_is_ever_printed(tmp_path: Path,
                                           caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.DEBUG)
    out: list[str] = []
    files = {"good.yaml": _good("1"), "bad.yaml": BAD, "broken.yaml": BROKEN_YAML,
             "dup.yaml": DUPLICATE, "section.yaml": SECTION_AS_STRING, "pasted.yaml": PASTED,
             "listener-bad.yaml": LISTENER_BAD, "listener-good.yaml": LISTENER_GOOD,
             "listener-pasted.yaml": LISTENER_PASTED}
    for name, text in files.items():
        (tmp_path / name).write_text(text)

    # The CLIs.
    for name in ("good.yaml", "bad.yaml", "broken.yaml", "dup.yaml", "section.yaml",
                 "pasted.yaml"):
        out.append(_run("-m", "continuum.cli", "config", "validate", str(tmp_path / name)))
    out.append(_run("-m", "continuum.cli", "config", "defaults"))
    out.append(_run("-m", "continuum.cli", "serve", "--config", str(tmp_path / "bad.yaml")))
    for name in ("listener-bad.yaml", "listener-good.yaml", "listener-pasted.yaml"):
        out.append(_run("-m", "listener.cli", "--config", str(tmp_path / name), "--check"))
    out.append(_run("-m", "listener.cli", "--print-defaults"))

    # Errors as the library raises them.
    refused_files = []
    for name in ("bad.yaml", "broken.yaml", "dup.yaml", "section.yaml", "pasted.yaml"):
        try:
            load_config(tmp_path / name)
        except ConfigError as exc:
            out += [str(exc), repr(exc.issues)]
            refused_files.append(name)
    result = check_config_file(tmp_path / "bad.yaml")
    out.append("\n".join(issue.render(result.source) for issue in result.errors))

    # The running app: admin views, reload refused, watcher log, reload applied.
    path = tmp_path / "router.yaml"
    path.write_text(_good("1"))
    registry = PluginRegistry()
    config = load_config(path, registry)
    out += [repr(config), str(config)]
    service = RouterService(config, registry=registry, metrics=RouterMetrics())
    reloader = ConfigReloader(service, path)
    client = falcon.testing.TestClient(create_app(config, registry=registry, service=service,
                                                  reloader=reloader))
    headers = {"Authorization": f"Bearer {P['admin-token']}"}
    for view in ("strategies", "backends", "prefix-routing/stats", "response-cache/stats",
                 "kv-index/stats", "kv-index/backends"):
        resp = client.simulate_get(f"/admin/{view}", headers=headers)
        assert resp.status_code == 200, view
        out.append(resp.text)
    backends = client.simulate_get("/admin/backends", headers=headers).json["backends"]
    assert backends[0]["url"] == "http://user:***@127.0.0.1:9"
    out.append(client.simulate_post("/admin/routing/explain", headers=headers, json={
        "model": "m", "messages": [{"role": "user", "content": "x"}]}).text)
    out.append(client.simulate_get("/admin/backends", headers={
        "Authorization": "Bearer wrong"}).text)

    path.write_text(BAD)
    refused = client.simulate_post("/admin/config/reload", headers=headers)
    assert refused.status_code == 400
    out.append(refused.text)
    path.write_text(BAD + "\n# touched\n")
    assert reloader.check() is None  # the watcher logs the refusal
    for name in ("broken.yaml", "dup.yaml", "section.yaml", "pasted.yaml"):
        path.write_text(files[name])
        out.append(client.simulate_post("/admin/config/reload", headers=headers).text)

    path.write_text(_good("2"))
    applied = client.simulate_post("/admin/config/reload", headers=headers)
    assert applied.status_code == 200, applied.text
    assert "admin.token" in applied.json["applied"]
    assert "kv_cache_index.cache_salt.secret" in applied.json["restart_required"]
    out.append(applied.text)
    new_headers = {"Authorization": f"Bearer {P['admin-token-2']}"}
    out.append(client.simulate_get("/admin/backends", headers=new_headers).text)
    out.append(json.dumps([r.getMessage() for r in caplog.records]))
    out.append(caplog.text)
    assert "config change ignored" in caplog.text  # the watcher's log was captured

    assert _leaks(out) == []
    # Not vacuous: every error path was really driven (a message naming each secret
    # field), every bad file refused, and every plant was in a file the outputs came from.
    assert refused_files == ["bad.yaml", "broken.yaml", "dup.yaml", "section.yaml",
                             "pasted.yaml"]
    assert len(refused.json["errors"]) == len(result.errors)
    bad_paths = {issue.path for issue in result.errors}
    assert {"backends[0].url", "backends[0].api_key", "backends[1].url",
            "backends[1].api_key", "backends[2].url", "backends[2].api_key",
            "response_cache.redis.url", "auth.keys[0].key", "auth.keys[1].key",
            "kv_cache_index.cache_salt.secret", "kv_cache_index.event_sources[0].endpoint",
            "admin.token"} <= bad_paths, bad_paths
    assert len(_leaks([*files.values(), _good("2")])) == len(PLANTS) + len(NUMBER_PLANTS)
