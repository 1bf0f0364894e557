"""The layer map (docs/architecture.md) holds in the code: no upward import, no cycle among the
core's modules, the core never imports Lightning, and the map lists exactly the modules there are.

Every import counts: at module level, inside functions (lazy), and under ``TYPE_CHECKING``
(annotations only). Imports of an old module path (lightning_replay/_aliases.py) count as imports
of the module it names now.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

from lightning_replay._aliases import MOVED

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "lightning_replay"
DOC = ROOT / "docs" / "architecture.md"

#: Layers from bottom to top, by module path prefix (the longest prefix wins). A module may
#: import its own layer and the layers below; never one above.
LAYERS = {
    "lightning_replay.errors": 0,
    "lightning_replay._compat": 0,
    "lightning_replay._aliases": 0,
    "lightning_replay.core.base": 1,
    "lightning_replay.core.mechanisms": 2,
    "lightning_replay.core.replay": 3,
    "lightning_replay.core.runtime": 4,
    "lightning_replay.core.engine": 5,
    "lightning_replay.tools": 6,
    "lightning_replay.strategies": 6,
    "lightning_replay.callbacks": 6,
    "lightning_replay.loggers": 6,
    "lightning_replay": 7,  # the package itself: the public names users import
    "lightning_replay.cli": 8,
    "lightning_replay.apps": 8,
    "lightning_replay.demos": 8,
}
NAMES = {
    0: "foundation",
    1: "state and contract types",
    2: "discovery and preservation mechanisms",
    3: "probe, restore and checks",
    4: "per-segment runtime",
    5: "engine and planner",
    6: "Lightning shells and tools",
    7: "the public package",
    8: "apps, demos and the command line",
}

#: Imports that break the map today, as (importer, imported, kind): each goes when the code
#: is fixed, and the test fails if one listed no longer happens (so the list only shrinks).
KNOWN: set[tuple[str, str, str]] = set()
#: Cycles among core modules today (each a sorted list of modules); the same rule as KNOWN.
KNOWN_CYCLES: list[list[str]] = []


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join(parts)


def _modules() -> dict[str, Path]:
    return {_module_name(p): p for p in sorted(PACKAGE.rglob("*.py"))}


MODULES = _modules()


def _canonical(name: str) -> str | None:
    """The package module an imported name is (old paths resolved), or None if outside."""
    while name:
        name = MOVED.get(name, name)
        if name in MODULES:
            return name
        if "." not in name:
            return None
        name = name.rsplit(".", 1)[0]
    return None


def _is_type_checking(test: ast.expr) -> bool:
    return "TYPE_CHECKING" in ast.unparse(test)


def imports(module: str) -> list[tuple[str, str, int]]:
    """(imported module, kind, line) for every import in ``module``: kind is ``"top"``,
    ``"lazy"`` (inside a function) or ``"type"`` (under ``TYPE_CHECKING``)."""
    path = MODULES[module]
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    out: list[tuple[str, str, int]] = []

    def targets(node: ast.Import | ast.ImportFrom) -> list[str]:
        if isinstance(node, ast.Import):
            return [a.name for a in node.names]
        if node.level:
            base = package.split(".")[: len(package.split(".")) - node.level + 1]
            stem = ".".join(base + ([node.module] if node.module else []))
        else:
            stem = node.module or ""
        # ``from pkg import sub`` imports the submodule when there is one
        return [
            f"{stem}.{a.name}"
            if MOVED.get(f"{stem}.{a.name}", f"{stem}.{a.name}") in MODULES
            else stem
            for a in node.names
        ]

    def visit(node: ast.AST, kind: str) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.If) and _is_type_checking(child.test):
                for c in child.body:
                    visit_one(c, "type")
                for c in child.orelse:
                    visit_one(c, kind)
            else:
                visit_one(child, kind)

    def visit_one(node: ast.AST, kind: str) -> None:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
            visit(node, "lazy" if kind == "top" else kind)
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            for t in targets(node):
                out.append((t, kind, node.lineno))
        else:
            visit(node, kind)

    visit(ast.parse(path.read_text()), "top")
    return out


def layer(module: str) -> int:
    best = max((p for p in LAYERS if module == p or module.startswith(p + ".")), key=len)
    return LAYERS[best]


def _edges() -> dict[tuple[str, str], set[str]]:
    """(importer, imported) -> the kinds of import, within the package."""
    edges: dict[tuple[str, str], set[str]] = {}
    for m in MODULES:
        for target, kind, _ in imports(m):
            t = _canonical(target)
            if t is not None and t != m:
                edges.setdefault((m, t), set()).add(kind)
    return edges


def _is_core(m: str) -> bool:
    return layer(m) <= LAYERS["lightning_replay.core.engine"]


def upward_imports() -> set[tuple[str, str, str]]:
    return {
        (a, b, kind) for (a, b), kinds in _edges().items() for kind in kinds if layer(b) > layer(a)
    }


def core_cycles(core_only: bool = True) -> list[list[str]]:
    """The strongly connected components of more than one core module (of any module with
    ``core_only=False``), by Tarjan's algorithm."""
    graph: dict[str, set[str]] = {m: set() for m in MODULES if _is_core(m) or not core_only}
    for a, b in _edges():
        if a in graph and b in graph:
            graph[a].add(b)
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    out: list[list[str]] = []

    def strong(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                strong(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            strong(v)
    return out


def test_no_module_imports_a_layer_above_its_own():
    found = upward_imports()
    new = sorted(found - KNOWN)
    assert not new, "imports up the layer map (importer, imported, kind):\n" + "\n".join(
        f"  {a} ({NAMES[layer(a)]}) -> {b} ({NAMES[layer(b)]}) [{k}]" for a, b, k in new
    )
    gone = sorted(KNOWN - found)
    assert not gone, f"fixed, take them off KNOWN: {gone}"


def test_no_cycle_among_core_modules():
    assert core_cycles() == KNOWN_CYCLES


def test_no_cycle_anywhere_in_the_package():
    # (the shells, tools and apps too: the public package imports the shells, never the reverse)
    assert core_cycles(core_only=False) == KNOWN_CYCLES


def test_the_core_never_imports_lightning():
    bad = [
        (m, t, line)
        for m in MODULES
        if _is_core(m)
        for t, _, line in imports(m)
        if t.split(".")[0] in ("lightning", "pytorch_lightning", "lightning_fabric")
    ]
    assert bad == []


def test_the_checker_sees_lazy_and_type_only_imports(tmp_path, monkeypatch):
    # (a referee that would miss the back edges this test exists for would pass vacuously)
    src = (
        "from typing import TYPE_CHECKING\n"
        "if TYPE_CHECKING:\n"
        "    from lightning_replay.engine import ReplayEngine\n"
        "def f():\n"
        "    from lightning_replay import runtime\n"
    )
    path = PACKAGE / "core" / "base" / "_i29_fake.py"
    monkeypatch.setitem(MODULES, "lightning_replay.core.base._i29_fake", path)
    monkeypatch.setattr(Path, "read_text", lambda self, *a, **k: src)
    found = {(t, k) for t, k, _ in imports("lightning_replay.core.base._i29_fake")}
    assert ("lightning_replay.engine", "type") in found
    assert ("lightning_replay.runtime", "lazy") in found
    assert _canonical("lightning_replay.runtime") == "lightning_replay.core.runtime"


#: (module, annotated name) where a module below the runtime still takes the runtime or engine
KNOWN_WIDE: set[tuple[str, str]] = set()


def wide_arguments() -> set[tuple[str, str]]:
    """Where a module below the runtime layer annotates an argument or field with
    ``SegmentRuntime`` or ``ReplayEngine`` (it should take a protocol of core/base/ports.py)."""
    out = set()
    for m, path in MODULES.items():
        if layer(m) >= LAYERS["lightning_replay.core.runtime"]:
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            notes = []
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                a = node.args
                notes = [
                    x.annotation for x in a.posonlyargs + a.args + a.kwonlyargs if x.annotation
                ]
            elif isinstance(node, ast.AnnAssign):
                notes = [node.annotation]
            for note in notes:
                text = ast.unparse(note)
                for wide in ("SegmentRuntime", "ReplayEngine"):
                    if wide in text:
                        out.add((m, wide))
    return out


def test_no_module_below_the_runtime_takes_the_runtime_or_the_engine():
    found = wide_arguments()
    assert not sorted(found - KNOWN_WIDE), sorted(found - KNOWN_WIDE)
    assert not sorted(KNOWN_WIDE - found), (
        f"fixed, take them off KNOWN_WIDE: {sorted(KNOWN_WIDE - found)}"
    )


# ------------------------------------------------------------------ the map in the docs
def documented_modules() -> set[str]:
    """Modules the map names: ``lightning_replay/...py`` paths in its tables."""
    text = DOC.read_text()
    return {_module_name(ROOT / p) for p in re.findall(r"`(lightning_replay/[\w/]+\.py)`", text)}


def test_every_module_the_map_lists_exists():
    missing = sorted(documented_modules() - set(MODULES))
    assert not missing, f"docs/architecture.md lists modules that do not exist: {missing}"


def test_every_module_is_in_the_map():
    # (every core module, and the shells, tools, apps and demos above it)
    modules = {m for m in MODULES if MODULES[m].name != "__init__.py"}
    unlisted = sorted(modules - documented_modules())
    assert not unlisted, f"docs/architecture.md does not list: {unlisted}"


@pytest.mark.parametrize("module", sorted(MODULES))
def test_every_module_has_a_layer(module):
    assert layer(module) in NAMES
