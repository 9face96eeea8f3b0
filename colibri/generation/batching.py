"""Continuous batching: many requests share each forward pass of one model.

    sched = Scheduler(model, parallel=4)            # 4 slots, KV budget = 4 * ctx tokens
    sched.start()                                   # a background thread runs the steps
    h = sched.submit(ids, SamplingParams(max_tokens=32, stop=["\\n\\n"]))
    for ev in h:                                    # TokenEvent per token, the last one
        print(ev.text, end="")                      # carries finish_reason
    sched.stop()

Each step is one forward pass over the running slots (Model.forward_ragged): one decode
token of every slot that is generating, plus at most prefill_chunk prompt tokens of the
requests being prefilled (the oldest first; several short prompts share a step), so a long
prompt never stalls the running streams for more than a chunk. A step of one segment runs
through Model.forward (one token: the decode step), so a sequence alone gets colibri.forward's
bits and RoutingTrace (colibri.generate's one prompt); a prompt of embeddings (input_embeds)
gets a Model.forward of its own (forward_ragged takes ids). A request submitted while
others run joins at the next step. Each slot has a KV cache of its own, made for exactly
prompt + max_tokens tokens when the request is admitted and dropped when it finishes:
admission is counted in those bytes against kv_budget, and a request that does not fit yet
waits in a bounded queue (QueueFullError past it).

Per request: its own Sampler (seeded: the same seed gives the same draws whatever else is in
the batch; the logits of a row inside a batch can differ from the row alone in the last bits,
kernels.linear summing a block of tokens in another order, so a draw within ~1e-7 of a
boundary of the cumulative distribution could go the other way), penalties over its own history, stop ids,
stop strings matched across token boundaries (held back until they cannot match), the
log-probabilities of the penalised logits it sampled from, and optionally the experts each
generated token was routed to (the routing of the pass that consumed the token: its event
comes one step later).
"""
from __future__ import annotations

import itertools
import logging
import math
import queue
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np

from ..engine.checks import is_int as _is_int
from ..engine.kv_cache import DEFAULT_MAX_CTX, KVCache
from ..engine.routing import RoutingTrace, decode_ids
from ..errors import ColibriError
from ..format.tokenizer import IncrementalDecoder
from .constraints import constrained_choice
from .prefix_sharing import PrefixCache, PrefixSharing
from .prompt_logprobs import logits_rows, take_prompt_logprobs
from .sampling import MAX_LOGPROBS, SamplingParams, log_softmax, top_logprobs
from .stops import StopText, default_stop_ids

__all__ = ["SamplingParams", "TokenEvent", "RequestHandle", "Scheduler",
           "ContextLengthError", "QueueFullError", "FINISH_REASONS", "MAX_LOGPROBS"]

log = logging.getLogger("colibri.generation.batching")

FINISH_REASONS = ("stop", "length", "cancelled", "error")


class ContextLengthError(ColibriError, ValueError):
    """prompt + max_tokens do not fit the context (or the whole KV budget)."""


class QueueFullError(ColibriError):
    """The waiting queue is full; retry after `retry_after` seconds."""

    def __init__(self, message: str, retry_after: float):
        super().__init__(message)
        self.retry_after = float(retry_after)


# ---------------------------------------------------------------------------------------------
# a request's settings and its events
# ---------------------------------------------------------------------------------------------

