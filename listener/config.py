"""``continuum-kv-listener`` configuration: the same loader, path-named errors as the router.

See ``conf/config.kv-listener.yaml.example`` for a commented example and
``continuum-kv-listener --print-defaults`` for every key.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

from continuum.config.addresses import MAX_PORT, check_host_port, check_url, port_problem
from continuum.config.fields import (
    Issues,
    build_section,
    check_secret_source,
    from_env,
    join,
    secret_from_file_or_env,
    setting,
)
from continuum.config.loader import read_yaml
from continuum.errors import ConfigError, ConfigIssue
from listener.bus_config import BusClientConfig

SOURCE_NAME = r"[A-Za-z0-9_-]{1,64}"
ENGINES = ("vllm", "sglang", "trtllm")
TEMPLATES = ("auto", "chatml", "llama3")
#: Most data-parallel ranks one ZMQ source subscribes to (``data_parallel_size``).
MAX_DATA_PARALLEL = 256
_WILDCARD_HOSTS = ("*", "0.0.0.0", "::", "[::]", "")


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
    max_chain_text_bytes: int = setting(
        16777216, doc="token ids of recent chains kept so that any of their blocks can be "
        "extended with chain keys (4 bytes a token; 0: no chain keys, only the seed key)",
        min=0,
        max=10_000_000_000)
    max_message_bytes: int = setting(
        8 * 1024 * 1024, doc="largest ZMQ message part accepted (ZMQ_MAXMSGSIZE); a larger "
        "one drops the publisher's connection, which reconnects", min=65536, max=1024**3)
    max_sequence_streams: int = setting(
        1024, doc="(topic, rank) sequence counters kept per source, least recently used "
        "dropped first; a ZMQ source's data_parallel_size and a TensorRT-LLM engine's "
        "attention-DP ranks each need one per rank",
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
    secret_env: str | None = setting(None, doc="environment variable holding the secret",
                                     env_var=True)

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
    zmq_endpoint: str | None = setting(None, doc="vLLM/SGLang KV event PUB endpoint",
                                       credentials=True)
    zmq_mode: str = setting("bind", doc="bind (engines connect to us) or connect",
                            choices=("bind", "connect"))
    zmq_topic: str = setting("", doc="topic filter (engines default to the empty topic)")
    data_parallel_size: int = setting(
        1, doc="vLLM/SGLang data-parallel ranks behind this one backend: rank r publishes on "
        "zmq_endpoint (and replay_endpoint) offset by r as the engines do (tcp port + r, "
        "inproc name + _dp<r>); the source takes every rank's stream and keys blocks per rank",
        min=1, max=MAX_DATA_PARALLEL)
    replay_endpoint: str | None = setting(
        None, doc="the engine's ROUTER replay endpoint, asked at start and after a "
        "sequence gap", credentials=True)
    detokenize_endpoint: str | None = setting(
        None, doc="the engine's /detokenize URL (its /tokenize is derived from it)",
        credentials=True)
    trtllm_endpoint: str | None = setting(None, doc="trtllm-serve's /kv_cache_events URL",
                                          credentials=True)
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
    chain_chunk_bytes: int = setting(1024, doc="must equal the router's "
                                     "kv_cache_index.chain.chunk_bytes", min=64, max=65536)
    chain_max_keys: int = setting(128, doc="must equal the router's "
                                  "kv_cache_index.chain.max_keys", min=1, max=1024)
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
                parts = check_url(join(path, "trtllm_endpoint"), self.trtllm_endpoint, issues,
                                  ("http", "https"), "an http(s) URL")
                if parts is not None and parts.hostname not in self.allowed_publishers:
                    issues.error(join(path, "trtllm_endpoint"),
                                 "host is not in allowed_publishers", parts.hostname)
            if self.require_salt is False:
                issues.error(join(path, "require_salt"), "trtllm-serve has no /detokenize: "
                             "router-issued salts are the only way to attribute its blocks")
            if self.data_parallel_size > 1:
                issues.error(join(path, "data_parallel_size"), "must be 1 for engine: trtllm "
                             "(trtllm-serve reports every attention-DP rank in one "
                             "/kv_cache_events reply, each event tagged with its rank)",
                             self.data_parallel_size)
        else:
            if not self.zmq_endpoint:
                issues.error(join(path, "zmq_endpoint"), f"is required for engine: {self.engine}")
            elif not self.zmq_endpoint.startswith(("tcp://", "ipc://", "inproc://")):
                issues.error(join(path, "zmq_endpoint"), "must be a tcp://, ipc:// or "
                             "inproc:// endpoint", self.zmq_endpoint)
            else:
                check_tcp_port(join(path, "zmq_endpoint"), self.zmq_endpoint, issues)
                check_rank_endpoints(join(path, "zmq_endpoint"), self.zmq_endpoint,
                                     self.data_parallel_size, issues)
            if self.replay_endpoint:
                check_tcp_port(join(path, "replay_endpoint"), self.replay_endpoint, issues)
                check_rank_endpoints(join(path, "replay_endpoint"), self.replay_endpoint,
                                     self.data_parallel_size, issues)
                self._check_replay_ports(join(path, "replay_endpoint"), issues)
            if not self.salt_required and not self.detokenize_endpoint:
                issues.error(join(path, "detokenize_endpoint"),
                             "is required unless require_salt: true")
        if self.detokenize_endpoint:
            check_url(join(path, "detokenize_endpoint"), self.detokenize_endpoint, issues,
                      ("http", "https"), "an http(s) URL")


    def rank_ports(self, key: str) -> tuple[str, int, int] | None:
        """``(host, first port, ranks)`` of the tcp ports every rank uses for ``key``
        (``zmq_endpoint`` or ``replay_endpoint``): P .. P + N - 1 on ``host``; None for a
        trtllm source, an endpoint that is not ``tcp://host:port`` with a port from 1 or
        one whose ranks cannot be offset (errors of their own)."""
        endpoint = getattr(self, key)
        ranks = self.data_parallel_size
        if self.engine == "trtllm" or not endpoint or rank_endpoint_problem(endpoint, ranks):
            return None
        found = _tcp_host_port(endpoint)
        return None if found is None else (found[0], found[1], ranks)

    def _check_replay_ports(self, path: str, issues: Issues) -> None:
        """The ranks' PUB ports and replay ports may not overlap on one host: rank ``r``'s
        PUB port would be rank ``s``'s replay port (e.g. PUB 5557 and replay 5558 with two
        ranks: rank 1 publishes on 5558)."""
        pub, replay = self.rank_ports("zmq_endpoint"), self.rank_ports("replay_endpoint")
        if pub is None or replay is None or not same_host(pub[0], replay[0]):
            return
        first_pub, first_replay, ranks = pub[1], replay[1], pub[2]
        if abs(first_pub - first_replay) >= ranks:
            return
        port = max(first_pub, first_replay)
        if ranks == 1:
            message = f"port {port} is zmq_endpoint's port too, on the same host"
        else:
            message = (f"rank {port - first_replay}'s replay port {port} is rank "
                       f"{port - first_pub}'s zmq_endpoint port on the same host (ports "
                       f"{first_replay}..{first_replay + ranks - 1} overlap "
                       f"{first_pub}..{first_pub + ranks - 1}; data_parallel_size: {ranks})")
        issues.error(path, message, self.replay_endpoint)


def _tcp_host_port(endpoint: str) -> tuple[str, int] | None:
    """``(host, port)`` of ``tcp://host:port`` (the destination of ``source;destination``,
    a bracketed host without its brackets) with a port from 1 to 65535, else None."""
    if not endpoint.startswith("tcp://"):
        return None
    host, _, port = endpoint[len("tcp://"):].rsplit(";", 1)[-1].rpartition(":")
    if not (port.isascii() and port.isdigit()) or not 0 < int(port) <= MAX_PORT:
        return None
    return (host[1:-1] if host.startswith("[") and host.endswith("]") else host), int(port)


_LOOPBACK = ("localhost", "127.0.0.1", "::1")


def same_host(a: str, b: str) -> bool:
    """Whether two endpoint hosts certainly share their ports: the same text, a wildcard
    bind (every local address) and a loopback or wildcard one, or two names of the
    loopback. Anything else may be two machines (or two addresses of one)."""
    if a == b:
        return True
    local = _WILDCARD_HOSTS + _LOOPBACK
    if a in _WILDCARD_HOSTS or b in _WILDCARD_HOSTS:
        return (a in local or a.startswith("127.")) and (b in local or b.startswith("127."))
    return a in _LOOPBACK and b in _LOOPBACK


def check_tcp_port(path: str, endpoint: str, issues: Issues) -> None:
    """A ``tcp://host:port`` ZMQ endpoint's host has no spaces and its port is 0 to 65535
    or ZMQ's wildcard (``*``, ``!``); other transports are left to ZMQ."""
    if not endpoint.startswith("tcp://"):
        return
    address = endpoint[len("tcp://"):].rsplit(";", 1)[-1]  # "source;destination"
    host, _, port = address.rpartition(":")
    if not host or any(ch.isspace() for ch in host):
        issues.error(path, "must be tcp://host:port (the host without spaces)", endpoint)
    elif port not in ("*", "!") and (problem := port_problem(port, 0)):
        issues.error(path, problem, endpoint)


