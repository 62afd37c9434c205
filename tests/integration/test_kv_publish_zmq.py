"""The simulated engine's ZMQ KV-event publisher over real sockets on 127.0.0.1.

Every wait is a bounded poll; nothing asserts on time. A PUB socket drops messages until the
subscriber's subscription has reached it (``docs/kv-events.md`` §1.4), so each test first sends
probe batches until one arrives; probe ``k`` carries hash ``k``, which lets the test check that
its sequence number is ``k`` (numbering starts at 0, one per batch) even though earlier probes
were dropped.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
import zmq
import zmq.green

from continuum.kv_events import AllBlocksCleared, BlockRemoved, BlockStored, KvEvent
from continuum.sim.kv_publish import END_SEQ, ZmqKvPublisher, offset_endpoint, should_bind
from continuum.sim.kv_wire import get_profile
from listener.decode import decode_zmq_frames, decode_zmq_payload

pytestmark = pytest.mark.timeout(60)

POLL_MS = 5000
BATCHES: list[list[KvEvent]] = [
    [BlockStored((11, 12), None, (1, 2, 3, 4), 2, medium="GPU")],
    [BlockStored((13,), 12, (5, 6), 2, medium="GPU"), BlockRemoved((11,), medium="GPU")],
    [AllBlocksCleared()],
]


@pytest.fixture
def ctx() -> Iterator[zmq.Context[Any]]:
    context: zmq.Context[Any] = zmq.Context()
    yield context
    context.destroy(linger=0)


def _sub(ctx: zmq.Context[Any]) -> zmq.Socket[Any]:
    sub: zmq.Socket[Any] = ctx.socket(zmq.SUB)
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    return sub


def _first_delivered(pub: ZmqKvPublisher, sub: zmq.Socket[Any]) -> int:
    for probe in range(250):
        pub.publish([BlockRemoved((probe,))])
        if sub.poll(20):
            batch = decode_zmq_frames(sub.recv_multipart())
            assert batch.events == (BlockRemoved((probe,)),)
            assert batch.seq == probe
            return probe
    raise AssertionError("the subscription never reached the publisher")


def _check_stream(pub: ZmqKvPublisher, sub: zmq.Socket[Any], topic: bytes = b"") -> None:
    seq = _first_delivered(pub, sub)
    for events in BATCHES:
        pub.publish(events)
    for events in BATCHES:
        seq += 1
        assert sub.poll(POLL_MS), f"batch {seq} never arrived"
        batch = decode_zmq_frames(sub.recv_multipart())
        assert (batch.seq, batch.topic, batch.events) == (seq, topic, tuple(events))
        assert batch.data_parallel_rank == pub.dp_rank


def test_listener_binds_engine_connects(ctx: zmq.Context[Any]) -> None:
    sub = _sub(ctx)
    port = sub.bind_to_random_port("tcp://127.0.0.1")
    endpoint = f"tcp://127.0.0.1:{port}"
    assert not should_bind(endpoint, get_profile("vllm-0.33"))
    pub = ZmqKvPublisher("vllm-0.33", endpoint, topic="kv@0")
    try:
        _check_stream(pub, sub, b"kv@0")
    finally:
        pub.close()
        sub.close(linger=0)


@pytest.mark.parametrize("profile", ["vllm-0.22", "vllm-0.33", "sglang-0.5.9", "sglang-0.5.22"])
def test_engine_binds_listener_connects(ctx: zmq.Context[Any], profile: str) -> None:
    # "*" makes every engine bind (§1.1); port 0 lets the OS pick a free one.
    pub = ZmqKvPublisher(profile, "tcp://*:0")
    sub = _sub(ctx)
    try:
        port = pub.endpoint.rsplit(":", 1)[1]
        sub.connect(f"tcp://127.0.0.1:{port}")
        _check_stream(pub, sub)
    finally:
        pub.close()
        sub.close(linger=0)


def test_explicit_bind_and_rank_offset(ctx: zmq.Context[Any]) -> None:
    sub = _sub(ctx)
    port = sub.bind_to_random_port("tcp://127.0.0.1")
    # dp_rank 2 offsets the port by 2; bind=False overrides the rule, which would not bind
    # here either, and the rank travels in every batch.
    pub = ZmqKvPublisher("sglang-0.5.22", f"tcp://127.0.0.1:{port - 2}", bind=False, dp_rank=2)
    try:
        assert pub.endpoint == f"tcp://127.0.0.1:{port}"
        _check_stream(pub, sub)
    finally:
        pub.close()
        sub.close(linger=0)


def test_bind_rule_and_endpoint_offsets() -> None:
    vllm, sglang = get_profile("vllm-0.33"), get_profile("sglang-0.5.22")
    assert should_bind("tcp://*:5557", vllm) and should_bind("tcp://[::]:5557", vllm)
    assert should_bind("ipc:///tmp/kv", vllm) and should_bind("inproc://kv", vllm)
    assert not should_bind("tcp://0.0.0.0:5557", vllm)
    assert should_bind("tcp://0.0.0.0:5557", sglang)
    assert not should_bind("tcp://0.0.0.0:5557", get_profile("sglang-0.5.9"))
    assert offset_endpoint("tcp://*:5557", 3, vllm) == "tcp://*:5560"
    assert offset_endpoint("tcp://*:0", 3, vllm) == "tcp://*:0"
    assert offset_endpoint("tcp://*:0", 3, get_profile("vllm-0.22")) == "tcp://*:3"
    assert offset_endpoint("inproc://kv", 1, sglang) == "inproc://kv_dp1"
    assert offset_endpoint("ipc:///tmp/kv", 1, sglang) == "ipc:///tmp/kv"


def _replay(dealer: Any, pub: ZmqKvPublisher, start: int, *, serve: bool) -> list[list[bytes]]:
    """Send one replay request and collect the reply messages up to the end marker."""
    dealer.send_multipart([b"", start.to_bytes(8, "big")])
    for _ in range(100):
        if not serve or pub.serve_replay(0.05):
            break
    replies = []
    for _ in range(100):
        assert dealer.poll(POLL_MS), "replay reply never arrived"
        frames = dealer.recv_multipart()
        assert frames[0] == b""  # the delimiter ROUTER echoes back
        replies.append(frames[1:])
        if END_SEQ in frames:
            return replies
    raise AssertionError("no replay end marker")


@pytest.mark.parametrize(("profile", "with_topic"), [
    ("vllm-0.22", False), ("sglang-0.5.9", False), ("vllm-0.33", True), ("sglang-0.5.22", True),
])
def test_replay_returns_buffered_batches(
    ctx: zmq.Context[Any], profile: str, with_topic: bool
) -> None:
    pub = ZmqKvPublisher(profile, "tcp://127.0.0.1:0", bind=True, topic=b"t",
                         replay_endpoint="tcp://127.0.0.1:0", buffer_steps=3)
    dealer = ctx.socket(zmq.DEALER)
    try:
        assert pub.replay_endpoint is not None
        dealer.connect(pub.replay_endpoint)
        batches = [[BlockRemoved((n,))] for n in range(5)]
        for events in batches:
            pub.publish(events)
        # A malformed request (no empty delimiter: 2 frames at the ROUTER) is ignored.
        dealer.send_multipart([(0).to_bytes(8, "big")])
        for start, expected in ((0, [2, 3, 4]), (3, [3, 4]), (9, [])):
            *batch_replies, end = _replay(dealer, pub, start, serve=True)
            assert end == ([b"", END_SEQ, b""] if with_topic else [END_SEQ, b""])
            seqs = []
            for reply in batch_replies:
                if with_topic:
                    topic, *reply = reply
                    assert topic == b"t"
                seq_frame, payload = reply
                seq = int.from_bytes(seq_frame, "big")
                seqs.append(seq)
                assert decode_zmq_payload(payload).events == tuple(batches[seq])
            assert seqs == expected
    finally:
        dealer.close(linger=0)
        pub.close()


def test_replay_server_greenlet_answers_green_clients() -> None:
    green_ctx = zmq.green.Context()
    pub = ZmqKvPublisher("vllm-0.33", "tcp://127.0.0.1:0", bind=True,
                         replay_endpoint="tcp://127.0.0.1:0", context=green_ctx)
    dealer = green_ctx.socket(zmq.DEALER)
    try:
        assert pub.replay_endpoint is not None
        dealer.connect(pub.replay_endpoint)
        pub.publish([AllBlocksCleared()])
        pub.start_replay_server()
        # The green dealer's poll yields to the hub, where the server greenlet answers.
        replies = _replay(dealer, pub, 0, serve=False)
        assert [r[1] for r in replies] == [(0).to_bytes(8, "big"), END_SEQ]
    finally:
        dealer.close(linger=0)
        pub.close()
        green_ctx.destroy(linger=0)
    with pytest.raises(RuntimeError):
        pub.publish([])


MONKEY_PATCHED_SCRIPT = """
from gevent import monkey
monkey.patch_all()
import gevent
import zmq.green as zmq
from continuum.kv_events import AllBlocksCleared
from continuum.sim.kv_publish import ZmqKvPublisher
from listener.decode import decode_zmq_frames

