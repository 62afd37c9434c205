"""The semantic cache's in-memory vector index: unit vectors grouped by partition, the
oldest entry out first past ``max_entries``, each entry with its own expiry.

Why this shape: similarity is only ever computed inside one partition (one tenant, model,
output-affecting fields and conversation history), so each partition keeps its own
contiguous ``float32`` matrix and a lookup is one matrix-vector product over it. A partition
past :data:`EXACT_ROWS` rows is first scanned through a fixed random projection to
:data:`SKETCH_DIMS` dimensions (a Johnson-Lindenstrauss sketch, 8x fewer bytes to read); the
best :data:`RERANK` rows are then scored exactly. The sketch can only cost a hit (a true
match ranked out of the shortlist), never serve a wrong one: the threshold is applied to the
exact cosine. That keeps a lookup over 100,000 x 1,024-dim entries within a few milliseconds,
where the exact product alone reads 400 MB.

This module imports numpy; the router imports it only when the semantic cache is enabled.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np
import numpy.typing as npt

Matrix = npt.NDArray[np.float32]
#: A partition with more rows than this is pre-filtered through the sketch.
EXACT_ROWS = 4096
SKETCH_DIMS = 128
RERANK = 64
_GROW = 256
#: Matrix elements up to which a product goes through BLAS (see :func:`_scores`).
_BLAS_ELEMENTS = 1 << 20


@dataclass(frozen=True, slots=True)
class Match:
    """The best entry of a lookup: its key, cosine and the text it was stored for."""

    key: str
    score: float
    text: str


@dataclass
class _Partition:
    """One partition's rows; row ``i`` of every array is one entry (swap-delete keeps them
    contiguous)."""

    vectors: Matrix
    sketches: Matrix
    expires: npt.NDArray[np.float64]
    keys: list[str] = field(default_factory=list)
    texts: list[str] = field(default_factory=list)
    rows: dict[str, int] = field(default_factory=dict)

    @property
    def size(self) -> int:
        return len(self.keys)


class VectorIndex:
    """Unit vectors by partition; not thread-safe (one per worker, gevent is cooperative)."""

    def __init__(self, max_entries: int,
                 clock: Callable[[], float] = time.time) -> None:
        self.max_entries = max_entries
        self._clock = clock
        self._parts: dict[str, _Partition] = {}
        #: Every entry (partition, key) in insertion order: the eviction order.
        self._order: OrderedDict[tuple[str, str], None] = OrderedDict()
        self._projection: dict[int, Matrix] = {}
        self.evictions = 0

    def __len__(self) -> int:
        return len(self._order)

    def __contains__(self, item: tuple[str, str]) -> bool:
        return item in self._order

    def _now(self) -> float:
        return self._clock()

    def _project(self, dims: int) -> Matrix:
        """The fixed projection for ``dims``-dimensional vectors (same seed everywhere)."""
        proj = self._projection.get(dims)
        if proj is None:
            rng = np.random.default_rng(dims)
            proj = (rng.standard_normal((dims, SKETCH_DIMS)) / np.sqrt(SKETCH_DIMS)).astype(
                np.float32)
            self._projection[dims] = proj
        return proj

    def add(self, partition: str, key: str, vector: Matrix, text: str, ttl: float) -> None:
        """Index ``vector`` (unit length) under ``key``; replaces an entry of that key,
        evicts the oldest past ``max_entries``."""
        if (partition, key) in self._order:
            self.remove(partition, key)
        part = self._parts.get(partition)
        dims = vector.shape[0]
        if part is not None and part.vectors.shape[1] != dims:
            self._drop_partition(partition)  # the embedding model changed its dimensions
            part = None
        if part is None:
            part = self._parts[partition] = _Partition(
                np.empty((_GROW, dims), np.float32), np.empty((_GROW, SKETCH_DIMS), np.float32),
                np.empty(_GROW, np.float64))
        row = part.size
        if row == part.vectors.shape[0]:
            grow = max(_GROW, row)
            part.vectors = np.concatenate([part.vectors, np.empty((grow, dims), np.float32)])
            part.sketches = np.concatenate(
                [part.sketches, np.empty((grow, SKETCH_DIMS), np.float32)])
            part.expires = np.concatenate([part.expires, np.empty(grow, np.float64)])
        part.vectors[row] = vector
        part.sketches[row] = vector @ self._project(dims)
        part.expires[row] = self._now() + ttl
        part.rows[key] = row
        part.keys.append(key)
        part.texts.append(text)
        self._order[(partition, key)] = None
        self._evict()

    def _evict(self) -> None:
        while len(self._order) > self.max_entries:
            (old_part, old_key), _ = self._order.popitem(last=False)
            self._remove_row(old_part, old_key)
            self.evictions += 1

    def resize(self, max_entries: int) -> None:
        """A new bound; the oldest entries past it are evicted now."""
        self.max_entries = max_entries
        self._evict()

    def remove(self, partition: str, key: str) -> bool:
        """Drop one entry; False when it was not indexed."""
        if (partition, key) not in self._order:
            return False
        del self._order[(partition, key)]
        self._remove_row(partition, key)
        return True

    def _remove_row(self, partition: str, key: str) -> None:
        part = self._parts[partition]
        row = part.rows.pop(key)
        last = part.size - 1
        if row != last:
            part.vectors[row] = part.vectors[last]
            part.sketches[row] = part.sketches[last]
            part.expires[row] = part.expires[last]
            part.keys[row] = moved = part.keys[last]
            part.texts[row] = part.texts[last]
            part.rows[moved] = row
        part.keys.pop()
        part.texts.pop()
        if not part.keys:
            del self._parts[partition]

    def _drop_partition(self, partition: str) -> None:
        part = self._parts.pop(partition)
        for key in part.keys:
            self._order.pop((partition, key), None)

    def search(self, partition: str, vector: Matrix) -> Match | None:
        """The most similar live entry of ``partition`` (expired rows are dropped on the
        way), or None when the partition is empty."""
        part = self._parts.get(partition)
        if part is None or part.vectors.shape[1] != vector.shape[0]:
            return None
        self._expire(partition, part)
        n = part.size
        if n == 0:
            return None
        if n > EXACT_ROWS:
            rough = _scores(part.sketches[:n], vector @ self._project(vector.shape[0]))
            rows = np.argpartition(rough, n - RERANK)[n - RERANK:]
            scores = part.vectors[rows] @ vector
            best = int(np.argmax(scores))
            row, score = int(rows[best]), float(scores[best])
        else:
            scores = _scores(part.vectors[:n], vector)
            row = int(np.argmax(scores))
            score = float(scores[row])
        return Match(part.keys[row], score, part.texts[row])

    def _expire(self, partition: str, part: _Partition) -> None:
        dead = np.flatnonzero(part.expires[:part.size] <= self._now())
        for key in [part.keys[int(i)] for i in dead]:
            self.remove(partition, key)

    def keys(self, partition: str) -> set[str]:
        """The keys indexed in ``partition``."""
        part = self._parts.get(partition)
        return set(part.keys) if part is not None else set()

    def clear(self) -> int:
        """Drop everything; the number of entries dropped."""
        count = len(self._order)
        self._parts.clear()
        self._order.clear()
        return count

    def partitions(self) -> int:
        """How many partitions hold entries."""
        return len(self._parts)


def _scores(matrix: Matrix, vector: Matrix) -> Matrix:
    """``matrix @ vector``. A large product goes through numpy's own loop (einsum), not
    BLAS: a multithreaded BLAS matrix-vector product spins threads on cores that gunicorn
    workers and gevent already use, and measured 4-7x slower under load (2 busy cores:
    100,000 x 128 took 12 ms against 1.8 ms); below :data:`_BLAS_ELEMENTS` BLAS is
    faster and stays on one thread."""
    if matrix.size <= _BLAS_ELEMENTS:
        out: Matrix = matrix @ vector
        return out
    return np.einsum("ij,j->i", matrix, vector)  # type: ignore[no-any-return]


def unit(values: list[float] | Matrix) -> Matrix | None:
    """``values`` as a unit ``float32`` vector; None for an empty, zero or non-finite one,
    or one that is not a list of numbers (what an embedding backend sent)."""
    try:
        with np.errstate(over="ignore"):  # beyond float32: inf, refused below
            vector = np.asarray(values, dtype=np.float32)
    except (ValueError, TypeError):
        return None
    if vector.ndim != 1 or vector.size == 0 or not np.all(np.isfinite(vector)):
        return None
    norm = float(np.linalg.norm(vector))
    if norm == 0.0:
        return None
    out: Matrix = vector / norm
    return out

