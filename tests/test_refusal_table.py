"""The refusal table of docs/reliability.md names its tests (issue 50, step 1).

Every row of the table under "What the engine refuses" names, in its last column, the pytest node ids of the tests
that trigger that refusal. Here every row must name at least one, and every node id named anywhere in README.md and
docs/*.md must exist: the file, and the test function (or ``Class::method``) defined in it, found by reading the file's
syntax tree, without importing or collecting anything.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PAGE = ROOT / "docs" / "reliability.md"
SECTION = "## What the engine refuses"
#: A pytest node id in a code span: ``tests/test_x.py::test_y``, ``tests/test_x.py::TestY::test_z``, with an optional
#: parametrization ``[...]``.
NODE_ID = re.compile(r"`(tests/[\w/]+\.py(?:::\w+)+(?:\[[^\]`]*\])?)`")


def section_table(markdown: str, heading: str) -> tuple[list[str], list[list[str]]]:
    """The header and the rows (cells, stripped) of the first table after ``heading``, before the next heading.
    A pipe escaped as ``\\|`` (inside a cell's text or code) does not split cells."""
    lines = markdown.splitlines()
    start = lines.index(heading)
    table: list[list[str]] = []
    for line in lines[start + 1:]:
        if line.startswith("#"):
            break
        if line.startswith("|"):
            table.append([c.strip() for c in re.split(r"(?<!\\)\|", line.strip())[1:-1]])
        elif table:
            break
    if len(table) < 3 or not all(set(c) <= set(":-") for c in table[1]):
        raise ValueError(f"no table with a header and rows under {heading!r}")
    return table[0], table[2:]


def node_ids(text: str) -> list[str]:
    return NODE_ID.findall(text)


def missing_node(node_id: str, root: Path = ROOT) -> str | None:
    """Why ``node_id`` names no test (``None`` when it does): its file is missing, or the file defines no such test
    function (module level) or ``Class::method``."""
    path, *names = re.sub(r"\[.*\]$", "", node_id).split("::")
    file = root / path
    if not file.is_file():
        return f"{node_id}: no file {path}"
    body = ast.parse(file.read_text(), filename=str(file)).body
    for i, name in enumerate(names):
        last = i == len(names) - 1
        kinds = (ast.FunctionDef, ast.AsyncFunctionDef) if last else (ast.ClassDef,)
        found = next((n for n in body if isinstance(n, kinds) and n.name == name), None)
        if found is None:
            return f"{node_id}: {path} defines no {'test' if last else 'class'} {name}"
        if not name.startswith("test" if last else "Test"):
            return f"{node_id}: {name} is not a name pytest collects"
        body = found.body
    return None


def test_every_refusal_names_a_test_that_exists():
    header, rows = section_table(PAGE.read_text(), SECTION)
    assert header[0] == "refused" and header[-1] == "test", header
    assert len(rows) >= 8, f"the walk found {len(rows)} rows"
    problems = []
    for row in rows:
        if len(row) != len(header):
            problems.append(f"{len(row)} cells, the header has {len(header)}: {row[0][:60]}")
            continue
        ids = node_ids(row[-1])
        rest = NODE_ID.sub("", row[-1]).replace(",", "").strip()
        if not ids or rest:
            problems.append(f"the test cell must be node ids only, one or more: {row[0][:60]!r}: {row[-1]!r}")
        problems += [why for node in ids if (why := missing_node(node))]
    assert not problems, "docs/reliability.md's refusal table:\n" + "\n".join(problems)


def test_node_ids_named_in_the_docs_exist():
    pages = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
    named = {(page.name, node) for page in pages for node in node_ids(page.read_text())}
    assert len(named) >= 10, "the walk found no node ids"
    problems = [f"{page}: {why}" for page, node in sorted(named) if (why := missing_node(node))]
    assert not problems, "\n".join(problems)


def test_the_table_walk_and_the_resolver(tmp_path):
    """On made-up files: escaped pipes stay in their cell, the table ends at the next heading, and a missing file,
    function, class or method, or a name pytest does not collect, is reported."""
    page = ("# P\n\n## Refusals\n\ntext\n\n| refused | test |\n|---|---|\n| `a \\| b` | `tests/t.py::test_a` |\n"
            "| c | `tests/t.py::TestK::test_m[x-1]`, `tests/t.py::test_b` |\n\n## Next\n\n| x | y |\n|---|---|\n")
    header, rows = section_table(page, "## Refusals")
    assert header == ["refused", "test"]
    assert rows == [["`a \\| b`", "`tests/t.py::test_a`"],
                    ["c", "`tests/t.py::TestK::test_m[x-1]`, `tests/t.py::test_b`"]]
    assert node_ids(rows[1][1]) == ["tests/t.py::TestK::test_m[x-1]", "tests/t.py::test_b"]
    (tmp_path / "tests").mkdir()
    (tmp_path / "tests" / "t.py").write_text("def test_a():\n    def test_inner(): pass\n\n"
                                             "class TestK:\n    def test_m(self): pass\n\ndef helper(): pass\n")
    assert missing_node("tests/t.py::test_a", tmp_path) is None
    assert missing_node("tests/t.py::TestK::test_m[x-1]", tmp_path) is None
    assert "no file" in missing_node("tests/u.py::test_a", tmp_path)
    assert "defines no test test_b" in missing_node("tests/t.py::test_b", tmp_path)
    assert "defines no test test_inner" in missing_node("tests/t.py::test_inner", tmp_path)  # not module level
    assert "defines no class TestJ" in missing_node("tests/t.py::TestJ::test_m", tmp_path)
    assert "defines no test test_n" in missing_node("tests/t.py::TestK::test_n", tmp_path)
    assert "not a name pytest collects" in missing_node("tests/t.py::helper", tmp_path)
    with pytest.raises(ValueError, match="no table"):
        section_table("## Refusals\n\nnone here\n\n## Next\n", "## Refusals")
