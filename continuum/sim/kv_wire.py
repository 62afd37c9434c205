"""Encode neutral KV events in each engine's wire format (``docs/kv-events.md`` §2-§4, §8).

The simulated engine's publishers (:mod:`continuum.sim.kv_publish`) use these; the output is
byte-identical to what the engines' msgspec structs produce (the fixtures under
``tests/fixtures/kv-events/`` prove it). Encoding is faithful, not helpful: a field the
profile's engine does not have is dropped, and a ``None`` is written as the engine would
(arrays carry every declared field; maps omit ``None`` optional fields but keep required
ones). Hashes are taken in canonical form (unsigned 64-bit ints) and written as the engine
writes them: vLLM uint64 (or ``bin`` if given ``bytes``), SGLang signed int64.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import msgpack

from continuum.kv_events import AllBlocksCleared, BlockHash, BlockRemoved, BlockStored, KvEvent

__all__ = [
    "PROFILES",
    "WireProfile",
    "encode_zmq_payload",
    "get_profile",
    "trtllm_created_data",
    "trtllm_removed_data",
    "trtllm_stored_data",
]

_U64 = (1 << 64) - 1

_VLLM_STORED = (
    "block_hashes", "parent_block_hash", "token_ids", "block_size", "lora_id", "medium",
    "lora_name", "extra_keys", "group_idx", "kv_cache_spec_kind",
    "kv_cache_spec_sliding_window", "locality", "ownership", "session_id",
    "lookahead_token_ids",
)
_VLLM_REMOVED = ("block_hashes", "medium", "group_idx", "locality", "ownership")
_SGLANG_STORED = ("block_hashes", "parent_block_hash", "token_ids", "block_size", "lora_id",
                  "medium")


@dataclass(frozen=True)
class WireProfile:
    """How one engine release writes KV events and runs its sockets.

    Attributes:
        name: Profile name (``"vllm-0.33"``).
        maps: Events are map-encoded (vLLM ≥0.24, SGLang ≥0.5.20); else arrays.
        stored_fields: BlockStored fields in declaration order.
        removed_fields: BlockRemoved fields in declaration order.
        required: Fields a map always carries, even when ``None`` (no default upstream).
        signed_hashes: Hashes go out as signed int64 (SGLang).
        salt_metadata: A salted store appends ``{"cache_salt": salt}`` (SGLang 0.5.18-0.5.19).
        salt_extra_key: A salted store that contains block 0 (no parent) carries the salt as
            ``extra_keys[0] == (salt,)``, the other entries ``None`` (vLLM ≥0.17, §6/§10);
            the neutral ``cache_salt`` field itself is not on vLLM's wire.
        topic_in_replay: Replay replies are ``[topic, seq, payload]`` (else ``[seq, payload]``).
        binds_any_address: ``0.0.0.0`` endpoints bind (SGLang ≥0.5.13).
        keeps_port_zero: Rank offsets leave port 0 alone (vLLM ≥0.31).
    """

    name: str
    maps: bool
    stored_fields: tuple[str, ...]
    removed_fields: tuple[str, ...]
    required: frozenset[str] = frozenset()
    signed_hashes: bool = False
    salt_metadata: bool = False
    salt_extra_key: bool = False
    topic_in_replay: bool = False
    binds_any_address: bool = False
    keeps_port_zero: bool = False


_VLLM_REQUIRED = frozenset(("block_hashes", "parent_block_hash", "token_ids", "block_size",
                            "lora_id", "medium", "lora_name"))
_SGLANG_REQUIRED = frozenset(("block_hashes", "parent_block_hash", "token_ids", "block_size",
                              "lora_id"))

#: The supported profiles. vLLM 0.22 is the last array layout (0.22-0.23); vLLM 0.33 maps with
#: every field to date; SGLang 0.5.9 arrays (0.5.9-0.5.17); SGLang 0.5.18 arrays with salt
#: metadata (0.5.18-0.5.19); SGLang 0.5.22 maps with ``lora_name`` (0.5.22-0.5.23).
PROFILES: dict[str, WireProfile] = {
    p.name: p
    for p in (
        WireProfile("vllm-0.22", maps=False, stored_fields=_VLLM_STORED[:11],
                    removed_fields=_VLLM_REMOVED[:3], salt_extra_key=True),
        WireProfile("vllm-0.33", maps=True, stored_fields=_VLLM_STORED,
                    removed_fields=_VLLM_REMOVED, required=_VLLM_REQUIRED, salt_extra_key=True,
                    topic_in_replay=True, keeps_port_zero=True),
        WireProfile("sglang-0.5.9", maps=False, stored_fields=_SGLANG_STORED,
                    removed_fields=("block_hashes", "medium"), signed_hashes=True),
        WireProfile("sglang-0.5.18", maps=False, stored_fields=_SGLANG_STORED,
                    removed_fields=("block_hashes", "medium"), signed_hashes=True,
                    salt_metadata=True, binds_any_address=True),
        WireProfile("sglang-0.5.22", maps=True,
                    stored_fields=(*_SGLANG_STORED, "cache_salt", "session_id", "lora_name"),
                    removed_fields=("block_hashes", "medium"), required=_SGLANG_REQUIRED,
                    signed_hashes=True, topic_in_replay=True, binds_any_address=True),
    )
}


def get_profile(name: str) -> WireProfile:
    """Look up a profile; full release numbers (``"vllm-0.33.0"``) are accepted too.

    Raises:
        ValueError: Unknown profile, with the list of known ones.
    """
    profile = PROFILES.get(name) or PROFILES.get(name.removesuffix(".0"))
    if profile is None:
        raise ValueError(f"unknown KV-event profile {name!r}; known: {', '.join(PROFILES)}")
    return profile


def _wire_hash(value: BlockHash, signed: bool) -> int | bytes:
    if isinstance(value, bytes):
        if not signed:
            return value  # vLLM's raw-digest representation
        value = int.from_bytes(value[-8:], "big")
    value &= _U64
    return value - (1 << 64) if signed and value >= 1 << 63 else value


def _pack(value: object) -> bytes:
    packed: bytes = msgpack.packb(value)
    return packed


def _salt_extra_keys(event: BlockStored) -> tuple[tuple[object, ...] | None, ...] | None:
    """vLLM's published ``extra_keys`` of a salted store (§6, §10).

    The salt is an extra key of block 0 only, so only the event holding block 0 (the one
    without a parent) shows it: entry 0 is ``(salt,)`` (0.17-0.30 publish the hashed tuple,
    whose salt key is the plain string; ≥0.31 publish the untagged form, the same string),
    one ``None`` per other block. Extra keys already on the event are left alone.
    """
    if (event.cache_salt is None or event.parent_block_hash is not None
            or event.extra_keys is not None or not event.block_hashes):
        return event.extra_keys
    return ((event.cache_salt,), *([None] * (len(event.block_hashes) - 1)))


def _field_value(event: KvEvent, name: str, signed: bool, salt_extra_key: bool = False) -> object:
    if name == "extra_keys" and salt_extra_key and isinstance(event, BlockStored):
        keys = _salt_extra_keys(event)
        return None if keys is None else [None if k is None else list(k) for k in keys]
    value = getattr(event, name)
    if name == "block_hashes":
        return [_wire_hash(h, signed) for h in value]
    if name == "parent_block_hash":
        return None if value is None else _wire_hash(value, signed)
    if name == "token_ids" and isinstance(event, BlockStored) and event.token_pairs is not None:
        return [list(pair) for pair in event.token_pairs]
    if isinstance(value, tuple):
        return list(value)
    return value


def _array_header(n: int) -> bytes:
    if n < 16:
        return bytes([0x90 | n])
    return b"\xdc" + n.to_bytes(2, "big") if n < 1 << 16 else b"\xdd" + n.to_bytes(4, "big")


def _map_header(n: int, declared: int) -> bytes:
    # msgspec sizes the header for the most keys the struct could write (declared fields +
    # the tag), so vLLM 0.33's BlockStored always gets map16 even with 10 keys present.
    if declared + 1 > 15:
        return b"\xde" + n.to_bytes(2, "big")
    return bytes([0x80 | n])


def _encode_event(event: KvEvent, profile: WireProfile) -> bytes:
    fields: tuple[str, ...]
    if isinstance(event, BlockStored):
        tag, fields = "BlockStored", profile.stored_fields
    elif isinstance(event, BlockRemoved):
        tag, fields = "BlockRemoved", profile.removed_fields
    elif isinstance(event, AllBlocksCleared):
        tag, fields = "AllBlocksCleared", ()
    else:
        raise TypeError(f"not a KV event: {type(event).__name__}")
    values = [(name, _field_value(event, name, profile.signed_hashes, profile.salt_extra_key))
              for name in fields]
    if not profile.maps:
        items: list[object] = [tag, *(value for _, value in values)]
        if (profile.salt_metadata and isinstance(event, BlockStored)
                and event.cache_salt is not None):
            # SGLang 0.5.18-0.5.19 BlockStoredWithMetadata: the salt rides in an 8th element.
            items.append({"cache_salt": event.cache_salt})
        return _pack(items)
    pairs = [_pack("type") + _pack(tag)]
    pairs.extend(_pack(name) + _pack(value)
                 for name, value in values if value is not None or name in profile.required)
    return _map_header(len(pairs), len(fields)) + b"".join(pairs)


def encode_zmq_payload(
    events: Sequence[KvEvent], profile: WireProfile | str, *, ts: float, dp_rank: int | None = 0
) -> bytes:
    """Encode one ``KVEventBatch`` payload: ``[ts: float64, events, rank]``.

    Args:
        events: The events of one scheduler step.
        profile: A :class:`WireProfile` or its name.
        ts: Batch timestamp (``time.time()`` upstream).
        dp_rank: Data-parallel rank (SGLang: ``attn_dp_rank``); engines fill in 0.

    Returns:
        The msgpack bytes, as the engine would send them in the payload frame.
    """
    wire = get_profile(profile) if isinstance(profile, str) else profile
    return b"".join((
        b"\x93",
        _pack(float(ts)),
        _array_header(len(events)),
        *(_encode_event(e, wire) for e in events),
        _pack(dp_rank),
    ))


def _cache_level(medium: str | None) -> int:
    if medium is None or medium == "GPU":
        return 0
    level = medium.removeprefix("CACHE_LEVEL_")
    return int(level) if level.isdigit() else 1  # any non-GPU medium is secondary


def _json_hash(value: BlockHash) -> int:
    return int.from_bytes(value[-8:], "big") if isinstance(value, bytes) else value & _U64


def _mm_pairs(entry: tuple[object, ...] | None) -> list[tuple[object, object]]:
    pairs = []
    for key in entry or ():
        if not (isinstance(key, tuple) and len(key) == 2):
            raise ValueError(f"TensorRT-LLM mm_keys entries must be (hash, offset) pairs: {key!r}")
        pairs.append((key[0], key[1]))
    return pairs


def trtllm_stored_data(event: BlockStored) -> dict[str, Any]:
    """A ``stored`` payload (§8.3); block i is ``token_ids[i*block_size:(i+1)*block_size]``.

    The newest schema is written (``mm_keys`` and ``cache_salt`` on every block); ``mm_keys``
    come from ``extra_keys`` entries of ``(hash, start_offset)`` pairs.
    """
    blocks = []
    size = event.block_size
    for i, block_hash in enumerate(event.block_hashes):
        mm = event.extra_keys[i] if event.extra_keys and i < len(event.extra_keys) else None
        blocks.append({
            "type": "stored_block",
            "block_hash": _json_hash(block_hash),
            "tokens": [{"type": "unique_token", "token_id": t, "token_extra_id": 0}
                       for t in event.token_ids[i * size:(i + 1) * size]],
            "cache_level": _cache_level(event.medium),
            "priority": 35 if event.priority is None else event.priority,
            "mm_keys": [{"type": "mm_key", "hash": h, "start_offset": o}
                        for h, o in _mm_pairs(mm)],
            "cache_salt": event.cache_salt,
        })
    parent = event.parent_block_hash
    return {"type": "stored", "parent_hash": None if parent is None else _json_hash(parent),
            "blocks": blocks}


def trtllm_removed_data(block_hashes: Sequence[BlockHash]) -> dict[str, Any]:
    """A ``removed`` payload (§8.3)."""
    return {"type": "removed", "block_hashes": [_json_hash(h) for h in block_hashes]}


def trtllm_created_data(num_blocks_per_cache_level: Sequence[int]) -> dict[str, Any]:
    """The ``created`` payload that opens every event stream (§8.3)."""
    return {"type": "created", "num_blocks_per_cache_level": list(num_blocks_per_cache_level)}
