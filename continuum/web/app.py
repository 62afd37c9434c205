"""The WSGI application: thin Falcon resources over :class:`~continuum.service.RouterService`.

``gunicorn -c conf/gunicorn.conf.py 'continuum.app:get_app()'`` calls
:func:`get_app` in each worker after the fork; it reads ``$CONTINUUM_CONFIG``.
"""

from __future__ import annotations

import json
import logging
import os
from typing import Any

import falcon

from continuum import request as rq
from continuum.config import CONFIG_ENV, RouterConfig
from continuum.errors import (
    ConfigError,
    ConfigIssue,
    ContinuumError,
    ModelNotFoundError,
    RequestError,
)
from continuum.hostshm import RUNTIME_DIR_ENV
from continuum.metrics import CONTENT_TYPE, RouterMetrics
from continuum.registry import PluginRegistry
from continuum.routing import anthropic
from continuum.service import RouterService
from continuum.web import admin, drain, tracing
from continuum.web.fleet import FleetBus, fleet_of
from continuum.web.http import (
    JSON,
    RequestIdHeader,
    handle_continuum_error,
    handle_unexpected,
    read_body,
    request_id_of,
    serialize_http_error,
)
from continuum.web.observe import LOG_FORMAT, Observer, configure_access_log
from continuum.web.reload import ConfigReloader, boot_config, config_state

log = logging.getLogger(__name__)


class ProxyResource:
    """``POST`` an OpenAI-compatible request to the chosen backend."""

    #: Its requests get a server span when tracing is on (:mod:`continuum.web.tracing`).
    traced = True

    def __init__(self, service: RouterService, endpoint: str, path: str) -> None:
        self.service = service
        self.endpoint = endpoint
        self.path = path

    def on_post(self, req: falcon.Request, resp: falcon.Response) -> None:
        service = self.service
        # Headers read from the WSGI environment as ``get_header`` reads them, without
        # the KeyError it raises and catches for each absent one.
        env = req.env
        tenant = service.auth.tenant(env.get("HTTP_AUTHORIZATION"), env.get("HTTP_X_API_KEY"))
        server = service.config.server
        raw = read_body(req, server.max_body_bytes, server.client_body_timeout_seconds)
        forward = None
        if self.endpoint in rq.ANTHROPIC_ENDPOINTS:
            forward = {name: value for name in anthropic.FORWARDED_HEADERS
                       if (value := req.get_header(name))}
        record = req.context.__dict__.get("record")  # Context.get, without its call
        if record is not None:
            record.tenant = tenant
        ctx = service.admit(raw, self.endpoint, request_id_of(req), tenant=tenant,
                            cache_control=env.get("HTTP_CACHE_CONTROL"),
                            forward_headers=forward)
        result = service.proxy(ctx, self.path, record)
        resp.status = result.status
        resp.set_headers(result.headers)  # set_header for each, in one call
        if result.stream is not None:
            resp.set_header("Cache-Control", "no-cache")
            resp.stream = result.stream
        else:
            resp.data = result.body


class ModelsResource:
    """``GET /v1/models``: the union of every routable backend's models."""

    endpoint = "models"

    def __init__(self, service: RouterService) -> None:
        self.service = service

    def on_get(self, req: falcon.Request, resp: falcon.Response) -> None:
        data = [_openai_model(mid) for mid in self.service.pool.model_ids("openai")]
        resp.content_type = JSON
        resp.data = json.dumps({"object": "list", "data": data}).encode()

    def on_get_one(self, req: falcon.Request, resp: falcon.Response, model_id: str) -> None:
        """``GET /v1/models/{id}`` (``client.models.retrieve``)."""
        if model_id not in self.service.pool.model_ids("openai"):
            raise ModelNotFoundError(f"The model '{model_id}' does not exist or is not "
                                     "served by this router", param="model")
        resp.content_type = JSON
        resp.data = json.dumps(_openai_model(model_id)).encode()


def _openai_model(model_id: str) -> dict[str, Any]:
    return {"id": model_id, "object": "model", "created": 0, "owned_by": "continuum-router"}


def _anthropic_model(model_id: str) -> dict[str, Any]:
    return {"type": "model", "id": model_id, "display_name": model_id,
            "created_at": "1970-01-01T00:00:00Z"}


