"""A consistent-hash ring with virtual nodes, shared by the hash-based strategies.

Positions come from blake2b, never from Python's ``hash()``: ``hash()`` of a ``str`` is
salted per process (``PYTHONHASHSEED``), so two gunicorn workers or two router instances
would disagree about which backend owns a key and split every prefix's KV cache between
them. A ring is immutable once built; strategies cache one per candidate-name tuple.
"""

from __future__ import annotations

import hashlib
import struct
from bisect import bisect_right
from collections.abc import Iterator, Sequence

#: Virtual nodes per backend; 150 keeps each backend's share within a few percent.
DEFAULT_VIRTUAL_NODES = 150
_RING = 1 << 64
#: Big-endian 64-bit word unpackers for the usual digest sizes (SHA-256: 4 probes).
_WORDS = {n: struct.Struct(f">{n}Q").unpack for n in (1, 2, 4)}
#: Keys whose :meth:`HashRing.lookup_probes` answer a ring remembers; more start over.
_MAX_REMEMBERED = 4096


def stable_hash(data: bytes) -> int:
    """A 64-bit position on the ring for ``data``, identical in every process.

    The 8-byte blake2b digest, read big-endian.
    """
    return int.from_bytes(hashlib.blake2b(data, digest_size=8).digest(), "big")


class HashRing:
    """Backends placed on a 64-bit ring at ``virtual_nodes`` positions each.

    Backend ``name`` gets the positions ``stable_hash(f"{name}#{i}")`` for ``i`` in
    ``range(virtual_nodes)``, so a backend's positions do not depend on which other backends
    are on the ring: removing one backend moves only the keys it owned.

    Attributes:
        names: the backend names, in the order given; indices below refer to this tuple.
        positions: sorted ring positions of every virtual node.
        owners: ``owners[i]`` is the index in ``names`` of the backend at ``positions[i]``.
    """

    __slots__ = ("names", "owners", "positions", "remembered")

    def __init__(self, names: Sequence[str], virtual_nodes: int = DEFAULT_VIRTUAL_NODES) -> None:
        if virtual_nodes < 1:
            raise ValueError(f"virtual_nodes must be at least 1 (got {virtual_nodes})")
        self.names: tuple[str, ...] = tuple(names)
        # Sorting (position, name) rather than (position, index) keeps the ring identical
        # whatever order the names arrive in, even on a 64-bit collision.
        nodes = sorted(
            (stable_hash(f"{name}#{i}".encode()), name, index)
            for index, name in enumerate(self.names)
            for i in range(virtual_nodes)
        )
        self.positions: list[int] = [node[0] for node in nodes]
        self.owners: list[int] = [node[2] for node in nodes]
        #: digest -> :meth:`lookup_probes` answer. Prefix keys repeat by design (a system
        #: prompt, a session), and a remembered one costs a dict lookup instead of four
        #: probes' bisecting and 64-bit arithmetic. The ring never changes, so neither do
        #: the answers; the memo lives and dies with the ring.
        self.remembered: dict[bytes, int] = {}

    def __len__(self) -> int:
        return len(self.positions)

    def lookup(self, key: bytes) -> int:
        """Index into :attr:`positions` of the first virtual node clockwise of ``key``.

        Raises:
            LookupError: the ring is empty.
        """
        return self.lookup_position(stable_hash(key))

    def lookup_position(self, position: int) -> int:
        """Like :meth:`lookup`, for a key already hashed with :func:`stable_hash`.

        Raises:
            LookupError: the ring is empty.
        """
        positions = self.positions
        if not positions:
            raise LookupError("the hash ring is empty")
        index = bisect_right(positions, position)
        return 0 if index == len(positions) else index

    def owner_index(self, key: bytes) -> int:
        """Index in :attr:`names` of the backend that owns ``key``."""
        return self.owners[self.lookup_position(stable_hash(key))]

    def walk_indices(self, key: bytes) -> Iterator[int]:
        """Indices in :attr:`names` of every backend, in clockwise order from ``key``.

        Each backend appears once. The walk is lazy, so a bounded-load caller that accepts
        the first or second backend touches only a handful of virtual nodes.
        """
        return self.walk_indices_from(stable_hash(key))

    def lookup_probes(self, digest: bytes) -> int:
        """Multi-probe lookup: index into :attr:`positions` of the virtual node nearest
        clockwise to any of the probes carried by ``digest``.

        ``digest`` is a uniform hash (a SHA-256 prefix key); each 8-byte word is one probe.
        Taking the nearest of several probes evens out the unequal arcs that random
        virtual-node positions leave (multi-probe consistent hashing, Appleton & O'Reilly
        2015): with 150 virtual nodes and 4 probes, 8 backends each get within about 1.5
        percentage points of 1/8 of the keys, against about 3 with one probe. It stays
        consistent: removing a backend moves only the keys it owned.

        Raises:
            LookupError: the ring is empty.
        """
        best_index = self.remembered.get(digest)
        if best_index is not None:
            return best_index
        positions = self.positions
        total = len(positions)
        if not total:
            raise LookupError("the hash ring is empty")
        best_index = 0
        best_distance = _RING
        if len(digest) == 32:  # a SHA-256 key: its four words, without a slice
            probes = _WORDS[4](digest)
        else:
            words = len(digest) // 8
            unpack = _WORDS.get(words)
            probes = unpack(digest[:words * 8]) if unpack is not None else \
                struct.unpack(f">{words}Q", digest[:words * 8])
        for probe in probes:
            index = bisect_right(positions, probe)
            if index == total:
                index = 0
            distance = (positions[index] - probe) % _RING
            if distance < best_distance:
                best_index, best_distance = index, distance
        probed = self.remembered
        if len(probed) >= _MAX_REMEMBERED:
            probed.clear()
        probed[digest] = best_index
        return best_index

    def walk_indices_from(self, position: int) -> Iterator[int]:
        """Like :meth:`walk_indices`, from a position already on the ring's 64-bit scale."""
        return self.walk_indices_at(self.lookup_position(position))

    def walk_indices_at(self, start: int) -> Iterator[int]:
        """Like :meth:`walk_indices`, starting at virtual node ``start`` (an index into
        :attr:`positions`, e.g. from :meth:`lookup_probes`)."""
        owners = self.owners
        total = len(owners)
        remaining = len(self.names)
        seen: set[int] = set()
        for step in range(total):
            owner = owners[(start + step) % total]
            if owner not in seen:
                seen.add(owner)
                yield owner
                remaining -= 1
                if remaining == 0:
                    return

    def walk(self, key: bytes) -> Iterator[str]:
        """Names of every backend, in clockwise order from ``key``, each once."""
        names = self.names
        for index in self.walk_indices(key):
            yield names[index]
