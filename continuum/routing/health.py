"""Active health checks: a greenlet per worker probes every backend, or, with the workers of
a host sharing one prober (:mod:`continuum.routing.shared_health`), takes the prober's
results.

Invariants:
  * A backend is either ``healthy`` or not; only :meth:`HealthTracker.observe` changes it.
  * One added or changed by a reload starts ``unprobed`` (not healthy, takes no request);
    its first probe result, pass or fail, makes it healthy or unhealthy. So does every
    backend of a worker that starts with health checks on: a worker booting after the
    config file changed must not trust a backend no worker has probed yet. The worker
    waits up to a second for its first round before serving (:meth:`HealthMonitor.
    await_startup`), and a request that finds only unprobed backends waits for their first
    results (at most two probe timeouts) rather than failing at once.
  * A first result that finds a backend healthy is not counted as a transition (it is the
    state expected); one that finds it unhealthy is.
  * ``unhealthy_threshold`` consecutive failures take a healthy backend out;
    ``healthy_threshold`` consecutive successes put an unhealthy one back. A result of the
    other kind resets the streak.
  * Passive failures (a connect error while proxying) count like failed probes, so a dead
    backend leaves rotation at the first requests that hit it, not a probe later.

Transitions (state, event) → state:

    ===========  =======  ===================================================
    state        event    next
    ===========  =======  ===================================================
    unprobed     success  healthy
    unprobed     failure  unhealthy
    healthy      success  healthy (failure streak reset)
    healthy      failure  healthy, or unhealthy when the streak hits the limit
    unhealthy    failure  unhealthy (success streak reset)
    unhealthy    success  unhealthy, or healthy when the streak hits the limit
    ===========  =======  ===================================================
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import requests

from continuum.routing.engine_metrics import SlotLearner, read_queue
from continuum.routing.shared_health import FOLLOW_SECONDS

if TYPE_CHECKING:
    from continuum.config import HealthCheckConfig
    from continuum.metrics import RouterMetrics
    from continuum.routing.backends import Backend, BackendPool
    from continuum.routing.shared_health import SharedProbes

log = logging.getLogger(__name__)


class HealthTracker:
    """Consecutive-result counting for one backend (see the module's transition table), and
    its slots learned from its metrics (``backends[].learn_slots``)."""

    __slots__ = ("_failures", "_successes", "backend", "healthy_threshold", "metrics_warned",
                 "slot_learner", "unhealthy_threshold")

    def __init__(self, backend: Backend, unhealthy_threshold: int, healthy_threshold: int) -> None:
        self.backend = backend
        self.unhealthy_threshold = unhealthy_threshold
        self.healthy_threshold = healthy_threshold
        self._failures = 0
        self._successes = 0
        self.slot_learner = SlotLearner()
        self.metrics_warned = False

    def observe(self, ok: bool) -> bool | None:
        """Record one result; return the new state if it changed, else None. The first
        result of an unprobed backend decides its state at once."""
        backend = self.backend
        if not backend.probed:
            backend.probed = True
            self._successes, self._failures = (1, 0) if ok else (0, 1)
            backend.healthy = ok
            return ok
        if ok:
            self._failures = 0
            self._successes += 1
            if not backend.healthy and self._successes >= self.healthy_threshold:
                backend.healthy = True
                return True
        else:
            self._successes = 0
            self._failures += 1
            if backend.healthy and self._failures >= self.unhealthy_threshold:
                backend.healthy = False
                return False
        return None


class HealthMonitor:
    """Probes every enabled backend on an interval and keeps ``Backend.healthy`` current.

    ``shared``: the host's shared probes; this worker then probes only while it holds the
    role, and otherwise feeds the holder's results to its trackers (:meth:`follow`).
    """

    def __init__(
        self,
        pool: BackendPool,
        config: HealthCheckConfig,
        metrics: RouterMetrics | None = None,
        session_factory: Callable[[], requests.Session] = requests.Session,
        shared: SharedProbes | None = None,
    ) -> None:
        self.pool = pool
        self.config = config
        self.metrics = metrics
        self.shared = shared
        # As a follower: the holder's token and the last result seen, per backend name,
        # and when to probe a backend the holder's file has no fresh entry for.
        self._followed: dict[str, tuple[str, int]] = {}
        self._own_due: dict[str, float] = {}
        self.trackers = {
            b.name: HealthTracker(b, config.unhealthy_threshold, config.healthy_threshold)
            for b in pool
        }
        self._session = session_factory()
        self._greenlet: Any = None
        self._started = False
        # Set (and replaced) whenever an unprobed backend gets its first result.
        self._first_result: Any = None
        for backend in pool:
            self._publish(backend)

    def reconfigure(self, config: HealthCheckConfig) -> None:
        """Apply new probe settings; the running loop picks them up on its next round."""
        self.config = config
        for tracker in self.trackers.values():
            tracker.unhealthy_threshold = config.unhealthy_threshold
            tracker.healthy_threshold = config.healthy_threshold
        if config.enabled and self._started:
            self.start()
        elif self._greenlet is not None:
            self._greenlet.kill(block=False)
            self._greenlet = None

    def sync(self) -> list[Backend]:
        """Follow the pool after a reload: trackers for its new backend objects (the kept
        ones keep theirs), none for removed ones; probe the new ones at once when running.
        Returns the new backends."""
        config, old = self.config, self.trackers
        self.trackers = {}
        added = []
        for backend in self.pool:
            tracker = old.get(backend.name)
            if tracker is None or tracker.backend is not backend:
                tracker = HealthTracker(backend, config.unhealthy_threshold,
                                        config.healthy_threshold)
                added.append(backend)
                self._publish(backend)
            self.trackers[backend.name] = tracker
        if not config.enabled:  # no probe will come: nothing to wait for
            for backend in added:
                backend.probed = backend.healthy = True
                self._publish(backend)
        elif added and self._started:
            import gevent

            for backend in added:
                if backend.config.enabled:
                    gevent.spawn(self.probe, backend)
        return added

    def observe(self, backend: Backend, ok: bool) -> None:
        """Feed one probe or passive result for ``backend``."""
        tracker = self.trackers.get(backend.name)
        if tracker is None:
            return
        if tracker.backend is not backend:
            return  # a result for a backend object a reload has replaced
        first = not backend.probed
        changed = tracker.observe(ok)
        if first:
            event, self._first_result = self._first_result, None
            if event is not None:
                event.set()
            if ok:  # the state expected of a backend, not a change worth counting
                log.info("backend %s passed its first health check", backend.name)
                self._publish(backend)
                return
        if changed is not None:
            state = "healthy" if changed else "unhealthy"
            log.warning("backend %s is now %s", backend.name, state)
            if self.metrics is not None:
                self.metrics.child(self.metrics.health_transitions, backend.name, state).inc()
            self._publish(backend)

    def _publish(self, backend: Backend) -> None:
        if self.metrics is not None:
            self.metrics.child(self.metrics.healthy, backend.name).set(1 if backend.healthy else 0)

    def probe(self, backend: Backend) -> bool:
        """Probe ``backend`` once (blocking I/O; gevent-friendly when patched)."""
        config = self.config
        timeout = config.timeout_ms / 1000
        headers = {}
        key = backend.config.resolved_api_key()
        path = config.path
        if backend.config.protocol == "anthropic":
            # The Anthropic API has no health path; listing models is its cheapest call.
            path = "/v1/models"
            headers["anthropic-version"] = backend.config.anthropic_version
            if key:
                headers["x-api-key"] = key
        elif backend.config.type == "gemini":
            # Google has no health path either; models.list is free (x-goog-api-key).
            path = "/v1beta/models"
            if key:
                headers["x-goog-api-key"] = key
        elif key:
            headers["Authorization"] = f"Bearer {key}"
        try:
            resp = self._session.get(backend.url + path, timeout=timeout, headers=headers)
            ok = resp.status_code < 400
            if ok and path == "/v1/models":
                backend.discovered_models = _model_ids(resp)
            elif ok and path == "/v1beta/models":
                backend.discovered_models = frozenset(
                    str(m.get("name", "")).removeprefix("models/")
                    for m in resp.json().get("models", []) if isinstance(m, dict)) - {""}
            elif ok and not backend.config.models:
                models = self._session.get(
                    backend.url + "/v1/models", timeout=timeout, headers=headers
                )
                if models.status_code < 400:
                    backend.discovered_models = _model_ids(models)
        except (requests.RequestException, ValueError) as exc:
            log.debug("probe of %s failed: %s", backend.name, exc)
            ok = False
        if ok and backend.config.learn_slots:
            self._learn_slots(backend, headers, timeout)
        if self.shared is not None and self.shared.holder:
            self.shared.record(backend, ok)
        self.observe(backend, ok)
        return ok

    def _learn_slots(self, backend: Backend, headers: dict[str, str], timeout: float) -> None:
        """Read ``backend``'s queue gauges from its ``/metrics`` and update its slots
        (:mod:`continuum.routing.engine_metrics`). A failure here does not fail the probe:
        the slots stay as they were."""
        tracker = self.trackers.get(backend.name)
        if tracker is None or tracker.backend is not backend:
            return
        try:
            resp = self._session.get(backend.url + "/metrics", timeout=timeout, headers=headers)
            queue = read_queue(resp.text) if resp.status_code < 400 else None
        except requests.RequestException as exc:
            log.debug("metrics of %s unreadable: %s", backend.name, exc)
            return
        if queue is None:
            if not tracker.metrics_warned:
                tracker.metrics_warned = True
                log.warning("backend %s: learn_slots is on, but its /metrics (HTTP %d) has "
                            "no vLLM or SGLang queue gauges; its slots stay unknown",
                            backend.name, resp.status_code)
            return
        slots = tracker.slot_learner.observe(*queue)
        if slots is not None and slots != backend.slots:
            log.info("backend %s: %d slots, learned from its metrics", backend.name, slots)
            backend.slots = slots

    def probe_all(self) -> None:
        """Probe every enabled backend concurrently and wait for the results."""
        import gevent

        backends = [b for b in self.pool if b.config.enabled]
        gevent.joinall([gevent.spawn(self.probe, b) for b in backends])
        if self.shared is not None and self.shared.holder:
            self.shared.publish({b.name for b in backends})

    def view(self) -> dict[str, bool]:
        """For ``GET /admin/backends``: whether the host's workers share one prober, and
        whether this worker probes (the prober, or every worker when not shared)."""
        shared = self.shared
        return {"shared": shared is not None,
                "prober": self.config.enabled and (shared is None or shared.probing)}

    def follow(self) -> int:
        """As a follower: feed every holder result not yet seen to the trackers, and probe
        the backends the holder's file has no fresh entry for (each at most once an
        interval, without waiting for the result). Returns the results taken."""
        import gevent

        assert self.shared is not None
        config = self.config
        holder, entries = self.shared.entries()
        now = time.monotonic()
        stale = 2 * config.interval_seconds + config.timeout_ms / 1000
        taken = 0
        for backend in self.pool:
            if not backend.config.enabled:
                continue
            name = backend.name
            entry = entries.get(name)
            if entry is None or entry.url != backend.url or now - entry.at > stale:
                if now >= self._own_due.get(name, 0.0):
                    self._own_due[name] = now + config.interval_seconds
                    gevent.spawn(self.probe, backend)
                continue
            seen_holder, seen = self._followed.get(name, ("", 0))
            fresh = entry.seq - seen if seen_holder == holder and seen <= entry.seq else 1
            if fresh > 0 and entry.results:
                backend.discovered_models = entry.models
                if backend.config.learn_slots:
                    backend.slots = entry.slots
                for ok in entry.results[-min(fresh, len(entry.results)):]:
                    self.observe(backend, ok)
                    taken += 1
            self._followed[name] = (holder, entry.seq)
        return taken

    def await_first_results(self, backends: Sequence[Backend]) -> None:
        """Wait until one of ``backends`` is healthy or none is still unprobed, at most two
        probe timeouts (a probe's connect and its read are bounded apart). Returns at once
        when no probe is coming (checks off, or not started in this process)."""
        self._await(lambda: any(b.healthy and not b.draining for b in backends) or not any(
            not b.probed and b.config.enabled for b in backends),
            2 * self.config.timeout_ms / 1000)

    def await_startup(self, seconds: float) -> None:
        """Wait until every enabled backend has its first result, at most ``seconds``
        (a worker calls it once before serving, so its first requests see every live
        backend; one still unprobed after it stays out until its probe answers)."""
        self._await(lambda: all(b.probed or not b.config.enabled for b in self.pool), seconds)

    def _await(self, done: Callable[[], bool], seconds: float) -> None:
        """Wait for first probe results until ``done()``, at most ``seconds``; at once when
        no probe is coming."""
        if not (self._started and self.config.enabled and self._greenlet is not None):
            return
        from gevent.event import Event

        deadline = time.monotonic() + seconds
        while not done():
            left = deadline - time.monotonic()
            if left <= 0:
                return
            if self._first_result is None:
                self._first_result = Event()
            self._first_result.wait(left)

    def start(self) -> None:
        """Start the probing greenlet (call in the worker, after the fork). On the first
        start every enabled backend becomes unprobed: the first round decides."""
        first, self._started = not self._started, True
        if not self.config.enabled or self._greenlet is not None:
            return
        if first:
            for backend in self.pool:
                if backend.config.enabled and backend.probed:
                    backend.probed = backend.healthy = False
                    self._publish(backend)
        import gevent

        def loop() -> None:
            while self.config.enabled:
                pause = self.config.interval_seconds
                try:
                    if self.shared is None or self.shared.hold():
                        self.probe_all()
                    else:
                        self.follow()
                        pause = min(pause, FOLLOW_SECONDS)
                except Exception:  # a bug here must not stop health checking
                    log.exception("health check round failed")
                gevent.sleep(pause)

        self._greenlet = gevent.spawn(loop)

    def stop(self) -> None:
        """Stop the probing greenlet (and, as the host's prober, give the role up)."""
        if self._greenlet is not None:
            self._greenlet.kill(block=False)
            self._greenlet = None
        if self.shared is not None:
            self.shared.release()
        self._session.close()


def _model_ids(resp: requests.Response) -> frozenset[str]:
    data = resp.json().get("data", [])
    return frozenset(m["id"] for m in data if isinstance(m, dict) and isinstance(m.get("id"), str))
