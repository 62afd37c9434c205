"""One backend, several data-parallel ranks: one ZMQ source takes every rank's stream.

A vLLM or SGLang engine run with data parallelism N behind one HTTP endpoint is one router
backend (the engine balances over its ranks; the backend's KV is the union of theirs), but
each rank publishes its own PUB stream, rank ``r`` on the configured endpoint offset by
``r`` (``docs/kv-events.md`` §1.1). These tests run real PUB sockets, one per rank at the
engines' own endpoints (``P`` and ``P + 1``, written out here rather than derived by the
listener's code), against one :class:`ZmqSource` with ``data_parallel_size: 2`` and the
real :class:`DefaultSourceProcessor`, in bind and in connect mode. Prefixes are attributed
through router-issued salts (vLLM's ``extra_keys``), so no ``/detokenize`` is involved.

A bound SUB only gets a connecting PUB's messages once its subscription has arrived (§1.4),
and a PUB that binds only sends to a SUB connected by then: each rank publishes no-op
heartbeats (a removal of an unknown hash) until the source has heard it, and the tests
assert on what follows. Ranks' messages travel on different connections, so a test waits
for each batch before sending one on another rank whenever their order matters.
"""

from __future__ import annotations

import contextlib
import functools
import socket
import time
from collections.abc import Iterator
from typing import Any

import gevent
import msgpack
import pytest
import zmq.green as zmq

from continuum.cache_salt import make_salt
from continuum.devtools import procs
from continuum.kv_events import BlockRemoved, BlockStored, KvEvent
from continuum.sim.kv_publish import ZmqKvPublisher
from continuum.sim.kv_wire import encode_zmq_payload
from listener.config import DetokenizeConfig, LimitsConfig, SourceConfig
from listener.model import CACHE_CLEARED, CACHE_CREATED, CACHE_EVICTED, PrefixEvent
from listener.processor import DefaultSourceProcessor
from listener.sources_zmq import ZapAuthenticator, ZmqSource

pytestmark = pytest.mark.timeout(120)

BACKEND = "vllm-dp"
SECRET = b"data-parallel-test-secret"
P, Q = "ab" * 32, "cd" * 32
HEARTBEAT = 0xDEAD  # a hash no rank ever stores: its removal changes nothing
PROFILE = "vllm-0.33"

wait_until = functools.partial(procs.wait_until, sleep=gevent.sleep, interval=0.02)


def free_port_run(count: int) -> int:
    """A port ``P`` with ``P .. P + count - 1`` all free on 127.0.0.1 (just now)."""
    for _ in range(200):
        with contextlib.ExitStack() as stack:
            first = stack.enter_context(socket.socket())
            first.bind(("127.0.0.1", 0))
            base: int = first.getsockname()[1]
            if base + count - 1 > 65535:
                continue
            try:
                for offset in range(1, count):
                    stack.enter_context(socket.socket()).bind(("127.0.0.1", base + offset))
            except OSError:
                continue
            return base
    raise RuntimeError(f"no run of {count} free ports")


def salted(hashes: tuple[int, ...], prefix: str, parent: int | None = None) -> BlockStored:
    """A vLLM store of 2-token blocks; a chain's first carries the router's salt."""
    extra = None if parent is not None else (
        (make_salt(SECRET, BACKEND, prefix),), *([None] * (len(hashes) - 1)))
    return BlockStored(hashes, parent, tuple(range(2 * len(hashes))), 2, medium="GPU",
                       extra_keys=extra)


def removed(*hashes: int) -> BlockRemoved:
    return BlockRemoved(hashes, medium="GPU")


