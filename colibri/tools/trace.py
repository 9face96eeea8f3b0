"""Routing as data: which experts each token chose, with what weights, out of which distribution.

    import colibri
    tr = colibri.trace(model, "def fib(n):")  # a Trace (colibri.tools.trace)
    tr.experts        int32   (T, M, K)  experts chosen per token and MoE layer, heaviest first
    tr.weights        float32 (T, M, K)  their combine weights, as the forward pass used them
    tr.logits         float32 (T, M, E)  raw router logits
    tr.probs          float32 (T, M, E)  softmax of the logits over all E experts
    tr.shared_gate    float32 (T, M) | None   sigmoid gate of the shared expert (Qwen2-MoE)
    tr.token_ids      int64   (T,)       the tokens
    tr.positions      int64   (T,)       position inside its window; 0 starts a new sequence
    tr.tokens         list[str] (T)      each token's text (decoded on first use)
    tr.layers         list[int] (M)      the model's MoE layer numbers (dense layers route nothing)
    tr.telemetry      TokenTelemetry | None   with telemetry=True: expert hits / misses (T, M),
                                         bytes read (T,), page faults (T,)
                                         (colibri.experts.telemetry)

A trace is taken from the forward pass itself (`Model.forward(..., return_routing=True)`), so
`experts` and `weights` are the ids and weights the expert kernels received, not a recomputation.

Long inputs run in windows of `window` tokens (default: the model's context, at most 4096),
each window through a fresh KV cache, fed `batch_size` tokens per forward call. `iter_trace`
yields one Trace per call, so a caller that folds them into statistics (colibri.tools.stats,
as `routing_stats` does) holds one chunk at a time, whatever the length of the text; `trace`
concatenates them. A text file given as a `pathlib.Path` is read and tokenized piece by piece
(at line ends), never whole.

Shapes in the package's alphabet (colibri): T tokens, M MoE layers, K experts per token,
E experts.
"""
from __future__ import annotations

import os
from collections.abc import Iterable, Iterator, Sequence
from pathlib import Path

import numpy as np

from ..engine.kv_cache import DEFAULT_MAX_CTX
from ..errors import ColibriError
from ..experts.telemetry import ExpertTelemetry, TokenTelemetry
from ..format.tokenizer import NoTokenizerError
from .stats import RoutingStats

__all__ = ["Trace", "trace", "iter_trace", "routing_stats", "UnknownLayerError", "format_route"]

DEFAULT_BATCH = 256              # tokens per forward call
_FILE_PIECE = 1 << 16            # characters of a text file tokenized at a time


class UnknownLayerError(ColibriError, ValueError):
    """A layer number that is not one of the model's MoE layers."""


def softmax(logits: np.ndarray) -> np.ndarray:
    """float32 softmax over the last axis, max-subtracted (as the router kernel computes it)."""
    z = np.asarray(logits, dtype=np.float32)
    z = np.exp(z - z.max(axis=-1, keepdims=True))
    return (z / z.sum(axis=-1, keepdims=True)).astype(np.float32, copy=False)


def format_route(experts: np.ndarray, weights: np.ndarray) -> str:
    """'3 0.62, 5 0.38': the experts of one token in one layer with their weights."""
    return ", ".join(f"{int(e)} {float(w):.2f}" for e, w in zip(experts, weights))


def _token_label(text: str, width: int = 16) -> str:
    """repr() of a token's text, shortened to `width` characters."""
    r = repr(text)
    return r if len(r) <= width else r[:width - 2] + "…" + r[-1]


