"""Every error the router raises, under one root.

Each leaf also inherits the builtin it resembles, carries structured fields, and knows the
HTTP status and OpenAI error ``type`` it maps to, so a single handler in ``continuum.web.app``
turns any of them into a response.
"""

from __future__ import annotations

from typing import Any


class ContinuumError(Exception):
    """Root of all Continuum Router errors."""

    status: int = 500
    error_type: str = "server_error"
    code: str | None = None
    #: What the client is told instead of ``message``, for errors whose message carries
    #: internals (backend names, addresses, socket errors) that belong in the log only.
    public_message: str | None = None

    def __init__(self, message: str, **fields: Any) -> None:
        super().__init__(message)
        self.message = message
        self.fields = fields


class ConfigError(ContinuumError, ValueError):
    """Invalid configuration; ``issues`` holds every problem found, each naming its key path."""

    def __init__(self, issues: list[ConfigIssue], source: str = "<config>") -> None:
        self.issues = issues
        self.source = source
        super().__init__("\n".join(issue.render(source) for issue in issues))


class ConfigIssue:
    """One problem (or warning) in a config file, located by its dotted key path and, when
    read from a file, by ``location`` (``"line:column"`` of the key)."""

    __slots__ = ("location", "message", "path", "value")

    def __init__(self, path: str, message: str, value: Any = None,
                 location: str | None = None) -> None:
        self.path = path
        self.message = message
        self.value = value
        self.location = location

    def render(self, source: str) -> str:
        where = f"{source}:{self.location}" if self.location else source
        suffix = "" if self.value is None else f" (got {self.value!r})"
        return f"{where}: {self.path}: {self.message}{suffix}"

    def __repr__(self) -> str:
        return f"ConfigIssue({self.path!r}, {self.message!r}, {self.value!r})"


class PluginError(ContinuumError, LookupError):
    """A plugin could not be found, loaded, or does not implement its interface."""

    def __init__(self, message: str, *, group: str, name: str) -> None:
        super().__init__(message, group=group, name=name)
        self.group = group
        self.name = name


class RequestError(ContinuumError, ValueError):
    """The client sent something we cannot route (400); ``param`` names the field at fault
    and ``code`` says what is wrong with it (``invalid_type``, ``invalid_value``, …)."""

    status = 400
    error_type = "invalid_request_error"

    def __init__(self, message: str, *, param: str | None = None,
                 code: str | None = None) -> None:
        super().__init__(message, param=param)
        self.param = param
        if code is not None:
            self.code = code


class AuthenticationError(ContinuumError, PermissionError):
    """Missing or wrong credentials (401)."""

    status = 401
    error_type = "authentication_error"
    code = "invalid_api_key"


class ModelNotFoundError(ContinuumError, LookupError):
    """No enabled backend serves the requested model (404)."""

    status = 404
    error_type = "invalid_request_error"
    code = "model_not_found"


class PayloadTooLargeError(RequestError):
    """The request body exceeds ``server.max_body_bytes`` (413)."""

    status = 413
    code = "request_too_large"


class RequestTimeoutError(RequestError, TimeoutError):
    """The client did not send its request within ``server.client_*_timeout_seconds`` (408);
    the connection is closed after the answer."""

    status = 408
    code = "request_timeout"


class NoHealthyBackendError(ContinuumError, RuntimeError):
    """Every backend that could serve the request is down or disabled (503)."""

    status = 503
    error_type = "service_unavailable"
    code = "no_healthy_backend"


class UpstreamConnectError(ContinuumError, ConnectionError):
    """The backend could not be reached before any byte was sent (502)."""

    status = 502
    error_type = "bad_gateway"
    code = "upstream_connect_error"
    public_message = "the backend serving this model could not be reached"

    def __init__(self, message: str, *, backend: str) -> None:
        super().__init__(message, backend=backend)
        self.backend = backend


class UpstreamResponseTooLargeError(UpstreamConnectError):
    """A non-streamed backend answer exceeds ``server.max_upstream_response_bytes`` (502);
    it was cut off, not read whole."""

    code = "upstream_response_too_large"
    public_message = "upstream response exceeded server.max_upstream_response_bytes"


class UpstreamTimeoutError(ContinuumError, TimeoutError):
    """The backend did not answer within its timeout (504)."""

    status = 504
    error_type = "gateway_timeout"
    code = "upstream_timeout"
    public_message = "the backend serving this model did not answer in time"

    def __init__(self, message: str, *, backend: str) -> None:
        super().__init__(message, backend=backend)
        self.backend = backend


class StoreError(ContinuumError, RuntimeError):
    """A cache store or KV index failed; callers treat it as a miss, never as a 500."""

    def __init__(self, message: str, *, store: str, kind: str = "other") -> None:
        super().__init__(message, store=store, kind=kind)
        self.store = store
        self.kind = kind
