"""The broken-file campaign (llama.cpp's test-gguf style): one hand-built broken file per
format invariant and per metadata field, x seeds. Used by tests/test_safety_file_campaign.py
(a few seeds, in CI) and scripts/broken_files.py (many seeds, prints the figures).

Every file goes through open -> validate -> load; the outcome is
  "refused"   a ColibriError at open or load, or validate() reporting a problem;
  "accepted"  opens, validates clean and loads (a benign change, e.g. to user metadata);
  "crash"     any other exception (a bug).
"""
from __future__ import annotations

import copy
import json
import re
import struct
import zlib
from collections import Counter
from pathlib import Path
from typing import Iterator

import numpy as np

import colibri
from colibri.config import ModelConfig
from colibri.format import ColibriFile
from colibri.format.spec import EXPERT_STRUCT, HEADER_FIELDS, HEADER_STRUCT, RECORD_STRUCT
from colibri.format.validation import validate
from safety_helpers import SHIPPED, resave

# (field, struct code, offset) of each layout, from spec's structs
def _layout(st: struct.Struct, names: tuple[str, ...]) -> list[tuple[str, str, int]]:
    out, off = [], 0
    codes = re.findall(r"(\d*)([a-zA-Z])", st.format[1:])
    for name, (n, c) in zip(names, codes):
        size = struct.calcsize("<" + n + c)
        out.append((name, n + c, off))
        off += size
    return out

HEADER = _layout(HEADER_STRUCT, HEADER_FIELDS)
RECORD = _layout(RECORD_STRUCT, ("name", "dtype", "ndim", "reserved", "group_size", "shape",
                                 "offset", "nbytes", "crc32", "flags"))
EXPERT = _layout(EXPERT_STRUCT, ("layer", "expert", "offset", "size", "reserved"))


def _values(code: str, old: int, rng: np.random.Generator) -> list[int]:
    bits = struct.calcsize("<" + code) * 8
    top = (1 << bits) - 1
    return sorted({0, 1, old - 1 if old else 2, old + 1, top, top >> 1, old * 2,
                   int(rng.integers(0, min(top, 1 << 62)))} - {old})


def _format_mutants(raw: bytes, rng: np.random.Generator) -> Iterator[tuple[str, bytes]]:
    """Every numeric field of the header, of a random tensor record and of a random expert
    index record, set to boundary and random values (header CRC fixed up, so the later
    checks are reached), plus byte flips in each section."""
    h = dict(zip(HEADER_FIELDS, HEADER_STRUCT.unpack_from(raw, 0)))

    def put(buf, off, code, value, fix=True):
        b = bytearray(buf)
        struct.pack_into("<" + code, b, off, value & ((1 << 8 * struct.calcsize(code)) - 1))
        if fix:
            struct.pack_into("<I", b, 0x7C, zlib.crc32(bytes(b[:0x7C])))
        return bytes(b)

    for name, code, off in HEADER:
        if code[-1] == "s" or name == "header_crc32":
            continue
        for v in _values(code, h[name], rng):
            yield f"header.{name}", put(raw, off, code, v)
    r = int(rng.integers(h["tensor_count"]))
    base = h["table_offset"] + 160 * r
    rec = RECORD_STRUCT.unpack_from(raw, base)
    for (name, code, off), old in zip(RECORD, [rec[0], *rec[1:5], rec[5:9], *rec[9:]]):
        if name in ("name", "shape"):
            continue
        for v in _values(code, old, rng):
            yield f"record.{name}", put(raw, base + off, code, v, fix=False)
    for d in range(4):                                     # shape dims
        for v in _values("Q", rec[5 + d], rng):
            yield "record.shape", put(raw, base + 16 + 8 * d, "Q", v, fix=False)
    for k in rng.integers(0, 96, 4):                        # name bytes
        yield "record.name", put(raw, base + int(k), "B", int(rng.integers(256)), fix=False)
    if h["expert_count"]:
        e = int(rng.integers(h["expert_count"]))
        base = h["expert_index_offset"] + 32 * e
        rec = EXPERT_STRUCT.unpack_from(raw, base)
        for (name, code, off), old in zip(EXPERT, rec):
            for v in _values(code, old, rng):
                yield f"expert.{name}", put(raw, base + off, code, v, fix=False)
    for what, start, size in (("table", h["table_offset"], 160 * h["tensor_count"]),
                              ("metadata", h["metadata_offset"], h["metadata_size"]),
                              ("padding", h["metadata_offset"] + h["metadata_size"],
                               h["data_offset"] - h["metadata_offset"] - h["metadata_size"])):
        if size > 0:
            for at in rng.integers(start, start + size, 4):
                b = bytearray(raw)
                b[int(at)] ^= 1 << int(rng.integers(8))
                yield f"flip.{what}", bytes(b)
    for cut in sorted({int(x) for x in rng.integers(1, len(raw), 3)} | {127, 4096}):
        yield "truncated", raw[:cut]


