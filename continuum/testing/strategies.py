"""The contract every selection strategy must meet, as a reusable pytest suite.

A plugin author runs it against their strategy in a few lines::

    from continuum.testing import StrategyContract

    class TestFirstHealthy(StrategyContract):
        strategy_name = "FirstHealthy"   # looked up through the entry points
        sticky = True                    # always the same backend for the same request

The suite loads the strategy through :class:`continuum.registry.PluginRegistry`, so it
also proves the entry point is registered. Override :meth:`StrategyContract.make_strategy`
to pass collaborators (a seed, say), or :meth:`StrategyContract.strategy_factory` to skip
the registry altogether.

Behaviour flags (``deterministic``, ``weighted``, ``sticky``) are read from the test class
when set there, else from the strategy class, else taken as False; a case that a flag makes
inapplicable is reported as skipped, with the reason:

* ``deterministic``: two fresh instances give the same sequence for the same inputs
  (:class:`DeterministicCases`).
* ``weighted``: each backend's share of selections follows its ``weight``
  (:class:`WeightedCases`).
* ``sticky``: the same request always goes to the same backend (:class:`StickyCases`), so
  "every candidate is selected eventually" (:class:`SpreadingCases`) does not apply.

A test class that wants no case skipped builds itself from :class:`StrategyCases` (what
every strategy must pass) and the mixins its flags call for (:mod:`continuum.testing.contract`).
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import asdict
from typing import Any, ClassVar

try:
    import pytest
except ImportError as exc:  # pragma: no cover - depends on the environment
    raise ImportError(
        "continuum.testing needs pytest, which is a test extra: "
        "pip install 'continuum-router[test]'"
    ) from exc

from continuum.config import BackendConfig
from continuum.errors import NoHealthyBackendError
from continuum.interfaces import PrefixRoutingStats, SelectionStrategy
from continuum.registry import PluginRegistry
from continuum.request import CHAT, RequestContext, parse_request
from continuum.routing.backends import Backend
from continuum.testing.contract import Contract

STRATEGY_GROUP = "continuum.strategies"


def make_backends(
    n: int,
    weights: Sequence[int] | None = None,
    latencies: Sequence[float | None] | None = None,
) -> list[Backend]:
    """``n`` real backends named ``b0``, ``b1``, … at an unreachable local URL.

    Args:
        n: how many.
        weights: per-backend weight (default 1 each).
        latencies: per-backend ``latency_ewma`` in seconds; None leaves a backend unsampled.
    """
    backends = []
    for i in range(n):
        weight = 1 if weights is None else weights[i]
        config = BackendConfig(name=f"b{i}", url="http://127.0.0.1:9", weight=weight)
        backend = Backend(config)
        if latencies is not None:
            backend.latency_ewma = latencies[i]
        backends.append(backend)
    return backends


def make_context(model: str = "m", prefix: bytes | None = None) -> RequestContext:
    """A chat-completion request context for ``model``, with ``prefix`` as its prefix key."""
    body = {"model": model, "messages": [{"role": "user", "content": "Hello"}]}
    ctx = parse_request(json.dumps(body).encode(), CHAT, request_id="contract")
    ctx.prefix_key = prefix
    return ctx


def _is_one_of(chosen: object, candidates: Sequence[Backend]) -> bool:
    return any(chosen is candidate for candidate in candidates)


class StrategyCases(Contract):
    """The cases every strategy must pass, the hooks and the flags."""

    #: Config name of the strategy under test, resolved through the entry points.
    strategy_name: ClassVar[str] = ""
    #: Behaviour flags; None means "ask the strategy class".
    deterministic: ClassVar[bool | None] = None
    weighted: ClassVar[bool | None] = None
    sticky: ClassVar[bool | None] = None
    #: Calls made by the statistical cases, and the allowed gap between shares.
    calls: ClassVar[int] = 6000
    share_tolerance: ClassVar[float] = 0.03

    def make_strategy(self, cls: type[SelectionStrategy]) -> SelectionStrategy:
        """Build an instance of the loaded class; override to pass collaborators."""
        return cls()

    def strategy_factory(self) -> SelectionStrategy:
        """A fresh strategy instance; by default loaded from the registry by name."""
        if not self.strategy_name:
            raise NotImplementedError("set strategy_name or override strategy_factory()")
        return self.make_strategy(PluginRegistry().load(STRATEGY_GROUP, self.strategy_name))

    @classmethod
    def skipped_cases(cls) -> dict[str, str]:
        """The cases the strategy's behaviour flags make inapplicable."""
        skipped = super().skipped_cases()
        if cls._flag("sticky"):
            skipped.setdefault("test_every_candidate_is_selected_eventually",
                               "sticky: the same request always gets the same backend")
        else:
            skipped.setdefault("test_same_request_gets_same_backend", "not sticky")
        if not cls._flag("deterministic"):
            skipped.setdefault("test_fresh_instances_give_the_same_sequence",
                               "not deterministic")
        if not cls._flag("weighted"):
            skipped.setdefault("test_weights_are_respected", "not weighted")
        return skipped

    @classmethod
    def _flag(cls, name: str) -> bool:
        """The behaviour flag ``name``, from this class or else the strategy's class."""
        value = getattr(cls, name, None)
        if value is None and cls.strategy_name:
            strategy_cls = PluginRegistry().load(STRATEGY_GROUP, cls.strategy_name)
            value = getattr(strategy_cls, name, False)
        return bool(value)

    # -- the cases --------------------------------------------------------------------

    def test_is_a_selection_strategy(self) -> None:
        strategy = self.strategy_factory()
        assert isinstance(strategy, SelectionStrategy)
        if self.strategy_name:
            assert type(strategy).name == self.strategy_name

    def test_empty_candidates_raise_no_healthy_backend(self) -> None:
        with pytest.raises(NoHealthyBackendError, match="no healthy backend"):
            self.strategy_factory().select([], make_context())

    def test_single_candidate_is_always_returned(self) -> None:
        strategy = self.strategy_factory()
        only = make_backends(1)
        for i in range(50):
            assert strategy.select(only, make_context(f"model-{i % 5}")) is only[0]

    def test_result_is_one_of_the_candidates(self) -> None:
        strategy = self.strategy_factory()
        backends = make_backends(5, weights=[1, 2, 3, 1, 2])
        for i in range(200):
            chosen = strategy.select(backends, make_context(f"model-{i}"))
            assert _is_one_of(chosen, backends)

    def test_candidate_list_may_change_between_calls(self) -> None:
        strategy = self.strategy_factory()
        backends = make_backends(6, weights=[3, 1, 2, 1, 1, 2])
        subsets = [backends, backends[1:], backends[::2], backends[:2], backends[3:4]]
        for i in range(300):
            candidates = subsets[i % len(subsets)]
            assert _is_one_of(strategy.select(candidates, make_context(f"m{i % 7}")), candidates)

    def test_select_does_not_mutate_candidates(self) -> None:
        strategy = self.strategy_factory()
        backends = make_backends(4, weights=[2, 1, 1, 3], latencies=[0.2, None, 0.1, 0.3])
        candidates = list(backends)
        for i in range(100):
            strategy.select(candidates, make_context(f"model-{i}"))
        assert candidates == backends
        assert all(a is b for a, b in zip(candidates, backends, strict=True))
        # In-flight accounting belongs to the proxy; a strategy only reads it.
        assert [b.in_flight for b in backends] == [0, 0, 0, 0]
        # A read-only sequence works too.
        assert _is_one_of(strategy.select(tuple(backends), make_context()), backends)

    def test_stats_are_json_serialisable(self) -> None:
        strategy = self.strategy_factory()
        strategy.select(make_backends(3), make_context())
        stats: Any = strategy.stats()
        assert isinstance(stats, dict)
        assert json.loads(json.dumps(stats)) == stats

    def test_prefix_routing_stats_are_none_or_count_every_selection(self) -> None:
        strategy = self.strategy_factory()
        backends = make_backends(3)
        for prefix in (b"p1", b"p2", None):
            strategy.select(backends, make_context(prefix=prefix))
        stats: Any = strategy.prefix_routing_stats()
        if stats is None:  # not a prefix-routing strategy
            return
        assert isinstance(stats, PrefixRoutingStats)
        decisions = stats.routing_decisions
        assert decisions.total == 3
        assert decisions.prefix_hash + decisions.overflow + decisions.fallback == 3
        doc = asdict(stats)
        assert json.loads(json.dumps(doc)) == doc


