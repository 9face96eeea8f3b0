"""The per-tensor format fallback of colibri.convert: a quantized tensor whose input dimension
the group size does not divide is stored in the nearest format that holds it, with one
warning line listing them, instead of the conversion being refused."""
from __future__ import annotations

import warnings

import numpy as np
import pytest

torch = pytest.importorskip("torch")

import colibri.api as api  # noqa: E402
from colibri.convert import ConversionWarning, convert, plan  # noqa: E402
from colibri.format import ColibriFile  # noqa: E402
from hf_factory import load_hf_model  # noqa: E402
from test_model import BOUNDS, _rel_err  # noqa: E402


def _convert_warning(src, dst, **kw) -> tuple[str, object]:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        path = convert(src, dst, progress=False, **kw)
    lines = [str(w.message) for w in caught if issubclass(w.category, ConversionWarning)]
    assert len(lines) == 1 and "\n" not in lines[0], lines
    return lines[0], path


def test_dimension_off_the_block_falls_back_to_the_plain_format(hf_checkpoint, tmp_path):
    """Mixtral with I = 40: every expert's w_down (40 columns) cannot be q4; it is stored as
    the unquantized weights are (f32 here), the rest is q4, and the model runs."""
    src = hf_checkpoint("mixtral", intermediate_size=40, initializer_range=0.15)
    msg, dst = _convert_warning(src, tmp_path / "m.colibri", dtype="f32", quant="q4")
    assert msg.startswith("8 tensors cannot take q4 with group size 32")
    for i in (0, 1):
        assert f"layers.{i}.moe.experts.*.w_down (40 columns) -> f32" in msg
    assert "w_gate" not in msg and "w_up" not in msg
    with ColibriFile(dst) as f:
        for e in range(4):
            assert f.info(f"layers.0.moe.experts.{e}.w_down").dtype == "f32"
            assert f.info(f"layers.0.moe.experts.{e}.w_gate").dtype == "q4"
        fallback = f.metadata["converter"]["fallback"]
        assert fallback["layers.1.moe.experts.3.w_down"] == "f32" and len(fallback) == 8
    hf = load_hf_model(src)
    ids = np.random.default_rng(0).integers(3, 320, size=(2, 16))
    with torch.no_grad():
        want = hf(input_ids=torch.from_numpy(ids)).logits.numpy()
    with api.load(dst, threads=1, activations="f32", kv_dtype="f32") as m:
        got = api.forward(m, ids)
        cache = m.new_cache(ctx=32)
        step = np.stack([api.forward(m, np.array([t]), cache=cache)[0] for t in ids[0]])
    assert _rel_err(got, want) <= BOUNDS["q4"][0]
    assert _rel_err(step, got[0]) <= 1e-5               # the decode step reads the same file


def test_group_size_that_does_not_divide_takes_smaller_groups(hf_checkpoint):
    """hidden 96 with --group-size 64: the matrices reading 96 columns keep q8 with groups
    of 32 (the largest multiple of 32 dividing 96); the 64-column ones keep 64."""
    src = hf_checkpoint("olmoe", hidden_size=96, num_attention_heads=4, num_key_value_heads=2,
                        intermediate_size=64)
    with pytest.warns(ConversionWarning, match="cannot take q8 with group size 64") as rec:
        p = plan(src, quant="q8", group_size=64)
    msg = str(rec[0].message)
    assert "layers.0.moe.experts.*.w_gate (96 columns) -> q8 group 32" in msg
    by_name = {t.name: t for t in p.tensors}
    assert (by_name["layers.0.moe.experts.0.w_up"].dtype,
            by_name["layers.0.moe.experts.0.w_up"].group_size) == ("q8", 32)
    assert by_name["layers.0.moe.experts.0.w_down"].group_size == 64      # 64 columns
    assert p.group_size == 64


def test_nothing_falls_back_without_a_warning(hf_checkpoint):
    with warnings.catch_warnings():
        warnings.simplefilter("error", ConversionWarning)
        p = plan(hf_checkpoint("mixtral"), quant="q4")
    assert all(t.group_size == 32 for t in p.tensors if t.role is not None)
    assert p.fallback == {} and "fallback" not in p.metadata()["converter"]
