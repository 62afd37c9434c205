"""Spread a host's client connections evenly over its gunicorn workers.

The workers of one router accept from one listening socket. A new connection wakes every
worker waiting on it, and the first to run takes it; when a client opens its connection
pool in a burst (a load balancer, an SDK with a pool, a benchmark), some workers take
several times as many as others. Kept-alive connections stay with the worker that accepted
them, so the busiest worker's requests queue on its core while others have little to do:
32 connections opened at once reached a 4-worker router 12/7/9/4, 15/11/4/2 and 16/15/1/0
in three bursts.

Each worker publishes how many client connections it holds open in its slot of the host
segment (:attr:`~continuum.hostshm.HostSegment.connections`). Before accepting, a worker
that holds more than ``slack`` connections above the fewest any other worker holds stops
accepting for ``pause`` seconds: the other workers, woken by the same connection, take it.
When the pause ends it accepts the next connection whatever the counts say, so a
connection waits at most ``pause`` longer even when the less loaded workers are stuck.
This is nginx's reasoning for ``ngx_accept_disabled`` (a worker short of free connections
skips accepting), with the host's counts instead of one worker's own.

A worker that stops accepting for good (its server closed: shutdown, ``max_requests``,
reload) publishes :data:`~continuum.hostshm.NOT_ACCEPTING` so that no other worker waits
for it.

``server.balance_connections`` turns it off; with one worker it does nothing.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from gevent.server import StreamServer

from continuum.hostshm import NOT_ACCEPTING

if TYPE_CHECKING:
    from continuum.hostshm import HostSegment

#: Connections a worker may hold above the least loaded other worker and still accept.
SLACK = 1
#: Seconds a worker over its share stops accepting before it takes the next connection.
PAUSE_SECONDS = 0.002


class AcceptGate:
    """One worker's open-connection count and the decision whether to accept now.

    Args:
        segment: the host segment holding every worker's count.
        slack: connections above the least loaded other worker that still accept.
    """

    __slots__ = ("_forced", "deferred", "open", "retired", "segment", "slack")

    def __init__(self, segment: HostSegment, slack: int = SLACK) -> None:
        self.segment = segment
        self.slack = slack
        #: Client connections this worker holds open.
        self.open = 0
        #: Times this worker left a connection to the others (for tests and stats).
        self.deferred = 0
        #: The server closed: the segment says :data:`NOT_ACCEPTING` from then on.
        self.retired = False
        self._forced = False
        self._publish()

    def _publish(self) -> None:
        self.segment.connections = NOT_ACCEPTING if self.retired else self.open

    def opened(self) -> None:
        """A connection was accepted."""
        self.open += 1
        self._publish()

    def closed(self) -> None:
        """A connection ended."""
        self.open -= 1
        self._publish()

    def may_accept(self) -> bool:
        """Whether to accept now: this worker is within ``slack`` of the least loaded
        other worker, or the last pause has just ended (see the module docstring)."""
        if self._forced:
            self._forced = False
            return True
        fewest = self.segment.fewest_connections_elsewhere()
        if fewest is None or self.open <= fewest + self.slack:
            return True
        self.deferred += 1
        return False

    def force_next(self) -> None:
        """Accept the next connection unconditionally (a pause ended)."""
        self._forced = True

    def retire(self) -> None:
        """This worker accepts no more connections: the others must not wait for it, also
        while its last connections end."""
        self.retired = True
        self._publish()


class BalancedStreamServer(StreamServer):  # type: ignore[misc]
    """gevent's ``StreamServer`` asking an :class:`AcceptGate` before each accept.

    Args:
        gate: the worker's gate.
        pause: seconds to stop accepting when the gate says no.
        *args, **kwargs: ``StreamServer``'s.
    """

    def __init__(self, *args: Any, gate: AcceptGate, pause: float = PAUSE_SECONDS,
                 **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.gate = gate
        self.pause = pause
        self._pause_timer: Any = None

    def do_read(self) -> Any:
        """Accept one connection, unless the gate sends it to another worker: then stop
        watching the socket (it stays readable, and watching it would spin) until the
        pause ends."""
        if not self.gate.may_accept():
            self.stop_accepting()
            timer = self._pause_timer
            if timer is None:  # repeating, for again(): see continuum.wire.waits
                timer = self._pause_timer = self.loop.timer(self.pause, self.pause)
            timer.again(self._resume, update=True)
            return None
        return super().do_read()

    def _resume(self) -> None:
        self._pause_timer.stop()
        self.gate.force_next()
        self._start_accepting_if_started()

    def close(self) -> None:
        """Stop accepting for good (and say so to the other workers)."""
        self.gate.retire()
        timer = self._pause_timer
        if timer is not None:
            timer.stop()
            timer.close()
            self._pause_timer = None
        super().close()


__all__ = ["PAUSE_SECONDS", "SLACK", "AcceptGate", "BalancedStreamServer"]