def _bad_values(v, rng):
    """Wrong types and out-of-range values for one arch field holding v."""
    out = [None, "x", [1], {"a": 1}, True, -1, 0, 1 << 40, 1e300, -0.5]
    if isinstance(v, (int, float)) and not isinstance(v, bool):
        out += [v + 1, v * 2, -v]
    return out


def _metadata_mutants(rng: np.random.Generator) -> Iterator[tuple[str, callable]]:
    """(case, edit) per arch field x bad value, per top-level key removed or retyped, per
    tokenizer file broken; each written with a correct checksum by resave()."""
    with ColibriFile(SHIPPED) as cf:
        arch = dict(cf.arch)
        files = dict(cf.tokenizer_files)
    for field, v in arch.items():
        for bad in _bad_values(v, rng):
            def edit(m, f=field, b=bad):
                m["arch"][f] = b
            yield f"arch.{field}", edit
        yield f"arch.{field}", (lambda m, f=field: m["arch"].pop(f))
    yield "arch.<unknown>", lambda m: m["arch"].update(no_such_field=1)
    for key in ("arch", "config", "tokenizer", "user"):
        yield f"meta.{key}", (lambda m, k=key: m.pop(k))
        yield f"meta.{key}", (lambda m, k=key: m.update({k: [1]}))
    for name in files:
        text = files[name]
        at = int(rng.integers(len(text)))
        yield f"tokenizer.{name}", (lambda m, n=name, t=text, a=at:
                                    m["tokenizer"]["files"].update({n: t[:a]}))
        yield f"tokenizer.{name}", (lambda m, n=name: m["tokenizer"]["files"].update({n: "{"}))


def _same_config(a: dict, b: dict) -> bool:
    """A removed arch field whose default is the value it had: the same typed config."""
    if {k: v for k, v in a.items() if k != "arch"} != {k: v for k, v in b.items()
                                                        if k != "arch"}:
        return False
    try:
        return ModelConfig.from_metadata(a["arch"]) == ModelConfig.from_metadata(b["arch"])
    except (colibri.ColibriError, KeyError, TypeError):
        return False


def outcome(path: Path) -> str:
    try:
        with ColibriFile(path) as cf:
            problems = validate(cf)
        if problems:
            return "refused"
        colibri.load(path)
        return "accepted"
    except colibri.ColibriError:
        return "refused"
    except Exception as e:                                  # noqa: BLE001 - counted
        return f"crash {type(e).__name__}: {e}"[:300]


def campaign(seeds: int, work: Path, every: int = 1) -> dict:
    """Run seeds x (format mutants + metadata mutants); returns the counts per category
    {category: Counter(outcomes)} and the crash messages."""
    raw = SHIPPED.read_bytes()
    by: dict[str, Counter] = {}
    crashes: list[str] = []
    fresh = resave(SHIPPED, work / "fresh.colibri")
    fresh_raw = fresh.read_bytes()
    path = work / "broken.colibri"
    with ColibriFile(SHIPPED) as cf:
        base_meta = copy.deepcopy(cf.metadata)
    for seed in range(seeds):
        rng = np.random.default_rng(seed)
        for source in (raw, fresh_raw):
            for i, (case, data) in enumerate(_format_mutants(source, rng)):
                if i % every:
                    continue
                path.write_bytes(data)
                o = outcome(path)
                by.setdefault(case.split(".")[0], Counter())[o.split(" ")[0]] += 1
                if o.startswith("crash"):
                    crashes.append(f"{case} seed {seed}: {o}")
        for i, (case, edit) in enumerate(_metadata_mutants(rng)):
            if i % every:
                continue
            probe = copy.deepcopy(base_meta)
            try:
                edit(probe)
            except KeyError:
                continue
            if json.dumps(probe, sort_keys=True) == json.dumps(base_meta, sort_keys=True) \
                    or _same_config(probe, base_meta):
                by.setdefault(case.split(".")[0], Counter())["no-op"] += 1
                continue
            try:
                resave(SHIPPED, path, edit)
            except (ValueError, TypeError):           # the writer refused it: fine too
                by.setdefault(case.split(".")[0], Counter())["refused by writer"] += 1
                continue
            o = outcome(path)
            by.setdefault(case.split(".")[0], Counter())[o.split(" ")[0]] += 1
            if o.startswith("crash"):
                crashes.append(f"{case} seed {seed}: {o}")
            if o == "accepted" and case.startswith(("arch", "tokenizer")):
                crashes.append(f"{case} seed {seed}: accepted")
    return {"by": by, "crashes": crashes}