class AnthropicModelsResource:
    """``GET /anthropic/v1/models`` and ``/{id}``: the Anthropic backends' models, in the
    Models API's shape (one page: ``has_more`` false)."""

    endpoint = "anthropic_models"

    def __init__(self, service: RouterService) -> None:
        self.service = service

    def on_get(self, req: falcon.Request, resp: falcon.Response) -> None:
        ids = self.service.pool.model_ids("anthropic")
        resp.content_type = JSON
        resp.data = json.dumps({"data": [_anthropic_model(mid) for mid in ids],
                                "has_more": False, "first_id": ids[0] if ids else None,
                                "last_id": ids[-1] if ids else None}).encode()

    def on_get_one(self, req: falcon.Request, resp: falcon.Response, model_id: str) -> None:
        if model_id not in self.service.pool.model_ids("anthropic"):
            raise ModelNotFoundError(f"model: {model_id}", param="model")
        resp.content_type = JSON
        resp.data = json.dumps(_anthropic_model(model_id)).encode()


class HealthResource:
    """``GET /health`` (and ``HEAD``): 200 while at least one routable backend is healthy,
    else 503. Like a request, it first waits for the first probe results when no backend
    is healthy yet but some are unprobed (a worker that just started): a live fleet is not
    reported down for the milliseconds its first probes take."""

    def __init__(self, service: RouterService) -> None:
        self.service = service

    def on_get(self, req: falcon.Request, resp: falcon.Response) -> None:
        routable = self.service.pool.routable()
        if not any(b.healthy for b in routable):
            self.service.health.await_first_results(routable)
        healthy = sum(1 for b in routable if b.healthy)
        ok = healthy > 0
        resp.status = 200 if ok else 503
        resp.content_type = JSON
        resp.data = json.dumps(
            {"status": "ok" if ok else "unavailable",
             "backends": {"healthy": healthy, "total": len(routable)}}
        ).encode()

    #: ``HEAD /health`` (load balancers' checks such as HAProxy's ``httpchk HEAD``): the
    #: same status and headers, no body (Falcon drops it for HEAD).
    on_head = on_get


class MetricsResource:
    """``GET /metrics``: Prometheus text exposition (all workers in multiprocess mode)."""

    def __init__(self, metrics: RouterMetrics) -> None:
        self.metrics = metrics

    def on_get(self, req: falcon.Request, resp: falcon.Response) -> None:
        resp.content_type = CONTENT_TYPE
        resp.data = self.metrics.exposition()


class RouterApp(falcon.App):  # type: ignore[type-arg]
    """The Falcon app, with the worker's :class:`RouterService` at ``.service``."""

    service: RouterService
    #: The drained set of backends (``/admin/backends/{name}/drain``).
    drain: drain.DrainControl
    #: Records every client request in the metrics and the access log.
    observer: Observer