class Rank:
    """One engine rank's PUB socket: binds or connects its own endpoint, numbers its
    batches from 0 and stamps its rank on each, as vLLM's publisher does."""

    def __init__(self, ctx: Any, rank: int, endpoint: str, *, bind: bool) -> None:
        self.rank = rank
        self.seq = 0
        self.sock = ctx.socket(zmq.PUB)
        self.sock.setsockopt(zmq.LINGER, 0)
        if bind:
            self.sock.bind(endpoint)
        else:
            self.sock.connect(endpoint)

    def send(self, *events: KvEvent) -> int:
        """Publish one batch with the next sequence number; that number."""
        seq = self.seq
        payload = encode_zmq_payload(list(events), PROFILE, ts=time.time(), dp_rank=self.rank)
        self.sock.send_multipart([b"", seq.to_bytes(8, "big"), payload])
        self.seq += 1
        return seq

    def close(self) -> None:
        self.sock.close(linger=0)


class Dp:
    """A ``data_parallel_size: 2`` source with the real processor, recording its output."""

    def __init__(self, ctx: Any, zap: ZapAuthenticator, endpoint: str, mode: str, *,
                 ranks: int = 2, replay: str | None = None,
                 allowed: tuple[str, ...] = ("127.0.0.1",)) -> None:
        self.config = SourceConfig(
            backend_name=BACKEND, engine="vllm", model="m", zmq_endpoint=endpoint,
            zmq_mode=mode, replay_endpoint=replay, data_parallel_size=ranks,
            allowed_publishers=allowed, require_salt=True)
        self.out: list[PrefixEvent] = []
        self.processor = DefaultSourceProcessor(self.config, LimitsConfig(), DetokenizeConfig(),
                                                emit=self.out.append, salt_secret=SECRET)
        self.source = ZmqSource(self.config, self.processor, context=ctx, zap=zap)

    def next_seq(self, rank: int) -> int | None:
        value: int | None = self.source.health()["ranks"][str(rank)]["next_seq"]
        return value

    def blocks(self) -> set[tuple[Any, int]]:
        return set(self.processor.tracker.blocks)

    def since(self, mark: int) -> list[PrefixEvent]:
        return self.out[mark:]

    def deliver(self, rank: Rank, *events: KvEvent) -> None:
        """Publish one batch on ``rank`` and wait until the source applied it."""
        seq = rank.send(*events)
        wait_until(lambda: self.next_seq(rank.rank) == seq + 1,
                   f"rank {rank.rank}'s batch {seq}")

    def hear(self, *ranks: Rank) -> None:
        """Heartbeats on every rank until the source has heard each of them."""
        for _ in range(500):
            waiting = [r for r in ranks if self.next_seq(r.rank) is None]
            if not waiting:
                break
            for rank in waiting:
                rank.send(removed(HEARTBEAT))
            gevent.sleep(0.02)
        for rank in ranks:
            self.caught_up(rank)

    def refused_beyond(self, count: int) -> None:
        """Wait until more than ``count`` publishers were refused."""
        wait_until(lambda: self.source.stats.rejected_publishers > count, "a refusal")

    def caught_up(self, rank: Rank) -> None:
        """Wait until the source has applied every batch ``rank`` sent."""
        wait_until(lambda: self.next_seq(rank.rank) == rank.seq, f"rank {rank.rank}")


@contextlib.contextmanager
def two_ranks(ctx: Any, zap: ZapAuthenticator, mode: str,
              replay: str | None = None) -> Iterator[tuple[Dp, Rank, Rank]]:
    """A started two-rank source and both ranks' PUB sockets, each heard by the source.
    Bind mode: the source binds ``P`` and ``P + 1`` and the ranks connect; connect mode:
    the ranks bind them and the source connects."""
    port = free_port_run(2)
    dp = Dp(ctx, zap, f"tcp://127.0.0.1:{port}", mode, replay=replay)
    ranks: list[Rank] = []
    try:
        if mode == "bind":
            dp.source.start()
        for r in (0, 1):
            ranks.append(Rank(ctx, r, f"tcp://127.0.0.1:{port + r}", bind=mode == "connect"))
        if mode == "connect":
            dp.source.start()
        dp.hear(*ranks)
        yield dp, ranks[0], ranks[1]
    finally:
        for rank in ranks:
            rank.close()
        dp.source.stop()


