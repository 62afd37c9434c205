"""The WSGI application: thin Falcon resources over :class:`~continuum.service.RouterService`.

``gunicorn -c conf/gunicorn.conf.py 'continuum.app:get_app()'`` calls
:func:`get_app` in each worker after the fork; it reads ``$CONTINUUM_CONFIG``.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import socket
from typing import Any

import falcon
import gevent

from continuum import request as rq
from continuum.config import CONFIG_ENV, RouterConfig, ServerConfig, check_config_file
from continuum.errors import (
    ConfigError,
    ConfigIssue,
    ContinuumError,
    PayloadTooLargeError,
    RequestError,
    RequestTimeoutError,
)
from continuum.metrics import CONTENT_TYPE, RouterMetrics
from continuum.registry import PluginRegistry
from continuum.routing import anthropic
from continuum.service import RouterService
from continuum.web.reload import ConfigReloader

log = logging.getLogger(__name__)

JSON = "application/json"
ANTHROPIC_PREFIX = "/anthropic/"


def error_body(message: str, error_type: str, code: str | None, param: Any = None) -> bytes:
    """An OpenAI-shaped error document."""
    return json.dumps(
        {"error": {"message": message, "type": error_type, "code": code, "param": param}}
    ).encode()


def _is_anthropic(req: falcon.Request) -> bool:
    return req.path.startswith(ANTHROPIC_PREFIX)


def request_id_of(req: falcon.Request) -> str:
    """The request's id: the client's sane ``X-Request-Id`` or a fresh one, fixed on first
    use. It is sent upstream, returned as ``X-Request-Id``, and names the request in every
    log line and every 5xx body, so that a client's report finds the log entry."""
    rid: str | None = getattr(req.context, "request_id", None)
    if rid is None:
        rid = req.context.request_id = rq.new_request_id(req.get_header("X-Request-Id"))
    return rid


class RequestIdHeader:
    """Middleware: every answer, errors included, carries ``X-Request-Id``."""

    def process_response(self, req: falcon.Request, resp: falcon.Response, resource: Any,
                         req_succeeded: bool) -> None:
        resp.set_header("X-Request-Id", request_id_of(req))


def _error_document(req: falcon.Request, status: int, message: str, error_type: str,
                    code: str | None, param: Any = None) -> bytes:
    """The error body in the client's dialect; a 5xx also names the request id."""
    if status >= 500:
        message = f"{message} (request id {request_id_of(req)})"
    if _is_anthropic(req):
        return anthropic.error_document(status, message)
    return error_body(message, error_type, code, param)


def _handle_continuum_error(
    req: falcon.Request, resp: falcon.Response, exc: ContinuumError, params: Any
) -> None:
    if exc.status >= 500:
        # The full message (backend name, address, socket error) is for operators only.
        log.warning("request %s: %s %s -> %d: %s", request_id_of(req), req.method, req.path,
                    exc.status, exc.message)
    resp.status = exc.status
    resp.content_type = JSON
    resp.data = _error_document(req, exc.status, exc.public_message or exc.message,
                                exc.error_type, exc.code, exc.fields.get("param"))
    if exc.status == 401:
        resp.set_header("WWW-Authenticate", "Bearer")


def _handle_unexpected(
    req: falcon.Request, resp: falcon.Response, exc: Exception, params: Any
) -> None:
    """A bug, not a client or upstream problem: log it with the request, answer 500 in the
    client's error shape (never a traceback)."""
    log.exception("request %s: unhandled error in %s %s", request_id_of(req), req.method,
                  req.path)
    resp.status = 500
    resp.content_type = JSON
    resp.data = _error_document(req, 500, "internal error in the router (logged)",
                                "server_error", "internal_error")


def _serialize_http_error(
    req: falcon.Request, resp: falcon.Response, exc: falcon.HTTPError
) -> None:
    code = exc.status[:3] if isinstance(exc.status, str) else str(exc.status)
    error_type = "invalid_request_error" if code.startswith("4") else "server_error"
    message = exc.description or exc.title or "error"
    resp.content_type = JSON
    resp.data = _error_document(req, int(code), message, error_type, code)


def read_body(
    req: falcon.Request, limit: int,
    timeout: float = ServerConfig.client_body_timeout_seconds,
) -> bytes:
    """Read the request body, refusing more than ``limit`` bytes, and a client that takes
    longer than ``timeout`` seconds to send it (408), which is then hung up on so that it
    holds none of the worker's connections any longer."""
    length = req.content_length
    if length is not None and length > limit:
        raise PayloadTooLargeError(
            f"request body of {length} bytes exceeds the limit of {limit} bytes"
        )
    timer = gevent.Timeout(timeout)
    try:
        with timer:
            data = req.bounded_stream.read(limit + 1)
    except gevent.Timeout as exc:
        if exc is not timer:
            raise
        _stop_reading(req)
        raise RequestTimeoutError(
            f"request body not received within {timeout:g} s"
        ) from None
    if len(data) > limit:
        raise PayloadTooLargeError(f"request body exceeds the limit of {limit} bytes")
    return data


def _stop_reading(req: falcon.Request) -> None:
    """Shut the read side of the client's socket: gunicorn would otherwise drain the rest
    of the body before the next request; now it sees the end, sends the 408 and closes."""
    sock = req.env.get("gunicorn.socket")
    if sock is not None:
        with contextlib.suppress(OSError):
            sock.shutdown(socket.SHUT_RD)


