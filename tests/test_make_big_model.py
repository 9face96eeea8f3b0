"""scripts/make_big_model.py: the random Mixtral-shaped model of the larger-than-RAM benchmark,
written as .colibri and as a llama.cpp GGUF from the same seed, must be one model.

At a tiny geometry: both formats are written by the script itself (a subprocess, as a user
runs it), the GGUF goes through `colibri convert`, and every tensor of the converted file must
equal the directly written file's byte for byte (q4 nibbles and scales, the bf16 embedding,
f32 routers and norms), so the logits are the same bits. That the GGUF is what llama.cpp
reads as that model (its q / k permutation, stacked experts, keys) follows from colibri's GGUF
import, which tests/test_gguf_import.py checks against transformers and
scripts/check_gguf_llamacpp.py against llama.cpp's converter.
"""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import gguf
import numpy as np
import pytest

import colibri
from colibri.format import ColibriFile

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "make_big_model.py"
TINY = ["--layers", "2", "--set", "hidden_size=128", "intermediate_size=256",
        "num_attention_heads=4", "num_key_value_heads=2", "vocab_size=320"]


def _make(out: Path, *extra: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(SCRIPT), "--out", str(out), *TINY, *extra],
                          capture_output=True, text=True, timeout=120)


def _raw(t) -> tuple:
    """A tensor's stored bytes (QuantizedTensor: codes and scales; else the array)."""
    if hasattr(t, "scales"):
        return t.dtype, t.shape, t.data.tobytes(), t.scales.tobytes()
    return t.dtype, t.shape, t.tobytes()


@pytest.fixture(scope="module")
def both(tmp_path_factory):
    d = tmp_path_factory.mktemp("big")
    for name in ("m.colibri", "m.gguf"):
        run = _make(d / name)
        assert run.returncode == 0, run.stderr
    colibri.convert(d / "m.gguf", d / "from-gguf.colibri")
    return d


def test_gguf_converts_to_the_same_tensors(both):
    direct, via = ColibriFile(both / "m.colibri"), ColibriFile(both / "from-gguf.colibri")
    assert sorted(direct.names()) == sorted(via.names())
    assert direct.tensor("layers.1.moe.experts.7.w_down").dtype == "q4"
    assert direct.tensor("layers.1.attn.wk").dtype == "q4"
    for n in direct.names():
        assert _raw(direct.tensor(n)) == _raw(via.tensor(n)), n


def test_same_logits(both):
    ids = np.array([[1, 5, 290, 17, 260, 3, 99]])
    a = colibri.forward(colibri.load(both / "m.colibri", activations="f32"), ids)
    b = colibri.forward(colibri.load(both / "from-gguf.colibri", activations="f32"), ids)
    assert np.isfinite(a).all() and a.std() > 0
    np.testing.assert_array_equal(a, b)


def test_gguf_layout(both):
    r = gguf.GGUFReader(both / "m.gguf")
    t = {x.name: x for x in r.tensors}
    assert r.fields["general.architecture"].contents() == "llama"
    assert r.fields["llama.expert_count"].contents() == 8
    assert t["blk.0.ffn_up_exps.weight"].tensor_type.name == "Q4_0"
    assert list(t["blk.0.ffn_up_exps.weight"].shape) == [128, 256, 8]        # ggml order
    assert t["token_embd.weight"].tensor_type.name == "BF16"
    assert t["blk.1.ffn_gate_inp.weight"].tensor_type.name == "F32"
    assert len(r.fields["tokenizer.ggml.tokens"].data) == 320


def test_a_different_seed_is_a_different_model(both, tmp_path):
    assert _make(tmp_path / "s1.colibri", "--seed", "1").returncode == 0
    a, b = ColibriFile(both / "m.colibri"), ColibriFile(tmp_path / "s1.colibri")
    n = "layers.0.moe.experts.0.w_up"
    assert _raw(a.tensor(n)) != _raw(b.tensor(n))


def test_bad_arguments(tmp_path):
    run = _make(tmp_path / "x.gguf", "--group-size", "64")
    assert run.returncode != 0 and "Q4_0 has groups of 32" in run.stderr
    run = subprocess.run([sys.executable, str(SCRIPT), "--out", str(tmp_path / "x.colibri"),
                          "--set", "hidden=12"], capture_output=True, text=True, timeout=60)
    assert run.returncode != 0 and "--set 'hidden=12'" in run.stderr
    run = _make(tmp_path / "small.gguf", "--set", "vocab_size=100")
    assert run.returncode != 0 and "at least 259 tokens" in run.stderr
    assert not list(tmp_path.glob(".*tmp*"))                      # no temporary file left
