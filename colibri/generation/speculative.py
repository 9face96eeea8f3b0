"""Speculative decoding: k draft tokens verified in one forward pass of the target model.

    verify(model, cache, [t, d1..dk])  one ragged pass (the grouped MoE: an expert is read
                                       once for every draft that chose it): logits of all
                                       k+1 rows (k+1, V); the cache holds the k+1 tokens
    cache.truncate(n)                  the rollback to the accepted length (KVCache's planes
                                       are linear in slots and attention reads [0, length) only,
                                       so the MLA latent cache, sliding windows and sinks need
                                       nothing else)
    judge(...)                         the acceptance rule for one draft token
    iter_speculative(...)              one sequence's decode loop with drafts
    (colibri.generation.drafters)

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

import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import numpy as np

from ..engine.kv_cache import KVCache
from ..resources import ResourceError
from .constraints import Constraint, constrained_choice
from .drafters import Backoff, DEFAULT_DRAFT_TOKENS
from .sampling import Sampler, greedy, sample_from_probs
from .steps import GenerationStats, Step

__all__ = ["verify", "judge", "iter_speculative", "speculative_steps", "SpeculativeStats",
           "MAX_DRAFT_TOKENS"]

MAX_DRAFT_TOKENS = 32


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
    (M, n, K)]. The cache holds the n tokens afterwards: truncate it to the accepted length."""
    ids = np.asarray(tokens, dtype=np.int64)
    rows = [np.arange(ids.size)]
    out = model.forward_ragged([(cache, ids)], return_routing=return_routing, logits_rows=rows)
    if not return_routing:
        return out.reshape(ids.size, -1)
    logits, routing = out
    return logits.reshape(ids.size, -1), routing[0]


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


def _experts(routing: np.ndarray) -> int:
    """Distinct experts summed over the MoE layers of routing int (M, n, K)."""
    return sum(int(np.unique(layer).size) for layer in routing)


