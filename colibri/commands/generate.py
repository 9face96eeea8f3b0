"""colibri generate [MODEL] -p PROMPT: stream a continuation to stdout.

--verbose adds, on stderr, the experts each generated token chose in every MoE layer with
their weights and how many of them were in memory (bytes read, page faults), then prompt and
generation speed, where the time went and the memory totals (colibri.experts.telemetry). With
--draft (speculative decoding) it prints the totals only, with the acceptance rate, the
verification passes and the experts read per generated token.
"""
from __future__ import annotations

import argparse
import os
import sys

import numpy as np

from ..errors import ColibriError
from ..experts.telemetry import ExpertTelemetry, TokenTelemetry
from ..generation.drafters import DEFAULT_DRAFT_TOKENS, PROMPT_LOOKUP, PromptLookup
from ..generation.sampling import check_real
from ..generation.speculative import MAX_DRAFT_TOKENS
from ..tools.trace import Trace, format_route
from .common import (ACTIVATIONS_HELP, SHIPPED_MODEL, add_activations_arg, add_ctx_arg,
                     add_kv_dtype_arg, add_memory_args, add_model_arg, add_seed_arg,
                     add_threads_arg, open_model)


def register(subparsers, parents=()) -> None:
    p = subparsers.add_parser(
        "generate", parents=list(parents), help="generate text from a prompt",
        description="Continue a prompt with a .colibri model, streaming the text to stdout. "
                    f"{SHIPPED_MODEL}")
    add_model_arg(p)
    p.add_argument("-p", "--prompt", help="the prompt text")
    p.add_argument("-n", "--max-new-tokens", "--n-predict", type=int, default=128, metavar="N",
                   help="tokens to generate at most; -1: until the end of text or the "
                        "context is full, as in llama.cpp (default: %(default)s)")
    p.add_argument("--temp", type=float, default=0.8, metavar="T",
                   help="temperature; 0 = greedy (default: %(default)s)")
    p.add_argument("--top-k", type=int, default=40, metavar="K",
                   help="keep the K most likely tokens; 0 = off (default: %(default)s)")
    p.add_argument("--top-p", type=float, default=0.95, metavar="P",
                   help="nucleus sampling; 1 = off (default: %(default)s)")
    p.add_argument("--min-p", type=float, default=0.05, metavar="P",
                   help="drop tokens below P x the top probability; 0 = off (default: %(default)s)")
    p.add_argument("--repeat-penalty", type=float, default=1.0, metavar="R",
                   help="repetition penalty; 1 = off (default: %(default)s)")
    add_seed_arg(p, None, help="random seed (default: a fresh one each run)")
    add_threads_arg(p)
    add_activations_arg(p, help=f"{ACTIVATIONS_HELP} (default: %(default)s)")
    add_kv_dtype_arg(p)
    add_ctx_arg(p, help="KV cache size in tokens (default: prompt + N)")
    add_memory_args(p)
    p.add_argument("--chat", action="store_true",
                   help="wrap the prompt in the model's chat template")
    p.add_argument("--verbose", action="store_true",
                   help="show the experts of every token and the timing breakdown on stderr")
    p.add_argument("--embeddings", metavar="FILE.npy",
                   help="feed this (S, hidden) float array as the prompt instead of -p")
    p.add_argument("--json-schema", metavar="FILE",
                   help="structured output: the text follows this JSON schema (a .json file)")
    p.add_argument("--grammar", metavar="FILE",
                   help="structured output: the text follows this Lark grammar (llguidance's)")
    p.add_argument("--regex", metavar="REGEX",
                   help="structured output: the text matches this regular expression")
    p.add_argument("--draft", metavar="MODEL|prompt-lookup",
                   help="speculative decoding: draft tokens from n-gram matches in the prompt "
                        "and output (prompt-lookup) or from a smaller .colibri model with the "
                        "same tokenizer, verified k at a time in one pass of this model; the "
                        "same text at --temp 0, the same distribution when sampling")
    p.add_argument("--draft-tokens", type=int, default=DEFAULT_DRAFT_TOKENS, metavar="K",
                   help=f"the most draft tokens per verification, 1..{MAX_DRAFT_TOKENS} "
                        f"(default: %(default)s)")
    p.add_argument("--draft-ngram", type=int, default=3, metavar="N",
                   help="prompt lookup: the longest n-gram matched (down to 1; default: "
                        "%(default)s)")
    p.set_defaults(func=run)


