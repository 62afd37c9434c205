"""An engine restart that a replay would hide: the ZMQ source compares the overlap batch.

A vLLM/SGLang engine numbers its batches from 0 again when it restarts, with an empty cache
(``docs/kv-events.md`` §1.2). If the listener misses the new process's first batches (it
reconnected late, or they were dropped) and the first one it gets is *above* the number it
expects, the gap looks like lost messages of the old process, and the new process's replay
buffer answers contiguously from there. The source therefore asks the replay from the last
number it applied (``E - 1``) and compares that batch's bytes with the ones it applied
(§1.3, §12.3): the same bytes are the same process; other bytes are a restart.

Every engine here is the simulator's :class:`ZmqKvPublisher` with its replay ROUTER on real
127.0.0.1 sockets; a restart closes it and opens a new one on the same ports. The source
feeds the real :class:`DefaultSourceProcessor`, whose block index the tests inspect; blocks
are attributed through router salts, so no ``/detokenize`` is involved. Most tests hand the
source the live messages a test SUB socket received (as ``test_listener_sources`` does),
leaving some out to make the listener miss them; the last one runs the source's own loop.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import time
from collections.abc import Iterator
from typing import Any

import gevent
import pytest
import zmq.green as zmq

import listener.sources_zmq as sources_zmq
from continuum.cache_salt import make_salt
from continuum.devtools import procs
from continuum.devtools.procs import free_port, free_port_block
from continuum.kv_events import BlockStored
from continuum.sim.kv_publish import ZmqKvPublisher
from continuum.sim.kv_wire import encode_zmq_payload
from listener.config import DetokenizeConfig, LimitsConfig, SourceConfig
from listener.model import CACHE_CLEARED, CACHE_CREATED, CACHE_EVICTED, PrefixEvent
from listener.processor import DefaultSourceProcessor
from listener.sources_zmq import ZapAuthenticator, ZmqSource, fetch_replay

pytestmark = pytest.mark.timeout(120)

BACKEND = "vllm-r"
SECRET = b"restart-test-secret"
PROFILE = "vllm-0.33"
#: Block hashes of the old process (A) and of the restarted one (B): batch ``s`` of a
#: process stores the one block ``base + s``.
A, B = 1000, 5000

wait_until = functools.partial(procs.wait_until, sleep=gevent.sleep, interval=0.02)


def prefix(h: int) -> str:
    return f"{h:064x}"


def store(h: int) -> BlockStored:
    """A vLLM store of block ``h`` (2 tokens) whose salt attributes it to ``prefix(h)``."""
    return BlockStored((h,), None, (h % 50_000, 1), 2, medium="GPU",
                       extra_keys=((make_salt(SECRET, BACKEND, prefix(h)),),))


class Engine:
    """One engine process: a publisher bound at fixed PUB and replay ports (offset by the
    rank, as the engines do), serving replays from a greenlet; batch ``s`` stores block
    ``base + s``. A restart is a new ``Engine`` on the same ports."""

    def __init__(self, ctx: Any, port: int, replay_port: int, *, base: int,
                 profile: str = PROFILE, rank: int = 0, buffer_steps: int = 10_000,
                 topic: bytes = b"") -> None:
        self.base = base
        self.seq = 0  # batches published so far
        deadline = time.monotonic() + 10
        while True:  # the old process's sockets may still hold the ports for a moment
            try:
                self.pub = ZmqKvPublisher(
                    profile, f"tcp://127.0.0.1:{port}", bind=True, dp_rank=rank,
                    replay_endpoint=f"tcp://127.0.0.1:{replay_port}",
                    buffer_steps=buffer_steps, context=ctx, topic=topic)
                break
            except zmq.ZMQError as exc:
                if exc.errno != zmq.EADDRINUSE or time.monotonic() > deadline:
                    raise
                gevent.sleep(0.05)
        self.pub.start_replay_server()

    def publish(self, count: int = 1) -> None:
        for _ in range(count):
            self.pub.publish([store(self.base + self.seq)])
            self.seq += 1

    def keys(self, seqs: range, rank: int | None = None) -> set[Any]:
        """Index keys of the blocks of batches ``seqs`` (``(group, hash)``; with ranks
        ``((rank, group), hash)``)."""
        group = None if rank is None else (rank, None)
        return {(group, self.base + s) for s in seqs}

    def created(self, seqs: range) -> list[PrefixEvent]:
        return [PrefixEvent(CACHE_CREATED, prefix(self.base + s), 2) for s in seqs]

    def close(self) -> None:
        self.pub.close()


class Tap:
    """A SUB socket on an engine's PUB endpoint: what the listener would receive. It
    reconnects by itself to a restarted engine on the same port."""

    def __init__(self, ctx: Any, endpoint: str) -> None:
        self.sock = ctx.socket(zmq.SUB)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.setsockopt(zmq.SUBSCRIBE, b"")
        self.sock.connect(endpoint)

    def until(self, engine: Engine, min_seq: int) -> list[bytes]:
        """Publish on ``engine`` until a message numbered ``min_seq`` or more arrives;
        return it. Messages numbered lower are missed (never handed to the source)."""
        for _ in range(1000):
            if engine.seq <= min_seq + 50:
                engine.publish()
            while self.sock.poll(20):
                message: list[bytes] = self.sock.recv_multipart()
                if int.from_bytes(message[1], "big") >= min_seq:
                    return message
        raise AssertionError(f"no message numbered {min_seq} or more arrived")

    def take(self, engine: Engine, count: int) -> list[list[bytes]]:
        """Publish ``count`` batches on ``engine`` (already heard) and return them all."""
        first = engine.seq
        engine.publish(count)
        out: list[list[bytes]] = []
        while len(out) < count and self.sock.poll(5000):
            message = self.sock.recv_multipart()
            if int.from_bytes(message[1], "big") >= first:
                out.append(message)
        assert [int.from_bytes(m[1], "big") for m in out] == list(range(first, first + count))
        return out

    def close(self) -> None:
        self.sock.close(linger=0)


def seq_of(message: list[bytes]) -> int:
    return int.from_bytes(message[1], "big")


class Listener:
    """A ZMQ source (connect mode, with replay) and the real processor, recording its
    output; ``ranks`` data-parallel ranks."""

    def __init__(self, ctx: Any, zap: ZapAuthenticator, port: int, replay_port: int, *,
                 ranks: int = 1, limits: LimitsConfig | None = None) -> None:
        self.config = SourceConfig(
            backend_name=BACKEND, engine="vllm", model="m",
            zmq_endpoint=f"tcp://127.0.0.1:{port}", zmq_mode="connect",
            replay_endpoint=f"tcp://127.0.0.1:{replay_port}", data_parallel_size=ranks,
            allowed_publishers=("127.0.0.1",), require_salt=True)
        self.out: list[PrefixEvent] = []
        self.processor = DefaultSourceProcessor(self.config, LimitsConfig(), DetokenizeConfig(),
                                                emit=self.out.append, salt_secret=SECRET)
        self.source = ZmqSource(self.config, self.processor, context=ctx, zap=zap,
                                limits=limits)
        self.stats = self.source.stats

    def blocks(self) -> set[Any]:
        return set(self.processor.tracker.blocks)


@pytest.fixture
def asked(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """The start numbers of the replays the source asks for (the real ``fetch_replay``)."""
    starts: list[int] = []
    real = sources_zmq.fetch_replay

    def spy(context: Any, endpoint: str, start_seq: int, **kw: Any) -> Any:
        starts.append(start_seq)
        return real(context, endpoint, start_seq, **kw)

    monkeypatch.setattr(sources_zmq, "fetch_replay", spy)
    return starts


@pytest.fixture(params=["inline", "digest"])
def compare(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """Payloads compared as kept bytes (small ones) or as digests (every one, here)."""
    if request.param == "digest":
        monkeypatch.setattr(sources_zmq, "INLINE_PAYLOAD_BYTES", 0)
    return str(request.param)


@contextlib.contextmanager
def engine_and_tap(ctx: Any, zap: ZapAuthenticator, *, buffer_steps: int = 10_000,
                   profile: str = PROFILE, topic: bytes = b""
                   ) -> Iterator[tuple[Listener, Engine, Tap, Any]]:
    """An engine (process A, publishing on ``topic``), a tap on its PUB, and a listener
    source for it (topic filter "": every topic) that has not started (the tests hand it
    messages); ``reopen(base, buffer_steps)`` restarts the engine on the same ports and
    returns the new process."""
    port, replay_port = free_port(), free_port()
    engines = [Engine(ctx, port, replay_port, base=A, profile=profile,
                      buffer_steps=buffer_steps, topic=topic)]
    lst = Listener(ctx, zap, port, replay_port)
    tap = Tap(ctx, f"tcp://127.0.0.1:{port}")

    def reopen(base: int, steps: int = 10_000) -> Engine:
        engines[-1].close()
        engines.append(Engine(ctx, port, replay_port, base=base, profile=profile,
                              buffer_steps=steps))
        return engines[-1]

    try:
        yield lst, engines[0], tap, reopen
    finally:
        lst.source.stop()
        tap.close()
        for engine in engines:
            engine.close()


# -- the defect: a restart hidden by a contiguous replay -------------------------------------


# both replay layouts (§1.3): [seq, payload] (vLLM ≤0.25) and [topic, seq, payload]
@pytest.mark.parametrize("profile", ["vllm-0.22", "vllm-0.33"])
@pytest.mark.parametrize("history", ["replayed", "live"])
def test_a_restart_hidden_by_the_replay_is_found(
        ctx: Any, zap: ZapAuthenticator, asked: list[int], compare: str, profile: str,
        history: str) -> None:
    """Process A's blocks are indexed (from the start-up replay, or from live messages);
    A restarts as B, the listener misses B's first batches and then gets B's batch
    ``E + 2`` or later. B's buffer would answer a replay from ``E`` contiguously; the
    source asks from ``E - 1``, finds B's batch ``E - 1`` is not A's, counts a restart,
    resets and applies B's whole history: A's blocks leave the index, B's are in it."""
    with engine_and_tap(ctx, zap, profile=profile) as (lst, a, tap, reopen):
        a.publish(4)
        assert lst.source.catch_up() == 4
        if history == "live":  # the last applied batch came live (its bytes as received)
            message = tap.until(a, 4)
            lst.source.handle_frames(message)
            for message in tap.take(a, 2):
                lst.source.handle_frames(message)
        expected = a.seq
        assert lst.blocks() == a.keys(range(expected))
        assert (lst.stats.resets, lst.stats.restarts) == (0, 0)
        replays, mark = len(asked), len(lst.out)

        b = reopen(B)  # the engine restarts: numbers from 0, an empty cache
        message = tap.until(b, expected + 2)  # B's batches before this one are missed
        lst.source.handle_frames(message)

        assert lst.stats.restarts == 1 and lst.stats.resets == 1
        assert lst.stats.replay_failures == 0
        assert asked[replays:] == [expected - 1, 0]  # the overlap, then B's history
        assert lst.blocks() == b.keys(range(b.seq))  # A's blocks are gone, B's all in
        assert lst.out[mark:] == [PrefixEvent(CACHE_CLEARED), *b.created(range(b.seq))]
        # B's stream goes on in order: no gap, no replay
        gaps = lst.stats.sequence_gaps
        lst.source.handle_frames(tap.until(b, b.seq))
        assert lst.stats.sequence_gaps == gaps and len(asked) == replays + 2
        assert lst.blocks() == b.keys(range(b.seq))


