"""A memory budget for a model: the dense part resident, the experts in a cache of blocks.

    model = colibri.load("big.colibri", memory_budget=6 * 2**30)      # or --memory-budget 6GiB
    model.expert_cache.stats()     # hits, misses, bytes read, prefetch figures

The budget covers the weights: the dense part (attention, norms, routers, the head, shared
experts and dense MLPs; not the embedding table, of which a token reads one row from the
mapping, unless it is the tied head) stays resident, locked with mlock= where the system
allows; what is left holds
N = (budget - dense) // slot expert blocks (one expert of one layer: its gate, up and down
rows, page-aligned in the file). A budget below the dense part plus one layer's experts (a
prefill may use every expert of a layer at once) fails at load, naming the numbers.

Two ways to hold the blocks (docs/memory.md measures both):
  - "arena" (the default): an anonymous, page-aligned arena of N slots, locked with mlock=;
    a missing block is read into its slot with one pread (O_DIRECT where the file system
    allows, so the page cache holds no second copy; a block the page cache already holds
    is copied from it, and its pages there dropped); the layer's kernel runs over the arena
    with the routed ids mapped to slots (the same bytes, the same bits).
  - "madvise": the kernels read the mapping as without a budget; the cache only decides
    which blocks stay: MADV_WILLNEED on a block it takes in, MADV_DONTNEED and
    POSIX_FADV_DONTNEED on a block it evicts, so the page cache follows the budget.
Eviction: colibri.experts.eviction's policies (the simulator, colibri.tools.cache_sim, replays the
same code on recorded routing). Prefetch: colibri.experts.prefetch, on a thread of its own.

Shapes: T tokens, K experts per token, M MoE layers, E experts, N slots.
"""
from __future__ import annotations

import dataclasses
import mmap
import os
import threading

import numpy as np

from .. import kernels
from ..errors import ColibriError
from ..format import ColibriFile
from ..format.spec import PROJS
from ..kernels.weights import WeightRef
from . import residency
from .eviction import SlotTable, make_policy
from .expert_source import CachedExperts, WatchedExperts, without
from .prefetch import Prefetcher

__all__ = ["MemoryPlan", "memory_plan", "ExpertCache", "MemoryBudgetError", "MODES",
           "DEFAULT_POLICY", "read_dense"]

MODES = ("arena", "madvise")
DEFAULT_POLICY = "least-stale"     # chosen by the simulator's measurements (docs/memory.md)
READ_CHUNK = 1 << 30               # bytes per read call (Linux caps one read at 2 GiB - 4 KiB)


class MemoryBudgetError(ColibriError, ValueError):
    """A memory budget the model cannot run in."""


def _mib(n: int) -> str:
    return f"{n / 2**20:.1f} MiB"


