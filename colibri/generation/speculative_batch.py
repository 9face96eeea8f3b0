"""Speculative decoding inside continuous batching, per sequence: the one decode loop with
drafts (generate(..., draft=...) steps it for one prompt, `serve --draft` for every slot).

    sched = SpeculativeScheduler(model, Speculation(model, "prompt-lookup", 4), parallel=4)

SpeculativeScheduler is a colibri.generation.batching.Scheduler whose steps also carry drafts.
Each decoding request of the step carries its pending token plus up to k drafts (its own
drafter and Backoff) as one segment of the ragged pass; every row of such a segment comes
back (forward_ragged's logits_rows), and settle() applies colibri.generation.speculative's rule row
by row, emitting each accepted token through the scheduler's own path (stops, stop strings,
max_tokens, grammar), then rolls the request's cache back to what was accepted. Requests
asking for logprobs, prompt_logprobs or routing decode plainly (their events describe one
pass per token). A draft model's KV caches (one per request) are outside the scheduler's
KV budget. Speculation.counts (DraftCounts) adds up the drafts, acceptances, verification
passes, experts read and drafting seconds of the speculating requests.
"""
from __future__ import annotations

import time

import numpy as np

from .batching import Scheduler
from .drafters import Backoff, DraftModel, PromptLookup, make_drafter
from .prompt_logprobs import logits_rows, take_prompt_logprobs
from .sampling import greedy
from .speculative import MAX_DRAFT_TOKENS, DraftCounts, distinct_experts, judge

__all__ = ["SequenceSpeculation", "Speculation", "SpeculativeScheduler"]


class SequenceSpeculation:
    """One request's drafter, backoff and the drafts of the pass in flight."""

    def __init__(self, drafter, backoff: Backoff):
        self.drafter, self.backoff = drafter, backoff
        self.drafts: list[int] = []
        self.q = None
        self.draft_seconds = 0.0            # drafting this step (its backoff times the pass with it)
        self.decoding = False               # this step decodes for it (not a prompt chunk)


class Speculation:
    """What a Scheduler speculates with: draft (what make_drafter takes: "prompt-lookup", a
    .colibri path or a Model with the target's tokenizer, or a drafter) and num_draft_tokens
    (1..32). Each request gets a DraftModel of its own (its KV cache); prompt lookup keeps no
    state and is shared; a drafter of one's own is used as given, one request at a time
    (own_state: SpeculativeScheduler then takes parallel=1)."""

    def __init__(self, model, draft, num_draft_tokens: int = 4):
        if (isinstance(num_draft_tokens, bool) or not isinstance(num_draft_tokens, (int, np.integer))
                or not 1 <= num_draft_tokens <= MAX_DRAFT_TOKENS):
            raise ValueError(f"num_draft_tokens must be an integer in [1, {MAX_DRAFT_TOKENS}], "
                             f"got {num_draft_tokens!r}")
        self.k = int(num_draft_tokens)
        self.drafter = make_drafter(model, draft)      # checks the file / tokenizer once
        self.own_state = not isinstance(self.drafter, (PromptLookup, DraftModel))
        self.model = model
        self.counts = DraftCounts()
        # a plain decode step reads K experts in each MoE layer
        self.plain_experts = len(model.moe_layers) * model.config.num_experts_per_tok

    # -- admission ---------------------------------------------------------------------------
    def attach(self, r) -> None:
        """Give an admitted request its speculation state (None when it decodes plainly)."""
        p = r.params
        if (p.logprobs is not None or p.prompt_logprobs is not None or p.return_routing
                or r.embeds is not None):
            r.spec = None
            return
        drafter = self.drafter.another() if isinstance(self.drafter, DraftModel) else self.drafter
        drafter.start(r.prompt, r.cache.ctx)
        timed = r.sampler.is_greedy or r.sampler.seed is None
        r.spec = SequenceSpeculation(drafter, Backoff(self.k, timed=timed))

    # -- planning ----------------------------------------------------------------------------
    def propose(self, r) -> list[int]:
        """The drafts r's segment carries this step (also kept on r.spec)."""
        s = r.spec
        if s is None:
            return []
        s.decoding = True
        if s.drafts:
            s.drafts, s.q = [], None
        s.draft_seconds = 0.0
        if r.constraint is not None and r.constraint.done:
            return []
        k = s.backoff.next_length()          # first: most steps of a paused backoff end here
        if k <= 0:
            return []
        t0 = time.perf_counter()
        k = min(k, r.params.max_tokens - len(r.generated) - 1, r.cache.remaining - 1)
        if k > 0:
            s.drafts, s.q = s.drafter.propose(r.history, k, r.sampler, len(r.prompt))
        s.draft_seconds = time.perf_counter() - t0
        self.counts.draft_seconds += s.draft_seconds
        return list(s.drafts)

    def forward(self, model, segments, want_routing: bool):
        """Scheduler._forward for a step with drafts: (last rows (N, V), routing or None,
        {segment index: (its rows (S_i, V), the distinct experts they read)} of the segments
        carrying drafts). The routing is always recorded: it counts the experts read."""
        prompt_rows = logits_rows(segments)
        rows = self.rows(segments, prompt_rows)
        if len(segments) == 1 and prompt_rows is None:     # one sequence: its rows compiled
            (r, ids), = segments
            logits, routing = model.forward_rows(r.cache, np.asarray(ids, dtype=np.int64),
                                                 return_routing=True)
        else:
            logits, routing = model.forward_ragged([(r.cache, ids) for r, ids in segments],
                                                   return_routing=True, logits_rows=rows)
        last, spec = self.split(segments, rows, logits, prompt_rows)
        spec = {j: (block, distinct_experts(routing[j])) for j, block in spec.items()}
        return last, routing if want_routing else None, spec

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
    def settle_plain(self, r, seconds: float) -> None:
        """After a step that decoded r plainly (its pass took `seconds`): count a decode
        step's experts and time it for r's backoff (not when it ended r's prefill)."""
        s = r.spec
        if s is not None and s.decoding:
            s.decoding = False
            s.backoff.update(0, 0, seconds + s.draft_seconds)
            self.counts.experts_read += self.plain_experts

    def settle(self, sched, r, verified: tuple[np.ndarray, int], seconds: float) -> None:
        """After a step whose pass took `seconds` and gave verified (r's rows (n, V), the
        experts they read): judge r's drafts, emit through sched._take and roll r's cache
        back to what was accepted."""
        s = r.spec
        s.decoding = False
        block, experts = verified
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
            taken = len(r.generated)
            sched._take(r, tok, x, ended)
            if not ok:
                rejected = True
                break
            if len(r.generated) == taken:       # a stop: not an accepted token
                break
            accepted += 1
            if r.cache is None:                 # it ended (grammar complete, stop string)
                break
        else:
            if r.cache is not None:             # every draft accepted: the bonus token
                Scheduler._advance(sched, r, block[len(drafts)], None)
        c = self.counts
        c.verify_passes += 1
        c.experts_read += experts
        c.draft_tokens += len(drafts)
        c.accepted_tokens += accepted
        s.backoff.update(len(drafts), accepted, seconds + s.draft_seconds)
        if r.cache is not None:                 # still running
            if rejected:
                r.cache.truncate(n0 + 1 + accepted)
            s.drafter.accepted(len(r.history) - 1)     # the last token is not fed yet
        s.drafts, s.q = [], None


