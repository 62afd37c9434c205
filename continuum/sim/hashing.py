"""Each engine's block-hash chain, computed as the engine does (``docs/kv-events.md`` §6-§8.5).

:func:`hasher_for` returns a :data:`~continuum.kv_events.BlockHasher`,
``hasher(parent_hash, block_token_ids, cache_salt) -> block_hash``, that yields the *canonical*
hash the listener's decoders hand out (an unsigned 64-bit int, ``listener.wire_fields``), so
hashes the router or the simulator computes compare equal to hashes an engine published.

* ``vllm``: ``sha256_cbor`` chain, ``H((parent_digest or NONE_HASH, tuple(tokens),
  extra_keys))`` with ``NONE_HASH = H("vllm-none-hash")`` (the ≥0.29 default root seed); the
  published int is the digest's last 8 bytes. A cache salt is block 0's only extra key,
  ``("cache_salt", salt)`` from 0.31 (plain ``salt`` before). Not covered: LoRA, multimodal
  and prompt-embeds extra keys, lookahead tokens (≥0.33), and the default ``sha256``
  (pickle) / ``xxhash`` algorithms. Reproduces the vLLM fixtures exactly.
* ``sglang``: SHA-256 page chain over 4-byte little-endian tokens, each page prefixed with
  the previous page's digest; the published int64 is the first 8 digest bytes (canonical:
  read unsigned). A salted chain starts from ``sha256(b"sglang-cache-salt-v1\\0" + salt)``.
  EAGLE bigram pages: pass the pairs flattened or as 2-tuples. Not covered: the ``dynamo``
  namespaced format and ≤0.5.5 ``hash(tuple)``. Reproduces the SGLang fixtures exactly; the
  salted variant follows the spec but has no fixture to check against.
* ``trtllm``: ``v1_block_key`` (mix32 per token over a seed from the token count and the
  parent). Reproduces the TRT-LLM fixtures exactly. A salt mixes in ``cache_salt_id`` (first
  8 bytes of ``sha256(salt)``, little-endian), which matches TensorRT-LLM's Python reference
  and KV-cache-manager V2; the C++ V1 manager mixes ``std::hash(salt)`` instead, so salted V1
  hashes cannot be reproduced outside the engine (§8.5). LoRA ids are not covered.

vLLM and SGLang chain on the parent's *full* digest, which the 64-bit published value does not
contain. Their hashers therefore remember the digests they produced (a bounded LRU memo) and
accept as parent only a hash they computed themselves (or the raw digest as ``bytes``): chain
calls through one hasher, or use :func:`block_hash_chain`.
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from collections.abc import Sequence

from continuum.kv_events import BlockHash, BlockHasher

__all__ = [
    "SglangBlockHasher",
    "TrtllmBlockHasher",
    "VllmBlockHasher",
    "block_hash_chain",
    "cbor_encode",
    "hasher_for",
    "trtllm_v1_block_key",
]

_U32 = (1 << 32) - 1
_U64 = (1 << 64) - 1
_MEMO_SIZE = 1 << 16


def _cbor_head(major: int, n: int) -> bytes:
    # Canonical CBOR: the shortest argument encoding that fits.
    if n < 24:
        return bytes([major << 5 | n])
    for extra, size in ((24, 1), (25, 2), (26, 4), (27, 8)):
        if n < 1 << (8 * size):
            return bytes([major << 5 | extra]) + n.to_bytes(size, "big")
    raise ValueError(f"CBOR integer too large: {n}")


def cbor_encode(value: object) -> bytes:
    """Encode ``value`` as canonical CBOR, as ``cbor2.dumps(value, canonical=True)`` does.

    Only what vLLM hashes is supported: None, bools, 64-bit ints, bytes, str, tuples/lists.

    Raises:
        TypeError: Any other type (floats, maps, big ints are never hashed by vLLM).
    """
    if value is None:
        return b"\xf6"
    if isinstance(value, bool):
        return b"\xf5" if value else b"\xf4"
    if isinstance(value, int):
        return _cbor_head(0, value) if value >= 0 else _cbor_head(1, -1 - value)
    if isinstance(value, bytes):
        return _cbor_head(2, len(value)) + value
    if isinstance(value, str):
        encoded = value.encode("utf-8")
        return _cbor_head(3, len(encoded)) + encoded
    if isinstance(value, (tuple, list)):
        return _cbor_head(4, len(value)) + b"".join(cbor_encode(v) for v in value)
    raise TypeError(f"cannot CBOR-encode {type(value).__name__}")


class _DigestMemo:
    """Bounded LRU of canonical hash -> full digest, so a chain can continue from a parent."""

    def __init__(self, size: int) -> None:
        self._size = size
        self._digests: OrderedDict[int, bytes] = OrderedDict()

    def put(self, key: int, digest: bytes) -> None:
        self._digests[key] = digest
        self._digests.move_to_end(key)
        if len(self._digests) > self._size:
            self._digests.popitem(last=False)

    def parent_digest(self, parent: BlockHash) -> bytes:
        if isinstance(parent, bytes):
            return parent
        try:
            digest = self._digests[parent]
        except KeyError:
            raise ValueError(
                f"parent hash {parent} was not computed by this hasher; the full digest it "
                "stands for is unknown (chain calls through one hasher)"
            ) from None
        self._digests.move_to_end(parent)
        return digest


class VllmBlockHasher:
    """vLLM ``sha256_cbor`` block hashes (§6), as canonical 64-bit ints.

    Args:
        seed: Root seed; vLLM ≥0.29 uses ``PYTHONHASHSEED`` if set, else ``"vllm-none-hash"``.
        tagged_salt: Salt extra key as ``("cache_salt", salt)`` (≥0.31) or plain ``salt``.
        memo_size: How many recent digests to remember for chaining.
    """

    def __init__(
        self, *, seed: str = "vllm-none-hash", tagged_salt: bool = True, memo_size: int = _MEMO_SIZE
    ) -> None:
        self.none_hash = hashlib.sha256(cbor_encode(seed)).digest()
        self._tagged_salt = tagged_salt
        self._memo = _DigestMemo(memo_size)

    def digest(
        self, parent: bytes | None, tokens: Sequence[int], extra_keys: tuple[object, ...] | None
    ) -> bytes:
        """The full 32-byte hash of one block given its parent's full digest (None = root)."""
        key = (self.none_hash if parent is None else parent, tuple(tokens), extra_keys)
        return hashlib.sha256(cbor_encode(key)).digest()

    def __call__(
        self, parent: BlockHash | None, tokens: Sequence[int], cache_salt: str | None
    ) -> int:
        """Hash one block; ``cache_salt`` only counts for the first block (parent None)."""
        extra: tuple[object, ...] | None = None
        if parent is None and cache_salt:
            extra = (("cache_salt", cache_salt),) if self._tagged_salt else (cache_salt,)
        parent_digest = None if parent is None else self._memo.parent_digest(parent)
        digest = self.digest(parent_digest, tokens, extra)
        value = int.from_bytes(digest[-8:], "big")
        self._memo.put(value, digest)
        return value


