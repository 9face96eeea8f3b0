"""The model's private attributes are read by nothing outside model.py: every other module
of the package, the tests and the scripts reach a Model through its public names only (an AST
walk, so a rename of a private attribute cannot break a caller it does not know of)."""
from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
MODEL = ROOT / "colibri" / "engine" / "model.py"


def _model_private_names() -> set[str]:
    """The private names of class Model: its `self._x = ...` attributes and `_x` methods."""
    tree = ast.parse(MODEL.read_text())
    cls = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "Model")
    names = set()
    for node in ast.walk(cls):
        if (isinstance(node, ast.FunctionDef) and node.name.startswith("_")
                and not node.name.startswith("__") and not node.name.startswith("_repr_")):
            # (_repr_html_ and kin: IPython's display protocol, public by convention)
            names.add(node.name)
        targets = node.targets if isinstance(node, ast.Assign) else (
            [node.target] if isinstance(node, (ast.AnnAssign, ast.AugAssign)) else [])
        for t in targets:
            for a in ast.walk(t):
                if (isinstance(a, ast.Attribute) and isinstance(a.value, ast.Name)
                        and a.value.id == "self" and a.attr.startswith("_")
                        and not a.attr.startswith("__")):
                    names.add(a.attr)
    return names


def _is_super(node: ast.AST) -> bool:
    """`super()`: a subclass reaching its own base's method (a Scheduler subclass calling
    super()._plan() reads no Model attribute that happens to share the name)."""
    return (isinstance(node, ast.Call) and isinstance(node.func, ast.Name)
            and node.func.id == "super")


def _reads(path: Path, names: set[str]) -> list[str]:
    """`x._name` (x not self / cls / super()) for each private name of Model, and the same name given
    to getattr / setattr as a string."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if (isinstance(node, ast.Attribute) and node.attr in names
                and not (isinstance(node.value, ast.Name) and node.value.id in ("self", "cls"))
                and not _is_super(node.value)):
            found.append(f"{path.relative_to(ROOT)}:{node.lineno}: .{node.attr}")
        if (isinstance(node, ast.Call) and isinstance(node.func, ast.Name)
                and node.func.id in ("getattr", "setattr", "hasattr") and len(node.args) > 1
                and isinstance(node.args[1], ast.Constant) and node.args[1].value in names):
            found.append(f"{path.relative_to(ROOT)}:{node.lineno}: {node.func.id} "
                         f"{node.args[1].value!r}")
    return found


def test_the_walk_sees_the_private_names():
    names = _model_private_names()
    assert {"_general", "_step", "_forward"} <= names, names       # the walk finds them


def test_no_model_private_read_outside_model_py():
    names = _model_private_names()
    files = [p for d in ("colibri", "tests", "scripts", "asv_bench") for p in
             sorted((ROOT / d).rglob("*.py")) if p != MODEL]
    found = [hit for p in files for hit in _reads(p, names)]
    assert not found, "private attributes of Model read outside model.py:\n" + "\n".join(found)
