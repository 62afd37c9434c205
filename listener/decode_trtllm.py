"""Decode ``trtllm-serve`` ``POST /kv_cache_events`` replies (``docs/kv-events.md`` §8).

Import it through :mod:`listener.decode`, the one decoder module; it lives apart only to keep
modules small. Each envelope becomes a :class:`TrtllmEvent` carrying its ``event_id``,
``window_size`` and the neutral events it means:

* ``created`` → ``(AllBlocksCleared(),)``: the event manager (re)started with an empty cache;
  TensorRT-LLM has no other "all cleared" event, and a restart shows up exactly like this.
* ``stored`` → one :class:`BlockStored` per run of consecutive blocks that share token count,
  cache level, priority, cache salt and LoRA id. A run's ``block_size`` is its blocks' token
  count (``len(tokens)``, §8.4), so a trailing partial block becomes its own event whose
  parent is the previous block. ``cache_level`` 0/1 becomes ``medium`` ``"GPU"``/``"CPU"``
  (other levels ``"CACHE_LEVEL_<n>"``); ``mm_keys`` become ``extra_keys`` entries of
  ``(hash, start_offset)`` pairs (``None`` for blocks without any).
* ``removed`` → ``(BlockRemoved(hashes),)`` (no medium: TensorRT-LLM does not say).
* Each block pool is keyed apart: ``window_size`` (a variable sliding-window model has one
  pool per window, each with its own events for the same hashes) is the neutral events'
  ``group_idx``, so a removal from one pool leaves the block another pool holds.
* ``updated`` → the change is in :attr:`TrtllmEvent.update`. A cache-level change (a block
  offloaded from the GPU to host memory, or brought back) also becomes the neutral events of
  a move, as vLLM's offloading reports one: ``BlockStored`` of the block's hash alone (no
  tokens, ``block_size`` 0: a placeholder) on the new level's medium, then ``BlockRemoved``
  from the old level's medium. The processor adds the medium to a tracked block and skips an
  unknown one (``placeholder_blocks``). A priority-only update means nothing for prefixes:
  no neutral event.
* any other ``type`` → no neutral event, ``kind`` is that type, and the list's ``skipped``
  count goes up. The entry is kept so that event ids stay contiguous: a consumer that sees an
  id jump knows events were really lost (buffer overflow), not merely unknown.
* a **malformed** event costs only itself (the drain is destructive: refusing the reply
  would lose its good events for good). It is counted in the list's ``malformed`` (the first
  one's location in ``malformed_at``) and kept as an entry without neutral events, so that
  its id still counts: of kind :data:`MALFORMED` when what it lost is only a hit (a
  ``stored``, an ``updated`` tier move, an unknown type); of kind
  :data:`MALFORMED_REMOVAL` when its ``data.type`` is ``removed`` or cannot be read at all,
  since a lost removal would leave its blocks indexed for good: the source treats that
  entry like a gap of its rank (that rank's blocks cleared; without ranks, a reset). A
  malformed ``created`` stays a ``created`` (a restart whatever its pool sizes). An
  envelope whose ``event_id`` or ``attention_dp_rank`` cannot be read is dropped: the hole
  in its ids is then a gap.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, NamedTuple

from continuum.kv_events import AllBlocksCleared, BlockRemoved, BlockStored, KvEvent
from listener.errors import DecodeError
from listener.wire_fields import (
    canonical_block_hash,
    expect_int,
    expect_list,
    expect_map,
    expect_str,
    hash_list,
    optional_hash,
    optional_int,
    optional_str,
)

#: ``kind`` of the entry kept for a malformed event (see the module docstring).
MALFORMED = "malformed"
#: ``kind`` of the entry kept for a malformed event that may have been a removal (its
#: ``data.type`` is ``removed`` or unreadable): its blocks' removal is lost.
MALFORMED_REMOVAL = "malformed-removal"
_KINDS = frozenset(("created", "stored", "removed", "updated"))

#: TensorRT-LLM cache levels (``kPrimaryLevel``, ``kSecondaryLevel``) as neutral media.
CACHE_LEVEL_MEDIA = ("GPU", "CPU")


def cache_level_medium(level: int) -> str:
    """Name a TensorRT-LLM cache level as a neutral ``medium``."""
    return CACHE_LEVEL_MEDIA[level] if level < len(CACHE_LEVEL_MEDIA) else f"CACHE_LEVEL_{level}"


@dataclass(frozen=True, slots=True)
class TrtllmBlockUpdated:
    """An ``updated`` event: a block's cache level and/or priority changed.

    Each change is ``(old_value, new_value)``, or ``None`` when that attribute did not change.
    """

    block_hash: int
    cache_level: tuple[int, int] | None = None
    priority: tuple[int, int] | None = None


@dataclass(frozen=True, slots=True)
class TrtllmEvent:
    """One element of a ``/kv_cache_events`` reply, decoded.

    Attributes:
        event_id: Monotonic per event manager, from 0 (``created``); a jump means lost events.
        kind: The ``data.type``: ``created``, ``stored``, ``removed``, ``updated`` or unknown.
        events: The neutral events this envelope means (see the module docstring).
        window_size: Attention window of the block pool; ``None`` in older builds.
        attention_dp_rank: Set only under attention data parallelism.
        num_blocks_per_cache_level: ``created`` only: pool size per cache level.
        update: ``updated`` only: what changed.
        hash_algo: KV-cache-manager V2 metadata, when sent.
        layer_group_id: KV-cache-manager V2 metadata, when sent.
    """

    event_id: int
    kind: str
    events: tuple[KvEvent, ...] = ()
    window_size: int | None = None
    attention_dp_rank: int | None = None
    num_blocks_per_cache_level: tuple[int, ...] | None = None
    update: TrtllmBlockUpdated | None = None
    hash_algo: str | None = None
    layer_group_id: int | None = None


class TrtllmEventList(list[TrtllmEvent]):
    """The decoded reply: a list of :class:`TrtllmEvent` plus ``skipped``, the unknown kinds,
    and ``malformed``, the events refused (``malformed_at``: where the first one was)."""

    skipped: int = 0
    malformed: int = 0
    malformed_at: str | None = None


class _Block(NamedTuple):
    block_hash: int
    tokens: tuple[int, ...]
    medium: str
    priority: int | None
    cache_salt: str | None
    lora_id: int | None
    mm_keys: tuple[tuple[str, int], ...] | None

    def run_key(self) -> tuple[object, ...]:
        return (len(self.tokens), self.medium, self.priority, self.cache_salt, self.lora_id)


def _token(value: object, path: str) -> int:
    # A token is {"type": "unique_token", "token_id": n, "token_extra_id": m}; a bare int is
    # accepted too. token_extra_id only distinguishes multimodal placeholders, and the block
    # hash already covers it, so it is not kept.
    if isinstance(value, dict):
        return expect_int(value.get("token_id"), f"{path}.token_id", minimum=0)
    return expect_int(value, path, minimum=0)


def _mm_keys(value: object, path: str) -> tuple[tuple[str, int], ...] | None:
    if value is None:
        return None
    keys = []
    for i, raw in enumerate(expect_list(value, path)):
        kpath = f"{path}[{i}]"
        key = expect_map(raw, kpath)
        keys.append((expect_str(key.get("hash"), f"{kpath}.hash"),
                     expect_int(key.get("start_offset"), f"{kpath}.start_offset", minimum=0)))
    return tuple(keys) or None


def _block(value: object, path: str) -> _Block:
    block = expect_map(value, path)
    tokens = tuple(_token(t, f"{path}.tokens[{i}]")
                   for i, t in enumerate(expect_list(block.get("tokens"), f"{path}.tokens")))
    if not tokens:
        raise DecodeError(f"{path}.tokens", "stored block has no tokens")
    return _Block(
        block_hash=canonical_block_hash(block.get("block_hash"), f"{path}.block_hash"),
        tokens=tokens,
        medium=cache_level_medium(
            expect_int(block.get("cache_level", 0), f"{path}.cache_level", minimum=0)
        ),
        priority=optional_int(block.get("priority"), f"{path}.priority"),
        cache_salt=optional_str(block.get("cache_salt"), f"{path}.cache_salt"),
        lora_id=optional_int(block.get("lora_id"), f"{path}.lora_id"),
        mm_keys=_mm_keys(block.get("mm_keys"), f"{path}.mm_keys"),
    )


def _stored(data: dict[Any, Any], path: str, window: int | None) -> tuple[KvEvent, ...]:
    parent = optional_hash(data.get("parent_hash"), f"{path}.parent_hash")
    blocks = [_block(b, f"{path}.blocks[{i}]")
              for i, b in enumerate(expect_list(data.get("blocks"), f"{path}.blocks"))]
    events: list[KvEvent] = []
    start = 0
    while start < len(blocks):
        end = start + 1
        while end < len(blocks) and blocks[end].run_key() == blocks[start].run_key():
            end += 1
        run = blocks[start:end]
        first = run[0]
        mm = tuple(b.mm_keys for b in run)
        events.append(BlockStored(
            block_hashes=tuple(b.block_hash for b in run),
            parent_block_hash=parent,
            token_ids=tuple(t for b in run for t in b.tokens),
            block_size=len(first.tokens),
            lora_id=first.lora_id,
            medium=first.medium,
            cache_salt=first.cache_salt,
            extra_keys=mm if any(k is not None for k in mm) else None,
            priority=first.priority,
            group_idx=window,
        ))
        # Block i's parent is block i-1 (§8.3), so the next run hangs off this run's tail.
        parent = run[-1].block_hash
        start = end
    return tuple(events)


def _diff(value: object, path: str, minimum: int | None = None) -> tuple[int, int] | None:
    if value is None:
        return None
    diff = expect_map(value, path)
    return (expect_int(diff.get("old_value"), f"{path}.old_value", minimum=minimum),
            expect_int(diff.get("new_value"), f"{path}.new_value", minimum=minimum))


def _moved(block_hash: int, level: tuple[int, int] | None,
           window: int | None) -> tuple[KvEvent, ...]:
    """The neutral events of a cache-level change: stored on the new level (a placeholder:
    the hash alone), then removed from the old one. Nothing when the level did not change."""
    if level is None or level[0] == level[1]:
        return ()
    old, new = level
    return (BlockStored((block_hash,), None, (), 0, medium=cache_level_medium(new),
                        group_idx=window),
            BlockRemoved((block_hash,), medium=cache_level_medium(old), group_idx=window))


def _event(value: object, path: str) -> TrtllmEvent:
    envelope = expect_map(value, path)
    event_id = expect_int(envelope.get("event_id"), f"{path}.event_id", minimum=0)
    data = expect_map(envelope.get("data"), f"{path}.data")
    dpath = f"{path}.data"
    kind = expect_str(data.get("type"), f"{dpath}.type")
    common: dict[str, Any] = {
        "event_id": event_id,
        "kind": kind,
        "window_size": optional_int(envelope.get("window_size"), f"{path}.window_size"),
        "attention_dp_rank": optional_int(
            envelope.get("attention_dp_rank"), f"{path}.attention_dp_rank", minimum=0
        ),
        "hash_algo": optional_str(envelope.get("hash_algo"), f"{path}.hash_algo"),
        "layer_group_id": optional_int(envelope.get("layer_group_id"), f"{path}.layer_group_id"),
    }
    if kind == "created":
        levels = data.get("num_blocks_per_cache_level")
        lpath = f"{dpath}.num_blocks_per_cache_level"
        counts = None if levels is None else tuple(
            expect_int(n, f"{lpath}[{i}]", minimum=0)
            for i, n in enumerate(expect_list(levels, lpath))
        )
        return TrtllmEvent(**common, events=(AllBlocksCleared(),),
                           num_blocks_per_cache_level=counts)
    if kind == "stored":
        return TrtllmEvent(**common, events=_stored(data, dpath, common["window_size"]))
    if kind == "removed":
        hashes = hash_list(data.get("block_hashes"), f"{dpath}.block_hashes")
        removed = BlockRemoved(block_hashes=hashes, group_idx=common["window_size"])
        return TrtllmEvent(**common, events=(removed,) if hashes else ())
    if kind == "updated":
        update = TrtllmBlockUpdated(
            block_hash=canonical_block_hash(data.get("block_hash"), f"{dpath}.block_hash"),
            cache_level=_diff(data.get("cache_level"), f"{dpath}.cache_level", minimum=0),
            priority=_diff(data.get("priority"), f"{dpath}.priority"),
        )
        moved = _moved(update.block_hash, update.cache_level, common["window_size"])
        return TrtllmEvent(**common, events=moved, update=update)
    return TrtllmEvent(**common)


def _malformed(value: object) -> TrtllmEvent | None:
    """What is kept of an envelope that failed to decode: its id and rank, so that the id
    sequence stays contiguous, and whether it was (or may have been) a ``created`` or a
    removal; None when its id or rank cannot be read."""
    if not isinstance(value, dict):
        return None
    try:
        event_id = expect_int(value.get("event_id"), "", minimum=0)
        rank = optional_int(value.get("attention_dp_rank"), "", minimum=0)
    except DecodeError:
        return None
    data = value.get("data")
    kind = data.get("type") if isinstance(data, dict) else None
    if kind == "created":
        return TrtllmEvent(event_id, "created", (AllBlocksCleared(),), attention_dp_rank=rank)
    if kind == "removed" or not isinstance(kind, str):
        return TrtllmEvent(event_id, MALFORMED_REMOVAL, attention_dp_rank=rank)
    return TrtllmEvent(event_id, MALFORMED, attention_dp_rank=rank)


def decode_trtllm_events(body: bytes | str | list[Any]) -> TrtllmEventList:
    """Decode one ``POST /kv_cache_events`` reply.

    Args:
        body: The raw JSON body, or the already parsed JSON array.

    Returns:
        One :class:`TrtllmEvent` per envelope, in order; ``skipped`` counts unknown kinds,
        ``malformed`` the events refused (see the module docstring).

    Raises:
        DecodeError: Not JSON, or not an array.
    """
    if isinstance(body, (bytes, bytearray, memoryview, str)):
        try:
            parsed = json.loads(body if isinstance(body, str) else bytes(body))
        except Exception as exc:
            # json reports bad input as JSONDecodeError, UnicodeDecodeError, ValueError (huge
            # ints) or RecursionError (deep nesting); all mean the same to us.
            raise DecodeError("$", f"not valid JSON ({type(exc).__name__}: {exc})") from None
    else:
        parsed = body
    result = TrtllmEventList()
    for i, envelope in enumerate(expect_list(parsed, "$")):
        try:
            event = _event(envelope, f"$[{i}]")
        except DecodeError as exc:
            # One event's bad fields cost that event, not the reply: the drain is
            # destructive, so a refused reply's good events would be lost for good.
            result.malformed += 1
            if result.malformed_at is None:
                result.malformed_at = exc.path
            kept = _malformed(envelope)
            if kept is not None:
                result.append(kept)
            continue
        if event.kind not in _KINDS:
            result.skipped += 1
        result.append(event)
    return result
