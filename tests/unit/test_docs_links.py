"""The README, ``docs/`` and the man pages refer only to files inside the repository.

The repository stands alone: a reader of a checkout, a wheel's long description or a man
page must find every file they are pointed to. A *file reference* is a relative path with a
slash whose first part names something at the top of the repository, or whose last part has
a file extension (``shared/DESIGN.md``); it must name an existing file or directory, from
the repository's root or, as the docs say ``web/app.py`` for ``continuum/web/app.py``, from
one of the packages. Markdown links must resolve from the document's own folder.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("continuum", "stores", "strategies", "listener")
MARKDOWN = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
MAN_PAGES = sorted((ROOT / "conf" / "man").glob("*.1"))

# A relative path: not after a letter, slash, dot, colon or hyphen (so no URL tail), at least
# one slash inside.
_PATH = re.compile(r"(?<![\w./:$<-])([\w.-]+(?:/[\w.-]+)+/?)(?![\w/:<>-])")
_EXTENSION = re.compile(r"\.[A-Za-z][A-Za-z0-9]{0,8}$")
_FENCE = re.compile(r"^```.*?^```", re.M | re.S)
_LINK = re.compile(r"\]\(([^)\s]+)\)")


def file_references(text: str) -> list[str]:
    """The file references in ``text`` (see the module docstring)."""
    found = []
    for match in _PATH.finditer(text):
        path = match.group(1)
        first = path.split("/", 1)[0]
        if path.startswith(".") and not path.startswith(".ci/") and first != ".importlinter":
            continue  # ./x, ../x: markdown links are checked on their own
        if (ROOT / first).exists() or _EXTENSION.search(path.rstrip("/")):
            found.append(path)
    return found


def exists_in_repo(path: str) -> bool:
    return any((base / path).exists() for base in (ROOT, *(ROOT / p for p in PACKAGES)))


def man_text(path: Path) -> str:
    """A man page's text without roff escapes that split words (``\\-``, ``\\fB``)."""
    text = path.read_text()
    return re.sub(r"\\f[BIRP]", "", text).replace("\\-", "-").replace("\\&", "")


@pytest.mark.parametrize("doc", MARKDOWN, ids=lambda p: p.relative_to(ROOT).as_posix())
def test_markdown_refers_only_to_files_in_the_repository(doc: Path) -> None:
    text = _FENCE.sub("", doc.read_text())
    missing = [ref for ref in file_references(text) if not exists_in_repo(ref)]
    assert not missing, f"{doc.name} refers to files that are not in the repository: {missing}"
    links = [target for target in _LINK.findall(text)
             if not re.match(r"[a-z]+:", target) and not target.startswith("#")]
    broken = [t for t in links if not (doc.parent / t.split("#", 1)[0]).exists()]
    assert not broken, f"{doc.name} links to files that are not in the repository: {broken}"


@pytest.mark.parametrize("page", MAN_PAGES, ids=lambda p: p.name)
def test_man_pages_refer_only_to_files_in_the_repository(page: Path) -> None:
    refs = file_references(man_text(page))
    assert refs, "no file reference found: the pattern no longer matches the man page"
    missing = [ref for ref in refs if not exists_in_repo(ref)]
    assert not missing, f"{page.name} refers to files that are not in the repository: {missing}"


def test_the_docs_point_to_the_architecture_and_the_license() -> None:
    readme = (ROOT / "README.md").read_text()
    assert "](docs/architecture.md)" in readme and "](LICENSE)" in readme
    assert "docs/architecture.md" in man_text(ROOT / "conf" / "man" / "continuum-router.1")


def test_references_outside_the_repository_are_found() -> None:
    text = ("specification in `shared/seed/kv-cache-optimization.ko.md`; see `shared/DESIGN.md`"
            " and conf/config.yaml.example, not https://example.com/a/b.md or /v1/models")
    refs = file_references(text)
    assert refs == ["shared/seed/kv-cache-optimization.ko.md", "shared/DESIGN.md",
                    "conf/config.yaml.example"]
    assert [ref for ref in refs if not exists_in_repo(ref)] == refs[:2]
