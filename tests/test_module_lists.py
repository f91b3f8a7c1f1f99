"""Each package's `__init__` docstring names its modules, one line each (`  name   what it is`), and the docs link to
those lists instead of copying them: a module added, renamed or removed without its line fails here."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = sorted(p.parent for top in ("connector", "sparse_kv_lab") for p in (ROOT / top).rglob("__init__.py"))
LINE = re.compile(r"^  ([a-z_][a-z0-9_]*/?) {2,}\S", re.M)
"""A module's line: two spaces, its name (a package with a slash), two spaces or more, what it is."""


def listed(package: Path) -> list[str]:
    return LINE.findall(ast.get_docstring(ast.parse((package / "__init__.py").read_text()), clean=False) or "")


def actual(package: Path) -> set[str]:
    modules = {p.stem for p in package.glob("*.py") if p.name != "__init__.py"}  # __main__ included
    return modules | {f"{p.name}/" for p in package.iterdir() if (p / "__init__.py").exists()}


@pytest.mark.parametrize("package", PACKAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_package_lists_each_of_its_modules_once(package):
    names = listed(package)
    assert len(names) == len(set(names)), f"{package.name}/__init__.py lists a module twice: {names}"
    missing, stale = sorted(actual(package) - set(names)), sorted(set(names) - actual(package))
    assert not missing and not stale, (f"{package.relative_to(ROOT)}/__init__.py: add a line for {missing}, drop "
                                       f"the line of {stale} (two spaces, the name, two spaces, what it is)")


def test_the_docs_link_to_the_lists_instead_of_copying_them():
    for doc in ("docs/architecture.md", "docs/internals.md"):
        text = (ROOT / doc).read_text()
        copied = [line for line in text.splitlines() if LINE.match(line)]
        assert not copied, f"{doc} copies module lines {copied[:3]}: link to the package's __init__.py instead"
