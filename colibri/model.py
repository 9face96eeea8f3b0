"""Model: the weights of a .colibri file as views over its mapping, and the forward pass.

Nothing is copied at load time: dense matrices and expert stacks become WeightRefs (byte
offsets into the mapping) that the kernels read in place, whatever their format (f32, f16,
bf16, q8, q4); norm weights and biases are small float32 views. The forward pass reads top to
bottom in data-flow order:

    embed -> per layer [RMSNorm -> attention (NumPy) -> + -> RMSNorm -> MoE or dense MLP -> +]
          -> RMSNorm -> head (kernels.linear) -> float32 logits

A decode step (one token of one sequence, a cache without padding) takes a fast path with the
same operations: no mask, the residual stream updated in place, every per-layer vector in the
cache's preallocated DecodeWork (Model.fast_decode = False turns it off). q, k and v, adjacent in
the file, are one kernel call (one WeightRef over the three matrices); the kernels are called
prepared (weights checked at load), norms and RoPE are compiled row operations
(Model.compiled_row_ops), and a plain decode call (no routing, mask or positions) enters
through Model._decode_step, which skips the general input checks and the BLAS thread limit.

Shape alphabet: B batch, S sequence (new tokens), T = B*S tokens, D hidden, V vocab,
H / Hkv heads, Dh head dim, E experts, K experts per token, I expert intermediate,
L keys attended, G scale groups.
"""
from __future__ import annotations

import functools
import os
import time
from dataclasses import dataclass, field

import numpy as np

from . import kernels, quant
from .attention import Attention, DecodeWork, Rope, build_mask, rms_norm, rms_norm_row
from .errors import ColibriError
from .format import ColibriFile, QuantizedTensor
from .kv_cache import DEFAULT_MAX_CTX, KVCache
from .moe import DenseMLP, MoE
from .runtime import Timings, blas_on_one_thread, default_threads
from .weights import WeightRef, expert_ref, fused_ref, vector, weight_ref

__all__ = ["Model", "RoutingTrace"]


# ---------------------------------------------------------------------------------------------
# routing trace
# ---------------------------------------------------------------------------------------------

@dataclass
class RoutingTrace:
    """Which experts each token chose, per MoE layer.

    layers: the MoE layer numbers, in order; ids[j] int32 (B, S, K) and weights[j] float32
    (B, S, K) belong to layers[j] (B is dropped for 1-D input); shared_gate[j] float32 (B, S)
    is sigmoid(x·g) of the shared expert when the model has one, else the list is empty;
    logits[j] float32 (B, S, E) are the raw router logits (the full distribution is their
    softmax; colibri.trace builds on them).
    """
    layers: list[int]
    ids: list[np.ndarray]
    weights: list[np.ndarray]
    shared_gate: list[np.ndarray] = field(default_factory=list)
    logits: list[np.ndarray] = field(default_factory=list)

    def __getitem__(self, layer: int) -> tuple[np.ndarray, np.ndarray]:
        """(ids, weights) of MoE layer number `layer`."""
        try:
            j = self.layers.index(layer)
        except ValueError:
            raise KeyError(f"layer {layer} has no routed experts (MoE layers: {self.layers})") from None
        return self.ids[j], self.weights[j]

    def stacked(self) -> tuple[np.ndarray, np.ndarray]:
        """ids int32 (n_moe_layers, [B,] S, K) and weights float32 of the same shape."""
        return np.stack(self.ids), np.stack(self.weights)

    def __repr__(self) -> str:
        shape = self.ids[0].shape if self.ids else ()
        return f"RoutingTrace(layers={self.layers}, ids/weights per layer {shape})"


# ---------------------------------------------------------------------------------------------
# the model
# ---------------------------------------------------------------------------------------------

@dataclass
class _Layer:
    attn_norm: np.ndarray
    attn: Attention
    ffn_norm: np.ndarray
    ffn: MoE | DenseMLP


