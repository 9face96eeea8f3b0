"""`echo` on /v1/completions: the prompt before each choice's text, and with `logprobs` the
prompt's own tokens scored (what lm-evaluation-harness's local-completions model sends for
every log-likelihood task: {"echo": true, "logprobs": 1, "max_tokens": 1}).

A choice's logprobs object then covers the prompt tokens and the generated ones, in the
legacy completions shape (as vLLM and OpenAI's echo give it):

    tokens          [prompt token texts..., generated...]
    token_logprobs  [null, log p(prompt[1] | prompt[0]), ..., generated...]
    top_logprobs    [null, {text: logprob} (the `logprobs` most likely and the prompt token
                     itself), ..., generated...]
    text_offset     [0, len(text of prompt[0]), ...]: each prompt token at the sum of the
                     lengths of the token texts before it; the generated ones after the
                     echoed prompt text, as without echo

A choice that a stop token (EOS) ended lists that token last (its text is not echoed), as
vLLM and OpenAI's legacy completions do: lm-eval reads `token_logprobs[len(context):-1]`
as the continuation, taking the last entry for the generated token.

The prompt's log-probabilities come from its prefill (colibri.generation.prompt_logprobs: the raw
logits, float64 log-softmax), taken by the first choice of each prompt and shared by its
others. `max_tokens: 0` scores the prompt without generating. The text echoed is the prompt
as sent, or for token ids their decoded text.
"""
from __future__ import annotations

from collections.abc import Callable

__all__ = ["prompt_text", "add_echo"]


def prompt_text(tokenizer, prompt: str | list[int]) -> str:
    """The text a choice echoes: the prompt as sent, token ids decoded ('' without a
    tokenizer)."""
    if isinstance(prompt, str):
        return prompt
    return tokenizer.decode(prompt) if tokenizer is not None else ""


def _prompt_part(ids: list[int], scored: list | None, k: int, text: Callable[[int], str]
                 ) -> tuple[list, list, list, list]:
    """(tokens, token_logprobs, top_logprobs, text_offset) of the prompt ids, from the
    handle's prompt_logprobs ([None, (logprob, top or None), ...])."""
    tokens = [text(t) for t in ids]
    offsets, at = [], 0
    for piece in tokens:
        offsets.append(at)
        at += len(piece)
    token_lp: list = [None]
    top: list = [None]
    for t, entry in zip(ids[1:], (scored or [None])[1:]):
        lp, best = entry
        token_lp.append(lp)
        if k:
            d = {text(i): v for i, v in best or ()}
            d.setdefault(text(t), lp)              # the prompt token itself, as OpenAI's
            top.append(d)
        else:
            top.append(None)
    return tokens, token_lp, top, offsets


def add_echo(body: dict, prompts: list[str | list[int]], prompt_ids: list[list[int]],
             scored: list[list | None], n: int, k: int | None, tokenizer,
             text: Callable[[int], str], stops: dict | None = None) -> dict:
    """Put the prompt before each choice of a completion body (choice i answers prompt i // n),
    and, when logprobs were asked (k not None), its scored tokens before the generated ones
    in the choice's logprobs. scored: the prompt_logprobs of each prompt; stops: choice index
    -> the final TokenEvent of a choice a stop token ended, whose token closes its logprobs
    (lm-eval takes the last entry for the generated token: without it, a choice that stopped
    on EOS at once would lose its last prompt token instead). Returns body."""
    stops = stops or {}
    cache: dict[int, str] = {}

    def cached(t: int) -> str:
        if t not in cache:
            cache[t] = text(t)
        return cache[t]

    parts: dict[int, tuple] = {}
    for choice in body["choices"]:
        p = choice["index"] // n
        echoed = prompt_text(tokenizer, prompts[p])
        choice["text"] = echoed + choice["text"]
        lp = choice.get("logprobs")
        if k is None or lp is None:
            continue
        if p not in parts:
            parts[p] = _prompt_part(prompt_ids[p], scored[p], k, cached)
        tokens, token_lp, top, offsets = parts[p]
        choice["logprobs"] = out = {
            "tokens": tokens + lp["tokens"],
            "token_logprobs": token_lp + lp["token_logprobs"],
            "top_logprobs": top + lp["top_logprobs"],
            "text_offset": offsets + [len(echoed) + o for o in lp["text_offset"]]}
        stop = stops.get(choice["index"])
        if stop is not None:
            out["tokens"].append(cached(stop.stop_token))
            out["token_logprobs"].append(stop.logprob)
            out["top_logprobs"].append({cached(t): v for t, v in stop.top_logprobs}
                                       if stop.top_logprobs is not None else None)
            out["text_offset"].append(len(choice["text"]))
    return body
