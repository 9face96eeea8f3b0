"""Plots of routing: expert utilisation heatmap, token × layer map, co-activation matrix.

matplotlib is optional (`pip install matplotlib`); it is imported when a plot is drawn, never
at `import colibri`. Figures are made with `matplotlib.figure.Figure`, not pyplot: no display,
no global figure list to leak into, the same code on a headless server and in a notebook
(Jupyter shows a returned Figure). Each function returns the Figure; pass `ax=` to draw into
an axes of your own figure instead. Save with `fig.savefig("out.png")`.

    from colibri.tools import plot
    plot.expert_heatmap(stats).savefig("experts.png")        # layers × experts, utilisation
    plot.token_map(trace)                                   # tokens × layers, chosen experts
    plot.coactivation(stats, layer=3)                       # experts × experts of one layer
"""
from __future__ import annotations

import numpy as np

from .stats import RoutingStats
from .trace import Trace, UnknownLayerError

__all__ = ["expert_heatmap", "token_map", "coactivation"]


def _mpl():
    """(Figure class, matplotlib.colors, matplotlib.colormaps) or a clear ImportError.
    matplotlib is optional: imported here, when a plot is drawn."""
    from ..extras import require_extra
    colors = require_extra("matplotlib.colors", "plot", "drawing a plot")
    colormaps = require_extra("matplotlib", "plot", "drawing a plot").colormaps
    return require_extra("matplotlib.figure", "plot", "drawing a plot").Figure, colors, colormaps


def _stats(data) -> RoutingStats:
    if isinstance(data, RoutingStats):
        return data
    if isinstance(data, Trace):
        return data.stats()
    raise TypeError(f"expected a RoutingStats or a Trace, got {type(data).__name__}")


def _axes(ax, size):
    Figure, _, _ = _mpl()
    if ax is not None:
        return ax.figure, ax
    fig = Figure(figsize=size, layout="constrained")
    return fig, fig.add_subplot()


def expert_heatmap(data, *, ax=None, title: str | None = None, annotate: bool | None = None):
    """Utilisation (load / fair share) per MoE layer and expert: an (M, E) image.

    data: RoutingStats or Trace. Colour: blue below the fair share, white at 1, red above;
    dead experts (no token) are marked ×. annotate: print the values in the cells
    (default: when there are at most 256 cells).
    """
    _, colors, _ = _mpl()
    st = _stats(data)
    u = st.utilisation                                                        # (M, E)
    M, E = u.shape
    fig, ax = _axes(ax, (min(14.0, 4.5 + 0.4 * E), min(12.0, 2.0 + 0.4 * M)))
    vmax = max(2.0, float(u.max()))
    im = ax.imshow(u, cmap="RdBu_r", norm=colors.TwoSlopeNorm(vmin=0.0, vcenter=1.0, vmax=vmax),
                   aspect="auto", interpolation="nearest")
    dead_l, dead_e = np.nonzero(st.dead)
    if len(dead_l):
        ax.scatter(dead_e, dead_l, marker="x", s=40, c="black", linewidths=1.5,
                   label="dead (no token)")
        ax.legend(loc="upper right", fontsize="small", framealpha=0.8)
    if annotate if annotate is not None else M * E <= 256:
        for (j, e), v in np.ndenumerate(u):
            ax.text(e, j, f"{v:.1f}", ha="center", va="center", fontsize=7,
                    color="white" if abs(v - 1) > 0.6 * (vmax - 1) else "black")
    ax.set_xlabel("expert")
    ax.set_ylabel("MoE layer")
    ax.set_yticks(range(M), [str(x) for x in st.layers])
    if E <= 64:
        ax.set_xticks(range(E))
    ax.set_title(title or f"expert utilisation, {st.tokens} tokens, top-{st.top_k} of {E}")
    fig.colorbar(im, ax=ax, label="utilisation (1 = fair share)")
    return fig