@dataclass
class TokenEvent:
    """One generated token; the last event of a request has finish_reason set.

    token: the id (-1 for a final event that carries only trailing text, or nothing);
    text: its text piece ('' while a character is incomplete, or with no tokenizer);
    logprob: log-probability of token under the penalised logits (None unless asked);
    top_logprobs: [(id, logprob), ...] best first (None unless logprobs > 0);
    routing: int32 (M, K), the experts the token was routed to per MoE layer (None unless asked);
    trace: with routing, the RoutingTrace of that pass (ids, weights, router logits) when
    the request ran alone in it (as a single sequence always does), else None;
    finish_reason: None while running, else "stop" | "length" | "cancelled" | "error";
    stop_token: on a final event (token -1) ended by a stop token, its id (else -1), with its
    logprob / top_logprobs when asked: not part of the text or the counts, but what echo
    reports after the prompt (vLLM's and OpenAI's legacy completions list it; lm-eval's
    local-completions drops the last entry as the generated one).
    """
    token: int
    text: str
    logprob: float | None = None
    top_logprobs: list[tuple[int, float]] | None = None
    routing: np.ndarray | None = None
    finish_reason: str | None = None
    stop_token: int = -1
    trace: RoutingTrace | None = None


class RequestHandle:
    """What Scheduler.submit returns: iterate it for the TokenEvents (blocking), cancel() it.

    id, prompt_tokens, completion_tokens (updated as tokens come), finish_reason (None until
    the last event), error (the exception when finish_reason is "error"), prompt_logprobs
    (with SamplingParams.prompt_logprobs: [None, (logprob, top or None), ...] per prompt
    token, complete when the first event comes; colibri.generation.prompt_logprobs), cached_tokens
    (prompt tokens copied from the prefix cache, set when the prefill is done).
    """

    def __init__(self, request_id: str, prompt_tokens: int, scheduler: "Scheduler"):
        self.id = request_id
        self.prompt_tokens = prompt_tokens
        self.completion_tokens = 0
        self.finish_reason: str | None = None
        self.error: BaseException | None = None
        self.prompt_logprobs: list | None = None
        self.cached_tokens = 0
        self._events: queue.SimpleQueue[TokenEvent] = queue.SimpleQueue()
        self._scheduler = scheduler
        self._cancel = False

    def __iter__(self):
        """TokenEvents as they come; ends after the one with finish_reason set."""
        while True:
            ev = self._events.get()
            yield ev
            if ev.finish_reason is not None:
                return

    def cancel(self) -> None:
        """Stop generating: the slot is freed at the next step (a last event says "cancelled")."""
        self._cancel = True
        self._scheduler._wake_up()

    def __repr__(self) -> str:
        return (f"RequestHandle({self.id}, prompt_tokens={self.prompt_tokens}, "
                f"completion_tokens={self.completion_tokens}, finish_reason={self.finish_reason})")


# ---------------------------------------------------------------------------------------------
# a request inside the scheduler
# ---------------------------------------------------------------------------------------------

class _Request:
    """The scheduler's record of one request: its settings, text state and, once admitted,
    its KV cache. embeds: the prompt as embeddings float32 (S, D) (prompt then [])."""

    def __init__(self, handle: RequestHandle, prompt: list[int], params: SamplingParams,
                 stop_ids: set[int], tokenizer, on_event, kv_bytes: int, vocab_size: int,
                 embeds: np.ndarray | None = None):
        self.handle, self.prompt, self.params, self.on_event = handle, prompt, params, on_event
        self.embeds = embeds
        self.n_prompt = len(prompt) if embeds is None else len(embeds)
        self.stop_ids = stop_ids
        self.sampler = params.sampler()
        self.constraint = (None if params.constraint is None
                           else params.constraint.start(tokenizer, vocab_size))
        self.decoder = (IncrementalDecoder(tokenizer, prompt)
                        if tokenizer is not None and params.detokenize else None)
        self.guard = StopText(list(params.stop))
        self.kv_bytes = kv_bytes                   # reserved while admitted
        self.cache: KVCache | None = None
        self.prefilled = 0                         # prompt tokens in the cache
        self.kept_rows = None                      # prompt_logprobs: blocks' last rows (KeptRows)
        self.history = list(prompt)                # prompt + generated (repetition penalty)
        self.generated: list[int] = []
        self.feed: int | None = None               # the token the next pass consumes
        self.deferred: TokenEvent | None = None    # return_routing: emitted after that pass
        self.t_submit = time.perf_counter()

    @property
    def prefilling(self) -> bool:
        return self.prefilled < self.n_prompt

    def text_tail(self) -> str:
        """The text still held back at the end (incomplete characters, a partial stop)."""
        if self.decoder is None:
            return ""
        tail = self.guard.feed(self.decoder.flush())
        return tail + ("" if self.guard.done else self.guard.flush())


