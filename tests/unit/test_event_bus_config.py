"""Push-mode config: the router's dynamo.event_bus and the listener's event_bus, every
error naming its key path."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from continuum.config import check_config
from continuum.kv.bus import BusRefused, BusRegistry, Hello, token_digest
from listener.config import check_listener_config

HASH = "sha256:" + "ab" * 32


def router_errors(doc: dict[str, Any]) -> list[str]:
    return [f"{i.path}: {i.message}" for i in check_config(doc).errors]


def bus(tmp_path: Path, **extra: Any) -> dict[str, Any]:
    cert = tmp_path / "c.pem"
    cert.write_text("x")
    return {"event_bus": {"enabled": True, "listen": "127.0.0.1:9443",
                          "tls": {"cert": str(cert), "key": str(cert)}, **extra}}


def test_router_bus_errors_name_their_key_paths(tmp_path: Path) -> None:
    errors = router_errors({
        "dynamo": bus(tmp_path, brokers=[
            {"id": "a", "role": "kv_listener", "token_hash": "sha256:ABCD",
             "backends": ["vllm-1"]},
            {"id": "b", "role": "admin", "token_hash": HASH},
            {"id": "a", "role": "broker", "token_hash": HASH}]),
        "kv_cache_index": {"enabled": True, "event_sources": [
            {"backend_name": "vllm-1", "transport": "event_bus",
             "endpoint": "http://l:7817/events/vllm-1"}]},
    })
    assert any(e.startswith("dynamo.event_bus.brokers[0].token_hash: must be \"sha256:\"")
               for e in errors), errors
    assert any(e.startswith("dynamo.event_bus.brokers[1].role: must be one of") for e in errors)
    assert any(e.startswith("dynamo.event_bus.brokers[2].id: duplicate broker id")
               for e in errors)
    assert any(e.startswith("kv_cache_index.event_sources[0].endpoint: must be omitted with "
                            "transport: event_bus") for e in errors)


def test_router_bus_needs_tls_and_the_bus_enabled(tmp_path: Path) -> None:
    errors = router_errors({"dynamo": {"event_bus": {"enabled": True}}})
    assert "dynamo.event_bus.tls.cert: required when event_bus.enabled (the bus is TLS " \
        "only)" in errors
    errors = router_errors({"kv_cache_index": {"event_sources": [
        {"backend_name": "vllm-1", "transport": "event_bus"}]}})
    assert errors == ["kv_cache_index.event_sources[0].transport: needs "
                      "dynamo.event_bus.enabled: true"]
    ok = check_config({"dynamo": bus(tmp_path, brokers=[
        {"id": "kv-a", "role": "kv_listener", "token_hash": HASH, "backends": ["vllm-1"]}]),
        "kv_cache_index": {"event_sources": [
            {"backend_name": "vllm-1", "transport": "event_bus"}]}})
    assert ok.errors == [] and ok.config is not None
    assert ok.config.dynamo.event_bus.brokers[0].backends == ("vllm-1",)


def listener_errors(section: dict[str, Any]) -> list[str]:
    _, errors, _ = check_listener_config({"event_bus": section})
    return [f"{i.path}: {i.message}" for i in errors]


def test_listener_bus_errors(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    assert listener_errors({"url": "http://router:9443", "client_id": "a",
                            "credential_env": "HOME"}) == [
        "event_bus.url: must be an https://host[:port] URL (the bus is TLS only)"]
    assert listener_errors({"url": "https://router/path", "client_id": "a",
                            "credential_env": "HOME"}) == [
        "event_bus.url: must be https://host[:port] only (no path, query or user)"]
    assert "event_bus.credential: is never read from the config file: put the secret in a " \
        "file (credential_file) or an environment variable (credential_env)" in \
        listener_errors({"url": "https://r", "client_id": "a", "credential": "s3cret"})
    assert listener_errors({"url": "https://r", "client_id": "a"}) == [
        "event_bus.credential_file: set credential_file, credential_env or client_cert_file "
        "+ client_key_file"]
    pem = tmp_path / "c.pem"
    pem.write_text("x")
    assert listener_errors({"url": "https://r", "client_id": "a",
                            "client_cert_file": str(pem)}) == [
        "event_bus.client_key_file: client_cert_file and client_key_file go together"]
    monkeypatch.setenv("BUS_TOKEN", "t0k")
    config, errors, _ = check_listener_config({"event_bus": {
        "url": "https://router.example.com", "client_id": "kv-a", "credential_env":
        "BUS_TOKEN", "reconnect_backoff": {"initial": "500ms", "max": "30s"},
        "drain_deadline": "2s"}})
    assert errors == [] and config is not None and config.event_bus is not None
    assert config.event_bus.address == ("router.example.com", 443)
    assert config.event_bus.reconnect_backoff.initial == 0.5
    assert config.event_bus.resolved_credential() == "t0k"


def test_registry_authenticates_and_forbids_on_shrink() -> None:
    from continuum.config.event_bus import BrokerConfig

    a = BrokerConfig(id="kv-a", role="kv_listener", token_hash=token_digest("tok"),
                     backends=("vllm-1", "vllm-2"))
    m = BrokerConfig(id="kv-m", role="kv_listener", backends=("vllm-1",))
    registry = BusRegistry([a, m])
    hello = Hello.parse({"type": "hello", "role": "kv_listener", "client_id": "kv-a",
                         "sources": ["vllm-1"]})
    with pytest.raises(BusRefused) as refused:
        registry.admit(hello, "wrong", frozenset())
    assert (refused.value.status, refused.value.reason) == (401, "unauthenticated")
    with pytest.raises(BusRefused) as refused:  # a certificate for another id
        registry.admit(hello, None, frozenset({"kv-m"}))
    assert refused.value.reason == "unauthenticated"
    with pytest.raises(BusRefused) as refused:
        registry.admit(Hello("broker", "kv-a", ("vllm-1",)), "tok", frozenset())
    assert (refused.value.status, refused.value.reason) == (403, "wrong_role")
    with pytest.raises(BusRefused) as refused:
        registry.admit(Hello("kv_listener", "kv-a", ("vllm-9",)), "tok", frozenset())
    assert refused.value.reason == "unlisted_backend" and "vllm-9" in refused.value.message
    by_token = registry.admit(hello, "tok", frozenset())
    by_cert = registry.admit(Hello("kv_listener", "kv-m", ("vllm-1",)), None,
                             frozenset({"kv-m"}))
    assert registry.pick("vllm-1") is by_token
    by_token.draining = True
    assert registry.pick("vllm-1") is by_cert and registry.pick("vllm-2") is None
    ended = registry.update_brokers([BrokerConfig(id="kv-a", role="kv_listener",
                                                  token_hash=a.token_hash,
                                                  backends=("vllm-2",)), m])
    assert [(s.id, "vllm-1" in why) for s, why in ended] == [(by_token.id, True)]
    assert registry.sessions == [by_cert]
    with pytest.raises(BusRefused) as refused:
        Hello.parse({"type": "hello", "role": "kv_listener", "client_id": "x",
                     "sources": ["bad name"]})
    assert refused.value.reason == "bad_hello"
