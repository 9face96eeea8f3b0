# cython: language_level=3
"""colibri._kernels: the compiled MoE kernels (import colibri.kernels, not this module).

Three roles, as in scikit-learn: `def` wrappers check dtypes, shapes, ranges and the byte
bounds of every weight with the GIL held, allocate outputs and scratch, then enter
`with nogil:`; `cdef ... noexcept nogil` workers run the loops; the per-ISA inner loops live
in _simd.h: the row kernel (one weight row against up to COLIBRI_MAX_NT tokens, dequantizing
in registers) and, for prefill, the GEMM path (a panel of rows dequantized once to f32 in
per-thread scratch, then a register-blocked micro-kernel over all the matrix's tokens).
Nothing inside a pool job can fail: every check happens before it.

Paths: a matrix applied to fewer than gemm_min_tokens tokens (linear: T; expert FFN: that
expert's tokens) runs on the row kernel, from that count on on the GEMM path. Both are
exact to the dequantized weights with f32 activations; they sum in different orders.

Determinism: every output element is produced by one kernel call whose inputs do not
depend on the number of threads, and whose arithmetic depends only on the path, not on how
many tokens share the pass, nor on the tiles, panels or token blocks (see _simd.h); the
choice of path depends only on the token count; the expert outputs are combined per token in
k order. So results are bit-identical for any thread count on a given ISA path. A token gets
the same bits alone (decode) or inside any block of fewer than gemm_min_tokens tokens, and
the same bits inside any two blocks of gemm_min_tokens or more; between the two (alone vs a
long prefill) its results may differ in the last bits (both within the f32 dot-product error
bound of the float64 reference).

Threads: the work runs on colibri's thread pool (_pool.h) as jobs of equal work items, which
the caller and the workers claim one at a time; a job returns when every item is done, so a
late worker costs nothing. Work too small to pay for a job runs on fewer threads, down to one
without touching the pool (_team, min_parallel_bytes). The expert FFN runs its stages
(gather, gate/up, down + combine) as three jobs over flat lists of work items.

Activations: with activations="int8" or "int16" a q8/q4 matrix (Wmat.iact) runs the
integer row kernel (_simd.h, "idot") on token rows quantized once per call into an Act (int8
or int16 codes, per
32-block scales and sums, packed as the SIMD bodies want): linear quantizes x before its
parallel loop; the expert FFN quantizes each gathered row (or x once, at T == 1) for gate /
up, and each gate/up work item quantizes the h columns it produced for w_down (its tiles are
then whole 32-blocks). Plain-format matrices keep the f32 path in the same call. The
quantization is bit-identical on every path and the integer dot follows the same
determinism rule as the f32 one. Such matrices never take the GEMM path: their row kernel, sharing each
decoded weight block between 4 tokens, already costs fewer instructions per weight.

Scratch: one grow-only per-process buffer (_take/_give), so a decode step allocates no
scratch arrays; a concurrent second caller (another Python thread) gets a fresh one.

Shapes: T tokens, D hidden, I expert intermediate, E experts, K experts per token,
R rows (outputs) and C columns (inputs) of a weight matrix, G group size, NT tokens per pass.
Sections: weights and ISA, linear, routing, dispatch, FFN, dequant, decode attention, bandwidth.
"""
from libc.stdlib cimport free, malloc
from libc.stdint cimport int8_t, int32_t, int64_t, uint8_t, uint64_t
from libc.math cimport INFINITY, expf

from math import gcd

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
        COLIBRI_INT8_NT
    ctypedef void (*colibri_dot_fn)(const uint8_t *row0, Py_ssize_t row_stride,
                                    Py_ssize_t nrows, Py_ssize_t cols, Py_ssize_t group,
                                    const float *x, Py_ssize_t x_stride,
                                    const float *xsum, Py_ssize_t xsum_stride,
                                    int nt, float *out, Py_ssize_t out_stride) noexcept nogil
    int colibri_isa_supported(int isa)
    int colibri_isa_best()
    colibri_dot_fn colibri_dot_for(int isa, int fmt)
    ctypedef void (*colibri_idot_fn)(const uint8_t *row0, Py_ssize_t row_stride,
                                     Py_ssize_t nrows, Py_ssize_t cols, Py_ssize_t group,
                                     const int8_t *q, Py_ssize_t q_stride, const float *d,
                                     const int32_t *s, Py_ssize_t d_stride, int nt, float *out,
                                     Py_ssize_t out_stride) noexcept nogil
    colibri_idot_fn colibri_idot_for(int isa, int fmt, int wide)
    Py_ssize_t colibri_act_row_bytes(int wide, Py_ssize_t cols)
    void colibri_quantize_act(int isa, int wide, const float *x, Py_ssize_t b0, Py_ssize_t b1,
                              int8_t *q, float *d, int32_t *s)
    void colibri_quantize_pad(int wide, Py_ssize_t cols, int8_t *q, float *d, int32_t *s,
                              Py_ssize_t npad)
    void colibri_quantize_plain(int isa, int wide, const float *x, Py_ssize_t cols, void *q,
                                float *d)
    void colibri_quantize_row(int isa, int wide, const float *x, Py_ssize_t cols, int8_t *q,
                              float *d, int32_t *s, Py_ssize_t npad)
    int colibri_block_tokens(int fmt)
    uint64_t colibri_read_sum(int isa, const uint8_t *p, size_t n)
    void colibri_decode_row(int fmt, const uint8_t *row, Py_ssize_t cols, Py_ssize_t group,
                            float *out)
    void colibri_group_sums(const float *x, Py_ssize_t cols, Py_ssize_t group, float *xsum)
    float colibri_silu(float g)
    void colibri_silu_mul(int isa, float *h, const float *u, Py_ssize_t n)
    float colibri_gumbel(uint64_t seed, uint64_t t, uint64_t e)
    enum:
        COLIBRI_GEMM_NR
        COLIBRI_GEMM_NB
        COLIBRI_GEMM_SCRATCH
    ctypedef void (*colibri_gemm_fn)(const uint8_t *row0, Py_ssize_t row_stride, int nr,
                                     Py_ssize_t cols, Py_ssize_t group, const float *x,
                                     Py_ssize_t xs, Py_ssize_t n, float *y, Py_ssize_t ys,
                                     float *panel) noexcept nogil
    colibri_gemm_fn colibri_gemm_for(int isa, int fmt)

cdef extern from "_attend.h" nogil:
    void colibri_attend(int isa, const float *q, int G, int Dh, const float *k, const float *v,
                        Py_ssize_t hs, Py_ssize_t rs, Py_ssize_t n, float scale, float *s,
                        float *out, int h0, int h1)

# The thread pool (_pool.h): colibri_pool_run(nth, fn, ctx, n) calls fn(ctx, i) for i < n on
# up to nth threads and returns when all have returned; colibri_worker_num() is the running
# thread's number (0..nth-1), which picks its slice of per-thread scratch.
cdef extern from "_pool.h" nogil:
    ctypedef void (*colibri_task_fn)(void *ctx, Py_ssize_t item) noexcept nogil
    void colibri_pool_run(int nth, colibri_task_fn fn, void *ctx, Py_ssize_t n)
    int colibri_worker_num()
    int colibri_pool_threaded()
    int colibri_pool_spin_us
    long colibri_pool_backoffs
    long colibri_pool_worker_items
    enum:
        COLIBRI_POOL_MAX_THREADS

# A row tile of a weight matrix is about this many bytes: it stays in L1/L2 while every
# token block of the call passes over it, so the weights stream from memory once.
cdef enum:
    TILE_BYTES = 32768

FORMATS = {"f32": COLIBRI_F32, "f16": COLIBRI_F16, "bf16": COLIBRI_BF16,
           "q8": COLIBRI_Q8, "q4": COLIBRI_Q4}
ISA_NAMES = ("scalar", "avx2", "avx512")
RULES = {"softmax_topk": 0, "topk_softmax": 1}
ACTIVATIONS = ("f32", "int8", "int16")   # _activations: codes 0, 1, 2

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
    int block                  # tokens per pass of the row kernel (colibri_block_tokens)
    colibri_dot_fn dot         # row kernel of the current ISA
    colibri_gemm_fn gemm       # GEMM panel kernel of the current ISA (prefill path)
    float *gemm_scratch        # COLIBRI_GEMM_SCRATCH floats per thread; NULL: no GEMM path
    bint iact                  # quantized activations (int8 / int16) and a q8/q4 format:
                               # idot, not dot
    bint wide                  # ... with int16 codes (activations="int16")
    colibri_idot_fn idot       # that row kernel of the current ISA (iact only)


ctypedef struct Act:
    # token rows quantized to int8 or int16 for the idot row kernels, in the packed layout of
    # colibri_quantize_row (_simd.h): blocks paired, d and s permuted per chunk of 8
    int8_t *q                  # (n, colibri_act_row_bytes) code bytes, row stride qs bytes
    float *d                   # (n, dpad) block scales, row stride ds; dpad = C/32 rounded up
    int32_t *s                 # (n, dpad) 8 * block sums of q       to 8, zero-padded
    Py_ssize_t qs, ds          # row strides; 0: every token reads row 0
    int isa                    # the path that quantizes (the same bits on every path)
    int wide                   # int16 codes (else int8)


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
    offset, rows, cols, group = w.offset, w.rows, w.cols, w.group_size
    row_stride, n_experts, expert_stride = w.row_stride, w.n_experts, w.expert_stride
    if not (type(offset) is int and type(rows) is int and type(cols) is int
            and type(group) is int and type(row_stride) is int and type(n_experts) is int
            and type(expert_stride) is int):            # slow path: numpy ints, or errors
        offset, rows, cols, group, row_stride, n_experts, expert_stride = [
            _int_field(w, f, name) for f in ("offset", "rows", "cols", "group_size",
                                             "row_stride", "n_experts", "expert_stride")]
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


