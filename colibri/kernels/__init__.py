"""The compute kernels of colibri: linear layers, routing, dispatch and the MoE FFN.

This is the Python face of the compiled module ``colibri._kernels``: each function checks
and converts its arguments, then makes one compiled call. The kernels know buffers, integers
and float arrays, nothing about model families or tensor names. Weights are passed as a
``weights.WeightRef`` (read in place, dequantized in registers); the instruction set, the
thread count for ``threads=None`` and the tuning knobs are the ``runtime`` module's.

Every kernel has a plain-NumPy twin in ``colibri.kernels._reference`` (``<name>_ref``): the spec and
the test oracle. Results do not depend on the thread count.

Activations: the quantized-weight kernels (linear, expert_ffn, swiglu) take
``activations="f32"`` (the kernels' default: x in float32, exact products with the decoded
weights; a Model's default is "int16", colibri.engine.model.DEFAULT_ACTIVATIONS)
or ``"int8"``: each token's input is quantized to int8 in blocks of 32 (llama.cpp's Q8_0,
``quantize_activations``) and dotted with q4/q8/mxfp4 weight codes in integer arithmetic: 2-3.5x
fewer instructions per multiply-add, at the cost of Q8_0's rounding of the inputs (about
0.5% of the output's scale on random data); or ``"int16"``: the same with 16-bit codes
(``quantize_activations(x, bits=16)``), each input within 2^-16 of its block's largest
magnitude (about 1e-5 of the output's scale: finer than f16 activations), at about twice
int8's instructions and a third of f32's. Plain-format weights (f32/f16/bf16) ignore the
option and keep the f32 path, so a whole model can run with either.

Shapes (the package's alphabet): T tokens, D hidden, I expert intermediate, E experts,
K experts per token, R rows (outputs) and C columns (inputs) of a weight matrix, H / Hkv
heads, G = H / Hkv, Dh head dim.

Decode step: the small row operations of a token (``rms_norm_rows``, ``rope_rows``: NumPy's
float32 arithmetic in one compiled call) and prepared calls (``prepare_linear``,
``prepare_route``, ``prepare_expert_ffn``: weights and settings checked once, each call
checks only its arrays). The ``*_into`` names are the compiled functions themselves, for the
decode step (arrays only, no conversions; a bad argument is a ValueError).

``biased_experts.BiasedExperts`` is the expert FFN with biases and / or swigluoai (GPT-OSS)
over ``prepare_biased_experts*``, with its Python specification: what a MoE layer, an expert
cache's arena and an expert shard all run.
"""
from __future__ import annotations

import time
from collections.abc import Callable

import numpy as np

from .. import _kernels
from .kernel_args import expert_ids, f32_array, out_array, rows_f32, weight_refs
from .runtime import resolve_threads
from .weights import WeightRef

__all__ = [
    "ACTIVATIONS", "linear", "route_topk", "group_by_expert", "expert_ffn", "swiglu",
    "quantize_activations", "attend_decode", "dequantize", "read_bandwidth",
    "rms_norm_rows", "rope_rows", "rms_norm_rows_into", "rope_rows_into", "attend_cached_into",
    "attend_cached_sinks_into", "kv_widen_into",
    "prepare_linear", "prepare_route", "prepare_expert_ffn", "prepare_mla_absorbed",
    "prepare_biased_experts",
    "prepare_biased_experts_grouped",
    "mxfp4_f32_activations",
]

ROUTING_RULES: tuple[str, ...] = ("softmax_topk", "topk_softmax", "sparsemixer",
                                  "softmax_group_topk", "sigmoid_group_topk")
ACTIVATIONS: tuple[str, ...] = _kernels.ACTIVATIONS   # the compiled module checks them


# ---------------------------------------------------------------------------------------------
# kernels


