"""The built-in selection strategies: the shared contract, then each one's own behaviour."""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
from collections import Counter

import pytest

from continuum.config import parse_config
from continuum.hostshm import HostSegment
from continuum.interfaces import SelectionStrategy
from continuum.registry import PluginRegistry
from continuum.routing.hashring import HashRing, stable_hash
from continuum.testing import make_backends, make_context
from continuum.testing.strategies import (
    DeterministicCases,
    SpreadingCases,
    StickyCases,
    WeightedCases,
)

GROUP = "continuum.strategies"


def load(name: str, **collaborators: object) -> SelectionStrategy:
    """A fresh instance of the built-in ``name``, found through the entry points."""
    cls = PluginRegistry().load(GROUP, name)
    return cls(**collaborators)


# -- the contract, once per built-in ---------------------------------------------------
# Each built-in includes the case mixins its flags call for, so no case is skipped here;
# test_includes_every_case_that_applies (in each) fails if one that applies is left out.


class TestRoundRobinContract(SpreadingCases, DeterministicCases):
    strategy_name = "RoundRobin"


class TestWeightedRoundRobinContract(SpreadingCases, DeterministicCases, WeightedCases):
    strategy_name = "WeightedRoundRobin"


class TestLeastLatencyContract(SpreadingCases, DeterministicCases):
    strategy_name = "LeastLatency"


class TestRandomContract(SpreadingCases, DeterministicCases, WeightedCases):
    strategy_name = "Random"
    deterministic = True  # only because every instance here gets the same seed

    def make_strategy(self, cls: type[SelectionStrategy]) -> SelectionStrategy:
        return cls(seed=1234)


class TestConsistentHashContract(StickyCases, DeterministicCases):
    strategy_name = "ConsistentHash"


# -- RoundRobin -------------------------------------------------------------------------


def test_round_robin_cycles_in_order() -> None:
    strategy = load("RoundRobin")
    backends = make_backends(3)
    names = [strategy.select(backends, make_context()).name for _ in range(7)]
    assert names == ["b0", "b1", "b2", "b0", "b1", "b2", "b0"]


# -- WeightedRoundRobin -----------------------------------------------------------------


def test_smooth_weighted_round_robin_matches_nginx_sequence() -> None:
    strategy = load("WeightedRoundRobin")
    backends = make_backends(3, weights=[5, 1, 1])
    names = [strategy.select(backends, make_context()).name for _ in range(14)]
    nginx = ["b0", "b0", "b1", "b0", "b2", "b0", "b0"]
    assert names == nginx + nginx


def test_weighted_round_robin_keeps_state_by_name_when_candidates_change() -> None:
    strategy = load("WeightedRoundRobin")
    a, b, c = make_backends(3, weights=[2, 1, 1])
    # b drops out for a while: a and c alternate 2:1 between themselves.
    names = [strategy.select([a, c], make_context()).name for _ in range(6)]
    assert Counter(names) == {"b0": 4, "b2": 2}
    # A list in a different order still finds each backend's own current weight.
    names = [strategy.select([c, b, a], make_context()).name for _ in range(8)]
    assert Counter(names) == {"b0": 4, "b1": 2, "b2": 2}


# -- LeastLatency -----------------------------------------------------------------------


def test_least_latency_prefers_the_fastest_sampled_backend() -> None:
    strategy = load("LeastLatency")
    backends = make_backends(3, latencies=[0.40, 0.05, 0.20])
    assert {strategy.select(backends, make_context()).name for _ in range(20)} == {"b1"}


def test_least_latency_tries_unsampled_backends_first() -> None:
    strategy = load("LeastLatency")
    slow, fast, new = make_backends(3, latencies=[0.40, 0.05, None])
    assert strategy.select([slow, fast, new], make_context()) is new
    # Once the new backend has a sample it competes on latency like the others.
    new.record(True, 0.30)
    assert strategy.select([slow, fast, new], make_context()) is fast
    new.latency_ewma = 0.01
    assert strategy.select([slow, fast, new], make_context()) is new


