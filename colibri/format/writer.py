"""Writing a .colibri file: TensorSpec (what is planned), ColibriWriter (plan the layout,
stream the tensors, then fsync and rename a temporary file onto the destination) and save()
(one call for small files).

The destination is never opened for writing: the bytes go to a temporary file in its folder
that is renamed over it at the end (a new inode), so a process that maps the old file (a
server) keeps reading the old bytes and never sees a truncated or half-written file (SIGBUS).
Each writer holds an exclusive flock on its temporary file; the temporary files of writers
that were killed hold none, and the next writer of the same destination removes them. The
header is written last, after an fsync of everything else: a file cut short at any moment
starts with 128 zero bytes and no reader takes it for a finished one. Free space is checked
before anything is created (ColibriError naming the bytes needed; docs/safety.md).

The layout is docs/format.md §1: routers, then dense tensors, then the expert blocks (one
page-aligned block per (layer, expert)), every tensor 64-aligned.
"""
from __future__ import annotations

import errno
import json
import os
import secrets
import stat
import struct
import zlib
from dataclasses import dataclass
from typing import Callable

try:
    import fcntl
except ImportError:  # no advisory locks (Windows): stale temporary files are left alone
    fcntl = None

import numpy as np

from .. import dtypes
from ..dtypes import DTYPE_NAMES, DTYPES
from ..errors import ColibriError
from . import quant
from .checks import check_metadata, first_missing, with_metadata_crc
from .spec import (
    ALIGNMENT, EXPERT_RE, EXPERT_RECORD_SIZE, EXPERT_STRUCT, FORMAT_VERSION, HEADER_FLAG_CRC,
    HEADER_SIZE, HEADER_STRUCT, LAYER_RE, MAGIC, MAX_NAME_BYTES, PAGE_SIZE, PROJS,
    METADATA_CRC_KEY, RECORD_FLAG_CRC, RECORD_SIZE, RECORD_STRUCT, ROUTER_RE, layer_count,
    round_up,
)

ROLES = ("router", "dense", "expert")
_WRITE_CHUNK = 1 << 24  # bytes of input encoded and written at a time (bounds temporaries)
_TEMP_INFIX = ".tmp-"
_TEMP_TOKEN_BYTES = 4   # .NAME.tmp-<8 hex digits>


def _temp_prefix(path: str | os.PathLike) -> tuple[str, str]:
    """(folder, name prefix) of the temporary files that writers of `path` create."""
    folder, base = os.path.split(os.path.abspath(os.fspath(path)))
    return folder, f".{base}{_TEMP_INFIX}"


def _is_temp_name(name: str, prefix: str) -> bool:
    token = name[len(prefix):]
    return (name.startswith(prefix) and len(token) == 2 * _TEMP_TOKEN_BYTES
            and all(c in "0123456789abcdef" for c in token))


