"""The plugin registry: lazy entry points, helpful unknown-name errors, interface checks."""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Sequence

import pytest

from continuum.errors import PluginError
from continuum.interfaces import SelectionStrategy
from continuum.registry import PluginRegistry
from continuum.request import RequestContext
from continuum.routing.backends import Backend

GROUP = "continuum.strategies"
BUILTINS = ["ConsistentHash", "LeastLatency", "Random", "RoundRobin", "WeightedRoundRobin"]

_LAZY_SCRIPT = """
import json, sys
from continuum.registry import PluginRegistry

def loaded():
    return sorted(m for m in sys.modules if m == "strategies" or m.startswith("strategies."))

registry = PluginRegistry()
report = {"after_import": loaded()}
report["names"] = registry.names("continuum.strategies")
report["after_names"] = loaded()
registry.load("continuum.strategies", "RoundRobin")
report["after_load"] = loaded()
print(json.dumps(report))
"""


def test_entry_points_are_imported_only_on_lookup() -> None:
    proc = subprocess.run(
        [sys.executable, "-c", _LAZY_SCRIPT],
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    )
    report = json.loads(proc.stdout)
    assert report["after_import"] == []
    assert set(BUILTINS) <= set(report["names"])
    assert report["after_names"] == []
    # Looking one up imports that module only, not its siblings.
    assert report["after_load"] == ["strategies", "strategies.round_robin"]


def test_names_lists_the_builtins() -> None:
    assert set(BUILTINS) <= set(PluginRegistry().names(GROUP))


def test_unknown_name_lists_available_names_and_suggests_the_closest() -> None:
    with pytest.raises(PluginError) as info:
        PluginRegistry().load(GROUP, "RoundRobn")
    message = str(info.value)
    assert "'RoundRobn'" in message
    for name in BUILTINS:
        assert name in message
    assert message.endswith("did you mean 'RoundRobin'?")
    assert (info.value.group, info.value.name) == (GROUP, "RoundRobn")
    assert isinstance(info.value, LookupError)


def test_unknown_name_without_a_close_match_has_no_suggestion() -> None:
    with pytest.raises(PluginError, match="available: ") as info:
        PluginRegistry().load(GROUP, "Zzzzzz")
    assert "did you mean" not in str(info.value)


def test_unknown_group_is_an_error() -> None:
    with pytest.raises(PluginError, match=r"unknown plugin group 'continuum\.nope'"):
        PluginRegistry().names("continuum.nope")


class NotAStrategy:
    """Has a select method but does not implement the interface."""

    name = "Impostor"

    def select(self, candidates: Sequence[Backend], ctx: RequestContext) -> Backend:
        return candidates[0]


class Direct(SelectionStrategy):
    """A conforming strategy registered without entry points."""

    name = "Direct"

    def select(self, candidates: Sequence[Backend], ctx: RequestContext) -> Backend:
        return candidates[-1]


def test_non_conforming_class_is_rejected_naming_the_interface() -> None:
    registry = PluginRegistry(extra={GROUP: {"Impostor": NotAStrategy}})
    assert "Impostor" in registry.names(GROUP)
    with pytest.raises(PluginError) as info:
        registry.load(GROUP, "Impostor")
    assert "does not implement continuum.interfaces.SelectionStrategy" in str(info.value)
    assert registry.loaded() == []


def test_extra_registration_is_found_and_reported() -> None:
    registry = PluginRegistry(extra={GROUP: {"Direct": Direct}})
    assert registry.load(GROUP, "Direct") is Direct
    assert registry.info(GROUP, "Direct").distribution == "<registered>"


def test_info_reports_the_supplying_distribution_and_caches() -> None:
    registry = PluginRegistry()
    info = registry.info(GROUP, "WeightedRoundRobin")
    assert info.distribution == "continuum-router"
    assert info.value == "strategies.weighted_round_robin:WeightedRoundRobin"
    assert info.obj.__name__ == "WeightedRoundRobin"
    assert info.obj.name == "WeightedRoundRobin"
    assert registry.load(GROUP, "WeightedRoundRobin") is info.obj
    assert registry.loaded() == [info]


@pytest.mark.parametrize("name", BUILTINS)
def test_every_builtin_is_named_as_registered(name: str) -> None:
    cls = PluginRegistry().load(GROUP, name)
    assert issubclass(cls, SelectionStrategy)
    assert cls.name == name


def test_the_name_registry_checks_names_without_importing_the_plugin(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """What the gunicorn master checks a HUP's config with: a plugin's module must not be
    imported before gevent patches the workers' standard library."""
    from importlib import metadata

    from continuum.registry import NameRegistry

    def refuse(self: metadata.EntryPoint) -> object:
        raise AssertionError(f"imported {self.value}")

    monkeypatch.setattr(metadata.EntryPoint, "load", refuse)
    registry = NameRegistry()
    assert registry.load(GROUP, "PrefixAwareHash") is object
    with pytest.raises(PluginError, match="did you mean 'PrefixAwareHash'"):
        registry.load(GROUP, "PrefixAwareHsh")
    with pytest.raises(PluginError, match="failed to load: imported strategies"):
        PluginRegistry().load(GROUP, "RoundRobin")  # the patch holds: the real one imports