def linear(x: np.ndarray, w: WeightRef, bias: np.ndarray | None = None, *,
           threads: int | None = None, out: np.ndarray | None = None, expert: int = 0,
           activations: str = "f32") -> np.ndarray:
    """y = x @ W.T (+ bias), for any weight format, dequantizing in registers.

    Parameters
    ----------
    x : float32 (T, C), or (C,) for one token
    w : WeightRef (R, C), or a stack (E, R, C) of which `expert` is used
    bias : float32 (R,) or None
    threads : int or None (runtime.default_threads())
    out : float32 (T, R) (or (R,)) to write into, not overlapping x; or None
    expert : int, which matrix of a stack
    activations : "f32" (default), "int8" or "int16"
        "int8" / "int16" with a q4/q8/mxfp4 weight: x is quantized per token with
        quantize_activations (bits 8 / 16; C must be a multiple of 32, which q4/q8/mxfp4
        guarantee) and y[t, r] = sum_b (s_r,g(b) * d_t,b) * isum_t,r,b (+ bias[r]), isum the
        exact int32 dot of block b's weight codes (q4: nibble - 8, mxfp4: 2 * FP4 with
        s = 2^(e - 127) / 2) with q_t. Plain-format weights use the f32 path whatever this
        says.

    Returns
    -------
    y : float32 (T, R), or (R,) for 1-D x

    Notes
    -----
    Parallel over tiles of output rows; each tile is read from memory once for all T tokens
    (blocks of a few tokens share each pass over a weight row). From runtime.gemm_min_tokens()
    tokens on, f32 activations take the prefill path (a panel of rows decoded once to f32,
    then a register-blocked micro-kernel): exact to the weights too, but summed in another
    order, so a token alone and inside such a block may differ in the last bits. Likewise
    int8 / int16 activations with a q4/q8 weight from the ISA path's crossover
    (runtime.igemm_min_tokens, runtime.igemm_crossover): the integer GEMM path, the same
    exact block sums, one fused multiply-add per block in block order. Every path gives the
    same bits for any thread count.
    """
    x = f32_array("x", x, (1, 2))
    one = x.ndim == 1
    x2 = x.reshape(1, -1) if one else x
    b = None if bias is None else f32_array("bias", bias, (1,))
    y = out_array(out, (w.rows,) if one else (x2.shape[0], w.rows))
    _kernels.linear(x2, w, b, y.reshape(x2.shape[0], w.rows), int(expert),
                    resolve_threads(threads), activations)
    return y


def route_topk(logits: np.ndarray, k: int, *, rule: str = "softmax_topk",
               norm_topk_prob: bool = False, noise_seed: int | None = None,
               threads: int | None = None, bias: np.ndarray | None = None, n_group: int = 1,
               topk_group: int = 1, jitter_eps: float = 0.0) -> tuple[np.ndarray, np.ndarray]:
    """Pick k experts per token and their weights from router logits.

    Parameters
    ----------
    logits : float32 (T, E); -inf and huge values are fine, NaN is a ValueError
    k : int, 1 <= k <= E
    rule : "softmax_topk", "topk_softmax" or "sparsemixer"
        "softmax_topk": p = softmax over all E (max-subtracted, f32); the k largest p
        (ties -> lower expert index); weights = p[ids], divided by their sum when
        `norm_topk_prob`. "topk_softmax": the k largest logits; weights = softmax over those
        k (max taken over the k, so nothing underflows that need not). "sparsemixer"
        (PhiMoE, k = 2, no noise): see _reference.sparsemixer_ref; `jitter_eps` is the
        config's router_jitter_noise.
        The group rules (DeepSeek) split the E experts into n_group groups of E / n_group
        consecutive experts, keep the topk_group best groups (ties -> lower group) and take
        the top k of their experts:
        "softmax_group_topk" (DeepSeek-V2 group_limited_greedy): p = softmax over all E; a
        group scores its largest p; weights = p[ids], never renormalised.
        "sigmoid_group_topk" (DeepSeek-V3, GLM-4-MoE): s = sigmoid(logits), the choice
        c = s + bias; a group scores the sum of its two largest c; top-k by c; weights =
        s[ids], divided by (their sum + 1e-20) when `norm_topk_prob`.
        (routed_scaling_factor is the caller's: moe.MoE multiplies the weights by it.)
    norm_topk_prob : bool, renormalise the k weights of "softmax_topk" /
        "sigmoid_group_topk" to sum 1
    noise_seed : int or None
        If given, Gumbel(0, 1) noise is added to the logits before the selection
        (sampling-time routing); the weights still come from the un-noised logits. The noise
        is a pure function of (seed, token index in this call, expert): reproducible, and
        independent of the thread count. To vary it across layers or steps, vary the seed.
        Not with the group rules.
    threads : int or None
    bias : float32 (E,), the correction bias of "sigmoid_group_topk" (else unused)
    n_group, topk_group : int, the groups of the group rules (else unused)

    Returns
    -------
    ids : int32 (T, K)
    weights : float32 (T, K)
        Each row listed by descending weight, ties -> lower expert index. Top-k is a partial
        selection (one pass over E), not a sort. All -inf logits give uniform weights; +inf
        logits share the mass equally; never NaN.
    """
    logits = f32_array("logits", logits, (2,))
    if rule not in ROUTING_RULES:
        raise ValueError(f"unknown routing rule {rule!r}; expected one of "
                         f"{', '.join(ROUTING_RULES)}")
    if isinstance(k, bool) or not isinstance(k, (int, np.integer)):
        raise ValueError(f"k must be an int, found {k!r}")
    if noise_seed is not None and (isinstance(noise_seed, bool)
                                   or not isinstance(noise_seed, (int, np.integer))):
        raise ValueError(f"noise_seed must be an int or None, found {noise_seed!r}")
    b = None if bias is None else f32_array("bias", bias, (1,))
    return _kernels.route_topk(logits, int(k), rule, bool(norm_topk_prob),
                               None if noise_seed is None else int(noise_seed),
                               resolve_threads(threads), b, int(n_group), int(topk_group),
                               float(jitter_eps))


