"""`colibri inspect` (colibri/commands/inspect.py over colibri/tools/inspect.py): the report,
--json totals, tensor rows, --validate, --dump-gate; bad arguments as one line, exit status 2."""
from __future__ import annotations

import json
import math
import re
import shutil

import numpy as np
import pytest

from colibri.cli import main
from colibri.convert import convert
from colibri.format import ColibriFile, save

from cli_helpers import one_line_error, run


@pytest.fixture(scope="module")
def model(hf_checkpoint, tmp_path_factory):
    """A q4 qwen2_moe .colibri file made through the CLI (layer 0 MoE with a shared expert,
    layer 1 dense; shared by the module, read-only)."""
    dst = tmp_path_factory.mktemp("inspect") / "tiny.colibri"
    assert main(["convert", str(hf_checkpoint("qwen2_moe", "bfloat16")), str(dst), "--quant",
                 "q4", "--group-size", "32", "--meta", "licence=apache-2.0", "note=x y",
                 "-q"]) == 0
    return dst


@pytest.fixture(scope="module")
def mixtral(hf_checkpoint, tmp_path_factory):
    """An f32 mixtral .colibri file (MoE layers 0 and 1)."""
    return str(convert(hf_checkpoint("mixtral", initializer_range=0.15),
                       tmp_path_factory.mktemp("inspect") / "mixtral.colibri", dtype="f32",
                       progress=False))


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
    with ColibriFile(model) as cf:
        arch, emb = cf.arch, cf.to_float32("tok_embeddings")
    odd = tmp_path / "odd.colibri"
    save(odd, {"tok_embeddings": emb, "extra": np.ones(4, np.float32)}, {"arch": arch})
    code, out, _ = run(capsys, "inspect", str(odd), "--validate")
    assert code == 1
    assert "'layers.0.attn.wq' missing" in out and "'extra' is not part of" in out
    code, out, _ = run(capsys, "inspect", str(odd))      # no experts, no arch totals: still fine
    assert code == 0 and "tok_embeddings" in out


# --------------------------------------------------------------------------------------------
# --dump-gate
# --------------------------------------------------------------------------------------------

def test_dump_gate_text_and_json(mixtral, capsys):
    with ColibriFile(mixtral) as cf:
        w = cf.to_float32("layers.1.moe.router")                              # (E, D)
    norms = np.linalg.norm(w.astype(np.float64), axis=1)
    code, out, err = run(capsys, "inspect", mixtral, "--dump-gate", "--layer", "1")
    assert code == 0 and err == ""
    lines = out.splitlines()
    assert lines[0] == "layers.1.moe.router: f32 4x64 (experts x hidden), layer 1"
    assert lines[1].startswith(f"  expert 0  norm {norms[0]:.4g}")
    assert f"min {norms.min():.4g} (expert {norms.argmin()})" in out
    assert "cosine between rows" in out and "non-finite 0" in out
    code, out, _ = run(capsys, "inspect", mixtral, "--dump-gate", "--layer", "1",
                       "--json")
    d = json.loads(out)
    np.testing.assert_allclose(d["matrix"], w, rtol=1e-6)
    np.testing.assert_allclose(d["row_norms"], norms, rtol=1e-6)
    assert d["tensor"]["name"] == "layers.1.moe.router" and d["summary"]["experts"] == 4
    code, out, _ = run(capsys, "inspect", mixtral, "--dump-gate", "--layer", "0",
                       "--rows", "2")
    assert "... 2 more experts" in out


@pytest.mark.parametrize("args, match", [
    (["--dump-gate", "--layer", "1"], "layer 1 has no router .* MoE layers: 0"),
    (["--dump-gate"], "--dump-gate needs --layer L .*: 0\\)"),
    (["--layer", "0"], "--layer goes with --dump-gate"),
    (["--dump-gate", "--layer", "0", "--tensor", "norm"], "cannot be combined"),
])
def test_dump_gate_bad_arguments(model, capsys, args, match):
    code, out, err = run(capsys, "inspect", model, *args)
    assert code == 2 and out == ""
    assert re.search(match, one_line_error(err, "inspect"))