class Trace:
    """Routing of T tokens through the M MoE layers of a model (see the module docstring).

    Construct with `trace()` / `iter_trace()`, or by hand for tests and other engines:
    `Trace(experts, weights, logits=..., probs=..., token_ids=..., positions=..., layers=...)`.
    `probs` defaults to softmax(logits); both may be None (probability statistics are then NaN).
    `positions` defaults to 0..T-1 (one sequence); `layers` to 0..L-1.
    """

    def __init__(self, experts, weights, *, logits=None, probs=None, token_ids=None,
                 positions=None, layers: Sequence[int] | None = None, shared_gate=None,
                 n_experts: int | None = None, tokenizer=None, tokens: Sequence[str] | None = None,
                 telemetry: TokenTelemetry | None = None):
        self.experts = np.asarray(experts, dtype=np.int32)                      # (T, M, K)
        self.weights = np.asarray(weights, dtype=np.float32)                    # (T, M, K)
        if self.experts.ndim != 3 or self.experts.shape != self.weights.shape:
            raise ValueError(f"experts and weights must both have shape (T, M, K); got "
                             f"{self.experts.shape} and {self.weights.shape}")
        T, M, K = self.experts.shape
        self.logits = None if logits is None else np.asarray(logits, dtype=np.float32)
        if probs is None and self.logits is not None:
            probs = softmax(self.logits)
        self.probs = None if probs is None else np.asarray(probs, dtype=np.float32)
        for name in ("logits", "probs"):
            a = getattr(self, name)
            if a is not None and (a.ndim != 3 or a.shape[:2] != (T, M)):
                raise ValueError(f"{name} must have shape ({T}, {M}, E), got {a.shape}")
        if n_experts is None:
            if self.probs is not None:
                n_experts = self.probs.shape[2]
            else:
                n_experts = int(self.experts.max()) + 1 if self.experts.size else 0
        self.n_experts = int(n_experts)
        if self.experts.size and (self.experts.min() < 0 or self.experts.max() >= self.n_experts):
            raise ValueError(f"expert ids must lie in [0, {self.n_experts}), found "
                             f"{int(self.experts.min())}..{int(self.experts.max())}")
        self.token_ids = (np.full(T, -1, np.int64) if token_ids is None
                          else np.asarray(token_ids, dtype=np.int64).reshape(T))
        self.positions = (np.arange(T, dtype=np.int64) if positions is None
                          else np.asarray(positions, dtype=np.int64).reshape(T))
        self.layers = list(range(M)) if layers is None else [int(x) for x in layers]
        if len(self.layers) != M:
            raise ValueError(f"{len(self.layers)} layer numbers for {M} layers of routing")
        self.shared_gate = None if shared_gate is None else \
            np.asarray(shared_gate, dtype=np.float32).reshape(T, M)
        self.tokenizer = tokenizer
        self._tokens = None if tokens is None else list(tokens)
        if telemetry is not None and telemetry.hits.shape != (T, M):
            raise ValueError(f"telemetry must have ({T}, {M}) hits, got {telemetry.hits.shape}")
        self.telemetry = telemetry

    # -- from a forward pass ---------------------------------------------------------------------
    @classmethod
    def from_routing(cls, routing, token_ids, positions=None, *, tokenizer=None,
                     n_experts: int | None = None) -> "Trace":
        """A Trace from the RoutingTrace of `Model.forward(ids (S,), return_routing=True)`.

        token_ids (S,): the ids that pass consumed; positions (S,): their positions.
        """
        def stack(arrays, last):            # M x (S, last) -> (S, M, last)
            return np.stack([np.asarray(a).reshape(len(token_ids), last) for a in arrays], axis=1)

        token_ids = np.asarray(token_ids, dtype=np.int64).reshape(-1)
        K = np.asarray(routing.ids[0]).shape[-1] if routing.ids else 0
        experts = stack(routing.ids, K)
        weights = stack(routing.weights, K)
        logits = stack(routing.logits, np.asarray(routing.logits[0]).shape[-1]) \
            if getattr(routing, "logits", None) else None
        gate = stack(routing.shared_gate, 1)[..., 0] if routing.shared_gate else None
        return cls(experts, weights, logits=logits, token_ids=token_ids, positions=positions,
                   layers=routing.layers, shared_gate=gate, n_experts=n_experts,
                   tokenizer=tokenizer)

    # -- sizes and parts ---------------------------------------------------------------------------
    def __len__(self) -> int:
        return self.experts.shape[0]

    @property
    def n_layers(self) -> int:
        return self.experts.shape[1]

    @property
    def top_k(self) -> int:
        return self.experts.shape[2]

    @property
    def tokens(self) -> list[str]:
        """Each token's text on its own (special tokens included); '[id]' without a tokenizer."""
        if self._tokens is None:
            ids = self.token_ids.tolist()
            if self.tokenizer is None:
                self._tokens = [f"[{i}]" for i in ids]
            else:
                text = {i: self.tokenizer.token_text(i) for i in set(ids) if i >= 0}
                self._tokens = [text.get(i, f"[{i}]") for i in ids]
        return self._tokens

    def layer_index(self, layer: int) -> int:
        """Index j along the M axis of MoE layer number `layer`."""
        try:
            return self.layers.index(int(layer))
        except ValueError:
            raise UnknownLayerError(f"layer {layer} is not a MoE layer of this model (MoE "
                                    f"layers: {', '.join(map(str, self.layers))})") from None

    def select_layers(self, layers: Iterable[int]) -> "Trace":
        """The same tokens, routing of the given MoE layers only (layer numbers, in that order)."""
        j = [self.layer_index(x) for x in layers]
        pick = lambda a: None if a is None else a[:, j]  # noqa: E731
        return Trace(self.experts[:, j], self.weights[:, j], logits=pick(self.logits),
                     probs=pick(self.probs), token_ids=self.token_ids, positions=self.positions,
                     layers=[self.layers[i] for i in j], shared_gate=pick(self.shared_gate),
                     n_experts=self.n_experts, tokenizer=self.tokenizer, tokens=self._tokens,
                     telemetry=None if self.telemetry is None else TokenTelemetry(
                         self.telemetry.hits[:, j], self.telemetry.misses[:, j],
                         *(getattr(self.telemetry, k) for k in TokenTelemetry.FIELDS[2:])))

    def __getitem__(self, index) -> "Trace":
        """Tokens `index` (a slice, or an int/bool/int-array selection) as a new Trace."""
        if isinstance(index, (int, np.integer)):
            index = slice(int(index), int(index) + 1 or None)
        pick = lambda a: None if a is None else a[index]  # noqa: E731
        tokens = None if self._tokens is None else \
            list(np.asarray(self._tokens, dtype=object)[index])
        return Trace(self.experts[index], self.weights[index], logits=pick(self.logits),
                     probs=pick(self.probs), token_ids=self.token_ids[index],
                     positions=self.positions[index], layers=self.layers,
                     shared_gate=pick(self.shared_gate), n_experts=self.n_experts,
                     tokenizer=self.tokenizer, tokens=tokens, telemetry=pick(self.telemetry))

    @classmethod
    def concat(cls, traces: Sequence["Trace"]) -> "Trace":
        """Tokens of several traces of the same model, one after the other."""
        traces = list(traces)
        if not traces:
            raise ValueError("nothing to concatenate: no traces")
        first = traces[0]
        for t in traces[1:]:
            if t.layers != first.layers or t.top_k != first.top_k or t.n_experts != first.n_experts:
                raise ValueError(f"traces disagree: layers {t.layers} vs {first.layers}, top-k "
                                 f"{t.top_k} vs {first.top_k}, experts {t.n_experts} vs "
                                 f"{first.n_experts}")

        def cat(name):
            parts = [getattr(t, name) for t in traces]
            return None if any(p is None for p in parts) else np.concatenate(parts)

        tokens = None if any(t._tokens is None for t in traces) else \
            [s for t in traces for s in t._tokens]
        tel = None if any(t.telemetry is None for t in traces) else \
            TokenTelemetry.concat([t.telemetry for t in traces])
        return cls(cat("experts"), cat("weights"), logits=cat("logits"), probs=cat("probs"),
                   token_ids=cat("token_ids"), positions=cat("positions"), layers=first.layers,
                   shared_gate=cat("shared_gate"), n_experts=first.n_experts,
                   tokenizer=first.tokenizer, tokens=tokens, telemetry=tel)

    # -- quick statistics --------------------------------------------------------------------------
    @property
    def expert_counts(self) -> np.ndarray:
        """int64 (M, E): how many tokens chose each expert in each MoE layer."""
        M, E = self.n_layers, self.n_experts
        flat = (np.arange(M)[None, :, None] * E + self.experts).reshape(-1)
        return np.bincount(flat, minlength=M * E).reshape(M, E).astype(np.int64)

    def stats(self, **kwargs) -> RoutingStats:
        """RoutingStats of this trace (colibri.tools.stats); kwargs go to RoutingStats."""
        return RoutingStats.from_trace(self, **kwargs)

    # -- text, JSON, HTML, files -----------------------------------------------------------------
    def format_table(self, limit: int | None = None, offset: int = 0) -> str:
        """One aligned line per token: "token   0 'def'  → L0 [3 0.62, 5 0.38]  L1 [...]".

        limit: at most this many tokens; offset: number of the first token (for chunks).
        """
        T = len(self) if limit is None else min(limit, len(self))
        labels = [_token_label(s) for s in self.tokens[:T]]
        wi = len(str(max(offset + T - 1, 0)))
        wt = max((len(s) for s in labels), default=0)
        cells = [[f"L{layer} [{format_route(self.experts[t, j], self.weights[t, j])}]"
                  for j, layer in enumerate(self.layers)] for t in range(T)]
        wc = [max(len(c[j]) for c in cells) for j in range(self.n_layers)] if cells else []
        lines = [f"token {offset + t:>{wi}} {labels[t]:<{wt}} → " +
                 "  ".join(c.ljust(w) for c, w in zip(cells[t], wc)).rstrip()
                 for t in range(T)]
        if T < len(self):
            lines.append(f"… {len(self) - T} more tokens")
        return "\n".join(lines)

    def to_dict(self, limit: int | None = None) -> dict:
        """JSON-ready: {"layers", "n_experts", "top_k", "tokens": [{"index", "id", "text",
        "position", "routes": [{"layer", "experts", "weights"[, "shared_gate"]}]}]}."""
        T = len(self) if limit is None else min(limit, len(self))
        rows = []
        for t in range(T):
            routes = []
            for j, layer in enumerate(self.layers):
                r = {"layer": layer, "experts": self.experts[t, j].tolist(),
                     "weights": [round(float(w), 6) for w in self.weights[t, j]]}
                if self.shared_gate is not None:
                    r["shared_gate"] = round(float(self.shared_gate[t, j]), 6)
                routes.append(r)
            rows.append({"index": t, "id": int(self.token_ids[t]), "text": self.tokens[t],
                         "position": int(self.positions[t]), "routes": routes})
        return {"layers": self.layers, "n_experts": self.n_experts, "top_k": self.top_k,
                "tokens": rows}

    def _repr_html_(self) -> str:
        from .display import trace_html   # notebook display: HTML code loaded on demand
        return trace_html(self)

    def __repr__(self) -> str:
        return (f"Trace({len(self)} tokens, MoE layers {self.layers}, top-{self.top_k} of "
                f"{self.n_experts} experts" + (", shared gate" if self.shared_gate is not None
                                               else "") + ")")

    def save(self, path: str | os.PathLike) -> None:
        """Write the arrays (and the token texts) to an .npz file; Trace.load reads it back."""
        arrays = {k: getattr(self, k) for k in ("experts", "weights", "logits", "probs",
                                                "token_ids", "positions", "shared_gate")
                  if getattr(self, k) is not None}
        if self.telemetry is not None:
            arrays.update({f"telemetry_{k}": getattr(self.telemetry, k)
                           for k in TokenTelemetry.FIELDS})
        np.savez_compressed(path, layers=np.asarray(self.layers, np.int64),
                            n_experts=np.int64(self.n_experts),
                            tokens=np.asarray(self.tokens, dtype=np.str_), **arrays)

    @classmethod
    def load(cls, path: str | os.PathLike) -> "Trace":
        with np.load(path, allow_pickle=False) as z:
            get = lambda k: z[k] if k in z.files else None  # noqa: E731
            tel = None if "telemetry_hits" not in z.files else \
                TokenTelemetry(*(z[f"telemetry_{k}"] for k in TokenTelemetry.FIELDS))
            return cls(z["experts"], z["weights"], logits=get("logits"), probs=get("probs"),
                       token_ids=get("token_ids"), positions=get("positions"),
                       layers=z["layers"].tolist(), shared_gate=get("shared_gate"),
                       n_experts=int(z["n_experts"]), tokens=z["tokens"].tolist(),
                       telemetry=tel)


