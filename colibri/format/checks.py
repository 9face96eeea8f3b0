"""The checks of docs/format.md §8: what a reader verifies before it maps a file, and the
full-read checks of validate().

The open-time checks work on plain bytes and the table / index as numpy record arrays
(spec.RECORD_DTYPE, spec.EXPERT_DTYPE); each raises ColibriFormatError naming the file and
saying what was expected and what was found. The full-read checks return problems as text.
"""
from __future__ import annotations

import itertools
import json
import zlib
from typing import Any, Callable, Iterable, NoReturn

import numpy as np

from .. import dtypes
from ..dtypes import BLOCK, DTYPE_NAMES, DTYPES
from ..errors import ColibriFormatError
from . import safe_json
from .spec import (
    ALIGNMENT, EXPERT_RE, EXPERT_RECORD_SIZE, FORMAT_VERSION, HEADER_FIELDS, HEADER_FLAG_CRC,
    HEADER_SIZE, HEADER_STRUCT, MAGIC, MAX_METADATA_BYTES, MAX_PREFIX_PADDING, MAX_TENSORS,
    METADATA_CRC_KEY, PAGE_SIZE, PROJS, RECORD_FLAG_CRC, RECORD_SIZE, ROUTER_RE, expert_name,
    layer_count, round_up,
)

# Per on-disk code: bits per element and whether the format is quantized (vector lookups).
_BITS = np.array([DTYPES[n].bits for n in DTYPE_NAMES], np.uint64)
_QUANTIZED = np.array([DTYPES[n].quantized for n in DTYPE_NAMES])
_SCALE_BYTES = np.array([DTYPES[n].scale_bytes for n in DTYPE_NAMES], np.uint64)   # per group
_FIXED_GROUP = np.array([DTYPES[n].fixed_group for n in DTYPE_NAMES], np.int64)    # mxfp4: 32


def fail(path: str, problem: str) -> NoReturn:
    raise ColibriFormatError(f"{path}: {problem}")


def first_missing(have: set[int], n: int, limit: int = 8) -> list[int]:
    """Up to `limit` numbers of range(n) not in `have`, without building range(n) (n comes
    from the file and may be 2^32-1)."""
    return list(itertools.islice((i for i in range(n) if i not in have), limit))


# ----------------------------------------------------------------------------- header


def _describe_foreign(head: bytes) -> str:
    """A guess at what a non-colibri file is, for the error message."""
    if head[:4] == b"GGUF":
        return " (this looks like a GGUF file)"
    if len(head) >= 9 and head[8:9] == b"{":
        return " (this looks like a safetensors file)"
    if head[:2] == b"PK":
        return " (this looks like a zip / PyTorch checkpoint)"
    if head[:1] in (b"{", b"["):
        return " (this looks like a JSON file)"
    return ""


