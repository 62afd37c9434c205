"""The router's config sections: every key, its default, range and meaning.

Later tiers add their sections here; ``continuum-router config defaults`` prints this table.
"""

from __future__ import annotations

import importlib.util
import os
from collections.abc import Sequence
from dataclasses import dataclass

from continuum.config.addresses import check_host_port, check_url
from continuum.config.event_bus import DynamoConfig, check_event_bus_sources
from continuum.config.fields import (
    Issues,
    check_secret_source,
    from_env,
    join,
    secret_from_file_or_env,
    setting,
)
from continuum.errors import ConfigIssue

NAME_PATTERN = r"[A-Za-z0-9_-]{1,64}"
BACKEND_TYPES = ("openai", "anthropic", "gemini")


@dataclass(frozen=True)
class ServerConfig:
    """``server``: how the router listens and what it accepts."""

    bind: str = setting("127.0.0.1:8080", doc="host:port gunicorn binds", restart=True)
    workers: int = setting(
        1, doc="gunicorn gevent worker processes (state is per worker)", min=1, max=256,
        restart=True,
    )
    worker_connections: int = setting(
        1000, doc="concurrent connections per gevent worker", min=1, max=100000, restart=True
    )
    balance_connections: bool = setting(
        True, doc="with several workers, a worker holding more client connections than "
        "the least loaded other worker plus one leaves new ones to the others (for at most "
        "2 ms), so a client's kept-alive pool spreads over every worker", restart=True,
    )
    max_body_bytes: int = setting(
        10 * 1024 * 1024, doc="largest accepted request body; larger gets 413",
        min=1024, max=1024**3,
    )
    max_upstream_response_bytes: int = setting(
        64 * 1024 * 1024, doc="largest non-streamed backend answer read; larger gets 502",
        min=1024, max=16 * 1024**3,
    )
    max_stream_duration_seconds: float = setting(
        0.0, doc="longest a streamed answer is relayed before it ends with an SSE error "
        "event; 0 = unlimited", min=0, max=7 * 86400, duration=True,
    )
    client_header_timeout_seconds: float = setting(
        10.0, doc="time a client has to send a request's whole header, from its first byte "
        "(first request: from the connection); slower gets 408 and is closed",
        min=1, max=3600, duration=True,
    )
    client_body_timeout_seconds: float = setting(
        30.0, doc="time a client has to send a request's whole body; slower gets 408 and is "
        "closed", min=1, max=3600, duration=True,
    )
    max_json_depth: int = setting(
        128, doc="deepest array/object nesting accepted in a request body; deeper gets 400",
        min=8, max=512,
    )
    log_level: str = setting(
        "info", doc="log level", choices=("debug", "info", "warning", "error")
    )
    access_log: str = setting(
        "text", doc="one access-log line per client request (logger continuum.access): "
        "text (key=value), json, or off", choices=("text", "json", "off"), restart=True,
    )
    stream_usage: bool = setting(
        True, doc="ask OpenAI-compatible backends for the usage chunk of streams "
        "(stream_options.include_usage) when the client did not, for the token metrics; "
        "the router strips that chunk from the client's stream",
    )
    watch_config: bool = setting(
        True, doc="reload the config when its file changes", restart=True
    )
    watch_interval_seconds: float = setting(
        2.0, doc="how often the config file is checked", min=0.2, max=3600, restart=True
    )

    def check(self, path: str, issues: Issues) -> None:
        check_host_port(join(path, "bind"), self.bind, issues, unix=True)


#: :attr:`BackendConfig.protocols` by ``type`` (every other type: OpenAI's only).
_OPENAI = ("openai",)
_OPENAI_AND_ANTHROPIC = ("openai", "anthropic")
_PROTOCOLS = {"anthropic": ("anthropic",), "gemini": _OPENAI_AND_ANTHROPIC}


