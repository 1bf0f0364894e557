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


# ------------------------------------------------------------------ composed objects, narrow ports
#: The classes the runtime and the engine are: composed of lower objects, never mixing them in.
COMPOSED = {
    "lightning_replay.core.runtime": "SegmentRuntime",
    "lightning_replay.core.engine.engine": "ReplayEngine",
}


def test_the_runtime_and_the_engine_mix_in_nothing_from_below():
    """No class defined below the runtime layer is a base of ``SegmentRuntime`` or
    ``ReplayEngine``: a lower object is composed (an attribute the runtime holds, built from a
    narrow port), not mixed in (its methods would read the whole runtime through ``self``)."""
    import importlib

    mixed = []
    for module, name in COMPOSED.items():
        cls = getattr(importlib.import_module(module), name)
        for base in cls.__mro__[1:]:
            owner = _canonical(base.__module__)
            if owner is not None and layer(owner) < layer(module):
                mixed.append(f"{name} <- {owner}.{base.__qualname__}")
    assert not mixed, f"mixins from a lower layer (compose them instead): {mixed}"


def _protocols() -> dict[str, type]:
    """The protocols of core/base/ports.py (and the runtime's own RuntimeHost), by name."""
    from typing import Protocol

    from lightning_replay.core.base import ports

    return {
        n: c
        for n, c in vars(ports).items()
        if isinstance(c, type) and Protocol in c.__mro__ and c is not Protocol
    }


def port_members(cls: type) -> set[str]:
    """Everything a protocol declares, its bases' included: fields and methods."""
    out: set[str] = set()
    for c in cls.__mro__:
        if c.__module__ in ("typing", "builtins") or c.__name__ == "Protocol":
            continue
        out |= set(vars(c).get("__annotations__", {}))
        out |= {k for k, v in vars(c).items() if callable(v) and not k.startswith("__")}
    return out


#: How many members each port declares (its bases' included). A port grows only by an edit
#: here, where a reviewer sees it: the bound is the interface's width today.
PORT_SIZES = {
    "RecordSink": 1,
    "Device": 3,
    "Accounting": 6,
    "Window": 12,
    "ReplayHost": 22,
    "CostSource": 4,
    "ReplaySegment": 19,
    "ProbeHost": 12,
    "ProbedSegment": 23,
    "CheckHost": 13,
    "CheckedSegment": 17,
}


def test_each_port_is_as_wide_as_listed():
    sizes = {n: len(port_members(c)) for n, c in _protocols().items()}
    assert sizes == PORT_SIZES, (
        "a port's width changed: update PORT_SIZES (a port should only grow by what its users "
        f"really need): {sizes}"
    )


def _port_of(note: ast.expr | None, ports: dict[str, type]) -> type | None:
    if note is None:
        return None
    text = ast.unparse(note).strip("\"'")
    return ports.get(text)


def port_reaches(tree: ast.AST, ports: dict[str, type]) -> list[tuple[str, str, str]]:
    """(where, port, member) for every attribute a module reaches on a port: on an argument
    annotated with a port, on ``self.X`` where ``__init__`` stored such an argument as ``X``,
    and on a local name bound to either (``eng = self.host``)."""
    found = []

    def port_field(port: type, attr: str) -> type | None:
        """The port a port's field is declared as (``ReplaySegment.engine: ReplayHost``)."""
        for c in port.__mro__:
            note = vars(c).get("__annotations__", {}).get(attr)
            if note is not None:
                return ports.get(str(note).strip("\"'"))
        return None

    def port_of(v: ast.expr, local: dict[str, type], fields: dict[str, type]) -> type | None:
        """The port expression ``v`` is: a name bound to one, ``self.X`` for a field holding
        one, or a port's field declared as a port (``rt.engine``)."""
        if isinstance(v, ast.Name):
            return local.get(v.id)
        if isinstance(v, ast.Attribute):
            if isinstance(v.value, ast.Name) and v.value.id == "self" and v.attr in fields:
                return fields[v.attr]
            outer = port_of(v.value, local, fields)
            if outer is not None:
                return port_field(outer, v.attr)
        return None

    def scan(fn: ast.AST, where: str, names: dict[str, type], fields: dict[str, type]):
        local = dict(names)
        for node in ast.walk(fn):  # aliases first: ``eng = self.host``, ``eng = rt.engine``
            if (
                isinstance(node, ast.Assign)
                and len(node.targets) == 1
                and isinstance(node.targets[0], ast.Name)
            ):
                p = port_of(node.value, local, fields)
                if p is not None:
                    local[node.targets[0].id] = p
        for node in ast.walk(fn):
            if isinstance(node, ast.Attribute):
                p = port_of(node.value, local, fields)
                if p is not None:
                    found.append((where, p.__name__, node.attr))

    def args_of(fn: ast.FunctionDef) -> dict[str, type]:
        a = fn.args
        out = {}
        for x in a.posonlyargs + a.args + a.kwonlyargs:
            p = _port_of(x.annotation, ports)
            if p is not None:
                out[x.arg] = p
        return out

    for node in ast.walk(tree):
        if isinstance(node, ast.ClassDef):
            fields: dict[str, type] = {}
            for fn in node.body:
                if isinstance(fn, ast.FunctionDef) and fn.name == "__init__":
                    params = args_of(fn)
                    for st in ast.walk(fn):
                        if (
                            isinstance(st, ast.Assign)
                            and isinstance(st.value, ast.Name)
                            and st.value.id in params
                        ):
                            for t in st.targets:
                                if isinstance(t, ast.Attribute) and isinstance(t.value, ast.Name):
                                    fields[t.attr] = params[st.value.id]
            for fn in node.body:
                if isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)):
                    scan(fn, f"{node.name}.{fn.name}", args_of(fn), fields)
        elif isinstance(node, ast.FunctionDef) and node.col_offset == 0:
            scan(node, node.name, args_of(node), {})
    return found


def test_lower_layers_reach_only_what_their_ports_declare():
    """Below the runtime, a module reaches on a port only the members the port declares: the
    port is the whole of what it may touch of the runtime or the engine, and its width
    (PORT_SIZES) is then the width of the interface."""
    ports = _protocols()
    members = {n: port_members(c) for n, c in ports.items()}
    undeclared = set()
    reached = 0
    for m, path in MODULES.items():
        if not _is_core(m) or layer(m) >= LAYERS["lightning_replay.core.runtime"]:
            continue
        for where, port, attr in port_reaches(ast.parse(path.read_text()), ports):
            reached += 1
            if attr not in members[port]:
                undeclared.add((m, where, port, attr))
    assert reached > 100  # the scan sees the probe's and the checks' ports
    assert not undeclared, sorted(undeclared)


def test_the_port_scan_sees_fields_arguments_and_aliases():
    from typing import Protocol

    class Inner(Protocol):
        x: int

    class Port(Protocol):
        a: int
        inner: Inner

    src = (
        "class C:\n"
        "    def __init__(self, p: Port) -> None:\n"
        "        self.port = p\n"
        "    def f(self):\n"
        "        eng = self.port\n"
        "        return self.port.a + eng.b\n"
        "def g(q: 'Port'):\n"
        "    e = q.inner\n"
        "    return q.c + e.y + q.inner.z\n"
    )
    got = {(w, p, a) for w, p, a in port_reaches(ast.parse(src), {"Port": Port, "Inner": Inner})}
    assert got == {
        ("C.f", "Port", "a"),
        ("C.f", "Port", "b"),
        ("g", "Port", "c"),
        ("g", "Port", "inner"),
        ("g", "Inner", "y"),
        ("g", "Inner", "z"),
    }