def group_by_expert(ids: np.ndarray, n_experts: int) -> tuple[np.ndarray, np.ndarray]:
    """Counting sort of the (token, k) slots by expert.

    Parameters
    ----------
    ids : int (T, K), values in 0..E-1
    n_experts : int, E

    Returns
    -------
    offsets : int64 (E+1,)
    slots : int32 (T*K,)
        The flat slots t*K + k of expert e are slots[offsets[e]:offsets[e+1]], ascending.
    """
    return _kernels.group_by_expert(expert_ids(ids, int(n_experts)), int(n_experts))


def expert_ffn(x: np.ndarray, ids: np.ndarray, weights: np.ndarray, w_gate: WeightRef,
               w_up: WeightRef, w_down: WeightRef, *, threads: int | None = None,
               out: np.ndarray | None = None, activations: str = "f32") -> np.ndarray:
    """The routed SwiGLU experts of one MoE layer.

    Parameters
    ----------
    x : float32 (T, D)
    ids : int (T, K), the expert of each (token, slot)
    weights : float32 (T, K), the routing weights
    w_gate, w_up : WeightRef stacks (E, I, D)
    w_down : WeightRef stack (E, D, I); the three formats may differ
    threads : int or None
    out : float32 (T, D) to write into (may be x itself), or None
    activations : "f32" (default), "int8" or "int16"
        "int8" / "int16": each q4/q8/mxfp4 matrix runs that path (see linear): x is
        quantized for gate and up, and h = silu(gate) * up is quantized (per token, blocks
        of 32) before a q4/q8/mxfp4 w_down. Matrices in plain formats keep the f32 path.

    Returns
    -------
    y : float32 (T, D)
        y[t] = sum_k weights[t,k] * W_down[e] @ (silu(W_gate[e] @ x[t]) * (W_up[e] @ x[t])),
        e = ids[t, k].

    Notes
    -----
    Tokens are grouped by expert, so each chosen expert is read once per call: gate and up
    in one pass over the expert's tokens, then down, each as a flat list of (expert, row
    tile) work items shared by the threads. Experts no token chose are never touched (not
    even their pages). The sum over k runs in k order per token after all experts ran, so
    the result is identical for any thread count.
    """
    x = f32_array("x", x, (2,))
    ids = expert_ids(ids, w_gate.n_experts)
    weights = f32_array("weights", weights, (2,))
    y = out_array(out, x.shape)
    _kernels.expert_ffn(x, ids, weights, w_gate, w_up, w_down, y, resolve_threads(threads),
                        activations)
    return y


