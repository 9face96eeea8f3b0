"""Prefix caching: the keys and values of token prefixes kept for later requests.

    pc = PrefixCache.for_model(model, capacity=64 * 2**20)
    hit = pc.match(prompt)              # the longest cached run of whole blocks (PrefixMatch)
    pc.load(cache, hit)                 # copy them into a fresh KVCache: slots [0, hit.tokens)
    ...prefill prompt[hit.tokens:] ...
    pc.store(prompt, cache)             # keep the whole blocks the cache now holds

Design: hashed fixed-size blocks, as vLLM's automatic prefix caching (not SGLang's radix
tree: a block table is one dict lookup per block and its eviction unit is fixed). The
prompt is cut into blocks of `block_tokens` tokens (16 by default, vLLM's); block i is keyed
by a digest chained over every token before it, blake2b(digest of block i-1 || its token
ids), rooted in the model's namespace (the file's identity: device, inode, size, mtime; the
cache dtype, the activations, the cache geometry), so equal digests mean the same tokens
from the start of the sequence in the same model. A block keeps its tokens too and a match
compares them, so not even a digest collision can return another prefix's keys.

A block holds copies of its slots' rows in every layer's K and V planes of a KVCache in the
cache's storage dtype: k (layers, Hkv, block, Dh), v (layers, Hkv, block, Dv). For
multi-head latent attention (DeepSeek, colibri/engine/mla.py) those planes are the latent c (Rkv)
and the rotated shared key (Dr), so the MLA latent cache is what is kept, at its own small
size. A hit is copied into the request's own contiguous cache (the attention kernels read
one (P, Dh) plane per head), which is a memory copy instead of a prefill: rows are the
exact bits the first request computed.

A block a request asking for prompt log-probabilities stored also carries its rows' scores
(colibri.generation.prompt_logprobs.BlockScores, counted in its bytes), so a later such request with
the same prefix takes them with the keys and values (match's `scored`): lm-eval's choices
of one question share their context this way.

Bounds: the bytes of all blocks stay within `capacity`, and within a `limit` the caller
gives (the Scheduler gives what its KV budget does not hold for admitted requests: the two
share one budget, batching.Scheduler). A block to store that does not fit evicts the least
recently used unreferenced blocks first; when not enough can go, it is not stored.
Referenced blocks (refs > 0: a running request matched or stored them and has not yet
finished its prefill) are never evicted. A use touches a chain from its last block to its
first, so a prefix is always more recent than its continuations and LRU evicts the tails
first (a block whose parent went is unreachable; it never outlives it under this order).

A match leaves at least the prompt's last token to compute, so there are logits to sample
from. What reuse is valid for: every family whose keys and values at slot p depend only on
the tokens 0..p, which includes sliding-window attention (the cache keeps every slot; the
window is a mask over slot indices applied when attending) and GPT-OSS's attention sinks
(learned logits, not cached tokens). Not LongRoPE (PhiMoE): which rotary table a key was
rotated with depends on the length of the call that computed it, so a cached key may not
be what this request would compute; for_model gives such a model a disabled cache and says
why (`unsupported`).

Thread-safe (one lock); the counters are what /metrics shows (stats()).
"""
from __future__ import annotations

import hashlib
import threading
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import numpy as np

from .kv_cache import DEFAULT_MAX_CTX, KVCache

__all__ = ["PrefixCache", "PrefixMatch", "Block", "DEFAULT_BLOCK_TOKENS", "model_namespace",
           "unsupported_reason"]

DEFAULT_BLOCK_TOKENS = 16                  # vLLM's default block size


@dataclass(eq=False)
class Block:
    """One cached block: digest (16 bytes, chained over the tokens before it), tokens int64
    (block,), k (layers, Hkv, block, Dh) and v (layers, Hkv, block, Dv) in the storage
    dtype, refs (running requests holding it), scores (its rows' prompt log-probabilities
    when a request asking for them stored it: colibri.generation.prompt_logprobs.BlockScores, with k
    and nbytes; None otherwise)."""
    digest: bytes
    tokens: np.ndarray
    k: np.ndarray
    v: np.ndarray
    refs: int = 0
    scores: object | None = None

    @property
    def nbytes(self) -> int:
        return self.k.nbytes + self.v.nbytes + (0 if self.scores is None
                                                else self.scores.nbytes)


