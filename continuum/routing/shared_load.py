"""In-flight counts shared by the gunicorn workers of one router host.

Each worker is a process with its own :class:`~continuum.routing.backends.BackendPool`, so
on its own it sees about 1/N of the real load on a backend: CHWBL's bound, LeastLatency's
ties and the KV load guard would all let N times too much through. With a host segment
(:mod:`continuum.hostshm`) every worker publishes its own count per backend in its row of
an mmap'd table and reads a backend's load as the sum of the column, so each of them
decides on the host's load.

Cost: a worker's update is one 8-byte store into its own row (no lock, no syscall); a read
is one strided slice-and-sum over the rows in use (a few hundred nanoseconds for a few
workers; ``tools/bench/micro.py`` measures it, see docs/scale-out.md). A worker that dies
leaves its row behind until :class:`HostLoad`'s sweep (every ``SWEEP_SECONDS``) or the next
claimer of its slot wipes it.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from continuum.hostshm import HostSegment
    from continuum.routing.backends import BackendPool

log = logging.getLogger(__name__)

SWEEP_SECONDS = 1.0


class HostLoad:
    """Publishes ``pool``'s in-flight counts in ``segment`` and sweeps dead workers' rows."""

    def __init__(self, pool: BackendPool, segment: HostSegment) -> None:
        self.pool = pool
        self.segment = segment
        for backend in pool:
            backend.share_load(segment)
        self._greenlet: Any = None

    def start(self) -> None:
        """Start the sweep greenlet (in the worker)."""
        if self._greenlet is not None:
            return
        import gevent

        def loop() -> None:
            while True:
                gevent.sleep(SWEEP_SECONDS)
                try:
                    wiped = self.segment.sweep()
                    if wiped:
                        log.info("host load: wiped the rows of %d dead worker(s)", wiped)
                except Exception:  # the sweep must outlive one bad pass
                    log.exception("host load sweep failed")

        self._greenlet = gevent.spawn(loop)

    def stop(self) -> None:
        """Stop sweeping and stop sharing (the counts become private again)."""
        if self._greenlet is not None:
            self._greenlet.kill(block=False)
            self._greenlet = None
        for backend in self.pool:
            backend.share_load(None)

    def distribution(self) -> dict[str, int]:
        """The host's in-flight count per backend."""
        return {b.name: b.in_flight for b in self.pool}


__all__ = ["SWEEP_SECONDS", "HostLoad"]
