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

__all__ = ["logits_rows", "take_prompt_logprobs"]

_ROWS = 64                 # rows per float64 log-softmax block (V * 8 bytes each)


def _log_softmax_rows(x: np.ndarray) -> np.ndarray:
    """float64 log-softmax of each row of float32 (R, V), as sampling.log_softmax per row
    (the same error for a row whose largest logit is not finite)."""
    x = x.astype(np.float64)
    m = x.max(axis=1, keepdims=True)
    if not np.isfinite(m).all():
        bad = float(m[~np.isfinite(m)][0])
        raise ColibriError(f"cannot take a log-softmax: the largest logit is {bad}")
    x -= m
    return x - np.log(np.exp(x).sum(axis=1, keepdims=True))


def _top_rows(lp: np.ndarray, k: int) -> list[list[tuple[int, float]]]:
    """sampling.top_logprobs of each row of float64 (R, V): the k most likely, best first,
    ties lower id first (k = 1: the first argmax, which is that)."""
    k = min(int(k), lp.shape[1])
    if k == 1:
        best = lp.argmax(axis=1)
        return [[(int(i), float(v))] for i, v in zip(best, lp[np.arange(lp.shape[0]), best])]
    part = np.argpartition(-lp, k - 1, axis=1)[:, :k]
    out = []
    for row, cand in zip(lp, part):
        order = cand[np.lexsort((cand, -row[cand]))]
        out.append([(int(i), float(row[i])) for i in order])
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
        targets = np.asarray(r.prompt[a + 1:a + 1 + n], dtype=np.int64)
        for b in range(0, n, _ROWS):
            lp = _log_softmax_rows(block[b:b + _ROWS][:n - b])
            chosen = lp[np.arange(lp.shape[0]), targets[b:b + lp.shape[0]]]
            tops = _top_rows(lp, k) if k else [None] * lp.shape[0]
            h.prompt_logprobs.extend(zip(chosen.tolist(), tops))
    return last
