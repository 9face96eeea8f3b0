"""Weights as the kernels see them: read-only arrays and a real read-only mapping of a file
(with the file's layout), pages of unchosen experts never touched, bad weight references
raising ValueError (never a read outside the buffer), bounds rechecked at call time.
"""
from __future__ import annotations

import mmap
import types

import numpy as np
import pytest

from colibri import _kernels, dtypes, kernels as K
from colibri.format import quant
from colibri.kernels.weights import WeightRef
from colibri.kernels import _reference as R
from kernel_helpers import (
    F32, assert_dot_close, assert_ffn_close, magnitude, make_experts, make_weight, rng_for)
from kernel_helpers import isa, parallel_everything  # noqa: F401 (fixtures)


def test_read_only_arrays(isa):
    rng = np.random.default_rng(8)
    wg, wu, wd = make_experts(rng, 4, 64, 96, ("q4",) * 3, 32)
    for w in (wg, wu, wd):
        w.buf.setflags(write=False)
    x = rng.standard_normal((5, 64)).astype(F32)
    logits = rng.standard_normal((5, 4)).astype(F32)
    for a in (x, logits):
        a.setflags(write=False)
    ids, weights = K.route_topk(logits, 2, norm_topk_prob=True)
    ids.setflags(write=False)
    weights.setflags(write=False)
    K.group_by_expert(ids, 4)
    y = K.expert_ffn(x, ids, weights, wg, wu, wd, threads=2)
    assert_ffn_close(y, R.expert_ffn_ref(x, ids, weights, wg, wu, wd))
    assert_dot_close(K.linear(x, wg, expert=1), R.linear_ref(x, wg, expert=1),
                     magnitude(x, wg, 1))
    K.swiglu(x, wg.expert(0), wu.expert(0), wd.expert(0))
    K.dequantize(wd, 3)


