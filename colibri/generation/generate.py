"""colibri.generate / stream: a thin client of colibri.generation.batching's Scheduler, the one
generation loop (prefill, sample, stop, feed back), stepped in the caller's thread.

    generate(model, prompt_or_ids)  text in -> text out (ids in -> ids out), or a stream:
                                    one request, its text decoded here
    generate(model, [p, p, ...])    several prompts together (continuous batching), each
                                    stopping on its own, their text from the scheduler
    generate(..., draft=...)        speculative decoding: one request of a SpeculativeScheduler
                                    (colibri.generation.speculative_batch), the same loop

For one prompt text is produced incrementally here (tokenizer.IncrementalDecoder): a piece
is emitted only when it holds whole characters, and text stop sequences are held back until
they cannot match; the scheduler then only makes the ids (SamplingParams.detokenize False).
"""
from __future__ import annotations

import time
from collections.abc import Iterator
import numpy as np

from ..errors import ColibriError
from ..format.tokenizer import IncrementalDecoder, NoTokenizerError
from ..resources import ResourceError, check_allocation
from .batching import Scheduler, TokenEvent
from .constraints import compile_spec
from .sampling import SamplingParams
from .speculative import SpeculativeStats
from .speculative_batch import Speculation, SpeculativeScheduler
from .steps import GenerationStats, Step
from .stops import StopText, default_stop_ids, split_stop

__all__ = ["generate", "stream", "Step", "GenerationStats", "prompt_ids", "is_batch",
           "default_stop_ids"]


# ---------------------------------------------------------------------------------------------
# prompts and stops
# ---------------------------------------------------------------------------------------------

def prompt_ids(model, prompt_or_ids, chat: bool = False) -> tuple[list[int], bool]:
    """(token ids, is_text) for a string, a list of chat messages, or ids."""
    if isinstance(prompt_or_ids, str) or (isinstance(prompt_or_ids, list) and prompt_or_ids
                                          and isinstance(prompt_or_ids[0], dict)):
        tok = model.tokenizer
        if tok is None:
            raise NoTokenizerError(f"{model.file.path}: this model file carries no tokenizer; "
                                   f"pass token ids instead of text")
        if chat or not isinstance(prompt_or_ids, str):
            return tok.apply_chat_template(prompt_or_ids), True
        return tok.encode(prompt_or_ids), True
    if chat:
        raise ValueError("chat=True needs a text prompt or a list of messages, not token ids")
    if prompt_or_ids is None or isinstance(prompt_or_ids, (bytes, dict, set)):
        raise TypeError(f"the prompt must be text, chat messages or token ids, got "
                        f"{type(prompt_or_ids).__name__}")
    ids = np.asarray(prompt_or_ids)
    if ids.size == 0:
        raise ValueError(f"the prompt is empty (shape {ids.shape}): give at least one token "
                         f"id or some text")
    if ids.dtype.kind not in "iu":
        raise ValueError(f"prompt ids must be integers, got dtype {ids.dtype}")
    if ids.ndim == 2 and ids.shape[0] == 1:
        ids = ids[0]
    if ids.ndim != 1:
        raise ValueError(f"prompt ids must have shape (S,) (one sequence), got {ids.shape}")
    if ids.size and (int(ids.min()) < 0 or int(ids.max()) >= model.vocab_size):
        raise ValueError(f"prompt ids out of range [0, {model.vocab_size}): min {int(ids.min())}, "
                         f"max {int(ids.max())}")
    return [int(t) for t in ids], False


# ---------------------------------------------------------------------------------------------
# the public entry points
# ---------------------------------------------------------------------------------------------

