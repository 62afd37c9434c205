"""TensorRT-LLM KV events from the poll to the prefix events, through the real processor.

Each reply goes through :meth:`TrtllmSource.poll_once` (a fake HTTP session answers with the
scripted JSON), the decoder and :class:`DefaultSourceProcessor`, so these tests see what the
router would: malformed events that cost only themselves, attention-DP ranks with their own
event ids and their own copies of a block, and ``updated`` cache-level moves.
"""

from __future__ import annotations

import io
import json
import logging
from typing import Any

import pytest

from continuum.cache_salt import make_salt
from listener.config import DetokenizeConfig, LimitsConfig, SourceConfig
from listener.model import (
    CACHE_CLEARED,
    CACHE_CREATED,
    CACHE_EVICTED,
    CACHE_OFFLOADED,
    PrefixEvent,
)
from listener.processor import DefaultSourceProcessor
from listener.sources_trtllm import TrtllmSource

SECRET = b"trtllm-events-test-secret"
BACKEND = "trt-1"
P1, P2 = "1" * 64, "2" * 64
WINDOW = 4096


class _Raw:
    def __init__(self, body: bytes) -> None:
        self._body = io.BytesIO(body)

    def read(self, size: int, decode_content: bool = True) -> bytes:
        return self._body.read(size)


class _Reply:
    is_redirect = False
    status_code = 200

    def __init__(self, body: bytes) -> None:
        self.raw = _Raw(body)

    def __enter__(self) -> _Reply:
        return self

    def __exit__(self, *exc: object) -> None:
        pass


class _Session:
    """Answers each POST with the next queued body, as ``trtllm-serve`` drains its queue."""

    def __init__(self) -> None:
        self.bodies: list[bytes] = []

    def post(self, url: str, **kwargs: Any) -> _Reply:
        return _Reply(self.bodies.pop(0) if self.bodies else b"[]")


class Trt:
    """A TensorRT-LLM source and its real processor; ``reply()`` polls one scripted body."""

    def __init__(self, limits: LimitsConfig | None = None) -> None:
        config = SourceConfig(backend_name=BACKEND, engine="trtllm", model="m",
                              trtllm_endpoint="http://127.0.0.1:9/kv_cache_events",
                              allowed_publishers=("127.0.0.1",))
        self.out: list[PrefixEvent] = []
        self.processor = DefaultSourceProcessor(
            config, limits or LimitsConfig(), DetokenizeConfig(), emit=self.out.append,
            salt_secret=SECRET)
        self.session = _Session()
        self.source = TrtllmSource(config, self.processor, session=self.session,  # type: ignore[arg-type]
                                   limits=limits)

    def reply(self, *envelopes: Any) -> list[PrefixEvent]:
        """Poll once for ``envelopes``; the prefix events that poll produced."""
        start = len(self.out)
        self.session.bodies.append(json.dumps(list(envelopes)).encode())
        assert self.source.poll_once()
        return self.out[start:]

    def counts(self) -> tuple[int, int, int]:
        """``(sequence_gaps, restarts, resets)`` of the source."""
        stats = self.source.stats
        return stats.sequence_gaps, stats.restarts, stats.resets

    def keys(self) -> set[tuple[Any, int]]:
        return set(self.processor.tracker.blocks)


def env(event_id: int, data: dict[str, Any], rank: int | None = None) -> dict[str, Any]:
    doc: dict[str, Any] = {"event_id": event_id, "data": data, "window_size": WINDOW}
    if rank is not None:
        doc["attention_dp_rank"] = rank
    return doc


def created() -> dict[str, Any]:
    return {"type": "created", "num_blocks_per_cache_level": [64, 0]}


def stored(hashes: list[int], parent: int | None, prefix: str, level: int = 0
           ) -> dict[str, Any]:
    """A salted chain of 2-token blocks (the router's salt for ``prefix`` on every block)."""
    salt = make_salt(SECRET, BACKEND, prefix)
    return {"type": "stored", "parent_hash": parent, "blocks": [
        {"type": "stored_block", "block_hash": h, "cache_level": level, "priority": 35,
         "tokens": [{"type": "unique_token", "token_id": t, "token_extra_id": 0}
                    for t in (2 * i + 1, 2 * i + 2)], "mm_keys": [], "cache_salt": salt}
        for i, h in enumerate(hashes)]}


def removed(*hashes: Any) -> dict[str, Any]:
    return {"type": "removed", "block_hashes": list(hashes)}


def updated(h: int, level: tuple[int, int] | None = None,
            priority: tuple[int, int] | None = None) -> dict[str, Any]:
    def diff(change: tuple[int, int] | None) -> dict[str, Any] | None:
        return None if change is None else {
            "type": "event_diff", "old_value": change[0], "new_value": change[1]}
    return {"type": "updated", "block_hash": h, "cache_level": diff(level),
            "priority": diff(priority)}


