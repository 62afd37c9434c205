"""EventHub: ids, history resume, cleared + snapshot, backpressure, draining.

The hub is driven directly: a subscription is the generator the SSE responder hands to the
WSGI server, read here with ``next()`` after the events it should see were published, so no
read ever waits (the keepalive test waits 10 ms by design).
"""

from __future__ import annotations

import json
import random
import re
from collections.abc import Iterator

import pytest

from listener.hub import (
    BUFFER_OVERFLOW,
    DRAINING,
    KEEPALIVE,
    EventHub,
    HubStateError,
    format_record,
    new_epoch,
)
from listener.model import (
    CACHE_CLEARED,
    CACHE_CREATED,
    CACHE_EVICTED,
    CACHE_OFFLOADED,
    PrefixEvent,
)

Record = tuple[str | None, str, dict[str, object]]


def prefix(n: int) -> str:
    return f"{n:064x}"


def created(n: int, tokens: int | None = 16) -> PrefixEvent:
    return PrefixEvent(CACHE_CREATED, prefix(n), tokens)


def parse(chunk: bytes) -> list[Record]:
    """SSE records of a chunk as ``(id, event, data)``; comments are dropped."""
    records: list[Record] = []
    for block in chunk.decode().split("\n\n"):
        fields: dict[str, str] = {}
        for line in block.split("\n"):
            if line and not line.startswith(":"):
                key, _, value = line.partition(": ")
                fields[key] = value
        if fields:
            records.append((fields.get("id"), fields["event"], json.loads(fields["data"])))
    return records


def read(stream: Iterator[bytes]) -> list[Record]:
    return parse(next(stream))


def drain(stream: Iterator[bytes]) -> list[Record]:
    """Every record until the stream ends (only when it ends by itself)."""
    return [record for chunk in stream for record in parse(chunk)]


@pytest.fixture
def hub() -> EventHub:
    return EventHub(["a", "b"], history_size=100, subscriber_queue=50, epoch="e1")


def test_ids_count_from_one_per_backend_with_the_run_epoch(hub: EventHub) -> None:
    assert [hub.publish("a", created(i)) for i in range(3)] == ["e1-1", "e1-2", "e1-3"]
    assert hub.publish("b", created(9)) == "e1-1"
    assert hub.latest_id("a") == "e1-3"
    assert hub.latest_id("b") == "e1-1"
    assert re.fullmatch(r"[0-9a-f]{12}", new_epoch())
    assert EventHub(["a"]).epoch != EventHub(["a"]).epoch  # a restarted listener differs


def test_record_format() -> None:
    assert format_record(created(1, 32), "e1-7") == (
        b'id: e1-7\nevent: cache_created\ndata: {"event":"cache_created","prefix_hash":"'
        + prefix(1).encode() + b'","token_count":32}\n\n')
    assert format_record(PrefixEvent(CACHE_CLEARED)) == (
        b'event: cache_cleared\ndata: {"event":"cache_cleared"}\n\n')
    assert format_record(DRAINING) == b'event: draining\ndata: {"event":"draining"}\n\n'


def test_a_record_is_named_by_its_event_not_by_its_chain_changes() -> None:
    """The router reads a record's type from its ``event:`` line. A prefix still held whose
    chain lost a key is a ``cache_created`` with an evicted chain key; until this test its
    ``event:`` line took the last chain change's type, so the router dropped the holding."""
    key = "ab" * 8
    event = PrefixEvent(CACHE_CREATED, prefix(1), 48,
                        ((CACHE_CREATED, "cd" * 8, 48), (CACHE_EVICTED, key, 0)))
    record = format_record(event, "e1-8")
    assert record.startswith(b"id: e1-8\nevent: cache_created\n")
    data = json.loads(record.split(b"data: ", 1)[1])
    assert data["event"] == CACHE_CREATED
    assert data["chain"] == {CACHE_CREATED: [["cd" * 8, 48]], CACHE_EVICTED: [[key, 0]]}


def test_unknown_backend(hub: EventHub) -> None:
    assert not hub.has_backend("c")
    with pytest.raises(KeyError):
        hub.publish("c", created(1))
    with pytest.raises(KeyError):
        hub.stream("c")
    with pytest.raises(KeyError):
        hub.publisher("c")


def test_resume_from_history_sends_exactly_the_missed_events(hub: EventHub) -> None:
    for i in range(1, 6):
        hub.publish("a", created(i))
    stream = hub.stream("a", "e1-2")
    assert [(r[0], r[2]["prefix_hash"]) for r in read(stream)] == [
        ("e1-3", prefix(3)), ("e1-4", prefix(4)), ("e1-5", prefix(5))]
    hub.publish("a", created(6))
    assert [r[0] for r in read(stream)] == ["e1-6"]
    stream.close()
    assert hub.subscribers("a") == 0