def generate(model, prompt_or_ids, max_new_tokens: int = 64, temperature: float = 0.0,
             top_k: int = 0, top_p: float = 1.0, min_p: float = 0.0,
             repetition_penalty: float = 1.0, seed: int | None = None, stop=None,
             stream: bool = False, chat: bool = False, ctx: int | None = None,
             return_routing: bool = False, input_embeds: np.ndarray | None = None,
             presence_penalty: float = 0.0, frequency_penalty: float = 0.0,
             parallel: int | None = None, json_schema=None, regex: str | None = None,
             grammar: str | None = None, draft=None, num_draft_tokens: int = 4):
    """Continue a prompt, or several.

    prompt_or_ids: text (str), chat messages ([{"role", "content"}, ...]) or token ids (S,);
        or a list of those (texts, message lists, id lists) or an int array (B, S), B > 1:
        a batch (below).
    temperature 0 = greedy (the default); top_k 0, top_p 1, min_p 0, repetition_penalty 1,
    presence_penalty / frequency_penalty 0 (OpenAI's, over the generated tokens) = off;
    seed: seed of the sampler's numpy Generator (same seed, same tokens).
    stop: None = the model's end-of-sequence ids; else token ids and/or strings; [] = none.
    chat: render a text prompt with the model's chat template (as one user message).
    ctx: KV cache size (default: prompt + max_new_tokens); generation ends when prompt plus
        generated tokens reach it.
    json_schema (a dict or its JSON text) / regex / grammar (Lark): structured output, at most
        one (colibri.generation.constraints, llguidance): every token is drawn among those the
        grammar allows, and generation stops when it is complete; a spec llguidance rejects is a
        ConstraintError naming the problem. json_schema={"type": "object"} is any object.
    draft: speculative decoding (colibri.generation.speculative, docs/speculative.md):
    "prompt-lookup"
        (drafts copied from n-gram matches in the prompt and output), a draft model (a
        .colibri path or a Model with the same tokenizer) or a colibri.generation.drafters drafter;
        num_draft_tokens (1..32): the most drafts per verification pass. The same tokens as
        without it at temperature 0, the same distribution when sampling; one prompt only;
        model.last_stats is then a speculative.SpeculativeStats (acceptance, experts read).
        It runs as one request of a speculative_batch.SpeculativeScheduler.
    input_embeds: float (S, D) prompt embeddings instead of a prompt (prompt_or_ids=None); the
        result is text when the model has a tokenizer, else ids.
    Returns the generated text (for text prompts) or an int64 array of new ids (for ids),
    without the stop token/string. stream=True returns an iterator of text pieces (or ids);
    with return_routing=True the stream yields Step objects (token, text, routing) instead.
    Statistics of the run: model.last_stats (GenerationStats).

    One prompt runs as one request of colibri.generation.batching.Scheduler, stepped in this thread.
    A batch runs through it too (continuous batching: the sequences
    share each forward pass, each stops on its own): the result is a list with one entry per
    prompt, each what generate(prompt, ...) returns (the same tokens when greedy, and with a
    seed, which every sequence gets). stream=True yields (index, piece) pairs, index the
    prompt's position in the list, piece its next text piece (or id) as it comes.
    parallel: sequences running at once (default all of them); ctx caps each sequence;
    model.last_stats is a list of GenerationStats, one per prompt. The sampling settings
    (of one prompt too) take the ranges SamplingParams.check allows (sampling.REAL_BOUNDS:
    temperature <= 2, ...); return_routing
    and input_embeds need one prompt (Scheduler with SamplingParams(return_routing=True)
    gives a batch's routing).
    """
    _check_lengths(max_new_tokens, ctx)
    spec = compile_spec(json_schema=json_schema, regex=regex, grammar=grammar)
    if draft is not None and (is_batch(prompt_or_ids) or return_routing
                              or input_embeds is not None):
        raise ValueError("draft (speculative decoding) works with one prompt of text or ids, "
                         "without return_routing or input_embeds")
    if is_batch(prompt_or_ids):
        if return_routing or input_embeds is not None:
            raise ValueError("return_routing and input_embeds work with one prompt; for a "
                             "batch's routing use colibri.generation.batching.Scheduler with "
                             "SamplingParams(return_routing=True)")
        params = dict(temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p,
                      repetition_penalty=repetition_penalty, presence_penalty=presence_penalty,
                      frequency_penalty=frequency_penalty, seed=seed, constraint=spec)
        return _generate_batch(model, list(prompt_or_ids), max_new_tokens, params, stop,
                               stream, chat, ctx, parallel)
    if input_embeds is not None:
        if prompt_or_ids is not None:
            raise ValueError("give either a prompt (text or ids) or input_embeds, not both")
        x = np.asarray(input_embeds)
        if x.ndim != 2 or x.shape[1] != model.hidden_size:
            raise ValueError(f"input_embeds must have shape (S, {model.hidden_size}), got {x.shape}")
        ids, is_text = [], model.tokenizer is not None
    else:
        ids, is_text = prompt_ids(model, prompt_or_ids, chat)
    stop_ids, stop_texts = split_stop(stop)
    if stop is None:
        stop_ids = default_stop_ids(model)
    if stop_texts and model.tokenizer is None:
        raise NoTokenizerError("text stop sequences need a tokenizer; this model has none")
    n = len(ids) if input_embeds is None else len(input_embeds)
    if n == 0:
        raise ValueError("the prompt is empty: give at least one token")
    if ctx is not None and n >= ctx:
        raise ColibriError(f"the prompt has {n} tokens but ctx is {ctx}: "
                           f"nothing left to generate into")
    _check_room(model, n, max_new_tokens, ctx)
    budget = max_new_tokens if ctx is None else min(max_new_tokens, ctx - n)
    params = SamplingParams(
        max_tokens=budget, temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p,
        repetition_penalty=repetition_penalty, presence_penalty=presence_penalty,
        frequency_penalty=frequency_penalty, seed=seed, stop_ids=list(stop_ids),
        return_routing=return_routing, constraint=spec, detokenize=False)
    speculation = None if draft is None else Speculation(model, draft, num_draft_tokens)
    stats = (GenerationStats if draft is None else SpeculativeStats)(prompt_tokens=n)
    steps = _scheduled_steps(model, ids, input_embeds, params, stats,
                             ctx_bound=budget < max_new_tokens, speculation=speculation)
    model.last_stats = stats
    with_text = is_text or return_routing and model.tokenizer is not None
    it = _with_text(model, steps, ids, stop_texts, stats) if with_text else steps
    if return_routing:
        return it if stream else list(it)
    if stream:
        return (s.text for s in it) if is_text else (s.token for s in it)
    if is_text:
        return "".join(s.text for s in it)
    return np.fromiter((s.token for s in it), dtype=np.int64)


