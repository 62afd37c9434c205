"""Third-party plugin distributions, really installed, selected by their config names.

The example distributions live in ``tests/plugins/continuum-example-strategy`` and
``tests/plugins/continuum-example-scorer``; each is built and installed with pip into a
private target directory (no network: setuptools is already in the environment), then used
from subprocesses that have that directory on their path: a script, the plugin's own
contract tests, and (the scorer) the router itself under gunicorn.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any
from xml.etree import ElementTree

import pytest
import requests

from continuum.config import check_config
from continuum.registry import PluginRegistry

PLUGINS = Path(__file__).resolve().parents[1] / "plugins"
PLUGIN_SOURCE = PLUGINS / "continuum-example-strategy"
SCORER_SOURCE = PLUGINS / "continuum-example-scorer"

#: Offline install of exactly this distribution, built with the environment's setuptools.
PIP_OPTIONS = ["--no-deps", "--no-build-isolation", "--no-index", "--disable-pip-version-check"]

CONFIG = {
    "selection_strategy": "FirstHealthy",
    "backends": [
        {"name": "primary", "url": "http://127.0.0.1:9", "models": ["m"]},
        {"name": "standby", "url": "http://127.0.0.1:10", "models": ["m"]},
    ],
}

_USE_PLUGIN = """
import json, sys
from continuum.routing.backends import Backend
from continuum.config import check_config
from continuum.registry import PluginRegistry
from continuum.testing import make_context

