"""The bench's sections are one table: each row is a name `--only` takes, a result that is judged."""

from __future__ import annotations

import ast
import dataclasses
import re
from pathlib import Path

import pytest

from bench import __main__ as bench_main
from bench import goals, sections

BENCH = Path(sections.__file__).parent


def test_every_section_has_one_name_and_only_takes_each() -> None:
    assert len(set(sections.NAMES)) == len(sections.NAMES) == len(sections.TABLE)
    for name in sections.NAMES:
        assert bench_main.parse(["--only", name]).only == name
    with pytest.raises(SystemExit):
        bench_main.parse(["--only", "nosuchsection"])


def test_a_section_either_feeds_the_goals_or_judges_itself() -> None:
    fields = {field.name for field in dataclasses.fields(goals.Results)}
    for entry in sections.TABLE:
        assert entry.result is None or entry.result in fields, entry.name
        assert entry.result is None or entry.verdicts is None, f"{entry.name} is judged twice"


def test_every_module_that_measures_a_section_is_in_the_table() -> None:
    """A module with a `measure(bed, ...)` is a section: forgetting its row leaves it never run.

    sections.py imports each module its rows use (ruff refuses an import left unused).
    """
    imported = {
        alias.asname or alias.name
        for node in ast.walk(ast.parse((BENCH / "sections.py").read_text(encoding="utf-8")))
        if isinstance(node, ast.ImportFrom) and node.module == "bench"
        for alias in node.names
    }
    for path in sorted(BENCH.glob("*.py")):
        tree = ast.parse(path.read_text(encoding="utf-8"))
        measures = any(
            isinstance(node, ast.FunctionDef)
            and node.name == "measure"
            and node.args.args[:1]
            and node.args.args[0].arg == "bed"
            for node in tree.body
        )
        if measures:
            names = [alias for alias in imported if alias in (path.stem, f"{path.stem}_mod")]
            assert names, f"bench/{path.name} has no row in sections.TABLE"


def _readme_rows() -> dict[str, list[str]]:
    """The rows of bench/README.md's table of sections, by section name (the first `code` of the section cell)."""
    text = (BENCH / "README.md").read_text(encoding="utf-8")
    table = text.split("\n## The sections\n", 1)[1].split("\n## ", 1)[0]
    rows = {}
    for line in table.splitlines():
        cells = [cell.strip() for cell in line.strip().strip("|").split("|")]
        if line.startswith("|") and cells[0].isdigit():
            found = re.match(r"`([a-z_]+)`", cells[1])
            assert found, f"bench/README.md: row {cells[0]} does not begin with the section's name in `code`"
            rows[found.group(1)] = cells
    return rows


def test_the_readme_has_one_row_for_every_section_with_its_number_goal_and_figure() -> None:
    rows = _readme_rows()
    assert set(rows) == set(sections.NAMES), "bench/README.md's table of sections vs sections.TABLE"
    for entry in sections.TABLE:
        number, _, run, goal, figure = rows[entry.name]
        assert entry.title.startswith(f"{number}. "), f"{entry.name}: numbered {number} in the README, {entry.title!r}"
        assert run, f"{entry.name}: say how to run it"
        assert goal, f"{entry.name}: say its goal (or none)"
        assert re.search(r"\b20\d\d-\d\d-\d\d\b", figure), f"{entry.name}: its latest figure has no date"
