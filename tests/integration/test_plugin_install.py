"""A third-party strategy distribution, really installed, selected by its config name.

The example distribution lives in ``tests/plugins/continuum-example-strategy``; it is built
and installed with pip into a private target directory (no network: setuptools is already
in the environment), then used from a subprocess that has that directory on its path.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path
from xml.etree import ElementTree

import pytest

from continuum.config import check_config
from continuum.registry import PluginRegistry

PLUGIN_SOURCE = Path(__file__).resolve().parents[1] / "plugins" / "continuum-example-strategy"

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


@pytest.fixture(scope="module")
def plugin_site(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """Install the example distribution into a private directory; (site, source copy)."""
    root = tmp_path_factory.mktemp("plugin")
    # Build from a copy so the checkout gets no build/ or *.egg-info litter.
    source = root / "continuum-example-strategy"
    shutil.copytree(PLUGIN_SOURCE, source)
    site = root / "site"
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    _run(
        [sys.executable, "-m", "pip", "install", *PIP_OPTIONS, "--target", str(site), str(source)],
        env,
        root,
    )
    return site, source


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


@pytest.mark.slow
def test_plugin_passes_the_shipped_strategy_contract(plugin_site: tuple[Path, Path]) -> None:
    site, source = plugin_site
    report = site.parent / "contract.xml"
    _run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", f"--junitxml={report}"],
        _plugin_env(site),
        source,
    )
    outcomes = {}
    for case in ElementTree.parse(report).iter("testcase"):
        tags = [child.tag for child in case if child.tag in ("failure", "error", "skipped")]
        outcome = tags[0] if tags else "passed"
        outcomes[case.get("name")] = outcome
    assert "failure" not in outcomes.values()
    assert "error" not in outcomes.values()
    assert outcomes["test_empty_candidates_raise_no_healthy_backend"] == "passed"
    assert outcomes["test_same_request_gets_same_backend"] == "passed"
    assert outcomes["test_select_does_not_mutate_candidates"] == "passed"
    # Declared sticky: "every candidate is selected" does not apply to it.
    assert "test_every_candidate_is_selected_eventually" not in outcomes  # sticky: removed
    assert "skipped" not in outcomes.values()
    assert outcomes["test_first_candidate_wins"] == "passed"