class SpreadingCases(StrategyCases):
    """For a strategy that is not ``sticky``: it spreads requests over every candidate."""

    def test_every_candidate_is_selected_eventually(self) -> None:
        strategy = self.strategy_factory()
        backends = make_backends(4)
        chosen = {strategy.select(backends, make_context()).name for _ in range(400)}
        assert chosen == {b.name for b in backends}


class StickyCases(StrategyCases):
    """For a ``sticky`` strategy: the same request always gets the same backend."""

    def test_same_request_gets_same_backend(self) -> None:
        strategy = self.strategy_factory()
        backends = make_backends(5)
        for model in ("llama", "qwen", "mistral"):
            first = strategy.select(backends, make_context(model))
            for _ in range(50):
                assert strategy.select(backends, make_context(model)) is first


class DeterministicCases(StrategyCases):
    """For a ``deterministic`` strategy: fresh instances make the same choices."""

    def test_fresh_instances_give_the_same_sequence(self) -> None:
        def run() -> list[str]:
            strategy = self.strategy_factory()
            backends = make_backends(4, weights=[3, 1, 2, 1])
            return [
                strategy.select(backends, make_context(f"model-{i % 9}")).name for i in range(200)
            ]

        assert run() == run()


class WeightedCases(StrategyCases):
    """For a ``weighted`` strategy: shares of selections follow the backends' weights."""

    def test_weights_are_respected(self) -> None:
        strategy = self.strategy_factory()
        weights = [1, 2, 3, 4]
        backends = make_backends(4, weights=weights)
        counts: dict[str, int] = dict.fromkeys((b.name for b in backends), 0)
        ctx = make_context()
        for _ in range(self.calls):
            counts[strategy.select(backends, ctx).name] += 1
        for backend, weight in zip(backends, weights, strict=True):
            share = counts[backend.name] / self.calls
            assert share == pytest.approx(weight / sum(weights), abs=self.share_tolerance), counts


class StrategyContract(SpreadingCases, StickyCases, DeterministicCases, WeightedCases):
    """The whole contract: subclass as ``Test<Something>`` and set ``strategy_name`` (or
    override a hook); the cases its behaviour flags rule out are skipped."""


StrategyCases.full_contract = StrategyContract
