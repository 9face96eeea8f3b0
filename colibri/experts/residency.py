"""What the operating system holds in memory for us, and the calls that change it.

    resident_pages(buf, offset, size)   pages of buf[offset:offset+size] in memory (mincore)
    fault_counts()                      (minor, major) page faults of this process (getrusage)
    lock(buf, offset, size)             mlock the range; False where not allowed
    advise(buf, offset, size, advice)   madvise WILLNEED / DONTNEED on a range of a mapping
    drop_file_range(fd, offset, size)   posix_fadvise DONTNEED: drop clean page-cache pages

Thin ctypes wrappers over libc (Linux; macOS has the same calls). A range is rounded out to
whole pages; `buf` is a NumPy uint8 array over a mapping (the model file's, or an arena).
"""
from __future__ import annotations

import ctypes
import ctypes.util
import mmap
import os
import resource

import numpy as np

__all__ = ["PAGE", "resident_pages", "fault_counts", "lock", "unlock", "advise",
           "drop_file_range", "WILLNEED", "DONTNEED", "RANDOM"]

PAGE = mmap.PAGESIZE
WILLNEED = getattr(mmap, "MADV_WILLNEED", 3)
DONTNEED = getattr(mmap, "MADV_DONTNEED", 4)
RANDOM = getattr(mmap, "MADV_RANDOM", 1)

_libc = ctypes.CDLL(ctypes.util.find_library("c") or None, use_errno=True)
_libc.mincore.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p)
_libc.mlock.argtypes = _libc.munlock.argtypes = (ctypes.c_void_p, ctypes.c_size_t)
_libc.madvise.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int)


def _pages(buf: np.ndarray, offset: int, size: int) -> tuple[int, int]:
    """(page-aligned address, length) covering buf[offset:offset+size]."""
    start = buf.ctypes.data + offset
    first = start - start % PAGE
    end = start + size
    return first, -(-(end - first) // PAGE) * PAGE


def resident_pages(buf: np.ndarray, offset: int, size: int,
                   vec: np.ndarray | None = None) -> tuple[int, int]:
    """(resident, total) pages of the range, from mincore. vec: a uint8 scratch of at least
    `total` entries (made when None)."""
    addr, length = _pages(buf, offset, size)
    n = length // PAGE
    if vec is None or len(vec) < n:
        vec = np.empty(n, np.uint8)
    if _libc.mincore(addr, length, vec.ctypes.data) != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"mincore of {length} bytes at offset {offset}: {os.strerror(err)}")
    return int(np.count_nonzero(vec[:n] & 1)), n


def fault_counts() -> tuple[int, int]:
    """(minor, major) page faults of this process so far."""
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_minflt, r.ru_majflt


def lock(buf: np.ndarray, offset: int, size: int) -> bool:
    """mlock the range (faulting it in); False when the system refuses (RLIMIT_MEMLOCK,
    no privilege), so callers can say so and go on unlocked."""
    addr, length = _pages(buf, offset, size)
    return _libc.mlock(addr, length) == 0


def unlock(buf: np.ndarray, offset: int, size: int) -> None:
    addr, length = _pages(buf, offset, size)
    _libc.munlock(addr, length)


def advise(buf: np.ndarray, offset: int, size: int, advice: int) -> None:
    """madvise the range (WILLNEED: start reading it in; DONTNEED: drop our mapping of it)."""
    addr, length = _pages(buf, offset, size)
    if _libc.madvise(addr, length, advice) != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"madvise({advice}) of {length} bytes at offset {offset}: "
                           f"{os.strerror(err)}")


def drop_file_range(fd: int, offset: int, size: int) -> None:
    """Ask the kernel to drop the clean page-cache pages of a file range (not mapped
    elsewhere): what makes an evicted block stop counting against a memory cgroup."""
    if hasattr(os, "posix_fadvise"):
        os.posix_fadvise(fd, offset, size, os.POSIX_FADV_DONTNEED)