# -- 1. a malformed event costs only itself ------------------------------------------------

def bad_store(h: int) -> dict[str, Any]:
    """A ``stored`` whose block has a boolean token id: malformed."""
    doc = stored([h], None, P2)
    doc["blocks"][0]["tokens"][0]["token_id"] = True
    return doc


def test_trtllm_malformed_event_costs_only_itself(caplog: pytest.LogCaptureFixture) -> None:
    """A store whose token id is a boolean, between two good events of one reply: the
    reply's other events are applied (the drain is destructive: refusing the reply lost
    them for good), the bad one is counted and its id still counts, so the next reply is no
    gap; the first bad one's location is logged once. (A lost store only loses a hit.)"""
    trt = Trt()
    assert trt.reply(env(0, created()), env(1, stored([11, 12], None, P1))) == [
        PrefixEvent(CACHE_CLEARED), PrefixEvent(CACHE_CREATED, P1, 4)]
    caplog.set_level(logging.DEBUG, logger="listener.sources")
    out = trt.reply(env(2, bad_store(31)), env(3, stored([21], None, P2)),
                    env(4, removed(11, 12)))
    assert out == [PrefixEvent(CACHE_CREATED, P2, 2), PrefixEvent(CACHE_EVICTED, P1, 4)]
    stats = trt.source.stats
    assert (stats.malformed_events, stats.decode_errors, stats.poll_errors) == (1, 0, {})
    assert trt.reply(env(5, bad_store(32)), env(6, removed(21))) == [
        PrefixEvent(CACHE_EVICTED, P2, 2)]
    assert stats.malformed_events == 2 and trt.counts() == (0, 1, 1)  # only created's reset
    warned = [r for r in caplog.records if "malformed" in r.getMessage()]
    assert [r.levelno for r in warned] == [logging.WARNING, logging.DEBUG]
    assert "first at $[0].data.blocks[0].tokens[0].token_id" in warned[0].getMessage()
    assert trt.source.connected and trt.source.last_error is None


@pytest.mark.parametrize("bad", [
    removed(True),  # a removal whose hashes cannot be read
    {"type": ["removed"], "block_hashes": [12]},  # a type that cannot be read
    "removed",  # data that is not an object
])
def test_trtllm_a_malformed_removal_clears_its_rank(bad: Any) -> None:
    """A malformed ``removed`` (or an event whose type cannot be read) lost a removal: were
    it skipped like a bad store, the blocks it removed would stay indexed for good. Its rank
    is cleared instead, as for a gap (the events before it applied first, those after it
    too); another rank keeps its blocks; its id still counts (no gap follows). Without
    ranks, the backend is reset."""
    trt = Trt()
    trt.reply(env(0, created(), 0), env(1, stored([11], None, P1), 0),
              env(0, created(), 1), env(1, stored([11, 12], None, P1), 1))
    out = trt.reply(env(2, stored([21], None, P2), 1), env(3, bad, 1),
                    env(4, stored([41], None, P2), 1), env(2, stored([13], 11, P1), 0))
    # rank 1's 11, 12, 21 go: P1 is left with rank 0's block 11 (2 tokens), P2 (held by
    # rank 1 only) is evicted; then rank 1's 41 and rank 0's 13 are applied
    assert out == [PrefixEvent(CACHE_CREATED, P2, 2), PrefixEvent(CACHE_CREATED, P1, 2),
                   PrefixEvent(CACHE_EVICTED, P2, 2), PrefixEvent(CACHE_CREATED, P2, 2),
                   PrefixEvent(CACHE_CREATED, P1, 4)]
    assert trt.keys() == {((0, WINDOW), 11), ((0, WINDOW), 13), ((1, WINDOW), 41)}
    assert trt.source.stats.malformed_events == 1
    assert trt.counts() == (0, 2, 1)  # no gap, no reset: the two created, the first reset
    assert trt.reply(env(5, removed(41), 1)) == [PrefixEvent(CACHE_EVICTED, P2, 2)]
    assert trt.counts() == (0, 2, 1)
    # without ranks: a reset of the backend
    flat = Trt()
    flat.reply(env(0, created()), env(1, stored([11], None, P1)))
    assert flat.reply(env(2, bad), env(3, stored([21], None, P2))) == [
        PrefixEvent(CACHE_CLEARED), PrefixEvent(CACHE_CREATED, P2, 2)]
    assert flat.counts() == (0, 1, 2) and flat.keys() == {(WINDOW, 21)}


