"""The shipped contract suites as a plugin author runs them: cases that do not apply are
reported as skipped with the reason, never dropped from the run.

Each suite runs in a pytest session of its own (``pytester``), against built-in plugins
standing in for third-party ones, so the skips are the inner session's and this suite's
own run skips nothing.
"""

from __future__ import annotations

import pytest

from continuum.testing import StrategyContract

pytest_plugins = ["pytester"]

HEADER = """
from continuum.testing import CacheStoreContract, KvIndexContract, StrategyContract
from continuum.testing.strategies import DeterministicCases, SpreadingCases
from stores.kv_memory import InMemoryKvIndex
from stores.memory import InMemoryCacheStore
"""


def run_suite(pytester: pytest.Pytester, source: str) -> dict[str, tuple[str, str]]:
    """Run the test classes in ``source`` in a session of their own: ``case`` (parameters
    dropped) → (outcome, skip reason or failure text)."""
    pytester.makepyfile(test_suite=HEADER + source)
    result = pytester.inline_run("-p", "no:randomly", "-p", "no:cacheprovider")
    found: dict[str, tuple[str, str]] = {}
    for report in result.getreports("pytest_runtest_logreport"):
        if report.when != "call" and not (report.when == "setup" and report.skipped):
            continue
        name = report.nodeid.rsplit("::", 1)[1].split("[")[0]
        if report.skipped:
            detail = str(report.longrepr[2]).removeprefix("Skipped: ")
        else:
            detail = str(report.longrepr) if report.failed else ""
        found[name] = (report.outcome, detail)
    return found


def skipped(outcomes: dict[str, tuple[str, str]]) -> dict[str, str]:
    return {name: detail for name, (outcome, detail) in outcomes.items()
            if outcome == "skipped"}


def test_strategy_flags_skip_cases_with_the_reason(pytester: pytest.Pytester) -> None:
    outcomes = run_suite(pytester, """
class TestSpreading(StrategyContract):
    strategy_name = "RoundRobin"
""")
    assert skipped(outcomes) == {
        "test_same_request_gets_same_backend": "not sticky",
        "test_weights_are_respected": "not weighted",
    }
    assert outcomes["test_every_candidate_is_selected_eventually"][0] == "passed"
    assert outcomes["test_includes_every_case_that_applies"][0] == "passed"
    assert {o for o, _ in outcomes.values()} == {"passed", "skipped"}


def test_unsupported_names_cases_to_skip_and_why(pytester: pytest.Pytester) -> None:
    outcomes = run_suite(pytester, """
class TestSticky(StrategyContract):
    strategy_name = "ConsistentHash"
    unsupported = {"test_stats_are_json_serialisable": "stats are not JSON here"}
""")
    assert skipped(outcomes) == {
        "test_every_candidate_is_selected_eventually":
            "sticky: the same request always gets the same backend",
        "test_weights_are_respected": "not weighted",
        "test_stats_are_json_serialisable": "stats are not JSON here",
    }
    assert outcomes["test_same_request_gets_same_backend"][0] == "passed"


def test_hooks_a_store_or_index_lacks_skip_their_cases(pytester: pytest.Pytester) -> None:
    outcomes = run_suite(pytester, """
class TestStore(CacheStoreContract):
    def make_store(self):
        return InMemoryCacheStore(capacity=10)
""")
    assert skipped(outcomes) == {
        "test_clear_leaves_foreign_keys_alone":
            "put_foreign() and get_foreign() are not overridden",
        "test_failing_store_raises_only_store_error": "make_broken_store() is not overridden",
    }
    outcomes = run_suite(pytester, """
class TestUncountedIndex(KvIndexContract):
    counts_entries = False

    def make_index(self, *, storage_offloading=False, treat_eviction_as_offload=True,
                   ttl=600):
        return InMemoryKvIndex(100, ttl, storage_offloading=storage_offloading,
                               treat_eviction_as_offload=treat_eviction_as_offload)
""")
    assert skipped(outcomes) == {
        "test_stats_count_prefixes_and_entries":
            "counts_entries is False: stats() reports no counts",
    }


def test_a_class_missing_an_applicable_mixin_fails(pytester: pytest.Pytester) -> None:
    # WeightedRoundRobin is weighted: leaving out WeightedCases is caught, not skipped.
    outcomes = run_suite(pytester, """
class TestFromMixins(SpreadingCases, DeterministicCases):
    strategy_name = "WeightedRoundRobin"
""")
    assert skipped(outcomes) == {}
    outcome, detail = outcomes.pop("test_includes_every_case_that_applies")
    assert outcome == "failed"
    assert ("TestFromMixins leaves out cases that apply to its plugin: "
            "test_weights_are_respected; include their mixins") in detail
    assert "test_every_candidate_is_selected_eventually" in outcomes
    assert "test_fresh_instances_give_the_same_sequence" in outcomes
    assert {o for o, _ in outcomes.values()} == {"passed"}


def test_unsupported_naming_no_case_is_refused() -> None:
    with pytest.raises(TypeError, match=r"TestTypo\.unsupported names no case of it: "
                                        r"test_weights_are_respectd"):
        type("TestTypo", (StrategyContract,),
             {"strategy_name": "RoundRobin",
              "unsupported": {"test_weights_are_respectd": "typo"}})