def test_a_restart_seen_in_a_replay_from_zero_needs_no_second_replay(
        ctx: Any, zap: ZapAuthenticator, asked: list[int]) -> None:
    """A applied one batch (E = 1): the overlap replay is asked from 0, so its answer is
    already B's whole history; it is applied as it is, without asking again."""
    with engine_and_tap(ctx, zap) as (lst, a, tap, reopen):
        a.publish(1)
        assert lst.source.catch_up() == 1
        b = reopen(B)
        lst.source.handle_frames(tap.until(b, 3))
        assert (lst.stats.restarts, lst.stats.resets) == (1, 1)
        assert lst.blocks() == b.keys(range(b.seq))
        assert lst.out[1:] == [PrefixEvent(CACHE_CLEARED), *b.created(range(b.seq))]
        assert asked == [0, 0]


# -- no regression: the same process's gap, a wrapped buffer ---------------------------------


def test_a_gap_in_the_same_process_is_filled_without_a_reset(
        ctx: Any, zap: ZapAuthenticator, asked: list[int], compare: str) -> None:
    """Live batches ``k+1``, ``k+2`` are applied, ``k+3`` and ``k+4`` are lost, ``k+5``
    arrives: the replay is asked from ``k+2``, whose bytes are the ones applied, so it is
    the same process: the overlap is dropped, ``k+3 .. k+5`` applied, nothing reset."""
    with engine_and_tap(ctx, zap) as (lst, a, tap, _reopen):
        a.publish(2)
        assert lst.source.catch_up() == 2
        lst.source.handle_frames(tap.until(a, 2))  # heard; a gap here is replayed too
        live = tap.take(a, 5)
        first = seq_of(live[0])
        for message in live[:2]:
            lst.source.handle_frames(message)
        replays, mark = len(asked), len(lst.out)
        duplicates = lst.stats.duplicates
        lst.source.handle_frames(live[4])
        assert asked[replays:] == [first + 1]  # from E - 1: the overlap batch
        assert lst.stats.duplicates == duplicates + 1  # the live batch the replay brought
        assert (lst.stats.resets, lst.stats.restarts, lst.stats.replay_failures) == (0, 0, 0)
        assert lst.blocks() == a.keys(range(a.seq))
        assert lst.out[mark:] == a.created(range(first + 2, first + 5))
        assert CACHE_CLEARED not in {e.type for e in lst.out}
        # and the stream goes on in order
        gaps = lst.stats.sequence_gaps
        for message in tap.take(a, 2):
            lst.source.handle_frames(message)
        assert lst.stats.sequence_gaps == gaps and lst.blocks() == a.keys(range(a.seq))


