"""The .colibri model file: reader (mmap, zero-copy views) and atomic writer.

One little-endian file per model (docs/format.md is the full specification):

    header (128 B) | tensor table (160 B / tensor) | expert index (32 B / expert block)
    | metadata (UTF-8 JSON) | zero padding to a page | data: routers, dense, expert blocks

The reader checks every header field, every table record and every expert-index record
against the file size and against each other with plain reads *before* it maps the file,
so a truncated, corrupted or hostile file raises ColibriFormatError and never reaches numpy.
Tensor data is never read at open: views are made on demand and checksums are verified
only by verify_checksums()/validate().

Shape alphabet: E experts, R rows (output features), C columns (input features),
G scale groups per row.
"""
from __future__ import annotations

import itertools
import json
import math
import mmap
import os
import re
import secrets
import stat
import struct
import zlib
from dataclasses import dataclass
from collections.abc import Mapping
from typing import Any, Iterable

import numpy as np

from . import quant
from .errors import ColibriError, ColibriFormatError

FORMAT_VERSION = 1
MAGIC = b"COLI"
HEADER_SIZE = 128
RECORD_SIZE = 160
EXPERT_RECORD_SIZE = 32
ALIGNMENT = 64
PAGE_SIZE = 4096
MAX_NAME_BYTES = 95

HEADER_FLAG_CRC = 1  # header flags bit 0: per-tensor CRC32s present
RECORD_FLAG_CRC = 1  # record flags bit 0: this record's crc32 is valid

# Header: magic, version, n_experts, n_layers, header_size, tensor_count, routing_offset,
# data_offset, table_offset, record_size, alignment, expert_index_offset,
# expert_record_size, expert_count, metadata_offset, metadata_size, file_size, page_size,
# flags, reserved[20], header_crc32.
_HEADER = struct.Struct("<4sIIIIIQQQIIQIIQQQII20sI")
_HEADER_FIELDS = (
    "magic", "version", "n_experts", "n_layers", "header_size", "tensor_count",
    "routing_offset", "data_offset", "table_offset", "record_size", "alignment",
    "expert_index_offset", "expert_record_size", "expert_count", "metadata_offset",
    "metadata_size", "file_size", "page_size", "flags", "reserved", "header_crc32",
)
_RECORD = struct.Struct("<96sBBHI4QQQII")
_EXPERT_RECORD = struct.Struct("<IIQQQ")
assert _HEADER.size == HEADER_SIZE and _RECORD.size == RECORD_SIZE
assert _EXPERT_RECORD.size == EXPERT_RECORD_SIZE

# The same records as numpy structured dtypes: validating 20k records is a few vector ops.
_RECORD_DTYPE = np.dtype([
    ("name", "u1", (96,)), ("dtype", "u1"), ("ndim", "u1"), ("reserved", "<u2"),
    ("group_size", "<u4"), ("shape", "<u8", (4,)), ("offset", "<u8"), ("nbytes", "<u8"),
    ("crc32", "<u4"), ("flags", "<u4"),
])
_EXPERT_DTYPE = np.dtype([
    ("layer", "<u4"), ("expert", "<u4"), ("offset", "<u8"), ("size", "<u8"),
    ("reserved", "<u8"),
])
assert _RECORD_DTYPE.itemsize == RECORD_SIZE and _EXPERT_DTYPE.itemsize == EXPERT_RECORD_SIZE

# index = on-disk dtype code: f32, f16, bf16, q8, q4, i32
DTYPE_NAMES = tuple(sorted(quant.DTYPE_CODES, key=quant.DTYPE_CODES.__getitem__))
_NUMPY_DTYPES = {"f32": np.dtype("<f4"), "f16": np.dtype("<f2"), "bf16": np.dtype("<u2"),
                 "i32": np.dtype("<i4")}
PROJS = ("w_gate", "w_up", "w_down")   # order of the tensors inside an expert block
ROUTER_RE = re.compile(r"layers\.([0-9]+)\.moe\.router", re.ASCII)
EXPERT_RE = re.compile(r"layers\.([0-9]+)\.moe\.experts\.([0-9]+)\.(w_gate|w_up|w_down)",
                       re.ASCII)
_LAYER_RE = re.compile(r"layers\.([0-9]+)\.", re.ASCII)


