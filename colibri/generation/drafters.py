"""Where speculative decoding's draft tokens come from (colibri.generation.speculative_batch
verifies them with colibri.generation.speculative's rule).

    PromptLookup(max_ngram=3, min_ngram=1)   n-gram match in the prompt and the output so far
                                             (transformers' prompt_lookup_num_tokens, vLLM's
                                             "ngram"): no second model, q is a point mass
    DraftModel(draft_model, target_model)    a smaller .colibri model with the same tokenizer
                                             decodes k tokens ahead in its own KV cache
    Backoff(k)                               how many tokens to draft next, from how many of
                                             the last drafts were accepted

A drafter's propose(history, k, sampler) returns (drafts: list of at most k ids, q float64
(len, V) or None): q[i] is the distribution drafts[i] was drawn from, None for a point mass
(prompt lookup, or a greedy draft model). After a verification the caller reports how far
the history stayed (accepted(history_length)) so a draft model can drop what was rejected;
start(prompt, ctx) begins a sequence. Any object with these three methods is a drafter.
"""
from __future__ import annotations

import copy
import os

import numpy as np

from ..errors import ColibriError
from .sampling import Sampler, sample_from_probs

__all__ = ["PromptLookup", "DraftModel", "Backoff", "DraftMismatchError", "make_drafter",
           "is_drafter", "check_same_vocabulary",
           "PROMPT_LOOKUP", "DEFAULT_DRAFT_TOKENS"]

PROMPT_LOOKUP = "prompt-lookup"
DEFAULT_DRAFT_TOKENS = 4


class DraftMismatchError(ColibriError, ValueError):
    """The draft model's vocabulary or tokenizer differs from the target's."""


class PromptLookup:
    """Drafts copied from the history: the tokens that followed the most recent earlier
    occurrence of the history's last n tokens, n from max_ngram down to min_ngram (the
    longest suffix that matches wins); a match that runs into the suffix (a loop) is
    continued periodically."""

    def __init__(self, max_ngram: int = 3, min_ngram: int = 1):
        for name, v in (("max_ngram", max_ngram), ("min_ngram", min_ngram)):
            if isinstance(v, bool) or not isinstance(v, (int, np.integer)) or v < 1:
                raise ValueError(f"prompt lookup: {name} must be an integer >= 1, got {v!r}")
        if min_ngram > max_ngram:
            raise ValueError(f"prompt lookup: min_ngram {min_ngram} is above max_ngram "
                             f"{max_ngram}")
        self.max_ngram, self.min_ngram = int(max_ngram), int(min_ngram)

    def start(self, prompt, ctx: int) -> None:
        pass

    def propose(self, history, k: int, sampler: Sampler | None = None, n_prompt: int = 0):
        """(up to k ids copied from the history, None): no match, no drafts."""
        h = np.asarray(history, dtype=np.int64)
        n_all = h.size
        if k <= 0 or n_all < 2:
            return [], None
        for n in range(min(self.max_ngram, n_all - 1), self.min_ngram - 1, -1):
            suffix = h[n_all - n:]
            # windows starting at 0 .. n_all-n-1: every earlier occurrence of the suffix
            hits = h[:n_all - 1] == suffix[0]
            starts = np.flatnonzero(hits[:n_all - n])
            for j in range(1, n):
                if starts.size == 0:
                    break
                starts = starts[h[starts + j] == suffix[j]]
            if starts.size:
                s = int(starts[-1]) + n                           # the most recent one
                # a match that runs into the suffix is a loop of period n_all - s: the
                # copy continues it (a repeated token drafts k repeats, not one)
                idx = s + np.arange(k) % (n_all - s)
                return [int(t) for t in h[idx]], None
        return [], None

    def accepted(self, length: int) -> None:
        pass

    def __repr__(self) -> str:
        return f"PromptLookup(max_ngram={self.max_ngram}, min_ngram={self.min_ngram})"


def _vocab(model) -> dict | None:
    tok = model.tokenizer
    return None if tok is None else tok.hf.get_vocab()


