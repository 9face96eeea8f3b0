"""Shared builders of the tests/test_format_*.py files: the spec's field offsets written out
from docs/format.md (not taken from colibri.format, so a drift between the code and the spec
fails), byte editors for hostile files, and a small model file (fixtures model_path and
model_bytes; import them into a test module to use them).
"""
from __future__ import annotations

import os
import struct
import zlib
from pathlib import Path

import numpy as np
import pytest

from colibri.errors import ColibriFormatError
from colibri.format import ColibriFile, TensorSpec, save


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


# ------------------------------------------------------------------------------ a small model

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


def specs_for(tensors: dict) -> list[TensorSpec]:
    return [TensorSpec.infer(n, d, a.shape, G if d in ("q8", "q4") else 0)
            for n, (a, d) in tensors.items()]


def small() -> dict:
    rng = np.random.default_rng(1)
    return {"a": (rng.standard_normal((4, 64)).astype(np.float32), "f32"),
            "b": (rng.standard_normal((2, 64)).astype(np.float32), "q4")}
