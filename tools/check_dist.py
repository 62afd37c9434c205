"""Build the wheel, install it in a fresh venv, and check what a user would get.

Usage: ``python tools/check_dist.py [--wheel PATH] [--keep]``

Checks (every failure is listed; exit 0 when all pass, 1 otherwise, 2 when the wheel or the
venv cannot be made):

* the wheel's top-level packages are exactly :data:`EXPECTED_TOP_LEVEL` (no ``tests`` or
  ``tools``), from its RECORD and its ``top_level.txt``;
* ``continuum/py.typed`` is in the wheel, and so is ``LICENSE`` (in its ``.dist-info``);
* the console scripts are exactly :data:`EXPECTED_CONSOLE_SCRIPTS`;
* the installed distribution's entry points (every group, name and target) are those of
  ``setup.cfg``'s ``[options.entry_points]``, and every target imports;
* in the venv, ``continuum`` is imported from the venv (not this checkout), its version is
  ``continuum.__version__`` of the source, ``continuum-router config defaults`` runs, and
  each console script's ``--version`` prints ``<script> <version>``.

The source tree is copied to a temp dir before building so the build leaves nothing behind
in the checkout. Installing the wheel's dependencies uses pip's configured index and cache.
"""

from __future__ import annotations

import argparse
import configparser
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
DIST_NAME = "continuum-router"

#: Update these when packages or console scripts are added (e.g. continuum-kv-listener).
EXPECTED_TOP_LEVEL = frozenset({"continuum", "stores", "strategies", "listener"})
EXPECTED_CONSOLE_SCRIPTS = frozenset({"continuum-router", "continuum-sim", "continuum-kv-listener"})
REQUIRED_FILES = ("continuum/py.typed",)
#: Never to be packaged.
FORBIDDEN_TOP_LEVEL = frozenset({"tests", "tools", "conf", "docs", "build"})

_COPY_IGNORE = shutil.ignore_patterns(
    ".git", "build", "dist", "*.egg-info", "__pycache__", "*.pyc", ".tox", ".venv", "venv",
    ".mypy_cache", ".pytest_cache", ".ruff_cache", ".hypothesis",
)

# Run by the venv's python: the installed distribution's entry points and where continuum is.
_PROBE = r"""
import importlib, json, sys
from importlib import metadata
dist = metadata.distribution(sys.argv[1])
eps = {}
for ep in dist.entry_points:
    eps.setdefault(ep.group, {})[ep.name] = ep.value
failed = {}
for ep in dist.entry_points:
    try:
        ep.load()
    except Exception as exc:  # report every broken target
        failed[f"{ep.group}:{ep.name}"] = f"{type(exc).__name__}: {exc}"
import continuum
print(json.dumps({"version": dist.version, "entry_points": eps, "load_errors": failed,
                  "continuum_file": continuum.__file__}))
"""


class DistError(Exception):
    """The wheel or the venv could not be made."""


class Checks:
    """Collects pass/fail lines."""

    def __init__(self) -> None:
        self.failures: list[str] = []

    def check(self, ok: bool, what: str, detail: str = "") -> None:
        print(f"  [{'ok' if ok else 'FAIL'}] {what}" + (f": {detail}" if detail and not ok else ""))
        if not ok:
            self.failures.append(what + (f": {detail}" if detail else ""))


def run(argv: list[str], cwd: Path, env: dict[str, str] | None = None,
        timeout: float = 900) -> subprocess.CompletedProcess[str]:
    return subprocess.run(argv, cwd=str(cwd), env=env, capture_output=True, text=True,
                          timeout=timeout, check=False)


def clean_env() -> dict[str, str]:
    """The environment without anything that would put this checkout on the path."""
    env = dict(os.environ)
    for name in ("PYTHONPATH", "PYTHONHOME", "PYTHONSTARTUP", "VIRTUAL_ENV", "PYTHONNOUSERSITE"):
        env.pop(name, None)
    env["PYTHONNOUSERSITE"] = "1"
    return env


def source_version() -> str:
    text = (ROOT / "continuum" / "__init__.py").read_text()
    match = re.search(r'^__version__\s*=\s*["\']([^"\']+)["\']', text, re.M)
    if not match:
        raise DistError("cannot read __version__ from continuum/__init__.py")
    return match.group(1)