def swiglu(x: np.ndarray, w_gate: WeightRef, w_up: WeightRef, w_down: WeightRef, *,
           threads: int | None = None, activations: str = "f32") -> np.ndarray:
    """A dense SwiGLU FFN (shared experts, dense layers).

    Parameters
    ----------
    x : float32 (T, D)
    w_gate, w_up : WeightRef (I, D)
    w_down : WeightRef (D, I)
    threads : int or None
    activations : "f32" (default), "int8" or "int16", as in expert_ffn

    Returns
    -------
    y : float32 (T, D), W_down @ (silu(W_gate @ x[t]) * (W_up @ x[t])) per token
    """
    x = f32_array("x", x, (2,))
    y = np.empty(x.shape, dtype=np.float32)
    _kernels.swiglu(x, w_gate, w_up, w_down, y, resolve_threads(threads), activations)
    return y


def quantize_activations(x: np.ndarray, bits: int = 8) -> tuple[np.ndarray, np.ndarray]:
    """Quantize activations the way the "int8" (bits 8: llama.cpp's Q8_0) or "int16"
    (bits 16) path does.

    Parameters
    ----------
    x : float32 (T, C), C a multiple of 32 (else ValueError)
    bits : 8 or 16

    Returns
    -------
    q : int8 (bits 8) or int16 (bits 16), (T, C)
    d : float32 (T, C/32)
        Per block b of 32 elements of a row: amax = max |x|; d = amax / qmax (f32 division;
        qmax 127 or 32767); id = 1 / d (0 when d == 0); q = round-half-even(x * id) (f32
        product), in [-qmax, qmax]. A block holding a NaN or an inf gets d = NaN and q = 0
        (every output using it is NaN); a block whose 1 / d overflows (amax below ~3.7e-37
        for 8 bits) gets d = 0 and q = 0. Bit-identical on every ISA path;
        _reference.quantize_activations_ref is its twin.
    """
    x = f32_array("x", x, (2,))
    return _kernels.quantize_activations(x, bits)


# The storage dtypes of a KV cache plane the attention kernels read (bf16 as uint16 bits).
_KV_STORAGE = (np.dtype(np.float32), np.dtype(np.float16), np.dtype(np.uint16))


def attend_decode(q: np.ndarray, k: np.ndarray, v: np.ndarray, scale: float, *,
                  out: np.ndarray | None = None, threads: int | None = None) -> np.ndarray:
    """Attention of one new token over a KV cache slice (what a decode step computes).

    Parameters
    ----------
    q : float32 (H, Dh), the token's query heads (after RoPE)
    k, v : (Hkv, n, Dh), the keys and values attended (n >= 1), both of one KV cache storage
        dtype: float32, float16, or uint16 holding bf16 bits (KVCache's "f32" / "f16" /
        "bf16"), widened exactly as they are read; rows contiguous, heads and positions may
        be strided (a slice of a cache is read in place); H must be a multiple of Hkv: query
        head h reads kv head h // (H / Hkv)
    scale : float, the score scale (usually Dh ** -0.5)
    out : float32 (H, Dh) to write into (not overlapping q), or None
    threads : int or None; parallel over kv heads when the work is large (long contexts)

    Returns
    -------
    out : float32 (H, Dh), out[h] = softmax_j(scale * q[h] . k[g, j]) @ v[g], g = h // G

    Notes
    -----
    One pass per head in C (csrc/attend.h): scores, max, exp, sum, weighted values; no mask (the
    caller passes only the positions attended). The scalar, AVX2 and AVX-512 paths agree to
    ~1e-6 relative (the SIMD exp is a polynomial); each gives the same bits for any thread
    count, and a 16-bit k / v gives the bits of the same call on its float32 widening.
    """
    q = f32_array("q", q, (2,))
    k = np.asarray(k)
    v = np.asarray(v)
    for name, a in (("k", k), ("v", v)):
        if a.dtype not in _KV_STORAGE or a.ndim != 3:
            raise ValueError(f"{name} must be float32, float16 or uint16 (bf16 bits) "
                             f"(Hkv, n, Dh), found {a.dtype} with shape {a.shape}")
    if v.dtype != k.dtype:
        raise ValueError(f"k and v must have the same dtype, found {k.dtype} and {v.dtype}")
    if k.strides[2] != k.itemsize or v.strides != k.strides:     # rows must be contiguous
        k, v = np.ascontiguousarray(k), np.ascontiguousarray(v)
    y = out_array(out, q.shape)
    _kernels.attend_decode(q, k, v, float(scale), y, resolve_threads(threads))
    return y


