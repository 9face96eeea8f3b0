"""The runtime settings of the kernels: instruction set, threads, tuning knobs, BLAS, timings.

Instruction set: the widest path this CPU and OS support is chosen at import (scalar, avx2,
avx512, avxvnni, avx512vnni: the last two are avx2 / avx512 with VNNI integer row kernels);
``set_isa`` or the environment variable ``COLIBRI_ISA`` forces one.

Threads: ``threads=None`` means ``default_threads()`` (``COLIBRI_NUM_THREADS``, else
``OMP_NUM_THREADS``, else the physical cores in this process's affinity mask); results do
not depend on the count. The kernels run on colibri's own thread pool (``csrc/pool.h``): the
calling thread works too and returns as soon as every work item is done, so it never waits
for a worker that is asleep or descheduled.

Tuning knobs (``KNOBS``): each is one ``Knob`` record (name, environment variable, default,
smallest value, the compiled getter and setter) from which its accessors (``spin_us()``,
``set_spin_us(us)``, None restoring the default) and the environment parsing at import come.
The compiled module keeps the values; this module sets every knob at import, from its
environment variable or else its default. None of them changes a result, only the speed:

- ``spin_us`` (``COLIBRI_SPIN_US``): microseconds an idle worker spins (so the next kernel
  call of a decode step finds it awake) before it sleeps; a worker that finds itself
  preempted while spinning (the cores shared with other busy processes) stops spinning for
  a while. 0 sleeps at once.
- ``min_parallel_bytes`` (``COLIBRI_MIN_PARALLEL_BYTES``): a call whose work (weight bytes
  streamed x tokens) is below this per thread uses fewer threads (one, without touching the
  pool, for the small matrices of a small model).
- ``gemm_min_tokens`` (no variable): tokens per matrix from which f32 activations take the
  prefill (GEMM) path.
- ``igemm_min_tokens`` (no variable): the same for q8 / q4 / mxfp4 matrices on int8 / int16
  activations (the integer GEMM path); 0, the default, takes each path's measured
  crossover (``igemm_crossover(isa, activations)``).

BLAS: ``blas_on_one_thread()`` keeps NumPy's BLAS (the attention matmuls) on one thread
while the kernels' threads hold the cores. ``Timings``: seconds per stage of a forward pass.
"""
from __future__ import annotations

import functools
import os
import time
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import psutil
import threadpoolctl

from ..resources import ResourceError, address_space_left

from .. import _kernels

__all__ = [
    "ISAS", "available_isas", "get_isa", "set_isa",
    "MAX_THREADS", "default_threads", "resolve_threads",
    "Knob", "KNOBS", "MIN_PARALLEL_BYTES", "GEMM_MIN_TOKENS", "IGEMM_MIN_TOKENS", "SPIN_US",
    "min_parallel_bytes", "set_min_parallel_bytes", "gemm_min_tokens", "set_gemm_min_tokens",
    "igemm_min_tokens", "set_igemm_min_tokens", "igemm_crossover",
    "spin_us", "set_spin_us", "pool_backoffs",
    "blas_on_one_thread", "reserve_blas_buffer", "STAGES", "Timings",
]


# ---------------------------------------------------------------------------------------------
# instruction set

ISAS: tuple[str, ...] = tuple(_kernels.ISA_NAMES)   # by the compiled module's code 0 .. 4


def available_isas() -> list[str]:
    """The paths this CPU and OS run, in ISAS order ("scalar" always)."""
    return [name for code, name in enumerate(ISAS) if _kernels.isa_supported(code)]


def get_isa() -> str:
    """The path the kernels use now."""
    return ISAS[_kernels.get_isa()]


def set_isa(name: str | None) -> None:
    """Force a path ("scalar", "avx2", "avx512", "avxvnni", "avx512vnni", "amx", or the tile
    emulation "amx-emu", a test path never chosen by default), or None for the widest
    supported one.

    Raises ValueError for an unknown name or a path this CPU/OS cannot run.
    """
    if name is None:
        _kernels.set_isa(_kernels.best_isa())
        return
    if name not in ISAS:
        raise ValueError(f"unknown ISA {name!r}; expected one of {', '.join(ISAS)}")
    if name not in available_isas():
        raise ValueError(f"ISA {name!r} is not supported by this CPU/OS (available: "
                         f"{', '.join(available_isas())})")
    _kernels.set_isa(ISAS.index(name))


# ---------------------------------------------------------------------------------------------
# threads

MAX_THREADS: int = int(_kernels.MAX_THREADS)      # the thread pool's limit


