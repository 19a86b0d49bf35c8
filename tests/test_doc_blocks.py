"""Docs that cannot lie (issue 50): the fenced code blocks of README.md and docs/*.md, tested.

- Every ```python block runs, one test per block (tests/doc_block_cases.py): a setup per block supplies what the
  block leaves out (the names it reads and never binds, its ``name = ...`` placeholders) on as many gloo ranks as
  the block's parallel sizes need; the rest of the block runs as written, and what its comments say is checked
  against an independent computation.
- Every command of a ```bash / ```sh / ```console block that runs one of our entry points (torchrun's script,
  ``python examples/...``, ``python tools/...``, ``python bench/...``, ``python -m megatron_hybrid...``) is parsed by
  that entry point's own parser, ``build_parser()``, without running it; torchrun's own options by torchrun's
  parser; the recipe's arguments are validated too (``validate_args`` at torchrun's world size) when the files
  they name exist here; a tool's ``check_args`` runs where it has one. ``python -c`` code is compiled. Every other
  command must be a known setup or outside command (:data:`SETUP_PROGRAMS`, :data:`OUTSIDE_MODULES`): a new kind of
  command fails until it is classified here.
- Markers, an HTML comment on a line of its own before a block: ``<!-- doc-test: run -->`` runs the block's
  commands (after its setup commands: no installs) as subprocesses in the slow tier; ``<!-- doc-test: skip
  (reason) -->`` leaves a block out, and needs its reason.
"""

from __future__ import annotations

import contextlib
import dataclasses
import importlib.util
import io
import os
import re
import runpy
import shlex
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Optional

import pytest

from tests.doc_block_cases import SETUPS, compile_block

ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
RECIPE = ROOT / "examples" / "ppo" / "train_ppo.py"
PYTHON_LANGS = {"python", "py", "python3"}
SHELL_LANGS = {"bash", "sh", "shell", "console"}
#: Commands that set a machine up or are not ours: not parsed, never run by the ``run`` marker either.
SETUP_PROGRAMS = {"cd", "export", ".", "source", "pip", "pip3", "git", "mkdir"}
#: ``python -m X`` of modules that are not ours.
OUTSIDE_MODULES = {"venv", "pip", "pytest", "mkdocs"}
#: The folders whose scripts are our entry points.
ENTRY_FOLDERS = ("examples", "tools", "bench")


# -- the extractor ---------------------------------------------------------------------------------------------

class DocError(ValueError):
    """A malformed block or marker in a page."""


@dataclasses.dataclass(frozen=True)
class Block:
    file: str
    """The page, relative to the repository root."""
    line: int
    """The opening fence's line (1-based)."""
    lang: str
    text: str
    marker: Optional[str] = None
    """The body of the ``<!-- doc-test: ... -->`` line before the block, stripped."""

    @property
    def id(self) -> str:
        return f"{self.file}:{self.line}"


FENCE = re.compile(r"^(?P<indent> {0,3})(?P<fence>`{3,}|~{3,})(?P<info>.*)$")
CLOSE = re.compile(r"^ {0,3}(?P<fence>`{3,}|~{3,})\s*$")
MARKER = re.compile(r"^\s*<!--\s*doc-test:(?P<body>.*?)-->\s*$")
MARKER_LOOSE = re.compile(r"<!--\s*doc-test", re.IGNORECASE)
#: A code span: a run of backticks, closed by a run of the same length (CommonMark).
CODE_SPAN = re.compile(r"(?<!`)(`+)(?!`).*?(?<!`)\1(?!`)")