class SglangBlockHasher:
    """SGLang ≥0.5.6 SHA-256 page hashes (§7), as canonical 64-bit ints.

    Args:
        memo_size: How many recent digests to remember for chaining.
    """

    def __init__(self, *, memo_size: int = _MEMO_SIZE) -> None:
        self._memo = _DigestMemo(memo_size)

    @staticmethod
    def salt_prior(cache_salt: str) -> bytes:
        """The digest a salted request's chain starts from (``compute_node_event_hash_values``)."""
        return hashlib.sha256(b"sglang-cache-salt-v1\0" + cache_salt.encode("utf-8")).digest()

    @staticmethod
    def digest(prior: bytes | None, tokens: Sequence[int] | Sequence[tuple[int, int]]) -> bytes:
        """The full page digest: ``sha256(prior ‖ tokens as u32 little-endian)``."""
        h = hashlib.sha256(prior or b"")
        for token in tokens:
            # EAGLE bigram pages hash both tokens of each pair.
            for t in token if isinstance(token, tuple) else (token,):
                if not 0 <= t <= _U32:
                    raise ValueError(f"token id {t} does not fit in 32 bits")
                h.update(t.to_bytes(4, "little"))
        return h.digest()

    def __call__(
        self, parent: BlockHash | None, tokens: Sequence[int], cache_salt: str | None
    ) -> int:
        """Hash one page; a salt seeds the chain at the first page (parent None)."""
        if parent is None:
            prior = self.salt_prior(cache_salt) if cache_salt else None
        else:
            prior = self._memo.parent_digest(parent)
        digest = self.digest(prior, tokens)
        value = int.from_bytes(digest[:8], "big")
        self._memo.put(value, digest)
        return value


