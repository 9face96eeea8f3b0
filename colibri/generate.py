"""Generation as a chain of small verbs: prefill, decode_one, iter_steps, generate / stream.

    prefill(model, ids, cache)      run the prompt, fill the cache, logits of the last position
    decode_one(model, token, cache) feed one token, logits of the next
    iter_steps(...)                 sample, stop, feed back: yields one Step per new token
    generate(model, prompt_or_ids)  text in -> text out (ids in -> ids out), or a stream
    generate(model, [p, p, ...])    several prompts together through colibri.batching's
                                    Scheduler (continuous batching), each stopping on its own

Text is produced incrementally (tokenizer.IncrementalDecoder): a piece is emitted only when
it holds whole characters, and text stop sequences are held back until they cannot match.
"""
from __future__ import annotations

import time
from collections.abc import Iterator, Sequence
import numpy as np

from .batching import Scheduler, TokenEvent
from .constraints import Constraint, compile_spec, constrained_choice
from .errors import ColibriError
from .kv_cache import KVCache
from .prefix_cache import PrefixCache
from .resources import ResourceError
from .sampling import Sampler, SamplingParams
from .steps import GenerationStats, Step
from .stops import StopText, default_stop_ids, split_stop
from .tokenizer import IncrementalDecoder, NoTokenizerError

__all__ = ["prefill", "decode_one", "iter_steps", "generate", "stream", "Step",
           "GenerationStats", "prompt_ids", "is_batch", "default_stop_ids"]


# ---------------------------------------------------------------------------------------------
# the verbs
# ---------------------------------------------------------------------------------------------

def prefill(model, ids, cache: KVCache, *, attention_mask=None, return_routing: bool = False):
    """Run prompt ids (S,) or (B, S) into `cache`; logits float32 of the last position,
    (V,) or (B, V) [, RoutingTrace]."""
    out = model.forward(ids, cache=cache, attention_mask=attention_mask,
                        return_routing=return_routing, last_only=True)
    logits, trace = out if return_routing else (out, None)
    logits = logits[..., -1, :]
    return (logits, trace) if return_routing else logits


def decode_one(model, token, cache: KVCache, *, return_routing: bool = False):
    """Feed one token per sequence (int, or int (B,)); logits float32 (V,) or (B, V) [, trace]."""
    tok = np.asarray(token, dtype=np.int64)
    ids = tok.reshape(1) if tok.ndim == 0 else tok.reshape(-1, 1)
    out = model.forward(ids, cache=cache, return_routing=return_routing, last_only=True)
    logits, trace = out if return_routing else (out, None)
    logits = logits[..., -1, :]
    return (logits, trace) if return_routing else logits


