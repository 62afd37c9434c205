"""Listener sources over real sockets: simulated engines, ZMQ publishers, trtllm-serve polls.

The processor here is a stub implementing the ``SourceProcessor`` protocol (one
``cache_created`` per stored block hash, ``cache_evicted`` per removed one, ``cache_cleared``
on reset), so these tests see exactly what the sources hand over. Every wait is bounded by a
deadline and yields to gevent (``gevent.sleep``) so the source greenlets run; nothing asserts
on time. A bound SUB only gets a connecting PUB's messages once its subscription has arrived
(``docs/kv-events.md`` §1.4), so tests publish until a first batch arrives and assert on what
follows.
"""

from __future__ import annotations

import contextlib
import errno
import functools
import http.server
import json
import logging
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import gevent
import msgpack
import pytest
import requests
import zmq.green as zmq

from continuum.devtools import procs
from continuum.devtools.procs import Child, free_port, free_port_block, wait_http
from continuum.kv_events import AllBlocksCleared, BlockRemoved, BlockStored, KvEvent, KvEventBatch
from continuum.sim.hashing import block_hash_chain, hasher_for
from continuum.sim.kv_publish import ZmqKvPublisher
from continuum.sim.kv_wire import encode_zmq_payload
from listener.config import LimitsConfig, ListenerConfig, SourceConfig
from listener.hub import EventHub
from listener.model import CACHE_CLEARED, CACHE_CREATED, CACHE_EVICTED, Emit, PrefixEvent
from listener.server import ListenerCollector
from listener.sources_trtllm import TrtllmSource
from listener.sources_zmq import (
    REFUSED_PEERS_NAMED,
    ZapAuthenticator,
    ZmqSource,
    zmq_endpoint_host,
    zmq_source_issues,
)

pytestmark = pytest.mark.timeout(120)

BACKEND = "b1"
SIM = [sys.executable, "-m", "continuum.sim.cli", "--fast"]
WORDS = "the listener turns engine block events into prefix events for the router " * 3


class StubProcessor:
    """Records batches and resets; emits one prefix event per block hash."""

    def __init__(self, emit: Emit, *, fail_on: int | None = None) -> None:
        self.emit = emit
        self.batches: list[KvEventBatch] = []
        self.resets: list[str] = []
        self.fail_on = fail_on

    def handle_batch(self, batch: KvEventBatch) -> None:
        if self.fail_on is not None and batch.seq == self.fail_on:
            raise RuntimeError("boom")
        self.batches.append(batch)
        for event in batch.events:
            if isinstance(event, BlockStored):
                for h in event.block_hashes:
                    assert isinstance(h, int)
                    self.emit(PrefixEvent(CACHE_CREATED, f"{h:064x}", event.block_size))
            elif isinstance(event, BlockRemoved):
                for h in event.block_hashes:
                    assert isinstance(h, int)
                    self.emit(PrefixEvent(CACHE_EVICTED, f"{h:064x}"))
            else:
                self.emit(PrefixEvent(CACHE_CLEARED))

    def reset(self, reason: str) -> None:
        self.resets.append(reason)
        self.emit(PrefixEvent(CACHE_CLEARED))

    def stats(self) -> dict[str, int]:
        return {"tracked_blocks": len(self.batches), "mismatched_blocks": 0}

    def seqs(self, rank: int | None = 0) -> list[int]:
        return [b.seq for b in self.batches if b.data_parallel_rank == rank and b.seq is not None]

    def stored(self) -> list[BlockStored]:
        return [e for b in self.batches for e in b.events if isinstance(e, BlockStored)]


#: Waits yield to gevent (``gevent.sleep``), so the server greenlets in this thread run.
wait_until = functools.partial(procs.wait_until, sleep=gevent.sleep, interval=0.02)


def zmq_config(endpoint: str, mode: str = "bind", *, engine: str = "vllm",
               allowed: tuple[str, ...] = ("127.0.0.1",), replay: str | None = None,
               topic: str = "", name: str = BACKEND) -> SourceConfig:
    return SourceConfig(backend_name=name, engine=engine, model="sim-model",
                        zmq_endpoint=endpoint, zmq_mode=mode, zmq_topic=topic,
                        replay_endpoint=replay, allowed_publishers=allowed,
                        detokenize_endpoint="http://127.0.0.1:9/detokenize")


def trtllm_config(url: str, allowed: tuple[str, ...] = ("127.0.0.1",)) -> SourceConfig:
    return SourceConfig(backend_name=BACKEND, engine="trtllm", model="sim-model",
                        trtllm_endpoint=url, trtllm_poll_interval_ms=10,
                        allowed_publishers=allowed)


def stream_events(hub: EventHub, since: str) -> list[tuple[str, str | None]]:
    """``(event, prefix_hash)`` of the records after ``since`` (a hub id), from history."""
    stream = hub.stream(BACKEND, since, keepalive=0.01)
    try:
        chunk = next(stream)
    finally:
        stream.close()
    out = []
    for block in chunk.decode().split("\n\n"):
        data = [ln[len("data: "):] for ln in block.split("\n") if ln.startswith("data: ")]
        if data:
            doc = json.loads(data[0])
            out.append((doc["event"], doc.get("prefix_hash")))
    return out


@pytest.fixture
def hub() -> EventHub:
    return EventHub([BACKEND, "other"], epoch="e1")


class Sim:
    """A ``continuum-sim`` engine process; stopped by its PID."""

    def __init__(self, tmp: Path, *args: str, port: int | None = None) -> None:
        self.port = port or free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.proc = Child([*SIM, "--port", str(self.port), *args],
                          log=tmp / f"sim-{time.monotonic_ns()}.log")
        try:
            wait_http(self.url + "/health", children=[self.proc])
        except BaseException:
            self.proc.stop()
            raise

    def complete(self, prompt: str) -> None:
        resp = requests.post(self.url + "/v1/completions",
                             json={"prompt": prompt, "max_tokens": 1}, timeout=10)
        resp.raise_for_status()

    def tokens(self, prompt: str) -> list[int]:
        resp = requests.post(self.url + "/tokenize", json={"prompt": prompt}, timeout=10)
        resp.raise_for_status()
        return list(resp.json()["tokens"])

    def stop(self) -> int | None:
        self.proc.stop()
        return self.proc.returncode


# -- simulated vLLM / SGLang engines, both socket modes ------------------------------------


