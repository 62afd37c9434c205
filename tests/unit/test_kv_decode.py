"""KV-event decoding, encoding and hashing against the reference fixtures.

The fixtures (``tests/fixtures/kv-events/``; how they were made: ``docs/kv-events.md`` §11,
"The reference fixtures") are the upstream engines' own bytes, so: every fixture must decode
to the events its README documents, our encoders must reproduce every fixture byte for byte,
our hashers must reproduce every fixture hash, and nothing but ``DecodeError`` may ever
escape a decoder.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from pathlib import Path
from typing import Any

import msgpack
import pytest
import zmq.green as zmq
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from continuum.kv_events import AllBlocksCleared, BlockRemoved, BlockStored, KvEventBatch
from continuum.sim.hashing import block_hash_chain, cbor_encode, hasher_for
from continuum.sim.kv_publish import TrtllmEventQueue, ZmqKvPublisher
from continuum.sim.kv_wire import PROFILES, encode_zmq_payload, get_profile
from listener.decode import (
    STORED_FIELDS,
    DecodeError,
    RemovalLostBatch,
    TrtllmEvent,
    canonical_block_hash,
    decode_trtllm_events,
    decode_zmq_frames,
    decode_zmq_payload,
)
from listener.decode_trtllm import MALFORMED, MALFORMED_REMOVAL

FIXTURES = Path(__file__).resolve().parent.parent / "fixtures" / "kv-events"
TS = 1760000000.5
U64 = 1 << 64

TOKENS = (151644, 872, 198, 9064, 374, 279, 6722, 315, 5616, 30, 151645, 198)
CHILD_TOKENS = (151644, 77091, 198, 151667)
# Hashes as the fixture README documents them (SGLang's signed, as on the wire).
VLLM = (1599616908291577667, 758100790664640678, 3016138638863174236)
VLLM_CHILD = 1765977289531300367
SGLANG_WIRE = (-1944566869021170841, 9056173362842263460, -6890035088589460102)
SGLANG = tuple(h % U64 for h in SGLANG_WIRE)  # canonical form
TRTLLM = (611133224384185, 10229191825752411066, 7977488755677805169)
TRTLLM_CHILD = 6731268394244529271


def fixture(name: str) -> bytes:
    return (FIXTURES / name).read_bytes()


def _vllm_stored(hashes: tuple[int, ...], parent: int | None, tokens: tuple[int, ...]) -> Any:
    return BlockStored(hashes, parent, tokens, 4, medium="GPU", group_idx=0,
                       kv_cache_spec_kind="full_attention")


VLLM_REMOVED = (BlockRemoved((VLLM[2],), medium="GPU", group_idx=0),
                BlockRemoved((VLLM[1],), medium="GPU", group_idx=0))
SGLANG_REMOVED = (BlockRemoved((SGLANG[1], SGLANG[2]), medium="GPU"),)
EXPECTED_ZMQ: dict[str, tuple[Any, ...]] = {
    "vllm-0.22.0__stored_chain3": (_vllm_stored(VLLM, None, TOKENS),),
    "vllm-0.22.0__stored_chain3_child": (_vllm_stored((VLLM_CHILD,), VLLM[2], CHILD_TOKENS),),
    "vllm-0.22.0__removed": VLLM_REMOVED,
    "vllm-0.22.0__all_cleared": (AllBlocksCleared(),),
    "vllm-0.33.0__stored_chain3": (_vllm_stored(VLLM, None, TOKENS),),
    "vllm-0.33.0__stored_chain3_child": (_vllm_stored((VLLM_CHILD,), VLLM[2], CHILD_TOKENS),),
    "vllm-0.33.0__removed": VLLM_REMOVED,
    "vllm-0.33.0__all_cleared": (AllBlocksCleared(),),
    "sglang-0.5.9__stored_chain3": tuple(
        BlockStored((SGLANG[i],), SGLANG[i - 1] if i else None, TOKENS[4 * i:4 * i + 4], 4,
                    medium="GPU")
        for i in range(3)
    ),
    "sglang-0.5.9__removed": SGLANG_REMOVED,
    "sglang-0.5.9__all_cleared": (AllBlocksCleared(),),
    "sglang-0.5.22__stored_chain3": (BlockStored(SGLANG, None, TOKENS, 4, medium="GPU"),),
    "sglang-0.5.22__removed": SGLANG_REMOVED,
    "sglang-0.5.22__all_cleared": (AllBlocksCleared(),),
}
EXPECTED_TRTLLM: dict[str, tuple[int, str, tuple[Any, ...]]] = {
    "trtllm-current__created": (0, "created", (AllBlocksCleared(),)),
    "trtllm-current__stored_chain3": (
        1, "stored", (BlockStored(TRTLLM, None, TOKENS, 4, medium="GPU", priority=35),)),
    "trtllm-current__stored_chain3_child": (
        2, "stored",
        (BlockStored((TRTLLM_CHILD,), TRTLLM[2], CHILD_TOKENS, 4, medium="GPU", priority=35),)),
    "trtllm-current__removed": (3, "removed", (BlockRemoved((TRTLLM_CHILD, TRTLLM[2])),)),
}


# -- the fixture copies are intact ----------------------------------------------------------

def test_fixture_copies_match_the_manifest() -> None:
    manifest = json.loads(fixture("manifest.json"))
    assert {e["file"] for e in manifest} == {
        p.name for p in FIXTURES.iterdir() if p.suffix in (".msgpack", ".json")
    } - {"manifest.json"}
    for entry in manifest:
        data = fixture(entry["file"])
        assert len(data) == entry["bytes"], entry["file"]
        assert hashlib.sha256(data).hexdigest() == entry["sha256"], entry["file"]
    assert set(EXPECTED_ZMQ) | set(EXPECTED_TRTLLM) == {
        e["file"].rsplit(".", 1)[0] for e in manifest
    }


# -- every fixture decodes to the documented events ------------------------------------------

@pytest.mark.parametrize("name", sorted(EXPECTED_ZMQ))
def test_zmq_fixture_decodes_to_documented_events(name: str) -> None:
    batch = decode_zmq_frames([b"", (7).to_bytes(8, "big"), fixture(f"{name}.msgpack")])
    assert batch == KvEventBatch(ts=TS, events=EXPECTED_ZMQ[name], data_parallel_rank=0, seq=7,
                                 skipped=0, topic=b"")


@pytest.mark.parametrize("name", sorted(EXPECTED_TRTLLM))
def test_trtllm_fixture_decodes_to_documented_events(name: str) -> None:
    event_id, kind, events = EXPECTED_TRTLLM[name]
    (decoded,) = decode_trtllm_events(fixture(f"{name}.json"))
    # the block pool's window_size keys its blocks (group_idx): one pool per window
    pooled = tuple(e if isinstance(e, AllBlocksCleared) else dataclasses.replace(e, group_idx=4096)
                   for e in events)
    assert (decoded.event_id, decoded.kind, decoded.events) == (event_id, kind, pooled)
    assert decoded.window_size == 4096
    assert decoded.attention_dp_rank is None
    if kind == "created":
        assert decoded.num_blocks_per_cache_level == (2048, 0)


def test_sglang_signed_and_unsigned_hashes_are_one_key() -> None:
    assert [canonical_block_hash(h) for h in SGLANG_WIRE] == list(SGLANG)
    assert canonical_block_hash(SGLANG[0]) == SGLANG[0]


# -- our hashers reproduce the fixture hashes -------------------------------------------------

@pytest.mark.parametrize(("engine", "chain", "child"), [
    ("vllm", VLLM, VLLM_CHILD),
    ("sglang", SGLANG, None),
    ("trtllm", TRTLLM, TRTLLM_CHILD),
])
def test_hasher_reproduces_fixture_hashes(
    engine: str, chain: tuple[int, ...], child: int | None
) -> None:
    hasher = hasher_for(engine)
    assert block_hash_chain(hasher, TOKENS, 4) == list(chain)
    if child is not None:
        assert hasher(chain[-1], CHILD_TOKENS, None) == child


def test_hashers_match_hashes_decoded_from_the_fixtures() -> None:
    for name, engine in (("vllm-0.33.0__stored_chain3.msgpack", "vllm"),
                         ("sglang-0.5.22__stored_chain3.msgpack", "sglang")):
        (stored,) = decode_zmq_payload(fixture(name)).events
        assert isinstance(stored, BlockStored)
        assert tuple(block_hash_chain(hasher_for(engine), TOKENS, 4)) == stored.block_hashes
    (event,) = decode_trtllm_events(fixture("trtllm-current__stored_chain3.json"))
    (stored,) = event.events
    assert isinstance(stored, BlockStored)
    assert tuple(block_hash_chain(hasher_for("trtllm"), TOKENS, 4)) == stored.block_hashes


def test_salt_changes_every_hash_of_the_chain() -> None:
    for engine in ("vllm", "vllm-0.30", "sglang", "trtllm"):
        plain = block_hash_chain(hasher_for(engine), TOKENS, 4)
        salted = block_hash_chain(hasher_for(engine), TOKENS, 4, cache_salt="tenant-a")
        other = block_hash_chain(hasher_for(engine), TOKENS, 4, cache_salt="tenant-b")
        assert not set(plain) & set(salted)
        assert not set(salted) & set(other)


def test_vllm_chain_rejects_a_parent_it_did_not_compute() -> None:
    with pytest.raises(ValueError, match="not computed by this hasher"):
        hasher_for("vllm")(VLLM[0], TOKENS[4:8], None)
    # The raw digest (what VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=0 publishes) chains directly.
    vllm = hasher_for("vllm")
    root = vllm.digest(None, TOKENS[:4], None)  # type: ignore[attr-defined]
    assert vllm(root, TOKENS[4:8], None) == VLLM[1]


def test_cbor_encoding_is_canonical() -> None:
    assert cbor_encode((b"\x01", (1, 23, 24, 255, 256, 65536, 2**32), None, "a", -1, -25)) == (
        bytes.fromhex("864101870117181818ff190100" "1a00010000" "1b0000000100000000")
        + b"\xf6\x61a\x20\x38\x18")
    with pytest.raises(TypeError):
        cbor_encode(1.5)


# -- our encoders reproduce the fixtures byte for byte ---------------------------------------

@pytest.mark.parametrize("name", sorted(EXPECTED_ZMQ))
def test_encoder_reproduces_fixture_bytes(name: str) -> None:
    profile = name.split("__")[0]
    assert encode_zmq_payload(EXPECTED_ZMQ[name], profile, ts=TS, dp_rank=0) == fixture(
        f"{name}.msgpack")


def test_trtllm_queue_reproduces_fixture_bytes() -> None:
    queue = TrtllmEventQueue(16, window_size=4096, num_blocks_per_cache_level=(2048, 0))

    def drained() -> bytes:
        return json.dumps(queue.drain(), separators=(",", ":")).encode()

    assert drained() == fixture("trtllm-current__created.json")
    for name in ("stored_chain3", "stored_chain3_child", "removed"):
        queue.publish(EXPECTED_TRTLLM[f"trtllm-current__{name}"][2])
        assert drained() == fixture(f"trtllm-current__{name}.json")
    assert queue.drain() == []


def test_publisher_frames_and_fixtures_decode_alike() -> None:
    """Frames off a real PUB socket decode exactly as the fixtures (and carry their bytes)."""
    ctx = zmq.Context()
    sub = ctx.socket(zmq.SUB)
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    try:
        for profile in ("vllm-0.22.0", "vllm-0.33.0", "sglang-0.5.9", "sglang-0.5.22"):
            endpoint = f"inproc://kv-{profile}"
            pub = ZmqKvPublisher(profile, endpoint, context=ctx, clock=lambda: TS)
            sub.connect(endpoint)
            try:
                seq = _first_delivered(pub, sub)
                for name in sorted(n for n in EXPECTED_ZMQ if n.startswith(profile)):
                    pub.publish(EXPECTED_ZMQ[name])
                    seq += 1
                    assert sub.poll(5000)
                    frames = sub.recv_multipart()
                    raw = fixture(f"{name}.msgpack")
                    assert frames == [b"", seq.to_bytes(8, "big"), raw]
                    assert decode_zmq_frames(frames) == decode_zmq_frames(
                        [b"", seq.to_bytes(8, "big"), raw])
            finally:
                sub.disconnect(endpoint)
                pub.close()
    finally:
        sub.close(linger=0)
        ctx.term()


def _first_delivered(pub: ZmqKvPublisher, sub: Any) -> int:
    """Publish probes until one arrives (the subscription takes a moment); return its seq."""
    for probe in range(200):
        pub.publish([BlockRemoved((probe,))])
        if sub.poll(20):
            batch = decode_zmq_frames(sub.recv_multipart())
            assert batch.events == (BlockRemoved((probe,)),)
            assert batch.seq == probe  # sequence numbers start at 0, one per batch
            return probe
    raise AssertionError("subscription never reached the publisher")


# -- decoder tolerance -------------------------------------------------------------------------

def _payload(events: list[Any], *envelope_tail: Any) -> bytes:
    return msgpack.packb([TS, events, *envelope_tail])  # type: ignore[no-any-return]


def test_vllm_0_9_envelope_without_rank_and_extra_trailing_fields() -> None:
    future = ["BlockStored", [1], None, [1, 2], 2, None, "GPU", None, None, 3, "mamba", 8,
              "LOCAL", "tier0", "s1", [[9]], "some-future-field", 42]
    batch = decode_zmq_payload(_payload([future, ["BlockRemoved", [1], "GPU", 3, "LOCAL", "t", 7]]))
    assert batch.data_parallel_rank is None
    assert batch.events == (
        BlockStored((1,), None, (1, 2), 2, medium="GPU", group_idx=3, kv_cache_spec_kind="mamba",
                    kv_cache_spec_sliding_window=8, locality="LOCAL", ownership="tier0",
                    session_id="s1", lookahead_token_ids=((9,),)),
        BlockRemoved((1,), medium="GPU", group_idx=3, locality="LOCAL", ownership="t"),
    )
    minimal = decode_zmq_payload(_payload([["BlockStored", [5], 4, [1], 1], ["BlockRemoved", [5]]]))
    assert minimal.events == (BlockStored((5,), 4, (1,), 1), BlockRemoved((5,)))


def test_every_hash_representation_normalises_to_the_same_key() -> None:
    digest = hashlib.sha256(b"x").digest()
    low64 = int.from_bytes(digest[-8:], "big")
    v2_hex = digest.hex()
    raw = [digest, digest * 2, low64, -1, v2_hex]
    batch = decode_zmq_payload(_payload([["BlockRemoved", raw]]))
    assert batch.events[0].block_hashes == (  # type: ignore[union-attr]
        low64, low64, low64, U64 - 1, int.from_bytes(digest[:8], "big"))


def test_sglang_salt_metadata_map_events_and_bigram_tokens() -> None:
    salted = ["BlockStored", [-5], None, [1, 2], 2, None, "GPU", {"cache_salt": "s"}]
    mapped = {"type": "BlockStored", "block_hashes": [7], "parent_block_hash": -5,
              "token_ids": [[1, 2], [2, 3]], "block_size": 2, "lora_id": None,
              "cache_salt": "s", "session_id": "q", "lora_name": "ada", "unknown": [1]}
    batch = decode_zmq_payload(_payload([salted, mapped], 1))
    assert batch.data_parallel_rank == 1
    assert batch.events == (
        BlockStored((U64 - 5,), None, (1, 2), 2, medium="GPU", cache_salt="s"),
        BlockStored((7,), U64 - 5, (1, 2), 2, cache_salt="s", session_id="q", lora_name="ada",
                    token_pairs=((1, 2), (2, 3))),
    )
    assert encode_zmq_payload(batch.events[:1], "sglang-0.5.18", ts=TS, dp_rank=1) == _payload(
        [salted], 1)


def test_unknown_tags_are_skipped_and_counted() -> None:
    batch = decode_zmq_payload(_payload(
        [["BlockPinned", 1], {"type": "Future", "x": 1}, ["AllBlocksCleared"]], 0))
    assert (batch.events, batch.skipped) == ((AllBlocksCleared(),), 2)


def test_offloading_connector_placeholder_decodes() -> None:
    """vLLM's OffloadingConnector placeholder store (its ``_placeholder_stored``): no
    tokens, ``block_size`` 0. Refused, it took the GPU stores of its batch with it."""
    batch = decode_zmq_payload(_payload([
        ["BlockStored", [7, 8], None, [1, 2, 3, 4], 2, None, "GPU"],
        {"type": "BlockStored", "block_hashes": [7], "parent_block_hash": None,
         "token_ids": [], "block_size": 0, "lora_id": None, "medium": "CPU",
         "lora_name": None, "group_idx": 0, "locality": None, "ownership": None}], 0))
    stored = [(e.block_hashes, e.token_ids, e.block_size, e.medium) for e in batch.events
              if isinstance(e, BlockStored)]
    assert stored == [((7, 8), (1, 2, 3, 4), 2, "GPU"), ((7,), (), 0, "CPU")]


def test_map_envelope_is_tolerated() -> None:
    raw = msgpack.packb({"ts": 1, "events": [{"type": "AllBlocksCleared"}], "attn_dp_rank": 2})
    assert decode_zmq_payload(raw) == KvEventBatch(1.0, (AllBlocksCleared(),), 2)


@pytest.mark.parametrize(("event", "where"), [
    (["BlockStored", "x", None, [], 4], "$[1][1].block_hashes"),
    ({"type": "BlockRemoved", "block_hashes": [True]}, "$[1][1].block_hashes[0]"),
    (["BlockStored", [1], None, [1, -1], 4], "$[1][1].token_ids[1]"),
    (["BlockStored", [1], None, [1]], "$[1][1]"),  # too few fields
    ({"block_hashes": [1]}, "$[1][1]"),  # no type
    (7, "$[1][1]"),
])
def test_a_malformed_event_costs_only_itself(event: Any, where: str) -> None:
    """Its batch's other events are applied (refusing the batch would read as a sequence
    gap: a reset of the backend); the first bad one's location is kept for the log."""
    batch = decode_zmq_payload(_payload([["BlockRemoved", [5]], event, ["AllBlocksCleared"],
                                         {"type": "BlockRemoved", "block_hashes": [True]}]))
    assert batch.events == (BlockRemoved((5,)), AllBlocksCleared())
    assert (batch.malformed, batch.malformed_at, batch.skipped) == (2, where, 0)


