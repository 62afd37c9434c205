"""The shipped strategy contract, run against this plugin through its entry point."""

from continuum.testing import StrategyContract, make_backends, make_context


class TestFirstHealthy(StrategyContract):
    strategy_name = "FirstHealthy"


def test_first_candidate_wins() -> None:
    backends = make_backends(3)
    strategy = TestFirstHealthy().strategy_factory()
    assert strategy.select(backends[1:], make_context()) is backends[1]