def test_least_latency_ties_go_to_fewer_in_flight_then_rotate() -> None:
    strategy = load("LeastLatency")
    backends = make_backends(3, latencies=[0.1, 0.1, 0.1])
    backends[0].in_flight = 2
    names = [strategy.select(backends, make_context()).name for _ in range(10)]
    assert set(names) == {"b1", "b2"}
    assert abs(names.count("b1") - names.count("b2")) <= 1


# -- Random -----------------------------------------------------------------------------


def test_random_is_reproducible_with_a_seed_and_varies_without() -> None:
    backends = make_backends(4, weights=[1, 2, 3, 4])

    def run(seed: int) -> list[str]:
        strategy = load("Random", seed=seed)
        return [strategy.select(backends, make_context()).name for _ in range(100)]

    assert run(7) == run(7)
    assert run(7) != run(8)


# -- ConsistentHash ---------------------------------------------------------------------


def test_consistent_hash_same_model_same_backend_across_instances() -> None:
    backends = make_backends(8)
    first, second = load("ConsistentHash"), load("ConsistentHash")
    models = [f"model-{i}" for i in range(200)]
    assert [first.select(backends, make_context(m)).name for m in models] == [
        second.select(list(reversed(backends)), make_context(m)).name for m in models
    ]


_OWNERS_SCRIPT = """
import json
from continuum.registry import PluginRegistry
from continuum.testing import make_backends, make_context
strategy = PluginRegistry().load("continuum.strategies", "ConsistentHash")()
backends = make_backends(8)
print(json.dumps([strategy.select(backends, make_context(f"model-{i}")).name
                  for i in range(300)]))
"""


def test_consistent_hash_agrees_across_processes_with_different_hash_seeds() -> None:
    results = []
    for seed in ("1", "2"):
        env = {**os.environ, "PYTHONHASHSEED": seed}
        proc = subprocess.run(
            [sys.executable, "-c", _OWNERS_SCRIPT],
            env=env,
            capture_output=True,
            text=True,
            timeout=60,
            check=True,
        )
        results.append(json.loads(proc.stdout))
    assert results[0] == results[1]
    # And both agree with this process.
    strategy = load("ConsistentHash")
    backends = make_backends(8)
    here = [strategy.select(backends, make_context(f"model-{i}")).name for i in range(300)]
    assert results[0] == here
    assert len(set(here)) == 8


def test_consistent_hash_removing_one_of_eight_moves_only_its_models() -> None:
    strategy = load("ConsistentHash")
    backends = make_backends(8)
    removed = backends[5]
    remaining = [b for b in backends if b is not removed]
    models = [f"tenant-{i}/model" for i in range(2000)]
    before = {m: strategy.select(backends, make_context(m)).name for m in models}
    after = {m: strategy.select(remaining, make_context(m)).name for m in models}
    moved = [m for m in models if before[m] != after[m]]
    # Exactly the models the removed backend owned move, and nothing else.
    assert moved == [m for m in models if before[m] == removed.name]
    assert 0.08 < len(moved) / len(models) < 0.18


def test_consistent_hash_spreads_models_over_backends() -> None:
    strategy = load("ConsistentHash")
    backends = make_backends(8)
    counts = Counter(
        strategy.select(backends, make_context(f"model-{i}")).name for i in range(2000)
    )
    assert set(counts) == {b.name for b in backends}
    expected = 2000 / 8
    assert all(0.6 * expected < n < 1.4 * expected for n in counts.values()), counts


def test_consistent_hash_caches_one_ring_per_candidate_set() -> None:
    strategy = load("ConsistentHash")
    backends = make_backends(4)
    for i in range(20):
        strategy.select(backends, make_context(f"m{i}"))
        strategy.select(backends[:3], make_context(f"m{i}"))
    assert strategy.stats() == {"virtual_nodes": 150, "cached_rings": 2}


# -- HashRing ---------------------------------------------------------------------------


def test_stable_hash_is_blake2b_not_python_hash() -> None:
    digest = hashlib.blake2b(b"b0#0", digest_size=8).digest()
    assert stable_hash(b"b0#0") == int.from_bytes(digest, "big")


