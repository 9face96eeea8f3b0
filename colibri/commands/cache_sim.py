"""colibri cache-sim TRACE: replay recorded routing through expert-cache policies and budgets.

TRACE is an .npz of `colibri routes --save` (or Trace.save). Budgets are memory budgets as
`--memory-budget` reads them (the dense part of --model FILE comes off the top), or plain slot
counts with --slots. Prints hit rate, misses and MB read per token and, with --bandwidth, the
predicted tokens/s; --plot OUT.png draws hit rate vs budget per policy (colibri.tools.cache_sim).
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from ..errors import ColibriError
from ..experts.eviction import POLICIES, CacheFullError
from ..tools.cache_sim import CacheGeometry, format_table, plot_hit_rates, sweep
from ..tools.trace import Trace
from .common import byte_size, int_list


def _list(kind):
    def parse(text: str) -> list:
        return [kind(v) for v in text.split(",")]
    return parse


def _policies(text: str) -> list[str]:
    names = text.split(",")
    bad = [n for n in names if n not in POLICIES]
    if bad:
        raise argparse.ArgumentTypeError(f"unknown policy {', '.join(bad)} (expected among "
                                         f"{', '.join(POLICIES)})")
    return names


def register(subparsers, parents=()) -> None:
    p = subparsers.add_parser(
        "cache-sim", parents=list(parents), help="simulate the expert cache on a routing trace",
        description="Replay a routing trace (colibri routes --save) through expert-cache "
                    "policies and memory budgets: hit rate, bytes read per token, predicted "
                    "tokens/s for a disk bandwidth.")
    p.add_argument("trace", metavar="TRACE", help=".npz routing trace (colibri routes --save)")
    p.add_argument("-m", "--model", metavar="FILE",
                   help="the .colibri file the trace was made with: its dense part and "
                        "block size turn --budget into slots")
    size = p.add_mutually_exclusive_group(required=True)
    size.add_argument("--budget", type=_list(byte_size), metavar="SIZES",
                      help="memory budgets, comma-separated (1GiB,1.5GiB), as --memory-budget")
    size.add_argument("--slots", type=int_list(1), metavar="N",
                      help="expert slots, comma-separated (no model needed)")
    p.add_argument("--policy", type=_policies, default=list(POLICIES), metavar="P",
                   help=f"policies, comma-separated (default: all: {','.join(POLICIES)})")
    p.add_argument("--chunk", type=int, default=1, metavar="N",
                   help="tokens per forward call: 1 replays a decode (default), more a prefill")
    p.add_argument("--bandwidth", type=float, default=None, metavar="GBS",
                   help="disk read bandwidth in GB/s, for the predicted tokens/s")
    p.add_argument("--compute-tps", type=float, default=None, metavar="TPS",
                   help="decode speed with every expert in memory (adds the compute time)")
    p.add_argument("--plot", metavar="OUT.png", help="hit rate vs budget per policy")
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    if not Path(args.trace).is_file():
        raise ColibriError(f"{args.trace}: no such file")
    if args.chunk < 1:
        raise ColibriError(f"--chunk must be >= 1, found {args.chunk}")
    if args.budget is not None and args.model is None:
        raise ColibriError("--budget needs --model FILE (its dense part and block size); or "
                           "give --slots")
    with open(args.trace, "rb") as f:
        if f.read(4) != b"PK\x03\x04":         # numpy's message for that is about pickles
            raise ColibriError(f"{args.trace}: not a routing trace (not an .npz archive; "
                               f"colibri routes --save writes one)")
    try:
        tr = Trace.load(args.trace)
    except (OSError, ValueError, KeyError) as e:
        raise ColibriError(f"{args.trace}: not a routing trace ({e})") from None
    geo = CacheGeometry.of_file(args.model) if args.model else None
    if args.budget is not None:
        slots = [geo.slots_for(b) for b in args.budget]
        small = [b for b, n in zip(args.budget, slots) if n < tr.n_experts]
        if small:
            raise ColibriError(f"budget {small[0]} bytes leaves {geo.slots_for(small[0])} expert "
                               f"slots after the dense part ({geo.dense_bytes} bytes); a layer "
                               f"needs {tr.n_experts}")
    else:
        slots = args.slots
    try:
        results = sweep(tr.experts, slots, args.policy, geometry=geo, budgets=args.budget,
                        n_experts=tr.n_experts, chunk=args.chunk)
    except CacheFullError as e:
        raise ColibriError(str(e)) from None
    bw = args.bandwidth * 1e9 if args.bandwidth else None
    if args.plot:
        try:
            plot_hit_rates(results).savefig(args.plot, dpi=120)
        except ImportError as e:
            raise ColibriError(str(e)) from None
        print(f"wrote {args.plot}", file=sys.stderr)
    if args.json:
        print(json.dumps({"trace": args.trace, "tokens": len(tr), "layers": tr.layers,
                          "results": [r.summary(bw, args.compute_tps) for r in results]},
                         indent=1))
    else:
        print(f"{args.trace}: {len(tr)} tokens, {tr.n_layers} MoE layers, top-{tr.top_k} of "
              f"{tr.n_experts}" + (f"; slot {geo.slot_bytes / 2**20:.2f} MiB, dense "
                                   f"{geo.dense_bytes / 2**20:.1f} MiB" if geo else ""))
        print(format_table(results, bw, args.compute_tps))
    return 0
