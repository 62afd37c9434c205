"""Per-request observation: ``continuum_requests_total`` and the access log, once each.

:class:`Observer` (Falcon middleware) gives every client request of the API endpoints a
:class:`~continuum.metrics.RequestRecord` when it arrives, lets the resource and the
service fill it in, and records it when the answer is finished: at once for a body, when
the last piece went out (or the client went away) for a stream. So requests the router
answers itself (401, 400, unknown model 404, ``no_healthy_backend`` 503) and cache hits are
counted exactly like proxied ones, and a retried request once (its attempts are in
``continuum_upstream_attempts_total``). ``/metrics``, ``/health`` and ``/admin`` are
operators' endpoints and not counted.

The access log (logger ``continuum.access``, ``server.access_log``) is one line per
request: text ``key=value`` pairs or one JSON object. The tenant id is hashed (SHA-256,
12 hex digits): it tells requests of one tenant apart without writing the client's
tenant name into log storage.
"""

from __future__ import annotations

import atexit
import functools
import hashlib
import json
import logging
import os
import re
import time
from collections.abc import Iterable, Iterator, Sequence
from typing import Any

import falcon

from continuum.metrics import RequestRecord, RouterMetrics
from continuum.web.http import request_id_of

access_log = logging.getLogger("continuum.access")
log = logging.getLogger(__name__)

#: The root logger's line format in the worker (``logging.basicConfig`` in
#: :func:`continuum.web.app.get_app`); text access lines go out through it.
LOG_FORMAT = "%(asctime)s %(process)d %(levelname)s %(name)s: %(message)s"
_JSON_HANDLER_FORMAT = "%(message)s"

#: Paths that are not client API requests.
_OPERATOR_PREFIXES = ("/metrics", "/health", "/admin")
UNKNOWN = "unknown"
TEXT, JSON_FORMAT, OFF = "text", "json", "off"


def tenant_hash(tenant: str | None) -> str | None:
    """The tenant id as logged: 12 hex digits of its SHA-256."""
    return None if tenant is None else _tenant_digest(tenant)


@functools.lru_cache(maxsize=1024)  # tenants are the configured client keys': few
def _tenant_digest(tenant: str) -> str:
    return hashlib.sha256(tenant.encode()).hexdigest()[:12]


def _ms(start: float, end: float | None) -> float | None:
    return None if end is None else round((end - start) * 1000, 3)


#: The access-log fields' names, in the order of :func:`access_values`.
ACCESS_KEYS = ("request_id", "tenant", "endpoint", "model", "backend", "decision", "cache",
               "status", "outcome", "ttft_ms", "duration_ms", "prompt_tokens",
               "cached_tokens", "completion_tokens")


def access_values(record: RequestRecord) -> tuple[Any, ...]:
    """The access-log fields of a finished ``record``, in the order of
    :data:`ACCESS_KEYS`."""
    started = record.started
    return (record.request_id, tenant_hash(record.tenant), record.endpoint, record.model,
            record.backend, record.decision, record.cache, record.final_status,
            record.outcome, _ms(started, record.first_byte) if record.stream else None,
            _ms(started, record.finished), record.prompt_tokens, record.cached_tokens,
            record.completion_tokens)


def access_fields(record: RequestRecord) -> dict[str, Any]:
    """The access-log fields of a finished ``record``, by name."""
    return dict(zip(ACCESS_KEYS, access_values(record), strict=True))


#: A text value containing one of these is written as a JSON string.
_NEEDS_QUOTES = re.compile(r'[ "=\\]').search


def _text_value(value: Any) -> str:
    if value is None:
        return "-"
    if type(value) is int:
        return str(value)
    text = str(value)
    return json.dumps(text) if not text or _NEEDS_QUOTES(text) else text


def format_access(record: RequestRecord, fmt: str) -> str:
    """One access-log line for ``record`` in ``fmt`` (text or json)."""
    if fmt == JSON_FORMAT:
        return json.dumps(access_fields(record), separators=(",", ":"))
    # ``key=_text_value(value)`` for each field. The common line first: every value's
    # ``str()`` (``-`` for None) as it stands, in one formatting. It is the line when no
    # value is empty or has a character to quote: then it has the template's blanks and
    # equals signs and no more, no quote or backslash, no "= " and no "=" at its end (a
    # few scans of the line, instead of converting every value twice).
    values = access_values(record)
    line = _TEXT_LINE % tuple(map(_DASH.get, values, values))
    if line.count(" ") == _TEXT_BLANKS and line.count("=") == _TEXT_EQUALS and \
            '"' not in line and "\\" not in line and "= " not in line and line[-1] != "=":
        return line
    return " ".join(f"{key}={_text_value(value)}"
                    for key, value in zip(ACCESS_KEYS, values, strict=True))


