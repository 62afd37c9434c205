"""Forwarding one request to a backend and relaying its answer.

The hot path talks to backends through :mod:`continuum.wire.http_client`, a small keep-alive
HTTP/1.1 client: ``requests`` spends a few hundred microseconds of CPU per call on cookie,
hook and environment handling, and urllib3/http.client still a quarter of the router's CPU
(two sends, a liveness poll per reused connection, email-parser headers), against a
sub-millisecond budget. Health checks and admin paths use ``requests``.

Lifecycle of one dispatch:
  * The service picks a backend among :meth:`Forwarder.candidates` and builds the body for
    it; :meth:`Forwarder.send` takes an in-flight :class:`Lease` and opens the upstream
    request. A connect failure before any byte was sent releases the lease and raises
    :class:`~continuum.errors.UpstreamConnectError`; the service then sends once more to
    another candidate when :meth:`Forwarder.may_retry` allows it (:meth:`Forwarder.retrying`
    counts and logs that).
  * Non-streaming: the body is read (at most ``server.max_upstream_response_bytes``; a
    larger one is cut off and answered 502), the lease released, the result returned.
  * Streaming: :meth:`Forwarder.relay` yields upstream chunks as they arrive; its ``finally``
    closes the upstream connection and releases the lease on every exit, including the
    client going away (the WSGI server then closes the generator). With
    ``server.max_stream_duration_seconds`` a stream still running past it ends with the
    same SSE error event as a broken one (checked as pieces arrive: a silent backend is
    already bounded by its ``request_timeout_ms``).

Outcomes: a lease is released with ``ok`` True (the backend answered), False (it failed:
unreachable, timed out, a 5xx or a broken stream) or None (the client went away first,
status 499). Only True and False are samples of the backend's success rate and latency;
a disconnect says nothing about the backend, so it must not lower the rate the KV scorer
weighs, nor put a truncated duration into the latency EWMA.
"""

from __future__ import annotations

import json
import logging
import ssl
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any
from urllib.parse import urlsplit

from continuum.errors import (
    ModelNotFoundError,
    NoHealthyBackendError,
    UpstreamConnectError,
    UpstreamResponseTooLargeError,
    UpstreamTimeoutError,
)
from continuum.wire import http_client as upstream_http
from continuum.wire.sse import MAX_SSE_BUFFER_SIZE

if TYPE_CHECKING:
    from continuum.metrics import RouterMetrics
    from continuum.request import RequestContext
    from continuum.routing.backends import Backend, BackendPool

log = logging.getLogger(__name__)

#: Headers of the upstream answer that are passed back to the client: besides these, every
#: one starting with :data:`PASS_PREFIXES`. ``retry-after-ms`` and ``x-should-retry`` are
#: what the openai and anthropic SDKs read to decide on and time their retries.
PASS_HEADERS = frozenset((
    "content-type", "retry-after", "retry-after-ms", "x-should-retry", "x-request-id",
    "openai-processing-ms", "request-id",
))
#: Rate-limit headers: Anthropic's ``anthropic-ratelimit-{requests,tokens,input-tokens,
#: output-tokens}-{limit,remaining,reset}``, OpenAI's ``x-ratelimit-{limit,remaining,
#: reset}-{requests,tokens}``.
PASS_PREFIXES = ("anthropic-ratelimit-", "x-ratelimit-")

#: Status recorded for a request whose client went away before it finished (nginx's 499).
CLIENT_CLOSED = 499


