"""One small registry for every plugin kind, backed by entry points.

Plugins (built-in or third-party) are registered in a distribution's metadata under one of
the groups in :data:`continuum.interfaces.PLUGIN_GROUPS`. Nothing is imported until a
name is looked up; the loaded object is checked against its group's interface then, and
the registry remembers which distribution supplied it.
"""

from __future__ import annotations

import difflib
from dataclasses import dataclass
from importlib import metadata
from typing import Any

from continuum.errors import PluginError
from continuum.interfaces import PLUGIN_GROUPS


@dataclass(frozen=True)
class PluginInfo:
    """A loaded plugin and where it came from."""

    group: str
    name: str
    obj: type
    distribution: str
    version: str
    value: str


def _entry_points(group: str) -> dict[str, metadata.EntryPoint]:
    found: dict[str, metadata.EntryPoint] = {}
    for ep in metadata.entry_points(group=group):
        found.setdefault(ep.name, ep)
    return found


class PluginRegistry:
    """Looks plugins up by group and config name; caches what it has loaded.

    Instances are cheap and independent (no module-level state), so tests can build their
    own; ``extra`` registers objects directly, for tests and embedding.
    """

    def __init__(self, extra: dict[str, dict[str, type]] | None = None) -> None:
        self._loaded: dict[tuple[str, str], PluginInfo] = {}
        self._extra = extra or {}

    def names(self, group: str) -> list[str]:
        """Every name registered under ``group``, sorted."""
        self._check_group(group)
        return sorted(set(_entry_points(group)) | set(self._extra.get(group, {})))

    def load(self, group: str, name: str) -> type:
        """The plugin class registered as ``name`` in ``group``.

        Raises:
            PluginError: unknown name (the message lists the available names and the closest
                match), import failure, or an object that does not implement the interface.
        """
        return self.info(group, name).obj

    def info(self, group: str, name: str) -> PluginInfo:
        """Like :meth:`load`, with the supplying distribution."""
        key = (group, name)
        cached = self._loaded.get(key)
        if cached is not None:
            return cached
        self._check_group(group)
        interface = PLUGIN_GROUPS[group]
        direct = self._extra.get(group, {}).get(name)
        if direct is not None:
            info = PluginInfo(group, name, direct, "<registered>", "", direct.__qualname__)
        else:
            ep = _entry_points(group).get(name)
            if ep is None:
                raise PluginError(self.unknown_message(group, name), group=group, name=name)
            try:
                obj = ep.load()
            except Exception as exc:  # a broken plugin must not look like an unknown one
                raise PluginError(
                    f"plugin {name!r} in {group} ({ep.value}) failed to load: {exc}",
                    group=group,
                    name=name,
                ) from exc
            dist = ep.dist
            info = PluginInfo(
                group,
                name,
                obj,
                dist.metadata["Name"] if dist is not None else "<unknown>",
                dist.version if dist is not None else "",
                ep.value,
            )
        if not (isinstance(info.obj, type) and issubclass(info.obj, interface)):
            raise PluginError(
                f"plugin {name!r} in {group} ({info.value}) does not implement "
                f"{interface.__module__}.{interface.__qualname__}",
                group=group,
                name=name,
            )
        self._loaded[key] = info
        return info

    def create(self, group: str, name: str, *args: Any, **kwargs: Any) -> Any:
        """Load ``name`` and instantiate it with the given arguments."""
        return self.load(group, name)(*args, **kwargs)

    def unknown_message(self, group: str, name: str) -> str:
        """Error text for an unknown plugin name: what exists and what was probably meant."""
        available = self.names(group)
        close = difflib.get_close_matches(name, available, n=1, cutoff=0.6)
        hint = f"; did you mean {close[0]!r}?" if close else ""
        listing = ", ".join(available) or "none installed"
        return f"unknown plugin {name!r} in {group} (available: {listing}){hint}"

    def loaded(self) -> list[PluginInfo]:
        """Everything loaded so far, for ``GET /admin/strategies``."""
        return list(self._loaded.values())

    @staticmethod
    def _check_group(group: str) -> None:
        if group not in PLUGIN_GROUPS:
            raise PluginError(f"unknown plugin group {group!r}", group=group, name="")


class NameRegistry(PluginRegistry):
    """Answers :meth:`load` by name alone and imports nothing: what the gunicorn master
    checks a config with, before workers that import the plugins once gevent has patched
    the standard library (a module the master imported first would keep the unpatched
    one). An unknown name is the same error as :class:`PluginRegistry`'s."""

    def load(self, group: str, name: str) -> type:
        if name not in self.names(group):
            raise PluginError(self.unknown_message(group, name), group=group, name=name)
        return object