@dataclass(frozen=True)
class BackendConfig:
    """``backends[]``: one upstream inference server."""

    name: str = setting(doc="unique backend name", pattern=NAME_PATTERN)
    url: str = setting(doc="base URL, e.g. http://10.0.0.5:8000 (no /v1)", credentials=True)
    type: str = setting("openai", doc="wire protocol of the backend", choices=BACKEND_TYPES)
    models: tuple[str, ...] = setting(
        default_factory=tuple,
        doc="models served; empty = discovered from the backend's /v1/models",
    )
    weight: int = setting(1, doc="relative weight for weighted strategies", min=1, max=10000)
    slots: int | None = setting(
        None, doc="requests the engine runs at once (vLLM --max-num-seqs, SGLang "
        "--max-running-requests); beyond them it queues. Set, the KV load guard prices "
        "a holder's queue at its latency from its slots on, not only from the CHWBL bound",
        min=1, max=1_000_000)
    learn_slots: bool = setting(
        False, doc="learn slots from the engine's own Prometheus /metrics (vLLM, SGLang): "
        "each health probe also reads how many requests run and wait, and the slots are "
        "the most that ran in the last 4 probes that found requests waiting (from the "
        "second such probe on); for engines whose slots are not known or change with "
        "their KV memory")
    api_key: str | None = setting(None, doc="API key sent upstream (x-goog-api-key for "
                                  "type: gemini)", secret=True)
    api_key_env: str | None = setting(None, doc="environment variable holding the API key",
                                      env_var=True)
    connect_timeout_ms: int = setting(
        3000, doc="TCP connect timeout", min=10, max=600000
    )
    request_timeout_ms: int = setting(
        600000, doc="longest wait for the next upstream byte", min=100, max=3600000
    )
    anthropic_version: str = setting(
        "2023-06-01", doc="anthropic-version header sent to type: anthropic backends"
    )
    anthropic_auto_cache_control: bool = setting(
        True, doc="mark the last system block cache_control: ephemeral (type: anthropic)"
    )
    anthropic_messages: bool = setting(
        False, doc="the engine also serves Anthropic's Messages API at /v1/messages (vLLM "
        ">= 0.11.1, SGLang, llama.cpp): /anthropic/v1/messages requests for its models are "
        "passed through to it (type: openai)")
    enabled: bool = setting(True, doc="false removes the backend from every path")
    internal: bool = setting(
        False, doc="only the router itself calls it (e.g. embeddings); hidden from clients"
    )

    @property
    def protocol(self) -> str:
        """The API family the backend speaks: ``openai`` or ``anthropic``."""
        return "anthropic" if self.type == "anthropic" else "openai"

    @property
    def protocols(self) -> tuple[str, ...]:
        """The API families whose endpoints reach the backend: its own, and Anthropic's
        too for ``type: gemini`` (the gateway translates those requests) and for an engine
        with ``anthropic_messages`` (they are passed through to its /v1/messages)."""
        if self.anthropic_messages and self.type == "openai":
            return _OPENAI_AND_ANTHROPIC
        return _PROTOCOLS.get(self.type, _OPENAI)

    def resolved_api_key(self) -> str | None:
        """The API key, reading ``api_key_env`` now."""
        return from_env(self.api_key, self.api_key_env)

    def check(self, path: str, issues: Issues) -> None:
        parts = check_url(join(path, "url"), self.url, issues, ("http", "https"),
                          "an http:// or https:// URL")
        if parts is not None and parts.path.rstrip("/").endswith("/v1"):
            issues.warn(
                join(path, "url"), "ends in /v1; the router adds /v1/... itself", self.url
            )
        if self.api_key is not None and self.api_key_env is not None:
            issues.error(join(path, "api_key_env"), "set either api_key or api_key_env, not both")
        if self.learn_slots and self.slots is not None:
            issues.error(join(path, "learn_slots"), "set either slots or learn_slots, not both")
        if self.learn_slots and self.type != "openai":
            issues.error(join(path, "learn_slots"),
                         f"needs an engine's Prometheus /metrics (vLLM, SGLang); a type: "
                         f"{self.type} backend has none")
        if self.anthropic_messages and self.type != "openai":
            why = "it speaks the Messages API natively" if self.type == "anthropic" \
                else "the router translates those requests to its own API"
            issues.warn(join(path, "anthropic_messages"),
                        f"has no effect on a type: {self.type} backend: {why}")
        # a disabled backend sends nothing: its key is checked once it is enabled
        if self.api_key_env is not None and self.api_key_env not in os.environ and self.enabled:
            issues.warn(
                join(path, "api_key_env"),
                "environment variable is not set; requests go upstream without a key",
                self.api_key_env,
            )


@dataclass(frozen=True)
class HealthCheckConfig:
    """``health_check``: active probing that takes failing backends out and puts them back."""

    enabled: bool = setting(True, doc="run active health checks")
    interval_seconds: float = setting(
        5.0, doc="time between probes of one backend", min=0.1, max=3600, duration=True
    )
    timeout_ms: int = setting(2000, doc="probe timeout", min=10, max=60000)
    path: str = setting(
        "/health", doc="probe path; '/v1/models' also refreshes discovered models",
        pattern=r"/\S*",
    )
    unhealthy_threshold: int = setting(
        2, doc="consecutive failures that take a backend out", min=1, max=100
    )
    healthy_threshold: int = setting(
        2, doc="consecutive successes that put it back", min=1, max=100
    )


@dataclass(frozen=True)
class PoolConfig:
    """``pool``: how backend statistics are kept."""

    latency_ewma_alpha: float = setting(
        0.2, doc="weight of the newest sample in the latency EWMA", min=0.01, max=1.0
    )
    success_window: int = setting(
        100, doc="recent requests the success rate is computed over", min=1, max=100000,
        restart=True,
    )
    retry_connect_errors: bool = setting(
        True, doc="retry once on the next candidate when connecting fails before any byte"
    )


@dataclass(frozen=True)
class PrefixRoutingConfig:
    """``prefix_routing``: Tier 1 prefix keys and the CHWBL ring of ``PrefixAwareHash``."""

    enabled: bool = setting(False, doc="compute prefix keys (needed by PrefixAwareHash and Tier 4)")
    max_prefix_length: int = setting(
        1024, doc="bytes of the system prompt / first message hashed into the key",
        min=1, max=1048576,
    )
    load_factor_epsilon: float = setting(
        0.25, doc="CHWBL bound: a backend may hold (1 + epsilon) x the average in-flight",
        min=0.01, max=10.0,
    )
    virtual_nodes: int = setting(
        150, doc="ring positions per backend (hot reload rebuilds the ring)", min=1, max=10000
    )
    anthropic_cache_control_injection: bool = setting(
        False, doc="force cache_control on the last system block of every Anthropic request"
    )


_GLOB_CHARS = set("*?[]\\")


