"""Prometheus metrics, correct with several gunicorn workers.

With ``PROMETHEUS_MULTIPROC_DIR`` set (``continuum-router serve`` and
``conf/gunicorn.conf.py`` set it), every worker writes its samples to files there and
``/metrics`` aggregates all live and dead workers through ``MultiProcessCollector``; the
``child_exit`` hook marks dead workers. Without it, one process serves its own registry.

Metric objects live on a :class:`RouterMetrics` instance (no module-level singletons), so
tests can build as many apps as they like.
"""

from __future__ import annotations

import functools
import math
import os
import time
from bisect import bisect_left
from collections.abc import Callable
from typing import Any

from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    generate_latest,
)

MULTIPROC_ENV = "PROMETHEUS_MULTIPROC_DIR"

_LATENCY_BUCKETS = (
    0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120,
)

CONTENT_TYPE = CONTENT_TYPE_LATEST


#: The amounts of :meth:`RouterMetrics.attempt_done`: in flight -1, attempts +1.
_DONE = (-1, 1)

#: ``outcome`` label values of ``continuum_requests_total``.
UPSTREAM = "upstream"
CACHE_HIT = "cache_hit"
ROUTER_ERROR = "router_error"
#: Routing decisions (``decision`` label): the KV scorer's pick, the strategy's, a cached
#: answer, or none (the router answered itself).
KV_AWARE = "kv_aware"
STRATEGY = "strategy"
CACHE = "cache"
NONE = "none"


class RequestRecord:
    """One client request as the metrics and the access log see it: filled in by the web
    layer (id, endpoint, status) and the service (model, backend, decision, cache
    outcome, usage), then :meth:`RouterMetrics.observe_request` records it once."""

    __slots__ = (
        "backend",
        "cache",
        "cache_creation_tokens",
        "cached_tokens",
        "completion_tokens",
        "decision",
        "endpoint",
        "finished",
        "first_byte",
        "lease",
        "model",
        "prompt_tokens",
        "request_id",
        "started",
        "status",
        "stream",
        "tenant",
    )

    def __init__(self, endpoint: str, request_id: str = "") -> None:
        self.started = time.perf_counter()
        self.endpoint = endpoint
        self.request_id = request_id
        self.tenant: str | None = None
        self.model: str | None = None
        self.backend: str | None = None
        self.decision = NONE
        self.cache: str | None = None
        self.stream = False
        self.status = 0
        #: For a relayed stream: the upstream lease, whose ``status`` is what the stream's
        #: end was recorded with (200, or 499, 502, 504).
        self.lease: Any = None
        self.first_byte: float | None = None
        self.finished: float | None = None
        self.prompt_tokens: int | None = None
        self.cached_tokens: int | None = None
        self.cache_creation_tokens: int | None = None
        self.completion_tokens: int | None = None

    @property
    def outcome(self) -> str:
        """``cache_hit``, ``upstream`` (a backend was tried) or ``router_error``."""
        if self.decision == CACHE:
            return CACHE_HIT
        return UPSTREAM if self.backend is not None else ROUTER_ERROR

    @property
    def final_status(self) -> int:
        """The status to count: a relayed stream's recorded end wins over its 200."""
        lease = self.lease
        end = None if lease is None else lease.status
        return end if end is not None else self.status

    def mark_first_byte(self) -> None:
        """The first piece of the answer went to the client (once)."""
        if self.first_byte is None:
            self.first_byte = time.perf_counter()


def multiprocess_enabled() -> bool:
    """Whether samples go through the multiprocess directory."""
    return bool(os.environ.get(MULTIPROC_ENV))


def _native_lock() -> Any:
    """A lock of the operating system's threads, also in a gevent-patched process (where
    ``threading.Lock`` is gevent's, a Python-level object taking two calls per acquire).
    Nothing switches greenlets while a value's lock is held (no I/O that gevent patches:
    an add to a double in the map, and at worst opening a file), so greenlets cannot
    deadlock on it; real threads are excluded from each other as before."""
    try:
        from gevent.monkey import get_original
    except ImportError:  # pragma: no cover - gevent is a dependency
        import threading

        return threading.Lock()
    return get_original("_thread", "allocate_lock")()