@pytest.mark.parametrize("case", ["same process", "restarted", "reaches E only"])
def test_a_replay_that_no_longer_reaches_the_overlap_resets(
        ctx: Any, zap: ZapAuthenticator, asked: list[int], case: str,
        caplog: pytest.LogCaptureFixture) -> None:
    """The engine keeps 3 batches. When its buffer no longer holds ``E - 1`` (wrapped), the
    source cannot tell a gap from a restart: the state is reset and the replay applied from
    where it begins, as when a replay does not reach back far enough. That holds even when
    the buffer still begins exactly at ``E`` (the old process or a new one, it cannot say)."""
    with engine_and_tap(ctx, zap, buffer_steps=3) as (lst, a, tap, reopen):
        tap.until(a, 0)  # the tap hears the engine; its buffer keeps the last 3
        applied = lst.source.catch_up()
        assert applied == min(a.seq, 3) and lst.stats.resets == 0
        expected = a.seq
        assert lst.blocks() == a.keys(range(expected - applied, expected))
        engine = a
        if case == "restarted":
            engine = reopen(B, 3)
            message = tap.until(engine, expected + 4)
        else:
            message = tap.take(a, 5 if case == "same process" else 3)[-1]
        replays, mark = len(asked), len(lst.out)
        with caplog.at_level(logging.WARNING, logger="listener.sources"):
            lst.source.handle_frames(message)
        assert lst.stats.resets == 1 and lst.stats.restarts == 0
        kept = range(engine.seq - 3, engine.seq)
        assert lst.blocks() == engine.keys(kept)
        assert lst.out[mark:] == [PrefixEvent(CACHE_CLEARED), *engine.created(kept)]
        assert asked[replays:] == [expected - 1]
        assert "cannot tell a gap from a restart" in caplog.text


