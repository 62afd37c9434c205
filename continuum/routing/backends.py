"""Backends at run time: in-flight counts, latency EWMA, recent success rate, health.

One :class:`BackendPool` per worker process (see the concurrency notes in the README):
statistics are per worker; in-flight counts are too unless the pool shares them through
the host segment (:mod:`continuum.routing.shared_load`), when ``in_flight`` reads the
host's total. Under gevent a greenlet switch can only
happen at I/O, so the plain integer updates here need no lock.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable, Iterator, Sequence
from typing import TYPE_CHECKING

from continuum.hostshm import WAIT_LEVELS

if TYPE_CHECKING:
    from continuum.config import BackendConfig
    from continuum.hostshm import HostSegment

#: Samples a count needs before its time to a first token counts (one slow prefill is not
#: a queue).
WAIT_SAMPLES = 5


class Backend:
    """Run-time view of one configured backend, as strategies and scorers see it.

    Attributes:
        name: unique backend name from the config.
        url: base URL without a trailing slash.
        weight: relative weight for weighted strategies.
        in_flight: requests dispatched and not yet finished (released on every exit path).
        healthy: current verdict of the active health checks.
        probed: False until the first health check result: a backend added or changed by
            a reload starts unprobed and unhealthy, so it takes no request before a probe
            passes; so does every backend once a worker starts its health checks
            (:meth:`~continuum.routing.health.HealthMonitor.start`). Built here, outside a
            worker (no checks running), a backend is assumed healthy.
        draining: taken out of rotation by ``POST /admin/backends/{name}/drain``: no new
            requests; the ones in flight finish.
        latency_ewma: exponentially weighted mean of request latency in seconds (None until
            the first completed request); with a shared host segment, the host's: every
            worker's finished requests update it.
        models: model ids this backend serves (configured, or discovered when none are).
    """

    __slots__ = (
        "_alpha",
        "_cell",
        "_col",
        "_latency",
        "_local",
        "_outcomes",
        "_shared",
        "_successes",
        "_ttfp",
        "_ttfp_samples",
        "_waits",
        "_waits_version",
        "config",
        "configured_models",
        "discovered_models",
        "draining",
        "healthy",
        "name",
        "probed",
        "slots",
        "url",
        "weight",
    )

    def __init__(
        self,
        config: BackendConfig,
        *,
        ewma_alpha: float = 0.2,
        success_window: int = 100,
        unprobed: bool = False,
    ) -> None:
        self.config = config
        self.name = config.name
        self.url = config.url.rstrip("/")
        self.weight = config.weight
        #: ``backends[].slots``: requests the engine runs at once (None: not known).
        self.slots = config.slots
        self._local = 0
        self._shared: HostSegment | None = None
        self._col = self._cell = 0
        self.healthy = not unprobed
        self.probed = not unprobed
        self.draining = False
        self._latency: float | None = None
        # time to the first body piece of a stream, by the in-flight count at dispatch
        # (``in_flight``: the host's, with the other routers' when shared; EWMA, seconds),
        # the samples behind each, and the waits they imply (while the load is shared, the
        # host segment holds the table and ``_waits_version`` says which state of it
        # ``_waits`` was computed from)
        self._ttfp = [0.0] * WAIT_LEVELS
        self._ttfp_samples = [0] * WAIT_LEVELS
        self._waits: list[float] | None = None
        self._waits_version = -1
        # Built once: ``serves()`` runs for every backend on every request.
        self.configured_models = frozenset(config.models)
        self.discovered_models: frozenset[str] = frozenset()
        self._alpha = ewma_alpha
        self._outcomes: deque[bool] = deque(maxlen=success_window)
        self._successes = 0

    @property
    def in_flight(self) -> int:
        """Requests in flight on this backend: this worker's, or with a shared host segment
        (:mod:`continuum.routing.shared_load`) every worker's of this router host."""
        shared = self._shared
        return self._local if shared is None else shared.host_total(self._col)

    @in_flight.setter
    def in_flight(self, value: int) -> None:
        # Tests and tools set it; the forwarder uses acquire()/release().
        shared = self._shared
        if shared is not None:
            value = self._local + value - shared.host_total(self._col)
        self._set_local(value)

    def acquire(self) -> None:
        """One more request in flight from this worker."""
        self._set_local(self._local + 1)

    def release(self) -> None:
        """One request fewer in flight from this worker."""
        self._set_local(self._local - 1)

    def _set_local(self, value: int) -> None:
        self._local = value
        shared = self._shared
        if shared is not None:
            shared.words[self._cell] = value

    def share_load(self, segment: HostSegment | None) -> None:
        """Publish this worker's count in ``segment`` (None: keep it private). The latency
        EWMA and the time-to-first-piece table live in one place at a time: the host's while
        shared, this worker's else."""
        if self._shared is not None:
            self._latency = self._shared.latency(self._col)
            self._ttfp, self._ttfp_samples = self._shared.first_pieces(self._col)
        self._shared = segment
        self._waits = None
        if segment is not None:
            self._col = segment.column(self.name)
            self._cell = segment.cell(self._col)
            segment.words[self._cell] = self._local
            if self._latency is not None and segment.latency(self._col) is None:
                segment.set_latency(self._col, self._latency)

    @property
    def latency_ewma(self) -> float | None:
        """The latency EWMA in seconds: this worker's, or the host's when shared."""
        shared = self._shared
        return self._latency if shared is None else shared.latency(self._col)

    @latency_ewma.setter
    def latency_ewma(self, value: float | None) -> None:
        # Tests and tools set it; finished requests go through record().
        shared = self._shared
        if shared is None:
            self._latency = value
        else:
            shared.set_latency(self._col, value)

    @property
    def local_in_flight(self) -> int:
        """This worker's own in-flight requests."""
        return self._local

    @property
    def models(self) -> frozenset[str]:
        """Configured models, or the ones discovered from ``/v1/models`` when none are set."""
        return self.configured_models or self.discovered_models

    def serves(self, model: str) -> bool:
        """Whether this backend serves ``model``.

        A backend with no configured models whose model list has not been discovered yet
        is assumed to serve anything: refusing would turn a slow first probe into 404s.
        """
        models = self.models
        return model in models or not models

    @property
    def state(self) -> str:
        """``unprobed``, ``healthy`` or ``unhealthy`` (draining is shown apart)."""
        return "unprobed" if not self.probed else "healthy" if self.healthy else "unhealthy"

    @property
    def success_rate(self) -> float:
        """Fraction of successful requests over the recent window (1.0 with no history)."""
        total = len(self._outcomes)
        return 1.0 if total == 0 else self._successes / total

    def set_ewma_alpha(self, alpha: float) -> None:
        """Change the weight of new latency samples (hot reload)."""
        self._alpha = alpha

    def record(self, ok: bool, latency: float | None) -> None:
        """Record the outcome of one request (``latency`` in seconds, None if unknown)."""
        outcomes = self._outcomes
        if len(outcomes) == outcomes.maxlen and outcomes[0]:
            self._successes -= 1
        outcomes.append(ok)
        if ok:
            self._successes += 1
        if latency is not None:
            shared = self._shared
            if shared is not None:
                shared.add_latency(self._col, latency, self._alpha)
            else:
                prev = self._latency
                self._latency = latency if prev is None else \
                    prev + self._alpha * (latency - prev)

    def first_piece(self, level: int, seconds: float) -> None:
        """A stream sent when ``level`` requests were in flight here (:attr:`in_flight`)
        got its first body piece (its first token) ``seconds`` after it was sent. With a
        shared host segment the sample goes into the host's table, which every worker of
        the host learns from."""
        if level >= WAIT_LEVELS:
            return
        shared = self._shared
        if shared is not None:
            shared.add_first_piece(self._col, level, seconds, self._alpha)
            return
        samples = self._ttfp_samples[level]
        prev = self._ttfp[level]
        self._ttfp[level] = seconds if samples == 0 else prev + self._alpha * (seconds - prev)
        self._ttfp_samples[level] = samples + 1
        self._waits = None

    def queue_wait(self) -> float:
        """Seconds more than at its least busy a request sent now waits for its first
        token, as this worker (or, sharing the load, the host) has seen it: by the
        in-flight count at dispatch (:attr:`in_flight`: an engine queues the host's
        requests, not one worker's share),
        how much longer first tokens took than at the fastest count (each count once
        it has ``WAIT_SAMPLES`` samples; an engine batches up to its slots, so the counts
        under them cost about nothing, and queues beyond them). Never less than at a
        smaller count; 0 before any count has enough samples."""
        shared = self._shared
        if shared is not None:  # the host's table: recomputed once another sample is in
            version = shared.first_piece_version(self._col)
            if version != self._waits_version:
                self._waits, self._waits_version = None, version
        waits = self._waits
        if waits is None:
            ttfp, samples = (self._ttfp, self._ttfp_samples) if shared is None \
                else shared.first_pieces(self._col)
            waits = self._waits = _learned_waits(ttfp, samples)
        return waits[min(self.in_flight, WAIT_LEVELS - 1)]

    def __repr__(self) -> str:
        return f"<Backend {self.name} in_flight={self.in_flight} healthy={self.healthy}>"


