"""The package's import graph: no circle, and the layers import only downwards.

The graph is read from the source, not from an import: every ``import`` / ``from ... import`` statement of every
module of ``megatron_hybrid/`` (``megatron/patches/`` included), at the top of a module, inside a function or under
``if TYPE_CHECKING:`` alike, since a function-local import only hides a circle.
Relative imports are resolved; ``from pkg import name`` is an edge to ``pkg.name`` when that is a module, else to
``pkg``. Importing ``pkg.sub.mod`` runs ``pkg/sub/__init__.py`` first, so it is an edge to the package ``pkg.sub``
too, unless the importer is inside ``pkg.sub`` (its own package is already being imported: ``rl/__init__.py``
imports its modules, which import one another as ``.phases``). Without those edges a circle through a package's
``__init__`` stays hidden: ``fp8_kernels`` imported ``inference.kernels``, whose package imports the generator,
which reaches the fused decoder, which imports ``fp8_kernels`` (issue 49; the shared helpers now live in
``kernels/``).
"""

from __future__ import annotations

import ast
import importlib
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = "megatron_hybrid"
#: Folders whose modules the library must never import.
NOT_LIBRARY = ("tests", "examples", "bench", "tools")
#: What ``megatron/patches/`` (behaviour changes of megatron-core, below everything of ours) must not import: the
#: layers built on it. Today it imports nothing of the package beyond itself.
PATCHES = f"{PACKAGE}.megatron.patches"
NOT_FOR_PATCHES = (f"{PACKAGE}.rl", f"{PACKAGE}.inference", f"{PACKAGE}.engine")
#: Rooms at the bottom of the package: they import nothing of it outside themselves.
SELF_CONTAINED = (f"{PACKAGE}.kernels", f"{PACKAGE}.memory")
#: What each room must not import: the layers built on it. The reshard core and the FP8 weights sit below the
#: engine, generation, the recipe, the simulation and checkpoint conversion; generation below the engine and the
#: recipe.
_ABOVE_RESHARD = (f"{PACKAGE}.inference", f"{PACKAGE}.rl", f"{PACKAGE}.engine", f"{PACKAGE}.simulate",
                  f"{PACKAGE}.convert")
NOT_FOR = {
    # The megatron-core glue: below every room but the root's core_attention, which its models build on.
    f"{PACKAGE}.megatron": _ABOVE_RESHARD + (f"{PACKAGE}.reshard", f"{PACKAGE}.quant", f"{PACKAGE}.memory",
                                             f"{PACKAGE}.kernels", f"{PACKAGE}.groups", f"{PACKAGE}.layout",
                                             f"{PACKAGE}.validation", f"{PACKAGE}.transport", f"{PACKAGE}.report"),
    f"{PACKAGE}.reshard": _ABOVE_RESHARD,
    f"{PACKAGE}.quant": _ABOVE_RESHARD,
    f"{PACKAGE}.inference": (f"{PACKAGE}.rl", f"{PACKAGE}.engine"),
}


@dataclass(frozen=True)
class Import:
    """One import statement's edge: ``source`` imports ``target`` at ``path:line``."""

    source: str
    target: str
    """The module imported: ours (a key of the graph) or, for other packages, the name as written."""
    where: str
    """``FILE:LINE`` of the statement, the file relative to the root of the tree."""
    text: str
    """The statement's (first) source line."""

    def __str__(self) -> str:
        return f"{self.where}: {self.text.strip()}"


def module_files(root: Path, package: str, extra: dict[str, Path] | None = None) -> dict[str, Path]:
    """Module name → file for every ``.py`` under ``root/package`` (and under each ``extra`` folder, installed
    under the given module name)."""
    folders = {package: root / package, **(extra or {})}
    modules = {}
    for name, folder in folders.items():
        for path in sorted(folder.rglob("*.py")):
            parts = [name, *path.relative_to(folder).with_suffix("").parts]
            if parts[-1] == "__init__":
                parts.pop()
            modules[".".join(parts)] = path
    return modules