def test_resume_at_latest_and_from_zero(hub: EventHub) -> None:
    for i in range(1, 4):
        hub.publish("a", created(i))
    at_latest = hub.stream("a", "e1-3")
    assert next(at_latest) == b": open\n\n"  # nothing missed
    hub.publish("a", created(4))
    assert [r[0] for r in read(at_latest)] == ["e1-4"]
    from_zero = hub.stream("a", "e1-0")
    assert [r[0] for r in read(from_zero)] == ["e1-1", "e1-2", "e1-3", "e1-4"]
    at_latest.close()
    from_zero.close()
    assert hub.counters("a").resumes_history == 2


def test_query_style_whitespace_is_tolerated(hub: EventHub) -> None:
    hub.publish("a", created(1))
    stream = hub.stream("a", " e1-0 ")
    assert [r[0] for r in read(stream)] == ["e1-1"]
    stream.close()


@pytest.mark.parametrize("resume", [None, "", "f00-1", "garbage", "e1-99", "e1-1"])
def test_fresh_unknown_or_stale_resume_gets_cleared_then_snapshot(resume: str | None) -> None:
    hub = EventHub(["a"], history_size=3, epoch="e1")
    hub.publish("a", created(1, 16))
    hub.publish("a", created(2, 32))
    hub.publish("a", PrefixEvent(CACHE_OFFLOADED, prefix(2)))  # keeps its token count
    hub.publish("a", created(3, 48))
    hub.publish("a", PrefixEvent(CACHE_EVICTED, prefix(1)))
    hub.publish("a", created(4, None))
    # history now holds 4..6; "e1-1" is older than it, "e1-99" newer than the latest
    records = read(hub.stream("a", resume))
    assert records[0] == (None, CACHE_CLEARED, {"event": CACHE_CLEARED})
    assert sorted((r[1], r[2].get("prefix_hash"), r[2].get("token_count"))
                  for r in records[1:]) == [
        (CACHE_CREATED, prefix(3), 48),
        (CACHE_CREATED, prefix(4), None),
        (CACHE_OFFLOADED, prefix(2), 32),
    ]
    # only the last record carries an id: the latest event the snapshot reflects
    assert [r[0] for r in records] == [None, None, None, "e1-6"]
    assert hub.counters("a").resumes_snapshot == 1


def test_cleared_empties_the_snapshot_and_an_empty_snapshot_carries_the_id() -> None:
    hub = EventHub(["a"], epoch="e1")
    empty = read(hub.stream("a"))
    assert empty == [("e1-0", CACHE_CLEARED, {"event": CACHE_CLEARED})]
    hub.publish("a", created(1))
    hub.publish("a", PrefixEvent(CACHE_CLEARED))
    assert read(hub.stream("a", "old-3")) == [("e1-2", CACHE_CLEARED, {"event": CACHE_CLEARED})]
    assert hub.view_size("a") == 0


def test_restarted_listener_resume_ends_consistent() -> None:
    """A consumer of run 1 resumes on run 2: cleared + snapshot, then live, no duplicate."""
    first = EventHub(["a"], epoch="aaa")
    for i in range(1, 4):
        first.publish("a", created(i))
    last_seen = first.latest_id("a")
    second = EventHub(["a"], epoch="bbb")  # restarted: rebuilt only prefix 3 so far
    second.publish("a", created(3))
    stream = second.stream("a", last_seen)
    records = read(stream)
    assert [r[1] for r in records] == [CACHE_CLEARED, CACHE_CREATED]
    assert records[-1][0] == "bbb-1"
    second.publish("a", created(5))
    assert [r[0] for r in read(stream)] == ["bbb-2"]
    stream.close()


def test_slow_subscriber_gets_buffer_overflow_not_silent_loss() -> None:
    hub = EventHub(["a"], history_size=100, subscriber_queue=3, epoch="e1")
    slow = hub.stream("a", "e1-0")
    fast = hub.stream("a", "e1-0")
    assert next(slow) == next(fast) == b": open\n\n"
    got_fast: list[Record] = []
    for i in range(1, 6):
        hub.publish("a", created(i))
        got_fast += read(fast)
    assert [r[0] for r in got_fast] == [f"e1-{i}" for i in range(1, 6)]
    # the slow one receives what was queued (1..3), then buffer_overflow, then the end
    records = drain(slow)
    assert [r[0] for r in records] == ["e1-1", "e1-2", "e1-3", None]
    assert records[-1][1:] == (BUFFER_OVERFLOW, {"event": BUFFER_OVERFLOW})
    assert hub.counters("a").overflows == 1
    assert hub.subscribers("a") == 1
    # resuming from its last id loses nothing
    again = hub.stream("a", "e1-3")
    assert [r[0] for r in read(again)] == ["e1-4", "e1-5"]
    fast.close()
    again.close()
    assert hub.subscribers("a") == 0


