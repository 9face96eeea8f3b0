# colibri/pyx/weights.pxi: the ISA path of every later call, and the weights: a
# WeightRef-like object checked against its buffer and loaded into a Wmat; row tiles.

# A row tile of a weight matrix is about this many bytes: it stays in L1/L2 while every
# token block of the call passes over it, so the weights stream from memory once.
cdef enum:
    TILE_BYTES = 32768


# The formats the kernels multiply by, from the one table of formats (colibri/dtypes.py),
# whose codes are the C enum's (csrc/types.h): checked once, here.
FORMATS = {name: DTYPES[name].code for name in MATMUL}
_C_FORMATS = {"f32": COLIBRI_F32, "f16": COLIBRI_F16, "bf16": COLIBRI_BF16,
              "q8": COLIBRI_Q8, "q4": COLIBRI_Q4, "mxfp4": COLIBRI_MXFP4}
if FORMATS != _C_FORMATS:
    raise ImportError(f"colibri.dtypes formats {FORMATS} differ from the kernels' format codes "
                      f"{_C_FORMATS} (csrc/types.h)")
# What _row_bytes needs per format, read once (it runs on every checked call).
cdef dict _BITS = {name: DTYPES[name].bits for name in FORMATS}
cdef dict _SCALE_BYTES = {name: DTYPES[name].scale_bytes for name in FORMATS}
cdef dict _FIXED_GROUP = {name: DTYPES[name].fixed_group for name in FORMATS}
cdef frozenset _QUANTIZED = frozenset(QUANTIZED) & frozenset(FORMATS)


ISA_NAMES = ("scalar", "avx2", "avx512", "avxvnni", "avx512vnni", "amx-emu", "amx")   # csrc/types.h codes

cdef int _isa = colibri_isa_best()


def isa_supported(int code):
    """True when this CPU and OS run path `code` (0 scalar, 1 avx2, 2 avx512, 3 avxvnni, 4 avx512vnni)."""
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
    int fmt                    # COLIBRI_F32 .. COLIBRI_Q4, COLIBRI_MXFP4
    Py_ssize_t rows, cols      # R, C of one matrix
    Py_ssize_t group           # G (quantized), 0 otherwise
    Py_ssize_t row_stride, expert_stride, n_experts
    Py_ssize_t xsum_cols       # C / G for q4 (the offset fold needs per-group sums of x), else 0
    int block                  # tokens per pass of the row kernel (colibri_block_tokens)
    colibri_dot_fn dot         # row kernel of the current ISA
    colibri_gemm_fn gemm       # GEMM panel kernel of the current ISA (prefill path)
    float *gemm_scratch        # COLIBRI_GEMM_SCRATCH floats per thread; NULL: no GEMM path
    bint iact                  # quantized activations (int8 / int16) and a q8/q4/mxfp4 format:
                               # idot, not dot
    bint wide                  # ... with int16 codes (activations="int16")
    colibri_idot_fn idot       # that row kernel of the current ISA (iact only)
    colibri_igemm_fn igemm     # its GEMM (prefill) body (iact only); shares gemm_scratch
    Py_ssize_t igemm_min       # the ISA's measured crossover for it (0: none; iact only)


cdef inline object _row_bytes(str dtype, cols, group):
    """Bytes of one row's payload: dtypes.row_stride, whose checks _checked has made."""
    n = cols * _BITS[dtype] // 8
    return n + _SCALE_BYTES[dtype] * (cols // group) if dtype in _QUANTIZED else n


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
    if dtype in _QUANTIZED:
        if group <= 0 or group % BLOCK or cols % group:
            raise ValueError(f"{name}: group_size {group} must be a positive multiple of {BLOCK} "
                             f"dividing cols {cols} ({dtype})")
        if _FIXED_GROUP[dtype] and group != _FIXED_GROUP[dtype]:
            raise ValueError(f"{name}: group_size {group} must be {_FIXED_GROUP[dtype]} for "
                             f"{dtype}")
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
    1 int8, 2 int16), which q8/q4/mxfp4 weights honour (m.iact); plain formats keep the f32
    path."""
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
    m.iact = act != 0 and (m.fmt == COLIBRI_Q8 or m.fmt == COLIBRI_Q4 or m.fmt == COLIBRI_MXFP4)
    m.wide = m.iact and act == 2
    m.idot = NULL
    m.igemm = NULL
    m.igemm_min = 0
    if m.iact:
        m.idot = colibri_idot_for(_isa, m.fmt, m.wide)
        m.igemm = colibri_igemm_for(_isa, m.fmt, m.wide)
        m.igemm_min = colibri_igemm_crossover(_isa, m.wide)
        if m.idot == NULL or m.igemm == NULL:
            raise RuntimeError(f"{name}: no {ACTIVATIONS[act]} row kernel for format {dtype} "
                               f"on ISA {_isa}")
        # the pair bodies' int16: 3 tokens per pass (q4 1024 x 1024 in cache, 12 tokens, 1
        # thread: 4 per pass 35.6 GMAC/s, 3 37.3, 2 34.0; its four code vectors per pair
        # leave fewer registers); the small-M bodies (csrc/smallm.h) up to 8
        m.block = colibri_idot_block(_isa, m.fmt, m.wide)
        m.xsum_cols = 0                      # the idot kernels fold the q4 offset themselves
    return view


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
