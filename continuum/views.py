"""Typed views of a worker's state, as the admin API shows them.

:class:`~continuum.service.RouterService` builds them from its tiers (its ``*_view``
methods); the admin resources serialise them with :func:`dataclasses.asdict`. So the
shape of each admin document is declared here, field by field and in order, instead of
being assembled from string-keyed dicts in the web layer.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from continuum.config.addresses import redact_url
from continuum.interfaces import PrefixRoutingDecisions, PrefixRoutingSettings, PrefixRoutingStats
from continuum.kv.scorer import KvDecisions

if TYPE_CHECKING:
    from continuum.config import KvCacheIndexConfig, PrefixRoutingConfig
    from continuum.interfaces import KvCacheIndex, SelectionStrategy
    from continuum.kv.consumer import SourceStats
    from continuum.kv.scorer import KvScorerStats
    from continuum.registry import PluginInfo
    from continuum.routing.backends import Backend


# --- /admin/strategies ---------------------------------------------------------------------

@dataclass(frozen=True, slots=True)
class PluginView:
    """One plugin loaded through the entry points, and where it came from."""

    group: str
    name: str
    distribution: str
    version: str
    #: The entry point's ``module:attribute``.
    object: str


@dataclass(frozen=True, slots=True)
class StrategiesView:
    """The configured strategy, the registered ones, and every plugin loaded so far."""

    selection_strategy: str
    available: list[str]
    loaded: list[PluginView]


def plugin_view(info: PluginInfo) -> PluginView:
    """The admin view of a loaded plugin."""
    return PluginView(info.group, info.name, info.distribution, info.version, info.value)


# --- /admin/backends -----------------------------------------------------------------------

@dataclass(frozen=True, slots=True)
class BackendView:
    """One backend's configuration and live state."""

    name: str
    #: The URL with any password replaced by ``***``.
    url: str
    type: str
    enabled: bool
    internal: bool
    healthy: bool
    in_flight: int
    #: ``unprobed`` (added or changed by a reload, no probe result yet), ``healthy``,
    #: ``unhealthy``, or ``disabled`` (``enabled: false``).
    state: str
    #: Taken out of rotation by ``POST /admin/backends/{name}/drain``.
    draining: bool
    latency_ewma_ms: float | None
    success_rate: float
    models: list[str]
    weight: int
    #: Requests the engine runs at once: ``backends[].slots``, or learned from its metrics
    #: (``backends[].learn_slots``); None: not known (yet).
    slots: int | None
    #: ``configured``, ``learned`` (``learn_slots``; ``slots`` None until learned) or None.
    slots_source: str | None


def backend_view(backend: Backend) -> BackendView:
    """The admin view of ``backend`` (rounded for reading)."""
    ewma = backend.latency_ewma
    return BackendView(
        name=backend.name,
        url=redact_url(backend.url),
        type=backend.config.type,
        enabled=backend.config.enabled,
        internal=backend.config.internal,
        healthy=backend.healthy and backend.config.enabled,
        in_flight=backend.in_flight,
        # a disabled backend is never probed nor sent anything: its "healthy" is no news
        state=backend.state if backend.config.enabled else "disabled",
        draining=backend.draining,
        latency_ewma_ms=None if ewma is None else round(ewma * 1000, 3),
        success_rate=round(backend.success_rate, 4),
        models=sorted(backend.models),
        weight=backend.weight,
        slots=backend.slots,
        slots_source=("learned" if backend.config.learn_slots
                      else "configured" if backend.config.slots is not None else None),
    )


# --- /admin/prefix-routing/stats -----------------------------------------------------------

@dataclass(frozen=True, slots=True)
class BackendLoad:
    """A routable backend and its in-flight requests."""

    backend: str
    in_flight_requests: int


@dataclass(frozen=True, slots=True)
class PrefixRoutingView:
    """Prefix routing: its settings, and the decisions of a strategy that routes by prefix
    key (zeros when the configured strategy does not)."""

    enabled: bool
    selection_strategy: str
    config: PrefixRoutingSettings
    routing_decisions: PrefixRoutingDecisions
    backend_distribution: list[BackendLoad]
    unique_prefixes: int


def prefix_routing_view(
    settings: PrefixRoutingConfig, strategy_name: str, strategy: SelectionStrategy,
    routable: Sequence[Backend],
) -> PrefixRoutingView:
    """The view for ``settings`` and ``strategy`` (which reports through
    :meth:`~continuum.interfaces.SelectionStrategy.prefix_routing_stats`, if at all)."""
    stats = strategy.prefix_routing_stats() or PrefixRoutingStats(
        config=PrefixRoutingSettings(
            max_prefix_length=settings.max_prefix_length,
            load_factor_epsilon=settings.load_factor_epsilon,
            virtual_nodes=settings.virtual_nodes,
            anthropic_cache_control_injection=settings.anthropic_cache_control_injection,
        ),
        routing_decisions=PrefixRoutingDecisions(),
        unique_prefixes=0,
    )
    return PrefixRoutingView(
        enabled=settings.enabled,
        selection_strategy=strategy_name,
        config=stats.config,
        routing_decisions=stats.routing_decisions,
        backend_distribution=[BackendLoad(b.name, b.in_flight) for b in routable],
        unique_prefixes=stats.unique_prefixes,
    )


# --- /admin/kv-index/stats -----------------------------------------------------------------

@dataclass(frozen=True, slots=True)
class KvScoringView:
    """The scorer's weights (``kv_cache_index.scoring``)."""

    overlap_weight: float
    load_weight: float
    health_weight: float
    min_overlap_threshold: float
    gpu_tier_weight: float
    storage_tier_weight: float
    load_guard: bool
    #: ``adaptive`` (saved prefill against extra queue) or ``bound`` (the CHWBL bound).
    load_guard_mode: str