# -- data parallelism: one rank restarts ----------------------------------------------------


def test_a_hidden_restart_of_one_rank_clears_that_rank_only(
        ctx: Any, zap: ZapAuthenticator, asked: list[int]) -> None:
    """Two ranks, each with its own replay ROUTER (port + rank). Rank 1 restarts and its
    first batches are missed: rank 1's old blocks go (evictions, no ``cache_cleared``),
    rank 0's stay, rank 1's new history is indexed."""
    port, replay_port = free_port_block(2), free_port_block(2)
    ranks = [Engine(ctx, port, replay_port, base=A + 1000 * r, rank=r) for r in (0, 1)]
    lst = Listener(ctx, zap, port, replay_port, ranks=2)
    tap = Tap(ctx, f"tcp://127.0.0.1:{port + 1}")
    try:
        for engine in ranks:
            engine.publish(3)
        assert lst.source.catch_up() == 6
        old = ranks[1]
        assert lst.blocks() == ranks[0].keys(range(3), 0) | old.keys(range(3), 1)
        mark = len(lst.out)
        old.close()
        ranks.append(Engine(ctx, port, replay_port, base=B, rank=1))
        new = ranks[-1]
        lst.source.handle_frames(tap.until(new, 3 + 2))
        assert (lst.stats.restarts, lst.stats.resets) == (1, 0)
        assert lst.blocks() == ranks[0].keys(range(3), 0) | new.keys(range(new.seq), 1)
        evicted = [e for e in lst.out[mark:] if e.type == CACHE_EVICTED]
        assert {e.prefix_hash for e in evicted} == {prefix(old.base + s) for s in range(3)}
        assert [e for e in lst.out[mark:] if e.type != CACHE_EVICTED] == new.created(
            range(new.seq))
        assert CACHE_CLEARED not in {e.type for e in lst.out}
        assert asked == [0, 0, 2, 0]  # both start-up replays, rank 1's overlap, its history
    finally:
        lst.source.stop()
        tap.close()
        for engine in ranks:
            engine.close()


