"""The documentation site (docs/, mkdocs.yml): the flags page is the recipe's parser, the site builds without a
warning, and every relative link of a page points at a file that exists.

The flags page is checked twice: by the tool's own ``--check`` (the page is byte for byte what the tool writes), and
independently of the tool, by walking the parser's actions (every option string has a row, and no row names a flag
the parser does not have).

The figures (docs/img/) are tools/make_doc_figures.py's: it is run into a temporary folder, and every image a page
shows must be one it writes there, under the same name, and committed in docs/img/.
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
FIGURES_TOOL = ROOT / "tools" / "make_doc_figures.py"
IMG = DOCS / "img"
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


# -- the figures ---------------------------------------------------------------------------------------------------

#: A markdown image, ``![alt](target "title")``.
IMAGE = re.compile(r"!\[[^\]]*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")


def shown_images(page: Path) -> list[Path]:
    """The local images a markdown page shows, outside code blocks and code spans, as resolved paths."""
    text = re.sub(r"^```.*?^```", "", page.read_text(), flags=re.MULTILINE | re.DOTALL)
    text = re.sub(r"`[^`\n]*`", "", text)
    return [(page.parent / t).resolve() for t in IMAGE.findall(text) if not EXTERNAL.match(t)]


@pytest.fixture(scope="module")
def figures_tool() -> dict:
    return runpy.run_path(str(FIGURES_TOOL))  # as test_doc_blocks loads a tool (its dataclasses need a module)


def test_every_figure_shown_is_the_tools(figures_tool, tmp_path, capsys):
    """The tool writes its figures from bench/results/ (Agg, about 3 s); every image the pages and the README show
    is in docs/img/ and is one of them, and docs/img/ holds nothing else. matplotlib missing is a failure, as
    mkdocs is: the docs extra installs both."""
    if importlib.util.find_spec("matplotlib") is None:
        pytest.fail('matplotlib is not installed; install the docs extra: pip install -e ".[docs]"')
    written = figures_tool["main"](["--out", str(tmp_path)])
    names = {p.name for p in written}
    assert names == set(figures_tool["FIGURES"]) and all(p.stat().st_size > 1000 for p in written), written
    shown = {img for page in [ROOT / "README.md", *sorted(DOCS.glob("*.md"))] for img in shown_images(page)}
    assert len(shown) >= 5, f"the image walk found {sorted(shown)}"
    outside = sorted(str(p) for p in shown if p.parent != IMG.resolve())
    assert not outside, f"images shown from outside docs/img/: {outside}"
    shown_names = {p.name for p in shown}
    assert not shown_names - names, f"images shown that the tool does not write: {sorted(shown_names - names)}"
    committed = {p.name for p in IMG.iterdir()}
    assert shown_names <= committed, f"images shown but not in docs/img/: {sorted(shown_names - committed)}"
    assert committed <= shown_names, f"docs/img/ files no page shows: {sorted(committed - shown_names)}"


def test_figures_tool_names_a_missing_results_file(figures_tool, tmp_path, capsys):
    with pytest.raises(SystemExit) as exit_:
        figures_tool["main"](["--results", str(tmp_path), "--out", str(tmp_path / "img"), "--only", "train_pass.svg"])
    assert exit_.value.code == 2
    assert f"train_pass.svg reads {tmp_path / 'train_pass_h100.json'}, which is not a file" in capsys.readouterr().err
    assert not (tmp_path / "img").exists()  # nothing written before the check
