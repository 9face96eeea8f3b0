"""Errors that name the fix (colibri/extras.py): a missing optional dependency says which extra
brings it and the pip command, as one CLI line; simulated by hiding the module (sys.modules
None makes `import` fail as if it were not installed)."""
from __future__ import annotations

import pytest

from colibri.extras import MissingExtra, require_extra
from colibri.errors import ColibriError

from cli_helpers import one_line_error, run


def test_require_extra_returns_the_module():
    import json
    assert require_extra("json", "test") is json


def test_missing_module_names_extra_and_command(monkeypatch):
    monkeypatch.setitem(__import__("sys").modules, "gguf", None)
    with pytest.raises(MissingExtra) as e:
        require_extra("gguf", "gguf", "reading GGUF")
    assert isinstance(e.value, ImportError) and isinstance(e.value, ColibriError)
    assert "reading GGUF needs the gguf extra" in str(e.value)
    assert "pip install 'colibri[gguf]'" in str(e.value) and e.value.name == "gguf"


def test_convert_gguf_without_gguf_is_one_line(monkeypatch, tmp_path, capsys):
    src = tmp_path / "m.gguf"
    src.write_bytes(b"GGUF" + b"\0" * 60)
    monkeypatch.setitem(__import__("sys").modules, "gguf", None)
    code, _, err = run(capsys, "convert", src, tmp_path / "out.colibri")
    assert code == 2
    assert "pip install 'colibri[gguf]'" in one_line_error(err, "convert")


@pytest.mark.parametrize("module", ["fastapi", "uvicorn"])
def test_serve_without_server_extra_is_one_line(monkeypatch, capsys, module):
    monkeypatch.setitem(__import__("sys").modules, module, None)
    code, _, err = run(capsys, "serve", "--port", "0")
    assert code == 2
    assert "pip install 'colibri[server]'" in one_line_error(err, "serve")


def test_serve_ray_without_ray_is_one_line(monkeypatch, capsys):
    monkeypatch.setitem(__import__("sys").modules, "ray", None)
    monkeypatch.setitem(__import__("sys").modules, "ray.serve", None)
    code, _, err = run(capsys, "serve", "--ray", "--port", "0")
    assert code == 2
    assert "pip install 'colibri[ray]'" in one_line_error(err, "serve")


def test_plot_without_matplotlib_is_one_line(monkeypatch, tmp_path, capsys):
    for name in ("matplotlib", "matplotlib.colors", "matplotlib.figure"):
        monkeypatch.setitem(__import__("sys").modules, name, None)
    code, _, err = run(capsys, "routes", "-p", "def f(x):", "--plot", tmp_path / "r.png")
    assert code == 2
    assert "pip install 'colibri[plot]'" in one_line_error(err, "routes")


def test_quickstart_notebook_names_the_notebook_extra(monkeypatch):
    """The notebook's first code cell checks its extra before anything else: without
    matplotlib (or torch) it stops with the pip command, not an IPython magic error."""
    import json
    from pathlib import Path
    nb = json.loads((Path(__file__).resolve().parent.parent / "examples" /
                     "quickstart.ipynb").read_text(encoding="utf-8"))
    first = "".join(next(c for c in nb["cells"] if c["cell_type"] == "code")["source"])
    check = first[:first.index("%matplotlib")]       # the lines before the first magic
    monkeypatch.setitem(__import__("sys").modules, "matplotlib", None)
    with pytest.raises(MissingExtra, match=r"this notebook needs the notebook extra .*"
                                           r"pip install 'colibri\[notebook\]'"):
        exec(check, {})


def test_a_missing_base_dependency_is_one_line_naming_it(monkeypatch, capsys):
    # jinja2 renders chat templates; a clean install missed it once (CI), which printed an
    # "internal error": a base dependency gone is now an error naming the module and the fix
    import io
    import sys
    for name in ("jinja2", "jinja2.ext", "jinja2.sandbox"):
        monkeypatch.setitem(sys.modules, name, None)
    monkeypatch.setattr(sys, "stdin", io.StringIO("What does os.path.join do?\n"))
    code, _, err = run(capsys, "chat", "-n", "4")
    assert code == 2
    line = one_line_error(err, "chat")
    assert "jinja2 is not installed" in line and "pip install" in line

