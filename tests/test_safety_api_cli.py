"""One CLI error style (issue 15): the real `colibri` command, in subprocesses, on bad input:
exactly one stderr line `colibri...: error: ...`, exit status 2, no traceback; --debug (before
or after the command) shows the traceback instead."""
from __future__ import annotations

import os
import subprocess
import sys

import pytest

from colibri.api import default_model_path

MODEL = str(default_model_path())


def colibri(*argv: str | bytes, stdin: bytes | None = None) -> subprocess.CompletedProcess:
    """`colibri ARGV...` as the console script runs it (python -m colibri), bytes argv allowed."""
    env = dict(os.environ, RUST_BACKTRACE="0")
    return subprocess.run([sys.executable, "-m", "colibri", *argv], capture_output=True,
                          timeout=120, env=env, input=stdin)


def assert_one_line_error(p: subprocess.CompletedProcess, *fragments: str) -> str:
    err = p.stderr.decode("utf-8", "replace")
    lines = err.strip().splitlines()
    assert p.returncode == 2, (p.returncode, err)
    assert len(lines) == 1, err
    assert lines[0].startswith("colibri") and ": error: " in lines[0], err
    assert "Traceback" not in err
    for f in fragments:
        assert f in lines[0], lines[0]
    return lines[0]


CASES = {
    "empty prompt": (["generate", MODEL, "-p", ""], ["prompt is empty"]),
    "blank prompt": (["generate", MODEL, "-p", "   "], ["prompt is empty"]),
    "threads 999": (["generate", MODEL, "-p", "hi", "--threads", "999"], ["--threads", "999"]),
    "threads 0": (["generate", MODEL, "-p", "hi", "--threads", "0"], ["--threads"]),
    "bench threads list": (["bench", MODEL, "--threads", "1,999"], ["999"]),
    "non-UTF-8 prompt": (["generate", MODEL, "-p", b"caf\xe9"], ["not valid UTF-8", "xe9"]),
    "surrogate in meta": (["convert", "in", "out", "--meta", b"k=\xed\xa0\x80"],
                          ["not valid UTF-8"]),
    "missing file": (["generate", "/nonexistent/m.colibri", "-p", "hi"], ["No such file"]),
    "directory as model": (["inspect", os.path.dirname(MODEL)], ["directory"]),
    "n negative": (["generate", MODEL, "-p", "hi", "-n", "-2"], ["-n"]),
    "n not a number": (["generate", MODEL, "-p", "hi", "-n", "2.5"], ["-n"]),
    "temp nan": (["generate", MODEL, "-p", "hi", "--temp", "nan"], ["nan"]),
    "ctx huge": (["generate", MODEL, "-p", "hi", "--ctx", str(10**12)], ["bytes"]),
    "n huge": (["generate", MODEL, "-p", "hi", "-n", str(10**12)], ["bytes"]),
    "unknown command": (["frobnicate"], ["invalid choice"]),
}


@pytest.mark.parametrize("name", list(CASES))
def test_bad_input_is_one_line_and_exit_2(name):
    argv, fragments = CASES[name]
    assert_one_line_error(colibri(*argv), *fragments)


@pytest.mark.parametrize("where", ["before", "after"])
def test_debug_shows_the_traceback(where):
    argv = ["generate", MODEL, "-p", "hi", "-n", str(10**12)]
    argv = ["--debug", *argv] if where == "before" else [*argv, "--debug"]
    p = colibri(*argv)
    assert p.returncode != 0
    assert b"Traceback" in p.stderr


def test_good_input_still_works():
    p = colibri("generate", MODEL, "-p", "Once", "-n", "3", "--seed", "0")
    assert p.returncode == 0, p.stderr
    assert p.stdout.strip()
