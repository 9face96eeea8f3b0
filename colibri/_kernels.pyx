# cython: language_level=3
"""colibri._kernels: the compiled MoE kernels (import colibri.kernels, not this module).

Three roles, as in scikit-learn: `def` wrappers check dtypes, shapes, ranges and the byte
bounds of every weight with the GIL held, allocate outputs and scratch, then enter
`with nogil:`; `cdef ... noexcept nogil` workers run the loops; the per-ISA inner loops
(one weight row against up to COLIBRI_MAX_NT tokens, dequantizing in registers) live in
_simd.h. Nothing inside a prange can fail: every check happens before it.

Determinism: every output element is produced by one row-kernel call whose inputs do not
depend on the number of threads (token blocks are fixed by the data, not the schedule), and
the expert outputs are combined per token in k order, so results are bit-identical for any
thread count on a given ISA path.

Shapes: T tokens, D hidden, I expert intermediate, E experts, K experts per token,
R rows (outputs) and C columns (inputs) of a weight matrix, G group size, NT tokens per pass.
Sections: weights and ISA, linear, routing, dispatch, FFN, dequant, bandwidth.
"""
from cython.parallel cimport prange
from libc.stdint cimport int32_t, int64_t, uint8_t, uint64_t
from libc.math cimport INFINITY, expf

import numpy as np

cdef extern from "_simd.h" nogil:
    enum:
        COLIBRI_ISA_SCALAR
        COLIBRI_ISA_AVX2
        COLIBRI_ISA_AVX512
        COLIBRI_N_ISA
        COLIBRI_F32
        COLIBRI_F16
        COLIBRI_BF16
        COLIBRI_Q8
        COLIBRI_Q4
        COLIBRI_MAX_NT
    ctypedef void (*colibri_dot_fn)(const uint8_t *row, Py_ssize_t cols, Py_ssize_t group,
                                    const float *x, Py_ssize_t x_stride,
                                    const float *xsum, Py_ssize_t xsum_stride,
                                    int nt, float *out, Py_ssize_t out_stride) noexcept nogil
    int colibri_isa_supported(int isa)
    int colibri_isa_best()
    colibri_dot_fn colibri_dot_for(int isa, int fmt)
    uint64_t colibri_read_sum(int isa, const uint8_t *p, size_t n)
    void colibri_decode_row(int fmt, const uint8_t *row, Py_ssize_t cols, Py_ssize_t group,
                            float *out)
    void colibri_group_sums(const float *x, Py_ssize_t cols, Py_ssize_t group, float *xsum)
    float colibri_silu(float g)
    float colibri_gumbel(uint64_t seed, uint64_t t, uint64_t e)

# A row tile of a weight matrix is about this many bytes: it stays in L1/L2 while every
# token block of the call passes over it, so the weights stream from memory once.
cdef enum:
    TILE_BYTES = 32768

FORMATS = {"f32": COLIBRI_F32, "f16": COLIBRI_F16, "bf16": COLIBRI_BF16,
           "q8": COLIBRI_Q8, "q4": COLIBRI_Q4}
ISA_NAMES = ("scalar", "avx2", "avx512")
RULES = {"softmax_topk": 0, "topk_softmax": 1}

cdef int _isa = colibri_isa_best()


# =============================================================================================
# weights and ISA

def isa_supported(int code):
    """True when this CPU and OS run path `code` (0 scalar, 1 avx2, 2 avx512)."""
    return 0 <= code < COLIBRI_N_ISA and colibri_isa_supported(code) != 0


def best_isa():
    return colibri_isa_best()


def get_isa():
    return _isa


def set_isa(int code):
    """Select the path every later kernel call uses (the caller checked isa_supported)."""
    global _isa
    if not isa_supported(code):
        raise ValueError(f"ISA code {code} is not supported by this CPU/OS")
    _isa = code


ctypedef struct Wmat:
    const uint8_t *base        # row 0 of expert 0
    int fmt                    # COLIBRI_F32 .. COLIBRI_Q4
    Py_ssize_t rows, cols      # R, C of one matrix
    Py_ssize_t group           # G (quantized), 0 otherwise
    Py_ssize_t row_stride, expert_stride, n_experts
    Py_ssize_t xsum_cols       # C / G for q4 (the offset fold needs per-group sums of x), else 0
    colibri_dot_fn dot         # row kernel of the current ISA