@pytest.mark.parametrize(("event", "lost"), [
    (["BlockRemoved", [1], 3], True),  # a medium that is not a string
    (["BlockRemoved"], True),  # no hashes
    ({"type": "BlockRemoved", "block_hashes": "1"}, True),
    ({"block_hashes": [1]}, True),  # no type: it may have been a removal
    ({"type": ["BlockRemoved"], "block_hashes": [1]}, True),  # a type that is not a str
    ([7, [1]], True),
    ([], True),
    (7, True),  # not an event at all
    (["BlockStored", [1], None, [1, -1], 4], False),  # a bad store removed nothing
    ({"type": "BlockStored", "block_hashes": [1]}, False),
])
def test_a_malformed_removal_marks_its_batch(event: Any, lost: bool) -> None:
    """A malformed event that removed blocks (or whose tag cannot be read) makes the batch a
    ``RemovalLostBatch`` (the source then clears the rank: the removed blocks are unknown);
    a malformed store does not. The batch is otherwise the same."""
    batch = decode_zmq_payload(_payload([["BlockStored", [5], None, [1], 1], event,
                                         ["Unknown"]]), seq=4, topic=b"kv")
    assert batch.events == (BlockStored((5,), None, (1,), 1),)
    assert (batch.malformed, batch.skipped, batch.seq, batch.topic) == (1, 1, 4, b"kv")
    assert isinstance(batch, KvEventBatch)
    assert (type(batch) is RemovalLostBatch) == lost
    if lost:
        assert isinstance(batch, RemovalLostBatch) and batch.lost_removals == 1
    two = decode_zmq_payload(_payload([event, event]))
    assert getattr(two, "lost_removals", 0) == (2 if lost else 0)