def check_same_vocabulary(draft, target) -> None:
    """DraftMismatchError naming both files unless the two models share the vocabulary size
    and (when either carries one) the tokenizer's token -> id table."""
    a, b = str(draft.file.path), str(target.file.path)
    if draft.vocab_size != target.vocab_size:
        raise DraftMismatchError(f"the draft model {a} has a vocabulary of {draft.vocab_size} "
                                 f"tokens, the target {b} {target.vocab_size}: speculative "
                                 f"decoding needs the same tokenizer")
    va, vb = _vocab(draft), _vocab(target)
    if (va is None) != (vb is None):
        which = a if va is None else b
        raise DraftMismatchError(f"{which} carries no tokenizer and the other model does "
                                 f"(draft {a}, target {b}): cannot check they share one")
    if va is not None and va != vb:
        diff = sorted(set(va.items()) ^ set(vb.items()), key=lambda kv: kv[1])[:1]
        raise DraftMismatchError(f"the draft model {a} and the target {b} have different "
                                 f"tokenizers (e.g. token {diff[0][0]!r} -> id {diff[0][1]} in "
                                 f"only one of them): speculative decoding needs the same one")


class DraftModel:
    """A second, smaller model that decodes the drafts in its own KV cache, kept in step
    with the target's history (what was rejected is truncated away, what is new is fed in
    one pass before the next drafts)."""

    def __init__(self, draft, target):
        check_same_vocabulary(draft, target)
        self.model = draft
        self.cache = None
        self.fed = 0                        # history tokens in the draft cache

    def start(self, prompt, ctx: int) -> None:
        self.cache = self.model.new_cache(ctx=ctx)
        self.fed = 0

    def another(self) -> "DraftModel":
        """A DraftModel of the same two models (their vocabularies checked already) with no
        cache yet: one for each sequence."""
        twin = copy.copy(self)
        twin.cache, twin.fed = None, 0
        return twin

    def propose(self, history, k: int, sampler: Sampler, n_prompt: int = 0):
        """Up to k ids the draft model continues `history` with (greedy when the sampler is,
        else drawn from its processed distribution q, also returned (len, V)); the
        penalties see history[n_prompt:] as the generated tokens, as the target's do."""
        cache = self.cache
        k = min(k, cache.ctx - len(history))       # its cache takes history + k - 1
        if k <= 0:
            return [], None
        new = np.asarray(history[self.fed:], dtype=np.int64)
        logits = self.model.forward(new, cache=cache, last_only=True)[-1]
        seen = list(history)
        drafts, qs = [], []
        for i in range(k):
            x = sampler.penalise(logits, seen, seen[n_prompt:])
            if sampler.is_greedy:
                tok = int(np.argmax(x))
            else:
                q = sampler.distribution(x)
                tok = sample_from_probs(q, sampler.rng)
                qs.append(q)
            drafts.append(tok)
            seen.append(tok)
            if i < k - 1:
                logits = self.model.forward(np.array([tok]), cache=cache, last_only=True)[-1]
        self.fed = cache.length
        return drafts, (np.stack(qs) if qs else None)

    def accepted(self, length: int) -> None:
        """The target's history now agrees with the drafts up to `length` tokens."""
        if self.cache is not None and self.fed > length:
            self.cache.truncate(length)
            self.fed = length

    def __repr__(self) -> str:
        return f"DraftModel({self.model.file.path})"


