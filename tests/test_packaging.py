"""What `pip install .` carries: every Python package folder of colibri/ is listed in
pyproject.toml (setuptools ignores unlisted folders, so a new subpackage would be missing from
an installed colibri while the tests, run from the checkout, still pass)."""
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_every_subpackage_is_listed():
    listed = set(tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
                 ["packages"])
    found = {".".join(p.parent.relative_to(ROOT).parts)
             for p in (ROOT / "colibri").rglob("__init__.py") if "__pycache__" not in p.parts}
    missing = sorted(found - listed)
    assert not missing, f"pyproject.toml [tool.setuptools] packages lacks {missing}"
    absent = sorted(p for p in listed if not (ROOT / Path(*p.split("."))).is_dir())
    assert not absent, f"pyproject.toml lists packages with no folder: {absent}"


def test_base_dependencies_cover_the_chat_template():
    # the chat template's sandbox (chat_template.py) needs jinja2 at run time: a base
    # dependency, not only something the test extras happen to pull in (CI once lacked it)
    deps = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    assert any(d.lower().startswith("jinja2") for d in deps), deps