def _env_threads(var: str) -> int | None:
    value = os.environ.get(var, "").strip()
    if not value:
        return None
    first = value.split(",")[0].strip()         # OMP_NUM_THREADS may list nested levels
    try:
        n = int(first)
    except ValueError:
        n = 0
    if n < 1:
        raise ValueError(f"{var}={value!r} is not a positive integer")
    return n


def _affinity() -> set[int] | None:
    if hasattr(os, "sched_getaffinity"):
        return set(os.sched_getaffinity(0))
    try:
        return set(psutil.Process().cpu_affinity())
    except Exception:                            # not available on this platform
        return None


@functools.lru_cache(maxsize=1)
def _physical_cores_in_mask() -> int:
    """Physical cores among the CPUs this process may run on (hyperthreads counted once).

    Threads beyond the physical cores slow MoE decode: they share the core's load ports and
    the memory bandwidth, and add synchronisation.
    """
    cpus = _affinity()
    physical = psutil.cpu_count(logical=False) or os.cpu_count() or 1
    if not cpus:
        return max(1, physical)
    cores = set()
    for cpu in cpus:                             # Linux topology, where readable
        topo = f"/sys/devices/system/cpu/cpu{cpu}/topology/"
        try:
            with open(topo + "physical_package_id") as f:
                package = f.read().strip()
            with open(topo + "core_id") as f:
                core = f.read().strip()
        except OSError:
            break
        cores.add((package, core))
    else:
        return max(1, len(cores))
    # no topology: assume the mask holds the same share of physical cores as of CPUs
    logical = psutil.cpu_count(logical=True) or len(cpus)
    return max(1, min(len(cpus), round(len(cpus) * physical / logical)))


def default_threads() -> int:
    """Thread count for threads=None: COLIBRI_NUM_THREADS, else OMP_NUM_THREADS, else the
    physical cores in this process's CPU affinity mask, at most MAX_THREADS (the pool's
    limit; an explicit larger count is an error). The variables are read at each call."""
    for var in ("COLIBRI_NUM_THREADS", "OMP_NUM_THREADS"):
        n = _env_threads(var)
        if n is not None:
            return n
    return min(_physical_cores_in_mask(), MAX_THREADS)


def resolve_threads(threads: int | None) -> int:
    """The thread count a kernel call runs with: `threads`, or default_threads() for None;
    ValueError unless a positive int."""
    if threads is None:
        return default_threads()
    if isinstance(threads, bool) or not isinstance(threads, (int, np.integer)) or threads < 1:
        raise ValueError(f"threads must be a positive int or None, found {threads!r}")
    return int(threads)


def pool_backoffs() -> int:
    """How many times, since import, a spinning worker found itself preempted (the cores
    shared with other busy processes) and stopped spinning for a while (0.2 s)."""
    return int(_kernels.pool_backoffs())


# ---------------------------------------------------------------------------------------------
# tuning knobs: each defined once, here


@dataclass(frozen=True)
class Knob:
    """One tuning knob of the compiled kernels.

    name:     the accessors' name (`name()`, `set_name(value)`).
    env:      the environment variable read at import, or None.
    default:  the value at import without the variable, and after set(None).
    minimum:  the smallest value allowed (ValueError below it).
    get_compiled, set_compiled: the compiled module's getter and setter (it keeps the value).
    """

    name: str
    env: str | None
    default: int
    minimum: int
    get_compiled: Callable[[], int]
    set_compiled: Callable[[int], None]

    def _allowed(self, noun: str) -> str:
        """'a positive int' or 'an int >= 0': what the knob takes, for error messages."""
        return f"a positive {noun}" if self.minimum == 1 else f"an {noun} >= {self.minimum}"

    def get(self) -> int:
        """The value the kernels use now."""
        return int(self.get_compiled())

    def set(self, value: int | None) -> None:
        """Set the knob to an int >= minimum, or to its default for None (ValueError
        naming the knob otherwise)."""
        if value is None:
            value = self.default
        if (isinstance(value, bool) or not isinstance(value, (int, np.integer))
                or value < self.minimum):
            raise ValueError(f"{self.name} must be {self._allowed('int')}, found {value!r}")
        self.set_compiled(int(value))

    def apply_env(self) -> None:
        """Set the knob from its environment variable, or to its default when the variable
        is unset or empty; ValueError naming the variable for a value that is not allowed."""
        value = os.environ.get(self.env, "").strip() if self.env else ""
        if not value:
            self.set(None)
            return
        try:
            self.set(int(value))
        except ValueError:
            raise ValueError(f"{self.env}={value!r} is not {self._allowed('integer')}"
                             ) from None