def iter_steps(model, prompt: Sequence[int], sampler: Sampler, *, max_new_tokens: int,
               stop_ids: Sequence[int] = (), cache: KVCache | None = None,
               return_routing: bool = False, stats: GenerationStats | None = None,
               input_embeds: np.ndarray | None = None,
               constraint: Constraint | None = None,
               prefix_cache: PrefixCache | None = None) -> Iterator[Step]:
    """Yield one Step per generated token of one sequence (text pieces left empty).

    Without return_routing a token is yielded as soon as it is sampled (the forward pass that
    consumes it runs when the caller asks for the next one); with it, after that pass, so the
    Step carries the token's own routing. The stop token itself is not yielded.
    input_embeds float (S, D): a prompt given as embeddings instead of ids (prompt = []).
    constraint: a colibri.constraints.Constraint masking each draw; the sequence stops
    ("stop") when its grammar is complete. prefix_cache: a PrefixCache to start an empty
    cache from and to keep the prompt's (and at the end the generated tokens') blocks in.
    """
    prompt = [int(t) for t in prompt]
    n_prompt = len(prompt) if input_embeds is None else int(np.shape(input_embeds)[0])
    if n_prompt == 0:
        raise ValueError("the prompt is empty: give at least one token")
    if max_new_tokens < 0:
        raise ValueError(f"max_new_tokens must be >= 0, got {max_new_tokens}")
    stats = stats if stats is not None else GenerationStats()
    stats.prompt_tokens = n_prompt
    if cache is None:
        try:
            cache = model.new_cache(ctx=n_prompt + max_new_tokens + 1)
        except ResourceError as e:             # say which argument asked for the size
            raise ResourceError(f"a prompt of {n_prompt} tokens and max_new_tokens="
                                f"{max_new_tokens}: {e}") from None
    stops = set(int(s) for s in stop_ids)
    # only a fresh cache of one sequence holds exactly the prompt's tokens from slot 0
    pc = prefix_cache if input_embeds is None and cache.length == 0 and cache.batch == 1 else None
    model.timings.reset()
    t0 = time.perf_counter()
    if input_embeds is None:
        n = stats.cached_tokens = 0 if pc is None else pc.reuse(prompt, cache)
        logits = prefill(model, np.asarray(prompt[n:], dtype=np.int64), cache)
        if pc is not None:
            pc.store(prompt, cache)
    else:
        logits = model.forward(input_embeds=input_embeds, cache=cache, last_only=True)[-1]
    stats.prefill_seconds = time.perf_counter() - t0
    history = list(prompt)
    n_prompt_ids = len(history)
    stats.finish_reason = "length"
    try:
        for i in range(max_new_tokens):
            if cache.remaining == 0:                    # prompt + generated fill the context
                stats.finish_reason = "ctx"
                break
            x = sampler.penalise(logits, history, history[n_prompt_ids:])
            tok, _, ended = constrained_choice(sampler, x, constraint)
            if ended or tok in stops:
                stats.finish_reason = "stop"
                break
            history.append(tok)
            stats.generated_tokens += 1
            last = i == max_new_tokens - 1
            if constraint is not None and constraint.done:
                stats.finish_reason, last = "stop", True
            if return_routing:
                t1 = time.perf_counter()
                logits, trace = decode_one(model, tok, cache, return_routing=True)
                stats.decode_seconds += time.perf_counter() - t1
                stats.decode_steps += 1
                yield Step(i, tok, routing=trace)
                if constraint is not None and constraint.done:
                    break
                continue
            yield Step(i, tok)
            if last:
                break
            t1 = time.perf_counter()
            logits = decode_one(model, tok, cache)
            stats.decode_seconds += time.perf_counter() - t1
            stats.decode_steps += 1
    finally:                                        # also when the caller stops early
        stats.timings = model.timings.copy()
        if pc is not None:                          # the next chat turn starts with these
            pc.store(history[:cache.length], cache)


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
        one (colibri.constraints, llguidance): every token is drawn among those the grammar
        allows, and generation stops when it is complete; a spec llguidance rejects is a
        ConstraintError naming the problem. json_schema={"type": "object"} is any object.
    draft: speculative decoding (colibri.speculative, docs/speculative.md): "prompt-lookup"
        (drafts copied from n-gram matches in the prompt and output), a draft model (a
        .colibri path or a Model with the same tokenizer) or a colibri.drafters drafter;
        num_draft_tokens (1..32): the most drafts per verification pass. The same tokens as
        without it at temperature 0, the same distribution when sampling; one prompt only;
        model.last_stats is then a speculative.SpeculativeStats (acceptance, experts read).
    input_embeds: float (S, D) prompt embeddings instead of a prompt (prompt_or_ids=None); the
        result is text when the model has a tokenizer, else ids.
    Returns the generated text (for text prompts) or an int64 array of new ids (for ids),
    without the stop token/string. stream=True returns an iterator of text pieces (or ids);
    with return_routing=True the stream yields Step objects (token, text, routing) instead.
    Statistics of the run: model.last_stats (GenerationStats).

    A batch runs through colibri.batching.Scheduler (continuous batching: the sequences
    share each forward pass, each stops on its own): the result is a list with one entry per
    prompt, each what generate(prompt, ...) returns (the same tokens when greedy, and with a
    seed, which every sequence gets). stream=True yields (index, piece) pairs, index the
    prompt's position in the list, piece its next text piece (or id) as it comes.
    parallel: sequences running at once (default all of them); ctx caps each sequence;
    model.last_stats is a list of GenerationStats, one per prompt. The sampling settings
    take the ranges SamplingParams.check allows (temperature <= 2, ...); return_routing
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
                             "batch's routing use colibri.batching.Scheduler with "
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
    sampler = Sampler(temperature, top_k, top_p, min_p, repetition_penalty, seed,
                      presence_penalty, frequency_penalty)
    cache = None
    if ctx is not None:
        n = len(ids) if input_embeds is None else len(input_embeds)
        if n >= ctx:
            raise ColibriError(f"the prompt has {n} tokens but ctx is {ctx}: "
                               f"nothing left to generate into")
        cache = model.new_cache(ctx=ctx)
    constraint = None if spec is None else spec.start(model)
    if draft is not None:
        from .speculative import speculative_steps
        steps, stats = speculative_steps(model, draft, num_draft_tokens, ids, sampler,
                                         max_new_tokens=max_new_tokens, stop_ids=stop_ids,
                                         cache=cache, constraint=constraint)
    else:
        stats = GenerationStats()
        steps = iter_steps(model, ids, sampler, max_new_tokens=max_new_tokens,
                           stop_ids=stop_ids, cache=cache, return_routing=return_routing,
                           stats=stats, input_embeds=input_embeds, constraint=constraint,
                           prefix_cache=model.prefix_cache)
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
    longest = max(len(prompts[i]) + budgets[i] for i in todo)
    sched = Scheduler(model, parallel=n_par, ctx=longest, max_queue=len(todo),
                      prefill_chunk=max(64, max(len(prompts[i]) for i in todo)),
                      prefix_cache=model.prefix_cache)
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