@pytest.mark.parametrize(("payload", "where"), [
    (_payload([], "zero"), r"^\$\[2\]: "),
    (msgpack.packb(["ts", []]), r"^\$\[0\]: "),
    (b"\x93\xcb", r"^\$: not valid msgpack"),
    (_payload([]) + b"\x00", r"^\$: trailing bytes"),
])
def test_errors_say_what_and_where(payload: bytes, where: str) -> None:
    with pytest.raises(DecodeError, match=where):
        decode_zmq_payload(payload)


def test_frame_errors() -> None:
    with pytest.raises(DecodeError, match=r"^frames: expected 3 frames"):
        decode_zmq_frames([b"", b"\x00" * 8])
    with pytest.raises(DecodeError, match=r"^frames\[1\]: sequence number must be 8 bytes"):
        decode_zmq_frames([b"", b"\x00", _payload([])])
    with pytest.raises(DecodeError, match=r"^frames\[2\]: expected bytes"):
        decode_zmq_frames([b"", b"\x00" * 8, "text"])  # type: ignore[list-item]


# -- TensorRT-LLM specifics ----------------------------------------------------------------------

def _trt_block(h: Any, tokens: list[int], **extra: Any) -> dict[str, Any]:
    return {"type": "stored_block", "block_hash": h, "tokens": [
        {"type": "unique_token", "token_id": t, "token_extra_id": 0} for t in tokens],
        "cache_level": 0, "priority": 35, **extra}


