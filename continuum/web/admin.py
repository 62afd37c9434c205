"""``/admin`` endpoints: views of the router's state and a few controls, behind a token.

Access is decided in one place, :class:`AdminGate`, a Falcon middleware that runs before
any admin responder: a valid bearer token when one is configured, else 403 for everyone
unless ``admin.allow_unauthenticated`` opts out. State is per gunicorn worker (see the
README): each answer carries ``worker_pid``.
"""

from __future__ import annotations

import hmac
import json
import os
from collections.abc import Callable, Sequence
from dataclasses import asdict
from typing import Any

import falcon

from continuum import request as rq
from continuum.errors import (
    AuthenticationError,
    ConfigError,
    ContinuumError,
    RequestError,
    StoreError,
)
from continuum.service import RouterService
from continuum.web import totals
from continuum.web.fleet import fleet_of
from continuum.web.http import read_body, request_id_of
from continuum.web.reload import ConfigReloader


class AdminDisabledError(ContinuumError, PermissionError):
    """No admin token is configured, so every admin endpoint is closed (403)."""

    status = 403
    error_type = "permission_error"
    code = "admin_token_not_configured"


class AdminGate:
    """Falcon middleware: the only place ``/admin`` access is decided.

    It guards every resource derived from :class:`AdminResource`, whatever the path or
    method, before the responder runs (so a refused request never reads its body). The
    token is read from the live config on each request, so a reload rotates it.
    """

    def __init__(self, service: RouterService) -> None:
        self.service = service

    def process_resource(self, req: falcon.Request, resp: falcon.Response,
                         resource: object, params: dict[str, Any]) -> None:
        """Raise unless ``req`` may use ``resource``.

        Raises:
            AuthenticationError: a token is configured and the request lacks it (401).
            AdminDisabledError: no token and no ``allow_unauthenticated`` (403).
        """
        if not isinstance(resource, AdminResource):
            return
        admin = self.service.config.admin
        token = admin.resolved_token()
        if token:
            header = req.get_header("Authorization") or ""
            scheme, _, given = header.partition(" ")
            if scheme.lower() != "bearer" or not hmac.compare_digest(
                    given.strip().encode(), token.encode()):
                raise AuthenticationError("admin endpoints require a valid bearer token: "
                                          "send 'Authorization: Bearer <admin.token>'")
        elif not admin.allow_unauthenticated:
            raise AdminDisabledError(
                "admin endpoints are disabled because no admin token is configured: set "
                "admin.token (or admin.token_env, naming an environment variable) in the "
                "config and send 'Authorization: Bearer <token>'; for local development "
                "only, admin.allow_unauthenticated: true opens them without a token")


class AdminResource:
    """Base of every ``/admin`` resource; :class:`AdminGate` guards them all."""

    def __init__(self, service: RouterService) -> None:
        self.service = service

    def _spread(self, doc: dict[str, Any], action: str,
                payload: dict[str, Any] | None = None) -> None:
        """Add the ``fleet`` section: how many workers and routers applied ``action``; and
        add what the others cleared to this worker's counts in ``doc``, so that they are the
        fleet's."""
        fleet = fleet_of(self.service)
        if fleet is not None:
            section = fleet.spread(action, payload)
            for key, count in section.pop("elsewhere", {}).items():
                if isinstance(doc.get(key), int):
                    doc[key] += count
            doc["fleet"] = section

    def _send(self, resp: falcon.Response, doc: dict[str, Any], status: int = 200) -> None:
        resp.status = status
        resp.content_type = "application/json"
        resp.data = json.dumps({**doc, "worker_pid": os.getpid()}, indent=2).encode()


