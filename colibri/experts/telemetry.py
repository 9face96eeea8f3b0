"""Per-token expert telemetry: hits, misses, bytes read from disk, page faults.

    tel = ExpertTelemetry(model)          # watches every MoE layer from now on
    model.forward(...); ...
    t = tel.collect()                     # TokenTelemetry of the tokens run so far
    t.hits, t.misses                      int32 (T, M): expert blocks found / not found in memory
    t.bytes_read                          int64 (T,): bytes those misses brought in
    t.minor_faults, t.major_faults        int64 (T,): page faults of the forward call (getrusage)
    tel.close()                           # the layers run as before

A hit is an expert block (one expert of one layer: its gate, up and down rows) that was in
memory when a token's layer needed it. Without a memory budget, "in memory" is the page cache
of the mapped file, asked with mincore for every block a token used before the kernel reads
it; a miss's bytes are its pages that were not resident. With a budget, the expert cache
(colibri.experts.expert_cache) reports its own hits, misses and reads. In a call of several tokens
(a prefill) a block several tokens use counts once, for the first; the others are hits.

Rows follow the forward calls: a call starts when its first MoE layer runs, and its page
faults (from there to the next call's first MoE layer) go to its last token's row.
Shapes: T tokens, M MoE layers, K experts per token.
"""
from __future__ import annotations

from dataclasses import dataclass
from functools import partial

import numpy as np

from .expert_source import WatchedExperts, without
from .residency import PAGE, fault_counts, resident_pages

__all__ = ["TokenTelemetry", "ExpertTelemetry"]


@dataclass
class TokenTelemetry:
    """Expert residency and page faults per token (see the module docstring)."""
    hits: np.ndarray            # int32 (T, M)
    misses: np.ndarray          # int32 (T, M)
    bytes_read: np.ndarray      # int64 (T,)
    minor_faults: np.ndarray    # int64 (T,)
    major_faults: np.ndarray    # int64 (T,)

    FIELDS = ("hits", "misses", "bytes_read", "minor_faults", "major_faults")

    def __len__(self) -> int:
        return self.hits.shape[0]

    def __getitem__(self, index) -> "TokenTelemetry":
        return TokenTelemetry(*(getattr(self, k)[index] for k in self.FIELDS))

    @classmethod
    def empty(cls, n_layers: int) -> "TokenTelemetry":
        z = np.zeros(0, np.int64)
        return cls(np.zeros((0, n_layers), np.int32), np.zeros((0, n_layers), np.int32),
                   z, z.copy(), z.copy())

    @classmethod
    def concat(cls, parts: list["TokenTelemetry"]) -> "TokenTelemetry":
        return cls(*(np.concatenate([getattr(p, k) for p in parts]) for k in cls.FIELDS))

    @property
    def hit_rate(self) -> float:
        """Hits over accesses (nan with none)."""
        h, m = int(self.hits.sum()), int(self.misses.sum())
        return h / (h + m) if h + m else float("nan")

    def summary(self) -> dict:
        """Totals and per-token means: tokens, hits, misses, hit_rate, bytes_read,
        bytes_read_per_token, minor/major faults (total and per token)."""
        T = max(len(self), 1)
        out = {"tokens": len(self), "hits": int(self.hits.sum()),
               "misses": int(self.misses.sum()), "hit_rate": self.hit_rate,
               "bytes_read": int(self.bytes_read.sum())}
        out["bytes_read_per_token"] = out["bytes_read"] / T
        for k in ("minor_faults", "major_faults"):
            out[k] = int(getattr(self, k).sum())
            out[k + "_per_token"] = out[k] / T
        return out

    def format_token(self, t: int) -> str:
        """'experts 120/128 in memory, read 28.3 MB, faults 3 major / 210 minor'."""
        h, m = int(self.hits[t].sum()), int(self.misses[t].sum())
        return (f"experts {h}/{h + m} in memory, read {self.bytes_read[t] / 1e6:.1f} MB, "
                f"faults {int(self.major_faults[t])} major / {int(self.minor_faults[t])} minor")

    def format_summary(self) -> str:
        s = self.summary()
        return (f"experts: {s['hits']} hits, {s['misses']} misses (hit rate "
                f"{100 * s['hit_rate']:.1f}%), read {s['bytes_read_per_token'] / 1e6:.2f} MB "
                f"per token; page faults per token: {s['major_faults_per_token']:.1f} major, "
                f"{s['minor_faults_per_token']:.1f} minor ({s['tokens']} tokens)")