@pytest.mark.parametrize("fmt", ["f32", "bf16", "q4"])
def test_read_only_mmap_with_file_layout(tmp_path, isa, fmt):
    """Experts at a page-aligned stride after an odd offset, as in a .colibri file, read
    straight from a read-only mapping (unaligned element loads included)."""
    rng = rng_for("mmap", fmt)
    E, D, I, G = 4, 64, 96, 32
    page, head = 4096, 101                  # odd: unaligned elements
    mats = {n: (rng.standard_normal(s) * 0.3).astype(F32)
            for n, s in (("gate", (E, I, D)), ("up", (E, I, D)), ("down", (E, D, I)))}
    g = G if fmt in dtypes.QUANTIZED else 0
    sizes = {n: dtypes.tensor_nbytes(fmt, m.shape[1:], g) for n, m in mats.items()}
    stride = -(-sum(sizes.values()) // page) * page
    blob = bytearray(head + E * stride)
    blob[:head] = rng.integers(0, 256, head, dtype=np.uint8).tobytes()
    offsets = {"gate": head, "up": head + sizes["gate"],
               "down": head + sizes["gate"] + sizes["up"]}
    for n, m in mats.items():
        for e in range(E):
            enc = quant.encode(m[e], fmt, g).tobytes()
            start = offsets[n] + e * stride
            blob[start:start + len(enc)] = enc
    path = tmp_path / "experts.bin"
    path.write_bytes(bytes(blob))
    with open(path, "rb") as f:
        mm = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
    try:
        buf = np.frombuffer(mm, dtype=np.uint8)
        assert not buf.flags.writeable
        ws = {n: WeightRef(buf, offsets[n], fmt, m.shape[1], m.shape[2], g,
                             n_experts=E, expert_stride=stride) for n, m in mats.items()}
        x = rng.standard_normal((6, D)).astype(F32)
        ids = np.array([[0, 2]] * 3 + [[2, 3]] * 3, np.int32)
        weights = rng.random((6, 2)).astype(F32)
        y = K.expert_ffn(x, ids, weights, ws["gate"], ws["up"], ws["down"], threads=2)
        assert_ffn_close(y, R.expert_ffn_ref(x, ids, weights, ws["gate"], ws["up"], ws["down"]))
        for e in range(E):
            assert np.array_equal(K.dequantize(ws["down"], e),
                                  quant.decode(quant.encode(mats["down"][e], fmt, g), fmt,
                                               (D, I), g))
        del buf, ws
    finally:
        try:
            mm.close()
        except BufferError:                  # a failed assertion still holds a view
            pass


def _pages_present(addr: int, nbytes: int) -> np.ndarray | None:
    """Per page of [addr, addr + nbytes): is it mapped in this process (Linux pagemap)?"""
    page = mmap.PAGESIZE
    first, last = addr // page, (addr + nbytes - 1) // page
    try:
        with open("/proc/self/pagemap", "rb") as f:
            f.seek(first * 8)
            raw = f.read((last - first + 1) * 8)
    except OSError:
        return None
    if len(raw) != (last - first + 1) * 8:
        return None
    return (np.frombuffer(raw, dtype="<u8") >> np.uint64(63)).astype(bool)


@pytest.mark.parametrize("activations", K.ACTIVATIONS)
def test_unchosen_expert_pages_are_never_touched(tmp_path, isa, activations):
    """Not activated = not touched: after expert_ffn over a read-only mapping, no page of an
    expert that no token chose is mapped into the process, while the chosen ones are."""
    rng = np.random.default_rng(12)
    E, D, I, G = 4, 64, 96, 32
    # Far beyond the kernel's fault-around window and its large page-cache folios (a fault
    # may map a whole 2 MB folio of the file).
    stride = 4 << 20
    ws, blob = {}, bytearray(E * stride)
    sizes = {"gate": (I, D), "up": (I, D), "down": (D, I)}
    offset = 0
    for name, shape in sizes.items():
        for e in range(E):
            enc = quant.encode((rng.standard_normal(shape) * 0.3).astype(F32), "q4", G)
            blob[e * stride + offset:e * stride + offset + enc.size] = enc.tobytes()
        ws[name] = offset
        offset += dtypes.tensor_nbytes("q4", shape, G)
    path = tmp_path / "sparse.bin"
    path.write_bytes(bytes(blob))
    with open(path, "rb") as f:
        mm = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
    try:
        buf = np.frombuffer(mm, dtype=np.uint8)
        addr = buf.__array_interface__["data"][0]
        before = _pages_present(addr, buf.size)
        if before is None or before.any():
            pytest.skip("no usable /proc/self/pagemap on this system")
        refs = [WeightRef(buf, ws[n], "q4", *sizes[n], G, n_experts=E, expert_stride=stride)
                for n in ("gate", "up", "down")]
        x = rng.standard_normal((5, D)).astype(F32)
        ids = np.array([[0, 2]] * 5, np.int32)
        y = K.expert_ffn(x, ids, rng.random((5, 2)).astype(F32), *refs, threads=2,
                         activations=activations)
        assert np.isfinite(y).all()
        for e, chosen in ((0, True), (1, False), (2, True), (3, False)):
            present = _pages_present(addr + e * stride, offset)
            assert present.any() == chosen, (e, present)
        del buf, refs
    finally:
        try:
            mm.close()
        except BufferError:
            pass


def test_bad_weight_refs_raise():
    buf = quant.encode(np.ones((4, 64), F32), "q4", 32)               # 4 rows of 36 bytes
    ok = dict(buf=buf, offset=0, dtype="q4", rows=4, cols=64, group_size=32)
    WeightRef(**ok)
    bad = [
        (dict(offset=1), "past the end"),
        (dict(offset=-1), "negative"),
        (dict(rows=5), "past the end"),
        (dict(offset=10**20), "past the end"),
        (dict(dtype="q5"), "dtype"),
        (dict(dtype="i32"), "dtype"),
        (dict(group_size=48), "group_size"),
        (dict(group_size=0), "group_size"),
        (dict(row_stride=35), "row_stride"),
        (dict(n_experts=2, expert_stride=144), "past the end"),
        (dict(n_experts=2, expert_stride=8, rows=1), "expert_stride"),
        (dict(buf=buf.view(np.float32)), "uint8"),
        (dict(buf=np.zeros((2, 72), np.uint8)), "1-D"),
        (dict(buf=np.zeros(300, np.uint8)[::2]), "contiguous"),
        (dict(rows=0), "rows"),
        (dict(cols=2.0), "cols"),
    ]
    for change, match in bad:
        with pytest.raises(ValueError, match=match):
            WeightRef(**{**ok, **change})


def test_kernels_recheck_bounds_at_call_time():
    """A WeightRef altered after construction, or any object with the fields, is checked
    again by the compiled kernels before they touch memory."""
    rng = np.random.default_rng(4)
    w, _ = make_weight(rng, (3, 8, 64), "q4", 32)
    x = np.ones((2, 64), F32)
    broken = WeightRef(w.buf, w.offset, w.dtype, w.rows, w.cols, w.group_size,
                         n_experts=3, expert_stride=w.expert_stride)
    object.__setattr__(broken, "n_experts", 4)                         # bypasses validation
    with pytest.raises(ValueError, match="past the end"):
        K.linear(x, broken, expert=3)
    fake = types.SimpleNamespace(**{f: getattr(w, f) for f in (
        "buf", "offset", "dtype", "rows", "cols", "group_size", "row_stride", "n_experts",
        "expert_stride")})
    fake.offset = w.buf.size - 10
    with pytest.raises(ValueError, match="past the end"):
        K.linear(x, fake)
    with pytest.raises(ValueError, match="past the end"):
        K.expert_ffn(x, np.zeros((2, 1), np.int32), np.ones((2, 1), F32), w, w, fake)
    with pytest.raises(ValueError, match="past the end"):
        K.dequantize(fake)
    fake.offset, fake.buf = 0, w.buf.astype(np.int16)
    with pytest.raises(ValueError, match="uint8"):
        _kernels.weight_span(fake)