cdef object _load(object w, str name, Wmat *m, int act=0):
    """Check w and fill m for the current ISA; return the typed view of the buffer, which
    the caller keeps alive while the kernel runs. act: the activations code (_activations:
    1 int8, 2 int16), which q8/q4 weights honour (m.iact); plain formats keep the f32 path."""
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
    m.block = colibri_block_tokens(m.fmt)
    m.dot = colibri_dot_for(_isa, m.fmt)
    m.gemm = colibri_gemm_for(_isa, m.fmt)
    m.gemm_scratch = NULL
    if m.dot == NULL or m.gemm == NULL:
        raise RuntimeError(f"{name}: no row kernel for format {dtype} on ISA {_isa}")
    m.iact = act != 0 and (m.fmt == COLIBRI_Q8 or m.fmt == COLIBRI_Q4)
    m.wide = m.iact and act == 2
    m.idot = NULL
    if m.iact:
        m.idot = colibri_idot_for(_isa, m.fmt, m.wide)
        if m.idot == NULL:
            raise RuntimeError(f"{name}: no {ACTIVATIONS[act]} row kernel for format {dtype} "
                               f"on ISA {_isa}")
        # int16: 3 tokens per pass (q4 1024 x 1024 in cache, 12 tokens, 1 thread: 4 per pass
        # 35.6 GMAC/s, 3 37.3, 2 34.0; its four code vectors per pair leave fewer registers)
        m.block = 3 if m.wide else COLIBRI_INT8_NT
        m.xsum_cols = 0                      # the idot kernels fold the q4 offset themselves
    return view


def _activations(activations):
    """0 for "f32", 1 for "int8", 2 for "int16"; ValueError naming the allowed values
    otherwise (for any object: the one check of the argument, kernels.py passes it through)."""
    if not isinstance(activations, str) or activations not in ACTIVATIONS:
        raise ValueError(f"activations must be one of {', '.join(map(repr, ACTIVATIONS))}, "
                         f"found {activations!r}")
    return ACTIVATIONS.index(activations)


