"""colibri inspect [FILE]: header, metadata, tensors, totals; rows of a tensor; --validate;
--dump-gate --layer L: the router matrix of one MoE layer with row norms and a summary;
--kernels: the kernel path of each matmul class on this machine (colibri.kernels.kernel_paths)."""
from __future__ import annotations

import argparse
import json
import math

import numpy as np

from ..errors import ColibriError, ColibriFormatError
from ..format import ColibriFile
from ..kernels.kernel_paths import (format_kernel_paths, kernel_paths, matmul_formats,
                                    wider_not_chosen)
from ..tools import inspect as report
from .common import ACTIVATIONS_HELP, add_activations_arg, add_model_arg, model_path


def register(subparsers, parents=()) -> None:
    p = subparsers.add_parser(
        "inspect", parents=list(parents), help="show what is inside a .colibri file",
        description="Show the header, metadata, tensor table and totals of a .colibri file; "
                    "the first rows of one tensor; or validate it.")
    add_model_arg(p, "file", "FILE")
    p.add_argument("--tensor", metavar="NAME", help="print the first rows of this tensor "
                   "(dequantized when quantized)")
    p.add_argument("--rows", type=int, default=None, metavar="N", help="rows for --tensor "
                   "(default: 4) or --dump-gate (default: all)")
    p.add_argument("--dump-gate", action="store_true", help="print the router matrix "
                   "(experts x hidden) of the MoE layer given by --layer, with row norms")
    p.add_argument("--layer", type=int, metavar="L", help="layer for --dump-gate")
    p.add_argument("--validate", action="store_true", help="read everything: checksums, "
                   "padding, non-finite values, tensors vs arch; exit 1 on problems")
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.add_argument("--full", action="store_true", help="list every expert tensor")
    p.add_argument("--kernels", action="store_true", help="which kernel path (ISA, body) "
                   "each matmul class of this file runs on here, and why no wider one")
    add_activations_arg(p, "-a", "--activations", help=f"{ACTIVATIONS_HELP}, for --kernels "
                        "(default: int16)")
    p.set_defaults(func=run)


def _finite(x):
    """JSON has no NaN/inf: report them as strings."""
    if isinstance(x, float) and not math.isfinite(x):
        return str(x)
    if isinstance(x, list):
        return [_finite(v) for v in x]
    return x


def _moe_layers(cf: ColibriFile) -> list[int]:
    return sorted(int(n.split(".")[1]) for n in cf.tensors if n.endswith(".moe.router"))


def gate_report(cf: ColibriFile, layer: int, rows: int | None = None) -> dict:
    """The router matrix of `layer` (E, D) as float32 with row norms and a summary (JSON-ready
    apart from 'matrix', a NumPy array)."""
    name = f"layers.{layer}.moe.router"
    if name not in cf.tensors:
        layers = _moe_layers(cf)
        raise ColibriError(f"{cf.path}: layer {layer} has no router (no tensor {name!r}); "
                           f"MoE layers: {', '.join(map(str, layers)) or 'none'}")
    info = cf.tensors[name]
    w = cf.to_float32(name).reshape(info.shape[0], -1)                        # (E, D)
    E, D = w.shape
    finite = np.isfinite(w)
    w64 = np.where(finite, w, 0.0).astype(np.float64)
    norms = np.linalg.norm(w64, axis=1)                                       # (E,)
    unit = w64 / np.where(norms > 0, norms, 1.0)[:, None]
    cos = unit @ unit.T                                                       # (E, E)
    off = cos[~np.eye(E, dtype=bool)] if E > 1 else np.zeros(1)
    i, j = np.unravel_index(np.argmax(np.where(np.eye(E, dtype=bool), -np.inf, cos)), cos.shape) \
        if E > 1 else (0, 0)
    notes = []
    config = report.model_config(cf)
    if config is not None and (E, D) != (config.num_experts, config.hidden_size):
        notes.append(f"shape {E}x{D} is not (num_experts, hidden_size) = "
                     f"({config.num_experts}, {config.hidden_size}): transposed?")
    if not finite.all():
        notes.append(f"{int((~finite).sum())} non-finite values")
    if (norms == 0).any():
        notes.append(f"all-zero rows (experts {np.flatnonzero(norms == 0).tolist()}): "
                     f"never chosen unless every logit ties")
    shown = E if rows is None else min(rows, E)
    return {
        "file": cf.path, "layer": layer, "tensor": report.tensor_record(info),
        "matrix": w[:shown],
        "row_norms": [float(x) for x in norms],
        "summary": {
            "experts": E, "hidden": D,
            "norm_min": float(norms.min()), "norm_min_expert": int(norms.argmin()),
            "norm_max": float(norms.max()), "norm_max_expert": int(norms.argmax()),
            "norm_mean": float(norms.mean()),
            "norm_ratio": float(norms.max() / norms.min()) if norms.min() > 0 else None,
            "cosine_max": float(off.max()), "cosine_max_pair": [int(i), int(j)],
            "cosine_mean_abs": float(np.abs(off).mean()),
            "value_min": float(w64.min()), "value_max": float(w64.max()),
            "value_mean_abs": float(np.abs(w64).mean()), "value_std": float(w64.std()),
            "non_finite": int((~finite).sum()),
        },
        "notes": notes,
    }


