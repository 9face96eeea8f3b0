"""Speculative decoding inside continuous batching, per sequence.

    sched = SpeculativeScheduler(model, Speculation(model, "prompt-lookup", 4), parallel=4)

SpeculativeScheduler is a colibri.generation.batching.Scheduler whose steps also carry drafts.
Each decoding request of the step carries its pending token plus up to k drafts (its own
drafter and Backoff) as one segment of the ragged pass; every row of such a segment comes
back (forward_ragged's logits_rows), and settle() applies colibri.generation.speculative's rule row
by row, emitting each accepted token through the scheduler's own path (stops, stop strings,
max_tokens, grammar), then rolls the request's cache back to what was accepted. Requests
asking for logprobs, prompt_logprobs or routing decode plainly (their events describe one
pass per token). A draft model's KV caches (one per request) are outside the scheduler's
KV budget.
"""
from __future__ import annotations

import time

import numpy as np

from .batching import Scheduler
from .drafters import Backoff, DraftModel, PromptLookup, make_drafter
from .prompt_logprobs import logits_rows, take_prompt_logprobs
from .sampling import greedy
from .speculative import MAX_DRAFT_TOKENS, judge

__all__ = ["Speculation", "SequenceSpeculation", "SpeculativeScheduler"]


class SequenceSpeculation:
    """One request's drafter, backoff and the drafts of the pass in flight."""

    def __init__(self, drafter, backoff: Backoff):
        self.drafter, self.backoff = drafter, backoff
        self.drafts: list[int] = []
        self.q = None
        self.draft_tokens = self.accepted_tokens = 0


class Speculation:
    """What a Scheduler speculates with: draft ("prompt-lookup", a .colibri path or a Model
    with the target's tokenizer) and num_draft_tokens (1..32)."""

    def __init__(self, model, draft, num_draft_tokens: int = 4):
        if (isinstance(num_draft_tokens, bool) or not isinstance(num_draft_tokens, (int, np.integer))
                or not 1 <= num_draft_tokens <= MAX_DRAFT_TOKENS):
            raise ValueError(f"num_draft_tokens must be an integer in [1, {MAX_DRAFT_TOKENS}], "
                             f"got {num_draft_tokens!r}")
        self.k = int(num_draft_tokens)
        first = make_drafter(model, draft)             # checks the file / tokenizer once
        self._draft_model = first.model if isinstance(first, DraftModel) else None
        self._lookup = first if isinstance(first, PromptLookup) else None
        self.model = model
        self.draft_tokens = self.accepted_tokens = 0

    def describe(self) -> str:
        return ("prompt-lookup" if self._lookup is not None
                else str(self._draft_model.file.path))

    # -- admission ---------------------------------------------------------------------------
    def attach(self, r) -> None:
        """Give an admitted request its speculation state (None when it decodes plainly)."""
        p = r.params
        if (p.logprobs is not None or p.prompt_logprobs is not None or p.return_routing
                or r.embeds is not None):
            r.spec = None
            return
        drafter = self._lookup if self._lookup is not None else DraftModel(self._draft_model,
                                                                           self.model)
        drafter.start(r.prompt, r.cache.ctx)
        timed = r.sampler.is_greedy or r.sampler.seed is None
        r.spec = SequenceSpeculation(drafter, Backoff(self.k, timed=timed))

    # -- planning ----------------------------------------------------------------------------
    def propose(self, r) -> list[int]:
        """The drafts r's segment carries this step (also kept on r.spec)."""
        s = r.spec
        if s is None:
            return []
        s.drafts, s.q = [], None
        if r.constraint is not None and r.constraint.done:
            return []
        room = min(r.params.max_tokens - len(r.generated) - 1, r.cache.remaining - 1)
        k = min(s.backoff.next_length(), room)
        if k > 0:
            s.drafts, s.q = s.drafter.propose(r.history, k, r.sampler, len(r.prompt))
        return list(s.drafts)

    @staticmethod
    def active(segments) -> bool:
        return any(getattr(r, "spec", None) is not None and r.spec.drafts for r, _ in segments)

    def forward(self, model, segments, want_routing: bool):
        """Scheduler._forward for a step with drafts: (last rows (N, V), routing or None,
        {segment index: its rows (S_i, V)} of the segments carrying drafts)."""
        prompt_rows = logits_rows(segments)
        rows = self.rows(segments, prompt_rows)
        out = model.forward_ragged([(r.cache, ids) for r, ids in segments],
                                   return_routing=want_routing, logits_rows=rows)
        logits, routing = out if want_routing else (out, None)
        last, spec = self.split(segments, rows, logits, prompt_rows)
        return last, routing, spec

    @staticmethod
    def rows(segments, prompt_rows):
        """logits_rows for the pass: every row of a speculating segment, the rows
        prompt_logprobs asks for (or the last) of the others."""
        out = []
        for j, (r, ids) in enumerate(segments):
            if getattr(r, "spec", None) is not None and r.spec.drafts:
                out.append(np.arange(len(ids)))
            else:
                out.append(np.array([len(ids) - 1]) if prompt_rows is None else prompt_rows[j])
        return out

    @staticmethod
    def split(segments, rows, logits, prompt_rows):
        """(last rows float32 (N, V), {segment index: its rows (n, V)} of the speculating
        ones), recording prompt logprobs of the others as the plain step does."""
        blocks, at = [], 0
        for seg_rows in rows:
            blocks.append(logits[at:at + seg_rows.size])
            at += seg_rows.size
        last = np.stack([b[-1] for b in blocks])
        spec = {j: blocks[j] for j, (r, _) in enumerate(segments)
                if getattr(r, "spec", None) is not None and r.spec.drafts}
        if prompt_rows is not None:
            keep = [j for j in range(len(segments)) if j not in spec]
            take_prompt_logprobs([segments[j] for j in keep], [rows[j] for j in keep],
                                 np.concatenate([blocks[j] for j in keep]))
        return last, spec

    # -- after the pass ----------------------------------------------------------------------
    def settle(self, sched, r, block: np.ndarray | None, seconds: float) -> bool:
        """After a step that took `seconds`: with block (n, V), r's rows, judge its drafts,
        emit through sched._take, roll r's cache back to what was accepted and return True;
        without (a plain step for r), note the seconds for its backoff and return False
        (the scheduler samples as usual)."""
        s = getattr(r, "spec", None)
        if block is None:
            if s is not None:
                s.backoff.update(0, 0, seconds)
            return False
        drafts, n0 = s.drafts, r.cache.length - len(s.drafts) - 1
        accepted, rejected = 0, False
        for i, d in enumerate(drafts):
            x = r.sampler.penalise(block[i], r.history, r.generated)
            if r.constraint is not None:
                x = r.constraint.mask(x)
            if r.sampler.is_greedy:
                tok = greedy(x)
                ok = tok == d
            else:
                ok, alt = judge(r.sampler.distribution(x), d,
                                None if s.q is None else s.q[i], r.sampler.rng)
                tok = d if ok else alt
            ended = r.constraint.accept(tok) if r.constraint is not None else False
            sched._take(r, tok, x, ended)
            if r.cache is None:                 # it ended (stop, length, grammar)
                break
            if not ok:
                rejected = True
                break
            accepted += 1
        else:
            if r.cache is not None:             # every draft accepted: the bonus token
                Scheduler._advance(sched, r, block[len(drafts)], None)
        s.draft_tokens += len(drafts)
        s.accepted_tokens += accepted
        self.draft_tokens += len(drafts)
        self.accepted_tokens += accepted
        s.backoff.update(len(drafts), accepted, seconds)
        if r.cache is not None:
            if rejected:
                r.cache.truncate(n0 + 1 + accepted)
            s.drafter.accepted(len(r.history) - 1)     # the last token is not fed yet
        s.drafts, s.q = [], None
        return True


