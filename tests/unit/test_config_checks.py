"""Config holes that used to pass: admin without a real token, ports out of range, hosts
with spaces, ``server.bind`` without a port, duplicate YAML keys; every schema error of a
file carries ``file:line:column``."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from continuum.config import check_config, check_config_file
from continuum.errors import ConfigIssue
from listener.config import check_listener_config, check_listener_file

BACKEND = {"name": "a", "url": "http://127.0.0.1:9000"}
TOKEN = {"admin": {"token": "t0k"}}


def _errors(config: dict[str, Any]) -> dict[str, str]:
    return {e.path: e.message for e in check_config(config).errors}


# --- admin --------------------------------------------------------------------------------

@pytest.mark.parametrize("token", ["", "   "])
def test_empty_admin_token_is_an_error(token: str) -> None:
    result = check_config({"backends": [BACKEND], "admin": {"token": token}})
    assert result.config is None
    assert [e.path for e in result.errors] == ["admin.token"]
    assert result.errors[0].message.startswith("must not be empty")


@pytest.mark.parametrize("value", [None, ""])
def test_admin_token_env_unset_or_empty_is_an_error(monkeypatch: pytest.MonkeyPatch,
                                                     value: str | None) -> None:
    if value is None:
        monkeypatch.delenv("CR_TEST_ADMIN_TOKEN", raising=False)
    else:
        monkeypatch.setenv("CR_TEST_ADMIN_TOKEN", value)
    result = check_config({"backends": [BACKEND], "admin": {"token_env": "CR_TEST_ADMIN_TOKEN"}})
    assert result.config is None
    (error,) = result.errors
    assert error.path == "admin.token_env"
    assert error.message.startswith("environment variable is not set")
    assert [w.path for w in result.warnings] == []


def test_no_admin_token_warns_that_admin_answers_403() -> None:
    result = check_config({"backends": [BACKEND]})
    assert result.config is not None
    (warning,) = result.warnings
    assert warning.path == "admin" and "403" in warning.message


def test_allow_unauthenticated_warns_and_excludes_a_token() -> None:
    result = check_config({"backends": [BACKEND], "admin": {"allow_unauthenticated": True}})
    assert result.config is not None and result.config.admin.allow_unauthenticated
    assert [w.path for w in result.warnings] == ["admin.allow_unauthenticated"]
    both = check_config({"backends": [BACKEND],
                         "admin": {"token": "t", "allow_unauthenticated": True}})
    assert [e.path for e in both.errors] == ["admin.allow_unauthenticated"]


# --- addresses ----------------------------------------------------------------------------

@pytest.mark.parametrize("url", ["http://127.0.0.1:99999", "http://127.0.0.1:0",
                                 "http://127.0.0.1:80a", "https://h:65536/x"])
def test_backend_url_port_out_of_range(url: str) -> None:
    message = _errors({"backends": [{**BACKEND, "url": url}], **TOKEN})["backends[0].url"]
    assert message.startswith("port must be a number from 1 to 65535")


@pytest.mark.parametrize("url", ["http://my host:8000", "http://127.0.0.1 :8000",
                                 "http://h\t:1"])
def test_backend_url_host_with_spaces(url: str) -> None:
    message = _errors({"backends": [{**BACKEND, "url": url}], **TOKEN})["backends[0].url"]
    assert "without spaces" in message


def test_unparsable_url_is_an_error_not_a_crash() -> None:
    message = _errors({"backends": [{**BACKEND, "url": "http://[::1:80"}], **TOKEN})
    assert message["backends[0].url"].startswith("must be an http:// or https:// URL")


def test_valid_urls_pass() -> None:
    result = check_config({
        "backends": [BACKEND, {"name": "b", "url": "http://[::1]:65535"},
                     {"name": "c", "url": "https://api.example.com"}],
        "response_cache": {"redis": {"url": "unix:///run/redis.sock"}},
        "kv_cache_index": {"event_sources": [
            {"backend_name": "a", "endpoint": "ws://127.0.0.1:1/events/a"}]},
        **TOKEN})
    assert result.errors == []


@pytest.mark.parametrize(("section", "path"), [
    ({"response_cache": {"redis": {"url": "redis://127.0.0.1:99999/0"}}},
     "response_cache.redis.url"),
    ({"kv_cache_index": {"event_sources": [
        {"backend_name": "a", "endpoint": "http://127.0.0.1:70000/events/a"}]}},
     "kv_cache_index.event_sources[0].endpoint"),
])
def test_redis_and_event_source_ports(section: dict[str, Any], path: str) -> None:
    message = _errors({"backends": [BACKEND], **section, **TOKEN})[path]
    assert message.startswith("port must be a number from 1 to 65535")


def test_redis_and_event_source_hosts_with_spaces() -> None:
    errors = _errors({"backends": [BACKEND], **TOKEN,
                      "response_cache": {"redis": {"url": "redis://my redis:6379"}},
                      "kv_cache_index": {"event_sources": [
                          {"backend_name": "a", "endpoint": "http://lis tener:1/events/a"}]}})
    assert "without spaces" in errors["response_cache.redis.url"]
    assert "without spaces" in errors["kv_cache_index.event_sources[0].endpoint"]


@pytest.mark.parametrize(("bind", "problem"), [
    ("127.0.0.1", "must be host:port"),
    ("127.0.0.1:", "port must be"),
    (":8080", "must be host:port"),
    ("127.0.0.1:99999", "port must be a number from 1 to 65535"),
    ("127.0.0.1:0", "port must be a number from 1 to 65535"),
    ("::1:8080", "IPv6 host must be in brackets"),
    ("my host:8080", "host must not contain spaces"),
])
def test_server_bind_needs_host_and_port(bind: str, problem: str) -> None:
    message = _errors({"backends": [BACKEND], "server": {"bind": bind}, **TOKEN})
    assert problem in message["server.bind"]


@pytest.mark.parametrize("bind", ["0.0.0.0:8080", "[::1]:8080", "unix:/run/cr.sock"])
def test_server_bind_accepts_gunicorn_forms(bind: str) -> None:
    assert _errors({"backends": [BACKEND], "server": {"bind": bind}, **TOKEN}) == {}


def _listener(source: dict[str, Any], **top: Any) -> dict[str, str]:
    base = {"backend_name": "e1", "engine": "vllm", "model": "m",
            "zmq_endpoint": "tcp://127.0.0.1:5557", "allowed_publishers": ["127.0.0.1"],
            "detokenize_endpoint": "http://127.0.0.1:8000/detokenize"}
    _config, errors, _warnings = check_listener_config({**top, "sources": [{**base, **source}]})
    return {e.path: e.message for e in errors}


@pytest.mark.parametrize(("source", "top", "path"), [
    ({"zmq_endpoint": "tcp://127.0.0.1:70000"}, {}, "sources[0].zmq_endpoint"),
    ({"replay_endpoint": "tcp://127.0.0.1:99999"}, {}, "sources[0].replay_endpoint"),
    ({"detokenize_endpoint": "http://127.0.0.1:99999/detokenize"}, {},
     "sources[0].detokenize_endpoint"),
    ({"engine": "trtllm", "zmq_endpoint": None,
      "trtllm_endpoint": "http://127.0.0.1:0/kv_cache_events"}, {"cache_salt": {"secret": "s"}},
     "sources[0].trtllm_endpoint"),
    ({}, {"listen": "127.0.0.1:70000"}, "listen"),
])
def test_listener_ports_out_of_range(source: dict[str, Any], top: dict[str, Any],
                                     path: str) -> None:
    assert _listener(source, **top)[path].startswith("port must be a number from")


def test_listener_hosts_with_spaces_and_listen_without_port() -> None:
    errors = _listener({"detokenize_endpoint": "http://my engine:8000/detokenize",
                        "zmq_endpoint": "tcp://my engine:5557"}, listen="127.0.0.1")
    assert "without spaces" in errors["sources[0].detokenize_endpoint"]
    assert "without spaces" in errors["sources[0].zmq_endpoint"]
    assert errors["listen"].startswith("must be host:port")


def test_listener_keeps_port_zero_and_zmq_wildcards() -> None:
    assert _listener({"zmq_endpoint": "tcp://*:0", "replay_endpoint": "tcp://127.0.0.1:*"},
                     listen="127.0.0.1:0") == {}


# --- the YAML loader ----------------------------------------------------------------------

def test_duplicate_keys_in_router_config(tmp_path: Path) -> None:
    path = tmp_path / "dup.yaml"
    path.write_text("server:\n  workers: 2\n  workers: 3\nadmin: {token: t}\n"
                    "backends: [{name: a, url: 'http://127.0.0.1:1'}]\nadmin: {token: u}\n")
    result = check_config_file(path)
    assert result.config is None
    assert [e.render("f") for e in result.errors] == [
        "f:3:3: server.workers: duplicate key (first set at line 2); remove one of them",
        "f:6:1: admin: duplicate key (first set at line 4); remove one of them",
    ]


def test_an_error_in_a_duplicated_keys_value_points_at_the_value_yaml_kept(
        tmp_path: Path) -> None:
    """YAML keeps the last of two equal keys: a fault in that value is reported on its
    line, not on the first key's."""
    path = tmp_path / "dup.yaml"
    path.write_text("admin: {token: t}\nserver:\n  workers: 2\n  workers: -3\n"
                    "backends: [{name: a, url: 'http://127.0.0.1:1'}]\n"
                    "backends:\n  - name: b\n    url: ftp://x\n")
    result = check_config_file(path)
    assert [e.render("f") for e in result.errors] == [
        "f:4:3: server.workers: duplicate key (first set at line 3); remove one of them",
        "f:6:1: backends: duplicate key (first set at line 5); remove one of them",
        "f:4:3: server.workers: must be between 1 and 256 (got -3)",
        "f:8:5: backends[0].url: must be an http:// or https:// URL (got 'ftp://x')",
    ]