def check_header(path: str, head: bytes, size: int) -> dict:
    """§8 steps 1-5 on the first min(size, 128) bytes of a file of `size` bytes; the header
    as a dict of its fields (magic decoded)."""
    if 0 < len(head) < 4 and MAGIC.startswith(head):
        fail(path, f"truncated header: file is {size} bytes")
    if len(head) == HEADER_SIZE and head.count(0) == HEADER_SIZE:
        fail(path, "the header is all zeros: an unfinished file (the writer writes the "
                   "header last; a conversion killed before it finished leaves this)")
    if len(head) < 4 or head[:4] != MAGIC:
        found = repr(head[:4]) if head else "an empty file"
        fail(path, f"not a colibri file: expected magic {MAGIC!r} at offset 0, found "
                   f"{found}{_describe_foreign(head)}")
    if size < HEADER_SIZE:
        fail(path, f"truncated header: file is {size} bytes, the header alone is "
                   f"{HEADER_SIZE} bytes")
    h = dict(zip(HEADER_FIELDS, HEADER_STRUCT.unpack(head)))
    h["magic"] = h["magic"].decode("ascii")
    version = h["version"]
    if version > FORMAT_VERSION:
        hint = " (or a big-endian file)" if version == FORMAT_VERSION << 24 else ""
        fail(path, f"written by a newer colibri (format version {version}, this reader "
                   f"supports {FORMAT_VERSION}){hint}: upgrade colibri")
    if version == 0:
        fail(path, "format version 0 is not valid (expected 1)")
    for field, want in (("header_size", HEADER_SIZE), ("record_size", RECORD_SIZE),
                        ("expert_record_size", EXPERT_RECORD_SIZE),
                        ("alignment", ALIGNMENT), ("page_size", PAGE_SIZE)):
        if h[field] != want:
            fail(path, f"header field {field} is {h[field]}, expected {want}")
    crc = zlib.crc32(head[:HEADER_SIZE - 4])
    if crc != h["header_crc32"]:
        fail(path, f"header checksum mismatch (stored 0x{h['header_crc32']:08x}, "
                   f"computed 0x{crc:08x}): the header is corrupted")
    if h["reserved"] != bytes(20):
        fail(path, "header reserved bytes 0x68..0x7b are not zero")
    if h["flags"] & ~HEADER_FLAG_CRC:
        fail(path, f"header flags 0x{h['flags']:x} has unknown bits (known: 0x1)")
    if h["file_size"] != size:
        kind = "truncated" if size < h["file_size"] else "has trailing bytes"
        fail(path, f"file {kind}: header says file_size {h['file_size']}, "
                   f"the file has {size} bytes")
    return h


def check_regions(path: str, h: dict) -> list[tuple[int, int, str]]:
    """§8 steps 6-7. Table, expert index and metadata: inside [header_size, data_offset),
    disjoint, and sized from counts BEFORE anything is read (a 2^32-1 count in a tiny file
    fails here, without allocating). Returns the regions [(start, end, what)], sorted."""
    size, data = h["file_size"], h["data_offset"]
    if data % PAGE_SIZE or data < HEADER_SIZE or data > size:
        fail(path, f"data_offset {data} must be a multiple of {PAGE_SIZE} within the "
                   f"file (file has {size} bytes)")
    routing = h["routing_offset"]
    if not data <= routing <= size or routing % ALIGNMENT:
        fail(path, f"routing_offset {routing} must be {ALIGNMENT}-aligned and within "
                   f"the data section [{data}, {size}]")
    regions = []
    for what, off_field, count, unit in (
            ("tensor table", "table_offset", h["tensor_count"], RECORD_SIZE),
            ("expert index", "expert_index_offset", h["expert_count"], EXPERT_RECORD_SIZE),
            ("metadata", "metadata_offset", h["metadata_size"], 1)):
        off, nbytes = h[off_field], count * unit
        if off % 8 and unit > 1:
            fail(path, f"{off_field} {off} is not a multiple of 8")
        if off < HEADER_SIZE or off + nbytes > data:
            count_field = {"tensor table": "tensor_count", "expert index": "expert_count",
                           "metadata": "metadata_size"}[what]
            fail(path, f"{what} [{off}, {off + nbytes}) ({count_field} {count}) does not "
                       f"fit between the header end {HEADER_SIZE} and data_offset {data} "
                       f"(file has {size} bytes)")
        regions.append((off, off + nbytes, what))
    if h["tensor_count"] > MAX_TENSORS:
        fail(path, f"tensor_count {h['tensor_count']} exceeds the reader's limit of "
                   f"{MAX_TENSORS} tensors")
    if h["metadata_size"] > MAX_METADATA_BYTES:
        fail(path, f"metadata_size {h['metadata_size']} exceeds the reader's limit of "
                   f"{MAX_METADATA_BYTES} bytes")
    if 3 * h["expert_count"] > h["tensor_count"]:
        fail(path, f"expert_count {h['expert_count']} needs {3 * h['expert_count']} expert "
                   f"tensors, the table has {h['tensor_count']}")
    regions.sort()
    for (s0, e0, w0), (s1, e1, w1) in zip(regions, regions[1:]):
        if s1 < e0:
            fail(path, f"{w0} [{s0}, {e0}) overlaps {w1} [{s1}, {e1})")
    want = round_up(max(e for _, e, _ in regions), PAGE_SIZE)
    if data != want:
        fail(path, f"data_offset {data} should be the first multiple of {PAGE_SIZE} after "
                   f"the metadata, table and index: {want}")
    padding = data - HEADER_SIZE - sum(e - s for s, e, _ in regions)
    if padding > MAX_PREFIX_PADDING:
        fail(path, f"{padding} padding bytes between the header and data_offset {data} "
                   f"(at most {MAX_PREFIX_PADDING}: the sections follow each other)")
    return regions