class SpeculativeScheduler(Scheduler):
    """A Scheduler (same arguments after `speculation`) whose decoding requests carry
    drafts: speculation a Speculation; stats() adds draft_tokens and accepted_tokens."""

    def __init__(self, model, speculation: Speculation, **kwargs):
        super().__init__(model, **kwargs)
        if speculation.own_state and self.parallel > 1:
            raise ValueError(f"the drafter {speculation.drafter!r} keeps one sequence's state: "
                             f"speculate with it at parallel=1, or give \"prompt-lookup\" or a "
                             f"draft model (one drafter per request)")
        self.speculation = speculation
        self._blocks: dict = {}                # request id -> (its rows, experts) of this step
        self._drafting = False                 # some segment of this step carries drafts
        self._seconds = 0.0                    # of this step's pass

    # Most steps carry no drafts (a backoff pauses where drafts do not pay): those cost what
    # a plain Scheduler step does, plus one next_length per decoding request.
    def _admit(self) -> None:
        if not self._queue:                    # nothing to admit: every running r has .spec
            return
        super()._admit()
        for r in self._running:
            if not hasattr(r, "spec"):
                self.speculation.attach(r)

    def _plan(self):
        segments = super()._plan()
        propose, drafting = self.speculation.propose, False
        for j, (r, ids) in enumerate(segments):
            if not r.prefilling:
                drafts = propose(r)
                if drafts:
                    segments[j] = (r, ids + drafts)
                    drafting = True
        self._drafting = drafting
        return segments

    def _forward(self, segments, want_routing: bool):
        t0 = time.perf_counter()
        if not self._drafting:
            out = super()._forward(segments, want_routing)
        else:
            self._blocks = {}
            own = [j for j, (r, _) in enumerate(segments)
                   if r.embeds is not None and r.prefilling]
            if own:
                # a prompt of embeddings runs alone (Scheduler._forward_embeds), the drafting
                # segments together through _speculate (its blocks keyed by request)
                out = self._forward_embeds(segments, own, want_routing)
            else:
                out = self._speculate(segments, want_routing)
        self._seconds = time.perf_counter() - t0
        return out

    def _speculate(self, segments, want_routing: bool):
        """The pass of a step whose drafting segments are all in `segments` (_plan set
        _drafting; a prompt of embeddings was split off by _forward_embeds)."""
        logits, routing, blocks = self.speculation.forward(self.model, segments, want_routing)
        self._blocks.update({id(segments[j][0]): b for j, b in blocks.items()})
        return logits, routing

    def _advance(self, r, logits, routing) -> None:
        verified = self._blocks.pop(id(r), None) if self._drafting else None
        if verified is None:
            self.speculation.settle_plain(r, self._seconds)
            super()._advance(r, logits, routing)
        else:
            self.speculation.settle(self, r, verified, self._seconds)

    def stats(self) -> dict:
        out = super().stats()
        c = self.speculation.counts
        out.update(draft_tokens=c.draft_tokens, accepted_tokens=c.accepted_tokens)
        return out
