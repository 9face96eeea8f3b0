"""Preallocated key/value cache for incremental decoding.

Per layer, keys and values live in two arrays of shape (B, Hkv, P, Dh): one
contiguous (P, Dh) plane per sequence and kv head, so attention reads `k[:, :, :L]` as a few
large strided blocks and the new tokens of a step are one slice assignment. The arrays are
made with np.zeros, which the OS backs lazily: a 4096-slot cache costs address space up front
and physical memory only as slots fill.

Besides K and V the cache remembers, per slot, whether it holds a real token (False for the
left padding of a batch) and its RoPE position, so later steps need neither the attention mask
nor the positions again. The decode step writes its one key and value inside the compiled
attention call (kernels.attend_cached_into); write_one is the same write in NumPy.

The value planes may be narrower or wider than the key planes (value_dim): a model with
multi-head latent attention (colibri/engine/mla.py) keeps one "head" per layer whose key plane holds
the compressed latent (Rkv wide) and whose value plane holds the shared rotary key (Dr wide)
instead of per-head keys and values (docs/families.md has the bytes per token).

The storage dtype is chosen when the cache is made (`dtype`, KV_DTYPES): "f32" (float32,
exact), "f16" (IEEE half, numpy float16) or "bf16" (bfloat16, kept as its uint16 bits: NumPy
has no bfloat16). A 16-bit cache takes half the bytes per token, and a decode step at depth
reads half the bytes. Every write rounds float32 to the storage dtype to nearest, ties to even
(NumPy's float16 cast; quant.f32_to_bf16; the compiled write in csrc/attend.h gives the same
bits); every read widens exactly (the compiled kernels convert as they load, the NumPy paths
convert the slices they read, to_f32). Attention always computes in float32.

Shapes as in the package docstring (P cache slots, S new tokens per sequence).
"""
from __future__ import annotations

import threading

import numpy as np

from ..errors import CacheBusyError, ColibriError
from ..format.quant import bf16_to_f32, f32_to_bf16
from ..kernels import kv_widen_into as _widen
from ..resources import check_allocation
from .run_state import RunState

__all__ = ["KVCache", "CacheOverflowError", "DEFAULT_MAX_CTX", "KV_DTYPES", "DEFAULT_KV_DTYPE",
           "kv_dtype_name"]

# Default context when the caller does not choose one: the model's max_position_embeddings,
# capped here because many configs advertise 32k-128k positions and a cache that size costs
# gigabytes of address space (and of RAM once filled) for a small CPU run. Pass ctx= for more.
DEFAULT_MAX_CTX = 4096


# The storage dtypes of a cache, and the NumPy dtype each is held in (bf16 as its bits).
KV_DTYPES = ("f32", "f16", "bf16")
_STORAGE = {"f32": np.dtype(np.float32), "f16": np.dtype(np.float16),
            "bf16": np.dtype(np.uint16)}
# The other spellings accepted (llama.cpp's -ctk values, vLLM's and PyTorch's names).
_ALIASES = {"float32": "f32", "fp32": "f32", "float16": "f16", "fp16": "f16", "half": "f16",
            "bfloat16": "bf16"}
# The default storage (docs/accuracy.md has the measured cost of each).
DEFAULT_KV_DTYPE = "f16"


def kv_dtype_name(dtype: str, argument: str = "kv_dtype") -> str:
    """The canonical name (one of KV_DTYPES) of a cache dtype spelling ("f16", "fp16",
    "float16", "half", "bf16", "bfloat16", "f32", "fp32", "float32", any case); ValueError
    naming `argument` and the allowed values otherwise."""
    name = dtype.lower() if isinstance(dtype, str) else None
    name = _ALIASES.get(name, name)
    if name not in _STORAGE:
        raise ValueError(f"{argument} must be one of {', '.join(KV_DTYPES)} (or "
                         f"{', '.join(_ALIASES)}), got {dtype!r}")
    return name


def to_storage(x: np.ndarray, dtype: str) -> np.ndarray:
    """float32 values -> the storage array of cache dtype `dtype` (KV_DTYPES), rounded to
    nearest, ties to even (f16: inf past 65504; bf16: NaN stays NaN)."""
    if dtype == "bf16":
        return f32_to_bf16(x)
    with np.errstate(over="ignore"):                 # past f16's range: inf, as documented
        return np.asarray(x, dtype=np.float32).astype(_STORAGE[dtype])