def _round_up(x: int, multiple: int) -> int:
    return -(-x // multiple) * multiple


def router_name(layer: int) -> str:
    return f"layers.{layer}.moe.router"


def expert_name(layer: int, expert: int, proj: str) -> str:
    return f"layers.{layer}.moe.experts.{expert}.{proj}"


@dataclass(frozen=True)
class TensorInfo:
    """One tensor-table record. shape is the logical shape (columns C last for q8/q4)."""
    name: str
    dtype: str
    shape: tuple[int, ...]
    offset: int
    nbytes: int
    group_size: int
    crc32: int | None


class TensorTable(Mapping):
    """name -> TensorInfo in table order (file order for files colibri wrote); read-only.

    TensorInfos are made on first access: a file with 20k tensors opens without building
    20k Python objects.
    """

    def __init__(self, names: list[str], pos: dict[str, int], table: np.ndarray):
        self._names, self._pos, self._cache = names, pos, {}
        self._code, self._ndim, self._shape = table["dtype"], table["ndim"], table["shape"]
        self._off, self._nb, self._gs = table["offset"], table["nbytes"], table["group_size"]
        self._crc, self._flags = table["crc32"], table["flags"]

    def __getitem__(self, name: str) -> TensorInfo:
        info = self._cache.get(name)
        if info is None:
            i = self._pos[name]
            crc = int(self._crc[i]) if self._flags[i] & RECORD_FLAG_CRC else None
            info = TensorInfo(name, DTYPE_NAMES[self._code[i]],
                              tuple(int(d) for d in self._shape[i, :self._ndim[i]]),
                              int(self._off[i]), int(self._nb[i]), int(self._gs[i]), crc)
            self._cache[name] = info
        return info

    def __contains__(self, name: object) -> bool:
        return name in self._pos

    def __iter__(self):
        return iter(self._names)

    def __len__(self) -> int:
        return len(self._names)

    def __repr__(self) -> str:
        return f"<TensorTable of {len(self)} tensors>"


class QuantizedTensor:
    """Zero-copy view of a q8/q4 tensor (or of a stack of them).

    data:   uint8, shape (..., R, C*bits/8), rows strided by the row stride
    scales: float16, shape (..., R, C/G), strided the same way
    shape:  the logical shape (..., R, C); dtype "q8" or "q4"; group_size G
    """

    def __init__(self, data: np.ndarray, scales: np.ndarray, dtype: str,
                 shape: tuple[int, ...], group_size: int):
        self.data = data
        self.scales = scales
        self.dtype = dtype
        self.shape = tuple(shape)
        self.group_size = group_size

    @property
    def ndim(self) -> int:
        return len(self.shape)

    def dequantize(self) -> np.ndarray:
        """float32 copy in the logical shape."""
        if self.dtype == "q8":
            return quant.dequantize_q8(self.data.view(np.int8), self.scales, self.group_size)
        return quant.dequantize_q4(self.data, self.scales, self.group_size)

    def __repr__(self) -> str:
        return f"QuantizedTensor({self.dtype}, shape={self.shape}, group_size={self.group_size})"


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


def _layer_count(names: Iterable[str]) -> int:
    """1 + the largest i of the names 'layers.{i}.*' (0 when there are none)."""
    ids = {n.split(".", 2)[1] for n in names if n.startswith("layers.")}
    return max((int(i) for i in ids if i.isascii() and i.isdigit()), default=-1) + 1


def _first_missing(have: set[int], n: int, limit: int = 8) -> list[int]:
    """Up to `limit` numbers of range(n) not in `have`, without building range(n) (n comes
    from the file and may be 2^32-1)."""
    return list(itertools.islice((i for i in range(n) if i not in have), limit))


def _is_utf8(b: bytes) -> bool:
    try:
        b.decode("utf-8")
        return True
    except UnicodeDecodeError:
        return False


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
    """ValueError unless meta has the §1.6 shape: an object whose known keys have the right
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


# ----------------------------------------------------------------------------- reader


class ColibriFile:
    """A .colibri file, validated and mapped read-only. Tensors are zero-copy numpy views.

    Opening costs a few plain reads and O(tensor_count) vector checks; no tensor data is
    touched. Views stay valid after close() (they keep the mapping alive).
    """

    def __init__(self, path: str | os.PathLike):
        self.path = os.fspath(path)
        self._mm: mmap.mmap | None = None
        self._base: np.ndarray | None = None
        self.buffer: memoryview | None = None
        fd = os.open(self.path, os.O_RDONLY | getattr(os, "O_BINARY", 0))
        try:
            st = os.fstat(fd)
            if stat.S_ISDIR(st.st_mode):
                self._fail("is a directory, not a colibri file")
            if not stat.S_ISREG(st.st_mode):
                self._fail("is not a regular file")
            # Identity of what was mapped: a hot reload compares it to decide to reopen.
            self.identity = (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns)
            self._parse(fd, st.st_size)
            # No MAP_POPULATE: pages come in only when a view touches them.
            try:
                self._mm = mmap.mmap(fd, self.file_size, access=mmap.ACCESS_READ)
            except ValueError as e:  # the file shrank since fstat
                self._fail(f"cannot map {self.file_size} bytes: {e}")
        finally:
            os.close(fd)  # the mapping keeps its own reference to the file
        self.buffer = memoryview(self._mm)
        self._base = np.frombuffer(self._mm, np.uint8)   # (file_size,) read-only

    # -- validation (plain reads, before any mapping) -----------------------------------

    def _fail(self, problem: str) -> None:
        raise ColibriFormatError(f"{self.path}: {problem}")

    def _read(self, fd: int, offset: int, size: int) -> bytes:
        out = bytearray()
        while len(out) < size:
            chunk = os.pread(fd, min(size - len(out), 1 << 30), offset + len(out))
            if not chunk:
                self._fail(f"unexpected end of file reading {size} bytes at offset {offset} "
                           f"(file changed while opening?)")
            out += chunk
        return bytes(out)

    def _parse(self, fd: int, size: int) -> None:
        head = self._read(fd, 0, min(size, HEADER_SIZE))
        if 0 < len(head) < 4 and MAGIC.startswith(head):
            self._fail(f"truncated header: file is {size} bytes")
        if len(head) < 4 or head[:4] != MAGIC:
            found = repr(head[:4]) if head else "an empty file"
            self._fail(f"not a colibri file: expected magic {MAGIC!r} at offset 0, found "
                       f"{found}{_describe_foreign(head)}")
        if size < HEADER_SIZE:
            self._fail(f"truncated header: file is {size} bytes, the header alone is "
                       f"{HEADER_SIZE} bytes")
        h = dict(zip(_HEADER_FIELDS, _HEADER.unpack(head)))
        h["magic"] = h["magic"].decode("ascii")
        version = h["version"]
        if version > FORMAT_VERSION:
            hint = " (or a big-endian file)" if version == FORMAT_VERSION << 24 else ""
            self._fail(f"written by a newer colibri (format version {version}, this reader "
                       f"supports {FORMAT_VERSION}){hint}: upgrade colibri")
        if version == 0:
            self._fail("format version 0 is not valid (expected 1)")
        for field, want in (("header_size", HEADER_SIZE), ("record_size", RECORD_SIZE),
                            ("expert_record_size", EXPERT_RECORD_SIZE),
                            ("alignment", ALIGNMENT), ("page_size", PAGE_SIZE)):
            if h[field] != want:
                self._fail(f"header field {field} is {h[field]}, expected {want}")
        crc = zlib.crc32(head[:HEADER_SIZE - 4])
        if crc != h["header_crc32"]:
            self._fail(f"header checksum mismatch (stored 0x{h['header_crc32']:08x}, "
                       f"computed 0x{crc:08x}): the header is corrupted")
        if h["reserved"] != bytes(20):
            self._fail("header reserved bytes 0x68..0x7b are not zero")
        if h["flags"] & ~HEADER_FLAG_CRC:
            self._fail(f"header flags 0x{h['flags']:x} has unknown bits (known: 0x1)")
        if h["file_size"] != size:
            kind = "truncated" if size < h["file_size"] else "has trailing bytes"
            self._fail(f"file {kind}: header says file_size {h['file_size']}, "
                       f"the file has {size} bytes")
        self.header = h
        self.version = version
        self.n_layers = h["n_layers"]
        self.n_experts = h["n_experts"]
        self.file_size = size
        self._check_regions(h)
        prefix = self._read(fd, 0, h["data_offset"])
        self._check_padding(prefix)
        table = np.frombuffer(prefix, _RECORD_DTYPE, h["tensor_count"], h["table_offset"])
        index = np.frombuffer(prefix, _EXPERT_DTYPE, h["expert_count"],
                              h["expert_index_offset"])
        names = self._check_names(table)
        self._pos = dict(zip(names, range(len(names))))
        n_layers = _layer_count(names)
        if n_layers != self.n_layers:
            self._fail(f"header n_layers is {self.n_layers} but the tensor names use "
                       f"{n_layers} layers (layers.0 .. layers.{n_layers - 1})")
        self._check_records(table, names, h)
        self._check_routing(table, names, h)
        self._check_expert_index(index, table, names, h)
        self.metadata = self._parse_metadata(prefix, h)
        self.config = self.metadata.get("config", {})
        self.arch = self.metadata.get("arch", {})
        self._model_config = None
        self.user_metadata = self.metadata.get("user", {})
        tok = self.metadata.get("tokenizer")
        self.tokenizer_files = tok["files"] if tok is not None else None
        self.tensors = TensorTable(names, self._pos, table)

    @property
    def model_config(self) -> "ModelConfig":
        """The typed "arch" metadata (colibri.config.ModelConfig), built on first use;
        ConfigError naming this file and the field when it is missing or wrong."""
        if self._model_config is None:
            from .config import ModelConfig
            self._model_config = ModelConfig.from_metadata(self.arch, source=str(self.path))
        return self._model_config

    def _check_regions(self, h: dict) -> None:
        """Table, expert index and metadata: inside [header_size, data_offset), disjoint,
        and sized from counts BEFORE anything is read (a 2^32-1 count in a tiny file fails
        here, without allocating)."""
        size, data = self.file_size, h["data_offset"]
        if data % PAGE_SIZE or data < HEADER_SIZE or data > size:
            self._fail(f"data_offset {data} must be a multiple of {PAGE_SIZE} within the "
                       f"file (file has {size} bytes)")
        routing = h["routing_offset"]
        if not data <= routing <= size or routing % ALIGNMENT:
            self._fail(f"routing_offset {routing} must be {ALIGNMENT}-aligned and within "
                       f"the data section [{data}, {size}]")
        regions = []
        for what, off_field, count, unit in (
                ("tensor table", "table_offset", h["tensor_count"], RECORD_SIZE),
                ("expert index", "expert_index_offset", h["expert_count"], EXPERT_RECORD_SIZE),
                ("metadata", "metadata_offset", h["metadata_size"], 1)):
            off, nbytes = h[off_field], count * unit
            if off % 8 and unit > 1:
                self._fail(f"{off_field} {off} is not a multiple of 8")
            if off < HEADER_SIZE or off + nbytes > data:
                count_field = {"tensor table": "tensor_count", "expert index": "expert_count",
                               "metadata": "metadata_size"}[what]
                self._fail(f"{what} [{off}, {off + nbytes}) ({count_field} {count}) does not "
                           f"fit between the header end {HEADER_SIZE} and data_offset {data} "
                           f"(file has {size} bytes)")
            regions.append((off, off + nbytes, what))
        regions.sort()
        for (s0, e0, w0), (s1, e1, w1) in zip(regions, regions[1:]):
            if s1 < e0:
                self._fail(f"{w0} [{s0}, {e0}) overlaps {w1} [{s1}, {e1})")
        self._regions = regions
        want = _round_up(max(e for _, e, _ in regions), PAGE_SIZE)
        if data != want:
            self._fail(f"data_offset {data} should be the first multiple of {PAGE_SIZE} after "
                       f"the metadata, table and index: {want}")

    def _check_padding(self, prefix: bytes) -> None:
        """Bytes of [header end, data_offset) outside the three regions must be zero: no
        room for a second payload (a polyglot file) between the sections."""
        start = HEADER_SIZE
        for s0, e0, what in self._regions + [(len(prefix), len(prefix), "data")]:
            if prefix.count(0, start, s0) != s0 - start:
                self._fail(f"non-zero bytes in the padding [{start}, {s0}) before the {what}")
            start = max(start, e0)

    def _check_names(self, table: np.ndarray) -> list[str]:
        """Names: 1..95 UTF-8 bytes, NUL-terminated, NUL-padded, unique."""
        raw = table["name"]                                   # (N, 96) uint8
        nul = raw == 0
        first = np.argmax(nul, axis=1)                        # index of the first NUL
        tail_ok = (nul | (np.arange(96)[None, :] < first[:, None])).all(axis=1)
        for bad, problem in ((~nul.any(axis=1), "name has no NUL terminator in its 96 bytes"),
                             (first == 0, "empty name"),
                             (~tail_ok, "name is followed by non-NUL padding")):
            if bad.any():
                i = int(np.argmax(bad))
                self._fail(f"tensor record {i}: {problem} ({raw[i].tobytes()[:40]!r}...)")
        # As 'S96' the trailing NULs drop off in C: the list is the names' bytes.
        encoded = raw.view("S96")[:, 0].tolist()
        try:
            names = [b.decode("utf-8") for b in encoded]
        except UnicodeDecodeError as e:
            i = next(k for k, b in enumerate(encoded) if not _is_utf8(b))
            self._fail(f"tensor record {i}: name {encoded[i]!r} is not valid UTF-8 ({e.reason})")
        if len(set(names)) != len(names):
            seen: set[str] = set()
            i = next(k for k, n in enumerate(names) if n in seen or seen.add(n))
            self._fail(f"tensor record {i}: duplicate tensor name {names[i]!r}")
        return names

    def _first(self, bad: np.ndarray, names: list[str], problem) -> None:
        """Raise for the first True in bad (a per-record mask); problem(i) -> str."""
        if bad.any():
            i = int(np.argmax(bad))
            self._fail(f"tensor {names[i]!r}: {problem(i)}")

    def _check_records(self, t: np.ndarray, names: list[str], h: dict) -> None:
        self._order = np.arange(0)
        if len(t) == 0:
            if h["file_size"] != h["data_offset"]:
                self._fail(f"no tensors, but the file has {h['file_size'] - h['data_offset']} "
                           f"bytes after data_offset {h['data_offset']}")
            return
        code, ndim, gs = t["dtype"], t["ndim"], t["group_size"].astype(np.int64)
        shape, off, nb = t["shape"], t["offset"], t["nbytes"]
        f = self._first
        f(code >= len(DTYPE_NAMES), names,
          lambda i: f"unknown dtype code {code[i]} (known: 0..{len(DTYPE_NAMES) - 1} = "
                    f"{', '.join(DTYPE_NAMES)})")
        f((ndim < 1) | (ndim > 4), names, lambda i: f"ndim {ndim[i]} is not in 1..4")
        f(t["reserved"] != 0, names, lambda i: f"reserved field is {t['reserved'][i]}, not 0")
        f((t["flags"] & ~np.uint32(RECORD_FLAG_CRC)) != 0, names,
          lambda i: f"record flags 0x{t['flags'][i]:x} has unknown bits")
        if not h["flags"] & HEADER_FLAG_CRC:
            f((t["flags"] & RECORD_FLAG_CRC) != 0, names,
              lambda i: "has a crc32 but header flags bit 0 (checksums present) is clear")
        used = np.arange(4)[None, :] < ndim[:, None]
        f(((shape == 0) & used).any(axis=1), names,
          lambda i: f"zero dimension in shape {tuple(int(x) for x in shape[i, :ndim[i]])}")
        f(((shape != 0) & ~used).any(axis=1), names,
          lambda i: f"unused shape entries beyond ndim {ndim[i]} are not 0: "
                    f"{[int(x) for x in shape[i]]}")
        cols = shape[np.arange(len(t)), ndim.astype(np.intp) - 1]
        quantized = (code == 3) | (code == 4)
        # uint64 throughout: uint64 % int64 would go through float64 and round.
        g_u = np.maximum(t["group_size"], 1).astype(np.uint64)
        bad_gs = quantized & ((gs <= 0) | (gs % 32 != 0) | (cols % g_u != 0))
        f(bad_gs, names, lambda i: f"group_size {gs[i]} invalid for {DTYPE_NAMES[code[i]]} "
                                   f"with {cols[i]} columns (need a positive multiple of 32 "
                                   f"that divides the columns)")
        f(~quantized & (gs != 0), names,
          lambda i: f"group_size {gs[i]} must be 0 for {DTYPE_NAMES[code[i]]}")
        f(off % ALIGNMENT != 0, names,
          lambda i: f"offset {off[i]} is not a multiple of alignment {ALIGNMENT}")
        size, data = h["file_size"], h["data_offset"]
        f(off < data, names, lambda i: f"offset {off[i]} is before data_offset {data}")
        f((off > size) | (nb > size - np.minimum(off, size)), names,
          lambda i: f"bytes [{off[i]}, {int(off[i]) + int(nb[i])}) extend past the end of the "
                    f"file ({size} bytes)")
        self._check_nbytes(t, names, cols, quantized, size)
        order = np.argsort(off, kind="stable")
        ends = off[order] + nb[order]  # no overflow: both <= file size
        clash = off[order][1:] < ends[:-1]
        if clash.any():
            k = int(np.argmax(clash))
            a, b = int(order[k]), int(order[k + 1])
            self._fail(f"tensor {names[b]!r} at [{off[b]}, {int(off[b]) + int(nb[b])}) overlaps "
                       f"tensor {names[a]!r} at [{off[a]}, {int(off[a]) + int(nb[a])})")
        if int(off[order[0]]) != data:
            self._fail(f"the first tensor {names[order[0]]!r} starts at {off[order[0]]}, "
                       f"not at data_offset {data}")
        if int(ends[-1]) != size:
            self._fail(f"the last tensor ends at {int(ends[-1])} but the file has {size} bytes "
                       f"(trailing bytes)")
        self._order = order

    def _check_nbytes(self, t: np.ndarray, names: list[str], cols: np.ndarray,
                      quantized: np.ndarray, size: int) -> None:
        """nbytes == shape x itemsize (or rows x row_stride), without integer overflow: a
        float64 estimate rejects anything far beyond the file size first, then the exact
        uint64 product (now known to fit) is compared."""
        code, shape, nb = t["dtype"], t["shape"], t["nbytes"]
        gs = np.maximum(t["group_size"].astype(np.float64), 1.0)
        dims = np.where(shape == 0, 1, shape)            # (N, 4) unused dims count as 1
        lead = dims.astype(np.float64).prod(axis=1) / cols.astype(np.float64)
        per_col = np.choose(np.minimum(code, 5), [4.0, 2.0, 2.0, 1.0, 0.5, 4.0])
        est = lead * cols.astype(np.float64) * (per_col + np.where(quantized, 2.0 / gs, 0.0))
        huge = est > 2.0 * size + 4096.0
        if huge.any():
            i = int(np.argmax(huge))
            self._fail(f"tensor {names[i]!r}: shape {self._shape(t, i)} of "
                       f"{DTYPE_NAMES[code[i]]} needs {self._exact_nbytes(t, i)} bytes, "
                       f"more than the file has ({size}); nbytes field is {nb[i]}")
        with np.errstate(over="ignore"):
            lead_u = dims.prod(axis=1) // cols
            itemsize = np.choose(np.minimum(code, 5), [4, 2, 2, 0, 0, 4]).astype(np.uint64)
            g = np.maximum(t["group_size"], 1).astype(np.uint64)
            qbits = np.where(code == 3, 8, 4).astype(np.uint64)
            row = np.where(quantized, cols * qbits // 8 + cols // g * 2, cols * itemsize)
            want = lead_u * row
        bad = want != nb
        if bad.any():
            i = int(np.argmax(bad))
            self._fail(f"tensor {names[i]!r}: nbytes {nb[i]} does not match shape "
                       f"{self._shape(t, i)} of {DTYPE_NAMES[code[i]]} "
                       f"(expected {self._exact_nbytes(t, i)})")

    @staticmethod
    def _shape(t: np.ndarray, i: int) -> tuple[int, ...]:
        return tuple(int(x) for x in t["shape"][i, :t["ndim"][i]])

    def _exact_nbytes(self, t: np.ndarray, i: int) -> int:
        """Python-int size of record i, for error messages (its group size is valid)."""
        code, shape, g = int(t["dtype"][i]), self._shape(t, i), int(t["group_size"][i])
        if code in (3, 4):
            cols = shape[-1]
            return math.prod(shape[:-1]) * (cols * (8 if code == 3 else 4) // 8 + cols // g * 2)
        return math.prod(shape) * _NUMPY_DTYPES[DTYPE_NAMES[code]].itemsize

    def _check_routing(self, t: np.ndarray, names: list[str], h: dict) -> None:
        routers = [i for i, n in enumerate(names) if ".moe.router" in n and ROUTER_RE.fullmatch(n)]
        want = min((int(t["offset"][i]) for i in routers), default=h["data_offset"])
        if h["routing_offset"] != want:
            what = "the first router's offset" if routers else "data_offset (no routers)"
            self._fail(f"routing_offset {h['routing_offset']} should be {what} {want}")

    def _check_expert_index(self, idx: np.ndarray, t: np.ndarray, names: list[str],
                            h: dict) -> None:
        """Every expert block: known (layer, expert), unique, page-aligned, covering exactly
        its w_gate, w_up, w_down (consecutive in the file); per layer all n_experts present
        with equal sizes, identical tensor layouts and a constant stride."""
        E, n = self.n_experts, len(idx)
        lay, exp = idx["layer"].astype(np.uint64), idx["expert"].astype(np.uint64)
        boff, bsize = idx["offset"], idx["size"]

        def first(bad: np.ndarray, problem) -> None:
            if bad.any():
                k = int(np.argmax(bad))
                self._fail(f"expert index record {k} (layer {lay[k]}, expert {exp[k]}): "
                           f"{problem(k)}")

        first((lay >= self.n_layers) | (exp >= E),
              lambda k: f"out of range (n_layers {self.n_layers}, n_experts {E})")
        first(idx["reserved"] != 0, lambda k: "reserved field is not 0")
        first(boff % PAGE_SIZE != 0,
              lambda k: f"block offset {boff[k]} is not a multiple of {PAGE_SIZE}")
        key = lay * np.uint64(max(E, 1)) + exp            # < 2^64: both fields are u32
        order = np.argsort(key, kind="stable")
        dup = np.zeros(n, bool)
        dup[order[1:]] = key[order[1:]] == key[order[:-1]]
        first(dup, lambda k: "duplicate block")
        # The three tensors of each block, by canonical name.
        want = [f"layers.{la}.moe.experts.{e}.{p}"
                for la, e in zip(idx["layer"].tolist(), idx["expert"].tolist()) for p in PROJS]
        get = self._pos.get
        members = np.array([get(w, -1) for w in want], np.intp).reshape(n, 3)
        first((members < 0).any(axis=1), lambda k: f"tensor "
              f"{want[3 * k + int(np.argmax(members[k] < 0))]!r} is missing")
        if sum(1 for name in names if ".moe.experts." in name) > 3 * n:
            covered = set(want)
            for name in names:
                if ".moe.experts." in name and name not in covered and EXPERT_RE.fullmatch(name):
                    self._fail(f"tensor {name!r}: expert tensor without an expert index record")
        self._blocks: dict[int, dict[int, tuple[int, int]]] = {}
        self._stride: dict[int, int] = {}
        if n == 0:
            return
        rank = np.empty(len(t), np.intp)
        rank[self._order] = np.arange(len(t))
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
        counts = np.searchsorted(key[order], (layers + 1) * np.uint64(max(E, 1))) - \
            np.searchsorted(key[order], layers * np.uint64(max(E, 1)))
        if (counts != E).any():
            la = int(layers[np.argmax(counts != E)])
            have = set(exp[lay == la].tolist())
            missing = _first_missing(have, E)
            self._fail(f"expert index, layer {la}: experts {missing} missing "
                       f"(n_experts {E})")
        grid = order.reshape(len(layers), E)               # (layers, E) -> record, by key
        size0 = bsize[grid[:, :1]]
        stride = (size0 + np.uint64(PAGE_SIZE - 1)) // np.uint64(PAGE_SIZE) * np.uint64(PAGE_SIZE)
        expect = boff[grid[:, :1]] + np.arange(E, dtype=np.uint64)[None, :] * stride
        bad = (bsize[grid] != size0) | (boff[grid] != expect)
        if bad.any():
            li, e = np.unravel_index(np.argmax(bad), bad.shape)
            k = grid[li, e]
            self._fail(f"expert index, layer {lay[k]}, expert {e}: block [{boff[k]}, "
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
                self._fail(f"tensor {names[i]!r}: dtype/shape/layout differs from expert 0 "
                           f"of its layer")
        self._blocks = {int(la): {} for la in layers}
        # (expect cannot overflow: the blocks are disjoint and inside the file, so
        # E * stride <= file_size + E * PAGE_SIZE)
        for la, e, o, sz in zip(lay.tolist(), exp.tolist(), boff.tolist(), bsize.tolist()):
            self._blocks[la][e] = (o, sz)
        self._stride = {int(la): int(st) for la, st in zip(layers, stride[:, 0])}

    def _parse_metadata(self, prefix: bytes, h: dict) -> dict:
        raw = prefix[h["metadata_offset"]: h["metadata_offset"] + h["metadata_size"]]
        try:
            meta = json.loads(raw.decode("utf-8"), object_pairs_hook=_no_duplicate_keys,
                              parse_constant=_reject_constant)
            check_metadata(meta)
        except UnicodeDecodeError as e:
            self._fail(f"metadata is not valid UTF-8 ({e.reason} at byte {e.start})")
        except RecursionError:
            self._fail("metadata JSON is nested too deeply")
        except ValueError as e:  # json.JSONDecodeError is a ValueError
            self._fail(f"metadata is not a valid colibri JSON object: {e}")
        return meta

    # -- access ------------------------------------------------------------------------

    def _mapping(self) -> mmap.mmap:
        if self._mm is None:
            raise ColibriError(f"{self.path}: file is closed")
        return self._mm

    def __contains__(self, name: object) -> bool:
        return name in self.tensors

    def __len__(self) -> int:
        return len(self.tensors)

    def names(self) -> list[str]:
        return list(self.tensors)

    def info(self, name: str) -> TensorInfo:
        try:
            return self.tensors[name]
        except KeyError:
            raise KeyError(f"{self.path}: no tensor named {name!r}") from None

    def _view(self, info: TensorInfo, lead_stride: int | None = None, count: int = 1
              ) -> np.ndarray | QuantizedTensor:
        """Read-only view of one tensor, or of `count` equally shaped tensors lead_stride
        bytes apart (shape (count, *shape)).

        Every view derives from self._base (np.frombuffer holds a buffer export of the
        mapping), so mmap.close() cannot unmap pages a view still points at. (An
        np.ndarray(buffer=mm) would NOT hold an export: closing under it segfaults.)
        """
        base = self._base
        if base is None:
            raise ColibriError(f"{self.path}: file is closed")
        dtype, shape, gs = info.dtype, info.shape, info.group_size
        if dtype in _NUMPY_DTYPES:
            np_dtype, phys = _NUMPY_DTYPES[dtype], shape
        else:  # rows of quant bytes followed by their scales
            np_dtype = np.dtype(np.uint8)
            phys = shape[:-1] + (quant.row_stride(dtype, shape[-1], gs),)
        if lead_stride is None:
            arr = base[info.offset: info.offset + info.nbytes].view(np_dtype).reshape(phys)
        else:
            strides = [np_dtype.itemsize]
            for d in reversed(phys[1:]):
                strides.insert(0, strides[0] * d)
            end = info.offset + (count - 1) * lead_stride + info.nbytes
            if end > len(base):  # guaranteed by the checks at open; never trust, verify
                raise ColibriFormatError(f"{self.path}: stack of {info.name!r} ends at {end}, "
                                         f"past the file ({len(base)} bytes)")
            arr = np.lib.stride_tricks.as_strided(
                base[info.offset: end].view(np_dtype), (count,) + phys,
                (lead_stride,) + tuple(strides), writeable=False)
        if dtype in _NUMPY_DTYPES:
            return arr
        data, scales = quant.split_rows(arr, dtype, shape[-1], gs)
        logical = ((count,) if lead_stride is not None else ()) + shape
        return QuantizedTensor(data, scales, dtype, logical, gs)

    def tensor(self, name: str) -> np.ndarray | QuantizedTensor:
        """Zero-copy read-only view: f32 -> float32, f16 -> float16, bf16 -> uint16 (raw
        bits), i32 -> int32, q8/q4 -> QuantizedTensor; logical shape."""
        return self._view(self.info(name))

    __getitem__ = tensor

    def to_float32(self, name: str) -> np.ndarray:
        """float32 copy in the logical shape (bf16 widened, q8/q4 dequantized)."""
        view = self.tensor(name)
        if isinstance(view, QuantizedTensor):
            return view.dequantize()
        if self.tensors[name].dtype == "bf16":
            return quant.bf16_to_f32(view)
        return view.astype(np.float32)

    def expert_block(self, layer: int, expert: int) -> tuple[int, int]:
        """(offset, size) in bytes of one expert's contiguous, page-aligned block."""
        try:
            return self._blocks[layer][expert]
        except KeyError:
            raise KeyError(f"{self.path}: no expert block for layer {layer}, "
                           f"expert {expert}") from None

    def expert_stride(self, layer: int) -> int:
        """Bytes between consecutive expert blocks of a layer."""
        self.expert_block(layer, 0)
        return self._stride[layer]

    def expert_stack(self, layer: int, which: str) -> np.ndarray | QuantizedTensor:
        """Zero-copy (E, R, C) view of w_gate/w_up/w_down over all experts of a layer,
        strided by the layer's constant block stride."""
        if which not in PROJS:
            raise ValueError(f"which must be one of {PROJS}, got {which!r}")
        self.expert_block(layer, 0)
        return self._view(self.tensors[expert_name(layer, 0, which)], self._stride[layer],
                          self.n_experts)

    # -- integrity ---------------------------------------------------------------------

    def verify_checksums(self, progress: bool = False) -> list[str]:
        """Names of tensors whose stored crc32 does not match their bytes (reads them all)."""
        mv = memoryview(self._mapping())
        infos: Iterable[TensorInfo] = [i for i in self.tensors.values() if i.crc32 is not None]
        if progress:
            from tqdm import tqdm
            infos = tqdm(infos, desc="checksums", unit="tensor")
        bad = []
        for info in infos:
            crc = 0
            for start in range(info.offset, info.offset + info.nbytes, 1 << 26):
                crc = zlib.crc32(mv[start: min(start + (1 << 26), info.offset + info.nbytes)],
                                 crc)
            if crc != info.crc32:
                bad.append(info.name)
        mv.release()
        return bad

    def validate(self, progress: bool = False) -> list[str]:
        """Problems found by a full read: checksum mismatches, non-zero gap bytes between
        tensors, non-finite floats or scales. Empty list = healthy. (Structure was already
        checked at open.)"""
        problems = [f"tensor {n!r}: crc32 mismatch" for n in self.verify_checksums(progress)]
        mm = self._mapping()
        end = self.header["data_offset"]
        for info in sorted(self.tensors.values(), key=lambda i: i.offset):
            if mm[end: info.offset].count(0) != info.offset - end:
                problems.append(f"non-zero padding bytes in [{end}, {info.offset}) before "
                                f"tensor {info.name!r}")
            end = info.offset + info.nbytes
        for info in self.tensors.values():
            n = self._count_nonfinite(info)
            if n:
                problems.append(f"tensor {info.name!r}: {n} non-finite values")
        return problems

    def _count_nonfinite(self, info: TensorInfo) -> int:
        if info.dtype == "i32":
            return 0
        view = self.tensor(info.name)
        if isinstance(view, QuantizedTensor):
            view = view.scales  # quant bytes are always finite; scales may not be
        flat = view.reshape(-1, view.shape[-1])  # (rows, C)
        step = max(1, (1 << 20) // flat.shape[1])  # ~1M elements: bounded temporaries
        total = 0
        for start in range(0, flat.shape[0], step):
            chunk = flat[start: start + step]
            if info.dtype == "bf16":
                total += int(np.count_nonzero((chunk & 0x7F80) == 0x7F80))
            else:
                total += int(chunk.size - np.count_nonzero(np.isfinite(chunk)))
        return total

    # -- lifetime ----------------------------------------------------------------------

    def close(self) -> None:
        """Drop the mapping. Views handed out earlier keep it alive until they go away."""
        self._base = None  # views made from it keep it (and the mapping) alive
        if self.buffer is not None:
            try:
                self.buffer.release()
            except BufferError:
                pass  # someone sliced self.buffer; their view keeps the mapping alive
            self.buffer = None
        if self._mm is not None:
            try:
                self._mm.close()
            except BufferError:
                pass  # numpy views exist: the mapping is unmapped when the last one dies
            self._mm = None

    def __enter__(self) -> "ColibriFile":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __repr__(self) -> str:
        return (f"ColibriFile({self.path!r}, version={self.version}, "
                f"tensors={len(self.tensors)}, n_layers={self.n_layers}, "
                f"n_experts={self.n_experts}, size={self.file_size})")


def open(path: str | os.PathLike) -> ColibriFile:  # noqa: A001 - colibri.open, by design
    """Open and validate a .colibri file (alias of ColibriFile(path))."""
    return ColibriFile(path)


# ----------------------------------------------------------------------------- writer

ROLES = ("router", "dense", "expert")
_WRITE_CHUNK = 1 << 24  # bytes of input encoded and written at a time (bounds temporaries)


@dataclass
class TensorSpec:
    """What the writer needs to plan one tensor before seeing its data.

    role: "router" (layers.{layer}.moe.router), "expert"
    (layers.{layer}.moe.experts.{expert}.{proj}) or "dense" (anything else).
    """
    name: str
    dtype: str
    shape: tuple[int, ...]
    group_size: int = 0
    role: str = "dense"
    layer: int | None = None
    expert: int | None = None
    proj: str | None = None

    @classmethod
    def infer(cls, name: str, dtype: str, shape: tuple[int, ...],
              group_size: int = 0) -> "TensorSpec":
        """A spec whose role/layer/expert/proj come from the canonical name (SPEC §1.7)."""
        if m := ROUTER_RE.fullmatch(name):
            return cls(name, dtype, tuple(shape), group_size, "router", int(m.group(1)))
        if m := EXPERT_RE.fullmatch(name):
            return cls(name, dtype, tuple(shape), group_size, "expert", int(m.group(1)),
                       int(m.group(2)), m.group(3))
        return cls(name, dtype, tuple(shape), group_size)


def _check_spec(s: TensorSpec, n_layers: int, n_experts: int) -> None:
    try:
        raw = s.name.encode("utf-8")
    except (UnicodeEncodeError, AttributeError):
        raise ValueError(f"tensor name {s.name!r} is not encodable as UTF-8") from None
    if not raw or len(raw) > MAX_NAME_BYTES or b"\0" in raw:
        raise ValueError(f"tensor name {s.name!r}: must be 1..{MAX_NAME_BYTES} UTF-8 bytes "
                         f"without NUL (has {len(raw)})")
    if s.dtype not in DTYPE_NAMES:
        raise ValueError(f"tensor {s.name!r}: unknown dtype {s.dtype!r} "
                         f"(known: {', '.join(DTYPE_NAMES)})")
    if not 1 <= len(s.shape) <= 4 or not all(
            isinstance(d, (int, np.integer)) and 0 < d < 2**63 for d in s.shape):
        raise ValueError(f"tensor {s.name!r}: shape {s.shape} must have 1..4 positive dims")
    if s.dtype in quant.QUANTIZED:
        quant.check_group_size(int(s.shape[-1]), s.group_size, s.name)
    elif s.group_size:
        raise ValueError(f"tensor {s.name!r}: group_size {s.group_size} given for "
                         f"unquantized dtype {s.dtype}")
    if s.role not in ROLES:
        raise ValueError(f"tensor {s.name!r}: role {s.role!r} not in {ROLES}")
    # Roles and canonical names must agree: the reader finds routers and experts by name.
    inferred = TensorSpec.infer(s.name, s.dtype, s.shape)
    if (inferred.role, inferred.layer, inferred.expert, inferred.proj) != (
            s.role, s.layer, s.expert, s.proj) and not (
            s.role == "dense" and inferred.role == "dense"):
        raise ValueError(f"tensor {s.name!r}: role {s.role} (layer {s.layer}, expert "
                         f"{s.expert}, proj {s.proj}) does not match its name; routers are "
                         f"'layers.L.moe.router', experts 'layers.L.moe.experts.E.PROJ'")
    if s.role != "dense" and s.layer >= n_layers:
        raise ValueError(f"tensor {s.name!r}: layer {s.layer} >= n_layers {n_layers}")
    if s.role == "expert" and s.expert >= n_experts:
        raise ValueError(f"tensor {s.name!r}: expert {s.expert} >= n_experts {n_experts}")


@dataclass
class _Planned:
    spec: TensorSpec
    offset: int
    nbytes: int
    crc32: int = 0
    written: bool = False


class ColibriWriter:
    """Writes a .colibri file atomically.

    The layout is planned from the specs up front; header, table, expert index and metadata
    are written at once; the caller then streams tensors in any order with write(). finish()
    fills in the CRCs, checks that every tensor was written, fsyncs and renames the temp file
    (.NAME.tmp-XXXX in the destination folder) onto the destination. On any exception inside
    `with`, abort() deletes the temp file and the destination is untouched.
    """

    def __init__(self, path: str | os.PathLike, specs: list[TensorSpec], metadata: dict,
                 *, n_layers: int, n_experts: int, checksums: bool = True,
                 overwrite: bool = False):
        self.path = os.fspath(path)
        self.overwrite = overwrite
        self.checksums = checksums
        self._fd: int | None = None
        self._tmp: str | None = None
        self._finished = False
        if os.path.isdir(self.path):
            raise IsADirectoryError(f"{self.path}: is a directory")
        if not overwrite and os.path.lexists(self.path):
            raise FileExistsError(f"{self.path}: already exists (pass overwrite=True to "
                                  f"replace it)")
        if not (0 <= n_layers < 2**32 and 0 <= n_experts < 2**32):
            raise ValueError(f"n_layers {n_layers} / n_experts {n_experts} must fit in u32")
        self.n_layers, self.n_experts = n_layers, n_experts
        self._plan(list(specs), metadata)
        folder, base = os.path.split(os.path.abspath(self.path))
        tmp = os.path.join(folder, f".{base}.tmp-{secrets.token_hex(4)}")
        self._fd = os.open(tmp, os.O_RDWR | os.O_CREAT | os.O_EXCL | getattr(os, "O_BINARY", 0),
                           0o666)
        self._tmp = tmp
        try:
            # Sized up front: the gaps between tensors read back as zeros (holes).
            os.ftruncate(self._fd, self.file_size)
            self._pwrite(self._preamble(), 0)
        except BaseException:
            self.abort()
            raise

    # -- planning ----------------------------------------------------------------------

    def _plan(self, specs: list[TensorSpec], metadata: dict) -> None:
        seen: set[str] = set()
        for s in specs:
            _check_spec(s, self.n_layers, self.n_experts)
            if s.name in seen:
                raise ValueError(f"duplicate tensor name {s.name!r}")
            seen.add(s.name)
        if _layer_count(seen) != self.n_layers:
            raise ValueError(f"n_layers is {self.n_layers} but the tensor names use "
                             f"{_layer_count(seen)} layers (layers.0 .. layers.N-1)")
        check_metadata(metadata)
        self._meta = json.dumps(metadata, ensure_ascii=False, sort_keys=False,
                                allow_nan=False).encode("utf-8")
        routers = sorted((s for s in specs if s.role == "router"), key=lambda s: s.layer)
        dense = [s for s in specs if s.role == "dense"]
        experts: dict[int, dict[int, dict[str, TensorSpec]]] = {}
        for s in specs:
            if s.role == "expert":
                experts.setdefault(s.layer, {}).setdefault(s.expert, {})[s.proj] = s
        for layer, blocks in experts.items():
            if sorted(blocks) != list(range(self.n_experts)):
                missing = _first_missing(set(blocks), self.n_experts)
                raise ValueError(f"layer {layer}: experts {missing} missing "
                                 f"(n_experts {self.n_experts})")
            for e, triple in sorted(blocks.items()):
                if len(triple) != 3:
                    raise ValueError(f"layer {layer}, expert {e}: missing "
                                     f"{sorted(set(PROJS) - set(triple))}")
            for e, triple in blocks.items():
                for p in PROJS:
                    a, b = blocks[0][p], triple[p]
                    if (a.dtype, tuple(a.shape), a.group_size) != (
                            b.dtype, tuple(b.shape), b.group_size):
                        raise ValueError(f"tensor {b.name!r}: {b.dtype} {tuple(b.shape)} "
                                         f"g{b.group_size} differs from expert 0 of layer "
                                         f"{layer} ({a.dtype} {tuple(a.shape)} g{a.group_size})")
        n_blocks = sum(len(b) for b in experts.values())
        if len(specs) >= 2**32:
            raise ValueError(f"{len(specs)} tensors: the format holds at most 2^32-1")
        table_end = HEADER_SIZE + len(specs) * RECORD_SIZE
        self._index_offset = _round_up(table_end, 8)
        self._meta_offset = self._index_offset + n_blocks * EXPERT_RECORD_SIZE
        self.data_offset = _round_up(self._meta_offset + len(self._meta), PAGE_SIZE)

        self._tensors: dict[str, _Planned] = {}
        cursor = self.data_offset

        def place(s: TensorSpec) -> _Planned:
            nonlocal cursor
            off = _round_up(cursor, ALIGNMENT)
            p = _Planned(s, off, quant.tensor_nbytes(s.dtype, tuple(s.shape), s.group_size))
            cursor = off + p.nbytes
            self._tensors[s.name] = p
            return p

        for s in routers + dense:
            place(s)
        self.routing_offset = self._tensors[routers[0].name].offset if routers \
            else self.data_offset
        self._blocks: list[tuple[int, int, int, int]] = []  # (layer, expert, offset, size)
        for layer in sorted(experts):
            for e in range(self.n_experts):
                cursor = _round_up(cursor, PAGE_SIZE)
                start = cursor
                for p in PROJS:
                    place(experts[layer][e][p])
                self._blocks.append((layer, e, start, cursor - start))
        self.file_size = cursor

    def _preamble(self) -> bytes:
        """Header, table, expert index and metadata: bytes [0, metadata end)."""
        out = bytearray(self._meta_offset + len(self._meta))
        flags = HEADER_FLAG_CRC if self.checksums else 0
        _HEADER.pack_into(
            out, 0, MAGIC, FORMAT_VERSION, self.n_experts, self.n_layers, HEADER_SIZE,
            len(self._tensors), self.routing_offset, self.data_offset, HEADER_SIZE,
            RECORD_SIZE, ALIGNMENT, self._index_offset, EXPERT_RECORD_SIZE,
            len(self._blocks), self._meta_offset, len(self._meta), self.file_size,
            PAGE_SIZE, flags, bytes(20), 0)
        struct.pack_into("<I", out, HEADER_SIZE - 4, zlib.crc32(out[:HEADER_SIZE - 4]))
        # Table in file order (== offset order), so readers listing it see the layout.
        for k, p in enumerate(self._tensors.values()):
            s = p.spec
            shape = tuple(int(d) for d in s.shape) + (0,) * (4 - len(s.shape))
            crc_ok = self.checksums and p.written
            _RECORD.pack_into(out, HEADER_SIZE + k * RECORD_SIZE, s.name.encode("utf-8"),
                              DTYPE_NAMES.index(s.dtype), len(s.shape), 0, s.group_size,
                              *shape, p.offset, p.nbytes, p.crc32 if crc_ok else 0,
                              RECORD_FLAG_CRC if crc_ok else 0)
        for k, (layer, e, off, size) in enumerate(self._blocks):
            _EXPERT_RECORD.pack_into(out, self._index_offset + k * EXPERT_RECORD_SIZE,
                                     layer, e, off, size, 0)
        out[self._meta_offset:] = self._meta
        return bytes(out)

    # -- writing -----------------------------------------------------------------------

    def _pwrite(self, data, offset: int) -> None:
        mv = memoryview(data).cast("B")
        while len(mv):
            n = os.pwrite(self._fd, mv, offset)
            mv, offset = mv[n:], offset + n

    def write(self, name: str, array: np.ndarray, raw: bool = False) -> None:
        """Write one tensor: array in its logical shape (encoded to the spec's dtype here,
        row chunk by row chunk, via quant.encode; for bf16 a uint16 array is taken as bf16
        bits), or, with raw=True, the exact on-disk bytes as uint8."""
        if self._fd is None:
            raise ColibriError(f"{self.path}: writer is closed")
        p = self._tensors.get(name)
        if p is None:
            raise KeyError(f"{self.path}: tensor {name!r} is not in the planned layout")
        if p.written:
            raise ValueError(f"tensor {name!r} written twice")
        s = p.spec
        crc, pos = 0, p.offset
        if raw:
            arr = np.ascontiguousarray(array)
            if arr.dtype != np.uint8 or arr.nbytes != p.nbytes:
                raise ValueError(f"tensor {name!r}: raw data must be uint8 of {p.nbytes} "
                                 f"bytes, got {arr.dtype} of {arr.nbytes} bytes")
            chunks = [arr.reshape(-1)]
        else:
            arr = np.asarray(array)
            if arr.shape != tuple(s.shape):
                raise ValueError(f"tensor {name!r}: shape {arr.shape} does not match the "
                                 f"planned {tuple(s.shape)}")
            # (rows, C): encoding is row-wise. A view for C-ordered input (and any 2-D
            # input); other layouts are copied once here.
            rows = arr.reshape(-1, arr.shape[-1])
            step = max(1, _WRITE_CHUNK // max(1, rows.shape[1] * rows.itemsize))
            if s.dtype == "bf16" and arr.dtype == np.uint16:
                # Already bf16 bits (what the reader hands out): stored as they are.
                chunks = (rows[i:i + step].astype("<u2", copy=False)
                          for i in range(0, rows.shape[0], step))
            else:
                chunks = (quant.encode(rows[i:i + step], s.dtype, s.group_size, name=name)
                          for i in range(0, rows.shape[0], step))
        for chunk in chunks:
            chunk = np.ascontiguousarray(chunk).reshape(-1).view(np.uint8)
            if pos + chunk.nbytes > p.offset + p.nbytes:
                raise ValueError(f"tensor {name!r}: encoded size exceeds {p.nbytes} bytes")
            self._pwrite(chunk, pos)
            if self.checksums:
                crc = zlib.crc32(chunk, crc)
            pos += chunk.nbytes
        if pos != p.offset + p.nbytes:
            raise ValueError(f"tensor {name!r}: wrote {pos - p.offset} bytes, expected "
                             f"{p.nbytes}")
        p.crc32, p.written = crc, True

    def finish(self) -> None:
        """Patch CRCs into the table, fsync, rename onto the destination, fsync the folder."""
        if self._finished:
            return
        if self._fd is None:
            raise ColibriError(f"{self.path}: writer was aborted")
        try:
            missing = [n for n, p in self._tensors.items() if not p.written]
            if missing:
                raise ValueError(f"{self.path}: {len(missing)} tensors never written: "
                                 f"{missing[:5]}")
            self._pwrite(self._preamble(), 0)
            size = os.fstat(self._fd).st_size
            if size != self.file_size:
                raise ColibriError(f"{self.path}: temp file is {size} bytes, expected "
                                   f"{self.file_size}")
            os.fsync(self._fd)
            os.close(self._fd)
            self._fd = None
            if not self.overwrite and os.path.lexists(self.path):
                raise FileExistsError(f"{self.path}: appeared while writing (pass "
                                      f"overwrite=True to replace it)")
            os.replace(self._tmp, self.path)
            self._tmp = None
        except BaseException:
            self.abort()
            raise
        self._finished = True
        _fsync_dir(os.path.dirname(os.path.abspath(self.path)))

    def abort(self) -> None:
        """Close and delete the temp file; the destination is left as it was."""
        if self._fd is not None:
            try:
                os.close(self._fd)
            finally:
                self._fd = None
        if self._tmp is not None:
            try:
                os.unlink(self._tmp)
            except FileNotFoundError:
                pass
            self._tmp = None

    def __enter__(self) -> "ColibriWriter":
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is None:
            self.finish()
        else:
            self.abort()

    def __del__(self) -> None:
        # A writer dropped without finish() must not leave its temp file behind.
        if getattr(self, "_tmp", None) is not None and not getattr(self, "_finished", True):
            try:
                self.abort()
            except Exception:  # interpreter shutdown: best effort only
                pass


def _fsync_dir(folder: str) -> None:
    """Make the rename durable. Not every platform/filesystem can fsync a directory."""
    try:
        fd = os.open(folder, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


_DTYPE_OF_NUMPY = {np.dtype(np.float32): "f32", np.dtype(np.float16): "f16",
                   np.dtype(np.int32): "i32", np.dtype(np.float64): "f32"}


def _dtype_for(name: str, arr: np.ndarray) -> str:
    if arr.dtype in _DTYPE_OF_NUMPY:
        return _DTYPE_OF_NUMPY[arr.dtype]
    if arr.dtype.name == "bfloat16":  # ml_dtypes
        return "bf16"
    raise ValueError(f"tensor {name!r}: cannot infer a colibri dtype from numpy {arr.dtype}; "
                     f"pass (array, dtype)")


def save(path: str | os.PathLike, tensors: dict[str, tuple[np.ndarray, str] | np.ndarray],
         metadata: dict | None = None, *, group_size: int | None = None, n_layers: int = 0,
         n_experts: int = 0, overwrite: bool = False, checksums: bool = True) -> None:
    """Write a small .colibri file in one call (tests, tools).

    tensors: name -> array (dtype inferred: float32/float64 -> f32, float16 -> f16,
    int32 -> i32, bfloat16 -> bf16) or (array, dtype). Roles come from the canonical names;
    n_layers / n_experts default to what the names imply. group_size (q8/q4) defaults to
    quant.DEFAULT_GROUP_SIZE.
    """
    specs, arrays = [], {}
    for name, value in tensors.items():
        arr, dtype = value if isinstance(value, tuple) else (value, None)
        arr = np.asarray(arr)
        dtype = dtype or _dtype_for(name, arr)
        gs = 0
        if dtype in quant.QUANTIZED:
            gs = quant.DEFAULT_GROUP_SIZE if group_size is None else group_size
        specs.append(TensorSpec.infer(name, dtype, arr.shape, gs))
        arrays[name] = arr
    layers = [int(m.group(1)) for s in specs if (m := _LAYER_RE.match(s.name))]
    experts = [s.expert for s in specs if s.role == "expert"]
    n_layers = n_layers or max(layers, default=-1) + 1
    n_experts = n_experts or max(experts, default=-1) + 1
    with ColibriWriter(path, specs, metadata if metadata is not None else {},
                       n_layers=n_layers, n_experts=n_experts, overwrite=overwrite,
                       checksums=checksums) as w:
        for name, arr in arrays.items():
            w.write(name, arr)
