"""colibri bench [MODEL]: prompt-processing and generation speed, in llama-bench's table.

The method is in colibri/tools/bench.py and docs/benchmarks.md.
"""
from __future__ import annotations

import argparse
import json
import sys

from ..errors import ColibriError
from ..tools.bench import DEFAULT_BANDWIDTH_BYTES, format_markdown, json_ready, run_bench
from .common import (ACTIVATIONS_HELP, SHIPPED_MODEL, add_activations_arg, add_kv_dtype_arg,
                     add_memory_args, add_model_arg, add_output_arg, add_seed_arg, add_threads_arg,
                     check_at_least, int_list, memory_options, model_path)


def register(subparsers, parents=()) -> None:
    p = subparsers.add_parser(
        "bench", parents=list(parents), help="measure prompt and generation speed",
        description="Measure prompt processing (ppP: one forward pass over P random tokens) "
                    "and text generation (tgN: N single-token decode steps) in tokens per "
                    "second, mean ± sd over repetitions, in the shape of llama-bench's table; "
                    "plus peak RSS, open time, where the time goes, and decode speed as a "
                    f"fraction of the memory-bandwidth ceiling. {SHIPPED_MODEL}")
    add_model_arg(p)
    p.add_argument("-p", "--n-prompt", type=int_list(0), default=[128], metavar="P",
                   help="prompt tokens of the pp test, a list allowed (1,128); 0 = no pp test "
                        "(default: 128)")
    p.add_argument("-n", "--n-gen", type=int_list(0), default=[64], metavar="N",
                   help="decode steps of the tg test, a list allowed; 0 = no tg test "
                        "(default: 64)")
    add_threads_arg(p, lists=True,
                    help="kernel threads, a list allowed (1,2) (default: physical cores)")
    p.add_argument("-r", "--repetitions", type=int, default=5, metavar="R",
                   help="timed repetitions of each test (default: %(default)s)")
    p.add_argument("-d", "--depth", type=int_list(0), default=[0], metavar="D",
                   help="tokens already in the KV cache when a test starts, a list allowed "
                        "(0,4096) (default: 0)")
    add_activations_arg(p, "-a", "--activations", lists=True,
                        help=f"{ACTIVATIONS_HELP}, a list allowed (f32,int16,int8) "
                             f"(default: int16)")
    add_kv_dtype_arg(p, lists=True, help="storage of the KV cache, a list allowed (f32,f16): "
                                         "f16, bf16 or f32")
    add_output_arg(p, help="markdown table or JSON list of results (default: %(default)s)")
    p.add_argument("--no-warmup", action="store_true", help="skip the untimed warm-up run")
    add_seed_arg(p, 0, help="seed of the random token ids (default: %(default)s)")
    p.add_argument("--bw-mib", type=int, default=DEFAULT_BANDWIDTH_BYTES // 2**20, metavar="MIB",
                   help="buffer of the read-bandwidth measurement in MiB; 0 = skip it and "
                        "the roofline ceiling (default: %(default)s)")
    p.add_argument("--telemetry", action="store_true",
                   help="record every timed token's expert hits / misses and bytes read "
                        "(mincore, or the expert cache's counters); page faults per token "
                        "are always shown")
    add_memory_args(p)
    p.add_argument("-q", "--quiet", action="store_true", help="no progress lines on stderr")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    check_at_least((("-r", args.repetitions, 1), ("--bw-mib", args.bw_mib, 0)))
    if not any(args.n_prompt) and not any(args.n_gen):
        raise ColibriError("nothing to run: -p and -n are both 0")
    show = not args.quiet and sys.stderr.isatty()
    try:
        rows = run_bench(model_path(args.model),
                         n_prompt=args.n_prompt, n_gen=args.n_gen, threads=args.threads,
                         reps=args.repetitions, depth=args.depth, warmup=not args.no_warmup,
                         seed=args.seed, activations=args.activations, kv_dtype=args.kv_dtype,
                         bandwidth_bytes=args.bw_mib * 2**20, telemetry=args.telemetry,
                         load_options=memory_options(args),
                         progress=(lambda line: print(line, file=sys.stderr, flush=True))
                         if show else None)
    except ValueError as e:          # arguments the model cannot take (e.g. beyond its context)
        raise ColibriError(str(e)) from e
    if args.output == "json":
        print(json.dumps(json_ready(rows), indent=1, allow_nan=False))
    else:
        print(format_markdown(rows))
    return 0
