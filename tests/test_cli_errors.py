"""Every command's errors are one line (`colibri CMD: error: ...`, exit 2) unless --debug: a
sample of failure kinds per command -- a missing file, a file of random bytes, a model file
cut in half, a flag value out of range or of the wrong type. (Missing extras: test_extras.py;
the model-file checks themselves: test_format_checks.py and the fuzz campaign.)"""
from __future__ import annotations

import os
import subprocess
import sys

import pytest

from colibri.api import default_model_path
from colibri.cli import main
from colibri.errors import ColibriError

from cli_helpers import one_line_error, run

# argv of each command with MODEL where the file goes
COMMANDS = {
    "generate": ["MODEL", "-p", "def f", "-n", "2", "-t", "1"],
    "bench": ["MODEL", "-p", "4", "-n", "2", "-r", "1", "--bw-mib", "0", "--no-warmup", "-t", "1"],
    "perplexity": ["MODEL", "-f", "TEXT", "-t", "1"],
    "routes": ["MODEL", "-p", "def f", "-t", "1"],
    "inspect": ["MODEL"],
    "cache-sim": ["MODEL", "--slots", "4"],
}
BAD_FLAGS = {            # (extra argv, what the line names)
    "generate": [(["--top-p", "0"], "--top-p 0.0"), (["-t", "zero"], "'zero' is not an integer"),
                 (["-c", "0"], "--ctx 0")],
    "bench": [(["-r", "0"], "-r 0"), (["-p", "a,b"], "'a,b' is not an integer")],
    "perplexity": [(["-c", "1"], "--ctx 1"), (["-b", "x"], "invalid int value: 'x'")],
    "routes": [(["--batch", "0"], "--batch must be >= 1"), (["--layer", "99"], "layer 99")],
    "inspect": [(["--bogus"], "unrecognized arguments: --bogus")],
    "cache-sim": [(["--chunk", "0"], "--chunk must be >= 1")],
}


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    d = tmp_path_factory.mktemp("bad")
    shipped = default_model_path().read_bytes()
    (d / "random.colibri").write_bytes(os.urandom(4096))
    (d / "half.colibri").write_bytes(shipped[:len(shipped) // 2])
    (d / "text.txt").write_text("def f(x):\n    return x + 1\n" * 40, encoding="utf-8")
    return d


def argv_of(command: str, model, files) -> list[str]:
    return [command] + [str(model) if a == "MODEL" else str(files / "text.txt")
                        if a == "TEXT" else a for a in COMMANDS[command]]


@pytest.mark.parametrize("command", sorted(COMMANDS))
@pytest.mark.parametrize("kind, expect", [
    ("missing.colibri", "missing.colibri"),
    ("random.colibri", "random.colibri: not a"),
    ("half.colibri", "half.colibri: "),
])
def test_a_bad_file_is_one_line(command, kind, expect, files, capsys):
    code, out, err = run(capsys, *argv_of(command, files / kind, files))
    assert code == 2, err
    line = one_line_error(err, command)
    assert expect in line, line
    if kind == "half.colibri" and command != "cache-sim":
        assert "truncated" in line, line           # says what is wrong with the file
    assert "Traceback" not in err and "pickle" not in line


@pytest.mark.parametrize("command, extra, expect",
                         [(c, x, e) for c, bad in sorted(BAD_FLAGS.items()) for x, e in bad])
def test_a_bad_flag_value_is_one_line(command, extra, expect, files, capsys, tmp_path):
    model = default_model_path()
    if command == "cache-sim":                       # a real trace to replay
        model = tmp_path / "t.npz"
        assert run(capsys, "routes", "-p", "def f(x):", "--save", model)[0] == 0
        capsys.readouterr()
    code, _, err = run(capsys, *argv_of(command, model, files), *extra)
    assert code == 2, err
    assert expect in one_line_error(err, command)


def test_debug_shows_the_traceback_instead(files):
    with pytest.raises(ColibriError, match="truncated"):        # raised, not one line
        main(["inspect", str(files / "half.colibri"), "--debug"])


@pytest.mark.parametrize("workers", ["1", "2"])
@pytest.mark.parametrize("kind", ["random.colibri", "half.colibri", "missing.colibri"])
def test_serve_a_bad_file_is_one_line_and_exits(kind, workers, files):
    """In a subprocess with a timeout: a server that started anyway would hang here."""
    pytest.importorskip("fastapi", reason="the server extra is not installed")
    proc = subprocess.run([sys.executable, "-m", "colibri", "serve", str(files / kind),
                           "--port", "0", "--workers", workers, "-t", "1"],
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2, proc.stderr
    line = one_line_error(proc.stderr, "serve")
    assert kind in line, line
