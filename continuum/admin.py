"""``/admin`` endpoints: read-only views of the router's state, behind a bearer token."""

from __future__ import annotations

import json
from typing import Any

import falcon

from continuum.service import RouterService


class _AdminResource:
    def __init__(self, service: RouterService, auth: Any) -> None:
        self.service = service
        self.auth = auth

    def _send(self, resp: falcon.Response, doc: Any) -> None:
        resp.content_type = "application/json"
        resp.data = json.dumps(doc, indent=2).encode()


class StrategiesResource(_AdminResource):
    """``GET /admin/strategies``: available and loaded plugins with their distributions."""

    def on_get(self, req: falcon.Request, resp: falcon.Response) -> None:
        self.auth.check(req)
        registry = self.service.registry
        loaded = [
            {"group": p.group, "name": p.name, "distribution": p.distribution,
             "version": p.version, "object": p.value}
            for p in registry.loaded()
        ]
        self._send(resp, {
            "selection_strategy": self.service.config.selection_strategy,
            "available": registry.names("continuum.strategies"),
            "loaded": loaded,
        })


class BackendsResource(_AdminResource):
    """``GET /admin/backends``: health, in-flight, latency and success rate per backend."""

    def on_get(self, req: falcon.Request, resp: falcon.Response) -> None:
        self.auth.check(req)
        backends = [
            {
                "name": b.name,
                "url": b.url,
                "enabled": b.config.enabled,
                "internal": b.config.internal,
                "healthy": b.healthy,
                "in_flight": b.in_flight,
                "latency_ewma_ms": (
                    None if b.latency_ewma is None else round(b.latency_ewma * 1000, 3)
                ),
                "success_rate": round(b.success_rate, 4),
                "models": sorted(b.models),
                "weight": b.weight,
            }
            for b in self.service.pool
        ]
        self._send(resp, {"backends": backends})


def add_routes(app: falcon.App[Any, Any], service: RouterService, auth: Any) -> None:
    """Mount every admin resource on ``app``."""
    app.add_route("/admin/strategies", StrategiesResource(service, auth))
    app.add_route("/admin/backends", BackendsResource(service, auth))