def setup_cfg_entry_points() -> dict[str, dict[str, str]]:
    """``[options.entry_points]`` of setup.cfg as {group: {name: target}}."""
    cfg = configparser.ConfigParser(interpolation=None)
    cfg.read(ROOT / "setup.cfg")
    if not cfg.has_section("options.entry_points"):
        return {}
    out: dict[str, dict[str, str]] = {}
    for group, block in cfg.items("options.entry_points"):
        for line in block.splitlines():
            line = line.split("#", 1)[0].strip()
            if not line:
                continue
            name, sep, target = line.partition("=")
            if not sep:
                raise DistError(f"setup.cfg: bad entry point line in [{group}]: {line!r}")
            out.setdefault(group, {})[name.strip()] = re.sub(r"\s+", "", target)
    return out


def build_wheel(tmp: Path) -> Path:
    src = tmp / "src"
    shutil.copytree(ROOT, src, ignore=_COPY_IGNORE)
    out = tmp / "dist"
    print(f"building the wheel from a copy of {ROOT} ...")
    proc = run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation",
                "-w", str(out), "."], cwd=src)
    if proc.returncode != 0:
        print(proc.stdout[-4000:], proc.stderr[-4000:], sep="\n", file=sys.stderr)
        raise DistError("pip wheel failed")
    wheels = sorted(out.glob("*.whl"))
    if len(wheels) != 1:
        raise DistError(f"expected one wheel in {out}, found {[w.name for w in wheels]}")
    return wheels[0]


def check_wheel(wheel: Path, checks: Checks) -> None:
    print(f"wheel {wheel.name}:")
    with zipfile.ZipFile(wheel) as zf:
        names = zf.namelist()
        dist_info = sorted({n.split("/", 1)[0] for n in names if n.split("/", 1)[0]
                            .endswith(".dist-info")})
        if len(dist_info) != 1:
            checks.check(False, "exactly one .dist-info directory", str(dist_info))
            return
        di = dist_info[0]
        record = zf.read(f"{di}/RECORD").decode()
        files = [line.rsplit(",", 2)[0] for line in record.splitlines() if line.strip()]
        top_level_txt = (zf.read(f"{di}/top_level.txt").decode().split()
                         if f"{di}/top_level.txt" in names else None)
        entry_points_txt = (zf.read(f"{di}/entry_points.txt").decode()
                            if f"{di}/entry_points.txt" in names else "")

    tops = set()
    for path in files:
        first = path.split("/", 1)[0]
        if first.endswith((".dist-info", ".data")):
            continue
        tops.add(first[:-3] if "/" not in path and first.endswith(".py") else first)
    checks.check(tops == EXPECTED_TOP_LEVEL, "top-level packages in RECORD are exactly "
                 + ", ".join(sorted(EXPECTED_TOP_LEVEL)),
                 f"found {sorted(tops)} (missing {sorted(EXPECTED_TOP_LEVEL - tops)}, "
                 f"extra {sorted(tops - EXPECTED_TOP_LEVEL)})")
    forbidden = sorted(tops & FORBIDDEN_TOP_LEVEL)
    checks.check(not forbidden, "no tests/, tools/ or other non-package trees packaged",
                 str(forbidden))
    if top_level_txt is not None:
        checks.check(set(top_level_txt) == EXPECTED_TOP_LEVEL, "top_level.txt matches",
                     f"found {sorted(top_level_txt)}")
    for required in REQUIRED_FILES:
        checks.check(required in files, f"{required} is in the wheel")
    # setuptools puts license_files in .dist-info/ or, since metadata 2.4, .dist-info/licenses/
    licenses = [path for path in files
                if path.startswith(f"{di}/") and path.rsplit("/", 1)[-1] == "LICENSE"]
    checks.check(len(licenses) == 1, "LICENSE is in the wheel's .dist-info", str(licenses))

    eps = configparser.ConfigParser(interpolation=None, delimiters=("=",))
    eps.optionxform = str  # type: ignore[assignment,method-assign]  # names are case-sensitive
    eps.read_string(entry_points_txt)
    scripts = set(eps.options("console_scripts")) if eps.has_section("console_scripts") else set()
    checks.check(scripts == EXPECTED_CONSOLE_SCRIPTS, "console scripts are exactly "
                 + ", ".join(sorted(EXPECTED_CONSOLE_SCRIPTS)),
                 f"found {sorted(scripts)}")


