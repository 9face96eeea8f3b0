"""Tests of colibri.format.quant: the bytes of every weight encoding (docs/format.md §6).

Expectations are built independently of the code under test: by hand for the nibble order and
the q values, by PyTorch for bf16, by the spec's arithmetic for sizes, and by the documented
per-element error bound for the quantizers.
"""
import numpy as np
import pytest
import torch

from colibri import dtypes
from colibri.format import quant as Q

RNG = np.random.default_rng(20240607)


# ---------------------------------------------------------------------------------------------
# bf16 against PyTorch


def _torch_bf16_bits(x: np.ndarray) -> np.ndarray:
    t = torch.from_numpy(np.ascontiguousarray(x, np.float32)).to(torch.bfloat16)
    return t.view(torch.int16).numpy().view(np.uint16)


def _special_f32() -> np.ndarray:
    u = [0x00000000, 0x80000000,                     # +-0
         0x7F800000, 0xFF800000,                     # +-inf
         0x7FC00000, 0xFFC00000, 0x7F800001, 0x7FBFFFFF, 0xFF800001, 0x7F80FFFF,  # NaNs
         0x00000001, 0x80000001, 0x00007FFF, 0x00008000, 0x00018000, 0x007FFFFF,  # denormals
         0x00800000, 0x3F808000, 0x3F818000, 0x3F808001, 0x3F817FFF,  # ties to even / not
         0xBF808000, 0xBF818000,                     # negative ties
         0x7F7FFFFF, 0x7F7F8000, 0x7F7F7FFF, 0xFF7FFFFF]  # largest finite: round to inf or not
    return np.array(u, dtype=np.uint32).view(np.float32)


def test_f32_to_bf16_matches_torch():
    rand_bits = RNG.integers(0, 2**32, size=200_000, dtype=np.uint64).astype(np.uint32)
    x = np.concatenate([_special_f32(), rand_bits.view(np.float32),
                        RNG.standard_normal(10_000).astype(np.float32) * 1e-39])
    got = Q.f32_to_bf16(x)
    want = _torch_bf16_bits(x)
    assert got.dtype == np.uint16 and got.shape == x.shape
    nan = np.isnan(x)
    assert nan.sum() > 6
    # NaN stays NaN (torch canonicalises the payload; we keep sign and top payload).
    assert np.isnan(Q.bf16_to_f32(got[nan])).all()
    np.testing.assert_array_equal(got[~nan], want[~nan])
    inf = np.isinf(x)
    np.testing.assert_array_equal(Q.bf16_to_f32(got[inf]), x[inf])


def test_f32_to_bf16_keeps_shape_and_accepts_strided():
    x = RNG.standard_normal((4, 6, 8)).astype(np.float32)
    got = Q.f32_to_bf16(x[:, ::2, :])
    assert got.shape == (4, 3, 8)
    np.testing.assert_array_equal(got, _torch_bf16_bits(x[:, ::2, :]))


def test_bf16_to_f32_all_patterns_exact():
    bits = np.arange(2**16, dtype=np.uint32).astype(np.uint16)
    got = Q.bf16_to_f32(bits)
    want = torch.from_numpy(bits.view(np.int16)).view(torch.bfloat16).float().numpy()
    assert got.dtype == np.float32
    nan = np.isnan(want)
    np.testing.assert_array_equal(np.isnan(got), nan)
    np.testing.assert_array_equal(got[~nan].view(np.uint32), want[~nan].view(np.uint32))
    # And back: every non-NaN pattern survives f32 -> bf16 unchanged.
    np.testing.assert_array_equal(Q.f32_to_bf16(got[~nan]), bits[~nan])


# ---------------------------------------------------------------------------------------------
# exact q values, scales and nibble order


def test_q4_nibble_order_hand_built():
    # One row, two 32-element blocks, group 64; scale 0.5 exactly (m = -4.0 -> -4/-8).
    # Block 0: elements 0..15 carry q = -8..7 (nibbles 0..15), elements 16..31 nibbles 15..0.
    # Block 1: elements 32..47 nibble 3, elements 48..63 nibble 12.
    nib = np.concatenate([np.arange(16), 15 - np.arange(16), np.full(16, 3), np.full(16, 12)])
    w = ((nib - 8) * 0.5).astype(np.float32)[None, :]
    packed, scales = Q.quantize_q4(w, 64)
    assert scales.dtype == np.float16 and scales.tolist() == [[0.5]]
    expected = ([i | ((15 - i) << 4) for i in range(16)]     # byte i: elem i low, 16+i high
                + [3 | (12 << 4)] * 16)
    assert packed.dtype == np.uint8 and packed.shape == (1, 32)
    assert packed[0].tolist() == expected
    # The on-disk row: 32 packed bytes, then the f16 scale 0.5 = 0x3800 little-endian.
    raw = Q.encode(w, "q4", 64)
    assert raw.tolist() == expected + [0x00, 0x38]
    np.testing.assert_array_equal(Q.decode(raw, "q4", (1, 64), 64), w)


