"""Write docs/flags.md, the PPO recipe's flags, from the recipe's own parser, so that the page cannot drift.

examples:
  # rewrite the page after adding or changing a flag of the recipe
  python tools/make_flags_page.py

  # exit 1 when docs/flags.md is not what the parser gives now (tests/test_docs.py runs this)
  python tools/make_flags_page.py --check

  # write the page somewhere else
  python tools/make_flags_page.py --output /tmp/flags.md

The parser is ``build_parser()`` of examples/ppo/train_ppo.py, loaded as bench/rl_step.py loads the recipe
(``runpy.run_path(..., run_name="recipe")``), with this checkout's megatron_hybrid first on the path. The page has
one section per argument group, in the parser's order, and one table row per argument: its option strings, its
default, its choices or type, and its help as ``--help`` prints it. Every argument is listed except -h/--help.
"""

from __future__ import annotations

import argparse
import difflib
import re
import runpy
import sys
from pathlib import Path
from typing import Optional, Sequence

ROOT = Path(__file__).resolve().parents[1]
RECIPE = ROOT / "examples" / "ppo" / "train_ppo.py"
PAGE = ROOT / "docs" / "flags.md"
#: The recipe and the page as the page names them (paths relative to the repository root).
RECIPE_NAME = "examples/ppo/train_ppo.py"
TOOL_NAME = "tools/make_flags_page.py"
#: Lines of the difference --check prints at most.
MAX_DIFF_LINES = 40


def load_parser(recipe: Path = RECIPE) -> argparse.ArgumentParser:
    """The recipe's parser, from its ``build_parser()``.

    This checkout goes first on ``sys.path``: an editable install of another checkout would otherwise supply
    ``megatron_hybrid`` (and its flags).
    """
    if str(ROOT) not in sys.path:
        sys.path.insert(0, str(ROOT))
    return runpy.run_path(str(recipe), run_name="recipe")["build_parser"]()


def is_help(action: argparse.Action) -> bool:
    """Whether ``action`` is argparse's -h/--help, which the page leaves out."""
    return isinstance(action, argparse._HelpAction)


def escape_text(text: str) -> str:
    """``text`` as literal markdown inside a table cell: nothing in it becomes markup or ends the cell."""
    text = re.sub(r"([\\`*\[\]|])", r"\\\1", text)
    # An underscore between two word characters is literal in Python-Markdown and on GitHub (snake_case names).
    text = re.sub(r"(?<!\w)_|_(?!\w)", r"\\_", text)
    return text.replace("<", "&lt;")


def code(text: str) -> str:
    """``text`` as a code span, or as escaped text where a code span cannot hold it: Python-Markdown keeps the
    backslash of ``\\|`` inside a code span, and a backtick would end it."""
    if "|" in text or "`" in text:
        return escape_text(text)
    return f"`{text}`"


def names(action: argparse.Action) -> str:
    """The flag(s) cell: every option string, or the name of a positional argument."""
    return ", ".join(code(s) for s in action.option_strings) if action.option_strings else code(action.dest)


def default(action: argparse.Action, owner: argparse.Action) -> str:
    """The default cell: the value argparse gives when the flag is absent (``None``: unset). ``owner`` is the first
    argument of the same ``dest``, whose default argparse uses for all of them."""
    if owner is not action:
        return f"as {names(owner).split(', ')[0]}"
    if action.required:
        return "required"
    if action.default is argparse.SUPPRESS:
        return "not set"
    return code(repr(action.default))


def kind(action: argparse.Action) -> str:
    """The choices/type cell: the accepted values, the value type and count, or what a switch stores."""
    if isinstance(action, argparse._CountAction):
        return "counted switch (repeatable)"
    if action.nargs == 0:
        # store_true / store_false (and BooleanOptionalAction) need no more words; a store_const does.
        if type(action) in (argparse._StoreConstAction, argparse._AppendConstAction):
            return f"switch, stores {code(repr(action.const))}"
        return "switch"
    if action.choices is not None:
        text = "one of " + ", ".join(code(str(c)) for c in action.choices)
    else:
        text = code(getattr(action.type, "__name__", repr(action.type)) if action.type is not None else "str")
    count = {None: "", "?": ", optional value", "*": ", any number", "+": ", one or more",
             argparse.REMAINDER: ", the rest of the command line"}
    text += count[action.nargs] if action.nargs in count else f", {action.nargs} values"
    if isinstance(action, (argparse._AppendAction, argparse._ExtendAction)):
        text += " (repeatable)"
    return text


