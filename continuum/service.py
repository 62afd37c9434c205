"""The router service: what a proxy request does, independent of the web framework."""

from __future__ import annotations

import json
import logging
from collections.abc import Iterator
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any, cast
from urllib.parse import urlsplit

from continuum import request as rq
from continuum import views
from continuum.auth import ClientAuth
from continuum.cache_salt import make_salt
from continuum.caching.cache_key import cache_key
from continuum.caching.gemini_context import GeminiContextCache
from continuum.caching.response_cache import BYPASS, HIT, MISS, ResponseCache
from continuum.config import restart_required
from continuum.config.fields import keep_restart_fields, walk
from continuum.errors import ConfigError, ContinuumError, RequestError, UpstreamConnectError
from continuum.hostshm import open_segment
from continuum.kv.bus_consumer import add_bus_consumers, rebuild_consumers
from continuum.kv.chain_scorer import ChainOverlapScorer
from continuum.kv.consumer import KvEventConsumerManager
from continuum.kv.lease import leased_consumers
from continuum.kv.scorer import KvOverlapScorer
from continuum.metrics import CACHE, RequestRecord, RouterMetrics
from continuum.prefix import request_prefix_key
from continuum.registry import PluginRegistry
from continuum.request import parse_request
from continuum.resources import WorkerResources
from continuum.routing.anthropic import injected_body, should_inject
from continuum.routing.backends import Backend, BackendPool
from continuum.routing.fleet_load import FleetLoad
from continuum.routing.forwarder import (
    Forwarder,
    Upstream,
    anthropic_error_event,
    openai_error_event,
)
from continuum.routing.gemini_dispatch import GeminiGateway, GeminiMetrics
from continuum.routing.health import HealthMonitor
from continuum.routing.selection import SelectionPipeline
from continuum.routing.shared_health import SharedProbes
from continuum.routing.shared_load import HostLoad
from continuum.routing.usage import UsageStream, asks_for_usage, read_body, with_stream_usage

if TYPE_CHECKING:
    from continuum.caching.semantic import Probe, SemanticCache
    from continuum.config import KvEventSourceConfig, RouterConfig
    from continuum.interfaces import BackendScorer, CacheStore, KvCacheIndex, SelectionStrategy
    from continuum.request import RequestContext

log = logging.getLogger(__name__)

#: Streamed endpoints whose usage chunk ``stream_options.include_usage`` asks for (the
#: Responses API reports usage in ``response.completed`` unasked, Anthropic in its events).
_USAGE_OPTION_ENDPOINTS = frozenset({rq.CHAT, rq.COMPLETIONS})

STRATEGIES = "continuum.strategies"
SCORERS = "continuum.scorers"
CACHE_STORES = "continuum.cache_stores"
KV_INDEXES = "continuum.kv_indexes"


def _public_url(url: str) -> str:
    """``url`` without credentials (for logs)."""
    parts = urlsplit(url)
    return f"{parts.scheme}://{parts.hostname}" + (f":{parts.port}" if parts.port else "")


@dataclass
class ProxyResult:
    """What to send back to the client: a body or a stream, with status and headers."""

    status: int
    headers: dict[str, str] = field(default_factory=dict)
    body: bytes | None = None
    stream: Iterator[bytes] | None = None


@dataclass
class ReloadReport:
    """What a config reload changed, and what it could not change without a restart."""

    applied: list[str] = field(default_factory=list)
    restart_required: list[str] = field(default_factory=list)

    def as_dict(self) -> dict[str, Any]:
        return {"applied": self.applied, "restart_required": self.restart_required}


