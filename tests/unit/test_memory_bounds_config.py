"""Config keys of the memory and access bounds: ranges, and tokens only from a file or env."""

from __future__ import annotations

from pathlib import Path

import pytest

from continuum.config import check_config, defaults_text, parse_config
from listener.config import ListenerConfig, check_listener_config

BACKEND = {"name": "a", "url": "http://127.0.0.1:9000"}
SOURCE = {"backend_name": "a", "endpoint": "http://127.0.0.1:7817/events/a"}
LISTENER_SOURCE = {"backend_name": "a", "engine": "vllm", "model": "m",
                   "zmq_endpoint": "tcp://127.0.0.1:5557", "allowed_publishers": ["127.0.0.1"],
                   "detokenize_endpoint": "http://127.0.0.1:8000/detokenize"}


def _errors(data: dict) -> dict[str, str]:
    return {e.path: e.message for e in check_config({"backends": [BACKEND], **data}).errors}


def test_server_limits_defaults_and_ranges() -> None:
    cfg = parse_config({"backends": [BACKEND]})
    assert cfg.server.max_upstream_response_bytes == 64 * 1024 * 1024
    assert cfg.server.max_stream_duration_seconds == 0.0
    assert parse_config({"backends": [BACKEND], "server": {
        "max_stream_duration_seconds": "10m"}}).server.max_stream_duration_seconds == 600.0
    errors = _errors({"server": {"max_upstream_response_bytes": 10,
                                 "max_stream_duration_seconds": -1}})
    assert errors["server.max_upstream_response_bytes"].startswith("must be between 1024")
    assert errors["server.max_stream_duration_seconds"].startswith("must be between 0")
    text = defaults_text()
    assert "max_upstream_response_bytes: 67108864" in text
    assert "max_stream_duration_seconds:" in text and "listener_token_file: null" in text


def test_router_listener_tokens_come_from_a_file_or_env(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    token_file = tmp_path / "token"
    token_file.write_text("per-source\n")
    monkeypatch.setenv("KV_TOKEN", "index-wide")
    cfg = parse_config({"backends": [BACKEND], "kv_cache_index": {
        "listener_token_env": "KV_TOKEN",
        "event_sources": [{**SOURCE, "token_file": str(token_file)},
                          {**SOURCE, "backend_name": "b"}]}})
    kv = cfg.kv_cache_index
    assert [kv.source_token(s) for s in kv.event_sources] == ["per-source", "index-wide"]


def test_inline_unreadable_and_conflicting_tokens_are_errors(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("NO_SUCH_TOKEN", raising=False)
    empty = tmp_path / "empty"
    empty.write_text("\n")
    spaced = tmp_path / "spaced"
    spaced.write_text("two words")
    errors = _errors({"kv_cache_index": {
        "listener_token": "inline",
        "event_sources": [
            {**SOURCE, "token": "inline"},
            {**SOURCE, "backend_name": "b", "token_file": str(tmp_path / "missing")},
            {**SOURCE, "backend_name": "c", "token_file": str(empty)},
            {**SOURCE, "backend_name": "d", "token_env": "NO_SUCH_TOKEN"},
            {**SOURCE, "backend_name": "e", "token_file": str(spaced)},
            {**SOURCE, "backend_name": "f", "token_file": str(empty), "token_env": "X"},
        ]}})
    sources = "kv_cache_index.event_sources"
    assert errors["kv_cache_index.listener_token"].startswith(
        "is never read from the config file: put the secret in a file (listener_token_file)")
    assert errors[f"{sources}[0].token"].startswith("is never read from the config file")
    assert errors[f"{sources}[1].token_file"].startswith("cannot read the file")
    assert errors[f"{sources}[2].token_file"] == "the file is empty"
    assert errors[f"{sources}[3].token_env"] == "environment variable is not set or empty"
    assert errors[f"{sources}[4].token_file"] == (
        "the secret must be printable ASCII without spaces")
    assert errors[f"{sources}[5].token_env"] == "set either token_file or token_env, not both"


def test_listener_keys(tmp_path: Path) -> None:
    token_file = tmp_path / "token"
    token_file.write_text("s3cret\n")
    config, errors, _ = check_listener_config({
        "sources": [LISTENER_SOURCE], "max_subscribers": 3,
        "events_auth": {"token_file": str(token_file)},
        "limits": {"max_message_bytes": 1 << 20, "max_sequence_streams": 16},
        "detokenize": {"max_response_bytes": 65536}})
    assert errors == [] and config is not None
    assert config.events_auth.resolved() == "s3cret"
    assert (config.max_subscribers, config.limits.max_message_bytes,
            config.limits.max_sequence_streams, config.detokenize.max_response_bytes) == (
        3, 1 << 20, 16, 65536)
    defaults = ListenerConfig()
    assert defaults.events_auth.resolved() is None and defaults.max_subscribers == 256
    assert defaults.limits.max_message_bytes == 8 * 1024 * 1024
    _, errors, _ = check_listener_config({
        "sources": [LISTENER_SOURCE], "events_auth": {"token": "inline"},
        "max_subscribers": 0, "limits": {"max_message_bytes": 10}})
    messages = {e.path: e.message for e in errors}
    assert messages["events_auth.token"].startswith("is never read from the config file")
    assert messages["max_subscribers"].startswith("must be between 1")
    assert messages["limits.max_message_bytes"].startswith("must be between 65536")