cdef inline Py_ssize_t _dpad(Py_ssize_t C) noexcept nogil:
    """Entries per token row of Act.d / .s: C/32 rounded up to 8 (the SIMD bodies load the
    scales of 8 blocks at a time)."""
    return (C // 32 + 7) // 8 * 8


cdef inline Act _act_at(const Act *a, Py_ssize_t p) noexcept nogil:
    """a from token row p on."""
    cdef Act r = a[0]
    r.q = a.q + p * a.qs
    r.d = a.d + p * a.ds
    r.s = a.s + p * a.ds
    return r


cdef char *_carve_act(char **cur, Act *a, Py_ssize_t n, Py_ssize_t C, bint wide) noexcept nogil:
    """Carve an Act of n rows of C columns, int16 codes when wide, from *cur
    (_act_bytes(n, C, wide))."""
    cdef Py_ssize_t dp = _dpad(C)
    a.qs = colibri_act_row_bytes(wide, C)
    a.ds = dp
    a.isa = _isa
    a.wide = wide
    a.q = <int8_t *>_carve(cur, n * a.qs)
    a.d = <float *>_carve(cur, 4 * n * dp)
    a.s = <int32_t *>_carve(cur, 4 * n * dp)
    return cur[0]


cdef inline Py_ssize_t _act_bytes(Py_ssize_t n, Py_ssize_t C, bint wide) noexcept nogil:
    return n * (colibri_act_row_bytes(wide, C) + 8 * _dpad(C)) + 3 * 64


cdef void _quantize_serial(const float *x, Py_ssize_t n, Py_ssize_t C, const Act *a) noexcept nogil:
    """Quantize the n rows of x (n, C) into a (rows 0..n-1), serially."""
    cdef Py_ssize_t i
    for i in range(n):
        colibri_quantize_row(a.isa, a.wide, x + i * C, C, a.q + i * a.qs, a.d + i * a.ds,
                             a.s + i * a.ds, a.ds)


def quantize_activations(const float[:, ::1] x, int bits=8):
    """q int8 or int16 (T, C), d float32 (T, C/32): x float32 (T, C) in blocks of 32 with
    one scale each (bits 8: llama.cpp's Q8_0; 16: the same rule with 32767; _simd.h)."""
    cdef Py_ssize_t T = x.shape[0], C = x.shape[1], i, nb = C // 32
    if bits not in (8, 16):
        raise ValueError(f"quantize_activations: bits must be 8 or 16, found {bits}")
    if C % 32:
        raise ValueError(f"quantize_activations: x has {C} columns, not a multiple of 32 "
                         f"(the block size)")
    q = np.zeros((T, C), dtype=np.int8 if bits == 8 else np.int16)
    d = np.zeros((T, nb), dtype=np.float32)
    if T == 0 or C == 0:
        return q, d
    cdef uint8_t[:, ::1] qv = q.view(np.uint8)
    cdef float[:, ::1] dv = d
    cdef int wide = bits == 16
    with nogil:
        for i in range(T):
            colibri_quantize_plain(_isa, wide, &x[i, 0], C, &qv[i, 0], &dv[i, 0])
    return q, d


cdef inline Py_ssize_t _tile_rows(Py_ssize_t R, Py_ssize_t row_bytes, int threads,
                                  Py_ssize_t align, bint one_pass) noexcept nogil:
    """Rows per tile: about TILE_BYTES of weights, at least 4 tiles per thread when R allows,
    a multiple of `align` (the tile boundaries never change a result: each output is one
    row-kernel call). one_pass (every token of the call in one row-kernel pass, so no tile
    is read twice): just 4 tiles per thread. Each tile a thread takes starts a new stream
    the prefetches have not reached: long tiles keep each thread's reads contiguous
    (measured, 2 threads, int8 q4 one token: 600 MB matrix 22 -> 27.5 GB/s with 128 KiB
    tiles instead of 32 KiB; docs/performance.md change 15)."""
    cdef Py_ssize_t tr = TILE_BYTES // row_bytes
    cdef Py_ssize_t per = (R + 4 * threads - 1) // (4 * threads)
    if tr > per or one_pass:
        tr = per
    tr = (tr + align - 1) // align * align
    if tr < align:
        tr = align
    return tr


# ---------------------------------------------------------------------------------------------
# threads: how many a piece of work is worth

# A pool job costs a few microseconds (publish it, wake a sleeping worker, wait for the items
# workers took): below about this many bytes of weight streamed (times tokens) per thread,
# an extra thread loses more than it saves. Measured: docs/performance.md.
cdef Py_ssize_t _min_bytes = 1 << 18


def set_min_parallel_bytes(Py_ssize_t nbytes):
    """Work (weight bytes x tokens) below which a kernel adds no thread; >= 1."""
    global _min_bytes
    if nbytes < 1:
        raise ValueError(f"min_parallel_bytes must be >= 1, found {nbytes}")
    _min_bytes = nbytes


def get_min_parallel_bytes():
    return _min_bytes


MAX_THREADS = COLIBRI_POOL_MAX_THREADS     # the thread pool's limit


def set_spin_us(int us):
    """How long (microseconds) an idle pool worker spins before it sleeps; >= 0."""
    global colibri_pool_spin_us
    if us < 0:
        raise ValueError(f"spin_us must be >= 0, found {us}")
    colibri_pool_spin_us = us


def get_spin_us():
    return colibri_pool_spin_us


def pool_backoffs():
    """Times a spinning worker found itself preempted (the cores shared with other busy
    processes) and stopped spinning for a while."""
    return colibri_pool_backoffs


def pool_worker_items():
    """Work items run by the pool's worker threads (not by the calling thread) so far."""
    return colibri_pool_worker_items


def threaded():
    """True when the build has the thread pool (POSIX threads), False when kernels run on the
    calling thread only."""
    return bool(colibri_pool_threaded())


cdef inline int _team(double work, int threads) noexcept nogil:
    """Threads for `work` bytes: one per _min_bytes, between 1 and `threads`."""
    cdef double n = work / _min_bytes
    if n >= threads:
        return threads
    if n < 2.0:
        return 1
    return <int>n


# ---------------------------------------------------------------------------------------------
# GEMM path: from how many tokens per matrix the prefill path replaces the row kernel

# Measured on AVX2 (EPYC, 1 thread, 1024 x 1024 in L2): from 4 tokens on the GEMM path is
# faster than the row kernel for every format (q4 22.6 vs 17.0 GMAC/s at 4 tokens, 36 vs 19 at
# 32; callgrind 0.46 vs 0.60 instructions per multiply-add at 4, 0.55 vs 0.54 at 3).
cdef Py_ssize_t _gemm_min = 4


def set_gemm_min_tokens(Py_ssize_t n):
    """Tokens per matrix (linear: T; expert FFN: an expert's tokens) from which the kernels
    use the GEMM path; a huge value turns it off. >= 1."""
    global _gemm_min
    if n < 1:
        raise ValueError(f"gemm_min_tokens must be >= 1, found {n}")
    _gemm_min = n


def get_gemm_min_tokens():
    return _gemm_min


# GEMM tiles (linear, w_down): GEMM_TILE_PANELS panels of rows, whatever the format: each
# token pass reads its x once per panel, and x is what the GEMM path streams (the weights are
# read once per pass). Passed to _tile_rows as the bytes of a row.
cdef enum:
    GEMM_TILE_PANELS = 4
cdef Py_ssize_t _GEMM_TILE_ROW_BYTES = TILE_BYTES // (GEMM_TILE_PANELS * COLIBRI_GEMM_NR)


cdef inline Py_ssize_t _gemm_bytes(Py_ssize_t n, int nth) noexcept nogil:
    """Bytes of GEMM scratch for a call whose largest matrix has n tokens, nth threads."""
    return 4 * COLIBRI_GEMM_SCRATCH * nth if n >= _gemm_min else 0


# ---------------------------------------------------------------------------------------------
# scratch: one reusable buffer

# Kept between calls up to this size (a long prefill's scratch is given back to the OS).
cdef Py_ssize_t _ARENA_KEEP = 64 << 20
cdef object _arena = None
cdef bint _arena_busy = False


cdef object _take(Py_ssize_t nbytes):
    """A uint8 array of at least nbytes + 64 (room to align to 64): the shared buffer when it
    is free and not too large, a fresh one otherwise. Give it back with _give."""
    global _arena, _arena_busy
    if _arena_busy or nbytes > _ARENA_KEEP:
        return np.empty(nbytes + 64, dtype=np.uint8)
    if _arena is None or _arena.shape[0] < nbytes + 64:
        _arena = None
        _arena = np.empty(nbytes + 64, dtype=np.uint8)
    _arena_busy = True
    return _arena


cdef void _give(object buf):
    global _arena_busy
    if buf is _arena:
        _arena_busy = False


cdef inline char *_base(object buf):
    """The 64-byte aligned start of a _take buffer."""
    cdef uint8_t[::1] v = buf
    cdef size_t a = <size_t>&v[0]
    return <char *>((a + 63) & ~(<size_t>63))


cdef inline char *_carve(char **cur, Py_ssize_t nbytes) noexcept nogil:
    """nbytes from *cur, which moves on by nbytes rounded up to 64."""
    cdef char *r = cur[0]
    cur[0] = cur[0] + (nbytes + 63) // 64 * 64
    return r


def _check_threads(int threads):
    if not 1 <= threads <= COLIBRI_POOL_MAX_THREADS:
        raise ValueError(f"threads must be in 1..{COLIBRI_POOL_MAX_THREADS}, found {threads}")


def _check_f32_out(out, tuple shape, str name):
    if (not isinstance(out, np.ndarray) or out.dtype != np.float32 or out.shape != shape
            or not out.flags.c_contiguous or not out.flags.writeable):
        raise ValueError(f"{name} must be a writable C-contiguous float32 array of shape "
                         f"{shape}, found {getattr(out, 'dtype', type(out).__name__)} "
                         f"{getattr(out, 'shape', '')}")


# =============================================================================================
# linear: y (T, R) = x (T, C) @ W.T (+ bias)

cdef void _linear_rows(const Wmat *w, Py_ssize_t expert, const float *x, Py_ssize_t n,
                       const float *xsum, Act a, const float *bias, float *y,
                       Py_ssize_t y_stride, Py_ssize_t r0, Py_ssize_t r1) noexcept nogil:
    """Rows r0..r1 of W (expert `expert`) against the n tokens of x (n, C), xsum (n, C/G)
    (or, when w.iact, their quantized rows a): y[t, r] = W[r] . x[t] (+ bias[r]), y with
    row stride y_stride.
    Token blocks outside, rows inside: the tile of rows is reused by every block from cache."""
    if w.gemm_scratch != NULL and n >= _gemm_min and not w.iact:
        _linear_rows_gemm(w, expert, x, n, bias, y, y_stride, r0, r1)
        return
    cdef const uint8_t *base = w.base + expert * w.expert_stride
    cdef Py_ssize_t C = w.cols, ss = w.xsum_cols, t0, r, t
    cdef int nt
    t0 = 0
    while t0 < n:
        nt = <int>(n - t0) if n - t0 < w.block else w.block
        if w.iact:                                    # the whole tile in one call
            w.idot(base + r0 * w.row_stride, w.row_stride, r1 - r0, C, w.group,
                   a.q + t0 * a.qs, a.qs, a.d + t0 * a.ds, a.s + t0 * a.ds, a.ds, nt,
                   y + t0 * y_stride + r0, y_stride)
        else:
            w.dot(base + r0 * w.row_stride, w.row_stride, r1 - r0, C, w.group, x + t0 * C, C,
                  xsum + t0 * ss, ss, nt, y + t0 * y_stride + r0, y_stride)
        if bias != NULL:
            for r in range(r0, r1):
                for t in range(nt):
                    y[(t0 + t) * y_stride + r] += bias[r]
        t0 += nt


cdef void _linear_rows_gemm(const Wmat *w, Py_ssize_t expert, const float *x, Py_ssize_t n,
                            const float *bias, float *y, Py_ssize_t y_stride, Py_ssize_t r0,
                            Py_ssize_t r1) noexcept nogil:
    """_linear_rows on the GEMM path: passes of up to COLIBRI_GEMM_NB tokens (of near-equal
    size), each over the panels of COLIBRI_GEMM_NR rows (see _simd.h): a pass's x is read
    from cache by every panel of the tile; each panel is decoded once per pass."""
    cdef const uint8_t *base = w.base + expert * w.expert_stride
    cdef float *panel = w.gemm_scratch + colibri_worker_num() * COLIBRI_GEMM_SCRATCH
    cdef Py_ssize_t C = w.cols, rs = w.row_stride, p, t0, t1, s, ns, r, t
    cdef int nr
    ns = (n + COLIBRI_GEMM_NB - 1) // COLIBRI_GEMM_NB
    for s in range(ns):
        t0 = s * n // ns
        t1 = (s + 1) * n // ns
        p = r0
        while p < r1:
            nr = <int>(r1 - p) if r1 - p < COLIBRI_GEMM_NR else COLIBRI_GEMM_NR
            w.gemm(base + p * rs, rs, nr, C, w.group, x + t0 * C, C, t1 - t0,
                   y + t0 * y_stride + p, y_stride, panel)
            p += nr
    if bias != NULL:
        for t in range(n):
            for r in range(r0, r1):
                y[t * y_stride + r] += bias[r]


cdef void _group_sums_serial(const float *x, Py_ssize_t n, Py_ssize_t cols, Py_ssize_t group,
                             float *xsum) noexcept nogil:
    """xsum (n, C/G) = per-group sums of the n rows of x (n, C); C adds per row, serial."""
    cdef Py_ssize_t i
    for i in range(n):
        colibri_group_sums(x + i * cols, cols, group, xsum + i * (cols // group))


ctypedef struct LinearJob:
    # one linear call on the pool: work item i = rows i*tr .. (i+1)*tr of the matrix
    const Wmat *m
    Py_ssize_t expert, T, R, tr
    const float *x
    const float *xs
    Act a
    const float *bias
    float *y


cdef void _linear_task(void *ctx, Py_ssize_t i) noexcept nogil:
    cdef const LinearJob *j = <const LinearJob *>ctx
    cdef Py_ssize_t r1 = (i + 1) * j.tr
    if r1 > j.R:
        r1 = j.R
    _linear_rows(j.m, j.expert, j.x, j.T, j.xs, j.a, j.bias, j.y, j.R, i * j.tr, r1)


def linear(const float[:, ::1] x, w, bias, float[:, ::1] out, Py_ssize_t expert, int threads,
           activations="f32"):
    """out (T, R) = x (T, C) @ W[expert].T (+ bias (R,)); x float32, w a WeightRef."""
    _check_threads(threads)
    cdef int act = _activations(activations)
    cdef Wmat m
    keep = _load(w, "w", &m, act)
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
    cdef const char *x0 = <const char *>&x[0, 0]
    cdef const char *o0 = <const char *>&out[0, 0]
    if x0 < o0 + 4 * T * R and o0 < x0 + 4 * T * C:      # both C-contiguous: byte ranges
        raise ValueError("out must not overlap x (linear reads every row of x while writing)")
    _linear_run(&x[0, 0], T, &m, bp, &out[0, 0], expert, threads)


cdef _linear_run(const float *x, Py_ssize_t T, const Wmat *w, const float *bp, float *out,
                 Py_ssize_t expert, int threads):
    """linear's work once its arguments are checked: x (T, C) and out (T, R) C-contiguous,
    T >= 1, not overlapping; w is copied (the call sets the copy's GEMM scratch)."""
    cdef Wmat m = w[0]
    cdef Py_ssize_t R = m.rows, C = m.cols
    cdef int nth = _team(<double>R * m.row_stride * T, threads)
    cdef Py_ssize_t gbytes = 0 if m.iact else _gemm_bytes(T, nth)     # idot: row kernel
    cdef Py_ssize_t tr = _tile_rows(R, _GEMM_TILE_ROW_BYTES if gbytes else m.row_stride, nth,
                                    COLIBRI_GEMM_NR if gbytes else 1,
                                    not gbytes and T <= COLIBRI_MAX_NT)
    cdef Py_ssize_t n_tiles = (R + tr - 1) // tr
    cdef LinearJob job
    cdef float *xs = NULL
    cdef Act a
    cdef char *cur
    a.q, a.d, a.s, a.qs, a.ds, a.isa, a.wide = NULL, NULL, NULL, 0, 0, 0, 0
    scratch = None
    cdef Py_ssize_t xbytes = 0 if gbytes else T * m.xsum_cols * 4     # GEMM: no sums
    if m.iact:
        scratch = _take(_act_bytes(T, C, m.wide))
        cur = _base(scratch)
        _carve_act(&cur, &a, T, C, m.wide)
    elif xbytes > 0 or gbytes > 0:
        scratch = _take(xbytes + 64 + gbytes)
        cur = _base(scratch)
        xs = <float *>_carve(&cur, xbytes)
        if gbytes > 0:
            m.gemm_scratch = <float *>_carve(&cur, gbytes)
    try:
        with nogil:
            if m.iact:
                _quantize_serial(x, T, C, &a)
            elif xbytes > 0:
                _group_sums_serial(x, T, C, m.group, xs)
            # (one thread: the pool runs the tiles in order on this thread)
            job.m, job.expert, job.x, job.T, job.xs, job.a = &m, expert, x, T, xs, a
            job.bias, job.y, job.R, job.tr = bp, out, R, tr
            colibri_pool_run(nth, _linear_task, &job, n_tiles)
    finally:
        if scratch is not None:
            _give(scratch)


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


ctypedef struct RouteJob:
    # route_topk on the pool: work item t = token t
    const float *logits
    Py_ssize_t E, k
    int rule
    bint norm, noisy
    uint64_t seed
    float *p
    float *key
    int32_t *ids
    float *w


cdef void _route_task(void *ctx, Py_ssize_t t) noexcept nogil:
    cdef const RouteJob *j = <const RouteJob *>ctx
    _route_token(j.logits + t * j.E, j.E, j.k, j.rule, j.norm, j.noisy, j.seed, t,
                 j.p + t * j.E, j.key + t * j.E, j.ids + t * j.k, j.w + t * j.k)


def route_topk(const float[:, ::1] logits, Py_ssize_t k, str rule, bint norm_topk_prob,
               noise_seed, int threads):
    """ids int32 (T, K), weights float32 (T, K) from logits float32 (T, E)."""
    _check_threads(threads)
    cdef Py_ssize_t T = logits.shape[0], E = logits.shape[1]
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
    cdef float *scratch = <float *>malloc(2 * T * E * sizeof(float))
    if scratch == NULL:
        raise MemoryError(f"route_topk: no memory for {T} x {E} scratch")
    cdef float *p = scratch
    cdef float *key = scratch + T * E
    cdef int nth = _team(<double>T * E * 64, threads)      # ~64 B of work per logit
    cdef RouteJob job
    try:
        with nogil:
            job.logits, job.E, job.k = &logits[0, 0], E, k
            job.rule, job.norm = rcode, norm_topk_prob
            job.noisy, job.seed, job.p, job.key = noisy, seed, p, key
            job.ids, job.w = &iv[0, 0], &wv[0, 0]
            colibri_pool_run(nth, _route_task, &job, T)
    finally:
        free(scratch)
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

cdef enum:
    GATEUP_ROWS = 64            # idot gate/up rows per kernel call (then the SiLU product)

cdef void _gateup_rows(const Wmat *g, const Wmat *u, Py_ssize_t e, const float *x,
                       Py_ssize_t xs, Py_ssize_t n, const float *xsg, Py_ssize_t ssg,
                       const float *xsu, Py_ssize_t ssu, Act a, float *h, Py_ssize_t r0,
                       Py_ssize_t r1) noexcept nogil:
    """h[t, r] = silu(W_gate[e][r] . x[t]) * (W_up[e][r] . x[t]) for r in r0..r1, t < n;
    x (n, D) with row stride xs (0: every token is the same row), xsg / xsu the group sums
    of x for gate / up with row strides ssg / ssu, a the quantized x (for a matrix with
    .iact), h (n, I). Gate and up rows are read in the same pass over a token block."""
    if g.gemm_scratch != NULL and n >= _gemm_min and not g.iact and not u.iact:
        _gateup_rows_gemm(g, u, e, x, xs, n, h, r0, r1)
        return
    cdef const uint8_t *bg = g.base + e * g.expert_stride
    cdef const uint8_t *bu = u.base + e * u.expert_stride
    cdef Py_ssize_t D = g.cols, I = g.rows, t0, r, t, rb, re
    cdef float ub[GATEUP_ROWS * COLIBRI_MAX_NT]
    cdef float *ht
    cdef int nt, block = g.block if g.block < u.block else u.block
    t0 = 0
    while t0 < n:
        nt = <int>(n - t0) if n - t0 < block else block
        # blocks of GATEUP_ROWS rows: gate into h, up into ub, then the SiLU product
        rb = r0
        while rb < r1:
            re = rb + GATEUP_ROWS if rb + GATEUP_ROWS < r1 else r1
            if g.iact and u.iact:
                # both on the idot path: the block's gate rows in one call, then its up rows
                # (the f32 bodies measured slower so: their rows stay interleaved, below)
                g.idot(bg + rb * g.row_stride, g.row_stride, re - rb, D, g.group,
                       a.q + t0 * a.qs, a.qs, a.d + t0 * a.ds, a.s + t0 * a.ds, a.ds, nt,
                       h + t0 * I + rb, I)
                u.idot(bu + rb * u.row_stride, u.row_stride, re - rb, D, u.group,
                       a.q + t0 * a.qs, a.qs, a.d + t0 * a.ds, a.s + t0 * a.ds, a.ds, nt,
                       ub, GATEUP_ROWS)
            else:
                for r in range(rb, re):
                    if g.iact:
                        g.idot(bg + r * g.row_stride, g.row_stride, 1, D, g.group,
                               a.q + t0 * a.qs, a.qs, a.d + t0 * a.ds, a.s + t0 * a.ds, a.ds,
                               nt, h + t0 * I + r, I)
                    else:
                        g.dot(bg + r * g.row_stride, g.row_stride, 1, D, g.group, x + t0 * xs,
                              xs, xsg + t0 * ssg, ssg, nt, h + t0 * I + r, I)
                    if u.iact:
                        u.idot(bu + r * u.row_stride, u.row_stride, 1, D, u.group,
                               a.q + t0 * a.qs, a.qs, a.d + t0 * a.ds, a.s + t0 * a.ds, a.ds,
                               nt, ub + (r - rb), GATEUP_ROWS)
                    else:
                        u.dot(bu + r * u.row_stride, u.row_stride, 1, D, u.group, x + t0 * xs,
                              xs, xsu + t0 * ssu, ssu, nt, ub + (r - rb), GATEUP_ROWS)
            for t in range(nt):
                colibri_silu_mul(_isa, h + (t0 + t) * I + rb, ub + t * GATEUP_ROWS, re - rb)
            rb = re
        t0 += nt


cdef void _gateup_rows_gemm(const Wmat *g, const Wmat *u, Py_ssize_t e, const float *x,
                            Py_ssize_t xs, Py_ssize_t n, float *h, Py_ssize_t r0,
                            Py_ssize_t r1) noexcept nogil:
    """_gateup_rows on the GEMM path: per pass of up to COLIBRI_GEMM_NB tokens and panel of
    COLIBRI_GEMM_NR rows, gate into h, up into the thread's NB x NR tile, then
    h = silu(h) * up."""
    cdef const uint8_t *bg = g.base + e * g.expert_stride
    cdef const uint8_t *bu = u.base + e * u.expert_stride
    cdef float *panel = g.gemm_scratch + colibri_worker_num() * COLIBRI_GEMM_SCRATCH
    cdef float *up = panel + (COLIBRI_GEMM_SCRATCH - COLIBRI_GEMM_NB * COLIBRI_GEMM_NR)
    cdef Py_ssize_t D = g.cols, I = g.rows, p, t0, t1, s, ns, t, i
    cdef float *ht
    cdef int nr
    ns = (n + COLIBRI_GEMM_NB - 1) // COLIBRI_GEMM_NB
    for s in range(ns):
        t0 = s * n // ns
        t1 = (s + 1) * n // ns
        p = r0
        while p < r1:
            nr = <int>(r1 - p) if r1 - p < COLIBRI_GEMM_NR else COLIBRI_GEMM_NR
            g.gemm(bg + p * g.row_stride, g.row_stride, nr, D, g.group, x + t0 * xs, xs,
                   t1 - t0, h + t0 * I + p, I, panel)
            u.gemm(bu + p * u.row_stride, u.row_stride, nr, D, u.group, x + t0 * xs, xs,
                   t1 - t0, up, COLIBRI_GEMM_NR, panel)
            for t in range(t1 - t0):
                colibri_silu_mul(_isa, h + (t0 + t) * I + p, up + t * COLIBRI_GEMM_NR, nr)
            p += nr


cdef int _load_ffn(w_gate, w_up, w_down, Wmat *g, Wmat *u, Wmat *d, list keep,
                   int act) except -1:
    keep.append(_load(w_gate, "w_gate", g, act))
    keep.append(_load(w_up, "w_up", u, act))
    keep.append(_load(w_down, "w_down", d, act))
    if (u.rows != g.rows or u.cols != g.cols or d.rows != g.cols or d.cols != g.rows
            or u.n_experts != g.n_experts or d.n_experts != g.n_experts):
        raise ValueError(
            f"FFN weights disagree: w_gate ({g.n_experts} x {g.rows} x {g.cols}), w_up "
            f"({u.n_experts} x {u.rows} x {u.cols}), w_down ({d.n_experts} x {d.rows} x "
            f"{d.cols}); expected (E, I, D), (E, I, D), (E, D, I)")
    return 0


ctypedef struct Ffn:
    # everything the work items of one expert_ffn call share; positions p index the
    # (token, k) slots grouped by expert: expert e owns positions offsets[e]..offsets[e+1]
    Wmat g, u, d
    Py_ssize_t T, K, D, I
    const float *x              # (T, D) the input
    float *xg                   # (TK, D) gathered input rows, or x itself when T == 1
    Py_ssize_t xg_stride        # D, or 0 when T == 1 (every position reads x[0])
    float *xsg                  # group sums of the gathered rows for w_gate (q4), (TK, D/Gg)
    float *xsu                  # ... for w_up
    Py_ssize_t ssg, ssu         # their row strides (0 when T == 1)
    float *h                    # (TK, I) activations
    float *xsd                  # (TK, I/Gd) group sums of h for w_down (q4)
    float *og                   # (TK, D) expert outputs
    bint qx                     # gate or up runs the idot path: quantize the gathered rows
    Act ax                      # (rows_x, D) quantized input (row stride 0 when T == 1)
    Act ah                      # (TK, I) quantized h, when w_down runs the idot path
    const int64_t *offsets      # (E+1,)
    const int32_t *slots        # (TK,) position -> slot t*K + k
    const int64_t *pos          # (TK,) slot -> position
    const int32_t *active       # (n_active,) experts with tokens, ascending
    Py_ssize_t n_active
    Py_ssize_t tr_gu, nt_gu     # gate/up work item: rows tr_gu of one active expert
    Py_ssize_t tr_dn            # down work item: rows tr_dn of every active expert
    const float *weights        # (T, K)
    float *y                    # (T, D)


cdef void _ffn_gather(const Ffn *f, Py_ssize_t p) noexcept nogil:
    """Position p: copy its token's x row, and the group sums of it for gate / up (q4)."""
    cdef const float *src = f.x + (f.slots[p] // f.K) * f.D
    cdef float *dst = f.xg + p * f.D
    cdef Py_ssize_t c
    for c in range(f.D):
        dst[c] = src[c]
    if f.g.xsum_cols > 0:
        colibri_group_sums(dst, f.D, f.g.group, f.xsg + p * f.ssg)
    if f.u.xsum_cols > 0:
        colibri_group_sums(dst, f.D, f.u.group, f.xsu + p * f.ssu)
    if f.qx:
        colibri_quantize_row(f.ax.isa, f.ax.wide, dst, f.D, f.ax.q + p * f.ax.qs, f.ax.d + p * f.ax.ds,
                             f.ax.s + p * f.ax.ds, f.ax.ds)


cdef void _ffn_gateup(const Ffn *f, Py_ssize_t it) noexcept nogil:
    """Work item it: rows r0..r1 of gate and up of one active expert (_ffn_gateup_rows)."""
    cdef Py_ssize_t r0 = (it % f.nt_gu) * f.tr_gu, r1 = r0 + f.tr_gu
    if r1 > f.I:
        r1 = f.I
    _ffn_gateup_rows(f, f.active[it // f.nt_gu], r0, r1)


cdef void _ffn_gateup_rows(const Ffn *f, Py_ssize_t e, Py_ssize_t r0, Py_ssize_t r1) noexcept nogil:
    """Rows r0..r1 of gate and up of expert e, for all its tokens; then the group sums (q4)
    or the quantized blocks (idot path) of the new h columns for w_down (r0, r1: whole groups /
    blocks of 32)."""
    cdef Py_ssize_t p0 = f.offsets[e], n_e = f.offsets[e + 1] - f.offsets[e], p
    cdef Py_ssize_t Gd = f.d.group, sd = f.d.xsum_cols
    _gateup_rows(&f.g, &f.u, e, f.xg + p0 * f.xg_stride, f.xg_stride, n_e,
                 f.xsg + p0 * f.ssg, f.ssg, f.xsu + p0 * f.ssu, f.ssu, _act_at(&f.ax, p0),
                 f.h + p0 * f.I, r0, r1)
    if sd > 0:
        for p in range(p0, p0 + n_e):
            colibri_group_sums(f.h + p * f.I + r0, r1 - r0, Gd, f.xsd + p * sd + r0 // Gd)
    if f.d.iact:
        for p in range(p0, p0 + n_e):
            colibri_quantize_act(f.ah.isa, f.ah.wide, f.h + p * f.I, r0 // 32, r1 // 32,
                                 f.ah.q + p * f.ah.qs, f.ah.d + p * f.ah.ds, f.ah.s + p * f.ah.ds)


cdef void _ffn_down(const Ffn *f, Py_ssize_t it) noexcept nogil:
    """Work item it: rows r0..r1 of w_down of every active expert, for their tokens; then
    y[t, r0:r1] = sum_k weights[t, k] * og[pos[t*K + k], r0:r1], in k order."""
    cdef Py_ssize_t r0 = it * f.tr_dn, r1 = r0 + f.tr_dn, j
    if r1 > f.D:
        r1 = f.D
    for j in range(f.n_active):
        _ffn_down_rows(f, f.active[j], r0, r1)
    _ffn_combine(f, r0, r1)


cdef inline void _ffn_down_rows(const Ffn *f, Py_ssize_t e, Py_ssize_t r0, Py_ssize_t r1) noexcept nogil:
    """Rows r0..r1 of w_down of expert e, for its tokens, into their og rows."""
    cdef Py_ssize_t p0 = f.offsets[e]
    _linear_rows(&f.d, e, f.h + p0 * f.I, f.offsets[e + 1] - p0, f.xsd + p0 * f.d.xsum_cols,
                 _act_at(&f.ah, p0), NULL, f.og + p0 * f.D, f.D, r0, r1)


cdef void _ffn_combine(const Ffn *f, Py_ssize_t r0, Py_ssize_t r1) noexcept nogil:
    """y[t, r0:r1] = sum_k weights[t, k] * og[pos[t*K + k], r0:r1], in k order."""
    cdef Py_ssize_t t, k, c
    cdef float wk
    cdef float *yt
    cdef const float *ot
    for t in range(f.T):
        yt = f.y + t * f.D
        for c in range(r0, r1):
            yt[c] = 0.0
        for k in range(f.K):
            wk = f.weights[t * f.K + k]
            ot = f.og + f.pos[t * f.K + k] * f.D
            for c in range(r0, r1):
                yt[c] = yt[c] + wk * ot[c]


cdef void _ffn_expert(const Ffn *f, Py_ssize_t it) noexcept nogil:
    """Work item it of the whole-expert schedule: all of active expert it (gate and up, then
    w_down into its og rows). The same row-kernel calls as the gate/up and down items, so the
    same bits."""
    cdef Py_ssize_t e = f.active[it]
    _ffn_gateup_rows(f, e, 0, f.I)
    _ffn_down_rows(f, e, 0, f.D)


cdef void _ffn_expert_task(void *f, Py_ssize_t it) noexcept nogil:
    _ffn_expert(<const Ffn *>f, it)


cdef void _ffn_gather_task(void *f, Py_ssize_t it) noexcept nogil:
    _ffn_gather(<const Ffn *>f, it)


cdef void _ffn_gateup_task(void *f, Py_ssize_t it) noexcept nogil:
    _ffn_gateup(<const Ffn *>f, it)


cdef void _ffn_down_task(void *f, Py_ssize_t it) noexcept nogil:
    _ffn_down(<const Ffn *>f, it)


cdef void _ffn_run(Ffn *f, Py_ssize_t n_gather, Py_ssize_t n_gu, Py_ssize_t n_dn,
                   int nth) noexcept nogil:
    """The three stages, one pool job each (a job returns when all its items are done)."""
    colibri_pool_run(nth, _ffn_gather_task, f, n_gather)
    colibri_pool_run(nth, _ffn_gateup_task, f, n_gu)
    colibri_pool_run(nth, _ffn_down_task, f, n_dn)


cdef void _ffn_run_experts(Ffn *f, int nth) noexcept nogil:
    """Decode schedule: one job of whole experts (f.n_active items, a multiple of nth, so the
    threads get equal shares), then the combine on this thread. One stage boundary instead
    of two, and no thread waits at the gate/up -> down boundary for the slowest tile."""
    colibri_pool_run(nth, _ffn_expert_task, f, f.n_active)
    _ffn_combine(f, 0, f.D)


cdef _ffn(const float[:, ::1] x, const int32_t[:, ::1] ids, const float[:, ::1] weights,
          Wmat *g, Wmat *u, Wmat *d, float[:, ::1] out, int threads):
    """out (T, D) = sum_k weights[t, k] * FFN_{ids[t, k]}(x[t]) (checked arguments)."""
    cdef Ffn f
    cdef Py_ssize_t T = x.shape[0], D = x.shape[1], K = ids.shape[1], E = g.n_experts
    cdef Py_ssize_t I = g.rows, TK = T * K, p, e, n_active = 0, e_tokens
    cdef double work = 0.0
    cdef Py_ssize_t max_tokens = 0               # of any expert
    cdef bint one = T == 1, one_pass
    cdef Py_ssize_t bytes_gu = I * (g.row_stride + u.row_stride), bytes_dn = D * d.row_stride
    # the team size _ffn_run will use (work = weight bytes x positions, summed over experts)
    cdef int nth_gemm = _team(<double>(bytes_gu + bytes_dn) * TK, threads)
    # the GEMM path serves the matrices on f32 activations (int8 / int16 ones keep the row kernel,
    # fewer instructions per weight)
    cdef bint gemm_gu = not (g.iact or u.iact), gemm_dn = not d.iact
    cdef Py_ssize_t gbytes = _gemm_bytes(TK, nth_gemm) if gemm_gu or gemm_dn else 0
    f.g, f.u, f.d = g[0], u[0], d[0]
    f.T, f.K, f.D, f.I = T, K, D, I
    cdef Py_ssize_t sg = g.xsum_cols, su = u.xsum_cols, sd = d.xsum_cols
    cdef Py_ssize_t rows_x = 1 if one else TK
    cdef bint qx = g.iact or u.iact
    cdef Py_ssize_t nbytes = (8 * (E + 1) + 8 * E + 4 * TK + 8 * TK + 4 * E
                              + 4 * rows_x * (0 if one else D) + 4 * rows_x * (sg + su)
                              + 4 * TK * (I + sd + D) + 9 * 64 + gbytes
                              + (_act_bytes(rows_x, D, g.wide or u.wide) if qx else 0)
                              + (_act_bytes(TK, I, d.wide) if d.iact else 0))
    buf = _take(nbytes)
    cdef char *cur = _base(buf)
    cdef int64_t *offsets = <int64_t *>_carve(&cur, 8 * (E + 1))
    cdef int64_t *cursor = <int64_t *>_carve(&cur, 8 * E)
    cdef int32_t *slots = <int32_t *>_carve(&cur, 4 * TK)
    cdef int64_t *pos = <int64_t *>_carve(&cur, 8 * TK)
    cdef int32_t *active = <int32_t *>_carve(&cur, 4 * E)
    cdef float *xg = <float *>_carve(&cur, 0 if one else 4 * TK * D)
    f.xsg = <float *>_carve(&cur, 4 * rows_x * sg)
    f.xsu = <float *>_carve(&cur, 4 * rows_x * su)
    f.h = <float *>_carve(&cur, 4 * TK * I)
    f.xsd = <float *>_carve(&cur, 4 * TK * sd)
    f.og = <float *>_carve(&cur, 4 * TK * D)
    if gbytes > 0:                               # one scratch, shared by the three matrices
        f.g.gemm_scratch = <float *>_carve(&cur, gbytes)
        f.u.gemm_scratch = f.g.gemm_scratch
        f.d.gemm_scratch = f.g.gemm_scratch
    f.qx = qx
    f.ax.q, f.ax.d, f.ax.s, f.ax.qs, f.ax.ds, f.ax.isa, f.ax.wide = NULL, NULL, NULL, 0, 0, 0, 0
    f.ah = f.ax
    if qx:
        _carve_act(&cur, &f.ax, rows_x, D, g.wide or u.wide)
    if d.iact:
        _carve_act(&cur, &f.ah, TK, I, d.wide)
    f.x = &x[0, 0]
    f.weights = &weights[0, 0]
    f.y = &out[0, 0]
    cdef Py_ssize_t n_gather, n_gu, n_dn
    cdef int nth
    # GEMM path: tiles of whole panels, w_down's of GEMM_TILE_PANELS panels (the row-kernel
    # tiles of w_down, a few rows of every active expert, would stream each h once per row or
    # two; here once per tile)
    cdef Py_ssize_t align_gu = d.group if sd > 0 else (32 if d.iact else 1), align_dn = 1
    if gbytes > 0 and gemm_gu:
        align_gu = align_gu * COLIBRI_GEMM_NR // gcd(align_gu, COLIBRI_GEMM_NR)
    if gbytes > 0 and gemm_dn:
        align_dn = COLIBRI_GEMM_NR
    try:
        with nogil:
            _count_sort(&ids[0, 0], TK, E, offsets, slots, cursor)
            for p in range(TK):
                pos[slots[p]] = p
            for e in range(E):
                e_tokens = offsets[e + 1] - offsets[e]
                if e_tokens > 0:
                    if e_tokens > max_tokens:
                        max_tokens = e_tokens
                    active[n_active] = <int32_t>e
                    n_active += 1
                    work += <double>(bytes_gu + bytes_dn) * e_tokens
            nth = _team(work, threads)
            if gbytes > 0 and nth > nth_gemm:    # (equal: work == (bytes_gu + bytes_dn) TK)
                nth = nth_gemm
            f.offsets, f.slots, f.pos, f.active, f.n_active = offsets, slots, pos, active, n_active
            if one:                              # decode: every position reads x[0]
                f.xg, f.xg_stride, f.ssg, f.ssu = <float *>f.x, 0, 0, 0
                if sg > 0:
                    colibri_group_sums(f.x, D, g.group, f.xsg)
                if su > 0:
                    colibri_group_sums(f.x, D, u.group, f.xsu)
                if qx:
                    _quantize_serial(f.x, 1, D, &f.ax)
                    f.ax.qs, f.ax.ds = 0, 0
                n_gather = 0
            else:
                f.xg, f.xg_stride, f.ssg, f.ssu = xg, D, sg, su
                n_gather = TK
            if d.iact:                           # the padding of h's packed rows
                for p in range(TK):
                    colibri_quantize_pad(f.ah.wide, I, f.ah.q + p * f.ah.qs, f.ah.d + p * f.ah.ds,
                                         f.ah.s + p * f.ah.ds, f.ah.ds)
            # gate/up tiles are whole groups of w_down's input (q4: group sums) or whole
            # 32-blocks (idot path), so each item can sum / quantize the h columns it made
            one_pass = max_tokens <= COLIBRI_MAX_NT       # each expert's tokens in one pass
            f.tr_gu = _tile_rows(I, g.row_stride + u.row_stride, nth, align_gu, one_pass)
            f.nt_gu = (I + f.tr_gu - 1) // f.tr_gu
            # down tiles: sized by one expert's rows (each expert's token passes reuse its
            # part of the tile from cache); never below 16 rows, so that the combine reads
            # whole lines of og and y (it walks every token's K rows of the tile)
            f.tr_dn = _tile_rows(D, _GEMM_TILE_ROW_BYTES if gbytes and gemm_dn
                                 else d.row_stride,
                                 nth, align_dn, one_pass)
            if f.tr_dn < 16 and D >= 16 * 4 * nth:
                f.tr_dn = 16
            n_gu = n_active * f.nt_gu
            n_dn = (D + f.tr_dn - 1) // f.tr_dn
            if one and n_active % nth == 0:          # decode, experts shared out evenly
                _ffn_run_experts(&f, nth)
            else:
                _ffn_run(&f, n_gather, n_gu, n_dn, nth)
    finally:
        _give(buf)


def expert_ffn(const float[:, ::1] x, const int32_t[:, ::1] ids, const float[:, ::1] weights,
               w_gate, w_up, w_down, float[:, ::1] out, int threads, activations="f32"):
    """out (T, D) = sum_k weights[t, k] * FFN_{ids[t, k]}(x[t]); out may be x itself."""
    _check_threads(threads)
    cdef int act = _activations(activations)
    cdef Wmat g, u, d
    keep = []
    _load_ffn(w_gate, w_up, w_down, &g, &u, &d, keep, act)
    cdef Py_ssize_t T = x.shape[0], D = x.shape[1], K = ids.shape[1]
    cdef Py_ssize_t E = g.n_experts
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
    _ffn(x, ids, weights, &g, &u, &d, out, threads)


def swiglu(const float[:, ::1] x, w_gate, w_up, w_down, float[:, ::1] out, int threads,
           activations="f32"):
    """out (T, D) = W_down @ (silu(W_gate @ x) * (W_up @ x)) per token; one dense FFN (the
    expert FFN with every token on its single expert at weight 1, which is exact)."""
    _check_threads(threads)
    cdef int act = _activations(activations)
    cdef Wmat g, u, d
    keep = []
    _load_ffn(w_gate, w_up, w_down, &g, &u, &d, keep, act)
    if g.n_experts != 1:
        raise ValueError(f"swiglu takes single matrices, found n_experts {g.n_experts}")
    cdef Py_ssize_t T = x.shape[0], D = x.shape[1]
    if D != g.cols:
        raise ValueError(f"x has {D} columns, the FFN's hidden size is {g.cols}")
    if out.shape[0] != T or out.shape[1] != D:
        raise ValueError(f"out has shape ({out.shape[0]}, {out.shape[1]}), expected ({T}, {D})")
    if T == 0:
        return
    _ffn(x, np.zeros((T, 1), dtype=np.int32), np.ones((T, 1), dtype=np.float32), &g, &u, &d,
         out, threads)


# =============================================================================================
# dequant (a test and debugging helper: the kernels above never build a dequantized matrix)

ctypedef struct DequantJob:
    const Wmat *m
    const uint8_t *base
    float *out


cdef void _dequant_task(void *ctx, Py_ssize_t r) noexcept nogil:
    cdef const DequantJob *j = <const DequantJob *>ctx
    colibri_decode_row(j.m.fmt, j.base + r * j.m.row_stride, j.m.cols, j.m.group,
                       j.out + r * j.m.cols)


def dequantize(w, Py_ssize_t expert, int threads):
    """float32 (R, C): the matrix of expert `expert`, decoded with the scalar path."""
    _check_threads(threads)
    cdef Wmat m
    keep = _load(w, "w", &m)
    if not 0 <= expert < m.n_experts:
        raise ValueError(f"expert {expert} out of range for a weight of {m.n_experts} experts")
    out = np.empty((m.rows, m.cols), dtype=np.float32)
    cdef float[:, ::1] ov = out
    cdef DequantJob job
    job.m, job.base, job.out = &m, m.base + expert * m.expert_stride, &ov[0, 0]
    with nogil:
        colibri_pool_run(threads, _dequant_task, &job, m.rows)
    return out


# =============================================================================================
# decode attention: one token's query heads over a KV cache slice (_attend.h)

ctypedef struct AttendJob:
    # work item g = the G query heads of kv head g
    const float *q
    const float *k
    const float *v
    float *out
    float *s                    # G * n floats of score scratch per thread
    Py_ssize_t hs, rs, n
    int G, Dh, isa
    float scale


cdef _attend_run(const float *q, const float *k, const float *v, float *out, Py_ssize_t hs,
                 Py_ssize_t rs, Py_ssize_t n, Py_ssize_t H, Py_ssize_t Hkv, Py_ssize_t Dh,
                 float scale, int threads, str name):
    """The attention of H query heads q (H, Dh) over n keys / values of Hkv heads (head h
    at k + h * hs, position j at + j * rs; v the same) into out (H, Dh), on the pool, one
    work item per kv head (checked arguments)."""
    cdef int nth = _team(<double>8 * Hkv * n * Dh, threads)
    if nth > Hkv:
        nth = <int>Hkv
    cdef float *scratch = <float *>malloc(4 * nth * n * (H // Hkv))
    if scratch == NULL:
        raise MemoryError(f"{name}: no memory for {nth} x {n} scores")
    cdef AttendJob job
    job.q, job.k, job.v, job.out, job.s = q, k, v, out, scratch
    job.hs, job.rs, job.n = hs, rs, n
    job.G, job.Dh, job.isa, job.scale = <int>(H // Hkv), <int>Dh, _isa, scale
    try:
        with nogil:
            colibri_pool_run(nth, _attend_task, &job, Hkv)
    finally:
        free(scratch)


cdef void _attend_task(void *ctx, Py_ssize_t g) noexcept nogil:
    cdef const AttendJob *j = <const AttendJob *>ctx
    colibri_attend(j.isa, j.q, j.G, j.Dh, j.k, j.v, j.hs, j.rs, j.n, j.scale,
                   j.s + colibri_worker_num() * j.n * j.G, j.out, <int>(g * j.G),
                   <int>((g + 1) * j.G))


def attend_decode(const float[:, ::1] q, const float[:, :, :] k, const float[:, :, :] v,
                  float scale, float[:, ::1] out, int threads):
    """out (H, Dh) = softmax(scale * q k^T) v per head; q (H, Dh), k and v (Hkv, n, Dh)
    float32 (rows contiguous, heads and positions strided), H a multiple of Hkv."""
    _check_threads(threads)
    cdef Py_ssize_t H = q.shape[0], Dh = q.shape[1], Hkv = k.shape[0], n = k.shape[1]
    if k.shape[2] != Dh or v.shape[0] != Hkv or v.shape[1] != n or v.shape[2] != Dh:
        raise ValueError(f"attend_decode: k ({k.shape[0]}, {k.shape[1]}, {k.shape[2]}) and v "
                         f"({v.shape[0]}, {v.shape[1]}, {v.shape[2]}) must both be "
                         f"(Hkv, n, {Dh}) for q of shape ({H}, {Dh})")
    if Hkv < 1 or H % Hkv:
        raise ValueError(f"attend_decode: {H} query heads are not a multiple of {Hkv} kv heads")
    if n < 1:
        raise ValueError("attend_decode: no position to attend to (n = 0)")
    if out.shape[0] != H or out.shape[1] != Dh:
        raise ValueError(f"attend_decode: out has shape ({out.shape[0]}, {out.shape[1]}), "
                         f"expected ({H}, {Dh})")
    if (k.strides[1] != v.strides[1] or k.strides[0] != v.strides[0] or k.strides[2] != 4
            or v.strides[2] != 4 or k.strides[1] % 4 or k.strides[0] % 4):
        raise ValueError("attend_decode: k and v must have the same strides, rows contiguous")
    cdef const char *q0 = <const char *>&q[0, 0]
    cdef const char *o0 = <const char *>&out[0, 0]
    if q0 < o0 + 4 * H * Dh and o0 < q0 + 4 * H * Dh:
        raise ValueError("attend_decode: out must not overlap q")
    if Dh == 0:
        return
    _attend_run(&q[0, 0], &k[0, 0, 0], &v[0, 0, 0], &out[0, 0], k.strides[0] // 4,
                k.strides[1] // 4, n, H, Hkv, Dh, scale, threads, "attend_decode")


# =============================================================================================
# memory read bandwidth

ctypedef struct ReadJob:
    const uint8_t *p
    Py_ssize_t n, part
    int isa
    uint64_t sums[COLIBRI_POOL_MAX_THREADS]


cdef void _read_task(void *ctx, Py_ssize_t i) noexcept nogil:
    cdef ReadJob *j = <ReadJob *>ctx
    cdef Py_ssize_t lo = i * j.part, hi = lo + j.part
    if hi > j.n:
        hi = j.n
    j.sums[i] = colibri_read_sum(j.isa, j.p + lo, <size_t>(hi - lo))


def read_sum(const uint8_t[::1] buf, int threads):
    """Sum of buf as u64 words (wrapping), each thread streaming one contiguous part."""
    _check_threads(threads)
    cdef Py_ssize_t n = buf.shape[0], i
    cdef uint64_t total = 0
    cdef ReadJob job
    if n == 0:
        return 0
    cdef Py_ssize_t part = (n + threads - 1) // threads
    part = (part + 4095) // 4096 * 4096                # page-aligned parts
    cdef Py_ssize_t nparts = (n + part - 1) // part    # <= threads
    job.p, job.n, job.part, job.isa = &buf[0], n, part, _isa
    with nogil:
        colibri_pool_run(threads, _read_task, &job, nparts)
    for i in range(nparts):
        total += job.sums[i]
    return int(total)


# =============================================================================================
# row operations of a decode step (_rowops.h): RMSNorm of rows, RoPE of heads in place, and
# the prepared calls (weights checked once). Their arrays are checked through NumPy's C API
# (type, dtype, byte order, alignment, C order, writability, shapes): a decode step passes
# ~150 arrays, and a typed memoryview costs ~1 us of buffer-protocol code per array.

cdef extern from "_npy.h":
    int colibri_npy_import() except -1
    float *colibri_f32_array(object a, int ndim, int writable, Py_ssize_t *dims)
    void *colibri_array_data(object a)

colibri_npy_import()

cdef extern from "_rowops.h" nogil:
    void colibri_rms_norm_rows(const float *x, Py_ssize_t xs, Py_ssize_t rows, Py_ssize_t n,
                               const float *weight, float eps, float *out, Py_ssize_t os)
    void colibri_rope_rows(float *x, Py_ssize_t xs, Py_ssize_t rows, Py_ssize_t h,
                           const float *c, const float *s)


cdef str _found(a):
    return (f"{getattr(a, 'dtype', type(a).__name__)} with shape {getattr(a, 'shape', None)}"
            + (" (not C-contiguous)" if isinstance(a, np.ndarray) and not a.flags.c_contiguous
               else "") + (" (read-only)" if isinstance(a, np.ndarray)
                           and not a.flags.writeable else ""))


cdef float *_f32(object a, str name, int ndim, bint writable, Py_ssize_t *dims) except NULL:
    """The data of a, an aligned native-order C-contiguous float32 ndarray of ndim dimensions
    (writable if asked), its shape in dims; else ValueError naming what was expected and
    found. The caller holds a reference to a while it uses the pointer."""
    cdef float *p = colibri_f32_array(a, ndim, writable, dims)
    if p == NULL:
        raise ValueError(f"{name} must be a {'writable ' if writable else ''}C-contiguous "
                         f"float32 array of {ndim} dimension{'s' if ndim > 1 else ''}, found "
                         f"{_found(a)}")
    return p


cdef bint _overlap(const float *a, Py_ssize_t na, const float *b, Py_ssize_t nb) noexcept:
    return a < b + nb and b < a + na


def rms_norm_rows(x, weight, float eps, out):
    """out (N, C) = weight * (x * (1 / sqrt(mean(x^2) + eps))) per row of x (N, C) float32;
    weight (C,); out may be x itself. NumPy's operations and summation order (_rowops.h)."""
    cdef Py_ssize_t xd[2]
    cdef Py_ssize_t wd[1]
    cdef Py_ssize_t od[2]
    cdef const float *x0 = _f32(x, "x", 2, False, xd)
    cdef const float *w0 = _f32(weight, "weight", 1, False, wd)
    cdef float *o0 = _f32(out, "out", 2, True, od)
    cdef Py_ssize_t N = xd[0], C = xd[1]
    if wd[0] != C:
        raise ValueError(f"rms_norm_rows: weight has {wd[0]} elements, expected {C} "
                         f"(the columns of x, shape ({N}, {C}))")
    if od[0] != N or od[1] != C:
        raise ValueError(f"rms_norm_rows: out has shape ({od[0]}, {od[1]}), "
                         f"expected ({N}, {C})")
    if x0 != o0 and _overlap(x0, N * C, o0, N * C):
        raise ValueError("rms_norm_rows: out overlaps x without being x")
    if N == 0 or C == 0:
        return
    colibri_rms_norm_rows(x0, C, N, C, w0, eps, o0, C)     # a few rows: the GIL is kept


def rope_rows(x, cos, sin):
    """Rotate each row of x (N, Dh) float32 in place by the half-split rule on its first
    2h columns, h = len(cos) = len(sin) (<= Dh / 2): x[:h], x[h:2h] = x[:h] cos - x[h:2h] sin,
    x[h:2h] cos + x[:h] sin (NumPy's float32 operations, _rowops.h)."""
    cdef Py_ssize_t xd[2]
    cdef Py_ssize_t cd[1]
    cdef Py_ssize_t sd[1]
    cdef float *x0 = _f32(x, "x", 2, True, xd)
    cdef const float *c0 = _f32(cos, "cos", 1, False, cd)
    cdef const float *s0 = _f32(sin, "sin", 1, False, sd)
    cdef Py_ssize_t N = xd[0], Dh = xd[1], h = cd[0]
    if sd[0] != h or 2 * h > Dh:
        raise ValueError(f"rope_rows: cos ({h},) and sin ({sd[0]},) must have the same "
                         f"length h with 2h <= {Dh} (the columns of x, shape ({N}, {Dh}))")
    if _overlap(x0, N * Dh, c0, h) or _overlap(x0, N * Dh, s0, h):
        raise ValueError("rope_rows: cos / sin overlap x")
    if N == 0 or h == 0:
        return
    colibri_rope_rows(x0, Dh, N, h, c0, s0)     # a few rows: the GIL is kept


def attend_cached(q, k_cache, v_cache, k_new, v_new, Py_ssize_t slot, Py_ssize_t start,
                  float scale, out, int threads):
    """KVCache.write_one then attend_decode, in one call: k_new / v_new (Hkv, Dh) go to
    slot `slot` of sequence 0 of k_cache / v_cache (B, Hkv, S, Dh), then out (H, Dh) =
    attention of q (H, Dh) over slots start..slot (the same kernel and bits as attend_decode
    over that slice). All float32 C-contiguous; 0 <= start <= slot < S."""
    _check_threads(threads)
    cdef Py_ssize_t qd[2]
    cdef Py_ssize_t kd[4]
    cdef Py_ssize_t vd[4]
    cdef Py_ssize_t knd[2]
    cdef Py_ssize_t vnd[2]
    cdef Py_ssize_t od[2]
    cdef const float *qp = _f32(q, "q", 2, False, qd)
    cdef float *kc = _f32(k_cache, "k_cache", 4, True, kd)
    cdef float *vc = _f32(v_cache, "v_cache", 4, True, vd)
    cdef const float *knp = _f32(k_new, "k_new", 2, False, knd)
    cdef const float *vnp = _f32(v_new, "v_new", 2, False, vnd)
    cdef float *op = _f32(out, "out", 2, True, od)
    cdef Py_ssize_t H = qd[0], Dh = qd[1], Hkv = kd[1], S = kd[2]
    cdef Py_ssize_t n = slot + 1 - start, g, i
    for i in range(4):
        if vd[i] != kd[i]:
            raise ValueError(f"attend_cached: v_cache {v_cache.shape} and k_cache "
                             f"{k_cache.shape} differ")
    if (kd[0] < 1 or kd[3] != Dh or knd[0] != Hkv or knd[1] != Dh or vnd[0] != Hkv
            or vnd[1] != Dh):
        raise ValueError(f"attend_cached: k_cache {k_cache.shape} must be (B >= 1, Hkv, S, "
                         f"{Dh}) and k_new {k_new.shape}, v_new {v_new.shape} (Hkv, {Dh}) "
                         f"for q of shape ({H}, {Dh})")
    if Hkv < 1 or H % Hkv:
        raise ValueError(f"attend_cached: {H} query heads are not a multiple of {Hkv} kv heads")
    if not 0 <= start <= slot < S:
        raise ValueError(f"attend_cached: slots {start}..{slot} are not inside the cache's "
                         f"{S} slots (0 <= start <= slot < S)")
    if od[0] != H or od[1] != Dh:
        raise ValueError(f"attend_cached: out has shape ({od[0]}, {od[1]}), "
                         f"expected ({H}, {Dh})")
    cdef Py_ssize_t plane = Hkv * S * Dh                  # one sequence's (Hkv, S, Dh)
    if (_overlap(op, H * Dh, qp, H * Dh) or _overlap(op, H * Dh, kc, plane)
            or _overlap(op, H * Dh, vc, plane) or _overlap(kc, plane, vc, plane)
            or _overlap(knp, Hkv * Dh, kc, plane) or _overlap(vnp, Hkv * Dh, vc, plane)):
        raise ValueError("attend_cached: out, q, the new rows and the caches must not overlap")
    if Dh == 0:
        return
    for g in range(Hkv):                                  # the new token's key and value
        for i in range(Dh):
            kc[(g * S + slot) * Dh + i] = knp[g * Dh + i]
            vc[(g * S + slot) * Dh + i] = vnp[g * Dh + i]
    _attend_run(qp, kc + start * Dh, vc + start * Dh, op, S * Dh, Dh, n, H, Hkv, Dh, scale,
                threads, "attend_cached")


# ---------------------------------------------------------------------------------------------
# prepared calls: a weight (or three), its thread count and activations checked once, then a
# call per decode step that checks only what changes (the arrays)

cdef class PreparedLinear:
    """linear with w, bias, threads and activations fixed: `p(x, out)` writes out (T, R) =
    x (T, C) @ W.T (+ bias); the same work as linear(x, w, bias, out, 0, threads,
    activations). The weight is checked when made and again (re-read) if the ISA changes."""
    cdef Wmat m
    cdef object w, keep, bias_view, activations
    cdef const float *bp
    cdef int threads, isa
    cdef readonly Py_ssize_t rows, cols

    def __init__(self, w, bias, int threads, activations="f32"):
        _check_threads(threads)
        _activations(activations)
        self.w, self.threads, self.activations = w, threads, activations
        self._load()
        self.rows, self.cols = self.m.rows, self.m.cols
        cdef const float[::1] bv
        self.bp = NULL
        if bias is not None:
            bv = bias
            if bv.shape[0] != self.m.rows:
                raise ValueError(f"bias has {bv.shape[0]} elements, expected rows {self.m.rows}")
            self.bias_view = bv
            self.bp = &bv[0]

    def _load(self):
        self.keep = _load(self.w, "w", &self.m, _activations(self.activations))
        self.isa = _isa

    def __call__(self, x, out):
        cdef Py_ssize_t xd[2]
        cdef Py_ssize_t od[2]
        cdef const float *xp = _f32(x, "x", 2, False, xd)
        cdef float *op = _f32(out, "out", 2, True, od)
        cdef Py_ssize_t T = xd[0], R = self.m.rows, C = self.m.cols
        if xd[1] != C:
            raise ValueError(f"x has {xd[1]} columns, the weight has cols {C}")
        if od[0] != T or od[1] != R:
            raise ValueError(f"out has shape ({od[0]}, {od[1]}), expected ({T}, {R})")
        if T == 0:
            return
        if _overlap(xp, T * C, op, T * R):
            raise ValueError("out must not overlap x (linear reads every row of x while "
                             "writing)")
        if self.isa != _isa:
            self._load()
        _linear_run(xp, T, &self.m, self.bp, op, 0, self.threads)


cdef class PreparedRoute:
    """route_topk with k, rule, norm_topk_prob and threads fixed, no noise: `p(logits)` ->
    (ids int32 (T, K), weights float32 (T, K)) from logits float32 (T, E), as route_topk."""
    cdef Py_ssize_t k
    cdef int rule, threads
    cdef bint norm

    def __init__(self, Py_ssize_t k, str rule, bint norm_topk_prob, int threads):
        _check_threads(threads)
        if rule not in RULES:
            raise ValueError(f"unknown routing rule {rule!r}; expected one of "
                             f"{', '.join(RULES)}")
        if k < 1:
            raise ValueError(f"k = {k} must be >= 1")
        self.k, self.rule, self.norm, self.threads = k, RULES[rule], norm_topk_prob, threads

    def __call__(self, logits):
        cdef Py_ssize_t ld[2]
        cdef const float *lp = _f32(logits, "logits", 2, False, ld)
        cdef Py_ssize_t T = ld[0], E = ld[1], k = self.k, i, bad = -1
        if k > E:
            raise ValueError(f"k = {k} must be in 1..E, with E = {E} experts")
        for i in range(T * E):
            if lp[i] != lp[i]:                                     # NaN
                bad = i
                break
        if bad >= 0:
            raise ValueError(f"logits contain NaN (first at token {bad // E}, expert "
                             f"{bad % E})")
        ids = np.empty((T, k), dtype=np.int32)
        wts = np.empty((T, k), dtype=np.float32)
        if T == 0:
            return ids, wts
        cdef float *scratch = <float *>malloc(2 * T * E * sizeof(float))
        if scratch == NULL:
            raise MemoryError(f"route_topk: no memory for {T} x {E} scratch")
        cdef RouteJob job
        job.logits, job.E, job.k = lp, E, k
        job.rule, job.norm, job.noisy, job.seed = self.rule, self.norm, False, 0
        job.p, job.key = scratch, scratch + T * E
        job.ids = <int32_t *>colibri_array_data(ids)
        job.w = <float *>colibri_array_data(wts)
        try:
            with nogil:
                colibri_pool_run(_team(<double>T * E * 64, self.threads), _route_task, &job, T)
        finally:
            free(scratch)
        return ids, wts


cdef class PreparedExperts:
    """expert_ffn with the three expert stacks, threads and activations fixed:
    `p(x, ids, weights, out)`, the same work as expert_ffn(x, ids, weights, ..., out, ...)."""
    cdef Wmat g, u, d
    cdef object w_gate, w_up, w_down, keep, activations
    cdef int threads, isa

    def __init__(self, w_gate, w_up, w_down, int threads, activations="f32"):
        _check_threads(threads)
        _activations(activations)
        self.w_gate, self.w_up, self.w_down = w_gate, w_up, w_down
        self.threads, self.activations = threads, activations
        self._load()

    def _load(self):
        keep = []
        _load_ffn(self.w_gate, self.w_up, self.w_down, &self.g, &self.u, &self.d, keep,
                  _activations(self.activations))
        self.keep, self.isa = keep, _isa

    def __call__(self, const float[:, ::1] x, const int32_t[:, ::1] ids,
                 const float[:, ::1] weights, float[:, ::1] out):
        cdef Py_ssize_t T = x.shape[0], D = x.shape[1], K = ids.shape[1], E = self.g.n_experts
        cdef Py_ssize_t i, bad = -1
        if D != self.g.cols:
            raise ValueError(f"x has {D} columns, the experts' hidden size is {self.g.cols}")
        if ids.shape[0] != T or K < 1:
            raise ValueError(f"ids has shape ({ids.shape[0]}, {K}), expected ({T}, K >= 1)")
        if weights.shape[0] != T or weights.shape[1] != K:
            raise ValueError(f"weights has shape ({weights.shape[0]}, {weights.shape[1]}), "
                             f"expected ({T}, {K})")
        if out.shape[0] != T or out.shape[1] != D:
            raise ValueError(f"out has shape ({out.shape[0]}, {out.shape[1]}), expected "
                             f"({T}, {D})")
        for i in range(T * K):
            if not 0 <= ids[i // K, i % K] < E:
                bad = i
                break
        if bad >= 0:
            raise ValueError(f"expert id {ids[bad // K, bad % K]} at ({bad // K}, {bad % K}) "
                             f"is out of range for {E} experts")
        if T == 0:
            return
        if self.isa != _isa:
            self._load()
        _ffn(x, ids, weights, &self.g, &self.u, &self.d, out, self.threads)