class RouterService:
    """Holds one worker's run-time state and proxies requests through it.

    One request: :meth:`admit` parses it and derives its keys; :meth:`proxy` answers it
    from the response cache or selects a backend, builds the body for that backend and
    has the forwarder send it (retrying once elsewhere after a connect failure). The web
    layer calls those, :meth:`explain`, and the ``*_view`` methods for the admin API.
    """

    def __init__(
        self,
        config: RouterConfig,
        *,
        registry: PluginRegistry,
        metrics: RouterMetrics,
    ) -> None:
        self.config = config
        self.registry = registry
        self.metrics = metrics
        self.pool = BackendPool(
            Backend(b, ewma_alpha=config.pool.latency_ewma_alpha,
                    success_window=config.pool.success_window)
            for b in config.backends
        )
        # Scale-out (docs/scale-out.md): the host segment the workers share, if any.
        self.host = open_segment()
        self.host_load = HostLoad(self.pool, self.host) \
            if self.host is not None and config.fleet.share_in_flight else None
        # ... and with the other routers', through Redis (continuum.routing.fleet_load)
        self.fleet_load = FleetLoad.from_config(config, self.pool, self.host) \
            if self.host_load is not None and self.host is not None else None
        # ... and one prober for the host's workers (continuum.routing.shared_health)
        shared = SharedProbes(self.host.directory) \
            if self.host is not None and config.fleet.share_health_checks else None
        self.health = HealthMonitor(self.pool, config.health_check, metrics, shared=shared)
        self.pipeline = SelectionPipeline(self._make_strategy(config))
        self.forwarder = Forwarder(
            self.pool,
            metrics,
            retry_connect_errors=config.pool.retry_connect_errors,
            on_result=self.health.observe,
            await_probes=self.health.await_first_results,
            max_response_bytes=config.server.max_upstream_response_bytes,
            max_stream_seconds=config.server.max_stream_duration_seconds,
            retry_after_seconds=config.health_check.interval_seconds,
        )
        self.auth = ClientAuth(config.auth)
        kv = config.kv_cache_index
        self._salt_secret = kv.cache_salt.resolved() if kv.cache_salt.enabled else None
        self._salt_per_tenant = self._salt_secret is not None and kv.cache_salt.per_tenant
        self._salted_backends = frozenset(s.backend_name for s in kv.event_sources)
        # Connections the plugins share (one pool per server and settings), theirs to name.
        self.resources = WorkerResources()
        store_cls = cast("type[CacheStore]",
                         registry.load(CACHE_STORES, config.response_cache.backend))
        store = store_cls.from_config(config, **self._collaborators())
        self.response_cache = ResponseCache(config.response_cache, store, metrics)
        self.semantic = self._build_semantic(config)
        self._build_kv_tier(config)
        self._build_scorers(config)
        self._build_gemini(config)

    def _build_gemini(self, config: RouterConfig) -> None:
        """``type: gemini`` backends: the gateway, and the context-cache manager when
        ``gemini_context_cache.enabled`` (nothing is built for a fleet without them). The
        manager shares its map through the response-cache store when that is shared."""
        self.gemini: GeminiGateway | None = None
        self.gemini_context: GeminiContextCache | None = None
        gemini_backends = [b for b in self.pool if b.config.type == "gemini"]
        if not gemini_backends:
            return
        settings = config.gemini_context_cache
        gmetrics = GeminiMetrics(self.metrics)
        if settings.enabled:
            shared = config.response_cache.backend != "memory"
            self.gemini_context = GeminiContextCache(
                settings, gmetrics,
                shared=(lambda: self.response_cache.store) if shared else None)
            self.gemini_context.register_backends(gemini_backends)
        self.gemini = GeminiGateway(self.forwarder, settings, gmetrics, self.gemini_context)

    def _collaborators(self) -> dict[str, Any]:
        """What every scorer, store and index plugin is built with (``from_config``)."""
        return {"metrics": self.metrics, "resources": self.resources}

    def _build_semantic(self, config: RouterConfig) -> SemanticCache | None:
        """The semantic path, when on; imported only then (it needs numpy, an extra).
        Its bodies go to whatever store the response cache has at the time."""
        cache = config.response_cache
        if not (cache.enabled and cache.semantic.enabled):
            return None
        from continuum.caching.semantic import SemanticCache

        backend = next(b for b in config.backends if b.name == cache.semantic.backend)
        return SemanticCache(cache, backend, lambda: self.response_cache.store, self.metrics)

    def _build_kv_tier(self, config: RouterConfig) -> None:
        """Tier 4: the index and its event consumers."""
        kv = config.kv_cache_index
        self.kv_index: KvCacheIndex | None = None
        self.kv_consumers: KvEventConsumerManager | None = None
        if not kv.enabled:
            return
        index_cls = cast("type[KvCacheIndex]", self.registry.load(KV_INDEXES, kv.backend))
        self.kv_index = index_cls.from_config(config, **self._collaborators())
        self.kv_consumers = KvEventConsumerManager(
            kv.event_sources, self.kv_index, self.metrics.registry,
            tokens={s.backend_name: kv.source_token(s) for s in kv.event_sources},
            lease=leased_consumers(config, self.host))  # one consumer per host/fleet
        add_bus_consumers(self.kv_consumers, kv.event_sources, self.kv_index)

    def _build_scorers(self, config: RouterConfig) -> None:
        """The configured ``scorers``, loaded from ``continuum.scorers`` by name, in order.

        Scorers only see requests with a prefix key, so none is built without
        ``prefix_routing.enabled``; a scorer may also decline the config (``from_config``
        returns None: ``KvOverlap`` without a KV index).
        """
        self.kv_scorer: KvOverlapScorer | None = None
        #: The KV scorer when it matches chains (``kv_cache_index.match: chain``): requests
        #: get their chain of prefix keys, and the routes taken are recorded in the index.
        self._chain_scorer: ChainOverlapScorer | None = None
        if not config.prefix_routing.enabled:
            return
        built: list[BackendScorer] = []
        for name in config.scorers:
            scorer_cls = cast("type[BackendScorer]", self.registry.load(SCORERS, name))
            scorer = scorer_cls.from_config(config, index=self.kv_index,
                                            **self._collaborators())
            if scorer is not None:
                built.append(scorer)
        self.pipeline.scorers = tuple(built)
        self.kv_scorer = next((s for s in built if isinstance(s, KvOverlapScorer)), None)
        self._chain_scorer = self.kv_scorer \
            if isinstance(self.kv_scorer, ChainOverlapScorer) else None
        if self._chain_scorer is not None and self.host_load is not None:
            # the host's workers place new sessions on one picture of the KV pressure
            self._chain_scorer.share_pressure(self.host)

    def _make_strategy(self, config: RouterConfig) -> SelectionStrategy:
        strategy: SelectionStrategy = self.registry.create(
            STRATEGIES, config.selection_strategy, config, metrics=self.metrics, pool=self.pool,
            host=self.host,
        )
        return strategy

    @property
    def strategy(self) -> SelectionStrategy:
        """The configured selection strategy."""
        return self.pipeline.strategy

    def start(self) -> None:
        """Start background greenlets (health checks, store upkeep). Call in the worker."""
        self.health.start()
        if self.host_load is not None:
            self.host_load.start()
        if self.fleet_load is not None:
            self.fleet_load.start()
        self.resources.start()
        self.response_cache.store.start()
        if self.kv_index is not None:
            self.kv_index.start()
        for scorer in self.pipeline.scorers:
            scorer.start()
        if self.kv_consumers is not None:
            self.kv_consumers.start()

    def summary(self) -> str:
        """One line for the startup log: the backends, the strategy, which tiers are on."""
        c = self.config
        backends = ", ".join(
            f"{b.name}={_public_url(b.url)} ({b.type}; {','.join(b.models) or 'discovered'}"
            f"{'' if b.enabled else '; disabled'}{'; internal' if b.internal else ''})"
            for b in c.backends)
        tiers = [f"prefix_routing={'on' if c.prefix_routing.enabled else 'off'}",
                 "response_cache=" + (c.response_cache.backend if c.response_cache.enabled
                                      else "off"),
                 f"semantic_cache={'on' if self.semantic is not None else 'off'}",
                 "kv_index=" + (c.kv_cache_index.backend if self.kv_index is not None
                                else "off"),
                 "scorers=" + (",".join(type(s).__name__ for s in self.pipeline.scorers)
                               or "none")]
        if self.gemini is not None:  # only with type: gemini backends
            tiers.append("gemini_context_cache=" + (
                "off" if self.gemini_context is None
                else "shared" if c.response_cache.backend != "memory" else "per-worker"))
        return (f"backends: {backends}; strategy: {c.selection_strategy}; "
                f"tiers: {' '.join(tiers)}")

    def stop(self) -> None:
        """Stop background greenlets and close connections."""
        self.health.stop()
        if self.kv_consumers is not None:
            self.kv_consumers.stop()
        for scorer in self.pipeline.scorers:
            scorer.close()
        if self.kv_index is not None:
            self.kv_index.close()
        self.response_cache.store.close()
        if self.semantic is not None:
            self.semantic.close()
        if self.gemini_context is not None:
            self.gemini_context.close()
        self.forwarder.close()
        self.resources.close()  # whatever a plugin did not hand back
        if self.fleet_load is not None:
            self.fleet_load.stop()
        if self.host_load is not None:
            self.host_load.stop()
        if self.host is not None:
            self.host.release()

    def admit(
        self,
        raw: bytes,
        endpoint: str,
        request_id: str,
        *,
        tenant: str | None = None,
        cache_control: str | None = None,
        forward_headers: dict[str, str] | None = None,
        caching: bool = True,
    ) -> RequestContext:
        """Parse a client's request and derive every key from it, once: the one place where
        client input becomes router state, hence the one place where input the checks in
        :func:`~continuum.request.parse_request` did not foresee (an exception from
        parsing, the prefix key or the cache key) becomes a 400 rather than a 500. The
        exception goes to the log with the request id; the client gets the id. What is
        built later from the request (cache salts from the prefix hash, per-backend bodies
        re-encoding what ``json.loads`` produced within the depth limit) cannot fail.

        ``caching=False`` (routing/explain) skips the response cache.
        """
        try:
            ctx = parse_request(raw, endpoint, tenant=tenant, request_id=request_id,
                                max_depth=self.config.server.max_json_depth)
            ctx.forward_headers = forward_headers or None
            self.prepare(ctx, cache_control, caching=caching)
        except ContinuumError:
            raise
        except Exception as exc:
            log.warning("request %s: input rejected, deriving its keys raised %s: %.300s",
                        request_id, type(exc).__name__, exc,
                        exc_info=log.isEnabledFor(logging.DEBUG))
            raise RequestError(f"the request could not be processed ({type(exc).__name__}; "
                               f"request id {request_id})", code="invalid_request") from None
        return ctx

    def prepare(
        self, ctx: RequestContext, cache_control: str | None = None, *, caching: bool = True
    ) -> None:
        """Derive what routing and caching need from the parsed request: the prefix key,
        the chain of prefix keys when the KV scorer matches chains, and, when the response
        cache may answer it, the cache key."""
        settings = self.config.prefix_routing
        if settings.enabled:
            ctx.prefix_key = request_prefix_key(
                ctx.keyed_body, ctx.model, max_prefix_length=settings.max_prefix_length
            )
            chain_scorer = self._chain_scorer
            if chain_scorer is not None and ctx.prefix_key is not None:
                ctx.chain = chain_scorer.request_chain(ctx)
        if caching and self.response_cache.eligible(ctx, cache_control):
            ctx.cache_key = cache_key(ctx)

    def proxy(self, ctx: RequestContext, path: str,
              record: RequestRecord | None = None) -> ProxyResult:
        """Answer ``ctx`` (from :meth:`admit`) from the response cache, or send it to the
        backend the pipeline picks (storing the answer when it is cacheable). ``record``
        (the web layer's, for the metrics and the access log) gets the model, backend,
        routing decision and the usage the answer reports."""
        record = record or RequestRecord(ctx.endpoint, ctx.request_id)
        record.model, record.stream = ctx.model, ctx.stream
        if self._salt_per_tenant and "cache_salt" in ctx.body:
            self._refuse_client_salt(ctx)
        cache = self.response_cache
        if ctx.cache_key is None:
            result = self._forward(ctx, path, record)
            result.headers["X-Cache"] = BYPASS
            return result
        entry = cache.lookup(ctx)
        if entry is not None:
            headers = {"Content-Type": entry.content_type, "X-Cache": HIT}
            if entry.kind == "sse":
                headers["Cache-Control"] = "no-cache"
                return self._replayed(record, headers, None, entry.events())
            return self._replayed(record, headers, entry.payload, None)
        probe = self.semantic.lookup(ctx) if self.semantic is not None else None
        if probe is not None and probe.entry is not None:
            assert self.semantic is not None
            return self._replayed(record, *self.semantic.replay(probe))
        result = self._forward(ctx, path, record, cache, probe)
        result.headers["X-Cache"] = MISS
        return result

    @staticmethod
    def _replayed(record: RequestRecord, headers: dict[str, str], body: bytes | None,
                  stream: Iterator[bytes] | None) -> ProxyResult:
        """A cached answer, its usage read into ``record`` (decision ``cache``)."""
        record.decision = CACHE
        if body is not None:
            read_body(record, body)
            return ProxyResult(200, headers, body=body)
        assert stream is not None
        return ProxyResult(200, headers, stream=iter(UsageStream(stream, record)))

    def _forward(
        self, ctx: RequestContext, path: str, record: RequestRecord,
        cache: ResponseCache | None = None, probe: Probe | None = None,
    ) -> ProxyResult:
        error_event = anthropic_error_event if ctx.protocol == "anthropic" \
            else openai_error_event
        stream_usage = ctx.stream and ctx.endpoint in _USAGE_OPTION_ENDPOINTS and \
            self.config.server.stream_usage and not asks_for_usage(ctx.body)
        upstream = self._send(ctx, path, record, stream_usage)
        headers = upstream.headers()
        headers["X-Continuum-Backend"] = upstream.backend.name
        content_type = headers.get("content-type", "application/json")
        adapter = upstream.adapter
        if ctx.stream and upstream.status == 200:
            record.lease = upstream.lease
            stream = self.forwarder.relay(upstream, error_event)
            if adapter is not None:
                stream = adapter.stream(stream, upstream)
            # the usage-only chunk goes to a client that asked for it, as OpenAI sends it:
            # the one the router asked for, or a translating adapter's (Gemini native)
            stream = iter(UsageStream(stream, record, strip=stream_usage))
            if cache is not None:
                done = None if probe is None or self.semantic is None else \
                    self.semantic.stream_done(probe, content_type)
                stream = cache.tee_stream(ctx, stream, content_type,
                                          lambda: upstream.completed, done)
            return ProxyResult(200, headers, stream=stream)
        data = self.forwarder.read_all(upstream) if adapter is None else \
            adapter.read(self.forwarder, upstream)
        read_body(record, data)
        if cache is not None and not ctx.stream:
            cache.store_body(ctx, upstream.status, content_type, data)
            if probe is not None and self.semantic is not None:
                self.semantic.store_body(probe, upstream.status, content_type, data)
        return ProxyResult(upstream.status, headers, body=data)

    def _send(self, ctx: RequestContext, path: str, record: RequestRecord,
              stream_usage: bool = False) -> Upstream:
        """Select a backend, build the body for it and send it; after a connect failure
        (nothing was sent) once more to another candidate, when the forwarder allows it.

        Raises:
            ModelNotFoundError, NoHealthyBackendError: nothing can take the request.
            UpstreamConnectError: the backend (and the retry, if any) was unreachable.
            UpstreamTimeoutError: the backend accepted the request but did not answer in time.
        """
        forwarder, decide = self.forwarder, self.pipeline.decide
        headers = ctx.forward_headers
        candidates = forwarder.candidates(ctx)
        backend, record.decision = decide(candidates, ctx)
        record.backend = backend.name
        self._routed(ctx, backend)
        try:
            return self._send_to(backend, ctx, path, headers, stream_usage)
        except UpstreamConnectError:
            if not forwarder.may_retry(candidates):
                raise
            forwarder.retrying(backend, ctx)
        backend, record.decision = decide([b for b in candidates if b is not backend], ctx)
        record.backend = backend.name
        self._routed(ctx, backend)
        return self._send_to(backend, ctx, path, headers, stream_usage)

    def _send_to(self, backend: Backend, ctx: RequestContext, path: str,
                 headers: dict[str, str] | None, stream_usage: bool = False) -> Upstream:
        """Send to ``backend``: Gemini backends through their dispatcher (which builds its
        own body), every other one through the forwarder."""
        if self.gemini is not None and backend.config.type == "gemini":
            return self.gemini.send(backend, ctx, path, headers)
        return self.forwarder.send(backend, ctx, path,
                                   self._body_for(ctx, backend, stream_usage), headers)

    def _routed(self, ctx: RequestContext, backend: Backend) -> None:
        """With chain matching, the chain scorer records the route in the index
        (``kv_cache_index.approximate``), so the next request sharing the chain finds it
        before (or without) the engine's KV events."""
        if self._chain_scorer is not None:
            self._chain_scorer.record_route(ctx, backend)

    def _refuse_client_salt(self, ctx: RequestContext) -> None:
        """With per-tenant salts, a client's own ``cache_salt`` would let tenants that pick
        the same value share an engine's prefix cache again: refused for any model a salted
        backend serves (whichever backend the request would have gone to)."""
        serving = self.pool.serving(ctx.model, ctx.protocol)
        if any(b.name in self._salted_backends for b in serving):
            raise RequestError("'cache_salt' is issued by the router per tenant for this "
                               "model; remove it from the request", param="cache_salt")

    def _body_for(self, ctx: RequestContext, backend: Backend,
                  stream_usage: bool = False) -> bytes:
        """The bytes to send ``backend``: the client's own, except for ``type: anthropic``
        backends that get ``cache_control`` injected (where the precedence says so) and
        OpenAI requests to backends with a KV event source, which get a router-issued
        ``cache_salt`` (a client's own is never replaced; with per-tenant salts it is
        refused before this). An Anthropic request to an engine (``anthropic_messages``)
        goes as the client sent it: the engine caches prefixes by itself, and its Messages
        endpoint takes no ``cache_salt``. ``stream_usage`` adds
        ``stream_options.include_usage`` (see :mod:`continuum.routing.usage`)."""
        if ctx.protocol == "anthropic":
            if backend.config.type == "anthropic" and should_inject(
                    self.config.prefix_routing.anthropic_cache_control_injection,
                    backend.config.anthropic_auto_cache_control):
                return injected_body(ctx.body) or ctx.raw
            return ctx.raw
        secret = self._salt_secret
        if secret is None or ctx.prefix_key is None or backend.name not in \
                self._salted_backends or "cache_salt" in ctx.body:
            return with_stream_usage(ctx.body, ctx.raw) if stream_usage else ctx.raw
        salt = make_salt(secret, backend.name, ctx.prefix_hash or "",
                         ctx.tenant if self._salt_per_tenant else None)
        body = {**ctx.body, "cache_salt": salt}
        return with_stream_usage(body, json.dumps(body).encode()) if stream_usage \
            else json.dumps(body).encode()

    def explain(self, ctx: RequestContext) -> dict[str, Any]:
        """What routing would do with ``ctx`` (from :meth:`admit`) and why; sends nothing
        upstream."""
        serving = self.pool.serving(ctx.model, ctx.protocol)
        candidates = [b for b in serving if b.healthy]
        chain = ctx.chain
        doc: dict[str, Any] = {
            "model": ctx.model,
            "prefix_hash": ctx.prefix_hash,
            "kv_match": None if self.kv_scorer is None
            else "chain" if self._chain_scorer is not None else "seed",
            "chain": {"depth": len(chain.keys), "bytes": chain.total_bytes,
                      "keys": list(chain.keys)} if chain is not None else None,
            "prefix_routing_enabled": self.config.prefix_routing.enabled,
            "strategy": self.config.selection_strategy,
            "candidates": [
                {"backend": b.name, "healthy": b.healthy, "in_flight": b.in_flight,
                 "success_rate": round(b.success_rate, 4)}
                for b in serving
            ],
        }
        if not candidates:
            doc["decision"] = None
            doc["reason"] = "no healthy backend serves this model" if serving else \
                "no enabled backend serves this model"
            return doc
        scorer = self.kv_scorer
        if scorer is not None and ctx.prefix_key is not None:
            scorer.prepare(ctx, candidates)
            rows = scorer.explain(ctx, candidates)
            doc["kv_scores"] = rows
            best = max(rows, key=lambda row: row["score"])
            if best["score"] > self.pipeline.threshold:
                reason = ("highest composite score above the pool threshold "
                          f"{self.pipeline.threshold}")
                if "why" in best:
                    reason = (f"highest score above the pool threshold "
                              f"{self.pipeline.threshold}: it matches {best['matched_depth']} "
                              f"of {best['chain_depth']} chain keys ({best['matched_tokens']} "
                              f"tokens) and {best['why']}")
                doc["decision"] = {"decision": "kv_aware", "backend": best["backend"],
                                   "tier": best["tier"], "score": best["score"],
                                   "reason": reason}
                return doc
            doc["kv_fallback_reason"] = (
                "no candidate holds this prefix" if not any(r["token_count"] for r in rows)
                else f"no score above {self.pipeline.threshold}"
                + "".join(f"; {r['backend']}: {r['why']}" for r in rows
                          if r.get("token_count") and "why" in r))
        explain = getattr(self.strategy, "explain", None)
        if explain is not None:
            doc["decision"] = explain(candidates, ctx)
        else:
            doc["decision"] = {"reason": f"{self.config.selection_strategy} does not explain "
                               "its decisions; it picks among the healthy candidates"}
        return doc

    # --- views for the admin API ----------------------------------------------------------

    def strategies_view(self) -> views.StrategiesView:
        """The configured strategy, the registered ones and the plugins loaded so far."""
        return views.StrategiesView(
            selection_strategy=self.config.selection_strategy,
            available=self.registry.names(STRATEGIES),
            loaded=[views.plugin_view(p) for p in self.registry.loaded()],
        )

    def backend_views(self) -> list[views.BackendView]:
        """Every configured backend, in config order."""
        return [views.backend_view(b) for b in self.pool]

    def prefix_routing_view(self) -> views.PrefixRoutingView:
        """Prefix routing settings and the strategy's decisions, if it routes by prefix."""
        return views.prefix_routing_view(self.config.prefix_routing,
                                         self.config.selection_strategy, self.strategy,
                                         self.pool.routable())

    def kv_index_view(self) -> views.KvIndexView:
        """Tier 4 at a glance: index counters, event sources, scorer decisions."""
        scorer = self.kv_scorer.stats() if self.kv_scorer is not None else None
        sources = self.kv_consumers.stats() if self.kv_consumers is not None else []
        return views.kv_index_view(self.config.kv_cache_index, self.kv_index, scorer, sources)

    def kv_sources_view(self) -> views.KvSourcesView:
        """Every KV event source in detail."""
        sources = self.kv_consumers.stats() if self.kv_consumers is not None else []
        return views.KvSourcesView(self.config.kv_cache_index.enabled,
                                   [views.kv_source_view(s) for s in sources])

    def clear_kv_index(self) -> views.KvIndexCleared | None:
        """Drop every KV index entry (events rebuild it); None when there is no index.

        Raises:
            StoreError: the index could not be cleared.
        """
        index = self.kv_index
        if index is None:
            return None
        counts = views.index_counts(index)
        # the seed key's entries and the chain's, as clear() counts them; -1: not known
        # without asking the store (Redis)
        before = counts.entry_count + counts.chain_entry_count \
            if counts.entry_count >= 0 and counts.chain_entry_count >= 0 else -1
        return views.KvIndexCleared(entries_before_clear=before, cleared_entries=index.clear())

    def reload(self, new: RouterConfig) -> ReloadReport:
        """Apply ``new`` to the running worker; report what needs a restart instead.

        Raises:
            ConfigError: ``new``'s backends pass /anthropic requests, which carry no
                ``cache_salt``, to a salted engine while the running per-tenant salts (a
                restart-only setting, which ``new`` may turn off in vain) are in force:
                tenants would share its cache. Nothing was changed.
        """
        old = self.config
        conflicts = new.unsalted_messages(
            keep_restart_fields(old.kv_cache_index.cache_salt, new.kv_cache_index.cache_salt))
        if conflicts:
            raise ConfigError(conflicts)
        report = ReloadReport(restart_required=restart_required(old, new))
        backends = old.backends
        if old.backends != new.backends:
            changed = self._reload_backends(new)
            if changed is None:
                report.restart_required.append("backends")
            else:
                report.applied += changed
                backends = new.backends
        old_leaves = {path: value for path, _f, value in walk(old)}
        for path, _f, value in walk(new):
            if path.startswith("backends") or path in report.restart_required:
                continue
            if old_leaves.get(path, value) != value:
                report.applied.append(path)
        sources = self._reload_kv_sources(old, new, report)
        new = replace(keep_restart_fields(old, new), backends=backends)
        if sources is not None:
            new = replace(new, kv_cache_index=replace(new.kv_cache_index,
                                                      event_sources=sources))
        self.config = new
        if new.selection_strategy != old.selection_strategy:
            self.pipeline.strategy = self._make_strategy(new)
        else:
            report.restart_required += self.strategy.reconfigure(new)
        self.health.reconfigure(new.health_check)
        for backend in self.pool:
            backend.set_ewma_alpha(new.pool.latency_ewma_alpha)
        self.forwarder.retry_connect_errors = new.pool.retry_connect_errors
        self.forwarder.max_response_bytes = new.server.max_upstream_response_bytes
        self.forwarder.max_stream_seconds = new.server.max_stream_duration_seconds
        self.forwarder.retry_after_seconds = new.health_check.interval_seconds
        self._reload_response_cache(new)
        self.auth = ClientAuth(new.auth)
        return report

    def _reload_backends(self, new: RouterConfig) -> list[str] | None:
        """Apply ``new.backends`` to the pool: unchanged backends keep their object and
        state; added and changed ones start unprobed (not routable until a health check
        passes), removed ones leave (their requests in flight finish). The key paths
        applied, or None when a restart is needed instead: a ``type: gemini`` or
        ``internal`` backend is among the changes (the Gemini cache manager and the
        semantic cache hold theirs)."""
        running = {b.name: b for b in self.pool}
        wanted = {c.name: c for c in new.backends}
        touched = sorted(name for name in running.keys() | wanted.keys()
                         if name not in running or name not in wanted
                         or running[name].config != wanted[name])
        configs = [c for name in touched for c in (
            wanted.get(name), running[name].config if name in running else None) if c]
        if any(c.type == "gemini" or c.internal for c in configs):
            return None
        pool = new.pool
        backends = []
        for cfg in new.backends:
            current = running.get(cfg.name)
            if current is None or current.config != cfg:
                replaced = current
                current = Backend(cfg, ewma_alpha=pool.latency_ewma_alpha,
                                  success_window=pool.success_window, unprobed=True)
                current.draining = replaced is not None and replaced.draining
                self.forwarder.forget(cfg.name)
            backends.append(current)
        for name in touched:
            if name not in wanted:
                self.forwarder.forget(name)
        self.pool.replace(backends)
        self.health.sync()
        log.info("backends reloaded: %s (added or changed ones are unprobed until a "
                 "health check passes)", ", ".join(touched))
        return [f"backends.{name}" for name in touched]

    def _reload_kv_sources(self, old: RouterConfig, new: RouterConfig,
                           report: ReloadReport) -> tuple[KvEventSourceConfig, ...] | None:
        """Changed ``kv_cache_index.event_sources``: restart every consumer, pull and push
        sources together (:func:`~continuum.kv.bus_consumer.rebuild_consumers`); the new
        sources, or None when nothing changed or the index itself needs a restart."""
        kv_old, kv_new = old.kv_cache_index, new.kv_cache_index
        if (self.kv_consumers is None or self.kv_index is None or kv_old.event_sources ==
                kv_new.event_sources or replace(kv_old, event_sources=()) !=
                replace(kv_new, event_sources=(), cache_salt=kv_old.cache_salt)):
            return None
        self.kv_consumers = rebuild_consumers(
            self.kv_consumers, kv_new.event_sources, self.kv_index,
            {s.backend_name: kv_new.source_token(s) for s in kv_new.event_sources},
            self.metrics.registry)
        self._salted_backends = frozenset(s.backend_name for s in kv_new.event_sources)
        prefix = "kv_cache_index.event_sources"
        report.restart_required[:] = [p for p in report.restart_required
                                      if not p.startswith(prefix)]
        report.applied.append(prefix)
        return kv_new.event_sources

    def _reload_response_cache(self, new: RouterConfig) -> None:
        """The store adjusts itself or builds its replacement (new connection settings:
        a new pool); the old store is closed, and its connection with it unless another
        plugin (a KV index on the same server) still holds it."""
        replacement = self.response_cache.store.reconfigure(new, **self._collaborators())
        if replacement is not None:
            replacement.start()
        self.response_cache.reconfigure(new.response_cache, replacement)
        # The semantic index survives a reload unless its embedding backend or model
        # changed or the path was turned off (SemanticCache.reconfigure decides).
        if self.semantic is None or not self.semantic.reconfigure(new):
            if self.semantic is not None:
                self.semantic.close()
            self.semantic = self._build_semantic(new)

    def response_cache_stats(self) -> dict[str, Any]:
        """``/admin/response-cache/stats``: the exact cache's document with a ``semantic``
        section."""
        doc = self.response_cache.stats()
        doc["semantic"] = self.semantic.stats() if self.semantic is not None else \
            {"enabled": False}
        return doc

    def clear_response_cache(self) -> tuple[int, int]:
        """Drop every response-cache entry (the ``sem:`` space with them) and this worker's
        semantic index: (store entries, index entries).

        Raises:
            StoreError: the store could not be cleared.
        """
        cleared = self.response_cache.clear()
        return cleared, self.semantic.clear() if self.semantic is not None else 0

    def gemini_context_stats(self) -> dict[str, Any]:
        """``/admin/gemini-context-cache/stats`` (``{"enabled": false}`` when off)."""
        if self.gemini_context is None:
            return {"enabled": False}
        return self.gemini_context.stats()

    def clear_gemini_context(self) -> int | None:
        """Drop the Gemini cache map and DELETE its resources; None when it is off."""
        return None if self.gemini_context is None else self.gemini_context.clear()
