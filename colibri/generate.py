"""Generation as a chain of small verbs: prefill, decode_one, iter_steps, generate / stream.

    prefill(model, ids, cache)      run the prompt, fill the cache, logits of the last position
    decode_one(model, token, cache) feed one token, logits of the next
    iter_steps(...)                 sample, stop, feed back: yields one Step per new token
    generate(model, prompt_or_ids)  text in -> text out (ids in -> ids out), or a stream

Text is produced incrementally (tokenizer.IncrementalDecoder): a piece is emitted only when
it holds whole characters, and text stop sequences are held back until they cannot match.
"""
from __future__ import annotations

import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field

import numpy as np

from .errors import ColibriError
from .kv_cache import KVCache
from .sampling import Sampler
from .tokenizer import IncrementalDecoder, NoTokenizerError

__all__ = ["prefill", "decode_one", "iter_steps", "generate", "stream", "Step",
           "GenerationStats", "prompt_ids"]


@dataclass
class Step:
    """One generated token: id, its text piece ('' while a character is incomplete or with no
    tokenizer), and, when asked for, the routing of the forward pass that consumed it."""
    index: int
    token: int
    text: str = ""
    routing: object | None = None


@dataclass
class GenerationStats:
    """Counts and seconds of the last generation (model.last_stats)."""
    prompt_tokens: int = 0
    generated_tokens: int = 0
    prefill_seconds: float = 0.0
    decode_steps: int = 0
    decode_seconds: float = 0.0
    finish_reason: str = ""                 # "stop" | "length" | "ctx"
    timings: dict = field(default_factory=dict)   # seconds per stage (router, experts, ...)

    @property
    def prompt_tps(self) -> float:
        return self.prompt_tokens / self.prefill_seconds if self.prefill_seconds else 0.0

    @property
    def generation_tps(self) -> float:
        return self.decode_steps / self.decode_seconds if self.decode_seconds else 0.0

    def summary(self) -> str:
        return (f"prompt: {self.prompt_tokens} tokens in {self.prefill_seconds * 1e3:.1f} ms "
                f"({self.prompt_tps:.1f} tok/s); generation: {self.generated_tokens} tokens, "
                f"{self.decode_steps} decode steps in {self.decode_seconds * 1e3:.1f} ms "
                f"({self.generation_tps:.1f} tok/s); finish: {self.finish_reason}")


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
               input_embeds: np.ndarray | None = None) -> Iterator[Step]:
    """Yield one Step per generated token of one sequence (text pieces left empty).

    Without return_routing a token is yielded as soon as it is sampled (the forward pass that
    consumes it runs when the caller asks for the next one); with it, after that pass, so the
    Step carries the token's own routing. The stop token itself is not yielded.
    input_embeds float (S, D): a prompt given as embeddings instead of ids (prompt = []).
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
        cache = model.new_cache(ctx=n_prompt + max_new_tokens + 1)
    stops = set(int(s) for s in stop_ids)
    model.timings.reset()
    t0 = time.perf_counter()
    if input_embeds is None:
        logits = prefill(model, np.asarray(prompt, dtype=np.int64), cache)
    else:
        logits = model.forward(input_embeds=input_embeds, cache=cache, last_only=True)[-1]
    stats.prefill_seconds = time.perf_counter() - t0
    history = list(prompt)
    stats.finish_reason = "length"
    try:
        for i in range(max_new_tokens):
            if cache.remaining == 0:                    # prompt + generated fill the context
                stats.finish_reason = "ctx"
                break
            tok = sampler(logits, history)
            if tok in stops:
                stats.finish_reason = "stop"
                break
            history.append(tok)
            stats.generated_tokens += 1
            last = i == max_new_tokens - 1
            if return_routing:
                t1 = time.perf_counter()
                logits, trace = decode_one(model, tok, cache, return_routing=True)
                stats.decode_seconds += time.perf_counter() - t1
                stats.decode_steps += 1
                yield Step(i, tok, routing=trace)
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
    ids = np.asarray(prompt_or_ids)
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


def default_stop_ids(model) -> list[int]:
    """End-of-sequence ids: the config's eos_token_id plus the tokenizer's/generation config's."""
    ids: set[int] = set()
    eos = model.config.eos_token_id
    if eos is not None:
        ids.update(eos if isinstance(eos, tuple) else [eos])
    if model.file.tokenizer_files and model.tokenizer is not None:
        ids.update(model.tokenizer.eos_token_ids)
    return sorted(int(i) for i in ids)


def _split_stop(stop) -> tuple[list[int], list[str]]:
    if stop is None:
        return [], []
    items = [stop] if isinstance(stop, (int, str, np.integer)) else list(stop)
    ids = [int(s) for s in items if isinstance(s, (int, np.integer))]
    texts = [s for s in items if isinstance(s, str)]
    bad = [s for s in items if not isinstance(s, (int, np.integer, str))]
    if bad or any(t == "" for t in texts):
        raise ValueError(f"stop must be token ids and/or non-empty strings, got {stop!r}")
    return ids, texts


