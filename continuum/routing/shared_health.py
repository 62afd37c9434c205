"""Health probes shared by the workers of one host: one worker probes, every worker judges.

Without this every gunicorn worker probes every backend: a host of 8 workers sends each
backend 8 probes per interval (16 when the backend has no configured models and each probe
also lists them), and pays 8 workers' CPU for it. With ``fleet.share_health_checks`` (on
by default; it needs the host's runtime directory, as every ``fleet`` mechanism does) one
worker per host, the holder of an ``flock`` on ``health.lock``, probes. After each round
it writes what it saw to ``health.json`` (a temporary file renamed over the old one, so a
reader never sees half of it):

.. code-block:: json

    {"holder": "4711-1733340000.123",
     "backends": {"a": {"url": "http://10.0.0.5:8000", "seq": 17, "at": 81234.5,
                        "results": [true, true, false], "models": ["m"],
                        "slots": 8}}}

``seq`` counts the holder's probes of the backend, ``results`` are the last
:data:`HISTORY` of them (newest last), ``at`` is when the last one ended
(``time.monotonic()``, one clock for every process of the host), ``models`` what the probes
discovered (empty when the backend's models are configured), ``slots`` what they learned
from its metrics (``backends[].learn_slots``; null when off or not yet learned). The other workers
(followers) look at the file every :data:`FOLLOW_SECONDS` (a ``stat``; a read only when it
changed) and feed each result they have not seen yet into their own
:class:`~continuum.routing.health.HealthTracker`, as if they had probed themselves. So
every worker still counts its own streaks: the thresholds, the passive failures of its own
requests and its transition metrics behave as before, on the same probe results.

A follower probes a backend itself, on its own interval, while the file has no fresh entry
for it (none, another URL, or the last result older than two intervals and a timeout): a
backend only its config has yet (a reload reaches the workers one at a time), or a holder
that hangs. A holder that dies drops its lock with its process; the next follower to try
(every :data:`FOLLOW_SECONDS`) probes from then on, and the others take its results from
its first round (a new ``holder`` restarts the count).

Standard library only (the lock is :func:`continuum.hostshm.try_lock`'s ``flock``).
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import time
from collections import deque
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from continuum.hostshm import try_lock

if TYPE_CHECKING:
    from continuum.routing.backends import Backend

log = logging.getLogger(__name__)

LOCK_FILE = "health.lock"
STATE_FILE = "health.json"
#: Results kept per backend: a follower that missed this many rounds takes the latest ones.
HISTORY = 16
#: How often a follower looks at the file (and tries for the holder's lock), at most.
FOLLOW_SECONDS = 0.25


@dataclass(frozen=True, slots=True)
class ProbeEntry:
    """One backend's line in ``health.json``."""

    url: str
    seq: int
    at: float
    results: tuple[bool, ...]
    models: frozenset[str]
    slots: int | None = None


class _Record:
    __slots__ = ("at", "models", "results", "seq", "slots", "url")

    def __init__(self, url: str) -> None:
        self.url = url
        self.seq = 0
        self.at = 0.0
        self.results: deque[bool] = deque(maxlen=HISTORY)
        self.models: frozenset[str] = frozenset()
        self.slots: int | None = None


class SharedProbes:
    """This worker's side of the host's shared probes in ``directory`` (module docstring)."""

    def __init__(self, directory: str | os.PathLike[str]) -> None:
        self.directory = Path(directory)
        self.path = self.directory / STATE_FILE
        self._lock_fd: int | None = None
        self._unusable = False
        self._token = ""
        self._records: dict[str, _Record] = {}
        self._seen_stat: tuple[int, int, int] | None = None
        self._holder = ""
        self._entries: dict[str, ProbeEntry] = {}

    @property
    def holder(self) -> bool:
        """Whether this worker is the host's prober."""
        return self._lock_fd is not None

    @property
    def probing(self) -> bool:
        """Whether this worker probes: the prober, or on its own when the runtime directory
        is unusable."""
        return self._lock_fd is not None or self._unusable

    def hold(self) -> bool:
        """Whether this worker is the prober, taking the role if nobody has it."""
        if self._lock_fd is not None or self._unusable:
            return True
        try:
            fd = try_lock(self.directory / LOCK_FILE)
        except OSError as exc:
            log.warning("health checks: %s unusable (%s): this worker probes itself",
                        self.directory, exc)
            self._unusable = True
            return True
        if fd is None:
            return False
        self._lock_fd = fd
        self._records.clear()
        self._token = f"{os.getpid()}-{time.time():.6f}"
        log.info("health checks: this worker (pid %d) probes the backends for the host",
                 os.getpid())
        return True

    def release(self) -> None:
        """Give the role up (worker exit); a follower takes it at its next look."""
        if self._lock_fd is not None:
            os.close(self._lock_fd)
            self._lock_fd = None

    # --- the holder ----------------------------------------------------------------------

    def record(self, backend: Backend, ok: bool) -> None:
        """One probe result of ``backend`` (the holder's, not a passive one)."""
        rec = self._records.get(backend.name)
        if rec is None or rec.url != backend.url:
            rec = self._records[backend.name] = _Record(backend.url)
        rec.seq += 1
        rec.at = time.monotonic()
        rec.results.append(ok)
        rec.models = backend.discovered_models
        rec.slots = backend.slots if backend.config.learn_slots else None

    def publish(self, names: set[str]) -> None:
        """Write the records of ``names`` to ``health.json``, atomically."""
        doc = {"holder": self._token, "backends": {
            name: {"url": r.url, "seq": r.seq, "at": r.at, "results": list(r.results),
                   "models": sorted(r.models), "slots": r.slots}
            for name, r in self._records.items() if name in names}}
        tmp = self.path.with_suffix(f".{os.getpid()}.tmp")
        try:
            tmp.write_text(json.dumps(doc, separators=(",", ":")))
            tmp.replace(self.path)
        except OSError as exc:
            log.warning("health checks: cannot write %s: %s", self.path, exc)
            with contextlib.suppress(OSError):
                tmp.unlink()

    # --- a follower ----------------------------------------------------------------------

    def entries(self) -> tuple[str, dict[str, ProbeEntry]]:
        """The holder's token and its entries as last written (re-read only when the file
        changed); empty when there is no file or it cannot be read."""
        try:
            st = os.stat(self.path)
        except OSError:
            self._seen_stat, self._holder, self._entries = None, "", {}
            return self._holder, self._entries
        stamp = (st.st_mtime_ns, st.st_size, st.st_ino)
        if stamp != self._seen_stat:
            try:
                doc = json.loads(self.path.read_bytes())
                self._holder, self._entries = str(doc["holder"]), _parse(doc["backends"])
            except (OSError, ValueError, KeyError, TypeError) as exc:
                log.warning("health checks: unreadable %s (%s): probing myself", self.path, exc)
                self._holder, self._entries = "", {}
            self._seen_stat = stamp
        return self._holder, self._entries


def _parse(raw: Any) -> dict[str, ProbeEntry]:
    out = {}
    for name, e in raw.items():
        out[str(name)] = ProbeEntry(
            str(e["url"]), int(e["seq"]), float(e["at"]), tuple(bool(r) for r in e["results"]),
            frozenset(str(m) for m in e["models"]),
            None if e.get("slots") is None else int(e["slots"]))
    return out


__all__ = ["FOLLOW_SECONDS", "HISTORY", "ProbeEntry", "SharedProbes"]