class AdminView(AdminResource):
    """A ``GET`` view of one worker's state (:meth:`doc`). ``?workers=all`` answers with
    every worker's view instead: ``{"workers": [...], "fleet": {...}}``, this worker's
    first, then those of the host's other workers and of the routers sharing Redis, each
    with its ``worker_pid``, gathered through the fleet bus (:mod:`continuum.web.fleet`);
    a view with per-worker counters adds their sums as ``total`` (:meth:`total`)."""

    #: The path it is mounted at (set by :meth:`AdminIndexResource.mount`), which names the
    #: view to the other workers.
    path = ""

    def doc(self) -> dict[str, Any]:
        raise NotImplementedError

    def snapshot(self) -> dict[str, Any]:
        """:meth:`doc` with this worker's ``worker_pid``: one entry of ``?workers=all``."""
        return {**self.doc(), "worker_pid": os.getpid()}

    def total(self, views: Sequence[dict[str, Any]]) -> dict[str, Any] | None:
        """The ``total`` section of ``?workers=all`` (:mod:`continuum.web.totals`); None:
        a view without counters to sum."""
        return None

    def on_get(self, req: falcon.Request, resp: falcon.Response) -> None:
        scope = req.get_param("workers")
        if scope is None:
            self._send(resp, self.doc())
            return
        if scope != "all":
            raise RequestError(f"workers must be 'all' (every worker's view), got '{scope}'",
                               param="workers", code="invalid_value")
        views = [self.snapshot()]
        doc: dict[str, Any] = {"workers": views}
        fleet = fleet_of(self.service)
        if fleet is not None:  # else one worker, or workers that share nothing: this one
            section = fleet.spread("snapshot", {"view": self.path})
            views += section.pop("elsewhere", {}).get("snapshots", [])
            doc["fleet"] = section
        total = self.total(views)
        if total is not None:
            doc["total"] = total
        self._send(resp, doc)


class StrategiesResource(AdminView):
    """``GET /admin/strategies``: available and loaded plugins with their distributions."""

    def doc(self) -> dict[str, Any]:
        return asdict(self.service.strategies_view())


class BackendsResource(AdminView):
    """``GET /admin/backends``: health, in-flight, latency and success rate per backend."""

    def doc(self) -> dict[str, Any]:
        return {"backends": [asdict(b) for b in self.service.backend_views()],
                "health_checks": self.service.health.view()}


class PrefixRoutingStatsResource(AdminView):
    """``GET /admin/prefix-routing/stats``: prefix routing's settings, its routing
    decisions, the load per backend and the unique prefixes seen (this worker)."""

    def doc(self) -> dict[str, Any]:
        return asdict(self.service.prefix_routing_view())

    def total(self, views: Sequence[dict[str, Any]]) -> dict[str, Any] | None:
        return totals.prefix_routing(views)


class ExplainResource(AdminResource):
    """``POST /admin/routing/explain``: how a request body would be routed, sending nothing.

    The body is the request as a client would send it; ``?endpoint=anthropic`` reads it as
    an Anthropic Messages request.
    """

    def on_post(self, req: falcon.Request, resp: falcon.Response) -> None:
        given = req.get_param("endpoint")
        if given not in (None, "anthropic", "chat"):
            raise RequestError(f"endpoint must be 'chat' (the default) or 'anthropic', got "
                               f"'{given}'", param="endpoint", code="invalid_value")
        endpoint = rq.ANTHROPIC_MESSAGES if given == "anthropic" else rq.CHAT
        server = self.service.config.server
        raw = read_body(req, server.max_body_bytes, server.client_body_timeout_seconds)
        ctx = self.service.admit(raw, endpoint, request_id_of(req), caching=False)
        self._send(resp, self.service.explain(ctx))


class ConfigReloadResource(AdminResource):
    """``POST /admin/config/reload``: re-read the config file in every worker and router;
    a file with errors is refused and the running config kept."""

    def __init__(self, service: RouterService, reloader: ConfigReloader | None) -> None:
        super().__init__(service)
        self.reloader = reloader

    def on_post(self, req: falcon.Request, resp: falcon.Response) -> None:
        if self.reloader is None:
            raise _NoConfigFile("this router was not started from a config file")
        try:
            report = self.reloader.reload(broadcast=fleet_of(self.service) is None)
        except ConfigError as exc:
            self._send(resp, {"success": False, "errors": [
                issue.render(exc.source) for issue in exc.issues]}, status=400)
            return
        doc = {"success": True, **report.as_dict()}
        self._spread(doc, "reload")
        self._send(resp, doc)


