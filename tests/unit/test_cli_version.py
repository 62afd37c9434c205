"""``--version`` on the three command-line tools prints ``<prog> <version>`` and exits 0."""

from __future__ import annotations

import subprocess
import sys

import pytest

import continuum

# (console script, the module its entry point lives in)
CLIS = [
    ("continuum-router", "continuum.cli"),
    ("continuum-sim", "continuum.sim.cli"),
    ("continuum-kv-listener", "listener.cli"),
]


@pytest.mark.parametrize(("prog", "module"), CLIS)
def test_version_prints_the_package_version(prog: str, module: str) -> None:
    # A child process: the sim and the listener monkey-patch with gevent before parsing.
    # The router needs no subcommand for it.
    result = subprocess.run([sys.executable, "-m", module, "--version"], capture_output=True,
                            text=True, timeout=60, check=False)
    assert result.returncode == 0, result.stderr
    assert result.stdout == f"{prog} {continuum.__version__}\n"
    assert result.stderr == ""

