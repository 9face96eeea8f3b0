"""The `colibri` command line (colibri/cli.py): version, commands, one-line errors, warnings,
--debug, the console script; `colibri convert`; the arguments the commands share
(commands/common.py). `colibri inspect` is in test_inspect.py."""
from __future__ import annotations

import argparse
import shutil
import subprocess
import sys

import pytest

from colibri import __version__
from colibri.api import default_model_path
from colibri.cli import COMMANDS, build_parser, main
from colibri.commands import common
from colibri.kernels import ACTIVATIONS
from colibri.errors import ColibriError
from colibri.format import ColibriFile

from cli_helpers import one_line_error, run


@pytest.fixture(scope="module")
def model(hf_checkpoint, tmp_path_factory):
    """A q4 qwen2_moe .colibri file made through the CLI (shared by the module; read-only)."""
    dst = tmp_path_factory.mktemp("cli") / "tiny.colibri"
    assert main(["convert", str(hf_checkpoint("qwen2_moe", "bfloat16")), str(dst), "--quant",
                 "q4", "--group-size", "32", "--meta", "licence=apache-2.0", "note=x y",
                 "-q"]) == 0
    return dst


def test_version_and_commands(capsys):
    code, out, _ = run(capsys, "--version")
    assert code == 0 and out.strip() == f"colibri {__version__}"
    assert {"convert", "inspect"} <= set(COMMANDS)
    code, out, _ = run(capsys, "--help")
    assert code == 0 and "convert" in out and "inspect" in out
    code, _, err = run(capsys)
    assert code == 2 and "choose a command" in err


def test_console_script_entry_point():
    exe = shutil.which("colibri")
    cmd = [exe] if exe else [sys.executable, "-m", "colibri.cli"]
    done = subprocess.run(cmd + ["--version"], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0 and done.stdout.strip() == f"colibri {__version__}"


def test_convert_writes_the_file(model):
    with ColibriFile(model) as cf:
        assert cf.user_metadata == {"licence": "apache-2.0", "note": "x y"}
        assert cf.tensors["layers.0.moe.experts.1.w_gate"].dtype == "q4"
        assert cf.tensors["layers.0.moe.router"].dtype == "f32"
        assert cf.tensors["tok_embeddings"].dtype == "bf16"


def test_convert_options_reach_the_converter(hf_checkpoint, tmp_path, capsys):
    dst = tmp_path / "m.colibri"
    code, out, err = run(capsys, "convert", str(hf_checkpoint("olmoe")), str(dst), "--dtype",
                         "bf16", "--quant", "q8", "--quantize", "attn,head", "--router-dtype",
                         "bf16", "--no-checksums")
    assert code == 0 and f"wrote {dst}" in out
    with ColibriFile(dst) as cf:
        assert cf.tensors["layers.1.attn.wo"].dtype == "q8"
        assert cf.tensors["lm_head"].dtype == "q8"
        assert cf.tensors["layers.1.moe.experts.0.w_up"].dtype == "bf16"
        assert cf.tensors["layers.1.moe.router"].dtype == "bf16"
        assert all(i.crc32 is None for i in cf.tensors.values())


@pytest.mark.parametrize("argv, match", [
    (["convert", "SRC", "DST", "--quant", "q3"], "invalid choice: 'q3'"),
    (["convert", "SRC", "DST", "--group-size", "x"], "invalid int value"),
    (["convert", "SRC"], "required: DST"),
    (["convert", "SRC", "DST", "--bogus"], "unrecognized arguments: --bogus"),
    (["convert", "SRC", "DST", "--meta", "novalue"], "--meta 'novalue': expected key=value"),
    (["convert", "SRC", "DST", "--quant", "q4", "--quantize", "experts,heads"],
     "unknown quantize role 'heads'"),
    (["convert", "/nonexistent/folder", "DST"], "not a folder"),
    (["inspect", "/nonexistent/file.colibri"], "No such file or directory"),
])
def test_bad_arguments_give_one_line_errors(hf_checkpoint, tmp_path, capsys, argv, match):
    argv = [str(hf_checkpoint("olmoe")) if a == "SRC" else str(tmp_path / "o.colibri")
            if a == "DST" else a for a in argv]
    code, out, err = run(capsys, *argv)
    assert code == 2
    assert match in one_line_error(err, argv[0])
    assert not (tmp_path / "o.colibri").exists()


def test_convert_errors_are_one_line(hf_checkpoint, model, capsys):
    code, _, err = run(capsys, "convert", str(hf_checkpoint("qwen2_moe", "bfloat16")),
                       str(model))
    assert code == 2 and "--force" in one_line_error(err, "convert")


def test_debug_shows_the_traceback(tmp_path, capsys):
    with pytest.raises(ColibriError, match="not a folder"):
        main(["convert", str(tmp_path / "missing"), str(tmp_path / "o.colibri"), "--debug"])


def test_tokenizer_warning_is_one_line(hf_checkpoint, tmp_path, capsys):
    src = hf_checkpoint("mixtral", tokenizer=False)
    capsys.readouterr()
    code, _, err = run(capsys, "convert", str(src), str(tmp_path / "m.colibri"), "-q")
    assert code == 0
    assert err.strip().startswith("colibri convert: warning: ") and "tokenizer.json" in err
    assert len(err.strip().splitlines()) == 1


# --------------------------------------------------------------------------------------------
# the arguments the commands share (colibri/commands/common.py)
# --------------------------------------------------------------------------------------------

def _actions(command: str) -> dict:
    sub = build_parser().commands[command]
    return {a.dest: a for a in sub._actions}


@pytest.mark.parametrize("command", ["generate", "bench", "perplexity", "routes"])
def test_commands_share_model_and_threads(command):
    a = _actions(command)
    positional = [x for x in build_parser().commands[command]._actions
                  if x.dest == "model" and not x.option_strings]
    assert positional[0].nargs == "?" and positional[0].help == common.MODEL_HELP
    assert a["model"].option_strings == ["-m", "--model"]       # llama.cpp's spelling too
    assert a["threads"].default is None and "physical cores" in a["threads"].help
    args = build_parser().parse_args([command] + (["-p", "x"] if command == "routes" else
                                                  ["-f", "x"] if command == "perplexity" else []))
    assert common.model_path(args.model) == default_model_path()
    assert common.model_path("m.colibri") == "m.colibri"           # as given, not normalised


def test_activations_and_lists():
    for command in ("generate", "perplexity"):
        assert _actions(command)["activations"].choices == ACTIVATIONS
        assert _actions(command)["activations"].default == "int16"      # W4A16
    assert _actions("bench")["activations"].default == ["int16"]
    assert common.activation_list("f32,int8") == ["f32", "int8"]
    assert common.int_list(1)("1,2") == [1, 2]
    with pytest.raises(argparse.ArgumentTypeError, match="activations must be among"):
        common.activation_list("f32,f64")
    with pytest.raises(argparse.ArgumentTypeError, match="values must be >= 1"):
        common.int_list(1)("0,2")


def test_open_model_and_range_checks():
    args = argparse.Namespace(model=None, threads=1)                # no --activations: int16
    with common.open_model(args) as m:
        assert str(m.file.path) == str(default_model_path())
        assert m.threads == 1 and m.activations == "int16"
    common.check_at_least([("--ctx", None, 4), ("--batch", 1, 1)])    # unset or in range
    with pytest.raises(ColibriError, match=r"^--ctx 2 is out of range \(must be >= 4\)$"):
        common.check_at_least([("--batch", 1, 1), ("--ctx", 2, 4)])
