"""Scoring continuations: the log-likelihood of given tokens after a given context, batched.

    results = score(model, [(context_ids, continuation_ids), ...])
    results[i].logprob, results[i].is_greedy, results[i].token_logprobs

What evaluation harnesses ask of a model (lm-evaluation-harness's `loglikelihood`, every
multiple-choice benchmark, rolling perplexity): for each (context, continuation) pair, the
sum over the continuation's tokens of log p(token | everything before it), and whether
greedy decoding would have produced the continuation (each token the argmax of its row).

Several continuations of one context (the choices of a multiple-choice question) share it:
the context runs once, into a KV cache, and each continuation runs on its own copy of that
cache's slots (KVCache.prefix_copy), so a question with four choices costs its context once
plus four short continuations instead of four whole sequences. The last context token's
logits score every continuation's first token, so one-token continuations (MMLU's " A",
" B", ...) cost nothing beyond the context. share_contexts=False scores every pair whole
(the reference the saving is measured against, scripts/bench_eval.py).

Every forward pass is one ragged step (Model.forward_ragged) over as many sequences as fit
`batch_tokens` rows: context chunks and continuations of different questions together, the
head run only on the rows that are scored (logits_rows). A context longer than batch_tokens
is prefilled over several steps. Each row's values are those of its sequence alone, up to
the projections' summation order (docs/batching.md).

Log-probabilities are float64 log-softmax of the float32 logits (as sampling.log_softmax);
greedy compares with the first argmax, as torch.argmax does.
"""
from __future__ import annotations

from collections.abc import Callable, Sequence
from collections import deque
from dataclasses import dataclass, field

import numpy as np

from ..engine.kv_cache import KVCache

__all__ = ["Scored", "score", "row_logprobs", "DEFAULT_BATCH_TOKENS"]

# rows of one ragged step: large enough that the projections and experts run as GEMMs over
# many tokens (the prefill speed of `colibri bench`), small enough that a step's logits and
# activations stay a few MB
DEFAULT_BATCH_TOKENS = 512
_LOGSOFTMAX_ROWS = 64          # rows per float64 log-softmax block (V * 8 bytes each)


@dataclass
class Scored:
    """One (context, continuation) pair scored: logprob (the sum, float), is_greedy (every
    continuation token is its row's argmax), token_logprobs float64 (C,) per token."""
    logprob: float
    is_greedy: bool
    token_logprobs: np.ndarray = field(repr=False)