def test_trtllm_malformed_event_without_a_readable_id_leaves_a_gap() -> None:
    """An envelope whose ``event_id`` cannot be read cannot hold its place: the next event's
    id reads as a gap (state may be lost: reset), the reply's events after it are applied."""
    trt = Trt()
    trt.reply(env(0, created()), env(1, stored([11], None, P1)))
    out = trt.reply({"event_id": "two", "data": removed(11)}, env(3, stored([21], None, P2)))
    assert out == [PrefixEvent(CACHE_CLEARED), PrefixEvent(CACHE_CREATED, P2, 2)]
    assert trt.source.stats.malformed_events == 1 and trt.counts() == (1, 1, 2)


def test_trtllm_malformed_created_still_restarts() -> None:
    """A ``created`` with unreadable pool sizes is still the event manager's (re)start."""
    trt = Trt()
    trt.reply(env(0, created()), env(1, stored([11], None, P1)))
    bad = {"type": "created", "num_blocks_per_cache_level": "many"}
    assert trt.reply(env(0, bad), env(1, stored([21], None, P2))) == [
        PrefixEvent(CACHE_CLEARED), PrefixEvent(CACHE_CREATED, P2, 2)]
    assert trt.source.stats.malformed_events == 1 and trt.counts() == (0, 2, 2)


# -- 2. attention data parallelism -----------------------------------------------------------

def test_trtllm_attention_dp_ranks_count_their_own_event_ids() -> None:
    """Rank 0 forwards the other ranks' events, each rank numbered from its own 0: ranks
    interleave in one reply, in later replies too, without reading as gaps or restarts of
    each other (rank 1's ``created`` used to reset rank 0's blocks, and rank 0's next id
    after rank 1's read as a gap)."""
    trt = Trt()
    out = trt.reply(env(0, created(), 0), env(1, stored([11, 12], None, P1), 0),
                    env(2, stored([31], None, P2), 0),
                    env(0, created(), 1), env(1, stored([41], None, P2), 1))
    assert out == [PrefixEvent(CACHE_CLEARED), PrefixEvent(CACHE_CREATED, P1, 4),
                   PrefixEvent(CACHE_CREATED, P2, 2)]
    assert trt.counts() == (0, 2, 1)  # two created; one reset, the source's first event
    assert trt.keys() == {((0, WINDOW), 11), ((0, WINDOW), 12), ((0, WINDOW), 31),
                          ((1, WINDOW), 41)}
    out = trt.reply(env(3, removed(11, 12), 0), env(2, removed(41), 1),
                    env(4, stored([51], None, P1), 0), env(3, stored([52], None, P1), 1))
    assert out == [PrefixEvent(CACHE_EVICTED, P1, 4), PrefixEvent(CACHE_CREATED, P1, 2)]
    assert trt.keys() == {((0, WINDOW), 31), ((0, WINDOW), 51), ((1, WINDOW), 52)}
    assert trt.counts() == (0, 2, 1) and trt.source.stats.duplicates == 0
    # a repeated reply is dropped rank by rank
    trt.reply(env(4, stored([51], None, P1), 0), env(3, stored([52], None, P1), 1))
    assert trt.source.stats.duplicates == 2 and trt.counts() == (0, 2, 1)
    assert trt.source.health()["last_event_ids"] == {"0": 4, "1": 3}


def test_trtllm_attention_dp_ranks_hold_their_own_copies() -> None:
    """Two ranks cache the same prefix under the same hashes: rank 1's removal leaves rank
    0's copy (it used to evict the prefix the router still finds on rank 0), and the prefix
    goes with the last copy."""
    trt = Trt()
    assert trt.reply(env(0, created(), 0), env(1, stored([11, 12], None, P1), 0),
                     env(0, created(), 1), env(1, stored([11, 12], None, P1), 1)) == [
        PrefixEvent(CACHE_CLEARED), PrefixEvent(CACHE_CREATED, P1, 4)]
    assert trt.processor.tracker.tracked_blocks == 4
    assert trt.reply(env(2, removed(11, 12), 1)) == []
    assert trt.processor.tracker.tracked_blocks == 2
    assert trt.reply(env(2, removed(11, 12), 0)) == [PrefixEvent(CACHE_EVICTED, P1, 4)]


def test_trtllm_a_gap_on_one_rank_clears_that_rank_only() -> None:
    """Rank 1 loses events (and later restarts): its blocks go, rank 0's stay, and no
    ``cache_cleared`` drops the whole backend from the router."""
    trt = Trt()
    trt.reply(env(0, created(), 0), env(1, stored([11], None, P1), 0),
              env(0, created(), 1), env(1, stored([11], None, P1), 1),
              env(2, stored([21], None, P2), 1))
    out = trt.reply(env(2, stored([12], 11, P1), 0), env(7, stored([22], None, P2), 1))
    assert out == [PrefixEvent(CACHE_CREATED, P1, 4), PrefixEvent(CACHE_EVICTED, P2, 2),
                   PrefixEvent(CACHE_CREATED, P2, 2)]
    assert trt.counts() == (1, 2, 1)
    assert trt.keys() == {((0, WINDOW), 11), ((0, WINDOW), 12), ((1, WINDOW), 22)}
    out = trt.reply(env(0, created(), 1), env(3, removed(12), 0))
    assert out == [PrefixEvent(CACHE_EVICTED, P2, 2), PrefixEvent(CACHE_CREATED, P1, 2)]
    assert trt.counts() == (1, 3, 1) and trt.keys() == {((0, WINDOW), 11)}