@dataclass
class PrefixMatch:
    """The cached blocks of a prompt's prefix, in order: blocks, tokens (= len(blocks) *
    block size), the prompt's tokens covered."""
    blocks: list[Block] = field(default_factory=list)
    block_tokens: int = DEFAULT_BLOCK_TOKENS

    @property
    def tokens(self) -> int:
        return len(self.blocks) * self.block_tokens


def model_namespace(model) -> bytes:
    """The root of a model's digest chain: its file identity (a replaced or reloaded file is
    another namespace), cache dtype, activations and cache geometry."""
    key = repr((tuple(model.identity), model.kv_dtype, model.activations,
                tuple(model.cache_dims)))
    return hashlib.blake2b(key.encode(), digest_size=16).digest()


def unsupported_reason(model) -> str | None:
    """Why a model's cached keys may not be reused (None: they may)."""
    scaling = model.config.rope_scaling or {}
    kind = scaling.get("rope_type", scaling.get("type", "default"))
    if kind in ("longrope", "su"):
        return ("LongRoPE: the rotary table of a cached key depends on the length of the call "
                "that computed it, so a cached prefix may differ from what the request computes")
    return None


class PrefixCache:
    """Blocks of cached K/V keyed by token prefix (module docstring).

    n_layers, n_kv_heads, head_dim, value_dim: the geometry of the KVCaches it serves
    (model.cache_dims); dtype: their storage ("f32", "f16", "bf16"); capacity: bytes all
    blocks may take (0: off); block_tokens: tokens per block; namespace: the digest chain's
    root (model_namespace); unsupported: why this model's prefixes are never reused (the
    cache then stays off whatever capacity is set). token_bytes / block_bytes: the bytes of
    one token / one block in every layer's planes (token_bytes is a KVCache's
    bytes_per_token, what the Scheduler counts its budget in).
    """

    def __init__(self, n_layers: int, n_kv_heads: int, head_dim: int, value_dim: int,
                 dtype: str, capacity: int, *, block_tokens: int = DEFAULT_BLOCK_TOKENS,
                 namespace: bytes = b"", unsupported: str | None = None):
        for name, val, lo in (("block_tokens", block_tokens, 1), ("capacity", capacity, 0)):
            if isinstance(val, bool) or not isinstance(val, (int, np.integer)) or val < lo:
                raise ValueError(f"PrefixCache: {name} must be an integer >= {lo}, got {val!r}")
        self.dims = (int(n_layers), int(n_kv_heads), int(head_dim), int(value_dim))
        self.dtype = dtype
        self.block_tokens = int(block_tokens)
        self.unsupported = unsupported
        itemsize = 4 if dtype == "f32" else 2
        L, H, Dk, Dv = self.dims
        self.token_bytes = L * H * (Dk + Dv) * itemsize    # a KVCache's bytes_per_token
        self.block_bytes = self.token_bytes * self.block_tokens
        self._namespace = bytes(namespace)
        self._root = hashlib.blake2b(self._namespace, digest_size=16).digest()
        self._capacity = int(capacity)
        self._blocks: OrderedDict[bytes, Block] = OrderedDict()    # LRU first
        self._lock = threading.RLock()
        self.nbytes = 0
        self.hits = self.misses = self.evictions = self.stored = self.lookups = 0

    @classmethod
    def for_model(cls, model, capacity: int | None = None,
                  block_tokens: int = DEFAULT_BLOCK_TOKENS) -> "PrefixCache":
        """A cache for `model`'s KVCaches; capacity None: DEFAULT_MAX_CTX (4096) tokens'
        bytes, the size of one default context (0: off)."""
        L, H, Dk, Dv = model.cache_dims
        if capacity is not None and (isinstance(capacity, bool) or not isinstance(
                capacity, (int, np.integer)) or capacity < 0):
            raise ValueError(f"prefix_cache must be None (the default size) or a number of "
                             f"bytes >= 0 (0: off), got {capacity!r}")
        if capacity is None:
            itemsize = 4 if model.kv_dtype == "f32" else 2
            capacity = DEFAULT_MAX_CTX * L * H * (Dk + Dv) * itemsize
        return cls(L, H, Dk, Dv, model.kv_dtype, capacity, block_tokens=block_tokens,
                   namespace=model_namespace(model), unsupported=unsupported_reason(model))

    # -- settings and counters --------------------------------------------------------------
    @property
    def enabled(self) -> bool:
        return self._capacity > 0 and self.unsupported is None

    @property
    def capacity(self) -> int:
        return self._capacity

    @capacity.setter
    def capacity(self, nbytes: int) -> None:
        """A new bound in bytes (0: off); blocks past it are evicted (LRU, unreferenced)."""
        if isinstance(nbytes, bool) or not isinstance(nbytes, (int, np.integer)) or nbytes < 0:
            raise ValueError(f"PrefixCache: capacity must be an integer >= 0, got {nbytes!r}")
        with self._lock:
            self._capacity = int(nbytes)
            self.shrink(self._capacity)

    @property
    def namespace(self) -> bytes:
        return self._namespace

    def rekey(self, namespace: bytes) -> None:
        """Serve another model (version): every block goes, the chains start from the new
        root. Raises RuntimeError while a running request holds blocks."""
        with self._lock:
            self.clear()
            self._namespace = bytes(namespace)
            self._root = hashlib.blake2b(self._namespace, digest_size=16).digest()

    @property
    def pinned_bytes(self) -> int:
        with self._lock:
            return sum(b.nbytes for b in self._blocks.values() if b.refs)

    def __len__(self) -> int:
        return len(self._blocks)

    def stats(self) -> dict:
        """hits / misses (prompt tokens looked up, found / computed), lookups (prompts looked
        up), stored (blocks written), evictions (blocks), blocks, bytes, capacity_bytes,
        block_tokens."""
        with self._lock:
            return dict(hits=self.hits, misses=self.misses, lookups=self.lookups,
                        stored=self.stored, evictions=self.evictions, blocks=len(self._blocks),
                        bytes=self.nbytes, capacity_bytes=self._capacity if self.enabled else 0,
                        block_tokens=self.block_tokens)

    # -- keys ---------------------------------------------------------------------------------
    def chain(self, tokens: Sequence[int]) -> list[bytes]:
        """The digests of the whole blocks of `tokens`, block i's over tokens[:(i+1)*block]."""
        ids = np.asarray(tokens, dtype=np.int64)
        n, out, prev = ids.size // self.block_tokens, [], self._root
        for i in range(n):
            h = hashlib.blake2b(prev, digest_size=16)
            h.update(ids[i * self.block_tokens:(i + 1) * self.block_tokens].tobytes())
            prev = h.digest()
            out.append(prev)
        return out

    # -- lookups --------------------------------------------------------------------------------
    def match(self, tokens: Sequence[int], chain: list[bytes] | None = None,
              count: bool = True, scored: int | None = None) -> PrefixMatch:
        """The longest run of cached whole blocks `tokens` starts with, leaving at least its
        last token uncached (there must be logits to sample from); touched as used.
        chain: tokens' digests when the caller has them (chain(tokens)); count: add to the
        hits / misses counters (a request counts once, at admission); scored: only blocks
        whose scores keep at least that many tops (a request asking prompt_logprobs)."""
        ids = np.asarray(tokens, dtype=np.int64)
        out = PrefixMatch(block_tokens=self.block_tokens)
        if not self.enabled or ids.size == 0:
            if count and ids.size:
                with self._lock:
                    self.lookups += 1
                    self.misses += int(ids.size)
            return out
        usable = (ids.size - 1) // self.block_tokens
        chain = self.chain(ids[:usable * self.block_tokens]) if chain is None else chain
        bs = self.block_tokens
        with self._lock:
            for i, digest in enumerate(chain[:usable]):
                b = self._blocks.get(digest)
                if b is None or not np.array_equal(b.tokens, ids[i * bs:(i + 1) * bs]):
                    break
                if scored is not None and (b.scores is None or b.scores.k < scored):
                    break
                out.blocks.append(b)
            self._touch(out.blocks)
            if count:
                self.lookups += 1
                self.hits += out.tokens
                self.misses += int(ids.size) - out.tokens
        return out

    def count(self, hit_tokens: int, miss_tokens: int) -> None:
        """Count one prompt looked up: hit_tokens served from the cache, miss_tokens computed
        (for callers that match with count=False and learn the outcome later)."""
        with self._lock:
            self.lookups += 1
            self.hits += int(hit_tokens)
            self.misses += int(miss_tokens)

    def _touch(self, blocks: list[Block]) -> None:
        for b in reversed(blocks):            # the first block ends most recent: tails go first
            self._blocks.move_to_end(b.digest)

    def acquire(self, blocks: Sequence[Block]) -> None:
        """Hold blocks (a running request uses them): they are not evicted until released."""
        with self._lock:
            for b in blocks:
                b.refs += 1

    def release(self, blocks: Sequence[Block]) -> None:
        with self._lock:
            for b in blocks:
                b.refs = max(0, b.refs - 1)

    # -- copies between blocks and KV caches ----------------------------------------------------
    def reuse(self, tokens: Sequence[int], cache: KVCache) -> int:
        """Start an empty one-sequence `cache` with the longest cached prefix of `tokens`
        (match, then load; counted): the tokens it now holds, 0 on a miss or when off."""
        if not self.enabled or cache.length or cache.batch != 1:
            return 0
        hit = self.match(tokens)
        return self.load(cache, hit) if hit.blocks else 0

    def _check_cache(self, cache: KVCache) -> None:
        found = (cache.n_layers, cache.n_kv_heads, cache.head_dim, cache.value_dim)
        if found != self.dims or cache.dtype != self.dtype or cache.batch != 1:
            raise ValueError(f"prefix cache for (layers, kv heads, key dim, value dim) = "
                             f"{self.dims}, dtype {self.dtype}, one sequence; the KVCache has "
                             f"{found}, dtype {cache.dtype}, batch {cache.batch}")

    def load(self, cache: KVCache, hit: PrefixMatch) -> int:
        """Copy hit's blocks past cache.length into the cache (slots [length, hit.tokens),
        real tokens at positions 0..hit.tokens-1) and advance it; the tokens it now holds.
        cache.length must be a whole number of blocks within the hit."""
        self._check_cache(cache)
        bs, start = self.block_tokens, cache.length
        if start % bs or start > hit.tokens:
            raise ValueError(f"load: the cache holds {start} tokens, not a whole number of "
                             f"{bs}-token blocks within the hit of {hit.tokens}")
        if hit.tokens > cache.ctx:
            raise ValueError(f"load: {hit.tokens} cached tokens do not fit ctx {cache.ctx}")
        for i in range(start // bs, len(hit.blocks)):
            b, a = hit.blocks[i], i * bs
            for layer in range(cache.n_layers):
                cache.k[layer][0, :, a:a + bs] = b.k[layer]
                cache.v[layer][0, :, a:a + bs] = b.v[layer]
        n = hit.tokens
        cache.valid[0, start:n] = True
        cache.pos[0, start:n] = np.arange(start, n)
        cache.length = max(cache.length, n)
        return cache.length

    def store(self, tokens: Sequence[int], cache: KVCache, limit: int | None = None,
              chain: list[bytes] | None = None,
              scores: Callable[[int], object | None] | None = None) -> list[Block]:
        """Keep the whole blocks of `tokens` whose keys and values `cache` holds (its first
        min(len(tokens), cache.length) slots, which must be those tokens at positions 0, 1,
        ... without padding), the ones already cached touched; the chain's blocks, in order
        (shorter when a block did not fit: capacity, and `limit` bytes in all when given).
        A cache with padding or other positions stores nothing. scores: block index -> its
        rows' scores (or None), given to a block that has none or keeps fewer tops, when
        they fit the same bounds."""
        if not self.enabled:
            return []
        self._check_cache(cache)
        ids = np.asarray(tokens, dtype=np.int64)
        bs = self.block_tokens
        n = min(ids.size, cache.length) // bs
        if n == 0 or not cache.valid[0, :n * bs].all() or not np.array_equal(
                cache.pos[0, :n * bs], np.arange(n * bs)):
            return []
        chain = self.chain(ids[:n * bs]) if chain is None else chain[:n]
        bound = self._capacity if limit is None else min(self._capacity, int(limit))
        out: list[Block] = []
        with self._lock:
            for i, digest in enumerate(chain):
                b = self._blocks.get(digest)
                if b is None:
                    if not self.shrink(bound - self.block_bytes, keep=out):
                        break
                    b = self._copy_out(digest, ids[i * bs:(i + 1) * bs], cache, i * bs)
                    self._blocks[digest] = b
                    self.nbytes += b.nbytes
                    self.stored += 1
                elif not np.array_equal(b.tokens, ids[i * bs:(i + 1) * bs]):
                    break                                # a digest collision: keep the first
                if scores is not None:
                    self._score(b, scores(i), bound, keep=out)
                out.append(b)
            self._touch(out)
        return out

    def _score(self, b: Block, s, bound: int, keep: list[Block]) -> None:
        """Give b the scores s when it has none or keeps fewer tops, within bound bytes."""
        if s is None or (b.scores is not None and b.scores.k >= s.k):
            return
        grow = s.nbytes - (0 if b.scores is None else b.scores.nbytes)
        if self.shrink(bound - grow, keep=[*keep, b]):
            b.scores = s
            self.nbytes += grow

    def _copy_out(self, digest: bytes, tokens: np.ndarray, cache: KVCache, a: int) -> Block:
        bs = self.block_tokens
        L, H, Dk, Dv = self.dims
        k = np.empty((L, H, bs, Dk), dtype=cache.k[0].dtype)
        v = np.empty((L, H, bs, Dv), dtype=cache.v[0].dtype)
        for layer in range(L):
            k[layer] = cache.k[layer][0, :, a:a + bs]
            v[layer] = cache.v[layer][0, :, a:a + bs]
        return Block(digest, tokens.copy(), k, v)

    # -- eviction --------------------------------------------------------------------------------
    def shrink(self, nbytes: int, keep: Sequence[Block] = ()) -> bool:
        """Evict least recently used unreferenced blocks (not those in `keep`) until the
        blocks take at most nbytes; False when the referenced ones alone take more."""
        with self._lock:
            if self.nbytes <= nbytes:
                return True
            kept = {id(b) for b in keep}
            for digest in list(self._blocks):
                if self.nbytes <= nbytes:
                    break
                b = self._blocks[digest]
                if b.refs or id(b) in kept:
                    continue
                del self._blocks[digest]
                self.nbytes -= b.nbytes
                self.evictions += 1
            return self.nbytes <= nbytes

    def clear(self) -> None:
        """Drop every block (a reload, or on demand); RuntimeError while some are held."""
        with self._lock:
            if any(b.refs for b in self._blocks.values()):
                raise RuntimeError("clear: running requests hold prefix-cache blocks")
            self._blocks.clear()
            self.nbytes = 0

    def __repr__(self) -> str:
        state = ("off: " + self.unsupported) if self.unsupported else (
            f"{self.nbytes}/{self._capacity} bytes")
        return (f"PrefixCache({len(self._blocks)} blocks of {self.block_tokens} tokens, "
                f"{state}, hits={self.hits}, misses={self.misses})")