def token_map(trace: Trace, *, ax=None, rank: int = 0, max_tokens: int = 96,
              title: str | None = None, annotate: bool | None = None):
    """Tokens × MoE layers: the colour of a cell is the expert of weight rank `rank`
    (0 = the top expert); the cell text lists all K chosen experts (default: when at most
    600 cells). Rows are labelled with the token texts; at most max_tokens rows are shown.
    """
    if not isinstance(trace, Trace):
        raise TypeError(f"expected a Trace, got {type(trace).__name__}")
    if not 0 <= rank < trace.top_k:
        raise ValueError(f"rank must be in [0, {trace.top_k}), got {rank}")
    _, colors, colormaps = _mpl()
    tr = trace[:max_tokens]
    T, M, E = len(tr), tr.n_layers, tr.n_experts
    img = tr.experts[:, :, rank]                                              # (T, M)
    fig, ax = _axes(ax, (min(14.0, 3.0 + 0.55 * M * max(1, tr.top_k) / 2),
                         min(30.0, 1.2 + 0.22 * T)))
    base = "tab10" if E <= 10 else "tab20" if E <= 20 else "turbo"
    cmap = colormaps[base].resampled(E) if base == "turbo" else \
        colors.ListedColormap(colormaps[base].colors[:E])
    im = ax.imshow(img, cmap=cmap, vmin=-0.5, vmax=E - 0.5, aspect="auto",
                   interpolation="nearest")
    if annotate if annotate is not None else T * M <= 600:
        for (t, j), _ in np.ndenumerate(img):
            ax.text(j, t, " ".join(str(int(e)) for e in tr.experts[t, j]), ha="center",
                    va="center", fontsize=7)
    labels = [repr(s)[1:-1][:14] for s in tr.tokens]
    ax.set_yticks(range(T), [f"{t} {s}" for t, s in enumerate(labels)], fontsize=7)
    ax.set_xticks(range(M), [f"L{x}" for x in tr.layers])
    ax.set_xlabel("MoE layer")
    ax.set_ylabel("token")
    which = "top expert" if rank == 0 else f"expert of rank {rank}"
    ax.set_title(title or f"{which} per token and layer"
                 + (f" (first {T} of {len(trace)} tokens)" if len(trace) > T else ""))
    fig.colorbar(im, ax=ax, label="expert", ticks=range(E) if E <= 20 else None)
    return fig


def coactivation(data, layer: int | None = None, *, ax=None, normalize: bool = True,
                 title: str | None = None):
    """Experts × experts of one MoE layer (default: the first).

    normalize=True: row e shows P(e' chosen | e chosen) (diagonal left blank);
    False: raw counts of tokens that chose both (diagonal = the expert's own count).
    """
    st = _stats(data)
    layer = st.layers[0] if layer is None else layer
    if layer not in st.layers:
        raise UnknownLayerError(f"layer {layer} is not a MoE layer of this model (MoE "
                                f"layers: {', '.join(map(str, st.layers))})")
    j = st.layers.index(layer)
    E = st.n_experts
    if normalize:
        m = st.coactivation_rate[j].copy()
        np.fill_diagonal(m, np.nan)
        label, vmax = "P(column chosen | row chosen)", 1.0
    else:
        m = st.coactivation[j].astype(np.float64)
        label, vmax = "tokens choosing both", None
    fig, ax = _axes(ax, (min(12.0, 2.5 + 0.35 * E), min(11.0, 2.0 + 0.33 * E)))
    im = ax.imshow(np.ma.masked_invalid(m), cmap="viridis", vmin=0.0, vmax=vmax,
                   interpolation="nearest")
    if E <= 32:
        ax.set_xticks(range(E))
        ax.set_yticks(range(E))
    ax.set_xlabel("expert")
    ax.set_ylabel("expert")
    ax.set_title(title or f"co-activation, MoE layer {layer} ({st.tokens} tokens)")
    fig.colorbar(im, ax=ax, label=label)
    return fig
