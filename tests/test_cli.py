"""The `colibri` command line: convert and inspect, through main([...]) and the console script."""
from __future__ import annotations

import json
import math
import shutil
import subprocess
import sys

import numpy as np
import pytest

from colibri import __version__
from colibri.cli import COMMANDS, main
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


def test_inspect_report(model, capsys):
    code, out, err = run(capsys, "inspect", str(model))
    assert code == 0 and err == ""
    for needle in ("qwen2_moe", "shared expert 96", "tokenizer.json", "user.licence",
                   "apache-2.0", "q4 g32 on experts,shared", "layers.0.moe.router",
                   "layers.1.mlp.w_down", "active per token", "by dtype"):
        assert needle in out, needle
    # experts 1.. are folded in the human table, listed with --full
    assert "layers.0.moe.experts.2.w_up" not in out
    _, full, _ = run(capsys, "inspect", str(model), "--full")
    assert "layers.0.moe.experts.2.w_up" in full


def test_inspect_json_totals(model, capsys):
    code, out, _ = run(capsys, "inspect", str(model), "--json")
    assert code == 0
    report = json.loads(out)
    with ColibriFile(model) as cf:
        infos = list(cf.tensors.values())
        config = cf.model_config
        assert report["arch"] == cf.arch                 # the metadata as the file stores it
        assert [t["name"] for t in report["tensors"]] == [i.name for i in infos]
        assert report["header"]["tensor_count"] == len(infos)
    params = sum(math.prod(i.shape) for i in infos)
    per_expert = sum(math.prod(i.shape) for i in infos if ".experts.0." in i.name) // \
        len(config.moe_layer_ids)
    routed = sum(math.prod(i.shape) for i in infos if ".moe.experts." in i.name)
    t = report["totals"]
    assert t["parameters"] == params
    assert t["tensor_bytes"] == sum(i.nbytes for i in infos)
    assert t["experts_per_layer"] == config.num_experts == 4
    assert t["parameters_per_expert"] == per_expert == 3 * 32 * 64
    assert t["active_parameters_per_token"] == \
        params - routed + len(config.moe_layer_ids) * config.num_experts_per_tok * per_expert
    assert report["user"]["licence"] == "apache-2.0"
    assert report["tokenizer"]["present"] is True
    assert report["converter"]["quant"] == "q4"


@pytest.mark.parametrize("name", ["layers.0.moe.experts.2.w_down", "tok_embeddings", "norm",
                                  "layers.0.attn.bq"])
def test_inspect_tensor_rows(model, capsys, name):
    with ColibriFile(model) as cf:
        full = cf.to_float32(name).reshape(-1, cf.tensors[name].shape[-1])
    code, out, _ = run(capsys, "inspect", str(model), "--tensor", name, "--rows", "3", "--json")
    assert code == 0
    rows = np.array(json.loads(out)["rows"], dtype=np.float32)
    np.testing.assert_array_equal(rows, full[:3])
    code, out, _ = run(capsys, "inspect", str(model), "--tensor", name, "--rows", "2")
    lines = out.strip().splitlines()
    assert code == 0 and lines[0].startswith(name)
    assert len(lines) == 1 + min(2, full.shape[0])


def test_inspect_unknown_tensor_suggests(model, capsys):
    code, _, err = run(capsys, "inspect", str(model), "--tensor", "layers.0.moe.expert.2.w_up")
    line = one_line_error(err, "inspect")
    assert code == 2 and "did you mean" in line and "layers.0.moe.experts.2.w_up" in line


def test_validate_good_and_corrupted(model, tmp_path, capsys):
    code, out, _ = run(capsys, "inspect", str(model), "--validate")
    assert code == 0 and "valid" in out and "INVALID" not in out
    code, out, _ = run(capsys, "inspect", str(model), "--validate", "--json")
    assert code == 0 and json.loads(out)["valid"] is True

    bad = tmp_path / "bad.colibri"
    shutil.copy(model, bad)
    with ColibriFile(bad) as cf:
        offset = cf.tensors["layers.1.mlp.w_up"].offset
    with open(bad, "r+b") as f:
        f.seek(offset + 10)
        byte = f.read(1)
        f.seek(offset + 10)
        f.write(bytes([byte[0] ^ 0x5A]))
    code, out, _ = run(capsys, "inspect", str(bad), "--validate")
    assert code == 1 and "INVALID" in out and "layers.1.mlp.w_up" in out
    code, out, _ = run(capsys, "inspect", str(bad), "--validate", "--json")
    report = json.loads(out)
    assert code == 1 and report["valid"] is False
    assert any("layers.1.mlp.w_up" in p for p in report["problems"])


def test_validate_truncated_file(model, tmp_path, capsys):
    bad = tmp_path / "short.colibri"
    bad.write_bytes(model.read_bytes()[:-100])
    code, out, _ = run(capsys, "inspect", str(bad), "--validate")
    assert code == 1 and "INVALID" in out
    code, _, err = run(capsys, "inspect", str(bad))      # without --validate: a usage error
    assert code == 2 and str(bad) in one_line_error(err, "inspect")


def test_validate_checks_tensors_against_the_arch(model, tmp_path, capsys):
    """A structurally sound file whose tensors do not match its arch metadata is invalid."""
    from colibri.format import save
    with ColibriFile(model) as cf:
        arch, emb = cf.arch, cf.to_float32("tok_embeddings")
    odd = tmp_path / "odd.colibri"
    save(odd, {"tok_embeddings": emb, "extra": np.ones(4, np.float32)}, {"arch": arch})
    code, out, _ = run(capsys, "inspect", str(odd), "--validate")
    assert code == 1
    assert "'layers.0.attn.wq' missing" in out and "'extra' is not part of" in out
    code, out, _ = run(capsys, "inspect", str(odd))      # no experts, no arch totals: still fine
    assert code == 0 and "tok_embeddings" in out