def format_gate(g: dict) -> str:
    t, s = g["tensor"], g["summary"]
    dtype = t["dtype"] + (f"/g{t['group_size']}" if t["group_size"] else "")
    lines = [f"{t['name']}: {dtype} {s['experts']}x{s['hidden']} (experts x hidden), layer "
             f"{g['layer']}"]
    wi = len(str(s["experts"] - 1))
    norms = [f"{x:.4g}" for x in g["row_norms"]]
    wn = max(len(x) for x in norms)
    with np.printoptions(precision=4, suppress=False, threshold=8, edgeitems=3, linewidth=200):
        for e, row in enumerate(g["matrix"]):
            lines.append(f"  expert {e:>{wi}}  norm {norms[e]:<{wn}}  "
                         f"{np.array2string(row, separator=' ')}")
    if len(g["matrix"]) < s["experts"]:
        lines.append(f"  ... {s['experts'] - len(g['matrix'])} more experts (--rows)")
    ratio = "n/a" if s["norm_ratio"] is None else f"{s['norm_ratio']:.3g}"
    lines.append(f"row norms: min {s['norm_min']:.4g} (expert {s['norm_min_expert']}), max "
                 f"{s['norm_max']:.4g} (expert {s['norm_max_expert']}), mean "
                 f"{s['norm_mean']:.4g}, max/min {ratio}")
    a, b = s["cosine_max_pair"]
    lines.append(f"cosine between rows: max {s['cosine_max']:.3f} (experts {a} and {b}), "
                 f"mean |cos| {s['cosine_mean_abs']:.3f}")
    lines.append(f"values: min {s['value_min']:.4g}, max {s['value_max']:.4g}, mean |x| "
                 f"{s['value_mean_abs']:.4g}, std {s['value_std']:.4g}, non-finite "
                 f"{s['non_finite']}")
    lines += [f"note: {n}" for n in g["notes"]]
    return "\n".join(lines)


def run(args: argparse.Namespace) -> int:
    if args.rows is not None and args.rows < 1:
        raise ColibriError(f"--rows must be >= 1, found {args.rows}")
    if args.layer is not None and not args.dump_gate:
        raise ColibriError("--layer goes with --dump-gate")
    if args.dump_gate and (args.tensor is not None or args.validate):
        raise ColibriError("--dump-gate cannot be combined with --tensor or --validate")
    args.file = str(model_path(args.file))
    if args.dump_gate:
        with ColibriFile(args.file) as cf:
            if args.layer is None:
                raise ColibriError(f"--dump-gate needs --layer L (MoE layers of {cf.path}: "
                                   f"{', '.join(map(str, _moe_layers(cf))) or 'none'})")
            g = gate_report(cf, args.layer, args.rows)
            if args.json:
                g = dict(g, matrix=_finite(g["matrix"].tolist()))
                print(json.dumps(g, indent=1, allow_nan=False))
            else:
                print(format_gate(g))
        return 0
    try:
        cf = ColibriFile(args.file)
    except ColibriFormatError as e:
        if not args.validate:
            raise
        # a structurally broken file is a validation result, not a usage error
        problems = [str(e)]
        print(json.dumps({"file": args.file, "valid": False, "problems": problems}, indent=1)
              if args.json else f"{args.file}: INVALID\n  {problems[0]}")
        return 1
    if args.kernels:
        with cf:
            formats = matmul_formats(cf.tensors)
        if args.json:
            print(json.dumps({"file": args.file, "activations": args.activations,
                              "kernels": kernel_paths(formats, args.activations),
                              "wider_not_chosen": wider_not_chosen()}, indent=1))
        else:
            print("\n".join(format_kernel_paths(formats, args.activations)))
        return 0
    with cf:
        out = report.summary(cf) if args.json else None
        text: list[str] = []
        if args.tensor is not None:
            rows = report.tensor_rows(cf, args.tensor, args.rows or 4)
            if args.json:
                out = {"file": cf.path, "tensor": report.tensor_record(cf.tensors[args.tensor]),
                       "rows": _finite(rows.tolist())}
            else:
                text.append(report.format_rows(args.tensor, cf.tensors[args.tensor], rows))
        elif not args.json:
            text.append(report.format_summary(report.summary(cf), full=args.full))
        status = 0
        if args.validate:
            problems = report.validate(cf, progress=False)
            status = 1 if problems else 0
            if args.json:
                out.update(valid=not problems, problems=problems)
            else:
                text.append(f"{cf.path}: " + ("valid (structure, checksums, finite values, "
                                               "tensors match the arch and config.json, "
                                               "tokenizer and chat template work)" if not problems else
                                               f"INVALID, {len(problems)} problems"))
                text += [f"  {p}" for p in problems[:50]]
                if len(problems) > 50:
                    text.append(f"  ... and {len(problems) - 50} more")
        if args.json:
            print(json.dumps(out, indent=1, allow_nan=False))
        else:
            print("\n".join(text))
        return status
