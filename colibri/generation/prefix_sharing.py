"""The Scheduler's use of a PrefixCache: hits at admission, blocks kept as prompts fill, one
prefill for requests that share a prefix at the same time.

  - admit: a request's cache starts with the longest cached prefix of its prompt (copied,
    colibri.engine.prefix_cache), the blocks held until its prefill is done; a request asking for
    prompt_logprobs = k takes only blocks that carry their rows' scores with at least k
    tops (colibri.generation.prompt_logprobs: scored blocks), its handle's entries with them, and
    keeps each block's last row's logits while it prefills so its own blocks carry scores;
  - ready (each step, before a request gets a prompt chunk): blocks stored since its
    admission extend its prefix; and when a request admitted before it is computing the
    very next block of the same prefix (n > 1 choices of one prompt, the same system prompt
    arriving together, the choices of one multiple-choice question) and will store it in a
    form this one can take (scored with enough tops, if it asks for prompt_logprobs), it
    waits for that block instead of computing it too: the earliest of such requests never
    waits, so every wait ends;
  - after_chunk: the whole blocks of the prompt its cache now holds are stored (and held
    while it prefills, so a follower finds them);
  - end: prompt and generated tokens the cache holds are stored (the next chat turn starts
    with them), and its blocks released.

Stores are bounded by the room the KV budget leaves (`room()`: the budget minus the bytes
of the admitted requests), so the cache lives in the budget's idle part; admission evicts
from it what a new request needs (Scheduler._admit through make_room).
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

from ..engine.prefix_cache import PrefixCache, model_namespace
from .prompt_logprobs import KeptRows, entries_of_blocks, scores_of_block

__all__ = ["PrefixSharing", "scheduler_cache"]


def scheduler_cache(model, pc, budget: int) -> PrefixCache:
    """The Scheduler's prefix_cache argument made a PrefixCache: None one of `budget` bytes,
    an int one of min(int, budget) bytes (0: off), a PrefixCache of this model as it is."""
    if isinstance(pc, PrefixCache):
        if pc.namespace != model_namespace(model) or pc.dims != tuple(model.cache_dims):
            raise ValueError("prefix_cache belongs to another model (file, kv_dtype or "
                             "activations): give model.prefix_cache or a number of bytes")
        return pc
    if pc is not None and (isinstance(pc, bool) or not isinstance(pc, (int, np.integer))
                           or pc < 0):
        raise ValueError(f"prefix_cache must be None, a PrefixCache or a number of bytes "
                         f">= 0, got {pc!r}")
    return PrefixCache.for_model(model, budget if pc is None else min(int(pc), budget))


@dataclass
class _Prefix:
    """A running request's use of the cache: chain (digests of its prompt's usable blocks),
    held (blocks held while it prefills), cached (prompt tokens copied from the cache),
    scored (its prompt_logprobs: the tops its blocks need; None when it asks none)."""
    chain: list[bytes] = field(default_factory=list)
    held: list = field(default_factory=list)
    cached: int = 0
    scored: int | None = None


class PrefixSharing:
    """cache: the PrefixCache (off: every method does nothing); budget: the Scheduler's KV
    budget in bytes; in_use: bytes the admitted requests hold now."""

    def __init__(self, cache: PrefixCache, budget: int, in_use: Callable[[], int]):
        self.cache, self.budget, self.in_use = cache, budget, in_use
        self._on = cache.enabled
        self._of: dict = {}                       # request -> _Prefix, while admitted

    @classmethod
    def of(cls, scheduler, prefix_cache) -> "PrefixSharing":
        """A Scheduler's: prefix_cache None a cache of its own that may hold all of the KV
        budget the admitted requests do not; an int, at most that many bytes (0: off); a
        PrefixCache of this model (model.prefix_cache) to share with other users."""
        pc = scheduler_cache(scheduler.model, prefix_cache, scheduler.kv_budget)
        return cls(pc, scheduler.kv_budget, lambda: scheduler._kv_in_use)

    def room(self) -> int:
        return self.budget - self.in_use()

    def make_room(self, need: int) -> bool:
        """Whether `need` bytes (admitted requests' and a new one's) fit the budget beside
        the cache, evicting unreferenced blocks to make them fit."""
        if need > self.budget:
            return False
        return not self._on or self.cache.shrink(self.budget - need)

    def admit(self, r) -> None:
        """r's cache starts with the cached prefix of its prompt (none for a prompt given
        as embeddings: its slots are not those of any tokens)."""
        if not self._on or r.embeds is not None:
            return
        pc, st = self.cache, _Prefix(scored=r.params.prompt_logprobs)
        self._of[r] = st
        if st.scored is not None:
            r.kept_rows = KeptRows(pc.block_tokens)
        usable = (len(r.prompt) - 1) // pc.block_tokens * pc.block_tokens
        st.chain = pc.chain(r.prompt[:usable])
        self._extend(r, st)

    def _extend(self, r, st: _Prefix) -> None:
        pc, bs = self.cache, self.cache.block_tokens
        hit = pc.match(r.prompt, st.chain, count=False, scored=st.scored)
        if hit.tokens <= r.prefilled:
            return
        new = hit.blocks[r.prefilled // bs:]
        pc.acquire(new)
        st.held.extend(new)
        if st.scored is not None:                  # the handle's entries for those tokens
            h = r.handle
            if h.prompt_logprobs is None:
                h.prompt_logprobs = [None]
            first = r.prefilled // bs
            h.prompt_logprobs.extend(entries_of_blocks(
                [b.scores for b in new],
                [r.prompt[(i + 1) * bs] for i in range(first, first + len(new))], st.scored))
        pc.load(r.cache, hit)
        st.cached += hit.tokens - r.prefilled
        r.prefilled = hit.tokens

    def _takes_from(self, st: _Prefix, so: _Prefix) -> bool:
        """Whether blocks the request of `so` stores are ones the request of `st` takes."""
        return st.scored is None or (so.scored is not None and so.scored >= st.scored)

    def ready(self, r, running: list) -> bool:
        """Whether prefilling r may compute its next chunk now (after extending it)."""
        st = self._of.get(r)
        if st is None or not st.chain:
            return True
        bs = self.cache.block_tokens
        if r.prefilled % bs == 0 and r.prefilled == r.cache.length:
            self._extend(r, st)
        j = r.prefilled // bs
        if j >= len(st.chain):
            return True
        for o in running:
            if o is r:                             # only those admitted before r
                return True
            so = self._of.get(o)
            if (so is not None and o.prefilling and len(so.chain) > j
                    and so.chain[j] == st.chain[j] and o.prefilled < (j + 1) * bs
                    and self._takes_from(st, so)):
                return False
        return True

    def after_chunk(self, r) -> None:
        """After a prompt chunk of r: store its prompt's whole blocks, count it when done."""
        st = self._of.get(r)
        if st is None:
            return
        pc = self.cache
        kept = pc.store(r.prompt[:r.prefilled], r.cache, limit=self.room(),
                        scores=None if st.scored is None else self._scores(r, st))
        if st.scored is not None:                  # rows of blocks now behind it are done
            r.kept_rows.rows = {p: x for p, x in r.kept_rows.rows.items() if p >= r.prefilled}
        if r.prefilling:
            held = {id(b) for b in st.held}
            new = [b for b in kept if id(b) not in held]
            pc.acquire(new)
            st.held.extend(new)
            return
        pc.count(st.cached, len(r.prompt) - st.cached)
        pc.release(st.held)
        st.held = []

    def _scores(self, r, st: _Prefix):
        """block index -> the scores of r's rows of that block, None for a block it took
        from the cache (it has them) or whose last row it did not compute."""
        bs, entries, rows = self.cache.block_tokens, r.handle.prompt_logprobs, r.kept_rows.rows

        def of(i: int):
            last = rows.get((i + 1) * bs - 1)
            if last is None or entries is None or len(entries) < (i + 1) * bs:
                return None
            return scores_of_block(entries[i * bs + 1:(i + 1) * bs], last, st.scored)
        return of

    def cached_tokens(self, r) -> int:
        """Prompt tokens of r copied from the cache (0 when off)."""
        st = self._of.get(r)
        return 0 if st is None else st.cached

    def end(self, r, keep: bool) -> None:
        """r ends: keep (not after an error) the blocks of what its cache holds, release."""
        st = self._of.pop(r, None)
        if st is None:
            return
        if keep and r.cache is not None:
            self.cache.store(r.history[:r.cache.length], r.cache, limit=self.room())
        self.cache.release(st.held)
