"""colibri convert SRC DST: a Hugging Face model folder or a llama.cpp GGUF file -> one
.colibri file."""
from __future__ import annotations

import argparse
import sys
import time

from ..convert import DEFAULT_QUANTIZE, DTYPES, QUANTS, ROLES, convert, parse_meta
from ..format.quant import DEFAULT_GROUP_SIZE


def register(subparsers, parents=()) -> None:
    p = subparsers.add_parser(
        "convert", parents=list(parents),
        help="convert a Hugging Face checkpoint folder or a GGUF file",
        description="Convert a local Hugging Face model folder (config.json, safetensors, "
                    "tokenizer files) or a llama.cpp GGUF file into one .colibri file. "
                    "Routers, norms and biases stay f32; --quant applies to the --quantize "
                    "roles only. From a GGUF, Q8_0 / Q4_0 / MXFP4 / float tensors are kept "
                    "as they are and --quant (else --dtype, else the nearest format) holds "
                    "the other types (K-quants, IQ*), requantized with the error reported.")
    p.add_argument("src", metavar="SRC", help="Hugging Face model folder or .gguf file")
    p.add_argument("dst", metavar="DST", help="output .colibri file (or an existing folder)")
    p.add_argument("--dtype", choices=DTYPES, default="auto",
                   help="dtype of unquantized weight matrices (auto: the checkpoint's)")
    p.add_argument("--quant", choices=QUANTS, default="none",
                   help="quantize the --quantize roles to 8 or 4 bits with per-group scales")
    p.add_argument("--group-size", type=int, metavar="N", default=None,
                   help=f"q8/q4 scale group size, a multiple of 32 (default: "
                        f"{DEFAULT_GROUP_SIZE}, lowered to divide every quantized row)")
    p.add_argument("--quantize", metavar="ROLES", default=",".join(DEFAULT_QUANTIZE),
                   help=f"comma-separated roles to quantize, from {','.join(ROLES)} "
                        f"(default: %(default)s)")
    p.add_argument("--router-dtype", choices=DTYPES, default="f32",
                   help="dtype of routers and the shared-expert gate (default: f32)")
    p.add_argument("--meta", metavar="KEY=VALUE", nargs="+", action="extend", default=[],
                   help="free-form metadata stored in the file (licence, source, notes)")
    p.add_argument("--force", action="store_true", help="overwrite DST if it exists")
    p.add_argument("--no-checksums", action="store_true", help="skip per-tensor CRC32s")
    p.add_argument("-q", "--quiet", action="store_true", help="no progress bar, no summary")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    start = time.perf_counter()
    dst = convert(args.src, args.dst, dtype=args.dtype, quant=args.quant,
                  group_size=args.group_size, quantize=args.quantize,
                  router_dtype=args.router_dtype, meta=parse_meta(args.meta), force=args.force,
                  checksums=not args.no_checksums, progress=not args.quiet)
    if not args.quiet:
        size = dst.stat().st_size
        print(f"wrote {dst} ({size / 2**20:.1f} MiB) in {time.perf_counter() - start:.1f} s",
              file=sys.stdout)
    return 0