def _check_lengths(max_new_tokens, ctx) -> None:
    """TypeError / ValueError naming max_new_tokens or ctx when not an integer in range (a
    float such as 2.5 is refused, not carried into the cache size)."""
    for name, value, low in (("max_new_tokens", max_new_tokens, 0), ("ctx", ctx, 1)):
        if value is None and name == "ctx":
            continue
        if isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, np.integer)):
            raise TypeError(f"{name} must be an integer, got {value!r} ({type(value).__name__})")
        if value < low:
            raise ValueError(f"{name} must be >= {low}, got {value}")


def _check_room(model, n_prompt: int, max_new_tokens: int, ctx: int | None) -> None:
    """ResourceError now, naming the argument, when the KV cache these lengths ask for (ctx
    tokens, default the prompt's plus max_new_tokens + 1) cannot fit. Admission checks the
    cache it makes (prompt + budget tokens); this is for what it never makes: a ctx beyond
    that, or a max_new_tokens past what a request may ask (SamplingParams.check)."""
    if ctx is None and max_new_tokens <= 2**31 - 1:
        return
    tokens = n_prompt + max_new_tokens + 1 if ctx is None else ctx
    per_token = model.prefix_cache.token_bytes
    what = (f"ctx={ctx}" if ctx is not None else
            f"a prompt of {n_prompt} tokens and max_new_tokens={max_new_tokens}")
    check_allocation(tokens * (per_token + 9), f"{what}: a KV cache of {tokens} tokens "
                                               f"({per_token} bytes per token)")


def _scheduler(model, prompts: list[int], budgets: list[int], parallel: int,
               speculation: Speculation | None = None) -> Scheduler:
    """A Scheduler for sequences of these prompt lengths and token budgets, stepped by the
    caller: `parallel` slots, the longest prompt prefilled in one chunk, a KV budget of the
    slots' caches plus the model's prefix cache (admission never evicts it to make room;
    the prefix cache bounds itself); with speculation a SpeculativeScheduler."""
    longest = max(n + b for n, b in zip(prompts, budgets))
    pc = model.prefix_cache
    kv_budget = (parallel * longest * model.prefix_cache.token_bytes
                 + (pc.capacity if pc.enabled else 0))
    sizes = dict(parallel=parallel, ctx=max(2, longest), kv_budget=kv_budget,
                 max_queue=len(prompts), prefill_chunk=max(64, max(prompts)), prefix_cache=pc)
    if speculation is None:
        return Scheduler(model, **sizes)
    return SpeculativeScheduler(model, speculation, **sizes)


