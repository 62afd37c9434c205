"""The host segment: worker slots, shared in-flight counts, dead workers swept (real
processes sharing one mmap'd file)."""

from __future__ import annotations

import math
import subprocess
import sys
from pathlib import Path

import pytest

from continuum.config import BackendConfig
from continuum.hostshm import HostSegment, create
from continuum.metrics import RouterMetrics
from continuum.routing.backends import WAIT_SAMPLES, Backend
from continuum.routing.forwarder import Lease

CHILD = """
import sys, time
from continuum.hostshm import HostSegment
seg = HostSegment(sys.argv[1])
col = seg.column("b")
seg.words[seg.cell(col)] = int(sys.argv[2])
print(seg.slot, flush=True)
time.sleep(60)
"""


def _child(directory: Path, count: int) -> subprocess.Popen[str]:
    proc = subprocess.Popen([sys.executable, "-c", CHILD, str(directory), str(count)],
                            stdout=subprocess.PIPE, text=True)
    assert proc.stdout is not None
    proc.stdout.readline()  # its slot is claimed and its count written
    return proc


def _stop(proc: subprocess.Popen[str]) -> None:
    proc.kill()
    proc.wait()
    if proc.stdout is not None:
        proc.stdout.close()


def test_counts_add_up_across_processes_and_dead_rows_are_swept(tmp_path: Path) -> None:
    create(tmp_path)
    seg = HostSegment(tmp_path)
    backend = Backend(BackendConfig(name="b", url="http://127.0.0.1:1"))
    backend.share_load(seg)
    backend.acquire()
    backend.acquire()
    children = [_child(tmp_path, 3), _child(tmp_path, 4)]
    try:
        assert backend.in_flight == 2 + 3 + 4
        assert backend.local_in_flight == 2
        assert len({slot for slot, _pid, _gen in seg.live_workers()}) == 3
        _stop(children[0])  # a worker that dies holding requests
        assert seg.sweep() == 1
        assert backend.in_flight == 2 + 4
        backend.release()
        assert backend.in_flight == 1 + 4
        backend.in_flight = 10  # tests set the host's total; this worker's share moves
        assert backend.in_flight == 10 and backend.local_in_flight == 6
    finally:
        for child in children:
            _stop(child)
    seg.release()


def test_a_new_worker_takes_a_dead_slot_wiped(tmp_path: Path) -> None:
    seg = HostSegment(tmp_path)
    col = seg.column("b")
    dead = _child(tmp_path, 7)
    assert seg.host_total(col) == 7
    _stop(dead)
    fresh = _child(tmp_path, 0)  # claims the dead worker's slot: its 7 must not count
    try:
        assert seg.host_total(col) == 0
        assert [pid for _slot, pid, _gen in seg.live_workers()] == [seg.pid, fresh.pid]
    finally:
        _stop(fresh)
        seg.release()


def test_backend_columns_are_shared_by_name(tmp_path: Path) -> None:
    one, two = HostSegment(tmp_path), HostSegment(tmp_path, pid=1)
    assert one.column("x") == two.column("x") != one.column("y")
    assert one.column("y") == two.column("y")
    one.release()


def test_the_other_routers_count_adds_to_the_hosts(tmp_path: Path) -> None:
    """The elsewhere row (continuum.routing.fleet_load) counts in every worker's view of a
    backend's load, and not in what the host tells the other routers."""
    one, two = HostSegment(tmp_path), HostSegment(tmp_path, pid=1)
    col = one.column("b")
    backend = Backend(BackendConfig(name="b", url="http://127.0.0.1:1"))
    backend.share_load(two)  # a worker's backend, publishing in its row
    one.words[one.cell(col)] = 2
    backend.acquire()
    assert (one.host_total(col), one.workers_total(col)) == (3, 3)
    one.set_elsewhere(col, 4)
    assert (two.host_total(col), two.workers_total(col)) == (7, 3)
    assert two.host_total(two.column("other")) == 0
    assert backend.in_flight == 7
    backend.in_flight = 9  # tests and tools set the total: this worker's count makes it up
    assert (backend.local_in_flight, one.workers_total(col)) == (3, 5)
    one.set_elsewhere(col, 0)
    assert backend.in_flight == 5
    one.release()