def row_logprobs(logits: np.ndarray, targets: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(log p(target) float64 (R,), target is the first argmax bool (R,)) of logits float32
    (R, V) and targets int (R,): a float64 log-softmax per row, in blocks of rows."""
    R = logits.shape[0]
    lp = np.empty(R, dtype=np.float64)
    for a in range(0, R, _LOGSOFTMAX_ROWS):
        x = logits[a:a + _LOGSOFTMAX_ROWS].astype(np.float64)
        x -= x.max(axis=1, keepdims=True)
        t = targets[a:a + _LOGSOFTMAX_ROWS]
        lp[a:a + x.shape[0]] = x[np.arange(x.shape[0]), t] - np.log(np.exp(x).sum(axis=1))
    greedy = logits.argmax(axis=1) == targets if R else np.zeros(0, dtype=bool)
    return lp, greedy


class _Job:
    """Tokens to run through one cache: ids int64 (S,), whose rows from `first` on are scored.
    cache: the KVCache, or a function making it when the job first runs (a continuation's
    prefix copy, made only then); on_rows(k, logits (r, V)): the logits of scored rows
    k .. k+r-1 (counted from `first`); on_done(): after the last chunk."""
    __slots__ = ("cache", "ids", "first", "on_rows", "on_done", "fed")

    def __init__(self, cache, ids: np.ndarray, first: int, on_rows, on_done):
        self.cache, self.ids, self.first = cache, ids, first
        self.on_rows, self.on_done = on_rows, on_done
        self.fed = 0


class _Pair:
    """One request's result being put together: per-token logprobs and greedy flags of its
    continuation, and how many of its parts (first token; the rest) are still to come."""
    __slots__ = ("lp", "greedy", "missing")

    def __init__(self, n: int):
        self.lp = np.zeros(n, dtype=np.float64)
        self.greedy = np.zeros(n, dtype=bool)
        self.missing = 2 if n > 1 else 1


def _check(model, requests) -> list[tuple[np.ndarray, np.ndarray]]:
    if not isinstance(requests, (list, tuple)):
        raise ValueError(f"requests must be a list of (context ids, continuation ids) pairs, "
                         f"got {type(requests).__name__}")
    out = []
    V = model.vocab_size
    for i, req in enumerate(requests):
        if not isinstance(req, (list, tuple)) or len(req) != 2:
            raise ValueError(f"request {i} must be a (context ids, continuation ids) pair")
        ctx, cont = (np.asarray(x) for x in req)
        for name, a in (("context", ctx), ("continuation", cont)):
            if a.ndim != 1 or a.size == 0 or a.dtype.kind not in "iu":
                raise ValueError(f"request {i}: the {name} must be a non-empty list of token "
                                 f"ids, got dtype {a.dtype} shape {a.shape}")
            if int(a.min()) < 0 or int(a.max()) >= V:
                raise ValueError(f"request {i}: {name} token ids out of range [0, {V}): min "
                                 f"{int(a.min())}, max {int(a.max())}")
        out.append((ctx.astype(np.int64), cont.astype(np.int64)))
    return out


def score(model, requests: Sequence[tuple[Sequence[int], Sequence[int]]], *,
          batch_tokens: int = DEFAULT_BATCH_TOKENS, max_sequences: int | None = None,
          share_contexts: bool = True, progress: Callable[[int], None] | None = None
          ) -> list[Scored]:
    """Score each (context ids, continuation ids) pair (both non-empty, ids in [0, vocab))
    with `model`; results in the order of `requests` (module docstring).

    batch_tokens: rows per forward pass (>= 1); max_sequences: sequences per forward pass
    (None: as many as batch_tokens holds). share_contexts: run a context shared by
    several pairs once (False: every pair whole). progress: called with the number of pairs
    finished since its last call. The caller keeps each pair within the model's context
    (lm-eval's models truncate the context on the left). ValueError for malformed requests.
    """
    if isinstance(batch_tokens, bool) or not isinstance(batch_tokens, (int, np.integer)) \
            or batch_tokens < 1:
        raise ValueError(f"batch_tokens must be an integer >= 1, got {batch_tokens!r}")
    if max_sequences is not None and (isinstance(max_sequences, bool) or not isinstance(
            max_sequences, (int, np.integer)) or max_sequences < 1):
        raise ValueError(f"max_sequences must be None or an integer >= 1, got "
                         f"{max_sequences!r}")
    checked = _check(model, requests)
    pairs = [_Pair(cont.size) for _, cont in checked]
    results: list[Scored | None] = [None] * len(checked)

    def finished(i: int) -> None:
        p = pairs[i]
        p.missing -= 1
        if p.missing == 0:
            results[i] = Scored(float(p.lp.sum()), bool(p.greedy.all()), p.lp)
            if progress is not None:
                progress(1)

    queue: deque[_Job] = deque()
    if share_contexts:
        groups: dict[bytes, list[int]] = {}
        for i, (ctx, _) in enumerate(checked):
            groups.setdefault(ctx.tobytes(), []).append(i)
        for members in groups.values():
            queue.append(_context_job(model, checked, pairs, members, queue, finished))
    else:
        for i, (ctx, cont) in enumerate(checked):
            queue.append(_whole_job(model, ctx, cont, pairs[i], i, finished))
    _run(model, queue, int(batch_tokens), int(max_sequences or batch_tokens))
    return results                                              # type: ignore[return-value]


def _store(pair: _Pair, offset: int, targets: np.ndarray):
    """on_rows of a job whose scored row k predicts targets[k], stored at pair[offset + k]."""
    def on_rows(k: int, logits: np.ndarray) -> None:
        lp, greedy = row_logprobs(logits, targets[k:k + logits.shape[0]])
        pair.lp[offset + k:offset + k + lp.size] = lp
        pair.greedy[offset + k:offset + k + lp.size] = greedy
    return on_rows


def _whole_job(model, ctx, cont, pair: _Pair, i: int, finished) -> _Job:
    """context + continuation[:-1] in one sequence, every continuation token scored."""
    pair.missing = 1
    ids = np.concatenate([ctx, cont[:-1]])
    return _Job(lambda: model.new_cache(ctx=ids.size), ids, ctx.size - 1,
                _store(pair, 0, cont), lambda: finished(i))


def _context_job(model, checked, pairs, members: list[int], queue: deque, finished) -> _Job:
    """The job of a context shared by `members`: its last row scores each member's first
    continuation token; each member with more tokens then gets a job on a prefix copy of
    the context's cache (queued first, so that the copies do not pile up)."""
    ctx = checked[members[0]][0]
    c = ctx.size
    longest = max(checked[i][1].size for i in members)
    made: list[KVCache] = []            # the context's cache, made when its job first runs

    def make_cache() -> KVCache:
        made.append(model.new_cache(ctx=c + longest - 1))
        return made[0]

    firsts = np.array([checked[i][1][0] for i in members])

    def on_rows(k: int, logits: np.ndarray) -> None:        # the one scored row
        x = logits[0].astype(np.float64)
        x -= x.max()
        lp = x - np.log(np.exp(x).sum())
        best = int(np.argmax(logits[0]))
        for j, i in enumerate(members):
            pairs[i].lp[0] = lp[firsts[j]]
            pairs[i].greedy[0] = firsts[j] == best

    def on_done() -> None:
        rest = []
        for i in members:
            finished(i)
            cont = checked[i][1]
            if cont.size > 1:
                make = (lambda n: lambda: made[0].prefix_copy(c, ctx=c + n - 1))(cont.size)
                rest.append(_Job(make, cont[:-1], 0, _store(pairs[i], 1, cont[1:]),
                                 (lambda i: lambda: finished(i))(i)))
        queue.extendleft(reversed(rest))

    return _Job(make_cache, ctx, c - 1, on_rows, on_done)


def _run(model, queue: deque, batch_tokens: int, max_sequences: int) -> None:
    """Run the jobs, batch_tokens rows and max_sequences sequences per ragged step: the jobs
    already started first, then the queue's in order, each taking what is left of the step
    (a long one goes on in the next)."""
    active: list[_Job] = []
    while active or queue:
        budget, step = batch_tokens, []
        while budget and len(step) < max_sequences and (len(step) < len(active) or queue):
            job = active[len(step)] if len(step) < len(active) else queue.popleft()
            if not isinstance(job.cache, KVCache):
                job.cache = job.cache()
            n = min(job.ids.size - job.fed, budget)
            rows = np.arange(max(job.first - job.fed, 0), n, dtype=np.int64)
            step.append((job, n, rows))
            budget -= n
        segments = [(job.cache, job.ids[job.fed:job.fed + n]) for job, n, _ in step]
        logits = model.forward_ragged(segments, logits_rows=[r for _, _, r in step])
        at, active = 0, active[len(step):]            # started jobs this step had no room for
        for job, n, rows in step:
            if rows.size:
                job.on_rows(job.fed + int(rows[0]) - job.first, logits[at:at + rows.size])
                at += rows.size
            job.fed += n
            if job.fed < job.ids.size:
                active.insert(0, job)
            else:
                job.cache = None                     # its memory goes with the job
                job.on_done()