@pytest.mark.parametrize("mode", ["bind", "connect"])
def test_one_source_takes_both_ranks_streams(ctx: Any, zap: ZapAuthenticator,
                                             mode: str) -> None:
    """Rank 0 publishes on P, rank 1 on P + 1: both reach the one source, and each rank's
    copy of the same prefix is indexed under its own rank."""
    with two_ranks(ctx, zap, mode) as (dp, r0, r1):
        mark = len(dp.out)
        dp.deliver(r0, salted((11, 12), P))
        assert dp.since(mark) == [PrefixEvent(CACHE_CREATED, P, 4)]
        dp.deliver(r1, salted((11, 12), P), salted((21,), Q))
        assert dp.since(mark) == [PrefixEvent(CACHE_CREATED, P, 4),
                                  PrefixEvent(CACHE_CREATED, Q, 2)]
        assert dp.blocks() == {((0, None), 11), ((0, None), 12),
                             ((1, None), 11), ((1, None), 12), ((1, None), 21)}
        assert dp.processor.stats()["attributed_prefixes"] == 2
        health = dp.source.health()
        assert health["data_parallel_size"] == 2 and health["sequence_streams"] == 2
        assert [health["ranks"][r]["endpoint"] for r in ("0", "1")] == dp.source.endpoints
        ports = [int(e.rpartition(":")[2]) for e in dp.source.endpoints]
        assert ports[1] == ports[0] + 1
        assert (health["ranks"]["0"]["next_seq"], health["ranks"]["1"]["next_seq"]) == (
            r0.seq, r1.seq)
        wait_until(lambda: [dp.source.health()["ranks"][r]["peers"] for r in ("0", "1")]
                   == [1, 1], "one publisher per rank")
        assert dp.source.health()["peers"] == 2 and dp.source.connected
        stats = dp.source.stats
        assert (stats.decode_errors, stats.rejected_publishers, stats.restarts) == (0, 0, 0)
        # rank 1's engine goes away: that rank has no peer left, rank 0 still has its own
        r1.close()
        wait_until(lambda: dp.source.health()["ranks"]["1"]["peers"] == 0, "rank 1's peer gone")
        assert dp.source.health()["ranks"]["0"]["peers"] == 1 and dp.source.connected


@pytest.mark.parametrize("mode", ["bind", "connect"])
def test_a_removal_on_one_rank_keeps_the_other_ranks_copy(ctx: Any, zap: ZapAuthenticator,
                                                          mode: str) -> None:
    """Both ranks hold P under the same hashes; rank 1 evicts it: the router must still
    find P on the backend (rank 0 has it). It leaves only with rank 0's copy."""
    with two_ranks(ctx, zap, mode) as (dp, r0, r1):
        dp.deliver(r0, salted((11, 12), P))
        dp.deliver(r1, salted((11, 12), P))
        mark = len(dp.out)
        dp.deliver(r1, removed(12), removed(11))
        assert dp.since(mark) == []
        assert dp.blocks() == {((0, None), 11), ((0, None), 12)}
        assert dp.processor.stats()["attributed_prefixes"] == 1
        dp.deliver(r1, salted((11, 12), P))  # rank 1 caches it again: nothing new to say
        assert dp.since(mark) == []
        dp.deliver(r0, removed(11, 12))
        assert dp.since(mark) == []
        dp.deliver(r1, removed(11, 12))  # the last copy
        assert dp.since(mark) == [PrefixEvent(CACHE_EVICTED, P, 4)]
        assert dp.blocks() == set()


