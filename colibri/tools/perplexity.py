"""Perplexity of a model over a text, and what a quantization cost against a base model.

    res = perplexity("model-q4.colibri", text, ctx=512, base="model-f32.colibri")
    res.ppl, res.kl.mean, res.kl.same_top, res.kl.ppl_ratio

The text is tokenized once (as the tokenizer does by default) and cut into windows of `ctx`
tokens; each window is one forward pass from an empty cache, and only some of its positions
are scored, so every scored token has context behind it:

- default (llama.cpp's `llama-perplexity`): consecutive, non-overlapping windows of ctx tokens
  (a tail shorter than ctx is dropped); in each, the second half is scored: the logits at
  positions ctx/2 .. ctx-2 predict the tokens at ctx/2+1 .. ctx-1. Every scored token has at
  least ctx/2 tokens of context. As llama-perplexity does, when the tokenizer puts a BOS
  first (`bos=None`, the default) the first token of every window is replaced by BOS, so
  each window starts as a tokenized text does (that position is never scored); `bos=False`
  cuts the stream as it is.
- stride S (transformers' sliding-window recipe, 1 <= S < ctx): windows start every S tokens;
  each scores the tokens no earlier window scored, so every token but the first is scored
  once, with at least ctx - S tokens of context (fewer in the first window). The last window
  is moved back to end at the last token, so all windows hold ctx tokens. The stream is cut
  as it is (transformers' recipe) unless `bos=True`.

Per scored token: nll = -log softmax(logits)[target] (float64). Perplexity = exp(mean nll),
with the standard error exp(mean) * sd(nll) / sqrt(n), as llama-perplexity prints it.

Against a base model (the same windows through both): KL(base || model) per scored position,
sum_v p_base(v) (log p_base(v) - log p_model(v)), its mean, median, 90/95/99/99.9 % quantiles
and maximum; the same-top-token rate (argmax of both logits equal); and the perplexity ratio
PPL(model) / PPL(base). Both models must share the tokenizer (the same tokenizer.json) and
the vocabulary size. The same forward passes also return both models' routing, compared per
MoE layer over every position of every window (`res.routing`, colibri.tools.fidelity: top-k set
agreement, top-1 agreement, router-weight error).

Shapes in the package's alphabet (colibri): B windows in a batch, S = ctx tokens each, V vocab;
n scored tokens of a window, N of the whole text.
"""
from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from ..engine.kv_cache import DEFAULT_KV_DTYPE
from ..engine.model import DEFAULT_ACTIVATIONS, Model
from ..errors import ColibriError
from ..format.tokenizer import NoTokenizerError
from .fidelity import RoutingFidelity, compare_routing, fidelity_rows
from .trace import Trace

__all__ = ["perplexity", "plan_windows", "window_bos", "PerplexityResult", "KLStats",
           "token_logprobs", "check_same_vocabulary", "format_markdown", "MIN_CTX"]

MIN_CTX = 4
QUANTILES = (0.90, 0.95, 0.99, 0.999)


# ---------------------------------------------------------------------------------------------
# windows
# ---------------------------------------------------------------------------------------------

