"""Config loading: defaults, ranges, unknown keys, every error at once, the CLI."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from continuum.config import (
    check_config,
    check_config_file,
    defaults_text,
    load_config,
    parse_config,
    restart_required,
)
from continuum.errors import ConfigError
from continuum.registry import PluginRegistry

ROOT = Path(__file__).resolve().parents[2]
BACKEND = {"name": "a", "url": "http://127.0.0.1:9000"}


def test_defaults_apply() -> None:
    cfg = parse_config({"backends": [BACKEND]})
    assert cfg.server.max_body_bytes == 10 * 1024 * 1024
    assert cfg.selection_strategy == "RoundRobin"
    assert cfg.backends[0].weight == 1 and cfg.backends[0].type == "openai"
    assert cfg.health_check.interval_seconds == 5.0


def test_three_mistakes_are_all_reported_with_paths(tmp_path: Path) -> None:
    path = tmp_path / "bad.yaml"
    path.write_text(
        "backends:\n"
        "  - name: a\n"
        "    url: http://127.0.0.1:1\n"
        "    weigth: 3\n"
        "  - name: b\n"
        "    url: ftp://nope\n"
        "server:\n"
        "  max_body_bytes: 12\n"
    )
    result = check_config_file(path)
    rendered = [e.render(result.source) for e in result.errors]
    assert sorted(rendered) == [  # file:line:column of each key
        f"{path}:4:5: backends[0].weigth: unknown key; did you mean 'weight'?",
        f"{path}:6:5: backends[1].url: must be an http:// or https:// URL (got 'ftp://nope')",
        f"{path}:8:3: server.max_body_bytes: must be between 1024 and 1073741824 (got 12)",
    ]
    paths = sorted(e.path for e in result.errors)
    assert paths == ["backends[0].weigth", "backends[1].url", "server.max_body_bytes"]
    with pytest.raises(ConfigError) as err:
        load_config(path)
    assert str(err.value).count(str(path)) == 3


def test_types_ranges_choices_required() -> None:
    result = check_config({
        "backends": [{"name": "bad name!", "url": "http://h", "weight": True,
                      "type": "grpc", "slots": 0}, {"url": "http://h", "slots": "4"}],
        "health_check": {"interval_seconds": "soon"},
    })
    messages = {e.path: e.message for e in result.errors}
    assert messages["backends[0].name"].startswith("must match")
    assert messages["backends[0].weight"] == "expected an integer"
    assert messages["backends[0].type"] == "must be one of 'openai', 'anthropic', 'gemini'"
    assert messages["backends[1].name"] == "is required"
    assert messages["backends[0].slots"] == "must be between 1 and 1000000"
    assert messages["backends[1].slots"] == "expected an integer"
    assert "duration" in messages["health_check.interval_seconds"]


def test_learn_slots_needs_an_engine_a_probe_and_no_configured_slots() -> None:
    assert parse_config({"backends": [dict(BACKEND, learn_slots=True)]}) \
        .backends[0].learn_slots is True
    result = check_config({
        "backends": [dict(BACKEND, learn_slots=True, slots=4),
                     {"name": "c", "url": "https://api.anthropic.com", "type": "anthropic",
                      "learn_slots": True},
                     {"name": "d", "url": "http://h:8000", "learn_slots": "yes"}],
    })
    messages = {e.path: e.message for e in result.errors}
    assert messages == {
        "backends[0].learn_slots": "set either slots or learn_slots, not both",
        "backends[1].learn_slots": "needs an engine's Prometheus /metrics (vLLM, SGLang); "
                                   "a type: anthropic backend has none",
        "backends[2].learn_slots": "expected a boolean",
    }
    result = check_config({"backends": [dict(BACKEND, learn_slots=True)],
                           "health_check": {"enabled": False}})
    assert {e.path: e.message for e in result.errors} == {
        "backends[0].learn_slots": "learned by the health probes: needs health_check.enabled"}


def test_durations_and_duplicates() -> None:
    cfg = parse_config({"backends": [BACKEND], "health_check": {"interval_seconds": "2m"}})
    assert cfg.health_check.interval_seconds == 120.0
    result = check_config({"backends": [BACKEND, dict(BACKEND)]})
    assert [e.path for e in result.errors] == ["backends[1].name"]
    assert "duplicate" in result.errors[0].message


def test_unknown_strategy_lists_available_and_suggests() -> None:
    result = check_config({"backends": [BACKEND], "selection_strategy": "RoundRobn"},
                          registry=PluginRegistry())
    (error,) = result.errors
    assert error.path == "selection_strategy"
    assert "RoundRobin" in error.message and "did you mean 'RoundRobin'" in error.message


def test_warnings_name_their_path(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("NOPE_KEY", raising=False)
    result = check_config({"backends": [{**BACKEND, "api_key_env": "NOPE_KEY",
                                         "url": "http://h:1/v1"}]})
    assert result.config is not None
    paths = sorted(w.path for w in result.warnings)
    assert paths == ["admin", "backends[0].api_key_env", "backends[0].url"]
    # a disabled backend's unset key is not worth a warning until it is enabled
    off = check_config({"backends": [BACKEND, {**BACKEND, "name": "later", "enabled": False,
                                               "api_key_env": "NOPE_KEY"}]})
    assert off.config is not None
    assert [w.path for w in off.warnings if "api_key_env" in w.path] == []


def test_secrets_from_env(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("UP_KEY", "sk-1")
    cfg = parse_config({"backends": [{**BACKEND, "api_key_env": "UP_KEY"}],
                        "admin": {"token_env": "UP_KEY"}})
    assert cfg.backends[0].resolved_api_key() == "sk-1"
    assert cfg.admin.resolved_token() == "sk-1"
    both = check_config({"backends": [{**BACKEND, "api_key": "x", "api_key_env": "UP_KEY"}]})
    assert [e.path for e in both.errors] == ["backends[0].api_key_env"]


def test_invalid_yaml_names_line_and_column(tmp_path: Path) -> None:
    path = tmp_path / "broken.yaml"
    path.write_text("server:\n  bind: [\n")
    result = check_config_file(path)
    assert result.config is None
    (error,) = result.errors
    assert (error.path, error.location) == ("<document>", "3:1")
    assert error.render(str(path)).startswith(f"{path}:3:1: <document>: invalid YAML: ")


def test_restart_required_fields() -> None:
    old = parse_config({"backends": [BACKEND]})
    new = parse_config({"backends": [BACKEND], "server": {"workers": 4, "max_body_bytes": 4096}})
    assert restart_required(old, new) == ["server.workers"]


def test_defaults_text_covers_every_section() -> None:
    text = defaults_text()
    for key in ("server:", "max_body_bytes: 10485760", "backends:", "selection_strategy:",
                "health_check:", "admin:", "unhealthy_threshold: 2"):
        assert key in text


def _cli(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "continuum.cli", *args], capture_output=True,
                          text=True, cwd=ROOT, timeout=60, env={**os.environ, **(env or {})})


def test_cli_validate_example_ok_and_bad_file_fails(tmp_path: Path) -> None:
    ok = _cli("config", "validate", "conf/config.yaml.example",
              env={"CONTINUUM_ADMIN_TOKEN": "example-token"})
    assert ok.returncode == 0, ok.stdout + ok.stderr
    assert "ok" in ok.stdout
    no_token = _cli("config", "validate", "conf/config.yaml.example",
                    env={"CONTINUUM_ADMIN_TOKEN": ""})
    assert no_token.returncode == 1
    assert "admin.token_env: environment variable is not set" in no_token.stdout
    bad = tmp_path / "bad.yaml"
    bad.write_text("selecton_strategy: RoundRobin\nbackends: [{name: a, url: 'x'}]\n")
    res = _cli("config", "validate", str(bad))
    assert res.returncode == 1
    assert "selecton_strategy: unknown key; did you mean 'selection_strategy'?" in res.stdout
    assert "backends[0].url" in res.stdout


def test_cli_validate_reports_names_and_plugins_alongside_refused_values(
        tmp_path: Path) -> None:
    """A duplicate backend name and a misspelt strategy are reported in the same run as a
    refused value elsewhere (before, they showed only once every value was valid), and the
    run says that other cross-key checks wait for the fixes."""
    bad = tmp_path / "bad.yaml"
    bad.write_text("server: {workers: lots}\n"
                   "backends: [{name: a, url: 'http://127.0.0.1:1'},\n"
                   "           {name: a, url: 'http://127.0.0.1:2', weight: -1}]\n"
                   "selection_strategy: PrefixAwareHsh\n"
                   "scorers: [7]\n")
    res = _cli("config", "validate", str(bad), env={"CONTINUUM_ADMIN_TOKEN": ""})
    assert res.returncode == 1
    errors = [line for line in res.stdout.splitlines() if line.startswith("error: ")]
    assert [line.split(": ")[2] for line in errors] == [
        "server.workers", "backends[1].weight", "scorers[0]", "backends[1].name",
        "selection_strategy"], errors
    assert f"{bad}:4:1: selection_strategy" in errors[4]  # each with its line and column
    assert "server.workers: expected an integer" in errors[0]
    assert "backends[1].weight: must be between" in errors[1]
    assert "scorers[0]: expected a string" in errors[2]
    assert "backends[1].name: duplicate backend name (also backends[0])" in errors[3]
    assert "did you mean 'PrefixAwareHash'?" in errors[4]
    assert res.stdout.splitlines()[-1].startswith("note: some checks that combine several")
    # a file whose only errors are the cross-key ones gets no note
    bad.write_text("backends: [{name: a, url: 'http://127.0.0.1:1'},\n"
                   "           {name: a, url: 'http://127.0.0.1:2'}]\n")
    res = _cli("config", "validate", str(bad))
    assert res.returncode == 1 and "duplicate backend name" in res.stdout
    assert "note:" not in res.stdout


def test_cli_defaults_prints_table() -> None:
    res = _cli("config", "defaults")
    assert res.returncode == 0
    assert res.stdout == defaults_text()


def test_per_tenant_salts_default_off_and_warn_when_they_cannot_isolate() -> None:
    assert parse_config({"backends": [BACKEND]}).kv_cache_index.cache_salt.per_tenant is False
    assert "per_tenant: false" in defaults_text()
    salt = {"enabled": True, "secret": "s", "per_tenant": True}
    keys = {"keys": [{"key": "sk-1", "tenant": "acme"}]}
    cases = [
        ({"cache_salt": {"per_tenant": True}}, {}, True, "kv_cache_index.cache_salt.per_tenant"),
        ({"cache_salt": salt}, keys, False, "kv_cache_index.cache_salt.per_tenant"),
        ({"cache_salt": salt}, {}, True, "kv_cache_index.cache_salt.per_tenant"),
        ({"cache_salt": salt}, keys, True, None),
    ]
    for kv, auth, prefix_routing, warned in cases:
        result = check_config({"backends": [BACKEND], "kv_cache_index": kv, "auth": auth,
                               "prefix_routing": {"enabled": prefix_routing},
                               "admin": {"token": "t"}})
        assert result.config is not None and not result.errors
        assert [w.path for w in result.warnings] == ([warned] if warned else []), kv


@pytest.mark.parametrize(("scoring", "prefix_routing", "warned"), [
    ({"gpu_tier_weight": 0.25}, True, True),  # under the 0.3 threshold: nothing can pass
    ({"gpu_tier_weight": 0.3}, True, False),  # equal: a full GPU match passes the gate
    ({"gpu_tier_weight": 0.5, "min_overlap_threshold": 0.6}, True, True),
    ({"gpu_tier_weight": 0.25}, False, False),  # no scorer runs: the other warning says so
])
def test_a_gpu_tier_weight_under_the_threshold_warns(
        scoring: dict[str, float], prefix_routing: bool, warned: bool) -> None:
    result = check_config({"backends": [BACKEND], "admin": {"token": "t"},
                           "prefix_routing": {"enabled": prefix_routing},
                           "kv_cache_index": {"enabled": True, "scoring": scoring}})
    assert result.config is not None and not result.errors
    paths = [w.path for w in result.warnings]
    assert ("kv_cache_index.scoring.gpu_tier_weight" in paths) is warned, paths
    if warned:
        (message,) = [w.message for w in result.warnings
                      if w.path == "kv_cache_index.scoring.gpu_tier_weight"]
        assert "always falls back" in message


def test_anthropic_messages_adds_the_anthropic_protocol_to_engines_only() -> None:
    assert "anthropic_messages: false" in defaults_text()
    cfg = parse_config({"backends": [
        BACKEND,
        dict(BACKEND, name="engine", anthropic_messages=True),
        {"name": "claude", "url": "https://api.anthropic.com", "type": "anthropic",
         "anthropic_messages": True},
        {"name": "g", "url": "https://generativelanguage.googleapis.com", "type": "gemini"},
    ]})
    assert [b.protocols for b in cfg.backends] == [
        ("openai",), ("openai", "anthropic"), ("anthropic",), ("openai", "anthropic")]


def test_anthropic_messages_warns_where_it_has_no_effect() -> None:
    result = check_config({"backends": [
        dict(BACKEND, anthropic_messages=True),
        {"name": "claude", "url": "https://api.anthropic.com", "type": "anthropic",
         "anthropic_messages": True},
        {"name": "g", "url": "https://generativelanguage.googleapis.com", "type": "gemini",
         "anthropic_messages": True},
    ], "admin": {"token": "t"}})
    assert result.config is not None and not result.errors
    assert {w.path: w.message for w in result.warnings} == {
        "backends[1].anthropic_messages": "has no effect on a type: anthropic backend: it "
                                          "speaks the Messages API natively",
        "backends[2].anthropic_messages": "has no effect on a type: gemini backend: the "
                                          "router translates those requests to its own API",
    }


@pytest.mark.parametrize(("per_tenant", "sourced", "enabled", "refused"), [
    (True, True, True, True),  # salted per tenant, but the Messages endpoint takes no salt
    (False, True, True, False),  # shared salts: nothing to isolate
    (True, False, True, False),  # no event source: the router never salts that engine
    (True, True, False, False),  # disabled: no request; checked when a reload enables it
])
def test_per_tenant_salts_refuse_an_engine_serving_anthropic_messages(
        per_tenant: bool, sourced: bool, enabled: bool, refused: bool) -> None:
    sources = [{"backend_name": "engine", "endpoint": "http://127.0.0.1:7000/events"}] \
        if sourced else []
    result = check_config({
        "backends": [BACKEND, dict(BACKEND, name="engine", anthropic_messages=True,
                                   enabled=enabled)],
        "prefix_routing": {"enabled": True},
        "auth": {"keys": [{"key": "sk-1", "tenant": "acme"}]},
        "admin": {"token": "t"},
        "kv_cache_index": {"event_sources": sources, "cache_salt": {
            "enabled": True, "secret": "s", "per_tenant": per_tenant}},
    })
    errors = {e.path: e.message for e in result.errors}
    assert errors == ({"backends[1].anthropic_messages": (
        "the engine's /v1/messages takes no cache_salt, so its /anthropic requests would "
        "share its prefix cache across tenants despite kv_cache_index.cache_salt.per_tenant; "
        "set one of the two false")} if refused else {})