def test_trtllm_partial_blocks_salt_mm_keys_and_updates() -> None:
    body = [
        {"event_id": 5, "data": {"type": "stored", "parent_hash": 9, "blocks": [
            _trt_block(1, [1, 2, 3, 4], cache_salt="s"),
            _trt_block(2, [5, 6, 7, 8], cache_salt="s",
                       mm_keys=[{"type": "mm_key", "hash": "ab" * 32, "start_offset": 3}]),
            _trt_block(3, [9], cache_salt="s")]}, "window_size": 256, "attention_dp_rank": 1},
        {"event_id": 6, "data": {"type": "updated", "block_hash": 2,
                                 "cache_level": {"type": "event_diff", "new_value": 1,
                                                 "old_value": 0}, "priority": None}},
        {"event_id": 7, "data": {"type": "evicted_to_disk", "block_hashes": [1]}},
        {"event_id": 8, "data": {"type": "removed", "block_hashes": ["00" * 8 + "ff" * 24]},
         "hash_algo": "v2_sha256", "layer_group_id": 0},
    ]
    stored, updated, unknown, removed = events = decode_trtllm_events(json.dumps(body))
    assert events.skipped == 1
    assert stored.events == (
        BlockStored((1, 2), 9, (1, 2, 3, 4, 5, 6, 7, 8), 4, medium="GPU", cache_salt="s",
                    priority=35, extra_keys=(None, (("ab" * 32, 3),)), group_idx=256),
        BlockStored((3,), 2, (9,), 1, medium="GPU", cache_salt="s", priority=35,
                    group_idx=256),
    )
    assert (stored.window_size, stored.attention_dp_rank) == (256, 1)
    # a cache-level change is a move: the hash alone stored on the new level, removed from
    # the old one (as vLLM's offloading reports it)
    assert updated.events == (BlockStored((2,), None, (), 0, medium="CPU"),
                              BlockRemoved((2,), medium="GPU")) and updated.update is not None
    assert (updated.update.block_hash, updated.update.cache_level, updated.update.priority) == (
        2, (0, 1), None)
    assert (unknown.kind, unknown.event_id, unknown.events) == ("evicted_to_disk", 7, ())
    assert removed.events == (BlockRemoved((0,)),)
    assert (removed.hash_algo, removed.layer_group_id, removed.window_size) == (
        "v2_sha256", 0, None)
    assert decode_trtllm_events(body) == events  # an already parsed body decodes alike