def plan_windows(n_tokens: int, ctx: int, stride: int | None = None) -> list[tuple[int, int]]:
    """Windows over a stream of n_tokens: a list of (begin, first), each window being tokens
    [begin, begin + ctx) whose positions first .. ctx-1 are scored (predicted by the logits
    at first-1 .. ctx-2). See the module docstring for the two schemes."""
    if ctx < MIN_CTX:
        raise ValueError(f"ctx must be at least {MIN_CTX}, got {ctx}")
    if n_tokens < ctx:
        raise ValueError(f"the text has {n_tokens} tokens, fewer than one window of ctx {ctx}; "
                         f"use a longer text or a smaller ctx")
    if stride is None:
        first = ctx // 2 + 1
        return [(c * ctx, first) for c in range(n_tokens // ctx)]
    if not 1 <= stride < ctx:
        raise ValueError(f"stride must be in [1, ctx) = [1, {ctx}), got {stride}")
    windows = [(0, 1)]
    begin, scored_to = 0, ctx          # tokens [0, scored_to) are scored (or the first token)
    while scored_to < n_tokens:
        begin += stride
        end = min(begin + ctx, n_tokens)
        b = end - ctx                  # the last window is moved back to hold ctx tokens
        windows.append((b, scored_to - b))
        scored_to = end
    return windows


# ---------------------------------------------------------------------------------------------
# per-token numbers
# ---------------------------------------------------------------------------------------------

def token_logprobs(logits: np.ndarray) -> np.ndarray:
    """log softmax over the last axis, in float64: logits (..., V) -> (..., V)."""
    x = logits.astype(np.float64)
    x -= x.max(axis=-1, keepdims=True)
    x -= np.log(np.exp(x).sum(axis=-1, keepdims=True))
    return x


@dataclass
class KLStats:
    """KL(base || model) over the scored positions, and how often both pick the same token.

    kl: float64 (N,) per scored position, in nats. ppl_base: the base model's perplexity over
    the same tokens; ppl_ratio = PPL(model) / PPL(base).
    """
    base: str
    kl: np.ndarray = field(repr=False)
    same_top: float
    ppl_base: float
    ppl_ratio: float

    @property
    def mean(self) -> float:
        return float(self.kl.mean())

    @property
    def stderr(self) -> float:
        n = self.kl.size
        return float(self.kl.std(ddof=1) / math.sqrt(n)) if n > 1 else 0.0

    @property
    def median(self) -> float:
        return float(np.median(self.kl))

    def quantile(self, q: float) -> float:
        return float(np.quantile(self.kl, q))

    @property
    def max(self) -> float:
        return float(self.kl.max())

    def to_dict(self) -> dict[str, Any]:
        out = {"base": self.base, "kl_mean": self.mean, "kl_stderr": self.stderr,
               "kl_median": self.median}
        out.update({f"kl_q{_qname(q)}": self.quantile(q) for q in QUANTILES})
        out.update(kl_max=self.max, same_top=self.same_top, ppl_base=self.ppl_base,
                   ppl_ratio=self.ppl_ratio)
        return out


def _qname(q: float) -> str:
    return f"{100 * q:g}".replace(".", "_")          # 0.999 -> "99_9"


@dataclass
class PerplexityResult:
    """Perplexity of `model` over a token stream; `kl` when a base model was given.

    nll: float64 (N,) negative log-likelihood of each scored token, in stream order.
    windows: the (begin, first) pairs of plan_windows.
    """
    model: str
    n_tokens: int
    ctx: int
    stride: int | None
    windows: list[tuple[int, int]] = field(repr=False)
    nll: np.ndarray = field(repr=False)
    kl: KLStats | None = None
    routing: RoutingFidelity | None = None      # with a base model that routes (MoE layers)
    bos: int | None = None                      # the id put first in every window, if any

    @property
    def n_scored(self) -> int:
        return int(self.nll.size)

    @property
    def ppl(self) -> float:
        return float(math.exp(self.nll.mean()))

    @property
    def ppl_stderr(self) -> float:
        n = self.nll.size
        return self.ppl * float(self.nll.std(ddof=1)) / math.sqrt(n) if n > 1 else 0.0

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready summary (no per-token arrays)."""
        out = {"model": self.model, "n_tokens": self.n_tokens, "ctx": self.ctx,
               "stride": self.stride, "window_bos": self.bos, "n_windows": len(self.windows),
               "n_scored": self.n_scored, "ppl": self.ppl, "ppl_stderr": self.ppl_stderr,
               "nll_mean": float(self.nll.mean())}
        out["kl"] = self.kl.to_dict() if self.kl is not None else None
        out["routing"] = self.routing.to_dict() if self.routing is not None else None
        return out


# ---------------------------------------------------------------------------------------------
# inputs
# ---------------------------------------------------------------------------------------------

def _model(m, threads: int | None, activations: str, kv_dtype: str):
    """(Model, opened_here) for a Model (kept as it is) or a path (opened with activations
    and kv_dtype)."""
    if isinstance(m, Model):
        return m, False
    return Model(m, threads=threads, activations=activations, kv_dtype=kv_dtype), True


def _window_cache(m, x: np.ndarray):
    """A cache for the windows x (B, S) when m stores its caches in 16 bits (the window then
    attends over the rounded keys and values, as it would through generate); None for f32,
    whose cache would hold the same values as no cache."""
    return None if m.kv_dtype == "f32" else m.new_cache(ctx=x.shape[1], batch=x.shape[0])


def check_same_vocabulary(model, base) -> None:
    """ColibriError unless both models have the same vocabulary size and tokenizer.json."""
    if model.vocab_size != base.vocab_size:
        raise ColibriError(f"{base.file.path} and {model.file.path} do not share a vocabulary: "
                           f"vocab_size {base.vocab_size} vs {model.vocab_size}")
    a = (base.file.tokenizer_files or {}).get("tokenizer.json")
    b = (model.file.tokenizer_files or {}).get("tokenizer.json")
    if a != b:
        what = ("only one of them carries a tokenizer" if (a is None) != (b is None)
                else "their tokenizers (tokenizer.json) differ")
        raise ColibriError(f"{base.file.path} and {model.file.path} do not share a tokenizer: "
                           f"{what}")


def window_bos(model, bos: bool | None, stride: int | None) -> int | None:
    """The token id put first in every window, or None: bos True -> the tokenizer's BOS
    (ValueError when the model has none), False -> None, None -> the BOS when the scheme is
    llama-perplexity's (stride None) and the tokenizer puts a BOS first, else None."""
    tok = model.tokenizer
    if bos is None:
        return tok.bos_token_id if stride is None and tok is not None and tok.adds_bos else None
    if not bos:
        return None
    if tok is None or tok.bos_token_id is None:
        raise ValueError(f"bos=True, but {model.file.path} has no BOS token "
                         f"({'no tokenizer' if tok is None else 'its tokenizer names none'})")
    return int(tok.bos_token_id)


def _token_ids(model, data) -> np.ndarray:
    if isinstance(data, str):
        tok = model.tokenizer
        if tok is None:
            raise NoTokenizerError(f"{model.file.path} carries no tokenizer, so text cannot be "
                                   f"scored; give token ids instead")
        # verbose=False: no "longer than the maximum length" warning, the windows cut it;
        # max_chars=None: a corpus the caller chose, of any length
        ids = np.asarray(tok.encode(data, verbose=False, max_chars=None), dtype=np.int64)
    else:
        ids = np.asarray(data)
        if ids.dtype.kind not in "iu" or ids.ndim != 1:
            raise ValueError(f"token ids must be a 1-D integer array, got {ids.dtype} "
                             f"{ids.shape}")
        ids = ids.astype(np.int64)
    if ids.size and (int(ids.min()) < 0 or int(ids.max()) >= model.vocab_size):
        raise ValueError(f"token ids out of range [0, {model.vocab_size}): min {int(ids.min())}, "
                         f"max {int(ids.max())}")
    return ids


# ---------------------------------------------------------------------------------------------
# the measurement
# ---------------------------------------------------------------------------------------------

def perplexity(model, data: str | Sequence[int] | np.ndarray, *, ctx: int | None = None,
               stride: int | None = None, batch: int = 1, base=None,
               threads: int | None = None, activations: str = DEFAULT_ACTIVATIONS,
               kv_dtype: str = DEFAULT_KV_DTYPE, bos: bool | None = None,
               progress: Callable[[int, int], None] | None = None) -> PerplexityResult:
    """Perplexity of `model` over `data`, and KL statistics against `base` when given.

    model, base: a Model or the path of a .colibri file (opened with `threads`, closed after).
    activations: of `model` when it is a path ("int16" the default, "f32" exact or "int8",
        see colibri.load); a `base` given as a path always runs with exact f32 activations,
        so `base` = the same file measures what the model's activations cost.
    kv_dtype: of `model` when it is a path ("f16" the default, "bf16", "f32"; a Model keeps
        its own): a 16-bit model runs each window through a cache of that dtype; a `base`
        given as a path always runs f32 (no cache), so --kl-base measures the cache's cost.
    data: text (tokenized with the model's tokenizer) or token ids int (T,).
    ctx: window length (default: min(512, the model's context)); stride: None for
        llama-perplexity's scheme (second half of non-overlapping windows), or the step of
        sliding windows (module docstring). batch: windows per forward pass.
    bos: put the tokenizer's BOS first in every window (True), cut the stream as it is
        (False), or (None) do as llama-perplexity does: BOS first when the scheme is its own
        and the tokenizer puts a BOS first. The result's `bos` says which id, if any.
    progress: called as progress(windows_done, windows_total) after each batch.
    Raises ValueError (numbers named) for bad ctx/stride/batch or a text shorter than ctx,
    ColibriError when base and model do not share the tokenizer.
    """
    if isinstance(batch, bool) or not isinstance(batch, (int, np.integer)) or batch < 1:
        raise ValueError(f"batch must be an integer >= 1, got {batch!r}")
    m, own_m = _model(model, threads, activations, kv_dtype)
    b, own_b = (None, False) if base is None else _model(base, threads, "f32", "f32")
    try:
        if b is not None:
            check_same_vocabulary(m, b)
        ctx = min(512, m.max_context) if ctx is None else int(ctx)
        limit = min(m.max_context, b.max_context) if b is not None else m.max_context
        if ctx > limit:
            raise ValueError(f"ctx {ctx} is longer than the model's context {limit}")
        ids = _token_ids(m, data)
        windows = plan_windows(ids.size, ctx, stride)
        first_id = window_bos(m, bos, stride)
        nll: list[np.ndarray] = []
        kl: list[np.ndarray] = []
        same: list[np.ndarray] = []
        base_nll: list[np.ndarray] = []
        routes = b is not None and bool(m.moe_layers)
        routing: RoutingFidelity | None = None
        for start in range(0, len(windows), batch):
            group = windows[start:start + batch]
            x = np.stack([ids[w:w + ctx] for w, _ in group])                       # (B, S)
            if first_id is not None:
                x[:, 0] = first_id                 # never a scored position (first >= 1)
            if routes:
                logits, r_m = m.forward(x, _window_cache(m, x), return_routing=True)   # (B, S, V)
                blogits, r_b = b.forward(x, _window_cache(b, x), return_routing=True)
                part = _compare(r_m, r_b, x.reshape(-1), m, b)
                routing = part if routing is None else routing + part
            else:
                logits = m.forward(x, _window_cache(m, x))                         # (B, S, V)
                blogits = b.forward(x, _window_cache(b, x)) if b is not None else None
            for j, (_, first) in enumerate(group):
                targets = x[j, first:]                                             # (n,)
                lp = token_logprobs(logits[j, first - 1:ctx - 1])                  # (n, V)
                nll.append(-lp[np.arange(targets.size), targets])
                if blogits is not None:
                    blp = token_logprobs(blogits[j, first - 1:ctx - 1])            # (n, V)
                    base_nll.append(-blp[np.arange(targets.size), targets])
                    d = (np.exp(blp) * (blp - lp)).sum(axis=-1)
                    kl.append(np.maximum(d, 0.0))       # >= 0 up to rounding
                    same.append(lp.argmax(axis=-1) == blp.argmax(axis=-1))
            if progress is not None:
                progress(min(start + batch, len(windows)), len(windows))
        res = PerplexityResult(str(m.file.path), int(ids.size), ctx, stride, windows,
                               np.concatenate(nll), bos=first_id)
        if b is not None:
            bn = np.concatenate(base_nll)
            ppl_base = float(math.exp(bn.mean()))
            res.kl = KLStats(str(b.file.path), np.concatenate(kl),
                             float(np.concatenate(same).mean()), ppl_base, res.ppl / ppl_base)
            if routing is not None:
                routing.model, routing.base = res.model, res.kl.base
            res.routing = routing
        return res
    finally:
        if own_m:
            m.close()
        if own_b:
            b.close()


def _compare(r_m, r_b, ids: np.ndarray, m, b) -> RoutingFidelity:
    """compare_routing of two forward passes' RoutingTraces over the same ids (B*S,)."""
    try:
        return compare_routing(Trace.from_routing(r_m, ids, n_experts=m.config.num_experts),
                               Trace.from_routing(r_b, ids, n_experts=b.config.num_experts))
    except ValueError as e:
        raise ColibriError(f"{b.file.path} and {m.file.path}: {e}") from None


# ---------------------------------------------------------------------------------------------
# text
# ---------------------------------------------------------------------------------------------

def _md_table(header: list[str], rows: list[list[str]], right: set[int]) -> list[str]:
    body = [header] + rows
    widths = [max(len(r[i]) for r in body) for i in range(len(header))]
    out = []
    for j, r in enumerate(body):
        out.append("| " + " | ".join(c.rjust(w) if i in right else c.ljust(w)
                                     for i, (c, w) in enumerate(zip(r, widths))) + " |")
        if j == 0:
            out.append("| " + " | ".join("-" * (w - 1) + ":" if i in right else "-" * w
                                         for i, w in enumerate(widths)) + " |")
    return out


def _fmt(x: float) -> str:
    return f"{x:.4g}" if abs(x) >= 1e-3 or x == 0 else f"{x:.2e}"


def format_markdown(res: PerplexityResult, source: str | None = None) -> str:
    """Perplexity table (model, and base when compared), then the KL table."""
    scheme = (f"second half of {len(res.windows)} windows of {res.ctx}" if res.stride is None
              else f"{len(res.windows)} windows of {res.ctx}, stride {res.stride}")
    if res.bos is not None:
        scheme += f", each starting with BOS ({res.bos})"
    lines = [f"{source or 'text'}: {res.n_tokens} tokens; scored {res.n_scored} ({scheme})", ""]
    rows = [[Path(res.model).name, f"{res.ppl:.4f} ± {res.ppl_stderr:.4f}",
             f"{float(res.nll.mean()):.4f}"]]
    if res.kl is not None:
        rows.append([Path(res.kl.base).name + " (base)", f"{res.kl.ppl_base:.4f}", ""])
    lines += _md_table(["model", "PPL", "mean nll"], rows, {1, 2})
    if res.kl is not None:
        k = res.kl
        lines.append("")
        lines += _md_table(
            ["KL(base ‖ model), nats", "mean", "median", "90%", "95%", "99%", "99.9%", "max",
             "same top", "PPL ratio"],
            [[Path(res.model).name, f"{_fmt(k.mean)} ± {_fmt(k.stderr)}", _fmt(k.median),
              *(_fmt(k.quantile(q)) for q in QUANTILES), _fmt(k.max), f"{100 * k.same_top:.2f}%",
              f"{k.ppl_ratio:.4f}"]],
            set(range(1, 10)))
    if res.routing is not None:
        title, header, rows = fidelity_rows(res.routing)
        lines += ["", title, ""] + _md_table(header, rows, set(range(1, len(header))))
    return "\n".join(lines)