class Lease:
    """One in-flight slot on a backend; :meth:`release` is idempotent."""

    __slots__ = ("admitted", "backend", "endpoint", "level", "metrics", "released", "started",
                 "status")

    def __init__(self, backend: Backend, endpoint: str, metrics: RouterMetrics) -> None:
        self.backend = backend
        self.endpoint = endpoint
        self.metrics = metrics
        self.released = False
        #: The status the attempt was recorded with, once released.
        self.status: int | None = None
        self.started = time.perf_counter()
        #: Whether the first body piece of the stream has arrived.
        self.admitted = False
        #: Requests in flight on the backend when this one was sent, as the load-aware
        #: decisions count them (the host's workers' and, when shared, the other routers').
        self.level = backend.in_flight
        backend.acquire()
        metrics.adder(metrics.in_flight, backend.name)(1)

    def admit(self) -> None:
        """The stream's first body piece (its first token) arrived: tell the backend how
        long it took at the in-flight count it was sent at (once)."""
        if not self.admitted and not self.released:
            self.admitted = True
            self.backend.first_piece(self.level, time.perf_counter() - self.started)

    def release(self, status: int, ok: bool | None) -> None:
        """Give the slot back and record the outcome (once).

        ``ok`` None: the client went away before the backend finished, which is no verdict
        on the backend; the request is counted in the metrics (with ``status``) but not in
        the backend's success window or latency EWMA.
        """
        if self.released:
            return
        self.released = True
        self.status = status
        backend, metrics = self.backend, self.metrics
        backend.release()
        elapsed = time.perf_counter() - self.started
        if ok is not None:
            backend.record(ok, elapsed if ok else None)
        metrics.attempt_done(self.endpoint, backend.name, status)


@dataclass
class Upstream:
    """An opened upstream response and the lease that pays for it."""

    backend: Backend
    response: upstream_http.Response
    lease: Lease
    #: The client request's id, for the log lines and error events of its relay.
    request_id: str = ""
    #: Set by :meth:`Forwarder.relay` when the upstream body ended normally.
    completed: bool = False
    #: Translates the answer for the client (``type: gemini``, see
    #: :mod:`continuum.routing.gemini_dispatch`); None: relayed as it is.
    adapter: Any = None

    @property
    def status(self) -> int:
        return self.response.status

    def headers(self) -> dict[str, str]:
        """The upstream headers worth passing to the client."""
        return {name: value for name, value in self.response.headers.items()
                if name in PASS_HEADERS or name.startswith(PASS_PREFIXES)}


PassiveHealth = Callable[["Backend", bool], None]
#: Waits for the first probe results of unprobed backends (see ``Forwarder.candidates``).
AwaitProbes = Callable[[Sequence["Backend"]], None]