@dataclass(frozen=True)
class RedisConfig:
    """``response_cache.redis``: the shared Redis/Valkey connection (Tier 3).

    Every key hot-reloads: a change opens a new connection pool for the response cache
    (a Redis KV index keeps the pool it started with until a restart)."""

    url: str = setting(
        "redis://127.0.0.1:6379", doc="redis:// or rediss:// URL (db and password may be in it)",
        credentials=True,
    )
    tls: bool = setting(False, doc="use TLS with a redis:// URL")
    pool_size: int = setting(8, doc="connections in the pool", min=1, max=1024)
    key_prefix: str = setting(
        "cr:resp:", doc="namespace for response keys (no glob characters)"
    )
    connect_timeout_ms: int = setting(3000, doc="connect timeout", min=10, max=60000)
    command_timeout_ms: int = setting(1000, doc="per-command timeout", min=10, max=60000)
    fallback_capacity: int = setting(
        1000, doc="entries of the in-memory fallback while Redis is down", min=1,
        max=10_000_000,
    )
    fallback_ttl_seconds: int = setting(
        300, doc="TTL of fallback entries", min=1, max=86400
    )
    fallback_to_memory: bool = setting(
        True, doc="serve from memory while Redis is unreachable"
    )
    probe_interval_seconds: float = setting(
        30.0, doc="how often a Redis in fallback is probed", min=0.1, max=3600, duration=True,
    )
    mode: str = setting(
        "standalone", doc="standalone (the url), cluster (Redis Cluster, seeded by nodes or "
        "the url) or sentinel (the master named sentinel_master, found by the nodes)",
        choices=("standalone", "cluster", "sentinel"),
    )
    nodes: tuple[str, ...] = setting(
        default_factory=tuple, doc="host:port list: cluster seed nodes, or the sentinels",
    )
    sentinel_master: str = setting(
        "mymaster", doc="the master name the sentinels monitor (mode: sentinel)",
    )

    def check(self, path: str, issues: Issues) -> None:
        for i, node in enumerate(self.nodes):
            check_host_port(join(path, f"nodes[{i}]"), node, issues)
        if self.mode == "sentinel" and not self.nodes:
            issues.error(join(path, "nodes"), "mode: sentinel needs the sentinels' "
                         "host:port addresses", list(self.nodes))
        if self.mode == "sentinel" and not self.sentinel_master:
            issues.error(join(path, "sentinel_master"), "must not be empty with mode: "
                         "sentinel", self.sentinel_master)
        if self.mode != "standalone" and self.url.startswith("unix:"):
            issues.error(join(path, "url"), f"mode: {self.mode} needs a TCP redis:// URL",
                         self.url)
        what = "a redis://, rediss:// or unix:// URL"
        check_url(join(path, "url"), self.url, issues, ("redis", "rediss", "unix"), what,
                  host_required=not self.url.startswith("unix:"))
        if set(self.key_prefix) & _GLOB_CHARS:
            issues.error(join(path, "key_prefix"),
                         "must not contain glob characters (* ? [ ] \\)", self.key_prefix)
        if not self.key_prefix:
            issues.error(join(path, "key_prefix"), "must not be empty (clear would match "
                         "every key in the database)")


def _numpy_installed() -> bool:
    """Whether numpy can be imported, without importing it (a ``None`` in
    ``sys.modules``, which blocks an import, counts as missing)."""
    try:
        return importlib.util.find_spec("numpy") is not None
    except (ImportError, ValueError):
        return False


@dataclass(frozen=True)
class SemanticCacheConfig:
    """``response_cache.semantic``: the similarity path, tried after an exact-cache miss.

    The local config is the whole switch: there is no hub or control-plane flag. The
    embedding backend may be ``internal: true`` (never routed client traffic) but not
    ``enabled: false``; both are checked in :meth:`RouterConfig.check`, which knows the
    backends."""

    enabled: bool = setting(False, doc="answer paraphrases of cached deterministic chat "
                            "requests (needs the 'semantic' extra: numpy)")
    backend: str | None = setting(
        None, doc="configured backend serving /v1/embeddings (required when enabled)")
    embedding_model: str | None = setting(
        None, doc="model asked of that backend (required when enabled)")
    threshold: float = setting(0.92, doc="cosine similarity a hit needs", min=0.0, max=1.0)
    max_entries: int = setting(1000, doc="vectors in each router's index; oldest out first",
                               min=1, max=1_000_000)
    ttl: float | None = setting(None, doc="lifetime of an entry; omitted: response_cache.ttl",
                                min=1, max=30 * 86400, duration=True)
    embedding_timeout_ms: int = setting(
        2000, doc="longest embedding call; past it the request is a plain miss",
        min=100, max=60000)
    max_input_bytes: int = setting(
        8192, doc="a longer last user message skips the path", min=1, max=1048576)
    false_hit_gate: bool = setting(
        True, doc="refuse a match whose texts differ in negations, numbers or names")


@dataclass(frozen=True)
class ResponseCacheConfig:
    """``response_cache``: Tier 2 exact and streaming response cache."""

    enabled: bool = setting(False, doc="answer repeated deterministic requests from cache")
    backend: str = setting(
        "memory", doc="store plugin (entry-point group continuum.cache_stores)", restart=True
    )
    capacity: int = setting(1000, doc="entries before LRU eviction (memory store)",
                            min=1, max=100_000_000)
    ttl: float = setting(300.0, doc="lifetime of an entry", min=1, max=30 * 86400,
                         duration=True)
    max_response_size: int = setting(
        1048576, doc="largest non-streamed body stored", min=1, max=1024**3
    )
    max_stream_buffer_size: int = setting(
        10485760, doc="largest streamed response buffered for the cache", min=1, max=1024**3
    )
    cache_streaming: bool = setting(
        True, doc="buffer streamed responses (up to max_stream_buffer_size) and cache them"
    )
    redis: RedisConfig = setting(default_factory=RedisConfig, doc="Redis/Valkey store")
    semantic: SemanticCacheConfig = setting(
        default_factory=SemanticCacheConfig, doc="semantic (similarity) cache")


@dataclass(frozen=True)
class LoadGuardConfig:
    """``kv_cache_index.scoring.load_guard``: keep KV-aware routing from piling onto a
    busy holder. ``adaptive`` (with ``match: chain``): a holder qualifies while the prefill
    its match saves is worth more than its queue beyond the candidates' mean (priced by its
    latency only once it reaches the CHWBL bound) and, with ``learned_wait``, than its
    learned wait for a first token beyond the least-waiting candidate's;
    ``bound``: while it is under the CHWBL bound (the only mode of ``match: seed``)."""

    enabled: bool = setting(True, doc="guard KV-aware routing against load",
                            restart=True)
    mode: str = setting("adaptive", doc="adaptive: saved prefill vs extra queue; bound: "
                        "the CHWBL bound", choices=("adaptive", "bound"), restart=True)
    prefill_ms_per_1k_tokens: float = setting(
        100.0, doc="adaptive: what computing 1000 prompt tokens costs a backend (ms)",
        min=0.001, max=100000.0, restart=True,
    )
    queue_ms_per_request: float = setting(
        10.0, doc="adaptive: cost of each in-flight request beyond the candidates' mean "
        "(ms); at the CHWBL bound, a backend's latency EWMA / its in-flight count when higher",
        min=0.0, max=100000.0, restart=True,
    )
    learned_wait: bool = setting(
        False, doc="adaptive: also price the wait for a first token a holder would make a "
        "request do beyond the least-waiting candidate's, learned from how long its streams "
        "took to their first token at each in-flight count (a holder turned down leaves the "
        "request to the strategy); shorter mean TTFT under load, about a point less prefix "
        "hit rate on the load demo", restart=True)
    slot_wait: bool = setting(
        True, doc="adaptive: a holder at or beyond its slots (backends[].slots or "
        "learn_slots) is priced at its wait for a slot, the requests beyond its slots "
        "(counting this one) times its latency EWMA / its in-flight count, beyond the "
        "least-waiting candidate's, instead of its queue beyond the mean at that latency; "
        "and the "
        "strategy passes over backends whose slots are full (PrefixAwareHash to the next on "
        "its ring with a free slot, any other chooses among those with one). Load demo, "
        "four two-slot engines: p99 TTFT about 40% lower for 1-2 points of prefix hit rate",
        restart=True)
    load_factor_epsilon: float = setting(
        0.25, doc="bound = max(floor, ceil((1 + epsilon) * (in_flight_total + 1) / N))",
        min=0.01, max=10.0, restart=True,
    )
    floor: int = setting(4, doc="the bound never drops below this many in-flight requests",
                         min=1, max=100000, restart=True)


