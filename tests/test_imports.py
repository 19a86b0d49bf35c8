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
``kernels/``). The package root, a parent of every target, is not such an edge: every importer is inside it, and
Python has run the root's ``__init__.py`` to its end before any module of the package runs.
A package that imports its names on first use (the root, ``reshard/``, ``quant/``, ``kernels/``, ``megatron/``: a
``_LAZY`` table read by a module ``__getattr__``) runs no import of its own; ``from pkg import name`` runs the
module ``_LAZY`` names, so it is an edge to that module (and to ``pkg``, whose ``__init__.py`` runs first).

The rooms above the core import it only through its public names (issue 49). The core is what generation
(``inference/``) and the recipe (``rl/``) are built on: the packages ``reshard/`` (the reshard plan, its executor and
the collectives), ``memory/``, ``quant/``, ``kernels/`` and ``megatron/`` (``patches/`` included), and the modules of
the root that are rooms of one module: ``layout``, ``constraints``, ``groups``, ``transport``, ``modes``,
``validation``, ``core_attention`` and ``checks``. Not in it: ``engine`` (it drives the generator, so it sits above
generation), ``simulate`` and ``report`` (tools over the engine), ``forward`` and the deprecated shims ``arguments`` and
``ppo``, and ``convert/`` (checkpoint conversion, a room beside generation; the recipe's checkpoint export still reads its file
layout from ``convert.layout``). A package's public names are its ``__init__.py``'s ``__all__``; a module's are its
``__all__``, or, where it has none, its names without a leading underscore. So ``from ..reshard import agree_max``,
not ``from ..reshard.communication import agree_max``.
"""

from __future__ import annotations

import ast
import importlib
import importlib.util
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

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
SELF_CONTAINED = (f"{PACKAGE}.kernels", f"{PACKAGE}.memory", f"{PACKAGE}.constraints")
#: What each room must not import: the layers built on it. The reshard core and the FP8 weights sit below the
#: engine, generation, the recipe, the simulation and checkpoint conversion; generation below the engine and the
#: recipe.
_ABOVE_RESHARD = (f"{PACKAGE}.inference", f"{PACKAGE}.rl", f"{PACKAGE}.engine", f"{PACKAGE}.simulate",
                  f"{PACKAGE}.convert")
#: The core (see the module's docstring): packages, whose public names are their ``__init__``'s ``__all__``, and
#: modules of the root.
CORE_PACKAGES = tuple(f"{PACKAGE}.{room}" for room in ("reshard", "memory", "quant", "kernels", "megatron"))
CORE_MODULES = tuple(f"{PACKAGE}.{room}" for room in ("layout", "constraints", "groups", "transport", "modes",
                                                      "validation", "core_attention", "checks"))
#: The rooms that import the core only through its public names.
ABOVE_CORE = (f"{PACKAGE}.inference", f"{PACKAGE}.rl")
#: The imports of the core that do not go through its public names, (file, what is imported) → why.
NOT_THROUGH_PUBLIC_NAMES = {
    ("megatron_hybrid/inference/generator.py", f"{PACKAGE}.megatron.compat"):
        "compat as a namespace: the call reads compat.group_timeout, marked as a megatron-core version difference",
    ("megatron_hybrid/rl/optimizer.py", f"{PACKAGE}.megatron.compat"):
        "compat as a namespace: the call reads compat.te_version_known, marked as a megatron-core version difference",
}
NOT_FOR = {
    # The megatron-core glue: below every room but the root's core_attention, which its models build on, and
    # constraints (the table of layout rules, which GPTArchitecture.validate reads; it imports nothing).
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


def lazy_names(modules: dict[str, Path]) -> dict[str, dict[str, str]]:
    """Package → {name: module} for every package whose ``__init__.py`` imports its names on first use: a dict
    literal ``_LAZY = {"name": ".module"}`` that its module ``__getattr__`` (PEP 562) reads, as the package root's."""
    tables = {}
    for package, path in modules.items():
        if path.name != "__init__.py":
            continue
        for node in ast.parse(path.read_text(), str(path)).body:
            if isinstance(node, ast.Assign) and [getattr(t, "id", None) for t in node.targets] == ["_LAZY"]:
                tables[package] = {name: importlib.util.resolve_name(target, package)
                                   for name, target in ast.literal_eval(node.value).items()}
    return tables