# min_parallel_bytes: work per thread (weight bytes streamed x tokens) below which a kernel
# adds no thread; 1 parallelises everything, as the tests do. A pool job costs a few
# microseconds (publish it, wake a sleeping worker, wait for the items workers took): below
# about 256 KiB per thread an extra thread loses more than it saves (docs/performance.md).
MIN_PARALLEL_BYTES = Knob("min_parallel_bytes", "COLIBRI_MIN_PARALLEL_BYTES", 1 << 18, 1,
                          _kernels.get_min_parallel_bytes, _kernels.set_min_parallel_bytes)
# gemm_min_tokens: tokens per matrix (linear: T; expert FFN: one expert's tokens) from which
# a matrix on f32 activations takes the prefill path (a panel of rows decoded once to f32,
# then a register-blocked micro-kernel, docs/performance.md); a huge value keeps every call
# on the row kernel. Both paths are exact to the weights; they sum in different orders.
# Measured on AVX2 (EPYC, 1 thread, 1024 x 1024 in L2): from 4 tokens on the GEMM path is
# faster than the row kernel for every format (q4 22.6 vs 17.0 GMAC/s at 4 tokens, 36 vs 19 at
# 32; callgrind 0.46 vs 0.60 instructions per multiply-add at 4, 0.55 vs 0.54 at 3).
GEMM_MIN_TOKENS = Knob("gemm_min_tokens", None, 4, 1,
                       _kernels.get_gemm_min_tokens, _kernels.set_gemm_min_tokens)
# igemm_min_tokens: the same for a q8 / q4 / mxfp4 matrix on int8 / int16 activations: from this many
# tokens per matrix it takes the integer GEMM path (csrc/igemm.h: a panel of rows decoded
# once per K-chunk into vpdpbusd / vpdpwssd order, docs/performance.md change 25) instead of
# the idot row kernel. 0, the default: each ISA path's measured crossover
# (igemm_crossover: avx512vnni 4, 16 on AMD CPUs; avxvnni int8 6; none on avx2 / avx512,
# whose GEMM body measured no faster than the row kernel); another value applies to every
# path. Both paths sum each block exactly in integers; the f32 parts differ in order.
IGEMM_MIN_TOKENS = Knob("igemm_min_tokens", None, 0, 0,
                        _kernels.get_igemm_min_tokens, _kernels.set_igemm_min_tokens)
# spin_us: microseconds an idle worker thread spins before it sleeps; 0 sleeps at once.
# Spinning keeps the workers awake between the kernel calls of a decode step (a sleeping
# worker takes tens of microseconds to wake, per call); sleeping frees the core for other
# processes.
SPIN_US = Knob("spin_us", "COLIBRI_SPIN_US", 500, 0,
               _kernels.get_spin_us, _kernels.set_spin_us)
KNOBS: tuple[Knob, ...] = (MIN_PARALLEL_BYTES, GEMM_MIN_TOKENS, IGEMM_MIN_TOKENS, SPIN_US)

# the accessors by name: runtime.spin_us(), runtime.set_spin_us(100), set_spin_us(None) ...
min_parallel_bytes, set_min_parallel_bytes = MIN_PARALLEL_BYTES.get, MIN_PARALLEL_BYTES.set
gemm_min_tokens, set_gemm_min_tokens = GEMM_MIN_TOKENS.get, GEMM_MIN_TOKENS.set
igemm_min_tokens, set_igemm_min_tokens = IGEMM_MIN_TOKENS.get, IGEMM_MIN_TOKENS.set
spin_us, set_spin_us = SPIN_US.get, SPIN_US.set


def igemm_crossover(isa: str | None = None, activations: str = "int16") -> int | None:
    """Tokens per matrix from which ISA path `isa` (default: the current one) runs q8 / q4 /
    mxfp4 matrices on `activations` ("int8" / "int16") on the integer GEMM path when
    igemm_min_tokens() is 0 (the default); None: that path keeps the row kernel."""
    if activations not in ("int8", "int16"):
        raise ValueError(f"activations must be 'int8' or 'int16', found {activations!r}")
    name = get_isa() if isa is None else isa
    if name not in ISAS:
        raise ValueError(f"unknown ISA {isa!r}; expected one of {', '.join(ISAS)}")
    return _kernels.igemm_crossover(ISAS.index(name), activations == "int16")