class ResponseCacheStatsResource(AdminView):
    """``GET /admin/response-cache/stats``: entries, hits, misses and evictions of the
    response cache (and the semantic cache), with its settings."""

    def doc(self) -> dict[str, Any]:
        return self.service.response_cache_stats()

    def total(self, views: Sequence[dict[str, Any]]) -> dict[str, Any] | None:
        return totals.response_cache(views)


class ResponseCacheInvalidateResource(AdminResource):
    """``POST /admin/response-cache/invalidate``: empty the response cache and the semantic
    index on every worker and router; the body is ``{"clear_all": true}``."""

    def on_post(self, req: falcon.Request, resp: falcon.Response) -> None:
        raw = read_body(req, 65536, self.service.config.server.client_body_timeout_seconds)
        try:
            body = rq.load_json(raw or b"{}")
        except RequestError:
            raise RequestError("body must be JSON: {\"clear_all\": true}",
                               code="invalid_json") from None
        if not isinstance(body, dict) or body.get("clear_all") is not True:
            raise RequestError("only {\"clear_all\": true} is supported", param="clear_all",
                               code="invalid_value")
        try:
            cleared, semantic = self.service.clear_response_cache()
        except StoreError as exc:
            self._send(resp, {"success": False, "action": "clear_all",
                              "error": exc.message}, status=503)
            return
        doc: dict[str, Any] = {"success": True, "action": "clear_all",
                               "cleared_entries": cleared}
        if self.service.semantic is not None:  # the seed's shape when the path is off
            doc["cleared_semantic_index_entries"] = semantic
        self._spread(doc, "response_cache_clear")
        self._send(resp, doc)


class KvIndexStatsResource(AdminView):
    """``GET /admin/kv-index/stats``: the KV cache index's settings and counters, its
    event sources and the scorer's decisions."""

    def doc(self) -> dict[str, Any]:
        return asdict(self.service.kv_index_view())

    def total(self, views: Sequence[dict[str, Any]]) -> dict[str, Any] | None:
        return totals.kv_index(views)


class KvIndexBackendsResource(AdminView):
    """``GET /admin/kv-index/backends``: per-backend event statistics."""

    def doc(self) -> dict[str, Any]:
        return asdict(self.service.kv_sources_view())


class KvIndexClearResource(AdminResource):
    """``POST /admin/kv-index/clear``: drop every entry on every worker and router; the
    engines' events rebuild the index."""

    def on_post(self, req: falcon.Request, resp: falcon.Response) -> None:
        try:
            cleared = self.service.clear_kv_index()
        except StoreError as exc:
            self._send(resp, {"success": False, "error": exc.message}, status=503)
            return
        if cleared is None:
            raise _KvIndexDisabled("the KV cache index is not enabled "
                                   "(kv_cache_index.enabled: false)")
        doc = {"success": True, **asdict(cleared)}
        self._spread(doc, "kv_index_clear")
        self._send(resp, doc)


class GeminiContextStatsResource(AdminView):
    """``GET /admin/gemini-context-cache/stats``: the Gemini context cache's entries,
    refusals, creations in flight and counters per backend (this worker)."""

    def doc(self) -> dict[str, Any]:
        return self.service.gemini_context_stats()

    def total(self, views: Sequence[dict[str, Any]]) -> dict[str, Any] | None:
        return totals.gemini_context(views)


class GeminiContextClearResource(AdminResource):
    """``POST /admin/gemini-context-cache/clear``: empty the map on every worker and router
    and DELETE its cachedContents resources."""

    def on_post(self, req: falcon.Request, resp: falcon.Response) -> None:
        cleared = self.service.clear_gemini_context()
        if cleared is None:
            raise _GeminiContextDisabled(
                "the Gemini context cache is not enabled (gemini_context_cache.enabled: "
                "false, or no type: gemini backend)")
        doc: dict[str, Any] = {"success": True, "cleared_entries": cleared}
        self._spread(doc, "gemini_context_clear")
        self._send(resp, doc)