@pytest.mark.parametrize(("body", "where"), [
    (b"[{", r"^\$: not valid JSON"),
    (b"{}", r"^\$: expected an array"),
])
def test_trtllm_errors_say_what_and_where(body: bytes, where: str) -> None:
    with pytest.raises(DecodeError, match=where):
        decode_trtllm_events(body)


def _removed_env(event_id: int, *hashes: Any) -> dict[str, Any]:
    return {"event_id": event_id, "data": {"type": "removed", "block_hashes": list(hashes)}}


@pytest.mark.parametrize(("bad", "where", "kept"), [
    ({"event_id": 2, "data": {"type": "stored", "parent_hash": None, "blocks": [
        {"block_hash": 1.5, "tokens": [1]}]}}, "$[1].data.blocks[0].block_hash", MALFORMED),
    ({"event_id": 2, "data": {"type": "stored", "parent_hash": None, "blocks": [
        {"block_hash": 1, "tokens": []}]}}, "$[1].data.blocks[0].tokens", MALFORMED),
    ({"event_id": 2, "data": {"type": "updated", "block_hash": 1, "cache_level": {
        "old_value": 0, "new_value": -1}}}, "$[1].data.cache_level.new_value", MALFORMED),
    ({"event_id": 2, "data": {"type": "unknown-to-us", "block_hash": True},
      "window_size": "wide"}, "$[1].window_size", MALFORMED),
    # a removal, or what may have been one: its removal is lost (the source clears)
    (_removed_env(2, float("inf")), "$[1].data.block_hashes[0]", MALFORMED_REMOVAL),
    ({**_removed_env(2, 1), "window_size": "wide"}, "$[1].window_size", MALFORMED_REMOVAL),
    ({"event_id": 2, "data": "removed"}, "$[1].data", MALFORMED_REMOVAL),
    ({"event_id": 2, "data": {"type": 3, "block_hashes": [1]}}, "$[1].data.type",
     MALFORMED_REMOVAL),
    ({"event_id": 2, "data": {"block_hashes": [1]}}, "$[1].data.type", MALFORMED_REMOVAL),
    # a restart whatever its pool sizes
    ({"event_id": 2, "data": {"type": "created", "num_blocks_per_cache_level": "many"}},
     "$[1].data.num_blocks_per_cache_level", "created"),
    # without a readable id (or rank) it cannot keep its place: the id hole is a gap
    ({"data": {"type": "created"}}, "$[1].event_id", None),
    ({**_removed_env(2, 1), "attention_dp_rank": -1}, "$[1].attention_dp_rank", None),
    (7, "$[1]", None),
])
def test_trtllm_malformed_event_costs_only_itself(bad: Any, where: str,
                                                   kept: str | None) -> None:
    """The drain is destructive: refusing the reply would lose its good events for good. The
    bad one is counted (the first one's location kept for the log) and, when its id can be
    read, kept without neutral events so that its id still counts; a removal (or an event
    whose type cannot be read) is kept as a lost removal."""
    body = [_removed_env(1, 5), bad, _removed_env(3, 6), _removed_env(4, True)]
    events = decode_trtllm_events(json.dumps(body))
    assert (events.malformed, events.malformed_at, events.skipped) == (2, where, 0)
    good = [TrtllmEvent(1, "removed", (BlockRemoved((5,)),)),
            TrtllmEvent(3, "removed", (BlockRemoved((6,)),))]
    last = TrtllmEvent(4, MALFORMED_REMOVAL)
    if kept is None:
        assert events == [*good, last]
    else:
        middle = TrtllmEvent(2, kept, (AllBlocksCleared(),) if kept == "created" else ())
        assert events == [good[0], middle, good[1], last]