@dataclass(frozen=True)
class KvScoringConfig:
    """``kv_cache_index.scoring``: the KvOverlapScorer weights (read once at start)."""

    overlap_weight: float = setting(0.6, doc="weight of the tier-weighted overlap",
                                    min=0.0, max=1.0, restart=True)
    load_weight: float = setting(0.3, doc="weight of 1 - load_ratio", min=0.0, max=1.0,
                                 restart=True)
    health_weight: float = setting(0.1, doc="weight of the backend's success rate",
                                   min=0.0, max=1.0, restart=True)
    min_overlap_threshold: float = setting(
        0.3, doc="tier-weighted normalised overlap a holder needs to be scored",
        min=0.0, max=1.0, restart=True,
    )
    gpu_tier_weight: float = setting(1.0, doc="multiplier for GpuHot holdings",
                                     min=0.0, max=10.0, restart=True)
    storage_tier_weight: float = setting(0.6, doc="multiplier for StorageWarm holdings",
                                         min=0.0, max=10.0, restart=True)
    load_guard: LoadGuardConfig = setting(default_factory=LoadGuardConfig,
                                          doc="bounded-load guard for KV-aware routing")

    def check(self, path: str, issues: Issues) -> None:
        total = self.overlap_weight + self.load_weight + self.health_weight
        if abs(total - 1.0) > 1e-9:
            # overlap_weight + load_weight + health_weight
            issues.error(join(path, "overlap_weight"), "weights must sum to 1.0",
                         round(total, 9))


@dataclass(frozen=True)
class StorageOffloadingConfig:
    """``kv_cache_index.storage_offloading``: GpuHot vs StorageWarm tiers."""

    enabled: bool = setting(False, doc="track the storage tier of each holding", restart=True)
    treat_eviction_as_offload: bool = setting(
        True, doc="a cache_evicted of a GpuHot entry demotes it to StorageWarm", restart=True
    )


@dataclass(frozen=True)
class KvEventSourceConfig:
    """``kv_cache_index.event_sources[]``: one listener stream per backend."""

    backend_name: str = setting(doc="the backend whose cache the stream describes",
                                pattern=NAME_PATTERN, restart=True)
    endpoint: str | None = setting(
        None, doc="http(s):// SSE or ws(s):// URL of the listener's /events/<backend>",
        restart=True, credentials=True,
    )
    transport: str = setting("sse", doc="sse (pull from the listener's endpoint) or "
                             "event_bus (the listener pushes to dynamo.event_bus; no endpoint)",
                             choices=("sse", "event_bus"), restart=True)
    reconnect_interval_ms: int = setting(
        5000, doc="first reconnect delay; doubles up to max(this, 60 s)", min=10,
        max=3_600_000, restart=True,
    )
    token: str | None = setting(None, doc="never inline (an error): use token_file or "
                                "token_env", secret=True, restart=True)
    token_file: str | None = setting(
        None, doc="file holding the listener's bearer token for this stream (overrides "
        "kv_cache_index.listener_token_*)", restart=True)
    token_env: str | None = setting(None, doc="environment variable holding that token",
                                    restart=True)

    def resolved_token(self) -> str | None:
        """This stream's bearer token, read now (None: use the index-wide one)."""
        return secret_from_file_or_env(self.token_file, self.token_env)

    def check(self, path: str, issues: Issues) -> None:
        check_secret_source(path, issues, "token", inline=self.token, file=self.token_file,
                            env_name=self.token_env)
        if self.transport == "event_bus":
            if self.endpoint is not None:
                issues.error(join(path, "endpoint"), "must be omitted with transport: "
                             "event_bus (the listener pushes to dynamo.event_bus)",
                             self.endpoint)
            return
        if self.endpoint is None:
            issues.error(join(path, "endpoint"), "is required with transport: sse")
            return
        check_url(join(path, "endpoint"), self.endpoint, issues,
                  ("http", "https", "ws", "wss"), "an http, https, ws or wss URL")


@dataclass(frozen=True)
class CacheSaltConfig:
    """``kv_cache_index.cache_salt``: send router-issued ``cache_salt`` to engine backends
    so the listener can attribute their KV blocks without detokenizing (required for
    TensorRT-LLM). Format and security: :mod:`continuum.cache_salt`."""

    enabled: bool = setting(False, doc="salt requests to backends that have an event source",
                            restart=True)
    secret: str | None = setting(None, doc="HMAC secret shared with the listener",
                                 secret=True, restart=True)
    secret_env: str | None = setting(None, doc="environment variable holding the secret",
                                     restart=True, env_var=True)
    per_tenant: bool = setting(False, doc="bind salts to the client's tenant too: tenants "
                               "never share engine prefix caches (lower hit rate); a client's "
                               "own cache_salt is refused (400)", restart=True)

    def resolved(self) -> bytes | None:
        value = from_env(self.secret, self.secret_env)
        return value.encode() if value else None

    def check(self, path: str, issues: Issues) -> None:
        if self.secret is not None and self.secret_env is not None:
            issues.error(join(path, "secret_env"), "set either secret or secret_env, not both")
        elif self.enabled and self.resolved() is None:
            issues.error(join(path, "secret"), "cache_salt.enabled needs secret or secret_env "
                         "(set and non-empty)")
        if self.per_tenant and not self.enabled:
            issues.warn(join(path, "per_tenant"), "has no effect without cache_salt.enabled")


