"""The log-probabilities of a request's own prompt tokens, taken from its prefill (vLLM's
prompt_logprobs; what `echo` with `logprobs` answers on /v1/completions).

A prompt is prefilled in chunks (colibri.generation.batching); a chunk of prompt[a:a+S] through the
ragged step gives, at row j, the logits that predict prompt[a+j+1]. For a request whose
SamplingParams ask for prompt_logprobs, the scheduler asks the ragged step for every row
of its chunks (Model.forward_ragged's logits_rows), not only the last one; each row's
float64 log-softmax (sampling.log_softmax, the raw logits: no penalty applies to a prompt)
gives the logprob of the next prompt token and, with prompt_logprobs = k > 0, the k most
likely tokens. The first prompt token has no row before it (its entry is None, as vLLM's
and OpenAI's echo give null). The last row of the prompt predicts the first generated
token and stays the sampler's.

    rows = logits_rows(segments)            # None when no segment needs more than its last row
    logits = forward_ragged(..., logits_rows=rows)
    last = take_prompt_logprobs(segments, rows, logits)   # (N, V), recorded on each handle

Each handle's prompt_logprobs is then [None, (logprob, top or None), ...], one entry per
prompt token, complete once the request's first event comes.

Scored blocks (colibri.generation.prefix_sharing): a prompt block of B tokens at a kept in the
prefix cache may carry its rows' scores, so that a later request with the same prefix takes them
instead of computing them. Rows a..a+B-2 predict tokens inside the block: their entries are
kept as they are (BlockScores, at most k tops each). Row a+B-1 predicts the token after the
block, which another prompt may choose differently: its float32 logits are kept and scored
for the asking prompt's next token (entries_of_blocks). While such a request prefills, the
logits of those last rows are kept on it (KeptRows) until its blocks are stored.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from ..errors import ColibriError
from .sampling import top_ids

__all__ = ["logits_rows", "take_prompt_logprobs", "KeptRows", "BlockScores", "scores_of_block",
           "entries_of_blocks"]

_ROWS = 64                 # rows per float64 log-softmax block (V * 8 bytes each)


def _score_rows(x: np.ndarray, targets: np.ndarray, k: int
                ) -> tuple[list[float], list | None]:
    """Of each row of float32 logits x (R, V): log p(targets[r]) and, for k > 0, the k most
    likely (id, log p), best first, ties lower id first; each the same bits as
    sampling.log_softmax and sampling.top_logprobs on that row alone (the same error for a
    row whose largest logit is not finite). Only the per-row log-sum-exp is taken in float64
    over the whole row; the few values answered are then z - lse, as the full row would
    hold them, and the ranking is the float32 logits' (the float64 conversion keeps order)."""
    R = x.shape[0]
    m = x.max(axis=1)                                                        # (R,) float32
    if not np.isfinite(m).all():
        bad = float(m[~np.isfinite(m)][0])
        raise ColibriError(f"cannot take a log-softmax: the largest logit is {bad}")
    m64 = m.astype(np.float64)[:, None]
    z = np.subtract(x, m64, dtype=np.float64)                               # (R, V)
    np.exp(z, out=z)
    lse = np.log(z.sum(axis=1))                                              # (R,)

    def lp(cols: np.ndarray) -> np.ndarray:       # z - lse at int cols (R, c): float64 (R, c)
        picked = np.take_along_axis(x, cols, axis=1).astype(np.float64)
        return (picked - m64) - lse[:, None]

    chosen = lp(np.asarray(targets, dtype=np.int64)[:, None])[:, 0].tolist()
    if not k:
        return chosen, None
    ids = (x.argmax(axis=1)[:, None] if k == 1                 # top_ids' k = 1, at once
           else np.array([top_ids(row, k) for row in x], dtype=np.int64).reshape(R, -1))
    vals = lp(ids).tolist()
    return chosen, [list(zip(i, v)) for i, v in zip(ids.tolist(), vals)]


@dataclass
class KeptRows:
    """The float32 logits (V,) of the rows at prompt positions p with (p + 1) % every == 0
    (each whole block's last row), by p; a request's `kept_rows` while it prefills."""
    every: int
    rows: dict = field(default_factory=dict)


