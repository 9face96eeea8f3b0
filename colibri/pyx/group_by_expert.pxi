# colibri/pyx/group_by_expert.pxi: the (token, k) slots grouped by expert
# (the dispatch of an MoE layer).

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
