"""The .colibri writer: round trips of every dtype and rank, streaming in any order, atomic
writes (temporary file and rename), refusing bad specs."""
from __future__ import annotations

import os
import zlib
from pathlib import Path

import numpy as np
import pytest

from colibri import dtypes
from colibri.format import quant
from colibri.format import ColibriFile, ColibriWriter, QuantizedTensor, TensorSpec, save
from colibri import format as fmt

from format_helpers import CODES, G, specs_for, small


SHAPES = [(1,), (7,), (3, 5), (2, 3, 5), (2, 1, 3, 5)]
QSHAPES = [(64,), (3, 64), (2, 3, 96), (2, 1, 3, 32)]


def encoded(arr: np.ndarray, dtype: str, gs: int = 0) -> bytes:
    return quant.encode(arr, dtype, gs).tobytes()


@pytest.mark.parametrize("dtype", ["f32", "f16", "bf16", "i32", "q8", "q4"])
def test_roundtrip_every_dtype_and_rank(tmp_path, dtype):
    rng = np.random.default_rng(CODES[dtype])
    shapes = QSHAPES if dtype in ("q8", "q4") else SHAPES
    gs = G if dtype in ("q8", "q4") else 0
    src = {}
    for k, shape in enumerate(shapes):
        a = rng.integers(-2**31, 2**31, shape, dtype=np.int64).astype(np.int32) \
            if dtype == "i32" else (rng.standard_normal(shape) * 3).astype(np.float32)
        src[f"t{k}"] = (a, dtype)
    path = tmp_path / "rt.colibri"
    save(path, src, group_size=G)
    with ColibriFile(path) as cf:
        assert list(cf.tensors) == list(src)
        for name, (a, _) in src.items():
            info = cf.tensors[name]
            want = encoded(a, dtype, gs)
            assert (info.dtype, info.shape, info.group_size) == (dtype, a.shape, gs)
            assert info.nbytes == len(want) == dtypes.tensor_nbytes(dtype, a.shape, gs)
            assert info.crc32 == zlib.crc32(want)
            # The exact bytes the encoding defines, at the recorded offset.
            assert bytes(cf.buffer[info.offset: info.offset + info.nbytes]) == want
            view = cf.tensor(name)
            back = cf.to_float32(name)
            assert back.dtype == np.float32 and back.shape == a.shape
            if dtype in ("q8", "q4"):
                assert isinstance(view, QuantizedTensor) and view.shape == a.shape
                rows = np.frombuffer(want, np.uint8).reshape(a.shape[:-1] + (-1,))
                qd, sc = quant.split_rows(rows, dtype, a.shape[-1], gs)
                np.testing.assert_array_equal(view.data, qd)
                np.testing.assert_array_equal(view.scales, sc)
                assert not view.data.flags.writeable and not view.scales.flags.writeable
                np.testing.assert_array_equal(back, quant.decode(np.frombuffer(want, np.uint8),
                                                                 dtype, a.shape, gs))
                # within the quantizer's bound: half a step (+ the q4 clamp step)
                step = np.repeat(np.abs(sc.astype(np.float32)), gs, axis=-1)
                assert (np.abs(back - a) <= step * (1.0 if dtype == "q4" else 0.5) + 1e-6).all()
            else:
                np_dtype = {"f32": np.float32, "f16": np.float16, "bf16": np.uint16,
                            "i32": np.int32}[dtype]
                assert view.dtype == np_dtype and view.shape == a.shape
                assert not view.flags.writeable
                if dtype == "bf16":
                    np.testing.assert_array_equal(view, quant.f32_to_bf16(a))
                    np.testing.assert_array_equal(back, quant.bf16_to_f32(quant.f32_to_bf16(a)))
                else:
                    np.testing.assert_array_equal(view, a.astype(np_dtype))
                    np.testing.assert_array_equal(cf[name], view)
        assert cf.verify_checksums() == [] and cf.validate() == []


