"""The import structure of the four packages: the contracts hold, breaking one is caught.

The contracts live in ``.importlinter`` and ``tox -e lint`` checks them with ``lint-imports``;
this module checks them too, so that the README's test command (which is CI) does:

* every contract is kept by the tree as it is;
* a deliberately wrong import in a copy of the tree breaks the contract it should, and
  import-linter's report names that import with its line;
* no module imports itself back through a circle of runtime imports (``TYPE_CHECKING``
  imports are annotations only and do not count);
* every runtime dependency declared in ``setup.cfg`` is imported by the packages (a declared
  but unused dependency is dead weight in every install).
"""

from __future__ import annotations

import configparser
import os
import re
import shutil
import subprocess
import sys
from collections.abc import Iterable
from importlib import metadata
from pathlib import Path

import grimp
import pytest

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("continuum", "stores", "strategies", "listener")
CONFIG = ROOT / ".importlinter"

# lint-imports, run by this interpreter (its console script may not be on PATH). Rich and
# click both honour COLUMNS: wide enough that no contract name is wrapped.
_LINT = "from importlinter.cli import lint_imports_command; lint_imports_command()"


def contract_names() -> dict[str, str]:
    """``{contract id: name}`` from ``.importlinter``."""
    parser = configparser.ConfigParser(interpolation=None)
    parser.read(CONFIG)
    prefix = "importlinter:contract:"
    return {section[len(prefix):]: parser[section]["name"]
            for section in parser.sections() if section.startswith(prefix)}


def lint_imports(tree: Path) -> subprocess.CompletedProcess[str]:
    """Run ``lint-imports`` on the packages under ``tree`` (its cwd, first on ``sys.path``)."""
    env = {**os.environ, "COLUMNS": "250", "NO_COLOR": "1", "TERM": "dumb"}
    env.pop("PYTHONPATH", None)
    return subprocess.run([sys.executable, "-c", _LINT, "--no-cache"], cwd=tree, env=env,
                          capture_output=True, text=True, timeout=120, check=False)


def verdicts(output: str) -> dict[str, str]:
    """``{contract name: "KEPT" | "BROKEN"}`` from a lint-imports report."""
    found: dict[str, str] = {}
    for name in contract_names().values():
        match = re.search(re.escape(name) + r" (KEPT|BROKEN)\b", output)
        if match:
            found[name] = match.group(1)
    return found


def import_cycles(graph: grimp.ImportGraph) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan, iteratively).

    Each is a set of modules that import each other in a circle; a self-import is not
    counted. Components and their members come back sorted.
    """
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    # The depth-first path: each module with the imports it has still to visit.
    path: list[tuple[str, list[str]]] = []
    cycles: list[list[str]] = []

    def enter(module: str) -> None:
        index[module] = low[module] = len(index)
        stack.append(module)
        on_stack.add(module)
        path.append((module, sorted(graph.find_modules_directly_imported_by(module))))

    for root in sorted(graph.modules):
        if root in index:
            continue
        enter(root)
        while path:
            module, pending = path[-1]
            if pending:
                imported = pending.pop()
                if imported not in index:
                    enter(imported)
                elif imported in on_stack:
                    low[module] = min(low[module], index[imported])
                continue
            path.pop()
            if path:
                parent = path[-1][0]
                low[parent] = min(low[parent], low[module])
            if low[module] == index[module]:
                component: list[str] = []
                while not component or component[-1] != module:
                    component.append(stack.pop())
                    on_stack.discard(component[-1])
                if len(component) > 1:
                    cycles.append(sorted(component))
    return sorted(cycles)


def describe(graph: grimp.ImportGraph, cycle: Iterable[str]) -> str:
    """Every import between the members of ``cycle``, with its line: what to break."""
    members = set(cycle)
    lines = []
    for importer in sorted(members):
        for imported in sorted(graph.find_modules_directly_imported_by(importer) & members):
            for detail in graph.get_import_details(importer=importer, imported=imported):
                lines.append(f"  {importer} -> {imported} (l.{detail['line_number']}: "
                             f"{detail['line_contents']})")
    return "\n".join(lines)


def copy_tree(dest: Path) -> Path:
    """The four packages and ``.importlinter`` copied under ``dest``."""
    for package in PACKAGES:
        shutil.copytree(ROOT / package, dest / package,
                        ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
    shutil.copy2(CONFIG, dest / CONFIG.name)
    return dest


def add_import(tree: Path, module: str, statement: str) -> int:
    """Append ``statement`` to ``module``'s file in ``tree``; return its line number."""
    path = tree / (module.replace(".", "/") + ".py")
    if not path.exists():
        path = tree / module.replace(".", "/") / "__init__.py"
    text = path.read_text()
    if not text.endswith("\n"):
        text += "\n"
    path.write_text(text + statement + "  # deliberately wrong\n")
    return text.count("\n") + 1