def test_duplicate_keys_in_listener_config(tmp_path: Path) -> None:
    path = tmp_path / "dup.yaml"
    path.write_text("history_size: 10\nlog_level: info\nhistory_size: 20\n")
    config, errors, _warnings = check_listener_file(path)
    assert config is None
    assert [e.render("f") for e in errors] == [
        "f:3:1: history_size: duplicate key (first set at line 1); remove one of them"]


def test_merge_keys_are_not_duplicates(tmp_path: Path) -> None:
    path = tmp_path / "merge.yaml"
    path.write_text("admin: {token: t}\nbackends:\n"
                    "  - &base {name: a, url: 'http://127.0.0.1:1', weight: 2}\n"
                    "  - {<<: *base, name: b}\n")
    result = check_config_file(path)
    assert result.errors == []
    assert result.config is not None
    assert [(b.name, b.weight) for b in result.config.backends] == [("a", 2), ("b", 2)]


def test_schema_errors_carry_line_and_column(tmp_path: Path) -> None:
    path = tmp_path / "c.yaml"
    path.write_text("admin:\n  token: t\nbackends:\n  - name: a\n    url: http://h:99999\n"
                    "  - url: http://h:1\n"
                    "kv_cache_index:\n  scoring:\n    overlap_weight: 0.9\n")
    result = check_config_file(path)
    assert sorted(e.render(str(path)) for e in result.errors) == sorted([
        f"{path}:5:5: backends[0].url: port must be a number from 1 to 65535, not '99999' "
        "(got 'http://h:99999')",
        f"{path}:6:5: backends[1].name: is required",  # missing: where its item starts
        f"{path}:9:5: kv_cache_index.scoring.overlap_weight: weights must sum to 1.0 (got 1.3)",
    ])