def test_bf16_inputs_bits_and_ml_dtypes(tmp_path):
    ml_dtypes = pytest.importorskip("ml_dtypes")
    bits = np.array([0x3F80, 0xC000, 0x7F80, 0x0001, 0x8000], np.uint16)  # 1, -2, inf, tiny, -0
    as_bf16 = np.array([1.5, -3.25], dtype=ml_dtypes.bfloat16)
    save(tmp_path / "b.colibri", {"bits": (bits, "bf16"), "ml": as_bf16})
    with ColibriFile(tmp_path / "b.colibri") as cf:
        np.testing.assert_array_equal(cf["bits"], bits)           # stored as given, bit-exact
        assert cf.tensors["ml"].dtype == "bf16"
        np.testing.assert_array_equal(cf.to_float32("ml"), [1.5, -3.25])
        assert cf.validate() == ["tensor 'bits': 1 non-finite values"]


def test_writer_any_order_chunked_and_raw(tmp_path, monkeypatch):
    t = small()
    p = tmp_path / "w.colibri"
    with ColibriWriter(p, specs_for(t), {}, n_layers=0, n_experts=0) as w:
        w.write("b", quant.encode(t["b"][0], "q4", G), raw=True)   # pre-encoded bytes
        w.write("a", t["a"][0])
    with ColibriFile(p) as cf:
        np.testing.assert_array_equal(cf["a"], t["a"][0])
        assert bytes(cf.buffer[cf.tensors["b"].offset:][:cf.tensors["b"].nbytes]) == \
            encoded(t["b"][0], "q4", G)
        assert cf.verify_checksums() == []
    # A tensor larger than one write chunk goes out in several chunks, same bytes.
    big = np.random.default_rng(2).standard_normal((300, 64)).astype(np.float32)
    calls = []
    real = quant.encode
    monkeypatch.setattr(quant, "encode", lambda *a, **k: calls.append(1) or real(*a, **k))
    monkeypatch.setattr(fmt.writer, "_WRITE_CHUNK", 64 * 4 * 7)  # 7 rows
    save(tmp_path / "big.colibri", {"x": (big, "q8")}, group_size=G)
    assert len(calls) == 43                     # ceil(300 / 7) chunks
    with ColibriFile(tmp_path / "big.colibri") as cf:
        assert bytes(cf.buffer[cf.tensors["x"].offset:][:cf.tensors["x"].nbytes]) == \
            encoded(big, "q8", G)


def test_checksums_off(tmp_path):
    save(tmp_path / "n.colibri", {"a": np.ones(3, np.float32)}, checksums=False)
    with ColibriFile(tmp_path / "n.colibri") as cf:
        assert cf.header["flags"] == 0 and cf.tensors["a"].crc32 is None
        assert cf.verify_checksums() == []


def listing(folder: Path) -> list[str]:
    return sorted(os.listdir(folder))


def test_exception_mid_write_leaves_nothing(tmp_path):
    t = small()
    p = tmp_path / "x.colibri"
    with pytest.raises(RuntimeError, match="boom"):
        with ColibriWriter(p, specs_for(t), {}, n_layers=0, n_experts=0) as w:
            w.write("a", t["a"][0])
            tmp = [f for f in listing(tmp_path) if f.startswith(".x.colibri.tmp-")]
            assert len(tmp) == 1                     # temp lives beside the destination
            raise RuntimeError("boom")
    assert listing(tmp_path) == []


def test_existing_destination_untouched_on_failure(tmp_path):
    t = small()
    p = tmp_path / "x.colibri"
    p.write_bytes(b"old contents")
    with pytest.raises(ValueError, match="never written"):
        with ColibriWriter(p, specs_for(t), {}, n_layers=0, n_experts=0, overwrite=True) as w:
            w.write("a", t["a"][0])               # "b" missing: finish() must refuse
    assert p.read_bytes() == b"old contents" and listing(tmp_path) == ["x.colibri"]
    w = ColibriWriter(p, specs_for(t), {}, n_layers=0, n_experts=0, overwrite=True)
    w.abort()
    w.abort()
    assert listing(tmp_path) == ["x.colibri"]
    w = ColibriWriter(p, specs_for(t), {}, n_layers=0, n_experts=0, overwrite=True)
    del w                                         # dropped without finish: temp removed
    assert listing(tmp_path) == ["x.colibri"]


def test_refuses_overwrite_by_default(tmp_path):
    p = tmp_path / "x.colibri"
    save(p, {"a": np.zeros(3, np.float32)})
    before = p.read_bytes()
    with pytest.raises(FileExistsError, match="overwrite"):
        save(p, {"a": np.ones(3, np.float32)})
    assert p.read_bytes() == before and listing(tmp_path) == ["x.colibri"]
    # overwrite=True replaces by rename: a reader of the old file keeps its old data.
    with ColibriFile(p) as old:
        view = old["a"]
        save(p, {"a": np.ones(3, np.float32)}, overwrite=True)
        np.testing.assert_array_equal(view, 0)
        with ColibriFile(p) as new:
            np.testing.assert_array_equal(new["a"], 1)
    assert listing(tmp_path) == ["x.colibri"]