def to_f32(a: np.ndarray) -> np.ndarray:
    """A slice of a cache plane (any storage dtype) as float32, exact: the slice itself for
    an f32 cache (a view), a widened copy otherwise (kernels.kv_widen_into, block of rows by
    block of rows; the same values as quant.bf16_to_f32 / NumPy's float16 cast)."""
    if a.dtype == np.float32:
        return a
    out = np.empty(a.shape, dtype=np.float32)
    if a.size == 0 or a.ndim < 2 or a.strides[-1] != a.itemsize:
        out[...] = bf16_to_f32(a) if a.dtype == np.uint16 else a
        return out
    src = a.reshape(-1, a.shape[-2], a.shape[-1])        # a view for a cache slice
    dst = out.reshape(src.shape)
    for i in range(src.shape[0]):
        _widen(src[i], dst[i])
    return out


class CacheOverflowError(ColibriError, ValueError):
    """Appending the new tokens would run past the cache's context length."""


class _Held:
    """A lock already acquired, released when the `with` block ends."""
    __slots__ = ("lock",)

    def __init__(self, lock: threading.Lock):
        self.lock = lock

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.lock.release()


class KVCache:
    """Keys and values of every layer for a batch of B sequences, P = ctx slots each.

    Attributes: dtype (the storage, one of KV_DTYPES); k, v (lists over layers of
    (B, Hkv, P, Dh) and (B, Hkv, P, Dv) arrays of the storage dtype, float32 / float16 /
    uint16 bf16 bits, Dv = value_dim, head_dim unless given); valid (B, P) bool;
    pos (B, P) int64 (RoPE position of each slot); length (slots in use, shared by the batch);
    owner (the identity of the model file that first used it, None before; colibri.engine.checks).

    The run state of the decode step lives here too, so two caches decoding in two threads
    never share a buffer: run_state (the RunState a model made for this cache, None before
    its first decode step; colibri.engine.run_state) and decode_binding (the compiled layers bound
    to it and to these planes, a _kernels.DecodeBinding, None before; colibri.engine.decode_layer).
    Neither is copied by `copy`. The lock of `claim` keeps one forward pass per cache.
    The arrays are sized before they are made: a cache that cannot fit the memory available
    is a ResourceError stating the bytes (colibri.resources).
    """

    def __init__(self, n_layers: int, batch: int, n_kv_heads: int, ctx: int, head_dim: int,
                 value_dim: int | None = None, dtype: str = "f32"):
        value_dim = head_dim if value_dim is None else value_dim
        self.dtype = kv_dtype_name(dtype, "KVCache: dtype")
        for name, val in (("n_layers", n_layers), ("batch", batch), ("n_kv_heads", n_kv_heads),
                          ("ctx", ctx), ("head_dim", head_dim), ("value_dim", value_dim)):
            if (isinstance(val, (bool, np.bool_)) or not isinstance(val, (int, np.integer))
                    or val < 1):
                raise ValueError(f"KVCache: {name} must be a positive integer, got {val!r}")
        self.n_layers, self.batch, self.n_kv_heads = int(n_layers), int(batch), int(n_kv_heads)
        self.ctx, self.head_dim, self.value_dim = int(ctx), int(head_dim), int(value_dim)
        check_allocation(self.nbytes + self.batch * self.ctx * 9,       # + valid, pos
                         f"a KV cache of ctx {self.ctx} for {self.batch} sequence(s) "
                         f"({self.bytes_per_token} bytes per token)")
        self.owner = None
        self._lock = threading.Lock()
        shape = (self.batch, self.n_kv_heads, self.ctx, self.head_dim)   # (B, Hkv, P, Dh)
        store = _STORAGE[self.dtype]
        self.k = [np.zeros(shape, dtype=store) for _ in range(self.n_layers)]
        shape = shape[:3] + (self.value_dim,)                           # (B, Hkv, P, Dv)
        self.v = [np.zeros(shape, dtype=store) for _ in range(self.n_layers)]
        self.valid = np.zeros((self.batch, self.ctx), dtype=bool)         # (B, P)
        self.pos = np.zeros((self.batch, self.ctx), dtype=np.int64)       # (B, P)
        self.length = 0
        self.run_state: RunState | None = None        # the decode step's buffers (not copied)
        self.decode_binding = None      # _kernels.DecodeBinding over run_state (not copied)

    # -- sizes ------------------------------------------------------------------------------
    @property
    def itemsize(self) -> int:
        """Bytes of one stored element (4 for f32, 2 for f16 / bf16)."""
        return _STORAGE[self.dtype].itemsize

    @property
    def nbytes(self) -> int:
        """Bytes reserved for K and V (all layers)."""
        return self.batch * self.ctx * self.bytes_per_token

    @property
    def bytes_per_token(self) -> int:
        """Bytes one token of one sequence takes in every layer's K and V planes."""
        return (self.n_layers * self.n_kv_heads * (self.head_dim + self.value_dim)
                * self.itemsize)

    @property
    def remaining(self) -> int:
        return self.ctx - self.length

    def __len__(self) -> int:
        return self.length

    def next_positions(self) -> np.ndarray:
        """int64 (B,): the RoPE position the next real token of each sequence gets."""
        if self.length == 0:
            return np.zeros(self.batch, dtype=np.int64)
        pos = np.where(self.valid[:, :self.length], self.pos[:, :self.length], -1)
        return pos.max(axis=1) + 1

    def check_room(self, n_new: int) -> None:
        """Raise CacheOverflowError when n_new more tokens do not fit."""
        if self.length + n_new > self.ctx:
            raise CacheOverflowError(
                f"KV cache overflow: ctx {self.ctx}, current length {self.length}, "
                f"{n_new} new tokens would need {self.length + n_new} slots; "
                f"make a larger cache (model.new_cache(ctx=...)) or truncate/reset this one")

    # -- writing (called by the model during a forward pass) ------------------------------------
    def _store(self, x: np.ndarray) -> np.ndarray:
        return x if self.dtype == "f32" else to_storage(x, self.dtype)

    def write(self, layer: int, k: np.ndarray, v: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Store k float32 (B, Hkv, S, Dh), v (B, Hkv, S, Dv) at slots [length, length+S) of
        `layer` (rounded to the storage dtype).

        Returns float32 (B, Hkv, L, Dh) and (B, Hkv, L, Dv), L = length+S, everything the
        layer attends to: views of an f32 cache, widened copies of a 16-bit one. The length
        itself moves only in `commit`, once every layer has written.
        """
        s = k.shape[2]
        start = self.length
        self.k[layer][:, :, start:start + s] = self._store(k)
        self.v[layer][:, :, start:start + s] = self._store(v)
        return to_f32(self.k[layer][:, :, :start + s]), to_f32(self.v[layer][:, :, :start + s])

    def write_one(self, layer: int, k: np.ndarray, v: np.ndarray, start: int = 0
                  ) -> tuple[np.ndarray, np.ndarray]:
        """`write` for one token of sequence 0 (batch 1): the write the decode step's
        compiled attention call makes (kernels.attend_cached_into), in NumPy.

        k, v float32 (Hkv, Dh) go to slot `length`; returns float32 (Hkv, length+1-start, Dh)
        of slots [start, length+1) of that sequence (views of an f32 cache, as `write`).
        """
        n = self.length
        kl, vl = self.k[layer][0], self.v[layer][0]
        kl[:, n] = self._store(k)
        vl[:, n] = self._store(v)
        return to_f32(kl[:, start:n + 1]), to_f32(vl[:, start:n + 1])

    def commit(self, valid: np.ndarray, positions: np.ndarray) -> None:
        """Advance by S slots after a forward pass; valid bool (B, S), positions int (B, S)."""
        s = valid.shape[1]
        self.check_room(s)
        self.valid[:, self.length:self.length + s] = valid
        self.pos[:, self.length:self.length + s] = positions
        self.length += s

    def commit_one(self, position: int) -> None:
        """commit for one real token of sequence 0 at RoPE position `position` (batch 1)."""
        self.check_room(1)
        n = self.length
        self.valid[0, n] = True
        self.pos[0, n] = position
        self.length = n + 1

    # -- management -----------------------------------------------------------------------------
    def reset(self) -> None:
        """Forget every token (the memory is kept and simply overwritten later)."""
        self.length = 0
        self.valid[:] = False

    def truncate(self, n: int) -> None:
        """Keep the first n slots (a shared prompt prefix) and forget the rest."""
        if int(n) != n or not 0 <= n <= self.length:
            raise ValueError(f"truncate: n must be an integer in [0, {self.length}] "
                             f"(the current length), got {n!r}")
        n = int(n)
        self.valid[:, n:self.length] = False
        self.length = n

    def copy(self) -> "KVCache":
        """An independent cache with the same contents (e.g. to branch from a shared prefix)."""
        new = KVCache.__new__(KVCache)
        new.n_layers, new.batch, new.n_kv_heads = self.n_layers, self.batch, self.n_kv_heads
        new.ctx, new.head_dim, new.value_dim = self.ctx, self.head_dim, self.value_dim
        new.dtype = self.dtype
        new.k, new.v = [], []
        for k, v in zip(self.k, self.v):
            k2 = np.zeros_like(k)
            v2 = np.zeros_like(v)
            k2[:, :, :self.length] = k[:, :, :self.length]   # copy only the filled slots
            v2[:, :, :self.length] = v[:, :, :self.length]
            new.k.append(k2)
            new.v.append(v2)
        new.valid = self.valid.copy()
        new.pos = self.pos.copy()
        new.length = self.length
        new.run_state = new.decode_binding = None
        new.owner = self.owner
        new._lock = threading.Lock()
        return new

    def prefix_copy(self, n: int | None = None, ctx: int | None = None) -> "KVCache":
        """A new cache of `ctx` slots (default: this one's) holding a copy of this cache's
        first n slots (default: all it holds): keys, values, padding and positions, so the
        copy continues from slot n exactly as this cache would have. Several continuations
        of one scored context each run on their own prefix copy (colibri.generation.scoring), the
        context computed once. Only the n slots are copied; ValueError unless
        0 <= n <= length and n <= ctx."""
        n = self.length if n is None else n
        ctx = self.ctx if ctx is None else ctx
        if isinstance(n, bool) or not isinstance(n, (int, np.integer)) or not 0 <= n <= self.length:
            raise ValueError(f"prefix_copy: n must be an integer in [0, {self.length}] (the "
                             f"current length), got {n!r}")
        if isinstance(ctx, bool) or not isinstance(ctx, (int, np.integer)) or ctx < max(n, 1):
            raise ValueError(f"prefix_copy: ctx must be an integer >= max(n, 1) = {max(n, 1)}, "
                             f"got {ctx!r}")
        n = int(n)
        new = KVCache(self.n_layers, self.batch, self.n_kv_heads, int(ctx), self.head_dim,
                      value_dim=self.value_dim, dtype=self.dtype)
        for dst, src in zip(new.k + new.v, self.k + self.v):
            dst[:, :, :n] = src[:, :, :n]
        new.valid[:, :n] = self.valid[:, :n]
        new.pos[:, :n] = self.pos[:, :n]
        new.length = n
        new.owner = self.owner
        return new

    def claim(self) -> "_Held":
        """The cache's lock, taken (use as `with cache.claim(): ...`, released on exit);
        CacheBusyError when a forward pass on another thread holds it."""
        if not self._lock.acquire(blocking=False):
            raise CacheBusyError("this KVCache is in a forward pass on another thread; give "
                                 "each thread its own cache (model.new_cache() or cache.copy())")
        return _Held(self._lock)

    def __repr__(self) -> str:
        return (f"KVCache(layers={self.n_layers}, batch={self.batch}, kv_heads={self.n_kv_heads}, "
                f"head_dim={self.head_dim}"
                + (f", value_dim={self.value_dim}" if self.value_dim != self.head_dim else "")
                + f", ctx={self.ctx}, length={self.length}, dtype={self.dtype}, "
                f"{self.nbytes / 2**20:.1f} MiB)")
