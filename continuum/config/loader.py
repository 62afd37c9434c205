"""The one YAML reader of config files, shared by the router and the listener.

PyYAML alone loses two things a config check needs: where each key is (so a schema error
can say ``file:line:column``, not only the key path) and duplicate keys (it silently keeps
the last, so ``workers: 2`` followed by ``workers: 3`` would quietly mean 3). This module
composes the node tree, indexes every key path with its position, reports duplicates, and
only then builds the plain Python document.

Messages never quote the file's text: PyYAML's own error strings include the offending
line, which may hold a secret, so only the problem and its position are kept.
"""

from __future__ import annotations

import os
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from continuum.errors import ConfigError, ConfigIssue

_MERGE_TAG = "tag:yaml.org,2002:merge"


@dataclass
class YamlDocument:
    """A parsed config file: its data, where each key path starts, and duplicate keys."""

    data: Any
    marks: dict[str, str] = field(default_factory=dict)  # key path -> "line:column"
    duplicates: list[ConfigIssue] = field(default_factory=list)

    def annotate(self, errors: list[ConfigIssue], warnings: list[ConfigIssue]
                 ) -> list[ConfigIssue]:
        """Every error of the file, duplicate keys first, each issue with its position."""
        errors = [*self.duplicates, *errors]
        self.locate([*errors, *warnings])
        return errors

    def locate(self, issues: Iterable[ConfigIssue]) -> None:
        """Give each issue the position of its key path, or of its nearest ancestor in the
        file (a missing key is reported where its section starts)."""
        for issue in issues:
            if issue.location is not None:
                continue
            path: str | None = issue.path
            while path:
                if path in self.marks:
                    issue.location = self.marks[path]
                    break
                path = parent_path(path)


def parent_path(path: str) -> str | None:
    """``a.b[2]`` → ``a.b`` → ``a`` → None."""
    if path.endswith("]") and "[" in path:
        return path[:path.rindex("[")]
    if "." in path:
        return path[:path.rindex(".")]
    return None


def _where(mark: Any) -> str:
    return f"{mark.line + 1}:{mark.column + 1}"


def _yaml_issue(exc: yaml.YAMLError) -> ConfigIssue:
    """A YAML syntax error without PyYAML's quoted snippet of the offending line."""
    if isinstance(exc, yaml.MarkedYAMLError):
        text = "; ".join(part for part in (exc.context, exc.problem) if part) or "syntax error"
        mark = exc.problem_mark or exc.context_mark
        return ConfigIssue("<document>", f"invalid YAML: {text}",
                           location=_where(mark) if mark is not None else None)
    return ConfigIssue("<document>", f"invalid YAML: {type(exc).__name__}")


class _Indexer:
    """Walks a composed node tree once, recording key positions and duplicate keys."""

    def __init__(self, loader: yaml.SafeLoader, doc: YamlDocument) -> None:
        self.loader = loader
        self.doc = doc
        self.seen: set[int] = set()  # aliases share nodes: index each node once

    def walk(self, node: yaml.Node, path: str) -> None:
        if id(node) in self.seen:
            return
        self.seen.add(id(node))
        if isinstance(node, yaml.MappingNode):
            self._mapping(node, path)
        elif isinstance(node, yaml.SequenceNode):
            for i, item in enumerate(node.value):
                item_path = f"{path}[{i}]"
                self.doc.marks.setdefault(item_path, _where(item.start_mark))
                self.walk(item, item_path)

    def _mapping(self, node: yaml.MappingNode, path: str) -> None:
        first: dict[Any, Any] = {}
        for key_node, value_node in node.value:
            if key_node.tag == _MERGE_TAG:  # "<<: *base": later explicit keys override it
                merged = value_node.value if isinstance(value_node, yaml.SequenceNode) \
                    else [value_node]
                for item in merged:
                    self.walk(item, path)
                continue
            if not isinstance(key_node, yaml.ScalarNode):
                continue  # a complex key; the schema reports it as an unknown key
            key = self.loader.construct_object(key_node)
            key_path = f"{path}.{key}" if path else str(key)
            try:
                previous = first.setdefault(key, key_node)
            except TypeError:  # an unhashable key cannot be a config key anyway
                continue
            if previous is not key_node:
                self.doc.duplicates.append(ConfigIssue(
                    key_path, f"duplicate key (first set at line "
                    f"{previous.start_mark.line + 1}); remove one of them",
                    location=_where(key_node.start_mark)))
                # YAML keeps the last value: errors in it are reported where it is written.
                marks = self.doc.marks
                for stale in [p for p in marks if p == key_path
                              or p.startswith((f"{key_path}.", f"{key_path}["))]:
                    del marks[stale]
            self.doc.marks[key_path] = _where(key_node.start_mark)
            self.walk(value_node, key_path)


def parse_yaml(text: str, source: str = "<config>") -> YamlDocument:
    """Parse one YAML document; an empty one is ``{}``.

    Raises:
        ConfigError: the text is not valid YAML (with line and column, never a snippet).
    """
    loader = yaml.SafeLoader(text)
    try:
        node = loader.get_single_node()
        doc = YamlDocument({})
        if node is not None:
            _Indexer(loader, doc).walk(node, "")
            doc.data = loader.construct_document(node)
        if doc.data is None:
            doc.data = {}
        return doc
    except yaml.YAMLError as exc:
        raise ConfigError([_yaml_issue(exc)], source) from None
    finally:
        loader.dispose()


def read_yaml(path: str | os.PathLike[str]) -> YamlDocument:
    """Read and parse a config file.

    Raises:
        ConfigError: the file cannot be read, is not UTF-8, or is not valid YAML.
    """
    try:
        text = Path(path).read_text(encoding="utf-8")
    except OSError as exc:
        raise ConfigError([ConfigIssue("<file>", f"cannot read: {exc.strerror or exc}")],
                          str(path)) from None
    except UnicodeDecodeError as exc:
        raise ConfigError([ConfigIssue("<file>", f"not UTF-8 text (byte {exc.start})")],
                          str(path)) from None
    return parse_yaml(text, str(path))