@pytest.mark.parametrize("mode", ["bind", "connect"])
@pytest.mark.parametrize(("engine", "profile"), [
    ("vllm", "vllm-0.22"), ("vllm", "vllm-0.33"),
    ("sglang", "sglang-0.5.9"), ("sglang", "sglang-0.5.22"),
])
def test_simulated_engine_events_reach_the_processor(
        tmp_path: Path, ctx: Any, zap: ZapAuthenticator, hub: EventHub,
        engine: str, profile: str, mode: str) -> None:
    endpoint = f"tcp://127.0.0.1:{free_port()}"
    processor = StubProcessor(hub.publisher(BACKEND))
    source = ZmqSource(zmq_config(endpoint, mode, engine=engine), processor, context=ctx,
                       zap=zap)
    engine_mode = "--zmq-connect" if mode == "bind" else "--zmq-bind"
    args = ["--engine", engine, "--zmq-endpoint", endpoint, engine_mode, "--kv-format", profile]
    sim: Sim | None = None
    try:
        if mode == "bind":
            source.start()
            sim = Sim(tmp_path, *args)
        else:
            sim = Sim(tmp_path, *args)
            source.start()
        for attempt in range(200):  # until the subscription has reached the engine's PUB
            sim.complete(f"warm-up {attempt}: {WORDS}")
            gevent.sleep(0.05)
            if processor.batches:
                break
        wait_until(lambda: bool(processor.batches), "a first batch")
        wait_until(lambda: source.connected, "the connection state")
        gevent.sleep(0.2)  # let the warm-up's last batches in before counting
        before = len(processor.batches)
        prompt = f"final {engine} {profile} {mode}: {WORDS}"
        sim.complete(prompt)
        wait_until(lambda: len(processor.batches) > before, "the final prompt's batches")
        wait_until(lambda: sum(len(e.block_hashes) for b in processor.batches[before:]
                               for e in b.events if isinstance(e, BlockStored))
                   >= len(sim.tokens(prompt)) // 16, "every block of the final prompt")
        stored = [e for b in processor.batches[before:] for e in b.events
                  if isinstance(e, BlockStored)]
        tokens = sim.tokens(prompt)
        full = len(tokens) // 16 * 16
        assert [t for e in stored for t in e.token_ids][:full] == tokens[:full]
        expected = block_hash_chain(hasher_for(profile), tokens, 16)
        assert [h for e in stored for h in e.block_hashes][:len(expected)] == expected
        seqs = processor.seqs()
        assert seqs == list(range(seqs[0], seqs[0] + len(seqs)))  # in order, no gap inside
        assert source.stats.decode_errors == 0
        assert source.stats.rejected_publishers == 0
        assert hub.counters(BACKEND).events_out[CACHE_CREATED] >= len(expected)
        health = source.health()
        assert health["state"] == "connected" and health["peers"] == 1
        assert "token" not in json.dumps(health)
    finally:
        source.stop()
        if sim is not None:
            assert sim.stop() == 0


# -- sequence numbers ----------------------------------------------------------------------


def frames(seq: int, events: list[KvEvent], *, profile: str = "vllm-0.33", rank: int = 0,
           topic: bytes = b"") -> list[bytes]:
    payload = encode_zmq_payload(events, profile, ts=time.time(), dp_rank=rank)
    return [topic, seq.to_bytes(8, "big"), payload]


def stored(h: int) -> list[KvEvent]:
    return [BlockStored((h,), None, tuple(range(16)), 16, medium="GPU")]


@contextlib.contextmanager
def heard_source(ctx: Any, zap: ZapAuthenticator,
                 hub: EventHub) -> Iterator[tuple[ZmqSource, StubProcessor, Any]]:
    """A started ZMQ source and a PUB socket connected to it that has published stores
    until the source heard one (a PUB drops what it sends before the connection is up)."""
    endpoint = f"tcp://127.0.0.1:{free_port()}"
    processor = StubProcessor(hub.publisher(BACKEND))
    source = ZmqSource(zmq_config(endpoint), processor, context=ctx, zap=zap)
    pub = ctx.socket(zmq.PUB)
    pub.setsockopt(zmq.LINGER, 0)
    try:
        source.start()
        pub.connect(endpoint)
        seq = 0
        while not processor.batches and seq < 500:  # an engine publishing until we hear it
            pub.send_multipart(frames(seq, stored(1000 + seq)))
            seq += 1
            gevent.sleep(0.02)
        wait_until(lambda: bool(processor.batches), "a first batch")
        gevent.sleep(0.1)
        yield source, processor, pub
    finally:
        pub.close(linger=0)
        source.stop()


def test_sequence_gap_over_a_socket_clears_the_stream(
        ctx: Any, zap: ZapAuthenticator, hub: EventHub) -> None:
    with heard_source(ctx, zap, hub) as (source, processor, pub):
        first = processor.seqs()[0]
        # a first sequence number > 0 is lost state too (nothing before it was seen)
        assert (source.stats.sequence_gaps, len(processor.resets)) == (
            (1, 1) if first > 0 else (0, 0))
        gaps, resets, mark = source.stats.sequence_gaps, len(processor.resets), hub.latest_id(
            BACKEND)
        last = processor.seqs()[-1]
        for n in (last + 1, last + 2, last + 5):
            pub.send_multipart(frames(n, stored(n)))
        wait_until(lambda: processor.seqs()[-1] == last + 5, "the batch after the gap")
        assert source.stats.sequence_gaps == gaps + 1
        assert len(processor.resets) == resets + 1
        assert "sequence gap: expected" in processor.resets[-1]
        assert stream_events(hub, mark) == [
            (CACHE_CREATED, f"{last + 1:064x}"), (CACHE_CREATED, f"{last + 2:064x}"),
            (CACHE_CLEARED, None), (CACHE_CREATED, f"{last + 5:064x}")]


def test_sequence_table_without_replay(ctx: Any, zap: ZapAuthenticator, hub: EventHub) -> None:
    processor = StubProcessor(hub.publisher(BACKEND), fail_on=5)
    source = ZmqSource(zmq_config("tcp://127.0.0.1:1"), processor, context=ctx, zap=zap)
    for seq in (0, 1):
        source.handle_frames(frames(seq, stored(seq)))
    assert processor.resets == []
    source.handle_frames(frames(0, stored(0)))  # back to 0 without a replay: a restart
    assert source.stats.restarts == 1 and "went back from 2 to 0" in processor.resets[-1]
    for seq in (1, 2):
        source.handle_frames(frames(seq, stored(seq)))
    # back to 1: a restart, and 1 > 0 is also lost state: one reset covers both
    source.handle_frames(frames(1, stored(1)))
    assert (source.stats.restarts, source.stats.sequence_gaps) == (2, 1)
    assert len(processor.resets) == 2
    source.handle_frames([b"", (2).to_bytes(8, "big"), b"\xc1not msgpack"])
    source.handle_frames([b"", b"\x00"])
    assert source.stats.decode_errors == 2
    source.handle_frames(frames(3, stored(3)))  # the malformed 2 left a hole: lost state
    assert source.stats.sequence_gaps == 2 and len(processor.resets) == 3
    assert "expected 2, got 3" in processor.resets[-1]
    # topics and data-parallel ranks are numbered separately
    source.handle_frames(frames(0, stored(50), rank=1))
    source.handle_frames(frames(0, stored(60), topic=b"kv@1"))
    source.handle_frames(frames(4, stored(4)))
    assert len(processor.resets) == 3
    source.handle_frames(frames(5, stored(5)))  # the processor fails: counted, reset
    assert source.stats.processor_errors == 1 and "processor error" in processor.resets[-1]
    assert processor.seqs() == [0, 1, 0, 1, 2, 1, 3, 0, 4]
    assert source.stats.batches == 11  # the failed batch was handed over too
    assert "token" not in json.dumps(source.health())


def test_a_malformed_event_costs_only_itself_over_a_socket(
        ctx: Any, zap: ZapAuthenticator, hub: EventHub) -> None:
    """A batch with one bad event (a ``BlockStored`` whose hashes are booleans) beside a
    good store: the store is applied, the bad event counted, and the next batch is no gap
    (before, the whole batch was refused and the next one reset the backend)."""
    with heard_source(ctx, zap, hub) as (source, processor, pub):
        last, resets = processor.seqs()[-1], len(processor.resets)
        gaps = source.stats.sequence_gaps
        good = frames(last + 1, stored(7))
        events = msgpack.unpackb(good[2])
        events[1].append({"type": "BlockStored", "block_hashes": [True], "token_ids": [1],
                          "block_size": 1})
        pub.send_multipart([good[0], good[1], msgpack.packb(events)])
        pub.send_multipart(frames(last + 2, stored(8)))
        wait_until(lambda: processor.seqs()[-1] == last + 2, "the batch after the bad event")
        assert processor.seqs()[-2:] == [last + 1, last + 2]
        assert (source.stats.malformed_events, source.stats.decode_errors) == (1, 0)
        assert (source.stats.sequence_gaps, len(processor.resets)) == (gaps, resets)


@pytest.mark.parametrize("bad", [
    {"type": "BlockRemoved", "block_hashes": [True]},  # a removal whose hashes are booleans
    ["BlockRemoved", [7], 3],  # an array removal whose medium is not a string
    {"type": 3, "block_hashes": [7]},  # a tag that cannot be read
])
def test_a_malformed_removal_over_a_socket_resets_after_its_batch(
        ctx: Any, zap: ZapAuthenticator, hub: EventHub, bad: Any) -> None:
    """A malformed removal lost the removal of blocks the index may hold: skipped like a
    bad store, they would stay indexed for good (the engine dropped them). The batch's
    other events are applied, then the backend is reset (one rank: the whole backend), as
    for a TensorRT-LLM ``malformed-removal``; its number counts, so the next batch is no
    gap and no second reset."""
    with heard_source(ctx, zap, hub) as (source, processor, pub):
        last, resets = processor.seqs()[-1], len(processor.resets)
        gaps = source.stats.sequence_gaps
        mark = hub.latest_id(BACKEND)
        good = frames(last + 1, stored(7))
        events = msgpack.unpackb(good[2])
        events[1].append(bad)
        pub.send_multipart([good[0], good[1], msgpack.packb(events)])
        pub.send_multipart(frames(last + 2, stored(8)))
        wait_until(lambda: processor.seqs()[-1] == last + 2, "the batch after the bad event")
        assert processor.seqs()[-2:] == [last + 1, last + 2]
        assert (source.stats.malformed_events, source.stats.decode_errors) == (1, 0)
        assert source.stats.sequence_gaps == gaps
        assert len(processor.resets) == resets + 1
        assert "malformed removal" in processor.resets[-1]
        assert stream_events(hub, mark) == [
            (CACHE_CREATED, f"{7:064x}"), (CACHE_CLEARED, None), (CACHE_CREATED, f"{8:064x}")]


@pytest.mark.parametrize("profile", ["vllm-0.22", "vllm-0.33", "sglang-0.5.9", "sglang-0.5.22"])
def test_replay_fills_gaps_from_the_engines_router(
        ctx: Any, zap: ZapAuthenticator, hub: EventHub, profile: str) -> None:
    """The engine's ROUTER replays what the listener missed: no reset, nothing twice.

    The publisher is the simulator's in-process ``ZmqKvPublisher``; the test's own SUB
    receives its messages and hands them to the source, leaving some out to make gaps.
    """
    pub = ZmqKvPublisher(profile, "tcp://127.0.0.1:0", bind=True,
                         replay_endpoint="tcp://127.0.0.1:0", context=ctx)
    pub.start_replay_server()
    assert pub.replay_endpoint is not None
    sub = ctx.socket(zmq.SUB)
    sub.setsockopt(zmq.LINGER, 0)
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    processor = StubProcessor(hub.publisher(BACKEND))
    source = ZmqSource(zmq_config("tcp://127.0.0.1:1", replay=pub.replay_endpoint),
                       processor, context=ctx, zap=zap)
    try:
        for n in range(5):  # published before anyone listens: only the replay has them
            pub.publish(stored(n))
        sub.connect(pub.endpoint)
        received: list[list[bytes]] = []
        n = 5
        while not received and n < 500:
            pub.publish(stored(n))
            n += 1
            if sub.poll(20):
                received.append(sub.recv_multipart())
        assert received, "the subscription never reached the publisher"
        source.handle_frames(received[0])  # first seq > 0: replay from 0
        assert source.stats.replays == 1
        assert processor.seqs() == list(range(n))
        for m in range(n, n + 6):
            pub.publish(stored(m))
        live: list[list[bytes]] = []
        while len(live) < 6 and sub.poll(5000):
            live.append(sub.recv_multipart())
        assert len(live) == 6
        for i, message in enumerate(live):
            if i != 1:  # batch n+1 is lost on the way: n+2 shows the gap
                source.handle_frames(message)
        # the replay from n+1 brought n+1..n+5, so the live n+2..n+5 were duplicates (and
        # so was the first message, which the first replay included)
        assert processor.seqs() == list(range(n + 6))
        assert source.stats.replays == 2 and source.stats.duplicates == 1 + 4
        assert processor.resets == [] and source.stats.replay_failures == 0
        assert [e.block_hashes[0] for e in processor.stored()] == list(range(n + 6))
        # a restarted engine (sequence back to 0, outside the replayed range) still resets
        restarted = ZmqKvPublisher(profile, "tcp://127.0.0.1:0", bind=True, context=ctx)
        try:
            source.handle_frames(frames(0, stored(99), profile=profile))
        finally:
            restarted.close()
        assert source.stats.restarts == 1 and len(processor.resets) == 1
    finally:
        source.stop()
        sub.close(linger=0)
        pub.close()


def test_replay_that_cannot_cover_the_gap_resets(
        ctx: Any, zap: ZapAuthenticator, hub: EventHub) -> None:
    pub = ZmqKvPublisher("vllm-0.33", "tcp://127.0.0.1:0", bind=True,
                         replay_endpoint="tcp://127.0.0.1:0", buffer_steps=2, context=ctx)
    pub.start_replay_server()
    assert pub.replay_endpoint is not None
    processor = StubProcessor(hub.publisher(BACKEND))
    source = ZmqSource(zmq_config("tcp://127.0.0.1:1", replay=pub.replay_endpoint),
                       processor, context=ctx, zap=zap)
    try:
        for n in range(6):  # the replay buffer keeps only 4 and 5
            pub.publish(stored(n))
        source.handle_frames(frames(5, stored(5)))
        assert processor.seqs() == [4, 5]
        assert len(processor.resets) == 1 and "replay has no batches 0..3" in processor.resets[0]
    finally:
        source.stop()
        pub.close()
    # a replay endpoint that never answers: counted, reset, the live batch applied
    silent = ctx.socket(zmq.ROUTER)
    silent.setsockopt(zmq.LINGER, 0)
    port = silent.bind_to_random_port("tcp://127.0.0.1")
    processor = StubProcessor(hub.publisher(BACKEND))
    source = ZmqSource(zmq_config("tcp://127.0.0.1:1", replay=f"tcp://127.0.0.1:{port}"),
                       processor, context=ctx, zap=zap)
    try:
        import listener.sources_zmq as sources_zmq

        with pytest.MonkeyPatch.context() as mp:
            mp.setattr(sources_zmq, "REPLAY_TIMEOUT", 0.3)
            source.handle_frames(frames(3, stored(3)))
        assert source.stats.replay_failures == 1 and processor.seqs() == [3]
        assert len(processor.resets) == 1
    finally:
        source.stop()
        silent.close(linger=0)


class OutOfSockets:
    """A context that cannot make the first ``refuse`` DEALER sockets (replays'): EMFILE,
    as when the process is out of file descriptors; other sockets are ``ctx``'s."""

    def __init__(self, ctx: Any, refuse: int = 1_000_000) -> None:
        self.ctx = ctx
        self.refuse = refuse

    def socket(self, kind: int) -> Any:
        if kind == zmq.DEALER and self.refuse > 0:
            self.refuse -= 1
            raise zmq.ZMQError(errno.EMFILE)
        return self.ctx.socket(kind)


def test_a_replay_socket_that_cannot_be_made_fails_that_replay_only(
        ctx: Any, zap: ZapAuthenticator, hub: EventHub) -> None:
    """No socket for a replay (EMFILE) is a failed replay like a silent engine: counted,
    the stream reset and the live batch applied (before, the error escaped: counted as a
    processor error, the live batch dropped); at start-up, the other ranks are still asked."""
    pub = ZmqKvPublisher("vllm-0.33", "tcp://127.0.0.1:0", bind=True,
                         replay_endpoint="tcp://127.0.0.1:0", context=ctx)
    pub.start_replay_server()
    assert pub.replay_endpoint is not None
    processor = StubProcessor(hub.publisher(BACKEND))
    source = ZmqSource(zmq_config("tcp://127.0.0.1:1", replay=pub.replay_endpoint),
                       processor, context=OutOfSockets(ctx), zap=zap)
    try:
        for n in range(4):
            pub.publish(stored(n))
        source.handle_frames(frames(0, stored(0)))
        source.handle_frames(frames(3, stored(3)))  # 1 and 2 missed: a replay is needed
        stats = source.stats
        assert (stats.replays, stats.replay_failures, stats.processor_errors) == (1, 1, 0)
        assert processor.seqs() == [0, 3] and len(processor.resets) == 1
        assert "sequence gap: expected 1, got 3" in processor.resets[0]
    finally:
        source.stop()
        pub.close()
    # start-up: rank 0's or rank 1's replay gets no socket, the other rank's is applied
    port, replay = free_port_block(2), free_port_block(2)
    pubs = [ZmqKvPublisher("vllm-0.33", f"tcp://127.0.0.1:{port}", bind=True, dp_rank=r,
                           replay_endpoint=f"tcp://127.0.0.1:{replay}", context=ctx)
            for r in (0, 1)]
    config = SourceConfig(backend_name=BACKEND, engine="vllm", model="sim-model",
                          zmq_endpoint=f"tcp://127.0.0.1:{port}", zmq_mode="connect",
                          replay_endpoint=f"tcp://127.0.0.1:{replay}",
                          data_parallel_size=2, allowed_publishers=("127.0.0.1",))
    processor = StubProcessor(hub.publisher(BACKEND))
    source = ZmqSource(config, processor, context=OutOfSockets(ctx, refuse=1), zap=zap)
    try:
        for pub in pubs:
            pub.start_replay_server()
            pub.publish(stored(10 + pub.dp_rank))
        assert source.catch_up() == 1
        stats = source.stats
        assert (stats.replays, stats.replay_failures, stats.processor_errors) == (2, 1, 0)
        assert processor.seqs(0) + processor.seqs(1) == [0]
    finally:
        source.stop()
        for pub in pubs:
            pub.close()


# -- allowed_publishers --------------------------------------------------------------------


def _publisher(ctx: Any, source_ip: str, port: int, keep: list[Any]) -> Any:
    """A PUB socket connected from ``source_ip`` to 127.0.0.1:``port`` (its address is the
    one ZAP sees), added to ``keep`` for closing."""
    pub = ctx.socket(zmq.PUB)
    pub.setsockopt(zmq.LINGER, 0)
    keep.append(pub)
    pub.connect(f"tcp://{source_ip}:0;127.0.0.1:{port}")
    return pub


def _publish_until(pub: Any, cond: Callable[[], bool], rounds: int = 250) -> None:
    for seq in range(rounds):
        pub.send_multipart(frames(seq, stored(seq)))
        gevent.sleep(0.02)
        if cond():
            return


def test_zap_refuses_publishers_outside_allowed_publishers(ctx: Any, zap: ZapAuthenticator,
                                                            hub: EventHub) -> None:
    port = free_port()
    endpoint = f"tcp://127.0.0.1:{port}"
    processor = StubProcessor(hub.publisher(BACKEND))
    source = ZmqSource(zmq_config(endpoint, allowed=("127.0.0.2",)), processor, context=ctx,
                       zap=zap)
    publishers = []
    try:
        source.start()
        # from 127.0.0.1: refused at the handshake, nothing reaches the decoder
        pub = _publisher(ctx, "127.0.0.1", port, publishers)
        _publish_until(pub, lambda: source.stats.rejected_publishers > 0)
        wait_until(lambda: source.stats.rejected_publishers > 0, "the refusal")
        for seq in range(20):
            pub.send_multipart(frames(seq, stored(seq)))
        gevent.sleep(0.2)
        assert processor.batches == [] and source.stats.decode_errors == 0
        assert source.health()["peers"] == 0
        # from 127.0.0.2 (listed): delivered
        allowed = _publisher(ctx, "127.0.0.2", port, publishers)
        _publish_until(allowed, lambda: bool(processor.batches))
        wait_until(lambda: bool(processor.batches), "a batch from the allowed publisher")
    finally:
        for pub in publishers:
            pub.close(linger=0)
        source.stop()
    # the same publisher address, once listed, gets through (a new port: libzmq releases
    # the old one asynchronously)
    port = free_port()
    endpoint = f"tcp://127.0.0.1:{port}"
    processor = StubProcessor(hub.publisher("other"))
    source = ZmqSource(zmq_config(endpoint, allowed=("127.0.0.1",), name="other"), processor,
                       context=ctx, zap=zap)
    pub = ctx.socket(zmq.PUB)
    pub.setsockopt(zmq.LINGER, 0)
    try:
        source.start()
        pub.connect(f"tcp://127.0.0.1:0;127.0.0.1:{port}")
        _publish_until(pub, lambda: bool(processor.batches))
        wait_until(lambda: bool(processor.batches), "a batch from 127.0.0.1 once allowed")
        assert source.stats.rejected_publishers == 0
    finally:
        pub.close(linger=0)
        source.stop()


def test_a_connection_failing_its_handshake_beside_the_engine_leaves_its_peer_count(
        ctx: Any, zap: ZapAuthenticator, hub: EventHub) -> None:
    """A connection that opens before the engine's but ends its handshake after it (here a
    plain TCP client that never speaks ZMTP, as a port scan or a TCP health check; a
    refused publisher's handshake can end as late), then closes: the engine's success is
    not taken for the other connection's, so the engine stays counted (``peers`` 1,
    connected) while it streams, and 0 once it goes. A refused publisher beside it changes
    nothing either. (A handshake event names no connection: the engine's success used to
    be pinned on the oldest waiting connection, the TCP client's, and left with it.)"""
    import socket

    port = free_port()
    endpoint = f"tcp://127.0.0.1:{port}"
    processor = StubProcessor(hub.publisher(BACKEND))
    source = ZmqSource(zmq_config(endpoint, allowed=("127.0.0.2",)), processor, context=ctx,
                       zap=zap)
    sockets: list[Any] = []
    silent = None
    try:
        source.start()
        silent = socket.create_connection(("127.0.0.1", port), timeout=5)
        gevent.sleep(0.2)  # accepted (and reported) before the engine connects
        engine = _publisher(ctx, "127.0.0.2", port, sockets)
        _publish_until(engine, lambda: bool(processor.batches))
        wait_until(lambda: bool(processor.batches), "the engine's first batch")
        assert source.health()["peers"] == 1
        silent.close()  # its handshake fails now, after the engine's succeeded
        refused = _publisher(ctx, "127.0.0.1", port, sockets)
        samples = []
        seq = processor.seqs()[-1] + 1
        for _ in range(25):  # the engine streams on
            engine.send_multipart(frames(seq, stored(seq)))
            refused.send_multipart(frames(seq, stored(seq)))
            seq += 1
            gevent.sleep(0.02)
            samples.append(source.health()["peers"])
        assert source.stats.publisher_disconnects >= 1 and source.stats.rejected_publishers
        assert set(samples) == {1} and source.connected
        assert processor.seqs()[-1] == seq - 1
        engine.close(linger=0)
        wait_until(lambda: source.health()["peers"] == 0, "the engine's peer gone")
        assert not source.connected
    finally:
        if silent is not None:
            silent.close()
        for sock in sockets:
            sock.close(linger=0)
        source.stop()


def test_zap_answers_by_domain(ctx: Any) -> None:
    auth = ZapAuthenticator(ctx)
    refused: list[str] = []
    try:
        auth.register("d", frozenset({"10.0.0.1"}), any_local=False, on_reject=refused.append)
        auth.register("ipc", frozenset(), any_local=True, on_reject=refused.append)

        def ask(domain: bytes, address: bytes) -> bytes:
            return auth.answer([b"1.0", b"7", domain, address, b"", b"NULL"])[2]

        assert ask(b"d", b"10.0.0.1") == b"200"
        assert ask(b"d", b"10.0.0.2") == b"400"
        assert ask(b"ipc", b"") == b"200"
        assert ask(b"unknown", b"10.0.0.1") == b"400"
        assert auth.answer([b"2.0"])[2] == b"500"
        assert refused == ["10.0.0.2"]
    finally:
        auth.close()


def test_refused_publishers_are_named_in_a_bounded_number_of_warnings(
        ctx: Any, zap: ZapAuthenticator, hub: EventHub, caplog: pytest.LogCaptureFixture) -> None:
    """Peers from ever new addresses (an IPv6 scanner) are each refused and counted; the
    first ``REFUSED_PEERS_NAMED`` addresses are named in a warning each, then one warning
    says later ones are logged at debug level only. What the source keeps of them is
    bounded (before, one warned-about key per address, for good)."""
    source = ZmqSource(zmq_config(f"tcp://127.0.0.1:{free_port()}", allowed=("127.0.0.2",)),
                       StubProcessor(hub.publisher(BACKEND)), context=ctx, zap=zap)
    domain = f"continuum-kv/{BACKEND}".encode()
    try:
        source.start()
        with caplog.at_level(logging.DEBUG, logger="listener"):
            for i in range(3000):
                for _ in range(2):  # each address tries twice
                    reply = zap.answer([b"1.0", b"1", domain, f"2001:db8::{i:x}".encode(),
                                        b"", b"NULL"])
                    assert reply[2] == b"400"
    finally:
        source.stop()
    assert source.stats.rejected_publishers == 6000
    warned = [r.getMessage() for r in caplog.records
              if r.levelno == logging.WARNING and "refused a publisher" in r.getMessage()]
    assert len(warned) == REFUSED_PEERS_NAMED + 1
    assert all(f"from 2001:db8::{i:x} " in warned[i] for i in range(REFUSED_PEERS_NAMED))
    assert f"{2 * REFUSED_PEERS_NAMED + 1} refusals so far" in warned[-1]
    assert "debug level" in warned[-1]
    debug = [r for r in caplog.records if r.levelno == logging.DEBUG
             and f"refused a publisher from 2001:db8::{2999:x} " in r.getMessage()]
    assert len(debug) == 2  # a later address is still in the log, at debug level
    assert len(source._refused) == REFUSED_PEERS_NAMED and len(source._warned) <= 1


def test_connect_mode_host_must_be_allowed(ctx: Any) -> None:
    config = zmq_config("tcp://10.1.2.3:5557", "connect", allowed=("127.0.0.1",))
    [issue] = zmq_source_issues(config, "sources[0]")
    assert issue.path == "sources[0].zmq_endpoint" and "10.1.2.3" in issue.message
    with pytest.raises(ValueError, match="not in allowed_publishers"):
        ZmqSource(config, StubProcessor(lambda e: None), context=ctx)
    wildcard = zmq_config("tcp://*:5557", "connect")
    assert "wildcard" in zmq_source_issues(wildcard, "s")[0].message
    replay = zmq_config("tcp://*:5557", "bind", replay="tcp://10.9.9.9:5558")
    assert zmq_source_issues(replay, "s")[0].path == "s.replay_endpoint"
    assert zmq_source_issues(zmq_config("tcp://127.0.0.1:5557", "connect"), "s") == []
    assert zmq_source_issues(zmq_config("ipc:///tmp/kv", "connect"), "s") == []
    assert zmq_endpoint_host("tcp://[::1]:5557") == "::1"
    assert zmq_endpoint_host("tcp://127.0.0.2:0;10.0.0.1:5557") == "10.0.0.1"
    with pytest.raises(ValueError, match="ZapAuthenticator"):
        ZmqSource(zmq_config("tcp://127.0.0.1:5557"), StubProcessor(lambda e: None),
                  context=ctx)
    ListenerConfig()  # the config module itself stays importable without sockets


# -- trtllm-serve --------------------------------------------------------------------------


@contextlib.contextmanager
def polled(hub: EventHub, server: Any) -> Iterator[tuple[TrtllmSource, StubProcessor]]:
    """A TensorRT-LLM source polling ``server``'s ``/kv_cache_events`` by hand (``poll_once``)
    into a stub processor; the source, its session and the server closed at the end."""
    processor = StubProcessor(hub.publisher(BACKEND))
    session = requests.Session()
    source = TrtllmSource(trtllm_config(server.url + "/kv_cache_events"), processor,
                          session=session)
    try:
        yield source, processor
    finally:
        source.stop()
        session.close()
        server.close()


def test_trtllm_sim_is_polled_and_restarts_are_detected(tmp_path: Path, hub: EventHub) -> None:
    sim = Sim(tmp_path, "--engine", "trtllm")
    url = sim.url + "/kv_cache_events"
    processor = StubProcessor(hub.publisher(BACKEND))
    session = requests.Session()
    source = TrtllmSource(trtllm_config(url), processor, session=session)
    try:
        assert source.poll_once()  # [created]: the server's start, a reset
        assert source.stats.restarts == 1 and len(processor.resets) == 1
        sim.complete("trtllm one: " + WORDS)
        sim.complete("trtllm two: " + WORDS)
        assert source.poll_once()
        assert source.poll_once()  # an empty drain
        ids = processor.seqs(None)
        assert ids and ids == sorted(ids) and ids[0] == 1
        assert source.last_id is not None and source.last_id >= ids[-1]
        assert processor.stored() and source.stats.sequence_gaps == 0
        assert source.connected and source.health()["last_event_id"] == source.last_id
        # the server restarts on the same port: ids start again with ``created``
        port = sim.port
        assert sim.stop() == 0
        assert not source.poll_once() and source.stats.poll_errors == {"connect": 1}
        assert source.health()["state"] == "error"
        sim = Sim(tmp_path, "--engine", "trtllm", port=port)
        assert source.poll_once()
        assert source.stats.restarts == 2 and len(processor.resets) == 2
        assert "(re)started" in processor.resets[-1]
    finally:
        source.stop()
        session.close()
        assert sim.stop() == 0


def test_trtllm_source_runs_its_own_poll_loop(tmp_path: Path, hub: EventHub) -> None:
    sim = Sim(tmp_path, "--engine", "trtllm")
    processor = StubProcessor(hub.publisher(BACKEND))
    source = TrtllmSource(trtllm_config(sim.url + "/kv_cache_events"), processor)
    try:
        source.start()
        wait_until(lambda: source.connected, "a first successful poll")
        sim.complete("loop: " + WORDS)
        wait_until(lambda: bool(processor.stored()), "stored blocks")
        assert source.stats.polls >= 2
    finally:
        source.stop()
        assert sim.stop() == 0


class Scripted:
    """A tiny HTTP server answering each POST with the next scripted (status, headers, body)."""

    def __init__(self, replies: list[tuple[int, dict[str, str], Any]]) -> None:
        self.replies = list(replies)
        self.requests: list[str] = []
        outer = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                outer.requests.append(self.path)
                length = int(self.headers.get("Content-Length") or 0)
                self.rfile.read(length)
                status, headers, body = outer.replies.pop(0) if outer.replies else (
                    200, {}, [])
                data = json.dumps(body).encode()
                self.send_response(status)
                for key, value in headers.items():
                    self.send_header(key, value)
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            do_GET = do_POST

            def log_message(self, format: str, *args: Any) -> None:
                pass

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()
        self.thread.join(10)


def envelope(event_id: int, kind: str = "stored", h: int | None = None) -> dict[str, Any]:
    if kind == "created":
        data: dict[str, Any] = {"type": "created", "num_blocks_per_cache_level": [64, 0]}
    elif kind == "updated":
        data = {"type": "updated", "block_hash": h, "cache_level": None, "priority": None}
    else:
        data = {"type": "stored", "parent_hash": None, "blocks": [{
            "type": "stored_block", "block_hash": h if h is not None else event_id,
            "tokens": [{"type": "unique_token", "token_id": t, "token_extra_id": 0}
                       for t in range(4)], "cache_level": 0, "priority": 35}]}
    return {"event_id": event_id, "data": data}


def test_trtllm_ids_dedupe_gaps_and_backwards(hub: EventHub) -> None:
    server = Scripted([
        (200, {}, [envelope(0, "created"), envelope(1), envelope(2)]),
        (200, {}, [envelope(1), envelope(2), envelope(3), envelope(4, "updated", 3)]),
        (200, {}, [envelope(5)]),
        (200, {}, [envelope(8)]),  # 6 and 7 lost: a gap
        (200, {}, [envelope(2)]),  # before the previous reply: the server restarted
        (200, {}, "not a list"),
        (500, {}, {"error": "x"}),
    ])
    with polled(hub, server) as (source, processor):
        assert source.poll_once()
        assert processor.seqs(None) == [1] and len(processor.resets) == 1  # created: reset
        assert processor.batches[0].events == (
            BlockStored((1,), None, (0, 1, 2, 3), 4, medium="GPU", priority=35),
            BlockStored((2,), 1, (0, 1, 2, 3), 4, medium="GPU", priority=35),
        ) or len(processor.batches[0].events) == 2
        assert source.poll_once()  # 1, 2 repeated: dropped; 3 new; 4 updated: nothing
        assert source.stats.duplicates == 2 and processor.seqs(None) == [1, 3]
        assert source.poll_once()
        assert source.poll_once()
        assert source.stats.sequence_gaps == 1 and "gap: expected 6, got 8" in processor.resets[-1]
        assert source.poll_once()
        assert source.stats.restarts == 2 and "went back from 8 to 2" in processor.resets[-1]
        assert processor.seqs(None) == [1, 3, 5, 8, 2]
        assert not source.poll_once() and source.stats.decode_errors == 1
        assert not source.poll_once()
        assert source.stats.poll_errors == {"decode": 1, "status": 1}


def test_trtllm_first_poll_mid_stream_is_lost_state(hub: EventHub) -> None:
    server = Scripted([(200, {}, [envelope(40), envelope(41)])])
    with polled(hub, server) as (source, processor):
        assert source.poll_once()
        assert processor.seqs(None) == [40] and len(processor.resets) == 1
        assert "first event id is 40" in processor.resets[0]


def test_trtllm_a_malformed_event_costs_only_itself_over_http(hub: EventHub) -> None:
    """A reply with one bad event (a ``stored`` whose hash is a boolean) beside good
    stores: the stores are applied, the bad event counted, and its id still counts, so the
    next reply is no gap (before, the whole reply was refused and, the drain being
    destructive, its stores were lost for good). A bad ``removed`` is not skipped silently:
    the blocks it removed would stay indexed for good, so the source resets (the events
    before it applied first, those after it too, and no gap)."""
    bad = envelope(2)
    bad["data"]["blocks"][0]["block_hash"] = True
    lost = {"event_id": 5, "data": {"type": "removed", "block_hashes": [True]}}
    server = Scripted([(200, {}, [envelope(0, "created"), envelope(1), bad, envelope(3)]),
                       (200, {}, [envelope(4), lost, envelope(6)])])
    with polled(hub, server) as (source, processor):
        assert source.poll_once()
        assert [e.block_hashes for e in processor.stored()] == [(1,), (3,)]
        assert (source.stats.malformed_events, source.stats.decode_errors) == (1, 0)
        assert (source.stats.sequence_gaps, len(processor.resets)) == (0, 1)  # created's
        assert source.poll_once()
        assert [e.block_hashes for e in processor.stored()] == [(1,), (3,), (4,), (6,)]
        assert source.stats.malformed_events == 2 and len(processor.resets) == 2
        assert "event 5 is a malformed removal" in processor.resets[-1]
        assert processor.seqs(None)[-2:] == [4, 6]  # 4 before the reset, 6 after it
        assert source.stats.sequence_gaps == 0
        assert source.last_id == 6 and source.stats.poll_errors == {}


def test_trtllm_attention_dp_ranks_have_their_own_ids_over_http(hub: EventHub) -> None:
    """Rank 0 forwards rank 1's events in its replies, each rank counting from its own 0:
    batches go out per rank with their rank, and no rank's ids read as another's gap or
    restart (one ``last_id`` for all ranks reset the backend on nearly every reply)."""
    def on(rank: int, doc: dict[str, Any]) -> dict[str, Any]:
        return {**doc, "attention_dp_rank": rank}

    server = Scripted([
        (200, {}, [on(0, envelope(0, "created")), on(0, envelope(1, h=10)),
                   on(0, envelope(2, h=11)), on(1, envelope(0, "created")),
                   on(1, envelope(1, h=20))]),
        (200, {}, [on(1, envelope(2, h=21)), on(0, envelope(3, h=12))]),
    ])
    with polled(hub, server) as (source, processor):
        assert source.poll_once() and source.poll_once()
        # rank 1's created clears rank 1's blocks only: a batch of that rank, no reset
        assert [(b.data_parallel_rank, b.seq) for b in processor.batches] == [
            (0, 1), (1, None), (1, 1), (1, 2), (0, 3)]
        assert processor.batches[1].events == (AllBlocksCleared(),)
        assert len(processor.resets) == 1  # the source's first event only
        assert (source.stats.sequence_gaps, source.stats.restarts) == (0, 2)
        assert source.health()["last_event_ids"] == {"0": 3, "1": 2}


def test_trtllm_redirects_are_refused_not_followed(hub: EventHub) -> None:
    target = Scripted([(200, {}, [envelope(0, "created"), envelope(1)])])
    redirect = Scripted([(307, {"Location": target.url + "/kv_cache_events"}, {}),
                         (302, {"Location": target.url + "/kv_cache_events"}, {})])
    processor = StubProcessor(hub.publisher(BACKEND))
    session = requests.Session()
    source = TrtllmSource(trtllm_config(redirect.url + "/kv_cache_events"), processor,
                          session=session)
    try:
        assert not source.poll_once()
        assert not source.poll_once()
        assert source.stats.poll_errors == {"redirect": 2}
        assert target.requests == [] and processor.batches == []
        assert source.health()["last_error"] == "redirect"
    finally:
        source.stop()
        session.close()
        redirect.close()
        target.close()


def test_trtllm_host_must_be_allowed() -> None:
    with pytest.raises(ValueError, match="not in allowed_publishers"):
        TrtllmSource(trtllm_config("http://10.0.0.9:8000/kv_cache_events"),
                     StubProcessor(lambda e: None))
    with pytest.raises(ValueError, match="http"):
        TrtllmSource(trtllm_config("ftp://127.0.0.1/x"), StubProcessor(lambda e: None))
    source = TrtllmSource(trtllm_config("http://user:pw@127.0.0.1:8000/kv_cache_events"),
                          StubProcessor(lambda e: None))
    assert "pw" not in json.dumps(source.health())


def test_all_blocks_cleared_reaches_the_processor(ctx: Any, zap: ZapAuthenticator,
                                                  hub: EventHub) -> None:
    processor = StubProcessor(hub.publisher(BACKEND))
    source = ZmqSource(zmq_config("tcp://127.0.0.1:1"), processor, context=ctx, zap=zap)
    source.handle_frames(frames(0, [AllBlocksCleared()]))
    assert processor.batches[0].events == (AllBlocksCleared(),)


def test_start_up_replay_rebuilds_an_idle_engine(
        ctx: Any, zap: ZapAuthenticator, hub: EventHub) -> None:
    """A (re)started listener asks the replay socket for the engine's buffer before any
    live message: an engine that stays idle is known at once, and the live messages the
    replay already covered are not applied twice."""
    pub = ZmqKvPublisher("vllm-0.33", "tcp://127.0.0.1:0", bind=True,
                         replay_endpoint="tcp://127.0.0.1:0", context=ctx)
    pub.start_replay_server()
    assert pub.replay_endpoint is not None
    for n in range(5):  # published before the listener starts; then the engine goes idle
        pub.publish(stored(n))
    processor = StubProcessor(hub.publisher(BACKEND))
    source = ZmqSource(zmq_config(pub.endpoint, "connect", replay=pub.replay_endpoint),
                       processor, context=ctx, zap=zap)
    try:
        source.start()
        wait_until(lambda: processor.seqs() == [0, 1, 2, 3, 4], "the start-up replay")
        assert processor.resets == [] and source.stats.replays == 1
        wait_until(lambda: source.health()["peers"] == 1, "the engine connection")
        n = 5
        while processor.seqs()[-1:] != [n - 1] and n < 200:  # live again, no duplicates
            pub.publish(stored(n))
            n += 1
            gevent.sleep(0.02)
        seqs = processor.seqs()
        assert seqs == sorted(set(seqs)) and seqs[:5] == [0, 1, 2, 3, 4]
        assert processor.resets == []
    finally:
        source.stop()
        pub.close()


# -- bounded input ---------------------------------------------------------------------------


def test_oversize_message_is_dropped_and_the_source_keeps_working(
        ctx: Any, zap: ZapAuthenticator, hub: EventHub) -> None:
    """``limits.max_message_bytes`` is the SUB socket's ZMQ_MAXMSGSIZE: libzmq refuses the
    big part from its length header and drops that connection; the engine reconnects and
    the next normal batch is applied (after the gap the lost one leaves)."""
    endpoint = f"tcp://127.0.0.1:{free_port()}"
    processor = StubProcessor(hub.publisher(BACKEND))
    limits = LimitsConfig(max_message_bytes=65536)
    source = ZmqSource(zmq_config(endpoint), processor, context=ctx, zap=zap, limits=limits)
    pub = ctx.socket(zmq.PUB)
    pub.setsockopt(zmq.LINGER, 0)
    try:
        source.start()
        pub.connect(endpoint)
        _publish_until(pub, lambda: bool(processor.batches))
        wait_until(lambda: bool(processor.batches), "a first batch")
        gevent.sleep(0.1)
        last = processor.seqs()[-1]
        gaps = source.stats.sequence_gaps
        # a valid batch of 1 MiB: 300 000 token ids in one BlockStored
        big = [BlockStored((777,), None, tuple(range(1_000_000, 1_300_000)), 16, medium="GPU")]
        oversize = frames(last + 1, big)
        assert len(oversize[2]) > 1024 * 1024
        pub.send_multipart(oversize)
        wait_until(lambda: source.stats.publisher_disconnects >= 1, "the dropped connection")
        n = last + 2
        while n < last + 300 and processor.seqs()[-1] == last:  # the engine reconnects
            pub.send_multipart(frames(n, stored(n)))
            n += 1
            gevent.sleep(0.02)
        wait_until(lambda: processor.seqs()[-1] > last, "a batch after the oversize one")
        assert 777 not in {h for e in processor.stored() for h in e.block_hashes}
        assert source.stats.decode_errors == 0
        assert source.stats.sequence_gaps == gaps + 1  # the lost batch is a gap
        metrics = ListenerCollector(hub, [source])
        exported = {m.name: m.samples[0].value for m in metrics.collect()
                    if m.name.endswith("publisher_disconnects")}
        assert exported == {"continuum_kv_listener_publisher_disconnects": 1.0}
    finally:
        pub.close(linger=0)
        source.stop()


class ScriptedRouter:
    """A replay ROUTER on 127.0.0.1 that answers every request with ``answer`` (the
    frames of each message after the requester's identity and delimiter), from a greenlet."""

    def __init__(self, ctx: Any, answer: list[list[bytes]]) -> None:
        self.sock = ctx.socket(zmq.ROUTER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.setsockopt(zmq.SNDHWM, 0)
        port = self.sock.bind_to_random_port("tcp://127.0.0.1")
        self.endpoint = f"tcp://127.0.0.1:{port}"
        self.requests: list[int] = []
        self.answer = answer
        self.server = gevent.spawn(self._serve)

    def _serve(self) -> None:
        while True:
            identity, _, start = self.sock.recv_multipart()
            self.requests.append(int.from_bytes(start, "big"))
            for message in self.answer:
                self.sock.send_multipart([identity, b"", *message])

    def close(self) -> None:
        self.server.kill()
        self.sock.close(linger=0)


END = [b"", b"\xff" * 8, b""]


def test_a_replay_message_over_the_limit_fails_the_replay(
        ctx: Any, zap: ZapAuthenticator, hub: EventHub) -> None:
    """``limits.max_message_bytes`` is the replay DEALER's ``ZMQ_MAXMSGSIZE`` too, as it is
    the live SUB's: a replayed batch above it is refused by libzmq from its length header
    (never allocated), the connection drops, and the replay fails at once (not after the
    replay timeout): counted, nothing applied, no crash. A gap's replay that fails so
    resets, and the live batch is applied. Replies within the limit still come through."""
    import listener.sources_zmq as sources_zmq

    big = [BlockStored((777,), None, tuple(range(1_000_000, 1_300_000)), 16, medium="GPU")]
    oversize = frames(0, big)
    assert len(oversize[2]) > 1024 * 1024
    router = ScriptedRouter(ctx, [oversize, END])
    limits = LimitsConfig(max_message_bytes=65536)
    processor = StubProcessor(hub.publisher(BACKEND))
    source = ZmqSource(zmq_config("tcp://127.0.0.1:1", replay=router.endpoint), processor,
                       context=ctx, zap=zap, limits=limits)
    try:
        started = time.monotonic()
        assert source.catch_up() == 0
        assert time.monotonic() - started < sources_zmq.REPLAY_TIMEOUT / 2  # the drop ends it
        assert (source.stats.replays, source.stats.replay_failures) == (1, 1)
        assert processor.batches == [] and source.stats.decode_errors == 0
        assert router.requests == [0]
        # a gap's replay alike: failed, reset, the live batch applied
        live = frames(3, stored(3))
        source.handle_frames(live)
        assert (source.stats.replays, source.stats.replay_failures) == (2, 2)
        assert processor.seqs() == [3] and len(processor.resets) == 1
        # the same source takes a replay within its limit (from 3, the batch applied)
        router.answer = [live, frames(4, stored(4)), frames(5, stored(5)), END]
        source.handle_frames(frames(6, stored(6)))
        assert (source.stats.replays, source.stats.replay_failures) == (3, 2)
        assert processor.seqs() == [3, 4, 5, 6] and len(processor.resets) == 1
        assert router.requests == [0, 0, 3]
    finally:
        source.stop()
        router.close()


def test_sequence_table_keeps_the_most_recently_used_streams(
        ctx: Any, zap: ZapAuthenticator, hub: EventHub) -> None:
    processor = StubProcessor(hub.publisher(BACKEND))
    source = ZmqSource(zmq_config("tcp://127.0.0.1:1"), processor, context=ctx, zap=zap,
                       limits=LimitsConfig(max_sequence_streams=8))
    source.handle_frames(frames(0, stored(1), topic=b"real"))
    for i in range(2000):  # a publisher inventing topics
        source.handle_frames(frames(0, stored(2), topic=b"fake-%d" % i))
        if i % 5 == 0:  # the real stream keeps publishing, so it stays recent
            source.handle_frames(frames(1 + i // 5, stored(1), topic=b"real"))
    assert source.health()["sequence_streams"] == 8
    assert source.stats.pruned_streams == 2001 - 8
    gaps, restarts = source.stats.sequence_gaps, source.stats.restarts
    source.handle_frames(frames(1 + 2000 // 5, stored(1), topic=b"real"))
    assert (source.stats.sequence_gaps, source.stats.restarts) == (gaps, restarts)
