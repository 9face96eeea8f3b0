"""Running `colibri` subcommands in-process from tests, and checking their one-line errors."""
from __future__ import annotations

from colibri.cli import main


def run(capsys, *argv) -> tuple[int, str, str]:
    """(exit status, stdout, stderr) of `colibri ARGV...`; arguments may be paths or numbers."""
    try:
        code = main([str(a) for a in argv])
    except SystemExit as e:              # argparse --help / --version / usage errors
        code = e.code
    out, err = capsys.readouterr()
    return code, out, err


def one_line_error(err: str, command: str) -> str:
    """The single stderr line `colibri COMMAND: error: ...` (fails if there is anything else)."""
    lines = err.strip().splitlines()
    assert len(lines) == 1, err
    assert lines[0].startswith(f"colibri {command}: error: "), err
    return lines[0]