def _multiprocess_value_class(pid: list[int]) -> type:
    """The value class of prometheus-client's multiprocess mode, writing the same files
    (``<type>[_<mode>]_<pid>.db`` through its own ``MmapedDict`` and ``mmap_key``) with the
    same values, at a fraction of the work per sample.

    prometheus-client's ``MultiProcessValue`` takes, on every ``inc``/``set``, a lock that
    under gevent is Python-level, calls its process-identifier function to notice a fork,
    and looks the sample's position up by its JSON key; about 115 bytecodes and 6 Python
    calls per sample, 14 samples per proxied request. This class takes a native lock,
    compares ``pid[0]`` (the pid cached at import and refreshed in every forked child,
    ``os.register_at_fork``) with the pid its files belong to, and adds to its double in
    place, through a view of the file's map as doubles (``view[i] += amount``: no packing,
    no copy of the value kept beside the file's).

    The layout is prometheus-client's: each entry's value and timestamp are two doubles
    at a position that is a multiple of 8 (its key is padded to that), so a value is one
    aligned 8-byte store, which a concurrent ``/metrics`` read in another process sees
    whole. A key's position in its file never changes; the map object does when the file
    grows (``MmapedDict`` maps it again, larger), and then every value of that file is
    given a view of the new map. Views are released before a file is closed (an exported
    map cannot be). After a fork every value is re-read from the child's own files, as
    prometheus-client does."""
    from prometheus_client import values
    from prometheus_client.mmap_dict import MmapedDict, mmap_key

    lock = _native_lock()
    acquire, release = lock.acquire, lock.release
    files: dict[str, Any] = {}
    views: dict[Any, tuple[Any, Any]] = {}  # file -> (its map, a memoryview of it as doubles)
    live: list[Any] = []
    owner = [pid[0]]  # the process the open files belong to

    def view_of(file: Any) -> Any:
        """The doubles view of ``file``'s current map (lock held); a new map (the file
        grew) gets a new view, which its values then use."""
        mapped = file._m
        known = views.get(file)
        if known is not None and known[0] is mapped:
            return known[1]
        view = memoryview(mapped).cast("d")
        views[file] = (mapped, view)
        if known is not None:
            for value in live:
                if value._file is file:
                    value._view = view
            known[1].release()
        return view

    def close_all() -> None:
        """Release every view, then close every file (lock held, or at exit)."""
        for value in live:
            value._view = None
        for _mapped, view in views.values():
            view.release()
        views.clear()
        for f in files.values():
            f.close()
        files.clear()

    def cleanup() -> None:
        close_all()
        live.clear()

    values._multi_process_cleanups.append(cleanup)

    def forked() -> None:
        """In a forked child (lock held): reopen the files under its pid, re-read all."""
        owner[0] = pid[0]
        close_all()
        for value in live:
            value._reset()

    class MmapedValue:
        """A float in this process's mmapped file (see the factory)."""

        _multiprocess = True
        __slots__ = ("_file", "_index", "_params", "_view")

        def __init__(self, typ: str, metric_name: str, name: str, labelnames: Any,
                     labelvalues: Any, help_text: str, multiprocess_mode: str = "",
                     **kwargs: Any) -> None:
            self._params = (typ, metric_name, name, labelnames, labelvalues, help_text,
                            multiprocess_mode)
            with lock:
                if owner[0] != pid[0]:
                    forked()
                self._reset()
                live.append(self)

        def _reset(self) -> None:
            typ, metric_name, name, labelnames, labelvalues, help_text, mode = self._params
            prefix = f"{typ}_{mode}" if typ == "gauge" else typ
            file = files.get(prefix)
            if file is None:
                file = files[prefix] = MmapedDict(os.path.join(
                    os.environ[MULTIPROC_ENV], f"{prefix}_{owner[0]}.db"))  # type: ignore[no-untyped-call]
            self._file = file
            key = mmap_key(metric_name, name, labelnames, labelvalues, help_text)
            file.read_value(key)  # makes the entry if new (the map may grow)
            self._index = file._positions[key] // 8
            self._view = view_of(file)

        # ``acquire()``/``release()`` rather than ``with lock``: the with statement costs
        # about 250 ns more per sample under CPython 3.11 (its exit is a generic call).
        def inc(self, amount: float) -> None:
            acquire()
            try:
                if owner[0] != pid[0]:
                    forked()
                self._view[self._index] += amount
            finally:
                release()

        def set(self, value: float, timestamp: float | None = None) -> None:
            acquire()
            try:
                if owner[0] != pid[0]:
                    forked()
                view, index = self._view, self._index
                view[index] = value
                view[index + 1] = timestamp or 0.0
            finally:
                release()

        def set_exemplar(self, exemplar: Any) -> None:
            return  # not kept in multiprocess mode (as in prometheus-client)

        def get(self) -> float:
            with lock:
                if owner[0] != pid[0]:
                    forked()
                return float(self._view[self._index])

        def get_exemplar(self) -> Any:
            return None

        @staticmethod
        def inc_each(values: tuple[Any, ...], amounts: tuple[float, ...]) -> None:
            """``values[i].inc(amounts[i])`` for each, under one taking of the lock.
            ``amounts`` has one amount per value (:func:`joint`'s callers build both; a
            ``zip(strict=True)`` would parse a keyword on every call)."""
            acquire()
            try:
                if owner[0] != pid[0]:
                    forked()
                for value, amount in zip(values, amounts):  # noqa: B905 (see above)
                    if amount:  # else it adds nothing (uncached or uncreated tokens)
                        value._view[value._index] += amount
            finally:
                release()

    return MmapedValue


