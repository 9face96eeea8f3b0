"""colibri.tools.plot: each figure renders without a display (Agg), holds the data it claims, saves a
PNG; a missing matplotlib gives the install hint."""
from __future__ import annotations

import sys

import numpy as np
import pytest

pytest.importorskip("matplotlib")

from colibri.tools import plot  # noqa: E402
from colibri.tools.stats import RoutingStats  # noqa: E402
from colibri.tools.trace import Trace, UnknownLayerError  # noqa: E402

T, L, E, K = 12, 3, 6, 2


@pytest.fixture(scope="module")
def tr() -> Trace:
    rng = np.random.default_rng(3)
    logits = rng.standard_normal((T, L, E)).astype(np.float32)
    logits[:, 1, 5] = -30.0                                  # expert 5 of layer 1 never chosen
    experts = np.argsort(-logits, axis=-1, kind="stable")[..., :K]
    weights = np.take_along_axis(np.exp(logits), experts, -1)
    weights /= weights.sum(-1, keepdims=True)
    return Trace(experts, weights, logits=logits, layers=[0, 2, 3],
                 tokens=[f"tok<{i}>" for i in range(T)])


@pytest.fixture(scope="module")
def st(tr) -> RoutingStats:
    return tr.stats()


def _png(fig, path):
    fig.savefig(path)
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 1000


def test_expert_heatmap(tr, st, tmp_path):
    fig = plot.expert_heatmap(st)
    assert len(fig.axes) == 2                                # the map and its colour bar
    ax = fig.axes[0]
    img = ax.get_images()[0].get_array()
    assert img.shape == (L, E)
    np.testing.assert_allclose(img, st.utilisation)
    dead = ax.collections[0].get_offsets()                   # the × marks: (expert, layer row)
    np.testing.assert_array_equal(np.asarray(dead), [[5, 1]])
    assert [t.get_text() for t in ax.get_yticklabels()] == ["0", "2", "3"]
    assert len(ax.texts) == L * E                            # values annotated
    _png(fig, tmp_path / "heat.png")
    # from a Trace too, and into a given axes
    from matplotlib.figure import Figure
    outer = Figure()
    ax2 = outer.add_subplot()
    assert plot.expert_heatmap(tr, ax=ax2) is outer
    np.testing.assert_allclose(ax2.get_images()[0].get_array(), st.utilisation)
    with pytest.raises(TypeError, match="RoutingStats or a Trace"):
        plot.expert_heatmap(np.zeros((2, 2)))


def test_token_map(tr, tmp_path):
    fig = plot.token_map(tr)
    ax = fig.axes[0]
    img = ax.get_images()[0].get_array()
    assert img.shape == (T, L)
    np.testing.assert_array_equal(img, tr.experts[:, :, 0])
    labels = [t.get_text() for t in ax.get_yticklabels()]
    assert labels[3] == "3 tok<3>"
    assert [t.get_text() for t in ax.get_xticklabels()] == ["L0", "L2", "L3"]
    assert ax.texts[0].get_text() == " ".join(map(str, tr.experts[0, 0]))
    _png(fig, tmp_path / "tokens.png")
    second = plot.token_map(tr, rank=1, max_tokens=5)
    np.testing.assert_array_equal(second.axes[0].get_images()[0].get_array(), tr.experts[:5, :, 1])
    with pytest.raises(ValueError, match="rank"):
        plot.token_map(tr, rank=2)


def test_coactivation(st, tmp_path):
    fig = plot.coactivation(st, layer=2)
    img = fig.axes[0].get_images()[0].get_array()
    assert img.shape == (E, E)
    want = st.coactivation_rate[1].copy()
    np.fill_diagonal(want, np.nan)
    np.testing.assert_allclose(np.ma.filled(img, np.nan), want)
    raw = plot.coactivation(st, layer=0, normalize=False).axes[0].get_images()[0].get_array()
    np.testing.assert_array_equal(raw, st.coactivation[0])
    _png(fig, tmp_path / "coact.png")
    with pytest.raises(UnknownLayerError, match="layer 1 is not a MoE layer"):
        plot.coactivation(st, layer=1)


def test_missing_matplotlib_says_how_to_install(st, monkeypatch):
    for name in ("matplotlib", "matplotlib.colors", "matplotlib.figure"):
        monkeypatch.setitem(sys.modules, name, None)        # as if not installed
    with pytest.raises(ImportError, match=r"plot extra .*pip install 'colibri\[plot\]'"):
        plot.expert_heatmap(st)


def test_import_colibri_does_not_import_matplotlib():
    import subprocess
    import sys
    code = "import colibri, colibri.tools.plot, sys; print('matplotlib' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.stdout.strip() == "False", out.stderr
