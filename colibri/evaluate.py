"""lm-evaluation-harness in process: ColibriLM, an `lm_eval.api.model.LM` over a loaded model.

    import colibri, lm_eval
    from colibri.evaluate import ColibriLM
    lm = ColibriLM(colibri.load("model.colibri"))
    results = lm_eval.simple_evaluate(model=lm, tasks=["hellaswag"], limit=100)

`colibri eval MODEL --tasks T` (colibri/commands/eval.py) runs the same over lm-eval's
evaluator; importing this module also registers the model name "colibri" with lm-eval, so
`lm_eval.simple_evaluate(model="colibri", model_args="pretrained=model.colibri")` works.

The conventions are those of lm-eval's `hf` model (lm_eval/models/huggingface.py), so a
checkpoint scored by `lm_eval --model hf` and its conversion scored here give the same
per-sample log-likelihoods, within the logits error of the weight format:
- text is encoded with the tokenizer's own special-token setting (a BOS only where the
  tokenizer's config adds one; not again when the text already starts with it);
- a (context, continuation) pair is encoded as lm-eval's TemplateLM does (trailing spaces of
  the context moved to the continuation, the whole encoded, the context's tokens split
  off), an empty context becomes the prefix token (BOS, else EOS);
- context + continuation longer than max_length + 1 tokens lose their left end;
- loglikelihood_rolling cuts a text into lm-eval's rolling windows of max_length tokens;
- generate_until: greedy unless the task asks to sample, until the task's stop strings or
  the end-of-sequence token, the prompt left-truncated to max_length - max_gen_toks.
max_length defaults to the model's max_position_embeddings, as `hf`'s does.

Scoring (loglikelihood, rolling) goes through colibri.generation.scoring: a context shared by
several continuations runs once and each continuation on a copy of its KV cache, many sequences per
ragged step. Generation goes through continuous batching (colibri.generation.batching.Scheduler), up
to batch_size sequences at a time. Progress bars are tqdm's.
"""
from __future__ import annotations

import os

import numpy as np

from .extras import require_extra

require_extra("lm_eval", "eval", "colibri.evaluate (lm-evaluation-harness)")
from lm_eval import utils as lm_utils                                     # noqa: E402
from lm_eval.api.model import TemplateLM                                  # noqa: E402
from lm_eval.api.registry import register_model                           # noqa: E402
from lm_eval.models.utils import (handle_stop_sequences, normalize_gen_kwargs,  # noqa: E402
                                  postprocess_generated_text)
from tqdm import tqdm

from .engine.kv_cache import DEFAULT_KV_DTYPE
from .engine.model import DEFAULT_ACTIVATIONS, Model
from .errors import ColibriError
from .generation.batching import Scheduler
from .generation.sampling import (MAX_STOP_CHARS as _MAX_STOP_CHARS, MAX_STOPS as _MAX_STOPS,
                                  SamplingParams)
from .generation.scoring import DEFAULT_BATCH_TOKENS, score

__all__ = ["ColibriLM", "DEFAULT_BATCH_SIZE"]

DEFAULT_BATCH_SIZE = 16          # sequences per ragged step / generation slots
_MAX_GEN_TOKS = 256              # lm-eval's default, as the hf model's


def _batch_size(value) -> int:
    """lm-eval's batch_size (an int, a numeric string, "auto" or "auto:N") -> sequences."""
    if value is None:
        return DEFAULT_BATCH_SIZE
    if isinstance(value, str):
        if value.startswith("auto"):
            return DEFAULT_BATCH_SIZE
        if not value.isdigit():
            raise ValueError(f"batch_size must be a positive integer or 'auto', got {value!r}")
        value = int(value)
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 1:
        raise ValueError(f"batch_size must be a positive integer or 'auto', got {value!r}")
    return int(value)