def fenced_blocks(markdown: str, file: str) -> list[Block]:
    """The fenced code blocks of a Markdown page (CommonMark fences: three or more backticks or tildes, indented up
    to three spaces, closed by a fence of the same character at least as long), each with the ``doc-test`` marker
    that precedes it (blank lines between are allowed). An unclosed fence, a marker inside a line of prose or one
    that no block follows is a :class:`DocError`."""
    lines = markdown.splitlines()
    blocks: list[Block] = []
    marker: Optional[tuple[str, int]] = None
    i = 0
    while i < len(lines):
        m = FENCE.match(lines[i])
        if m and not (m["fence"][0] == "`" and "`" in m["info"]):
            fence, indent = m["fence"], len(m["indent"])
            info = m["info"].strip()
            body: list[str] = []
            j = i + 1
            while j < len(lines):
                c = CLOSE.match(lines[j])
                if c and c["fence"][0] == fence[0] and len(c["fence"]) >= len(fence):
                    break
                line = lines[j]
                body.append(line[min(indent, len(line) - len(line.lstrip(" "))):])
                j += 1
            else:
                raise DocError(f"{file}:{i + 1}: a code block that is never closed")
            blocks.append(Block(file, i + 1, info.split()[0].lower() if info else "",
                                "".join(f"{b}\n" for b in body), marker[0] if marker else None))
            marker = None
            i = j + 1
            continue
        mk = MARKER.match(lines[i])
        if mk:
            if marker is not None:
                raise DocError(f"{file}:{i + 1}: a second doc-test marker before one block (line {marker[1]})")
            marker = (mk["body"].strip(), i + 1)
        elif MARKER_LOOSE.search(CODE_SPAN.sub("", lines[i])):  # written in a code span, it is prose
            raise DocError(f"{file}:{i + 1}: a doc-test marker must be a line of its own, "
                           f"<!-- doc-test: run --> or <!-- doc-test: skip (reason) -->: {lines[i].strip()!r}")
        elif lines[i].strip() and marker is not None:
            raise DocError(f"{file}:{marker[1]}: a doc-test marker that no code block follows")
        i += 1
    if marker is not None:
        raise DocError(f"{file}:{marker[1]}: a doc-test marker that no code block follows")
    return blocks


def marker_kind(block: Block) -> tuple[Optional[str], Optional[str]]:
    """``(None, None)``, ``("run", None)`` or ``("skip", reason)``; anything else is a :class:`DocError`."""
    if block.marker is None:
        return None, None
    if block.marker == "run":
        if block.lang not in SHELL_LANGS:
            raise DocError(f"{block.id}: doc-test: run is for command blocks, not a {block.lang or 'plain'} block")
        return "run", None
    m = re.fullmatch(r"skip\s*\((?P<reason>.*)\)", block.marker)
    if m and m["reason"].strip():
        return "skip", m["reason"].strip()
    if m or block.marker == "skip":
        raise DocError(f"{block.id}: doc-test: skip needs a reason: <!-- doc-test: skip (needs a GPU) -->")
    raise DocError(f"{block.id}: unknown doc-test marker {block.marker!r} (run, or skip (reason))")


def all_blocks() -> list[Block]:
    return [b for page in PAGES for b in fenced_blocks(page.read_text(), str(page.relative_to(ROOT)))]


def python_blocks() -> list[tuple[str, Block]]:
    """The Python blocks with their setup keys, ``FILE#N`` (the page's N-th Python block: stable under edits of
    the prose around it)."""
    out, count = [], {}
    for b in all_blocks():
        if b.lang in PYTHON_LANGS:
            count[b.file] = count.get(b.file, 0) + 1
            out.append((f"{b.file}#{count[b.file]}", b))
    return out


# -- commands --------------------------------------------------------------------------------------------------

def command_lines(block: Block) -> list[tuple[int, str]]:
    """A shell block's logical lines with the page's line number of each: backslash-newline removed (as the shell
    does, also inside double quotes), blank lines and whole-line comments dropped. In a ``console`` block only the
    lines after a ``$`` prompt (and their continuations) are commands; the others are output."""
    out: list[tuple[int, str]] = []
    current: Optional[tuple[int, str]] = None
    for n, raw in enumerate(block.text.splitlines(), start=block.line + 1):
        if current is not None:
            current = (current[0], current[1] + raw)
        else:
            if block.lang == "console":
                if not raw.startswith("$ "):
                    continue
                raw = raw[2:]
            current = (n, raw)
        if current[1].endswith("\\"):
            current = (current[0], current[1][:-1])
            continue
        if current[1].strip() and not current[1].lstrip().startswith("#"):
            out.append(current)
        current = None
    if current is not None:
        raise DocError(f"{block.id}: the last line ends in a backslash")
    return out


SEPARATORS = {"&&", "||", ";", "|", "&"}