def remove_stale_temps(path: str | os.PathLike) -> list[str]:
    """Delete the temporary files that killed writers of `path` left beside it; return them.

    Only files that no live writer holds (an exclusive flock, taken by ColibriWriter as soon
    as it creates its file) are removed, so a conversion running in another process is safe.
    """
    if fcntl is None:
        return []
    folder, prefix = _temp_prefix(path)
    try:
        names = os.listdir(folder)
    except OSError:
        return []
    removed = []
    for name in sorted(n for n in names if _is_temp_name(n, prefix)):
        full = os.path.join(folder, name)
        try:
            fd = os.open(full, os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0))
        except OSError:             # gone already, or a symlink: not ours to delete
            continue
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            if os.fstat(fd).st_nlink and stat.S_ISREG(os.fstat(fd).st_mode):
                os.unlink(full)
                removed.append(full)
        except OSError:             # held by a live writer (or vanished meanwhile)
            pass
        finally:
            os.close(fd)
    return removed


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
        """A spec whose role/layer/expert/proj come from the canonical name (docs/format.md §7)."""
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
    if s.dtype in dtypes.QUANTIZED:
        dtypes.check_group_size(int(s.shape[-1]), s.group_size, s.name)
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

    The layout is planned from the specs up front; table, expert index and metadata are
    written at once, the header's 128 bytes left zero; the caller then streams tensors in any
    order with write(). finish() fills in the CRCs, checks that every tensor was written,
    fsyncs, writes the header last (so an unfinished file is never a colibri file), fsyncs,
    optionally verifies, and renames the temp file
    (.NAME.tmp-XXXXXXXX in the destination folder) onto the destination. On any exception
    inside `with`, abort() deletes the temp file and the destination is untouched. The
    destination itself is never opened for writing (see the module docstring); a replaced
    destination's permission bits carry over to the new file. `stale_removed` lists the temp
    files of killed writers of the same destination that the constructor deleted.
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
        self.stale_removed = remove_stale_temps(self.path)
        self._check_space()
        self._create_temp()
        try:
            if overwrite and os.path.exists(self.path):
                os.fchmod(self._fd, stat.S_IMODE(os.stat(self.path).st_mode))
            # Sized up front: the gaps between tensors read back as zeros (holes).
            os.ftruncate(self._fd, self.file_size)
            # Everything but the header, whose bytes stay zero until finish() writes them
            # last: a file cut short anywhere before that is not a colibri file at all.
            self._pwrite(self._preamble()[HEADER_SIZE:], HEADER_SIZE)
        except BaseException:
            self.abort()
            raise

    def _check_space(self) -> None:
        """ColibriError naming the bytes needed when the destination's filesystem has fewer
        free (checked before anything is created; a write that still hits ENOSPC says the
        same and the temp file is removed)."""
        folder = os.path.dirname(os.path.abspath(self.path))
        try:
            st = os.statvfs(folder)
        except (OSError, AttributeError):   # no statvfs (Windows): the writes will tell
            return
        free = st.f_bavail * st.f_frsize
        if free < self.file_size:
            raise ColibriError(self._space_message(free))

    def _space_message(self, free: int | None) -> str:
        folder = os.path.dirname(os.path.abspath(self.path))
        have = f"{folder} has {free} bytes free" if free is not None else f"{folder} is full"
        return (f"{self.path}: not enough disk space: the file needs {self.file_size} bytes "
                f"({self.file_size / 2**20:.1f} MiB), {have}; nothing was written")

    def _create_temp(self) -> None:
        """Create and lock a fresh temp file beside the destination."""
        folder, prefix = _temp_prefix(self.path)
        flags = os.O_RDWR | os.O_CREAT | os.O_EXCL | getattr(os, "O_BINARY", 0)
        while True:
            tmp = os.path.join(folder, prefix + secrets.token_hex(_TEMP_TOKEN_BYTES))
            fd = os.open(tmp, flags, 0o666)
            if fcntl is None:
                break
            fcntl.flock(fd, fcntl.LOCK_EX)
            # Another writer's cleanup may have taken it between open and flock: the name must
            # still be this file.
            try:
                if os.stat(tmp).st_ino == os.fstat(fd).st_ino:
                    break
            except FileNotFoundError:
                pass
            os.close(fd)
        self._fd, self._tmp = fd, tmp

    # -- planning ----------------------------------------------------------------------

    def _plan(self, specs: list[TensorSpec], metadata: dict) -> None:
        seen: set[str] = set()
        for s in specs:
            _check_spec(s, self.n_layers, self.n_experts)
            if s.name in seen:
                raise ValueError(f"duplicate tensor name {s.name!r}")
            seen.add(s.name)
        if layer_count(seen) != self.n_layers:
            raise ValueError(f"n_layers is {self.n_layers} but the tensor names use "
                             f"{layer_count(seen)} layers (layers.0 .. layers.N-1)")
        check_metadata(metadata)
        # The checksum key is the writer's own (the reader drops it): last, over the rest.
        metadata = {k: v for k, v in metadata.items() if k != METADATA_CRC_KEY}
        self._meta = with_metadata_crc(json.dumps(metadata, ensure_ascii=False,
                                                  sort_keys=False, allow_nan=False
                                                  ).encode("utf-8"))
        routers = sorted((s for s in specs if s.role == "router"), key=lambda s: s.layer)
        dense = [s for s in specs if s.role == "dense"]
        experts: dict[int, dict[int, dict[str, TensorSpec]]] = {}
        for s in specs:
            if s.role == "expert":
                experts.setdefault(s.layer, {}).setdefault(s.expert, {})[s.proj] = s
        for layer, blocks in experts.items():
            if sorted(blocks) != list(range(self.n_experts)):
                missing = first_missing(set(blocks), self.n_experts)
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
        self._index_offset = round_up(table_end, 8)
        self._meta_offset = self._index_offset + n_blocks * EXPERT_RECORD_SIZE
        self.data_offset = round_up(self._meta_offset + len(self._meta), PAGE_SIZE)

        self._tensors: dict[str, _Planned] = {}
        cursor = self.data_offset

        def place(s: TensorSpec) -> _Planned:
            nonlocal cursor
            off = round_up(cursor, ALIGNMENT)
            p = _Planned(s, off, dtypes.tensor_nbytes(s.dtype, tuple(s.shape), s.group_size))
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
                cursor = round_up(cursor, PAGE_SIZE)
                start = cursor
                for p in PROJS:
                    place(experts[layer][e][p])
                self._blocks.append((layer, e, start, cursor - start))
        self.file_size = cursor

    def _preamble(self) -> bytes:
        """Header, table, expert index and metadata: bytes [0, metadata end)."""
        out = bytearray(self._meta_offset + len(self._meta))
        flags = HEADER_FLAG_CRC if self.checksums else 0
        HEADER_STRUCT.pack_into(
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
            RECORD_STRUCT.pack_into(out, HEADER_SIZE + k * RECORD_SIZE, s.name.encode("utf-8"),
                              DTYPES[s.dtype].code, len(s.shape), 0, s.group_size,
                              *shape, p.offset, p.nbytes, p.crc32 if crc_ok else 0,
                              RECORD_FLAG_CRC if crc_ok else 0)
        for k, (layer, e, off, size) in enumerate(self._blocks):
            EXPERT_STRUCT.pack_into(out, self._index_offset + k * EXPERT_RECORD_SIZE,
                                     layer, e, off, size, 0)
        out[self._meta_offset:] = self._meta
        return bytes(out)

    # -- writing -----------------------------------------------------------------------

    def _pwrite(self, data, offset: int) -> None:
        mv = memoryview(data).cast("B")
        while len(mv):
            try:
                n = os.pwrite(self._fd, mv, offset)
            except OSError as e:
                if e.errno in (errno.ENOSPC, errno.EDQUOT):
                    free = None
                    try:
                        st = os.statvfs(os.path.dirname(os.path.abspath(self.path)))
                        free = st.f_bavail * st.f_frsize
                    except (OSError, AttributeError):
                        pass
                    raise ColibriError(self._space_message(free)) from None
                raise
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

    def finish(self, verify: Callable[[str, bytes], None] | None = None) -> None:
        """Patch CRCs into the table, fsync, write the header, fsync, rename onto the
        destination, fsync the folder. The header goes last: until it is on disk the file
        starts with 128 zero bytes, which no reader takes for a colibri file.

        verify(temp path, header bytes), when given, runs on the temporary file before its
        header is written (open it with ColibriFile(path, pending_header=header)) and may
        raise to refuse it (the temp file is then removed). A kill during verification
        leaves a file whose header is still zero: only the header write, one fsync and the
        rename separate a complete-looking file from the destination."""
        if self._finished:
            return
        if self._fd is None:
            raise ColibriError(f"{self.path}: writer was aborted")
        try:
            missing = [n for n, p in self._tensors.items() if not p.written]
            if missing:
                raise ValueError(f"{self.path}: {len(missing)} tensors never written: "
                                 f"{missing[:5]}")
            preamble = self._preamble()
            self._pwrite(preamble[HEADER_SIZE:], HEADER_SIZE)
            size = os.fstat(self._fd).st_size
            if size != self.file_size:
                raise ColibriError(f"{self.path}: temp file is {size} bytes, expected "
                                   f"{self.file_size}")
            os.fsync(self._fd)               # every other byte is durable before the header
            if verify is not None:
                verify(self._tmp, preamble[:HEADER_SIZE])
            self._pwrite(preamble[:HEADER_SIZE], 0)
            os.fsync(self._fd)
            if not self.overwrite and os.path.lexists(self.path):
                raise FileExistsError(f"{self.path}: appeared while writing (pass "
                                      f"overwrite=True to replace it)")
            # Renamed while still open and locked, so no cleanup can take it first. A process
            # mapping the old destination keeps the old inode's bytes.
            os.replace(self._tmp, self.path)
            self._tmp = None
            os.close(self._fd)
            self._fd = None
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


# numpy dtype of an array -> the format save() stores it in: each plain format's own storage
# (not bf16's uint16 bits, which would be ambiguous), and float64 narrowed to f32.
_DTYPE_OF_NUMPY = {**{d.storage: d.name for d in DTYPES.values()
                      if d.storage is not None and d.name != "bf16"},
                   np.dtype(np.float64): "f32"}


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
        if dtype in dtypes.QUANTIZED:
            gs = quant.DEFAULT_GROUP_SIZE if group_size is None else group_size
        specs.append(TensorSpec.infer(name, dtype, arr.shape, gs))
        arrays[name] = arr
    layers = [int(m.group(1)) for s in specs if (m := LAYER_RE.match(s.name))]
    experts = [s.expert for s in specs if s.role == "expert"]
    n_layers = n_layers or max(layers, default=-1) + 1
    n_experts = n_experts or max(experts, default=-1) + 1
    with ColibriWriter(path, specs, metadata if metadata is not None else {},
                       n_layers=n_layers, n_experts=n_experts, overwrite=overwrite,
                       checksums=checksums) as w:
        for name, arr in arrays.items():
            w.write(name, arr)