def test_trtllm_updates_decode_to_cache_level_moves() -> None:
    def update(level: Any, priority: Any = None, **envelope: Any) -> TrtllmEvent:
        diff = [None if d is None else {"type": "event_diff", "old_value": d[0],
                                        "new_value": d[1]} for d in (level, priority)]
        (event,) = decode_trtllm_events(json.dumps([{
            "event_id": 1, **envelope, "data": {"type": "updated", "block_hash": 7,
                                                "cache_level": diff[0], "priority": diff[1]}}]))
        return event

    moved = update((1, 0), window_size=512, attention_dp_rank=3)
    assert moved.events == (BlockStored((7,), None, (), 0, medium="GPU", group_idx=512),
                            BlockRemoved((7,), medium="CPU", group_idx=512))
    assert moved.attention_dp_rank == 3 and moved.update is not None
    assert update((0, 2)).events[0] == BlockStored((7,), None, (), 0, medium="CACHE_LEVEL_2")
    # priority-only, or no change at all: nothing for prefixes
    assert update(None, (35, 80)).events == () and update((1, 1)).events == ()


def test_trtllm_queue_merges_removals_clears_and_overflows() -> None:
    queue = TrtllmEventQueue(3, window_size=64, attention_dp_rank=0)
    queue.publish([BlockStored((1, 2), None, (1, 2, 3, 4), 2),
                   BlockStored((3,), 2, (5, 6), 2, medium="CPU")])
    queue.publish([BlockRemoved((1,)), BlockRemoved((3,), medium="CPU")])
    queue.publish([AllBlocksCleared()])
    drained = queue.drain()
    # created(0) and the first stored(1) were discarded: 3 slots, 5 events.
    assert [e["event_id"] for e in drained] == [2, 3, 4] and queue.dropped == 2
    assert drained[0]["data"]["blocks"][0]["cache_level"] == 1
    assert [e["data"] for e in drained[1:]] == [
        {"type": "removed", "block_hashes": [1, 3]}, {"type": "removed", "block_hashes": [2]}]
    assert all(e["window_size"] == 64 and e["attention_dp_rank"] == 0 for e in drained)
    queue.restart((8, 0))
    assert [(e["event_id"], e["data"]["type"]) for e in queue.drain()] == [(0, "created")]
    queue.close()
    with pytest.raises(RuntimeError):
        queue.publish([])