def simple_commands(line: str) -> list[list[str]]:
    """A command line's simple commands, as the shell splits them into words (``&&``, ``||``, ``;``, ``|`` separate
    them, a trailing comment is dropped, leading ``NAME=value`` assignments too); a command substitution
    ``$(...)`` stands as one word, ``SUBST``: its value does not matter to a parser."""
    line = re.sub(r"\$\([^()]*\)", "SUBST", line)
    lexer = shlex.shlex(line, posix=True, punctuation_chars=True)
    lexer.whitespace_split = True
    commands: list[list[str]] = [[]]
    for word in lexer:
        if word in SEPARATORS:
            commands.append([])
        elif word in {"<", ">", ">>", "2>", "(", ")"}:
            raise DocError(f"redirections and subshells are not parsed here: {line!r}")
        elif not commands[-1] and re.match(r"^[A-Za-z_][A-Za-z0-9_]*=", word):
            continue
        else:
            commands[-1].append(word)
    return [c for c in commands if c]


@dataclasses.dataclass(frozen=True)
class Command:
    block: Block
    line: int
    argv: tuple[str, ...]
    kind: str
    """``entry`` (ours: parsed), ``inline`` (``python -c``: compiled), ``setup`` or ``outside`` (neither)."""
    script: Optional[str] = None
    """The entry point: a path relative to the root, or a module name for ``python -m``."""
    args: tuple[str, ...] = ()
    """The entry point's own arguments."""
    world_size: Optional[int] = None
    """torchrun's ``--nproc_per_node`` × ``--nnodes`` where both are numbers."""

    @property
    def id(self) -> str:
        what = self.script or (" ".join(self.argv[:2]) if self.kind != "inline" else "python -c")
        return f"{self.block.file}:{self.line} {what}"


def torchrun_parser():
    from torch.distributed.run import get_args_parser

    return get_args_parser()


def _parse_quietly(parser, argv) -> tuple[object, str]:
    """``parser.parse_args(argv)``; a SystemExit (a bad flag or value, or ``--help``) fails the test with what the
    parser printed."""
    err, out = io.StringIO(), io.StringIO()
    try:
        with contextlib.redirect_stderr(err), contextlib.redirect_stdout(out):
            return parser.parse_args(list(argv)), ""
    except SystemExit as e:
        return None, f"exit {e.code}: {err.getvalue().strip() or out.getvalue().strip()}"


def classify(block: Block, line: int, argv: list[str]) -> Command:
    program = os.path.basename(argv[0])
    if program in SETUP_PROGRAMS:
        return Command(block, line, tuple(argv), "setup")
    if program == "torchrun":
        args, error = _parse_quietly(torchrun_parser(), argv[1:])
        if error:
            raise DocError(f"{block.id}:{line}: torchrun's parser refuses {shlex.join(argv)}: {error}")
        world = None
        lo, _, hi = str(args.nnodes).partition(":")  # "2", or an elastic "MIN:MAX" (torchrun's default "1:1")
        if str(args.nproc_per_node).isdigit() and lo.isdigit() and (hi or lo) == lo:
            world = int(args.nproc_per_node) * int(lo)
        if args.module or args.no_python:
            raise DocError(f"{block.id}:{line}: torchrun -m / --no-python is not handled here: {shlex.join(argv)}")
        return Command(block, line, tuple(argv), "entry", _entry_script(block, line, args.training_script),
                       tuple(args.training_script_args), world)
    if re.fullmatch(r"python(3(\.\d+)?)?", program):
        if len(argv) >= 3 and argv[1] == "-m":
            module = argv[2]
            if module in OUTSIDE_MODULES:
                return Command(block, line, tuple(argv), "outside")
            if module.split(".")[0] == "megatron_hybrid":
                return Command(block, line, tuple(argv), "entry", module, tuple(argv[3:]))
            raise DocError(f"{block.id}:{line}: python -m {module}: neither ours nor a known outside module "
                           f"(OUTSIDE_MODULES)")
        if len(argv) >= 3 and argv[1] == "-c":
            return Command(block, line, tuple(argv), "inline")
        if len(argv) >= 2 and not argv[1].startswith("-"):
            return Command(block, line, tuple(argv), "entry", _entry_script(block, line, argv[1]), tuple(argv[2:]))
    raise DocError(f"{block.id}:{line}: a command this test does not know: {shlex.join(argv)} (ours: torchrun, "
                   f"python {{examples,tools,bench}}/..., python -m megatron_hybrid...; or add it to SETUP_PROGRAMS)")