def in_flight_of(backends: Sequence[Backend]) -> list[int]:
    """``[b.in_flight for b in backends]``, without a property call per backend (under
    CPython 3.11 each costs a new interpreter frame entered from C): what a strategy reads
    on every request."""
    return [b._local if b._shared is None else b._shared.host_total(b._col) for b in backends]


def _learned_waits(ttfp: list[float], samples: list[int]) -> list[float]:
    """The wait at each in-flight count (:meth:`Backend.queue_wait`) from the time-to-first-
    piece EWMA at each count and the samples behind it."""
    known = [level for level in range(WAIT_LEVELS) if samples[level] >= WAIT_SAMPLES]
    waits = [0.0] * WAIT_LEVELS
    if not known:
        return waits
    base = min(ttfp[level] for level in known)
    wait = 0.0
    for level in range(WAIT_LEVELS):
        if samples[level] >= WAIT_SAMPLES:
            wait = max(wait, ttfp[level] - base)
        waits[level] = wait
    return waits


class BackendPool:
    """All configured backends of one worker, indexed by name."""

    def __init__(self, backends: Iterable[Backend]) -> None:
        self._by_name = {b.name: b for b in backends}
        self._order = list(self._by_name.values())

    def __iter__(self) -> Iterator[Backend]:
        return iter(self._order)

    def __len__(self) -> int:
        return len(self._order)

    def replace(self, backends: Iterable[Backend]) -> None:
        """Make ``backends`` the pool, in their order (a reload; kept objects keep state)."""
        self._by_name = {b.name: b for b in backends}
        self._order = list(self._by_name.values())

    def get(self, name: str) -> Backend | None:
        """The backend called ``name``, or None."""
        return self._by_name.get(name)

    def routable(self) -> list[Backend]:
        """Enabled, client-facing backends (``internal`` ones only serve the router itself)."""
        return [b for b in self._order if b.config.enabled and not b.config.internal]

    def serving(self, model: str, protocol: str = "openai") -> list[Backend]:
        """Routable backends speaking ``protocol`` that serve ``model``, healthy or not."""
        return [
            b for b in self.routable() if protocol in b.config.protocols and b.serves(model)
        ]

    def candidates(self, model: str, protocol: str = "openai") -> list[Backend]:
        """Routable, healthy, not draining backends speaking ``protocol`` that serve
        ``model``."""
        return [
            b for b in self.routable()
            if b.healthy and not b.draining and protocol in b.config.protocols
            and b.serves(model)
        ]

    def model_ids(self, protocol: str | None = None) -> list[str]:
        """Union of the models of every routable backend (of ``protocol``), sorted."""
        ids: set[str] = set()
        for backend in self.routable():
            if protocol is not None and protocol not in backend.config.protocols:
                continue
            ids.update(backend.models)
        return sorted(ids)
