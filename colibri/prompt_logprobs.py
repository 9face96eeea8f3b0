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

from .sampling import log_softmax, top_logprobs

__all__ = ["logits_rows", "take_prompt_logprobs"]


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
        for i in range(len(ids)):
            target = a + i + 1
            if target >= len(r.prompt):
                break                              # the row that predicts the generated token
            lp = log_softmax(block[i])
            h.prompt_logprobs.append((float(lp[r.prompt[target]]),
                                      top_logprobs(lp, k) if k else None))
    return last