# ---------------------------------------------------------------------------------------------
# running the model
# ---------------------------------------------------------------------------------------------

def _encode(model, text: str, first: bool = True) -> np.ndarray:
    tok = model.tokenizer
    if tok is None:
        raise NoTokenizerError(f"{model.file.path}: this model file carries no tokenizer; "
                               f"pass token ids instead of text")
    # a long piece of a file is meant to exceed the model's context (it runs in windows), so
    # the tokenizer's warning about that would be noise here
    ids = tok.encode(text, add_special_tokens=first, verbose=False, max_chars=None)
    return np.asarray(ids, dtype=np.int64)


def _file_pieces(model, path: Path) -> Iterator[np.ndarray]:
    """Token ids of a text file, piece by piece: ~64k characters cut after a line end."""
    first = True
    rest = ""
    with open(path, encoding="utf-8", errors="replace") as f:
        while True:
            block = f.read(_FILE_PIECE)
            text = rest + block
            if not block:
                if text:
                    yield _encode(model, text, first)
                return
            cut = text.rfind("\n") + 1
            if cut == 0 and len(text) < 16 * _FILE_PIECE:      # no line end yet: read more
                rest = text
                continue
            cut = cut or len(text)
            rest = text[cut:]
            yield _encode(model, text[:cut], first)
            first = False