class Backoff:
    """Draft length control: up to k tokens, shortened after rejections and paused when
    speculation does not pay, so a text with nothing to look up runs at plain speed.

    After a verification of d drafts with a accepted: all accepted grows the length by one
    (up to k); some rejected sets it to a + 1; none accepted is a miss. Timed, the length
    starts at 1 (untimed at k). With timed=True the
    seconds of each pass count too: a verification whose seconds per token produced are
    above the running mean of a plain decode step's is a miss as well (on a CPU a pass of
    k+1 tokens can cost close to k+1 steps: then acceptance alone does not make it pay).
    After two misses in a row drafting pauses for 2**misses steps (at most max_pause), then
    probes again; timed, one step in 17 is plain anyway, to follow the machine's load, and a
    verification slower than drafted + 1 plain steps (it could not pay even if every draft
    were accepted) pauses for max_pause steps at once. timed=False decides from acceptance only, so the same seed gives the same
    draws run after run."""

    def __init__(self, k: int, max_pause: int = 64, timed: bool = True):
        self.k = int(k)
        self.timed = bool(timed)
        # timed, the first probe drafts one token (a pass of k + 1 rows costs up to k + 1
        # steps: on a text with nothing to look up it would be lost), growing by one per
        # pass that keeps every draft
        self.length = 1 if self.timed else self.k
        self.misses = 0
        self.pause = 0
        self.max_pause = int(max_pause)
        self.plain_seconds: float | None = None      # running mean of a plain step
        self.spec_seconds: float | None = None       # of a verification, per token produced
        self.pause = 3 if self.timed else 0          # first measure plain steps (the first
        self._unmeasured = 1                         # one builds the decode state: not timed)
        self.since_plain = 0
        self.refresh = 16                            # then one plain step in every 17

    def next_length(self) -> int:
        """Tokens to draft now (0: decode one token plainly this step)."""
        if self.pause > 0:
            self.pause -= 1
            return 0
        self.since_plain += 1
        if self.timed and self.since_plain > self.refresh:   # re-measure a plain step: the
            self.since_plain = 0                             # machine's load drifts
            return 0
        return self.length

    @staticmethod
    def _mean(old: float | None, new: float) -> float:
        return new if old is None else 0.7 * old + 0.3 * new

    def update(self, drafted: int, accepted: int, seconds: float | None = None) -> None:
        """After a pass that carried `drafted` drafts (0: a plain step) of which `accepted`
        were accepted, taking `seconds`."""
        if drafted == 0:
            if seconds is not None and self._unmeasured:
                self._unmeasured -= 1
            elif seconds is not None:
                self.plain_seconds = self._mean(self.plain_seconds, seconds)
            return
        paying = True
        if self.timed and seconds is not None and self.plain_seconds:
            self.spec_seconds = self._mean(self.spec_seconds, seconds / (accepted + 1))
            if seconds > (drafted + 1) * self.plain_seconds:  # not even every draft accepted
                self.misses += 1                              # would pay: back off at once
                self.pause = self.max_pause
                return
            paying = self.spec_seconds <= self.plain_seconds
        if accepted == 0 or not paying:
            self.misses += 1
            self.length = max(1, min(self.length, accepted + 1))
            self.pause = min(2 ** self.misses, self.max_pause) if self.misses > 1 else 0
            return
        self.misses = 0
        self.length = min(self.k, self.length + 1) if accepted == drafted else accepted + 1

    def __repr__(self) -> str:
        return f"Backoff(k={self.k}, length={self.length}, misses={self.misses})"


def is_drafter(obj) -> bool:
    """True for an object with a drafter's start, propose and accepted methods."""
    return all(callable(getattr(obj, name, None)) for name in ("start", "propose", "accepted"))


def make_drafter(target, draft, *, max_ngram: int = 3, min_ngram: int = 1):
    """The drafter for `draft`: "prompt-lookup", a colibri Model, a path to a .colibri
    file (loaded with the target's threads, activations and KV dtype), or a drafter made
    already (PromptLookup(max_ngram=...), DraftModel, an object of one's own with start,
    propose and accepted: returned as it is)."""
    if is_drafter(draft):
        return draft
    if isinstance(draft, str) and draft == PROMPT_LOOKUP:
        return PromptLookup(max_ngram, min_ngram)
    if isinstance(draft, (str, os.PathLike)):
        if not os.path.isfile(draft):
            raise FileNotFoundError(f"draft model {os.fspath(draft)!r}: no such file (give a "
                                    f".colibri path or {PROMPT_LOOKUP!r})")
        draft = type(target)(draft, threads=target.threads, activations=target.activations,
                             kv_dtype=target.kv_dtype)           # a Model, as the target
    if hasattr(draft, "new_cache") and hasattr(draft, "forward"):
        return DraftModel(draft, target)
    raise TypeError(f"draft must be {PROMPT_LOOKUP!r}, a .colibri path, a colibri Model or a "
                    f"drafter (start, propose, accepted), got {type(draft).__name__}")
