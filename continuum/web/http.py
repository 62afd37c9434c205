"""HTTP plumbing shared by the proxy resources and the admin API: request ids, bounded
body reads and error documents in the client's dialect.

It sits below both :mod:`continuum.web.app` and :mod:`continuum.web.admin`, so that the
app can mount the admin resources without the admin module importing the app back.
"""

from __future__ import annotations

import contextlib
import json
import logging
import math
import socket
from typing import Any

import falcon
import gevent

from continuum import request as rq
from continuum.config import ServerConfig
from continuum.errors import (
    ContinuumError,
    PayloadTooLargeError,
    RequestError,
    RequestTimeoutError,
)
from continuum.routing import anthropic
from continuum.wire.wsgi_fast import read_held

log = logging.getLogger(__name__)

JSON = "application/json"
ANTHROPIC_PREFIX = "/anthropic/"


def error_body(message: str, error_type: str, code: str | None, param: Any = None,
               request_id: str | None = None) -> bytes:
    """An OpenAI-shaped error document (with the router's request id when given)."""
    error = {"message": message, "type": error_type, "code": code, "param": param}
    if request_id is not None:
        error["request_id"] = request_id
    return json.dumps({"error": error}).encode()


def _is_anthropic(req: falcon.Request) -> bool:
    return req.path.startswith(ANTHROPIC_PREFIX)


def request_id_of(req: falcon.Request) -> str:
    """The request's id: the client's sane ``X-Request-Id`` or a fresh one, fixed on first
    use. It is sent upstream, returned as ``X-Request-Id``, and names the request in every
    log line and every 5xx body, so that a client's report finds the log entry."""
    rid: str | None = getattr(req.context, "request_id", None)
    if rid is None:
        # (``get_header`` would raise and catch a KeyError when the client sent none)
        rid = req.context.request_id = rq.new_request_id(req.env.get("HTTP_X_REQUEST_ID"))
    return rid


class RequestIdHeader:
    """Middleware: every answer, errors included, carries ``X-Request-Id``."""

    def process_response(self, req: falcon.Request, resp: falcon.Response, resource: Any,
                         req_succeeded: bool) -> None:
        resp.set_header("X-Request-Id", request_id_of(req))


def _error_document(req: falcon.Request, status: int, message: str, error_type: str,
                    code: str | None, param: Any = None) -> bytes:
    """The error body in the client's dialect with the request id (Anthropic's API puts
    ``request_id`` at the top level, so does the router; OpenAI's in the error object);
    a 5xx also names it in the message, which is what SDKs show."""
    rid = request_id_of(req)
    if status >= 500:
        message = f"{message} (request id {rid})"
    if _is_anthropic(req):
        return anthropic.error_document(status, message, rid)
    return error_body(message, error_type, code, param, rid)


def handle_continuum_error(
    req: falcon.Request, resp: falcon.Response, exc: ContinuumError, params: Any
) -> None:
    """Falcon error handler: a :class:`ContinuumError` as its status and error document."""
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
    retry_after = exc.fields.get("retry_after")
    if retry_after is not None:  # whole seconds, at least 1 (RFC 9110 delay-seconds)
        resp.set_header("Retry-After", str(max(1, math.ceil(retry_after))))


def handle_unexpected(
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


def serialize_http_error(
    req: falcon.Request, resp: falcon.Response, exc: falcon.HTTPError
) -> None:
    """Falcon's own errors (404, 405…) in the client's error shape."""
    code = exc.status[:3] if isinstance(exc.status, str) else str(exc.status)
    error_type = "invalid_request_error" if code.startswith("4") else "server_error"
    message = exc.description or exc.title or "error"
    if code == "404" and not exc.description:  # no route: say which, and what is served
        message = f"no such endpoint: {req.method} {req.path}" + _route_hint(req.path)
    elif code == "405":
        allowed = dict(exc.headers or {}).get("Allow", "")  # HTTPMethodNotAllowed sets it
        message = f"{req.method} is not allowed on {req.path}" + (
            f" (allowed: {allowed})" if allowed else "")
    resp.content_type = JSON
    resp.data = _error_document(req, int(code), message, error_type, code)


def _route_hint(path: str) -> str:
    """What a 404 adds for a path the router serves elsewhere ("" for none)."""
    if "/v1/v1/" in path:
        return ("; the SDK's base_url ends in /v1 and the client adds /v1 again: drop it "
                "from the base_url")
    if path.startswith("/admin/"):
        return "; GET /admin lists the admin endpoints"
    return _ROUTE_HINTS.get(path.rstrip("/"), "")


#: Paths clients ask for that the router serves elsewhere: the hint its 404 gives.
_ROUTE_HINTS = {
    path: "; Anthropic's Messages API is served under /anthropic: set the Anthropic SDK's "
          "base_url (ANTHROPIC_BASE_URL) to http://<router>/anthropic"
    for path in ("/v1/messages", "/v1/messages/count_tokens", "/messages")
} | {
    path: "; the OpenAI-compatible API is under /v1: set the SDK's base_url to "
          "http://<router>/v1"
    for path in ("/chat/completions", "/completions", "/embeddings", "/models", "/responses")
}


def read_body(
    req: falcon.Request, limit: int,
    timeout: float = ServerConfig.client_body_timeout_seconds,
) -> bytes:
    """Read the request body, refusing more than ``limit`` bytes, and a client that takes
    longer than ``timeout`` seconds to send it (408), which is then hung up on so that it
    holds none of the worker's connections any longer.

    A body sent with ``Transfer-Encoding: chunked`` (no ``Content-Length``: Go's and
    Node's clients with a streamed body, ``curl -T -``) is read from the server's own
    decoder to its last chunk, under the same limit; Falcon's bounded stream would read it
    as empty."""
    length = req.content_length
    if length is not None and length > limit:
        raise PayloadTooLargeError(
            f"request body of {length} bytes exceeds the limit of {limit} bytes"
        )
    if length is not None:  # all of it came with the head: nothing to wait for
        held = read_held(req.env.get("wsgi.input"), length)
        if held is not None:
            return held
    chunked = length is None and "chunked" in (req.get_header("Transfer-Encoding") or "").lower()
    # the WSGI server's own input ends where the chunks end
    stream = req.stream if chunked else req.bounded_stream
    timer = gevent.Timeout(timeout)
    try:
        with timer:
            data = stream.read(limit + 1)
    except Exception as exc:  # the server's decoder: gunicorn's errors are plain Exceptions
        if not chunked:
            raise
        _stop_reading(req)  # where the next request would start is unknown
        why = "it ended before its last chunk" if isinstance(exc, OSError) else str(exc)
        raise RequestError(f"request body is not valid chunked transfer coding: {why}",
                           code="invalid_chunked_body") from None
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