def split_title(title: str) -> tuple[str, str]:
    """A group title ``name (note)`` as its heading ``Name`` and ``(note)``; a title without a note as itself."""
    name, sep, rest = title.partition(" (")
    if not (sep and rest.endswith(")")):
        name, rest = title, ""
    return name[:1].upper() + name[1:], sep.strip() + rest


def render(parser: argparse.ArgumentParser) -> str:
    """The page: a header, then one section and table per argument group that has arguments besides --help."""
    formatter = parser._get_formatter()
    listed = [a for a in parser._actions if not is_help(a)]
    owners: dict[str, argparse.Action] = {}
    for action in listed:
        owners.setdefault(action.dest, action)
    sections = []
    covered = []
    for group in parser._action_groups:
        actions = [a for a in group._group_actions if not is_help(a)]
        if not actions:
            continue
        heading, note = split_title(group.title or "")
        lines = [f"## {escape_text(heading)}", ""]
        if note:
            lines += [escape_text(note), ""]
        if group.description:
            lines += [escape_text(" ".join(group.description.split())), ""]
        lines += ["| flag(s) | default | choices/type | help |", "|---|---|---|---|"]
        for action in actions:
            help_text = " ".join(formatter._expand_help(action).split()) if action.help else ""
            cells = (names(action), default(action, owners[action.dest]), kind(action), escape_text(help_text))
            lines.append("| " + " | ".join(cells) + " |")
        sections.append("\n".join(lines))
        covered += actions
    assert sorted(map(id, covered)) == sorted(map(id, listed)), "an argument in no group, or in two"
    header = [
        "# Flags of the PPO recipe",
        "",
        f"`{RECIPE_NAME}` (PPO and GRPO on the HybridEngine) takes Megatron-LM's flags under Megatron-LM's names",
        "(a Megatron-LM launch script carries over) and flags of its own. This page is generated from the recipe's",
        f"parser (`build_parser()`) by `{TOOL_NAME}`: do not edit it by hand, run `python {TOOL_NAME}`",
        "after changing a flag (`tests/test_docs.py` fails while the page and the parser differ).",
        f"`python {RECIPE_NAME} --help` prints the same help, with example commands.",
        "",
        f"{sum(len(a.option_strings) or 1 for a in listed)} flags in {len(sections)} groups. A default of `None` "
        "means unset: the help says what applies then.",
    ]
    return "\n\n".join(["\n".join(header)] + sections) + "\n"


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--output", type=Path, default=PAGE,
                        help="the page to write or check (default: docs/flags.md of this checkout)")
    parser.add_argument("--check", action="store_true",
                        help="write nothing; exit 1 with the difference when --output is not what would be written")
    args = parser.parse_args(argv)
    page = render(load_parser())
    if not args.check:
        args.output.parent.mkdir(parents=True, exist_ok=True)
        args.output.write_text(page)
        print(f"wrote {args.output}")
        return 0
    current = args.output.read_text() if args.output.exists() else None
    if current == page:
        return 0
    if current is None:
        print(f"{args.output} does not exist; run `python {TOOL_NAME}` to write it", file=sys.stderr)
        return 1
    diff = list(difflib.unified_diff(current.splitlines(), page.splitlines(), f"{args.output} (as it is)",
                                     f"{args.output} (from {RECIPE_NAME}'s parser)", lineterm=""))
    more = len(diff) - MAX_DIFF_LINES
    print(f"{args.output} differs from what {RECIPE_NAME}'s parser gives now; run `python {TOOL_NAME}` and commit "
          "the page. The difference:\n" + "\n".join(diff[:MAX_DIFF_LINES])
          + (f"\n... ({more} more lines)" if more > 0 else ""), file=sys.stderr)
    return 1


if __name__ == "__main__":
    sys.exit(main())