def _sequences(model, source) -> Iterator[tuple[Iterator[np.ndarray], int | None]]:
    """(iterator of id blocks, total length if known) for each independent sequence."""
    if isinstance(source, str):
        ids = _encode(model, source)
        yield iter([ids]), len(ids)
    elif isinstance(source, os.PathLike):
        path = Path(source)
        if not path.is_file():
            raise ColibriError(f"{path}: no such text file")
        yield _file_pieces(model, path), None
    else:
        items = list(source) if not isinstance(source, np.ndarray) else source
        if len(items) and all(isinstance(s, str) for s in items):      # several texts
            for text in items:
                ids = _encode(model, text)
                yield iter([ids]), len(ids)
            return
        ids = np.asarray(items)
        if ids.dtype == object or ids.dtype.kind not in "iu":
            raise ValueError(f"expected text, a list of texts, a pathlib.Path or token ids; "
                             f"got an array of dtype {ids.dtype}")
        if ids.ndim == 2 and ids.shape[0] == 1:
            ids = ids[0]
        if ids.ndim != 1:
            raise ValueError(f"token ids must have shape (S,) (one sequence), got {ids.shape}")
        yield iter([ids.astype(np.int64)]), len(ids)


def iter_trace(model, source, *, batch_size: int = DEFAULT_BATCH, max_tokens: int | None = None,
               window: int | None = None, telemetry: bool = False) -> Iterator[Trace]:
    """Run `source` through the model, yielding the Trace of each forward call.

    source: text (str); a text file (pathlib.Path, read and tokenized piece by piece); a list
        of texts (each its own sequence, positions restart at 0); or token ids (S,).
    batch_size: tokens per forward call (each yielded Trace has at most this many).
    max_tokens: stop after this many tokens in total (None: all).
    window: tokens per KV cache; a longer sequence continues in a fresh window whose positions
        restart at 0 (default: the model's context length, at most 4096).
    telemetry: also record each token's expert hits / misses, bytes read and page faults
        (Trace.telemetry, colibri.experts.telemetry; with batch_size=1 every token is its own call,
        as in a decode).
    Only the last position's logits are computed (the head is skipped for the others).
    """
    if int(batch_size) != batch_size or batch_size < 1:
        raise ValueError(f"batch_size must be a positive integer, got {batch_size!r}")
    if max_tokens is not None and (int(max_tokens) != max_tokens or max_tokens < 1):
        raise ValueError(f"max_tokens must be a positive integer, got {max_tokens!r}")
    ctx_max = model.max_context
    if window is None:
        window = min(ctx_max, DEFAULT_MAX_CTX)
    if int(window) != window or not 1 <= window <= ctx_max:
        raise ValueError(f"window must be an integer in [1, {ctx_max}] (the model's context "
                         f"length), got {window!r}")
    recorder = ExpertTelemetry(model) if telemetry else None
    try:
        yield from _traces(model, source, batch_size, max_tokens, window, recorder)
    finally:
        if recorder is not None:
            recorder.close()