def make_venv(tmp: Path, wheel: Path) -> Path:
    venv = tmp / "venv"
    print(f"creating a fresh venv in {venv} and installing the wheel with its dependencies ...")
    proc = run([sys.executable, "-m", "venv", str(venv)], cwd=tmp, env=clean_env())
    if proc.returncode != 0:
        print(proc.stdout, proc.stderr, sep="\n", file=sys.stderr)
        raise DistError("python -m venv failed")
    python = venv / "bin" / "python"
    proc = run([str(python), "-m", "pip", "install", "--disable-pip-version-check", "-q",
                str(wheel)], cwd=tmp, env=clean_env())
    if proc.returncode != 0:
        print(proc.stdout[-4000:], proc.stderr[-4000:], sep="\n", file=sys.stderr)
        raise DistError("pip install of the wheel failed")
    return venv


def check_installed(venv: Path, tmp: Path, checks: Checks) -> None:
    print("installed distribution:")
    python = venv / "bin" / "python"
    env = clean_env()
    proc = run([str(python), "-c", _PROBE, DIST_NAME], cwd=tmp, env=env, timeout=120)
    if proc.returncode != 0:
        checks.check(False, "probe of the installed distribution runs", proc.stderr[-2000:])
        return
    info = json.loads(proc.stdout.strip().splitlines()[-1])
    installed = Path(info["continuum_file"]).resolve()
    checks.check(venv.resolve() in installed.parents, "continuum is imported from the venv",
                 str(installed))
    version = source_version()
    checks.check(info["version"] == version, f"installed version is {version}", info["version"])

    declared = setup_cfg_entry_points()
    got = {g: {n: re.sub(r"\s+", "", v) for n, v in names.items()}
           for g, names in info["entry_points"].items()}
    checks.check(set(got) == set(declared), "entry-point groups match setup.cfg",
                 f"setup.cfg {sorted(declared)}, installed {sorted(got)}")
    for group in sorted(set(declared) | set(got)):
        want, have = declared.get(group, {}), got.get(group, {})
        diff = sorted(f"{n}: setup.cfg {want.get(n)!r} vs installed {have.get(n)!r}"
                      for n in set(want) | set(have) if want.get(n) != have.get(n))
        checks.check(not diff, f"entry points of [{group}] match setup.cfg ({len(want)})",
                     "; ".join(diff))
    checks.check(set(declared.get("console_scripts", {})) == EXPECTED_CONSOLE_SCRIPTS,
                 "setup.cfg console_scripts equal EXPECTED_CONSOLE_SCRIPTS",
                 str(sorted(declared.get("console_scripts", {}))))
    checks.check(not info["load_errors"], "every entry-point target imports",
                 json.dumps(info["load_errors"]))

    for script in sorted(EXPECTED_CONSOLE_SCRIPTS):
        path = venv / "bin" / script
        checks.check(path.exists(), f"bin/{script} is installed")
        if path.exists():
            proc = run([str(path), "--version"], cwd=tmp, env=env, timeout=120)
            checks.check(proc.returncode == 0 and proc.stdout == f"{script} {version}\n",
                         f"`{script} --version` prints `{script} {version}`",
                         f"exit {proc.returncode}: {proc.stdout!r} {proc.stderr[-500:]!r}")
    router = venv / "bin" / "continuum-router"
    if router.exists():
        proc = run([str(router), "config", "defaults"], cwd=tmp, env=env, timeout=120)
        ok = proc.returncode == 0 and "backends" in proc.stdout
        checks.check(ok, "`continuum-router config defaults` runs from the venv",
                     f"exit {proc.returncode}: {proc.stderr[-1500:]}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--wheel", type=Path, help="check this wheel instead of building one")
    parser.add_argument("--keep", action="store_true", help="keep the temp dir")
    args = parser.parse_args(argv)

    tmp = Path(tempfile.mkdtemp(prefix="continuum-dist-"))
    checks = Checks()
    try:
        wheel = args.wheel.resolve() if args.wheel else build_wheel(tmp)
        check_wheel(wheel, checks)
        venv = make_venv(tmp, wheel)
        check_installed(venv, tmp, checks)
    except DistError as exc:
        print(f"check_dist: {exc}", file=sys.stderr)
        return 2
    except subprocess.TimeoutExpired as exc:
        print(f"check_dist: timed out: {exc}", file=sys.stderr)
        return 2
    finally:
        if args.keep:
            print(f"kept {tmp}")
        else:
            shutil.rmtree(tmp, ignore_errors=True)

    if checks.failures:
        print(f"\ncheck_dist: {len(checks.failures)} check(s) failed:", file=sys.stderr)
        for failure in checks.failures:
            print(f"  - {failure}", file=sys.stderr)
        return 1
    print("\ncheck_dist: all checks passed")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
