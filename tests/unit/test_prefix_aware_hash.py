"""PrefixAwareHash: spread, minimal remapping, bounded loads, decision labels, reload."""

from __future__ import annotations

import collections
import hashlib
import random
import subprocess
import sys

from continuum.config import parse_config
from continuum.metrics import RouterMetrics
from continuum.registry import PluginRegistry
from continuum.testing import make_backends, make_context
from continuum.testing.strategies import DeterministicCases, StickyCases
from strategies.prefix_aware_hash import PrefixAwareHash, load_bound


class TestPrefixAwareHashContract(StickyCases, DeterministicCases):
    strategy_name = "PrefixAwareHash"


def _key(i: int) -> bytes:
    return hashlib.sha256(f"prefix-{i}".encode()).digest()


def _config(**prefix_routing: object):  # type: ignore[no-untyped-def]
    return parse_config({"selection_strategy": "PrefixAwareHash",
                         "prefix_routing": {"enabled": True, **prefix_routing}})


def test_spread_over_eight_backends_is_near_even() -> None:
    strategy = PrefixAwareHash(_config())
    backends = make_backends(8)
    counts = collections.Counter(
        strategy.select(backends, make_context(prefix=_key(i))).name for i in range(10_000))
    shares = [counts[b.name] / 10_000 for b in backends]
    # Each backend within 2 percentage points of 1/8 (150 virtual nodes, 4 probes); the
    # sampling noise of 10,000 keys alone is about 0.4 points.
    assert all(abs(share - 0.125) < 0.02 for share in shares), shares


def test_removing_one_backend_remaps_about_an_eighth() -> None:
    strategy = PrefixAwareHash(_config())
    backends = make_backends(8)
    before = [strategy.select(backends, make_context(prefix=_key(i))).name for i in range(10_000)]
    after = [strategy.select(backends[:3] + backends[4:], make_context(prefix=_key(i))).name
             for i in range(10_000)]
    moved = [i for i in range(10_000) if before[i] != after[i]]
    assert 0.08 < len(moved) / 10_000 < 0.17
    assert all(before[i] == backends[3].name for i in moved)  # only the removed one's keys


