"""The shipped scorer contract, run against this plugin through its entry point."""

from continuum_example_scorer import PreferWeight

from continuum.config import BackendConfig, RouterConfig
from continuum.testing import ScorerContract


class TestPreferWeight(ScorerContract):
    scorer_name = "PreferWeight"


def test_equal_weights_leave_nothing_to_prefer() -> None:
    backends = tuple(BackendConfig(name=n, url="http://127.0.0.1:9") for n in "ab")
    assert PreferWeight.from_config(RouterConfig(backends=backends)) is None