def _apply_env() -> None:
    """The settings at import: COLIBRI_ISA, then every knob from its variable or default."""
    name = os.environ.get("COLIBRI_ISA", "").strip().lower()
    if name:
        try:
            set_isa(name)
        except ValueError as exc:
            raise ValueError(f"COLIBRI_ISA={name!r}: {exc}") from None
    for knob in KNOBS:
        knob.apply_env()


_apply_env()


# ---------------------------------------------------------------------------------------------
# NumPy's BLAS beside the kernels' threads

_BLAS_LIBS = None
_BLAS_OWNERSHIP = None      # threadpoolctl's per-thread count of open limits (recent versions)


class _BlasOnOneThread:
    """threadpoolctl's `limit(limits=1, user_api="blas")` context without its bookkeeping of
    every library's info: on entry each BLAS library not on one thread already is set to one,
    on exit it gets its count back (and threadpoolctl's ownership count of OpenBLAS's shared
    pool is kept as limit() keeps it). Measured warm: ~3 us a forward pass instead of ~16."""

    __slots__ = ("saved",)

    def __enter__(self):
        global _BLAS_LIBS, _BLAS_OWNERSHIP
        if _BLAS_LIBS is None:                   # the libraries are looked up at first use
            _BLAS_OWNERSHIP = getattr(threadpoolctl, "CONTROLLING_THREAD_OWNERSHIP", None)
            _BLAS_LIBS = list(threadpoolctl.ThreadpoolController().select(user_api="blas")
                              .lib_controllers)
        saved = []
        for lib in _BLAS_LIBS:
            n = lib.get_num_threads()
            if n != 1:
                lib.set_num_threads(1)
                saved.append((lib, n))
        self.saved = saved
        if _BLAS_OWNERSHIP is not None:
            _BLAS_OWNERSHIP.increment()
        return self

    def __exit__(self, *exc) -> None:
        for lib, n in self.saved:
            lib.set_num_threads(n)
        if _BLAS_OWNERSHIP is not None:
            _BLAS_OWNERSHIP.decrement()


# the buffer OpenBLAS maps at its first matrix product (measured: 32 MiB, on 1 or 2 threads)
BLAS_BUFFER = 40 << 20


def reserve_blas_buffer() -> None:
    """Under an address-space limit (RLIMIT_AS), make OpenBLAS map its work buffer now, at
    import, while it fits: a failed allocation inside OpenBLAS ends the process with its own
    message ("Memory allocation still failed after 10 retries"), so a later first product
    (the attention's) must not be the one to try. ResourceError when it cannot fit."""
    left = address_space_left()
    if left is None:
        return
    if left < BLAS_BUFFER:
        raise ResourceError(f"NumPy's BLAS needs about {BLAS_BUFFER} bytes of address space "
                            f"for its work buffer; the process's limit (RLIMIT_AS) leaves "
                            f"{left} bytes")
    a = np.ones((256, 256), dtype=np.float32)
    a @ a                                          # a product large enough to take the buffer


def blas_on_one_thread() -> _BlasOnOneThread:
    """A context in which NumPy's BLAS (the attention matmuls) runs on one thread.

    The kernels' threads already occupy every core; BLAS worker threads spinning beside
    them steal those cores (measured: pp128 of the shipped model 3.3x slower at 1 kernel
    thread, and ~100x slower at 2 when another process holds a core).
    """
    return _BlasOnOneThread()


# ---------------------------------------------------------------------------------------------
# timings

STAGES = ("embed", "attention", "router", "experts", "shared", "dense", "head")


class Timings:
    """Seconds spent per stage, accumulated with time.perf_counter (cheap: ~100 ns a call)."""

    def __init__(self):
        self.seconds = dict.fromkeys(STAGES, 0.0)

    def add(self, stage: str, t0: float) -> float:
        """Add the time since t0 to `stage`; return now (the next stage's t0)."""
        now = time.perf_counter()
        self.seconds[stage] += now - t0
        return now

    def reset(self) -> None:
        for k in self.seconds:
            self.seconds[k] = 0.0

    @property
    def total(self) -> float:
        return sum(self.seconds.values())

    def summary(self) -> str:
        """'attention 12.0 ms (30%), router ...' for the stages that took any time."""
        total = self.total or 1.0
        parts = [f"{k} {v * 1e3:.1f} ms ({100 * v / total:.0f}%)"
                 for k, v in self.seconds.items() if v > 0]
        return ", ".join(parts)

    def copy(self) -> dict[str, float]:
        return dict(self.seconds)
