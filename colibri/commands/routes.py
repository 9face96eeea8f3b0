"""colibri routes [MODEL] (-p PROMPT | -f FILE): which experts each token chose, and statistics.

With -p, one aligned line per token ("token 0 'def' → L0 [3 0.62, 5 0.38]  L1 [...]") then
the statistics of colibri.tools.stats (utilisation, balance, entropy, persistence, LRU hit rates).
With -f, the file is streamed through the model in windows and only the statistics are kept
(memory O(layers x experts²)); --table prints every token's line as it goes.
--plot OUT.png saves a figure: the token x layer map for a prompt, the utilisation heatmap
for a file (--plot-kind chooses). --json prints one JSON object instead of text.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from ..errors import ColibriError
from ..tools import plot
from ..tools.stats import RoutingStats
from ..tools.trace import iter_trace, trace as trace_of
from ..tools.trace import Trace
from .common import (SHIPPED_MODEL, add_ctx_arg, add_kv_dtype_arg, add_memory_args,
                     add_model_arg, add_threads_arg, open_model)

PLOT_KINDS = ("auto", "heatmap", "tokens", "coactivation")


def register(subparsers, parents=()) -> None:
    p = subparsers.add_parser(
        "routes", parents=list(parents), help="show the experts each token is routed to",
        description="Run a prompt or a text file through a .colibri model and show, per token "
                    "and MoE layer, the experts chosen with their weights, then expert "
                    f"statistics. {SHIPPED_MODEL}")
    add_model_arg(p)
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("-p", "--prompt", help="the text to route")
    src.add_argument("-f", "--file", metavar="FILE",
                     help="a text file, streamed in windows (statistics only, unless --table)")
    p.add_argument("--layer", type=int, metavar="L", help="only this MoE layer")
    p.add_argument("--plot", metavar="OUT.png", help="save a figure (needs matplotlib)")
    p.add_argument("--plot-kind", choices=PLOT_KINDS, default="auto",
                   help="auto: token map for -p, heatmap for -f; coactivation uses --layer "
                        "(default: the first MoE layer) (default: %(default)s)")
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.add_argument("--save", metavar="TRACE.npz",
                   help="write the routing of every token (a Trace, for colibri cache-sim)")
    p.add_argument("--table", action="store_true", help="with -f: also print every token's "
                   "routing")
    add_threads_arg(p)
    add_kv_dtype_arg(p)
    add_memory_args(p)
    p.add_argument("--max-tokens", type=int, default=None, metavar="N",
                   help="route at most N tokens (default: all)")
    add_ctx_arg(p, help="tokens per window: longer text restarts with an empty cache "
                        "(default: the model's context, at most 4096)")
    p.add_argument("--batch", type=int, default=256, metavar="N",
                   help="tokens per forward pass (default: %(default)s)")
    p.set_defaults(func=run)


def _check(args, model) -> None:
    for name, value in (("--threads", args.threads), ("--max-tokens", args.max_tokens),
                        ("--ctx", args.ctx), ("--batch", args.batch)):
        if value is not None and value < 1:
            raise ColibriError(f"{name} must be >= 1, found {value}")
    if args.ctx is not None and args.ctx > model.max_context:
        raise ColibriError(f"--ctx {args.ctx} exceeds the model's context length "
                           f"{model.max_context}")
    moe_layers = model.config.moe_layer_ids
    if args.layer is not None and args.layer not in moe_layers:
        raise ColibriError(f"layer {args.layer} is not a MoE layer of {model.file.path} "
                           f"(MoE layers: {', '.join(map(str, moe_layers))})")
    if args.table and args.prompt is not None:
        raise ColibriError("--table is for -f FILE; with -p the table is always printed")
    if args.plot_kind == "tokens" and args.file is not None:
        raise ColibriError("--plot-kind tokens needs a prompt (-p): a file is not traced "
                           "token by token")
    if args.prompt is not None and model.tokenizer is None:
        raise ColibriError(f"{model.file.path} has no tokenizer, so text cannot be encoded")
    if args.prompt == "":
        raise ColibriError("the prompt is empty")


def _plot(args, trace, stats) -> None:
    try:        # plot imports matplotlib when it draws: ImportError without it
        kind = args.plot_kind
        if kind == "auto":
            kind = "tokens" if trace is not None else "heatmap"
        if kind == "tokens":
            fig = plot.token_map(trace)
        elif kind == "heatmap":
            fig = plot.expert_heatmap(stats)
        else:
            fig = plot.coactivation(stats, args.layer)
    except ImportError as e:
        raise ColibriError(str(e)) from None
    fig.savefig(args.plot, dpi=120)
    print(f"wrote {args.plot} ({kind})", file=sys.stderr)


def run(args: argparse.Namespace) -> int:
    if args.file is not None and not Path(args.file).is_file():
        raise ColibriError(f"{args.file}: no such file")
    model = open_model(args)
    _check(args, model)
    layers = None if args.layer is None else [args.layer]
    kw = dict(batch_size=args.batch, max_tokens=args.max_tokens, window=args.ctx)
    out: dict = {"model": str(model.file.path)}
    tr = None
    if args.prompt is not None:
        tr = trace_of(model, args.prompt, **kw)
        if layers:
            tr = tr.select_layers(layers)
        stats = tr.stats()
        out.update(prompt=args.prompt, trace=tr.to_dict())
        if not args.json:
            print(tr.format_table())
            print()
    else:
        stats, rows, seen, parts = None, [], 0, []
        for part in iter_trace(model, Path(args.file), **kw):
            if args.save:
                parts.append(part)
            if layers:
                part = part.select_layers(layers)
            if stats is None:
                stats = RoutingStats(part.layers, part.n_experts, part.top_k)
            stats.update(part)
            if args.table:
                if args.json:
                    d = part.to_dict()["tokens"]
                    for r in d:
                        r["index"] += seen
                    rows += d
                else:
                    print(part.format_table(offset=seen), flush=True)
            seen += len(part)
        if stats is None:
            raise ColibriError(f"{args.file}: no tokens (empty file)")
        if args.save:
            tr = Trace.concat(parts)
        out["file"] = args.file
        if args.table and args.json:
            out["trace"] = {"layers": stats.layers, "n_experts": stats.n_experts,
                            "top_k": stats.top_k, "tokens": rows}
        if args.table and not args.json:
            print()
    out["stats"] = stats.summary()
    if args.save:
        tr.save(args.save)
        print(f"wrote {args.save} ({len(tr)} tokens)", file=sys.stderr)
    if args.plot:
        _plot(args, tr if args.prompt is not None else None, stats)
    if args.json:
        print(json.dumps(out, indent=1, ensure_ascii=False, allow_nan=False))
    else:
        print(stats.format_summary())
    return 0