def _resolve(name: str, modules: dict[str, Path]) -> str:
    """``name``, or the longest prefix of it that is one of ours (``pkg._C``, an extension module, is ``pkg``)."""
    while name not in modules and "." in name:
        name = name.rsplit(".", 1)[0]
    return name


def imports_of(module: str, path: Path, modules: dict[str, Path], root: Path) -> list[Import]:
    """Every import statement of ``module`` (anywhere in it), one :class:`Import` per module it names."""
    source = path.read_text()
    lines = source.splitlines()
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    found = []
    for node in ast.walk(ast.parse(source, str(path))):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                if node.level - 1 >= len(base):
                    raise ValueError(f"{path}:{node.lineno}: a relative import beyond the top-level package")
                base = base[:len(base) - (node.level - 1)]
                where = ".".join(base + ([node.module] if node.module else []))
            else:
                where = node.module
            targets = [f"{where}.{a.name}" if f"{where}.{a.name}" in modules else where for a in node.names]
        else:
            continue
        for target in dict.fromkeys(targets):
            ours = _resolve(target, modules)
            found.append(Import(module, ours if ours in modules else target,
                                f"{path.relative_to(root).as_posix()}:{node.lineno}", lines[node.lineno - 1]))
    return found


def with_packages(edges: list[Import], modules: dict[str, Path]) -> list[Import]:
    """``edges`` and, for each, an edge to every package of ours that the import runs first: each parent package
    of its target that is not the importer itself or one of the importer's own packages."""
    out = list(edges)
    for e in edges:
        parts = e.target.split(".")
        for i in range(1, len(parts)):
            parent = ".".join(parts[:i])
            if parent in modules and e.source != parent and not e.source.startswith(parent + "."):
                out.append(Import(e.source, parent, e.where, e.text))
    return out


def import_graph(modules: dict[str, Path], root: Path) -> list[Import]:
    """Every import of every module in ``modules`` (files under ``root``), with the packages each one runs."""
    return with_packages([imp for module, path in modules.items() for imp in imports_of(module, path, modules, root)],
                         modules)


def strongly_connected(nodes: list[str], edges: list[Import]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan), each sorted."""
    succ: dict[str, set[str]] = {n: set() for n in nodes}
    for e in edges:
        if e.target in succ and e.target != e.source:
            succ[e.source].add(e.target)
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(succ[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(succ):
        if v not in index:
            visit(v)
    return sorted(found)


def circles_report(modules: dict[str, Path], edges: list[Import]) -> str:
    """Each import circle's modules and the import lines that form it ("" when there is none)."""
    report = []
    for component in strongly_connected(list(modules), edges):
        inside = set(component)
        lines = [f"    {e}" for e in edges if e.source in inside and e.target in inside and e.source != e.target]
        report.append(f"import circle of {len(component)} modules: {', '.join(component)}\n" + "\n".join(lines))
    return "\n".join(report)


@pytest.fixture(scope="module")
def modules() -> dict[str, Path]:
    return module_files(ROOT, PACKAGE)


@pytest.fixture(scope="module")
def edges(modules) -> list[Import]:
    return import_graph(modules, ROOT)


def test_the_graph_is_read(modules, edges):
    """The walk finds the package's modules and their imports of every kind (not vacuously acyclic)."""
    edges = {(e.source, e.target) for e in edges}
    assert {f"{PACKAGE}.rl.passes", f"{PATCHES}.cpu", f"{PACKAGE}.convert.virtual"} <= modules.keys()
    assert (f"{PACKAGE}.rl.passes", f"{PACKAGE}.rl.ppo") in edges  # from . import ppo: a module
    assert (f"{PACKAGE}.rl.passes", f"{PACKAGE}.megatron.compat") in edges  # from ..megatron.compat import name
    assert (f"{PACKAGE}.megatron.sharding", f"{PACKAGE}.megatron.compat") in edges  # function-local
    assert (f"{PACKAGE}.rl.checkpoint", f"{PATCHES}.distrib_optimizer") in edges  # into megatron/patches/
    assert (f"{PACKAGE}.inference.fused", f"{PACKAGE}.quant.fp8_kernels") in edges  # from ..quant.fp8_kernels
    assert (f"{PACKAGE}.inference.fused", f"{PACKAGE}.quant") in edges  # ... runs quant/__init__.py first
    assert (f"{PACKAGE}.rl.passes", f"{PACKAGE}.rl") not in edges  # its own package: already being imported