def _row_bytes(str dtype, cols, group):
    if dtype == "f32":
        return 4 * cols
    if dtype in ("f16", "bf16"):
        return 2 * cols
    quant = cols if dtype == "q8" else cols // 2
    return quant + 2 * (cols // group)


def _int_field(w, str field, str name):
    v = getattr(w, field)
    if isinstance(v, bool) or not isinstance(v, (int, np.integer)):
        raise ValueError(f"{name}: {field} must be an int, found {v!r}")
    return int(v)


def _checked(w, str name):
    """Read and check every field of a WeightRef-like object once; return them as
    (buf, dtype, offset, rows, cols, group, row_stride, n_experts, expert_stride, end).

    Raises ValueError naming `name`, the field and the numbers on any inconsistency. The
    kernels use exactly these values (not a second read of w), so after this no kernel can
    read outside the buffer, whatever the object says.
    """
    buf = w.buf
    if not isinstance(buf, np.ndarray):
        raise ValueError(f"{name}: buf must be a numpy uint8 array, found {type(buf).__name__}")
    if buf.dtype != np.uint8 or buf.ndim != 1 or not buf.flags.c_contiguous:
        raise ValueError(f"{name}: buf must be a 1-D C-contiguous uint8 array, found dtype "
                         f"{buf.dtype} with shape {buf.shape}")
    dtype = w.dtype
    if dtype not in FORMATS:
        raise ValueError(f"{name}: dtype {dtype!r} is not a weight format the kernels read "
                         f"(expected one of {', '.join(FORMATS)})")
    offset, rows, cols, group, row_stride, n_experts, expert_stride = (
        _int_field(w, f, name) for f in ("offset", "rows", "cols", "group_size", "row_stride",
                                         "n_experts", "expert_stride"))
    if rows < 1 or cols < 1 or n_experts < 1:
        raise ValueError(f"{name}: rows {rows}, cols {cols} and n_experts {n_experts} must "
                         f"all be >= 1")
    if dtype in ("q8", "q4"):
        if group <= 0 or group % 32 or cols % group:
            raise ValueError(f"{name}: group_size {group} must be a positive multiple of 32 "
                             f"dividing cols {cols} ({dtype})")
    else:
        group = 0
    rb = _row_bytes(dtype, cols, group)
    if row_stride < rb:
        raise ValueError(f"{name}: row_stride {row_stride} is smaller than one {dtype} row "
                         f"of {cols} columns ({rb} bytes)")
    span = (rows - 1) * row_stride + rb                  # bytes of one expert's matrix
    if n_experts == 1:
        expert_stride = 0
    elif expert_stride < span:
        raise ValueError(f"{name}: expert_stride {expert_stride} is smaller than one expert's "
                         f"matrix ({span} bytes: {rows} rows of stride {row_stride})")
    if offset < 0:
        raise ValueError(f"{name}: offset {offset} is negative")
    end = offset + (n_experts - 1) * expert_stride + span
    if end > buf.size:
        raise ValueError(f"{name}: {dtype} ({n_experts} x {rows} x {cols}) at offset {offset} "
                         f"ends at byte {end}, past the end of the buffer ({buf.size} bytes)")
    return buf, dtype, offset, rows, cols, group, row_stride, n_experts, expert_stride, end


def weight_span(w, str name="weight"):
    """Check a WeightRef-like object against its buffer (ValueError if inconsistent);
    return the byte range (first, end) it covers."""
    checked = _checked(w, name)
    return checked[2], checked[9]


cdef object _load(object w, str name, Wmat *m):
    """Check w and fill m for the current ISA; return the typed view of the buffer, which
    the caller keeps alive while the kernel runs."""
    buf, dtype, offset, rows, cols, group, row_stride, n_experts, expert_stride, _ = \
        _checked(w, name)
    cdef const uint8_t[::1] view = buf
    m.fmt = FORMATS[dtype]
    m.rows = rows
    m.cols = cols
    m.group = group
    m.row_stride = row_stride
    m.n_experts = n_experts
    m.expert_stride = expert_stride
    m.xsum_cols = cols // group if m.fmt == COLIBRI_Q4 else 0
    m.base = &view[0] + <Py_ssize_t>offset
    m.dot = colibri_dot_for(_isa, m.fmt)
    if m.dot == NULL:
        raise RuntimeError(f"{name}: no row kernel for format {dtype} on ISA {_isa}")
    return view


cdef inline Py_ssize_t _tile_rows(Py_ssize_t R, Py_ssize_t row_stride, int threads) noexcept nogil:
    """Rows per tile: about TILE_BYTES of weights, and at least 4 tiles per thread when R allows
    (the tile boundaries never change a result: each output is one row-kernel call)."""
    cdef Py_ssize_t tr = TILE_BYTES // row_stride
    cdef Py_ssize_t per = (R + 4 * threads - 1) // (4 * threads)
    if tr > per:
        tr = per
    if tr < 1:
        tr = 1
    return tr


cdef object _xsum_buffer(Py_ssize_t n, Py_ssize_t xsum_cols):
    """Scratch of per-group sums (n, C/G) for a q4 weight; a 1x1 dummy otherwise."""
    if xsum_cols > 0 and n > 0:
        return np.empty((n, xsum_cols), dtype=np.float32)
    return np.zeros((1, 1), dtype=np.float32)


cdef void _group_sums_rows(const float *x, Py_ssize_t n, Py_ssize_t cols, Py_ssize_t group,
                           float *xsum, int threads) noexcept nogil:
    """xsum (n, C/G) = per-group sums of the n rows of x (n, C)."""
    cdef Py_ssize_t i
    for i in prange(n, num_threads=threads, schedule='static'):
        colibri_group_sums(x + i * cols, cols, group, xsum + i * (cols // group))


def _check_threads(int threads):
    if threads < 1:
        raise ValueError(f"threads must be >= 1, found {threads}")


def _check_f32_out(out, tuple shape, str name):
    if (not isinstance(out, np.ndarray) or out.dtype != np.float32 or out.shape != shape
            or not out.flags.c_contiguous or not out.flags.writeable):
        raise ValueError(f"{name} must be a writable C-contiguous float32 array of shape "
                         f"{shape}, found {getattr(out, 'dtype', type(out).__name__)} "
                         f"{getattr(out, 'shape', '')}")


# =============================================================================================
# linear: y (T, R) = x (T, C) @ W.T (+ bias)

cdef void _linear_rows(const Wmat *w, Py_ssize_t expert, const float *x, Py_ssize_t n,
                       const float *xsum, const float *bias, float *y, Py_ssize_t y_stride,
                       Py_ssize_t r0, Py_ssize_t r1) noexcept nogil:
    """Rows r0..r1 of W (expert `expert`) against the n tokens of x (n, C):
    y[t, r] = W[r] . x[t] (+ bias[r]), y with row stride y_stride.
    Token blocks outside, rows inside: the tile of rows is reused by every block from cache."""
    cdef const uint8_t *base = w.base + expert * w.expert_stride
    cdef Py_ssize_t C = w.cols, ss = w.xsum_cols, t0, r, t
    cdef int nt
    t0 = 0
    while t0 < n:
        nt = <int>(n - t0) if n - t0 < COLIBRI_MAX_NT else COLIBRI_MAX_NT
        for r in range(r0, r1):
            w.dot(base + r * w.row_stride, C, w.group, x + t0 * C, C,
                  xsum + t0 * ss, ss, nt, y + t0 * y_stride + r, y_stride)
            if bias != NULL:
                for t in range(nt):
                    y[(t0 + t) * y_stride + r] += bias[r]
        t0 += nt


def linear(const float[:, ::1] x, w, bias, float[:, ::1] out, Py_ssize_t expert, int threads):
    """out (T, R) = x (T, C) @ W[expert].T (+ bias (R,)); x float32, w a WeightRef."""
    _check_threads(threads)
    cdef Wmat m
    keep = _load(w, "w", &m)
    cdef Py_ssize_t T = x.shape[0], R = m.rows, C = m.cols
    if x.shape[1] != C:
        raise ValueError(f"x has {x.shape[1]} columns, the weight has cols {C}")
    if out.shape[0] != T or out.shape[1] != R:
        raise ValueError(f"out has shape ({out.shape[0]}, {out.shape[1]}), expected ({T}, {R})")
    if not 0 <= expert < m.n_experts:
        raise ValueError(f"expert {expert} out of range for a weight of {m.n_experts} experts")
    cdef const float[::1] bv
    cdef const float *bp = NULL
    if bias is not None:
        bv = bias
        if bv.shape[0] != R:
            raise ValueError(f"bias has {bv.shape[0]} elements, expected rows {R}")
        bp = &bv[0]
    if T == 0:
        return
    if np.may_share_memory(np.asarray(x), np.asarray(out)):
        raise ValueError("out must not overlap x (linear reads every row of x while writing)")
    cdef float[:, ::1] xs = _xsum_buffer(T, m.xsum_cols)
    cdef Py_ssize_t tr = _tile_rows(R, m.row_stride, threads)
    cdef Py_ssize_t n_tiles = (R + tr - 1) // tr, i, r1
    with nogil:
        if m.xsum_cols > 0:
            _group_sums_rows(&x[0, 0], T, C, m.group, &xs[0, 0], threads)
        for i in prange(n_tiles, num_threads=threads, schedule='static'):
            r1 = (i + 1) * tr
            if r1 > R:
                r1 = R
            _linear_rows(&m, expert, &x[0, 0], T, &xs[0, 0], bp, &out[0, 0], R, i * tr, r1)


# =============================================================================================
# routing: logits (T, E) -> ids (T, K), weights (T, K)

cdef void _softmax(const float *v, Py_ssize_t n, float *p) noexcept nogil:
    """p = softmax(v), max-subtracted; exp in f32, sum in f64. Never NaN for non-NaN v:
    all -inf -> uniform, any +inf -> uniform over the +inf entries (the limits)."""
    cdef float m = v[0]
    cdef Py_ssize_t i, count = 0
    cdef double s = 0.0
    for i in range(1, n):
        if v[i] > m:
            m = v[i]
    if m == -INFINITY:
        for i in range(n):
            p[i] = <float>(1.0 / n)
        return
    if m == INFINITY:
        for i in range(n):
            if v[i] == INFINITY:
                count += 1
        for i in range(n):
            p[i] = <float>(1.0 / count) if v[i] == INFINITY else 0.0
        return
    for i in range(n):
        p[i] = expf(v[i] - m)
        s += p[i]
    for i in range(n):
        p[i] = <float>(p[i] / s)


cdef void _select_topk(const float *key, Py_ssize_t E, Py_ssize_t k, int32_t *ids) noexcept nogil:
    """ids[0..k) = the k largest keys, largest first, ties -> lower index.
    Partial selection: one pass, a sorted list of k kept by insertion (O(E k) worst case)."""
    cdef Py_ssize_t e, j, n = 0
    cdef float v
    for e in range(E):
        v = key[e]
        if n < k:
            j = n
            n += 1
        elif v > key[ids[k - 1]]:
            j = k - 1
        else:
            continue
        while j > 0 and v > key[ids[j - 1]]:        # strict: an equal key stays behind
            ids[j] = ids[j - 1]
            j -= 1
        ids[j] = <int32_t>e


cdef void _route_token(const float *l, Py_ssize_t E, Py_ssize_t k, int rule, bint norm,
                       bint noisy, uint64_t seed, Py_ssize_t t, float *p, float *key,
                       int32_t *ids, float *w) noexcept nogil:
    """One token's routing (see kernels.route_topk); p, key: scratch of E floats."""
    cdef const float *sel
    cdef Py_ssize_t e, j, i
    cdef double s = 0.0
    cdef float wj
    cdef int32_t ij
    if noisy:
        for e in range(E):
            key[e] = l[e] + colibri_gumbel(seed, <uint64_t>t, <uint64_t>e)
    if rule == 0:                                   # softmax over all E, then top-k
        _softmax(l, E, p)
        sel = p
        if noisy:
            sel = key
        _select_topk(sel, E, k, ids)
        for j in range(k):
            w[j] = p[ids[j]]
        if norm:
            for j in range(k):
                s += w[j]
            for j in range(k):
                w[j] = <float>(w[j] / s)
    else:                                           # top-k of the logits, softmax over the k
        sel = l
        if noisy:
            sel = key
        _select_topk(sel, E, k, ids)
        for j in range(k):
            p[j] = l[ids[j]]
        _softmax(p, k, w)
    # list by weight, descending, ties -> lower expert (insertion sort of k items)
    for j in range(1, k):
        wj = w[j]
        ij = ids[j]
        i = j
        while i > 0 and (w[i - 1] < wj or (w[i - 1] == wj and ids[i - 1] > ij)):
            w[i] = w[i - 1]
            ids[i] = ids[i - 1]
            i -= 1
        w[i] = wj
        ids[i] = ij


def route_topk(const float[:, ::1] logits, Py_ssize_t k, str rule, bint norm_topk_prob,
               noise_seed, int threads):
    """ids int32 (T, K), weights float32 (T, K) from logits float32 (T, E)."""
    _check_threads(threads)
    cdef Py_ssize_t T = logits.shape[0], E = logits.shape[1], t
    if rule not in RULES:
        raise ValueError(f"unknown routing rule {rule!r}; expected one of {', '.join(RULES)}")
    cdef int rcode = RULES[rule]
    if E < 1 or not 1 <= k <= E:
        raise ValueError(f"k = {k} must be in 1..E, with E = {E} experts")
    arr = np.asarray(logits)
    if T and np.isnan(arr).any():
        bad = np.argwhere(np.isnan(arr))[0]
        raise ValueError(f"logits contain NaN (first at token {bad[0]}, expert {bad[1]})")
    cdef bint noisy = noise_seed is not None
    cdef uint64_t seed = (int(noise_seed) & 0xFFFFFFFFFFFFFFFF) if noisy else 0
    ids = np.empty((T, k), dtype=np.int32)
    wts = np.empty((T, k), dtype=np.float32)
    if T == 0:
        return ids, wts
    cdef int32_t[:, ::1] iv = ids
    cdef float[:, ::1] wv = wts
    cdef float[:, ::1] p = np.empty((T, E), dtype=np.float32)
    cdef float[:, ::1] key = np.empty((T, E), dtype=np.float32)
    with nogil:
        for t in prange(T, num_threads=threads, schedule='static'):
            _route_token(&logits[t, 0], E, k, rcode, norm_topk_prob, noisy, seed, t,
                         &p[t, 0], &key[t, 0], &iv[t, 0], &wv[t, 0])
    return ids, wts


# =============================================================================================
# dispatch: group the (token, k) slots by expert

cdef void _count_sort(const int32_t *ids, Py_ssize_t n, Py_ssize_t E, int64_t *offsets,
                      int32_t *slots, int64_t *cursor) noexcept nogil:
    """offsets (E+1,): slots of expert e are slots[offsets[e]:offsets[e+1]], ascending.
    ids (n,) must be in 0..E-1 (checked by the caller)."""
    cdef Py_ssize_t i, e
    for e in range(E + 1):
        offsets[e] = 0
    for i in range(n):
        offsets[ids[i] + 1] += 1
    for e in range(E):
        offsets[e + 1] += offsets[e]
        cursor[e] = offsets[e]
    for i in range(n):
        e = ids[i]
        slots[cursor[e]] = <int32_t>i
        cursor[e] += 1


def _check_ids(ids_arr, Py_ssize_t E):
    if ids_arr.size and (ids_arr.min() < 0 or ids_arr.max() >= E):
        bad = np.argwhere((ids_arr < 0) | (ids_arr >= E))[0]
        raise ValueError(f"expert id {ids_arr[tuple(bad)]} at {tuple(int(b) for b in bad)} is "
                         f"out of range for {E} experts")


def group_by_expert(const int32_t[:, ::1] ids, Py_ssize_t n_experts):
    """offsets int64 (E+1,), slots int32 (T*K,) (counting sort, stable)."""
    if n_experts < 1:
        raise ValueError(f"n_experts must be >= 1, found {n_experts}")
    _check_ids(np.asarray(ids), n_experts)
    cdef Py_ssize_t n = ids.shape[0] * ids.shape[1]
    offsets = np.zeros(n_experts + 1, dtype=np.int64)
    slots = np.empty(n, dtype=np.int32)
    cdef int64_t[::1] ov = offsets
    cdef int64_t[::1] cur = np.empty(n_experts, dtype=np.int64)
    cdef int32_t[::1] sv = slots
    if n == 0:
        return offsets, slots
    with nogil:
        _count_sort(&ids[0, 0], n, n_experts, &ov[0], &sv[0], &cur[0])
    return offsets, slots


# =============================================================================================
# FFN: h = silu(x W_gate.T) * (x W_up.T); y = h W_down.T

cdef void _gateup_rows(const Wmat *g, const Wmat *u, Py_ssize_t e, const float *x,
                       Py_ssize_t n, const float *xsg, const float *xsu, float *h,
                       Py_ssize_t r0, Py_ssize_t r1) noexcept nogil:
    """h[t, r] = silu(W_gate[e][r] . x[t]) * (W_up[e][r] . x[t]) for r in r0..r1, t < n;
    x (n, D), h (n, I). Gate and up rows are read in the same pass over a token block."""
    cdef const uint8_t *bg = g.base + e * g.expert_stride
    cdef const uint8_t *bu = u.base + e * u.expert_stride
    cdef Py_ssize_t D = g.cols, I = g.rows, t0, r, t
    cdef float gv[COLIBRI_MAX_NT]
    cdef float uv[COLIBRI_MAX_NT]
    cdef int nt
    t0 = 0
    while t0 < n:
        nt = <int>(n - t0) if n - t0 < COLIBRI_MAX_NT else COLIBRI_MAX_NT
        for r in range(r0, r1):
            g.dot(bg + r * g.row_stride, D, g.group, x + t0 * D, D,
                  xsg + t0 * g.xsum_cols, g.xsum_cols, nt, gv, 1)
            u.dot(bu + r * u.row_stride, D, u.group, x + t0 * D, D,
                  xsu + t0 * u.xsum_cols, u.xsum_cols, nt, uv, 1)
            for t in range(nt):
                h[(t0 + t) * I + r] = colibri_silu(gv[t]) * uv[t]
        t0 += nt


cdef int _load_ffn(w_gate, w_up, w_down, Wmat *g, Wmat *u, Wmat *d, list keep) except -1:
    keep.append(_load(w_gate, "w_gate", g))
    keep.append(_load(w_up, "w_up", u))
    keep.append(_load(w_down, "w_down", d))
    if (u.rows != g.rows or u.cols != g.cols or d.rows != g.cols or d.cols != g.rows
            or u.n_experts != g.n_experts or d.n_experts != g.n_experts):
        raise ValueError(
            f"FFN weights disagree: w_gate ({g.n_experts} x {g.rows} x {g.cols}), w_up "
            f"({u.n_experts} x {u.rows} x {u.cols}), w_down ({d.n_experts} x {d.rows} x "
            f"{d.cols}); expected (E, I, D), (E, I, D), (E, D, I)")
    return 0


def expert_ffn(const float[:, ::1] x, const int32_t[:, ::1] ids, const float[:, ::1] weights,
               w_gate, w_up, w_down, float[:, ::1] out, int threads):
    """out (T, D) = sum_k weights[t, k] * FFN_{ids[t, k]}(x[t]); out may be x itself."""
    _check_threads(threads)
    cdef Wmat g, u, d
    keep = []
    _load_ffn(w_gate, w_up, w_down, &g, &u, &d, keep)
    cdef Py_ssize_t T = x.shape[0], D = x.shape[1], K = ids.shape[1]
    cdef Py_ssize_t E = g.n_experts, I = g.rows
    if D != g.cols:
        raise ValueError(f"x has {D} columns, the experts' hidden size is {g.cols}")
    if ids.shape[0] != T or K < 1:
        raise ValueError(f"ids has shape ({ids.shape[0]}, {K}), expected ({T}, K >= 1)")
    if weights.shape[0] != T or weights.shape[1] != K:
        raise ValueError(f"weights has shape ({weights.shape[0]}, {weights.shape[1]}), "
                         f"expected ({T}, {K})")
    if out.shape[0] != T or out.shape[1] != D:
        raise ValueError(f"out has shape ({out.shape[0]}, {out.shape[1]}), expected ({T}, {D})")
    _check_ids(np.asarray(ids), E)
    if T == 0:
        return
    cdef Py_ssize_t TK = T * K, p, t, k, c, it, e, tile, n_gu = 0, n_dn = 0
    # scratch, in expert-grouped slot order (position p holds slot slots[p] = t*K + k)
    cdef int64_t[::1] offsets = np.zeros(E + 1, dtype=np.int64)
    cdef int64_t[::1] cursor = np.empty(E, dtype=np.int64)
    cdef int32_t[::1] slots = np.empty(TK, dtype=np.int32)
    cdef int64_t[::1] pos = np.empty(TK, dtype=np.int64)           # slot -> position
    cdef float[:, ::1] xg = np.empty((TK, D), dtype=np.float32)     # gathered x
    cdef float[:, ::1] hg = np.empty((TK, I), dtype=np.float32)     # activations
    cdef float[:, ::1] og = np.empty((TK, D), dtype=np.float32)     # expert outputs
    cdef float[:, ::1] xsg = _xsum_buffer(TK, g.xsum_cols)
    cdef float[:, ::1] xsu = _xsum_buffer(TK, u.xsum_cols)
    cdef float[:, ::1] xsd = _xsum_buffer(TK, d.xsum_cols)
    # work items (expert, row tile), flat, only for experts with tokens
    cdef Py_ssize_t tr_gu = _tile_rows(I, g.row_stride + u.row_stride, threads)
    cdef Py_ssize_t tr_dn = _tile_rows(D, d.row_stride, threads)
    cdef Py_ssize_t nt_gu = (I + tr_gu - 1) // tr_gu, nt_dn = (D + tr_dn - 1) // tr_dn
    cdef int64_t[::1] items_gu = np.empty(E * nt_gu, dtype=np.int64)
    cdef int64_t[::1] items_dn = np.empty(E * nt_dn, dtype=np.int64)
    cdef Py_ssize_t r0, r1, n_e, src
    cdef float wk
    cdef float *yt
    cdef const float *ot
    with nogil:
        _count_sort(&ids[0, 0], TK, E, &offsets[0], &slots[0], &cursor[0])
        for p in range(TK):
            pos[slots[p]] = p
        for e in range(E):
            if offsets[e + 1] > offsets[e]:
                for tile in range(nt_gu):
                    items_gu[n_gu] = e * nt_gu + tile
                    n_gu += 1
                for tile in range(nt_dn):
                    items_dn[n_dn] = e * nt_dn + tile
                    n_dn += 1

        for p in prange(TK, num_threads=threads, schedule='static'):
            src = slots[p] // K
            for c in range(D):
                xg[p, c] = x[src, c]
            if g.xsum_cols > 0:
                colibri_group_sums(&xg[p, 0], D, g.group, &xsg[p, 0])
            if u.xsum_cols > 0:
                colibri_group_sums(&xg[p, 0], D, u.group, &xsu[p, 0])

        for it in prange(n_gu, num_threads=threads, schedule='dynamic'):
            e = items_gu[it] // nt_gu
            r0 = (items_gu[it] % nt_gu) * tr_gu
            r1 = r0 + tr_gu
            if r1 > I:
                r1 = I
            n_e = offsets[e + 1] - offsets[e]
            _gateup_rows(&g, &u, e, &xg[offsets[e], 0], n_e, &xsg[0, 0] + offsets[e] * g.xsum_cols,
                         &xsu[0, 0] + offsets[e] * u.xsum_cols, &hg[offsets[e], 0], r0, r1)

        if d.xsum_cols > 0:
            _group_sums_rows(&hg[0, 0], TK, I, d.group, &xsd[0, 0], threads)

        for it in prange(n_dn, num_threads=threads, schedule='dynamic'):
            e = items_dn[it] // nt_dn
            r0 = (items_dn[it] % nt_dn) * tr_dn
            r1 = r0 + tr_dn
            if r1 > D:
                r1 = D
            n_e = offsets[e + 1] - offsets[e]
            _linear_rows(&d, e, &hg[offsets[e], 0], n_e, &xsd[0, 0] + offsets[e] * d.xsum_cols,
                         NULL, &og[offsets[e], 0], D, r0, r1)

        # y[t] = sum_k weights[t, k] * og[pos[t*K + k]], in k order
        for t in prange(T, num_threads=threads, schedule='static'):
            yt = &out[t, 0]
            for c in range(D):
                yt[c] = 0.0
            for k in range(K):
                wk = weights[t, k]
                ot = &og[pos[t * K + k], 0]
                for c in range(D):
                    yt[c] = yt[c] + wk * ot[c]


def swiglu(const float[:, ::1] x, w_gate, w_up, w_down, float[:, ::1] out, int threads):
    """out (T, D) = W_down @ (silu(W_gate @ x) * (W_up @ x)) per token; one dense FFN."""
    _check_threads(threads)
    cdef Wmat g, u, d
    keep = []
    _load_ffn(w_gate, w_up, w_down, &g, &u, &d, keep)
    if g.n_experts != 1:
        raise ValueError(f"swiglu takes single matrices, found n_experts {g.n_experts}")
    cdef Py_ssize_t T = x.shape[0], D = x.shape[1], I = g.rows, i, r1
    if D != g.cols:
        raise ValueError(f"x has {D} columns, the FFN's hidden size is {g.cols}")
    if out.shape[0] != T or out.shape[1] != D:
        raise ValueError(f"out has shape ({out.shape[0]}, {out.shape[1]}), expected ({T}, {D})")
    if T == 0:
        return
    cdef float[:, ::1] h = np.empty((T, I), dtype=np.float32)
    cdef float[:, ::1] xsg = _xsum_buffer(T, g.xsum_cols)
    cdef float[:, ::1] xsu = _xsum_buffer(T, u.xsum_cols)
    cdef float[:, ::1] xsd = _xsum_buffer(T, d.xsum_cols)
    cdef Py_ssize_t tr_gu = _tile_rows(I, g.row_stride + u.row_stride, threads)
    cdef Py_ssize_t tr_dn = _tile_rows(D, d.row_stride, threads)
    with nogil:
        if g.xsum_cols > 0:
            _group_sums_rows(&x[0, 0], T, D, g.group, &xsg[0, 0], threads)
        if u.xsum_cols > 0:
            _group_sums_rows(&x[0, 0], T, D, u.group, &xsu[0, 0], threads)
        for i in prange((I + tr_gu - 1) // tr_gu, num_threads=threads, schedule='static'):
            r1 = (i + 1) * tr_gu
            if r1 > I:
                r1 = I
            _gateup_rows(&g, &u, 0, &x[0, 0], T, &xsg[0, 0], &xsu[0, 0], &h[0, 0],
                         i * tr_gu, r1)
        if d.xsum_cols > 0:
            _group_sums_rows(&h[0, 0], T, I, d.group, &xsd[0, 0], threads)
        for i in prange((D + tr_dn - 1) // tr_dn, num_threads=threads, schedule='static'):
            r1 = (i + 1) * tr_dn
            if r1 > D:
                r1 = D
            _linear_rows(&d, 0, &h[0, 0], T, &xsd[0, 0], NULL, &out[0, 0], D, i * tr_dn, r1)


# =============================================================================================
# dequant (a test and debugging helper: the kernels above never build a dequantized matrix)

def dequantize(w, Py_ssize_t expert, int threads):
    """float32 (R, C): the matrix of expert `expert`, decoded with the scalar path."""
    _check_threads(threads)
    cdef Wmat m
    keep = _load(w, "w", &m)
    if not 0 <= expert < m.n_experts:
        raise ValueError(f"expert {expert} out of range for a weight of {m.n_experts} experts")
    out = np.empty((m.rows, m.cols), dtype=np.float32)
    cdef float[:, ::1] ov = out
    cdef const uint8_t *base = m.base + expert * m.expert_stride
    cdef Py_ssize_t r
    with nogil:
        for r in prange(m.rows, num_threads=threads, schedule='static'):
            colibri_decode_row(m.fmt, base + r * m.row_stride, m.cols, m.group, &ov[r, 0])
    return out


# =============================================================================================
# memory read bandwidth

def read_sum(const uint8_t[::1] buf, int threads):
    """Sum of buf as u64 words (wrapping), each thread streaming one contiguous part."""
    _check_threads(threads)
    cdef Py_ssize_t n = buf.shape[0], i, lo, hi
    cdef uint64_t total = 0
    cdef int isa = _isa
    if n == 0:
        return 0
    cdef Py_ssize_t part = (n + threads - 1) // threads
    part = (part + 4095) // 4096 * 4096                # page-aligned parts
    cdef Py_ssize_t nparts = (n + part - 1) // part
    with nogil:
        for i in prange(nparts, num_threads=threads, schedule='static'):
            lo = i * part
            hi = lo + part
            if hi > n:
                hi = n
            total += colibri_read_sum(isa, &buf[lo], <size_t>(hi - lo))
    return int(total)