# -- the source's own loop: it reconnects to the restarted engine late ----------------------


def a_restarts_as_b_while_followed(ctx: Any, zap: ZapAuthenticator, *, a_batches: int,
                                   b_unheard: int, b_most: int) -> None:
    """A source running its own loop (connect mode) catches engine A's ``a_batches`` up at
    start and follows A. A stops; B starts on the same ports, publishes ``b_unheard``
    batches before anyone subscribes (dropped: only B's buffer has them), then one every
    20 ms until the source counts a restart (at most ``b_most`` in all). A's blocks must end
    up gone and all of B's indexed, after one restart and one reset."""
    port, replay_port = free_port(), free_port()
    a = Engine(ctx, port, replay_port, base=A)
    engines = [a]
    lst = Listener(ctx, zap, port, replay_port)
    try:
        a.publish(a_batches)
        lst.source.start()
        wait_until(lambda: lst.blocks() == a.keys(range(a_batches)), "A's start-up replay")
        wait_until(lambda: lst.source.health()["peers"] == 1, "the connection to A")
        a.close()
        wait_until(lambda: lst.stats.publisher_disconnects >= 1, "A's disconnection")
        b = Engine(ctx, port, replay_port, base=B)
        engines.append(b)
        if b_unheard:
            b.publish(b_unheard)
        while not lst.stats.restarts and b.seq < b_most:  # until the source has heard B
            b.publish()
            gevent.sleep(0.02)
        wait_until(lambda: lst.blocks() == b.keys(range(b.seq)), "B's blocks only")
        assert lst.stats.restarts == 1 and lst.stats.resets == 1
        assert PrefixEvent(CACHE_CLEARED) in lst.out
    finally:
        lst.source.stop()
        for engine in engines:
            engine.close()


def test_a_restarted_engine_heard_late_replaces_the_old_ones_blocks(
        ctx: Any, zap: ZapAuthenticator) -> None:
    """A started source (connect mode) catches A up at start and follows it. A stops; B
    starts on the same ports and publishes its first batches before the source has
    reconnected (a PUB without subscribers drops them), then more. Whatever B batch the
    source hears first, A's blocks end up gone and B's all indexed."""
    a_restarts_as_b_while_followed(ctx, zap, a_batches=4, b_unheard=6, b_most=506)


def test_payload_fingerprints() -> None:
    """Small payloads are kept as they are (bytes of any buffer type compare alike), large
    ones as a 16-byte digest; the size is part of it, so the two kinds never match."""
    fingerprint = sources_zmq._fingerprint
    small = b"\x93" * 100
    assert fingerprint(small) == (100, small) and fingerprint(small)[1] is small
    assert fingerprint(bytearray(small)) == fingerprint(small)
    big = b"x" * (sources_zmq.INLINE_PAYLOAD_BYTES + 1)
    size, digest = fingerprint(big)
    assert size == len(big) and len(digest) == 16
    assert fingerprint(big) == fingerprint(bytes(big)) != fingerprint(big[:-1] + b"y")


def test_the_kept_payloads_are_bounded_by_the_sequence_table(
        ctx: Any, zap: ZapAuthenticator) -> None:
    """One payload (or digest) per stream the table keeps, dropped with its stream."""
    lst = Listener(ctx, zap, 1, 2, limits=LimitsConfig(max_sequence_streams=8))
    for i in range(100):  # a publisher inventing topics
        body = encode_zmq_payload([store(A + i)], PROFILE, ts=time.time(), dp_rank=0)
        lst.source.handle_frames([b"t%d" % i, (0).to_bytes(8, "big"), body])
    assert lst.source.health()["sequence_streams"] == 8
    assert len(lst.source._last) == 8 and set(lst.source._last) == set(lst.source._expected)


# -- a restart after a replay: the replayed range holds the old process's numbers ----------


#: Block hashes of a third process (C), the one after B.
C = 9000


def published(ctx: Any, engine: Engine) -> list[list[bytes]]:
    """Every batch ``engine`` published, as the live messages it sent: the engines' replay
    buffer holds the very payload bytes they sent (§1.3), so a replay from 0 read with the
    real ``fetch_replay`` (not the ``asked`` spy) gives them back for the test to hand to
    the source as if they had arrived live."""
    got = fetch_replay(ctx, str(engine.pub.replay_endpoint), 0)
    assert got is not None and [seq for _, seq, _ in got] == list(range(engine.seq))
    return [[engine.pub.topic, seq.to_bytes(8, "big"), payload] for _, seq, payload in got]