def test_a_gap_on_one_rank_clears_that_ranks_blocks_only(ctx: Any,
                                                        zap: ZapAuthenticator) -> None:
    """Rank 1 loses a batch (no replay endpoint): what rank 1 held goes (Q, held by rank 1
    only), what rank 0 holds stays (P), and no ``cache_cleared`` drops the backend. Later
    rank 1 restarts (its numbers go back to 0): the same again."""
    with two_ranks(ctx, zap, "bind") as (dp, r0, r1):
        dp.deliver(r0, salted((11, 12), P))
        dp.deliver(r1, salted((11, 12), P), salted((21,), Q))
        mark = len(dp.out)
        gaps, resets = dp.source.stats.sequence_gaps, dp.source.stats.resets
        r1.seq += 3  # three of rank 1's batches are lost on the way
        dp.deliver(r1, salted((31,), Q))
        assert dp.source.stats.sequence_gaps == gaps + 1
        assert dp.source.stats.resets == resets  # not the backend's state: one rank's
        assert dp.since(mark) == [PrefixEvent(CACHE_EVICTED, Q, 2),
                                  PrefixEvent(CACHE_CREATED, Q, 2)]
        assert dp.blocks() == {((0, None), 11), ((0, None), 12), ((1, None), 31)}
        assert CACHE_CLEARED not in {e.type for e in dp.out[mark:]}
        # rank 0's stream was not touched: its next batch is no gap
        dp.deliver(r0, salted((13,), P, parent=12))
        assert dp.source.stats.sequence_gaps == gaps + 1
        assert dp.since(mark)[2:] == [PrefixEvent(CACHE_CREATED, P, 6)]
        # rank 1 restarts: numbers from 0 again, its blocks go, rank 0's stay
        mark = len(dp.out)
        r1.seq = 0
        dp.deliver(r1, removed(HEARTBEAT))
        assert dp.source.stats.restarts == 1 and dp.source.stats.resets == resets
        assert dp.since(mark) == [PrefixEvent(CACHE_EVICTED, Q, 2)]
        assert dp.blocks() == {((0, None), 11), ((0, None), 12), ((0, None), 13)}


def frames(rank: int, seq: int, *events: KvEvent) -> list[bytes]:
    """The live message rank ``rank`` sends as its batch ``seq``."""
    payload = encode_zmq_payload(list(events), PROFILE, ts=time.time(), dp_rank=rank)
    return [b"", seq.to_bytes(8, "big"), payload]


