"""The expert-cache simulator: recorded routing replayed through policies and budgets.

    from colibri.tools.cache_sim import simulate, sweep, CacheGeometry
    tr = colibri.tools.trace.Trace.load("routes.npz")          # colibri routes --save
    geo = CacheGeometry.of_file("model.colibri")               # dense part, block size
    r = simulate(tr.experts, geo.slots_for(1.5 * 2**30), "lru", geometry=geo)
    r.hit_rate, r.bytes_per_token, r.predicted_tps(bandwidth=1.3e9, compute_tps=27)

Each token's MoE layers are visited in order and each layer's K experts in order, as a
decode runs them; `chunk` > 1 replays calls of that many tokens (a prefill: layer by layer,
every token of the call at each layer). The decisions are those of the live cache: both run
colibri.experts.eviction.SlotTable.lookup, so on the same routing the simulated and the live hits
are equal (tests/test_cache_sim.py checks it).

Predicted speed: a token reads bytes_per_token from a disk of `bandwidth` bytes/s on top of
its compute time 1 / compute_tps: serial = 1 / (1/compute_tps + bytes/bandwidth); with the
reads hidden behind compute (a perfect prefetch), overlapped = 1 / max(...).

Shapes: T tokens, M MoE layers, K experts per token, E experts.
"""
from __future__ import annotations

import os
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

import numpy as np

from ..experts.eviction import POLICIES, SlotTable, make_policy
from ..experts.expert_cache import memory_plan
from ..format import ColibriFile
from .plot import _axes

__all__ = ["CacheGeometry", "SimResult", "simulate", "sweep", "format_table", "plot_hit_rates"]