def _from_module(node: ast.ImportFrom, package: str, path: Path) -> str:
    """The module a ``from ... import`` statement of a module in ``package`` imports from, relative imports
    resolved."""
    if not node.level:
        return node.module
    base = package.split(".")
    if node.level - 1 >= len(base):
        raise ValueError(f"{path}:{node.lineno}: a relative import beyond the top-level package")
    base = base[:len(base) - (node.level - 1)]
    return ".".join(base + ([node.module] if node.module else []))


def _package_of(module: str, path: Path) -> str:
    """The package that ``module``'s relative imports start from: itself for an ``__init__.py``."""
    return module if path.name == "__init__.py" else module.rpartition(".")[0]


def imports_of(module: str, path: Path, modules: dict[str, Path], root: Path,
               lazy: dict[str, dict[str, str]]) -> list[Import]:
    """Every import statement of ``module`` (anywhere in it), one :class:`Import` per module it names: ``from pkg
    import name`` names ``pkg.name`` when that is a module, the module that ``lazy[pkg]`` imports ``name`` from
    when ``pkg`` imports it on first use, else ``pkg``."""
    source = path.read_text()
    lines = source.splitlines()
    package = _package_of(module, path)
    found = []
    for node in ast.walk(ast.parse(source, str(path))):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            where = _from_module(node, package, path)
            targets = [f"{where}.{a.name}" if f"{where}.{a.name}" in modules else lazy.get(where, {}).get(a.name, where)
                       for a in node.names]
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


def public_names(module: str) -> set[str]:
    """What ``module`` offers the rooms above it: its ``__all__``, or its names without a leading underscore."""
    imported = importlib.import_module(module)
    names = getattr(imported, "__all__", None)
    return set(names) if names is not None else {n for n in vars(imported) if not n.startswith("_")}


def _not_public(where: str, name: str | None, modules: dict[str, Path], core: tuple[str, ...],
                public: Callable[[str], set[str]]) -> str:
    """Why importing ``name`` from ``where`` (or ``import where`` when ``name`` is None), inside one of the rooms
    ``core``, does not go through the room's public names, and the public alternative; "" when it does."""
    room = next(r for r in core if _within(where, (r,)))
    is_package = where in modules and modules[where].name == "__init__.py"
    if where == room or is_package:
        if name is None or name in public(where):
            return ""
        if f"{where}.{name}" in modules:
            return f"{name} is a module of {where}: import the names it needs from {where}"
        return (f"{name} is not among {where}'s public names: add it to its __all__ if it belongs to the room's "
                f"interface, else to NOT_THROUGH_PUBLIC_NAMES with the reason")
    parts = where.split(".")
    packages = [p for p in (".".join(parts[:i]) for i in range(len(parts) - 1, len(room.split(".")) - 1, -1))
                if p in modules and modules[p].name == "__init__.py"]
    if name is None:
        return f"{where} is private to {room}: import the names it needs from {packages[0]}"
    for package in packages:
        if name in public(package):
            return f"{where} is private to {room}: from {package} import {name}"
    return (f"{where} is private to {room}, and {name} is not among its public names: add it to {room}'s __all__ if "
            f"it belongs to the room's interface, else to NOT_THROUGH_PUBLIC_NAMES with the reason")