#: None -> ``-``; ``_DASH.get(v, v)`` is any other value as it is.
_DASH: dict[Any, str] = {None: "-"}

#: The text line, one ``key=%s`` per field, in the order of :data:`ACCESS_KEYS`.
_TEXT_LINE = " ".join(f"{key}=%s" for key in ACCESS_KEYS)
_TEXT_BLANKS = _TEXT_LINE.count(" ")
_TEXT_EQUALS = _TEXT_LINE.count("=")


def configure_access_log(fmt: str) -> None:
    """Route ``continuum.access`` to stderr as bare lines (JSON stays parseable) for json,
    through the root logger's format for text; nowhere for off."""
    access_log.handlers.clear()
    if fmt == OFF:
        access_log.disabled = True
        return
    access_log.disabled = False
    access_log.setLevel(logging.INFO)
    if fmt == JSON_FORMAT:
        handler = logging.StreamHandler()
        handler.setFormatter(logging.Formatter(_JSON_HANDLER_FORMAT))
        access_log.addHandler(handler)
        access_log.propagate = False
    else:
        access_log.propagate = True


def _plain_stream_handler(handler: logging.Handler, fmt: str) -> bool:
    """Whether ``handler`` writes every INFO record to a stream as ``fmt`` with the default
    time format and nothing else (no filter, no subclass behaviour)."""
    formatter = handler.formatter
    return (type(handler) is logging.StreamHandler and not handler.filters
            and handler.level <= logging.INFO and formatter is not None
            and type(formatter) is logging.Formatter and formatter._fmt == fmt
            and formatter.datefmt is None and formatter.converter is time.localtime
            and formatter.default_time_format == logging.Formatter.default_time_format
            and formatter.default_msec_format == logging.Formatter.default_msec_format)


class AccessWriter:
    """Writes access-log lines, byte for byte as the logging set up by
    :func:`configure_access_log` would (``continuum.access`` through its own ``%(message)s``
    handler for json, through the root logger's one :data:`LOG_FORMAT` stream handler for
    text), straight to that handler's stream: the ``logging`` machinery (a record, caller
    lookup, level and filter walks, formatting the time) costs more than the line itself.
    Whenever logging is set up any other way (another handler or filter, a level, tests'
    capture handlers), the line goes through ``access_log.info`` as before."""

    __slots__ = ("_pid", "_second", "_stamp")

    def __init__(self) -> None:
        self._second = -1
        self._stamp = ""
        self._pid = 0

    def handler(self) -> tuple[logging.Handler, bool] | None:
        """The stream handler a line would reach and whether it is the text format one;
        None when logging is set up otherwise."""
        logger = access_log
        if logger.disabled or logger.filters or not logger.isEnabledFor(logging.INFO):
            return None
        handlers = logger.handlers
        if handlers:
            if len(handlers) == 1 and not logger.propagate and \
                    _plain_stream_handler(handlers[0], _JSON_HANDLER_FORMAT):
                return handlers[0], False
            return None
        root = logging.root
        if not logger.propagate or root.filters:
            return None
        # Loggers between it and the root pass a record on untouched when they have no
        # handler and propagate (their level and filters apply only to their own records).
        # gunicorn makes a ``continuum`` logger of the placeholder that any module's
        # ``continuum.x`` logger left in the master (``glogging.loggers``, when it sets its
        # handlers close-on-exec), so one is usually there: requiring the root as the
        # parent sent every line of ``continuum-router serve`` through ``logging``.
        parent = logger.parent
        while parent is not root:
            if parent is None or parent.handlers or not parent.propagate:
                return None
            parent = parent.parent
        handlers = root.handlers
        if len(handlers) == 1 and _plain_stream_handler(handlers[0], LOG_FORMAT):
            return handlers[0], True
        return None

    def write(self, message: str) -> None:
        """Log ``message`` at INFO on ``continuum.access``."""
        self.write_lines((message,))

    def write_lines(self, messages: Sequence[str]) -> None:
        """Log each of ``messages`` at INFO on ``continuum.access``, in order; straight to
        the stream, in one write, when logging is set up as the class describes."""
        target = self.handler()
        if target is None:
            for message in messages:
                access_log.info(message)
            return
        handler, text = target
        terminator = handler.terminator  # type: ignore[attr-defined]
        if text:
            now = time.time()
            second = int(now)
            if second != self._second:
                self._stamp = time.strftime(logging.Formatter.default_time_format,
                                            time.localtime(now))
                self._second = second
                self._pid = os.getpid()  # a fork runs on: renewed at least once a second
            msecs = int((now - second) * 1000)
            head = f"{self._stamp},{msecs:03d} {self._pid} INFO continuum.access: "
            out = "".join([f"{head}{message}{terminator}" for message in messages])
        else:
            out = "".join([f"{message}{terminator}" for message in messages])
        stream: Any = getattr(handler, "stream", None)
        handler.acquire()
        try:
            stream.write(out)
            stream.flush()
        except Exception:
            handler.release()
            for message in messages:
                access_log.info(message)  # logging reports the broken stream its own way
            return
        handler.release()


