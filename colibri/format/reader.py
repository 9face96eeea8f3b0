"""Reading a .colibri file: ColibriFile (the checked, read-only mapping) and its views.

Opening runs the checks of docs/format.md §8 (checks.py) with plain reads *before* the file
is mapped, so a truncated, corrupted or hostile file raises ColibriFormatError and never
reaches numpy. Tensor data is never read at open: views are made on demand (§9) and
checksums are verified only by verify_checksums()/validate().

Shapes (the package alphabet): E experts, R rows (output features), C columns (input
features), Q group size (C / Q scales per row).
"""
from __future__ import annotations

import mmap
import os
import stat
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Iterable, NoReturn

import numpy as np

from .. import dtypes
from ..config import ConfigError, ModelConfig
from ..dtypes import DTYPE_NAMES
from ..errors import ColibriError, ColibriFileChangedError, ColibriFormatError
from . import checks, mxfp4, quant
from .spec import (
    EXPERT_DTYPE, HEADER_SIZE, PROJS, RECORD_DTYPE, RECORD_FLAG_CRC, RECORD_SIZE, expert_name,
)

_READ_CHUNK = RECORD_SIZE * 6554      # ~1 MB, whole table records


def _kind(mode: int) -> str:
    """What a non-regular file is, for the error message."""
    for test, kind in ((stat.S_ISDIR, "a directory"), (stat.S_ISFIFO, "a FIFO (named pipe)"),
                       (stat.S_ISSOCK, "a socket"), (stat.S_ISCHR, "a character device"),
                       (stat.S_ISBLK, "a block device")):
        if test(mode):
            return kind
    return "not a regular file"


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
        if self.dtype == "mxfp4":                   # scales: the E8M0 bytes
            return mxfp4.dequantize(self.data, self.scales)
        return quant.dequantize_q4(self.data, self.scales, self.group_size)

    def __repr__(self) -> str:
        return f"QuantizedTensor({self.dtype}, shape={self.shape}, group_size={self.group_size})"


