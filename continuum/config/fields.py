"""The machinery behind the config table: typed, documented, range-checked fields.

A config section is a frozen dataclass whose fields are declared with :func:`setting`;
the same declarations drive loading, validation, ``config defaults`` and hot-reload
classification. Nothing here knows about particular sections.
"""

from __future__ import annotations

import dataclasses
import difflib
import os
import re
import types
import typing
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, Union

from continuum.config.addresses import redact_url
from continuum.errors import ConfigIssue

_DURATION = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*(ms|s|m|h|d)?\s*$")
_UNITS = {"ms": 0.001, "s": 1.0, "m": 60.0, "h": 3600.0, "d": 86400.0, None: 1.0}


def parse_duration(value: Any) -> float:
    """``"5m"`` → 300.0; numbers are seconds. Raises ValueError on anything else."""
    if isinstance(value, bool):
        raise ValueError("expected a duration such as '30s' or '5m'")
    if isinstance(value, (int, float)):
        return float(value)
    if isinstance(value, str):
        match = _DURATION.match(value)
        if match:
            return float(match.group(1)) * _UNITS[match.group(2)]
    raise ValueError("expected a duration such as '30s', '5m' or a number of seconds")


def format_duration(seconds: float) -> str:
    """300.0 → ``"5m"``: the inverse of :func:`parse_duration` for round values."""
    if seconds == 0:
        return "0s"
    for unit, size in (("d", 86400), ("h", 3600), ("m", 60), ("s", 1)):
        if seconds >= size and seconds % size == 0:
            return f"{int(seconds // size)}{unit}"
    return f"{int(seconds * 1000)}ms"


def setting(
    default: Any = dataclasses.MISSING,
    *,
    doc: str,
    min: float | None = None,
    max: float | None = None,
    choices: tuple[Any, ...] | None = None,
    pattern: str | None = None,
    duration: bool = False,
    restart: bool = False,
    secret: bool = False,
    credentials: bool = False,
    env_var: bool = False,
    default_factory: Callable[[], Any] | None = None,
) -> Any:
    """Declare one config key.

    Args:
        default: the seed's default; omit for a required key.
        doc: one line for ``config defaults`` and the docs.
        min, max: inclusive numeric range.
        choices: allowed values.
        pattern: regular expression a string must match in full.
        duration: accept ``"30s"``/``"5m"`` strings; stored as float seconds.
        restart: changing this key on hot reload needs a restart.
        secret: never printed (errors show ``<redacted str>``; left out of ``repr``).
        credentials: a URL whose ``user:password@`` part (and password-like query
            parameters) are secret: printed only through :func:`redact_url`.
        env_var: names an environment variable holding a secret; printed only when it
            looks like a variable name (a secret pasted here by mistake is not).
    """
    meta = {
        "doc": doc,
        "min": min,
        "max": max,
        "choices": choices,
        "pattern": re.compile(pattern) if pattern else None,
        "duration": duration,
        "restart": restart,
        "secret": secret,
        "credentials": credentials,
        "env_var": env_var,
    }
    shown = not (secret or credentials)
    if default_factory is not None:
        return dataclasses.field(default_factory=default_factory, metadata=meta, repr=shown)
    return dataclasses.field(default=default, metadata=meta, repr=shown)


_ENV_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]{0,127}")


class Redacted:
    """Stands in for a secret value wherever it would be printed: only its type shows."""

    __slots__ = ("kind",)

    def __init__(self, value: Any) -> None:
        self.kind = type(value).__name__

    def __repr__(self) -> str:
        return f"<redacted {self.kind}>"


def redacted(value: Any, meta: dict[str, Any] | None) -> Any:
    """``value`` as it may be printed, per its field's ``secret``, ``credentials`` and
    ``env_var`` flags (``meta``: the field's metadata, or None for no field)."""
    if value is None or not meta or isinstance(value, Redacted):
        return value
    if meta.get("secret"):
        return Redacted(value)
    if meta.get("credentials") and isinstance(value, str):
        return redact_url(value)
    if meta.get("env_var") and not (isinstance(value, str) and _ENV_NAME.fullmatch(value)):
        return Redacted(value)
    return value


class Issues:
    """Collects errors and warnings while a config is read, each with its key path."""

    def __init__(self) -> None:
        self.errors: list[ConfigIssue] = []
        self.warnings: list[ConfigIssue] = []

    def redact(self, root: type) -> None:
        """Hide the value of every issue whose key path is a secret field of ``root`` (or a
        URL with credentials), whichever ``check`` or reader recorded it."""
        for issue in (*self.errors, *self.warnings):
            issue.value = redacted(issue.value, meta_at(root, issue.path))

    def error(self, path: str, message: str, value: Any = None) -> None:
        self.errors.append(ConfigIssue(path, message, value))

    def warn(self, path: str, message: str, value: Any = None) -> None:
        self.warnings.append(ConfigIssue(path, message, value))


