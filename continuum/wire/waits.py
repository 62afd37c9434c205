"""Waiting on a gevent socket's own read watcher under a reused timer.

``gevent.socket.wait_read`` makes a new watcher and a new timer for every wait; on a hot
path (a kept-alive connection's next request, each record of a stream) the socket's own
``_read_event`` and one timer per connection, remade only when its length changes (a
gevent ``Timeout`` keeps the seconds it was made with), do the same without allocating.
"""

from __future__ import annotations

from typing import Any

import gevent
from gevent import get_hub, getcurrent


def timer_for(timer: gevent.Timeout | None, seconds: float) -> gevent.Timeout:
    """``timer`` when it runs ``seconds``; else a new one (``timer`` is closed)."""
    if timer is not None:
        if timer.seconds == seconds:
            return timer
        timer.close()
    return gevent.Timeout(seconds)


def arm(timer: gevent.Timeout) -> Any:
    """``timer.start()`` for a timer of :func:`timer_for` (one that raises itself, in the
    greenlet that arms it): its loop timer started exactly as ``Timeout.start`` starts
    it, without the Python-level checks around that (a few hundred instructions per
    wait). Returns the loop timer: its ``stop()`` is ``timer.cancel()``."""
    clock = timer.timer
    clock.start(timer._on_expiration, getcurrent(), timer, update=True)
    return clock


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