@dataclass(frozen=True)
class ChainConfig:
    """``kv_cache_index.chain``: the chain of prefix keys (:mod:`continuum.prefix_chain`).
    The KV listener's ``chain_chunk_bytes`` must be the same."""

    chunk_bytes: int = setting(1024, doc="bytes of canonical prompt per key (messages are "
                               "cut on their own)", min=64, max=65536, restart=True)
    max_keys: int = setting(128, doc="keys per request at most; the rest of a longer "
                            "prompt is ignored", min=1, max=1024, restart=True)


#: ``kv_cache_index.approximate.ttl_seconds`` when omitted (capped at entry_ttl_seconds).
APPROXIMATE_TTL_SECONDS = 60.0


@dataclass(frozen=True)
class ApproximateConfig:
    """``kv_cache_index.approximate``: the router records the chain it routed a request
    to, so backends without KV events (and events not arrived yet) still give locality."""

    enabled: bool = setting(True, doc="record each routed request's chain for its backend",
                            restart=True)
    ttl_seconds: float | None = setting(
        None, doc="lifetime of a recorded entry an engine event has not confirmed; omitted: "
        "60, or entry_ttl_seconds when shorter", min=0.1, max=86400.0, restart=True)
    weight: float = setting(0.8, doc="multiplier of an unconfirmed match's saved tokens",
                            min=0.0, max=1.0, restart=True)


@dataclass(frozen=True)
class PlacementConfig:
    """``kv_cache_index.placement``: where a request goes whose best match is its first
    message at most (a new session or a new document over a shared system prompt). With
    the adaptive guard, such a request goes to the candidate whose cost is least: the
    prefill it would redo there beyond the best holder's, plus ``weight`` times the KV it
    would join there, the tokens the router sent that backend to store recently beyond the
    least-filled candidate's (decayed over ``window_seconds``), plus its queue. Sessions
    then spread over the fleet's KV capacity instead of following their system prompt's
    holder, whose cache they would overrun."""

    enabled: bool = setting(True, doc="place requests that match only their first message "
                            "by KV pressure (adaptive guard only)", restart=True)
    window_seconds: float = setting(8.0, doc="time constant over which the tokens sent to "
                                    "a backend to store count as its pressure",
                                    min=0.1, max=3600.0, restart=True)
    weight: float = setting(0.1, doc="prefill tokens one token of pressure beyond the "
                            "least-filled candidate's is worth", min=0.0, max=100.0,
                            restart=True)


@dataclass(frozen=True)
class KvCacheIndexConfig:
    """``kv_cache_index``: Tier 4, the index of what each engine's GPU holds.

    Every key here needs a restart: the scorer reads its weights once at start.
    """

    enabled: bool = setting(False, doc="keep the index and score backends with it",
                            restart=True)
    backend: str = setting("memory", doc="index plugin (entry-point group "
                           "continuum.kv_indexes); redis shares response_cache.redis's pool",
                           restart=True)
    max_entries: int = setting(100000, doc="prefix entries kept (oldest 10% evicted when "
                               "full)", min=100, max=10_000_000, restart=True)
    entry_ttl_seconds: int = setting(600, doc="lifetime of an entry without a new event",
                                     min=1, max=86400, restart=True)
    redis_key_prefix: str = setting("cr:kvidx:", doc="namespace of the Redis index",
                                    restart=True)
    match: str = setting("chain", doc="chain: longest match of the request's chain of "
                         "prefix keys; seed: the seed's system-prompt key only",
                         choices=("chain", "seed"), restart=True)
    chain: ChainConfig = setting(default_factory=ChainConfig, doc="chain of prefix keys")
    approximate: ApproximateConfig = setting(default_factory=ApproximateConfig,
                                             doc="router-recorded chains (match: chain)")
    scoring: KvScoringConfig = setting(default_factory=KvScoringConfig, doc="scorer weights")
    placement: PlacementConfig = setting(default_factory=PlacementConfig,
                                         doc="first-message matches placed by KV pressure")
    storage_offloading: StorageOffloadingConfig = setting(
        default_factory=StorageOffloadingConfig, doc="storage-tier awareness"
    )
    event_sources: tuple[KvEventSourceConfig, ...] = setting(
        default_factory=tuple, doc="listener streams to consume"
    )
    cache_salt: CacheSaltConfig = setting(default_factory=CacheSaltConfig,
                                          doc="router-issued cache salts")
    listener_token: str | None = setting(
        None, doc="never inline (an error): use listener_token_file or listener_token_env",
        secret=True, restart=True)
    listener_token_file: str | None = setting(
        None, doc="file holding the bearer token sent to every listener stream",
        restart=True)
    listener_token_env: str | None = setting(
        None, doc="environment variable holding that token", restart=True)

    @property
    def approximate_ttl(self) -> float:
        """The lifetime of an approximate entry: ``approximate.ttl_seconds`` when set, else
        :data:`APPROXIMATE_TTL_SECONDS` or ``entry_ttl_seconds``, whichever is shorter (an
        entry the router recorded outliving what engine events keep would be odd)."""
        ttl = self.approximate.ttl_seconds
        return min(APPROXIMATE_TTL_SECONDS, self.entry_ttl_seconds) if ttl is None else ttl

    @property
    def adaptive_placement(self) -> bool:
        """Whether the chain scorer places first-message matches: ``placement.enabled``
        under the adaptive load guard (which prices placement's queue)."""
        guard = self.scoring.load_guard
        return guard.enabled and guard.mode == "adaptive" and self.placement.enabled

    def source_token(self, source: KvEventSourceConfig) -> str | None:
        """The bearer token for ``source``'s stream: its own, else the index-wide one."""
        return source.resolved_token() or secret_from_file_or_env(
            self.listener_token_file, self.listener_token_env)

    def check(self, path: str, issues: Issues) -> None:
        check_secret_source(path, issues, "listener_token", inline=self.listener_token,
                            file=self.listener_token_file, env_name=self.listener_token_env)
        ttl = self.approximate.ttl_seconds
        if ttl is not None and ttl > self.entry_ttl_seconds:
            issues.error(join(path, "approximate.ttl_seconds"),
                         "must not exceed entry_ttl_seconds", self.approximate.ttl_seconds)
        if set(self.redis_key_prefix) & _GLOB_CHARS or not self.redis_key_prefix:
            issues.error(join(path, "redis_key_prefix"),
                         "must be non-empty and free of glob characters", self.redis_key_prefix)
        seen: set[str] = set()
        for i, source in enumerate(self.event_sources):
            if source is not None and source.backend_name in seen:
                issues.error(f"{join(path, 'event_sources')}[{i}].backend_name",
                             "duplicate event source for this backend", source.backend_name)
            if source is not None:
                seen.add(source.backend_name)


