"""The arguments the commands share, defined once, and opening the model they name.

Each `add_*` adds one argument where the command's parser lists it (so `--help` keeps each
command's order); the flag spellings a command accepts (`-t` beside `--threads`, ...) and, where
the meaning differs (`--ctx` is a KV cache size for generate, a window for perplexity and
routes), the help text are the command's; type, default and metavar come from here.
"""
from __future__ import annotations

import argparse
import re
from collections.abc import Callable, Sequence
from pathlib import Path

from ..api import default_model_path, load
from ..engine.kv_cache import DEFAULT_KV_DTYPE, KV_DTYPES, kv_dtype_name
from ..engine.model import DEFAULT_ACTIVATIONS, Model
from ..errors import ColibriError
from ..experts.eviction import POLICIES
from ..experts.expert_cache import DEFAULT_POLICY, MODES
from ..experts.prefetch import PREDICTORS
from ..kernels import ACTIVATIONS
from ..kernels.runtime import MAX_THREADS

MODEL_HELP = ".colibri file (default: the bundled tiny-moe.colibri)"
SHIPPED_MODEL = "Without MODEL, the small model shipped with colibri is used."
THREADS_HELP = "kernel threads (default: physical cores)"
ACTIVATIONS_HELP = ("activations of the q4/q8 matmuls: int16 (16-bit codes per 32 values, "
                    "logits within ~1e-4 of exact, ~2x f32's decode speed), f32 (exact to the "
                    "stored weights) or int8 (8-bit codes like llama.cpp: fastest, ~1e-2); "
                    "f32/f16/bf16 matrices always use f32")
KV_DTYPE_HELP = ("storage of the KV cache: f16 (half the bytes of f32, faster decode at depth), "
                 "bf16 or f32 (exact); llama.cpp's and vLLM's spellings (fp16, float16, "
                 "bfloat16, fp32) are accepted; docs/accuracy.md has the logits cost")


# --- argparse types ---------------------------------------------------------------------------

def int_list(minimum: int, maximum: int | None = None) -> Callable[[str], list[int]]:
    """argparse type: '128' or '1,2,4' -> [ints], each >= minimum (and <= maximum when
    given; llama-bench's list syntax)."""
    def parse(text: str) -> list[int]:
        try:
            values = [int(v) for v in text.split(",")]
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not an integer or a comma-separated "
                                             f"list of integers") from None
        bad = [v for v in values if v < minimum or (maximum is not None and v > maximum)]
        if bad:
            raise argparse.ArgumentTypeError(
                f"{text!r}: values must be >= {minimum}"
                + (f" and <= {maximum}" if maximum is not None else ""))
        return values
    return parse


def thread_count(text: str) -> int:
    """argparse type: a thread count in 1..MAX_THREADS (the kernels' pool)."""
    try:
        n = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
    if not 1 <= n <= MAX_THREADS:
        raise argparse.ArgumentTypeError(f"{n} threads: must be in 1..{MAX_THREADS} (the "
                                         f"kernels' thread pool)")
    return n


def activation_list(text: str) -> list[str]:
    """argparse type: 'f32' or 'f32,int16,int8' -> [names] (colibri.kernels.ACTIVATIONS)."""
    values = text.split(",")
    bad = [v for v in values if v not in ACTIVATIONS]
    if bad:
        raise argparse.ArgumentTypeError(f"{text!r}: activations must be among "
                                         f"{', '.join(ACTIVATIONS)}")
    return values


# --- the arguments ----------------------------------------------------------------------------

class _ModelArg(argparse.Action):
    """Stores the model file given as the positional MODEL or as -m/--model (llama.cpp's
    spelling) into one dest; both given and different is a usage error. argparse may match an
    absent optional positional (as None) before or after -m, so None never overwrites."""

    def __call__(self, parser, namespace, values, option_string=None):
        if values is None:
            return
        given = getattr(namespace, self.dest, None)
        if given is not None and given != values:
            raise argparse.ArgumentError(self, f"two different models: {given!r} and "
                                               f"{values!r} (give MODEL or -m MODEL, not both)")
        setattr(namespace, self.dest, values)


def add_model_arg(p: argparse.ArgumentParser, dest: str = "model", metavar: str = "MODEL") -> None:
    """The optional positional .colibri file, or the same as -m/--model FILE (llama.cpp's
    flag); model_path() gives the shipped model without either."""
    p.add_argument(dest, nargs="?", metavar=metavar, action=_ModelArg, help=MODEL_HELP)
    p.add_argument("-m", "--model", dest=dest, metavar=metavar, action=_ModelArg,
                   default=None, help=f"the {metavar} argument, as llama.cpp spells it")


def add_threads_arg(p: argparse.ArgumentParser, *flags: str, lists: bool = False,
                    help: str = THREADS_HELP) -> None:
    """-t/--threads N (None: physical cores); lists: '1,2' runs each count (bench)."""
    p.add_argument(*(flags or ("-t", "--threads")), dest="threads", default=None,
                   type=int_list(1, MAX_THREADS) if lists else thread_count,
                   metavar="T" if lists else "N", help=help)


def add_activations_arg(p: argparse.ArgumentParser, *flags: str, help: str,
                        lists: bool = False) -> None:
    """--activations f32|int16|int8 (default int16, DEFAULT_ACTIVATIONS); lists: 'f32,int8'
    runs each (bench)."""
    if lists:
        p.add_argument(*(flags or ("--activations",)), dest="activations",
                       type=activation_list, default=[DEFAULT_ACTIVATIONS], metavar="A",
                       help=help)
    else:
        p.add_argument(*(flags or ("--activations",)), dest="activations", choices=ACTIVATIONS,
                       default=DEFAULT_ACTIVATIONS, help=help)