def test_each_rank_is_replayed_from_its_own_replay_endpoint(ctx: Any,
                                                           zap: ZapAuthenticator) -> None:
    """The engines offset ``replay_endpoint`` per rank too: rank r's ROUTER, on R + r,
    holds rank r's buffer. At start the source asks both ranks' (an idle engine is known at
    once); a gap on rank 1 is filled from R + 1, so nothing is cleared and nothing applied
    twice. The publishers are the simulated engine's, which apply the offsets themselves."""
    port, replay = free_port_run(2), free_port_run(2)
    pubs = [ZmqKvPublisher(PROFILE, f"tcp://127.0.0.1:{port}", bind=True,
                           replay_endpoint=f"tcp://127.0.0.1:{replay}", dp_rank=r, context=ctx)
            for r in (0, 1)]
    dp = Dp(ctx, zap, f"tcp://127.0.0.1:{port}", "connect",
            replay=f"tcp://127.0.0.1:{replay}")
    try:
        assert [p.endpoint for p in pubs] == [f"tcp://127.0.0.1:{port + r}" for r in (0, 1)]
        assert [p.replay_endpoint for p in pubs] == [
            f"tcp://127.0.0.1:{replay + r}" for r in (0, 1)]
        for pub in pubs:
            pub.start_replay_server()
        pubs[0].publish([salted((11, 12), P)])  # before the listener starts, then idle
        pubs[1].publish([salted((11, 12), P)])
        pubs[1].publish([salted((21,), Q)])
        dp.source.start()
        wait_until(lambda: (dp.next_seq(0), dp.next_seq(1)) == (1, 2), "the start-up replays")
        assert dp.source.stats.replays == 2 and dp.source.stats.replay_failures == 0
        assert dp.blocks() == {((0, None), 11), ((0, None), 12),
                             ((1, None), 11), ((1, None), 12), ((1, None), 21)}
        assert dp.out == [PrefixEvent(CACHE_CREATED, P, 4), PrefixEvent(CACHE_CREATED, Q, 2)]
        dp.source.stop()  # from here on the test hands the source its live messages
        # rank 1's batches 2 and 3 are published; only 3 reaches the source
        pubs[1].publish([salted((31,), Q)])
        pubs[1].publish([salted((41,), Q)])
        dp.source.handle_frames(frames(1, 3, salted((41,), Q)))
        assert dp.source.stats.sequence_gaps == 1 and dp.source.stats.replays == 3
        assert dp.source.stats.duplicates == 1  # the replay from 2 brought 3 as well
        assert (dp.source.stats.resets, dp.source.stats.replay_failures) == (0, 0)
        assert (dp.next_seq(0), dp.next_seq(1)) == (1, 4)
        assert ((1, None), 31) in dp.blocks() and ((1, None), 41) in dp.blocks()
        assert ((1, None), 21) in dp.blocks() and ((0, None), 11) in dp.blocks()
        assert CACHE_CLEARED not in {e.type for e in dp.out}
        # rank 0's gap is asked from R, rank 0's own buffer
        pubs[0].publish([salted((13,), P, parent=12)])
        pubs[0].publish([removed(HEARTBEAT)])
        dp.source.handle_frames(frames(0, 2, removed(HEARTBEAT)))
        assert dp.source.stats.replays == 4 and dp.source.stats.resets == 0
        assert (dp.next_seq(0), dp.next_seq(1)) == (3, 4)
        assert ((0, None), 13) in dp.blocks()
        assert dp.out[-1] == PrefixEvent(CACHE_CREATED, P, 6)
    finally:
        dp.source.stop()
        for pub in pubs:
            pub.close()


def test_the_start_up_replays_hold_a_few_ranks_replies_at_a_time(
        ctx: Any, zap: ZapAuthenticator, monkeypatch: pytest.MonkeyPatch) -> None:
    """At most ``STARTUP_REPLAYS_AT_ONCE`` (here 2) ranks' start-up replays are asked at a
    time and each reply is applied as it comes, so at most that many are held; the ranks
    are asked concurrently (a rank that does not answer costs the timeout once per that
    many, where asking one after another cost it per rank); every replay's DEALER gets the
    source's ``limits.max_message_bytes``. (At first every rank's reply was fetched at once
    and held until all had arrived; then one rank at a time.)"""
    import listener.sources_zmq as sources_zmq

    ranks = 5
    port, replay = free_port_run(ranks), free_port_run(ranks)
    pubs = [ZmqKvPublisher(PROFILE, f"tcp://127.0.0.1:{port}", bind=True,
                           replay_endpoint=f"tcp://127.0.0.1:{replay}", dp_rank=r, context=ctx)
            for r in range(ranks)]
    dp = Dp(ctx, zap, f"tcp://127.0.0.1:{port}", "connect", ranks=ranks,
            replay=f"tcp://127.0.0.1:{replay}")
    asked: set[int] = set()
    held: set[int] = set()  # asked, and not yet applied in full
    most = [0]
    real_fetch, real_handle = sources_zmq.fetch_replay, dp.processor.handle_batch

    def fetch(context: Any, endpoint: str, start: int, **kw: Any) -> Any:
        assert kw["max_message_bytes"] == dp.source.max_message_bytes
        rank = int(endpoint.rpartition(":")[2]) - replay
        asked.add(rank)
        held.add(rank)
        most[0] = max(most[0], len(held))
        return real_fetch(context, endpoint, start, **kw)

    def handle(batch: Any) -> None:
        real_handle(batch)
        if HEARTBEAT in getattr(batch.events[-1], "block_hashes", ()):
            held.discard(batch.data_parallel_rank)  # its reply's last batch

    monkeypatch.setattr(sources_zmq, "STARTUP_REPLAYS_AT_ONCE", 2)
    monkeypatch.setattr(sources_zmq, "fetch_replay", fetch)
    monkeypatch.setattr(dp.processor, "handle_batch", handle)
    try:
        for pub in pubs:
            pub.start_replay_server()
            pub.publish([salted((10 + pub.dp_rank,), P)])
            pub.publish([removed(HEARTBEAT)])
        assert dp.source.catch_up() == 2 * ranks
        assert asked == set(range(ranks)) and held == set()
        assert most[0] == 2  # two at a time: concurrent, and never more
        assert dp.source.stats.replays == ranks and dp.source.stats.replay_failures == 0
        assert [dp.next_seq(r) for r in range(ranks)] == [2] * ranks
    finally:
        dp.source.stop()
        for pub in pubs:
            pub.close()