# -- property tests ------------------------------------------------------------------------------

# No example database (nothing written into the repo) and no deadline (no timed assertions).
PROPERTY = settings(database=None, deadline=None, max_examples=150,
                    suppress_health_check=[HealthCheck.too_slow])
hashes = st.integers(0, U64 - 1)
token = st.integers(0, 2**31)
opt_text = st.none() | st.text(max_size=6)
extra_key = st.recursive(st.none() | st.integers(-5, 2**40) | st.text(max_size=4)
                         | st.binary(max_size=4), lambda c: st.tuples(c, c), max_leaves=4)


@st.composite
def neutral_events(draw: st.DrawFn, profile: str) -> Any:
    """One event using only the fields ``profile`` carries (others stay at their default)."""
    wire = get_profile(profile)
    kind = draw(st.sampled_from(["stored", "removed", "cleared"]))
    if kind == "cleared":
        return AllBlocksCleared()
    fields = wire.stored_fields if kind == "stored" else wire.removed_fields
    values: dict[str, Any] = {"block_hashes": tuple(draw(st.lists(hashes, max_size=4)))}
    optional = {"medium": opt_text, "lora_name": opt_text, "kv_cache_spec_kind": opt_text,
                "locality": opt_text, "ownership": opt_text, "session_id": opt_text,
                "cache_salt": opt_text, "lora_id": st.none() | st.integers(0, 99),
                "group_idx": st.none() | st.integers(0, 9),
                "kv_cache_spec_sliding_window": st.none() | st.integers(1, 4096)}
    for name in fields:
        if name in optional:
            values[name] = draw(optional[name])
    if wire.salt_metadata and kind == "stored":
        values["cache_salt"] = draw(opt_text)
    if kind == "removed":
        return BlockRemoved(**values)
    n, size = max(len(values["block_hashes"]), 1), draw(st.integers(1, 4))
    values["block_hashes"] = values["block_hashes"] or (draw(hashes),)
    values["parent_block_hash"] = draw(st.none() | hashes)
    values["block_size"] = size
    if wire.signed_hashes and draw(st.booleans()):  # SGLang EAGLE bigram pages
        pairs = tuple(draw(st.lists(st.tuples(token, token), min_size=n * size,
                                    max_size=n * size)))
        values["token_pairs"], values["token_ids"] = pairs, tuple(p[0] for p in pairs)
    else:
        values["token_ids"] = tuple(draw(st.lists(token, min_size=n * size, max_size=n * size)))
    if "extra_keys" in fields:
        values["extra_keys"] = draw(st.none() | st.tuples(*[st.none() | st.tuples(extra_key)] * n))
    if "lookahead_token_ids" in fields:
        values["lookahead_token_ids"] = draw(st.none() | st.tuples(*[st.tuples(token)] * n))
    return BlockStored(**values)


@pytest.mark.parametrize("profile", sorted(PROFILES))
@PROPERTY
@given(data=st.data(), ts=st.floats(allow_nan=False), rank=st.none() | st.integers(0, 64))
def test_roundtrip_through_every_profile(
    profile: str, data: st.DataObject, ts: float, rank: int | None
) -> None:
    events = tuple(data.draw(st.lists(neutral_events(profile), max_size=5)))
    batch = decode_zmq_payload(encode_zmq_payload(events, profile, ts=ts, dp_rank=rank))
    assert (batch.ts, batch.events, batch.data_parallel_rank, batch.skipped) == (
        ts, events, rank, 0)