def _scheduled_steps(model, ids: list[int], input_embeds, params: SamplingParams,
                     stats: GenerationStats, ctx_bound: bool,
                     speculation: Speculation | None = None) -> Iterator[Step]:
    """The Steps of one request through a Scheduler (submitted now, so that bad settings
    raise at the call; stepped as the Steps are asked for: a token is yielded as soon as it
    is sampled, or with return_routing once the pass that consumed it has run). ctx_bound:
    ctx, not max_new_tokens, set the budget (a "length" end is then "ctx"). speculation:
    through a SpeculativeScheduler, its counts then copied into stats (SpeculativeStats)."""
    n = stats.prompt_tokens
    sched = _scheduler(model, [n], [params.max_tokens], 1, speculation)
    events: list[TokenEvent] = []
    handle = sched.submit(ids, params, on_event=events.append, input_embeds=input_embeds)

    def run() -> Iterator[Step]:
        model.timings.reset()
        stats.finish_reason = "length"
        index = 0
        try:
            while True:
                prefilling = handle.completion_tokens == 0     # no token taken yet
                t0 = time.perf_counter()
                try:
                    if not sched.step():
                        return
                except ResourceError as e:            # the cache made at admission
                    raise ResourceError(f"a prompt of {n} tokens and max_new_tokens="
                                        f"{params.max_tokens}: {e}") from None
                seconds = time.perf_counter() - t0
                if prefilling:
                    stats.prefill_seconds += seconds
                else:
                    stats.decode_seconds += seconds
                    stats.decode_steps += 1
                for ev in events:
                    if ev.finish_reason == "error":
                        raise handle.error
                    if ev.token >= 0:
                        stats.generated_tokens += 1
                        yield Step(index, ev.token, routing=ev.trace)
                        index += 1
                    if ev.finish_reason is not None:
                        stats.finish_reason = ("ctx" if ctx_bound and ev.finish_reason == "length"
                                               else ev.finish_reason)
                        return
                events.clear()
        finally:                                        # also when the caller stops early
            sched.stop(drain=False)
            stats.cached_tokens = handle.cached_tokens
            stats.timings = model.timings.copy()
            if speculation is not None:
                speculation.counts.copy_into(stats)
    return run()


def _with_text(model, steps: Iterator[Step], prompt: list[int], stop_texts: list[str],
               stats: GenerationStats) -> Iterator[Step]:
    """Fill Step.text from an incremental decoder; end at a text stop sequence."""
    dec = IncrementalDecoder(model.tokenizer, prompt)
    guard = StopText(stop_texts)
    last = None
    for step in steps:
        step.text = guard.feed(dec.push(step.token))
        last = step
        if guard.done:
            stats.finish_reason = "stop"
            steps.close()                         # stop the decode loop
            yield step
            return
        yield step
    tail = guard.feed(dec.flush()) + ("" if guard.done else guard.flush())
    if tail:
        if last is None:
            yield Step(-1, -1, tail)
        else:
            yield Step(last.index, -1, tail)      # trailing text (no new token)


# ---------------------------------------------------------------------------------------------
# several prompts at once
# ---------------------------------------------------------------------------------------------

def is_batch(prompt_or_ids) -> bool:
    """True for several prompts: a list/tuple of texts, message lists or id sequences, or an
    int array (B, S) with B > 1 (one id list, one text or one message list is one prompt)."""
    if isinstance(prompt_or_ids, np.ndarray):
        return prompt_or_ids.ndim == 2 and prompt_or_ids.shape[0] > 1
    if not isinstance(prompt_or_ids, (list, tuple)) or not prompt_or_ids:
        return False
    first = prompt_or_ids[0]
    return isinstance(first, (str, list, tuple, np.ndarray))