def from_env(literal: str | None, env_name: str | None) -> str | None:
    """A value given literally or through an environment variable (read now); None when
    neither is set or the variable is missing or empty."""
    if literal is not None:
        return literal
    if env_name:
        return os.environ.get(env_name) or None
    return None


def secret_from_file_or_env(file: str | None, env_name: str | None) -> str | None:
    """A secret read now from ``file`` (surrounding whitespace stripped) or from the
    environment variable ``env_name``; None when neither is set, or it is unreadable or
    empty (:func:`check_secret_source` reports those at config load)."""
    if file:
        try:
            return Path(file).read_text(encoding="utf-8").strip() or None
        except (OSError, UnicodeDecodeError):
            return None
    if env_name:
        return os.environ.get(env_name, "").strip() or None
    return None


def check_secret_source(path: str, issues: Issues, key: str, *, inline: str | None,
                        file: str | None, env_name: str | None) -> None:
    """Errors for a secret that may only come from ``<key>_file`` or ``<key>_env``.

    ``<key>`` itself (``inline``) is refused: a secret written into the config file ends up
    in backups, diffs and ``config`` output. Also refused: both sources at once, a file
    that cannot be read or is empty, an unset variable, and a value that cannot travel in
    an HTTP header (whitespace, control or non-ASCII characters).
    """
    file_key, env_key = f"{key}_file", f"{key}_env"
    if inline is not None:
        issues.error(join(path, key), f"is never read from the config file: put the secret "
                     f"in a file ({file_key}) or an environment variable ({env_key})")
    if file is not None and env_name is not None:
        issues.error(join(path, env_key), f"set either {file_key} or {env_key}, not both")
        return
    if file is not None:
        where = join(path, file_key)
        try:
            value = Path(file).read_text(encoding="utf-8").strip()
        except OSError as exc:
            issues.error(where, f"cannot read the file: {exc.strerror or exc}", file)
            return
        except UnicodeDecodeError:
            issues.error(where, "the file is not UTF-8 text", file)
            return
    elif env_name is not None:
        where, value = join(path, env_key), os.environ.get(env_name, "").strip()
        if not value:
            issues.error(where, "environment variable is not set or empty", env_name)
            return
    else:
        return
    if not value:
        issues.error(where, "the file is empty", file)
    elif not (value.isascii() and value.isprintable()) or any(ch.isspace() for ch in value):
        issues.error(where, "the secret must be printable ASCII without spaces")


def join(path: str, key: str) -> str:
    return f"{path}.{key}" if path else key


_INDEX = re.compile(r"\[\d+\]")


def meta_at(root: type, path: str) -> dict[str, Any] | None:
    """The field metadata of key path ``path`` (``backends[0].api_key``) in config class
    ``root``, or None when the path names no field."""
    cls: type | None = root
    meta: dict[str, Any] | None = None
    for name in _INDEX.sub("", path).split("."):
        if cls is None:
            return None
        found = {f.name: f for f in dataclasses.fields(cls)}.get(name)
        if found is None:
            return None
        meta = dict(found.metadata)
        cls = _section_type(cls, name)
    return meta


_HINTS: dict[type, dict[str, Any]] = {}


def hints(cls: type) -> dict[str, Any]:
    """Resolved type hints of a section class (cached)."""
    cached = _HINTS.get(cls)
    if cached is None:
        cached = _HINTS[cls] = typing.get_type_hints(cls)
    return cached


def _is_section(tp: Any) -> bool:
    return isinstance(tp, type) and dataclasses.is_dataclass(tp)


def _unwrap_optional(tp: Any) -> tuple[Any, bool]:
    origin = typing.get_origin(tp)
    if origin in (Union, types.UnionType):
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        if len(args) == 1 and len(typing.get_args(tp)) == 2:
            return args[0], True
    return tp, False


_TYPE_NAMES = {bool: "a boolean", int: "an integer", float: "a number", str: "a string"}


def describe_type(value: Any) -> str:
    """``"a string"``, ``"a list"`` …: what a value is, without printing it."""
    if isinstance(value, dict):
        return "a mapping"
    if isinstance(value, list):
        return "a list"
    return _TYPE_NAMES.get(type(value), type(value).__name__)


