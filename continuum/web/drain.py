"""Draining backends: ``POST /admin/backends/{name}/drain`` and ``/undrain``.

A drained backend takes no new requests (it is left out of the candidates, like an
unhealthy one); requests in flight on it finish normally, so an operator can drain, watch
``in_flight`` in ``/admin/backends`` (or ``continuum_backend_in_flight``) reach 0, and then
stop or upgrade the engine. ``continuum_backend_draining`` is 1 while it is drained.

Every gunicorn worker has its own pool, so the drained set is kept in a file in
``$CONTINUUM_RUNTIME_DIR`` (set by ``continuum.gunicorn_conf``): the worker that gets the
call writes it (under a lock), applies it, and spreads it with :mod:`continuum.web.fleet`,
so every other worker of the host applies it before its next request, and every router
sharing Redis records it in its own file (:meth:`DrainControl.follow`) before the reply.
Each worker also looks at the file every :data:`POLL_SECONDS`. Without a runtime directory
(one process) the set is the worker's own. The set survives a config reload (by backend
name) but not a restart of the router. Nothing here runs on the request path.
"""

from __future__ import annotations

import fcntl
import json
import logging
import os
from pathlib import Path
from typing import TYPE_CHECKING, Any

from continuum.errors import ContinuumError
from continuum.web.admin import AdminIndexResource, AdminResource
from continuum.web.reload import RUNTIME_DIR_ENV

if TYPE_CHECKING:
    import falcon

    from continuum.routing.backends import Backend
    from continuum.service import RouterService

log = logging.getLogger(__name__)

POLL_SECONDS = 0.5
_FILE = "drained-backends.json"


class BackendNotFoundError(ContinuumError, LookupError):
    """An admin action names a backend the config does not have (404)."""

    status = 404
    error_type = "not_found_error"
    code = "backend_not_found"


class BackendNotRoutableError(ContinuumError):
    """Draining a backend that takes no client traffic anyway (409)."""

    status = 409
    error_type = "invalid_request_error"
    code = "backend_not_routable"


class DrainControl:
    """The drained set of one worker, shared with the others through the runtime dir."""

    def __init__(self, service: RouterService, runtime_dir: str | None = None) -> None:
        self.service = service
        runtime_dir = runtime_dir if runtime_dir is not None else \
            os.environ.get(RUNTIME_DIR_ENV)
        self.path = Path(runtime_dir) / _FILE if runtime_dir else None
        self._local: set[str] = set()
        self._seen: tuple[int, int] | None = None
        self._greenlet: Any = None
        self.apply()

    def drained(self) -> set[str]:
        """The names drained now (the file's, or this worker's without a runtime dir)."""
        if self.path is None:
            return set(self._local)
        try:
            names = json.loads(self.path.read_text())
        except (OSError, ValueError):
            return set()
        return {n for n in names if isinstance(n, str)} if isinstance(names, list) else set()

    def set(self, name: str, draining: bool) -> Backend:
        """Drain (or undrain) backend ``name`` in every worker; the backend.

        Raises:
            BackendNotFoundError: no backend is called ``name``.
            BackendNotRoutableError: it is disabled or internal (takes no client traffic).
        """
        backend = self.service.pool.get(name)
        if backend is None:
            known = ", ".join(b.name for b in self.service.pool)
            raise BackendNotFoundError(f"no backend named '{name}' (configured: {known})")
        if not backend.config.enabled or backend.config.internal:
            why = "enabled: false" if not backend.config.enabled else "internal: true"
            raise BackendNotRoutableError(
                f"backend '{name}' takes no client requests ({why}); there is nothing "
                "to drain")
        self._record(name, draining)
        self.apply()
        log.warning("backend %s %s by the admin API (%d request(s) in flight in this "
                    "worker)", name, "drained" if draining else "undrained",
                    backend.in_flight)
        return backend

    def follow(self, name: str, draining: bool) -> None:
        """Apply a drain or undrain made elsewhere (:mod:`continuum.web.fleet`): by another
        worker of this host, whose file this worker re-reads, or by another router, which
        this router records in its own file when it routes to a backend of that name."""
        backend = self.service.pool.get(name)
        if backend is not None and backend.config.enabled and not backend.config.internal \
                and (name in self.drained()) != draining:
            self._record(name, draining)
            log.warning("backend %s %s by another router's admin API", name,
                        "drained" if draining else "undrained")
        self.apply()

    def _record(self, name: str, draining: bool) -> None:
        """Add ``name`` to the drained set, or take it out: the file's, or this worker's
        own without a runtime directory."""
        if self.path is None:
            (self._local.add if draining else self._local.discard)(name)
        else:
            self._write(name, draining)

    def _write(self, name: str, draining: bool) -> None:
        assert self.path is not None
        with open(self.path.with_suffix(".lock"), "a") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            names = self.drained()
            (names.add if draining else names.discard)(name)
            tmp = self.path.with_suffix(f".{os.getpid()}")
            tmp.write_text(json.dumps(sorted(names)))
            tmp.replace(self.path)

    def apply(self) -> None:
        """Mark the pool's backends from the drained set, and publish the gauge."""
        names = self.drained()
        metrics = self.service.metrics
        for backend in self.service.pool:
            backend.draining = backend.name in names
            metrics.child(metrics.draining, backend.name).set(1 if backend.draining else 0)

    def check(self) -> None:
        """Apply the set when the file changed."""
        sig = None
        if self.path is not None:
            try:
                st = self.path.stat()
                sig = (st.st_mtime_ns, st.st_size)
            except OSError:
                sig = None
        if sig != self._seen:
            self._seen = sig
            self.apply()

    def start(self, interval: float = POLL_SECONDS) -> None:
        """Follow the other workers' drains from a greenlet (call in the worker)."""
        if self.path is None or self._greenlet is not None:
            return
        import gevent

        def loop() -> None:
            while True:
                gevent.sleep(interval)
                try:
                    self.check()
                except Exception:  # the watcher must outlive one bad read
                    log.exception("drain watcher failed")

        self._greenlet = gevent.spawn(loop)

    def stop(self) -> None:
        if self._greenlet is not None:
            self._greenlet.kill(block=False)
            self._greenlet = None


class _DrainResource(AdminResource):
    """``POST /admin/backends/{name}/drain`` (or ``/undrain``)."""

    def __init__(self, service: RouterService, control: DrainControl, draining: bool) -> None:
        super().__init__(service)
        self.control = control
        self.draining = draining
        #: for ``GET /admin``
        self.description = (
            "stop sending new requests to the backend on every worker and router; requests "
            "in flight finish" if draining else "send requests to a drained backend again")

    def on_post(self, req: falcon.Request, resp: falcon.Response, name: str) -> None:
        backend = self.control.set(name, self.draining)
        doc: dict[str, Any] = {"success": True, "backend": name,
                               "draining": backend.draining, "state": backend.state,
                               "in_flight": backend.in_flight}
        # every worker of the host (before its next request) and every router sharing
        # Redis: once this answers, none sends a new request to a drained backend
        self._spread(doc, "drain", {"backend": name, "draining": self.draining})
        self._send(resp, doc)


def add_routes(app: falcon.App[Any, Any], service: RouterService,
               index: AdminIndexResource) -> DrainControl:
    """Mount drain and undrain on ``app`` (behind :class:`~continuum.web.admin.AdminGate`),
    listed by ``index`` (``GET /admin``)."""
    control = DrainControl(service)
    index.mount(app, "/admin/backends/{name}/drain", _DrainResource(service, control, True))
    index.mount(app, "/admin/backends/{name}/undrain", _DrainResource(service, control, False))
    return control