def _traces(model, source, batch_size: int, max_tokens: int | None, window: int,
            recorder: ExpertTelemetry | None) -> Iterator[Trace]:
    budget = max_tokens if max_tokens is not None else -1
    seen = 0
    for blocks, total in _sequences(model, source):
        cache = None
        for block in blocks:
            i = 0
            while i < len(block):
                if budget >= 0 and seen >= budget:
                    return
                if cache is None or cache.remaining == 0:
                    # a sequence of known length is one block: size the cache to what is left
                    cache = model.new_cache(ctx=window if total is None
                                            else min(window, len(block) - i))
                n = min(batch_size, len(block) - i, cache.remaining)
                if budget >= 0:
                    n = min(n, budget - seen)
                chunk = block[i:i + n]
                start = cache.length
                _, routing = model.forward(chunk, cache=cache, return_routing=True, last_only=True)
                tr = Trace.from_routing(routing, chunk, np.arange(start, start + n),
                                        tokenizer=model.tokenizer,
                                        n_experts=model.config.num_experts)
                if recorder is not None:
                    tr.telemetry = recorder.collect()
                yield tr
                i += n
                seen += n


def trace(model, source, *, batch_size: int = DEFAULT_BATCH, max_tokens: int | None = None,
          window: int | None = None, telemetry: bool = False) -> Trace:
    """The routing of every token of `source` as one Trace (see iter_trace for the arguments).

    Memory: T x M x (2K + 2E) x 4 bytes; for statistics over long texts use
    routing_stats, which folds the chunks as they come.
    """
    parts = list(iter_trace(model, source, batch_size=batch_size, max_tokens=max_tokens,
                            window=window, telemetry=telemetry))
    if not parts:
        raise ValueError("the input has no tokens")
    return parts[0] if len(parts) == 1 else Trace.concat(parts)


def routing_stats(model, source, *, batch_size: int = DEFAULT_BATCH,
                  max_tokens: int | None = None, window: int | None = None,
                  layers: Iterable[int] | None = None, **kwargs) -> RoutingStats:
    """Statistics of `source` (text, list of texts, pathlib.Path of a text file, or ids),
    folded chunk by chunk: memory O(M·E²) plus one chunk of routing, whatever the length.

    layers: restrict to these MoE layers; other arguments as iter_trace;
    kwargs go to RoutingStats (lru_sizes, rare_threshold).
    """
    stats = None
    for part in iter_trace(model, source, batch_size=batch_size, max_tokens=max_tokens,
                           window=window):
        if layers is not None:
            part = part.select_layers(layers)
        if stats is None:
            stats = RoutingStats(part.layers, part.n_experts, part.top_k, **kwargs)
        stats.update(part)
    if stats is None:
        raise ValueError("the input has no tokens")
    return stats
