"""Decode every engine's KV-cache event wire format into ``continuum.kv_events``.

One module for all formats, described in ``docs/kv-events.md`` (the § below are its sections):

* vLLM array-encoded events (0.9.x-0.23), vLLM map-encoded events (≥0.24), SGLang arrays
  (including 0.5.18-0.5.19 ``BlockStoredWithMetadata``, whose 8th element is a
  ``{"cache_salt": ...}`` map) and SGLang maps (≥0.5.20: ``cache_salt``, ``session_id``,
  ``lora_name``). Events are decoded *by shape* (§12): an array is ``[tag, field, ...]`` read
  by position, with extra trailing fields ignored and missing optional ones left ``None``; a
  map is read by name with unknown keys ignored. The batch envelope is an array (every
  release) or, tolerated, a map (an unreleased vLLM branch, §2).
* ``trtllm-serve`` ``POST /kv_cache_events`` JSON (§8): :func:`decode_trtllm_events`,
  implemented in :mod:`listener.decode_trtllm` (kept apart for size) and re-exported here,
  so this module is the one import for every format.

**Canonical block hash.** Every block hash and parent hash comes out as an *unsigned 64-bit
int* (:func:`canonical_block_hash`, rules in :mod:`listener.wire_fields`): SGLang's negative
int64 taken modulo 2**64, a vLLM ``bin`` digest as its last 8 bytes, a TensorRT-LLM V2 hex
digest as its first 8 bytes. ``continuum.sim.hashing`` computes hashes in the same form.

**Unknown event tags** are not fatal: such events are skipped and counted in
``KvEventBatch.skipped`` (TRT-LLM: ``TrtllmEventList.skipped``). Neither is **one malformed
event** of a ZMQ batch or a TRT-LLM reply: it is skipped and counted in
``KvEventBatch.malformed`` (TRT-LLM: ``TrtllmEventList.malformed``; the first one's location
in ``malformed_at``), and the other events are applied. A malformed event of a ZMQ batch
that removed blocks (tag ``BlockRemoved``, or a tag that cannot be read) makes the batch a
:class:`RemovalLostBatch`: the source then counts that rank's state as lost (TRT-LLM:
``malformed-removal``, :data:`MALFORMED_REMOVAL`).

**Errors.** Anything malformed raises :class:`~listener.errors.DecodeError` (a ``ValueError``)
naming the location, e.g. ``$[1][0].block_hashes: expected an array, got str``; no other
exception type escapes for any input.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import msgpack

from continuum.kv_events import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KvEvent,
    KvEventBatch,
)
from listener.decode_trtllm import (
    MALFORMED_REMOVAL,
    TrtllmBlockUpdated,
    TrtllmEvent,
    TrtllmEventList,
    decode_trtllm_events,
)
from listener.errors import DecodeError
from listener.wire_fields import (
    canonical_block_hash,
    expect_int,
    expect_list,
    freeze,
    hash_list,
    optional_hash,
    optional_int,
    optional_str,
    type_name,
)

__all__ = [
    "MALFORMED_REMOVAL",
    "REMOVED_FIELDS",
    "STORED_FIELDS",
    "DecodeError",
    "RemovalLostBatch",
    "TrtllmBlockUpdated",
    "TrtllmEvent",
    "TrtllmEventList",
    "canonical_block_hash",
    "decode_trtllm_events",
    "decode_zmq_frames",
    "decode_zmq_payload",
]

#: BlockStored fields by array position after the tag (vLLM declaration order, §4.1). SGLang
#: arrays are a prefix of this (§4.3), except that position 6 may be SGLang's metadata map.
STORED_FIELDS = (
    "block_hashes",
    "parent_block_hash",
    "token_ids",
    "block_size",
    "lora_id",
    "medium",
    "lora_name",
    "extra_keys",
    "group_idx",
    "kv_cache_spec_kind",
    "kv_cache_spec_sliding_window",
    "locality",
    "ownership",
    "session_id",
    "lookahead_token_ids",
)
#: BlockRemoved fields by array position after the tag (§4.2; SGLang's are a prefix).
REMOVED_FIELDS = ("block_hashes", "medium", "group_idx", "locality", "ownership")
_STORED_MAP_FIELDS = frozenset((*STORED_FIELDS, "cache_salt"))
_REMOVED_MAP_FIELDS = frozenset(REMOVED_FIELDS)
_OPTIONAL_STR_FIELDS = frozenset(
    ("medium", "lora_name", "kv_cache_spec_kind", "locality", "ownership", "session_id",
     "cache_salt")
)
_OPTIONAL_INT_FIELDS = frozenset(("lora_id", "group_idx", "kv_cache_spec_sliding_window"))
_MISSING: Any = object()


@dataclass(frozen=True, slots=True)
class RemovalLostBatch(KvEventBatch):
    """A ZMQ batch with malformed events of which at least one removed blocks (its tag is
    ``BlockRemoved``, or cannot be read): what :func:`decode_zmq_payload` returns for it.

    Skipping such an event like a bad store would leave the blocks it removed indexed for
    good, so the source counts the state of the batch's rank as lost once the batch is
    applied (as for a TensorRT-LLM ``malformed-removal``, §8). Every other batch is a plain
    :class:`~continuum.kv_events.KvEventBatch`.
    """

    #: The malformed events that removed (or may have removed) blocks; 1 or more.
    lost_removals: int = 1


def _removal_tag(raw: object) -> bool:
    """Whether a malformed event may have removed blocks: its tag is ``BlockRemoved`` or
    cannot be read (no tag, not a string, not an event at all)."""
    if isinstance(raw, list):
        tag = raw[0] if raw else None
    elif isinstance(raw, dict):
        tag = raw.get("type")
    else:
        tag = None
    return not isinstance(tag, str) or tag == "BlockRemoved"


def _token_ids(
    value: object, path: str
) -> tuple[tuple[int, ...], tuple[tuple[int, int], ...] | None]:
    """Decode ``token_ids``: ints, or (SGLang EAGLE bigram mode) 2-element token pairs."""
    items = expect_list(value, path)
    if not items or not isinstance(items[0], list):
        return tuple(expect_int(t, f"{path}[{i}]", minimum=0) for i, t in enumerate(items)), None
    pairs: list[tuple[int, int]] = []
    for i, pair in enumerate(items):
        if not isinstance(pair, list) or len(pair) != 2:
            raise DecodeError(f"{path}[{i}]", "expected a token pair (array of 2 ints), "
                              f"got {type_name(pair)}")
        pairs.append((expect_int(pair[0], f"{path}[{i}][0]", minimum=0),
                      expect_int(pair[1], f"{path}[{i}][1]", minimum=0)))
    return tuple(first for first, _ in pairs), tuple(pairs)


def _extra_keys(value: object, path: str) -> tuple[tuple[object, ...] | None, ...] | None:
    if value is None:
        return None
    entries: list[tuple[object, ...] | None] = []
    for i, entry in enumerate(expect_list(value, path)):
        if entry is None:
            entries.append(None)
        else:
            keys = expect_list(entry, f"{path}[{i}]")
            entries.append(tuple(freeze(k, f"{path}[{i}][{j}]", 1) for j, k in enumerate(keys)))
    return tuple(entries)


def _lookahead(value: object, path: str) -> tuple[tuple[int, ...], ...] | None:
    if value is None:
        return None
    rows = expect_list(value, path)
    return tuple(
        tuple(expect_int(t, f"{path}[{i}][{j}]", minimum=0)
              for j, t in enumerate(expect_list(row, f"{path}[{i}]")))
        for i, row in enumerate(rows)
    )


def _block_stored(fields: dict[str, object], path: str) -> BlockStored:
    """Build a BlockStored from raw fields by name (array and map events share this)."""
    for required in ("block_hashes", "token_ids", "block_size"):
        if required not in fields:
            raise DecodeError(path, f"BlockStored has no {required!r}")
    kwargs: dict[str, Any] = {}
    for name, raw in fields.items():
        fpath = f"{path}.{name}"
        if name == "block_hashes":
            kwargs[name] = hash_list(raw, fpath)
        elif name == "parent_block_hash":
            kwargs[name] = optional_hash(raw, fpath)
        elif name == "token_ids":
            kwargs["token_ids"], kwargs["token_pairs"] = _token_ids(raw, fpath)
        elif name == "block_size":
            # 0: vLLM's offloading connector's placeholder (see listener.processor)
            kwargs[name] = expect_int(raw, fpath, minimum=0)
        elif name in _OPTIONAL_STR_FIELDS:
            kwargs[name] = optional_str(raw, fpath)
        elif name in _OPTIONAL_INT_FIELDS:
            kwargs[name] = optional_int(raw, fpath)
        elif name == "extra_keys":
            kwargs[name] = _extra_keys(raw, fpath)
        elif name == "lookahead_token_ids":
            kwargs[name] = _lookahead(raw, fpath)
    kwargs.setdefault("parent_block_hash", None)
    return BlockStored(**kwargs)


def _block_removed(fields: dict[str, object], path: str) -> BlockRemoved:
    if "block_hashes" not in fields:
        raise DecodeError(path, "BlockRemoved has no 'block_hashes'")
    return BlockRemoved(
        block_hashes=hash_list(fields["block_hashes"], f"{path}.block_hashes"),
        medium=optional_str(fields.get("medium"), f"{path}.medium"),
        group_idx=optional_int(fields.get("group_idx"), f"{path}.group_idx"),
        locality=optional_str(fields.get("locality"), f"{path}.locality"),
        ownership=optional_str(fields.get("ownership"), f"{path}.ownership"),
    )


def _array_event(raw: list[Any], path: str) -> KvEvent | None:
    if not raw:
        raise DecodeError(path, "empty event array (no tag)")
    tag, body = raw[0], raw[1:]
    if not isinstance(tag, str):
        raise DecodeError(f"{path}[0]", f"event tag must be a str, got {type_name(tag)}")
    if tag == "BlockStored":
        if len(body) < 4:
            raise DecodeError(path, "BlockStored needs at least 4 fields (block_hashes, "
                              f"parent_block_hash, token_ids, block_size), got {len(body)}")
        fields: dict[str, object] = dict(zip(STORED_FIELDS, body, strict=False))
        metadata = fields.get("lora_name")
        if isinstance(metadata, dict):
            # SGLang 0.5.18-0.5.19 BlockStoredWithMetadata: the 8th element is a metadata map
            # where vLLM has lora_name.
            del fields["lora_name"]
            fields["cache_salt"] = optional_str(
                metadata.get("cache_salt"), f"{path}.metadata.cache_salt"
            )
        return _block_stored(fields, path)
    if tag == "BlockRemoved":
        if not body:
            raise DecodeError(path, "BlockRemoved needs at least 1 field (block_hashes)")
        return _block_removed(dict(zip(REMOVED_FIELDS, body, strict=False)), path)
    if tag == "AllBlocksCleared":
        return AllBlocksCleared()
    return None


def _map_event(raw: dict[Any, Any], path: str) -> KvEvent | None:
    tag = raw.get("type", _MISSING)
    if tag is _MISSING:
        raise DecodeError(path, "event map has no 'type' key")
    if not isinstance(tag, str):
        raise DecodeError(f"{path}.type", f"event tag must be a str, got {type_name(tag)}")
    if tag == "BlockStored":
        return _block_stored({k: v for k, v in raw.items() if k in _STORED_MAP_FIELDS}, path)
    if tag == "BlockRemoved":
        return _block_removed({k: v for k, v in raw.items() if k in _REMOVED_MAP_FIELDS}, path)
    if tag == "AllBlocksCleared":
        return AllBlocksCleared()
    return None


def _envelope(obj: object) -> tuple[tuple[object, str], tuple[object, str], tuple[object, str]]:
    """Split a batch into ``(value, path)`` for its ts, events and rank."""
    if isinstance(obj, list):
        if len(obj) < 2:
            raise DecodeError("$", f"batch array needs [ts, events, ...], got {len(obj)} elements")
        # vLLM 0.9.0 has no third (rank) element; later fields, if any, are ignored.
        rank = obj[2] if len(obj) > 2 else None
        return (obj[0], "$[0]"), (obj[1], "$[1]"), (rank, "$[2]")
    if isinstance(obj, dict):
        # Only an unmerged vLLM branch writes a map envelope (§2); read it by field name.
        for key in ("ts", "events"):
            if key not in obj:
                raise DecodeError("$", f"batch map has no {key!r}")
        rank_key = "attn_dp_rank" if "attn_dp_rank" in obj else "data_parallel_rank"
        rank = obj.get(rank_key)
        return (obj["ts"], "$.ts"), (obj["events"], "$.events"), (rank, f"$.{rank_key}")
    raise DecodeError("$", f"batch must be an array [ts, events, rank], got {type_name(obj)}")


def decode_zmq_payload(
    payload: bytes, *, seq: int | None = None, topic: bytes | None = None
) -> KvEventBatch:
    """Decode one msgpack ``KVEventBatch`` payload (vLLM or SGLang, any release).

    Args:
        payload: The third frame of a ZMQ KV-event message.
        seq: Sequence number to record on the batch (from the second frame), if known.
        topic: Topic frame to record on the batch, if known.

    Returns:
        The batch with its known events in order; unknown tags counted in ``skipped``,
        malformed events in ``malformed``. A batch with a malformed removal (or an event
        whose tag cannot be read) is a :class:`RemovalLostBatch`.

    Raises:
        DecodeError: The payload is not a valid batch.
    """
    if not isinstance(payload, (bytes, bytearray, memoryview)):
        raise DecodeError("$", f"payload must be bytes, got {type(payload).__name__}")
    try:
        obj = msgpack.unpackb(bytes(payload), raw=False, strict_map_key=False, use_list=True)
    except msgpack.ExtraData:
        raise DecodeError("$", "trailing bytes after the msgpack batch") from None
    except Exception as exc:
        # msgpack reports bad input through many exception types (ValueError, TypeError for
        # unhashable keys, StackError, UnicodeDecodeError, ...); all mean the same to us.
        raise DecodeError("$", f"not valid msgpack ({type(exc).__name__}: {exc})") from None
    (ts, ts_path), (raw_events, events_path), (rank, rank_path) = _envelope(obj)
    if isinstance(ts, bool) or not isinstance(ts, (int, float)):
        raise DecodeError(ts_path, f"expected a float timestamp, got {type_name(ts)}")
    events: list[KvEvent] = []
    skipped = malformed = lost_removals = 0
    malformed_at: str | None = None
    for i, raw in enumerate(expect_list(raw_events, events_path)):
        path = f"{events_path}[{i}]"
        try:
            if isinstance(raw, list):
                event = _array_event(raw, path)
            elif isinstance(raw, dict):
                event = _map_event(raw, path)
            else:
                raise DecodeError(path, f"event must be an array or a map, got "
                                  f"{type_name(raw)}")
        except DecodeError as exc:
            # One event's bad fields cost that event, not the others of its batch: its
            # sequence number is good, and refusing it all would read as a gap (a reset).
            malformed += 1
            if malformed_at is None:
                malformed_at = exc.path
            lost_removals += _removal_tag(raw)
            continue
        if event is None:
            skipped += 1
        else:
            events.append(event)
    data_parallel_rank = optional_int(rank, rank_path, minimum=0)
    if lost_removals:
        return RemovalLostBatch(ts=float(ts), events=tuple(events),
                                data_parallel_rank=data_parallel_rank, seq=seq,
                                skipped=skipped, malformed=malformed,
                                malformed_at=malformed_at, topic=topic,
                                lost_removals=lost_removals)
    return KvEventBatch(
        ts=float(ts),
        events=tuple(events),
        data_parallel_rank=data_parallel_rank,
        seq=seq,
        skipped=skipped,
        malformed=malformed,
        malformed_at=malformed_at,
        topic=topic,
    )


def decode_zmq_frames(frames: Sequence[bytes]) -> KvEventBatch:
    """Decode one live 3-frame message ``[topic, seq, payload]`` (§1.2).

    Args:
        frames: The frames as received (``recv_multipart()``).

    Returns:
        The batch, with ``seq`` (8-byte big-endian unsigned) and ``topic`` filled in.

    Raises:
        DecodeError: Wrong frame count, a sequence frame that is not 8 bytes, or a bad payload.
    """
    if not isinstance(frames, (list, tuple)):
        raise DecodeError("frames", f"expected a list of frames, got {type(frames).__name__}")
    if len(frames) != 3:
        raise DecodeError("frames", f"expected 3 frames [topic, seq, payload], got {len(frames)}")
    for i, frame in enumerate(frames):
        if not isinstance(frame, (bytes, bytearray, memoryview)):
            raise DecodeError(f"frames[{i}]", f"expected bytes, got {type(frame).__name__}")
    seq_frame = bytes(frames[1])
    if len(seq_frame) != 8:
        raise DecodeError("frames[1]", "sequence number must be 8 bytes big-endian, "
                          f"got {len(seq_frame)} bytes")
    return decode_zmq_payload(
        frames[2], seq=int.from_bytes(seq_frame, "big"), topic=bytes(frames[0])
    )
