"""colibri bench [MODEL]: prompt-processing and generation speed, in llama-bench's table.

The method is in colibri/bench.py and docs/benchmarks.md.
"""
from __future__ import annotations

import argparse
import json
import sys


def int_list(minimum: int):
    """argparse type: '128' or '1,2,4' -> [ints], each >= minimum (llama-bench's list syntax)."""
    def parse(text: str) -> list[int]:
        try:
            values = [int(v) for v in text.split(",")]
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not an integer or a comma-separated "
                                             f"list of integers") from None
        bad = [v for v in values if v < minimum]
        if bad:
            raise argparse.ArgumentTypeError(f"{text!r}: values must be >= {minimum}")
        return values
    return parse


def act_list(text: str) -> list[str]:
    """argparse type: 'f32' or 'f32,int16,int8' -> [names] (colibri.kernels.ACTIVATIONS)."""
    from ..kernels import ACTIVATIONS

    values = text.split(",")
    bad = [v for v in values if v not in ACTIVATIONS]
    if bad:
        raise argparse.ArgumentTypeError(f"{text!r}: activations must be among "
                                         f"{', '.join(ACTIVATIONS)}")
    return values


def register(subparsers, parents=()) -> None:
    from ..bench import DEFAULT_BANDWIDTH_BYTES

    p = subparsers.add_parser(
        "bench", parents=list(parents), help="measure prompt and generation speed",
        description="Measure prompt processing (ppP: one forward pass over P random tokens) "
                    "and text generation (tgN: N single-token decode steps) in tokens per "
                    "second, mean ± sd over repetitions, in the shape of llama-bench's table; "
                    "plus peak RSS, open time, where the time goes, and decode speed as a "
                    "fraction of the memory-bandwidth ceiling. Without MODEL, the small model "
                    "shipped with colibri is used.")
    p.add_argument("model", nargs="?", metavar="MODEL",
                   help=".colibri file (default: the bundled tiny-moe.colibri)")
    p.add_argument("-p", "--n-prompt", type=int_list(0), default=[128], metavar="P",
                   help="prompt tokens of the pp test, a list allowed (1,128); 0 = no pp test "
                        "(default: 128)")
    p.add_argument("-n", "--n-gen", type=int_list(0), default=[64], metavar="N",
                   help="decode steps of the tg test, a list allowed; 0 = no tg test "
                        "(default: 64)")
    p.add_argument("-t", "--threads", type=int_list(1), default=None, metavar="T",
                   help="kernel threads, a list allowed (1,2) (default: physical cores)")
    p.add_argument("-r", "--repetitions", type=int, default=5, metavar="R",
                   help="timed repetitions of each test (default: %(default)s)")
    p.add_argument("-d", "--depth", type=int, default=0, metavar="D",
                   help="tokens already in the KV cache when a test starts (default: 0)")
    p.add_argument("-a", "--activations", type=act_list, default=["f32"], metavar="A",
                   help="activations of the q4/q8 matmuls: f32 (exact to the stored weights), "
                        "int16 (16-bit codes per 32 values: within ~1e-4, faster) or int8 "
                        "(8-bit codes, like llama.cpp: fastest), a list allowed (f32,int16,int8) "
                        "(default: f32)")
    p.add_argument("-o", "--output", choices=("md", "json"), default="md",
                   help="markdown table or JSON list of results (default: %(default)s)")
    p.add_argument("--no-warmup", action="store_true", help="skip the untimed warm-up run")
    p.add_argument("--seed", type=int, default=0, metavar="S",
                   help="seed of the random token ids (default: %(default)s)")
    p.add_argument("--bw-mib", type=int, default=DEFAULT_BANDWIDTH_BYTES // 2**20, metavar="MIB",
                   help="buffer of the read-bandwidth measurement in MiB; 0 = skip it and "
                        "the roofline ceiling (default: %(default)s)")
    p.add_argument("-q", "--quiet", action="store_true", help="no progress lines on stderr")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from ..api import default_model_path
    from ..bench import json_ready, format_markdown, run_bench
    from ..errors import ColibriError

    for flag, value, minimum in (("-r", args.repetitions, 1), ("-d", args.depth, 0),
                                 ("--bw-mib", args.bw_mib, 0)):
        if value < minimum:
            raise ColibriError(f"{flag} {value} is out of range (must be >= {minimum})")
    if not any(args.n_prompt) and not any(args.n_gen):
        raise ColibriError("nothing to run: -p and -n are both 0")
    show = not args.quiet and sys.stderr.isatty()
    try:
        rows = run_bench(args.model if args.model is not None else default_model_path(),
                         n_prompt=args.n_prompt, n_gen=args.n_gen, threads=args.threads,
                         reps=args.repetitions, depth=args.depth, warmup=not args.no_warmup,
                         seed=args.seed, activations=args.activations,
                         bandwidth_bytes=args.bw_mib * 2**20,
                         progress=(lambda line: print(line, file=sys.stderr, flush=True))
                         if show else None)
    except ValueError as e:          # arguments the model cannot take (e.g. beyond its context)
        raise ColibriError(str(e)) from e
    if args.output == "json":
        print(json.dumps(json_ready(rows), indent=1, allow_nan=False))
    else:
        print(format_markdown(rows))
    return 0