@st.composite
def trtllm_step(draw: st.DrawFn) -> Any:
    if draw(st.booleans()):
        return BlockRemoved(tuple(draw(st.lists(hashes, min_size=1, max_size=4))))
    n, size = draw(st.integers(1, 4)), draw(st.integers(1, 4))
    mm = st.none() | st.tuples(st.tuples(st.text(min_size=1, max_size=8), st.integers(0, 99)))
    extra = draw(st.none() | st.tuples(*[mm] * n))
    return BlockStored(
        tuple(draw(st.lists(hashes, min_size=n, max_size=n))), draw(st.none() | hashes),
        tuple(draw(st.lists(token, min_size=n * size, max_size=n * size))), size,
        medium=draw(st.sampled_from(["GPU", "CPU"])), cache_salt=draw(opt_text),
        priority=draw(st.integers(0, 100)),
        extra_keys=extra if extra and any(e is not None for e in extra) else None)


@PROPERTY
@given(steps=st.lists(trtllm_step(), max_size=6))
def test_trtllm_roundtrip(steps: list[Any]) -> None:
    queue = TrtllmEventQueue(64, window_size=128)
    for event in steps:
        queue.publish([event])
    decoded = decode_trtllm_events(json.dumps(queue.drain()).encode())
    assert [e.event_id for e in decoded] == list(range(len(steps) + 1))
    assert [e.events for e in decoded[1:]] == [
        (dataclasses.replace(event, group_idx=128),) for event in steps]


# -- fuzzing: DecodeError and nothing else ---------------------------------------------------------

def only_decode_error(decode: Any, value: Any) -> None:
    try:
        decode(value)
    except DecodeError:
        pass


scalars = (st.none() | st.booleans() | st.integers(-(2**63), U64 - 1) | st.floats()
           | st.text(max_size=8) | st.binary(max_size=40))
values = st.recursive(scalars, lambda c: st.lists(c, max_size=5) | st.dictionaries(
    st.text(max_size=8) | st.integers(-3, 3), c, max_size=5), max_leaves=25)
tags = st.sampled_from(["BlockStored", "BlockRemoved", "AllBlocksCleared"]) | st.text(max_size=5)
field_names = st.sampled_from([*STORED_FIELDS, "type", "cache_salt", "metadata"])
near_events = (st.builds(lambda t, rest: [t, *rest], tags, st.lists(values, max_size=17))
               | st.builds(lambda t, rest: {"type": t, **rest}, tags,
                           st.dictionaries(field_names, values, max_size=8)))
near_batches = st.builds(lambda ts, events, tail: [ts, events, *tail], values,
                         st.lists(near_events, max_size=4), st.lists(values, max_size=2))


@PROPERTY
@given(payload=st.binary(max_size=200))
def test_random_bytes_raise_only_decode_error(payload: bytes) -> None:
    only_decode_error(decode_zmq_payload, payload)
    only_decode_error(decode_trtllm_events, payload)


@PROPERTY
@given(structure=values | near_batches)
def test_random_msgpack_structures_raise_only_decode_error(structure: Any) -> None:
    only_decode_error(decode_zmq_payload, msgpack.packb(structure))


@PROPERTY
@given(frames=st.lists(st.binary(max_size=12) | st.builds(msgpack.packb, near_batches),
                       max_size=4))
def test_random_frames_raise_only_decode_error(frames: list[bytes]) -> None:
    only_decode_error(decode_zmq_frames, frames)


@PROPERTY
@given(name=st.sampled_from(sorted(EXPECTED_ZMQ)), position=st.integers(0, 10**6),
       byte=st.integers(0, 255), cut=st.booleans())
def test_corrupted_fixtures_raise_only_decode_error(
    name: str, position: int, byte: int, cut: bool
) -> None:
    raw = bytearray(fixture(f"{name}.msgpack"))
    position %= len(raw)
    if cut:
        del raw[position:]
    else:
        raw[position] = byte
    only_decode_error(decode_zmq_payload, bytes(raw))


json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=8),
    lambda c: st.lists(c, max_size=4) | st.dictionaries(st.text(max_size=8), c, max_size=4),
    max_leaves=20)
trt_fields = st.sampled_from(["type", "parent_hash", "blocks", "block_hashes", "block_hash",
                              "tokens", "token_id", "cache_level", "priority", "mm_keys",
                              "cache_salt", "num_blocks_per_cache_level", "new_value",
                              "old_value", "hash", "start_offset", "lora_id"])
trt_objects = st.recursive(json_values, lambda c: st.lists(c, max_size=3) | st.dictionaries(
    trt_fields, c, max_size=6), max_leaves=30)
trt_envelopes = st.lists(st.fixed_dictionaries(
    {"event_id": json_values | st.integers(0, 9), "data": trt_objects},
    optional={"window_size": json_values, "attention_dp_rank": json_values,
              "hash_algo": json_values, "layer_group_id": json_values}), max_size=3)


@PROPERTY
@given(body=json_values | trt_envelopes)
def test_random_trtllm_bodies_raise_only_decode_error(body: Any) -> None:
    only_decode_error(decode_trtllm_events, json.dumps(body))
    if isinstance(body, list):
        only_decode_error(decode_trtllm_events, body)
