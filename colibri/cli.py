"""The `colibri` command: argparse with one module per subcommand in colibri/commands/.

Each module exposes `register(subparsers)`, which adds its parser and sets `func(args) -> int`;
the arguments several commands take (MODEL with the shipped model as default, --threads,
--activations, --ctx, --seed, -o) and opening the model come from commands/common.py.
Errors a user can cause (bad arguments, an argument that is not UTF-8, a missing file, a
ColibriError, a ValueError/TypeError naming an argument, a MemoryError) print one line
`colibri <cmd>: error: ...` on stderr and exit 2; anything else is one line `colibri <cmd>:
internal error: ...` and exit 1; `--debug` (before or after the command) shows the traceback
instead.
"""
from __future__ import annotations

import argparse
import importlib
import os
import sys
import warnings
from typing import Sequence

from .errors import ColibriError
from .version import __version__

# modules of colibri/commands/, in the order `colibri --help` lists them
COMMANDS = ("convert", "generate", "chat", "inspect", "bench", "perplexity", "eval", "routes",
            "serve", "cache-sim")


class Parser(argparse.ArgumentParser):
    """argparse, but a usage error is one line (plus where to find help), exit status 2."""

    def error(self, message: str):
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def build_parser() -> Parser:
    parser = Parser(prog="colibri", description="Run Mixture-of-Experts language models on "
                    "ordinary CPUs, from one mmap'd .colibri file.")
    parser.add_argument("--version", action="version", version=f"colibri {__version__}")
    debug = argparse.ArgumentParser(add_help=False)
    debug.add_argument("--debug", action="store_true", default=argparse.SUPPRESS,
                       help="show the full traceback of an error")
    parser.add_argument("--debug", action="store_true", default=False,
                        help="show the full traceback of an error")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", parser_class=Parser)
    for name in COMMANDS:
        module = importlib.import_module(f".commands.{name.replace('-', '_')}", __package__)
        module.register(sub, parents=[debug])
    parser.commands = sub.choices          # name -> subparser, for errors in its name
    return parser


def _one_line_warnings(prog: str) -> None:
    def show(message, category, filename, lineno, file=None, line=None):
        print(f"{prog}: warning: {message}", file=file or sys.stderr)
    warnings.showwarning = show


def _not_utf8(argv: Sequence[str]) -> str | None:
    """The message for the first argument that is not valid UTF-8, or None. Python gives
    undecodable bytes of the command line as lone surrogates (PEP 383); no text handling
    below can take them."""
    for i, arg in enumerate(argv, 1):
        try:
            arg.encode("utf-8")
        except UnicodeEncodeError as e:
            try:                            # the bytes as they came, when they were bytes
                shown = repr(arg.encode("utf-8", "surrogateescape"))
            except UnicodeEncodeError:      # a lone surrogate that was never a byte
                shown = ascii(arg)
            return (f"argument {i} ({shown[:80]}) is not valid UTF-8 (at character "
                    f"{e.start}); give text as UTF-8")
    return None


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the console script; returns the exit status (also when called from tests)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    bad = _not_utf8(argv)
    if bad is not None:
        print(f"colibri: error: {bad}", file=sys.stderr)
        return 2
    parser = build_parser()
    args, extra = parser.parse_known_args(argv)
    if extra:   # reported by the subcommand's parser, so the message names the command
        where = parser.commands.get(getattr(args, "command", None) or "", parser)
        where.error(f"unrecognized arguments: {' '.join(extra)}")
    if not getattr(args, "command", None):
        parser.print_usage(sys.stderr)
        print(f"colibri: error: choose a command: {', '.join(COMMANDS)}", file=sys.stderr)
        return 2
    prog = f"colibri {args.command}"
    if args.debug:
        return int(args.func(args) or 0)
    saved = warnings.showwarning
    _one_line_warnings(prog)
    try:
        return int(args.func(args) or 0)
    except KeyboardInterrupt:
        print(f"{prog}: interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:
        # the reader went away (`colibri generate ... | head`): stop quietly, as Unix tools do;
        # stdout is pointed at devnull so the interpreter's final flush does not fail again
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0
    except (ColibriError, OSError, ValueError, TypeError, MemoryError) as e:
        msg = str(e) if not isinstance(e, OSError) or not e.filename else \
            f"{e.filename}: {e.strerror or e}"
        if isinstance(e, MemoryError):
            msg = f"out of memory{': ' + msg if msg else ''}"
        print(f"{prog}: error: {' '.join(msg.split()) or type(e).__name__}", file=sys.stderr)
        return 2
    except ModuleNotFoundError as e:        # a base dependency gone from the environment
        print(f"{prog}: error: the module {e.name or e} is not installed; it is a dependency "
              f"of colibri: reinstall colibri with its dependencies (pip install colibri, or "
              f"pip install . in a checkout)", file=sys.stderr)
        return 2
    except Exception as e:                  # noqa: BLE001 - a bug: still one line, --debug for more
        print(f"{prog}: internal error: {type(e).__name__}: {' '.join(str(e).split())[:500]} "
              f"(run with --debug for the traceback)", file=sys.stderr)
        return 1
    finally:
        warnings.showwarning = saved


if __name__ == "__main__":
    sys.exit(main())
