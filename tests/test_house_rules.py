"""Rules of the house read from the source (issue 49): the mode names have one home, and units stay small enough to
hold in one's head (no class over 400 lines, no function over 100; the units still over, each at its length now,
may only shrink until split)."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "megatron_hybrid"
#: Where code of ours lives that uses the engine's modes.
SOURCES = [PACKAGE, ROOT / "examples", ROOT / "tools", ROOT / "bench"]
#: The values of megatron_hybrid.modes' enums that no other module may spell (``"model"`` is too common a word to
#: ban outright: it counts where the other side of the comparison names ``rollout_weights``).
MODE_NAMES = {"aliased", "canonical", "fp8"}
MAX_CLASS, MAX_FUNCTION = 400, 100
#: Units over the limits, at their length when the rule came: none may grow (issue 49, step 3, split the last).
OVER: dict[str, int] = {}


def python_files(folders: list[Path]) -> list[Path]:
    return [p for folder in folders for p in sorted(folder.rglob("*.py"))]


def mode_literals(source: str, path: str) -> list[str]:
    """``path:line`` of each comparison with a mode's name spelled as a string, and of each list or tuple that
    spells two of them (an argparse ``choices``)."""
    found = []
    for node in ast.walk(ast.parse(source, path)):
        if isinstance(node, ast.Compare):
            sides = [node.left, *node.comparators]
            text = ast.unparse(node)
            for side in sides:
                values = [side] if isinstance(side, ast.Constant) else \
                    list(side.elts) if isinstance(side, (ast.List, ast.Tuple, ast.Set)) else []
                for v in values:
                    if isinstance(v, ast.Constant) and (v.value in MODE_NAMES or
                                                        (v.value == "model" and "rollout_weights" in text)):
                        found.append(f"{path}:{node.lineno}: {text}")
        elif isinstance(node, (ast.List, ast.Tuple)):
            names = {e.value for e in node.elts if isinstance(e, ast.Constant) and isinstance(e.value, str)}
            if len(names & MODE_NAMES) >= 2:
                found.append(f"{path}:{node.lineno}: {ast.unparse(node)}")
    return found


def test_the_finder_sees_what_it_must():
    spelled = 'if mode == "aliased": pass\nif x in ("fp8", y): pass\nchoices = ["aliased", "canonical"]\n' \
              'if rollout_weights != "model": pass\nif key == "model": pass\n'
    assert [f.split(":")[1] for f in mode_literals(spelled, "f.py")] == ["1", "2", "3", "4"]
    assert mode_literals("if mode == WeightMode.ALIASED: pass\n", "f.py") == []


def test_mode_names_are_spelled_only_in_their_home():
    """WeightMode and RolloutWeights (megatron_hybrid/modes.py) are the only home of the names: everyone else
    compares with the members, so a renamed or new mode cannot be missed in one place."""
    found = []
    for path in python_files(SOURCES):
        if path == PACKAGE / "modes.py" or ROOT / "bench" / "results" in path.parents:  # results: records
            continue
        found += mode_literals(path.read_text(), str(path.relative_to(ROOT)))
    assert found == [], "\n".join(found)


def unit_lengths() -> dict[str, tuple[str, int]]:
    """``file:Qualified.name`` -> (kind, lines) of every class and function of the package."""
    out = {}
    for path in python_files([PACKAGE]):
        rel = str(path.relative_to(ROOT))

        def walk(node: ast.AST, prefix: str) -> None:
            for child in ast.iter_child_nodes(node):
                if isinstance(child, (ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
                    kind = "class" if isinstance(child, ast.ClassDef) else "function"
                    out[f"{rel}:{prefix}{child.name}"] = (kind, child.end_lineno - child.lineno + 1)
                    walk(child, f"{prefix}{child.name}.")

        walk(ast.parse(path.read_text(), rel), "")
    return out


def test_units_stay_small():
    lengths = unit_lengths()
    over = {name: n for name, (kind, n) in lengths.items() if n > (MAX_CLASS if kind == "class" else MAX_FUNCTION)}
    new = sorted(set(over) - set(OVER))
    grew = {name: (OVER[name], n) for name, n in over.items() if name in OVER and n > OVER[name]}
    assert not new, f"over {MAX_CLASS} lines (class) or {MAX_FUNCTION} (function): {new}"
    assert not grew, f"grew (was, is): {grew}"


@pytest.mark.parametrize("name", sorted(OVER))
def test_listed_units_exist_and_are_still_over(name):
    """A unit split below the limit leaves the list (keeping it would let it grow back unseen)."""
    lengths = unit_lengths()
    assert name in lengths, f"{name} is gone: remove it from OVER"
    kind, n = lengths[name]
    assert n > (MAX_CLASS if kind == "class" else MAX_FUNCTION), f"{name} is {n} lines now: remove it from OVER"
