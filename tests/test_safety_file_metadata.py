"""The metadata side of docs/safety.md: bounded reads (a sparse file declaring huge sections),
bounded JSON depth, the metadata checksum, typed config ranges, the config against the tensors
and against config.json, flipped key names, the tokenizer and chat template exercised by
validate, and an unfinished file that can never look finished."""
from __future__ import annotations

import json
import os
import struct
import subprocess
import sys
import tracemalloc
import zlib

import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

import colibri
from colibri.config import ConfigError
from colibri.errors import ColibriFormatError
from colibri.format import ColibriFile, ColibriWriter, TensorSpec, checks
from colibri.format.spec import METADATA_CRC_KEY
from colibri.format import safe_json
from colibri.format.safe_json import nesting_depth
from colibri.tools.inspect import validate
from safety_helpers import SHIPPED, resave


@pytest.fixture(scope="module")
def fresh(tmp_path_factory):
    """The shipped model re-saved by this writer (metadata checksum present)."""
    return resave(SHIPPED, tmp_path_factory.mktemp("fresh") / "m.colibri")


def test_a_fresh_file_and_the_shipped_one_validate(fresh):
    for path in (fresh, SHIPPED):
        with ColibriFile(path) as cf:
            assert validate(cf) == []
            assert "metadata_crc32" not in cf.metadata


# --- bounded reads ---------------------------------------------------------------------------