def dequantize(w: WeightRef, expert: int = 0, *, threads: int | None = None) -> np.ndarray:
    """The decoded matrix of one expert, float32 (R, C).

    A test and debugging helper (scalar decoding); the kernels never build this matrix.
    """
    return _kernels.dequantize(w, int(expert), resolve_threads(threads))


def read_bandwidth(nbytes: int, threads: int | None = None, *, repeats: int = 3) -> float:
    """Memory read bandwidth in GB/s (1e9 bytes/s).

    Parameters
    ----------
    nbytes : int, size of the buffer; well beyond the last-level cache (e.g. 1 GiB) to
        measure memory rather than cache
    threads : int or None; each thread streams one contiguous part
    repeats : int, timed passes (after one untimed pass over the freshly touched buffer)

    Returns
    -------
    float, the best pass
    """
    n_threads = resolve_threads(threads)
    if nbytes < 1 or repeats < 1:
        raise ValueError(f"nbytes ({nbytes}) and repeats ({repeats}) must be >= 1")
    buf = np.ones(int(nbytes), dtype=np.uint8)
    _kernels.read_sum(buf, n_threads)
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        _kernels.read_sum(buf, n_threads)
        best = min(best, time.perf_counter() - t0)
    return nbytes / max(best, 1e-9) / 1e9


# ---------------------------------------------------------------------------------------------
# the decode step's small row operations, and prepared kernel calls


def rms_norm_rows(x: np.ndarray, weight: np.ndarray, eps: float, *,
                  out: np.ndarray | None = None) -> np.ndarray:
    """RMSNorm of each row, in one compiled call (csrc/rowops.h).

    Parameters
    ----------
    x : float32 (N, C) or (C,), C-contiguous
    weight : float32 (C,)
    eps : float (used as float32)
    out : float32 of x's shape to write into (may be x itself), or None

    Returns
    -------
    out : float32, x's shape: weight * (x * (1 / sqrt(mean(x^2) + eps))) per row, in
        float32 with NumPy's operations and summation order (the same bits as
        attention.rms_norm on this NumPy); _reference.rms_norm_rows_ref is its twin.
    """
    x = rows_f32("x", x, (1, 2))
    weight = rows_f32("weight", weight, (1,))
    out = np.empty_like(x) if out is None else rows_f32("out", out, (x.ndim,), writable=True)
    if out.shape != x.shape:
        raise ValueError(f"out has shape {out.shape}, expected x's {x.shape}")
    C = x.shape[-1]
    _kernels.rms_norm_rows(x.reshape(-1, C), weight, float(eps), out.reshape(-1, C))
    return out


def rope_rows(x: np.ndarray, cos: np.ndarray, sin: np.ndarray) -> np.ndarray:
    """Rotary embedding of rows in place (the half-split rule), one compiled call.

    Parameters
    ----------
    x : float32 (N, Dh), C-contiguous, writable: the q and k heads of one token
    cos, sin : float32 (h,), h <= Dh / 2: the token's position's tables (Rope.cos_sin)

    Returns
    -------
    x, with x[:, :h], x[:, h:2h] = x1 cos - x2 sin, x2 cos + x1 sin (float32 products and
    sums as attention.apply_rope computes them); columns past 2h unchanged.
    """
    x = rows_f32("x", x, (2,), writable=True)
    _kernels.rope_rows(x, rows_f32("cos", cos, (1,)), rows_f32("sin", sin, (1,)))
    return x


# The same two operations without the Python layer, for the decode step: 2-D
# C-contiguous float32 arrays only, out required; anything else is a ValueError from the
# compiled checks (type, layout, shapes), never a crash.
rms_norm_rows_into: Callable[..., None] = _kernels.rms_norm_rows   # (x, weight, eps, out)
rope_rows_into: Callable[..., None] = _kernels.rope_rows           # (x, cos, sin)
# KVCache.write_one and attend_decode in one call (the same kernel, the same bits):
# (q (H, Dh), k_cache, v_cache (B, Hkv, S, Dh), k_new, v_new (Hkv, Dh), slot, start, scale,
# out (H, Dh), threads): the new key / value go to slot `slot` of sequence 0, then out =
# attention over slots start..slot. The caches float32, float16 or uint16 (bf16 bits), the
# new rows rounded into them to nearest-even; every other array float32; all C-contiguous
# (ValueError otherwise).
attend_cached_into: Callable[..., None] = _kernels.attend_cached
# attend_cached_into with attention sinks (GPT-OSS): (q, k_cache, v_cache, k_new, v_new, slot,
# start, scale, sinks float32 (H,), out, threads); a sink is one more logit per query head
# whose value row is zero (csrc/attend.h).
attend_cached_sinks_into: Callable[..., None] = _kernels.attend_cached_sinks
# A 16-bit cache slice widened exactly: (src float16 / uint16 bf16 bits (N, C), rows strided,
# out float32 (N, C) C-contiguous), F16C on the SIMD paths (NumPy's float16 cast is ~6x slower).
kv_widen_into: Callable[..., None] = _kernels.kv_widen


