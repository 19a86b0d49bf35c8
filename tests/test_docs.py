"""The documentation site (docs/, mkdocs.yml): the flags page is the recipe's parser, the site builds without a
warning, and every relative link of a page points at a file that exists.

The flags page is checked twice: by the tool's own ``--check`` (the page is byte for byte what the tool writes), and
independently of the tool, by walking the parser's actions (every option string has a row, and no row names a flag
the parser does not have).
"""

from __future__ import annotations

import argparse
import importlib.util
import re
import runpy
import subprocess
import sys
from pathlib import Path
from types import ModuleType

import pytest

ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"
FLAGS_PAGE = DOCS / "flags.md"
RECIPE = ROOT / "examples" / "ppo" / "train_ppo.py"
TOOL = ROOT / "tools" / "make_flags_page.py"
#: A markdown link or image, ``[text](target "title")``, not one written with escaped brackets.
LINK = re.compile(r"(?<!\\)\[[^\]]*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
#: A target with a scheme (https:, mailto:) points outside the site.
EXTERNAL = re.compile(r"^[a-zA-Z][a-zA-Z0-9+.-]*:")


@pytest.fixture(scope="module")
def tool() -> ModuleType:
    spec = importlib.util.spec_from_file_location("make_flags_page", TOOL)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def recipe_parser() -> argparse.ArgumentParser:
    return runpy.run_path(str(RECIPE), run_name="recipe")["build_parser"]()


def test_flags_page_is_what_the_tool_writes(tool, capsys):
    code = tool.main(["--check"])
    assert code == 0, capsys.readouterr().err


def test_check_reports_a_stale_page(tool, tmp_path, capsys):
    """--check exits 1 on a page that differs (here: one flag renamed), names the command that fixes it and shows
    the changed line; a missing page is an error too."""
    stale = tmp_path / "flags.md"
    stale.write_text(FLAGS_PAGE.read_text().replace("`--max-turns`", "`--max-turn`"))
    assert tool.main(["--check", "--output", str(stale)]) == 1
    err = capsys.readouterr().err
    assert "python tools/make_flags_page.py" in err and "-| `--max-turn` |" in err and "+| `--max-turns` |" in err
    assert tool.main(["--check", "--output", str(tmp_path / "missing.md")]) == 1
    assert "does not exist" in capsys.readouterr().err


def _flags_in_table_rows(page: str) -> set[str]:
    """The option strings named in the first cell of the page's table rows."""
    flags = set()
    for line in page.splitlines():
        if line.startswith("| `"):
            first_cell = line[1:].split(" | ", 1)[0]
            flags.update(re.findall(r"`(-[^`]+)`", first_cell))
    return flags


def test_every_flag_of_the_parser_has_a_row(recipe_parser):
    expected = {s for action in recipe_parser._actions for s in action.option_strings} - {"-h", "--help"}
    listed = _flags_in_table_rows(FLAGS_PAGE.read_text())
    assert len(expected) > 100, "the recipe's parser was not read"
    assert not expected - listed, f"flags of the recipe missing from docs/flags.md: {sorted(expected - listed)}"
    assert not listed - expected, f"docs/flags.md lists flags the recipe does not have: {sorted(listed - expected)}"


def test_site_builds_strict(tmp_path):
    """``mkdocs build --strict``: a warning (a broken link or anchor, a page outside the nav) fails the build.
    mkdocs missing is a failure, not a skip: CI installs the ``docs`` extra."""
    if importlib.util.find_spec("mkdocs") is None:
        pytest.fail('mkdocs is not installed; install the docs extra: pip install -e ".[docs]"')
    result = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "--config-file",
                             str(ROOT / "mkdocs.yml"), "--site-dir", str(tmp_path / "site")],
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stdout + result.stderr
    for page in ("index.html", "layout/index.html", "flags/index.html"):
        assert (tmp_path / "site" / page).is_file(), page


def relative_links(page: Path) -> list[str]:
    """The relative link targets of a markdown page, outside code blocks and code spans, without their anchors."""
    text = re.sub(r"^```.*?^```", "", page.read_text(), flags=re.MULTILINE | re.DOTALL)
    text = re.sub(r"`[^`\n]*`", "", text)
    targets = [t for t in LINK.findall(text) if not EXTERNAL.match(t) and not t.startswith("#")]
    return [re.split(r"[#?]", t, maxsplit=1)[0] for t in targets]


def test_relative_links_point_at_files():
    pages = sorted(DOCS.glob("*.md"))
    assert {p.name for p in pages} >= {"index.md", "layout.md", "flags.md"}
    assert {"layout.md", "flags.md"} <= set(relative_links(DOCS / "index.md")), "the link walk found nothing"
    broken = [f"{page.relative_to(ROOT)}: {target}" for page in pages for target in relative_links(page)
              if not (page.parent / target).is_file()]
    assert not broken, "links to missing files:\n" + "\n".join(broken)


def test_link_walk(tmp_path):
    """The walk takes relative links and images, drops anchors, and leaves out external links, in-page anchors,
    code and escaped brackets."""
    page = tmp_path / "page.md"
    page.write_text('See [a](a.md#part), ![b](img/b.png "B"), [c](https://example.com/c.md), [d](#here),\n'
                    "`[e](e.md)`, \\[f\\](f.md) and [g](../g.md?x=1).\n\n```\n[h](h.md)\n```\n")
    assert relative_links(page) == ["a.md", "img/b.png", "../g.md"]