class SpeculativeScheduler(Scheduler):
    """A Scheduler (same arguments after `speculation`) whose decoding requests carry
    drafts: speculation a Speculation; stats() adds draft_tokens and accepted_tokens."""

    def __init__(self, model, speculation: Speculation, **kwargs):
        super().__init__(model, **kwargs)
        self.speculation = speculation
        self._blocks: dict = {}                # request id -> its rows of this step
        self._seconds = 0.0                    # of this step's pass

    def _admit(self) -> None:
        super()._admit()
        for r in self._running:
            if not hasattr(r, "spec_ready"):
                r.spec_ready = True
                self.speculation.attach(r)

    def _plan(self):
        segments = super()._plan()
        return [(r, ids if r.prefilling else ids + self.speculation.propose(r))
                for r, ids in segments]

    def _forward(self, segments, want_routing: bool):
        t0 = time.perf_counter()
        if self.speculation.active(segments):
            logits, routing, blocks = self.speculation.forward(self.model, segments,
                                                               want_routing)
            self._blocks = {id(segments[j][0]): b for j, b in blocks.items()}
        else:
            logits, routing = super()._forward(segments, want_routing)
            self._blocks = {}
        self._seconds = time.perf_counter() - t0
        return logits, routing

    def _advance(self, r, logits, routing) -> None:
        if not self.speculation.settle(self, r, self._blocks.pop(id(r), None), self._seconds):
            super()._advance(r, logits, routing)

    def stats(self) -> dict:
        out = super().stats()
        out.update(draft_tokens=self.speculation.draft_tokens,
                   accepted_tokens=self.speculation.accepted_tokens)
        return out
