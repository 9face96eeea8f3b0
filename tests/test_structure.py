"""The package's structure rules: no import circle between its modules (imports at module
level and inside functions alike), no pair of folders importing each other both ways, and no
package file over 600 lines.

The import graph is built with `ast` from the source text, so nothing is imported to check
it: every `import x` / `from x import y` anywhere in a module is an edge to the colibri
module it names (`from pkg import name` is an edge to pkg.name when that is a module, else
to pkg's __init__). A package's __init__ importing its submodules is an edge like any
other; the implicit import of a parent package by its children is not.
"""
from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parent.parent / "colibri"
MAX_LINES = 600
SOURCES = ("*.py", "*.pyx", "*.pxi", "*.h")


def _modules() -> dict[str, Path]:
    """{dotted module name: file} of the package's Python modules."""
    mods = {}
    for f in PACKAGE.rglob("*.py"):
        parts = list(f.relative_to(PACKAGE.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        mods[".".join(parts)] = f
    return mods


def import_graph() -> dict[str, set[str]]:
    """{module: the colibri modules it imports}, compiled extensions (.pyx) left out."""
    mods = _modules()
    compiled = {".".join(f.relative_to(PACKAGE.parent).with_suffix("").parts)
                for f in PACKAGE.rglob("*.pyx")}
    graph: dict[str, set[str]] = {}
    for name, path in mods.items():
        here = name.split(".") if path.name == "__init__.py" else name.split(".")[:-1]
        deps: set[str] = set()
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                deps.update(a.name for a in node.names if a.name in mods)
            elif isinstance(node, ast.ImportFrom):
                base = here[:len(here) - node.level + 1] if node.level else []
                target = ".".join(base + ([node.module] if node.module else []))
                for a in node.names:
                    sub = f"{target}.{a.name}"
                    if sub in mods:
                        deps.add(sub)
                    elif sub not in compiled and target in mods:
                        deps.add(target)
        deps.discard(name)
        graph[name] = deps
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found = []
    for root in sorted(graph):
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            v, it = work[-1]
            w = next(it, None)
            if w is not None:
                if w not in index:
                    index[w] = low[w] = len(index)
                    stack.append(w)
                    on_stack.add(w)
                    work.append((w, iter(sorted(graph[w]))))
                elif w in on_stack:
                    low[v] = min(low[v], index[w])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[v])
            if low[v] == index[v]:
                comp = []
                while True:
                    w = stack.pop()
                    on_stack.discard(w)
                    comp.append(w)
                    if w == v:
                        break
                if len(comp) > 1:
                    found.append(sorted(comp))
    return found


# The one upward reach the folder rule allows: a notebook asks Model._repr_html_ for its HTML,
# which the display tool above the engine makes (loaded on demand, inside the method).
ON_DEMAND_UPWARD = {("colibri.engine.model", "colibri.tools.display")}


def floor(module: str) -> str | None:
    """The first level under colibri/ that a module is in: its folder (colibri.engine.moe ->
    "engine") or, for a top-level module, the module itself (colibri.api -> "api", a floor of
    one module). None for colibri/__init__.py, the public face, which gathers names from every
    floor and is imported by no module of the package."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else None


def floor_graph(graph: dict[str, set[str]]) -> dict[str, dict[str, list[tuple[str, str]]]]:
    """{floor a: {floor b: the module imports (a's module, b's module) that make a -> b}}, the
    allowed ON_DEMAND_UPWARD imports left out."""
    floors: dict[str, dict[str, list[tuple[str, str]]]] = {}
    for mod, deps in graph.items():
        a = floor(mod)
        if a is None:
            continue
        arrows = floors.setdefault(a, {})
        for dep in sorted(deps):
            b = floor(dep)
            if b is not None and b != a and (mod, dep) not in ON_DEMAND_UPWARD:
                arrows.setdefault(b, []).append((mod, dep))
                floors.setdefault(b, {})
    return floors


def test_the_cycle_finder_finds_a_circle_through_a_function_level_import():
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert cycles(graph) == [["a", "b", "c"]]
    assert cycles({"a": {"b"}, "b": set()}) == []


def test_the_graph_sees_function_level_and_relative_imports():
    graph = import_graph()
    assert "colibri.convert.gguf_import" in graph["colibri.convert.stream"]   # inside convert()
    assert "colibri.convert.checks" in graph["colibri.convert.gguf_import"]
    assert "colibri.convert" in graph["colibri"]


def test_no_import_circle():
    found = cycles(import_graph())
    assert not found, "import circles: " + "; ".join(" <-> ".join(c) for c in found)


def test_the_floor_graph_maps_modules_to_their_folders():
    graph = {"colibri.a.x": {"colibri.b.y"}, "colibri.b.y": {"colibri.a.z"},   # a <-> b
             "colibri.a.z": {"colibri.api"}, "colibri.api": {"colibri.c.w"},   # a -> api -> c
             "colibri.c.w": set(), "colibri": {"colibri.a.x"}}  # the package face: no floor
    floors = floor_graph(graph)
    assert floors["a"] == {"b": [("colibri.a.x", "colibri.b.y")],
                           "api": [("colibri.a.z", "colibri.api")]}
    assert cycles({f: set(to) for f, to in floors.items()}) == [["a", "b"]]
    assert "colibri" not in floors
    floors = floor_graph({**graph, "colibri.c.w": {"colibri.a.z"}})     # a -> api -> c -> a
    assert cycles({f: set(to) for f, to in floors.items()}) == [["a", "api", "b", "c"]]


def test_no_import_circle_between_folders():
    """Each folder (and each top-level module) is a floor: imports between floors run one way
    (whichever module, at module level or inside a function), and no ring of floors closes
    (format -> generation -> engine -> format would, with no two of them both ways)."""
    floors = floor_graph(import_graph())
    found = cycles({f: set(to) for f, to in floors.items()})
    assert not found, "floors in a circle: " + "; ".join(
        " / ".join(ring) + ": " + ", ".join(
            f"{a} -> {b} ({m} -> {d}{f' and {len(e) - 1} more' if len(e) > 1 else ''})"
            for a in ring for b, e in sorted(floors[a].items()) if b in ring
            for m, d in e[:1])
        for ring in found)


def test_no_package_file_over_600_lines():
    long = sorted((str(f.relative_to(PACKAGE.parent)), n) for pattern in SOURCES
                  for f in PACKAGE.rglob(pattern)
                  if (n := len(f.read_text().splitlines())) > MAX_LINES)
    assert not long, f"files over {MAX_LINES} lines: {long}"
