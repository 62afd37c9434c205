"""``continuum-kv-listener`` configuration: the same loader, path-named errors as the router.

See ``conf/config.kv-listener.yaml.example`` for a commented example and
``continuum-kv-listener --print-defaults`` for every key.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import yaml

from continuum.config.fields import (
    Issues,
    build_section,
    check_secret_source,
    from_env,
    join,
    secret_from_file_or_env,
    setting,
)
from continuum.errors import ConfigIssue

SOURCE_NAME = r"[A-Za-z0-9_-]{1,64}"
ENGINES = ("vllm", "sglang", "trtllm")
TEMPLATES = ("auto", "chatml", "llama3")


@dataclass(frozen=True)
class LimitsConfig:
    """``limits``: memory bounds of the block-chain tracker and the ZMQ input, per source."""

    max_chain_tokens: int = setting(
        16384, doc="longest token chain rebuilt for /detokenize; longer chains stay "
        "unattributed", min=1, max=10_000_000)
    max_tracked_blocks: int = setting(
        100000, doc="block metadata entries kept (oldest pruned first)", min=1,
        max=100_000_000)
    max_retained_tokens: int = setting(
        16777216, doc="token ids kept (4 bytes each; 64 MiB by default), oldest pruned first",
        min=1, max=1_000_000_000)
    max_message_bytes: int = setting(
        8 * 1024 * 1024, doc="largest ZMQ message part accepted (ZMQ_MAXMSGSIZE); a larger "
        "one drops the publisher's connection, which reconnects", min=65536, max=1024**3)
    max_sequence_streams: int = setting(
        1024, doc="(topic, rank) sequence counters kept; least recently used dropped first",
        min=1, max=1_000_000)


@dataclass(frozen=True)
class DetokenizeConfig:
    """``detokenize``: how the listener calls the engines' /tokenize and /detokenize."""

    timeout_ms: int = setting(2000, doc="per-call timeout", min=10, max=60000)
    max_concurrent: int = setting(4, doc="calls in flight per source", min=1, max=256)
    cache_entries: int = setting(4096, doc="recovered chain texts remembered per source",
                                 min=0, max=10_000_000)
    max_response_bytes: int = setting(
        4 * 1024 * 1024, doc="largest /tokenize or /detokenize reply read; a larger one is a "
        "failed call", min=1024, max=1024**3)


@dataclass(frozen=True)
class EventsAuthConfig:
    """``events_auth``: the bearer token ``/events`` requires (the router's
    ``kv_cache_index.listener_token_file``/``_env``); none set: the streams are open."""

    token: str | None = setting(None, doc="never inline (an error): use token_file or "
                                "token_env", secret=True)
    token_file: str | None = setting(None, doc="file holding the token")
    token_env: str | None = setting(None, doc="environment variable holding the token")

    def resolved(self) -> str | None:
        """The token, read now (None: /events is open)."""
        return secret_from_file_or_env(self.token_file, self.token_env)

    def check(self, path: str, issues: Issues) -> None:
        check_secret_source(path, issues, "token", inline=self.token, file=self.token_file,
                            env_name=self.token_env)


@dataclass(frozen=True)
class SaltConfig:
    """``cache_salt``: verify router-issued salts (the router's kv_cache_index.cache_salt)."""

    secret: str | None = setting(None, doc="shared HMAC secret", secret=True)
    secret_env: str | None = setting(None, doc="environment variable holding the secret")

    def resolved(self) -> bytes | None:
        value = from_env(self.secret, self.secret_env)
        return value.encode() if value else None

    def check(self, path: str, issues: Issues) -> None:
        if self.secret is not None and self.secret_env is not None:
            issues.error(join(path, "secret_env"), "set either secret or secret_env, not both")
        if self.secret_env is not None and not os.environ.get(self.secret_env):
            issues.error(join(path, "secret_env"), "environment variable is not set",
                         self.secret_env)