class _NoConfigFile(ContinuumError):
    status = 409
    error_type = "invalid_request_error"
    code = "no_config_file"


class _TierDisabled(ContinuumError):
    """An action on a tier that is off: 409 Conflict with the router's state."""

    status = 409
    error_type = "invalid_request_error"
    code = "tier_disabled"


class _KvIndexDisabled(_TierDisabled):
    code = "kv_index_disabled"


class _GeminiContextDisabled(_TierDisabled):
    code = "gemini_context_cache_disabled"


class AdminIndexResource(AdminResource):
    """``GET /admin``: every admin endpoint, its methods and what it does."""

    def __init__(self, service: RouterService) -> None:
        super().__init__(service)
        self.routes: list[tuple[str, AdminResource]] = []

    def mount(self, app: falcon.App[Any, Any], path: str, resource: AdminResource) -> None:
        """``app.add_route(path, resource)``, listed here."""
        app.add_route(path, resource)
        self.routes.append((path, resource))
        if isinstance(resource, AdminView):
            resource.path = path

    def views(self) -> dict[str, Callable[[], dict[str, Any]]]:
        """Every mounted :class:`AdminView`'s :meth:`~AdminView.snapshot`, by path (what a
        ``snapshot`` fleet action may ask a worker for)."""
        return {path: resource.snapshot for path, resource in self.routes
                if isinstance(resource, AdminView)}

    def on_get(self, req: falcon.Request, resp: falcon.Response) -> None:
        self._send(resp, {"endpoints": [_describe(path, resource)
                                        for path, resource in self.routes]})


def _describe(path: str, resource: AdminResource) -> dict[str, Any]:
    """An index row: the path, its methods (from the responders) and the resource's
    ``description``, else its docstring's first paragraph without the leading
    ``METHOD /path``."""
    methods = [m for m in ("GET", "POST", "PUT", "PATCH", "DELETE")
               if callable(getattr(resource, "on_" + m.lower(), None))]
    line = getattr(resource, "description", None) or \
        (type(resource).__doc__ or "").strip().split("\n\n")[0]
    summary = " ".join(line.split())
    if summary.startswith("``") and "``:" in summary:
        summary = summary.split("``:", 1)[1].strip()
    row: dict[str, Any] = {"path": path, "methods": methods,
                           "description": summary.replace("``", "")}
    if isinstance(resource, AdminView):
        row["query"] = {"workers": "all: every worker's and router's view in one answer"}
    return row


def add_routes(
    app: falcon.App[Any, Any], service: RouterService, reloader: ConfigReloader | None = None,
) -> AdminIndexResource:
    """Mount every admin resource on ``app`` (which must also carry :class:`AdminGate`), and
    ``GET /admin``, which lists them; other modules mount theirs through the index
    returned (:meth:`AdminIndexResource.mount`)."""
    index = AdminIndexResource(service)
    app.add_route("/admin", index)
    for path, resource in (
            ("/admin/strategies", StrategiesResource(service)),
            ("/admin/backends", BackendsResource(service)),
            ("/admin/prefix-routing/stats", PrefixRoutingStatsResource(service)),
            ("/admin/routing/explain", ExplainResource(service)),
            ("/admin/config/reload", ConfigReloadResource(service, reloader)),
            ("/admin/response-cache/stats", ResponseCacheStatsResource(service)),
            ("/admin/response-cache/invalidate", ResponseCacheInvalidateResource(service)),
            ("/admin/kv-index/stats", KvIndexStatsResource(service)),
            ("/admin/kv-index/backends", KvIndexBackendsResource(service)),
            ("/admin/kv-index/clear", KvIndexClearResource(service)),
            ("/admin/gemini-context-cache/stats", GeminiContextStatsResource(service)),
            ("/admin/gemini-context-cache/clear", GeminiContextClearResource(service))):
        index.mount(app, path, resource)
    return index


__all__ = [
    "AdminDisabledError", "AdminGate", "AdminIndexResource", "AdminResource", "RequestError",
    "add_routes",
]