def test_every_contract_is_kept() -> None:
    names = contract_names()
    assert {"layers", "core-names-no-plugin", "listener-low-level-only",
            "listener-reaches-no-router-code", "no-cycles"} <= set(names)
    result = lint_imports(ROOT)
    report = result.stdout + result.stderr
    assert verdicts(report) == dict.fromkeys(names.values(), "KEPT"), report
    assert result.returncode == 0, report
    assert f"Contracts: {len(names)} kept, 0 broken." in report


# case: (contract id, the wrong imports to add as (module, statement), a regular expression
# the broken contract's section of the report must match; LINE stands for the number of the
# first added line)
WRONG_IMPORTS = {
    "bottom-imports-the-service": (
        "layers", [("continuum.errors", "import continuum.service")],
        r"continuum\.errors -> continuum\.service \(l\.LINE\)"),
    "tier-imports-the-web": (
        "layers", [("continuum.caching.cache_key", "from continuum.web import app")],
        r"continuum\.caching\.cache_key -> continuum\.web\.app \(l\.LINE\)"),
    "tiers-import-each-other": (
        "layers", [("continuum.kv.scorer", "import continuum.routing.hashring")],
        r"continuum\.kv\.scorer -> continuum\.routing\.hashring \(l\.LINE\)"),
    "core-names-a-plugin": (
        "core-names-no-plugin", [("continuum.routing.hashring", "import stores.memory")],
        r"continuum\.routing\.hashring -> stores\.memory \(l\.LINE\)"),
    "listener-imports-routing": (
        "listener-low-level-only",
        [("listener.model", "from continuum.routing import backends")],
        r"listener\.model -> continuum\.routing\.backends \(l\.LINE\)"),
    "listener-reaches-the-service-through-errors": (
        "listener-reaches-no-router-code", [("continuum.errors", "import continuum.service")],
        r"continuum\.errors -> continuum\.service \(l\.LINE\)"),
    "plugin-imports-the-service": (
        "plugins-public-core-only", [("strategies.round_robin", "import continuum.service")],
        r"strategies\.round_robin -> continuum\.service \(l\.LINE\)"),
    "two-siblings-in-a-circle": (
        "no-cycles", [("continuum.prefix", "import continuum.cache_salt"),
                      ("continuum.cache_salt", "import continuum.prefix")],
        r"No cycles are allowed in continuum\.\n(?:.*\n){1,3}- \.(prefix -> \.cache_salt"
        r"|cache_salt -> \.prefix) \(1 import\)"),
}


@pytest.mark.parametrize("case", sorted(WRONG_IMPORTS))
def test_a_wrong_import_breaks_its_contract(case: str, tmp_path: Path) -> None:
    contract, additions, pattern = WRONG_IMPORTS[case]
    tree = copy_tree(tmp_path)
    lines = [add_import(tree, module, statement) for module, statement in additions]
    result = lint_imports(tree)
    report = result.stdout + result.stderr
    name = contract_names()[contract]
    assert result.returncode == 1, report
    assert verdicts(report)[name] == "BROKEN", report
    section = report[report.index(f"{name}\n---"):]
    assert re.search(pattern.replace("LINE", str(lines[0])), section), section


