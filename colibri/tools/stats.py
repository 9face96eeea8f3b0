"""Expert statistics over routing traces, accumulated chunk by chunk.

    from colibri import routing_stats                # colibri.tools.trace.routing_stats
    st = routing_stats(model, Path("corpus.txt"))    # streamed: one chunk of routing at a time
    st = trace.stats()                               # or over one Trace
    st.utilisation      float64 (M, E)   load / fair share; 1 = fair, 0 = dead
    st.summary()                         # JSON-ready dict; st.format_summary() -> text table

`RoutingStats.update(trace)` folds one Trace in and keeps only sums: memory is O(M·E²) (the
co-activation counts) whatever the number of tokens. Notation for one MoE layer, over the N
tokens seen: S_t the K experts token t chose, w_t,e their combine weights, p_t the router's
full distribution over the E experts (softmax of the logits).

    counts           c_e = #{t : e ∈ S_t}                               int64   (M, E)
    token_share      f_e = c_e / (N·K)            (sums to 1; 1/E when balanced)
    weight_share     Σ_t w_t,e / Σ_t Σ_e' w_t,e'  (sums to 1)
    utilisation      u_e = c_e / (N·K/E)          (load / ideal load; 1 = fair share, 0 = dead)
    cv               std_e(c_e) / mean_e(c_e)     (coefficient of variation; 0 = balanced)   (M,)
    aux_loss         E · Σ_e (c_e/N) · P_e, P_e = mean_t p_t,e: the Switch / Mixtral load-
                     balancing loss as transformers' load_balancing_loss_func computes it for
                     one layer (K when perfectly balanced, up to K·E when collapsed)    (M,)
    aux_loss_total   the same over all layers' rows together: what transformers reports as
                     `aux_loss` for the whole model                                    scalar
    entropy          mean_t H(p_t), H(p) = -Σ_e p_e ln p_e (nats; ln E = undecided)     (M,)
    marginal_entropy H(P) of the mean distribution (ln E = every expert used equally)   (M,)
    dead / rare      c_e = 0 / u_e < rare_threshold                              bool   (M, E)
    coactivation     C_e,e' = #{t : e, e' ∈ S_t}; diagonal = c_e             int64   (M, E, E)
    persistence      Σ_t |S_t ∩ S_t+1| / (K · #pairs): share of a token's experts the next
                     token keeps (pairs of consecutive tokens of one sequence)          (M,)
    persistence_per_expert  P(e ∈ S_t+1 | e ∈ S_t)                       float64 (M, E)
    lru_hit_rate     hits / (N·K) of an LRU cache of n experts per layer, for n in lru_sizes;
                     updated after each token (an expert is a hit when it is among the n
                     experts most recently used by earlier tokens; within a token, higher
                     weight = more recent). The cache stays warm across sequences.  (M, n_sizes)

Statistics that need router probabilities (aux_loss, entropies) are NaN when a trace had none.

This module reads a trace's arrays only (the `RoutingArrays` protocol below), so it sits under
colibri.tools.trace, which builds traces from a model and folds them here (`Trace.stats()`,
`routing_stats`).
"""
from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Protocol

import numpy as np


__all__ = ["RoutingStats", "RoutingArrays", "default_lru_sizes", "entropy"]

DEFAULT_RARE = 0.1          # utilisation below a tenth of the fair share counts as rare


