# colibri/pyx/activations.pxi: quantized activations (int8 / int16 codes): the activations
# argument, the packed token rows (Act) the idot row kernels read, quantize_activations.

ACTIVATIONS = ("f32", "int8", "int16")   # _activations: codes 0, 1, 2


def _activations(activations):
    """0 for "f32", 1 for "int8", 2 for "int16"; ValueError naming the allowed values
    otherwise (for any object: the one check of the argument, kernels.py passes it through)."""
    if not isinstance(activations, str) or activations not in ACTIVATIONS:
        raise ValueError(f"activations must be one of {', '.join(map(repr, ACTIVATIONS))}, "
                         f"found {activations!r}")
    return ACTIVATIONS.index(activations)


ctypedef struct Act:
    # token rows quantized to int8 or int16 for the idot row kernels, in the packed layout of
    # colibri_quantize_row (csrc/types.h): blocks paired, d and s permuted per chunk of 8
    int8_t *q                  # (n, colibri_act_row_bytes) code bytes, row stride qs bytes
    float *d                   # (n, dpad) block scales, row stride ds; dpad = C/32 rounded up
    int32_t *s                 # (n, dpad) 8 * block sums of q       to 8, zero-padded
    Py_ssize_t qs, ds          # row strides; 0: every token reads row 0
    int isa                    # the path that quantizes (the same bits on every path)
    int wide                   # int16 codes (else int8)


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
    one scale each (bits 8: llama.cpp's Q8_0; 16: the same rule with 32767; csrc/types.h)."""
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