def gaps(regions: list[tuple[int, int, str]], data_offset: int) -> list[tuple[int, int, str]]:
    """The padding [start, end, before what) of [header end, data_offset) outside the
    regions (at most MAX_PREFIX_PADDING bytes in all, check_regions)."""
    out, start = [], HEADER_SIZE
    for s0, e0, what in regions + [(data_offset, data_offset, "data")]:
        if s0 > start:
            out.append((start, s0, what))
        start = max(start, e0)
    return out


def check_gap(path: str, start: int, raw: bytes, what: str) -> None:
    """§8 step 8 for one gap: no room for a second payload (a polyglot file) between the
    sections."""
    if raw.count(0) != len(raw):
        fail(path, f"non-zero bytes in the padding [{start}, {start + len(raw)}) before the "
                   f"{what}")


def scan_table_chunk(path: str, chunk: bytes, start: int, table_offset: int) -> None:
    """While reading the table: a record whose name starts with NUL is empty (§8 step 9),
    so a sparse or zeroed table fails at its first chunk, before the rest is read."""
    first = chunk[::RECORD_SIZE]
    k = first.find(0)
    if k >= 0:
        fail(path, f"tensor record {(start - table_offset) // RECORD_SIZE + k}: empty name "
                   f"(a zeroed or sparse table?)")


def scan_metadata_chunk(path: str, chunk: bytes, start: int, metadata_offset: int) -> None:
    """While reading the metadata: JSON text never holds a NUL byte, so a zeroed or sparse
    metadata region fails at its first chunk."""
    k = chunk.find(0)
    if k >= 0:
        fail(path, f"metadata holds a NUL byte at offset {start + k} (byte "
                   f"{start + k - metadata_offset} of the metadata): not JSON text")


# ----------------------------------------------------------------------------- tensor table


def _is_utf8(b: bytes) -> bool:
    try:
        b.decode("utf-8")
        return True
    except UnicodeDecodeError:
        return False


def check_names(path: str, table: np.ndarray, n_layers: int) -> list[str]:
    """§8 step 9. Names: 1..95 UTF-8 bytes, NUL-terminated, NUL-padded, unique; the header's
    n_layers matches them. Returns the names in table order."""
    raw = table["name"]                                   # (N, 96) uint8
    nul = raw == 0
    first = np.argmax(nul, axis=1)                        # index of the first NUL
    tail_ok = (nul | (np.arange(96)[None, :] < first[:, None])).all(axis=1)
    for bad, problem in ((~nul.any(axis=1), "name has no NUL terminator in its 96 bytes"),
                         (first == 0, "empty name"),
                         (~tail_ok, "name is followed by non-NUL padding")):
        if bad.any():
            i = int(np.argmax(bad))
            fail(path, f"tensor record {i}: {problem} ({raw[i].tobytes()[:40]!r}...)")
    # As 'S96' the trailing NULs drop off in C: the list is the names' bytes.
    encoded = raw.view("S96")[:, 0].tolist()
    try:
        names = [b.decode("utf-8") for b in encoded]
    except UnicodeDecodeError as e:
        i = next(k for k, b in enumerate(encoded) if not _is_utf8(b))
        fail(path, f"tensor record {i}: name {encoded[i]!r} is not valid UTF-8 ({e.reason})")
    if len(set(names)) != len(names):
        seen: set[str] = set()
        i = next(k for k, n in enumerate(names) if n in seen or seen.add(n))
        fail(path, f"tensor record {i}: duplicate tensor name {names[i]!r}")
    used = layer_count(names)
    if used != n_layers:
        fail(path, f"header n_layers is {n_layers} but the tensor names use "
                   f"{used} layers (layers.0 .. layers.{used - 1})")
    return names