class Observer:
    """Falcon middleware: one :class:`RequestRecord` per client API request, recorded in
    the metrics and the access log when the answer is finished.

    Under the router's gevent worker (:meth:`log_after_sending`), a finished request's
    access line is formatted and written from the hub, right after the worker has written
    the answer and its greenlet waits for the next request: the client does not wait for
    it, and the lines of the requests that ended in one turn of the loop go out in one
    write. The metrics are recorded at once, before the answer is sent, so that a scrape
    that follows an answer (on any worker) counts it. Elsewhere (tests, another WSGI
    server) the line is written at once too."""

    def __init__(self, metrics: RouterMetrics, fmt: str = TEXT) -> None:
        self.metrics = metrics
        self.fmt = fmt
        self.writer = AccessWriter()
        self._run_callback: Any = None  # the hub loop's run_callback, once deferring
        self._pending: list[RequestRecord] = []

    def log_after_sending(self, run_callback: Any) -> None:
        """Write access lines from a callback of the loop ``run_callback`` belongs to (the
        gevent hub's ``loop.run_callback``), after the answer is written."""
        self._run_callback = run_callback
        atexit.register(self.flush)  # a worker that exits before the hub's next turn

    def flush(self) -> None:
        """Write the access lines still waiting for the hub's callback."""
        if self._pending:
            self._log_pending()

    def process_request(self, req: falcon.Request, resp: falcon.Response) -> None:
        if not req.path.startswith(_OPERATOR_PREFIXES):
            req.context.record = RequestRecord(UNKNOWN)

    def process_resource(self, req: falcon.Request, resp: falcon.Response, resource: Any,
                         params: dict[str, Any]) -> None:
        record: RequestRecord | None = req.context.__dict__.get("record")  # (Context.get)
        if record is not None and resource is not None:
            record.endpoint = getattr(resource, "endpoint", UNKNOWN)

    def process_response(self, req: falcon.Request, resp: falcon.Response, resource: Any,
                         req_succeeded: bool) -> None:
        record: RequestRecord | None = req.context.__dict__.get("record")  # (Context.get)
        if record is None:
            return
        record.request_id = request_id_of(req)
        record.status = resp.status_code
        cache = resp.get_header("X-Cache")
        if cache is not None:
            mode = resp.get_header("X-Cache-Mode")
            record.cache = f"{mode}_hit" if mode and cache == "HIT" else cache.lower()
        stream = resp.stream
        if stream is not None and not hasattr(stream, "read"):  # ours are iterators
            resp.stream = self._relay(stream, record)
        else:
            self.finish(record)

    def _relay(self, stream: Iterable[bytes], record: RequestRecord) -> Iterator[bytes]:
        """Pass ``stream`` on, noting its first piece; record the request at its end."""
        try:
            for piece in stream:
                if record.first_byte is None:
                    record.mark_first_byte()
                yield piece
        finally:
            close = getattr(stream, "close", None)
            if close is not None:
                close()  # the relay releases its lease first: its status is then known
            self.finish(record)

    def finish(self, record: RequestRecord) -> None:
        """Record ``record`` once: metrics, then the access-log line (written from the
        hub's next callbacks when deferring, see the class)."""
        self.metrics.observe_request(record)
        if self.fmt == OFF or not access_log.isEnabledFor(logging.INFO):
            return
        run_callback = self._run_callback
        if run_callback is None:
            self.writer.write(format_access(record, self.fmt))
            return
        pending = self._pending
        pending.append(record)
        if len(pending) == 1:
            run_callback(self._log_pending)

    def _log_pending(self) -> None:
        """The hub's callback: the access lines of every request finished since the last."""
        pending, self._pending = self._pending, []
        try:
            self.writer.write_lines([format_access(record, self.fmt) for record in pending])
        except Exception:  # the hub must not see it
            log.exception("could not write %d access-log line(s)", len(pending))