def _coerce_scalar(tp: Any, value: Any, meta: dict[str, Any]) -> Any:
    if meta.get("duration"):
        return parse_duration(value)
    if tp is bool:
        if isinstance(value, bool):
            return value
    elif tp is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
    elif tp is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
    elif tp is str:
        if isinstance(value, str):
            return value
    else:  # pragma: no cover - a declaration bug, not a user error
        raise TypeError(f"unsupported config type {tp!r}")
    raise ValueError(f"expected {_TYPE_NAMES[tp]}")


def _num(x: float) -> str:
    return str(int(x)) if float(x).is_integer() else f"{x:g}"


def _check_constraints(value: Any, meta: dict[str, Any]) -> str | None:
    lo, hi = meta.get("min"), meta.get("max")
    if lo is not None and hi is not None and not lo <= value <= hi:
        return f"must be between {_num(lo)} and {_num(hi)}"
    if lo is not None and value < lo:
        return f"must be at least {_num(lo)}"
    if hi is not None and value > hi:
        return f"must be at most {_num(hi)}"
    choices = meta.get("choices")
    if choices is not None and value not in choices:
        return "must be one of " + ", ".join(repr(c) for c in choices)
    pattern = meta.get("pattern")
    if pattern is not None and not pattern.fullmatch(value):
        return f"must match {pattern.pattern}"
    return None


def build_section(cls: type, data: Any, path: str, issues: Issues) -> Any:
    """Read ``data`` (a mapping from YAML) into an instance of section ``cls``.

    Every problem is recorded in ``issues`` and reading goes on, so that one pass reports
    everything; the returned section is only meaningful when no error was recorded.
    """
    if data is None:
        data = {}
    if not isinstance(data, dict):
        issues.error(path or "<root>", f"expected a mapping (got {describe_type(data)})")
        data = {}
    fields = {f.name: f for f in dataclasses.fields(cls)}
    for key in data:
        if key not in fields:
            close = difflib.get_close_matches(str(key), list(fields), n=1, cutoff=0.6)
            hint = f"; did you mean {close[0]!r}?" if close else ""
            issues.error(join(path, str(key)), f"unknown key{hint}")
    values: dict[str, Any] = {}
    types_ = hints(cls)
    for name, f in fields.items():
        key_path = join(path, name)
        if name not in data:
            if _is_section(types_[name]):  # defaults get their cross-field checks too
                values[name] = build_section(types_[name], {}, key_path, issues)
            elif f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING:
                issues.error(key_path, "is required")
            continue
        values[name] = read_value(types_[name], data[name], key_path, dict(f.metadata), issues)
    try:
        section = cls(**values)
    except TypeError:  # a required field was missing; an error is already recorded
        section = None
    check = getattr(cls, "check", None)
    # A section's own checks read its fields as declared: one whose value was refused
    # (None where the type has no None, in a field or a list item) already has its error,
    # and the checks that need it would trip over the None (`config defaults` prints
    # ``url: null`` for the backend to fill in).
    if section is not None and check is not None and not _has_refused(values, types_):
        check(section, path, issues)
    return section


def _has_refused(values: dict[str, Any], types_: dict[str, Any]) -> bool:
    """Whether a value in ``values``, or in a section or list below it, is None where its
    declared type does not allow it."""
    for name, value in values.items():
        tp, optional = _unwrap_optional(types_[name])
        if value is None:
            if not optional:
                return True
        elif isinstance(value, tuple) and typing.get_origin(tp) in (tuple, list):
            item_type, item_optional = _unwrap_optional((typing.get_args(tp) or (Any,))[0])
            for item in value:
                if item is None:
                    if not item_optional:
                        return True
                elif _is_section(item_type) and section_refused(item):
                    return True
        elif _is_section(tp) and section_refused(value):
            return True
    return False


def section_refused(section: Any) -> bool:
    """Whether a value anywhere in ``section`` was refused (None where its type has none)."""
    return _has_refused({f.name: getattr(section, f.name) for f in dataclasses.fields(section)},
                        hints(type(section)))


def read_value(tp: Any, value: Any, path: str, meta: dict[str, Any], issues: Issues) -> Any:
    """Read one value of declared type ``tp`` at ``path``."""
    tp, optional = _unwrap_optional(tp)
    if value is None:
        if optional:
            return None
        issues.error(path, "must not be empty")
        return None
    if _is_section(tp):
        return build_section(tp, value, path, issues)
    origin = typing.get_origin(tp)
    if origin in (tuple, list):
        (item_type, *_rest) = typing.get_args(tp)
        if not isinstance(value, list):
            issues.error(path, f"expected a list (got {describe_type(value)})")
            return ()
        return tuple(
            read_value(item_type, item, f"{path}[{i}]", meta, issues)
            for i, item in enumerate(value)
        )
    try:
        coerced = _coerce_scalar(tp, value, meta)
    except ValueError as exc:
        issues.error(path, str(exc), redacted(value, meta))
        return None
    problem = _check_constraints(coerced, meta)
    if problem:
        issues.error(path, problem, redacted(value, meta))
    return coerced


