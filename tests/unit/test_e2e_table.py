"""docs/e2e.md's table of every e2e test (where it runs, which pair it guards) names exactly the
tests tests/e2e has, each under the report row (suite) it belongs to."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

from vllm_zerocopy_testbed.config import REPO_ROOT

pytestmark = pytest.mark.unit

TABLE_HEADING = "## Every test: where it runs, which pair it guards"
ROW = re.compile(r"^\| (?P<suite>[a-z-]+) \| `(?P<test>test_\w+)`")


def _suite_of(decorators: list[ast.expr]) -> str | None:
    """The name in a ``pytest.mark.suite("name")`` among ``decorators`` (or a ``pytestmark`` list)."""
    for node in decorators:
        if (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "suite"
                and node.args and isinstance(node.args[0], ast.Constant)):
            return node.args[0].value
    return None


def e2e_tests(directory: Path) -> set[tuple[str, str]]:
    """(suite, test function) of every test in ``directory``'s modules."""
    found: set[tuple[str, str]] = set()
    for module in sorted(directory.glob("test_*.py")):
        tree = ast.parse(module.read_text())
        module_suite = None
        for node in tree.body:
            if isinstance(node, ast.Assign) and any(getattr(t, "id", "") == "pytestmark" for t in node.targets):
                marks = node.value.elts if isinstance(node.value, ast.List) else [node.value]
                module_suite = _suite_of(marks)
        for node in tree.body:
            if isinstance(node, ast.FunctionDef) and node.name.startswith("test_"):
                suite = _suite_of(node.decorator_list) or module_suite
                assert suite, f"{module.name}::{node.name} belongs to no suite (pytest.mark.suite)"
                found.add((suite, node.name))
    return found


def table_rows(text: str) -> list[tuple[str, str]]:
    """(suite, test) of each row of the table under ``TABLE_HEADING``."""
    assert TABLE_HEADING in text, f"docs/e2e.md has no section {TABLE_HEADING!r}"
    section = text.split(TABLE_HEADING, 1)[1].split("\n## ", 1)[0]
    return [(m["suite"], m["test"]) for m in map(ROW.match, section.splitlines()) if m]


def test_the_table_names_every_e2e_test_once_and_nothing_else() -> None:
    rows = table_rows((REPO_ROOT / "docs" / "e2e.md").read_text())
    tests = e2e_tests(REPO_ROOT / "tests" / "e2e")
    twice = sorted({row for row in rows if rows.count(row) > 1})
    assert not twice, f"rows given twice: {twice}"
    assert not tests - set(rows), f"e2e tests missing from the table in docs/e2e.md: {sorted(tests - set(rows))}"
    assert not set(rows) - tests, f"rows of the table with no such test in tests/e2e: {sorted(set(rows) - tests)}"


def test_a_test_missing_from_the_table_is_named(tmp_path: Path) -> None:
    """The check can fail: a module with a test the table lacks."""
    (tmp_path / "test_new.py").write_text(
        'import pytest\npytestmark = [pytest.mark.suite("plain")]\ndef test_something_new():\n    pass\n')
    tests = e2e_tests(tmp_path)
    assert tests == {("plain", "test_something_new")}
    rows = table_rows((REPO_ROOT / "docs" / "e2e.md").read_text())
    assert ("plain", "test_something_new") not in rows