def default_lru_sizes(n_experts: int, top_k: int) -> tuple[int, ...]:
    """Cache sizes worth simulating: K, 2K, 4K and E/2 experts per layer, below E."""
    return tuple(sorted({n for n in (top_k, 2 * top_k, 4 * top_k, n_experts // 2)
                         if 1 <= n < n_experts}))


def entropy(p: np.ndarray, axis: int = -1) -> np.ndarray:
    """Shannon entropy in nats along `axis` (0·ln 0 = 0), float64."""
    p = np.asarray(p, dtype=np.float64)
    with np.errstate(divide="ignore", invalid="ignore"):
        terms = np.where(p > 0, p * np.log(p), 0.0)
    return -terms.sum(axis=axis)


class RoutingArrays(Protocol):
    """What the statistics read of a trace (colibri.tools.trace.Trace is one)."""
    experts: np.ndarray               # int32 (T, M, K) chosen experts, heaviest first
    weights: np.ndarray               # float32 (T, M, K) their combine weights
    probs: np.ndarray | None          # float32 (T, M, E) router distribution, or None
    positions: np.ndarray             # int64 (T,) position in its sequence
    layers: list[int]                 # (M,) MoE layer numbers
    n_experts: int                    # E

    @property
    def top_k(self) -> int: ...       # K

    def __len__(self) -> int: ...     # T


class RoutingStats:
    """Running sums over traces of one model; see the module docstring for each statistic.

    layers: MoE layer numbers (M); n_experts E; top_k K; lru_sizes: cache sizes to simulate
    (default default_lru_sizes(E, K)); rare_threshold: utilisation below which an expert is rare.
    """

    def __init__(self, layers: Sequence[int], n_experts: int, top_k: int, *,
                 lru_sizes: Sequence[int] | None = None, rare_threshold: float = DEFAULT_RARE):
        self.layers = [int(x) for x in layers]
        self.n_experts, self.top_k = int(n_experts), int(top_k)
        M, E = len(self.layers), self.n_experts
        if M == 0 or E < 1 or not 1 <= self.top_k <= E:
            raise ValueError(f"need at least one layer and 1 <= top_k <= n_experts; got "
                             f"{M} layers, {E} experts, top_k {top_k}")
        sizes = default_lru_sizes(E, self.top_k) if lru_sizes is None else lru_sizes
        self.lru_sizes = tuple(sorted({int(n) for n in sizes}))
        if any(n < 1 for n in self.lru_sizes):
            raise ValueError(f"lru_sizes must be positive, got {list(sizes)}")
        self.rare_threshold = float(rare_threshold)
        self.tokens = 0                                              # N
        self.counts = np.zeros((M, E), np.int64)                     # c
        self.weight_sum = np.zeros((M, E), np.float64)
        self.prob_sum = np.zeros((M, E), np.float64)                 # N · P
        self.entropy_sum = np.zeros(M, np.float64)                   # Σ_t H(p_t)
        self.prob_tokens = 0                                         # tokens that had probs
        self.coactivation = np.zeros((M, E, E), np.int64)            # C
        self.kept = np.zeros((M, E), np.int64)                       # e ∈ S_t and e ∈ S_t+1
        self.kept_from = np.zeros((M, E), np.int64)                  # e ∈ S_t, t+1 exists
        self.pairs = 0
        self.lru_hits = np.zeros((M, len(self.lru_sizes)), np.int64)
        # state carried from one update to the next
        self._last_pos: int | None = None                            # position of the last token
        self._last_hot: np.ndarray | None = None                     # bool (M, E): its experts
        self._stamp = np.full((M, E), -1, np.int64)                  # last use, for the LRU
        self._clock = 0

    @classmethod
    def from_trace(cls, trace: RoutingArrays, **kwargs) -> "RoutingStats":
        return cls(trace.layers, trace.n_experts, trace.top_k, **kwargs).update(trace)

    # -- accumulation ------------------------------------------------------------------------------
    def update(self, trace: RoutingArrays) -> "RoutingStats":
        """Fold one trace in (tokens in order; a token at position p+1 right after one at
        position p continues its sequence, across updates too). Returns self."""
        if trace.layers != self.layers or trace.n_experts != self.n_experts \
                or trace.top_k != self.top_k:
            raise ValueError(f"trace of layers {trace.layers}, {trace.n_experts} experts, top-"
                             f"{trace.top_k} does not match these statistics (layers "
                             f"{self.layers}, {self.n_experts} experts, top-{self.top_k})")
        T = len(trace)
        if T == 0:
            return self
        M, E = len(self.layers), self.n_experts
        ids = trace.experts                                                   # (T, M, K)
        hot = np.zeros((T, M, E), bool)                                       # multi-hot S_t
        np.put_along_axis(hot, ids, True, axis=2)
        self.tokens += T
        self.counts += hot.sum(axis=0)
        np.add.at(self.weight_sum, (np.arange(M)[None, :, None], ids),
                  trace.weights.astype(np.float64))
        if trace.probs is not None:
            p = trace.probs.astype(np.float64)                                # (T, M, E)
            self.prob_sum += p.sum(axis=0)
            self.entropy_sum += entropy(p).sum(axis=0)
            self.prob_tokens += T
        # co-activation: C = Σ_t hot_t hot_t^T per layer; float32 matmul is exact below 2^24
        h = hot.transpose(1, 2, 0).astype(np.float32)                         # (M, E, T)
        self.coactivation += np.rint(h @ h.transpose(0, 2, 1)).astype(np.int64)
        self._persistence(trace.positions, hot)
        self._lru(ids)
        return self

    def _persistence(self, positions: np.ndarray, hot: np.ndarray) -> None:
        pos = positions
        if self._last_pos is not None:                       # the previous update's last token
            pos = np.concatenate([[self._last_pos], pos])
            hot = np.concatenate([self._last_hot[None], hot])
        cont = pos[1:] == pos[:-1] + 1                       # (pairs,): t+1 continues t
        a, b = hot[:-1][cont], hot[1:][cont]                 # (pairs, M, E)
        self.pairs += int(cont.sum())
        self.kept += (a & b).sum(axis=0)
        self.kept_from += a.sum(axis=0)
        self._last_pos, self._last_hot = int(pos[-1]), hot[-1].copy()

    def _lru(self, ids: np.ndarray) -> None:
        """Per token: hits against the state left by earlier tokens, then stamp its experts."""
        if not self.lru_sizes:
            return
        M, K = ids.shape[1], ids.shape[2]
        sizes = np.asarray(self.lru_sizes)
        rows = np.arange(M)[:, None]
        recency = np.arange(K - 1, -1, -1)                   # top weight = most recent
        stamp = self._stamp
        for t in range(ids.shape[0]):
            e = ids[t]                                                        # (M, K)
            s = stamp[rows, e]                                                # (M, K)
            newer = (stamp[:, None, :] > s[:, :, None]).sum(axis=2)           # (M, K) rank
            hit = (s >= 0)[..., None] & (newer[..., None] < sizes)            # (M, K, n)
            self.lru_hits += hit.sum(axis=1)
            stamp[rows, e] = self._clock + recency
            self._clock += K

    # -- derived statistics ------------------------------------------------------------------------
    def _need_tokens(self) -> int:
        if self.tokens == 0:
            raise ValueError("no tokens yet: update() the statistics with a trace first")
        return self.tokens

    @property
    def token_share(self) -> np.ndarray:
        """float64 (M, E): c_e / (N·K)."""
        return self.counts / (self._need_tokens() * self.top_k)

    @property
    def weight_share(self) -> np.ndarray:
        """float64 (M, E): the share of the combine weight each expert received."""
        self._need_tokens()
        tot = self.weight_sum.sum(axis=1, keepdims=True)
        return np.divide(self.weight_sum, tot, out=np.zeros_like(self.weight_sum), where=tot > 0)

    @property
    def utilisation(self) -> np.ndarray:
        """float64 (M, E): load / ideal load = c_e / (N·K/E)."""
        return self.token_share * self.n_experts

    @property
    def cv(self) -> np.ndarray:
        """float64 (M,): coefficient of variation of the counts over experts (population std)."""
        self._need_tokens()
        c = self.counts.astype(np.float64)
        return c.std(axis=1) / c.mean(axis=1)

    def _mean_probs(self) -> np.ndarray:
        if self.prob_tokens != self.tokens:
            return np.full_like(self.prob_sum, np.nan)
        return self.prob_sum / self._need_tokens()

    @property
    def mean_probs(self) -> np.ndarray:
        """float64 (M, E): P_e, the router's probability of each expert averaged over tokens."""
        return self._mean_probs()

    @property
    def aux_loss(self) -> np.ndarray:
        """float64 (M,): E · Σ_e (c_e / N) · P_e per layer (K when balanced)."""
        f = self.counts / self._need_tokens()
        return self.n_experts * (f * self._mean_probs()).sum(axis=1)

    @property
    def aux_loss_total(self) -> float:
        """transformers' load_balancing_loss_func over all MoE layers (rows of every layer
        pooled: E · Σ_e mean_l(c_l,e / N) · mean_l(P_l,e))."""
        f = (self.counts / self._need_tokens()).mean(axis=0)
        return float(self.n_experts * (f * self._mean_probs().mean(axis=0)).sum())

    @property
    def entropy(self) -> np.ndarray:
        """float64 (M,): mean over tokens of the router distribution's entropy (nats)."""
        if self.prob_tokens != self._need_tokens():
            return np.full(len(self.layers), np.nan)
        return self.entropy_sum / self.tokens

    @property
    def marginal_entropy(self) -> np.ndarray:
        """float64 (M,): entropy (nats) of the mean router distribution P."""
        return entropy(self._mean_probs())

    @property
    def max_entropy(self) -> float:
        return math.log(self.n_experts)

    @property
    def dead(self) -> np.ndarray:
        """bool (M, E): experts no token chose."""
        self._need_tokens()
        return self.counts == 0

    def rare(self, threshold: float | None = None) -> np.ndarray:
        """bool (M, E): utilisation below `threshold` (default rare_threshold), dead included."""
        th = self.rare_threshold if threshold is None else float(threshold)
        return self.utilisation < th

    @property
    def coactivation_rate(self) -> np.ndarray:
        """float64 (M, E, E): P(e' ∈ S_t | e ∈ S_t) = C_e,e' / c_e (row e; NaN for dead e)."""
        c = self.counts[:, :, None].astype(np.float64)
        with np.errstate(divide="ignore", invalid="ignore"):
            return np.where(c > 0, self.coactivation / c, np.nan)

    @property
    def persistence(self) -> np.ndarray:
        """float64 (M,): share of a token's K experts that the next token keeps (NaN: no pairs)."""
        if self.pairs == 0:
            return np.full(len(self.layers), np.nan)
        return self.kept.sum(axis=1) / (self.pairs * self.top_k)

    @property
    def persistence_per_expert(self) -> np.ndarray:
        """float64 (M, E): P(e ∈ S_t+1 | e ∈ S_t) (NaN where e never had a successor)."""
        with np.errstate(divide="ignore", invalid="ignore"):
            return np.where(self.kept_from > 0, self.kept / self.kept_from, np.nan)

    @property
    def lru_hit_rate(self) -> np.ndarray:
        """float64 (M, len(lru_sizes)): hit rate of an LRU cache of n experts per layer."""
        return self.lru_hits / (self._need_tokens() * self.top_k)

    # -- reports ---------------------------------------------------------------------------------
    def summary(self) -> dict:
        """JSON-ready: totals and one dict per MoE layer (NaN reported as None)."""
        def num(x, nd=4):
            x = float(x)
            return None if math.isnan(x) else round(x, nd)

        u, dead, rare = self.utilisation, self.dead, self.rare()
        per_layer = []
        for j, layer in enumerate(self.layers):
            per_layer.append({
                "layer": layer,
                "cv": num(self.cv[j]),
                "aux_loss": num(self.aux_loss[j]),
                "entropy": num(self.entropy[j]),
                "marginal_entropy": num(self.marginal_entropy[j]),
                "utilisation_min": num(u[j].min()),
                "utilisation_max": num(u[j].max()),
                "busiest_expert": int(u[j].argmax()),
                "dead": np.flatnonzero(dead[j]).tolist(),
                "rare": np.flatnonzero(rare[j] & ~dead[j]).tolist(),
                "persistence": num(self.persistence[j]),
                "lru_hit_rate": {str(n): num(self.lru_hit_rate[j, i])
                                 for i, n in enumerate(self.lru_sizes)},
                "token_share": [num(x) for x in self.token_share[j]],
                "weight_share": [num(x) for x in self.weight_share[j]],
            })
        return {
            "tokens": self.tokens, "layers": self.layers, "n_experts": self.n_experts,
            "top_k": self.top_k, "aux_loss": num(self.aux_loss_total),
            "aux_loss_balanced": float(self.top_k), "max_entropy": num(self.max_entropy),
            "persistence": num(np.nanmean(self.persistence)) if self.pairs else None,
            "lru_sizes": list(self.lru_sizes), "rare_threshold": self.rare_threshold,
            "per_layer": per_layer,
        }

    def format_summary(self, experts: bool | None = None) -> str:
        """An aligned text table, one row per MoE layer; then, when `experts` (default: at most
        16 experts), the utilisation of every expert of every layer."""
        s = self.summary()
        f = lambda x, nd=2: "-" if x is None else f"{x:.{nd}f}"  # noqa: E731
        lst = lambda v: ",".join(map(str, v)) if v else "-"  # noqa: E731
        head = (f"{s['tokens']} tokens, {len(self.layers)} MoE layers, top-{self.top_k} of "
                f"{self.n_experts} experts; aux loss {f(s['aux_loss'], 3)} (balanced = "
                f"{self.top_k}); entropy in nats (max ln {self.n_experts} = "
                f"{self.max_entropy:.2f})")
        rows = [("layer", "cv", "aux", "entropy", "marginal", "util min..max", "dead",
                 "rare", "persist") + tuple(f"LRU{n}" for n in self.lru_sizes)]
        for r in s["per_layer"]:
            rows.append((f"L{r['layer']}", f(r["cv"]), f(r["aux_loss"]), f(r["entropy"]),
                         f(r["marginal_entropy"]),
                         f"{f(r['utilisation_min'])}..{f(r['utilisation_max'])}",
                         lst(r["dead"]), lst(r["rare"]), f(r["persistence"]))
                        + tuple(f(r["lru_hit_rate"][str(n)]) for n in self.lru_sizes))
        widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
        lines = [head] + ["  ".join(c.rjust(w) if i else c.ljust(w)
                                    for i, (c, w) in enumerate(zip(r, widths))).rstrip()
                          for r in rows]
        if experts if experts is not None else self.n_experts <= 16:
            u = self.utilisation
            grid = [("utilisation",) + tuple(f"e{e}" for e in range(self.n_experts))]
            grid += [(f"L{layer}",) + tuple(f"{v:.2f}" for v in u[j])
                     for j, layer in enumerate(self.layers)]
            w = [max(len(r[i]) for r in grid) for i in range(len(grid[0]))]
            lines += [""] + ["  ".join(c.rjust(x) if i else c.ljust(x)
                                       for i, (c, x) in enumerate(zip(r, w))) for r in grid]
        return "\n".join(lines)

    def _repr_html_(self) -> str:
        from .display import stats_html   # notebook display: HTML code loaded on demand
        return stats_html(self)

    def __repr__(self) -> str:
        return (f"RoutingStats({self.tokens} tokens, MoE layers {self.layers}, top-{self.top_k} "
                f"of {self.n_experts} experts)")