def test_a_restart_right_after_the_start_up_replay_is_found(
        ctx: Any, zap: ZapAuthenticator, asked: list[int], compare: str) -> None:
    """The start-up replay applies A's batches 0..4 (E = 5); A's live copies of some of
    them arrive after it (duplicates: same numbers, same bytes, dropped). A stays idle,
    then restarts as B, and B's live batches 0..5 arrive. B's 0..4 are numbered within the
    replayed range but are not the batches replayed: B's 0 is a restart (A's blocks
    cleared) and B's batches are applied in order. Before, every live number in the
    replayed range was a duplicate until one numbered 5 or more was applied: B's first
    five batches were dropped and A's blocks stayed indexed for good."""
    with engine_and_tap(ctx, zap) as (lst, a, _tap, reopen):
        a.publish(5)
        assert lst.source.catch_up() == 5
        old = published(ctx, a)
        for message in old[3:]:  # A's live copies of what the replay brought
            lst.source.handle_frames(message)
        assert lst.stats.duplicates == 2 and lst.blocks() == a.keys(range(5))
        mark = len(lst.out)

        b = reopen(B)
        b.publish(6)
        for message in published(ctx, b):
            lst.source.handle_frames(message)

        assert (lst.stats.restarts, lst.stats.resets, lst.stats.duplicates) == (1, 1, 2)
        assert lst.blocks() == b.keys(range(6))
        assert lst.out[mark:] == [PrefixEvent(CACHE_CLEARED), *b.created(range(6))]
        assert lst.stats.sequence_gaps == 0 and asked == [0]  # B's 0 came: nothing to ask
        assert lst.source._replayed == {}  # let go once a live batch went past the replay


def test_a_crash_loop_after_a_restart_seen_in_a_replay_is_found(
        ctx: Any, zap: ZapAuthenticator, asked: list[int], compare: str) -> None:
    """A restart found by a gap's replay applies the new process's history from 0 (B's
    0..n-1). B stays idle and restarts too, as C: C's live batches, numbered within B's
    replayed 0..n-1, are not B's: C's 0 is another restart. Before, they were dropped as
    duplicates of B's replay (and C's first n batches never indexed)."""
    with engine_and_tap(ctx, zap) as (lst, a, tap, reopen):
        a.publish(4)
        assert lst.source.catch_up() == 4
        b = reopen(B)
        lst.source.handle_frames(tap.until(b, 4 + 2))  # B's history is replayed from 0
        assert (lst.stats.restarts, lst.stats.resets) == (1, 1)
        assert lst.blocks() == b.keys(range(b.seq)) and asked == [0, 3, 0]
        n = b.seq
        mark = len(lst.out)

        c = reopen(C)
        c.publish(n + 1)
        for message in published(ctx, c):
            lst.source.handle_frames(message)

        assert (lst.stats.restarts, lst.stats.resets) == (2, 2)
        assert lst.blocks() == c.keys(range(n + 1))
        assert lst.out[mark:] == [PrefixEvent(CACHE_CLEARED), *c.created(range(n + 1))]
        assert asked == [0, 3, 0]


def test_a_rank_that_restarts_after_the_start_up_replay_is_cleared(
        ctx: Any, zap: ZapAuthenticator, asked: list[int]) -> None:
    """Two ranks, both caught up at start (each rank's E = 3). Rank 1 restarts and its new
    process's live batches 0..3 arrive: rank 1's old blocks go (evictions, no
    ``cache_cleared``), its new ones are indexed, rank 0's stay."""
    port, replay_port = free_port_block(2), free_port_block(2)
    ranks = [Engine(ctx, port, replay_port, base=A + 1000 * r, rank=r) for r in (0, 1)]
    lst = Listener(ctx, zap, port, replay_port, ranks=2)
    try:
        for engine in ranks:
            engine.publish(3)
        assert lst.source.catch_up() == 6
        old = ranks[1]
        mark = len(lst.out)
        old.close()
        new = Engine(ctx, port, replay_port, base=B, rank=1)
        ranks.append(new)
        new.publish(4)
        for message in published(ctx, new):
            lst.source.handle_frames(message)
        assert (lst.stats.restarts, lst.stats.resets, lst.stats.duplicates) == (1, 0, 0)
        assert lst.blocks() == ranks[0].keys(range(3), 0) | new.keys(range(4), 1)
        evicted = [e for e in lst.out[mark:] if e.type == CACHE_EVICTED]
        assert {e.prefix_hash for e in evicted} == {prefix(old.base + s) for s in range(3)}
        assert [e for e in lst.out[mark:] if e.type != CACHE_EVICTED] == new.created(range(4))
        assert CACHE_CLEARED not in {e.type for e in lst.out} and asked == [0, 0]
    finally:
        lst.source.stop()
        for engine in ranks:
            engine.close()


