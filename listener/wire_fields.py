"""Checked readers for decoded wire values, shared by the KV-event decoders.

Each reader takes a value from ``msgpack.unpackb`` or ``json.loads`` plus its location and
either returns it typed or raises :class:`~listener.errors.DecodeError` naming the location.

**Canonical block hash.** :func:`canonical_block_hash` turns every wire representation of a
block hash (``docs/kv-events.md`` §5, "Block hashes on the wire") into one form, an
*unsigned 64-bit int*:

* an int in [0, 2**64) is kept (vLLM uint64, TensorRT-LLM ``size_t``);
* a negative int64 (SGLang) is taken modulo 2**64, i.e. the same 8 bytes read unsigned;
* ``bytes`` (vLLM's raw digest with ``VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=0``, 32 or k*32
  bytes) becomes its last 8 bytes read big-endian, exactly the int vLLM publishes by
  default, so both vLLM settings produce the same keys;
* a hex string (TensorRT-LLM V2 ``v2_sha256`` digests) becomes its first 8 bytes read
  big-endian, TRT-LLM's own ``v2_sha256_64`` truncation.

``continuum.sim.hashing`` computes hashes in this same form.
"""

from __future__ import annotations

import re
from typing import Any

from listener.errors import DecodeError

U64_MASK = (1 << 64) - 1
_I64_MIN = -(1 << 63)
_HEX = re.compile(r"[0-9a-fA-F]+")
# Extra keys nest a level or two; the cap keeps hostile input far from Python's recursion
# limit (msgpack and json both allow deeper nesting than we would survive).
_MAX_DEPTH = 16
_TYPE_NAMES = {bool: "bool", int: "int", float: "float", str: "str", bytes: "bin",
               list: "array", dict: "map"}


def type_name(value: object) -> str:
    """Name a decoded value's type in wire terms, for error messages."""
    if value is None:
        return "nil"
    return _TYPE_NAMES.get(type(value), type(value).__name__)


def canonical_block_hash(value: object, path: str = "$") -> int:
    """Normalise any wire representation of a block hash to an unsigned 64-bit int.

    Args:
        value: An int in [-2**63, 2**64), a non-empty ``bytes`` digest, or a hex string.
        path: Location used in the error message.

    Returns:
        The canonical hash (see the module docstring for the rule per representation).

    Raises:
        DecodeError: ``value`` is none of the accepted representations.
    """
    if isinstance(value, bool):
        raise DecodeError(path, "expected a block hash, got bool")
    if isinstance(value, int):
        if not _I64_MIN <= value <= U64_MASK:
            raise DecodeError(path, f"block hash {value} does not fit in 64 bits")
        return value & U64_MASK
    if isinstance(value, bytes):
        if not value:
            raise DecodeError(path, "empty bin block hash")
        return int.from_bytes(value[-8:], "big")
    if isinstance(value, str):
        if not _HEX.fullmatch(value):
            raise DecodeError(path, f"string block hash is not hex: {value[:40]!r}")
        return int(value[:16], 16)
    raise DecodeError(path, f"expected a block hash (int, bin or hex str), got {type_name(value)}")


def optional_hash(value: object, path: str) -> int | None:
    """Like :func:`canonical_block_hash` but also accepts nil (a root block's parent)."""
    return None if value is None else canonical_block_hash(value, path)


def hash_list(value: object, path: str) -> tuple[int, ...]:
    """Decode an array of block hashes into canonical hashes."""
    items = expect_list(value, path)
    return tuple(canonical_block_hash(h, f"{path}[{i}]") for i, h in enumerate(items))


def expect_int(value: object, path: str, *, minimum: int | None = None) -> int:
    """Return ``value`` if it is an int (not a bool) of at least ``minimum``."""
    if not isinstance(value, int) or isinstance(value, bool):
        raise DecodeError(path, f"expected an int, got {type_name(value)}")
    if minimum is not None and value < minimum:
        raise DecodeError(path, f"expected an int >= {minimum}, got {value}")
    return value


def optional_int(value: object, path: str, *, minimum: int | None = None) -> int | None:
    """Like :func:`expect_int` but also accepts nil."""
    return None if value is None else expect_int(value, path, minimum=minimum)


def expect_str(value: object, path: str) -> str:
    """Return ``value`` if it is a str."""
    if not isinstance(value, str):
        raise DecodeError(path, f"expected a str, got {type_name(value)}")
    return value


def optional_str(value: object, path: str) -> str | None:
    """Return ``value`` if it is a str or nil."""
    return None if value is None else expect_str(value, path)


def expect_list(value: object, path: str) -> list[Any]:
    """Return ``value`` if it is an array."""
    if not isinstance(value, list):
        raise DecodeError(path, f"expected an array, got {type_name(value)}")
    return value


def expect_map(value: object, path: str) -> dict[Any, Any]:
    """Return ``value`` if it is a map."""
    if not isinstance(value, dict):
        raise DecodeError(path, f"expected a map, got {type_name(value)}")
    return value


def freeze(value: object, path: str, depth: int = 0) -> object:
    """Turn a decoded scalar-or-array value into an immutable one (arrays become tuples).

    Raises:
        DecodeError: A map or other non-scalar inside, or nesting deeper than 16.
    """
    if isinstance(value, list):
        if depth >= _MAX_DEPTH:
            raise DecodeError(path, "value nested too deeply")
        return tuple(freeze(v, f"{path}[{i}]", depth + 1) for i, v in enumerate(value))
    if value is None or isinstance(value, (bool, int, float, str, bytes)):
        return value
    raise DecodeError(path, f"unsupported value of type {type_name(value)}")
