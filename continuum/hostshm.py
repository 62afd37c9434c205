"""One shared-memory segment per router host: what the gunicorn workers of one router share.

Several gunicorn workers run one router; each is its own process with its own state. The few
numbers they must agree on live in one small file mapped into every worker
(``$CONTINUUM_RUNTIME_DIR/host.shm``, set by :mod:`continuum.gunicorn_conf`; the master
creates it in ``on_starting``, a worker that finds none creates it under the lock):

* a **worker table**: one slot per live worker (its PID, the last fleet-action
  generation it applied, see :mod:`continuum.web.fleet`, and how many client
  connections it holds open, see :mod:`continuum.wire.accept_balance`);
* the **fleet-action generation**, bumped by the worker that received an admin action;
* the **rotation**: how many turns the host's workers have taken in RoundRobin's cycle
  (:mod:`strategies.round_robin`), so that they cycle as one router, and this router's
  place among the live routers, as one worker last read them from Redis (with the
  in-flight counts);
* a **backend table**: the column of each backend name;
* a **load table**: ``in_flight[backend column][worker slot]`` (a backend's counts are
  contiguous, so the sum is one ``struct.unpack_from``), see
  :mod:`continuum.routing.shared_load`;
* an **elsewhere row**: ``elsewhere[backend column]``, the other routers' in-flight counts
  as last read from Redis by one worker of the host (:mod:`continuum.routing.fleet_load`),
  0 when nothing shares them;
* a **pressure table**: ``pressure[backend column][worker slot]``, two float64 each (the
  KV pressure the worker put on the backend and when), which the KV placement reads as
  the host's, decayed to now (:mod:`continuum.kv.chain_scorer`);
* an **elsewhere pressure row**: ``elsewhere_pressure[backend column]``, two float64 each,
  the other routers' KV pressure as last read from Redis with the in-flight counts;
* a **latency row**: ``latency[backend column]``, one float64, the host's latency EWMA of
  the backend (``Backend.latency_ewma``), which every worker's finished requests update;
* a **first-piece table**: per backend column a version word and, for each in-flight count
  ``0 .. WAIT_LEVELS - 1``, the EWMA of how long streams sent at that count took to their
  first body piece and how many fed it (two float64), which every worker's streams update
  and the load guard's learned waits read (``Backend.queue_wait``).

Writes: a worker writes only its own slot's row (the latency row, the first-piece table and
the rotation are the exceptions: any worker folds its sample in or takes a turn, and two
that do so at once lose one sample, or take the same turn), with aligned 8-byte stores
(which readers never see torn on the platforms gunicorn runs on), so the hot
path takes no lock. Claiming a
slot or a column, and bumping the generation, happen under ``flock`` on ``host.lock``.
A slot whose PID is gone (a killed worker) is wiped and reused by the next claimer, and
:meth:`HostSegment.sweep` wipes it sooner (every worker runs it now and then), so a dead
worker's in-flight count stops counting.

Standard library only: ``mmap``, ``fcntl``, ``struct``.
"""

from __future__ import annotations

import contextlib
import fcntl
import math
import mmap
import os
import struct
import uuid
from collections.abc import Iterator
from pathlib import Path

RUNTIME_DIR_ENV = "CONTINUUM_RUNTIME_DIR"
#: The file in the runtime directory a reload bumps, so that every worker and the KV
#: event bus notice it (:mod:`continuum.web.reload`, :mod:`continuum.kv.bus_process`).
GENERATION_FILE = "reload-generation"
SEGMENT_FILE = "host.shm"
LOCK_FILE = "host.lock"

MAGIC = 0x434F4E54484F5354  # "CONTHOST"
MAX_WORKERS = 128
MAX_BACKENDS = 256
NAME_BYTES = 64
WORKER_FIELDS = 4  # pid, applied generation, open client connections, spare
_W_CONNECTIONS = 2
#: What a worker that accepts no more connections publishes as its count (never the fewest).
NOT_ACCEPTING = 1 << 40