def test_q4_nibble_order_random_against_loop():
    # Expectation built with plain Python loops from the spec's byte rule.
    C, G = 128, 32
    k = RNG.integers(-8, 8, size=(3, C))
    k[:, ::G] = -8                                       # m = -8 * s in every group -> scale s
    s = np.array([0.25, 2.0, 0.03125], np.float32)[:, None]
    w = (k * s).astype(np.float32)
    packed, scales = Q.quantize_q4(w, G)
    np.testing.assert_array_equal(scales, np.broadcast_to(s, (3, C // G)).astype(np.float16))
    for r in range(3):
        for j in range(C // 32):
            for i in range(16):
                lo = k[r, 32 * j + i] + 8
                hi = k[r, 32 * j + 16 + i] + 8
                assert packed[r, 16 * j + i] == lo | (hi << 4)
    np.testing.assert_array_equal(Q.dequantize_q4(packed, scales, G), w)


def test_q8_exact_values_and_layout():
    C, G = 96, 32
    k = RNG.integers(-127, 128, size=(2, C))
    k[:, ::G] = 127                                      # max|w| = 127 * s -> scale s
    s = np.float32(0.0078125)
    w = (k * s).astype(np.float32)
    q, scales = Q.quantize_q8(w, G)
    assert q.dtype == np.int8 and scales.dtype == np.float16
    np.testing.assert_array_equal(q, k)
    assert (scales == s).all()
    raw = Q.encode(w, "q8", G).reshape(2, -1)
    np.testing.assert_array_equal(raw[:, :C].view(np.int8), k)
    np.testing.assert_array_equal(raw[:, C:].copy().view("<f2"), np.full((2, 3), s, np.float16))


def test_round_half_to_even_and_q4_clamp():
    s = 1 / 128                                          # exact in f16 and f32
    w = np.zeros((1, 32), np.float32)
    w[0, 0] = 127 * s
    w[0, 1], w[0, 2], w[0, 3] = 2.5 * s, 3.5 * s, -2.5 * s
    q, _ = Q.quantize_q8(w, 32)
    assert q[0, :4].tolist() == [127, 2, 4, -2]
    # q4: the first value of largest magnitude sets the sign of the scale; an equal-magnitude
    # value of the other sign clamps to 7 (one step of error, the Q4_0 trade for level 16).
    w = np.zeros((1, 32), np.float32)
    w[0, 0], w[0, 1] = -4.0, 4.0
    d = Q.decode(Q.encode(w, "q4", 32), "q4", w.shape, 32)
    assert d[0, :2].tolist() == [-4.0, 3.5]
    w[0, 0], w[0, 1] = 4.0, -4.0
    d = Q.decode(Q.encode(w, "q4", 32), "q4", w.shape, 32)
    assert d[0, :2].tolist() == [4.0, -3.5]


@pytest.mark.parametrize("fmt", ["q8", "q4"])
@pytest.mark.parametrize("G", [32, 64, 128])
def test_requantize_is_bit_exact(fmt, G):
    # decode then encode again gives the same bytes: q values and f16 scales both survive.
    w = (RNG.standard_t(4, size=(2, 16, 256)) * 0.02).astype(np.float32)
    raw = Q.encode(w, fmt, G)
    again = Q.encode(Q.decode(raw, fmt, w.shape, G), fmt, G)
    np.testing.assert_array_equal(raw, again)


def test_zero_and_underflowing_groups_decode_to_zero():
    w = np.zeros((2, 64), np.float32)
    w[1, 32:] = RNG.standard_normal(32) * 1e-9          # scale underflows float16 -> 0
    for fmt, quantize in (("q8", Q.quantize_q8), ("q4", Q.quantize_q4)):
        qd, scales = quantize(w, 32)
        assert scales[0].tolist() == [0.0, 0.0]
        assert scales[1, 0] == 0 and scales[1, 1] == 0
        d = Q.decode(Q.encode(w, fmt, 32), fmt, w.shape, 32)
        np.testing.assert_array_equal(d, np.zeros_like(w))
        assert not np.isnan(d).any()
    packed, _ = Q.quantize_q4(np.zeros((1, 32), np.float32), 32)
    assert (packed == 0x88).all()                        # nibble 8 = 0.0


# ---------------------------------------------------------------------------------------------
# error bound


def _bound_violations(w: np.ndarray, d: np.ndarray, fmt: str, G: int, scales: np.ndarray):
    """Elements whose error exceeds the documented bound (module docstring of quant)."""
    w64 = w.astype(np.float64).reshape(*w.shape[:-1], -1, G)
    err = np.abs(w64 - d.astype(np.float64).reshape(w64.shape))
    s = scales.astype(np.float64)[..., None]
    if fmt == "q8":
        s32 = np.abs(w64).max(-1, keepdims=True) / 127
        slack = 127 * np.abs(s32 - s)
        bound = np.abs(s) / 2 + slack
    else:
        idx = np.abs(w64).argmax(-1)[..., None]
        s32 = np.take_along_axis(w64, idx, -1) / -8
        slack = 8 * np.abs(s32 - s)
        with np.errstate(divide="ignore", invalid="ignore"):
            clamped_hi = w64 / s > 7.5                  # the nibble-15 side: one step at most
        bound = np.where(clamped_hi, np.abs(s), np.abs(s) / 2) + slack
    # f32 division before rounding may misplace exact half-way points by an ulp.
    return err > bound * (1 + 1e-6) + 1e-30


@pytest.mark.parametrize("fmt", ["q8", "q4"])
@pytest.mark.parametrize("G", [32, 64, 128])
@pytest.mark.parametrize("kind", ["gauss", "student_t", "outliers", "tiny"])
def test_error_within_documented_bound(fmt, G, kind):
    shape = (3, 24, 512)
    if kind == "gauss":
        w = RNG.standard_normal(shape) * 0.02
    elif kind == "student_t":
        w = RNG.standard_t(4, size=shape) * 0.02
    elif kind == "outliers":
        w = RNG.standard_normal(shape) * 0.02
        w[..., RNG.choice(512, 5, replace=False)] *= 50
    else:                                               # f16-subnormal scales
        w = RNG.standard_normal(shape) * 1e-6
    w = w.astype(np.float32)
    raw = Q.encode(w, fmt, G)
    d = Q.decode(raw, fmt, w.shape, G)
    _, scales = (Q.quantize_q8 if fmt == "q8" else Q.quantize_q4)(w, G)
    bad = _bound_violations(w, d, fmt, G, scales)
    assert not bad.any(), f"{bad.sum()} elements beyond the bound"
    # The simple per-group bound the docs state: q8 half a step, q4 one step (f16 slack).
    wg = np.abs(w.reshape(*w.shape[:-1], -1, G)).max(-1, keepdims=True)
    step = wg / (127 if fmt == "q8" else 8)
    factor = 0.5 if fmt == "q8" else 1.0
    err = np.abs(w - d).reshape(wg.shape[:-1] + (G,))
    if kind != "tiny":                                   # normal f16 scales only
        assert (err <= step * factor * (1 + 2**-9)).all()


def test_bound_check_can_fail():
    # The oracle above must flag a decode that is off by one level.
    w = (RNG.standard_normal((2, 64)) * 0.02).astype(np.float32)
    packed, scales = Q.quantize_q4(w, 32)
    wrong = Q.dequantize_q4(packed ^ np.uint8(0x01), scales, 32)
    assert _bound_violations(w, wrong, "q4", 32, scales).any()


# ---------------------------------------------------------------------------------------------
# stacks, chunks, views


@pytest.mark.parametrize("fmt", ["q8", "q4"])
def test_stack_equals_per_expert_and_chunking_is_invisible(fmt, monkeypatch):
    w = (RNG.standard_normal((4, 10, 192)) * 0.05).astype(np.float32)
    whole = Q.encode(w, fmt, 64)
    per = np.concatenate([Q.encode(w[e], fmt, 64) for e in range(4)])
    np.testing.assert_array_equal(whole, per)
    monkeypatch.setattr(Q, "CHUNK_ELEMENTS", 200)      # ~1 row per chunk
    np.testing.assert_array_equal(Q.encode(w, fmt, 64), whole)
    per_dec = np.stack([Q.decode(Q.encode(w[e], fmt, 64), fmt, w[e].shape, 64)
                        for e in range(4)])
    np.testing.assert_array_equal(Q.decode(whole, fmt, w.shape, 64), per_dec)


def test_input_is_not_modified_and_other_float_dtypes():
    w = (RNG.standard_normal((8, 64)) * 0.1).astype(np.float32)
    w0 = w.copy()
    Q.encode(w, "q4", 32)
    Q.encode(w, "q8", 32)
    np.testing.assert_array_equal(w, w0)
    # f16 and f64 inputs quantize like their f32 values.
    h = w.astype(np.float16)
    np.testing.assert_array_equal(Q.encode(h, "q4", 32), Q.encode(h.astype(np.float32), "q4", 32))


@pytest.mark.parametrize("fmt", ["q8", "q4"])
def test_split_rows_zero_copy_on_strided_readonly_stack(fmt):
    # Three experts at a page-like stride with gaps, as the file lays them out.
    E, R, C, G = 3, 8, 128, 32
    w = (RNG.standard_normal((E, R, C)) * 0.02).astype(np.float32)
    rs = dtypes.row_stride(fmt, C, G)
    stride = R * rs + 40
    buf = np.zeros(E * stride, np.uint8)
    for e in range(E):
        buf[e * stride: e * stride + R * rs] = Q.encode(w[e], fmt, G)
    buf.flags.writeable = False
    rows = np.lib.stride_tricks.as_strided(buf, (E, R, rs), (stride, rs, 1), writeable=False)
    qd, sc = Q.split_rows(rows, fmt, C, G)
    assert qd.shape == (E, R, C * dtypes.dtype(fmt).bits // 8) and sc.shape == (E, R, C // G)
    assert qd.dtype == np.uint8 and sc.dtype == np.float16
    assert np.shares_memory(qd, buf) and np.shares_memory(sc, buf)
    assert not qd.flags.writeable and not sc.flags.writeable
    deq = Q.dequantize_q8 if fmt == "q8" else Q.dequantize_q4
    np.testing.assert_array_equal(deq(qd, sc, G), Q.decode(Q.encode(w, fmt, G), fmt, w.shape, G))
    with pytest.raises(ValueError, match=f"{rs} bytes"):
        Q.split_rows(rows[..., :-2], fmt, C, G)


# ---------------------------------------------------------------------------------------------
# plain encodings and errors


def test_plain_round_trips():
    w = RNG.standard_normal((3, 7)).astype(np.float32)
    for dtype in ("f32", "f16", "bf16"):
        raw = Q.encode(w, dtype)
        assert raw.dtype == np.uint8 and raw.ndim == 1
        assert raw.size == dtypes.tensor_nbytes(dtype, w.shape)
        d = Q.decode(raw, dtype, w.shape)
        assert d.dtype == np.float32 and d.shape == w.shape
    np.testing.assert_array_equal(Q.decode(Q.encode(w, "f32"), "f32", w.shape), w)
    np.testing.assert_array_equal(Q.decode(Q.encode(w, "f16"), "f16", w.shape),
                                  w.astype(np.float16).astype(np.float32))
    np.testing.assert_array_equal(
        Q.decode(Q.encode(w, "bf16"), "bf16", w.shape),
        torch.from_numpy(w).to(torch.bfloat16).float().numpy())
    # bf16 on disk: little-endian u16 upper halves.
    one = Q.encode(np.array([1.0, -2.0], np.float32), "bf16")
    assert one.tolist() == [0x80, 0x3F, 0x00, 0xC0]
    bits = np.array([0x3F80, 0xC000], np.uint16)             # uint16 = bf16 bits, kept
    assert Q.encode(bits, "bf16").tolist() == [0x80, 0x3F, 0x00, 0xC0]
    i = np.array([[-2**31, 2**31 - 1, 0]], np.int64)
    np.testing.assert_array_equal(Q.decode(Q.encode(i, "i32"), "i32", i.shape), i)


def test_encode_errors_name_the_tensor():
    w = np.ones((2, 64), np.float32)
    w[1, 5] = np.nan
    for fmt in ("q8", "q4"):
        with pytest.raises(ValueError, match=r"'blk.w'.*non-finite.*row 1, column 5"):
            Q.encode(w, fmt, 32, name="blk.w")
    w[1, 5] = np.inf
    with pytest.raises(ValueError, match="non-finite"):
        Q.quantize_q4(w, 32)
    big = np.ones((1, 32), np.float32)
    big[0, 3] = 6e5                                      # 6e5 / 8 > 65504
    with pytest.raises(ValueError, match=r"'big'.*float16 maximum 65504"):
        Q.encode(big, "q4", 32, name="big")
    big[0, 3] = 1e7                                      # 1e7 / 127 > 65504
    with pytest.raises(ValueError, match="float16 maximum"):
        Q.quantize_q8(big, 32)
    big[0, 3] = 5e5                                      # fits q4 (62500), not f16 itself
    Q.quantize_q4(big, 32)
    with pytest.raises(ValueError, match="beyond the float16 range"):
        Q.encode(big, "f16", name="big")
    with pytest.raises(ValueError, match="outside int32"):
        Q.encode(np.array([2**31]), "i32")
    with pytest.raises(ValueError, match="expected 36 bytes"):
        Q.decode(np.zeros(35, np.uint8), "q4", (1, 64), 32)