@dataclass(frozen=True)
class CacheGeometry:
    """What turns a budget into slots: the dense part's bytes and one slot's (a block's)."""
    dense_bytes: int
    slot_bytes: int
    n_blocks: int = 0

    @classmethod
    def of_file(cls, path: str | os.PathLike) -> "CacheGeometry":
        with ColibriFile(path) as f:
            plan = memory_plan(f)
        return cls(plan.dense_bytes, plan.slot_bytes, plan.n_blocks)

    def slots_for(self, budget: int) -> int:
        """Slots a memory budget leaves for experts (as colibri.load(memory_budget=) counts)."""
        n = max(0, (int(budget) - self.dense_bytes) // self.slot_bytes)
        return min(n, self.n_blocks) if self.n_blocks else n


@dataclass
class SimResult:
    """One replay: per-token hits and misses (int32 (T, M)) of `policy` with `n_slots`."""
    policy: str
    n_slots: int
    hits: np.ndarray
    misses: np.ndarray
    slot_bytes: int = 0
    budget: int | None = None
    chunk: int = 1
    extra: dict = field(default_factory=dict)

    @property
    def hit_rate(self) -> float:
        h, m = int(self.hits.sum()), int(self.misses.sum())
        return h / (h + m) if h + m else float("nan")

    @property
    def misses_per_token(self) -> float:
        return float(self.misses.sum()) / max(self.hits.shape[0], 1)

    @property
    def bytes_per_token(self) -> float:
        return self.misses_per_token * self.slot_bytes

    def predicted_tps(self, bandwidth: float, compute_tps: float | None = None,
                      overlapped: bool = False) -> float:
        """Tokens/s with a disk of `bandwidth` bytes/s (see the module docstring); without
        compute_tps, the disk alone."""
        io = self.bytes_per_token / bandwidth
        compute = 1.0 / compute_tps if compute_tps else 0.0
        t = max(io, compute) if overlapped else io + compute
        return 1.0 / t if t > 0 else float("inf")

    def summary(self, bandwidth: float | None = None, compute_tps: float | None = None) -> dict:
        out = {"policy": self.policy, "slots": self.n_slots, "budget": self.budget,
               "chunk": self.chunk, "tokens": int(self.hits.shape[0]),
               "hit_rate": self.hit_rate, "misses_per_token": self.misses_per_token,
               "bytes_per_token": self.bytes_per_token}
        if bandwidth:
            out["predicted_tps"] = self.predicted_tps(bandwidth, compute_tps)
            out["predicted_tps_overlapped"] = self.predicted_tps(bandwidth, compute_tps, True)
        return out


def simulate(experts: np.ndarray, n_slots: int, policy: str = "lru", *,
             n_experts: int | None = None, chunk: int = 1, slot_bytes: int = 0,
             budget: int | None = None) -> SimResult:
    """Replay experts int (T, M, K) through a cache of n_slots blocks under `policy`.

    n_experts: E (default: the largest id + 1); chunk: tokens per forward call (1: decode).
    A call whose layer needs more distinct blocks than there are slots raises
    colibri.experts.eviction.CacheFullError, as the live cache would.
    """
    experts = np.asarray(experts)
    if experts.ndim != 3:
        raise ValueError(f"experts must have shape (T, M, K), got {experts.shape}")
    if int(chunk) != chunk or chunk < 1:
        raise ValueError(f"chunk must be a positive integer, got {chunk!r}")
    if int(n_slots) != n_slots or n_slots < 1:
        raise ValueError(f"n_slots must be a positive integer, got {n_slots!r}")
    T, M, K = experts.shape
    E = int(n_experts) if n_experts is not None else int(experts.max()) + 1
    table = SlotTable(int(n_slots), make_policy(policy, M, E))
    hits = np.zeros((T, M), np.int32)
    for c0 in range(0, T, chunk):
        table.begin_call()
        part = experts[c0:c0 + chunk]
        for j in range(M):
            _, hit, _ = table.lookup(j, part[:, j])
            hits[c0:c0 + chunk, j] = np.count_nonzero(hit, axis=1)
    return SimResult(policy, int(n_slots), hits, K - hits, slot_bytes, budget, int(chunk))


def sweep(experts: np.ndarray, slots: Iterable[int], policies: Sequence[str] = POLICIES, *,
          geometry: CacheGeometry | None = None, budgets: Sequence[int] | None = None,
          n_experts: int | None = None, chunk: int = 1) -> list[SimResult]:
    """simulate for every (policy, slot count); budgets (bytes, one per slot count) only
    label the results."""
    slots = list(slots)
    labels = list(budgets) if budgets is not None else [None] * len(slots)
    sb = geometry.slot_bytes if geometry is not None else 0
    return [simulate(experts, n, p, n_experts=n_experts, chunk=chunk, slot_bytes=sb, budget=b)
            for p in policies for n, b in zip(slots, labels)]


def _gib(n: int | None) -> str:
    return "-" if n is None else f"{n / 2**30:.2f} GiB"


def format_table(results: Sequence[SimResult], bandwidth: float | None = None,
                 compute_tps: float | None = None) -> str:
    """Markdown: policy, budget, slots, hit rate, misses and MB read per token [, t/s]."""
    head = ["policy", "budget", "slots", "hit rate", "misses/token", "MB/token"]
    if bandwidth:
        head += ["t/s serial", "t/s overlapped"]
    rows = [head]
    for r in results:
        sized = r.slot_bytes > 0              # bytes known (a model's geometry)
        row = [r.policy, _gib(r.budget), str(r.n_slots), f"{100 * r.hit_rate:.1f}%",
               f"{r.misses_per_token:.1f}", f"{r.bytes_per_token / 1e6:.1f}" if sized else "-"]
        if bandwidth:
            row += [f"{r.predicted_tps(bandwidth, compute_tps):.1f}" if sized else "-",
                    f"{r.predicted_tps(bandwidth, compute_tps, True):.1f}" if sized else "-"]
        rows.append(row)
    widths = [max(len(r[i]) for r in rows) for i in range(len(head))]
    lines = ["| " + " | ".join(c.ljust(w) for c, w in zip(r, widths)) + " |" for r in rows]
    lines.insert(1, "| " + " | ".join("-" * w for w in widths) + " |")
    return "\n".join(lines)


def plot_hit_rates(results: Sequence[SimResult]):
    """matplotlib Figure: hit rate vs budget (or slots) per policy. ImportError without
    matplotlib."""
    fig, ax = _axes(None, (6, 4))       # matplotlib is imported there, when a plot is drawn
    by_budget = all(r.budget is not None for r in results)
    for policy in dict.fromkeys(r.policy for r in results):
        rs = [r for r in results if r.policy == policy]
        xs = [r.budget / 2**30 if by_budget else r.n_slots for r in rs]
        ax.plot(xs, [100 * r.hit_rate for r in rs], marker="o", label=policy)
    ax.set_xlabel("memory budget (GiB)" if by_budget else "expert slots")
    ax.set_ylabel("expert hit rate (%)")
    ax.set_title("expert cache: hit rate vs budget")
    ax.grid(True, alpha=0.3)
    ax.legend()
    return fig