def test_an_engine_restarted_while_idle_after_the_start_up_replay_replaces_it(
        ctx: Any, zap: ZapAuthenticator) -> None:
    """The source's own loop (connect mode): its start-up replay applies A's 40 batches;
    A stays idle, then stops, and B starts on the same ports. Whichever of B's batches the
    source hears first is numbered below 40, within the replayed range, and its bytes are
    not A's: a restart. A's blocks end up gone and B's all indexed (before, B's batches up
    to 39 were dropped as duplicates, and A's blocks stayed)."""
    a_restarts_as_b_while_followed(ctx, zap, a_batches=40, b_unheard=0, b_most=30)


def test_the_fingerprints_of_a_replay_are_bounded_and_let_go(
        ctx: Any, zap: ZapAuthenticator) -> None:
    """One fingerprint per batch a replay applied, only for the streams the table keeps;
    each live copy takes its own, and the stream's are dropped once a live batch goes past
    the replay, or with the stream."""
    with engine_and_tap(ctx, zap) as (lst, a, _tap, _reopen):
        a.publish(5)
        assert lst.source.catch_up() == 5
        key = (b"", 0)
        assert sorted(lst.source._replayed[key]) == [0, 1, 2, 3, 4]
        live = published(ctx, a)
        lst.source.handle_frames(live[4])
        assert sorted(lst.source._replayed[key]) == [0, 1, 2, 3]
        a.publish()
        lst.source.handle_frames(published(ctx, a)[5])  # past the replay: E
        assert lst.source._replayed == {} and lst.stats.duplicates == 1
        assert lst.blocks() == a.keys(range(6)) and lst.stats.restarts == 0
    # a stream pruned from the table takes its fingerprints with it
    lst = Listener(ctx, zap, 1, 2, limits=LimitsConfig(max_sequence_streams=2))
    for i in range(3):
        body = encode_zmq_payload([store(A + i)], PROFILE, ts=time.time(), dp_rank=0)
        lst.source._apply_start_up([(b"t%d" % i, 0, body)])
    assert set(lst.source._replayed) == set(lst.source._expected) == {(b"t1", 0), (b"t2", 0)}


# -- late batches: older than what was applied, from the same publisher --------------------


def test_live_batches_older_than_the_start_up_replay_are_late_not_restarts(
        ctx: Any, zap: ZapAuthenticator, asked: list[int], compare: str) -> None:
    """The engine keeps 5 batches. 20 are published while the source starts (its SUB,
    here the tap, is subscribed: they queue); the start-up replay brings only the last 5.
    The queued live batches then arrive: the first 15 are older than the replay's window,
    numbered below E and in no replay. They are not a restart (the engine's replay still
    holds the very bytes applied): dropped as late, with one replay to check, no clear.
    Before, each was a restart: the backend reset and replayed again, 15 times."""
    with engine_and_tap(ctx, zap, buffer_steps=5) as (lst, a, tap, _reopen):
        tap.until(a, 0)  # the SUB is subscribed from here on
        queued = tap.take(a, 20)
        first = seq_of(queued[0])
        assert lst.source.catch_up() == 5
        assert lst.blocks() == a.keys(range(first + 15, first + 20))
        mark = len(lst.out)
        for message in queued:
            lst.source.handle_frames(message)
        stats = lst.stats
        assert (stats.restarts, stats.resets, stats.sequence_gaps) == (0, 0, 0)
        assert stats.duplicates == 20 and stats.replay_failures == 0
        assert asked == [0, first + 15]  # one check, from the oldest batch replayed
        assert lst.out[mark:] == [] and lst.blocks() == a.keys(range(first + 15, first + 20))
        # the stream goes on in order; a late batch's verdict ends with it
        for message in tap.take(a, 2):
            lst.source.handle_frames(message)
        assert lst.blocks() == a.keys(range(first + 15, first + 22))
        assert stats.sequence_gaps == 0 and lst.source._late == {} and len(asked) == 2
        # a restarted engine's batch numbered below E (newer than the last applied) is
        # still a restart, at once: nothing to ask
        b = _reopen(B)
        b.publish(3)
        for message in published(ctx, b):
            lst.source.handle_frames(message)
        assert (stats.restarts, stats.resets) == (1, 1) and len(asked) == 2
        assert lst.blocks() == b.keys(range(3))