def test_ring_positions_are_the_same_in_another_process() -> None:
    strategy = PrefixAwareHash(_config())
    backends = make_backends(8)
    here = [strategy.select(backends, make_context(prefix=_key(i))).name for i in range(200)]
    code = (
        "import hashlib;"
        "from continuum.config import parse_config;"
        "from continuum.testing import make_backends, make_context;"
        "from strategies.prefix_aware_hash import PrefixAwareHash;"
        "s = PrefixAwareHash(parse_config({'prefix_routing': {'enabled': True}}));"
        "b = make_backends(8);"
        "print(','.join(s.select(b, make_context(prefix=hashlib.sha256("
        "f'prefix-{i}'.encode()).digest())).name for i in range(200)))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         env={"PYTHONHASHSEED": "12345", "PATH": ""}, timeout=60, check=True)
    assert out.stdout.strip().split(",") == here


def test_zipf_load_never_exceeds_the_bound_and_overflow_is_counted() -> None:
    metrics = RouterMetrics()
    strategy = PrefixAwareHash(_config(load_factor_epsilon=0.25), metrics=metrics)
    backends = make_backends(8)
    rng = random.Random(7)
    weights = [1 / (rank ** 1.2) for rank in range(1, 201)]
    active: list = []
    for step in range(20_000):
        if active and (len(active) > 64 or rng.random() < 0.45):
            active.pop(rng.randrange(len(active))).in_flight -= 1
        prefix = rng.choices(range(200), weights)[0]
        bound = load_bound(backends, 0.25)
        chosen = strategy.select(backends, make_context(prefix=_key(prefix)))
        assert chosen.in_flight < bound, (step, chosen.in_flight, bound)
        chosen.in_flight += 1
        active.append(chosen)
    decisions = strategy.stats()["routing_decisions"]
    assert decisions["total"] == 20_000
    assert decisions["overflow"] > 0 and decisions["fallback"] == 0
    assert float(decisions["overflow_rate"]) == round(decisions["overflow"] / 20_000, 4)
    sample = metrics.prefix_requests.labels("overflow")._value.get()
    assert sample == decisions["overflow"]


def test_owner_keeps_request_below_bound_then_overflows_clockwise() -> None:
    strategy = PrefixAwareHash(_config(load_factor_epsilon=0.5))
    backends = make_backends(4)
    ctx = make_context(prefix=_key(1))
    owner = strategy.select(backends, ctx)
    order = strategy.explain(backends, ctx)["ring_order"]
    assert order[0] == owner.name and sorted(order) == sorted(b.name for b in backends)
    owner.in_flight = 10  # far above ceil(1.5 * 11 / 4) = 5
    explained = strategy.explain(backends, ctx)
    assert explained["decision"] == "overflow" and explained["backend"] == order[1]
    assert explained["load_bound"] == 5
    assert strategy.select(backends, ctx).name == order[1]


def test_with_spill_at_slots_a_full_owner_passes_to_the_next_with_a_free_slot() -> None:
    """``load_guard.slot_wait`` (the KV scorer sets ``ctx.spill_at_slots``): an owner
    whose slots are full passes the request on although it is under the CHWBL bound; the
    next backend clockwise whose slots are full too is passed over as well. Without the
    flag, or with every slot full, the bound alone decides, as before."""
    strategy = PrefixAwareHash(_config())
    backends = make_backends(4)
    ctx = make_context(prefix=_key(3))
    order = strategy.explain(backends, ctx)["ring_order"]
    by_name = {b.name: b for b in backends}
    for backend in backends:
        backend.slots = 2
    by_name[order[0]].in_flight = 2  # its two slots are full
    by_name[order[1]].in_flight = 2
    by_name[order[3]].in_flight = 4
    bound = strategy.explain(backends, ctx)["load_bound"]
    assert bound == 3  # ceil(1.25 * (8 + 1) / 4): the owner is under it
    assert strategy.select(backends, ctx).name == order[0]
    ctx.spill_at_slots = True
    explained = strategy.explain(backends, ctx)
    assert (explained["decision"], explained["backend"]) == ("overflow", order[2])
    assert explained["reason"] == f"the owner {order[0]} has no free slot; next with one clockwise"
    assert strategy.select(backends, ctx).name == order[2]
    for backend in backends:
        backend.in_flight = 2  # every slot full: the owner keeps it under the bound
    assert strategy.select(backends, ctx).name == order[0]
    by_name[order[0]].slots = None  # unknown slots: only the bound counts
    by_name[order[0]].in_flight = 1
    assert strategy.select(backends, ctx).name == order[0]


def test_no_prefix_key_hashes_the_model_without_bound() -> None:
    strategy = PrefixAwareHash(_config())
    backends = make_backends(4)
    first = strategy.select(backends, make_context("llama"))
    first.in_flight = 1000
    assert strategy.select(backends, make_context("llama")) is first
    assert strategy.stats()["routing_decisions"]["fallback"] == 2


def test_reconfigure_rebuilds_ring_and_keeps_in_flight() -> None:
    strategy = PrefixAwareHash(_config(virtual_nodes=150))
    backends = make_backends(8)
    backends[2].in_flight = 3
    before = [strategy.select(backends, make_context(prefix=_key(i))).name for i in range(500)]
    assert strategy.reconfigure(_config(virtual_nodes=10)) == []
    assert strategy.stats()["config"]["virtual_nodes"] == 10
    after = [strategy.select(backends, make_context(prefix=_key(i))).name for i in range(500)]
    assert before != after and backends[2].in_flight == 3


def test_unique_prefixes_estimate() -> None:
    strategy = PrefixAwareHash(_config())
    backends = make_backends(3)
    for i in range(3000):
        strategy.select(backends, make_context(prefix=_key(i % 1000)))
    assert 950 <= strategy.stats()["unique_prefixes"] <= 1050


def test_unique_prefixes_past_the_keys_remembered_as_counted() -> None:
    """Keys are given to the estimator once while remembered; past the bound the memory
    starts over and the estimate is unchanged by keys given again."""
    from strategies import prefix_aware_hash

    strategy = PrefixAwareHash(_config())
    backends = make_backends(3)
    distinct = prefix_aware_hash._MAX_COUNTED + 2000
    for _ in range(2):
        for i in range(distinct):
            strategy.select(backends, make_context(prefix=_key(i)))
            assert len(strategy._counted) <= prefix_aware_hash._MAX_COUNTED
    assert 0.97 * distinct <= strategy.stats()["unique_prefixes"] <= 1.03 * distinct


def test_loaded_through_registry_with_collaborators() -> None:
    cls = PluginRegistry().load("continuum.strategies", "PrefixAwareHash")
    assert cls is PrefixAwareHash
    cfg = _config()
    assert cls(cfg, metrics=RouterMetrics(), pool=None).settings is cfg.prefix_routing


def test_warning_when_prefix_routing_disabled() -> None:
    from continuum.config import check_config

    result = check_config({"selection_strategy": "PrefixAwareHash"})
    assert [w.path for w in result.warnings if w.path == "selection_strategy"] == [
        "selection_strategy"]
    enabled = check_config({"selection_strategy": "PrefixAwareHash",
                            "prefix_routing": {"enabled": True}})
    assert all(w.path != "selection_strategy" for w in enabled.warnings)