class _Linear:
    """x (N, C) -> x @ W^T (+ b) through kernels.linear; a projection for Attention.

    out: float32 (N, R) to write into (the decode fast path passes its buffers, 2-D and
    contiguous as x: then the call is the prepared one, the weight checked at load)."""

    __slots__ = ("w", "b", "threads", "activations", "prepared")

    def __init__(self, w: WeightRef, b: np.ndarray | None, threads: int, activations: str):
        self.w, self.b, self.threads, self.activations = w, b, threads, activations
        self.prepared = kernels.prepare_linear(w, b, threads=threads, activations=activations)

    def __call__(self, x: np.ndarray, out: np.ndarray | None = None) -> np.ndarray:
        if out is None:
            return kernels.linear(x, self.w, self.b, threads=self.threads,
                                  activations=self.activations)
        self.prepared(x, out)
        return out


def _fused_linear(projs: tuple[_Linear, ...], threads: int) -> _Linear | None:
    """q, k, v projections as one _Linear when their matrices are adjacent in the file (the
    converter writes them so) and all or none have a bias: one kernel call instead of three,
    the same values (each output row is one row-kernel call, whatever the matrix around it)."""
    ref = fused_ref([p.w for p in projs])
    biases = [p.b for p in projs]
    if ref is None or (any(b is None for b in biases) and any(b is not None for b in biases)):
        return None
    bias = None if biases[0] is None else np.concatenate(biases).astype(np.float32, copy=False)
    return _Linear(ref, bias, threads, projs[0].activations)


def _trace_layer(trace: RoutingTrace, i: int, moe: MoE, x: np.ndarray, ids: np.ndarray,
                 wts: np.ndarray, gate: np.ndarray | None, B: int, S: int, threads: int) -> None:
    """Append MoE layer i's routing (ids, weights (T, K), shared gate (T,), x (T, D)) to
    trace, shaped (B, S, ...)."""
    trace.layers.append(i)
    trace.ids.append(ids.reshape(B, S, -1).astype(np.int32, copy=False))
    trace.weights.append(wts.reshape(B, S, -1).astype(np.float32, copy=False))
    if gate is not None:
        trace.shared_gate.append(gate.reshape(B, S))
    # the router matmul again, outside the timed stages: same kernel, same input, so the
    # same logits the routing above was computed from
    trace.logits.append(kernels.linear(x, moe.router, threads=threads).reshape(B, S, -1))


def _norm_row(work: DecodeWork, x: np.ndarray, weight: np.ndarray, eps: np.float32,
              out: np.ndarray) -> np.ndarray:
    """RMSNorm of the residual row x (1, D) into out (1, D), by the work's compiled row
    operation when it has one (the same bits as rms_norm_row)."""
    if work.norm_rows is not None:
        work.norm_rows(x, weight, eps, out)
        return out
    return rms_norm_row(x, weight, eps, out, work.tmp)


