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


def test_the_protocol_history_has_a_line_for_the_current_version():
    # connector.protocol.messages.PROTOCOL_VERSION points at docs/internals.md's history: a bump without its entry
    # fails here.
    from connector.protocol.messages import PROTOCOL_VERSION

    text = (ROOT / "docs" / "internals.md").read_text()
    history = text.split("### Protocol versions", 1)[1].split("```")[1]
    versions = [int(m) for m in re.findall(r"^\s?(\d+)  ", history, flags=re.M)]
    assert versions == list(range(1, PROTOCOL_VERSION + 1))