def _sparse(tmp_path, field, value, total):
    """The first 4 KB of a real file, `field` (metadata_size or tensor_count) set to a huge
    value and the sections after it moved to fit, data_offset where §8 wants it; the file
    extended sparse to `total` bytes (it holds 4 KB on disk)."""
    raw = bytearray(SHIPPED.read_bytes()[:4096])
    h = lambda off, code="<Q": struct.unpack_from(code, raw, off)[0]   # noqa: E731
    if field == "metadata_size":
        struct.pack_into("<Q", raw, 0x50, value)
        end = h(0x48) + value
    else:
        struct.pack_into("<I", raw, 0x14, value)
        index = -(-(128 + 160 * value) // 8) * 8
        struct.pack_into("<Q", raw, 0x38, index)
        struct.pack_into("<Q", raw, 0x48, index + 32 * h(0x44, "<I"))
        end = index + 32 * h(0x44, "<I") + h(0x50)
    data = -(-end // 4096) * 4096
    struct.pack_into("<Q", raw, 0x18, data)                    # routing_offset
    struct.pack_into("<Q", raw, 0x20, data)                    # data_offset
    struct.pack_into("<Q", raw, 0x58, total)                   # file_size
    struct.pack_into("<I", raw, 0x7C, zlib.crc32(bytes(raw[:0x7C])))
    p = tmp_path / f"sparse-{field}.colibri"
    with open(p, "wb") as f:
        f.write(raw)
        f.truncate(total)
    return p


@pytest.mark.parametrize("field,value", [("metadata_size", 1_600_000_000),
                                         ("metadata_size", 100_000_000),
                                         ("tensor_count", 5_000_000),
                                         ("tensor_count", 600_000)])
def test_sparse_files_declaring_huge_sections_fail_without_big_allocations(tmp_path, field,
                                                                           value):
    p = _sparse(tmp_path, field, value, 1 << 31)
    tracemalloc.start()
    with pytest.raises(ColibriFormatError) as info:
        ColibriFile(p)
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    assert str(p) in str(info.value)
    assert peak < 16 << 20, (peak, str(info.value))


def test_metadata_with_a_nul_is_refused_at_its_first_chunk(fresh, tmp_path):
    raw = bytearray(fresh.read_bytes())
    off = struct.unpack_from("<Q", raw, 0x48)[0]
    raw[off + 5] = 0
    p = tmp_path / "nul.colibri"
    p.write_bytes(raw)
    with pytest.raises(ColibriFormatError, match="NUL byte"):
        ColibriFile(p)


# --- JSON depth, checksum, key names ---------------------------------------------------------

def test_nesting_depth_ignores_brackets_in_strings():
    assert nesting_depth('{"a": [1, {"b": "[[[{{{\\"[["}]}') == 3
    assert nesting_depth('"\\\\"') == 0 and nesting_depth("[]") == 1
    assert nesting_depth("[" * 5000 + "]" * 5000) == 5000


def test_deeply_nested_metadata_is_refused_without_recursion_error(tmp_path):
    deep = {"x": 1}
    for _ in range(200):
        deep = {"x": deep}
    p = tmp_path / "deep.colibri"
    colibri.format.save(p, {"a": np.zeros(4, np.float32)}, {"user": {}, "extra": deep})
    with pytest.raises(ColibriFormatError, match="levels deep"):
        ColibriFile(p)


def _flip(src, tmp_path, at: int, name: str):
    raw = bytearray(src.read_bytes())
    off = struct.unpack_from("<Q", raw, 0x48)[0]
    raw[off + at] ^= 0x01
    p = tmp_path / name
    p.write_bytes(raw)
    return p


def test_every_metadata_byte_flip_of_a_fresh_file_is_refused_at_open(fresh, tmp_path):
    """The issue's campaign: single-byte flips inside the metadata JSON. All are refused at
    open now (the checksum), each with a ColibriFormatError naming the file."""
    size = struct.unpack_from("<Q", fresh.read_bytes(), 0x50)[0]
    rng = np.random.default_rng(15)
    for at in rng.choice(size, 40, replace=False):
        p = _flip(fresh, tmp_path, int(at), "flip.colibri")
        with pytest.raises(ColibriFormatError) as info:
            ColibriFile(p)
        assert str(p) in str(info.value)


def _edit_old_file(tmp_path, old: bytes, new: bytes):
    """The shipped file with one same-length metadata edit and its metadata checksum (when
    it has one) recomputed, as an old file without a checksum would be: it opens, and what
    comes after the checksum must still refuse it."""
    raw = bytearray(SHIPPED.read_bytes())
    arch = raw.index(b'"arch": {')                   # config.json has the same keys: edit the arch
    at = raw.index(old, arch)
    assert len(old) == len(new) and at < raw.index(b"}", arch)
    raw[at: at + len(old)] = new
    off, size = struct.unpack_from("<QQ", raw, 0x48)
    meta = bytes(raw[off: off + size])
    n = len(checks.metadata_suffix(0))
    if METADATA_CRC_KEY.encode() in meta[-n:]:
        raw[off + size - n: off + size] = checks.metadata_suffix(zlib.crc32(meta[:-n]))
    p = tmp_path / "edited.colibri"
    p.write_bytes(raw)
    return p


@pytest.mark.parametrize("old,new,where", [
    (b'"num_hidden_layers": 6', b'"num_hidden_layers": 5', "layers in [0, 5)"),
    (b'"num_experts": 8', b'"num_experts": 9', "num_experts 9"),
    (b'"num_experts_per_tok": 2', b'"num_experts_per_tok": 9', "num_experts_per_tok 9"),
    (b'"hidden_size": 128', b'"hidden_size": 129', "the arch implies (4099, 129)"),   # (vocab, hidden)
    (b'"rms_norm_eps": 1e-05', b'"rms_norm_eps": 1e+05', "rms_norm_eps"),
    (b'"rms_norm_eps": 1e-05', b'"rms_norm_eps": -1e-5', "rms_norm_eps"),
    (b'"rope_theta": 10000.0', b'"rope_theta": 0.00000', "rope_theta"),
    (b'"sliding_window": null', b'"sliding_window": 1   ', "sliding_window"),
    (b'"num_hidden_layers"', b'"num_hidden_layerz"', "num_hidden_layerz"),
    (b'"family": "mixtral"', b'"famiky": "mixtral"', "famiky"),
])
def test_arch_values_that_contradict_the_file_are_refused_naming_them(tmp_path, old, new, where):
    p = _edit_old_file(tmp_path, old, new)
    with pytest.raises((ConfigError, ColibriFormatError)) as info:
        colibri.load(p)
    assert where in str(info.value) and str(p) in str(info.value), str(info.value)
    with ColibriFile(p) as cf:
        problems = validate(cf)
    assert any(where in x for x in problems), problems


@pytest.mark.parametrize("old,new", [
    (b'"rope_theta": 10000.0', b'"rope_theta": 10001.0'),      # ranges hold: config.json differs
    (b'"max_position_embeddings": 512', b'"max_position_embeddings": 612'),
])
def test_validate_compares_the_arch_with_config_json(tmp_path, old, new):
    p = _edit_old_file(tmp_path, old, new)
    with ColibriFile(p) as cf:
        problems = validate(cf)
    assert any("config.json implies" in x for x in problems), problems


def test_flipped_metadata_key_names_are_clear_errors_never_key_errors(tmp_path):
    raw = SHIPPED.read_bytes()
    off, size = struct.unpack_from("<QQ", raw, 0x48)
    text = raw[off: off + size]
    keys = sorted({m for m in json.loads(text)} | set(json.loads(text)["arch"])
                  | set(json.loads(text)["tokenizer"]["files"]) | {"files"})
    tried = 0
    for key in keys:
        token = json.dumps(key).encode()
        at = text.find(token)
        if at < 0:
            continue
        p = tmp_path / "k.colibri"
        b = bytearray(raw)
        b[off + at + 1] ^= 0x02                # first character of the key
        p.write_bytes(b)
        tried += 1
        try:
            with ColibriFile(p) as cf:
                validate(cf)
            colibri.load(p)
        except colibri.ColibriError:
            pass                               # KeyError / TypeError would escape the test
    assert tried >= 20


# --- tokenizer and chat template at validate time --------------------------------------------

@pytest.mark.parametrize("files,fragment", [
    ({"tokenizer.json": "{ not json"}, "tokenizer: cannot be built"),
    ({"tokenizer.json": '{"model": {"type": "Nope"}}'}, "tokenizer: cannot be built"),
])
def test_a_broken_tokenizer_fails_validate(tmp_path, files, fragment):
    p = resave(SHIPPED, tmp_path / "t.colibri",
               lambda m: m["tokenizer"]["files"].update(files))
    with ColibriFile(p) as cf:
        problems = validate(cf)
    assert any(fragment in x for x in problems), problems


def test_a_chat_template_that_cannot_render_fails_validate(tmp_path):
    p = resave(SHIPPED, tmp_path / "t.colibri", lambda m: m["tokenizer"]["files"].update(
        {"chat_template.jinja": "{{ messages[0].content | no_such_filter }}"}))
    with ColibriFile(p) as cf:
        problems = validate(cf)
    assert any("chat template" in x for x in problems), problems


# --- an unfinished file can never look finished ----------------------------------------------

def test_an_unfinished_writers_file_is_not_a_colibri_file(tmp_path):
    """Everything written but the final step: the header is still zeros."""
    t = {"layers.0.moe.router": np.ones((2, 64), np.float32), "norm": np.ones(64, np.float32)}
    for e in range(2):
        for proj in ("w_gate", "w_up", "w_down"):
            t[f"layers.0.moe.experts.{e}.{proj}"] = np.ones((64, 64), np.float32)
    specs = [TensorSpec.infer(n, "f32", a.shape) for n, a in t.items()]
    w = ColibriWriter(tmp_path / "x.colibri", specs, {"user": {}}, n_layers=1, n_experts=2)
    for n, a in t.items():
        w.write(n, a)                      # every tensor, every CRC computed
    copy = tmp_path / "copy.colibri"
    copy.write_bytes(open(w._tmp, "rb").read())
    w.abort()
    assert os.path.getsize(copy) == w.file_size
    with pytest.raises(ColibriFormatError, match="all zeros: an unfinished file"):
        ColibriFile(copy)


def _reference_depth(text: str) -> int:
    depth = deepest = 0
    inside = escaped = False
    for c in text:
        if inside:
            if escaped:
                escaped = False
            elif c == "\\":
                escaped = True
            elif c == '"':
                inside = False
        elif c == '"':
            inside = True
        elif c in "[{":
            depth += 1
            deepest = max(deepest, depth)
        elif c in "]}":
            depth -= 1
    return deepest


_json_doc = st.recursive(st.none() | st.text(alphabet='ab"\\[]{}', max_size=6),
                         lambda c: st.lists(c, max_size=3)
                         | st.dictionaries(st.text(alphabet='k"\\[{', max_size=3), c,
                                           max_size=3), max_leaves=12)


@pytest.mark.parametrize("chunk", [1, 2, 5, 1 << 20])
@settings(max_examples=80, deadline=None)
@given(doc=_json_doc)
def test_nesting_depth_matches_a_plain_scanner_across_chunk_boundaries(chunk, doc):
    text = json.dumps(doc)
    old, safe_json._CHUNK = safe_json._CHUNK, chunk
    try:
        assert nesting_depth(text) == _reference_depth(text)
    finally:
        safe_json._CHUNK = old


def test_opening_under_a_tight_address_space_limit_is_a_clean_error(tmp_path):
    """RLIMIT_AS a few MB above what the process uses: the mapping (4.7 MB) cannot be made,
    or the checks' buffers cannot; either way a ColibriError naming the file (no bare OSError
    or MemoryError)."""
    code = (
        "import re, resource, colibri, colibri.format.validation\n"
        "from colibri.format import ColibriFile\n"
        "vm = int(re.search(r'VmSize:\\s+(\\d+)', open('/proc/self/status').read())[1]) * 1024\n"
        "resource.setrlimit(resource.RLIMIT_AS, (vm + (3 << 20), resource.RLIM_INFINITY))\n"
        "try:\n"
        "    ColibriFile(colibri.default_model_path()); print('opened')\n"
        "except colibri.ColibriError as e:\n"
        "    print('clean', e)\n")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                       timeout=120, cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    assert r.stdout.startswith(("clean", "opened")), r.stdout
    if r.stdout.startswith("clean"):
        assert "tiny-moe.colibri" in r.stdout, r.stdout
        assert "cannot map" in r.stdout or "out of memory" in r.stdout, r.stdout
