"""Prefetch for the expert cache: while layer l computes, read what layer l+1 will need.

Predictors (Prefetcher(cache, predictor)):
    router     the next MoE layer's router applied to this layer's input (the hidden state
               is close to the one the next layer will see): its top-k experts. The baseline
               of the offloading literature; one router matmul (E x D) per layer.
    previous   the experts the next layer chose for the previous token (routing persists
               from token to token); after the last layer, the first layer's for the next
               token.
    both       the union, the router's first.
Predictions are made for one-token calls (decode steps); a prefill reads what it needs.

The reads run on one thread of their own (os.preadv releases the GIL, so they overlap the
kernels); a request is dropped when the layer it was for has already started (the layer
reads what it lacks itself, and waits only for a block the prefetch thread is reading at that
moment). A prefetched block counts as one access for the eviction policy.

Recall per layer (stats()): of the experts a layer chose, the share each predictor had
predicted for it. Shapes: M MoE layers, K experts per token, E experts, D hidden.
"""
from __future__ import annotations

import collections
import threading
import weakref

import numpy as np

from .eviction import CacheFullError

__all__ = ["Prefetcher", "PREDICTORS"]

PREDICTORS = ("router", "previous", "both")


class Prefetcher:
    """Predicts each next layer's experts and reads them into `cache` on a thread."""

    def __init__(self, cache, predictor: str = "router"):
        if predictor not in PREDICTORS:
            raise ValueError(f"prefetch must be one of {', '.join(PREDICTORS)}, got "
                             f"{predictor!r}")
        self.cache, self.predictor = cache, predictor
        model = cache.model
        self.M = len(cache.layers)
        self.E = cache.plan.n_experts
        self._moes = [model.layers[layer].ffn for layer in cache.layers]
        self.uses = (("router", "previous") if predictor == "both" else (predictor,))
        self._previous: list[np.ndarray | None] = [None] * self.M     # ids (K,) per layer
        self._predicted = {name: [None] * self.M for name in self.uses}
        self.recall_hits = {name: np.zeros(self.M, np.int64) for name in self.uses}
        self.recall_total = {name: np.zeros(self.M, np.int64) for name in self.uses}
        self.dropped = 0
        self._queue: collections.deque = collections.deque()
        self._wake = threading.Condition()
        self._stop = False
        # the thread holds the prefetcher weakly: a model dropped without close() lets it end
        self._thread = threading.Thread(target=_serve, args=(weakref.ref(self), self._wake),
                                        name="colibri-prefetch", daemon=True)
        self._thread.start()

    # -- on the compute thread ---------------------------------------------------------------------
    def after_layer(self, j: int, x: np.ndarray, ids: np.ndarray) -> None:
        """Layer j's blocks are resident: score the predictions made for it, then predict
        and request layer j+1's (x float32 (1, D) its input, ids int32 (1, K))."""
        if ids.shape[0] != 1:
            return
        actual = ids[0]
        for name in self.uses:
            pred = self._predicted[name][j]
            if pred is not None:
                self.recall_hits[name][j] += np.isin(actual, pred).sum()
                self.recall_total[name][j] += actual.size
            self._predicted[name][j] = None
        self._previous[j] = actual.copy()
        nxt = j + 1
        call = self.cache.table.policy.token
        if nxt == self.M:                   # the next token's first layer: only "previous"
            nxt, call = 0, call + 1
            if "previous" not in self.uses:
                return
        parts = []
        if "router" in self.uses and nxt != 0:
            routed = self._moes[nxt].route(x)[0][0]
            self._predicted["router"][nxt] = routed
            parts.append(routed)
        if "previous" in self.uses and self._previous[nxt] is not None:
            self._predicted["previous"][nxt] = self._previous[nxt]
            parts.append(self._previous[nxt])
        if not parts:
            return
        experts = list(dict.fromkeys(int(e) for p in parts for e in p))
        with self._wake:
            self._queue.append((call * self.M + nxt, [nxt * self.E + e for e in experts]))
            self._wake.notify()

    # -- on the prefetch thread --------------------------------------------------------------------
    def _fetch(self, target: int, blocks: list[int]) -> None:
        """Read the blocks of a request not yet resident, unless their layer has started."""
        cache, table = self.cache, self.cache.table
        for b in blocks:
            with cache.lock:
                if cache.position >= target:          # the layer runs: it reads itself
                    self.dropped += 1
                    break
                if table.block_slot[b] >= 0:
                    continue
                try:
                    s, old = table.claim(b, table.pinned)
                except CacheFullError:            # every slot in use: nothing to evict
                    break
                table.policy.access(b)
                table.busy[s] = True
                cache._ready[s].clear()
            try:
                size = cache._load(s, b, old)
            finally:
                with cache.lock:
                    table.busy[s] = False
                    cache._ready[s].set()
            with cache.lock:
                cache.prefetch_reads += 1
                cache.prefetch_bytes += size
                cache._pending_bytes += size

    # -- reports -----------------------------------------------------------------------------------
    def recall(self) -> dict[str, np.ndarray]:
        """float (M,) per predictor: predicted share of each layer's chosen experts (nan for
        a layer never predicted)."""
        out = {}
        for name, h in self.recall_hits.items():
            n = self.recall_total[name]
            out[name] = np.where(n > 0, h / np.maximum(n, 1), np.nan)
        return out

    def stats(self) -> dict:
        """predictor, dropped (requests whose layer had started), recall per predictor and
        layer (None: never predicted), and its mean over the predicted layers."""
        rec = self.recall()
        return {"predictor": self.predictor, "dropped": self.dropped,
                "recall": {k: [None if np.isnan(v) else round(float(v), 4) for v in r]
                           for k, r in rec.items()},
                "mean_recall": {k: float(np.nanmean(r)) if np.isfinite(r).any() else None
                                for k, r in rec.items()}}

    def close(self) -> None:
        with self._wake:
            self._stop = True
            self._wake.notify()
        self._thread.join(timeout=5)


def _serve(ref: weakref.ref, wake: threading.Condition) -> None:
    """The prefetch thread: serve requests while the prefetcher lives and is not closed."""
    while True:
        with wake:
            p = ref()
            if p is None or p._stop:
                return
            if not p._queue:
                del p
                wake.wait(timeout=1.0)
                continue
            request = p._queue.popleft()
        p._fetch(*request)
        del p