def test_an_old_process_late_batches_after_its_restart_was_found_are_dropped(
        ctx: Any, zap: ZapAuthenticator, asked: list[int], compare: str) -> None:
    """A restart is found (B's batch above E, B's history replayed); then A's last live
    batches arrive late (A's connection, B's on another), numbered below B's E. They are
    older than B's last batch and B's replay matches what was applied: late, dropped,
    after one replay to check. Before, each was another restart: rank cleared and B's
    history replayed again."""
    with engine_and_tap(ctx, zap) as (lst, a, tap, reopen):
        a.publish(3)
        assert lst.source.catch_up() == 3
        stragglers = [tap.until(a, 3), *tap.take(a, 1)]  # A's, not yet handed over
        top = seq_of(stragglers[-1])
        b = reopen(B)
        lst.source.handle_frames(tap.until(b, top + 5))  # B's, above A's stragglers
        assert (lst.stats.restarts, lst.stats.resets) == (1, 1)
        assert lst.blocks() == b.keys(range(b.seq))
        replays, mark, duplicates = len(asked), len(lst.out), lst.stats.duplicates
        for message in stragglers:
            lst.source.handle_frames(message)
        assert (lst.stats.restarts, lst.stats.resets) == (1, 1)
        assert lst.stats.duplicates == duplicates + 2
        assert len(asked) == replays + 1  # the first one checked; the next one follows it
        assert lst.out[mark:] == [] and lst.blocks() == b.keys(range(b.seq))
        # B goes on in order
        lst.source.handle_frames(tap.until(b, b.seq))
        assert lst.blocks() == b.keys(range(b.seq)) and lst.stats.restarts == 1


def test_an_old_batch_is_a_restart_when_the_replay_is_another_publishers(
        ctx: Any, zap: ZapAuthenticator, asked: list[int], compare: str) -> None:
    """A batch numbered below E, no newer than the last applied and in no replay (A's
    batch 2 a second time, its copy already taken) could be late, so the replay is asked:
    the engine has restarted meanwhile (B), whose batches are not the ones applied: a
    restart, A's blocks go and B's whole history is indexed."""
    with engine_and_tap(ctx, zap) as (lst, a, _tap, reopen):
        a.publish(5)
        assert lst.source.catch_up() == 5
        old = published(ctx, a)
        lst.source.handle_frames(old[2])  # the live copy of a replayed batch: taken
        assert lst.stats.duplicates == 1 and lst.stats.restarts == 0
        b = reopen(B)
        b.publish(6)
        lst.source.handle_frames(old[2])
        assert (lst.stats.restarts, lst.stats.resets, lst.stats.duplicates) == (1, 1, 2)
        assert asked == [0, 0, 0]  # the check (from A's oldest kept), then B's history
        assert lst.blocks() == b.keys(range(6))


# -- a start-up replay without topics (vLLM <=0.25, SGLang <=0.5.21) ----------------------


@pytest.mark.parametrize("profile", ["vllm-0.22", "vllm-0.33"])
def test_a_start_up_replay_without_topics_becomes_the_live_topics_stream(
        ctx: Any, zap: ZapAuthenticator, asked: list[int], profile: str) -> None:
    """The engine publishes on topic ``kv``; the listener's filter is "" (every topic).
    vLLM 0.22 replays ``[seq, payload]``: the start-up replay's stream can only be keyed by
    the configured topic; the first live batch, on ``kv``, takes that state over and
    follows it in order (before, its stream started over: a first number above 0, a reset
    when the buffer had wrapped, the history replayed again). vLLM 0.33's replay names
    its topic."""
    with engine_and_tap(ctx, zap, profile=profile, topic=b"kv", buffer_steps=5) as (
            lst, a, tap, _reopen):
        tap.until(a, 0)
        a.publish(8)  # the buffer keeps the last 5
        assert lst.source.catch_up() == 5
        expected = a.seq
        assert lst.blocks() == a.keys(range(expected - 5, expected))
        for message in tap.take(a, 2):
            assert message[0] == b"kv"
            lst.source.handle_frames(message)
        stats = lst.stats
        assert (stats.resets, stats.sequence_gaps, stats.duplicates) == (0, 0, 0)
        assert asked == [0]
        assert list(lst.source._expected) == [(b"kv", 0)]
        assert lst.source.health()["sequence_streams"] == 1
        assert lst.blocks() == a.keys(range(expected - 5, expected + 2))
        assert lst.source._topicless == {}
