"""The log-probabilities of a request's own prompt tokens, taken from its prefill (vLLM's
prompt_logprobs; what `echo` with `logprobs` answers on /v1/completions).

A prompt is prefilled in chunks (colibri.batching); a chunk of prompt[a:a+S] through the
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
"""
from __future__ import annotations

import numpy as np

from .errors import ColibriError
from .sampling import top_ids

__all__ = ["logits_rows", "take_prompt_logprobs"]

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
        targets = np.asarray(r.prompt[a + 1:a + 1 + n], dtype=np.int64)
        for b in range(0, n, _ROWS):
            rows_x = block[b:min(b + _ROWS, n)]
            chosen, tops = _score_rows(rows_x, targets[b:b + rows_x.shape[0]], k)
            h.prompt_logprobs.extend(zip(chosen, tops or [None] * len(chosen)))
    return last