def _mix32(value: int, seed: int) -> int:
    v = value & _U32
    v = (((v >> 16) ^ v) * 0x45D9F3B) & _U32
    v = (((v >> 16) ^ v) * 0x45D9F3B) & _U32
    v = (((v >> 16) ^ v) + 0x9E3779B9) & _U32
    # The C++ adds a uint32 to size_t terms, so only the token part wraps at 32 bits.
    return seed ^ ((v + ((seed << 6) & _U64) + (seed >> 2)) & _U64)


def _mix64(value: int, seed: int) -> int:
    v = value & _U64
    v = ((v ^ (v >> 30)) * 0xBF58476D1CE4E5B9) & _U64
    v = ((v ^ (v >> 27)) * 0x94D049BB133111EB) & _U64
    v ^= v >> 31
    return seed ^ ((v + 0x9E3779B9 + ((seed << 6) & _U64) + (seed >> 2)) & _U64)


def trtllm_v1_block_key(
    tokens: Sequence[int],
    parent_hash: int = 0,
    *,
    cache_salt_id: int | None = None,
    lora_task_id: int | None = None,
) -> int:
    """TensorRT-LLM's ``v1_block_key`` (§8.5): the V1 KV-cache manager's block hash."""
    seed = (len(tokens) ^ (parent_hash * 0xBF58476D1CE4E5B9)) & _U64
    if parent_hash == 0 and cache_salt_id is not None:
        seed = _mix64(cache_salt_id, seed)
    for token in tokens:
        seed = _mix32(token, seed)
    if lora_task_id is not None:
        seed = _mix64(lora_task_id, seed)
    return seed


class TrtllmBlockHasher:
    """TensorRT-LLM ``v1_block_key`` hashes; stateless, the chain runs on the 64-bit value."""

    @staticmethod
    def cache_salt_id(cache_salt: str) -> int:
        """First 8 bytes of ``sha256(salt)``, little-endian (TRT-LLM ``get_cache_salt_id``)."""
        return int.from_bytes(hashlib.sha256(cache_salt.encode("utf-8")).digest()[:8], "little")

    def __call__(
        self, parent: BlockHash | None, tokens: Sequence[int], cache_salt: str | None
    ) -> int:
        """Hash one block; the salt only counts at the root."""
        if isinstance(parent, bytes):
            parent = int.from_bytes(parent[-8:], "big")
        salt_id = self.cache_salt_id(cache_salt) if cache_salt else None
        return trtllm_v1_block_key(tokens, parent or 0, cache_salt_id=salt_id)


def _version(engine: str) -> tuple[int, ...] | None:
    _, _, rest = engine.partition("-")
    try:
        return tuple(int(part) for part in rest.split(".")) if rest else None
    except ValueError:
        return None


def hasher_for(engine: str, *, seed: str = "vllm-none-hash") -> BlockHasher:
    """Return a fresh block hasher for an engine or wire profile name.

    Args:
        engine: ``"vllm"``, ``"sglang"``, ``"trtllm"``, or a profile such as ``"vllm-0.30"``
            (a vLLM version below 0.31 selects the untagged salt key).
        seed: vLLM root seed (its ``PYTHONHASHSEED``, if the engine sets one).

    Raises:
        ValueError: Unknown engine.
    """
    family = engine.partition("-")[0].lower()
    if family == "vllm":
        version = _version(engine)
        return VllmBlockHasher(seed=seed, tagged_salt=version is None or version >= (0, 31))
    if family == "sglang":
        return SglangBlockHasher()
    if family in ("trtllm", "tensorrt_llm"):
        return TrtllmBlockHasher()
    raise ValueError(f"no block hasher for engine {engine!r}; known: vllm, sglang, trtllm")


def block_hash_chain(
    hasher: BlockHasher,
    token_ids: Sequence[int],
    block_size: int,
    cache_salt: str | None = None,
) -> list[BlockHash]:
    """Hash every *full* block of ``token_ids`` in order, each chained to the previous one.

    Raises:
        ValueError: ``block_size`` is not positive.
    """
    if block_size < 1:
        raise ValueError(f"block_size must be positive, got {block_size}")
    hashes: list[BlockHash] = []
    parent: BlockHash | None = None
    for start in range(0, len(token_ids) - block_size + 1, block_size):
        parent = hasher(parent, token_ids[start : start + block_size], cache_salt)
        hashes.append(parent)
    return hashes
