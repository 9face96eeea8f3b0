"""colibri inspect FILE: header, metadata, tensors, totals; rows of a tensor; --validate."""
from __future__ import annotations

import argparse
import json
import math

from .. import inspect as report
from ..errors import ColibriError, ColibriFormatError
from ..format import ColibriFile


def register(subparsers, parents=()) -> None:
    p = subparsers.add_parser(
        "inspect", parents=list(parents), help="show what is inside a .colibri file",
        description="Show the header, metadata, tensor table and totals of a .colibri file; "
                    "the first rows of one tensor; or validate it.")
    p.add_argument("file", metavar="FILE", help=".colibri file")
    p.add_argument("--tensor", metavar="NAME", help="print the first rows of this tensor "
                   "(dequantized when quantized)")
    p.add_argument("--rows", type=int, default=4, metavar="N", help="rows for --tensor "
                   "(default: %(default)s)")
    p.add_argument("--validate", action="store_true", help="read everything: checksums, "
                   "padding, non-finite values, tensors vs arch; exit 1 on problems")
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.add_argument("--full", action="store_true", help="list every expert tensor")
    p.set_defaults(func=run)


def _finite(x):
    """JSON has no NaN/inf: report them as strings."""
    if isinstance(x, float) and not math.isfinite(x):
        return str(x)
    if isinstance(x, list):
        return [_finite(v) for v in x]
    return x


def run(args: argparse.Namespace) -> int:
    if args.rows < 1:
        raise ColibriError(f"--rows must be >= 1, found {args.rows}")
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
    with cf:
        out = report.summary(cf) if args.json else None
        text: list[str] = []
        if args.tensor is not None:
            rows = report.tensor_rows(cf, args.tensor, args.rows)
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
                                               "tensors match the arch)" if not problems else
                                               f"INVALID, {len(problems)} problems"))
                text += [f"  {p}" for p in problems[:50]]
                if len(problems) > 50:
                    text.append(f"  ... and {len(problems) - 50} more")
        if args.json:
            print(json.dumps(out, indent=1, allow_nan=False))
        else:
            print("\n".join(text))
        return status