# Layout in 8-byte words.
_HDR_MAGIC = 0
_HDR_GENERATION = 1
_HDR_SLOTS_USED = 2  # highest claimed slot + 1 (readers sum rows below it)
_HDR_HOST_ID = 3     # 2 words: a random id naming this router instance
_HDR_ROTATION = 5    # turns taken in RoundRobin's cycle by the host's workers
_HDR_ROTATION_PLACE = 6  # this router's place among the live ones << 32 | how many (0: none)
_HEADER_WORDS = 8
_WORKERS_AT = _HEADER_WORDS
_NAMES_AT = _WORKERS_AT + MAX_WORKERS * WORKER_FIELDS  # in words; names are bytes
_LOAD_AT = _NAMES_AT + MAX_BACKENDS * NAME_BYTES // 8
_ELSEWHERE_AT = _LOAD_AT + MAX_WORKERS * MAX_BACKENDS
_PRESSURE_AT = _ELSEWHERE_AT + MAX_BACKENDS  # 2 words (value, at) per cell
_ELSEWHERE_PRESSURE_AT = _PRESSURE_AT + 2 * MAX_BACKENDS * MAX_WORKERS  # (value, at)
_LATENCY_AT = _ELSEWHERE_PRESSURE_AT + 2 * MAX_BACKENDS  # float64 per backend, 0.0: none
#: In-flight counts (0 .. WAIT_LEVELS - 1) whose time to a first piece a backend learns.
WAIT_LEVELS = 64
_FIRST_PIECE_AT = _LATENCY_AT + MAX_BACKENDS
_FIRST_PIECE_STRIDE = 1 + 2 * WAIT_LEVELS  # version word, then (EWMA, samples) per count
SIZE = (_FIRST_PIECE_AT + MAX_BACKENDS * _FIRST_PIECE_STRIDE) * 8
_FIRST_PIECES = struct.Struct(f"<{2 * WAIT_LEVELS}d")
_PAIR = struct.Struct("<dd")
_UNPACK = [struct.Struct(f"<{n}q").unpack_from for n in range(MAX_WORKERS + 1)]


def runtime_dir() -> Path | None:
    """``$CONTINUUM_RUNTIME_DIR``, or None outside ``continuum-router serve``/gunicorn."""
    value = os.environ.get(RUNTIME_DIR_ENV)
    return Path(value) if value else None


def write_private(path: Path, data: bytes) -> None:
    """Replace ``path`` with ``data`` at once (a temporary file renamed over it), readable
    by this user only (mode 0600).

    Raises:
        OSError: the directory is not writable.
    """
    tmp = path.with_name(f"{path.name}.{os.getpid()}")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "wb") as f:
        f.write(data)
    tmp.replace(path)


def pid_alive(pid: int) -> bool:
    """Whether a process ``pid`` exists (one of another user's counts as alive)."""
    if pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