class Model:
    """A loaded .colibri model. `Model(path_or_file, threads=None, activations="f32")`; see
    colibri.load."""

    # Decode fast path (one sequence, one new token, a cache without padding): no mask, the
    # residual stream updated in place, every per-layer vector in preallocated buffers (one
    # DecodeWork per cache). False sends every step through the general path (tests compare).
    fast_decode = True
    # The decode fast path's RMSNorms and RoPE as compiled row operations (kernels.
    # rms_norm_rows_into, rope_rows_into: NumPy's arithmetic in one call each) instead of
    # chains of NumPy calls, and the cache write joined to the attention kernel's call
    # (kernels.attend_cached_into). False: the NumPy code and KVCache.write_one (tests compare).
    compiled_row_ops = True

    def __init__(self, file: str | os.PathLike | ColibriFile, threads: int | None = None,
                 activations: str = "f32"):
        if threads is not None and (int(threads) != threads or threads < 1):
            raise ValueError(f"threads must be a positive integer, got {threads!r}")
        if activations not in kernels.ACTIVATIONS:
            raise ValueError(f"activations must be one of {', '.join(kernels.ACTIVATIONS)}, "
                             f"got {activations!r}")
        self.activations = activations
        self.file = file if isinstance(file, ColibriFile) else ColibriFile(file)
        self.threads = int(threads) if threads is not None else default_threads()
        a = self.arch = dict(self.file.arch)
        self.config = self.file.model_config      # typed geometry (colibri.config.ModelConfig)
        self.hf_config = self.file.config         # the checkpoint's config.json, as converted
        self.vocab_size = int(a["vocab_size"])
        self.hidden_size = int(a["hidden_size"])
        self.n_layers = int(a["num_hidden_layers"])
        self.n_heads = int(a["num_attention_heads"])
        self.n_kv_heads = int(a["num_key_value_heads"])
        self.head_dim = int(a["head_dim"])
        self.eps = float(a["rms_norm_eps"])
        self.moe_layers = [int(i) for i in a.get("moe_layers", range(self.n_layers))]
        self.timings = Timings()
        self.last_stats = None          # GenerationStats of the last generate() call
        self._tokenizer = None
        self._tokenizer_loaded = False
        self._build()

    # -- construction -----------------------------------------------------------------------
    def _build(self) -> None:
        f, a, t = self.file, self.arch, self.threads
        buf = np.frombuffer(f.buffer, dtype=np.uint8)      # the whole mapping, read-only, 1-D
        self._buf = buf
        if a.get("router", "softmax_topk") != "softmax_topk":
            raise ColibriError(f"{f.path}: router rule {a.get('router')!r} is not supported "
                               f"(supported: softmax_topk)")
        self.rope = Rope.from_arch(a)
        self._attend_cached = functools.partial(kernels.attend_cached_into, threads=t)
        self._eps32 = np.float32(self.eps)
        self._work_args = (self.hidden_size, self.n_heads, self.n_kv_heads, self.head_dim,
                           self.rope.rot_dim // 2)
        self.embedding = f.tensor("tok_embeddings")                                  # (V, D)
        head = "tok_embeddings" if a.get("tie_word_embeddings") or "lm_head" not in f else "lm_head"
        self.head = weight_ref(f, buf, head)                                         # (V, D)
        self._head = kernels.prepare_linear(self.head, threads=t, activations=self.activations)
        self._cache_dims = (self.n_layers, self.n_kv_heads, self.head_dim)
        self.final_norm = vector(f, "norm")
        window = a.get("sliding_window") or None
        layer_types = a.get("layer_types")
        moe = set(self.moe_layers)
        self.layers: list[_Layer] = []
        for i in range(self.n_layers):
            p = f"layers.{i}."
            bias = lambda n: vector(f, p + n) if (p + n) in f else None   # noqa: E731
            proj = lambda n, b: _Linear(weight_ref(f, buf, p + n), bias(b), t,  # noqa: E731
                                        self.activations)
            qk_norm = a.get("qk_norm", "none")
            w = window if (layer_types is None or layer_types[i] == "sliding_attention") else None
            wq, wk, wv = (proj(f"attn.w{n}", f"attn.b{n}") for n in "qkv")
            attn = Attention(
                wq, wk, wv, proj("attn.wo", "attn.bo"),
                n_heads=self.n_heads, n_kv_heads=self.n_kv_heads, head_dim=self.head_dim,
                eps=self.eps, qk_norm=qk_norm,
                q_norm=vector(f, p + "attn.q_norm") if qk_norm != "none" else None,
                k_norm=vector(f, p + "attn.k_norm") if qk_norm != "none" else None,
                clip_qkv=a.get("clip_qkv"), window=w, wqkv=_fused_linear((wq, wk, wv), t),
                attend_one=functools.partial(kernels.attend_decode_into, threads=t))
            if i in moe:
                E = int(a["num_experts"])
                shared = None
                if int(a.get("shared_expert_intermediate_size") or 0) > 0:
                    shared = tuple(weight_ref(f, buf, f"{p}moe.shared.{n}")
                                   for n in ("w_gate", "w_up", "w_down"))
                gate = (weight_ref(f, buf, p + "moe.shared_gate")
                        if shared is not None and a.get("shared_expert_gate") else None)
                ffn = MoE(weight_ref(f, buf, p + "moe.router"),
                          *(expert_ref(f, buf, i, n, E) for n in ("w_gate", "w_up", "w_down")),
                          top_k=int(a["num_experts_per_tok"]),
                          norm_topk_prob=bool(a.get("norm_topk_prob")), threads=t,
                          shared=shared, shared_gate=gate, activations=self.activations)
            else:
                ffn = DenseMLP(*(weight_ref(f, buf, f"{p}mlp.{n}")
                                 for n in ("w_gate", "w_up", "w_down")), threads=t,
                                activations=self.activations)
            self.layers.append(_Layer(vector(f, p + "attn_norm"), attn,
                                      vector(f, p + "ffn_norm"), ffn))

    # -- helpers -------------------------------------------------------------------------------
    @property
    def tokenizer(self):
        """The model's Tokenizer (built on first use from the embedded files), or None."""
        if not self._tokenizer_loaded:
            from .tokenizer import tokenizer_from_files
            self._tokenizer = tokenizer_from_files(self.file.tokenizer_files)
            self._tokenizer_loaded = True
        return self._tokenizer

    @property
    def max_context(self) -> int:
        return int(self.arch.get("max_position_embeddings") or DEFAULT_MAX_CTX)

    def new_cache(self, ctx: int | None = None, batch: int = 1) -> KVCache:
        """A KV cache for `batch` sequences of up to `ctx` tokens.

        ctx defaults to the model's max_position_embeddings capped at DEFAULT_MAX_CTX (4096):
        a cache costs 2 * layers * batch * Hkv * ctx * Dh * 4 bytes once filled.
        """
        if ctx is None:
            ctx = min(self.max_context, DEFAULT_MAX_CTX)
        return KVCache(self.n_layers, batch, self.n_kv_heads, ctx, self.head_dim)

    def embed(self, ids: np.ndarray) -> np.ndarray:
        """Embedding rows of ids int (B, S) -> float32 (B, S, D); only those rows are decoded."""
        e = self.embedding
        flat = ids.reshape(-1)
        if isinstance(e, QuantizedTensor):
            rows = QuantizedTensor(e.data[flat], e.scales[flat], e.dtype,
                                   (flat.shape[0], e.shape[-1]), e.group_size).dequantize()
        elif e.dtype == np.uint16:                                           # bf16 bits
            rows = quant.bf16_to_f32(e[flat])
        else:
            rows = e[flat].astype(np.float32)
        return rows.reshape(*ids.shape, self.hidden_size)

    # -- input checking -------------------------------------------------------------------------
    def _check_inputs(self, input_ids, input_embeds, cache, positions, attention_mask):
        """-> (x float32 (B, S, D) or ids int64 (B, S), squeeze, valid (B, S), positions (B, S))."""
        if (input_ids is None) == (input_embeds is None):
            raise ValueError("give exactly one of input_ids and input_embeds")
        if input_ids is not None:
            ids = np.asarray(input_ids)
            if ids.dtype == object or ids.dtype.kind not in "iu":
                raise ValueError(f"input_ids must be integers, got dtype {ids.dtype}")
            if ids.ndim not in (1, 2):
                raise ValueError(f"input_ids must have shape (S,) or (B, S), got ndim {ids.ndim} "
                                 f"(shape {ids.shape})")
            squeeze = ids.ndim == 1
            ids = ids.reshape(1, -1) if squeeze else ids
            if ids.size == 0:
                raise ValueError(f"input_ids is empty (shape {np.asarray(input_ids).shape})")
            if ids.size == 1:                                  # a decode step: no reductions
                lo = hi = int(ids.reshape(-1)[0])
            else:
                lo, hi = int(ids.min()), int(ids.max())
            if lo < 0 or hi >= self.vocab_size:
                raise ValueError(f"input_ids out of range [0, {self.vocab_size}): "
                                 f"min {lo}, max {hi} (vocab_size {self.vocab_size})")
            data = ids.astype(np.int64, copy=False)
        else:
            x = np.asarray(input_embeds)
            if x.dtype.kind != "f":
                raise ValueError(f"input_embeds must be floating point, got dtype {x.dtype}")
            if x.ndim not in (2, 3) or x.shape[-1] != self.hidden_size:
                raise ValueError(f"input_embeds must have shape (S, {self.hidden_size}) or "
                                 f"(B, S, {self.hidden_size}), got {x.shape}")
            squeeze = x.ndim == 2
            x = x[None] if squeeze else x
            if x.shape[1] == 0:
                raise ValueError("input_embeds has no tokens (S = 0)")
            if not np.isfinite(x).all():
                raise ValueError(f"input_embeds holds {int((~np.isfinite(x)).sum())} non-finite values")
            data = np.ascontiguousarray(x, dtype=np.float32)
        B, S = data.shape[:2]
        past = 0
        if cache is not None:
            if not isinstance(cache, KVCache):
                raise ValueError(f"cache must be a KVCache (model.new_cache()), got {type(cache).__name__}")
            if cache.batch != B:
                raise ValueError(f"cache batch {cache.batch} does not match input batch {B}")
            if (cache.n_layers, cache.n_kv_heads, cache.head_dim) != (
                    self.n_layers, self.n_kv_heads, self.head_dim):
                raise ValueError(f"cache made for (layers, kv heads, head dim) = "
                                 f"{(cache.n_layers, cache.n_kv_heads, cache.head_dim)}, model has "
                                 f"{(self.n_layers, self.n_kv_heads, self.head_dim)}")
            cache.check_room(S)
            past = cache.length
        if attention_mask is None:
            valid = np.ones((B, S), dtype=bool)
        else:
            m = np.asarray(attention_mask)
            if m.ndim == 1 and squeeze:
                m = m[None]
            if m.ndim != 2 or m.shape[0] != B or m.shape[1] not in (S, past + S):
                raise ValueError(f"attention_mask must have shape ({B}, {S}) or ({B}, {past + S}) "
                                 f"(past {past} + new {S}), got {np.asarray(attention_mask).shape}")
            if not np.isin(m, (0, 1)).all():
                raise ValueError("attention_mask must hold only 0 and 1 (or booleans)")
            m = m.astype(bool)
            if m.shape[1] == past + S and past and not np.array_equal(m[:, :past], cache.valid[:, :past]):
                raise ValueError("attention_mask's first columns disagree with the padding already in the cache")
            valid = m[:, -S:]
        if positions is None:
            start = cache.next_positions() if cache is not None else np.zeros(B, np.int64)
            if S == 1 and attention_mask is None:             # one real token each: its start
                pos = start[:, None]
            else:
                pos = start[:, None] + np.cumsum(valid, axis=1) - 1
                pos = np.maximum(pos, 0)
        else:
            p = np.asarray(positions)
            if p.dtype.kind not in "iu":
                raise ValueError(f"positions must be integers, got dtype {p.dtype}")
            if p.ndim == 1:
                p = np.broadcast_to(p, (B, p.shape[0]))
            if p.shape != (B, S):
                raise ValueError(f"positions must have shape ({S},) or ({B}, {S}), got "
                                 f"{np.asarray(positions).shape}")
            if p.size and int(p.min()) < 0:
                raise ValueError(f"positions must be >= 0, got min {int(p.min())}")
            pos = p.astype(np.int64)
        return data, squeeze, valid, pos

    def _decode_work(self, cache: KVCache, valid: np.ndarray) -> DecodeWork | None:
        """The cache's DecodeWork when a step of one token of one sequence may take the decode
        fast path (that token and every cached slot real, i.e. nothing to mask), else None."""
        if not self.fast_decode or not valid[0, 0] or not cache.valid[0, :cache.length].all():
            return None
        return self._decode_work_of(cache)

    def _decode_work_of(self, cache: KVCache) -> DecodeWork:
        """The cache's DecodeWork for this model (made on first use, remade if the model's
        settings changed)."""
        work = cache.scratch.get("decode")
        ops = ((kernels.rms_norm_rows_into, kernels.rope_rows_into, self._attend_cached)
               if self.compiled_row_ops else (None, None, None))
        key = self._work_args + (self.eps, True) + ops
        if work is None or work.key != key:
            work = cache.scratch["decode"] = DecodeWork(*self._work_args, cache.ctx, self.eps,
                                                        True, *ops)
        return work

    # -- forward ----------------------------------------------------------------------------------
    def forward(self, input_ids=None, cache: KVCache | None = None, positions=None,
                return_routing: bool = False, input_embeds=None, attention_mask=None,
                last_only: bool = False):
        """Logits float32 (B, S, V), or (S, V) for 1-D input; see colibri.forward.

        last_only: compute the head for the last position only (logits (B, 1, V) / (1, V)),
        which is all a generation step needs.
        """
        if (type(cache) is KVCache and cache.batch == 1 and self.fast_decode
                and input_embeds is None and attention_mask is None and positions is None
                and not return_routing):
            logits = self._decode_step(input_ids, cache)
            if logits is not None:
                return logits
        with blas_on_one_thread():
            return self._forward(input_ids, cache, positions, return_routing, input_embeds,
                                 attention_mask, last_only)

    def _decode_step(self, input_ids, cache: KVCache) -> np.ndarray | None:
        """A decode step the lean way, or None when this call is not one (the general entry
        then checks, raises or runs it).

        It is one when input_ids is one integer token ((1,) or (1, 1) array, in range), the
        cache has room, no padding and this model's shapes, and every layer's attention is
        compiled (so no BLAS call runs and the BLAS thread limit is not needed). The same
        operations and bits as _forward's fast path, with fewer Python and NumPy calls around
        them: each costs several microseconds in a decode step, whose weight streaming has
        evicted the interpreter's code and data from the caches.
        """
        ids = input_ids
        if (not isinstance(ids, np.ndarray) or ids.size != 1 or ids.ndim not in (1, 2)
                or ids.dtype.kind not in "iu" or cache.length >= cache.ctx
                or (cache.n_layers, cache.n_kv_heads, cache.head_dim) != self._cache_dims
                or not all(layer.attn.attend_one is not None for layer in self.layers)):
            return None
        token, n = int(ids.reshape(-1)[0]), cache.length
        if not 0 <= token < self.vocab_size or np.count_nonzero(cache.valid[0, :n]) != n:
            return None
        tm = self.timings
        t0 = time.perf_counter()
        work = self._decode_work_of(cache)
        position = int(np.maximum.reduce(cache.pos[0, :n])) + 1 if n else 0   # no padding
        h1 = self._embed_row(token, work.h)                                     # (1, D)
        cos1, sin1 = self.rope.cos_sin_one(position)                            # (R/2,)
        t0 = self._decode_layers(h1, cos1, sin1, cache, work, None, tm.add("embed", t0))
        logits = np.empty((1, self.vocab_size), dtype=np.float32)
        self._head(_norm_row(work, h1, self.final_norm, self._eps32, work.xa), logits)
        tm.add("head", t0)
        cache.commit_one(position)
        return logits if ids.ndim == 1 else logits.reshape(1, 1, self.vocab_size)

    def _embed_row(self, token: int, out: np.ndarray) -> np.ndarray:
        """The embedding row of one token into out float32 (1, D), as embed decodes it."""
        e = self.embedding
        if isinstance(e, np.ndarray) and e.dtype == np.uint16:                 # bf16 bits
            np.left_shift(e[token], 16, out=out.view(np.uint32), dtype=np.uint32)
        elif isinstance(e, np.ndarray) and e.dtype in (np.float32, np.float16):
            np.copyto(out[0], e[token])
        else:
            out[...] = self.embed(np.array([[token]]))[0]
        return out

    def _decode_layers(self, h1: np.ndarray, cos1: np.ndarray, sin1: np.ndarray,
                       cache: KVCache, work: DecodeWork, trace: RoutingTrace | None,
                       t0: float) -> float:
        """The layers of a decode step on the residual row h1 (1, D), updated in place;
        cos1 / sin1 (R/2,) of the token's position. Returns the time of the last stage."""
        tm, eps = self.timings, self._eps32
        for i, layer in enumerate(self.layers):
            a = _norm_row(work, h1, layer.attn_norm, eps, work.xa)
            np.add(h1, layer.attn.decode(a, cos1, sin1, cache, i, work), out=h1)
            x = _norm_row(work, h1, layer.ffn_norm, eps, work.xf)                 # (1, D)
            t0 = tm.add("attention", t0)
            if isinstance(layer.ffn, MoE):
                y, ids, wts, gate = layer.ffn(x, tm, out=work.y)
                if trace is not None:
                    _trace_layer(trace, i, layer.ffn, x, ids, wts, gate, 1, 1, self.threads)
            else:
                y = layer.ffn(x, tm)
            np.add(h1, y, out=h1)
            t0 = time.perf_counter()
        return t0

    def _forward(self, input_ids, cache, positions, return_routing, input_embeds,
                 attention_mask, last_only):
        data, squeeze, valid, pos = self._check_inputs(input_ids, input_embeds, cache,
                                                       positions, attention_mask)
        tm = self.timings
        t0 = time.perf_counter()
        B, S = valid.shape
        D = self.hidden_size
        h = self.embed(data) if data.dtype == np.int64 else data.copy()       # (B, S, D)
        work = self._decode_work(cache, valid) if B == 1 and S == 1 and cache is not None else None
        if work is None:
            # keys visible to the new tokens: the cache's slots, then the new ones
            all_valid = valid if cache is None else np.concatenate(
                [cache.valid[:, :cache.length], valid], axis=1)              # (B, L)
        masks: dict = {}
        cos, sin = self.rope.cos_sin(pos)                                     # (B, 1, S, R/2)
        if work is not None:            # decode fast path: h1 (1, D) is the residual stream
            h1, cos1, sin1 = h.reshape(1, D), cos[0, 0, 0], sin[0, 0, 0]
        trace = RoutingTrace([], [], []) if return_routing else None
        t0 = tm.add("embed", t0)
        if work is not None:            # same operations, in place, into work's buffers
            t0 = self._decode_layers(h1, cos1, sin1, cache, work, trace, t0)
        else:
            for i, layer in enumerate(self.layers):
                w = layer.attn.window
                if w not in masks:
                    masks[w] = build_mask(all_valid, S, w)                    # (B, S, L)
                a = rms_norm(h, layer.attn_norm, self.eps)
                h = h + layer.attn(a, cos, sin, masks[w], cache, i)
                x = rms_norm(h, layer.ffn_norm, self.eps).reshape(B * S, D)   # (T, D)
                t0 = tm.add("attention", t0)
                if isinstance(layer.ffn, MoE):
                    y, ids, wts, gate = layer.ffn(x, tm)
                    if trace is not None:
                        _trace_layer(trace, i, layer.ffn, x, ids, wts, gate, B, S,
                                     self.threads)
                else:
                    y = layer.ffn(x, tm)
                h = h + y.reshape(B, S, D)
                t0 = time.perf_counter()
        if work is not None:
            h = _norm_row(work, h1, self.final_norm, self._eps32, work.xa).reshape(1, 1, D)
        else:
            if last_only:
                h = h[:, -1:]
            h = rms_norm(h, self.final_norm, self.eps)
        n = h.shape[1]
        logits = kernels.linear(np.ascontiguousarray(h.reshape(B * n, D)), self.head,
                                threads=self.threads, activations=self.activations
                                ).reshape(B, n, self.vocab_size)
        tm.add("head", t0)
        if cache is not None:
            cache.commit(valid, pos)
        if squeeze:
            logits = logits[0]
            if trace is not None:
                trace.ids = [a[0] for a in trace.ids]
                trace.weights = [a[0] for a in trace.weights]
                trace.shared_gate = [a[0] for a in trace.shared_gate]
                trace.logits = [a[0] for a in trace.logits]
        return (logits, trace) if return_routing else logits

    __call__ = forward

    # -- generation -------------------------------------------------------------------------------
    def generate(self, prompt_or_ids, max_new_tokens: int = 64, **kwargs):
        """Generate text or ids; see colibri.generate.generate for the arguments."""
        from .generate import generate
        return generate(self, prompt_or_ids, max_new_tokens=max_new_tokens, **kwargs)

    def close(self) -> None:
        self.file.close()

    def __enter__(self) -> "Model":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _repr_html_(self) -> str:
        """Notebook display: config, sizes, formats, bytes per expert (colibri.display)."""
        from .display import model_html
        return model_html(self)

    def __repr__(self) -> str:
        a = self.arch
        return (f"Model({a.get('family')}, layers={self.n_layers}, hidden={self.hidden_size}, "
                f"experts={a.get('num_experts')} top-{a.get('num_experts_per_tok')}, "
                f"vocab={self.vocab_size}, threads={self.threads}"
                + (f", activations={self.activations}" if self.activations != "f32" else "")
                + f", file={self.file.path})")