def _round_pages(n: int) -> int:
    return -(-n // residency.PAGE) * residency.PAGE


@dataclasses.dataclass(frozen=True)
class MemoryPlan:
    """How a budget splits for one file: dense ranges kept resident, slots for experts."""
    dense_ranges: tuple[tuple[int, int], ...]   # (offset, size) of every resident tensor
    dense_bytes: int            # their size, rounded to pages
    slot_bytes: int             # one expert block, rounded to pages (the largest layer's)
    n_blocks: int               # expert blocks in the file (M * E)
    n_experts: int              # E
    layers: tuple[int, ...]     # the MoE layers' numbers (M)
    budget: int | None = None
    n_slots: int = 0

    def slots_for(self, budget: int) -> int:
        """Expert slots a budget of `budget` bytes leaves after the dense part."""
        return max(0, (int(budget) - self.dense_bytes) // self.slot_bytes)

    @property
    def minimum(self) -> int:
        """The smallest budget: the dense part and one layer's experts."""
        return self.dense_bytes + self.n_experts * self.slot_bytes


def check_memory_budget(budget) -> None:
    """ValueError unless `budget` is None or a whole number of bytes >= 0."""
    if budget is not None and (isinstance(budget, bool) or not isinstance(
            budget, (int, np.integer)) or budget < 0):
        raise ValueError(f"memory_budget must be None or a number of bytes >= 0, got "
                         f"{budget!r}")


def memory_plan(f: ColibriFile, budget: int | None = None) -> MemoryPlan:
    """The plan of `f` for `budget` bytes (None: only the sizes). MemoryBudgetError when the
    budget is below MemoryPlan.minimum."""
    c = f.model_config
    layers = tuple(c.moe_layer_ids)
    E = f.n_experts
    # the embedding table is read a row per token, unless it is also the (tied) head
    tied = c.tie_word_embeddings or "lm_head" not in f
    dense = tuple((i.offset, i.nbytes) for n, i in f.tensors.items()
                  if ".moe.experts." not in n and (tied or n != "tok_embeddings"))
    slot = max((_round_pages(f.expert_block(layer, 0)[1]) for layer in layers), default=0)
    plan = MemoryPlan(dense, sum(_round_pages(s) for _, s in dense), slot, len(layers) * E, E,
                      layers)
    if budget is None or not layers:
        return plan
    if budget < plan.minimum:
        raise MemoryBudgetError(
            f"{f.path}: memory budget {_mib(budget)} is below what the model needs: the dense "
            f"part (attention, norms, routers, head, shared experts) takes "
            f"{_mib(plan.dense_bytes)} and one layer's experts {E} x {_mib(slot)} = "
            f"{_mib(E * slot)}, so at least {_mib(plan.minimum)}")
    n = min(plan.slots_for(budget), plan.n_blocks)
    return MemoryPlan(dense, plan.dense_bytes, slot, plan.n_blocks, E, layers, int(budget), n)


def read_fully(fd: int, view: memoryview, offset: int) -> int:
    """Read len(view) bytes of fd from offset into view, however many reads it takes (one
    read returns at most ~2 GiB on Linux, and fewer bytes when a signal interrupts it).
    Returns the bytes read: fewer than len(view) only at the end of the file."""
    done, size = 0, len(view)
    while done < size:
        got = os.preadv(fd, [view[done: done + READ_CHUNK]], offset + done)
        if got == 0:
            break
        done += got
    return done


def read_dense(f: ColibriFile, ranges) -> np.ndarray:
    """An anonymous buffer the size of the file with only `ranges` read into it (the other
    pages never touched, so never resident): the weights of mmap=False, at the same offsets."""
    arena = mmap.mmap(-1, f.file_size)
    buf = np.frombuffer(arena, np.uint8)
    fd = os.open(f.path, os.O_RDONLY)
    try:
        for off, size in ranges:
            with memoryview(arena)[off: off + size] as view:
                got = read_fully(fd, view, off)
            if got != size:
                raise ColibriError(f"{f.path}: short read: {got} of {size} bytes at offset "
                                   f"{off} (the file changed or was truncated?)")
    finally:
        os.close(fd)
    return buf


class _Reader:
    """Reads expert blocks from the file into arena slots: O_DIRECT where allowed."""

    def __init__(self, path: str):
        self.fd = os.open(path, os.O_RDONLY)
        self.direct = -1
        if hasattr(os, "O_DIRECT"):
            try:
                self.direct = os.open(path, os.O_RDONLY | os.O_DIRECT)
            except OSError:
                self.direct = -1

    def read(self, view: memoryview, offset: int, size: int, cached: bool = False) -> None:
        """The block at `offset` into view; cached: its pages are in the page cache, so it
        is copied from there (a plain pread) instead of read from the disk again."""
        if self.direct >= 0 and not cached:
            try:
                got = os.preadv(self.direct, [view[:_round_pages(size)]], offset)
                if got >= size:
                    return
            except OSError:                      # the file system refuses O_DIRECT reads
                os.close(self.direct)
                self.direct = -1
        got = read_fully(self.fd, view[:size], offset)
        if got != size:
            raise ColibriError(f"short read of an expert block: {got} of {size} bytes at "
                               f"offset {offset}")
        residency.drop_file_range(self.fd, offset, size)   # no second copy in the page cache

    def close(self) -> None:
        for fd in (self.fd, self.direct):
            if fd >= 0:
                os.close(fd)
        self.fd = self.direct = -1


class ExpertCache:
    """The expert blocks of `model` held in `plan.n_slots` slots (see the module docstring).

    Puts a CachedExperts (colibri.experts.expert_source) over every MoE layer's expert source;
    close() takes them out. Counters: stats(). telemetry: the ExpertTelemetry watching the
    cache's layers (a WatchedExperts over them), or None.
    """

    def __init__(self, model, plan: MemoryPlan, *, policy: str = DEFAULT_POLICY,
                 mode: str = "arena", mlock: bool = False, prefetch: str | None = None,
                 mapped: bool = True):
        if mode not in MODES:
            raise ValueError(f"mode must be one of {', '.join(MODES)}, got {mode!r}")
        if mode == "madvise" and not mapped:
            raise ValueError("the madvise mode keeps the experts in the file's mapping: it "
                             "cannot run with mmap=False")
        self.mapped = mapped
        self.model, self.plan, self.mode = model, plan, mode
        f = model.file
        self.layers = list(plan.layers)
        self.table = SlotTable(plan.n_slots, make_policy(policy, len(self.layers), f.n_experts))
        self.policy = policy
        self.lock = threading.Lock()
        self._ready = [threading.Event() for _ in range(plan.n_slots)]
        self._blocks = [[f.expert_block(layer, e) for e in range(f.n_experts)]
                        for layer in self.layers]
        self.hits = self.misses = self.bytes_read = self.bytes_copied = 0
        self.prefetch_reads = self.prefetch_bytes = self._pending_bytes = 0
        self.locked = False
        self.position = 0
        self._reader = _Reader(f.path)
        if mode == "arena":
            self._arena = mmap.mmap(-1, max(plan.n_slots * plan.slot_bytes, residency.PAGE))
            self.arena = np.frombuffer(self._arena, np.uint8)
            if mlock:
                self.locked = residency.lock(self.arena, 0, len(self.arena))
            arena_calls = [self._arena_kernels(layer) for layer in self.layers]
        else:
            self.arena = None
            arena_calls = [None] * len(self.layers)     # madvise: the mapping's own calls
        if mode == "madvise":
            self._evict_file_pages()
        self.prefetcher = None
        self._sources = []
        for j, layer in enumerate(self.layers):
            moe = model.layers[layer].ffn
            moe.expert_source = CachedExperts(self, j, arena_calls[j], moe.expert_source)
            self._sources.append((moe, moe.expert_source))
        if prefetch:
            self.prefetcher = Prefetcher(self, prefetch)

    # -- construction ---------------------------------------------------------------------------
    def _arena_kernels(self, layer: int):
        """The layer's expert kernel over the arena, k(x, ids, slots, weights, y): its three
        stacks at their offsets inside a block, the slots plan.slot_bytes apart. Experts with
        biases or their own activation (GPT-OSS) read their biases by expert id."""
        f, moe = self.model.file, self.model.layers[layer].ffn
        base = f.expert_block(layer, 0)[0]
        refs = []
        for proj, ref in zip(PROJS, (moe.w_gate, moe.w_up, moe.w_down)):
            info = f.info(f"layers.{layer}.moe.experts.0.{proj}")
            refs.append(WeightRef(self.arena, info.offset - base, ref.dtype, ref.rows, ref.cols,
                                  ref.group_size, ref.row_stride, n_experts=self.plan.n_slots,
                                  expert_stride=self.plan.slot_bytes))
        be = moe.biased_experts
        if be is not None:
            # the same BiasedExperts over the slots (colibri.kernels.biased_experts)
            arena_experts = dataclasses.replace(be, w_gate=refs[0], w_up=refs[1],
                                                w_down=refs[2], n_experts=f.n_experts)
            return lambda x, ids, slots, weights, y: arena_experts(x, ids, weights, y, slots)
        fused = kernels.prepare_expert_ffn(*refs, threads=moe.threads,
                                           activations=moe.activations)
        return lambda x, ids, slots, weights, y: fused(x, slots, weights, y)

    def _evict_file_pages(self) -> None:
        """madvise mode: drop the expert blocks' pages from the page cache, so that what
        stays is what the cache takes in. (The arena leaves them: a block the page cache
        holds is copied from there, then dropped.)"""
        buf = self.model.buffer
        for blocks in self._blocks:
            off = blocks[0][0]
            size = blocks[-1][0] + blocks[-1][1] - off
            if self.mapped:
                residency.advise(buf, off, size, residency.DONTNEED)
            residency.drop_file_range(self._reader.fd, off, size)

    # -- the layer calls (CachedExperts) ---------------------------------------------------------
    @property
    def telemetry(self):
        """The ExpertTelemetry watching this cache's layers (colibri.experts.telemetry), or None:
        the owner of a WatchedExperts above the cache's source of its first layer."""
        for moe, mine in self._sources[:1]:
            s = moe.expert_source
            while s is not None and s is not mine:
                if isinstance(s, WatchedExperts) and s.owner is not None:
                    return s.owner
                s = s.inner
        return None

    def ensure(self, j: int, ids: np.ndarray) -> np.ndarray:
        """Make layer j's blocks for ids int (T, K) resident; -> their slots int32 (T, K).
        A missing block is read by this thread; a block a prefetch is reading is waited for
        (that block only)."""
        return self.ensure_counted(j, ids)[0]

    def ensure_counted(self, j: int, ids: np.ndarray
                       ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """ensure, and what it found: (slots int32 (T, K), hit bool (T, K): the block was
        resident, nbytes int64 (T,): bytes read for each token's blocks, the prefetch's
        reads since the last call on the first), the counters updated."""
        table = self.table
        with self.lock:
            if j == 0:
                table.begin_call()
            self.position = table.policy.token * len(self.layers) + j   # the prefetch's clock
            slots, hit, loads = table.lookup(j, ids)
            for s, _, _ in loads:
                table.busy[s] = True
                self._ready[s].clear()
            pending, self._pending_bytes = self._pending_bytes, 0
        nbytes = np.zeros(ids.shape[0], np.int64)
        nbytes[0] = pending
        first = {s: i for i, s in reversed(list(enumerate(slots.reshape(-1).tolist())))}
        for s, b, old in loads:
            size = self._load(s, b, old)
            nbytes[first[s] // ids.shape[1]] += size
            with self.lock:
                table.busy[s] = False
                self._ready[s].set()
        for s in set(slots.reshape(-1).tolist()):
            if not self._ready[s].is_set():           # being read by the prefetch thread
                self._ready[s].wait()
        n_hit = int(np.count_nonzero(hit))
        self.hits += n_hit
        self.misses += hit.size - n_hit
        self.bytes_read += int(nbytes.sum()) - pending
        return slots, hit, nbytes

    def _load(self, slot: int, block: int, evicted: int) -> int:
        """Read block into slot (arena) or advise it in (madvise, after the evicted block's
        pages leave). Returns the bytes read."""
        j, e = divmod(block, self.plan.n_experts)
        off, size = self._blocks[j][e]
        if self.mode == "arena":
            start = slot * self.plan.slot_bytes
            view = memoryview(self._arena)[start: start + self.plan.slot_bytes]
            buf = self.model.buffer
            cached = self.mapped and residency.resident_pages(buf, off, size)[0] == \
                -(-size // residency.PAGE)
            try:
                self._reader.read(view, off, size, cached)
            finally:
                view.release()
            if cached:                 # copied: the page cache's copy goes, the disk's stays
                if self.mapped:
                    residency.advise(buf, off, size, residency.DONTNEED)
                self.bytes_copied += size
                return 0
        else:
            if evicted >= 0:
                self._forget(evicted)
            residency.advise(self.model.buffer, off, size, residency.WILLNEED)
        return size

    def _forget(self, block: int) -> None:
        """madvise mode: the pages of an evicted block leave the mapping and the page cache."""
        j, e = divmod(block, self.plan.n_experts)
        off, size = self._blocks[j][e]
        residency.advise(self.model.buffer, off, size, residency.DONTNEED)
        residency.drop_file_range(self._reader.fd, off, size)

    # -- reports ---------------------------------------------------------------------------------
    def stats(self) -> dict:
        """hits, misses, hit_rate, bytes_read (demand reads from the disk),
        bytes_from_page_cache (blocks copied from it instead), prefetch_reads / prefetch_bytes,
        slots, slot_bytes, dense_bytes, budget, policy, mode, locked, and the prefetcher's
        per-layer recall when there is one."""
        n = self.hits + self.misses
        out = {"hits": self.hits, "misses": self.misses,
               "hit_rate": self.hits / n if n else float("nan"), "bytes_read": self.bytes_read,
               "bytes_from_page_cache": self.bytes_copied,
               "prefetch_reads": self.prefetch_reads, "prefetch_bytes": self.prefetch_bytes,
               "slots": self.plan.n_slots, "slot_bytes": self.plan.slot_bytes,
               "dense_bytes": self.plan.dense_bytes, "budget": self.plan.budget,
               "policy": self.policy, "mode": self.mode, "locked": self.locked}
        if self.prefetcher is not None:
            out["prefetch"] = self.prefetcher.stats()
        return out

    def close(self) -> None:
        """Stop the prefetch thread, give the layers back their plain kernel calls."""
        if self.prefetcher is not None:
            self.prefetcher.close()
            self.prefetcher = None
        for moe, source in self._sources:
            moe.expert_source = without(moe.expert_source, source)
        self._sources = []
        self._reader.close()


# ---------------------------------------------------------------------------------------------
# what colibri.load(memory_budget=, mlock=, mmap=) does


def weights_buffer(f: ColibriFile, plan: MemoryPlan | None, mapped: bool) -> np.ndarray:
    """The buffer the model's WeightRefs point into: the file's mapping, or (mapped=False)
    an anonymous copy at the same offsets: the whole file, or with a plan its dense part."""
    if mapped:
        return np.frombuffer(f.buffer, dtype=np.uint8)
    ranges = [(0, f.file_size)] if plan is None else plan.dense_ranges
    return read_dense(f, ranges)


def hold_weights(model, plan: MemoryPlan | None, *, mlock: bool, mapped: bool,
                 policy: str = DEFAULT_POLICY, mode: str = "arena",
                 prefetch: str | None = None) -> ExpertCache | None:
    """After the model is built: lock what must stay (mlock), bring the dense part in, and
    with a plan start the expert cache. Returns the cache, or None without a plan."""
    buf = model.buffer
    if plan is None:
        if mlock:
            model.memory_locked = residency.lock(buf, 0, len(buf))
        return None
    locked = True
    for off, size in plan.dense_ranges:
        if mlock:
            locked &= residency.lock(buf, off, size)
        elif mapped:
            residency.advise(buf, off, size, residency.WILLNEED)
    model.memory_locked = mlock and locked
    return ExpertCache(model, plan, policy=policy, mode=mode, mlock=mlock, prefetch=prefetch,
                       mapped=mapped)
