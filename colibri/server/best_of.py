"""`best_of` on /v1/completions: generate best_of completions per prompt, answer the n best.

OpenAI's rule: "the one with the highest log probability per token": each candidate is
ranked by the mean log-probability of its generated tokens (under the penalised logits it
was sampled from; a candidate that generated nothing ranks last), ties keeping the
candidates' order. best_of below n is taken as n (candidates = max(n, best_of)). The
candidates all run; the answer (or, with stream, the chunks sent once they all finished)
holds the chosen n per prompt, indexed prompt * n + j as without best_of.
"""
from __future__ import annotations

import math

from .responses import ChoiceState

__all__ = ["choose_best"]


def _mean_logprob(c: ChoiceState) -> float:
    lps = [e.logprob for e in c.events if e.logprob is not None]
    return sum(lps) / len(lps) if lps else -math.inf


def choose_best(states: list[ChoiceState], n: int, candidates: int) -> list[ChoiceState]:
    """The n best of each prompt's `candidates` states (states in prompt-major order), their
    index set to prompt * n + rank."""
    out = []
    for p in range(len(states) // candidates):
        group = states[p * candidates:(p + 1) * candidates]
        ranked = sorted(range(candidates), key=lambda j: -_mean_logprob(group[j]))[:n]
        for rank, j in enumerate(ranked):
            group[j].index = p * n + rank
            out.append(group[j])
    return out