def test_no_runtime_import_cycles() -> None:
    graph = grimp.build_graph(*PACKAGES, exclude_type_checking_imports=True, cache_dir=None)
    cycles = import_cycles(graph)
    assert not cycles, "\n".join(f"import cycle {' <-> '.join(c)}:\n{describe(graph, c)}"
                                 for c in cycles)


def test_cycle_finder_counts_lazy_imports_but_not_type_checking_ones(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    package = tmp_path / "layering_probe"
    package.mkdir()
    (package / "__init__.py").write_text("")
    # a -> b at import time, b -> a inside a function: a runtime circle.
    (package / "a.py").write_text("from layering_probe import b\n")
    (package / "b.py").write_text("def f():\n    from layering_probe import a\n    return a\n")
    # c -> d, d -> c only under TYPE_CHECKING: annotations, no circle at run time.
    (package / "c.py").write_text("from layering_probe import d\n")
    (package / "d.py").write_text("from typing import TYPE_CHECKING\n"
                                  "if TYPE_CHECKING:\n    from layering_probe import c\n")
    # e -> f -> g -> e: a longer circle.
    for here, there in (("e", "f"), ("f", "g"), ("g", "e")):
        (package / f"{here}.py").write_text(f"import layering_probe.{there}\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    graph = grimp.build_graph("layering_probe", exclude_type_checking_imports=True,
                              cache_dir=None)
    cycles = import_cycles(graph)
    assert cycles == [["layering_probe.a", "layering_probe.b"],
                      ["layering_probe.e", "layering_probe.f", "layering_probe.g"]]
    assert "layering_probe.b -> layering_probe.a (l.2: from layering_probe import a)" in (
        describe(graph, cycles[0]))


def _normalize(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def declared_requirements() -> list[str]:
    """The distribution names in ``setup.cfg``'s ``install_requires``."""
    parser = configparser.ConfigParser(interpolation=None)
    parser.read(ROOT / "setup.cfg")
    names = []
    for line in parser["options"]["install_requires"].splitlines():
        line = line.split("#", 1)[0].strip()
        match = re.match(r"[A-Za-z0-9][A-Za-z0-9._-]*", line)
        if match:
            names.append(match.group(0))
    return names


def _top_level_modules() -> dict[str, set[str]]:
    """Each installed distribution's top-level modules, by normalized name: its
    ``top_level.txt``, else the first part of the paths it installed (what
    ``packages_distributions`` does from Python 3.11 on; 3.10's reads ``top_level.txt``
    only, which the wheels of redis and pyzmq do not have)."""
    provided_by: dict[str, set[str]] = {}
    for dist in metadata.distributions():
        names = set((dist.read_text("top_level.txt") or "").split())
        if not names:
            for path in dist.files or ():
                first = path.parts[0]
                if first.endswith((".dist-info", ".egg-info")) or first.startswith(".."):
                    continue
                if len(path.parts) > 1 or first.endswith(".py"):
                    names.add(first.removesuffix(".py"))
        provided_by.setdefault(_normalize(dist.metadata["Name"]), set()).update(names)
    return provided_by


def test_every_declared_runtime_dependency_is_imported() -> None:
    graph = grimp.build_graph(*PACKAGES, include_external_packages=True,
                              exclude_type_checking_imports=True, cache_dir=None)
    imported = {module for module in graph.modules if module.split(".")[0] not in PACKAGES}
    provided_by = _top_level_modules()
    declared = declared_requirements()
    assert "falcon" in declared and "gunicorn" in declared
    unused = {name: sorted(provided_by.get(_normalize(name), set()))
              for name in declared if not provided_by.get(_normalize(name), set()) & imported}
    assert not unused, f"declared in setup.cfg but never imported: {unused}"