@register_model("colibri")
class ColibriLM(TemplateLM):
    """An lm-eval model over a colibri Model (module docstring).

    model: a loaded colibri Model (kept open; the caller closes it), or the path of a
        .colibri file (opened with threads / activations / kv_dtype, closed by close()).
    pretrained: the same as a path (lm-eval's model_args name: "pretrained=model.colibri").
    batch_size: sequences per forward pass when scoring (within batch_tokens rows) and
        generation slots; "auto" gives DEFAULT_BATCH_SIZE.
    batch_tokens: rows per forward pass when scoring (colibri.generation.scoring).
    max_length: the longest sequence scored (tokens; default: the model's
        max_position_embeddings, as lm-eval's hf model). max_gen_toks: generate_until's
        default budget (256, the hf model's).
    add_bos_token: None (the tokenizer's own setting, as hf), True or False to force it.
    prefix_token_id: the token that stands for an empty context (default: BOS, else EOS).
    seed: the seed of the first sampled generation (request i gets seed + i).
    Other keyword arguments lm-eval passes (device, max_batch_size, ...) are ignored.
    """

    def __init__(self, model: Model | str | os.PathLike | None = None, *,
                 pretrained: str | os.PathLike | None = None, batch_size=None,
                 batch_tokens: int = DEFAULT_BATCH_TOKENS, max_length: int | None = None,
                 max_gen_toks: int = _MAX_GEN_TOKS, add_bos_token: bool | None = None,
                 prefix_token_id: int | None = None, seed: int = 1234,
                 threads: int | None = None, activations: str = DEFAULT_ACTIVATIONS,
                 kv_dtype: str = DEFAULT_KV_DTYPE, **ignored):
        super().__init__()
        source = model if model is not None else pretrained
        if source is None:
            raise ValueError("ColibriLM needs a model: a loaded colibri Model or the path of a "
                             ".colibri file (model_args pretrained=FILE)")
        if isinstance(source, Model):
            self.model, self._owned = source, False
        else:
            from .api import load
            self.model = load(source, threads=None if threads is None else int(threads),
                              activations=activations, kv_dtype=kv_dtype)
            self._owned = True
        tok = self.model.tokenizer
        if tok is None:
            self.close()
            raise ColibriError(f"{self.model.file.path} carries no tokenizer; lm-eval's tasks "
                               f"are text, so ColibriLM needs one")
        self.colibri_tokenizer = tok
        self.tokenizer = tok.hf                  # lm-eval reads chat_template, special tokens
        self._batch = _batch_size(batch_size)
        self.batch_tokens = int(batch_tokens)
        self._max_length = None if max_length is None else int(max_length)
        self.max_gen_toks = int(max_gen_toks)
        self.add_bos_token = _optional_bool(add_bos_token, "add_bos_token")
        self.custom_prefix_token_id = None if prefix_token_id is None else int(prefix_token_id)
        self.seed = int(seed)
        for name, value in (("batch_tokens", self.batch_tokens), ("max_gen_toks", self.max_gen_toks)):
            if value < 1:
                raise ValueError(f"{name} must be >= 1, got {value}")
        if self.max_length < 2:
            raise ValueError(f"max_length must be >= 2, got {self.max_length}")

    def close(self) -> None:
        """Close the model if this object opened it."""
        if self._owned:
            self.model.close()

    # -- what lm-eval reads ---------------------------------------------------------------------
    @property
    def eot_token_id(self) -> int:
        return self.tokenizer.eos_token_id

    @property
    def prefix_token_id(self) -> int:
        if self.custom_prefix_token_id is not None:
            return self.custom_prefix_token_id
        if self.tokenizer.bos_token_id is not None:
            return self.tokenizer.bos_token_id
        return self.tokenizer.eos_token_id

    @property
    def max_length(self) -> int:
        return self._max_length if self._max_length else int(self.model.max_context)

    @property
    def batch_size(self) -> int:
        return self._batch

    @property
    def tokenizer_name(self) -> str:
        return str(self.model.file.path).replace("/", "__")

    def get_model_info(self) -> dict:
        c = self.model.config
        return {"model_source": "colibri", "model_path": str(self.model.file.path),
                "model_family": c.family, "activations": self.model.activations,
                "kv_dtype": self.model.kv_dtype, "threads": self.model.threads}

    # -- text <-> ids, as lm-eval's hf model ----------------------------------------------------
    def tok_encode(self, string: str, add_special_tokens: bool | None = None,
                   left_truncate_len: int | None = None, **kwargs) -> list[int]:
        if add_special_tokens is None:
            add = self.add_bos_token
            bos_text = self.tokenizer.decode(self.prefix_token_id)
            if string.startswith(bos_text):  # already there (a chat prompt), as hf decides it
                add = False
        else:
            add = add_special_tokens
        ids = self.colibri_tokenizer.encode(string, verbose=False, max_chars=None,
                                            **({} if add is None else
                                               {"add_special_tokens": bool(add)}))
        return ids[-left_truncate_len:] if left_truncate_len else ids

    def tok_decode(self, tokens, skip_special_tokens: bool = True) -> str:
        tokens = [tokens] if isinstance(tokens, (int, np.integer)) else list(tokens)
        return self.colibri_tokenizer.decode(tokens, skip_special_tokens=skip_special_tokens)

    def apply_chat_template(self, chat_history: list[dict[str, str]],
                            add_generation_prompt: bool = True) -> str:
        """The conversation as text, rendered with the model file's chat template (the
        sandboxed renderer of colibri.format.chat_template); continuing the last message
        (lm-eval's add_generation_prompt=False) goes through transformers'
        continue_final_message."""
        if not self.colibri_tokenizer.has_chat_template:
            raise ColibriError(f"{self.model.file.path} has no chat template; run without "
                               f"--apply-chat-template")
        if add_generation_prompt:
            return self.colibri_tokenizer.render_chat(chat_history, True)
        return self.tokenizer.apply_chat_template(chat_history, tokenize=False,
                                                  add_generation_prompt=False,
                                                  continue_final_message=True)

    # -- scoring ------------------------------------------------------------------------------
    def _loglikelihood_tokens(self, requests, disable_tqdm: bool = False,
                              override_bs: int | None = None) -> list[tuple[float, bool]]:
        """requests: [(cache key or None, context ids, continuation ids)] -> [(logprob,
        is_greedy)], lm-eval's hf model's left truncation to max_length + 1 tokens."""
        pairs = []
        for _, ctx, cont in requests:
            if not ctx or not cont:
                raise ValueError("lm-eval gave an empty context or continuation to score")
            if len(cont) > self.max_length:
                raise ValueError(f"a continuation of {len(cont)} tokens is longer than "
                                 f"max_length {self.max_length}")
            whole = (list(ctx) + list(cont))[-(self.max_length + 1):]
            pairs.append((whole[:len(whole) - len(cont)], list(cont)))
        bar = tqdm(total=len(pairs), disable=disable_tqdm or self.rank != 0,
                   desc="Running loglikelihood requests")
        try:
            scored = score(self.model, pairs, batch_tokens=self.batch_tokens,
                           max_sequences=self.batch_size, progress=bar.update)
        finally:
            bar.close()
        out = []
        for (key, _, _), s in zip(requests, scored):
            answer = (s.logprob, s.is_greedy)
            if key is not None:
                self.cache_hook.add_partial("loglikelihood", key, answer)
            out.append(answer)
        return out

    def loglikelihood_rolling(self, requests, disable_tqdm: bool = False) -> list[float]:
        """Each text's log-likelihood over lm-eval's rolling windows of max_length tokens
        (the first conditioned on the prefix token), every window from an empty cache."""
        windows, owner = [], []
        for i, (string,) in enumerate(tqdm([r.args for r in requests],
                                           disable=disable_tqdm or self.rank != 0)):
            for ctx, cont in map(lm_utils.make_disjoint_window,
                                 lm_utils.get_rolling_token_windows(
                                     token_list=self.tok_encode(string),
                                     prefix_token=self.prefix_token_id,
                                     max_seq_len=self.max_length, context_len=1)):
                windows.append((None, ctx, cont))
                owner.append(i)
        totals = [0.0] * len(requests)
        for i, (lp, _) in zip(owner, self._loglikelihood_tokens(windows, disable_tqdm)):
            totals[i] += lp
        for req, total in zip(requests, totals):
            self.cache_hook.add_partial("loglikelihood_rolling", req.args, total)
        return totals

    # -- generation ---------------------------------------------------------------------------
    def generate_until(self, requests, disable_tqdm: bool = False) -> list[str]:
        """Each (context, gen_kwargs) continued as lm-eval's hf model does, all of them
        through one continuous-batching scheduler of batch_size slots."""
        if not requests:
            return []
        eos = self.tok_decode(self.eot_token_id, skip_special_tokens=False)
        jobs = []
        for i, (context, gen_kwargs) in enumerate(r.args for r in requests):
            kwargs = normalize_gen_kwargs(gen_kwargs, self.max_gen_toks)
            until = [s for s in handle_stop_sequences(kwargs.pop("until", None), eos=eos) if s]
            budget = int(kwargs.pop("max_gen_toks"))
            if budget >= self.max_length:
                raise ValueError(f"max_gen_toks {budget} must be smaller than max_length "
                                 f"{self.max_length}")
            ids = self.tok_encode(context, left_truncate_len=self.max_length - budget)
            if not ids:
                ids = [self.prefix_token_id]
            sample = bool(kwargs.get("do_sample")) and float(kwargs.get("temperature", 0)) > 0
            engine_stops = [s for s in until if len(s) <= _MAX_STOP_CHARS][:_MAX_STOPS]
            params = SamplingParams(
                max_tokens=budget, stop=engine_stops,
                temperature=float(kwargs.get("temperature", 1.0)) if sample else 0.0,
                top_p=float(kwargs.get("top_p") or 1.0) if sample else 1.0,
                top_k=int(kwargs.get("top_k") or 0) if sample else 0,
                seed=(self.seed + i) % 2**63)
            jobs.append((ids, params, until))
        sched = Scheduler(self.model, parallel=self.batch_size,
                          ctx=max(len(ids) + p.max_tokens for ids, p, _ in jobs),
                          max_queue=len(jobs), prefill_chunk=self.batch_tokens)
        texts: list[list[str]] = [[] for _ in jobs]
        handles = [sched.submit(ids, params, (lambda out: lambda ev: out.append(ev.text))(texts[i]))
                   for i, (ids, params, _) in enumerate(jobs)]
        bar = tqdm(total=len(jobs), disable=disable_tqdm or self.rank != 0,
                   desc="Running generate_until requests")
        done = 0
        try:
            while sched.step():
                now = sum(h.finish_reason is not None for h in handles)
                bar.update(now - done)
                done = now
        finally:
            sched.stop(drain=False)
            bar.close()
        out = []
        for (context, gen_kwargs), h, (_, _, until), pieces in zip(
                (r.args for r in requests), handles, jobs, texts):
            if h.finish_reason == "error":
                raise ColibriError(f"generation failed: {h.error}") from h.error
            text = "".join(pieces)
            text = postprocess_generated_text(text, until, None)
            self.cache_hook.add_partial("generate_until", (context, gen_kwargs), text)
            out.append(text)
        return out


def _optional_bool(value, name: str) -> bool | None:
    """None, a bool, or lm-eval's model_args strings ("true", "False", ...)."""
    if value is None or isinstance(value, bool):
        return value
    if isinstance(value, str) and value.lower() in ("true", "false", "none"):
        return {"true": True, "false": False, "none": None}[value.lower()]
    raise ValueError(f"{name} must be true, false or none, got {value!r}")