@dataclass(frozen=True)
class ClientKeyConfig:
    """``auth.keys[]``: one client API key and the tenant it belongs to."""

    key: str | None = setting(None, doc="the key clients send", secret=True)
    key_env: str | None = setting(None, doc="environment variable holding the key",
                                  env_var=True)
    tenant: str | None = setting(None, doc="tenant id (isolates cached responses)",
                                 pattern=NAME_PATTERN)
    tenant_env: str | None = setting(None, doc="environment variable holding the tenant id")

    def check(self, path: str, issues: Issues) -> None:
        if (self.key is None) == (self.key_env is None):
            issues.error(join(path, "key"), "set exactly one of key or key_env")
        elif self.key_env is not None and not os.environ.get(self.key_env):
            issues.error(join(path, "key_env"), "environment variable is not set",
                         self.key_env)
        if (self.tenant is None) == (self.tenant_env is None):
            issues.error(join(path, "tenant"), "set exactly one of tenant or tenant_env")
        elif self.tenant_env is not None and not os.environ.get(self.tenant_env):
            issues.error(join(path, "tenant_env"), "environment variable is not set",
                         self.tenant_env)

    def resolved(self) -> tuple[str, str]:
        return (from_env(self.key, self.key_env) or "",
                from_env(self.tenant, self.tenant_env) or "")


@dataclass(frozen=True)
class AuthConfig:
    """``auth``: client API keys; each maps to a tenant."""

    required: bool = setting(False, doc="reject requests without a known key (401)")
    keys: tuple[ClientKeyConfig, ...] = setting(default_factory=tuple, doc="client keys")

    def check(self, path: str, issues: Issues) -> None:
        if self.required and not self.keys:
            issues.error(join(path, "keys"), "auth.required needs at least one key")


@dataclass(frozen=True)
class AdminConfig:
    """``admin``: the /admin endpoints, closed unless a token is set (or the explicit
    development opt-out)."""

    token: str | None = setting(None, doc="bearer token required by /admin", secret=True)
    token_env: str | None = setting(None, doc="environment variable holding the token",
                                    env_var=True)
    allow_unauthenticated: bool = setting(
        False, doc="open /admin without a token: local development only (warned at every "
        "start)",
    )

    def resolved_token(self) -> str | None:
        return from_env(self.token, self.token_env)

    def check(self, path: str, issues: Issues) -> None:
        if self.token is not None and self.token_env is not None:
            issues.error(join(path, "token_env"), "set either token or token_env, not both")
        elif self.token is not None and not self.token.strip():
            issues.error(join(path, "token"), "must not be empty: set a real token (or remove "
                         "the key to disable /admin)")
        elif self.token_env is not None and not (os.environ.get(self.token_env) or "").strip():
            issues.error(join(path, "token_env"), "environment variable is not set (or is "
                         "empty); export it before starting the router", self.token_env)
        has_token = self.token is not None or self.token_env is not None
        if self.allow_unauthenticated and has_token:
            issues.error(join(path, "allow_unauthenticated"),
                         "set either a token or allow_unauthenticated: true, not both")
        elif self.allow_unauthenticated:
            issues.warn(join(path, "allow_unauthenticated"),
                        "every /admin endpoint is open to anyone who can reach the port "
                        "(reload the config, clear the caches); for local development only")
        elif not has_token:
            issues.warn(path or "admin", "no token: every /admin endpoint answers 403; set "
                        "admin.token or admin.token_env to use them")


@dataclass(frozen=True)
class GeminiContextCacheConfig:
    """``gemini_context_cache``: server-side ``cachedContents`` for large, repeated system
    prompts sent to ``type: gemini`` backends (read once at start)."""

    enabled: bool = setting(False, doc="create and reuse cachedContents for type: gemini "
                            "backends", restart=True)
    min_prefix_bytes: int = setting(
        16384, doc="smallest system prompt (UTF-8 bytes) worth caching; approximates "
        "Google's per-model minimum token count", min=1024, max=1024**3, restart=True)
    ttl: float = setting(600.0, doc="TTL of a created cachedContents resource", min=60,
                         max=30 * 86400, duration=True, restart=True)
    extend_on_hit: bool = setting(
        False, doc="PATCH the TTL in the background when a hit finds <= 20% of it left",
        restart=True)
    max_entries: int = setting(1000, doc="entries (negative ones included) before LRU "
                               "eviction, which DELETEs the resource", min=10,
                               max=1_000_000, restart=True)
    create_timeout_ms: int = setting(5000, doc="timeout of the cachedContents create call",
                                     min=500, max=60000, restart=True)
    negative_ttl_seconds: int = setting(
        600, doc="how long a prefix Google refused (400) is not tried again", min=1,
        max=30 * 86400, restart=True)
    prefer_native_api: bool = setting(
        False, doc="send chat completions to native generateContent / "
        "streamGenerateContent instead of /v1beta/openai/chat/completions", restart=True)