def _entry_script(block: Block, line: int, path: str) -> str:
    rel = os.path.normpath(path)
    if rel.split(os.sep)[0] not in ENTRY_FOLDERS or not rel.endswith(".py"):
        raise DocError(f"{block.id}:{line}: {path} is not a script of {', '.join(ENTRY_FOLDERS)}")
    if not (ROOT / rel).is_file():
        raise DocError(f"{block.id}:{line}: {path} does not exist")
    return rel


def all_commands() -> list[Command]:
    out = []
    for block in all_blocks():
        if block.lang not in SHELL_LANGS or marker_kind(block)[0] == "skip":
            continue
        for line, text in command_lines(block):
            out.extend(classify(block, line, argv) for argv in simple_commands(text))
    return out


_SCRIPTS: dict[str, dict] = {}


def load_entry(script: str) -> dict:
    """The entry point's globals, its ``__main__`` guard not run (as tools/make_flags_page.py loads the recipe)."""
    if script not in _SCRIPTS:
        if script.endswith(".py"):
            path = ROOT / script
        else:
            spec = importlib.util.find_spec(script)
            if spec is None or spec.origin is None:
                raise DocError(f"python -m {script}: no such module")
            path = Path(spec.origin)
        _SCRIPTS[script] = runpy.run_path(str(path), run_name="doc_test")
    return _SCRIPTS[script]


#: The recipe's flags that name inputs (files, directories, importable ``module:name``): validate_args reads them.
RECIPE_INPUTS = ("pretrained_checkpoint", "tokenizer_model", "prompt_file", "prompt_data", "eval_prompt_data", "load",
                 "reward_model_load", "reward_fn", "env")


def missing_inputs(args) -> list[str]:
    """The recipe's input flags whose files or modules are not on this machine (relative to the root)."""
    missing = []
    for name in RECIPE_INPUTS:
        value = getattr(args, name, None)
        if value is None:
            continue
        target = value.partition(":")[0] if name in ("reward_fn", "env") else value
        if name in ("reward_fn", "env") and not target.endswith(".py") and "/" not in target:
            found = importlib.util.find_spec(target.split(".")[0]) is not None
        else:
            found = (ROOT / target).exists()
        if not found:
            missing.append(f"--{name.replace('_', '-')} {value}")
    return missing


def parse_command(command: Command) -> dict:
    """Parse (and where possible validate) the command's arguments with its entry point's parser; return what
    was done. Fails the test on a refused argument."""
    entry = load_entry(command.script)
    if "build_parser" not in entry:
        pytest.fail(f"{command.script} has no build_parser(): give it one (the parser its main uses) so that "
                    f"{command.id} can be parsed")
    parser = entry["build_parser"]()
    args, error = _parse_quietly(parser, command.args)
    if error:
        pytest.fail(f"{command.id}: {command.script}'s parser refuses {shlex.join(command.args)!r}: {error}")
    if command.script == str(RECIPE.relative_to(ROOT)):
        missing = missing_inputs(args)
        if command.world_size is None or missing:
            return {"validated": False, "why": missing or ["no world size"]}
        try:
            entry["validate_args"](args, command.world_size)
        except ValueError as e:
            pytest.fail(f"{command.id}: validate_args at world size {command.world_size}: {e}")
        return {"validated": True}
    if "check_args" in entry:
        try:
            entry["check_args"](args)
        except ValueError as e:
            pytest.fail(f"{command.id}: {command.script}'s check_args: {e}")
        return {"validated": True}
    return {"validated": False, "why": ["the entry point has no checks beyond its parser"]}


# -- tests of the extractor and the command walk -----------------------------------------------------------------

SAMPLE = """\
# A page

Text with `inline code` and a ``` in prose that is no fence; a marker is written `<!-- doc-test: run -->`.

```python
x = 1
```

<!-- doc-test: skip (needs a GPU) -->

  ~~~~ bash extra words
  torchrun --nproc_per_node 2 \\
      examples/ppo/train_ppo.py  # a comment
  ~~~
  still inside: the closing fence must be as long
  ~~~~

<!-- doc-test: run -->
```console
$ python tools/convert_checkpoint.py --help
usage: ...
```

````
```
nested
````
"""


