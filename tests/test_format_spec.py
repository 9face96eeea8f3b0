"""The .colibri layout against docs/format.md: field offsets, section placement, the
document's own example file and reader."""
from __future__ import annotations

import json
import re
import struct
import zlib
from pathlib import Path

import numpy as np
import pytest

from colibri.format import ColibriFile, spec

from format_helpers import (  # model_path, model_bytes are fixtures
    HEADER, RECORD, EXPERT, CODES, get, record_base, expert_base, model_tensors, METADATA,
    model_path, model_bytes, E, L,
)


DOC = Path(__file__).resolve().parents[1] / "docs" / "format.md"


def doc_example(tag: str) -> str:
    if not DOC.exists():
        pytest.skip("docs/format.md not present")
    m = re.search(rf"<!-- example: {tag} -->\s*```python\n(.*?)```", DOC.read_text(), re.S)
    assert m, f"docs/format.md lost its {tag} example"
    return m.group(1)


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
    stored = json.loads(meta.decode())
    assert list(stored)[-1] == "metadata_crc32"          # §5: last, the CRC32 of the bytes before it
    suffix = f'"metadata_crc32": "{stored.pop("metadata_crc32")}"}}'.encode()
    assert meta.endswith(suffix)
    assert f"{zlib.crc32(meta[:-len(suffix)]):08x}" == suffix.decode()[19:27]
    assert stored == METADATA
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


def test_spec_records_match_the_document():
    """colibri.format.spec's struct layouts and record dtypes put every field where the
    document (format_helpers' tables) says."""
    values = {f: i + 1 for i, f in enumerate(spec.HEADER_FIELDS)}
    values.update(magic=b"COLI", reserved=bytes(range(20)))
    packed = spec.HEADER_STRUCT.pack(*(values[f] for f in spec.HEADER_FIELDS))
    assert len(packed) == spec.HEADER_SIZE == 128
    assert {f: get(packed, 0, HEADER, f) for f in HEADER} == values
    for table, dtype, size in ((RECORD, spec.RECORD_DTYPE, spec.RECORD_SIZE),
                               (EXPERT, spec.EXPERT_DTYPE, spec.EXPERT_RECORD_SIZE)):
        assert dtype.itemsize == size
        offsets = {f: off for f, (off, _) in table.items()}
        shape0 = offsets.pop("shape0", None)
        for f in ("shape1", "shape2", "shape3"):
            offsets.pop(f, None)
        if shape0 is not None:
            offsets["shape"] = shape0
        assert {f: dtype.fields[f][1] for f in dtype.names} == offsets
    assert struct.calcsize("<" + "".join(c for _, c in RECORD.values())) == spec.RECORD_STRUCT.size


def test_canonical_names():
    assert spec.router_name(3) == "layers.3.moe.router"
    assert spec.ROUTER_RE.fullmatch(spec.router_name(12)).group(1) == "12"
    m = spec.EXPERT_RE.fullmatch(spec.expert_name(1, 7, "w_down"))
    assert m.groups() == ("1", "7", "w_down")
    assert spec.PROJS == ("w_gate", "w_up", "w_down")
    assert not spec.EXPERT_RE.fullmatch("layers.1.moe.experts.7.w_out")
    assert spec.layer_count(["tok_embeddings", "layers.0.attn.wq", "layers.4.ffn_norm"]) == 5
    assert spec.layer_count(["norm", "layers.x.attn.wq"]) == 0
