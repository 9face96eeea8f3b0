"""The package's structure rules: no import circle between its modules (imports at module
level and inside functions alike), and no package file over 600 lines.

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


def test_no_package_file_over_600_lines():
    long = sorted((str(f.relative_to(PACKAGE.parent)), n) for pattern in SOURCES
                  for f in PACKAGE.rglob(pattern)
                  if (n := len(f.read_text().splitlines())) > MAX_LINES)
    assert not long, f"files over {MAX_LINES} lines: {long}"