#: ``scorers`` by default: the built-in KV overlap scorer, which acts only when
#: ``kv_cache_index.enabled`` gives it an index.
DEFAULT_SCORERS: tuple[str, ...] = ("KvOverlap",)


@dataclass(frozen=True)
class FleetConfig:
    """``fleet``: how the gunicorn workers of one router, and several routers, act as one
    (docs/scale-out.md)."""

    use_redis: bool = setting(
        False, doc="exchange in-flight counts and admin actions with the other routers "
        "through response_cache.redis even when neither the response cache nor the KV "
        "index is on Redis (routers that share no cache, e.g. PrefixAwareHash alone)",
        restart=True,
    )
    share_in_flight: bool = setting(
        True, doc="share in-flight counts between the workers of a host "
        "($CONTINUUM_RUNTIME_DIR/host.shm) so load bounds see the host's load", restart=True,
    )
    share_rotation: bool = setting(
        True, doc="RoundRobin's workers take their turns from one counter in the host "
        "segment, so the host cycles through the backends as one router instead of each "
        "worker starting its own cycle; with share_in_flight_across_routers, each router "
        "starts its cycle its place's share of the way round, so routers taking requests "
        "in turn do not send a backend two in a row", restart=True,
    )
    redis_channel: bool = setting(
        True, doc="with a Redis response cache or KV index (or use_redis), spread admin "
        "actions to every router over Redis pub/sub", restart=True,
    )
    ack_timeout_seconds: float = setting(
        2.0, doc="how long an admin action waits for the other workers and routers to "
        "report it applied", min=0.0, max=60, duration=True,
    )
    share_health_checks: bool = setting(
        True, doc="one worker per host probes the backends and the host's other workers "
        "take its results ($CONTINUUM_RUNTIME_DIR/health.json), instead of every worker "
        "probing every backend", restart=True,
    )
    kv_event_lease: bool = setting(
        True, doc="one worker per host (per fleet with the Redis index) consumes each KV "
        "event source, under a lease", restart=True,
    )
    lease_ttl_ms: int = setting(
        3000, doc="the KV event-source lease's TTL; the holder renews it every third",
        min=300, max=600000, restart=True,
    )
    share_in_flight_across_routers: bool = setting(
        True, doc="with share_in_flight and a Redis response cache or KV index (or "
        "use_redis), one worker per host exchanges the host's in-flight counts with the "
        "other routers' through Redis (and, with KV placement, its KV pressure), so load "
        "bounds and placement see the fleet's", restart=True,
    )
    fleet_load_interval_ms: int = setting(
        25, doc="how often, while the host has requests in flight, its in-flight counts go "
        "to Redis and the other routers' are read (how stale they may be); an idle host, or "
        "one that found no other router live, exchanges every 250 ms (or this, when "
        "longer), and a router silent for 4 of those stops counting", min=10, max=10000,
        restart=True,
    )
    fleet_load_push_ms: int = setting(
        0, doc="when above 0, how often the exchanging worker looks at the host's in-flight "
        "counts and, when they changed, publishes them to the other routers over Redis "
        "pub/sub, so they see a new request a Redis hop later instead of up to two "
        "exchanges later (0, the default: counts go with the exchange only; 5 costs about "
        "1-1.5 ms of router CPU per request at the demo's load, docs/scale-out.md)",
        min=0, max=1000, restart=True,
    )


def check_backend_names(backends: Sequence[BackendConfig | None] | None,
                        issues: Issues) -> None:
    """Each backend's name is its own (also run while other values of the file are refused:
    it reads only the names)."""
    seen: dict[str, int] = {}
    for i, backend in enumerate(backends or []):
        if backend is None or not isinstance(backend.name, str):
            continue
        if backend.name in seen:
            issues.error(
                f"backends[{i}].name",
                f"duplicate backend name (also backends[{seen[backend.name]}])",
                backend.name,
            )
        seen.setdefault(backend.name, i)