class _StopText:
    """Holds back text that might be the start of a stop string; says when one appeared."""

    def __init__(self, stops: list[str]):
        self.stops = stops
        self.pending = ""
        self.done = False

    def feed(self, piece: str) -> str:
        if not self.stops:
            return piece
        self.pending += piece
        cut = min((self.pending.find(s) for s in self.stops if s in self.pending), default=-1)
        if cut >= 0:
            self.done = True
            out, self.pending = self.pending[:cut], ""
            return out
        hold = 0                                  # longest suffix that is a stop's prefix
        for s in self.stops:
            for n in range(min(len(s) - 1, len(self.pending)), 0, -1):
                if self.pending.endswith(s[:n]):
                    hold = max(hold, n)
                    break
        out = self.pending[:len(self.pending) - hold]
        self.pending = self.pending[len(self.pending) - hold:]
        return out

    def flush(self) -> str:
        out, self.pending = self.pending, ""
        return out


# ---------------------------------------------------------------------------------------------
# the public entry points
# ---------------------------------------------------------------------------------------------

def generate(model, prompt_or_ids, max_new_tokens: int = 64, temperature: float = 0.0,
             top_k: int = 0, top_p: float = 1.0, min_p: float = 0.0,
             repetition_penalty: float = 1.0, seed: int | None = None, stop=None,
             stream: bool = False, chat: bool = False, ctx: int | None = None,
             return_routing: bool = False, input_embeds: np.ndarray | None = None):
    """Continue a prompt.

    prompt_or_ids: text (str), chat messages ([{"role", "content"}, ...]) or token ids (S,).
    temperature 0 = greedy (the default); top_k 0, top_p 1, min_p 0, repetition_penalty 1 = off;
    seed: seed of the sampler's numpy Generator (same seed, same tokens).
    stop: None = the model's end-of-sequence ids; else token ids and/or strings; [] = none.
    chat: render a text prompt with the model's chat template (as one user message).
    ctx: KV cache size (default: prompt + max_new_tokens); generation ends when prompt plus
        generated tokens reach it.
    input_embeds: float (S, D) prompt embeddings instead of a prompt (prompt_or_ids=None); the
        result is text when the model has a tokenizer, else ids.
    Returns the generated text (for text prompts) or an int64 array of new ids (for ids),
    without the stop token/string. stream=True returns an iterator of text pieces (or ids);
    with return_routing=True the stream yields Step objects (token, text, routing) instead.
    Statistics of the run: model.last_stats (GenerationStats).
    """
    if input_embeds is not None:
        if prompt_or_ids is not None:
            raise ValueError("give either a prompt (text or ids) or input_embeds, not both")
        x = np.asarray(input_embeds)
        if x.ndim != 2 or x.shape[1] != model.hidden_size:
            raise ValueError(f"input_embeds must have shape (S, {model.hidden_size}), got {x.shape}")
        ids, is_text = [], model.tokenizer is not None
    else:
        ids, is_text = prompt_ids(model, prompt_or_ids, chat)
    stop_ids, stop_texts = _split_stop(stop)
    if stop is None:
        stop_ids = default_stop_ids(model)
    if stop_texts and model.tokenizer is None:
        raise NoTokenizerError("text stop sequences need a tokenizer; this model has none")
    sampler = Sampler(temperature, top_k, top_p, min_p, repetition_penalty, seed)
    cache = None
    if ctx is not None:
        n = len(ids) if input_embeds is None else len(input_embeds)
        if n >= ctx:
            raise ColibriError(f"the prompt has {n} tokens but ctx is {ctx}: "
                               f"nothing left to generate into")
        cache = model.new_cache(ctx=ctx)
    stats = GenerationStats()
    model.last_stats = stats
    steps = iter_steps(model, ids, sampler, max_new_tokens=max_new_tokens, stop_ids=stop_ids,
                       cache=cache, return_routing=return_routing, stats=stats,
                       input_embeds=input_embeds)
    with_text = is_text or return_routing and model.tokenizer is not None
    it = _with_text(model, steps, ids, stop_texts, stats) if with_text else steps
    if return_routing:
        return it if stream else list(it)
    if stream:
        return (s.text for s in it) if is_text else (s.token for s in it)
    if is_text:
        return "".join(s.text for s in it)
    return np.fromiter((s.token for s in it), dtype=np.int64)


def _with_text(model, steps: Iterator[Step], prompt: list[int], stop_texts: list[str],
               stats: GenerationStats) -> Iterator[Step]:
    """Fill Step.text from an incremental decoder; end at a text stop sequence."""
    dec = IncrementalDecoder(model.tokenizer, prompt)
    guard = _StopText(stop_texts)
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


def stream(model, prompt_or_ids, max_new_tokens: int = 64, **kwargs) -> Iterator:
    """generate(..., stream=True): text pieces (or ids) as they come."""
    return generate(model, prompt_or_ids, max_new_tokens=max_new_tokens, stream=True, **kwargs)
