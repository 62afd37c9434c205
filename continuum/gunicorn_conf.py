"""gunicorn settings for the router (``conf/gunicorn.conf.py`` re-exports this module).

Reads ``$CONTINUUM_CONFIG`` for ``server.bind``, ``server.workers`` and
``server.worker_connections``; command-line flags given to gunicorn still win. Selects the
router's gevent worker (:mod:`continuum.gunicorn_worker`: header timeouts). Sets up
prometheus-client multiprocess mode so ``/metrics`` is right with several workers. Gives
each instance its own gunicorn control socket (``gunicornc``), in its runtime directory.
"""

from __future__ import annotations

import os
import shutil
import socket
import tempfile
from typing import Any

from continuum.config import CONFIG_ENV, check_config_file, load_config
from continuum.errors import ConfigError

# Not imported from continuum.metrics: importing prometheus_client here, before the
# variable is set, would fix its value class to single-process mode for every worker.
MULTIPROC_ENV = "PROMETHEUS_MULTIPROC_DIR"

worker_class = "continuum.gunicorn_worker.GeventWorker"  # gevent, with header timeouts
# Gunicorn's own defaults, spelled out so operators see them here.
keepalive = 75
graceful_timeout = 30
timeout = 0  # gevent workers heartbeat from the hub; long streams must not be killed
accesslog = None
errorlog = "-"

if os.environ.get(CONFIG_ENV):
    _server = load_config().server
    bind = [_server.bind]
    workers = _server.workers
    worker_connections = _server.worker_connections
    loglevel = _server.log_level

# Must be decided before any worker imports prometheus_client: this file runs in the master
# before the app is loaded. The directory is ours to wipe only when we created it.
_OWN_DIRS: list[str] = []
if not os.environ.get(MULTIPROC_ENV):
    _OWN_DIRS.append(tempfile.mkdtemp(prefix="continuum-metrics-"))
    os.environ[MULTIPROC_ENV] = _OWN_DIRS[-1]
# Where workers tell each other to reload (see continuum.web.reload).
RUNTIME_DIR_ENV = "CONTINUUM_RUNTIME_DIR"
if not os.environ.get(RUNTIME_DIR_ENV):
    _OWN_DIRS.append(tempfile.mkdtemp(prefix="continuum-runtime-"))
    os.environ[RUNTIME_DIR_ENV] = _OWN_DIRS[-1]
# gunicorn (25.1+) opens a control socket for ``gunicornc`` at one path per user by default,
# so a second instance on the host would take it over and the first to stop would delete
# it. Each instance's lives in its own runtime directory instead (``--control-socket PATH``
# still wins; ``--no-control-socket`` turns it off).
control_socket = os.path.join(os.environ[RUNTIME_DIR_ENV], "gunicorn.ctl")


def on_starting(server: Any) -> None:
    """``gunicorn -k gevent`` (how operators run gevent apps) replaces the worker class this
    file sets with gunicorn's plain gevent worker, which has no header deadline; the
    router's is that same worker plus the deadline, so it is put back. Any other class is
    kept, with a warning that slow clients can then hold every connection."""
    from gunicorn.workers.ggevent import GeventWorker as PlainGeventWorker

    from continuum.gunicorn_worker import WORKER_CLASS, GeventWorker

    # The host segment the workers share (in-flight counts, fleet actions): made once here
    # so every worker maps the same file (continuum.hostshm).
    from continuum.hostshm import create

    try:
        create(os.environ[RUNTIME_DIR_ENV], fresh=True)
    except OSError as exc:
        server.log.warning("host segment not created in $%s: %s", RUNTIME_DIR_ENV, exc)

    _guard_reload(server)
    used = server.worker_class
    if used is PlainGeventWorker:
        server.cfg.set("worker_class", WORKER_CLASS)
        server.worker_class = server.cfg.worker_class
        server.log.info("-k gevent: using %s (gevent, with client_header_timeout_seconds)",
                        WORKER_CLASS)
    elif not issubclass(used, GeventWorker):
        server.log.warning("worker class %s.%s has no client_header_timeout_seconds: slow "
                           "clients can hold every connection; use %s or -k gevent",
                           used.__module__, used.__qualname__, WORKER_CLASS)


def _guard_reload(server: Any) -> None:
    """A ``HUP`` (``systemctl reload``, ``gunicornc reload``) is refused while the config
    file has errors: gunicorn would re-read this module (which raises on them) and start
    new workers that fail to boot, and a worker that fails to boot makes the master shut
    the whole router down. The running workers keep serving, and the error says what to
    fix."""
    reload = server.handle_hup

    def handle_hup() -> None:
        path = os.environ.get(CONFIG_ENV)
        if path:
            from continuum.registry import NameRegistry

            result = check_config_file(path, NameRegistry())  # imports no plugin
            if result.config is None:
                server.log.error(
                    "HUP refused: %s has errors; the workers keep running with the config "
                    "they have (fix it, then send HUP again):\n%s", path,
                    ConfigError(result.errors, result.source).message)
                return
        reload()

    server.handle_hup = handle_hup


def when_ready(server: Any) -> None:
    """Disable Nagle on the listening sockets; accepted sockets inherit it on Linux, so the
    first streamed chunk is never held back waiting for an ACK. Start the event-bus process
    when ``dynamo.event_bus.enabled`` (before the first worker: one per host, see
    :mod:`continuum.kv.bus_process`)."""
    for listener in server.LISTENERS:
        sock = getattr(listener, "sock", None)
        if sock is not None and sock.family in (socket.AF_INET, socket.AF_INET6):
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    _start_event_bus(server)


_BUS: list[Any] = []


def _start_event_bus(server: Any) -> None:
    path = os.environ.get(CONFIG_ENV)
    if not path or not load_config(path).dynamo.event_bus.enabled:
        return
    from continuum.kv.bus_process import BusSupervisor

    supervisor = BusSupervisor(path, os.environ[RUNTIME_DIR_ENV])
    supervisor.start()
    _BUS.append(supervisor)
    server.log.info("event bus process started (dynamo.event_bus.enabled)")


def child_exit(server: Any, worker: Any) -> None:
    """Let prometheus-client drop the live gauges of a dead worker."""
    from prometheus_client import multiprocess

    multiprocess.mark_process_dead(worker.pid)  # type: ignore[no-untyped-call]


def on_exit(server: Any) -> None:
    """Stop the event bus; remove the directories this config created."""
    for supervisor in _BUS:
        supervisor.stop()
    for path in _OWN_DIRS:
        shutil.rmtree(path, ignore_errors=True)
