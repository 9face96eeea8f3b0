"""Memory a request may take, sized before it is taken: refuse with the numbers, never try.

Three limits can end an allocation, and each ends it differently: physical memory plus swap
(the kernel's overcommit check, or later the OOM killer), a memory cgroup (the OOM killer),
and the address-space limit RLIMIT_AS (malloc returns NULL: NumPy raises MemoryError, but
OpenBLAS and Rust code such as the tokenizers library end the process instead). So what
colibri allocates in proportion to a request (the KV cache, the tokenizer) is checked first
against all three (`check_allocation`), and the shortfall is a ResourceError (a ColibriError
and a MemoryError) that says what needed how many bytes and how many there are.

Only the standard library and psutil: colibri/__init__.py runs `check_import_headroom`
before NumPy is imported (docs/safety-api.md has the measured address space of the import).
"""
from __future__ import annotations

import os
import resource
import sys

from .errors import ColibriError

__all__ = ["ResourceError", "memory_available", "address_space_left", "check_allocation",
           "check_import_headroom", "IMPORT_ADDRESS_SPACE", "TOKENIZER_ADDRESS_SPACE"]

MiB = 1 << 20
# address space importing numpy (with OpenBLAS on one thread) and colibri takes, measured
# (docs/safety-api.md: 150 MiB with OpenBLAS's default threads, ~120 MiB on one), with margin
IMPORT_ADDRESS_SPACE = 160 * MiB
# what building the tokenizer adds (tokenizers + transformers' classes: 46 MiB measured)
TOKENIZER_ADDRESS_SPACE = 64 * MiB
_CGROUP_FILES = (("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory.current"),
                 ("/sys/fs/cgroup/memory/memory.limit_in_bytes",
                  "/sys/fs/cgroup/memory/memory.usage_in_bytes"))


class ResourceError(ColibriError, MemoryError):
    """An allocation was refused before it was tried: the message states the bytes needed,
    the bytes available and which limit."""


def _vms() -> int:
    """This process's address space in bytes (/proc/self/statm: pages)."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[0]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return 0


def address_space_left() -> int | None:
    """Bytes of address space RLIMIT_AS still allows this process, or None when unlimited."""
    soft, _ = resource.getrlimit(resource.RLIMIT_AS)
    if soft == resource.RLIM_INFINITY:
        return None
    return max(0, soft - _vms())


def _cgroup_left() -> int | None:
    for limit_path, usage_path in _CGROUP_FILES:
        try:
            with open(limit_path) as f:
                limit = f.read().strip()
            with open(usage_path) as f:
                usage = int(f.read().strip())
        except (OSError, ValueError):
            continue
        if limit == "max" or int(limit) >= 1 << 60:      # v1 writes "no limit" as ~2**63
            return None
        return max(0, int(limit) - usage)
    return None


def memory_available() -> tuple[int, str]:
    """(bytes, where the figure comes from): RAM available plus free swap (psutil), or what a
    memory cgroup leaves, whichever is smaller."""
    import psutil
    ram = psutil.virtual_memory().available + psutil.swap_memory().free
    group = _cgroup_left()
    if group is not None and group < ram:
        return group, "the memory cgroup's limit less its usage"
    return ram, "available RAM plus free swap"


def _fmt(n: int) -> str:
    return f"{n} bytes ({n / 2**30:.2f} GiB)" if n >= 2**30 else f"{n} bytes ({n / MiB:.1f} MiB)"


def check_allocation(nbytes: int, what: str, resident: bool = True) -> None:
    """Raise ResourceError when `nbytes` for `what` cannot fit.

    resident: the bytes will be filled (a KV cache as it fills), so they must fit the memory
    available; False: only address space is taken (a mapping).
    """
    left = address_space_left()
    if left is not None and nbytes > left:
        raise ResourceError(f"{what} needs {_fmt(nbytes)} of address space; the process's "
                            f"limit (RLIMIT_AS) leaves {_fmt(left)}")
    if resident:
        avail, source = memory_available()
        if nbytes > avail:
            raise ResourceError(f"{what} needs {_fmt(nbytes)} of memory; {_fmt(avail)} are "
                                f"available ({source})")


def check_import_headroom() -> None:
    """Before NumPy is imported: under a tight RLIMIT_AS, keep OpenBLAS on one thread (its
    per-thread buffers are what it cannot allocate) and, when even that cannot fit, raise a
    MemoryError now instead of letting OpenBLAS print its own message and exit."""
    left = address_space_left()
    if left is None or left >= IMPORT_ADDRESS_SPACE or "numpy" in sys.modules:
        return
    if "OPENBLAS_NUM_THREADS" not in os.environ and "OMP_NUM_THREADS" not in os.environ:
        os.environ["OPENBLAS_NUM_THREADS"] = "1"
    if left < IMPORT_ADDRESS_SPACE * 3 // 4:     # NumPy with OpenBLAS on one thread, measured
        raise ResourceError(f"importing colibri (NumPy and its OpenBLAS) needs about "
                            f"{_fmt(IMPORT_ADDRESS_SPACE * 3 // 4)} of address space; the "
                            f"process's limit (RLIMIT_AS) leaves {_fmt(left)}")
