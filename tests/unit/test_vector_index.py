"""The semantic cache's vector index: best match, partitions, oldest-first eviction at
``max_entries``, per-entry TTL, swap-delete bookkeeping and the sketch shortlist."""

from __future__ import annotations

import numpy as np
import pytest

from continuum.caching.vector_index import EXACT_ROWS, Matrix, VectorIndex, unit


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def _vectors(n: int, dims: int = 32, seed: int = 0) -> list[Matrix]:
    rng = np.random.default_rng(seed)
    block = rng.standard_normal((n, dims)).astype(np.float32)
    block /= np.linalg.norm(block, axis=1, keepdims=True)
    return list(block)


def test_search_returns_the_most_similar_entry_with_its_cosine_and_text() -> None:
    index = VectorIndex(10)
    a, b = _vectors(2)
    index.add("p", "ka", a, "text a", 60)
    index.add("p", "kb", b, "text b", 60)
    near_b = unit(b + 0.1 * a)
    assert near_b is not None
    match = index.search("p", near_b)
    assert match is not None
    assert (match.key, match.text) == ("kb", "text b")
    assert match.score == pytest.approx(float(near_b @ b), abs=1e-5)
    assert index.search("empty", a) is None


def test_partitions_never_see_each_other() -> None:
    index = VectorIndex(10)
    (v,) = _vectors(1)
    index.add("tenant-a", "k", v, "t", 60)
    assert index.search("tenant-b", v) is None
    match = index.search("tenant-a", v)
    assert match is not None and match.score == pytest.approx(1.0, abs=1e-5)
    assert index.partitions() == 1 and len(index) == 1


def test_eviction_is_oldest_first_across_partitions() -> None:
    index = VectorIndex(3)
    vs = _vectors(5)
    index.add("p1", "k0", vs[0], "", 60)
    index.add("p2", "k1", vs[1], "", 60)
    index.add("p1", "k2", vs[2], "", 60)
    index.add("p2", "k3", vs[3], "", 60)  # evicts k0 (oldest, other partition than k3)
    assert len(index) == 3 and index.evictions == 1
    assert ("p1", "k0") not in index
    assert index.keys("p1") == {"k2"} and index.keys("p2") == {"k1", "k3"}
    # Re-adding a key makes it the newest: k1 survives the next eviction, k2 does not.
    index.add("p2", "k1", vs[1], "", 60)
    index.add("p1", "k4", vs[4], "", 60)
    assert index.keys("p1") == {"k4"} and index.keys("p2") == {"k1", "k3"}
    assert index.evictions == 2


def test_resize_evicts_the_oldest_down_to_the_new_bound() -> None:
    index = VectorIndex(5)
    for i, v in enumerate(_vectors(5)):
        index.add("p", f"k{i}", v, "", 60)
    index.resize(2)
    assert index.keys("p") == {"k3", "k4"} and index.evictions == 3


def test_ttl_expires_each_entry_on_its_own_clock() -> None:
    clock = Clock()
    index = VectorIndex(10, clock=clock)
    short, long = _vectors(2)
    index.add("p", "short", short, "", 10)
    index.add("p", "long", long, "", 100)
    clock.now += 11
    # The expired entry is gone, even for its own vector; the other one answers.
    match = index.search("p", short)
    assert match is not None and match.key == "long"
    assert len(index) == 1 and ("p", "short") not in index
    clock.now += 100
    assert index.search("p", long) is None
    assert len(index) == 0 and index.partitions() == 0


def test_removing_a_middle_row_keeps_every_other_entry_findable() -> None:
    index = VectorIndex(100)
    vs = _vectors(20)
    for i, v in enumerate(vs):
        index.add("p", f"k{i}", v, f"t{i}", 60)
    assert index.remove("p", "k3") and not index.remove("p", "k3")
    for i, v in enumerate(vs):
        match = index.search("p", v)
        assert match is not None
        if i == 3:
            assert match.key != "k3"
        else:
            assert (match.key, match.text) == (f"k{i}", f"t{i}")
            assert match.score == pytest.approx(1.0, abs=1e-5)


def test_a_new_dimension_replaces_the_partition() -> None:
    index = VectorIndex(10)
    (small,) = _vectors(1, dims=8)
    (big,) = _vectors(1, dims=16)
    index.add("p", "old", small, "", 60)
    assert index.search("p", big) is None  # other dimensions: no match, no error
    index.add("p", "new", big, "", 60)
    assert index.keys("p") == {"new"} and len(index) == 1


def test_large_partitions_find_the_true_match_through_the_sketch() -> None:
    n = EXACT_ROWS + 1000
    index = VectorIndex(n)
    vs = _vectors(n, dims=64, seed=3)
    for i, v in enumerate(vs):
        index.add("p", f"k{i}", v, "", 60)
    rng = np.random.default_rng(4)
    for target in (0, 1234, n - 1):
        query = unit(vs[target] + 0.05 * rng.standard_normal(64).astype(np.float32))
        assert query is not None
        match = index.search("p", query)
        assert match is not None and match.key == f"k{target}"
        assert match.score == pytest.approx(float(query @ vs[target]), abs=1e-5)


def test_clear_drops_everything_and_says_how_much() -> None:
    index = VectorIndex(10)
    for i, v in enumerate(_vectors(4)):
        index.add(f"p{i % 2}", f"k{i}", v, "", 60)
    assert index.clear() == 4
    assert len(index) == 0 and index.partitions() == 0


@pytest.mark.parametrize("values", [[], [0.0, 0.0], [1.0, float("nan")], [[1.0, 2.0]],
                                    ["a", "b"], [{"x": 1}, 2.0], [None, 1.0], [1e39, 1.0]])
def test_unit_refuses_vectors_it_cannot_normalise(values: list[float]) -> None:
    assert unit(values) is None


def test_unit_normalises() -> None:
    v = unit([3.0, 4.0])
    assert v is not None and v.dtype == np.float32
    assert v.tolist() == pytest.approx([0.6, 0.8])