class HostSegment:
    """This worker's view of the host segment in ``directory``, with its own slot.

    Raises:
        OSError: the directory is not writable.
        RuntimeError: every worker slot or backend column is taken.
    """

    def __init__(self, directory: str | os.PathLike[str], *, pid: int | None = None) -> None:
        self.directory = Path(directory)
        self.path = self.directory / SEGMENT_FILE
        self.lock_path = self.directory / LOCK_FILE
        self.pid = pid if pid is not None else os.getpid()
        with self.locked():
            create(self.directory, _locked=True)
            fd = os.open(self.path, os.O_RDWR)
            try:
                self._map = mmap.mmap(fd, SIZE)
            finally:
                os.close(fd)
            self.words = memoryview(self._map).cast("q")
            self.doubles = memoryview(self._map).cast("d")  # the same words as floats
            self.slot = self._claim_slot()
        self.host_id = self.words[_HDR_HOST_ID:_HDR_HOST_ID + 2].tobytes().hex()
        self._columns: dict[str, int] = {}

    # --- locking -----------------------------------------------------------------------

    @contextlib.contextmanager
    def locked(self) -> Iterator[None]:
        """Hold the host lock (``flock`` on ``host.lock``): claims and generation bumps."""
        fd = os.open(self.lock_path, os.O_RDWR | os.O_CREAT, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            yield
        finally:
            os.close(fd)  # closing drops the lock

    # --- worker slots ------------------------------------------------------------------

    def _worker(self, slot: int, field: int) -> int:
        return _WORKERS_AT + slot * WORKER_FIELDS + field

    def _claim_slot(self) -> int:
        words = self.words
        for slot in range(MAX_WORKERS):
            pid = words[self._worker(slot, 0)]
            if pid == self.pid or not pid_alive(pid):
                self._wipe(slot)
                words[self._worker(slot, 0)] = self.pid
                # A new worker starts with fresh state: nothing from before is pending.
                words[self._worker(slot, 1)] = words[_HDR_GENERATION]
                if slot + 1 > words[_HDR_SLOTS_USED]:
                    words[_HDR_SLOTS_USED] = slot + 1
                return slot
        raise RuntimeError(f"{self.path}: all {MAX_WORKERS} worker slots are taken")

    def _wipe(self, slot: int) -> None:
        words = self.words
        for field in range(WORKER_FIELDS):
            words[self._worker(slot, field)] = 0
        for col in range(MAX_BACKENDS):
            words[_LOAD_AT + col * MAX_WORKERS + slot] = 0
            cell = _PRESSURE_AT + 2 * (col * MAX_WORKERS + slot)
            words[cell] = words[cell + 1] = 0  # 0.0 as float64

    def sweep(self) -> int:
        """Wipe the slots of workers that died; how many were wiped."""
        wiped = 0
        words = self.words
        for slot in range(words[_HDR_SLOTS_USED]):
            pid = words[self._worker(slot, 0)]
            if pid and pid != self.pid and not pid_alive(pid):
                with self.locked():
                    if words[self._worker(slot, 0)] == pid:
                        self._wipe(slot)
                        wiped += 1
        return wiped

    def live_workers(self) -> list[tuple[int, int, int]]:
        """(slot, pid, applied generation) of every claimed slot whose process lives."""
        out = []
        words = self.words
        for slot in range(words[_HDR_SLOTS_USED]):
            pid = words[self._worker(slot, 0)]
            if pid and pid_alive(pid):
                out.append((slot, pid, words[self._worker(slot, 1)]))
        return out

    def release(self) -> None:
        """Give this worker's slot back (worker exit); its load row is wiped."""
        with self.locked():
            if self.words[self._worker(self.slot, 0)] == self.pid:
                self._wipe(self.slot)

    # --- open client connections (accept balancing) --------------------------------------

    @property
    def connections(self) -> int:
        """The client connections this worker holds open, as it last published them."""
        return self.words[self._worker(self.slot, _W_CONNECTIONS)]

    @connections.setter
    def connections(self, value: int) -> None:
        self.words[self._worker(self.slot, _W_CONNECTIONS)] = value

    def fewest_connections_elsewhere(self) -> int | None:
        """The fewest open connections any other claimed worker slot publishes; None when
        this worker is the only one. A dead worker's slot counts until it is swept (at most
        a second): its count is then frozen, and what that costs is bounded by the caller."""
        words = self.words
        fewest: int | None = None
        at = _WORKERS_AT
        for slot in range(words[_HDR_SLOTS_USED]):
            base = at + slot * WORKER_FIELDS
            if slot != self.slot and words[base]:
                count = words[base + _W_CONNECTIONS]
                if fewest is None or count < fewest:
                    fewest = count
        return fewest

    # --- fleet-action generation -------------------------------------------------------

    @property
    def generation(self) -> int:
        """The host's fleet-action generation (one aligned read)."""
        return self.words[_HDR_GENERATION]

    def bump_generation(self) -> int:
        """Add one to the generation (call under :meth:`locked`); the new value."""
        value = self.words[_HDR_GENERATION] + 1
        self.words[_HDR_GENERATION] = value
        return value

    @property
    def applied(self) -> int:
        """The generation this worker has applied."""
        return self.words[self._worker(self.slot, 1)]

    @applied.setter
    def applied(self, value: int) -> None:
        self.words[self._worker(self.slot, 1)] = value

    # --- RoundRobin's rotation ----------------------------------------------------------

    def take_turn(self, candidates: int) -> int:
        """The host's next turn in RoundRobin's cycle over ``candidates`` backends: the
        turns its workers have taken so far, started this router's place's share of the
        way round (router ``i`` of ``h`` live ones, as last read from Redis, starts at
        ``i * candidates // h``). Routers that take requests in turn then go round half
        a cycle apart (two) instead of in step, which sent each backend two requests in a
        row; a lone router starts at 0.

        Reads and one write, no lock: two workers that take a turn in the same instant may
        both get the same one (the cycle then repeats one backend once). That costs less
        than a lock on every request, and a locked counter would still not order requests
        that arrive at once."""
        words = self.words
        turn = words[_HDR_ROTATION]
        words[_HDR_ROTATION] = turn + 1
        place = words[_HDR_ROTATION_PLACE]
        if place:
            turn += (place >> 32) * candidates // (place & 0xFFFFFFFF)
        return turn

    @property
    def turns(self) -> int:
        """The turns this host's workers have taken."""
        return self.words[_HDR_ROTATION]

    def set_place(self, place: int, routers: int) -> None:
        """This router's place (0-based) among the ``routers`` live ones (one store)."""
        self.words[_HDR_ROTATION_PLACE] = place << 32 | routers

    # --- backend columns and load ------------------------------------------------------

    def column(self, name: str) -> int:
        """The load-table column of backend ``name`` (claimed under the lock if new)."""
        col = self._columns.get(name)
        if col is not None:
            return col
        raw = name.encode()[:NAME_BYTES - 1]
        base = _NAMES_AT * 8
        with self.locked():
            for col in range(MAX_BACKENDS):
                at = base + col * NAME_BYTES
                stored = self._map[at:at + NAME_BYTES].rstrip(b"\0")
                if stored == raw:
                    break
                if not stored:
                    self._map[at:at + len(raw)] = raw
                    break
            else:
                raise RuntimeError(f"{self.path}: all {MAX_BACKENDS} backend columns are taken")
        self._columns[name] = col
        return col

    def cell(self, col: int) -> int:
        """Word index of this worker's in-flight count for column ``col``."""
        return _LOAD_AT + col * MAX_WORKERS + self.slot

    def host_total(self, col: int) -> int:
        """Backend ``col``'s load as this host knows it: the sum of its counts over every
        worker slot in use (one ``unpack_from`` of the contiguous counts: the hot path's
        read), plus the other routers' count in the elsewhere row (0 unless shared)."""
        words = self.words
        at = (_LOAD_AT + col * MAX_WORKERS) * 8
        total: int = sum(_UNPACK[words[_HDR_SLOTS_USED]](self._map, at))
        elsewhere: int = words[_ELSEWHERE_AT + col]
        return total + elsewhere

    def workers_total(self, col: int) -> int:
        """Backend ``col``'s count over this host's workers only (what it tells the others)."""
        at = (_LOAD_AT + col * MAX_WORKERS) * 8
        total: int = sum(_UNPACK[self.words[_HDR_SLOTS_USED]](self._map, at))
        return total

    def set_elsewhere(self, col: int, count: int) -> None:
        """The other routers' in-flight count of backend ``col`` (one aligned store)."""
        self.words[_ELSEWHERE_AT + col] = count

    def set_pressure(self, col: int, value: float, at: float) -> None:
        """This worker's KV pressure on backend ``col``: ``value`` tokens as of ``at``
        (``time.monotonic()``, which every process of the host shares)."""
        _PAIR.pack_into(self._map, (_PRESSURE_AT + 2 * (col * MAX_WORKERS + self.slot)) * 8,
                        value, at)

    def host_pressure(self, col: int, now: float, window: float) -> float:
        """Backend ``col``'s KV pressure over this host's workers, each worker's decayed
        over ``window`` seconds to ``now``, plus the other routers' (the elsewhere
        pressure row, decayed the same way; 0 unless shared). A reader may see a value
        and its time from two different writes; the error is one update's decay at most."""
        value, then = _PAIR.unpack_from(self._map, (_ELSEWHERE_PRESSURE_AT + 2 * col) * 8)
        total = self.workers_pressure(col, now, window)
        if value > 0.0:
            total += value * math.exp(-max(0.0, now - then) / window)
        return total

    def workers_pressure(self, col: int, now: float, window: float) -> float:
        """Backend ``col``'s KV pressure over this host's workers only (what it tells the
        other routers)."""
        total = 0.0
        unpack, buf = _PAIR.unpack_from, self._map
        at = (_PRESSURE_AT + 2 * col * MAX_WORKERS) * 8
        for slot in range(self.words[_HDR_SLOTS_USED]):
            value, then = unpack(buf, at + 16 * slot)
            if value > 0.0:
                total += value * math.exp(-max(0.0, now - then) / window)
        return total

    def set_elsewhere_pressure(self, col: int, value: float, at: float) -> None:
        """The other routers' KV pressure on backend ``col``, ``value`` tokens as of ``at``
        (``time.monotonic()``)."""
        _PAIR.pack_into(self._map, (_ELSEWHERE_PRESSURE_AT + 2 * col) * 8, value, at)

    def latency(self, col: int) -> float | None:
        """The host's latency EWMA of backend ``col`` in seconds, None before a sample."""
        value: float = self.doubles[_LATENCY_AT + col]
        return value if value > 0.0 else None

    def add_latency(self, col: int, seconds: float, alpha: float) -> None:
        """Fold one request's latency into backend ``col``'s EWMA (weight ``alpha``; the
        first sample is the mean). Not under a lock: a sample another worker folds in at
        the same moment may be lost, which an EWMA shrugs off."""
        doubles, at = self.doubles, _LATENCY_AT + col
        prev = doubles[at]  # not above 0: no sample yet, as latency() reads it
        doubles[at] = max(seconds if not prev > 0.0 else prev + alpha * (seconds - prev), 1e-9)

    def set_latency(self, col: int, seconds: float | None) -> None:
        """Set backend ``col``'s EWMA (None: no sample)."""
        self.doubles[_LATENCY_AT + col] = 0.0 if seconds is None else max(seconds, 1e-9)

    def first_piece_version(self, col: int) -> int:
        """How many first-piece samples of backend ``col`` were folded in (a reader's
        cache key: unchanged, so is the table)."""
        version: int = self.words[_FIRST_PIECE_AT + col * _FIRST_PIECE_STRIDE]
        return version

    def first_pieces(self, col: int) -> tuple[list[float], list[int]]:
        """Backend ``col``'s table: the time-to-first-piece EWMA (seconds) at each in-flight
        count, and the samples behind each."""
        flat = _FIRST_PIECES.unpack_from(
            self._map, (_FIRST_PIECE_AT + col * _FIRST_PIECE_STRIDE + 1) * 8)
        return list(flat[0::2]), [int(n) for n in flat[1::2]]

    def add_first_piece(self, col: int, level: int, seconds: float, alpha: float) -> None:
        """Fold one stream's time to its first piece, sent at ``level`` in flight, into
        backend ``col``'s EWMA at that count (the first sample is the mean), and bump the
        version. Not under a lock, as :meth:`add_latency`."""
        if not 0 <= level < WAIT_LEVELS:
            return
        base = _FIRST_PIECE_AT + col * _FIRST_PIECE_STRIDE
        at = (base + 1 + 2 * level) * 8
        prev, samples = _PAIR.unpack_from(self._map, at)
        _PAIR.pack_into(self._map, at,
                        seconds if samples <= 0 else prev + alpha * (seconds - prev),
                        samples + 1)
        self.words[base] += 1

    def close(self) -> None:
        """Unmap (the slot is kept: call :meth:`release` first to give it back)."""
        with contextlib.suppress(BufferError, ValueError):
            self.words.release()
            self.doubles.release()
            self._map.close()


def create(directory: str | os.PathLike[str], *, fresh: bool = False,
           _locked: bool = False) -> Path:
    """Create ``host.shm`` in ``directory`` unless a valid one is there; ``fresh``: always
    a new one, and no fleet actions left from before (gunicorn's ``on_starting`` does this
    in the master, so every worker maps the same new file: a PID of a previous run, now
    another process's, must not keep counts alive)."""
    directory = Path(directory)
    path = directory / SEGMENT_FILE
    if not _locked:
        seg_lock = os.open(directory / LOCK_FILE, os.O_RDWR | os.O_CREAT, 0o600)
        fcntl.flock(seg_lock, fcntl.LOCK_EX)
    try:
        if fresh:
            for stale in (directory / "fleet").glob("*.json"):
                stale.unlink(missing_ok=True)
            # the previous run's probe results (continuum.routing.shared_health.STATE_FILE):
            # a new router judges its backends by its own first probes
            (directory / "health.json").unlink(missing_ok=True)
        try:
            with path.open("rb") as fh:
                head = fh.read(8)
            if not fresh and len(head) == 8 and int.from_bytes(head, "little") == MAGIC \
                    and path.stat().st_size == SIZE:
                return path
        except FileNotFoundError:
            pass
        tmp = path.with_suffix(f".{os.getpid()}.tmp")
        with tmp.open("wb") as fh:
            fh.truncate(SIZE)
            fh.seek(0)
            fh.write(MAGIC.to_bytes(8, "little"))
            fh.seek(_HDR_HOST_ID * 8)
            fh.write(uuid.uuid4().bytes)
        os.chmod(tmp, 0o600)
        tmp.replace(path)
        return path
    finally:
        if not _locked:
            os.close(seg_lock)




def try_lock(path: str | os.PathLike[str]) -> int | None:
    """An exclusive ``flock`` on ``path`` (created if missing) without waiting: the open
    file descriptor that holds it (closing it, or the process dying, drops the lock), or
    None when another process holds it.

    Raises:
        OSError: the file cannot be opened.
    """
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        os.close(fd)
        return None
    return fd


def open_segment() -> HostSegment | None:
    """This worker's :class:`HostSegment` in ``$CONTINUUM_RUNTIME_DIR``; None when the
    variable is unset (a router run in-process, by tests or tools) or the directory is not
    usable (logged: the worker then keeps its state to itself)."""
    directory = runtime_dir()
    if directory is None:
        return None
    try:
        return HostSegment(directory)
    except (OSError, RuntimeError) as exc:
        import logging

        logging.getLogger(__name__).warning(
            "host segment in %s unusable (%s): workers do not share state", directory, exc)
        return None


__all__ = ["MAX_BACKENDS", "MAX_WORKERS", "HostSegment", "create", "open_segment", "runtime_dir",
           "try_lock"]