def test_fenced_blocks_on_a_made_up_page():
    blocks = fenced_blocks(SAMPLE, "page.md")
    assert [(b.line, b.lang, b.marker) for b in blocks] == [
        (5, "python", None), (11, "bash", "skip (needs a GPU)"), (19, "console", "run"), (24, "", None)]
    assert blocks[0].text == "x = 1\n"
    assert blocks[1].text == ("torchrun --nproc_per_node 2 \\\n    examples/ppo/train_ppo.py  # a comment\n~~~\n"
                              "still inside: the closing fence must be as long\n")
    assert blocks[3].text == "```\nnested\n"
    assert [marker_kind(b) for b in blocks] == [(None, None), ("skip", "needs a GPU"), ("run", None), (None, None)]
    assert blocks[1].id == "page.md:11"
    # The console block: only the prompt line is a command; the bash block's continuation joins its two lines.
    assert command_lines(blocks[2]) == [(20, "python tools/convert_checkpoint.py --help")]
    assert command_lines(blocks[1])[0] == (12, "torchrun --nproc_per_node 2     examples/ppo/train_ppo.py  # a comment")


@pytest.mark.parametrize("page, message", [
    ("```python\nx = 1\n", "never closed"),
    ("<!-- doc-test: skip -->\n```python\nx = 1\n```\n", "needs a reason"),
    ("<!-- doc-test: skip () -->\n```python\nx = 1\n```\n", "needs a reason"),
    ("<!-- doc-test: skip (no GPU) -->\nSome prose.\n\n```python\nx = 1\n```\n", "no code block follows"),
    ("Prose <!-- doc-test: run --> in a line.\n```bash\nls\n```\n", "line of its own"),
    ("<!-- doc-test: run -->\n```python\nx = 1\n```\n", "for command blocks"),
    ("<!-- doc-test: maybe -->\n```bash\nls\n```\n", "unknown doc-test marker"),
    ("<!-- doc-test: run -->\n", "no code block follows"),
])
def test_malformed_blocks_and_markers_fail(page, message):
    with pytest.raises(DocError, match=message):
        for block in fenced_blocks(page, "bad.md"):
            marker_kind(block)


def test_simple_commands():
    line = ('python3 -m venv .venv && . .venv/bin/activate && A=1 B= torchrun --rdzv-id ppo-$(date +%s) '
            '--rdzv-endpoint "$MASTER_ADDR:29500" x.py --flag "a b"; echo done | cat  # trailing comment')
    assert simple_commands(line) == [
        ["python3", "-m", "venv", ".venv"], [".", ".venv/bin/activate"],
        ["torchrun", "--rdzv-id", "ppo-SUBST", "--rdzv-endpoint", "$MASTER_ADDR:29500", "x.py", "--flag", "a b"],
        ["echo", "done"], ["cat"]]


def _command(text: str) -> Command:
    block = Block("page.md", 1, "bash", text + "\n")
    (line, joined), = command_lines(block)
    (argv,) = simple_commands(joined)
    return classify(block, line, argv)


def test_commands_are_classified():
    c = _command("torchrun --nnodes 2 --nproc_per_node 8 examples/ppo/train_ppo.py --tensor-model-parallel-size 8")
    assert (c.kind, c.script, c.args, c.world_size) == (
        "entry", "examples/ppo/train_ppo.py", ("--tensor-model-parallel-size", "8"), 16)
    c = _command("python tools/convert_checkpoint.py megatron-to-hf --megatron-dir a --hf-dir b")
    assert (c.kind, c.script, c.args[0], c.world_size) == (
        "entry", "tools/convert_checkpoint.py", "megatron-to-hf", None)
    assert _command("python -m pytest -q tests").kind == "outside"
    assert _command("python -c 'print(1)'").kind == "inline"
    assert _command("pip install -e .").kind == "setup"
    for text, message in [("make all", "does not know"), ("python -m numpy", "neither ours"),
                          ("python setup.py build", "not a script of"),
                          ("python tools/no_such_tool.py", "does not exist"),
                          ("torchrun --nproc_per_node 2 --no-such-torchrun-flag x.py", "torchrun's parser refuses")]:
        with pytest.raises(DocError, match=message):
            _command(text)