class Forwarder:
    """Opens upstream requests and relays their bodies; says when a connect failure may be
    retried elsewhere."""

    def __init__(
        self,
        pool: BackendPool,
        metrics: RouterMetrics,
        *,
        retry_connect_errors: bool = True,
        on_result: PassiveHealth | None = None,
        await_probes: AwaitProbes | None = None,
        maxsize: int = 64,
        max_response_bytes: int | None = None,
        max_stream_seconds: float = 0.0,
        retry_after_seconds: float = 5.0,
    ) -> None:
        self.pool = pool
        self.metrics = metrics
        self.retry_connect_errors = retry_connect_errors
        #: Largest non-streamed body read (None: unlimited).
        self.max_response_bytes = max_response_bytes
        #: Longest a stream is relayed, in seconds (0: unlimited).
        self.max_stream_seconds = max_stream_seconds
        #: What a 503 for want of a healthy backend tells the client to wait (``Retry-After``):
        #: the health checks' interval, after which a backend may be back.
        self.retry_after_seconds = retry_after_seconds
        self.on_result = on_result
        self.await_probes = await_probes
        self._pools: dict[str, upstream_http.ConnectionPool] = {}
        self._maxsize = maxsize
        for backend in pool:  # at zero from the start: a rate() of 0, not "no data"
            metrics.child(metrics.retries, backend.name)

    def connection_pool(self, backend: Backend) -> upstream_http.ConnectionPool:
        """The keep-alive connection pool of ``backend`` (created on first use)."""
        cp = self._pools.get(backend.name)
        if cp is None:
            parts = urlsplit(backend.url)
            cfg = backend.config
            https = parts.scheme == "https"
            cp = upstream_http.ConnectionPool(
                parts.hostname or "127.0.0.1",
                parts.port or (443 if https else 80),
                connect_timeout=cfg.connect_timeout_ms / 1000,
                read_timeout=cfg.request_timeout_ms / 1000,
                tls=ssl.create_default_context() if https else None,
                maxsize=self._maxsize,
            )
            self._pools[backend.name] = cp
        return cp

    def forget(self, name: str) -> None:
        """Drop the connection pool of backend ``name`` (a reload changed or removed it;
        connections in use finish and are closed, not pooled)."""
        cp = self._pools.pop(name, None)
        if cp is not None:
            cp.clear()
        self.metrics.child(self.metrics.retries, name)

    def close(self) -> None:
        """Close the idle upstream connections of every backend."""
        for cp in self._pools.values():
            cp.clear()

    def candidates(self, ctx: RequestContext) -> list[Backend]:
        """Healthy backends for ``ctx.model``. When none is healthy yet but some have no
        probe result (a worker that just started, or backends a reload added), it waits for
        their first results (``await_probes``) before giving up.

        Raises:
            ModelNotFoundError: no enabled backend serves the model at all.
            NoHealthyBackendError: some do, but none is healthy.
        """
        found = self.pool.candidates(ctx.model, ctx.protocol)
        if found:
            return found
        serving = self.pool.serving(ctx.model, ctx.protocol)
        if not serving:
            raise ModelNotFoundError(self._not_served(ctx.model, ctx.protocol), param="model")
        if self.await_probes is not None and not all(b.probed for b in serving):
            self.await_probes(serving)
            found = self.pool.candidates(ctx.model, ctx.protocol)
            if found:
                return found
        raise NoHealthyBackendError(f"no healthy backend for model '{ctx.model}'",
                                    retry_after=self.retry_after_seconds)

    def _not_served(self, model: str, protocol: str) -> str:
        """The 404 message for ``model`` on an endpoint of ``protocol``: where the router
        serves it instead, when it does (a client that sends an OpenAI-served model to the
        Anthropic Messages API, or the other way round)."""
        message = f"The model '{model}' does not exist or is not served by this router"
        other = "anthropic" if protocol == "openai" else "openai"
        if not self.pool.serving(model, other):
            return message
        if other == "openai":
            return (f"The model '{model}' is served by this router's OpenAI endpoints "
                    "(/v1/chat/completions, ...), not by /anthropic/v1/messages, which "
                    "reaches type: anthropic and type: gemini backends, and engines "
                    "configured with anthropic_messages: true")
        return (f"The model '{model}' is served by this router's Anthropic Messages API "
                "(/anthropic/v1/messages), not by its OpenAI endpoints: point the Anthropic "
                "SDK's base_url at http://<router>/anthropic")

    def may_retry(self, candidates: Sequence[Backend]) -> bool:
        """Whether a connect failure may be retried on another of ``candidates``: nothing
        was sent, so repeating the request is safe (``pool.retry_connect_errors``)."""
        return self.retry_connect_errors and len(candidates) > 1

    def retrying(self, failed: Backend, ctx: RequestContext) -> None:
        """Count and log that ``ctx`` is sent again after ``failed`` could not be reached."""
        self.metrics.child(self.metrics.retries, failed.name).inc()
        log.warning("request %s: connect to backend %s failed; retrying on another",
                    ctx.request_id, failed.name)

    def send(
        self,
        backend: Backend,
        ctx: RequestContext,
        path: str,
        body: bytes,
        extra_headers: dict[str, str] | None = None,
    ) -> Upstream:
        """POST ``body`` to ``backend`` under an in-flight lease; the opened response.

        Raises:
            UpstreamConnectError: ``backend`` was unreachable, or closed the connection
                before a response head (nothing was processed: safe to send elsewhere).
            UpstreamTimeoutError: the backend accepted the request but did not answer in time.
        """
        headers = {"Content-Type": "application/json", "X-Request-Id": ctx.request_id}
        cfg = backend.config
        key = cfg.resolved_api_key()
        if cfg.protocol == "anthropic":
            headers["anthropic-version"] = cfg.anthropic_version
            if key:
                headers["x-api-key"] = key
        elif cfg.type == "gemini":
            if key:
                headers["x-goog-api-key"] = key
        elif key:
            headers["Authorization"] = f"Bearer {key}"
        if extra_headers:
            headers.update(extra_headers)
        lease = Lease(backend, ctx.endpoint, self.metrics)
        try:
            response = self.connection_pool(backend).request("POST", path, body, headers)
        except upstream_http.ConnectError as exc:
            self._failed(lease, "connect")
            raise UpstreamConnectError(
                f"could not connect to backend '{backend.name}' ({backend.url}): {exc}",
                backend=backend.name,
            ) from None
        except upstream_http.ReadTimeout:
            raise self._timed_out(lease) from None
        except (upstream_http.HTTPClientError, OSError) as exc:
            # The backend closed or broke the connection before a valid response head (a
            # stale kept-alive one was already retried on a fresh connection by the pool):
            # treated like a connect failure, so it is retried on another backend.
            self._failed(lease, "connect")
            raise UpstreamConnectError(
                f"backend '{backend.name}' ({backend.url}) closed the connection: {exc}",
                backend=backend.name,
            ) from None
        self.metrics.observer(self.metrics.ttfb, ctx.endpoint, backend.name)(
            time.perf_counter() - lease.started)
        if self.on_result is not None and response.status < 500:
            self.on_result(backend, True)
        return Upstream(backend, response, lease, ctx.request_id)

    def _timed_out(self, lease: Lease) -> UpstreamTimeoutError:
        """Record a read timeout (504) on ``lease``; the error to raise."""
        self._failed(lease, "timeout")
        backend = lease.backend
        return UpstreamTimeoutError(
            f"backend '{backend.name}' ({backend.url}) did not answer in time",
            backend=backend.name,
        )

    def _failed(self, lease: Lease, kind: str) -> None:
        status = 504 if kind == "timeout" else 502
        lease.release(status, ok=False)
        self.metrics.child(self.metrics.upstream_errors, lease.backend.name, kind).inc()
        if self.on_result is not None and kind == "connect":
            self.on_result(lease.backend, False)

    def read_all(self, upstream: Upstream) -> bytes:
        """Read a whole non-streamed body and release the lease.

        Raises:
            UpstreamTimeoutError: the body stalled past the read timeout.
            UpstreamConnectError: the backend dropped the connection mid-body.
            UpstreamResponseTooLargeError: the body is over ``max_response_bytes`` (it is
                not read further; the connection is closed).
        """
        response, lease, backend = upstream.response, upstream.lease, upstream.backend
        try:
            # pools or closes the connection, also on errors
            data = response.read(self.max_response_bytes)
        except upstream_http.BodyTooLarge as exc:
            self._failed(lease, "too_large")
            log.warning("response of %s cut off: %s", upstream.backend.name, exc)
            raise UpstreamResponseTooLargeError(
                "upstream response exceeded server.max_upstream_response_bytes",
                backend=upstream.backend.name,
            ) from None
        except upstream_http.ReadTimeout:
            raise self._timed_out(lease) from None
        except (upstream_http.HTTPClientError, OSError) as exc:
            response.close()
            self._failed(lease, "stream")
            raise UpstreamConnectError(
                f"backend '{backend.name}' ({backend.url}) broke the response: {exc}",
                backend=backend.name,
            ) from None
        lease.release(response.status, ok=response.status < 500)
        return data

    def relay(self, upstream: Upstream, error_event: Callable[[str], bytes]) -> Iterator[bytes]:
        """Yield the upstream body chunk by chunk as it arrives.

        A stream that breaks midway ends with ``error_event(message)`` (an SSE error record
        in the client's dialect that names only the request id: the backend, its address
        and the error go to the log under that id), never a hang. Once the stream has shown
        SSE framing (a blank line), the start of a record the upstream has not finished is
        held back until it is (:func:`_whole_records`), so that error record never lands
        inside a cut one, where no SDK could read it (nor the cut record, which the client
        could not have parsed either); a stream without blank lines goes as it comes. The
        lease is released
        and the upstream connection closed on every exit path, including ``GeneratorExit``
        when the client disconnects.
        """
        response, lease = upstream.response, upstream.lease
        complete = False
        status = response.status
        limit = self.max_stream_seconds
        held = b""  # the start of a record the upstream has not finished sending
        framed = False  # a blank line came: the stream is SSE records
        try:
            # Decoded body bytes (chunked framing removed) as they arrive, several records
            # per piece when several were already received.
            deadline = lease.started + limit if limit > 0 else None
            for piece in response.stream():
                if not lease.admitted:  # the first token
                    lease.admit()
                if held:
                    piece, held = held + piece, b""
                if piece.endswith(_RECORD_ENDS):  # engines send whole records
                    framed = True
                elif framed or b"\n\n" in piece or b"\n\r\n" in piece:
                    piece, held = _whole_records(piece)
                    framed = True
                if piece:
                    yield piece
                if deadline is not None and time.perf_counter() > deadline:
                    status = self._stream_too_long(upstream)
                    yield error_event(
                        "upstream stream exceeded server.max_stream_duration_seconds")
                    return
            complete = upstream.completed = True
            if held:  # a last record without its blank line: the client's to judge
                yield held
        except (upstream_http.HTTPClientError, OSError) as exc:
            kind = "timeout" if isinstance(exc, upstream_http.ReadTimeout) else "stream"
            self.metrics.child(self.metrics.upstream_errors, upstream.backend.name, kind).inc()
            status = 504 if kind == "timeout" else 502
            log.warning("request %s: stream from backend %s (%s) broke: %s",
                        upstream.request_id, upstream.backend.name, upstream.backend.url, exc)
            yield error_event(
                f"the upstream stream broke off (request id {upstream.request_id})")
        finally:
            ok: bool | None = complete and status < 500
            if not complete:
                # Unread data on this connection makes it unusable: close it so the backend
                # sees the client go away and stops generating.
                response.close()
                if status < 400:  # neither finished nor broken: the client went away
                    status, ok = CLIENT_CLOSED, None
            lease.release(status, ok)

    def _stream_too_long(self, upstream: Upstream) -> int:
        """Count a stream cut at ``max_stream_seconds``; its status for the metrics (504)."""
        self.metrics.child(self.metrics.upstream_errors, upstream.backend.name,
                           "stream_duration").inc()
        log.warning("stream from %s cut after %.0f s (server.max_stream_duration_seconds)",
                    upstream.backend.name, self.max_stream_seconds)
        return 504