def test_listener_schema_errors_carry_line_and_column(tmp_path: Path) -> None:
    path = tmp_path / "l.yaml"
    path.write_text("log_level: info\nlimits:\n  max_chain_tokens: zero\n")
    _config, errors, _warnings = check_listener_file(path)
    assert [e.render("l") for e in errors] == [
        "l:3:3: limits.max_chain_tokens: expected an integer (got 'zero')"]


def test_yaml_error_never_quotes_the_line(tmp_path: Path) -> None:
    path = tmp_path / "broken.yaml"
    path.write_text("admin:\n  token: \"hunter2-secret\n")
    result = check_config_file(path)
    (error,) = result.errors
    assert error.location is not None and error.path == "<document>"
    assert "hunter2" not in error.render(str(path))


def test_unreadable_files_are_issues_not_exceptions(tmp_path: Path) -> None:
    binary = tmp_path / "bin.yaml"
    binary.write_bytes(b"server:\n  bind: \xff\n")
    assert [e.path for e in check_config_file(binary).errors] == ["<file>"]
    assert [e.path for e in check_config_file(tmp_path / "missing.yaml").errors] == ["<file>"]


def test_location_falls_back_to_nearest_ancestor() -> None:
    from continuum.config.loader import parse_yaml

    doc = parse_yaml("a:\n  b:\n    - x: 1\n")
    issues = [ConfigIssue("a.b[0].y", "m"), ConfigIssue("a.c", "m"), ConfigIssue("z", "m")]
    doc.locate(issues)
    assert [i.location for i in issues] == ["3:7", "1:1", None]


