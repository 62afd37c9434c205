"""The router service: what a proxy request does, independent of the web framework."""

from __future__ import annotations

import logging
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from continuum.backends import Backend, BackendPool
from continuum.health import HealthMonitor
from continuum.metrics import RouterMetrics
from continuum.proxy import Forwarder, openai_error_event
from continuum.registry import PluginRegistry
from continuum.selection import SelectionPipeline

if TYPE_CHECKING:
    from continuum.config import RouterConfig
    from continuum.interfaces import BackendScorer
    from continuum.request import RequestContext

log = logging.getLogger(__name__)


@dataclass
class ProxyResult:
    """What to send back to the client: a body or a stream, with status and headers."""

    status: int
    headers: dict[str, str] = field(default_factory=dict)
    body: bytes | None = None
    stream: Iterator[bytes] | None = None


class RouterService:
    """Holds one worker's run-time state and proxies requests through it.

    Built from a :class:`RouterConfig` by :func:`build_service`; the web layer calls
    :meth:`proxy` and reads the attributes for admin views.
    """

    def __init__(
        self,
        config: RouterConfig,
        *,
        registry: PluginRegistry,
        metrics: RouterMetrics,
        scorers: tuple[BackendScorer, ...] = (),
    ) -> None:
        self.config = config
        self.registry = registry
        self.metrics = metrics
        self.pool = BackendPool(
            Backend(b, ewma_alpha=config.pool.latency_ewma_alpha,
                    success_window=config.pool.success_window)
            for b in config.backends
        )
        self.health = HealthMonitor(self.pool, config.health_check, metrics)
        strategy = registry.create("continuum.strategies", config.selection_strategy, config)
        self.pipeline = SelectionPipeline(strategy, scorers)
        self.forwarder = Forwarder(
            self.pool,
            metrics,
            retry_connect_errors=config.pool.retry_connect_errors,
            on_result=self.health.observe,
        )

    def start(self) -> None:
        """Start background greenlets (health checks). Call in the worker process."""
        self.health.start()

    def stop(self) -> None:
        """Stop background greenlets."""
        self.health.stop()

    def proxy(self, ctx: RequestContext, path: str) -> ProxyResult:
        """Send ``ctx`` to the backend the pipeline picks and return what to answer."""
        upstream = self.forwarder.open(ctx, self.pipeline.select, path, ctx.raw)
        headers = upstream.headers()
        headers["X-Continuum-Backend"] = upstream.backend.name
        if ctx.stream and upstream.status == 200:
            stream = self.forwarder.relay(upstream, openai_error_event)
            return ProxyResult(200, headers, stream=stream)
        body = self.forwarder.read_all(upstream)
        return ProxyResult(upstream.status, headers, body=body)