def create_app(
    config: RouterConfig,
    *,
    registry: PluginRegistry | None = None,
    metrics: RouterMetrics | None = None,
    service: RouterService | None = None,
    reloader: ConfigReloader | None = None,
    tracer_provider: Any = None,
) -> RouterApp:
    """Build the Falcon app for ``config``; collaborators may be injected (tests).

    Tracing is on with ``tracer_provider`` (an OpenTelemetry one), or when the ``OTEL_*``
    environment asks for it (:mod:`continuum.web.tracing`)."""
    registry = registry or PluginRegistry()
    metrics = metrics or RouterMetrics()
    service = service or RouterService(config, registry=registry, metrics=metrics)
    app = RouterApp(media_type=JSON, middleware=[admin.AdminGate(service)])
    app.req_options.strip_url_path_trailing_slash = True
    app.add_middleware(RequestIdHeader())
    app.observer = Observer(metrics, config.server.access_log)
    app.add_middleware(app.observer)
    if service.host is not None:  # several workers of one host: act as one (scale-out)
        service.fleet = FleetBus(service, reloader, service.host, config)  # type: ignore[attr-defined]
        app.add_middleware(service.fleet)  # type: ignore[attr-defined]
    app.add_error_handler(Exception, handle_unexpected)
    app.add_error_handler(ContinuumError, handle_continuum_error)
    app.set_error_serializer(serialize_http_error)
    app.add_route("/v1/chat/completions", ProxyResource(service, rq.CHAT, "/v1/chat/completions"))
    app.add_route("/v1/completions", ProxyResource(service, rq.COMPLETIONS, "/v1/completions"))
    app.add_route("/v1/embeddings", ProxyResource(service, rq.EMBEDDINGS, "/v1/embeddings"))
    app.add_route("/v1/responses", ProxyResource(service, rq.RESPONSES, "/v1/responses"))
    models = ModelsResource(service)
    app.add_route("/v1/models", models)
    # :path: model ids such as meta-llama/Llama-3.1-8B-Instruct hold slashes
    app.add_route("/v1/models/{model_id:path}", models, suffix="one")
    anthropic_models = AnthropicModelsResource(service)
    app.add_route("/anthropic/v1/models", anthropic_models)
    app.add_route("/anthropic/v1/models/{model_id:path}", anthropic_models, suffix="one")
    app.add_route(
        "/anthropic/v1/messages",
        ProxyResource(service, rq.ANTHROPIC_MESSAGES, "/v1/messages"),
    )
    app.add_route(
        "/anthropic/v1/messages/count_tokens",
        ProxyResource(service, rq.ANTHROPIC_COUNT_TOKENS, "/v1/messages/count_tokens"),
    )
    app.add_route("/health", HealthResource(service))
    app.add_route("/metrics", MetricsResource(metrics))
    index = admin.add_routes(app, service, reloader)
    app.drain = drain.add_routes(app, service, index)
    fleet = fleet_of(service)
    if fleet is not None:  # drains made elsewhere reach this worker's set through the bus
        fleet.drain = app.drain
        fleet.views = index.views()  # and ?workers=all asks every worker for its view
    tracing.install(app, service, tracer_provider)
    app.service = service
    return app


#: Logged by every worker of a gunicorn started without ``continuum.gunicorn_conf``, which
#: sets ``$CONTINUUM_RUNTIME_DIR`` in the master (plain ``gunicorn -k gevent``).
WITHOUT_GUNICORN_CONF = (
    "gunicorn was started without the router's settings (-c python:continuum.gunicorn_conf "
    "or -c conf/gunicorn.conf.py; continuum-router serve passes them): the workers share "
    "nothing. An admin clear or reload reaches only the worker that answers it; in-flight "
    "counts, health checks and RoundRobin's rotation are each worker's own; /metrics shows "
    "the samples of whichever worker answers the scrape; request headers have no deadline; "
    "server.bind and server.workers are not read")

#: Longest a starting worker waits for its first health check round before serving.
_STARTUP_PROBE_SECONDS = 1.0


def get_app() -> RouterApp:
    """Entry point for gunicorn: load ``$CONTINUUM_CONFIG``, build the app, start greenlets."""
    registry = PluginRegistry()
    path = os.environ.get(CONFIG_ENV)
    if not path:
        raise ConfigError([ConfigIssue("<file>", f"set ${CONFIG_ENV} to the config file")])
    seen = config_state(path)  # before the read: a change while this worker boots is seen
    result, fell_back = boot_config(path, registry)  # the file's, or the last good one
    config = result.config
    assert config is not None  # boot_config raises otherwise
    logging.basicConfig(
        level=config.server.log_level.upper(),
        format=LOG_FORMAT,
    )
    if fell_back is not None:
        log.error("%s", fell_back)
    for warning in result.warnings:
        log.warning("config: %s", warning.render(result.source))
    if not os.environ.get(RUNTIME_DIR_ENV):
        log.warning(WITHOUT_GUNICORN_CONF)
    configure_access_log(config.server.access_log)
    metrics = RouterMetrics()
    metrics.workers.set(1)
    service = RouterService(config, registry=registry, metrics=metrics)
    reloader = ConfigReloader(service, path, seen)
    app = create_app(config, registry=registry, metrics=metrics, service=service,
                     reloader=reloader)
    service.start()
    # Every backend is unprobed until this worker's first health check round: let the live
    # ones answer before the first request (a silent one does not hold the boot longer).
    service.health.await_startup(_STARTUP_PROBE_SECONDS)
    app.drain.start()
    fleet = fleet_of(service)
    if fleet is not None:
        fleet.start()
    log.info("%s", service.summary())
    if config.server.watch_config:
        reloader.start(config.server.watch_interval_seconds)
    return app


__all__ = ["RequestError", "create_app", "get_app"]