@pytest.mark.parametrize("text, message", [
    ("torchrun --nproc_per_node 4 examples/ppo/train_ppo.py --no-such-flag", "unrecognized arguments: --no-such-flag"),
    ("torchrun --nproc_per_node 4 examples/ppo/train_ppo.py --tensor-model-parallel-size two", "invalid int value"),
    ("torchrun --nproc_per_node 4 examples/ppo/train_ppo.py --tensor-model-parallel-size 3", "world size (4)"),
    ("python tools/convert_checkpoint.py hf-to-megatron --hf-dir a", "--megatron-dir"),
    ("python tools/convert_checkpoint.py hf-to-megatron --hf-dir a --megatron-dir b --tensor-model-parallel-size 0",
     "--tensor-model-parallel-size"),
    ("python tools/verify_checkpoint.py --hf-dir a --megatron-dir b --atol -1", "--atol"),
    ("python tools/make_tiny_hf_model.py --hf-dir a --family gpt2", "invalid choice"),
    ("python tools/make_tiny_hf_model.py --hf-dir a --family llama --like b", "exclude each other"),
])
def test_a_wrong_command_fails(text, message):
    """The parse step is not a formality: an unknown flag, a bad value, a missing required flag and a value the
    entry point's own checks refuse each fail the test, with the parser's message."""
    with pytest.raises(pytest.fail.Exception, match=re.escape(message)):
        parse_command(_command(text))


def test_validation_needs_the_inputs_here():
    """A recipe command naming files that are not on this machine is parsed, not validated."""
    done = parse_command(_command("torchrun --nproc_per_node 4 examples/ppo/train_ppo.py --load /no/such/ckpt"))
    assert done == {"validated": False, "why": ["--load /no/such/ckpt"]}
    done = parse_command(_command("torchrun --nproc_per_node 4 examples/ppo/train_ppo.py --env "
                                  "examples/tasks/tool_env.py:KeyTool --max-turns 2"))
    assert done == {"validated": True}


# -- the pages' blocks ---------------------------------------------------------------------------------------------

def test_the_pages_have_the_blocks_this_test_knows():
    """Every block parses as a block (markers well formed), every Python block has a setup and every setup a
    block, every command is classified; the counts guard against a walk that finds nothing."""
    blocks = all_blocks()
    for block in blocks:
        marker_kind(block)
    assert {b.lang for b in blocks} <= PYTHON_LANGS | SHELL_LANGS | {"", "text", "yaml", "json", "toml"}, \
        sorted({b.lang for b in blocks})
    keys = {key for key, b in python_blocks() if marker_kind(b)[0] != "skip"}
    assert keys == set(SETUPS), f"blocks without a setup: {sorted(keys - set(SETUPS))}; setups without a block: " \
                                f"{sorted(set(SETUPS) - keys)}"
    commands = all_commands()
    assert len([c for c in commands if c.kind == "entry"]) >= 10 and len(keys) >= 4


def _python_params() -> list:
    return [pytest.param(k, b, id=b.id, marks=[pytest.mark.slow] if k in SETUPS and SETUPS[k].slow else [])
            for k, b in python_blocks()]


@pytest.mark.parametrize("key, block", _python_params())
def test_python_block_runs(key, block, request):
    kind, reason = marker_kind(block)
    if kind == "skip":
        pytest.skip(f"{block.id}: {reason}")
    setup = SETUPS[key]
    extra = request.getfixturevalue(setup.fixture) if setup.fixture else {}
    from tests.doc_block_cases import run_block
    from tests.harness import run_distributed

    results = run_distributed(run_block, setup.world_size, key, str(ROOT / block.file), block.line, block.text,
                              extra, tensor_model_parallel_size=setup.tensor,
                              pipeline_model_parallel_size=setup.pipeline)
    summaries = [r for r in results if r is not None]
    assert summaries, "no rank checked anything"
    if "logits_compared" in summaries[0]:
        assert any(r["logits_compared"] for r in results), "the rollout logits were compared on no rank"
    if "log_probs_checked" in summaries[0]:
        assert any(r["log_probs_checked"] for r in results), "the log-probs were checked on no rank"


@pytest.fixture(scope="module")
def converted_qwen(tmp_path_factory) -> dict:
    """converter.md's ``./qwen-mcore``: a tiny Qwen2 (tools/make_tiny_hf_model.py's) converted at TP 1, and
    transformers' logits of the original on random tokens."""
    from megatron_hybrid.convert import hf_to_megatron
    from megatron_hybrid.convert.tiny import save_tiny_hf_model
    from megatron_hybrid.convert.verify import hf_logits, random_tokens

    root = tmp_path_factory.mktemp("converter")
    save_tiny_hf_model(str(root / "qwen-hf"), "qwen2", seed=0)
    arch = hf_to_megatron(str(root / "qwen-hf"), str(root / "qwen-mcore"), progress=False)
    tokens = random_tokens(arch.vocab_size, batch_size=2, seq_length=16, seed=5)
    return {"cwd": str(root), "tokens": tokens, "hf_logits": hf_logits(root / "qwen-hf", tokens)}


