"""The host relay of KV records (memory index, one consumer per host): its receiver."""

from __future__ import annotations

import threading
from pathlib import Path

from continuum.hostshm import HostSegment
from continuum.kv.lease import HostRelay


def test_a_relay_closed_before_its_receiver_first_ran_does_not_wait_forever(
        tmp_path: Path) -> None:
    """A reload or shutdown may stop the consumers before the receiver's greenlet first
    ran; it must end at once rather than bind and wait on a socket nobody will close
    (the stop joined it for 10 s)."""
    relay = HostRelay(HostSegment(tmp_path))
    relay.open()
    relay.close()
    receiver = threading.Thread(target=relay.serve, args=(None,), daemon=True)
    receiver.start()
    receiver.join(5)
    assert not receiver.is_alive()
    assert not relay.path.exists()