def _draft_kwargs(args) -> dict:
    """draft= / num_draft_tokens= for generate from --draft, --draft-tokens, --draft-ngram."""
    if args.draft is None:
        return {}
    if args.embeddings is not None:
        raise ColibriError("--draft needs a text prompt, not --embeddings")
    if not 1 <= args.draft_tokens <= MAX_DRAFT_TOKENS:
        raise ColibriError(f"--draft-tokens {args.draft_tokens} is out of range "
                           f"(1..{MAX_DRAFT_TOKENS})")
    if args.draft_ngram < 1:
        raise ColibriError(f"--draft-ngram {args.draft_ngram} is out of range (>= 1)")
    draft = PromptLookup(max_ngram=args.draft_ngram) if args.draft == PROMPT_LOOKUP else args.draft
    if not isinstance(draft, PromptLookup) and not os.path.isfile(draft):
        raise ColibriError(f"--draft {draft}: no such file (give a .colibri model or "
                           f"{PROMPT_LOOKUP})")
    return dict(draft=draft, num_draft_tokens=args.draft_tokens)


def _constraint_kwargs(args) -> dict:
    """json_schema= / grammar= / regex= for generate from --json-schema FILE, --grammar
    FILE, --regex; a file that cannot be read is a ColibriError naming it."""
    out = {}
    for flag, key, path in (("--json-schema", "json_schema", args.json_schema),
                            ("--grammar", "grammar", args.grammar)):
        if path is None:
            continue
        try:
            with open(path, encoding="utf-8") as f:
                out[key] = f.read()
        except (OSError, UnicodeDecodeError) as e:
            raise ColibriError(f"{flag} {path}: cannot read it ({e})") from None
    if args.regex is not None:
        out["regex"] = args.regex
    if len(out) > 1:
        raise ColibriError("give one of --json-schema, --grammar and --regex, not several")
    return out


def _check(args) -> None:
    if args.prompt is None and args.embeddings is None:
        raise ColibriError("give a prompt with -p PROMPT (or --embeddings FILE.npy)")
    if args.prompt is not None and args.embeddings is not None:
        raise ColibriError("give either -p PROMPT or --embeddings FILE.npy, not both")
    if args.prompt is not None and not args.prompt.strip() and not args.chat:
        raise ColibriError(f"the prompt is empty ({args.prompt!r}): give some text with -p")
    if args.embeddings is not None and args.chat:
        raise ColibriError("--chat needs a text prompt, not --embeddings")
    for name, value, ok in (("-n", args.max_new_tokens, args.max_new_tokens >= -1),  # -1: no cap
                            ("--top-k", args.top_k, args.top_k >= 0),
                            ("--threads", args.threads, args.threads is None or args.threads >= 1),
                            ("--ctx", args.ctx, args.ctx is None or args.ctx >= 1)):
        if not ok:
            raise ColibriError(f"{name} {value} is out of range")
    # the sampling ranges are colibri.generation.sampling's, the same the API and the server check
    for flag, key, value in (("--temp", "temperature", args.temp), ("--top-p", "top_p", args.top_p),
                             ("--min-p", "min_p", args.min_p),
                             ("--repeat-penalty", "repetition_penalty", args.repeat_penalty)):
        try:
            check_real(key, value)
        except ValueError as e:
            raise ColibriError(f"{flag} {value}: {e}") from None


def _load_embeddings(path: str, hidden: int) -> np.ndarray:
    with open(path, "rb") as f:
        magic = f.read(6)
    if magic != b"\x93NUMPY" and not magic.startswith(b"PK"):
        raise ColibriError(f"{path}: not a .npy file (it does not start with the NumPy magic); "
                           f"write it with numpy.save")
    try:
        x = np.load(path, allow_pickle=False)
    except ValueError as e:
        raise ColibriError(f"{path}: not a plain .npy array ({e})") from None
    if not isinstance(x, np.ndarray):                      # an .npz archive
        n = len(x.files)
        x.close()
        raise ColibriError(f"{path}: expected one array saved with numpy.save (.npy), found "
                           f"an archive of {n} arrays")
    if x.ndim == 3 and x.shape[0] == 1:
        x = x[0]
    if x.ndim != 2 or x.shape[1] != hidden or x.dtype.kind != "f":
        raise ColibriError(f"{path}: expected a float array of shape (S, {hidden}), found "
                           f"{x.dtype} {x.shape}")
    if x.shape[0] == 0:
        raise ColibriError(f"{path}: the array has no rows (shape {x.shape}): nothing to feed")
    bad = int((~np.isfinite(x)).sum())
    if bad:
        raise ColibriError(f"{path}: {bad} of {x.size} values are NaN or infinite")
    return x.astype(np.float32)