def test_draining_on_close(hub: EventHub) -> None:
    stream = hub.stream("a", "e1-0")
    assert next(stream) == b": open\n\n"
    hub.publish("a", created(1))
    hub.close()
    hub.close()  # idempotent
    records = drain(stream)
    assert [(r[0], r[1]) for r in records] == [("e1-1", CACHE_CREATED), (None, DRAINING)]
    assert hub.subscribers("a") == 0
    late = drain(hub.stream("b"))
    assert [r[1] for r in late] == [CACHE_CLEARED, DRAINING]


def test_keepalive_when_idle(hub: EventHub) -> None:
    stream = hub.stream("a", "e1-0", keepalive=0.01)
    assert next(stream) == b": open\n\n"
    assert next(stream) == KEEPALIVE
    hub.publish("a", created(1))
    assert [r[0] for r in read(stream)] == ["e1-1"]
    stream.close()


def test_client_gone_unsubscribes(hub: EventHub) -> None:
    stream = hub.stream("a")
    never_started = hub.stream("a")
    next(stream)
    assert hub.subscribers("a") == 1
    stream.close()
    never_started.close()  # a generator closed before it ran never subscribed
    assert hub.subscribers("a") == 0
    hub.publish("a", created(1))  # nobody to deliver to: fine


def test_publisher_is_the_processors_emit(hub: EventHub) -> None:
    emit = hub.publisher("b")
    emit(created(7))
    assert hub.latest_id("b") == "e1-1"
    assert hub.counters("b").events_out == {CACHE_CREATED: 1}


def test_invalid_arguments() -> None:
    with pytest.raises(ValueError):
        EventHub(["a"], history_size=0)
    with pytest.raises(ValueError):
        EventHub(["a"], epoch="Not-Hex")
    error = HubStateError("closed", "sent")
    assert "closed" in str(error) and "sent" in str(error)


def test_reconnecting_consumer_sees_every_event_once() -> None:
    """Random disconnects and resumes: the consumer's sequence equals the published one."""
    rng = random.Random(7)
    hub = EventHub(["a"], history_size=1000, subscriber_queue=1000, epoch="e1")
    published: list[str] = []
    seen: list[str] = []
    last: str | None = None
    stream = hub.stream("a", "e1-0", keepalive=0.01)
    next(stream)
    for i in range(1, 301):
        published.append(hub.publish("a", created(i)))
        if rng.random() < 0.3:
            for record_id, _, _ in read(stream):
                assert record_id is not None
                seen.append(record_id)
                last = record_id
        if rng.random() < 0.05:
            stream.close()
            stream = hub.stream("a", last or "e1-0", keepalive=0.01)
            seen += [r[0] for r in read(stream) if r[0] is not None]
            last = seen[-1] if seen else last
    seen += [r[0] for r in read(stream) if r[0] is not None]
    stream.close()
    assert seen == published


def test_chain_changes_are_published_and_kept_in_the_snapshot() -> None:
    hub = EventHub(["a"], epoch="e1")
    k1, k2, k3 = "01" * 8, "02" * 8, "03" * 8
    hub.publish("a", PrefixEvent(CACHE_CREATED, prefix(1), 48, (
        (CACHE_CREATED, k1, 16), (CACHE_CREATED, k2, 32), (CACHE_CREATED, k3, 48))))
    live = read(hub.stream("a", "e1-0"))
    assert live[0][2]["chain"] == {CACHE_CREATED: [[k1, 16], [k2, 32], [k3, 48]]}
    # a change of chain keys alone rides on an event repeating the prefix's state
    hub.publish("a", PrefixEvent(CACHE_CREATED, prefix(1), 48, (
        (CACHE_EVICTED, k2, 0), (CACHE_OFFLOADED, k3, 48))))
    hub.publish("a", PrefixEvent(CACHE_CREATED, prefix(2), 16, ((CACHE_CREATED, k1, 16),)))
    hub.publish("a", PrefixEvent(CACHE_EVICTED, prefix(2), 16))  # takes its chain keys along
    snapshot = {r[2]["prefix_hash"]: r[2] for r in read(hub.stream("a"))[1:]}
    assert list(snapshot) == [prefix(1)]
    assert snapshot[prefix(1)]["chain"] == {CACHE_CREATED: [[k1, 16]],
                                            CACHE_OFFLOADED: [[k3, 48]]}
    hub.publish("a", PrefixEvent(CACHE_CLEARED))
    assert [r[1] for r in read(hub.stream("a"))] == [CACHE_CLEARED]