class ColibriFile:
    """A .colibri file, validated and mapped read-only. Tensors are zero-copy numpy views.

    Opening costs a few plain reads and O(tensor_count) vector checks; no tensor data is
    touched. Views stay valid after close() (they keep the mapping alive).
    """

    def __init__(self, path: str | os.PathLike, *, pending_header: bytes | None = None):
        """pending_header: the 128 header bytes of a file still being written, whose header on
        disk is zero until its writer commits it (ColibriWriter.finish verifies the file this
        way, so no complete-looking file exists before the rename)."""
        self.path = os.fspath(path)
        self._pending_header = pending_header
        self._mm: mmap.mmap | None = None
        self._base: np.ndarray | None = None
        self.buffer: memoryview | None = None
        self._fd: int | None = None
        fd = self._open_regular()
        try:
            st = os.fstat(fd)
            # Identity of what was mapped: a hot reload compares it to decide to reopen.
            self.identity = (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns)
            self._parse(fd, st.st_size)
            # No MAP_POPULATE: pages come in only when a view touches them.
            try:
                self._mm = mmap.mmap(fd, self.file_size, access=mmap.ACCESS_READ)
            except ValueError as e:  # the file shrank since fstat
                self._fail(f"cannot map {self.file_size} bytes: {e}")
            except OSError as e:     # ENOMEM (address-space limit), ENODEV (no mmap here)
                raise ColibriError(f"{self.path}: cannot map {self.file_size} bytes read-only "
                                   f"({e.strerror or e})") from None
        except MemoryError as e:       # an address-space or memory limit: say which file
            os.close(fd)
            detail = str(e) or "no detail"
            raise ColibriError(f"{self.path}: out of memory while opening it ({detail}): "
                               f"raise the memory limit") from None
        except BaseException:
            os.close(fd)
            raise
        # Kept open: check_unchanged() fstat()s the mapped inode, not whatever the path
        # names now. (The mapping holds its own reference to the file.)
        self._fd = fd
        self.buffer = memoryview(self._mm)
        self._base = np.frombuffer(self._mm, np.uint8)   # (file_size,) read-only

    # -- validation (plain reads, before any mapping) -----------------------------------

    def _fail(self, problem: str) -> NoReturn:
        checks.fail(self.path, problem)

    def _open_regular(self) -> int:
        """A read-only descriptor of the path, a regular file: anything else (a FIFO, a
        device, a socket, a directory) is refused before it is opened (opening a FIFO
        blocks until a writer comes; opening a device can have effects). O_NONBLOCK keeps
        the open itself from blocking if the path is swapped for a FIFO in between, and the
        descriptor is checked again. Symlinks are followed (model folders use them)."""
        st = os.stat(self.path)                       # FileNotFoundError as before
        if not stat.S_ISREG(st.st_mode):
            self._fail(f"is {_kind(st.st_mode)}, not a regular file (a .colibri model file "
                       f"must be a regular file)")
        flags = (os.O_RDONLY | getattr(os, "O_BINARY", 0) | getattr(os, "O_NONBLOCK", 0)
                 | getattr(os, "O_NOCTTY", 0) | getattr(os, "O_CLOEXEC", 0))
        fd = os.open(self.path, flags)
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            os.close(fd)
            self._fail(f"is {_kind(st.st_mode)}, not a regular file (it changed while "
                       f"being opened)")
        return fd

    def _read(self, fd: int, offset: int, size: int, scan=None) -> bytes:
        """size bytes at offset, read 1 MB at a time; scan(chunk, chunk offset) may refuse
        the bytes early (a zeroed region of a sparse file fails at its first chunk)."""
        out = bytearray()
        while len(out) < size:
            want = min(size - len(out), _READ_CHUNK)
            chunk = os.pread(fd, want, offset + len(out))
            if not chunk:
                self._fail(f"unexpected end of file reading {size} bytes at offset {offset} "
                           f"(file changed while opening?)")
            if scan is not None:
                scan(chunk, offset + len(out))
            out += chunk
        return bytes(out)

    def _parse(self, fd: int, size: int) -> None:
        """The checks of §8, in its order; then the parsed header, table and metadata.
        Each section is read on its own, sized by check_regions' limits first."""
        path = self.path
        head = self._pending_header if self._pending_header is not None else \
            self._read(fd, 0, min(size, HEADER_SIZE))
        h = checks.check_header(path, head, size)
        self.header = h
        self.version = h["version"]
        self.n_layers = h["n_layers"]
        self.n_experts = h["n_experts"]
        self.file_size = size
        regions = checks.check_regions(path, h)
        for start, end, what in checks.gaps(regions, h["data_offset"]):
            checks.check_gap(path, start, self._read(fd, start, end - start), what)
        t_off, m_off = h["table_offset"], h["metadata_offset"]
        table_raw = self._read(fd, t_off, h["tensor_count"] * RECORD_DTYPE.itemsize,
                               lambda c, at: checks.scan_table_chunk(path, c, at, t_off))
        index_raw = self._read(fd, h["expert_index_offset"],
                               h["expert_count"] * EXPERT_DTYPE.itemsize)
        meta_raw = self._read(fd, m_off, h["metadata_size"],
                              lambda c, at: checks.scan_metadata_chunk(path, c, at, m_off))
        table = np.frombuffer(table_raw, RECORD_DTYPE, h["tensor_count"])
        index = np.frombuffer(index_raw, EXPERT_DTYPE, h["expert_count"])
        names = checks.check_names(path, table, self.n_layers)
        self._pos = dict(zip(names, range(len(names))))
        order = checks.check_records(path, table, names, h)
        checks.check_routing(path, table, names, h)
        self._blocks, self._stride = checks.check_expert_index(
            path, index, table, names, self._pos, order, self.n_layers, self.n_experts)
        self.metadata = checks.parse_metadata(path, meta_raw)
        self.config = self.metadata.get("config", {})
        self.arch = self.metadata.get("arch", {})
        self._model_config: ModelConfig | None = None
        self.user_metadata = self.metadata.get("user", {})
        tok = self.metadata.get("tokenizer")
        self.tokenizer_files = tok["files"] if tok is not None else None
        self.tensors = TensorTable(names, self._pos, table)

    def check_unchanged(self) -> None:
        """ColibriFileChangedError if the mapped file was changed in place since it was
        opened: another size (a truncated file's pages raise SIGBUS when touched, which no
        exception can catch) or another modification time (same-size overwrites change the
        weights under the model). Cheap (one fstat); load and reload call it, and so should
        anything about to run a long operation over the mapping. Replacing the file by
        rename (what colibri convert and ColibriWriter do) leaves the mapped inode alone and
        passes. docs/safety.md."""
        if self._fd is None:
            raise ColibriError(f"{self.path}: file is closed")
        st = os.fstat(self._fd)
        if st.st_size != self.file_size:
            raise ColibriFileChangedError(
                f"{self.path}: the mapped file changed size in place ({self.file_size} -> "
                f"{st.st_size} bytes) since it was opened; reading it could crash the process "
                f"(SIGBUS). Replace model files by rename, never rewrite them in place "
                f"(docs/safety.md)")
        if st.st_mtime_ns != self.identity[3]:
            raise ColibriFileChangedError(
                f"{self.path}: the mapped file was rewritten in place since it was opened "
                f"(modification time changed): its weights may differ from what was checked. "
                f"Replace model files by rename (docs/safety.md)")

    @property
    def model_config(self) -> ModelConfig:
        """The typed "arch" metadata (colibri.config.ModelConfig), built on first use;
        ConfigError naming this file and the field when it is missing or wrong."""
        if self._model_config is None:
            self._model_config = ModelConfig.from_metadata(self.arch, source=str(self.path))
        return self._model_config

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
        storage = dtypes.DTYPES[dtype].storage
        if storage is not None:
            np_dtype, phys = storage, shape
        else:  # rows of quant bytes followed by their scales
            np_dtype = np.dtype(np.uint8)
            phys = shape[:-1] + (dtypes.row_stride(dtype, shape[-1], gs),)
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
        if storage is not None:
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
            from tqdm import tqdm   # imported on use: ~40 ms, for a progress bar only
            infos = tqdm(infos, desc="checksums", unit="tensor")
        bad = checks.crc_mismatches(mv, ((i.name, i.offset, i.nbytes, i.crc32) for i in infos))
        mv.release()
        return bad

    def validate(self, progress: bool = False) -> list[str]:
        """Problems found by a full read: checksum mismatches, non-zero gap bytes between
        tensors, non-finite floats or scales, and "arch" metadata that is not a valid
        ModelConfig (the ConfigError's message). Empty list = healthy. (Structure was
        already checked at open.)"""
        self.check_unchanged()
        problems = [f"tensor {n!r}: crc32 mismatch" for n in self.verify_checksums(progress)]
        problems += checks.gap_problems(
            self._mapping(), self.header["data_offset"],
            ((i.name, i.offset, i.nbytes)
             for i in sorted(self.tensors.values(), key=lambda i: i.offset)))
        for info in self.tensors.values():
            n = self._count_nonfinite(info)
            if n:
                problems.append(f"tensor {info.name!r}: {n} non-finite values")
        if self.arch:   # files without an arch (tensor containers) have no config to check
            try:
                self.model_config
            except ConfigError as e:
                problems.append(str(e))
        return problems

    def _count_nonfinite(self, info: TensorInfo) -> int:
        if info.dtype == "i32":
            return 0
        view = self.tensor(info.name)
        if isinstance(view, QuantizedTensor):
            view = view.scales  # quant bytes are always finite; scales may not be
        return checks.count_nonfinite(view, bf16_bits=info.dtype == "bf16")

    # -- lifetime ----------------------------------------------------------------------

    def close(self) -> None:
        """Drop the mapping. Views handed out earlier keep it alive until they go away."""
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None
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

    def __del__(self) -> None:
        fd = getattr(self, "_fd", None)
        if fd is not None:
            try:
                os.close(fd)
            except OSError:
                pass

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