#: The class :func:`_install_multiprocess_values` installed, if it did.
_FAST_VALUE: Any = None


def _install_multiprocess_values() -> None:
    """In multiprocess mode, install :func:`_multiprocess_value_class` as
    prometheus-client's value class, with the pid cached at import and refreshed in every
    forked child (``os.register_at_fork``): prometheus-client's own calls ``os.getpid()``
    on every sample to notice a fork, a syscall each. It must be installed before any
    metric value exists in the process (values built earlier would keep a second map of
    the same file): this module is imported before any metric is built, and the gunicorn
    master builds none. A prometheus-client whose file layer is not the one this class
    was written against keeps its own class (with the cached pid)."""
    if not multiprocess_enabled():
        return
    from prometheus_client import mmap_dict, values

    pid = [os.getpid()]

    def refresh() -> None:
        pid[0] = os.getpid()

    os.register_at_fork(after_in_child=refresh)
    known = all(hasattr(mmap_dict.MmapedDict, name)
                for name in ("read_value", "_init_value", "close")) and \
        hasattr(mmap_dict, "mmap_key") and hasattr(values, "_multi_process_cleanups")
    if known:
        global _FAST_VALUE
        values.ValueClass = _FAST_VALUE = _multiprocess_value_class(pid)
    else:  # pragma: no cover - another prometheus-client file layer
        values.ValueClass = values.MultiProcessValue(lambda: pid[0])  # type: ignore[no-untyped-call]


_install_multiprocess_values()


def adder(child: Any) -> Callable[[float], None]:
    """``child.inc`` of a counter or gauge child, as its value's own ``inc`` when it has
    one: the same sample, without the metric's checks that a child always passes (it is
    observable; our amounts are never negative for counters). ``adder(c)(-1)`` is a
    gauge's ``dec()``."""
    value = getattr(child, "_value", None)
    inc = getattr(value, "inc", None)
    return inc if callable(inc) else child.inc  # type: ignore[no-any-return]


def joint(adds: tuple[Callable[[float], None], ...]) -> Callable[[tuple[float, ...]], None]:
    """One callable for several :func:`adder` results: ``j(amounts)`` is ``adds[i](amounts[i])``
    for each (adding 0 leaves a sample as it is), under one taking of the values' lock
    when they are all of this module's multiprocess class."""
    fast: Any = _FAST_VALUE
    owners = tuple(getattr(add, "__self__", None) for add in adds)
    if fast is not None and all(type(v) is fast for v in owners):
        return functools.partial(fast.inc_each, owners)

    def each(amounts: tuple[float, ...]) -> None:
        for add, amount in zip(adds, amounts, strict=True):
            add(amount)

    return each


def observer(child: Any) -> Callable[[float], None]:
    """``child.observe`` of a histogram child, adding to its sum and to the first bucket
    whose upper bound is at least the amount, as ``Histogram.observe`` does (a NaN lands
    in no bucket), straight on the values."""
    try:
        sum_inc = child._sum.inc
        bounds = list(child._upper_bounds)
        buckets = [bucket.inc for bucket in child._buckets]
    except AttributeError:  # pragma: no cover - another prometheus-client
        return child.observe  # type: ignore[no-any-return]
    if len(bounds) != len(buckets) or not bounds or bounds[-1] != math.inf:
        return child.observe  # type: ignore[no-any-return]
    fast: Any = _FAST_VALUE
    inc_each = None if fast is None else fast.inc_each
    sum_value = getattr(sum_inc, "__self__", None)
    values = [getattr(inc, "__self__", None) for inc in buckets]
    if inc_each is not None and type(sum_value) is fast and all(type(v) is fast for v in values):
        pairs = [(sum_value, value) for value in values]

        def observe_values(amount: float) -> None:
            if amount == amount:  # not NaN
                inc_each(pairs[bisect_left(bounds, amount)], (amount, 1))
            else:
                sum_inc(amount)

        return observe_values

    def observe(amount: float) -> None:
        sum_inc(amount)
        if amount == amount:  # not NaN
            buckets[bisect_left(bounds, amount)](1)

    return observe