def prepare_linear(w: WeightRef, bias: np.ndarray | None = None, *, threads: int | None = None,
                   activations: str = "f32") -> Callable[[np.ndarray, np.ndarray], None]:
    """linear with its weight, bias, threads and activations checked once.

    Returns p with p(x, out): out float32 (T, R) = x float32 (T, C) @ W.T (+ bias), both
    2-D and C-contiguous, not overlapping: the same work and bits as
    linear(x, w, bias, out=out, threads=threads, activations=activations), without the
    per-call checks of the weight (~3 us a call less). ValueError for bad arguments, here
    or at the call.
    """
    weight_refs(w=w)
    b = None if bias is None else rows_f32("bias", bias, (1,))
    return _kernels.PreparedLinear(w, b, resolve_threads(threads), activations)


def prepare_route(k: int, *, rule: str = "softmax_topk", norm_topk_prob: bool = False,
                  threads: int | None = None, bias: np.ndarray | None = None,
                  n_group: int = 1, topk_group: int = 1, jitter_eps: float = 0.0
                  ) -> Callable[[np.ndarray], tuple]:
    """route_topk with its settings checked once (no noise).

    Returns p with p(logits float32 (T, E), C-contiguous) -> (ids int32 (T, K), weights
    float32 (T, K)), the same as route_topk(logits, k, rule=rule,
    norm_topk_prob=norm_topk_prob, threads=threads, bias=bias, n_group=n_group,
    topk_group=topk_group, jitter_eps=jitter_eps).
    """
    if isinstance(k, bool) or not isinstance(k, (int, np.integer)):
        raise ValueError(f"k must be an int, found {k!r}")
    b = None if bias is None else rows_f32("bias", bias, (1,))
    return _kernels.PreparedRoute(int(k), rule, bool(norm_topk_prob), resolve_threads(threads),
                                  b, int(n_group), int(topk_group), float(jitter_eps))


def prepare_expert_ffn(w_gate: WeightRef, w_up: WeightRef, w_down: WeightRef, *,
                       threads: int | None = None, activations: str = "f32"
                       ) -> Callable[..., None]:
    """expert_ffn with its three weight stacks, threads and activations checked once.

    Returns p with p(x, ids, weights, out): x float32 (T, D), ids int32 (T, K), weights
    float32 (T, K), out float32 (T, D) (may be x), all C-contiguous: the same work and bits
    as expert_ffn(x, ids, weights, w_gate, w_up, w_down, out=out, ...).
    """
    weight_refs(w_gate=w_gate, w_up=w_up, w_down=w_down)
    return _kernels.PreparedExperts(w_gate, w_up, w_down, resolve_threads(threads), activations)


def prepare_mla_absorbed(kv_b: WeightRef, n_heads: int, nope_dim: int, v_dim: int, *,
                         threads: int | None = None) -> Callable[..., None]:
    """The absorbed decode step of latent attention (csrc/mla.h) with its kv_b
    (H*(Dn+Dv), Rkv), any weight format, read in place, checked once.

    Returns p with p(q, q_rope, lat_cache, rot_cache, c_new, kr_new, slot, scale, out):
    q float32 (H, Dn+Dr) (q_nope its first Dn columns), q_rope (H, Dr) rotated; the new
    latent c_new (1, Rkv) and rotated key kr_new (1, Dr) written to slot `slot` of sequence
    0 of lat_cache (B, 1, S, Rkv) / rot_cache (B, 1, S, Dr) (float32, float16 or uint16 bf16
    bits, rounded to nearest-even); out float32 (1, H*Dv) = per head W_vb[h] (softmax over
    slots 0..slot of scale * (q_nope W_kb[h] . c_j + q_rope . kr_j)) c_j: _reference's
    mla_absorbed on kv_b decoded to float32, up to summation order (~1e-6 relative).
    """
    weight_refs(kv_b=kv_b)
    return _kernels.PreparedMLA(kv_b, int(n_heads), int(nope_dim), int(v_dim),
                                resolve_threads(threads))


