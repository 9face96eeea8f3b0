"""The .colibri reader and writer: round trips, layout, atomic writes, hostile files.

Field offsets below are written out from the format specification (docs/format.md), not
taken from colibri.format, so a drift between the code and the spec fails here.
"""
from __future__ import annotations

import json
import os
import re
import struct
import time
import tracemalloc
import zlib
from pathlib import Path

import numpy as np
import pytest

from colibri import dtypes, quant
from colibri.errors import ColibriError, ColibriFormatError
from colibri.format import (
    ColibriFile, ColibriWriter, QuantizedTensor, TensorSpec, save,
)
from colibri import format as fmt

# ------------------------------------------------------------------------------ the spec

HEADER = {  # field: (offset, struct code)
    "magic": (0x00, "4s"), "version": (0x04, "I"), "n_experts": (0x08, "I"),
    "n_layers": (0x0C, "I"), "header_size": (0x10, "I"), "tensor_count": (0x14, "I"),
    "routing_offset": (0x18, "Q"), "data_offset": (0x20, "Q"), "table_offset": (0x28, "Q"),
    "record_size": (0x30, "I"), "alignment": (0x34, "I"), "expert_index_offset": (0x38, "Q"),
    "expert_record_size": (0x40, "I"), "expert_count": (0x44, "I"),
    "metadata_offset": (0x48, "Q"), "metadata_size": (0x50, "Q"), "file_size": (0x58, "Q"),
    "page_size": (0x60, "I"), "flags": (0x64, "I"), "reserved": (0x68, "20s"),
    "header_crc32": (0x7C, "I"),
}
RECORD = {
    "name": (0, "96s"), "dtype": (96, "B"), "ndim": (97, "B"), "reserved": (98, "H"),
    "group_size": (100, "I"), "shape0": (104, "Q"), "shape1": (112, "Q"),
    "shape2": (120, "Q"), "shape3": (128, "Q"), "offset": (136, "Q"), "nbytes": (144, "Q"),
    "crc32": (152, "I"), "flags": (156, "I"),
}
EXPERT = {"layer": (0, "I"), "expert": (4, "I"), "offset": (8, "Q"), "size": (16, "Q"),
          "reserved": (24, "Q")}
CODES = {"f32": 0, "f16": 1, "bf16": 2, "q8": 3, "q4": 4, "i32": 5}
G = 32


def get(buf, base: int, table: dict, field: str):
    off, code = table[field]
    return struct.unpack_from("<" + code, buf, base + off)[0]


def put(buf: bytearray, base: int, table: dict, field: str, value) -> None:
    off, code = table[field]
    struct.pack_into("<" + code, buf, base + off, value)


def fix_crc(buf: bytearray) -> bytearray:
    struct.pack_into("<I", buf, 0x7C, zlib.crc32(bytes(buf[:0x7C])))
    return buf


def set_header(buf: bytes, field: str, value, crc: bool = True) -> bytearray:
    out = bytearray(buf)
    put(out, 0, HEADER, field, value)
    return fix_crc(out) if crc else out


def record_base(buf, i: int) -> int:
    return get(buf, 0, HEADER, "table_offset") + 160 * i


def expert_base(buf, k: int) -> int:
    return get(buf, 0, HEADER, "expert_index_offset") + 32 * k


def record_index(buf, name: str) -> int:
    for i in range(get(buf, 0, HEADER, "tensor_count")):
        raw = bytes(buf[record_base(buf, i): record_base(buf, i) + 96])
        if raw.split(b"\0")[0] == name.encode():
            return i
    raise KeyError(name)


def set_record(buf: bytes, name_or_index, field: str, value) -> bytearray:
    out = bytearray(buf)
    i = name_or_index if isinstance(name_or_index, int) else record_index(out, name_or_index)
    put(out, record_base(out, i), RECORD, field, value)
    return out


def write(path: Path, data: bytes) -> None:
    """Replace path's contents. (Not open(..., "wb"): on ext4 a truncate-to-zero rewrite
    is flushed on close, 3 ms a file, which the thousands of hostile files here would feel.)"""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT, 0o644)
    try:
        os.pwrite(fd, bytes(data), 0)
        os.ftruncate(fd, len(data))
    finally:
        os.close(fd)


def expect_error(path: Path, data: bytes, *fragments: str) -> str:
    """Write data to path; opening it must raise ColibriFormatError naming the file and
    containing every fragment (case-insensitive)."""
    write(path, data)
    with pytest.raises(ColibriFormatError) as info:
        ColibriFile(path)
    msg = str(info.value)
    assert str(path) in msg
    for f in fragments:
        assert f.lower() in msg.lower(), (f, msg)
    return msg


# ------------------------------------------------------------------------------ fixtures

D, I, E, L, V = 64, 32, 3, 2, 11   # hidden, expert intermediate, experts, layers, vocab


