"""Hot reload: re-read the config file on request or when it changes, in every worker.

Each gunicorn worker has its own state, so each reloads itself. ``POST
/admin/config/reload`` reloads the worker that receives it at once and bumps a generation
file in ``$CONTINUUM_RUNTIME_DIR`` (set by ``continuum.gunicorn_conf``); every worker's
watcher notices the new generation, or a changed file, within
``server.watch_interval_seconds`` and reloads too. A config with errors is refused and the
running one stays; so is one without backends while the router runs some (an emptied or
half-written file).

A worker froze its startup objects out of the garbage collector's sight
(:func:`continuum.gunicorn_worker.settle_garbage_collector`); a reload replaces some of them
(the backends, strategy and stores of the old config), so it collects what the old config
left in reference cycles and freezes the rest again.
"""

from __future__ import annotations

import gc
import logging
import os
import threading
from pathlib import Path
from typing import TYPE_CHECKING, Any

from continuum.config import check_config_file
from continuum.errors import ConfigError, ConfigIssue
from continuum.hostshm import GENERATION_FILE, runtime_dir, write_private
from continuum.hostshm import RUNTIME_DIR_ENV as RUNTIME_DIR_ENV  # (drain, tests)

if TYPE_CHECKING:
    from continuum.config import CheckResult
    from continuum.registry import PluginRegistry
    from continuum.service import ReloadReport, RouterService

log = logging.getLogger(__name__)

#: A copy of the last config file a worker of this router loaded (at boot or reload), in
#: ``$CONTINUUM_RUNTIME_DIR``: what a worker boots with while the file has errors.
LAST_GOOD_FILE = "config.last-good.yaml"


def _collect_frozen() -> None:
    """What a reload left in reference cycles among frozen objects is collected, and what
    is alive is frozen again (nothing to do where nothing was frozen)."""
    if gc.get_freeze_count():
        gc.unfreeze()
        gc.collect()
        gc.freeze()


def _signature(path: Path) -> tuple[int, int] | None:
    try:
        st = path.stat()
    except OSError:
        return None
    return st.st_mtime_ns, st.st_size


def _generation_file() -> Path | None:
    runtime = runtime_dir()
    return runtime / GENERATION_FILE if runtime else None


def _read_generation(generation_file: Path | None) -> str | None:
    if generation_file is None:
        return None
    try:
        return generation_file.read_text()
    except OSError:
        return None


Seen = tuple[tuple[int, int] | None, str | None]


def last_good_path() -> Path | None:
    """Where this router keeps its last good config (None outside gunicorn)."""
    runtime = runtime_dir()
    return runtime / LAST_GOOD_FILE if runtime else None


def _read_bytes(path: Path) -> bytes | None:
    try:
        return path.read_bytes()
    except OSError:
        return None


def read_checked(path: str | os.PathLike[str], registry: PluginRegistry | None
                 ) -> tuple[CheckResult, bytes | None]:
    """:func:`~continuum.config.check_config_file`, and the file's bytes when it has no
    errors and did not change while it was read (for :func:`remember_good`)."""
    path = Path(path)
    before = _read_bytes(path)
    result = check_config_file(path, registry)
    if result.config is None or before is None or _read_bytes(path) != before:
        return result, None
    return result, before


def remember_good(raw: bytes | None) -> None:
    """Keep ``raw``, a config this router loaded, as :func:`last_good_path` (mode 0600: it
    may hold secrets, as the file does)."""
    target = last_good_path()
    if raw is None or target is None:
        return
    try:
        write_private(target, raw)
    except OSError as exc:  # the copy is a safety net, not a reason to refuse the config
        log.warning("could not keep a copy of the config in %s: %s", target, exc)


def boot_config(path: str | os.PathLike[str], registry: PluginRegistry | None
                ) -> tuple[CheckResult, str | None]:
    """The config a worker starts with: the file's; while the file has errors, the last
    good copy of this router's (:data:`LAST_GOOD_FILE`), with the error to log (the
    second item; None when the file was good). Without a good copy the file's errors are
    raised: a router that never loaded a config does not start.

    Without it a worker that gunicorn starts in place of one that died, or after a ``HUP``,
    fails to boot while the file has an error that the running workers' watchers refused,
    and gunicorn's master then shuts the whole router down.

    Raises:
        ConfigError: the file has errors and there is no good copy.
    """
    result, raw = read_checked(path, registry)
    if result.config is not None:
        remember_good(raw)
        return result, None
    good = last_good_path()
    fallback = check_config_file(good, registry) if good is not None and good.exists() \
        else None
    error = ConfigError(result.errors, result.source)
    if fallback is None or fallback.config is None:
        raise error
    return fallback, (f"config file {path} has errors; this worker starts with the last "
                      f"config this router loaded ({good}) until the file is fixed:\n"
                      f"{error.message}")