# --- redaction of URLs ----------------------------------------------------------------------

@pytest.mark.parametrize(("url", "shown"), [
    ("redis://:pw@h:6379/0", "redis://:***@h:6379/0"),
    ("redis://user:pw@h", "redis://user:***@h"),
    ("https://tok@h/x", "https://***@h/x"),
    ("redis://:p/w@d@h:1", "redis://:***@h:1"),
    ("rediss://h:1/0?password=pw&ssl_cert_reqs=none", "rediss://h:1/0?password=***&ssl_cert_reqs=none"),
    ("user:pw@h:6379", "user:***@h:6379"),
    ("http://127.0.0.1:8000/v1", "http://127.0.0.1:8000/v1"),
])
def test_redact_url(url: str, shown: str) -> None:
    from continuum.config.addresses import redact_url

    assert redact_url(url) == shown


# --- the KV index's approximate entries ---------------------------------------------------

@pytest.mark.parametrize(("kv", "lifetime"), [
    ({}, 60.0),
    ({"entry_ttl_seconds": 30}, 30.0),  # used to be refused: the omitted 60 exceeded it
    ({"entry_ttl_seconds": 1, "match": "seed"}, 1.0),
    ({"entry_ttl_seconds": 30, "approximate": {"ttl_seconds": 10}}, 10.0),
    ({"approximate": {"ttl_seconds": 600}}, 600.0),
])
def test_approximate_ttl_defaults_to_at_most_the_entry_ttl(kv: dict[str, Any],
                                                            lifetime: float) -> None:
    result = check_config({"backends": [BACKEND], "kv_cache_index": kv})
    assert result.errors == []
    assert result.config is not None
    assert result.config.kv_cache_index.approximate_ttl == lifetime


def test_an_approximate_ttl_set_above_the_entry_ttl_is_an_error() -> None:
    errors = _errors({"backends": [BACKEND], "kv_cache_index": {
        "entry_ttl_seconds": 30, "approximate": {"ttl_seconds": 45}}})
    assert list(errors) == ["kv_cache_index.approximate.ttl_seconds"]
    assert errors["kv_cache_index.approximate.ttl_seconds"].startswith(
        "must not exceed entry_ttl_seconds")