def test_destination_appearing_during_write_is_not_clobbered(tmp_path):
    t = small()
    p = tmp_path / "x.colibri"
    w = ColibriWriter(p, specs_for(t), {}, n_layers=0, n_experts=0)
    for name, (a, _) in t.items():
        w.write(name, a)
    p.write_bytes(b"someone else's")
    with pytest.raises(FileExistsError, match="appeared while writing"):
        w.finish()
    assert p.read_bytes() == b"someone else's" and listing(tmp_path) == ["x.colibri"]


@pytest.mark.parametrize("specs, match", [
    ([TensorSpec("x" * 96, "f32", (2,))], "1..95"),
    ([TensorSpec("é" * 48, "f32", (2,))], "1..95"),              # 96 UTF-8 bytes
    ([TensorSpec("", "f32", (2,))], "1..95"),
    ([TensorSpec("a\0b", "f32", (2,))], "NUL"),
    ([TensorSpec("a", "f32", (2,)), TensorSpec("a", "f32", (3,))], "duplicate"),
    ([TensorSpec("a", "f64", (2,))], "unknown dtype"),
    ([TensorSpec("a", "f32", (2, 0))], "positive"),
    ([TensorSpec("a", "f32", ())], "1..4"),
    ([TensorSpec("a", "f32", (1, 1, 1, 1, 1))], "1..4"),
    ([TensorSpec("a", "q4", (2, 48), 32)], "divide"),
    ([TensorSpec("a", "q8", (2, 64), 16)], "multiple of 32"),
    ([TensorSpec("a", "q8", (2, 64), 0)], "multiple of 32"),
    ([TensorSpec("a", "f32", (2, 64), 32)], "group_size"),
    ([TensorSpec("layers.0.moe.router", "f32", (3, 4))], "does not match its name"),
    ([TensorSpec("w", "f32", (3, 4), role="router", layer=0)], "does not match its name"),
    ([TensorSpec.infer("layers.0.moe.experts.0.w_gate", "f32", (2, 4))], "missing"),
    ([TensorSpec.infer(f"layers.0.moe.experts.{e}.{p}", "f32", (2, 4 + e))
      for e in range(2) for p in ("w_gate", "w_up", "w_down")], "differs from expert 0"),
])
def test_writer_rejects_bad_specs(tmp_path, specs, match):
    with pytest.raises(ValueError, match=match):
        ColibriWriter(tmp_path / "x.colibri", specs, {}, n_layers=1 if any(
            s.name.startswith("layers.") for s in specs) else 0, n_experts=2)
    assert listing(tmp_path) == []


def test_writer_rejects_bad_counts_metadata_and_writes(tmp_path):
    spec = [TensorSpec("layers.1.x", "f32", (2,))]
    with pytest.raises(ValueError, match="n_layers"):
        ColibriWriter(tmp_path / "x.colibri", spec, {}, n_layers=3, n_experts=0)
    for meta in ({"config": []}, {"user": {"a": 1}}, {"tokenizer": {"x": 1}}, [1],
                 {"x": float("nan")}):
        with pytest.raises(ValueError):
            ColibriWriter(tmp_path / "x.colibri", spec, meta, n_layers=2, n_experts=0)
    assert listing(tmp_path) == []
    with ColibriWriter(tmp_path / "x.colibri", spec, {}, n_layers=2, n_experts=0) as w:
        with pytest.raises(ValueError, match="shape"):
            w.write("layers.1.x", np.zeros(3, np.float32))
        with pytest.raises(KeyError):
            w.write("nope", np.zeros(2, np.float32))
        with pytest.raises(ValueError, match="raw"):
            w.write("layers.1.x", np.zeros(7, np.uint8), raw=True)
        w.write("layers.1.x", np.zeros(2, np.float32))
        with pytest.raises(ValueError, match="twice"):
            w.write("layers.1.x", np.zeros(2, np.float32))
    assert listing(tmp_path) == ["x.colibri"]
