"""The README's settings table is the settings struct's (`python -m connector settings --markdown`): a setting added,
renamed, re-defaulted or re-documented in connector.vllm.config without `python -m connector settings --update
README.md` fails here. And the README's links into docs/ lead to files that exist."""

from __future__ import annotations

import re
from pathlib import Path

from connector.cli.settings import markdown, table_in
from connector.vllm.config import LIMIT_KEYS, ConnectorSettings

ROOT = Path(__file__).resolve().parents[1]


def test_the_settings_table_is_generated_from_the_struct():
    table = table_in((ROOT / "README.md").read_text())
    assert table is not None, "README.md lost its settings markers"
    assert table == markdown(), "README.md's settings table is stale: run `python -m connector settings --update " \
                                "README.md`"
    names = [n for n in ConnectorSettings.__struct_fields__ if n != "limits"]
    assert all(f"| `{name}` |" in table for name in names + [f"limits.{n}" for n in LIMIT_KEYS])
    assert "|  |" not in table.replace("| `", "|`"), "a setting without a meaning: give it a docstring"


def test_every_setting_has_a_meaning():
    from connector.cli.settings import rows

    assert [name for name, _kind, _default, meaning, _section in rows() if not meaning] == []


def test_the_links_into_docs_exist():
    for page in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]:
        for target in re.findall(r"\]\(((?:\.\./|docs/)?[\w./-]+\.md)(?:#[^)]*)?\)", page.read_text()):
            assert (page.parent / target).resolve().exists(), f"{page.name} links to {target}, which is missing"


def test_ci_runs_the_readmes_two_set_up_commands_as_written():
    setup = (ROOT / "README.md").read_text().split("\n## Set up\n", 1)[1].split("\n## ", 1)[0]
    commands = re.findall(r"```bash\n(.+?)\n```", setup, re.S)
    assert len(commands) == 2, commands
    ci = (ROOT / ".ci" / "run").read_text().splitlines()
    for command in commands:
        assert command in ci, f".ci/run does not run the README's set-up command as written: {command}"