def test_trtllm_ranks_beyond_the_limit_are_dropped_and_start_anew(
        caplog: pytest.LogCaptureFixture) -> None:
    """Each attention-DP rank takes one of ``limits.max_sequence_streams`` (trtllm config
    has no rank count to check it against): a limit below the ranks in use drops a rank's
    sequence, whose next event is lost state, and the first drop logs a warning (once)."""
    caplog.set_level(logging.DEBUG, logger="listener.sources")
    trt = Trt(LimitsConfig(max_sequence_streams=2))
    trt.reply(env(0, created(), 0), env(0, created(), 1), env(1, stored([11], None, P1), 1))
    assert "max_sequence_streams" not in caplog.text
    trt.reply(env(0, created(), 2))  # a third rank: rank 0, the least recently used, goes
    assert trt.source.stats.pruned_streams == 1
    trt.reply(env(1, stored([21], None, P2), 0))  # its ids are unknown now: lost state
    assert trt.source.stats.sequence_gaps == 1 and trt.keys() == {
        ((1, WINDOW), 11), ((0, WINDOW), 21)}
    assert trt.source.stats.pruned_streams == 2
    warned = [r for r in caplog.records if "max_sequence_streams" in r.getMessage()]
    assert [r.levelno for r in warned] == [logging.WARNING, logging.DEBUG]
    assert "attention-DP rank 0: limits.max_sequence_streams (2) is below the ranks in use" \
        in warned[0].getMessage()


def test_trtllm_replies_without_ranks_keep_one_sequence_and_unranked_keys() -> None:
    trt = Trt()
    trt.reply(env(0, created()), env(1, stored([11], None, P1)))
    assert trt.keys() == {(WINDOW, 11)} and "last_event_ids" not in trt.source.health()
    assert trt.reply(env(3, stored([21], None, P2))) == [
        PrefixEvent(CACHE_CLEARED), PrefixEvent(CACHE_CREATED, P2, 2)]  # a gap: reset
    assert trt.counts() == (1, 1, 2)


# -- 3. updated: cache-level moves -------------------------------------------------------------

def test_trtllm_cache_level_updates_move_blocks_between_tiers() -> None:
    """An ``updated`` 0→1 offloads the block to host memory (the prefix goes to the
    offloaded tier instead of staying on the GPU in the index), 1→0 brings it back; a
    priority-only update changes nothing; an update of an unknown block is skipped and
    counted; TensorRT-LLM's ``removed`` then drops the block from whatever level."""
    trt = Trt()
    trt.reply(env(0, created()), env(1, stored([11, 12], None, P1)))
    # block 12 offloaded: the GPU holds the prefix up to block 11 only
    assert trt.reply(env(2, updated(12, level=(0, 1)))) == [PrefixEvent(CACHE_CREATED, P1, 2)]
    assert trt.reply(env(3, updated(11, level=(0, 1)))) == [
        PrefixEvent(CACHE_OFFLOADED, P1, 4)]
    assert trt.reply(env(4, updated(11, priority=(35, 90))),
                     env(5, updated(11, level=(1, 1)))) == []
    assert trt.reply(env(6, updated(12, level=(1, 0)))) == [PrefixEvent(CACHE_CREATED, P1, 4)]
    assert trt.reply(env(7, updated(99, level=(0, 1)))) == []
    assert trt.processor.stats()["placeholder_blocks"] == 1
    assert trt.processor.tracker.tracked_blocks == 2
    assert trt.reply(env(8, removed(12))) == [PrefixEvent(CACHE_OFFLOADED, P1, 2)]
    assert trt.reply(env(9, removed(11))) == [PrefixEvent(CACHE_EVICTED, P1, 2)]
    assert trt.counts() == (0, 1, 1)


def test_trtllm_updates_apply_to_their_rank_and_window() -> None:
    trt = Trt()
    trt.reply(env(0, created(), 0), env(1, stored([11], None, P1), 0),
              env(0, created(), 1), env(1, stored([11], None, P1), 1))
    assert trt.reply(env(2, updated(11, level=(0, 1)), 1)) == []  # rank 0's copy: GPU
    assert trt.reply(env(2, updated(11, level=(0, 1)), 0)) == [
        PrefixEvent(CACHE_OFFLOADED, P1, 2)]