def config_state(path: str | os.PathLike[str]) -> Seen:
    """What the watcher compares: the file's signature and the shared reload generation.
    Take it *before* reading the config a worker starts with: a change made while the
    worker boots is then still a change to its watcher."""
    return _signature(Path(path)), _read_generation(_generation_file())


class ConfigReloader:
    """Reloads ``path`` into ``service``; optionally watches it from a greenlet.

    ``seen``: the :func:`config_state` from before the running config was read (default:
    now, which misses a change made between that read and this call).
    """

    def __init__(self, service: RouterService, path: str | os.PathLike[str],
                 seen: Seen | None = None) -> None:
        self.service = service
        self.path = Path(path)
        self.generation_file = _generation_file()
        self._seen = seen if seen is not None else config_state(self.path)
        self._greenlet: Any = None
        # made in the worker, after gevent's patching: a lock greenlets wait on
        self._lock = threading.Lock()
        self.reloads = 0

    def _generation(self) -> str | None:
        return _read_generation(self.generation_file)

    def reload(self, *, broadcast: bool = False) -> ReloadReport:
        """Read the file and apply it, after any reload already under way in this worker.

        Three callers may ask at once: ``POST /admin/config/reload``, the watcher and a
        fleet action another worker sent. A reload waits (the KV consumers' restart joins
        their greenlets), and two applied together would each stop the same consumers
        and each start their own, one set of them running on unseen.

        Raises:
            ConfigError: the file has errors; nothing was changed.
        """
        with self._lock:
            return self._reload(broadcast)

    def _reload(self, broadcast: bool) -> ReloadReport:
        signature = _signature(self.path)  # before the read: a later change is still one
        result, raw = read_checked(self.path, self.service.registry)
        if result.config is None:
            raise ConfigError(result.errors, str(self.path))
        running = [b.name for b in self.service.config.backends]
        if running and not result.config.backends:
            # an emptied or half-written file would otherwise take every backend (and the
            # admin token with it) away from a serving router
            raise ConfigError([ConfigIssue(
                "backends", f"the file has no backends, and the router runs {len(running)} "
                f"({', '.join(running)}); a reload never removes every backend (an empty or "
                "half-written file?): the running config stays; restart the router to run "
                "without backends")], str(self.path))
        for warning in result.warnings:
            log.warning("config: %s", warning.render(result.source))
        report = self.service.reload(result.config)
        _collect_frozen()
        remember_good(raw)
        self.reloads += 1
        if broadcast and self.generation_file is not None:
            tmp = self.generation_file.with_suffix(f".{os.getpid()}")
            tmp.write_text(f"{os.getpid()}:{self.reloads}:{_signature(self.path)}")
            tmp.replace(self.generation_file)
        self._seen = (signature, self._generation())
        log.info("config reloaded: applied %s; restart required for %s",
                 report.applied or "nothing", report.restart_required or "nothing")
        return report

    def check(self) -> ReloadReport | None:
        """Reload if the file or the shared generation changed since the last look."""
        if (_signature(self.path), self._generation()) == self._seen:
            return None
        with self._lock:  # a reload under way ends first, and may have read this change
            current = (_signature(self.path), self._generation())
            if current == self._seen:
                return None
            self._seen = current
            try:
                return self._reload(broadcast=False)
            except ConfigError as exc:
                log.error("config change ignored, the running config stays:\n%s", exc)
                return None

    def start(self, interval: float) -> None:
        """Watch from a greenlet (call in the worker process)."""
        import gevent

        def loop() -> None:
            while True:
                gevent.sleep(interval)
                try:
                    self.check()
                except Exception:  # the watcher must outlive any one bad reload
                    log.exception("config watcher failed")

        if self._greenlet is None:
            self._greenlet = gevent.spawn(loop)

    def stop(self) -> None:
        if self._greenlet is not None:
            self._greenlet.kill(block=False)
            self._greenlet = None