def _same_terminal() -> bool:
    try:
        return (os.isatty(sys.stdout.fileno()) and os.isatty(sys.stderr.fileno())
                and os.ttyname(sys.stdout.fileno()) == os.ttyname(sys.stderr.fileno()))
    except (OSError, ValueError, AttributeError):      # no real file descriptors (tests, IDEs)
        return False


def _routing_line(model, step) -> str:
    """One stderr line per token, "token 3 17 'x' L0 → [3 0.62, 5 0.38] L1 → [...]": the
    step's routing read as a colibri.tools.trace Trace, cells formatted as `colibri routes`
    does."""
    tr = Trace.from_routing(step.routing, [step.token], tokenizer=model.tokenizer)
    text = repr(tr.tokens[0]) if model.tokenizer is not None else ""
    parts = [f"token {step.index} {step.token} {text}".rstrip()]
    parts += [f"L{layer} → [{format_route(tr.experts[0, j], tr.weights[0, j])}]"
              for j, layer in enumerate(tr.layers)]
    return " ".join(parts)


def _cache_line(st: dict) -> str:
    """'332 slots x 3.38 MiB (least-stale, arena), hit rate 95.5%, ... prefetch recall by
    layer (router): -, 0.44, ...'."""
    line = (f"{st['slots']} slots x {st['slot_bytes'] / 2**20:.2f} MiB ({st['policy']}, "
            f"{st['mode']}{', locked' if st['locked'] else ''}), hit rate "
            f"{100 * st['hit_rate']:.1f}%, {st['bytes_read'] / 1e6:.1f} MB read from the disk "
            f"and {st['bytes_from_page_cache'] / 1e6:.1f} MB copied from the page cache, "
            f"{st['prefetch_reads']} blocks prefetched")
    for name, recall in (st.get("prefetch") or {}).get("recall", {}).items():
        line += (f"; prefetch recall by layer ({name}): "
                 + ", ".join("-" if r is None else f"{r:.2f}" for r in recall))
    return line


def run(args: argparse.Namespace) -> int:
    _check(args)
    model = open_model(args)
    embeds = _load_embeddings(args.embeddings, model.hidden_size) if args.embeddings else None
    if args.prompt is not None and model.tokenizer is None:
        raise ColibriError(f"{model.file.path} has no tokenizer, so a text prompt cannot be "
                           f"encoded; use --embeddings FILE.npy")
    if args.max_new_tokens == -1:      # llama.cpp's "infinity": the context's end stops it
        args.ctx = args.ctx or model.max_context
        args.max_new_tokens = args.ctx
    kwargs = dict(max_new_tokens=args.max_new_tokens, temperature=args.temp, top_k=args.top_k,
                  top_p=args.top_p, min_p=args.min_p, repetition_penalty=args.repeat_penalty,
                  seed=args.seed, chat=args.chat, ctx=args.ctx, stream=True,
                  return_routing=args.verbose and args.draft is None, input_embeds=embeds,
                  **_constraint_kwargs(args), **_draft_kwargs(args))
    per_token = args.verbose and args.draft is None     # speculation: the totals only
    out = sys.stdout
    text_out = model.tokenizer is not None
    # On one terminal the routing lines (stderr) would cut the streamed text (stdout) apart:
    # there, --verbose shows the per-token lines and prints the text once at the end.
    held = [] if per_token and _same_terminal() else None
    recorder = ExpertTelemetry(model) if per_token else None
    decoded: list[TokenTelemetry] = []          # one row per decode step
    for item in model.generate(args.prompt, **kwargs):
        if per_token:
            piece = item.text or (f"{item.token} " if not text_out and item.token >= 0 else "")
            if held is not None:
                held.append(piece)
            elif piece:
                out.write(piece)
                out.flush()
            if item.routing is not None:
                rows = recorder.collect()      # the prefill's rows first, then this step's
                line = _routing_line(model, item)
                if len(rows):
                    decoded.append(rows[-1:])
                    line += " | " + rows.format_token(len(rows) - 1)
                print(line, file=sys.stderr, flush=True)
        else:
            out.write(item if isinstance(item, str) else f"{item} ")
            out.flush()
    if held is not None:
        out.write("".join(held))
    out.write("\n")
    out.flush()
    if args.verbose:
        st = model.last_stats
        print(st.summary(), file=sys.stderr)
        print("time: " + model.timings.summary(), file=sys.stderr)
        if decoded:
            print("memory: " + TokenTelemetry.concat(decoded).format_summary(),
                  file=sys.stderr)
        if model.expert_cache is not None:
            print("expert cache: " + _cache_line(model.expert_cache.stats()), file=sys.stderr)
        if recorder is not None:
            recorder.close()
    return 0