class ProxyResource:
    """``POST`` an OpenAI-compatible request to the chosen backend."""

    def __init__(self, service: RouterService, endpoint: str, path: str) -> None:
        self.service = service
        self.endpoint = endpoint
        self.path = path

    def on_post(self, req: falcon.Request, resp: falcon.Response) -> None:
        service = self.service
        tenant = service.auth.tenant(req.get_header("Authorization"),
                                     req.get_header("x-api-key"))
        server = service.config.server
        raw = read_body(req, server.max_body_bytes, server.client_body_timeout_seconds)
        forward = None
        if self.endpoint == rq.ANTHROPIC_MESSAGES:
            forward = {name: value for name in anthropic.FORWARDED_HEADERS
                       if (value := req.get_header(name))}
        ctx = service.admit(raw, self.endpoint, request_id_of(req), tenant=tenant,
                            cache_control=req.get_header("Cache-Control"),
                            forward_headers=forward)
        result = service.proxy(ctx, self.path)
        resp.status = result.status
        for name, value in result.headers.items():
            resp.set_header(name, value)
        if result.stream is not None:
            resp.set_header("Cache-Control", "no-cache")
            resp.stream = result.stream
        else:
            resp.data = result.body


class ModelsResource:
    """``GET /v1/models``: the union of every routable backend's models."""

    def __init__(self, service: RouterService) -> None:
        self.service = service

    def on_get(self, req: falcon.Request, resp: falcon.Response) -> None:
        data = [
            {"id": mid, "object": "model", "created": 0, "owned_by": "continuum-router"}
            for mid in self.service.pool.model_ids("openai")
        ]
        resp.content_type = JSON
        resp.data = json.dumps({"object": "list", "data": data}).encode()


class HealthResource:
    """``GET /health``: 200 while at least one routable backend is healthy, else 503."""

    def __init__(self, service: RouterService) -> None:
        self.service = service

    def on_get(self, req: falcon.Request, resp: falcon.Response) -> None:
        routable = self.service.pool.routable()
        healthy = sum(1 for b in routable if b.healthy)
        ok = healthy > 0
        resp.status = 200 if ok else 503
        resp.content_type = JSON
        resp.data = json.dumps(
            {"status": "ok" if ok else "unavailable",
             "backends": {"healthy": healthy, "total": len(routable)}}
        ).encode()


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


def create_app(
    config: RouterConfig,
    *,
    registry: PluginRegistry | None = None,
    metrics: RouterMetrics | None = None,
    service: RouterService | None = None,
    reloader: ConfigReloader | None = None,
) -> RouterApp:
    """Build the Falcon app for ``config``; collaborators may be injected (tests)."""
    from continuum.web import admin

    registry = registry or PluginRegistry()
    metrics = metrics or RouterMetrics()
    service = service or RouterService(config, registry=registry, metrics=metrics)
    app = RouterApp(media_type=JSON, middleware=[admin.AdminGate(service)])
    app.req_options.strip_url_path_trailing_slash = True
    app.add_middleware(RequestIdHeader())
    app.add_error_handler(Exception, _handle_unexpected)
    app.add_error_handler(ContinuumError, _handle_continuum_error)
    app.set_error_serializer(_serialize_http_error)
    app.add_route("/v1/chat/completions", ProxyResource(service, rq.CHAT, "/v1/chat/completions"))
    app.add_route("/v1/completions", ProxyResource(service, rq.COMPLETIONS, "/v1/completions"))
    app.add_route("/v1/embeddings", ProxyResource(service, rq.EMBEDDINGS, "/v1/embeddings"))
    app.add_route("/v1/models", ModelsResource(service))
    app.add_route(
        "/anthropic/v1/messages",
        ProxyResource(service, rq.ANTHROPIC_MESSAGES, "/v1/messages"),
    )
    app.add_route("/health", HealthResource(service))
    app.add_route("/metrics", MetricsResource(metrics))
    admin.add_routes(app, service, reloader)
    app.service = service
    return app


def get_app() -> RouterApp:
    """Entry point for gunicorn: load ``$CONTINUUM_CONFIG``, build the app, start greenlets."""
    registry = PluginRegistry()
    path = os.environ.get(CONFIG_ENV)
    if not path:
        raise ConfigError([ConfigIssue("<file>", f"set ${CONFIG_ENV} to the config file")])
    result = check_config_file(path, registry)
    if result.config is None:
        raise ConfigError(result.errors, path)
    config = result.config
    logging.basicConfig(
        level=config.server.log_level.upper(),
        format="%(asctime)s %(process)d %(levelname)s %(name)s: %(message)s",
    )
    for warning in result.warnings:
        log.warning("config: %s", warning.render(result.source))
    metrics = RouterMetrics()
    service = RouterService(config, registry=registry, metrics=metrics)
    reloader = ConfigReloader(service, path)
    app = create_app(config, registry=registry, metrics=metrics, service=service,
                     reloader=reloader)
    service.start()
    if config.server.watch_config:
        reloader.start(config.server.watch_interval_seconds)
    return app


__all__ = ["RequestError", "create_app", "get_app"]