#: How an SSE record ends: a blank line (LF or CRLF line ends).
_RECORD_ENDS = (b"\n\n", b"\r\n\r\n")
#: The most of an unfinished record :func:`_whole_records` holds back (a stream that is not
#: SSE, or a record this long, goes on as it comes): the SSE parsers' own record limit.
MAX_HELD_BYTES = MAX_SSE_BUFFER_SIZE


def _whole_records(piece: bytes) -> tuple[bytes, bytes]:
    """``piece`` split into its whole SSE records and the start of an unfinished one."""
    lf, crlf = piece.rfind(b"\n\n"), piece.rfind(b"\n\r\n")
    end = max(lf + 2 if lf >= 0 else 0, crlf + 3 if crlf >= 0 else 0)
    if not end:  # no blank line in it at all
        return (piece, b"") if len(piece) > MAX_HELD_BYTES else (b"", piece)
    if len(piece) - end > MAX_HELD_BYTES:
        return piece, b""
    return piece[:end], piece[end:]


def openai_error_event(message: str) -> bytes:
    """An SSE record carrying an OpenAI-shaped error (what the openai SDK raises on)."""
    payload = {"error": {"message": message, "type": "server_error", "code": "upstream_error"}}
    return b"data: " + json.dumps(payload).encode() + b"\n\n"


def anthropic_error_event(message: str) -> bytes:
    """An Anthropic-style SSE ``error`` event (what the anthropic SDK raises on)."""
    payload = {"type": "error", "error": {"type": "api_error", "message": message}}
    return b"event: error\ndata: " + json.dumps(payload).encode() + b"\n\n"