def test_allowed_publishers_guard_every_ranks_endpoint(ctx: Any,
                                                      zap: ZapAuthenticator) -> None:
    """The ZAP domain is the socket's, so it guards rank 1's port as it does rank 0's: a
    publisher from an address outside ``allowed_publishers`` (here 127.0.0.1 itself, the
    source allowing only 10.0.0.7) is refused at the handshake on either port."""
    port = free_port_run(2)
    dp = Dp(ctx, zap, f"tcp://127.0.0.1:{port}", "bind", allowed=("10.0.0.7",))
    try:
        dp.source.start()
        for r in (1, 0):
            before = dp.source.stats.rejected_publishers
            publisher = Rank(ctx, r, f"tcp://127.0.0.1:{port + r}", bind=False)
            try:
                for _ in range(250):
                    publisher.send(salted((21,), Q))
                    gevent.sleep(0.02)
                    if dp.source.stats.rejected_publishers > before:
                        break
                dp.refused_beyond(before)
            finally:
                publisher.close()
            gevent.sleep(0.1)  # a refused peer's reconnect attempts end with its socket
        assert dp.source.stats.batches == 0 and dp.source.stats.decode_errors == 0
        health = dp.source.health()
        assert (health["ranks"]["0"]["peers"], health["ranks"]["1"]["peers"]) == (0, 0)
        assert (dp.next_seq(0), dp.next_seq(1)) == (None, None)
    finally:
        dp.source.stop()


def test_one_rank_keeps_its_keys_and_behaviour(ctx: Any, zap: ZapAuthenticator) -> None:
    """``data_parallel_size: 1`` (the default) is the source as before: blocks keyed
    ``(group_idx, hash)`` whatever rank the batches carry, one endpoint, a gap resets the
    backend, and the health document has no per-rank part."""
    dp = Dp(ctx, zap, "tcp://127.0.0.1:1", "bind", ranks=1)
    assert dp.source.endpoints == ["tcp://127.0.0.1:1"]
    dp.source.handle_frames(frames(3, 0, salted((11, 12), P)))
    assert dp.blocks() == {(None, 11), (None, 12)}
    assert dp.out == [PrefixEvent(CACHE_CREATED, P, 4)]
    dp.source.handle_frames(frames(3, 5, removed(11, 12)))  # a gap: the backend is reset
    assert dp.source.stats.resets == 1
    assert dp.out[1:] == [PrefixEvent(CACHE_CLEARED)]
    health = dp.source.health()
    assert "ranks" not in health and "data_parallel_size" not in health