def private_imports(module: str, path: Path, modules: dict[str, Path], root: Path, *, core: tuple[str, ...],
                    public: Callable[[str], set[str]]) -> list[tuple[str, str, str, str]]:
    """Each import in ``module`` (anywhere in it) of one of the rooms ``core`` that does not go through the room's
    public names (``public(package)``), as (file, the module or name imported, ``FILE:LINE: statement``, why and
    the public alternative)."""
    source = path.read_text()
    lines = source.splitlines()
    file = path.relative_to(root).as_posix()
    found = []
    for node in ast.walk(ast.parse(source, str(path))):
        if isinstance(node, ast.Import):
            pairs = [(alias.name, None) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            where = _from_module(node, _package_of(module, path), path)
            pairs = [(where, alias.name) for alias in node.names]
        else:
            continue
        for where, name in pairs:
            why = _within(where, core) and _not_public(where, name, modules, core, public)
            if why:
                found.append((file, where if name is None else f"{where}.{name}",
                              f"{file}:{node.lineno}: {lines[node.lineno - 1].strip()}", why))
    return found


def import_graph(modules: dict[str, Path], root: Path) -> list[Import]:
    """Every import of every module in ``modules`` (files under ``root``), with the packages each one runs."""
    lazy = lazy_names(modules)
    return with_packages([imp for module, path in modules.items()
                          for imp in imports_of(module, path, modules, root, lazy)], modules)


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
    assert (f"{PACKAGE}.rl.passes", f"{PACKAGE}.megatron.compat") in edges  # a name megatron/ imports on first use
    assert (f"{PACKAGE}.megatron.sharding", f"{PACKAGE}.megatron.compat") in edges  # function-local
    assert (f"{PACKAGE}.rl.checkpoint", PATCHES) in edges  # from ..megatron.patches import name
    assert (f"{PACKAGE}.rl.checkpoint", f"{PACKAGE}.megatron") in edges  # ... runs megatron/__init__.py first
    assert (f"{PACKAGE}.inference.fused", f"{PACKAGE}.quant.fp8_kernels") in edges  # from ..quant import FP8_MAX
    assert (f"{PACKAGE}.inference.fused", f"{PACKAGE}.quant") in edges  # ... runs quant/__init__.py first
    assert (f"{PACKAGE}.rl.passes", f"{PACKAGE}.rl") not in edges  # its own package: already being imported
    assert (f"{PACKAGE}.rl.passes", PACKAGE) not in edges  # the root, every importer's package: already run


def test_no_import_circle(modules, edges):
    report = circles_report(modules, edges)
    assert not report, "\n" + report


def test_the_core_is_imported_through_its_public_names(modules):
    """inference/ and rl/ import the core only as ``from megatron_hybrid.reshard import agree_max`` (a name of the
    package's ``__all__``), never from a module inside one of its packages; the exceptions are listed, each with
    its reason, and each is still needed."""
    found = [hit for module, path in modules.items() if _within(module, ABOVE_CORE)
             for hit in private_imports(module, path, modules, ROOT, core=CORE_PACKAGES + CORE_MODULES,
                                        public=public_names)]
    bad: dict[str, list[str]] = {}
    for file, what, statement, why in found:
        if (file, what) not in NOT_THROUGH_PUBLIC_NAMES:
            bad.setdefault(statement, []).append(why)
    assert not bad, "inference/ and rl/ import the core other than through its public names:\n" + "\n".join(
        f"{statement}\n" + "\n".join(f"    {why}" for why in whys) for statement, whys in bad.items())
    unused = NOT_THROUGH_PUBLIC_NAMES.keys() - {(file, what) for file, what, _, _ in found}
    assert not unused, f"exceptions that no import needs any more: {sorted(unused)}"


@pytest.mark.parametrize("package", CORE_PACKAGES + (PATCHES,))
def test_the_core_public_names_are_there(package):
    """Every name of a core package's ``__all__`` is one, imported on first use where the package does so."""
    imported = importlib.import_module(package)
    assert imported.__all__, package
    missing = [name for name in imported.__all__ if not hasattr(imported, name)]
    assert not missing, f"{package}.__all__ names what it does not have: {missing}"


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
    ``pkg.sub`` importing one another do not make an edge to ``pkg.sub``; a module two packages down is an edge to
    both (but not to the root, the importer's own package)."""
    pkg = tmp_path / "pkg"
    (pkg / "sub" / "inner").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "a.py").write_text("from .sub.k import thing\n")
    (pkg / "b.py").write_text("from .sub.inner.j import deep\n")
    (pkg / "sub" / "__init__.py").write_text("from .m import other\n")
    (pkg / "sub" / "k.py").write_text("thing = 1\n")
    (pkg / "sub" / "m.py").write_text("from . import k\nfrom ..a import thing\nother = 2\n")
    (pkg / "sub" / "inner" / "__init__.py").write_text("")
    (pkg / "sub" / "inner" / "j.py").write_text("deep = 3\n")
    modules = module_files(tmp_path, "pkg")
    edges = import_graph(modules, tmp_path)
    assert ("pkg.sub.m", "pkg.sub") not in {(e.source, e.target) for e in edges}
    assert {e.target for e in edges if e.source == "pkg.b"} == {"pkg.sub.inner.j", "pkg.sub.inner", "pkg.sub"}
    assert strongly_connected(list(modules), edges) == [["pkg.a", "pkg.sub", "pkg.sub.m"]]
    assert "pkg/a.py:1: from .sub.k import thing" in circles_report(modules, edges)


def test_a_circle_through_a_lazy_name_is_reported(tmp_path):
    """``a`` imports a name that ``pkg.sub`` imports on first use from ``pkg.sub.k``, which imports ``a``: a circle,
    although ``pkg/sub/__init__.py`` imports nothing. A lazy name of the root is an edge to its module too."""
    pkg = tmp_path / "pkg"
    (pkg / "sub").mkdir(parents=True)
    (pkg / "__init__.py").write_text('_LAZY = {"other": ".b"}\n')
    (pkg / "a.py").write_text("from .sub import thing\n")
    (pkg / "b.py").write_text("other = 2\n")
    (pkg / "c.py").write_text("from pkg import other\n")
    (pkg / "sub" / "__init__.py").write_text('_LAZY = {"thing": ".k"}\n')
    (pkg / "sub" / "k.py").write_text("from ..a import x\nthing = 1\n")
    modules = module_files(tmp_path, "pkg")
    edges = import_graph(modules, tmp_path)
    assert ("pkg.c", "pkg.b") in {(e.source, e.target) for e in edges}
    assert strongly_connected(list(modules), edges) == [["pkg.a", "pkg.sub.k"]]


def test_a_private_import_of_the_core_is_reported(tmp_path):
    """Each way around a core package's public names is found, with its line and the public alternative; the
    public names themselves, a room imported as a whole (a package, a module of the root) and imports outside the
    core are not."""
    pkg = tmp_path / "pkg"
    (pkg / "core" / "sub").mkdir(parents=True)
    for name in ("__init__.py", "core/__init__.py", "core/sub/__init__.py", "other.py", "core/impl.py",
                 "core/sub/deep.py", "solo.py"):
        (pkg / name).write_text("")
    (pkg / "client.py").write_text("\n".join([
        "from .core import a", "from .core.impl import a, _b", "import pkg.core.impl", "from .core.sub.deep import d",
        "from . import core, other", "from .core import impl", "from .solo import s, _t", "from .other import anything",
        "import pkg.solo, pkg.core.sub"]))
    public = {"pkg.core": {"a"}, "pkg.core.sub": {"d"}, "pkg.solo": {"s"}}
    found = private_imports("pkg.client", pkg / "client.py", module_files(tmp_path, "pkg"), tmp_path,
                            core=("pkg.core", "pkg.solo"), public=public.__getitem__)
    assert [(what, statement) for _, what, statement, _ in found] == [
        ("pkg.core.impl.a", "pkg/client.py:2: from .core.impl import a, _b"),
        ("pkg.core.impl._b", "pkg/client.py:2: from .core.impl import a, _b"),
        ("pkg.core.impl", "pkg/client.py:3: import pkg.core.impl"),
        ("pkg.core.sub.deep.d", "pkg/client.py:4: from .core.sub.deep import d"),
        ("pkg.core.impl", "pkg/client.py:6: from .core import impl"),
        ("pkg.solo._t", "pkg/client.py:7: from .solo import s, _t"),
    ]
    advice = [why for _, _, _, why in found]
    assert advice[0] == "pkg.core.impl is private to pkg.core: from pkg.core import a"
    assert "_b is not among its public names" in advice[1]
    assert advice[3] == "pkg.core.sub.deep is private to pkg.core: from pkg.core.sub import d"
    assert advice[4] == "impl is a module of pkg.core: import the names it needs from pkg.core"


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
    itself is set and cleared in one place, the stage's forward (StageForwards.forward, and inside StepContext.step)."""
    where = {w.split(":")[0] + " in " + w.split(" in ")[1] for w in _step_state_writes(ROOT)}
    assert where == {
        "megatron_hybrid/inference/attention.py in install_kv_attention",
        "megatron_hybrid/inference/norms.py in install_step_norms",
        "megatron_hybrid/inference/moe.py in install_step_moe",
        "megatron_hybrid/inference/context.py in __init__",
        "megatron_hybrid/inference/context.py in step",
        "megatron_hybrid/inference/stage_forwards.py in forward",
    }, sorted(_step_state_writes(ROOT))