@dataclass(frozen=True, slots=True)
class KvIndexSettings:
    """The ``kv_cache_index`` settings worth showing."""

    backend: str
    max_entries: int
    entry_ttl_seconds: int
    event_sources_count: int
    #: ``chain`` (longest match of the request's chain of prefix keys) or ``seed``.
    match: str
    scoring: KvScoringView


@dataclass(frozen=True, slots=True)
class KvIndexCounts:
    """The counters every index reports (-1: the index cannot know, e.g. Redis sizes)."""

    prefix_count: int = 0
    entry_count: int = 0
    total_hits: int = 0
    total_evictions: int = 0
    #: Chain keys (:mod:`continuum.prefix_chain`) held, their (key, backend) entries, and
    #: how many of those the router recorded itself (``approximate``), not yet confirmed.
    chain_key_count: int = 0
    chain_entry_count: int = 0
    chain_approximate_entries: int = 0


@dataclass(frozen=True, slots=True)
class KvSourceSummary:
    """One event source, in short."""

    backend_name: str
    connected: bool
    events_received: int
    events_dropped: int
    last_event_at: str | None
    reconnect_count: int
    #: ``this worker``, or, with the KV lease, the worker (or router) that reads the stream
    #: for this one (``connected`` is this worker's own stream); None while none does.
    consumed_by: str | None


@dataclass(frozen=True, slots=True)
class KvIndexView:
    """Tier 4: settings, index counters, event sources and the scorer's decisions."""

    enabled: bool
    scorer_active: bool
    config: KvIndexSettings
    index: KvIndexCounts
    event_sources: list[KvSourceSummary]
    routing_decisions: KvDecisions
    query_latency_count: int
    overlap_score_count: int


def index_counts(index: KvCacheIndex | None) -> KvIndexCounts:
    """The common counters of ``index`` (zeros without one)."""
    if index is None:
        return KvIndexCounts()
    stats: dict[str, Any] = index.stats()
    return KvIndexCounts(
        prefix_count=stats.get("prefix_count", 0),
        entry_count=stats.get("entry_count", 0),
        total_hits=stats.get("total_hits", 0),
        total_evictions=stats.get("total_evictions", 0),
        chain_key_count=stats.get("chain_key_count", 0),
        chain_entry_count=stats.get("chain_entry_count", 0),
        chain_approximate_entries=stats.get("chain_approximate_entries", 0),
    )


def kv_index_view(
    kv: KvCacheIndexConfig, index: KvCacheIndex | None, scorer: KvScorerStats | None,
    sources: Sequence[SourceStats],
) -> KvIndexView:
    """The view of the index, the scorer's counters (``scorer`` None: no scorer runs) and
    the event sources."""
    scoring = kv.scoring
    return KvIndexView(
        enabled=kv.enabled,
        scorer_active=scorer is not None,
        config=KvIndexSettings(
            backend=kv.backend,
            max_entries=kv.max_entries,
            entry_ttl_seconds=kv.entry_ttl_seconds,
            event_sources_count=len(kv.event_sources),
            match=kv.match,
            scoring=KvScoringView(
                overlap_weight=scoring.overlap_weight,
                load_weight=scoring.load_weight,
                health_weight=scoring.health_weight,
                min_overlap_threshold=scoring.min_overlap_threshold,
                gpu_tier_weight=scoring.gpu_tier_weight,
                storage_tier_weight=scoring.storage_tier_weight,
                load_guard=scoring.load_guard.enabled,
                load_guard_mode=scoring.load_guard.mode,
            ),
        ),
        index=index_counts(index),
        event_sources=[
            KvSourceSummary(s.backend_name, s.connected, s.events_received, s.events_dropped,
                            s.last_event_at, s.reconnect_count, s.consumed_by)
            for s in sources
        ],
        routing_decisions=scorer.routing_decisions if scorer else KvDecisions(),
        query_latency_count=scorer.query_latency_count if scorer else 0,
        overlap_score_count=scorer.overlap_score_count if scorer else 0,
    )


# --- /admin/kv-index/backends and /admin/kv-index/clear ------------------------------------

@dataclass(frozen=True, slots=True)
class KvSourceConnection:
    """The state of a source's connection to its listener."""

    connected: bool
    reconnect_count: int
    last_event_at: str | None


@dataclass(frozen=True, slots=True)
class KvSourceEvents:
    """What a source received and what it did to the index."""

    received: int
    dropped: int
    malformed: int
    index_created: int
    index_evicted: int


@dataclass(frozen=True, slots=True)
class KvSourceView:
    """One event source in detail."""

    backend_name: str
    connection: KvSourceConnection
    events: KvSourceEvents
    last_event_id: str | None
    #: As in :class:`KvSourceSummary`.
    consumed_by: str | None


@dataclass(frozen=True, slots=True)
class KvSourcesView:
    """Every event source, in config order."""

    enabled: bool
    backends: list[KvSourceView]


def kv_source_view(s: SourceStats) -> KvSourceView:
    """The detailed view of one source."""
    return KvSourceView(
        backend_name=s.backend_name,
        connection=KvSourceConnection(s.connected, s.reconnect_count, s.last_event_at),
        events=KvSourceEvents(s.events_received, s.events_dropped, s.malformed,
                              s.index_created, s.index_evicted),
        last_event_id=s.last_event_id,
        consumed_by=s.consumed_by,
    )


@dataclass(frozen=True, slots=True)
class KvIndexCleared:
    """What ``POST /admin/kv-index/clear`` dropped."""

    entries_before_clear: int
    cleared_entries: int
