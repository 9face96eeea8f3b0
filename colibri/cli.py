"""The `colibri` command: argparse with one module per subcommand in colibri/commands/.

Each module exposes `register(subparsers)`, which adds its parser and sets `func(args) -> int`;
the arguments several commands take (MODEL with the shipped model as default, --threads,
--activations, --ctx, --seed, -o) and opening the model come from commands/common.py.
Errors a user can cause (bad arguments, a missing file, a ColibriError) print one line
`colibri <cmd>: error: ...` on stderr and exit 2; `--debug` shows the traceback instead.
"""
from __future__ import annotations

import argparse
import importlib
import os
import sys
import warnings
from typing import Sequence

from . import __version__
from .errors import ColibriError

# modules of colibri/commands/, in the order `colibri --help` lists them
COMMANDS = ("convert", "generate", "inspect", "bench", "perplexity", "routes", "serve")


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
        module = importlib.import_module(f".commands.{name}", __package__)
        module.register(sub, parents=[debug])
    parser.commands = sub.choices          # name -> subparser, for errors in its name
    return parser


def _one_line_warnings(prog: str) -> None:
    def show(message, category, filename, lineno, file=None, line=None):
        print(f"{prog}: warning: {message}", file=file or sys.stderr)
    warnings.showwarning = show


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the console script; returns the exit status (also when called from tests)."""
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
    except (ColibriError, OSError) as e:
        msg = str(e) if not isinstance(e, OSError) or not e.filename else \
            f"{e.filename}: {e.strerror or e}"
        print(f"{prog}: error: {' '.join(msg.split())}", file=sys.stderr)
        return 2
    finally:
        warnings.showwarning = saved


if __name__ == "__main__":
    sys.exit(main())