def iter_speculative(model, prompt: Sequence[int], sampler: Sampler, drafter, *,
                     max_new_tokens: int, num_draft_tokens: int = DEFAULT_DRAFT_TOKENS,
                     stop_ids: Sequence[int] = (), cache: KVCache | None = None,
                     stats: SpeculativeStats | None = None,
                     constraint: Constraint | None = None) -> Iterator[Step]:
    """One sequence decoded with speculation: one Step per generated token (text pieces
    left empty), the same tokens as plain decoding at temperature 0 and the same
    distribution when sampling. drafter: a colibri.generation.drafters drafter; num_draft_tokens:
    the
    most drafts per verification (colibri.generation.drafters.Backoff shortens and pauses them)."""
    prompt = [int(t) for t in prompt]
    n_prompt = len(prompt)
    if n_prompt == 0:
        raise ValueError("the prompt is empty: give at least one token")
    if max_new_tokens < 0:
        raise ValueError(f"max_new_tokens must be >= 0, got {max_new_tokens}")
    if (isinstance(num_draft_tokens, bool) or not isinstance(num_draft_tokens, (int, np.integer))
            or not 1 <= num_draft_tokens <= MAX_DRAFT_TOKENS):
        raise ValueError(f"num_draft_tokens must be an integer in [1, {MAX_DRAFT_TOKENS}], got "
                         f"{num_draft_tokens!r}")
    stats = stats if stats is not None else SpeculativeStats()
    stats.prompt_tokens = n_prompt
    if cache is None:
        try:
            cache = model.new_cache(ctx=n_prompt + max_new_tokens + 1)
        except ResourceError as e:
            raise ResourceError(f"a prompt of {n_prompt} tokens and max_new_tokens="
                                f"{max_new_tokens}: {e}") from None
    drafter.start(prompt, cache.ctx)
    stops = set(int(s) for s in stop_ids)
    plain_experts = len(model.moe_layers) * model.config.num_experts_per_tok
    # timing decides only where output cannot depend on it: greedy, or sampling unseeded
    backoff = Backoff(num_draft_tokens, timed=sampler.is_greedy or sampler.seed is None)
    model.timings.reset()
    t0 = time.perf_counter()
    logits = model.forward(np.asarray(prompt, dtype=np.int64), cache=cache, last_only=True)[-1]
    stats.prefill_seconds = time.perf_counter() - t0
    history = list(prompt)
    forced: tuple[int, bool] | None = None      # a token drawn by the rejection rule
    stats.finish_reason = "length"
    produced = 0
    try:
        while produced < max_new_tokens:
            if cache.remaining == 0:
                stats.finish_reason = "ctx"
                break
            if forced is None:
                x = sampler.penalise(logits, history, history[n_prompt:])
                tok, _, ended = constrained_choice(sampler, x, constraint)
            else:
                (tok, ended), forced = forced, None
            if ended or tok in stops:
                stats.finish_reason = "stop"
                break
            history.append(tok)
            produced += 1
            stats.generated_tokens += 1
            yield Step(produced - 1, tok)
            if constraint is not None and constraint.done:
                stats.finish_reason = "stop"
                break
            if produced == max_new_tokens:
                break
            # the pass that consumes tok, carrying drafts when there are any
            t1 = time.perf_counter()
            k = min(backoff.next_length(), max_new_tokens - produced - 1, cache.remaining - 1)
            drafts, q = drafter.propose(history, k, sampler, n_prompt) if k > 0 else ([], None)
            stats.draft_seconds += time.perf_counter() - t1
            n0 = cache.length
            if drafts:
                rows, routing = verify(model, cache, [tok] + drafts, return_routing=True)
                stats.experts_read += _experts(routing)
                stats.verify_passes += 1
                stats.draft_tokens += len(drafts)
            else:
                rows = model.forward(np.array([tok]), cache=cache, last_only=True)
                stats.experts_read += plain_experts
            seconds = time.perf_counter() - t1
            stats.decode_seconds += seconds
            stats.decode_steps += 1
            accepted, stop = 0, False
            for i, d in enumerate(drafts):
                x = sampler.penalise(rows[i], history, history[n_prompt:])
                if constraint is not None:
                    x = constraint.mask(x)
                if sampler.is_greedy:
                    ok, alt = greedy(x) == d, None
                else:
                    ok, alt = judge(sampler.distribution(x), d,
                                    None if q is None else q[i], sampler.rng)
                if not ok:
                    if alt is not None:
                        ended = constraint.accept(alt) if constraint is not None else False
                        forced = (alt, ended)
                    else:
                        logits = rows[i]
                    break
                ended = constraint.accept(d) if constraint is not None else False
                if ended or d in stops:
                    stop = True
                    break
                accepted += 1
                history.append(d)
                produced += 1
                stats.generated_tokens += 1
                yield Step(produced - 1, d)
                if constraint is not None and constraint.done:
                    stop = True
                    break
            else:
                logits = rows[len(drafts)]
            stats.accepted_tokens += accepted
            backoff.update(len(drafts), accepted, seconds)
            if drafts:
                cache.truncate(n0 + 1 + accepted)
                drafter.accepted(len(history))
            if stop:
                stats.finish_reason = "stop"
                break
    finally:
        stats.timings = model.timings.copy()


def speculative_steps(model, draft, num_draft_tokens: int, prompt: Sequence[int],
                      sampler: Sampler, **kwargs) -> tuple[Iterator[Step], SpeculativeStats]:
    """(the Steps, their stats) of generate(..., draft=...): `draft` as make_drafter takes
    it; kwargs those of iter_speculative (max_new_tokens, stop_ids, cache, constraint)."""
    from .drafters import make_drafter
    drafter = make_drafter(model, draft)
    stats = SpeculativeStats()
    steps = iter_speculative(model, prompt, sampler, drafter, num_draft_tokens=num_draft_tokens,
                             stats=stats, **kwargs)
    return steps, stats