def test_hash_ring_layout() -> None:
    ring = HashRing(["a", "b", "c"], virtual_nodes=150)
    assert len(ring) == 450
    assert ring.positions == sorted(ring.positions)
    assert Counter(ring.owners) == {0: 150, 1: 150, 2: 150}
    # Order of names changes indices, not which name owns a key.
    shuffled = HashRing(["c", "a", "b"], virtual_nodes=150)
    for i in range(100):
        key = f"k{i}".encode()
        assert shuffled.names[shuffled.owner_index(key)] == ring.names[ring.owner_index(key)]


def test_hash_ring_lookup_wraps_around() -> None:
    ring = HashRing(["a", "b"], virtual_nodes=4)
    for i in range(200):
        key = f"k{i}".encode()
        h = stable_hash(key)
        index = ring.lookup(key)
        after = [j for j, p in enumerate(ring.positions) if p > h]
        assert index == (after[0] if after else 0)


def test_hash_ring_walk_yields_each_backend_once_owner_first() -> None:
    ring = HashRing([f"n{i}" for i in range(6)], virtual_nodes=20)
    for i in range(50):
        key = f"k{i}".encode()
        walked = list(ring.walk(key))
        assert sorted(walked) == sorted(ring.names)
        assert walked[0] == ring.names[ring.owner_index(key)]
        assert [ring.names[j] for j in ring.walk_indices(key)] == walked


def test_hash_ring_multi_probe_lookup_is_the_nearest_probe_and_remembered(monkeypatch) -> None:
    """Each 8-byte word of the digest is a probe; the answer is the virtual node nearest
    clockwise to any of them, the same when the ring answers from what it remembers, and
    what it remembers stays within its bound."""
    import continuum.routing.hashring as hashring

    monkeypatch.setattr(hashring, "_MAX_REMEMBERED", 16)
    ring = HashRing([f"n{i}" for i in range(5)], virtual_nodes=30)
    span = 1 << 64

    def nearest(digest: bytes) -> int:
        best = None
        for word in range(len(digest) // 8):
            probe = int.from_bytes(digest[word * 8:word * 8 + 8], "big")
            for index, position in enumerate(ring.positions):
                distance = (position - probe) % span
                if best is None or distance < best[0]:
                    best = (distance, index)
        assert best is not None
        return best[1]

    digests = [hashlib.sha256(f"k{i}".encode()).digest() for i in range(40)]
    digests += [hashlib.sha256(b"short").digest()[:16], stable_hash(b"x").to_bytes(8, "big")]
    for _ in range(2):
        for digest in digests:
            assert ring.lookup_probes(digest) == nearest(digest)
            assert 1 <= len(ring.remembered) <= 16


def test_hash_ring_rejects_bad_input() -> None:
    with pytest.raises(ValueError, match="virtual_nodes"):
        HashRing(["a"], virtual_nodes=0)
    with pytest.raises(LookupError, match="empty"):
        HashRing([]).lookup(b"x")
    with pytest.raises(LookupError, match="empty"):
        HashRing([]).lookup_probes(hashlib.sha256(b"x").digest())


def test_round_robin_workers_of_one_host_take_turns_from_one_cycle(tmp_path) -> None:
    """Two workers (two mappings of one host segment, as two gunicorn workers have) that
    alternate cycle as one router; each on its own counter both start on b0."""
    backends = make_backends(4)
    segments = [HostSegment(tmp_path, pid=pid) for pid in (os.getpid(), os.getppid())]
    try:
        shared = [load("RoundRobin", host=seg) for seg in segments]
        names = [shared[i % 2].select(backends, make_context()).name for i in range(9)]
        assert names == ["b0", "b1", "b2", "b3", "b0", "b1", "b2", "b3", "b0"]
        assert shared[0].stats() == {"selections": 5, "shared_turns": True}

        off = parse_config({"fleet": {"share_rotation": False}})
        private = [load("RoundRobin", config=off, host=seg) for seg in segments]
        names = [private[i % 2].select(backends, make_context()).name for i in range(4)]
        assert names == ["b0", "b0", "b1", "b1"]
        assert private[0].stats()["shared_turns"] is False
    finally:
        for seg in segments:
            seg.release()
            seg.close()
