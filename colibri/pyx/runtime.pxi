# colibri/pyx/runtime.pxi: the runtime knobs (min_parallel_bytes, spin_us, gemm_min_tokens,
# igemm_min_tokens), the pool's counters, the thread team of a piece of work, and the
# reusable scratch buffer.

# ---------------------------------------------------------------------------------------------
# threads: how many a piece of work is worth

# The knobs' values live here; their defaults and the reasons for them are defined once, in
# colibri.kernels.runtime (KNOBS), which sets every knob at import: the initial values below are
# overwritten before any kernel runs.
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

# set at import by colibri.kernels.runtime (GEMM_MIN_TOKENS: the default and its measurement)
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


# set at import by colibri.kernels.runtime (IGEMM_MIN_TOKENS); 0: each path's measured crossover
cdef Py_ssize_t _igemm_min = 0
cdef Py_ssize_t _NEVER = 1 << 62


def set_igemm_min_tokens(Py_ssize_t n):
    """Tokens per matrix from which a q8 / q4 / mxfp4 matrix on int8 / int16 activations uses the
    integer GEMM path (csrc/igemm.h), on every ISA path; 0: each path's own measured
    crossover (igemm_crossover). A huge value turns the path off. >= 0."""
    global _igemm_min
    if n < 0:
        raise ValueError(f"igemm_min_tokens must be >= 0, found {n}")
    _igemm_min = n


def get_igemm_min_tokens():
    return _igemm_min


def igemm_crossover(int isa, bint wide):
    """The tokens per matrix from which ISA path `isa` runs the integer GEMM path by default
    (igemm_min_tokens 0) for int16 (wide) or int8 codes; None: never."""
    cdef Py_ssize_t n = colibri_igemm_crossover(isa, wide)
    return n if n > 0 else None


def isa_why_not(int isa):
    """Why this CPU / OS / build does not run path `isa` ("" when it does)."""
    return colibri_isa_why_not(isa).decode()


def amx_min_tokens():
    """Tokens per pass from which the amx / amx-emu paths run the tile bodies."""
    return colibri_amx_min_tokens


def idot_small_m(int isa, int fmt, bint wide):
    """True when (isa, fmt code, int16 codes) runs the small-M row bodies (csrc/smallm.h)."""
    return colibri_idot_small_m(isa, fmt, wide) != 0


def _amx_selfcheck_drill(bint corrupt):
    """Test hook: the AMX self-check's verdict path with the emulation on both sides
    (corrupt: one output bit flipped, so the check fails and disables amx for the process
    with its one warning line). True: the same bits; None: no avx512vnni path built."""
    cdef int r
    if not colibri_isa_supported(COLIBRI_ISA_AVX512VNNI):
        return None
    r = colibri_amx_selfcheck_drill(corrupt)
    return None if r < 0 else r == 1


cdef inline Py_ssize_t _gemm_min_for(const Wmat *m) noexcept nogil:
    """Tokens from which matrix m takes a GEMM path: the integer one for int8 / int16
    activations (m.iact), the f32 one otherwise."""
    if not m.iact:
        return _gemm_min
    if m.igemm == NULL:                      # no integer GEMM body: the row kernel
        return _NEVER
    if _igemm_min > 0:
        return _igemm_min
    return m.igemm_min if m.igemm_min > 0 else _NEVER


# GEMM tiles (linear, w_down): GEMM_TILE_PANELS panels of rows, whatever the format: each
# token pass reads its x once per panel, and x is what the GEMM path streams (the weights are
# read once per pass). Passed to _tile_rows as the bytes of a row.
cdef enum:
    GEMM_TILE_PANELS = 4
cdef Py_ssize_t _GEMM_TILE_ROW_BYTES = TILE_BYTES // (GEMM_TILE_PANELS * COLIBRI_GEMM_NR)


cdef inline Py_ssize_t _gemm_bytes(Py_ssize_t n, int nth, Py_ssize_t n_min) noexcept nogil:
    """Bytes of GEMM scratch for a call whose largest matrix has n tokens, nth threads, when
    its matrices take a GEMM path from n_min tokens (the integer path's scratch fits in the
    f32 one's: csrc/igemm.h)."""
    return 4 * COLIBRI_GEMM_SCRATCH * nth if n >= n_min else 0


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
