"""A value of the wrong type anywhere in a config is an error naming its key, never a
traceback: every key of ``config defaults`` (which prints ``url: null`` for the backend to
fill in), of the example config and of the listener's defaults, replaced in turn by values
of each other type. The sections' cross-field checks used to read the refused value (None)
and crash: ``continuum-router config defaults > c.yaml; continuum-router config validate
c.yaml`` ended in a TypeError."""

from __future__ import annotations

import copy
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from continuum.cli import _registry
from continuum.config import check_config, defaults_text
from listener.cli import defaults_text as listener_defaults
from listener.config import check_listener_config

ROOT = Path(__file__).resolve().parents[2]
WRONG = [None, [1, 2], {"a": 1}, "zz", -1, True, 1.5, "", [None]]


def _paths(doc: Any, prefix: tuple[Any, ...] = ()) -> Iterator[tuple[Any, ...]]:
    if isinstance(doc, dict):
        for key, value in doc.items():
            yield (*prefix, key)
            yield from _paths(value, (*prefix, key))
    elif isinstance(doc, list):
        for i, value in enumerate(doc):
            yield (*prefix, i)
            yield from _paths(value, (*prefix, i))


def _replaced(doc: Any, path: tuple[Any, ...], value: Any) -> Any:
    out = copy.deepcopy(doc)
    parent = out
    for key in path[:-1]:
        parent = parent[key]
    parent[path[-1]] = value
    return out


ROUTER_DOCS = {
    "config defaults": yaml.safe_load(defaults_text()),
    "config.yaml.example": yaml.safe_load((ROOT / "conf/config.yaml.example").read_text()),
}


@pytest.mark.parametrize("name", sorted(ROUTER_DOCS))
def test_every_router_key_with_a_wrong_type_is_an_error_not_a_crash(name: str) -> None:
    doc, registry = ROUTER_DOCS[name], _registry()
    checked = 0
    for path in _paths(doc):
        for value in WRONG:
            result = check_config(_replaced(doc, path, value), name, registry)
            checked += 1
            if result.config is None:  # refused: the reasons name keys
                assert result.errors and all(e.path for e in result.errors)
    assert checked > 700  # the walk reached the whole document


def test_a_refused_value_is_reported_at_its_own_key() -> None:
    doc = ROUTER_DOCS["config defaults"]
    errors = {e.path: e.message for e in check_config(doc, "d", _registry()).errors}
    assert errors["backends[0].url"] == "must not be empty"
    assert errors["backends[0].name"] == "must not be empty"
    doc = _replaced(ROUTER_DOCS["config.yaml.example"], ("server", "bind"), [1, 2])
    errors = {e.path: e.message for e in check_config(doc, "x", _registry()).errors}
    assert errors["server.bind"] == "expected a string"


def test_every_listener_key_with_a_wrong_type_is_an_error_not_a_crash() -> None:
    doc = yaml.safe_load(listener_defaults())
    for path in _paths(doc):
        for value in WRONG:
            config, errors, _warnings = check_listener_config(_replaced(doc, path, value))
            if config is None:
                assert errors


def test_validate_of_the_printed_defaults_names_what_to_fill_in(tmp_path: Path) -> None:
    defaults = tmp_path / "c.yaml"
    defaults.write_text(defaults_text())
    run = subprocess.run([sys.executable, "-m", "continuum.cli", "config", "validate",
                          str(defaults)], capture_output=True, text=True, timeout=60, cwd=ROOT)
    assert run.returncode == 1, run.stderr
    out = run.stdout + run.stderr
    assert "Traceback" not in out
    assert "backends[0].url: must not be empty" in out