pub = ZmqKvPublisher("sglang-0.5.22", "tcp://127.0.0.1:0", bind=True,
                     replay_endpoint="tcp://127.0.0.1:0")
pub.start_replay_server()
sub = zmq.Context.instance().socket(zmq.SUB)
sub.setsockopt(zmq.SUBSCRIBE, b"")
sub.connect(pub.endpoint)
received = []

def listen():
    while len(received) < 3:
        received.append(decode_zmq_frames(sub.recv_multipart()).seq)

listener = gevent.spawn(listen)
for _ in range(500):
    if received:
        break
    pub.publish([AllBlocksCleared()])
    gevent.sleep(0.01)
for _ in range(2):
    pub.publish([AllBlocksCleared()])
listener.join(timeout=20)
assert len(received) == 3 and received[1:] == [received[0] + 1, received[0] + 2], received
dealer = zmq.Context.instance().socket(zmq.DEALER)
dealer.connect(pub.replay_endpoint)
dealer.send_multipart([b"", received[-1].to_bytes(8, "big")])
assert dealer.poll(20000)
print(dealer.recv_multipart()[2] == received[-1].to_bytes(8, "big"))
pub.close()
"""


def test_publisher_under_gevent_monkey_patching() -> None:
    """The simulator runs monkey-patched; publishing, receiving and replay all cooperate."""
    import subprocess
    import sys

    result = subprocess.run([sys.executable, "-c", MONKEY_PATCHED_SCRIPT], capture_output=True,
                            text=True, timeout=60, check=False)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "True"