def test_the_other_routers_pressure_adds_to_the_hosts_and_decays(tmp_path: Path) -> None:
    """The elsewhere pressure row counts in the host's KV pressure, decayed from the time
    it was written, and not in what the host tells the other routers."""
    one, two = HostSegment(tmp_path), HostSegment(tmp_path, pid=1)
    col = one.column("b")
    one.set_pressure(col, 100.0, 50.0)
    two.set_pressure(col, 300.0, 50.0)
    assert one.workers_pressure(col, 50.0, 10.0) == one.host_pressure(col, 50.0, 10.0) == 400.0
    two.set_elsewhere_pressure(col, 1000.0, 40.0)
    assert one.workers_pressure(col, 50.0, 10.0) == 400.0
    expected = 400.0 + 1000.0 * math.exp(-1.0)  # written one window before
    assert abs(one.host_pressure(col, 50.0, 10.0) - expected) < 1e-9
    assert one.host_pressure(one.column("other"), 50.0, 10.0) == 0.0
    two.set_elsewhere_pressure(col, 0.0, 50.0)
    assert one.host_pressure(col, 50.0, 10.0) == 400.0
    one.release()
    two.release()


def test_fresh_segment_forgets_the_previous_run(tmp_path: Path) -> None:
    old = HostSegment(tmp_path)
    old.words[old.cell(old.column("b"))] = 5
    old.bump_generation()
    (tmp_path / "fleet").mkdir()
    (tmp_path / "fleet" / "1.json").write_text("{}")
    (tmp_path / "health.json").write_text("{}")  # the last run's prober's results
    host_id = old.host_id
    old.close()
    create(tmp_path, fresh=True)  # the master at start-up
    new = HostSegment(tmp_path)
    assert new.generation == 0 and new.host_total(new.column("b")) == 0
    assert new.host_id != host_id and not list((tmp_path / "fleet").glob("*.json"))
    assert not (tmp_path / "health.json").exists()
    create(tmp_path)  # a worker finding a valid segment keeps it
    assert HostSegment(tmp_path).host_id == new.host_id


def test_the_latency_ewma_is_the_hosts(tmp_path: Path) -> None:
    """Every worker's finished requests fold into one latency EWMA per backend: a worker
    sees the latency of requests another worker sent (LeastLatency, the KV guard's and
    placement's queue price read it)."""
    one, two = HostSegment(tmp_path), HostSegment(tmp_path, pid=1)
    config = BackendConfig(name="b", url="http://127.0.0.1:1")
    first, second = Backend(config, ewma_alpha=0.5), Backend(config, ewma_alpha=0.5)
    first.record(True, 0.4)  # before sharing: this worker's own sample
    first.share_load(one)
    second.share_load(two)
    assert first.latency_ewma == second.latency_ewma == 0.4  # the first sample went along
    second.record(True, 0.2)
    assert first.latency_ewma == second.latency_ewma == pytest.approx(0.3)
    first.record(False, None)  # a failure without a latency leaves it
    assert second.latency_ewma == pytest.approx(0.3)
    second.latency_ewma = None  # tests and tools reset it
    assert first.latency_ewma is None
    other = Backend(BackendConfig(name="c", url="http://127.0.0.1:2"))
    other.share_load(two)
    assert other.latency_ewma is None  # a column of its own
    one.release()


def test_the_hosts_workers_learn_one_first_token_wait_keyed_by_the_hosts_count(
        tmp_path: Path) -> None:
    """With the load shared, a backend's time to a first token is learned by the host's
    in-flight count at dispatch (the engine queues every worker's requests), from every
    worker's streams, and every worker prices it at the host's count."""
    one, two = HostSegment(tmp_path), HostSegment(tmp_path, pid=1)
    config = BackendConfig(name="b", url="http://127.0.0.1:1")
    mine, theirs = Backend(config, ewma_alpha=0.5), Backend(config, ewma_alpha=0.5)
    mine.share_load(one)
    theirs.share_load(two)
    # two slots: at 0 or 1 in flight 30 ms to the first token, at 2 130 ms; the other
    # worker's streams teach it, four samples short of five at 2 ...
    for _ in range(WAIT_SAMPLES):
        theirs.first_piece(0, 0.03)
        theirs.first_piece(1, 0.03)
    for _ in range(WAIT_SAMPLES - 1):
        theirs.first_piece(2, 0.13)
    for _ in range(3):
        theirs.acquire()  # three in flight, all the other worker's
    assert (mine.local_in_flight, mine.in_flight) == (0, 3)
    assert mine.queue_wait() == 0.0
    mine.first_piece(2, 0.13)  # ... and this worker's fifth completes it
    assert mine.queue_wait() == theirs.queue_wait() == pytest.approx(0.1)
    theirs.release()
    theirs.release()
    assert mine.queue_wait() == 0.0  # one in flight on the host
    # the forwarder's level is the host's count, not this worker's share
    lease = Lease(mine, "/v1/chat/completions", RouterMetrics())
    assert lease.level == 1
    lease.release(200, True)
    # leaving the segment, a worker keeps what the host learned
    mine.share_load(None)
    mine.in_flight = 2
    assert mine.queue_wait() == pytest.approx(0.1)
    one.release()