def offset_endpoint(endpoint: str, rank: int) -> str:
    """The endpoint data-parallel rank ``rank`` of vLLM or SGLang uses for ``endpoint``
    (``docs/kv-events.md`` §1.1, both the PUB and the replay endpoint): rank 0 keeps it, a
    ``tcp://`` port gains ``rank``, an ``inproc://`` name gains ``_dp<rank>``. The endpoint
    must pass :func:`rank_endpoint_problem`."""
    if rank == 0:
        return endpoint
    if endpoint.startswith("inproc://"):
        return f"{endpoint}_dp{rank}"
    base, _, port = endpoint.rpartition(":")
    return f"{base}:{int(port) + rank}"


def rank_endpoint_problem(endpoint: str, ranks: int) -> str | None:
    """Why the engines' per-rank rule cannot give ``ranks`` endpoints from ``endpoint``, or
    None (always None for one rank; a malformed tcp port is :func:`check_tcp_port`'s)."""
    if ranks <= 1 or endpoint.startswith("inproc://"):
        return None
    if not endpoint.startswith("tcp://"):
        return ("vLLM and SGLang offset only tcp:// ports and inproc:// names per data-parallel "
                "rank (their ranks > 0 cannot use this endpoint): use tcp:// or inproc://")
    if "inproc" in endpoint:
        return ("the engines offset an endpoint containing 'inproc' as an inproc:// name "
                "(rank r appends _dp<r>): name the host differently")
    port = endpoint.rpartition(":")[2]
    if port in ("*", "!"):
        return (f"a wildcard port cannot be offset per rank (data_parallel_size: {ranks}): "
                "name rank 0's port")
    if not (port.isascii() and port.isdigit()) or int(port) > MAX_PORT:
        return None  # check_tcp_port's error
    if int(port) == 0:
        return (f"port 0 cannot be offset per rank (data_parallel_size: {ranks}; vLLM from "
                "0.31 keeps port 0 for every rank): name rank 0's port")
    last = int(port) + ranks - 1
    if last > MAX_PORT:
        return (f"ranks 0..{ranks - 1} need ports {port}..{last} (data_parallel_size: "
                f"{ranks}), beyond {MAX_PORT}")
    return None


