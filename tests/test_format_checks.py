"""The checks of docs/format.md §8 on hostile files (truncated, overwritten, bit-flipped,
foreign, inconsistent), and the full-read checks of validate()."""
from __future__ import annotations

import struct
import time
import tracemalloc

import numpy as np
import pytest

from colibri.errors import ColibriFormatError
from colibri.format import EXPERT_RE, ColibriFile, QuantizedTensor, save

from format_helpers import (  # model_path, model_bytes are fixtures
    HEADER, RECORD, EXPERT, CODES, G, get, put, fix_crc, set_header, record_base, expert_base,
    record_index, set_record, write, expect_error, model_tensors, model_path, model_bytes, D, I,
    E, L, V, METADATA,
)


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
    (DENSE, "dtype", 7, "unknown dtype code 7"),
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
    for la in {int(n.split(".")[1]) for n in cf.names() if EXPERT_RE.fullmatch(n)}:
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


@pytest.mark.parametrize("arch, problem", [
    ({"family": "toy", "num_experts": 3}, "metadata 'arch' lacks the field 'vocab_size'"),
    ({**METADATA["arch"], "hidden_size": "64"},
     "metadata 'arch' field 'hidden_size' must be an integer, found '64'"),
    ({**METADATA["arch"], "colour": "blue"}, "metadata 'arch' has unknown field(s) 'colour'"),
    ({}, None),            # no arch: a plain tensor container, nothing to check
])
def test_validate_reports_an_arch_that_is_not_a_model_config(tmp_path, arch, problem):
    p = tmp_path / "arch.colibri"
    save(p, model_tensors(), {**METADATA, "arch": arch}, group_size=G)
    with ColibriFile(p) as cf:                         # opening does not parse the arch
        assert cf.validate() == ([f"{p}: {problem}"] if problem else [])