@dataclass(frozen=True)
class SourceConfig:
    """``sources[]``: one engine whose KV events become the stream ``/events/<backend_name>``."""

    backend_name: str = setting(doc="the router's backend name for this engine",
                                pattern=SOURCE_NAME)
    engine: str = setting(doc="engine kind", choices=ENGINES)
    model: str = setting(doc="model name the router sees (part of every prefix key)")
    zmq_endpoint: str | None = setting(None, doc="vLLM/SGLang KV event PUB endpoint")
    zmq_mode: str = setting("bind", doc="bind (engines connect to us) or connect",
                            choices=("bind", "connect"))
    zmq_topic: str = setting("", doc="topic filter (engines default to the empty topic)")
    replay_endpoint: str | None = setting(
        None, doc="the engine's ROUTER replay endpoint, asked at start and after a "
        "sequence gap")
    detokenize_endpoint: str | None = setting(
        None, doc="the engine's /detokenize URL (its /tokenize is derived from it)")
    trtllm_endpoint: str | None = setting(None, doc="trtllm-serve's /kv_cache_events URL")
    trtllm_poll_interval_ms: int = setting(100, doc="poll interval of /kv_cache_events",
                                           min=10, max=60000)
    allowed_publishers: tuple[str, ...] = setting(
        default_factory=tuple, doc="IP addresses allowed to publish (bind mode) or to be "
        "polled (trtllm); required")
    template: str = setting("auto", doc="chat template: auto (learned via /tokenize) or "
                            "explicit", choices=TEMPLATES)
    block_size: int | None = setting(None, doc="expected block size; None = learned from "
                                     "events", min=1, max=1_000_000)
    max_prefix_length: int = setting(1024, doc="must equal the router's "
                                     "prefix_routing.max_prefix_length", min=1, max=1048576)
    require_salt: bool | None = setting(
        None, doc="attribute only chains with a valid router-issued salt (default: true for "
        "trtllm, false otherwise)")

    @property
    def salt_required(self) -> bool:
        return self.require_salt if self.require_salt is not None else self.engine == "trtllm"

    def check(self, path: str, issues: Issues) -> None:
        if not self.allowed_publishers:
            issues.error(join(path, "allowed_publishers"),
                         "list the engine's IP addresses (events from others are refused)")
        if self.engine == "trtllm":
            if not self.trtllm_endpoint:
                issues.error(join(path, "trtllm_endpoint"), "is required for engine: trtllm")
            else:
                parts = urlsplit(self.trtllm_endpoint)
                if parts.scheme not in ("http", "https") or not parts.hostname:
                    issues.error(join(path, "trtllm_endpoint"), "must be an http(s) URL",
                                 self.trtllm_endpoint)
                elif parts.hostname not in self.allowed_publishers:
                    issues.error(join(path, "trtllm_endpoint"),
                                 "host is not in allowed_publishers", parts.hostname)
            if self.require_salt is False:
                issues.error(join(path, "require_salt"), "trtllm-serve has no /detokenize: "
                             "router-issued salts are the only way to attribute its blocks")
        else:
            if not self.zmq_endpoint:
                issues.error(join(path, "zmq_endpoint"), f"is required for engine: {self.engine}")
            elif not self.zmq_endpoint.startswith(("tcp://", "ipc://", "inproc://")):
                issues.error(join(path, "zmq_endpoint"), "must be a tcp://, ipc:// or "
                             "inproc:// endpoint", self.zmq_endpoint)
            if not self.salt_required and not self.detokenize_endpoint:
                issues.error(join(path, "detokenize_endpoint"),
                             "is required unless require_salt: true")
        for name in ("detokenize_endpoint",):
            value = getattr(self, name)
            if value and urlsplit(value).scheme not in ("http", "https"):
                issues.error(join(path, name), "must be an http(s) URL", value)


@dataclass(frozen=True)
class ListenerConfig:
    """The whole ``config.kv-listener.yaml``."""

    listen: str = setting("127.0.0.1:7817", doc="host:port of the SSE server")
    history_size: int = setting(
        10000, doc="events kept per backend for Last-Event-ID resume", min=1, max=10_000_000)
    subscriber_queue: int = setting(
        10000, doc="events queued for one slow subscriber before it is closed with "
        "buffer_overflow", min=1, max=10_000_000)
    max_subscribers: int = setting(
        256, doc="open /events subscriptions per backend; more are refused with 503",
        min=1, max=100_000)
    events_auth: EventsAuthConfig = setting(default_factory=EventsAuthConfig,
                                            doc="bearer token for /events")
    log_level: str = setting("info", doc="log level",
                             choices=("debug", "info", "warning", "error"))
    limits: LimitsConfig = setting(default_factory=LimitsConfig, doc="tracker memory limits")
    detokenize: DetokenizeConfig = setting(default_factory=DetokenizeConfig,
                                           doc="/detokenize calls")
    cache_salt: SaltConfig = setting(default_factory=SaltConfig,
                                     doc="router-issued salt verification")
    sources: tuple[SourceConfig, ...] = setting(default_factory=tuple, doc="engines")

    def check(self, path: str, issues: Issues) -> None:
        host, _, port = self.listen.rpartition(":")
        if not host or not port.isdigit():
            issues.error("listen", "must be host:port", self.listen)
        seen: set[str] = set()
        for i, source in enumerate(self.sources):
            if source is None:
                continue
            if source.backend_name in seen:
                issues.error(f"sources[{i}].backend_name", "duplicate source", source.backend_name)
            seen.add(source.backend_name)
            if source.salt_required and self.cache_salt.resolved() is None:
                issues.error(f"sources[{i}].require_salt",
                             "needs cache_salt.secret (or secret_env) to verify salts")
        if not self.sources:
            issues.warn("sources", "no sources: the listener will serve empty streams")


def check_listener_config(data: Any, source: str = "<config>") -> tuple[
        ListenerConfig | None, list[ConfigIssue], list[ConfigIssue]]:
    """Read a parsed YAML document: (config or None, errors, warnings)."""
    issues = Issues()
    config = build_section(ListenerConfig, data, "", issues)
    return (None if issues.errors else config), issues.errors, issues.warnings


def check_listener_file(path: str | os.PathLike[str]) -> tuple[
        ListenerConfig | None, list[ConfigIssue], list[ConfigIssue]]:
    """Read and check a listener config file: (config or None, errors, warnings).

    ``listener.app.listener_issues`` adds the checks that need the sources' code (the
    CLI runs both)."""
    try:
        data = yaml.safe_load(Path(path).read_text(encoding="utf-8")) or {}
    except (OSError, yaml.YAMLError) as exc:
        return None, [ConfigIssue("<file>", f"cannot read: {exc}")], []
    return check_listener_config(data, str(path))