def kv_dtype_arg(text: str) -> str:
    """argparse type: a KV cache dtype spelling -> its name (colibri.engine.kv_cache.KV_DTYPES)."""
    try:
        return kv_dtype_name(text, "--kv-dtype")
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def kv_dtype_list(text: str) -> list[str]:
    """argparse type: 'f16' or 'f32,f16,bf16' -> [names] (bench runs each)."""
    return [kv_dtype_arg(v) for v in text.split(",")]


def add_kv_dtype_arg(p: argparse.ArgumentParser, help: str = KV_DTYPE_HELP,
                     lists: bool = False) -> None:
    """--kv-dtype f16|bf16|f32 (alias --kv-cache-dtype, vLLM's name; default f16,
    DEFAULT_KV_DTYPE); lists: 'f32,f16' runs each (bench)."""
    p.add_argument("--kv-dtype", "--kv-cache-dtype", dest="kv_dtype",
                   type=kv_dtype_list if lists else kv_dtype_arg,
                   default=[DEFAULT_KV_DTYPE] if lists else DEFAULT_KV_DTYPE,
                   metavar="|".join(KV_DTYPES), help=f"{help} (default: {DEFAULT_KV_DTYPE})")


def add_ctx_arg(p: argparse.ArgumentParser, *flags: str, help: str) -> None:
    """-c/--ctx N (llama.cpp's -c/--ctx-size), tokens (None: the command's default, said in
    `help`)."""
    p.add_argument(*(flags or ("-c", "--ctx", "--ctx-size")), dest="ctx", type=int, default=None, metavar="N",
                   help=help)


def add_seed_arg(p: argparse.ArgumentParser, default: int | None, help: str) -> None:
    """-s/--seed S, llama.cpp's flag (default: the command's: bench draws its ids from 0,
    generate from a fresh one)."""
    p.add_argument("-s", "--seed", type=int, default=default, metavar="S", help=help)


_SIZE = re.compile(r"\s*(\d+(?:\.\d+)?)\s*([KMGT]?)(i?B?)\s*", re.IGNORECASE)


def byte_size(text: str) -> int:
    """argparse type: '6GiB', '1.5G', '800MiB', '4096' -> bytes (K/M/G/T are powers of 1024,
    as llama.cpp and free -h read them)."""
    m = _SIZE.fullmatch(text)
    if m is None:
        raise argparse.ArgumentTypeError(f"{text!r} is not a size (examples: 6GiB, 1.5G, "
                                         f"800MiB, 4096)")
    scale = 1024 ** " KMGT".index(m.group(2).upper() or " ")
    return int(float(m.group(1)) * scale)


def add_memory_args(p: argparse.ArgumentParser) -> None:
    """--memory-budget SIZE, --mlock, --no-mmap (colibri.load's memory_budget, mlock, mmap)."""
    p.add_argument("--memory-budget", type=byte_size, default=None, metavar="SIZE",
                   help="memory the weights may use (6GiB, 1.5G): the dense part stays "
                        "resident, experts live in a cache of the rest (default: no limit, "
                        "the page cache decides)")
    p.add_argument("--mlock", action="store_true",
                   help="lock the resident weights in memory (where the system allows)")
    p.add_argument("--no-mmap", dest="mmap", action="store_false",
                   help="read the weights into memory instead of mapping the file (with "
                        "--memory-budget: only the dense part; experts are read into the "
                        "cache)")
    p.add_argument("--cache-policy", choices=POLICIES, default=DEFAULT_POLICY,
                   help="with --memory-budget: which expert block to evict (default: "
                        "%(default)s)")
    p.add_argument("--cache-mode", choices=MODES, default="arena",
                   help="with --memory-budget: arena (blocks read into a pinned arena) or "
                        "madvise (the mapping, WILLNEED / DONTNEED) (default: %(default)s)")
    p.add_argument("--prefetch", choices=PREDICTORS, default=None,
                   help="with --memory-budget: read the next layer's likely experts ahead, "
                        "predicted by its router on the current hidden state, the previous "
                        "token's choices, or both (default: off)")


def memory_options(args: argparse.Namespace) -> dict:
    """colibri.load's memory keyword arguments from add_memory_args's flags."""
    out = {"memory_budget": getattr(args, "memory_budget", None),
           "mlock": getattr(args, "mlock", False), "mmap": getattr(args, "mmap", True)}
    if out["memory_budget"] is not None:
        out.update(cache_policy=args.cache_policy, cache_mode=args.cache_mode,
                   prefetch=args.prefetch)
    return out


def add_output_arg(p: argparse.ArgumentParser, help: str) -> None:
    """-o/--output md|json."""
    p.add_argument("-o", "--output", choices=("md", "json"), default="md", help=help)


# --- using them -------------------------------------------------------------------------------

def model_path(path: str | None) -> str | Path:
    """The MODEL argument as given, or the shipped model when it was left out."""
    return path if path is not None else default_model_path()


def open_model(args: argparse.Namespace) -> Model:
    """The Model of args.model with args.threads, args.activations and args.kv_dtype (the
    defaults, int16 and f16, when the command has no such flag)."""
    return load(model_path(args.model), threads=args.threads,
                activations=getattr(args, "activations", DEFAULT_ACTIVATIONS),
                kv_dtype=getattr(args, "kv_dtype", DEFAULT_KV_DTYPE), **memory_options(args))


def check_at_least(limits: Sequence[tuple[str, int | None, int]]) -> None:
    """ColibriError for the first (flag, value, minimum) whose value (None: unset) is below."""
    for flag, value, minimum in limits:
        if value is not None and value < minimum:
            raise ColibriError(f"{flag} {value} is out of range (must be >= {minimum})")
