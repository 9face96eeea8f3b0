"""colibri perplexity [MODEL] -f FILE: perplexity over a text, and KL against a base model.

The method is in colibri/perplexity.py and docs/benchmarks.md.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np

from ..errors import ColibriError
from ..kernels import ACTIVATIONS


def register(subparsers, parents=()) -> None:
    p = subparsers.add_parser(
        "perplexity", parents=list(parents), help="perplexity over a text; KL against a base model",
        description="Perplexity of a model over a text file, in windows of --ctx tokens "
                    "(llama-perplexity's scheme: the second half of each non-overlapping window "
                    "is scored; or sliding windows with --stride). With --kl-base, the same "
                    "windows also run through a base model (e.g. the f32 conversion of the same "
                    "checkpoint) and the KL divergence per token, the same-top-token rate and "
                    "the perplexity ratio say what the quantization cost. Without MODEL, the "
                    "small model shipped with colibri is used.")
    p.add_argument("model", nargs="?", metavar="MODEL",
                   help=".colibri file (default: the bundled tiny-moe.colibri)")
    p.add_argument("-f", "--file", required=True, metavar="FILE",
                   help="UTF-8 text file, or a .npy array of token ids")
    p.add_argument("-c", "--ctx", type=int, default=None, metavar="N",
                   help="window length in tokens (default: 512, or the model's context if "
                        "shorter)")
    p.add_argument("--stride", type=int, default=None, metavar="S",
                   help="sliding windows every S tokens (1 <= S < ctx), each scoring the "
                        "tokens no earlier window scored (default: off)")
    p.add_argument("--kl-base", metavar="BASE", default=None,
                   help="base .colibri file with the same tokenizer: report KL(base ‖ model), "
                        "same-top-token rate and the perplexity ratio")
    p.add_argument("-b", "--batch", type=int, default=1, metavar="B",
                   help="windows per forward pass (default: %(default)s)")
    p.add_argument("-t", "--threads", type=int, default=None, metavar="N",
                   help="kernel threads (default: physical cores)")
    p.add_argument("-a", "--activations", choices=ACTIVATIONS, default="f32",
                   help="activations of MODEL's q4/q8 matmuls: f32 (exact), int16 or int8 "
                        "(faster); the base always runs f32, so --kl-base MODEL measures their "
                        "cost (default: %(default)s)")
    p.add_argument("-o", "--output", choices=("md", "json"), default="md",
                   help="markdown tables or JSON (default: %(default)s)")
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
    from ..api import default_model_path
    from ..perplexity import MIN_CTX, format_markdown, perplexity

    for flag, value, minimum in (("--ctx", args.ctx, MIN_CTX), ("--stride", args.stride, 1),
                                 ("--batch", args.batch, 1), ("--threads", args.threads, 1)):
        if value is not None and value < minimum:
            raise ColibriError(f"{flag} {value} is out of range (must be >= {minimum})")
    data = _read_data(args.file)
    model = args.model if args.model is not None else default_model_path()
    show = args.output == "md" and sys.stderr.isatty()

    def progress(done: int, total: int) -> None:
        print(f"\rwindows {done}/{total}", end="\n" if done == total else "", file=sys.stderr,
              flush=True)

    try:
        res = perplexity(model, data, ctx=args.ctx, stride=args.stride, batch=args.batch,
                         base=args.kl_base, threads=args.threads, activations=args.activations,
                         progress=progress if show else None)
    except ValueError as e:          # e.g. a text shorter than one window, stride >= ctx
        raise ColibriError(str(e)) from e
    if args.output == "json":
        print(json.dumps({"file": args.file, **res.to_dict()}, indent=1))
    else:
        print(format_markdown(res, source=args.file))
    return 0