# ---------------------------------------------------------------------------------------------
# the scheduler
# ---------------------------------------------------------------------------------------------

class Scheduler:
    """Continuous batching over `parallel` slots of one model (see the module docstring).

    ctx: the most tokens (prompt + max_tokens) a request may take (default the model's
    context capped at kv_cache.DEFAULT_MAX_CTX); kv_budget: bytes of KV cache all admitted
    requests may hold together (default parallel * ctx * bytes per token); max_queue:
    requests that may wait beyond the free slots before submit raises QueueFullError;
    prefill_chunk: prompt tokens per step (a longer prompt is prefilled over several steps,
    each also advancing every running stream by one token). prefix_cache: prompt prefixes'
    KV kept in the budget's idle part (colibri.generation.prefix_sharing.PrefixSharing.of).
    """

    def __init__(self, model, parallel: int = 4, ctx: int | None = None,
                 kv_budget: int | None = None, max_queue: int = 64, prefill_chunk: int = 64,
                 prefix_cache: PrefixCache | int | None = None):
        for name, val, lo in (("parallel", parallel, 1), ("max_queue", max_queue, 0),
                              ("prefill_chunk", prefill_chunk, 1)):
            if not _is_int(val) or val < lo:
                raise ValueError(f"{name} must be an integer >= {lo}, got {val!r}")
        if ctx is None:
            ctx = min(model.max_context, DEFAULT_MAX_CTX)
        if not _is_int(ctx) or ctx < 2:
            raise ValueError(f"ctx must be an integer >= 2, got {ctx!r}")
        self.model = model
        self.parallel, self.ctx = int(parallel), int(ctx)
        self.max_queue, self.prefill_chunk = int(max_queue), int(prefill_chunk)
        self.kv_bytes_per_token = model.prefix_cache.token_bytes   # no cache made to learn it
        if kv_budget is None:
            kv_budget = self.parallel * self.ctx * self.kv_bytes_per_token
        if not _is_int(kv_budget) or kv_budget < self.kv_bytes_per_token:
            raise ValueError(f"kv_budget must be an integer of at least one token's "
                             f"{self.kv_bytes_per_token} bytes, got {kv_budget!r}")
        self.kv_budget = int(kv_budget)
        self._prefix = PrefixSharing.of(self, prefix_cache)
        self.prefix_cache = self._prefix.cache
        self._default_stop_ids: set[int] | None = None     # the EOS ids, on first need
        self._lock = threading.Lock()
        self._wake = threading.Condition(self._lock)
        self._step_lock = threading.Lock()           # one step at a time
        self._queue: deque[_Request] = deque()
        self._running: list[_Request] = []           # admitted, at most `parallel`
        self._ids = itertools.count(1)
        self._thread: threading.Thread | None = None
        self._stopping = self._drain = self._closed = False
        self._kv_in_use = 0
        self._tokens_in = self._tokens_out = self._finished = self._steps = 0
        self._mean_seconds = 0.0                     # running mean of a request's duration

    # -- submitting ------------------------------------------------------------------------------
    def submit(self, prompt_ids: Sequence[int], params: SamplingParams | None = None,
               on_event: Callable[[TokenEvent], None] | None = None, *,
               input_embeds: np.ndarray | None = None) -> RequestHandle:
        """Queue a request; its events come through the handle (and on_event, called from
        the scheduler thread). input_embeds float (S, D): the prompt as embeddings instead
        of ids (prompt_ids then []; not from the prefix cache, no prompt_logprobs). Raises
        ValueError (bad params, ids or embeddings), ContextLengthError, QueueFullError at
        once."""
        params = SamplingParams() if params is None else params
        if not isinstance(params, SamplingParams):
            raise ValueError(f"params must be a SamplingParams, got {type(params).__name__}")
        params.check()
        if input_embeds is None:
            prompt, embeds = self._check_prompt(prompt_ids), None
        else:
            prompt, embeds = [], self._check_embeds(prompt_ids, input_embeds, params)
        n_prompt = len(prompt) if embeds is None else len(embeds)
        V = self.model.vocab_size
        if params.stop_ids is not None and any(i >= V for i in params.stop_ids):
            raise ValueError(f"stop_ids must be token ids in [0, {V}), got max "
                             f"{max(params.stop_ids)}")
        wants_text = params.detokenize or params.stop or params.constraint is not None
        tokenizer = self.model.tokenizer if wants_text else None
        if params.stop and tokenizer is None:
            raise ValueError("stop strings need a tokenizer; this model file carries none "
                             "(use stop_ids)")
        need = n_prompt + params.max_tokens
        if need > self.ctx:
            raise ContextLengthError(
                f"the prompt has {n_prompt} tokens and max_tokens is {params.max_tokens}: "
                f"{need} tokens exceed the context of {self.ctx} tokens")
        kv_bytes = need * self.kv_bytes_per_token
        if kv_bytes > self.kv_budget:
            raise ContextLengthError(
                f"the prompt has {n_prompt} tokens and max_tokens is {params.max_tokens}: "
                f"{need} tokens need {kv_bytes} bytes of KV cache, more than the whole budget "
                f"of {self.kv_budget} bytes ({self.kv_budget // self.kv_bytes_per_token} tokens)")
        if params.stop_ids is None and self._default_stop_ids is None:
            self._default_stop_ids = set(default_stop_ids(self.model))
        stop_ids = self._default_stop_ids if params.stop_ids is None else set(params.stop_ids)
        handle = RequestHandle("", n_prompt, self)
        request = _Request(handle, prompt, params, stop_ids, tokenizer, on_event,
                           kv_bytes, V, embeds)       # a bad constraint raises here
        with self._lock:
            if self._closed:
                raise ColibriError("the scheduler is stopped; make a new one")
            # the free slots take their requests at the next step: those do not wait
            if len(self._queue) >= self.max_queue + self.parallel - len(self._running):
                raise QueueFullError(f"the queue is full ({self.max_queue} requests waiting "
                                     f"for a slot)", self._retry_after())
            handle.id = f"req-{next(self._ids)}"
            self._queue.append(request)
            self._wake.notify_all()
        return handle

    def _check_prompt(self, prompt_ids) -> list[int]:
        ids = np.asarray(prompt_ids)
        if ids.ndim != 1 or ids.size == 0:
            raise ValueError(f"prompt_ids must be a non-empty list of token ids, got shape "
                             f"{ids.shape}")
        if ids.dtype.kind not in "iu":
            raise ValueError(f"prompt_ids must be integers, got dtype {ids.dtype}")
        V = self.model.vocab_size
        if int(ids.min()) < 0 or int(ids.max()) >= V:
            raise ValueError(f"prompt_ids out of range [0, {V}): min {int(ids.min())}, "
                             f"max {int(ids.max())}")
        return [int(t) for t in ids]

    def _check_embeds(self, prompt_ids, input_embeds, params: SamplingParams) -> np.ndarray:
        """input_embeds as float32 (S, D), S >= 1, D the model's hidden size."""
        if len(prompt_ids):
            raise ValueError("give either prompt_ids or input_embeds, not both")
        if params.prompt_logprobs is not None:
            raise ValueError("prompt_logprobs needs a prompt of ids, not input_embeds")
        x = np.asarray(input_embeds)
        D = self.model.hidden_size
        if x.ndim != 2 or x.shape[0] == 0 or x.shape[1] != D or x.dtype.kind != "f":
            raise ValueError(f"input_embeds must be floats of shape (S, {D}), S >= 1, got "
                             f"dtype {x.dtype} shape {x.shape}")
        return x

    def _retry_after(self) -> float:
        """Seconds until a place in the queue is likely free: the mean request duration times
        the queue's turns through the slots (1 s before any request finished)."""
        turns = math.ceil((len(self._queue) + 1) / self.parallel)
        return round(max(1.0, self._mean_seconds * turns) if self._mean_seconds else 1.0, 1)

    # -- the background thread -------------------------------------------------------------------
    def start(self) -> None:
        """Run steps in a background thread until stop()."""
        with self._lock:
            if self._closed:
                raise ColibriError("the scheduler is stopped; make a new one")
            if self._thread is not None:
                return
            self._thread = threading.Thread(target=self._loop, name="colibri-scheduler",
                                            daemon=True)
            self._thread.start()

    def stop(self, drain: bool = True) -> None:
        """Stop the thread: drain=True finishes every queued and running request first,
        drain=False cancels them. New submits raise afterwards."""
        with self._lock:
            self._closed = self._stopping = True
            self._drain = drain
            thread = self._thread
            self._wake.notify_all()
        if thread is not None:
            thread.join()
        elif drain:
            while self.step():
                pass
        self._cancel_all()

    def _wake_up(self) -> None:
        with self._lock:
            self._wake.notify_all()

    def _has_work(self) -> bool:
        return bool(self._queue or self._running)

    def _loop(self) -> None:
        while True:
            with self._lock:
                while not self._stopping and not self._has_work():
                    self._wake.wait()
                if self._stopping and (not self._drain or not self._has_work()):
                    return
            try:
                self.step()
            except Exception:                      # never let the thread die silently
                log.exception("scheduler step failed")

    # -- one step --------------------------------------------------------------------------------
    def step(self) -> bool:
        """One forward pass over the running slots (admitting and cancelling first); False
        when there was nothing to run."""
        with self._step_lock:
            self._drop_cancelled()
            self._admit()
            segments = self._plan()
            if not segments:
                return False
            want_routing = False
            for r, _ in segments:                  # a loop: no generator made per step
                if r.params.return_routing and not r.prefilling:
                    want_routing = True
            try:
                logits, routing = self._forward(segments, want_routing)
            except Exception as exc:
                log.exception("forward pass failed; its %d requests end with 'error'",
                              len(segments))
                for r, _ in segments:
                    r.handle.error = exc
                    self._end(r, TokenEvent(-1, "", finish_reason="error"))
                return True
            self._steps += 1
            for j, (r, ids) in enumerate(segments):
                if r.prefilling:
                    r.prefilled += len(ids)
                    self._tokens_in += len(ids)
                    self._prefix.after_chunk(r)
                    if r.prefilling:
                        continue
                    r.handle.cached_tokens = self._prefix.cached_tokens(r)
                try:
                    self._advance(r, logits[j], None if routing is None else routing[j])
                except Exception as exc:           # e.g. NaN logits: this request only
                    log.exception("sampling %s failed; it ends with 'error'", r.handle.id)
                    r.handle.error = exc
                    self._end(r, TokenEvent(-1, "", finish_reason="error"))
            return True

    def _forward(self, segments, want_routing: bool):
        """logits float32 (N, V) of the last row of each segment [, routing per segment:
        int32 (M, S_i, K), or the RoutingTrace of a segment that ran alone]."""
        if len(segments) == 1:
            r, ids = segments[0]
            if not (r.prefilling and r.params.prompt_logprobs is not None):  # no prompt rows
                return self._forward_alone(r, ids, want_routing)
        own = [j for j, (r, _) in enumerate(segments) if r.embeds is not None and r.prefilling]
        if own:
            return self._forward_embeds(segments, own, want_routing)
        rows = logits_rows(segments)        # every prompt row of those asking prompt_logprobs
        extra = {} if rows is None else {"logits_rows": rows}
        out = self.model.forward_ragged([(r.cache, ids) for r, ids in segments],
                                        return_routing=want_routing, **extra)
        logits, routing = out if want_routing else (out, None)
        if rows is not None:
            logits = take_prompt_logprobs(segments, rows, logits)
        return logits, routing

    def _forward_alone(self, r: _Request, ids, want_routing: bool):
        """_forward of r's segment alone: Model.forward (logits (1, V) [, [RoutingTrace]])."""
        if r.embeds is not None and r.prefilling:
            return self.model.forward(input_embeds=ids, cache=r.cache, last_only=True), None
        out = self.model.forward(np.asarray(ids, dtype=np.int64), cache=r.cache,
                                 last_only=True, return_routing=want_routing)
        return (out[0], [out[1]]) if want_routing else (out, None)

    def _forward_embeds(self, segments, own: list[int], want_routing: bool):
        """_forward when segments `own` are embeddings: each by itself, the others together."""
        logits = np.empty((len(segments), self.model.vocab_size), dtype=np.float32)
        routing = [None] * len(segments)
        for j in own:
            logits[j] = self._forward_alone(*segments[j], False)[0][-1]
        rest = [j for j in range(len(segments)) if j not in own]
        if rest:
            out, rt = self._forward([segments[j] for j in rest], want_routing)
            logits[rest] = out
            for j, x in zip(rest, rt or ()):
                routing[j] = x
        return logits, routing if want_routing else None

    def _plan(self) -> list[tuple[_Request, list[int]]]:
        """The segments of this step: every decoding slot's token, then prompt chunks of
        at most prefill_chunk tokens in all, oldest prompt first (short prompts share one)."""
        segments, chunks, budget = [], [], self.prefill_chunk
        for r in self._running:
            if r.prefilled >= r.n_prompt:
                segments.append((r, [r.feed]))
            elif budget > 0 and self._prefix.ready(r, self._running):
                chunk = (r.prompt[r.prefilled:r.prefilled + budget] if r.embeds is None
                         else r.embeds[r.prefilled:])     # embeddings: whole, in one call
                chunks.append((r, chunk))
                budget -= len(chunk)
        return segments + chunks

    def _admit(self) -> None:
        """Move queued requests into free slots while their KV bytes fit (in order)."""
        with self._lock:
            while (self._queue and len(self._running) < self.parallel
                   and self._prefix.make_room(self._kv_in_use + self._queue[0].kv_bytes)):
                r = self._queue.popleft()
                r.cache = self.model.new_cache(ctx=r.n_prompt + r.params.max_tokens)
                self._kv_in_use += r.kv_bytes
                self._running.append(r)
                self._prefix.admit(r)

    def _drop_cancelled(self) -> None:
        if not self._queue and not any(r.handle._cancel for r in self._running):
            return                                 # the usual step: nothing to drop
        with self._lock:
            queued = [r for r in self._queue if r.handle._cancel]
            for r in queued:
                self._queue.remove(r)
        for r in queued + [r for r in self._running if r.handle._cancel]:
            self._end(r, TokenEvent(-1, "", finish_reason="cancelled"))

    def _cancel_all(self) -> None:
        with self._step_lock:
            with self._lock:
                waiting = list(self._queue) + list(self._running)
            for r in waiting:
                r.handle._cancel = True
            self._drop_cancelled()

    # -- tokens ----------------------------------------------------------------------------------
    def _advance(self, r: _Request, logits: np.ndarray, routing: np.ndarray | None) -> None:
        """After a pass that gave r's next logits (V,) (routing int32 (M, 1, K) of the token
        it consumed): emit the deferred event, sample the next token, emit or defer it."""
        if r.deferred is not None:                 # return_routing: its pass has run
            ev, r.deferred = r.deferred, None
            if isinstance(routing, RoutingTrace):  # the pass ran r alone
                K = self.model.config.num_experts_per_tok
                ev.trace, routing = routing, decode_ids(routing, K)
            ev.routing = routing[:, -1].copy()
            if ev.finish_reason is not None:
                self._end(r, ev)
                return
            self._emit(r, ev)
        if r.params.max_tokens == 0:               # scoring only: nothing to generate
            self._end(r, TokenEvent(-1, "", finish_reason="length"))
            return
        x = r.sampler.penalise(logits, r.history, r.generated)
        self._take(r, *constrained_choice(r.sampler, x, r.constraint))

    def _take(self, r: _Request, tok: int, x: np.ndarray, ended: bool) -> None:
        """r's next token, drawn from x (V,) (ended: it closed the grammar): stop or emit."""
        p = r.params
        lp = top = None
        if p.logprobs is not None:
            row = log_softmax(x)
            lp, top = float(row[tok]), top_logprobs(row, p.logprobs) if p.logprobs > 0 else None
        if ended or tok in r.stop_ids:
            self._end(r, TokenEvent(-1, r.text_tail(), lp, top, finish_reason="stop",
                                    stop_token=tok))
            return
        r.generated.append(tok)
        r.history.append(tok)
        r.handle.completion_tokens += 1
        self._tokens_out += 1
        text = r.guard.feed(r.decoder.push(tok)) if r.decoder is not None else ""
        finish = None
        if r.guard.done:
            finish = "stop"
        elif r.constraint is not None and r.constraint.done:     # the grammar is complete
            text += r.text_tail()
            finish = "stop"
        elif len(r.generated) >= p.max_tokens:
            text += r.text_tail()
            finish = "stop" if r.guard.done else "length"
        ev = TokenEvent(tok, text, lp, top, None, finish)
        if p.return_routing:
            r.deferred, r.feed = ev, tok           # emitted once the token's pass has run
        elif finish is not None:
            self._end(r, ev)
        else:
            self._emit(r, ev)
            r.feed = tok

    def _emit(self, r: _Request, ev: TokenEvent) -> None:
        if ev.finish_reason is not None:
            r.handle.finish_reason = ev.finish_reason
        r.handle._events.put(ev)
        if r.on_event is not None:
            try:
                r.on_event(ev)
            except Exception:                      # a broken consumer cancels its request
                log.exception("on_event of %s raised; cancelling it", r.handle.id)
                r.handle._cancel = True

    def _end(self, r: _Request, ev: TokenEvent) -> None:
        """Emit r's last event and free its slot and KV bytes."""
        with self._lock:
            if r in self._running:
                self._running.remove(r)
                self._kv_in_use -= r.kv_bytes
            self._finished += 1
            seconds = time.perf_counter() - r.t_submit
            self._mean_seconds += (seconds - self._mean_seconds) / min(self._finished, 32)
            self._wake.notify_all()
        self._prefix.end(r, keep=ev.finish_reason != "error")
        r.cache = None
        self._emit(r, ev)

    # -- introspection ---------------------------------------------------------------------------
    def stats(self) -> dict:
        """slots_total, slots_busy, queue_depth, kv_bytes_in_use, kv_bytes_budget, tokens_in
        (prompt tokens prefilled), tokens_out (made), requests_finished, steps, prefix_cache."""
        with self._lock:
            return dict(slots_total=self.parallel, slots_busy=len(self._running),
                        queue_depth=len(self._queue), kv_bytes_in_use=self._kv_in_use,
                        kv_bytes_budget=self.kv_budget, tokens_in=self._tokens_in,
                        tokens_out=self._tokens_out, requests_finished=self._finished,
                        steps=self._steps, prefix_cache=self.prefix_cache.stats())

    def __enter__(self) -> "Scheduler":
        self.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop(drain=exc[0] is None)

    def __repr__(self) -> str:
        s = self.stats()
        return (f"Scheduler(parallel={self.parallel}, ctx={self.ctx}, busy={s['slots_busy']}, "
                f"queued={s['queue_depth']}, kv {s['kv_bytes_in_use']}/{s['kv_bytes_budget']} B)")