def model_tensors(seed: int = 0, expert_dtypes=("q4", "bf16")) -> dict:
    rng = np.random.default_rng(seed)
    r = lambda *s: rng.standard_normal(s).astype(np.float32)  # noqa: E731
    t: dict = {"tok_embeddings": (r(V, D), "f16")}
    for layer in range(L):
        t[f"layers.{layer}.attn_norm"] = r(D)
        t[f"layers.{layer}.attn.wq"] = (r(D, D), "q8")
        t[f"layers.{layer}.attn.bq"] = r(7)
        t[f"layers.{layer}.moe.router"] = r(E, D)
        for e in range(E):
            for proj, shape in (("w_gate", (I, D)), ("w_up", (I, D)), ("w_down", (D, I))):
                t[f"layers.{layer}.moe.experts.{e}.{proj}"] = (r(*shape), expert_dtypes[layer])
    t["norm"] = r(D)
    t["lm_head"] = r(V, D)
    t["positions"] = np.arange(5, dtype=np.int32) - 2
    return t


METADATA = {
    "config": {"model_type": "toy", "hidden_size": D, "ünïcode": "γειά σου ✓"},
    "arch": {"family": "toy", "vocab_size": V, "hidden_size": D, "num_hidden_layers": L,
             "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16,
             "num_experts": E, "num_experts_per_tok": 2, "moe_intermediate_size": I},
    "tokenizer": {"files": {"tokenizer.json": "{\"version\": \"1.0\"}"}},
    "user": {"licence": "apache-2.0", "note": "日本語"},
    "converter": {"colibri_version": "0.1.0"},
}


@pytest.fixture(scope="module")
def model_path(tmp_path_factory) -> Path:
    p = tmp_path_factory.mktemp("model") / "toy.colibri"
    save(p, model_tensors(), METADATA, group_size=G)
    return p


@pytest.fixture(scope="module")
def model_bytes(model_path) -> bytes:
    return model_path.read_bytes()


# ------------------------------------------------------------------------------ round trips

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


def test_metadata_roundtrip(model_path):
    with ColibriFile(model_path) as cf:
        assert cf.metadata == METADATA
        assert list(cf.metadata) == list(METADATA)                 # order kept
        assert cf.config == METADATA["config"] and cf.arch == METADATA["arch"]
        assert cf.user_metadata == METADATA["user"]
        assert cf.tokenizer_files == METADATA["tokenizer"]["files"]
        raw = bytes(cf.buffer[cf.header["metadata_offset"]:][:cf.header["metadata_size"]])
        assert "γειά".encode() in raw                              # ensure_ascii=False


def test_empty_file_is_valid(tmp_path):
    p = tmp_path / "empty.colibri"
    save(p, {}, {"user": {"a": "b"}})
    with ColibriFile(p) as cf:
        assert len(cf.tensors) == 0 and cf.names() == []
        assert cf.file_size == cf.header["data_offset"] == 4096 == os.path.getsize(p)
        assert cf.header["routing_offset"] == 4096 and cf.user_metadata == {"a": "b"}
        assert cf.tokenizer_files is None and cf.config == {}
        assert cf.validate() == []


def test_reader_api(model_path):
    cf = fmt.open(model_path)
    st = os.stat(model_path)
    assert cf.identity == (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns)
    assert (cf.version, cf.n_layers, cf.n_experts, cf.file_size) == (1, L, E, st.st_size)
    assert "norm" in cf and "nope" not in cf and len(cf) == len(model_tensors())
    assert cf.names() == list(cf.tensors)
    with pytest.raises(KeyError, match="nope"):
        cf.tensor("nope")
    with pytest.raises(KeyError):
        cf.expert_block(0, E)
    with pytest.raises(ValueError, match="which"):
        cf.expert_stack(0, "w_sideways")
    assert cf.buffer.readonly and len(cf.buffer) == cf.file_size
    np.testing.assert_array_equal(cf.to_float32("positions"), np.arange(5) - 2)


def test_close_keeps_views_alive(model_path):
    cf = ColibriFile(model_path)
    view, stack = cf.tensor("lm_head"), cf.expert_stack(1, "w_up")
    qstack = cf.expert_stack(0, "w_down")
    head = cf.buffer[:4]
    copy, qcopy = view.copy(), qstack.dequantize()
    cf.close()
    cf.close()                                  # idempotent
    np.testing.assert_array_equal(view, copy)   # still mapped: the view holds the mapping
    np.testing.assert_array_equal(qstack.dequantize(), qcopy)
    assert bytes(head) == b"COLI"
    assert stack.shape == (E, I, D)
    with pytest.raises(ColibriError, match="closed"):
        cf.tensor("lm_head")
    with ColibriFile(model_path) as cf2:
        pass
    assert cf2.buffer is None


# ------------------------------------------------------------------------------ experts


@pytest.mark.parametrize("layer", range(L))
def test_expert_stack_is_a_zero_copy_strided_view(model_path, layer):
    with ColibriFile(model_path) as cf:
        for which in ("w_gate", "w_up", "w_down"):
            stack = cf.expert_stack(layer, which)
            singles = [cf.tensor(f"layers.{layer}.moe.experts.{e}.{which}") for e in range(E)]
            stride = cf.expert_stride(layer)
            assert stride % 4096 == 0
            if isinstance(stack, QuantizedTensor):
                assert stack.shape == (E,) + singles[0].shape
                for e in range(E):
                    np.testing.assert_array_equal(stack.data[e], singles[e].data)
                    np.testing.assert_array_equal(stack.scales[e], singles[e].scales)
                assert stack.data.strides[0] == stride
                assert np.shares_memory(stack.data, singles[1].data)
                np.testing.assert_array_equal(
                    stack.dequantize(), np.stack([s.dequantize() for s in singles]))
            else:
                assert stack.shape == (E,) + singles[0].shape and stack.strides[0] == stride
                np.testing.assert_array_equal(stack, np.stack(singles))
                assert np.shares_memory(stack, singles[2]) and not stack.flags.writeable