def prepare_biased_experts(w_gate: WeightRef, w_up: WeightRef, w_down: WeightRef,
                           b_gate: np.ndarray | None, b_up: np.ndarray | None,
                           b_down: np.ndarray | None, activation: str, alpha: float,
                           limit: float, *, threads: int | None = None,
                           activations: str = "f32", n_experts: int | None = None
                           ) -> Callable[..., None]:
    """One token's routed experts with biases and / or swigluoai (BiasedExperts' decode,
    colibri.kernels.biased_experts) as one compiled call, its stacks (E, I, D), (E, I, D),
    (E, D, I) and biases float32 (E, I), (E, I), (E, D) (or None) checked once.

    Returns p with p(x, ids, weights, out): x float32 (1, D), ids int32 (1, K), weights
    float32 (1, K), out float32 (1, D) not overlapping x, all C-contiguous: out = sum over
    the K slots in ascending id order (stable) of w * (down(act(gate(x) + b_gate, up(x) +
    b_up)) + b_down), act "swigluoai" (alpha, limit) or "silu" (silu(g) * u); the row
    kernels of prepare_linear on each expert (the same bits), the activation compiled
    (csrc/swigluoai.h: within a few ulp of biased_experts.swigluoai).

    Over an expert cache's arena the stacks are its slots (n_slots, ...), the biases (E, ...)
    with E = n_experts, and p(x, ids, weights, out, slots) reads expert ids[k] from stack
    row slots[k] (int32 (1, K)).
    """
    weight_refs(w_gate=w_gate, w_up=w_up, w_down=w_down)
    return _kernels.PreparedBiasedExperts(w_gate, w_up, w_down, b_gate, b_up, b_down,
                                          activation, float(alpha), float(limit),
                                          resolve_threads(threads), activations, n_experts)


# NumPy's float32 exp loop was found at import (the calls that reproduce np.exp can run)
EXP_LOOP: bool = bool(_kernels.EXP_LOOP)


def mxfp4_f32_activations(w: WeightRef, activations: str, n: int) -> bool:
    """True when BiasedExperts runs matrix w for an expert of n tokens on f32
    activations (the f32 GEMM) instead of `activations`: MXFP4 on int16, from 8 tokens,
    below the integer GEMM's crossover on the current ISA path."""
    weight_refs(w=w)
    return _kernels.mxfp4_f32_activations(w, activations, int(n))


def prepare_biased_experts_grouped(w_gate: WeightRef, w_up: WeightRef, w_down: WeightRef,
                                   b_gate: np.ndarray | None, b_up: np.ndarray | None,
                                   b_down: np.ndarray | None, activation: str, alpha: float,
                                   limit: float, *, threads: int | None = None,
                                   activations: str = "f32", n_experts: int | None = None
                                   ) -> Callable[..., None]:
    """prepare_biased_experts' experts over T token rows (prefill, ragged steps), one call.

    Returns p with p(x, ids, weights, out[, slots]): x float32 (T, D), ids int32 (T, K),
    weights float32 (T, K), out float32 (T, D) (may be x), slots as prepare_biased_experts':
    BiasedExperts.reference's result bit for bit (slots grouped by expert once; each
    expert's matrices over its tokens on the path a prepared linear of them takes, biases
    after; the activation NumPy's operations and exp; the outputs summed per token in
    ascending expert order). RuntimeError if NumPy's float32 exp loop was not found
    (EXP_LOOP False).
    """
    weight_refs(w_gate=w_gate, w_up=w_up, w_down=w_down)
    return _kernels.PreparedBiasedGrouped(w_gate, w_up, w_down, b_gate, b_up, b_down,
                                          activation, float(alpha), float(limit),
                                          resolve_threads(threads), activations, n_experts)