def check_rank_endpoints(path: str, endpoint: str, ranks: int, issues: Issues) -> None:
    """Record :func:`rank_endpoint_problem` of ``endpoint`` at ``path``."""
    problem = rank_endpoint_problem(endpoint, ranks)
    if problem:
        issues.error(path, problem, endpoint)


def rank_endpoints(endpoint: str, ranks: int) -> list[str]:
    """Every rank's endpoint, rank 0 first (see :func:`offset_endpoint`).

    Raises:
        ValueError: The endpoint cannot be offset ``ranks`` times.
    """
    problem = rank_endpoint_problem(endpoint, ranks)
    if problem:
        raise ValueError(f"{endpoint}: {problem}")
    return [offset_endpoint(endpoint, rank) for rank in range(ranks)]


def _bound_ports(source: SourceConfig) -> list[tuple[str, int, int]]:
    """``(host, port, rank)`` of every tcp port a bind-mode ZMQ source binds (none for port
    0, wildcards or malformed endpoints)."""
    endpoint = source.zmq_endpoint
    if (source.engine == "trtllm" or source.zmq_mode != "bind" or not endpoint
            or not endpoint.startswith("tcp://")
            or rank_endpoint_problem(endpoint, source.data_parallel_size)):
        return []
    parsed = _tcp_host_port(endpoint)
    if parsed is None:
        return []
    host, first = parsed
    return [(host, first + rank, rank) for rank in range(source.data_parallel_size)
            if first + rank <= MAX_PORT]


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
    event_bus: BusClientConfig | None = setting(
        None, doc="push mode: also push every source's stream to the router's event bus")

    def check(self, path: str, issues: Issues) -> None:
        check_host_port("listen", self.listen, issues, lowest_port=0)  # 0: any free port
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
            streams = self.limits.max_sequence_streams
            if source.engine != "trtllm" and source.data_parallel_size > streams:
                issues.error(f"sources[{i}].data_parallel_size", "needs "
                             f"limits.max_sequence_streams of at least {source.data_parallel_size}"
                             f" (one sequence counter per rank), not {streams}",
                             source.data_parallel_size)
        self._check_bound_ports(issues)
        self._check_listen_port(issues)
        if not self.sources:
            issues.warn("sources", "no sources: the listener will serve empty streams")

    def _check_bound_ports(self, issues: Issues) -> None:
        """Two bind-mode sources may not bind one port (data-parallel ranks included)."""
        taken: dict[int, list[tuple[str, int, int]]] = {}  # port → (host, source, rank)
        for i, source in enumerate(self.sources):
            if source is None:
                continue
            for host, port, rank in _bound_ports(source):
                for other_host, other, other_rank in taken.get(port, ()):
                    # a wildcard binds every local address, whatever the other names
                    if other != i and (same_host(host, other_host) or host in _WILDCARD_HOSTS
                                       or other_host in _WILDCARD_HOSTS):
                        issues.error(f"sources[{i}].zmq_endpoint", f"port {port} (rank {rank}) "
                                     f"is also bound by sources[{other}] (rank {other_rank})",
                                     source.zmq_endpoint)
                        return
                taken.setdefault(port, []).append((host, i, rank))

    def _check_listen_port(self, issues: Issues) -> None:
        """No rank's PUB or replay port may be the listener's own HTTP port (``listen``) on
        the same host: the listener (bind mode) or the engine could not bind it, or the
        listener would dial its own HTTP server."""
        found = _tcp_host_port(f"tcp://{self.listen}")
        if found is None:  # port 0 (any free port) or malformed (check_host_port's error)
            return
        host, port = found
        for i, source in enumerate(self.sources):
            if source is None:
                continue
            for key in ("zmq_endpoint", "replay_endpoint"):
                ranks = source.rank_ports(key)
                if ranks is None or not same_host(ranks[0], host):
                    continue
                first, count = ranks[1], ranks[2]
                if first <= port < first + count:
                    rank = f" (data-parallel rank {port - first})" if count > 1 else ""
                    issues.error(f"sources[{i}].{key}", f"port {port}{rank} is the "
                                 f"listener's own HTTP port (listen: {self.listen})",
                                 getattr(source, key))


def check_listener_config(data: Any, source: str = "<config>") -> tuple[
        ListenerConfig | None, list[ConfigIssue], list[ConfigIssue]]:
    """Read a parsed YAML document: (config or None, errors, warnings)."""
    issues = Issues()
    config = build_section(ListenerConfig, data, "", issues)
    issues.redact(ListenerConfig)
    return (None if issues.errors else config), issues.errors, issues.warnings


def check_listener_file(path: str | os.PathLike[str]) -> tuple[
        ListenerConfig | None, list[ConfigIssue], list[ConfigIssue]]:
    """Read and check a listener config file: (config or None, errors, warnings).

    ``listener.app.listener_issues`` adds the checks that need the sources' code (the
    CLI runs both). Every issue carries the ``line:column`` of its key; duplicate keys
    are errors."""
    try:
        doc = read_yaml(path)
    except ConfigError as exc:
        return None, exc.issues, []
    config, errors, warnings = check_listener_config(doc.data, str(path))
    errors = doc.annotate(errors, warnings)
    return (None if errors else config), errors, warnings