def test_layout(model_path, model_bytes):
    buf = model_bytes
    h = {f: get(buf, 0, HEADER, f) for f in HEADER}
    n = h["tensor_count"]
    assert h["magic"] == b"COLI" and h["version"] == 1 and h["header_size"] == 128
    assert (h["record_size"], h["alignment"], h["page_size"], h["expert_record_size"]) == (
        160, 64, 4096, 32)
    assert h["table_offset"] == 128
    assert h["expert_index_offset"] == -(-(128 + 160 * n) // 8) * 8
    assert h["expert_count"] == L * E
    assert h["metadata_offset"] == h["expert_index_offset"] + 32 * L * E
    meta = buf[h["metadata_offset"]: h["metadata_offset"] + h["metadata_size"]]
    assert json.loads(meta.decode()) == METADATA
    assert h["data_offset"] == -(-(h["metadata_offset"] + h["metadata_size"]) // 4096) * 4096
    assert not any(buf[h["metadata_offset"] + h["metadata_size"]: h["data_offset"]])
    assert h["file_size"] == len(buf) and h["flags"] == 1 and h["reserved"] == bytes(20)
    assert h["header_crc32"] == zlib.crc32(buf[:0x7C])

    recs = []
    for i in range(n):
        b = record_base(buf, i)
        name = buf[b: b + 96].split(b"\0")[0].decode()
        recs.append((get(buf, b, RECORD, "offset"), get(buf, b, RECORD, "nbytes"), name))
    assert recs == sorted(recs), "table is in file order"
    for off, nb, name in recs:
        assert off % 64 == 0, name
    for (o0, n0, _), (o1, _, _) in zip(recs, recs[1:]):
        assert o1 >= o0 + n0                               # no overlap
    assert recs[-1][0] + recs[-1][1] == len(buf)          # ends at the last tensor
    names = [r[2] for r in recs]
    # Routing section first, in layer order, starting at data_offset; then the dense tensors
    # in the order given; then the expert blocks layer by layer, expert by expert.
    assert names[:L] == [f"layers.{i}.moe.router" for i in range(L)]
    assert recs[0][0] == h["routing_offset"] == h["data_offset"]
    given = [k for k in model_tensors() if ".moe." not in k]
    assert names[L: L + len(given)] == given
    experts = [f"layers.{la}.moe.experts.{e}.{p}" for la in range(L) for e in range(E)
               for p in ("w_gate", "w_up", "w_down")]
    assert names[L + len(given):] == experts
    offs = {name: (o, nb) for o, nb, name in recs}
    with ColibriFile(model_path) as cf:
        for la in range(L):
            blocks = []
            for e in range(E):
                b = expert_base(buf, la * E + e)
                rec = {f: get(buf, b, EXPERT, f) for f in EXPERT}
                assert (rec["layer"], rec["expert"], rec["reserved"]) == (la, e, 0)
                gate = offs[f"layers.{la}.moe.experts.{e}.w_gate"]
                down = offs[f"layers.{la}.moe.experts.{e}.w_down"]
                assert rec["offset"] % 4096 == 0 and rec["offset"] == gate[0]
                assert rec["size"] == down[0] + down[1] - gate[0]
                assert cf.expert_block(la, e) == (rec["offset"], rec["size"])
                blocks.append((rec["offset"], rec["size"]))
            sizes = {s for _, s in blocks}
            strides = {b1[0] - b0[0] for b0, b1 in zip(blocks, blocks[1:])}
            assert len(sizes) == 1 and strides == {-(-sizes.pop() // 4096) * 4096}


# ------------------------------------------------------------------------------ writer


def specs_for(tensors: dict) -> list[TensorSpec]:
    return [TensorSpec.infer(n, d, a.shape, G if d in ("q8", "q4") else 0)
            for n, (a, d) in tensors.items()]


def small() -> dict:
    rng = np.random.default_rng(1)
    return {"a": (rng.standard_normal((4, 64)).astype(np.float32), "f32"),
            "b": (rng.standard_normal((2, 64)).astype(np.float32), "q4")}


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


# ------------------------------------------------------------------------------ hostile files


def test_truncation_everywhere(tmp_path, model_bytes):
    buf = model_bytes
    p = tmp_path / "t.colibri"
    preamble = get(buf, 0, HEADER, "metadata_offset") + get(buf, 0, HEADER, "metadata_size")
    points = list(range(preamble + 1)) + list(range(preamble, len(buf), 97)) + \
        [len(buf) - k for k in (1, 2, 3, 63, 64, 65)]
    for n in points:
        msg = expect_error(p, buf[:n])
        assert ("truncated" in msg) or ("empty file" in msg and n == 0), (n, msg)
    # The same cuts with file_size patched to match: the deeper checks must catch it.
    for n in range(0x80, len(buf), 61):
        expect_error(p, set_header(buf[:n], "file_size", n))


def bad_values(field: str, value, size: int):
    bits = {"I": 32, "Q": 64}[HEADER[field][1]]
    cand = {0, 1, value + 1, value - 1, value + 64, value + 4096, value - 4096,
            2**bits - 1, 2**(bits - 1), size, size + 4096}
    return sorted(v for v in cand if 0 <= v < 2**bits and v != value)


def test_every_header_field_overwritten(tmp_path, model_bytes):
    p = tmp_path / "h.colibri"
    buf = model_bytes
    n_cases = 0
    for field, (off, code) in HEADER.items():
        value = get(buf, 0, HEADER, field)
        if code == "4s":
            values = [b"GGUF", b"coli", b"\0\0\0\0", b"COLJ"]
        elif code == "20s":
            values = [b"\1" + bytes(19), bytes(19) + b"\xff"]
        else:
            values = bad_values(field, value, len(buf))
        for v in values:
            for crc in (True, False):
                if field == "header_crc32" and crc:
                    continue
                expect_error(p, set_header(buf, field, v, crc=crc))
                n_cases += 1
    assert n_cases > 150


def test_every_header_bit_flipped(tmp_path, model_bytes):
    """All 1024 single-bit flips of the header are rejected, whether or not the header CRC
    is recomputed to match (every field is either fixed or cross-checked)."""
    p = tmp_path / "b.colibri"
    for bit in range(128 * 8):
        flipped = bytearray(model_bytes)
        flipped[bit // 8] ^= 1 << (bit % 8)
        expect_error(p, flipped)
        if bit < 0x7C * 8:
            expect_error(p, fix_crc(flipped))


@pytest.mark.parametrize("field, value, fragment", [
    ("magic", b"GGUF", "magic"),
    ("version", 2, "newer colibri (format version 2, this reader supports 1)"),
    ("version", 1 << 24, "big-endian"),
    ("version", 0, "version 0"),
    ("header_size", 256, "header_size is 256, expected 128"),
    ("record_size", 128, "record_size"),
    ("expert_record_size", 40, "expert_record_size"),
    ("alignment", 32, "alignment"),
    ("page_size", 16384, "page_size"),
    ("flags", 3, "unknown bits"),
    ("flags", 0, "crc32 but header flags"),
    ("reserved", b"x" + bytes(19), "reserved"),
    ("file_size", 12345, "file_size"),
    ("tensor_count", 2**32 - 1, "tensor_count 4294967295"),
    ("expert_count", 2**32 - 1, "expert_count 4294967295"),
    ("metadata_size", 2**64 - 1, "metadata"),
    ("table_offset", 0, "tensor table"),
    ("table_offset", 132, "multiple of 8"),
    ("expert_index_offset", 2**64 - 8, "expert index"),
    ("metadata_offset", 2**63, "metadata"),
    ("data_offset", 3, "data_offset"),
    ("data_offset", 2**64 - 4096, "data_offset"),
    ("routing_offset", 2**64 - 64, "routing_offset"),
    ("n_layers", 2**32 - 1, "n_layers"),
    ("n_experts", E + 1, "missing"),
    ("n_experts", E - 1, "out of range"),
])
def test_header_field_errors_name_the_problem(tmp_path, model_bytes, field, value, fragment):
    expect_error(tmp_path / "h.colibri", set_header(model_bytes, field, value), fragment)


def test_header_crc_mismatch(tmp_path, model_bytes):
    bad = bytearray(model_bytes)
    bad[0x08] ^= 1                                      # n_experts, crc not recomputed
    expect_error(tmp_path / "c.colibri", bad, "header checksum mismatch")


def test_huge_count_in_tiny_file_fails_fast_without_allocating(tmp_path):
    hdr = bytearray(128)
    for field, v in (("magic", b"COLI"), ("version", 1), ("header_size", 128),
                     ("tensor_count", 2**32 - 1), ("data_offset", 4096), ("table_offset", 128),
                     ("record_size", 160), ("alignment", 64), ("expert_record_size", 32),
                     ("expert_index_offset", 2**40), ("metadata_offset", 300),
                     ("file_size", 200), ("page_size", 4096), ("routing_offset", 4096)):
        put(hdr, 0, HEADER, field, v)
    for size in (200, 8192):
        data = set_header(bytes(hdr) + bytes(size - 128), "file_size", size)
        tracemalloc.start()
        t0 = time.perf_counter()
        expect_error(tmp_path / "huge.colibri", data, "does not fit" if size > 4096 else
                     "data_offset")
        elapsed = time.perf_counter() - t0
        peak = tracemalloc.get_traced_memory()[1]
        tracemalloc.stop()
        assert elapsed < 0.5 and peak < 2 * size + 65536, (elapsed, peak)


def test_foreign_files(tmp_path):
    st = pytest.importorskip("safetensors.numpy")
    p = tmp_path / "model.safetensors"
    st.save_file({"w": np.ones((2, 2), np.float32)}, str(p))
    with pytest.raises(ColibriFormatError, match="safetensors"):
        ColibriFile(p)
    gguf = b"GGUF" + struct.pack("<IQQ", 3, 0, 0) + bytes(200)
    expect_error(tmp_path / "m.gguf", gguf, "GGUF", "expected magic b'COLI'")
    expect_error(tmp_path / "empty.colibri", b"", "empty file")
    expect_error(tmp_path / "three.colibri", b"COL", "truncated header")
    expect_error(tmp_path / "hdr.colibri", b"COLI" + bytes(60), "truncated header")
    expect_error(tmp_path / "text.colibri", b"hello world\n" * 20, "not a colibri file")
    (tmp_path / "dir.colibri").mkdir()
    with pytest.raises(ColibriFormatError, match="directory"):
        ColibriFile(tmp_path / "dir.colibri")
    with pytest.raises(FileNotFoundError):
        ColibriFile(tmp_path / "missing.colibri")


DENSE = "lm_head"              # f32 (V, D)
ROUTER = "layers.1.moe.router"
EXPERT0 = "layers.0.moe.experts.0.w_gate"


@pytest.mark.parametrize("target, field, value, fragment", [
    (DENSE, "dtype", 6, "unknown dtype code 6"),
    (DENSE, "dtype", 255, "unknown dtype code 255"),
    (DENSE, "dtype", CODES["f16"], "nbytes"),
    (DENSE, "dtype", CODES["q8"], "group_size 0"),
    (DENSE, "ndim", 0, "ndim 0"),
    (DENSE, "ndim", 5, "ndim 5"),
    (DENSE, "ndim", 1, "unused shape entries"),
    (DENSE, "ndim", 3, "zero dimension"),
    (DENSE, "reserved", 1, "reserved"),
    (DENSE, "group_size", 32, "must be 0"),
    (DENSE, "flags", 2, "unknown bits"),
    (DENSE, "shape0", 0, "zero dimension"),
    (DENSE, "shape0", 2**62, "more than the file has"),
    (DENSE, "shape0", 2**64 - 1, "more than the file has"),
    (DENSE, "shape1", 2**62 + D, "more than the file has"),
    # 4 * (2^62 + 7) wraps to 28 in uint64: exactly bq's nbytes. Only exact math sees it.
    ("layers.0.attn.bq", "shape0", 2**62 + 7, "more than the file has"),
    ("layers.0.attn.bq", "shape0", 2**63 + 7, "more than the file has"),
    (DENSE, "shape2", 5, "unused shape entries"),
    (DENSE, "shape3", 2**63, "unused shape entries"),
    (DENSE, "shape0", V + 1, "nbytes"),
    (DENSE, "nbytes", V * D * 4 + 4, "nbytes"),
    (DENSE, "nbytes", 2**64 - 1, "past the end"),
    (DENSE, "offset", 1, "alignment"),
    (DENSE, "offset", 2**64 - 64, "past the end"),
    (DENSE, "offset", 2**63, "past the end"),
    (DENSE, "offset", 64, "before data_offset"),
    (ROUTER, "offset", 4096 * 1000, "past the end"),
    # 2^64-1 columns: uint64 % int64 in NumPy goes through float64 and "divides" by 32.
    ("layers.0.attn.wq", "shape1", 2**64 - 1, "group_size 32 invalid"),
    ("layers.0.attn.wq", "group_size", 48, "group_size 48"),
    ("layers.0.attn.wq", "group_size", 128, "group_size 128"),
    ("layers.0.attn.wq", "group_size", 0, "group_size 0"),
    ("layers.0.attn.wq", "group_size", 64, "nbytes"),
    ("layers.0.attn.wq", "dtype", CODES["q4"], "nbytes"),
    (EXPERT0, "group_size", 64, "nbytes"),
])
def test_bad_record_fields(tmp_path, model_bytes, target, field, value, fragment):
    msg = expect_error(tmp_path / "r.colibri", set_record(model_bytes, target, field, value),
                       fragment)
    assert repr(target) in msg        # the error names the tensor


def test_overlapping_and_misplaced_offsets(tmp_path, model_bytes):
    p = tmp_path / "o.colibri"
    buf = model_bytes

    def off(name: str) -> int:
        return get(buf, record_base(buf, record_index(buf, name)), RECORD, "offset")

    # Point lm_head at the norm: both ranges overlap.
    expect_error(p, set_record(buf, DENSE, "offset", off("norm")), "overlaps")
    # Move the router by one alignment step into its neighbour.
    expect_error(p, set_record(buf, "layers.0.moe.router", "offset",
                               off("layers.0.moe.router") + 64), "overlaps")
    # Swap two dense offsets of different sizes: sizes no longer fit.
    b2 = set_record(buf, "norm", "offset", off(DENSE))
    expect_error(p, set_record(b2, DENSE, "offset", off("norm")))
    # Routing offset pointing at the second router instead of the first.
    expect_error(p, set_header(buf, "routing_offset", off(ROUTER)), "routing_offset")


@pytest.mark.parametrize("mutate, fragment", [
    (lambda raw: b"\xff\xfe" + raw[2:], "not valid UTF-8"),
    (lambda raw: b"a" * 96, "no NUL terminator"),
    (lambda raw: raw[:90] + b"junk!!", "non-NUL padding"),
    (lambda raw: bytes(96), "empty name"),
    (lambda raw: b"norm".ljust(96, b"\0"), "duplicate tensor name 'norm'"),
    (lambda raw: b"layers.7.x".ljust(96, b"\0"), "n_layers"),
    (lambda raw: b"layers.0.moe.experts.9.w_up".ljust(96, b"\0"), "without an expert index"),
])
def test_bad_names(tmp_path, model_bytes, mutate, fragment):
    buf = bytearray(model_bytes)
    b = record_base(buf, record_index(buf, DENSE))
    buf[b: b + 96] = mutate(bytes(buf[b: b + 96]))
    assert len(buf) == len(model_bytes)
    expect_error(tmp_path / "n.colibri", buf, fragment)


def set_expert(buf: bytes, k: int, field: str, value) -> bytearray:
    out = bytearray(buf)
    put(out, expert_base(out, k), EXPERT, field, value)
    return out


@pytest.mark.parametrize("k, field, value, fragment", [
    (0, "layer", L, "out of range"),
    (0, "layer", 2**32 - 1, "out of range"),
    (1, "expert", E, "out of range"),
    (1, "expert", 0, "duplicate block"),
    (0, "offset", 4096 * 3 + 64, "multiple of 4096"),
    (0, "offset", 2**64 - 4096, "does not cover"),
    (2, "size", 64, "does not cover"),
    (2, "size", 2**64 - 1, "does not cover"),
    (0, "reserved", 1, "reserved"),
])
def test_bad_expert_index(tmp_path, model_bytes, k, field, value, fragment):
    expect_error(tmp_path / "e.colibri", set_expert(model_bytes, k, field, value), fragment)


def test_expert_index_consistency(tmp_path, model_path, model_bytes):
    p = tmp_path / "e.colibri"
    buf = model_bytes
    # Index records may come in any order.
    swapped = bytearray(buf)
    a, b = expert_base(buf, 0), expert_base(buf, 4)
    swapped[a: a + 32], swapped[b: b + 32] = buf[b: b + 32], buf[a: a + 32]
    p.write_bytes(swapped)
    with ColibriFile(p) as cf, ColibriFile(model_path) as ref:
        for la in range(L):
            for e in range(E):
                assert cf.expert_block(la, e) == ref.expert_block(la, e)
    # A record pointing at another expert's block (layer 0 expert 1 -> expert 2's block).
    e2 = get(buf, expert_base(buf, 2), EXPERT, "offset")
    expect_error(p, set_expert(buf, 1, "offset", e2), "does not cover")
    # One record fewer: its tensors lose their record and the layer an expert.
    fewer = set_header(buf, "expert_count", L * E - 1)
    expect_error(p, fewer)
    # Expert tensors with a different shape in one expert of the layer.
    i = record_index(buf, "layers.1.moe.experts.2.w_up")
    b1 = set_record(buf, i, "shape0", D)
    b1 = set_record(b1, i, "shape1", I)
    expect_error(p, b1, "differs from expert 0")
    # w_up and w_down of an expert swapped in position: not in block order.
    iu = record_index(buf, "layers.0.moe.experts.1.w_up")
    idn = record_index(buf, "layers.0.moe.experts.1.w_down")
    ou = get(buf, record_base(buf, iu), RECORD, "offset")
    od = get(buf, record_base(buf, idn), RECORD, "offset")
    b2 = set_record(set_record(buf, iu, "offset", od), idn, "offset", ou)
    expect_error(p, b2, "not consecutive")


def test_expert_stride_must_be_constant(tmp_path, model_bytes):
    """Move the last expert block of the last layer one page later (data, records and index
    shifted together): every block still covers its tensors, but the stride breaks."""
    buf = model_bytes
    k = L * E - 1
    boff = get(buf, expert_base(buf, k), EXPERT, "offset")
    moved = bytearray(buf[:boff] + bytes(4096) + buf[boff:])
    put(moved, expert_base(moved, k), EXPERT, "offset", boff + 4096)
    for p in ("w_gate", "w_up", "w_down"):
        b = record_base(moved, record_index(moved, f"layers.{L - 1}.moe.experts.{E - 1}.{p}"))
        put(moved, b, RECORD, "offset", get(moved, b, RECORD, "offset") + 4096)
    moved = set_header(moved, "file_size", len(moved))
    expect_error(tmp_path / "s.colibri", moved, "constant stride")


def test_data_section_starts_at_data_offset(tmp_path):
    p = tmp_path / "one.colibri"
    save(p, {"a": np.ones(16, np.float32)})
    buf = p.read_bytes()
    assert len(buf) == 4096 + 64
    # The tensor moved 64 bytes later, the file extended with zeros: nothing overlaps, but
    # the data section no longer starts with a tensor.
    later = set_record(buf[:4096] + bytes(64) + buf[4096:], "a", "offset", 4096 + 64)
    expect_error(p, set_header(later, "file_size", len(later)), "first tensor")
    # An empty file with an extra page of padding before its (empty) data section.
    save(p, {}, overwrite=True)
    empty = p.read_bytes()
    padded = set_header(set_header(empty + bytes(4096), "data_offset", 8192), "file_size", 8192)
    padded = set_header(padded, "routing_offset", 8192)
    expect_error(p, padded, "data_offset 8192 should be the first multiple of 4096")


def test_metadata_errors(tmp_path, model_bytes):
    p = tmp_path / "m.colibri"
    mo, ms = get(model_bytes, 0, HEADER, "metadata_offset"), \
        get(model_bytes, 0, HEADER, "metadata_size")

    def with_meta(raw: bytes) -> bytearray:
        raw = raw.ljust(ms, b" ")
        assert len(raw) == ms
        out = bytearray(model_bytes)
        out[mo: mo + ms] = raw
        return out

    expect_error(p, with_meta(b"{not json"), "metadata")
    expect_error(p, with_meta(b'{"a": "\xff\xfe"}'), "UTF-8")
    expect_error(p, with_meta(b"[1, 2]"), "JSON object")
    expect_error(p, with_meta(b'{"a": NaN}'), "NaN")
    expect_error(p, with_meta(b'{"a": 1, "a": 2}'), "duplicate key 'a'")
    expect_error(p, with_meta(b'{"config": [1]}'), "'config' must be an object")
    expect_error(p, with_meta(b'{"user": {"k": 5}}'), "must be a string")
    expect_error(p, with_meta(b'{"tokenizer": {"files": [1]}}'), "tokenizer")
    expect_error(p, set_header(model_bytes, "metadata_size", ms - 1), "metadata")
    expect_error(p, set_header(model_bytes, "metadata_size", ms + 1), "metadata")


def test_deeply_nested_metadata(tmp_path):
    p = tmp_path / "deep.colibri"
    save(p, {"a": np.ones(2, np.float32)}, {"user": {"pad": "x" * 200_000}})
    buf = bytearray(p.read_bytes())
    mo, ms = get(buf, 0, HEADER, "metadata_offset"), get(buf, 0, HEADER, "metadata_size")
    buf[mo: mo + ms] = b"[" * ms                       # far beyond the recursion limit
    expect_error(p, buf, "metadata")


def test_trailing_bytes_and_padding(tmp_path, model_bytes):
    p = tmp_path / "tr.colibri"
    expect_error(p, model_bytes + b"\0", "trailing bytes")
    longer = set_header(model_bytes + b"\0" * 64, "file_size", len(model_bytes) + 64)
    expect_error(p, longer, "trailing bytes")
    # A payload hidden in the padding before the data section.
    hidden = bytearray(model_bytes)
    hidden[get(model_bytes, 0, HEADER, "data_offset") - 1] = 0x41
    expect_error(p, hidden, "padding")
    # Non-zero gap bytes inside the data section are not checked at open, but by validate().
    gap = bytearray(model_bytes)
    i = record_index(gap, "layers.0.attn.bq")         # 28 bytes: a 36-byte gap follows
    b = record_base(gap, i)
    end = get(gap, b, RECORD, "offset") + get(gap, b, RECORD, "nbytes")
    gap[end] = 1
    p.write_bytes(gap)
    with ColibriFile(p) as cf:
        problems = cf.validate()
        assert len(problems) == 1 and "padding" in problems[0]


def test_checksums_catch_data_corruption(tmp_path, model_bytes):
    p = tmp_path / "cs.colibri"
    buf = bytearray(model_bytes)
    b = record_base(buf, record_index(buf, "norm"))
    buf[get(buf, b, RECORD, "offset") + 5] ^= 0x10
    p.write_bytes(buf)
    with ColibriFile(p) as cf:                         # opens: data is not read at open
        assert cf.verify_checksums(progress=False) == ["norm"]
        assert any("crc32 mismatch" in x for x in cf.validate())


def test_nonfinite_scales_flagged(tmp_path, model_bytes):
    p = tmp_path / "nf.colibri"
    buf = bytearray(model_bytes)
    b = record_base(buf, record_index(buf, "layers.0.attn.wq"))
    off = get(buf, b, RECORD, "offset")
    struct.pack_into("<e", buf, off + D, float("inf"))   # first scale of row 0 (q8: D bytes)
    p.write_bytes(buf)
    with ColibriFile(p) as cf:
        problems = cf.validate()
        assert "tensor 'layers.0.attn.wq': 1 non-finite values" in problems


def touch_everything(cf: ColibriFile) -> None:
    for name in cf.names():
        v = cf.tensor(name)
        (v.data if isinstance(v, QuantizedTensor) else v).sum()
    for la in cf._blocks:
        for which in ("w_gate", "w_up", "w_down"):
            cf.expert_stack(la, which)


def test_random_byte_flip_fuzz(tmp_path):
    p0 = tmp_path / "seed.colibri"
    save(p0, model_tensors(seed=3), {"config": {"a": 1}}, group_size=G)
    buf = p0.read_bytes()
    data_offset = get(buf, 0, HEADER, "data_offset")
    preamble = get(buf, 0, HEADER, "metadata_offset") + get(buf, 0, HEADER, "metadata_size")
    rng = np.random.default_rng(20240601)
    p = tmp_path / "fuzz.colibri"
    opened = rejected = 0
    for trial in range(400):
        mutated = bytearray(buf)
        for _ in range(int(rng.integers(1, 4))):
            # Mostly the structure (header, table, index, metadata); some data bytes too.
            pos = int(rng.integers(0, preamble)) if rng.random() < 0.85 else \
                int(rng.integers(0, len(buf)))
            mutated[pos] = int(rng.integers(0, 256)) if rng.random() < 0.5 else \
                mutated[pos] ^ (1 << int(rng.integers(0, 8)))
        if rng.random() < 0.5:
            fix_crc(mutated)     # let the mutation reach the checks behind the header crc
        write(p, mutated)
        try:
            cf = ColibriFile(p)
        except ColibriFormatError as e:
            assert str(p) in str(e)
            rejected += 1
            continue
        opened += 1
        with cf:
            touch_everything(cf)
            changed = [i for i in range(data_offset, len(buf)) if mutated[i] != buf[i]] \
                if mutated[:data_offset] == buf[:data_offset] else []
            if changed:
                hit = [n for n, t in cf.tensors.items()
                       if any(t.offset <= i < t.offset + t.nbytes for i in changed)]
                assert set(hit) <= set(cf.verify_checksums())
                assert hit or cf.validate()          # a tensor byte or a gap byte changed
    assert rejected > 200 and opened > 10, (rejected, opened)


def test_structured_field_fuzz(tmp_path, model_bytes):
    """Random header / record / expert-index fields set to boundary values (header CRC
    recomputed): each file opens cleanly or raises ColibriFormatError."""
    rng = np.random.default_rng(7)
    buf = model_bytes
    n_t, n_e = get(buf, 0, HEADER, "tensor_count"), get(buf, 0, HEADER, "expert_count")
    tables = [(HEADER, lambda: 0), (RECORD, lambda: record_base(buf, int(rng.integers(n_t)))),
              (EXPERT, lambda: expert_base(buf, int(rng.integers(n_e))))]
    p = tmp_path / "sf.colibri"
    outcomes = {"rejected": 0, "opened": 0}
    for _ in range(300):
        mutated = bytearray(buf)
        for _ in range(int(rng.integers(1, 3))):
            table, base = tables[int(rng.integers(3))]
            field = list(table)[int(rng.integers(len(table)))]
            off, code = table[field]
            if code.endswith("s"):
                continue
            bits = struct.calcsize(code) * 8
            v = [0, 1, 31, 32, 64, 4096, 2**31, 2**32 - 1, 2**63, 2**64 - 1,
                 int(rng.integers(0, 2**20))][int(rng.integers(11))]
            put(mutated, base(), table, field, v % 2**bits)
        write(p, fix_crc(mutated))
        try:
            cf = ColibriFile(p)
        except ColibriFormatError:
            outcomes["rejected"] += 1
            continue
        outcomes["opened"] += 1
        with cf:
            touch_everything(cf)
            cf.validate()
    assert outcomes["rejected"] > 200, outcomes


def test_open_is_fast_for_many_tensors(tmp_path):
    layers, experts = 8, 64
    t = {}
    for la in range(layers):
        t[f"layers.{la}.moe.router"] = np.ones((experts, 32), np.float32)
        for e in range(experts):
            for proj in ("w_gate", "w_up", "w_down"):
                t[f"layers.{la}.moe.experts.{e}.{proj}"] = np.ones((1, 32), np.float16)
    p = tmp_path / "many.colibri"
    save(p, t)
    best = min(_timed_open(p) for _ in range(3))
    assert len(t) == 1544
    assert best < 0.25, f"opening {len(t)} tensors took {best * 1e3:.0f} ms"


def _timed_open(p: Path) -> float:
    t0 = time.perf_counter()
    ColibriFile(p).close()
    return time.perf_counter() - t0


DOC = Path(__file__).resolve().parents[1] / "docs" / "format.md"


def doc_example(tag: str) -> str:
    if not DOC.exists():
        pytest.skip("docs/format.md not present")
    m = re.search(rf"<!-- example: {tag} -->\s*```python\n(.*?)```", DOC.read_text(), re.S)
    assert m, f"docs/format.md lost its {tag} example"
    return m.group(1)


def test_docs_struct_reader_reads_every_dtype(model_path):
    """The short struct-based reader in docs/format.md agrees with ColibriFile."""
    ns: dict = {}
    exec(compile(doc_example("struct-reader"), "format.md", "exec"), ns)
    with ColibriFile(model_path) as cf:
        assert {i.dtype for i in cf.tensors.values()} == set(CODES)
        for name in cf.names():
            np.testing.assert_array_equal(ns["read_tensor"](str(model_path), name),
                                          cf.to_float32(name), err_msg=name)


def test_docs_hex_dumps_match_the_example_file(tmp_path, monkeypatch):
    """Every xxd line of the worked example is what save() writes today."""
    monkeypatch.chdir(tmp_path)
    exec(compile(doc_example("tiny-file"), "format.md", "exec"), {})
    data = (tmp_path / "tiny.colibri").read_bytes()
    lines = re.findall(r"^([0-9a-f]{8}): ((?:[0-9a-f]{2,4} )*[0-9a-f]{2,4})", DOC.read_text(),
                       re.M)
    assert len(lines) > 30
    for off, hexbytes in lines:
        want = bytes.fromhex(hexbytes.replace(" ", ""))
        assert data[int(off, 16): int(off, 16) + len(want)] == want, off
    ColibriFile(tmp_path / "tiny.colibri").close()
