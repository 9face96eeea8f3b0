"""examples/quickstart.ipynb runs top to bottom in a fresh kernel (nbclient), so it never rots;
and it is stored without outputs."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from colibri.api import default_model_path

NOTEBOOK = Path(__file__).resolve().parent.parent / "examples" / "quickstart.ipynb"


def test_notebook_is_stored_without_outputs():
    nb = json.loads(NOTEBOOK.read_text(encoding="utf-8"))
    code = [c for c in nb["cells"] if c["cell_type"] == "code"]
    assert code
    for cell in code:
        assert cell["outputs"] == [] and cell["execution_count"] is None, \
            "strip the outputs before committing (jupyter nbconvert --clear-output --inplace)"


def test_quickstart_executes(tmp_path):
    nbformat = pytest.importorskip("nbformat", reason="the test extra installs nbformat (nbclient)")
    nbclient = pytest.importorskip("nbclient", reason="the test extra installs nbclient")
    pytest.importorskip("ipykernel", reason="executing the notebook needs a Jupyter kernel: "
                        "pip install ipykernel")
    pytest.importorskip("matplotlib", reason="the notebook draws plots: pip install matplotlib")
    pytest.importorskip("torch", reason="the notebook makes a checkpoint with transformers, "
                        "which needs torch")
    default_model_path()                 # the notebook loads the shipped model: never skip
    nb = nbformat.read(NOTEBOOK, as_version=4)
    client = nbclient.NotebookClient(nb, timeout=120, startup_timeout=60, kernel_name="python3",
                                     resources={"metadata": {"path": str(tmp_path)}})
    client.execute()                     # raises CellExecutionError on the first failing cell
    outputs = [o for c in nb.cells if c.cell_type == "code" for o in c.outputs]
    text = "".join(o.get("text", "") for o in outputs if o.output_type == "stream")
    images = [o for o in outputs if "image/png" in o.get("data", {})]
    assert len(images) >= 3                               # token map, heatmap, KL histogram
    assert "logits (" in text and "KL(base ‖ model)" in text and "same top" in text