class ExpertTelemetry:
    """Records TokenTelemetry rows for every forward call of `model` until close().

    Puts a WatchedExperts (colibri.experts.expert_source) over every MoE layer's expert source,
    whichever it is: over an expert cache the cache reports its own hits and reads; over the
    mapping each call asks mincore about the blocks before the kernel reads them (a few
    microseconds per block). close() takes the watchers out again.
    """

    def __init__(self, model):
        self.model = model
        self.layers = list(model.moe_layers)
        self._index = {layer: j for j, layer in enumerate(self.layers)}
        self._first = self.layers[0] if self.layers else None
        self._parts: list[TokenTelemetry] = []
        self._row: TokenTelemetry | None = None       # the call being recorded
        self._faults = fault_counts()
        self._watched: list = []                      # (MoE, its WatchedExperts)
        for layer in self.layers:
            moe = model.layers[layer].ffn
            moe.expert_source = WatchedExperts(
                moe.expert_source, partial(self.record, layer), self._mapping_probe(layer),
                owner=self)
            self._watched.append((moe, moe.expert_source))

    def _mapping_probe(self, layer: int):
        """probe(ids) -> (hit bool (T, K), nbytes int64 (T,)): mincore on the mapped blocks
        of the experts ids int32 (T, K) of `layer`, a block several tokens use counted once
        (for the first; the others hits), a miss's bytes its pages not resident."""
        f, buf = self.model.file, self.model.buffer
        blocks = [f.expert_block(layer, e) for e in range(f.n_experts)]
        vec = np.empty(-(-blocks[0][1] // PAGE) + 1, np.uint8)

        def probe(ids: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
            flat = ids.reshape(-1)
            hit = np.ones(flat.shape, bool)
            nbytes = np.zeros(ids.shape[0], np.int64)
            _, first = np.unique(flat, return_index=True)
            for i in first:
                off, size = blocks[flat[i]]
                res, total = resident_pages(buf, off, size, vec)
                if res < total:
                    hit[i] = False
                    nbytes[i // ids.shape[1]] += (total - res) * PAGE
            return hit.reshape(ids.shape), nbytes
        return probe

    # -- recording ----------------------------------------------------------------------------
    def record(self, layer: int, hit: np.ndarray, nbytes: np.ndarray) -> None:
        """One layer of a call: hit bool (T, K) per access, nbytes int64 (T,) read for it."""
        T = hit.shape[0]
        if layer == self._first or self._row is None or len(self._row) != T:
            self._close_row()
            M = len(self.layers)
            z = np.zeros(T, np.int64)
            self._row = TokenTelemetry(np.zeros((T, M), np.int32), np.zeros((T, M), np.int32),
                                       z, z.copy(), z.copy())
        j = self._index[layer]
        h = np.count_nonzero(hit, axis=1)
        self._row.hits[:, j] += h
        self._row.misses[:, j] += hit.shape[1] - h
        self._row.bytes_read += nbytes

    def _close_row(self) -> None:
        now = fault_counts()
        if self._row is not None:
            self._row.minor_faults[-1] += now[0] - self._faults[0]
            self._row.major_faults[-1] += now[1] - self._faults[1]
            self._parts.append(self._row)
            self._row = None
        self._faults = now

    def collect(self) -> TokenTelemetry:
        """The rows of every call so far (the current one closed), and start afresh."""
        self._close_row()
        parts, self._parts = self._parts, []
        return TokenTelemetry.concat(parts) if parts else TokenTelemetry.empty(len(self.layers))

    def close(self) -> None:
        """Stop recording: the watchers this object put over the layers are taken out."""
        for moe, source in self._watched:
            moe.expert_source = without(moe.expert_source, source)
        self._watched = []

    def __enter__(self) -> "ExpertTelemetry":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