def _entry_commands() -> list[Command]:
    return [c for c in all_commands() if c.kind == "entry"]


@pytest.mark.parametrize("command", [pytest.param(c, id=c.id) for c in _entry_commands()])
def test_command_parses(command, monkeypatch):
    monkeypatch.chdir(ROOT)  # the commands run from the repository root; relative inputs are read from there
    parse_command(command)


@pytest.mark.parametrize("command", [pytest.param(c, id=c.id) for c in all_commands() if c.kind == "inline"])
def test_inline_python_compiles(command):
    compile(command.argv[2], command.id, "exec")


def test_compile_block_placeholders_and_values():
    """The block compiler: ``name = ...`` becomes a fill, a bare expression is recorded, line numbers are the
    page's, and the free names are what the block reads without binding."""
    text = "import os\nmodel = ...  # yours\nmodel.x\ny = f(model)\nprint(y)\n"
    compiled = compile_block(text, "page.md", 10)
    assert compiled.placeholders == ["model"] and compiled.free == {"f"}
    calls = []
    ns = {"__doc_fill__": lambda name: calls.append(name) or type("M", (), {"x": 3})(),
          "__doc_value__": lambda src, v: calls.append((src, v)), "f": lambda m: m.x + 1, "print": calls.append}
    exec(compiled.code, ns)
    assert calls == ["model", ("model.x", 3), 4, ("print(y)", None)]
    with pytest.raises(ZeroDivisionError) as info:
        exec(compile_block("x = 1\n1 / 0\n", "page.md", 10).code, {"__doc_value__": lambda s, v: v})
    assert info.traceback[-1].lineno + 1 == 12  # pytest counts from 0: the page's line 12


# -- blocks marked to run ----------------------------------------------------------------------------------------

def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _run_blocks() -> list[Block]:
    return [b for b in all_blocks() if marker_kind(b)[0] == "run"]


@pytest.mark.slow
@pytest.mark.parametrize("block", [pytest.param(b, id=b.id) for b in _run_blocks()])
def test_marked_block_runs(block, tmp_path):
    """The block's commands after its setup (the installs, the venv) run as they are written, from a scratch root, with
    this interpreter for ``python`` and ``torchrun`` (``python -m torch.distributed.run``) and a free rendezvous
    port (torchrun's ``PET_MASTER_PORT``, its own environment default for ``--master-port``). Each must exit 0;
    a recipe run must show the README's claim, a mean reward that rises by at least 0.5 (first to last 5 steps)."""
    commands = [classify(block, line, argv) for line, text in command_lines(block)
                for argv in simple_commands(text)]
    to_run = [c for c in commands if c.kind in ("entry", "inline")]
    assert to_run, f"{block.id}: nothing to run after the setup commands"
    # A scratch root: the repository's top-level entries linked in, so that relative paths resolve as from the
    # root and whatever a command writes stays out of the checkout.
    for entry in ROOT.iterdir():
        if entry.name != ".git":
            (tmp_path / entry.name).symlink_to(entry)
    env = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1", PET_MASTER_PORT=str(_free_port()))
    for c in to_run:
        argv = list(c.argv)
        argv = ([sys.executable, "-m", "torch.distributed.run", *argv[1:]] if argv[0] == "torchrun"
                else [sys.executable, *argv[1:]])
        start = time.monotonic()
        done = subprocess.run(argv, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=420)
        took = time.monotonic() - start
        assert done.returncode == 0, f"{c.id}: exit {done.returncode} after {took:.0f} s\n{done.stdout[-3000:]}" \
                                     f"\n{done.stderr[-3000:]}"
        if c.script == str(RECIPE.relative_to(ROOT)):
            m = re.search(r"mean reward of the first \d+ steps ([\d.]+), of the last \d+ ([\d.]+)", done.stdout)
            assert m, f"{c.id}: no summary line\n{done.stdout[-2000:]}"
            first, last = map(float, m.groups())
            assert last - first >= 0.5, f"{c.id}: mean reward {first} -> {last}"
        print(f"{c.id}: {took:.0f} s")
