"""Speculative decoding: k draft tokens verified in one forward pass of the target model.

    verify(model, cache, [t, d1..dk])  one ragged pass (the grouped MoE: an expert is read
                                       once for every draft that chose it): logits of all
                                       k+1 rows (k+1, V); the cache holds the k+1 tokens
    cache.truncate(n)                  the rollback to the accepted length (KVCache's planes
                                       are linear in slots and attention reads [0, length) only,
                                       so the MLA latent cache, sliding windows and sinks need
                                       nothing else)
    judge(...)                         the acceptance rule for one draft token
    SpeculativeStats, DraftCounts      what a speculative run counts

The decode loop with drafts is the Scheduler's (colibri.generation.speculative_batch:
SpeculativeScheduler, the client of this rule that generate(..., draft=...) and `serve
--draft` step); the drafts come from colibri.generation.drafters.

The rule (Leviathan et al. 2023, Chen et al. 2023): draft d drawn from q is accepted with
probability min(1, p(d) / q(d)); on rejection the token is drawn from norm(max(0, p - q)); when
every draft is accepted one more token comes from the last row's p. p and q are the
distributions the plain sampler draws from (Sampler.distribution: the penalties over the
history so far, a grammar's mask, temperature, top-k, top-p, min-p), so the output follows
the target's distribution exactly. For prompt lookup q is a point mass on d: accept with p(d),
else draw from p without d. At temperature 0 p is a point mass on the greedy token: a draft
is accepted when it is that token, and the output is the tokens of plain greedy decoding.

Rows of a multi-token pass run the projections as a block and the attention in NumPy: their
logits are within ~1e-6 (f32 activations) to ~1e-4 (int16) relative of the one-token decode
step's (colibri.generation.batching's notes), so a greedy choice between two logits closer than that
could differ from plain decoding's; the tests and scripts/bench_speculative.py compare the
outputs token for token.
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, fields

import numpy as np

from ..engine.kv_cache import KVCache
from .sampling import sample_from_probs
from .steps import GenerationStats

__all__ = ["verify", "judge", "distinct_experts", "SpeculativeStats", "DraftCounts",
           "MAX_DRAFT_TOKENS"]

MAX_DRAFT_TOKENS = 32


@dataclass
class DraftCounts:
    """What speculation did over the requests of a SpeculativeScheduler (for generate's one
    request: SpeculativeStats's fields of the same names)."""
    draft_tokens: int = 0
    accepted_tokens: int = 0
    verify_passes: int = 0
    experts_read: int = 0
    draft_seconds: float = 0.0

    def copy_into(self, stats: "SpeculativeStats") -> None:
        for f in fields(self):
            setattr(stats, f.name, getattr(self, f.name))


@dataclass
class SpeculativeStats(GenerationStats):
    """GenerationStats of a speculative run: draft_tokens proposed, accepted_tokens of them,
    verify_passes (passes that carried drafts; decode_steps counts every pass), experts_read
    (sum over the target's passes and MoE layers of the distinct experts a pass read),
    draft_seconds (of the drafter, included in decode_seconds)."""
    draft_tokens: int = 0
    accepted_tokens: int = 0
    verify_passes: int = 0
    experts_read: int = 0
    draft_seconds: float = 0.0

    @property
    def acceptance_rate(self) -> float:
        return self.accepted_tokens / self.draft_tokens if self.draft_tokens else 0.0

    @property
    def generation_tps(self) -> float:
        """Tokens after the first (which prefill gives) per decode second."""
        n = max(self.generated_tokens - 1, 0)
        return n / self.decode_seconds if self.decode_seconds else 0.0

    @property
    def experts_per_token(self) -> float:
        """Experts read per generated token after the first (plain decoding: MoE layers x K)."""
        n = max(self.generated_tokens - 1, 0)
        return self.experts_read / n if n else 0.0

    def summary(self) -> str:
        return (super().summary() + f"; speculative: {self.accepted_tokens}/{self.draft_tokens} "
                f"drafts accepted ({100 * self.acceptance_rate:.1f} %), {self.verify_passes} "
                f"verify passes, {self.experts_per_token:.1f} experts read per token")


def verify(model, cache: KVCache, tokens: Sequence[int], return_routing: bool = False):
    """Feed tokens int (n,) (the last sampled token, then the drafts) to `cache` in one pass;
    logits float32 (n, V): row i predicts the token after tokens[i] [, routing int32
    (M, n, K)]. The cache holds the n tokens afterwards: truncate it to the accepted length.
    One pass over the n rows (Model.forward_rows: the compiled decode step extended to n rows
    where it covers the model)."""
    ids = np.asarray(tokens, dtype=np.int64)
    if not return_routing:
        return model.forward_rows(cache, ids)
    logits, routing = model.forward_rows(cache, ids, return_routing=True)
    return logits, routing[0]


def judge(p: np.ndarray, draft: int, q: np.ndarray | None, rng: np.random.Generator
          ) -> tuple[bool, int | None]:
    """The rejection rule for one draft: p float64 (V,) the target's distribution, q (V,) the
    draft's (None: a point mass on `draft`). (True, None) when accepted, else (False, the
    token drawn from norm(max(0, p - q)))."""
    qd = 1.0 if q is None else float(q[draft])
    pd = float(p[draft])
    if qd > 0 and (pd >= qd or rng.random() * qd < pd):
        return True, None
    residual = p.copy()
    if q is None:
        residual[draft] = 0.0
    else:
        np.maximum(residual - q, 0.0, out=residual)
    if not residual.sum() > 0:               # p <= q everywhere but rejected: rounding only
        residual = p
    return False, sample_from_probs(residual, rng)


def distinct_experts(routing: np.ndarray) -> int:
    """Distinct experts summed over the MoE layers of routing int (M, n, K): what a pass of
    n rows read."""
    return sum(int(np.unique(layer).size) for layer in routing)