def keep_restart_fields(running: Any, loaded: Any) -> Any:
    """``loaded`` with every restart-only key (and every list of sections, such as
    ``backends``) taken from ``running``: the config a worker really runs after a reload."""
    changes: dict[str, Any] = {}
    for f in dataclasses.fields(loaded):
        old, new = getattr(running, f.name), getattr(loaded, f.name)
        if old == new:
            continue
        if f.metadata.get("restart") or (isinstance(new, tuple) and new
                                         and dataclasses.is_dataclass(new[0])):
            changes[f.name] = old
        elif dataclasses.is_dataclass(new) and not isinstance(new, type):
            changes[f.name] = keep_restart_fields(old, new)
    return dataclasses.replace(loaded, **changes) if changes else loaded


def walk(section: Any, path: str = "") -> Iterator[tuple[str, dataclasses.Field[Any], Any]]:
    """Yield ``(path, field, value)`` for every leaf of a section instance, depth first."""
    for f in dataclasses.fields(section):
        value = getattr(section, f.name)
        key_path = join(path, f.name)
        if dataclasses.is_dataclass(value) and not isinstance(value, type):
            yield from walk(value, key_path)
        elif isinstance(value, tuple) and value and dataclasses.is_dataclass(value[0]):
            for i, item in enumerate(value):
                yield from walk(item, f"{key_path}[{i}]")
        else:
            yield key_path, f, value


def _render(value: Any, meta: dict[str, Any]) -> str:
    value = redacted(value, meta)
    if isinstance(value, Redacted):
        return '"<redacted>"'
    if meta.get("duration") and isinstance(value, float):
        return f'"{format_duration(value)}"'
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, tuple):
        return "[" + ", ".join(_render(item, meta) for item in value) + "]"
    if isinstance(value, str):
        return '""' if value == "" else repr(value).replace("'", '"')
    return str(value)


def _limits(meta: dict[str, Any]) -> str:
    parts = []
    if meta.get("min") is not None or meta.get("max") is not None:
        parts.append(f"range {_num(meta['min']) if meta.get('min') is not None else ''}.."
                     f"{_num(meta['max']) if meta.get('max') is not None else ''}")
    if meta.get("choices"):
        parts.append("one of " + "|".join(str(c) for c in meta["choices"]))
    if meta.get("pattern") is not None:
        parts.append(f"matches {meta['pattern'].pattern}")
    if meta.get("secret"):
        parts.append("secret: never printed")
    elif meta.get("credentials"):
        parts.append("a password in it is never printed")
    if meta.get("restart"):
        parts.append("restart to change")
    return f" [{'; '.join(parts)}]" if parts else ""


def _section_type(cls: type, name: str) -> type | None:
    tp, _optional = _unwrap_optional(hints(cls)[name])
    if _is_section(tp):
        return tp  # type: ignore[no-any-return]
    args = typing.get_args(tp)
    if args and _is_section(args[0]):
        return args[0]  # type: ignore[no-any-return]
    return None


def defaults_text(root: type) -> str:
    """Every key of config class ``root`` with its default, range and meaning, as
    commented YAML (``continuum-router config defaults``, ``--print-defaults``)."""
    lines: list[str] = []

    def section(cls: type, indent: str) -> None:
        for f in dataclasses.fields(cls):
            meta = dict(f.metadata)
            sub = _section_type(cls, f.name)
            lines.append(f"{indent}# {meta.get('doc', '')}{_limits(meta)}")
            if sub is not None and f.default_factory is tuple:  # a list of sections
                lines.append(f"{indent}{f.name}:")
                lines.append(f"{indent}  - # one entry per item:")
                section(sub, indent + "    ")
            elif sub is not None:
                lines.append(f"{indent}{f.name}:")
                section(sub, indent + "  ")
            elif f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING:
                lines.append(f"{indent}{f.name}:  # required")
            else:
                factory: Any = f.default_factory
                default = factory() if f.default is dataclasses.MISSING else f.default
                lines.append(f"{indent}{f.name}: {_render(default, meta)}")

    section(root, "")
    return "\n".join(lines) + "\n"
