"""The event-bus process: one per router host, started and supervised by the gunicorn master.

Why a process of its own: push mode must keep **one TLS session per listener per router
host**, yet every gunicorn worker keeps its own index and consumers. So the bus port
(``dynamo.event_bus.listen``) is bound by this one process, never by the workers; each
worker's consumer of a ``transport: event_bus`` source reads the bus over loopback with the
ordinary SSE consumer (:mod:`continuum.kv.bus_consumer`), and the bus relays one pushed
stream per consumer over the listener's single connection. Every worker therefore sees every
event, from one session.

* ``when_ready`` (in the master, before the first fork) calls :meth:`BusSupervisor.start`
  when ``dynamo.event_bus.enabled``; a thread restarts the process if it dies (after one
  second); ``on_exit`` stops it with SIGTERM.
* The process writes ``bus-local.json`` (loopback URL and token, mode 0600) into the
  runtime directory (``$CONTINUUM_RUNTIME_DIR``); workers read it at every connect, so a
  restarted bus on a new port is found again.
* It exits when its parent (the master) is gone, even after a SIGKILL of the master.
* Hot reload: it watches the config file and the workers' reload generation file like a
  worker does, and applies ``dynamo.event_bus.brokers`` (ending the sessions they no
  longer allow with ``forbidden``); ``listen`` and ``tls`` need a restart.

Run by hand: ``python -m continuum.kv.bus_process --config config.yaml --runtime-dir DIR``.
This module imports nothing network-related at import time (the master imports it).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from continuum.hostshm import GENERATION_FILE, RUNTIME_DIR_ENV, write_private

log = logging.getLogger(__name__)

BUS_FILE = "bus-local.json"
RESTART_DELAY = 1.0


def bus_file(runtime_dir: str | os.PathLike[str]) -> Path:
    """Where the bus process publishes its loopback address."""
    return Path(runtime_dir) / BUS_FILE


def read_bus_file(runtime_dir: str | None) -> tuple[str, str] | None:
    """``(loopback url, token)`` of the running bus; None when there is none (yet)."""
    if not runtime_dir:
        return None
    try:
        doc = json.loads(bus_file(runtime_dir).read_text())
        return str(doc["url"]), str(doc["token"])
    except (OSError, ValueError, KeyError, TypeError):
        return None


def _write_bus_file(runtime_dir: str, url: str, token: str, tls: tuple[str, int]) -> Path:
    path = bus_file(runtime_dir)
    write_private(path, json.dumps({"url": url, "token": token, "pid": os.getpid(),
                                    "tls": f"{tls[0]}:{tls[1]}"}).encode())
    return path


def _signature(path: Path) -> Any:
    try:
        st = path.stat()
    except OSError:
        return None
    return st.st_mtime_ns, st.st_size, path.read_bytes() if path.name == GENERATION_FILE else b""


def main(argv: Sequence[str] | None = None) -> int:
    """Serve the event bus until SIGTERM/SIGINT; returns the exit status."""
    from gevent import monkey

    monkey.patch_all()

    import gevent
    from gevent.event import Event
    from prometheus_client import CollectorRegistry

    from continuum.config import check_config_file
    from continuum.kv.bus_server import EventBus

    parser = argparse.ArgumentParser(prog="continuum-event-bus")
    parser.add_argument("--config", default=os.environ.get("CONTINUUM_CONFIG"))
    parser.add_argument("--runtime-dir", default=os.environ.get(RUNTIME_DIR_ENV))
    args = parser.parse_args(argv)
    logging.basicConfig(format="%(asctime)s %(levelname)s event-bus: %(message)s",
                        level=logging.INFO)
    if not args.config or not args.runtime_dir:
        print("error: --config and --runtime-dir are required", file=sys.stderr)
        return 2
    config_path = Path(args.config)
    result = check_config_file(config_path)
    if result.config is None:
        for issue in result.errors:
            print("error: " + issue.render(str(config_path)), file=sys.stderr)
        return 1
    config = result.config
    bus = EventBus(config.dynamo.event_bus, CollectorRegistry())
    try:
        bus.start()
    except OSError as exc:
        print(f"error: event bus cannot listen on {config.dynamo.event_bus.listen}: {exc}",
              file=sys.stderr)
        return 1
    published = _write_bus_file(args.runtime_dir, bus.local_url, bus.local_token,
                                bus.tls_address)
    stop = Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        gevent.signal_handler(sig, stop.set)
    watched = [config_path, Path(args.runtime_dir) / GENERATION_FILE]
    seen = [_signature(p) for p in watched]
    interval = config.server.watch_interval_seconds
    parent = os.getppid()
    while not stop.wait(interval):
        if os.getppid() != parent:  # the gunicorn master is gone (even by SIGKILL)
            log.warning("parent process %d gone: stopping", parent)
            break
        now = [_signature(p) for p in watched]
        if now == seen:
            continue
        seen = now
        reloaded = check_config_file(config_path)
        if reloaded.config is None:
            log.error("config change ignored (errors), the running brokers stay")
            continue
        new = reloaded.config.dynamo.event_bus
        if (new.listen, new.tls) != (config.dynamo.event_bus.listen, config.dynamo.event_bus.tls):
            log.warning("dynamo.event_bus.listen/tls changed: restart the router to apply")
        ended = bus.update_brokers(new)
        log.info("config reloaded: brokers applied (%d session(s) ended with forbidden)",
                 ended)
        config = reloaded.config
    log.info("stopping")
    bus.stop()
    try:
        if json.loads(published.read_text()).get("pid") == os.getpid():
            published.unlink()
    except (OSError, ValueError):
        pass
    return 0


class BusSupervisor:
    """Runs the bus process from the gunicorn master and restarts it when it dies.

    Args:
        config_path: The router's config file.
        runtime_dir: ``$CONTINUUM_RUNTIME_DIR`` (where ``bus-local.json`` goes).
    """

    def __init__(self, config_path: str, runtime_dir: str) -> None:
        self.argv = [sys.executable, "-m", "continuum.kv.bus_process", "--config",
                     config_path, "--runtime-dir", runtime_dir]
        self.proc: subprocess.Popen[bytes] | None = None
        self.restarts = 0
        self._stopping = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        """Start the process and its watching thread."""
        self._thread = threading.Thread(target=self._run, name="event-bus-supervisor",
                                        daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stopping.is_set():
            self.proc = subprocess.Popen(self.argv)
            code = self.proc.wait()
            if self._stopping.is_set():
                return
            self.restarts += 1
            log.error("event bus process exited with %s; restarting in %.0f s", code,
                      RESTART_DELAY)
            self._stopping.wait(RESTART_DELAY)

    def stop(self, timeout: float = 10.0) -> None:
        """SIGTERM the process (SIGKILL after ``timeout``) and end the thread."""
        self._stopping.set()
        proc = self.proc
        if proc is not None and proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(timeout)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(timeout)
        if self._thread is not None:
            self._thread.join(timeout)


def wait_for_bus(runtime_dir: str, timeout: float) -> tuple[str, str] | None:
    """Poll for ``bus-local.json`` (tests and tools)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        found = read_bus_file(runtime_dir)
        if found is not None:
            return found
        time.sleep(0.05)
    return None


if __name__ == "__main__":
    raise SystemExit(main())
