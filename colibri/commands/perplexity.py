"""colibri perplexity [MODEL] -f FILE: perplexity over a text, and KL against a base model.

The method is in colibri/tools/perplexity.py and docs/benchmarks.md.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np

from ..errors import ColibriError
from ..tools.perplexity import MIN_CTX, format_markdown, perplexity
from .common import (SHIPPED_MODEL, add_activations_arg, add_ctx_arg, add_kv_dtype_arg,
                     add_memory_args, add_model_arg, add_output_arg, add_threads_arg,
                     check_at_least, memory_options, model_path, open_model)


def register(subparsers, parents=()) -> None:
    p = subparsers.add_parser(
        "perplexity", parents=list(parents), help="perplexity over a text; KL against a base model",
        description="Perplexity of a model over a text file, in windows of --ctx tokens "
                    "(llama-perplexity's scheme: the second half of each non-overlapping window "
                    "is scored; or sliding windows with --stride). With --kl-base, the same "
                    "windows also run through a base model (e.g. the f32 conversion of the same "
                    "checkpoint) and the KL divergence per token, the same-top-token rate and "
                    f"the perplexity ratio say what the quantization cost, and the routing "
                    f"agreement per MoE layer (top-k set, top-1, router-weight error) whether "
                    f"it changed which experts run. {SHIPPED_MODEL}")
    add_model_arg(p)
    p.add_argument("-f", "--file", required=True, metavar="FILE",
                   help="UTF-8 text file, or a .npy array of token ids")
    add_ctx_arg(p, help="window length in tokens (default: 512, or the model's "
                                       "context if shorter)")
    p.add_argument("--stride", type=int, default=None, metavar="S",
                   help="sliding windows every S tokens (1 <= S < ctx), each scoring the "
                        "tokens no earlier window scored (default: off)")
    p.add_argument("--kl-base", metavar="BASE", default=None,
                   help="base .colibri file with the same tokenizer: report KL(base ‖ model), "
                        "same-top-token rate, the perplexity ratio and, per MoE layer, how "
                        "often both route to the same experts (docs/fidelity.md)")
    p.add_argument("--bos", action=argparse.BooleanOptionalAction, default=None,
                   help="put the tokenizer's BOS first in every window (--bos) or cut the text "
                        "as it is (--no-bos); default: as llama-perplexity does, BOS first "
                        "when the tokenizer puts one first and --stride is not given")
    p.add_argument("-b", "--batch", type=int, default=1, metavar="B",
                   help="windows per forward pass (default: %(default)s)")
    add_threads_arg(p)
    add_memory_args(p)
    add_activations_arg(p, "-a", "--activations",
                        help="activations of MODEL's q4/q8 matmuls: int16 (within ~1e-4 of "
                             "exact), f32 (exact) or int8 (fastest); the base always runs f32, "
                             "so --kl-base MODEL measures their cost (default: %(default)s)")
    add_kv_dtype_arg(p, help="storage of MODEL's KV cache: f16, bf16 (each window then runs "
                             "through a 16-bit cache) or f32 (exact); the base always runs f32, "
                             "so --kl-base MODEL measures its cost")
    add_output_arg(p, help="markdown tables or JSON (default: %(default)s)")
    p.set_defaults(func=run)


def _read_data(path: str):
    """Text of a text file, or int token ids from a .npy file."""
    if path.endswith(".npy"):
        try:
            ids = np.load(path, allow_pickle=False)
        except ValueError as e:
            raise ColibriError(f"{path}: not a plain .npy array ({e})") from None
        if not isinstance(ids, np.ndarray) or ids.ndim != 1 or ids.dtype.kind not in "iu":
            raise ColibriError(f"{path}: expected a 1-D integer array of token ids, found "
                               f"{getattr(ids, 'dtype', type(ids).__name__)} "
                               f"{getattr(ids, 'shape', '')}")
        return ids
    try:
        return Path(path).read_text(encoding="utf-8")
    except UnicodeDecodeError as e:
        raise ColibriError(f"{path}: not UTF-8 text ({e.reason} at byte {e.start})") from None


def run(args: argparse.Namespace) -> int:
    check_at_least((("--ctx", args.ctx, MIN_CTX), ("--stride", args.stride, 1),
                    ("--batch", args.batch, 1), ("--threads", args.threads, 1)))
    data = _read_data(args.file)
    memory = memory_options(args)
    # with memory flags the model is opened here (perplexity() takes a Model as it is)
    model = open_model(args) if memory != memory_options(argparse.Namespace()) else \
        model_path(args.model)
    show = args.output == "md" and sys.stderr.isatty()

    def progress(done: int, total: int) -> None:
        print(f"\rwindows {done}/{total}", end="\n" if done == total else "", file=sys.stderr,
              flush=True)

    try:
        res = perplexity(model, data, ctx=args.ctx, stride=args.stride, batch=args.batch,
                         base=args.kl_base, threads=args.threads, activations=args.activations,
                         kv_dtype=args.kv_dtype, bos=args.bos,
                         progress=progress if show else None)
    except ValueError as e:          # e.g. a text shorter than one window, stride >= ctx
        raise ColibriError(str(e)) from e
    if args.output == "json":
        print(json.dumps({"file": args.file, **res.to_dict()}, indent=1))
    else:
        print(format_markdown(res, source=args.file))
    return 0