def _generate_batch(model, prompts: list, max_new_tokens: int, sampling: dict, stop,
                    stream: bool, chat: bool, ctx: int | None, parallel: int | None):
    """generate over several prompts through a Scheduler stepped in this thread."""
    if isinstance(max_new_tokens, bool) or int(max_new_tokens) != max_new_tokens \
            or max_new_tokens < 0:
        raise ValueError(f"max_new_tokens must be an integer >= 0, got {max_new_tokens!r}")
    encoded = [prompt_ids(model, p, chat) for p in prompts]
    is_text = encoded[0][1]
    if any(t != is_text for _, t in encoded):
        raise ValueError("a batch must be all text prompts or all token ids, not a mix")
    for i, (ids, _) in enumerate(encoded):
        if not ids:
            raise ValueError(f"prompt {i} is empty: give at least one token")
        if ctx is not None and len(ids) >= ctx:
            raise ColibriError(f"prompt {i} has {len(ids)} tokens but ctx is {ctx}: "
                               f"nothing left to generate into")
    stop_ids, stop_texts = split_stop(stop)
    if stop_texts and model.tokenizer is None:
        raise NoTokenizerError("text stop sequences need a tokenizer; this model has none")
    # per sequence: at most max_new_tokens, and no more than its ctx leaves
    budgets = [max_new_tokens if ctx is None else min(max_new_tokens, ctx - len(ids))
               for ids, _ in encoded]
    stats = [GenerationStats(prompt_tokens=len(ids)) for ids, _ in encoded]
    model.last_stats = stats
    pieces = _batch_pieces(model, [ids for ids, _ in encoded], budgets, sampling,
                           None if stop is None else stop_ids, stop_texts, parallel, stats)
    if not is_text:
        pieces = ((i, ev.token) for i, ev in pieces if ev.token >= 0)
    else:
        pieces = ((i, ev.text) for i, ev in pieces if ev.text)
    if stream:
        return pieces
    out: list[list] = [[] for _ in prompts]
    for i, piece in pieces:
        out[i].append(piece)
    if is_text:
        return ["".join(p) for p in out]
    return [np.array(p, dtype=np.int64) for p in out]


def _batch_pieces(model, prompts: list[list[int]], budgets: list[int], sampling: dict,
                  stop_ids: list[int] | None, stop_texts: list[str], parallel: int | None,
                  stats: list[GenerationStats]) -> Iterator[tuple[int, TokenEvent]]:
    """(index, TokenEvent) of every sequence as the steps make them; closing it early
    cancels what still runs."""
    todo = [i for i, n in enumerate(budgets) if n > 0]
    for i, n in enumerate(budgets):
        if n == 0:
            stats[i].finish_reason = "length"
    if not todo:
        return
    n_par = len(todo) if parallel is None else parallel
    sched = _scheduler(model, [len(prompts[i]) for i in todo], [budgets[i] for i in todo],
                       n_par)
    ready: list[tuple[int, TokenEvent]] = []
    handles = {}
    for i in todo:
        params = SamplingParams(max_tokens=budgets[i], stop=list(stop_texts),
                                stop_ids=stop_ids, **sampling)
        handles[i] = sched.submit(prompts[i], params,
                                  on_event=lambda ev, i=i: ready.append((i, ev)))
    model.timings.reset()
    t0 = time.perf_counter()
    try:
        while sched.step() or ready:
            for i, ev in ready:
                if ev.token >= 0:
                    stats[i].generated_tokens += 1
                if ev.finish_reason is not None:
                    stats[i].finish_reason = ev.finish_reason
                    if ev.finish_reason == "error":
                        raise ColibriError(f"generation of prompt {i} failed: "
                                           f"{handles[i].error}") from handles[i].error
                yield i, ev
            ready.clear()
    finally:                                         # also when the caller stops early
        sched.stop(drain=False)
        seconds = time.perf_counter() - t0
        for s in stats:
            s.decode_seconds = seconds
            s.timings = model.timings.copy()


def stream(model, prompt_or_ids, max_new_tokens: int = 64, **kwargs) -> Iterator:
    """generate(..., stream=True): text pieces (or ids) as they come."""
    return generate(model, prompt_or_ids, max_new_tokens=max_new_tokens, stream=True, **kwargs)
