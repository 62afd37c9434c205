"""Waiting on a gevent socket's own read watcher under a reused timer.

``gevent.socket.wait_read`` makes a new watcher and a new timer for every wait; on a hot
path (a kept-alive connection's next request, each record of a stream) the socket's own
``_read_event`` and one timer per connection, remade only when its length changes (a
gevent ``Timeout`` keeps the seconds it was made with), do the same without allocating.

A libev timer that is stopped keeps only what was left of it (``ev_timer_stop`` makes its
time relative to the moment of the stop), so ``start`` after ``stop`` runs for the rest,
not for the whole length: the waits of one connection would add up until one timed out
early (a kept-alive client's header after a few requests, an upstream stream whose gaps
together passed the read timeout). The timers made here repeat at their length, and
:func:`arm` restarts them with ``again`` (``ev_timer_again``), which runs them for the
whole length from now; a timer that runs out stops itself before it raises, so it
never repeats.
"""

from __future__ import annotations

from typing import Any

import gevent
from gevent import get_hub, getcurrent


def timer_for(timer: gevent.Timeout | None, seconds: float) -> gevent.Timeout:
    """``timer`` when it runs ``seconds``; else a new one (``timer`` is closed), whose
    loop timer repeats at ``seconds`` so that :func:`arm` can run it whole again."""
    if timer is not None:
        if timer.seconds == seconds:
            return timer
        timer.close()
    timer = gevent.Timeout(seconds)
    timer.timer.close()
    # as Timeout makes it (ref, priority -1), with ``repeat`` for ev_timer_again
    timer.timer = get_hub().loop.timer(seconds, seconds, priority=-1)
    return timer


def arm(timer: gevent.Timeout) -> Any:
    """``timer.start()`` for a timer of :func:`timer_for` (one that raises itself, in the
    greenlet that arms it): its loop timer started as ``Timeout.start`` starts it, but
    with ``again`` so that it runs its whole length (see the module docstring), and
    without the Python-level checks around that (a few hundred instructions per wait).
    Returns the loop timer: its ``stop()`` is ``timer.cancel()``."""
    clock = timer.timer
    clock.again(expire, clock, getcurrent(), timer, update=True)
    return clock


def expire(clock: Any, greenlet: Any, timer: gevent.Timeout) -> None:
    """A timer of :func:`timer_for` ran out: stop its loop timer (it repeats, for
    ``again``) and raise ``timer`` in ``greenlet``, as ``Timeout`` does."""
    clock.stop()
    timer._on_expiration(greenlet, timer)


def wait_watcher(watcher: Any, timer: gevent.Timeout) -> bool:
    """Wait until ``watcher`` fires, under ``timer`` (started here, cancelled on return):
    True when it fired, False when ``timer`` ran out first. Any other timeout raised
    meanwhile (an outer deadline) propagates."""
    clock = arm(timer)
    try:
        get_hub().wait(watcher)
    except gevent.Timeout as exc:
        if exc is not timer:
            raise
        return False
    finally:
        clock.stop()
    return True