def _first(path: str, bad: np.ndarray, names: list[str], problem: Callable[[int], str]
           ) -> None:
    """Raise for the first True in bad (a per-record mask); problem(i) -> str."""
    if bad.any():
        i = int(np.argmax(bad))
        fail(path, f"tensor {names[i]!r}: {problem(i)}")


def check_records(path: str, t: np.ndarray, names: list[str], h: dict) -> np.ndarray:
    """§8 steps 10-11: every record's fields, then the layout of the data section. Returns
    the table rows in offset (file) order."""
    if len(t) == 0:
        if h["file_size"] != h["data_offset"]:
            fail(path, f"no tensors, but the file has {h['file_size'] - h['data_offset']} "
                       f"bytes after data_offset {h['data_offset']}")
        return np.arange(0)
    code, ndim, gs = t["dtype"], t["ndim"], t["group_size"].astype(np.int64)
    shape, off, nb = t["shape"], t["offset"], t["nbytes"]

    def f(bad: np.ndarray, problem: Callable[[int], str]) -> None:
        _first(path, bad, names, problem)

    f(code >= len(DTYPE_NAMES),
      lambda i: f"unknown dtype code {code[i]} (known: 0..{len(DTYPE_NAMES) - 1} = "
                f"{', '.join(DTYPE_NAMES)})")
    f((ndim < 1) | (ndim > 4), lambda i: f"ndim {ndim[i]} is not in 1..4")
    f(t["reserved"] != 0, lambda i: f"reserved field is {t['reserved'][i]}, not 0")
    f((t["flags"] & ~np.uint32(RECORD_FLAG_CRC)) != 0,
      lambda i: f"record flags 0x{t['flags'][i]:x} has unknown bits")
    if not h["flags"] & HEADER_FLAG_CRC:
        f((t["flags"] & RECORD_FLAG_CRC) != 0,
          lambda i: "has a crc32 but header flags bit 0 (checksums present) is clear")
    used = np.arange(4)[None, :] < ndim[:, None]
    f(((shape == 0) & used).any(axis=1),
      lambda i: f"zero dimension in shape {tuple(int(x) for x in shape[i, :ndim[i]])}")
    f(((shape != 0) & ~used).any(axis=1),
      lambda i: f"unused shape entries beyond ndim {ndim[i]} are not 0: "
                f"{[int(x) for x in shape[i]]}")
    cols = shape[np.arange(len(t)), ndim.astype(np.intp) - 1]
    quantized = _QUANTIZED[code]
    # uint64 throughout: uint64 % int64 would go through float64 and round.
    g_u = np.maximum(t["group_size"], 1).astype(np.uint64)
    bad_gs = quantized & ((gs <= 0) | (gs % BLOCK != 0) | (cols % g_u != 0)
                          | ((_FIXED_GROUP[code] != 0) & (gs != _FIXED_GROUP[code])))
    f(bad_gs, lambda i: f"group_size {gs[i]} invalid for {DTYPE_NAMES[code[i]]} "
                        f"with {cols[i]} columns (need a positive multiple of {BLOCK} "
                        f"that divides the columns)")
    f(~quantized & (gs != 0),
      lambda i: f"group_size {gs[i]} must be 0 for {DTYPE_NAMES[code[i]]}")
    f(off % ALIGNMENT != 0,
      lambda i: f"offset {off[i]} is not a multiple of alignment {ALIGNMENT}")
    size, data = h["file_size"], h["data_offset"]
    f(off < data, lambda i: f"offset {off[i]} is before data_offset {data}")
    f((off > size) | (nb > size - np.minimum(off, size)),
      lambda i: f"bytes [{off[i]}, {int(off[i]) + int(nb[i])}) extend past the end of the "
                f"file ({size} bytes)")
    _check_nbytes(path, t, names, cols, quantized, size)
    order = np.argsort(off, kind="stable")
    ends = off[order] + nb[order]  # no overflow: both <= file size
    clash = off[order][1:] < ends[:-1]
    if clash.any():
        k = int(np.argmax(clash))
        a, b = int(order[k]), int(order[k + 1])
        fail(path, f"tensor {names[b]!r} at [{off[b]}, {int(off[b]) + int(nb[b])}) overlaps "
                   f"tensor {names[a]!r} at [{off[a]}, {int(off[a]) + int(nb[a])})")
    if int(off[order[0]]) != data:
        fail(path, f"the first tensor {names[order[0]]!r} starts at {off[order[0]]}, "
                   f"not at data_offset {data}")
    if int(ends[-1]) != size:
        fail(path, f"the last tensor ends at {int(ends[-1])} but the file has {size} bytes "
                   f"(trailing bytes)")
    return order