@dataclass(eq=False)
class BlockScores:
    """A cached prompt block's scores (module docstring): k, the tops each entry keeps;
    chosen float64 (B-1,), the logprob of each of the block's tokens after its first;
    top_ids int64 (B-1, k') and top_lps float64 (B-1, k') with k' = min(k, V), their tops
    (k = 0: none); last float32 (V,), the logits of the block's last row."""
    k: int
    chosen: np.ndarray
    top_ids: np.ndarray
    top_lps: np.ndarray
    last: np.ndarray

    @property
    def nbytes(self) -> int:
        return (self.chosen.nbytes + self.top_ids.nbytes + self.top_lps.nbytes
                + self.last.nbytes)


def scores_of_block(entries: list, last: np.ndarray, k: int) -> BlockScores:
    """BlockScores from a handle's entries for a block's tokens after its first (B-1 of
    (logprob, top or None)) and the logits of its last row; k: the request's
    prompt_logprobs."""
    chosen = np.array([e[0] for e in entries], dtype=np.float64)
    if k:
        top_ids = np.array([[t for t, _ in e[1]] for e in entries], dtype=np.int64)
        top_lps = np.array([[v for _, v in e[1]] for e in entries], dtype=np.float64)
    else:
        top_ids = np.empty((len(entries), 0), np.int64)
        top_lps = np.empty((len(entries), 0), np.float64)
    return BlockScores(int(k), chosen, top_ids.reshape(len(entries), -1),
                       top_lps.reshape(len(entries), -1), np.array(last, dtype=np.float32))


def entries_of_blocks(blocks: list[BlockScores], next_tokens: list[int], k: int) -> list:
    """The entries the rows of consecutive cached blocks give a prompt asking
    prompt_logprobs = k <= each block's k, next_tokens[j] the prompt's token after block j:
    per block its B entries, the kept ones (their first k tops: top_ids ranks best first,
    ties lower id first, so a shorter list is a prefix of a longer one) and its last row
    scored now, all the blocks' last rows in one _score_rows call; the same bits as scoring
    the rows where they were computed."""
    if not blocks:
        return []
    last_chosen, last_tops = _score_rows(np.stack([s.last for s in blocks]),
                                         np.asarray(next_tokens, dtype=np.int64), k)
    out = []
    for j, s in enumerate(blocks):
        chosen = s.chosen.tolist()
        if k:
            out.extend(zip(chosen, [list(zip(i, v)) for i, v in zip(
                s.top_ids[:, :k].tolist(), s.top_lps[:, :k].tolist())]))
        else:
            out.extend((c, None) for c in chosen)
        out.append((last_chosen[j], None if last_tops is None else last_tops[j]))
    return out


def _wants(r, ids) -> bool:
    return r.params.prompt_logprobs is not None and r.prefilled < len(r.prompt)


def logits_rows(segments) -> list[np.ndarray] | None:
    """Per segment (request, chunk ids): every row of a prompt chunk of a request asking
    for prompt_logprobs, the last row of any other; None when no segment asks."""
    if not any(_wants(r, ids) for r, ids in segments):
        return None
    return [np.arange(len(ids)) if _wants(r, ids) else np.array([len(ids) - 1])
            for r, ids in segments]


def take_prompt_logprobs(segments, rows: list[np.ndarray], logits: np.ndarray) -> np.ndarray:
    """Record the prompt logprobs of each asking segment's rows on its handle; return the
    last row of every segment, float32 (N, V), what the scheduler samples from."""
    last = np.empty((len(segments), logits.shape[1]), dtype=logits.dtype)
    at = 0
    for j, ((r, ids), seg_rows) in enumerate(zip(segments, rows)):
        block = logits[at:at + seg_rows.size]
        at += seg_rows.size
        last[j] = block[-1]
        if seg_rows.size == 1 and not _wants(r, ids):
            continue
        h, k, a = r.handle, r.params.prompt_logprobs, r.prefilled
        if h.prompt_logprobs is None:
            h.prompt_logprobs = [None]
        n = min(len(ids), len(r.prompt) - a - 1)   # not the row predicting the generated token
        kept = r.kept_rows
        if kept is not None:                       # each whole block's last row, for the cache
            for j in range((-(a + 1)) % kept.every, n, kept.every):
                kept.rows[a + j] = block[j].copy()
        targets = np.asarray(r.prompt[a + 1:a + 1 + n], dtype=np.int64)
        for b in range(0, n, _ROWS):
            rows_x = block[b:min(b + _ROWS, n)]
            chosen, tops = _score_rows(rows_x, targets[b:b + rows_x.shape[0]], k)
            h.prompt_logprobs.extend(zip(chosen, tops or [None] * len(chosen)))
    return last