class RouterMetrics:
    """Every router metric, registered in one registry per app."""

    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry or CollectorRegistry(auto_describe=True)
        r = self.registry
        self.requests = Counter(
            "continuum_requests_total",
            "Client requests, each counted once when answered, by endpoint, status class "
            "(2xx, 4xx, 5xx) and outcome (upstream, cache_hit, router_error)",
            ["endpoint", "status_class", "outcome"],
            registry=r,
        )
        self.upstream_attempts = Counter(
            "continuum_upstream_attempts_total",
            "Requests sent to a backend, retries included, by endpoint, backend and the "
            "status recorded (499: the client went away first)",
            ["endpoint", "backend", "status"],
            registry=r,
        )
        self.duration = Histogram(
            "continuum_request_duration_seconds",
            "Time from the router receiving a request to its last byte, by endpoint, "
            "backend and routing decision (kv_aware, strategy, cache, none)",
            ["endpoint", "backend", "decision"],
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.ttft = Histogram(
            "continuum_time_to_first_token_seconds",
            "Streamed answers: time from the router receiving the request to the first "
            "event relayed to the client, by endpoint, backend and routing decision",
            ["endpoint", "backend", "decision"],
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.ttfb = Histogram(
            "continuum_upstream_time_to_first_byte_seconds",
            "Time from dispatch to the response head of the backend, per attempt",
            ["endpoint", "backend"],
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.prompt_tokens = Counter(
            "continuum_prompt_tokens_total",
            "Prompt tokens the answers' usage reported (Anthropic: input + cache read + "
            "cache write), by backend and routing decision",
            ["backend", "decision"],
            registry=r,
        )
        self.cached_prompt_tokens = Counter(
            "continuum_cached_prompt_tokens_total",
            "Prompt tokens served from the engine's prefix cache (OpenAI "
            "prompt_tokens_details.cached_tokens, Anthropic cache_read_input_tokens)",
            ["backend", "decision"],
            registry=r,
        )
        self.cache_creation_tokens = Counter(
            "continuum_cache_creation_prompt_tokens_total",
            "Prompt tokens written to Anthropic's prompt cache (cache_creation_input_tokens)",
            ["backend", "decision"],
            registry=r,
        )
        self.completion_tokens = Counter(
            "continuum_completion_tokens_total",
            "Completion tokens the answers' usage reported, by backend and routing decision",
            ["backend", "decision"],
            registry=r,
        )
        self.in_flight = Gauge(
            "continuum_backend_in_flight",
            "Requests dispatched to a backend and not yet finished",
            ["backend"],
            multiprocess_mode="livesum",
            registry=r,
        )
        self.healthy = Gauge(
            "continuum_backend_healthy",
            "1 when the backend passes health checks (minimum over workers)",
            ["backend"],
            multiprocess_mode="livemin",
            registry=r,
        )
        self.draining = Gauge(
            "continuum_backend_draining",
            "1 while the backend is drained by the admin API (no new requests)",
            ["backend"],
            multiprocess_mode="livemax",
            registry=r,
        )
        self.upstream_errors = Counter(
            "continuum_upstream_errors_total",
            "Upstream failures by backend and kind (connect, timeout, stream, status, "
            "too_large, stream_duration)",
            ["backend", "kind"],
            registry=r,
        )
        self.retries = Counter(
            "continuum_upstream_retries_total",
            "Requests retried on another backend after a connect failure",
            ["backend"],
            registry=r,
        )
        self.health_transitions = Counter(
            "continuum_backend_health_transitions_total",
            "Health state changes by backend and new state",
            ["backend", "state"],
            registry=r,
        )
        self.prefix_requests = Counter(
            "continuum_prefix_routing_requests_total",
            "PrefixAwareHash selections by decision (prefix_hash, overflow, fallback)",
            ["strategy"],
            registry=r,
        )
        self.prefix_distribution = Counter(
            "continuum_prefix_routing_backend_distribution_total",
            "Requests PrefixAwareHash sent to each backend (rate() gives the load split)",
            ["backend"],
            registry=r,
        )
        self.response_cache = Counter(
            "continuum_response_cache_requests_total",
            "Response cache lookups by result (hit, miss, skip)",
            ["result"],
            registry=r,
        )
        self.response_cache_stores = Counter(
            "continuum_response_cache_stores_total",
            "Responses offered to the cache by outcome (stored, too_large, error, incomplete)",
            ["outcome"],
            registry=r,
        )
        self.cache_entries = Gauge(
            "continuum_response_cache_entries",
            "Entries in the in-memory response cache (per worker, summed)",
            [],
            multiprocess_mode="livesum",
            registry=r,
        )
        self.cache_evictions = Counter(
            "continuum_response_cache_evictions_total",
            "Entries evicted from the in-memory response cache (LRU)",
            [],
            registry=r,
        )
        self.semantic_requests = Counter(
            "continuum_semantic_cache_requests_total",
            "Semantic cache lookups after an exact miss by result (hit, miss, skip)",
            ["result"],
            registry=r,
        )
        self.semantic_skips = Counter(
            "continuum_semantic_cache_skips_total",
            "Requests that skipped the semantic path, by reason",
            ["reason"],
            registry=r,
        )
        self.semantic_gate_refusals = Counter(
            "continuum_semantic_cache_gate_refusals_total",
            "Matches above the threshold the false-hit gate refused (negation, number, entity)",
            ["reason"],
            registry=r,
        )
        self.semantic_embedding_latency = Histogram(
            "continuum_semantic_cache_embedding_seconds",
            "Embedding call latency (failures included)",
            buckets=(0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5),
            registry=r,
        )
        self.semantic_embedding_errors = Counter(
            "continuum_semantic_cache_embedding_errors_total",
            "Failed embedding calls by kind (timeout, connect, status, invalid, protocol)",
            ["kind"],
            registry=r,
        )
        self.semantic_entries = Gauge(
            "continuum_semantic_cache_index_entries",
            "Vectors in the semantic index (per worker, summed)",
            [],
            multiprocess_mode="livesum",
            registry=r,
        )
        self.redis_latency = Histogram(
            "continuum_cache_redis_latency_seconds",
            "Redis command latency by operation",
            ["operation"],
            buckets=(0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1,
                     0.25, 0.5, 1.0),
            registry=r,
        )
        self.redis_errors = Counter(
            "continuum_cache_redis_errors_total",
            "Redis failures by kind (connection, timeout, protocol, other)",
            ["kind"],
            registry=r,
        )
        self.fallback_active = Gauge(
            "continuum_cache_fallback_active",
            "1 while Redis is unreachable and the in-memory fallback serves (max over workers)",
            [],
            multiprocess_mode="livemax",
            registry=r,
        )
        self.kv_decisions = Counter(
            "continuum_kv_index_routing_decisions_total",
            "KV scorer passes by decision (kv_aware, fallback) and the chosen backend's tier",
            ["decision", "tier"],
            registry=r,
        )
        self.kv_placements = Counter(
            "continuum_kv_index_placements_total",
            "Requests placed by KV pressure (best match = their first message at most): "
            "to the best holder, or elsewhere (another backend cost less)",
            ["outcome"],
            registry=r,
        )
        self.kv_overlap_score = Histogram(
            "continuum_kv_index_overlap_score",
            "Best composite score of kv_aware decisions",
            buckets=(0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 1.0),
            registry=r,
        )
        self.kv_query_latency = Histogram(
            "continuum_kv_index_query_latency_seconds",
            "KV index query latency (one per scorer prepare)",
            buckets=(0.00001, 0.00005, 0.0001, 0.0005, 0.001, 0.005, 0.01, 0.05, 0.1),
            registry=r,
        )
        self.workers = Gauge(
            "continuum_workers",
            "Live gunicorn worker processes serving this router (1 per worker, summed)",
            [],
            multiprocess_mode="livesum",
            registry=r,
        )
        # Series of fixed label values exist from the start, at zero: a rate() over them is
        # 0, not "no data", before the first error.
        for kind in ("connection", "timeout", "protocol", "other"):
            self.redis_errors.labels(kind)
        # whatever the strategy (0 under any other than PrefixAwareHash, as the seed has it)
        for decision in ("prefix_hash", "overflow", "fallback"):
            self.prefix_requests.labels(decision)
        self._children: dict[tuple[str, ...], Any] = {}
        self._adders: dict[tuple[str, ...], Callable[[float], None]] = {}
        self._observers: dict[tuple[str, ...], Callable[[float], None]] = {}
        self._bundles: dict[tuple[Any, ...], tuple[Callable[..., None], ...]] = {}
        self._attempts: dict[tuple[str, str, int], Callable[[tuple[float, ...]], None]] = {}

    def child(self, metric: Any, *labels: str) -> Any:
        """The labelled child of ``metric``, cached (``labels()`` costs microseconds)."""
        key = (metric._name, *labels)
        child = self._children.get(key)
        if child is None:
            child = self._children[key] = metric.labels(*labels)
        return child

    def adder(self, metric: Any, *labels: str) -> Callable[[float], None]:
        """:func:`adder` of the labelled child of a counter or gauge (of the metric itself
        without labels), cached: ``add(1)`` is its ``inc()``, ``add(-1)`` a gauge's
        ``dec()``."""
        key = (metric._name, *labels)
        add = self._adders.get(key)
        if add is None:
            add = self._adders[key] = adder(self.child(metric, *labels) if labels else metric)
        return add

    #: :func:`joint`, for plugins that hold the metrics only.
    joint = staticmethod(joint)

    def observer(self, metric: Any, *labels: str) -> Callable[[float], None]:
        """:func:`observer` of the labelled child of a histogram (of the histogram itself
        without labels), cached."""
        key = (metric._name, *labels)
        observe = self._observers.get(key)
        if observe is None:
            observe = self._observers[key] = observer(
                self.child(metric, *labels) if labels else metric)
        return observe

    def observe_request(self, record: RequestRecord) -> None:
        """Count a finished client request: once in ``continuum_requests_total``, its
        duration and TTFT, and the tokens its answer reported. The samples of one label
        combination are looked up once and kept together (one dict lookup per request)."""
        finished = record.finished = time.perf_counter()
        status = record.final_status
        decision = record.decision
        backend = record.backend or ("cache" if decision == CACHE else NONE)
        key = (record.endpoint, backend, decision, status // 100, record.outcome)
        bundle = self._bundles.get(key)
        if bundle is None:
            bundle = self._bundles[key] = self._bundle(*key)
        counters, duration, ttft = bundle
        prompt = record.prompt_tokens
        # requests, and the tokens the answer reported (0 where it reported none)
        counters((1, prompt or 0, (record.cached_tokens or 0) if prompt is not None else 0,
                  (record.cache_creation_tokens or 0) if prompt is not None else 0,
                  record.completion_tokens or 0))
        duration(finished - record.started)
        if record.stream and record.first_byte is not None:
            ttft(record.first_byte - record.started)

    def _bundle(self, endpoint: str, backend: str, decision: str, hundreds: int,
                outcome: str) -> tuple[Callable[..., None], ...]:
        status_class = f"{hundreds}xx" if 1 <= hundreds <= 5 else "5xx"
        add, observe = self.adder, self.observer
        counters = joint((add(self.requests, endpoint, status_class, outcome),
                          add(self.prompt_tokens, backend, decision),
                          add(self.cached_prompt_tokens, backend, decision),
                          add(self.cache_creation_tokens, backend, decision),
                          add(self.completion_tokens, backend, decision)))
        return (counters, observe(self.duration, endpoint, backend, decision),
                observe(self.ttft, endpoint, backend, decision))

    def attempt_done(self, endpoint: str, backend: str, status: int) -> None:
        """An upstream attempt ended with ``status``: one fewer in flight on ``backend``,
        one more in ``continuum_upstream_attempts_total`` (both samples at once)."""
        key = (endpoint, backend, status)
        samples = self._attempts.get(key)
        if samples is None:
            samples = self._attempts[key] = joint((
                self.adder(self.in_flight, backend),
                self.adder(self.upstream_attempts, endpoint, backend, str(status))))
        samples(_DONE)

    def exposition(self) -> bytes:
        """The text exposition for ``GET /metrics``."""
        if multiprocess_enabled():
            from prometheus_client import multiprocess

            registry = CollectorRegistry()
            multiprocess.MultiProcessCollector(registry)  # type: ignore[no-untyped-call]
            return bytes(generate_latest(registry))
        return bytes(generate_latest(self.registry))