def test_a_rank_lost_twice_at_once_is_cleared_once(ctx: Any, zap: ZapAuthenticator) -> None:
    """Without a replay endpoint, rank 1's numbers go back from 5 to 3: a restart, and its
    first number after it is not 0, lost state too. That rank is cleared once, not twice
    (like two resets with nothing applied between), and the router hears one
    ``cache_cleared`` (rank 1 held the backend's only blocks). A rank is cleared again
    once a batch of it was applied since; another rank's clear is not held back."""
    dp = Dp(ctx, zap, "tcp://127.0.0.1:1", "bind")
    clears: list[int | None] = []
    real = dp.processor.handle_batch

    def handle(batch: Any) -> None:
        if any(type(e).__name__ == "AllBlocksCleared" for e in batch.events):
            clears.append(batch.data_parallel_rank)
        real(batch)

    dp.processor.handle_batch = handle  # type: ignore[method-assign]
    for seq in range(5):
        dp.source.handle_frames(frames(1, seq, salted((11 + seq,), Q) if seq == 0 else
                                       salted((11 + seq,), Q, parent=10 + seq)))
    assert dp.blocks() == {((1, None), 11 + s) for s in range(5)}
    mark = len(dp.out)
    dp.source.handle_frames(frames(1, 3, salted((31,), P)))
    stats = dp.source.stats
    assert (stats.restarts, stats.sequence_gaps, stats.resets) == (1, 1, 0)
    assert clears == [1]
    assert dp.since(mark) == [PrefixEvent(CACHE_CLEARED), PrefixEvent(CACHE_CREATED, P, 2)]
    assert dp.blocks() == {((1, None), 31)}
    # rank 1's batch 3 was applied: a later loss clears it again; rank 0's own clear too
    dp.source.handle_frames(frames(0, 0, salted((41,), Q)))
    dp.source.handle_frames(frames(1, 9, removed(HEARTBEAT)))
    dp.source.handle_frames(frames(0, 4, removed(HEARTBEAT)))
    assert clears == [1, 1, 0] and stats.resets == 0
    assert dp.blocks() == set()


def test_a_malformed_removal_clears_its_rank_after_its_batch(ctx: Any,
                                                            zap: ZapAuthenticator) -> None:
    """A malformed ``BlockRemoved`` on rank 1 lost a removal: the blocks it removed are
    unknown, and skipped they would stay indexed for good. The batch's other events are
    applied, then rank 1's blocks are cleared (rank 0's stay: no reset of the backend), as
    for a TensorRT-LLM ``malformed-removal``; its number counts (no gap after it). A
    malformed store beside it removed nothing: that costs only itself."""
    dp = Dp(ctx, zap, "tcp://127.0.0.1:1", "bind")
    dp.source.handle_frames(frames(0, 0, salted((11,), P)))
    dp.source.handle_frames(frames(1, 0, salted((21, 22), Q)))
    message = frames(1, 1, salted((23,), Q, parent=22))
    body = msgpack.unpackb(message[2])
    body[1].append(["BlockStored", [True], None, [1], 2])  # a bad store: only itself
    body[1].append(["BlockRemoved", [21, 22], 7])  # a medium that is not a string
    dp.source.handle_frames([message[0], message[1], msgpack.packb(body)])
    stats = dp.source.stats
    assert (stats.malformed_events, stats.sequence_gaps, stats.resets) == (2, 0, 0)
    assert dp.blocks() == {((0, None), 11)}
    assert dp.out[-2:] == [PrefixEvent(CACHE_CREATED, Q, 6), PrefixEvent(CACHE_EVICTED, Q, 6)]
    dp.source.handle_frames(frames(1, 2, salted((31,), Q)))  # the next: in order
    assert stats.sequence_gaps == 0 and dp.blocks() == {((0, None), 11), ((1, None), 31)}
    # a malformed store alone clears nothing
    message = frames(0, 1, salted((12,), P, parent=11))
    body = msgpack.unpackb(message[2])
    body[1].append(["BlockStored", [True], None, [1], 2])
    dp.source.handle_frames([message[0], message[1], msgpack.packb(body)])
    assert dp.blocks() == {((0, None), 11), ((0, None), 12), ((1, None), 31)}