def test_no_import_circle(modules, edges):
    report = circles_report(modules, edges)
    assert not report, "\n" + report


def test_library_does_not_import_scripts(edges):
    bad = [str(e) for e in edges if e.target.split(".")[0] in NOT_LIBRARY]
    assert not bad, "the library imports tests, examples, bench or tools:\n" + "\n".join(bad)


def _within(name: str, prefixes) -> bool:
    """``name`` is one of ``prefixes`` or inside one of them."""
    return any(name == p or name.startswith(p + ".") for p in prefixes)


@pytest.mark.parametrize("room", SELF_CONTAINED)
def test_bottom_rooms_import_nothing_else_of_the_package(edges, room):
    bad = [str(e) for e in edges if _within(e.source, (room,)) and _within(e.target, (PACKAGE,))
           and not _within(e.target, (room,))]
    assert not bad, f"{room} imports the package outside itself:\n" + "\n".join(bad)


@pytest.mark.parametrize("room", sorted(NOT_FOR))
def test_rooms_import_only_downwards(edges, room):
    bad = [str(e) for e in edges if _within(e.source, (room,)) and _within(e.target, NOT_FOR[room])]
    assert not bad, f"{room} imports a layer built on it:\n" + "\n".join(bad)


def test_patches_stay_below_the_library(edges):
    patches = PATCHES
    bad = [str(e) for e in edges if (e.source == patches or e.source.startswith(patches + "."))
           and any(e.target == p or e.target.startswith(p + ".") for p in NOT_FOR_PATCHES)]
    assert not bad, "patches/ imports a layer built on it:\n" + "\n".join(bad)


@pytest.mark.parametrize("back_import", [
    "from . import a",
    "from .a import thing",
    "import pkg.a",
    "def later():\n    from pkg import a",
    "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from .a import thing",
])
def test_a_circle_is_reported(tmp_path, back_import):
    """A two-module circle, closed by each spelling of an import, is found and named with its import lines;
    a module that only imports into the circle is not part of it."""
    pkg = tmp_path / "pkg"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "a.py").write_text("import os\nfrom .b import other\nthing = 1\n")
    (pkg / "b.py").write_text(f"{back_import}\nother = 2\n")
    (pkg / "c.py").write_text("from pkg import a, b\n")
    modules = module_files(tmp_path, "pkg")
    edges = import_graph(modules, tmp_path)
    assert strongly_connected(list(modules), edges) == [["pkg.a", "pkg.b"]]
    report = circles_report(modules, edges)
    assert "import circle of 2 modules: pkg.a, pkg.b" in report
    assert "pkg/a.py:2: from .b import other" in report
    assert f"pkg/b.py:{back_import.count(chr(10)) + 1}: {back_import.splitlines()[-1].strip()}" in report
    assert "pkg/c.py" not in report


def test_a_circle_through_a_package_init_is_reported(tmp_path):
    """``a`` imports ``pkg.sub.k``, which imports nothing; but importing it runs ``pkg/sub/__init__.py``, which
    imports ``pkg.sub.m``, which imports ``a``: a circle (issue 49's fp8_kernels → inference.kernels). Modules of
    ``pkg.sub`` importing one another do not make an edge to ``pkg.sub``."""
    pkg = tmp_path / "pkg"
    (pkg / "sub").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "a.py").write_text("from .sub.k import thing\n")
    (pkg / "sub" / "__init__.py").write_text("from .m import other\n")
    (pkg / "sub" / "k.py").write_text("thing = 1\n")
    (pkg / "sub" / "m.py").write_text("from . import k\nfrom ..a import thing\nother = 2\n")
    modules = module_files(tmp_path, "pkg")
    edges = import_graph(modules, tmp_path)
    assert ("pkg.sub.m", "pkg.sub") not in {(e.source, e.target) for e in edges}
    assert strongly_connected(list(modules), edges) == [["pkg.a", "pkg.sub", "pkg.sub.m"]]
    assert "pkg/a.py:1: from .sub.k import thing" in circles_report(modules, edges)