def _shape(t: np.ndarray, i: int) -> tuple[int, ...]:
    return tuple(int(x) for x in t["shape"][i, :t["ndim"][i]])


def _exact_nbytes(t: np.ndarray, i: int) -> int:
    """Python-int size of record i, for error messages (its group size is valid)."""
    return dtypes.tensor_nbytes(DTYPE_NAMES[t["dtype"][i]], _shape(t, i), int(t["group_size"][i]))


def _check_nbytes(path: str, t: np.ndarray, names: list[str], cols: np.ndarray,
                  quantized: np.ndarray, size: int) -> None:
    """nbytes == shape x itemsize (or rows x row_stride), without integer overflow: a
    float64 estimate rejects anything far beyond the file size first, then the exact
    uint64 product (now known to fit) is compared."""
    code, shape, nb = t["dtype"], t["shape"], t["nbytes"]
    bits = _BITS[code]                               # (N,) codes are known here
    gs = np.maximum(t["group_size"].astype(np.float64), 1.0)
    dims = np.where(shape == 0, 1, shape)            # (N, 4) unused dims count as 1
    lead = dims.astype(np.float64).prod(axis=1) / cols.astype(np.float64)
    per_col = bits.astype(np.float64) / 8.0
    sb = _SCALE_BYTES[code]
    est = lead * cols.astype(np.float64) * (per_col + np.where(quantized, sb / gs, 0.0))
    huge = est > 2.0 * size + 4096.0
    if huge.any():
        i = int(np.argmax(huge))
        fail(path, f"tensor {names[i]!r}: shape {_shape(t, i)} of "
                   f"{DTYPE_NAMES[code[i]]} needs {_exact_nbytes(t, i)} bytes, "
                   f"more than the file has ({size}); nbytes field is {nb[i]}")
    with np.errstate(over="ignore"):
        lead_u = dims.prod(axis=1) // cols
        g = np.maximum(t["group_size"], 1).astype(np.uint64)
        row = np.where(quantized, cols * bits // np.uint64(8) + cols // g * sb.astype(np.uint64),
                       cols * (bits // np.uint64(8)))
        want = lead_u * row
    bad = want != nb
    if bad.any():
        i = int(np.argmax(bad))
        fail(path, f"tensor {names[i]!r}: nbytes {nb[i]} does not match shape "
                   f"{_shape(t, i)} of {DTYPE_NAMES[code[i]]} "
                   f"(expected {_exact_nbytes(t, i)})")


def check_routing(path: str, t: np.ndarray, names: list[str], h: dict) -> None:
    """§8 step 12: routing_offset is the first router's offset (data_offset without routers)."""
    routers = [i for i, n in enumerate(names) if ".moe.router" in n and ROUTER_RE.fullmatch(n)]
    want = min((int(t["offset"][i]) for i in routers), default=h["data_offset"])
    if h["routing_offset"] != want:
        what = "the first router's offset" if routers else "data_offset (no routers)"
        fail(path, f"routing_offset {h['routing_offset']} should be {what} {want}")


# ----------------------------------------------------------------------------- expert index


def check_expert_index(path: str, idx: np.ndarray, t: np.ndarray, names: list[str],
                       pos: dict[str, int], order: np.ndarray, n_layers: int, n_experts: int
                       ) -> tuple[dict[int, dict[int, tuple[int, int]]], dict[int, int]]:
    """§8 step 13. Every expert block: known (layer, expert), unique, page-aligned, covering
    exactly its w_gate, w_up, w_down (consecutive in the file); per layer all n_experts
    present with equal sizes, identical tensor layouts and a constant stride.

    pos: name -> table row; order: table rows in file order (check_records). Returns
    blocks {layer: {expert: (offset, size)}} and strides {layer: bytes between blocks}."""
    E, n = n_experts, len(idx)
    lay, exp = idx["layer"].astype(np.uint64), idx["expert"].astype(np.uint64)
    boff, bsize = idx["offset"], idx["size"]

    def first(bad: np.ndarray, problem: Callable[[int], str]) -> None:
        if bad.any():
            k = int(np.argmax(bad))
            fail(path, f"expert index record {k} (layer {lay[k]}, expert {exp[k]}): "
                       f"{problem(k)}")

    first((lay >= n_layers) | (exp >= E),
          lambda k: f"out of range (n_layers {n_layers}, n_experts {E})")
    first(idx["reserved"] != 0, lambda k: "reserved field is not 0")
    first(boff % PAGE_SIZE != 0,
          lambda k: f"block offset {boff[k]} is not a multiple of {PAGE_SIZE}")
    key = lay * np.uint64(max(E, 1)) + exp            # < 2^64: both fields are u32
    by_key = np.argsort(key, kind="stable")
    dup = np.zeros(n, bool)
    dup[by_key[1:]] = key[by_key[1:]] == key[by_key[:-1]]
    first(dup, lambda k: "duplicate block")
    # The three tensors of each block, by canonical name.
    want = [expert_name(la, e, p)
            for la, e in zip(idx["layer"].tolist(), idx["expert"].tolist()) for p in PROJS]
    get = pos.get
    members = np.array([get(w, -1) for w in want], np.intp).reshape(n, 3)
    first((members < 0).any(axis=1), lambda k: f"tensor "
          f"{want[3 * k + int(np.argmax(members[k] < 0))]!r} is missing")
    if sum(1 for name in names if ".moe.experts." in name) > 3 * n:
        covered = set(want)
        for name in names:
            if ".moe.experts." in name and name not in covered and EXPERT_RE.fullmatch(name):
                fail(path, f"tensor {name!r}: expert tensor without an expert index record")
    if n == 0:
        return {}, {}
    rank = np.empty(len(t), np.intp)
    rank[order] = np.arange(len(t))
    r = rank[members]                                  # (n, 3) position in file order
    first((r[:, 1] != r[:, 0] + 1) | (r[:, 2] != r[:, 1] + 1),
          lambda k: "w_gate, w_up, w_down are not consecutive in the file")
    off, nb = t["offset"], t["nbytes"]
    g, d = members[:, 0], members[:, 2]
    # (off[d] + nb[d] - boff cannot wrap where boff == off[g]: g precedes d in the file)
    first((boff != off[g]) | (bsize != off[d] + nb[d] - boff),
          lambda k: f"block [{boff[k]}, {int(boff[k]) + int(bsize[k])}) does not cover "
                    f"exactly its tensors [{off[g[k]]}, {int(off[d[k]]) + int(nb[d[k]])})")
    # Per layer: experts 0..E-1, equal block sizes, constant stride, same tensor layout.
    layers = np.unique(lay)
    counts = np.searchsorted(key[by_key], (layers + 1) * np.uint64(max(E, 1))) - \
        np.searchsorted(key[by_key], layers * np.uint64(max(E, 1)))
    if (counts != E).any():
        la = int(layers[np.argmax(counts != E)])
        have = set(exp[lay == la].tolist())
        missing = first_missing(have, E)
        fail(path, f"expert index, layer {la}: experts {missing} missing "
                   f"(n_experts {E})")
    grid = by_key.reshape(len(layers), E)              # (layers, E) -> record, by key
    size0 = bsize[grid[:, :1]]
    stride = (size0 + np.uint64(PAGE_SIZE - 1)) // np.uint64(PAGE_SIZE) * np.uint64(PAGE_SIZE)
    expect = boff[grid[:, :1]] + np.arange(E, dtype=np.uint64)[None, :] * stride
    bad = (bsize[grid] != size0) | (boff[grid] != expect)
    if bad.any():
        li, e = np.unravel_index(np.argmax(bad), bad.shape)
        k = grid[li, e]
        fail(path, f"expert index, layer {lay[k]}, expert {e}: block [{boff[k]}, "
                   f"+{bsize[k]}) breaks the layer's constant stride (expected offset "
                   f"{expect[li, e]}, size {size0[li, 0]})")
    for j, p in enumerate(PROJS):
        m = members[grid, j]                           # (layers, E) table rows
        ref = m[:, :1]
        bad = ((t["dtype"][m] != t["dtype"][ref]) | (t["group_size"][m] != t["group_size"][ref])
               | (t["shape"][m] != t["shape"][ref]).any(axis=-1)
               | (off[m] - boff[grid] != off[ref] - boff[grid[:, :1]]))
        if bad.any():
            i = int(m.reshape(-1)[np.argmax(bad)])
            fail(path, f"tensor {names[i]!r}: dtype/shape/layout differs from expert 0 "
                       f"of its layer")
    blocks: dict[int, dict[int, tuple[int, int]]] = {int(la): {} for la in layers}
    # (expect cannot overflow: the blocks are disjoint and inside the file, so
    # E * stride <= file_size + E * PAGE_SIZE)
    for la, e, o, sz in zip(lay.tolist(), exp.tolist(), boff.tolist(), bsize.tolist()):
        blocks[la][e] = (o, sz)
    return blocks, {int(la): int(st) for la, st in zip(layers, stride[:, 0])}


# ----------------------------------------------------------------------------- metadata


def _reject_constant(token: str) -> Any:
    raise ValueError(f"non-standard JSON constant {token}")


def _no_duplicate_keys(pairs: list[tuple[str, Any]]) -> dict:
    out = dict(pairs)
    if len(out) != len(pairs):
        seen: set[str] = set()
        dup = next(k for k, _ in pairs if k in seen or seen.add(k))
        raise ValueError(f"duplicate key {dup!r}")
    return out


def check_metadata(meta: Any) -> None:
    """ValueError unless meta has the §5 shape: an object whose known keys have the right
    types (config/arch/converter: objects; user: string -> string; tokenizer: null or
    {"files": {filename: text}})."""
    if not isinstance(meta, dict):
        raise ValueError(f"metadata must be a JSON object, found {type(meta).__name__}")
    for key in ("config", "arch", "converter", "user"):
        if key in meta and not isinstance(meta[key], dict):
            raise ValueError(f"metadata {key!r} must be an object, "
                             f"found {type(meta[key]).__name__}")
    for k, v in meta.get("user", {}).items():
        if not isinstance(v, str):
            raise ValueError(f"metadata 'user' value for {k!r} must be a string, "
                             f"found {type(v).__name__}")
    tok = meta.get("tokenizer")
    if tok is not None:
        files = tok.get("files") if isinstance(tok, dict) else None
        if not isinstance(files, dict) or not all(isinstance(v, str) for v in files.values()):
            raise ValueError("metadata 'tokenizer' must be null or "
                             "{\"files\": {filename: text, ...}}")


def metadata_suffix(crc: int) -> bytes:
    """The last bytes of the metadata JSON colibri writes: its CRC32 key, value and the
    closing brace (a fixed length, so a reader finds the covered bytes without parsing)."""
    return f'"{METADATA_CRC_KEY}": "{crc:08x}"}}'.encode("ascii")


_SUFFIX_LEN = len(metadata_suffix(0))


def with_metadata_crc(body: bytes) -> bytes:
    """JSON object bytes `{...}` (json.dumps output) -> the same object with METADATA_CRC_KEY
    as its last key, holding the CRC32 of every byte before that key."""
    head = body.rstrip()[:-1]
    covered = head + (b"" if head.rstrip() == b"{" else b", ")
    return covered + metadata_suffix(zlib.crc32(covered))


def _check_metadata_crc(path: str, raw: bytes, meta: dict) -> None:
    """A file whose metadata carries METADATA_CRC_KEY (colibri writes it since the safety
    work; older files have none and are read as before) must match it byte for byte."""
    if METADATA_CRC_KEY not in meta:
        return
    stored = meta[METADATA_CRC_KEY]
    if not (isinstance(stored, str) and len(stored) == 8
            and all(c in "0123456789abcdef" for c in stored)
            and raw[-_SUFFIX_LEN:] == metadata_suffix(int(stored, 16))):
        fail(path, f"metadata key {METADATA_CRC_KEY!r} is malformed or not the last key "
                   f"(found {stored!r})")
    crc = zlib.crc32(raw[:-_SUFFIX_LEN])
    if f"{crc:08x}" != stored:
        fail(path, f"metadata checksum mismatch (stored {stored}, computed {crc:08x}): the "
                   f"metadata is corrupted")


def parse_metadata(path: str, raw: bytes) -> dict:
    """§8 step 14: the metadata bytes as a dict (strict JSON of bounded depth, the §5 shape,
    the checksum when present). The checksum key is removed from the result."""
    try:
        text = raw.decode("utf-8")
        safe_json.check_depth(raw, "metadata JSON")       # on the bytes: no second copy
        meta = json.loads(text, object_pairs_hook=_no_duplicate_keys,
                          parse_constant=_reject_constant)
        check_metadata(meta)
    except UnicodeDecodeError as e:
        fail(path, f"metadata is not valid UTF-8 ({e.reason} at byte {e.start})")
    except RecursionError:
        fail(path, "metadata JSON is nested too deeply")
    except ValueError as e:  # json.JSONDecodeError is a ValueError
        fail(path, f"metadata is not a valid colibri JSON object: {e}")
    _check_metadata_crc(path, raw, meta)
    meta.pop(METADATA_CRC_KEY, None)
    return meta


# ----------------------------------------------------------------------------- full read


def crc_mismatches(buffer: memoryview, tensors: Iterable[tuple[str, int, int, int]]
                   ) -> list[str]:
    """Names of the tensors (name, offset, nbytes, stored crc32) whose bytes in `buffer` do
    not have the stored CRC32 (read 64 MB at a time)."""
    bad = []
    for name, offset, nbytes, stored in tensors:
        crc = 0
        for start in range(offset, offset + nbytes, 1 << 26):
            crc = zlib.crc32(buffer[start: min(start + (1 << 26), offset + nbytes)], crc)
        if crc != stored:
            bad.append(name)
    return bad


def gap_problems(data: bytes, data_offset: int, extents: Iterable[tuple[str, int, int]]
                 ) -> list[str]:
    """Non-zero bytes between tensors: extents are (name, offset, nbytes) in file order."""
    problems, end = [], data_offset
    for name, offset, nbytes in extents:
        if data[end: offset].count(0) != offset - end:
            problems.append(f"non-zero padding bytes in [{end}, {offset}) before "
                            f"tensor {name!r}")
        end = offset + nbytes
    return problems


def count_nonfinite(values: np.ndarray, bf16_bits: bool = False) -> int:
    """Non-finite entries of a float array (..., C) (bf16_bits: uint16 bf16 bits), counted
    ~1M elements at a time so the temporaries stay small."""
    flat = values.reshape(-1, values.shape[-1])  # (rows, C)
    step = max(1, (1 << 20) // flat.shape[1])
    total = 0
    for start in range(0, flat.shape[0], step):
        chunk = flat[start: start + step]
        if bf16_bits:
            total += int(np.count_nonzero((chunk & 0x7F80) == 0x7F80))
        else:
            total += int(chunk.size - np.count_nonzero(np.isfinite(chunk)))
    return total