@dataclass(frozen=True)
class RouterConfig:
    """The whole router config file."""

    server: ServerConfig = setting(default_factory=ServerConfig, doc="HTTP server")
    backends: tuple[BackendConfig, ...] = setting(
        default_factory=tuple, doc="upstream backends"
    )
    selection_strategy: str = setting(
        "RoundRobin", doc="strategy plugin name (entry-point group continuum.strategies)"
    )
    scorers: tuple[str, ...] = setting(
        default_factory=lambda: DEFAULT_SCORERS,
        doc="scorer plugin names (entry-point group continuum.scorers), run before the "
        "strategy on requests with a prefix key; KvOverlap needs kv_cache_index.enabled",
        restart=True,
    )
    health_check: HealthCheckConfig = setting(
        default_factory=HealthCheckConfig, doc="active health checks"
    )
    pool: PoolConfig = setting(default_factory=PoolConfig, doc="backend statistics")
    prefix_routing: PrefixRoutingConfig = setting(
        default_factory=PrefixRoutingConfig, doc="Tier 1: prefix-aware sticky routing"
    )
    response_cache: ResponseCacheConfig = setting(
        default_factory=ResponseCacheConfig, doc="Tiers 2 and 3: response cache"
    )
    auth: AuthConfig = setting(default_factory=AuthConfig, doc="client API keys and tenants")
    kv_cache_index: KvCacheIndexConfig = setting(
        default_factory=KvCacheIndexConfig, doc="Tier 4: backend KV cache index"
    )
    admin: AdminConfig = setting(default_factory=AdminConfig, doc="admin API")
    gemini_context_cache: GeminiContextCacheConfig = setting(
        default_factory=GeminiContextCacheConfig, doc="Gemini cachedContents manager")
    dynamo: DynamoConfig = setting(default_factory=DynamoConfig,
                                   doc="push-mode event bus (docs/push-mode.md)")
    fleet: FleetConfig = setting(
        default_factory=FleetConfig, doc="workers and routers acting as one (scale-out)")

    @property
    def fleet_on_redis(self) -> bool:
        """Whether the routers of a fleet reach each other through ``response_cache.redis``:
        the response cache or the KV index is on Redis, or ``fleet.use_redis``."""
        cache, kv = self.response_cache, self.kv_cache_index
        return (self.fleet.use_redis or (cache.enabled and cache.backend == "redis")
                or (kv.enabled and kv.backend == "redis"))

    def check(self, path: str, issues: Issues) -> None:
        check_backend_names(self.backends, issues)
        if not self.backends:
            issues.warn("backends", "no backends configured; every request is refused (404: "
                        "no backend serves its model)")
        if self.health_check is not None and not self.health_check.enabled:
            for i, backend in enumerate(self.backends):
                if backend is not None and backend.learn_slots:
                    issues.error(f"backends[{i}].learn_slots",
                                 "learned by the health probes: needs health_check.enabled")
        kv = self.kv_cache_index
        names = {b.name for b in self.backends if b is not None}
        for i, source in enumerate(kv.event_sources):
            if source is not None and source.backend_name not in names:
                issues.warn(f"kv_cache_index.event_sources[{i}].backend_name",
                            "no backend of this name; its events will never be used",
                            source.backend_name)
        check_event_bus_sources(self, issues)
        if kv.enabled and self.prefix_routing.enabled:
            scoring = kv.scoring
            if scoring.gpu_tier_weight < scoring.min_overlap_threshold:
                issues.warn("kv_cache_index.scoring.gpu_tier_weight",
                            f"below min_overlap_threshold ({scoring.min_overlap_threshold:g}):"
                            " no backend can pass, KV-aware routing always falls back",
                            scoring.gpu_tier_weight)
        if kv.enabled and not self.prefix_routing.enabled:
            issues.warn("kv_cache_index.enabled",
                        "the KV scorer only runs with prefix_routing.enabled: true")
        self._check_scorers(issues)
        self._check_semantic(issues)
        if self.gemini_context_cache.enabled and not any(
                b is not None and b.type == "gemini" for b in self.backends):
            issues.warn("gemini_context_cache.enabled", "no type: gemini backend; nothing "
                        "will be cached")
        if kv.cache_salt.enabled and kv.cache_salt.per_tenant:
            self._check_unsalted_messages(issues)
            if not self.prefix_routing.enabled:
                issues.warn("kv_cache_index.cache_salt.per_tenant", "salts are only issued "
                            "with prefix_routing.enabled: true; tenants are not isolated")
            elif not self.auth.keys:
                issues.warn("kv_cache_index.cache_salt.per_tenant", "no auth.keys: requests "
                            "carry no tenant, so every request gets the same salt")
        if self.selection_strategy == "PrefixAwareHash" and not self.prefix_routing.enabled:
            issues.warn(
                "selection_strategy",
                "PrefixAwareHash without prefix_routing.enabled: true hashes only the model "
                "name, pinning each model to one backend",
                self.selection_strategy,
            )

    def unsalted_messages(self, salts: CacheSaltConfig) -> list[ConfigIssue]:
        """The errors :meth:`_check_unsalted_messages` finds in this config's backends when
        ``salts`` are the cache-salt settings in force (a reload keeps the running ones:
        they need a restart); none unless they are on and per tenant."""
        issues = Issues()
        if salts.enabled and salts.per_tenant:
            self._check_unsalted_messages(issues)
        return issues.errors

    def _check_unsalted_messages(self, issues: Issues) -> None:
        """Per-tenant salts keep tenants out of each other's engine prefix caches, but an
        engine's Messages endpoint takes no ``cache_salt``: /anthropic requests passed
        through to a salted backend (one with a KV event source, as the service salts)
        would share its cache across tenants. Refused rather than silently unisolated."""
        salted = {s.backend_name for s in self.kv_cache_index.event_sources if s is not None}
        for i, backend in enumerate(self.backends):
            # a disabled backend takes no request: checked again when a reload enables it
            if backend is not None and backend.enabled and backend.anthropic_messages and \
                    backend.type == "openai" and backend.name in salted:
                issues.error(f"backends[{i}].anthropic_messages",
                             "the engine's /v1/messages takes no cache_salt, so its "
                             "/anthropic requests would share its prefix cache across "
                             "tenants despite kv_cache_index.cache_salt.per_tenant; set one "
                             "of the two false")

    def _check_scorers(self, issues: Issues) -> None:
        """A name listed twice would score twice; a list of one's own (the default is
        harmless) does nothing without prefix keys. Unknown names are reported by
        :func:`continuum.config.check_config`, which has the plugin registry."""
        first: dict[str, int] = {}
        for i, name in enumerate(self.scorers):
            if name in first:
                issues.error(f"scorers[{i}]", f"listed twice (also scorers[{first[name]}])",
                             name)
            first.setdefault(name, i)
        if self.scorers and self.scorers != DEFAULT_SCORERS and not self.prefix_routing.enabled:
            issues.warn("scorers", "scorers only run on requests with a prefix key: set "
                        "prefix_routing.enabled: true")

    def _check_semantic(self, issues: Issues) -> None:
        """The semantic cache needs its backend, its model and numpy; the backend follows
        the visibility rule (``internal`` allowed, ``enabled: false`` refused)."""
        sem = self.response_cache.semantic
        if not sem.enabled:
            return
        path = "response_cache.semantic"
        if not _numpy_installed():
            issues.error(join(path, "enabled"), "needs numpy: install continuum-router[semantic]")
        if not self.response_cache.enabled:
            issues.warn(join(path, "enabled"), "has no effect without response_cache.enabled")
        if sem.embedding_model is None:
            issues.error(join(path, "embedding_model"), "required when semantic.enabled")
        if sem.backend is None:
            issues.error(join(path, "backend"), "required when semantic.enabled")
            return
        found = next((b for b in self.backends if b is not None and b.name == sem.backend),
                     None)
        if found is None:
            issues.error(join(path, "backend"), "no backend of this name", sem.backend)
        elif not found.enabled:
            issues.error(join(path, "backend"), "names an enabled: false backend", sem.backend)
        elif found.type != "openai":
            issues.error(join(path, "backend"), "must be a type: openai backend "
                         "(it is asked for /v1/embeddings)", sem.backend)