@pytest.mark.filterwarnings("ignore::DeprecationWarning")  # test_old_import_paths_warn checks the warning
def test_old_import_paths_still_work():
    """The recipe's arguments and the PPO algebra moved into ``rl/``; their former paths re-export them."""
    for old, new, names in (("arguments", "rl.arguments", ("add_hybrid_args", "add_megatron_args", "validate_args",
                                                           "TINY_MODEL", "TOKENIZER_TYPES")),
                            ("arguments", "checks", ("check_number", "output_dir_error")),
                            ("arguments", "rl.rewards", ("load_callable",)),
                            ("ppo", "rl.ppo", ("policy_loss", "compute_gae", "vocab_parallel_logprobs_entropy",
                                               "KLConfig", "make_kl_controller"))):
        old_module = importlib.import_module(f"{PACKAGE}.{old}")
        new_module = importlib.import_module(f"{PACKAGE}.{new}")
        for name in names:
            assert getattr(old_module, name) is getattr(new_module, name), (old, name)


def test_old_import_paths_warn(monkeypatch):
    """The former paths are deprecated: importing one warns, at the importer's line, and names the new one."""
    for old in ("arguments", "ppo"):
        importlib.import_module(f"{PACKAGE}.{old}")
        monkeypatch.delitem(sys.modules, f"{PACKAGE}.{old}")  # imported afresh below; the old one is put back
    with pytest.warns(DeprecationWarning, match=r"megatron_hybrid\.rl\.arguments") as arguments_warning:
        import megatron_hybrid.arguments  # noqa: F401
    with pytest.warns(DeprecationWarning, match=r"megatron_hybrid\.rl\.ppo") as ppo_warning:
        import megatron_hybrid.ppo  # noqa: F401
    assert [r.filename for r in (*arguments_warning, *ppo_warning)] == [__file__] * 2


def _step_state_writes(root: Path) -> list[str]:
    """``FILE:LINE in FUNCTION`` of every statement in the package that writes step state: an assignment to a
    module attribute ``step_context`` (or the old ``kv_step`` / ``in_step``), a write of ``StepContext.kv``, or
    entering a context's ``step(...)``."""
    out = []
    for path in sorted((root / PACKAGE).rglob("*.py")):
        tree = ast.parse(path.read_text(), filename=str(path))
        for func in [n for n in ast.walk(tree) if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))]:
            for node in ast.walk(func):
                targets = node.targets if isinstance(node, ast.Assign) else (
                    [node.target] if isinstance(node, (ast.AugAssign, ast.AnnAssign)) else [])
                hits = [t for t in targets if isinstance(t, ast.Attribute)
                        and t.attr in ("step_context", "kv_step", "in_step", "kv")]
                if (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "step"
                        and isinstance(node.func.value, ast.Attribute) and node.func.value.attr == "context"):
                    hits.append(node)
                out += [f"{path.relative_to(root).as_posix()}:{h.lineno} in {func.name}" for h in hits]
    return sorted(set(out))


def test_step_state_is_set_on_modules_only_by_the_stage_runner():
    """The modules reach the step through the context the runner gave them once (the install functions); the step
    itself is set and cleared in one place, the runner's forward (and inside StepContext.step)."""
    where = {w.split(":")[0] + " in " + w.split(" in ")[1] for w in _step_state_writes(ROOT)}
    assert where == {
        "megatron_hybrid/inference/attention.py in install_kv_attention",
        "megatron_hybrid/inference/norms.py in install_step_norms",
        "megatron_hybrid/inference/moe.py in install_step_moe",
        "megatron_hybrid/inference/context.py in __init__",
        "megatron_hybrid/inference/context.py in step",
        "megatron_hybrid/inference/runner.py in _forward",
    }, sorted(_step_state_writes(ROOT))