registry = PluginRegistry()
result = check_config(json.loads(sys.argv[1]), registry=registry)
info = registry.info("continuum.strategies", "FirstHealthy")
strategy = registry.create("continuum.strategies", result.config.selection_strategy, result.config)
backends = [Backend(b) for b in result.config.backends]
picks = [strategy.select(backends, make_context()).name for _ in range(5)]
picks.append(strategy.select(backends[::-1], make_context()).name)
print(json.dumps({
    "errors": [issue.render("config") for issue in result.errors],
    "distribution": info.distribution,
    "version": info.version,
    "value": info.value,
    "names": registry.names("continuum.strategies"),
    "picks": picks,
}))
"""


def _run(args: list[str], env: dict[str, str], cwd: Path) -> subprocess.CompletedProcess[str]:
    proc = subprocess.run(
        args, env=env, cwd=cwd, capture_output=True, text=True, timeout=300, check=False
    )
    assert proc.returncode == 0, f"{args} failed:\n{proc.stdout}\n{proc.stderr}"
    return proc


def _install(tmp_path_factory: pytest.TempPathFactory, distribution: Path) -> tuple[Path, Path]:
    """Install ``distribution`` into a private directory; (site, source copy)."""
    root = tmp_path_factory.mktemp("plugin")
    # Build from a copy so the checkout gets no build/ or *.egg-info litter.
    source = root / distribution.name
    shutil.copytree(distribution, source)
    site = root / "site"
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    _run(
        [sys.executable, "-m", "pip", "install", *PIP_OPTIONS, "--target", str(site), str(source)],
        env,
        root,
    )
    return site, source


@pytest.fixture(scope="module")
def plugin_site(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """The example strategy, installed; (site, source copy)."""
    return _install(tmp_path_factory, PLUGIN_SOURCE)


@pytest.fixture(scope="module")
def scorer_site(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """The example scorer, installed; (site, source copy)."""
    return _install(tmp_path_factory, SCORER_SOURCE)


def _plugin_env(site: Path) -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": str(site)}


@pytest.mark.slow
def test_first_healthy_is_unknown_before_install() -> None:
    result = check_config(CONFIG, registry=PluginRegistry())
    assert result.config is None
    [issue] = result.errors
    assert issue.path == "selection_strategy"
    assert "unknown plugin 'FirstHealthy'" in issue.message
    assert "available: " in issue.message
    for builtin in ("ConsistentHash", "LeastLatency", "Random", "RoundRobin"):
        assert builtin in issue.message


@pytest.mark.slow
def test_installed_plugin_is_selected_by_config_name(plugin_site: tuple[Path, Path]) -> None:
    site, _ = plugin_site
    assert (site / "continuum_example_strategy" / "__init__.py").is_file()
    proc = _run(
        [sys.executable, "-c", _USE_PLUGIN, json.dumps(CONFIG)], _plugin_env(site), site.parent
    )
    report = json.loads(proc.stdout)
    assert report["errors"] == []
    assert report["distribution"] == "continuum-example-strategy"
    assert report["version"] == "0.1.0"
    assert report["value"] == "continuum_example_strategy:FirstHealthy"
    assert "FirstHealthy" in report["names"]
    assert report["picks"] == ["primary"] * 5 + ["standby"]


def _contract_outcomes(site: Path, source: Path) -> dict[str | None, str]:
    """Run the installed plugin's own tests; each case's outcome by name (a skipped case's
    as ``skipped: <reason>``)."""
    report = site.parent / "contract.xml"
    _run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", f"--junitxml={report}"],
        _plugin_env(site),
        source,
    )
    outcomes = {}
    for case in ElementTree.parse(report).iter("testcase"):
        tags = [child for child in case if child.tag in ("failure", "error", "skipped")]
        outcome = tags[0].tag if tags else "passed"
        if outcome == "skipped":
            outcome += f": {tags[0].get('message')}"
        outcomes[case.get("name")] = outcome
    return outcomes


@pytest.mark.slow
def test_plugin_passes_the_shipped_strategy_contract(plugin_site: tuple[Path, Path]) -> None:
    outcomes = _contract_outcomes(*plugin_site)
    assert "failure" not in outcomes.values()
    assert "error" not in outcomes.values()
    assert outcomes["test_empty_candidates_raise_no_healthy_backend"] == "passed"
    assert outcomes["test_same_request_gets_same_backend"] == "passed"
    assert outcomes["test_select_does_not_mutate_candidates"] == "passed"
    assert outcomes["test_fresh_instances_give_the_same_sequence"] == "passed"
    assert outcomes["test_includes_every_case_that_applies"] == "passed"
    # Declared sticky and not weighted: the cases that do not apply show up as skipped,
    # saying why, rather than vanishing from the run.
    assert {name: o for name, o in outcomes.items() if o.startswith("skipped")} == {
        "test_every_candidate_is_selected_eventually":
            "skipped: sticky: the same request always gets the same backend",
        "test_weights_are_respected": "skipped: not weighted",
    }
    assert outcomes["test_first_candidate_wins"] == "passed"


SCORER_BACKENDS = [("light", 1), ("heavy", 3)]


def _scorer_config(urls: dict[str, str], scorers: list[str]) -> dict[str, Any]:
    return {
        "selection_strategy": "RoundRobin",
        "scorers": scorers,
        "prefix_routing": {"enabled": True},
        "backends": [{"name": name, "url": urls[name], "models": ["m"], "weight": weight}
                     for name, weight in SCORER_BACKENDS],
        "health_check": {"interval_seconds": 30},
    }


def _routed_to(router: Any, n: int = 6) -> list[str]:
    body = {"model": "m", "messages": [{"role": "system", "content": "You are terse."},
                                       {"role": "user", "content": "hi"}]}
    with requests.Session() as session:
        return [session.post(router.url + "/v1/chat/completions", json=body, timeout=10)
                .headers["X-Continuum-Backend"] for _ in range(n)]


@pytest.mark.slow
def test_scorer_is_unknown_before_install() -> None:
    result = check_config({"scorers": ["KvOverlap", "PreferWeight"]}, registry=PluginRegistry())
    assert result.config is None
    [issue] = result.errors
    assert issue.path == "scorers[1]"
    assert "unknown plugin 'PreferWeight' in continuum.scorers" in issue.message
    assert "available: KvOverlap" in issue.message


@pytest.mark.slow
def test_installed_scorer_passes_the_shipped_scorer_contract(
    scorer_site: tuple[Path, Path],
) -> None:
    outcomes = _contract_outcomes(*scorer_site)
    assert set(outcomes.values()) == {"passed"}
    assert outcomes["test_registered_under_its_config_name"] == "passed"
    assert outcomes["test_the_best_score_above_the_threshold_routes_the_request"] == "passed"
    assert outcomes["test_equal_weights_leave_nothing_to_prefer"] == "passed"


@pytest.mark.slow
@pytest.mark.e2e
def test_installed_scorer_is_selected_by_config_name_and_changes_routing(
    scorer_site: tuple[Path, Path], upstreams: Any, router_factory: Any
) -> None:
    site, _ = scorer_site
    env = {"PYTHONPATH": str(site)}
    urls = {name: upstreams(name).url for name, _ in SCORER_BACKENDS}
    plain = router_factory(_scorer_config(urls, ["KvOverlap"]), env=env)
    assert sorted(_routed_to(plain)) == ["heavy"] * 3 + ["light"] * 3  # RoundRobin

    scored = router_factory(_scorer_config(urls, ["KvOverlap", "PreferWeight"]), env=env)
    assert _routed_to(scored) == ["heavy"] * 6
    loaded = requests.get(scored.url + "/admin/strategies", timeout=5).json()["loaded"]
    scorers = {p["name"]: p for p in loaded if p["group"] == "continuum.scorers"}
    assert sorted(scorers) == ["KvOverlap", "PreferWeight"]  # KvOverlap declined: no index
    plugin = scorers["PreferWeight"]
    assert (plugin["distribution"], plugin["version"], plugin["object"]) == (
        "continuum-example-scorer", "0.1.0", "continuum_example_scorer:PreferWeight")
