"""The converter: tiny transformers checkpoints of every family -> .colibri -> read back.

The oracle is the transformers model itself (hf_factory.reference_tensors walks its modules),
not colibri's name maps.
"""
from __future__ import annotations

import json
import os
import tracemalloc
import warnings

import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

from colibri.format import quant
from colibri.config import ConfigError
from colibri.convert import ConversionWarning, convert, plan
from colibri.errors import ColibriError
from colibri.format import ColibriFile, ColibriWriter
from hf_factory import (copy_checkpoint, fuse_experts, load_hf_model,
                        make_hf_checkpoint, reference_tensors)

SMALL = ("attn_norm", "ffn_norm", "norm", "q_norm", "k_norm", "bq", "bk", "bv")


@pytest.fixture(scope="module")
def reference(hf_checkpoint):
    """reference(family, dtype="float32") -> canonical name -> float32 array (cached)."""
    cache = {}

    def get(family, dtype="float32"):
        if (family, dtype) not in cache:
            model = load_hf_model(hf_checkpoint(family, dtype), dtype)
            cache[family, dtype] = reference_tensors(model)
        return cache[family, dtype]
    return get


def kind(name: str) -> str:
    last = name.rsplit(".", 1)[-1]
    if last in SMALL:
        return "small"
    if name.endswith(("moe.router", "moe.shared_gate")):
        return "gate"
    return "matrix"


def no_temp_files(folder) -> bool:
    return not [f for f in os.listdir(folder) if ".tmp-" in f]


# --- exact round trips ------------------------------------------------------------------------

@pytest.mark.parametrize("ckpt_dtype, target, sharded", [
    ("float32", "auto", False),      # f32 stays f32
    ("bfloat16", "auto", True),      # bf16 stays bf16, bit for bit, from shards
    ("bfloat16", "f32", False),      # bf16 widened exactly
])
def test_roundtrip_exact(hf_checkpoint, reference, tmp_path, family_name, ckpt_dtype, target,
                         sharded):
    src = hf_checkpoint(family_name, ckpt_dtype, sharded)
    if sharded:
        assert (src / "model.safetensors.index.json").exists()
    dst = convert(src, tmp_path / "m.colibri", dtype=target, progress=False)
    ref = reference(family_name, ckpt_dtype)
    want_dtype = {"float32": "f32", "bfloat16": "bf16"}[ckpt_dtype] if target == "auto" \
        else target
    with ColibriFile(dst) as cf:
        assert set(cf.tensors) == set(ref)
        for name, expected in ref.items():
            info = cf.tensors[name]
            assert info.shape == expected.shape, name
            assert info.dtype == (want_dtype if kind(name) == "matrix" else "f32"), name
            np.testing.assert_array_equal(cf.to_float32(name), expected, err_msg=name)
        if want_dtype == "bf16":     # the stored bits are the checkpoint's bits
            bits = cf.tensor("tok_embeddings")
            assert bits.dtype == np.uint16
            np.testing.assert_array_equal(bits, quant.f32_to_bf16(ref["tok_embeddings"]))
        assert cf.verify_checksums() == []


@pytest.mark.parametrize("qformat", ["q8", "q4"])
def test_roundtrip_quantized_within_bound(hf_checkpoint, reference, tmp_path, family_name,
                                          qformat):
    src = hf_checkpoint(family_name)
    dst = convert(src, tmp_path / "m.colibri", quant=qformat, group_size=32,
                  quantize="experts,shared,attn,head,dense", progress=False)
    ref = reference(family_name)
    # documented bound (quant.py): |w - w_hat| <= |s|/2 (q8), |s| (1 + 2^-8) (q4), s = scale
    factor = 0.5 if qformat == "q8" else 1 + 2 ** -8
    n_quantized = 0
    with ColibriFile(dst) as cf:
        assert set(cf.tensors) == set(ref)
        for name, expected in ref.items():
            info = cf.tensors[name]
            got = cf.to_float32(name)
            if name == "tok_embeddings" or kind(name) != "matrix":
                assert info.dtype == "f32", name
                np.testing.assert_array_equal(got, expected, err_msg=name)
                continue
            assert (info.dtype, info.group_size) == (qformat, 32), name
            n_quantized += 1
            scales = np.abs(cf.tensor(name).scales.astype(np.float32))       # (R, C/G)
            bound = np.repeat(scales, 32, axis=-1) * factor * (1 + 1e-6) + 1e-12
            err = np.abs(got - expected)
            assert (err <= bound).all(), (name, float((err - bound).max()))
            # and the scales are those of *this* tensor: about max|w| of each group / levels
            peak = np.abs(expected).reshape(*expected.shape[:-1], -1, 32).max(-1)
            levels = 127 if qformat == "q8" else 8
            np.testing.assert_allclose(scales, peak / levels, rtol=2e-3, err_msg=name)
        assert n_quantized > 0
        meta = cf.metadata["converter"]
        assert meta["quant"] == qformat and meta["group_size"] == 32


def test_default_quantizes_experts_and_shared_only(hf_checkpoint, tmp_path):
    dst = convert(hf_checkpoint("qwen2_moe"), tmp_path / "m.colibri", quant="q4",
                  progress=False)
    with ColibriFile(dst) as cf:
        dtypes = {n: i.dtype for n, i in cf.tensors.items()}
        assert cf.metadata["converter"]["quantized"] == ["experts", "shared"]
    assert dtypes["layers.0.moe.experts.3.w_down"] == "q4"
    assert dtypes["layers.0.moe.shared.w_up"] == "q4"
    assert dtypes["layers.0.moe.router"] == "f32"
    assert dtypes["layers.0.moe.shared_gate"] == "f32"
    assert dtypes["layers.0.attn.wq"] == "f32"
    assert dtypes["layers.1.mlp.w_gate"] == "f32"
    assert dtypes["lm_head"] == "f32"


def test_f32_checkpoint_to_bf16_and_f16(hf_checkpoint, reference, tmp_path):
    src, ref = hf_checkpoint("mixtral"), reference("mixtral")
    with ColibriFile(convert(src, tmp_path / "b.colibri", dtype="bf16", progress=False)) as cf:
        np.testing.assert_array_equal(cf.tensor("layers.1.attn.wk"),
                                      quant.f32_to_bf16(ref["layers.1.attn.wk"]))
        assert cf.tensors["layers.1.attn_norm"].dtype == "f32"
    with ColibriFile(convert(src, tmp_path / "h.colibri", dtype="f16", router_dtype="f16",
                             progress=False)) as cf:
        np.testing.assert_array_equal(cf.tensor("layers.0.moe.experts.2.w_up"),
                                      ref["layers.0.moe.experts.2.w_up"].astype(np.float16))
        assert cf.tensors["layers.0.moe.router"].dtype == "f16"


def test_expert_stacks_and_layout(hf_checkpoint, reference, tmp_path):
    ref = reference("olmoe")
    dst = convert(hf_checkpoint("olmoe"), tmp_path / "m.colibri", progress=False)
    with ColibriFile(dst) as cf:
        assert (cf.n_layers, cf.n_experts) == (2, 4)
        for layer in range(2):
            stack = cf.expert_stack(layer, "w_up")
            for e in range(4):
                np.testing.assert_array_equal(stack[e], ref[f"layers.{layer}.moe.experts.{e}.w_up"])
                offset, size = cf.expert_block(layer, e)
                assert offset % 4096 == 0 and size > 0


def test_metadata_travels(hf_checkpoint, tmp_path):
    src = hf_checkpoint("qwen3_moe")
    dst = convert(src, tmp_path / "m.colibri", meta={"licence": "apache-2.0", "note": "a=b"},
                  progress=False)
    with ColibriFile(dst) as cf:
        assert cf.config == json.loads((src / "config.json").read_text())
        assert cf.arch["family"] == "qwen3_moe" and cf.arch["qk_norm"] == "per_head"
        assert cf.user_metadata == {"licence": "apache-2.0", "note": "a=b"}
        files = cf.tokenizer_files
        for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
                     "generation_config.json", "chat_template.jinja"):
            assert files[name] == (src / name).read_text(), name
        conv = cf.metadata["converter"]
        assert conv["source"] == src.name and os.sep not in conv["source"]
        assert conv["dtype"] == "f32" and conv["quant"] == "none" and conv["quantized"] == []
        assert conv["date"].endswith("+00:00")


def test_arch_metadata_is_the_model_config(hf_checkpoint, tmp_path, family_name):
    """The file's "arch" is the family's ModelConfig of config.json, and reads back as it."""
    src = hf_checkpoint(family_name)
    p = plan(src)
    assert p.config == p.family.model_config(json.loads((src / "config.json").read_text()))
    with ColibriFile(convert(src, tmp_path / "m.colibri", progress=False)) as cf:
        assert cf.arch == p.config.to_metadata()
        assert cf.model_config == p.config
        assert (cf.n_layers, cf.n_experts) == (p.config.num_hidden_layers, p.config.num_experts)


def test_tied_embeddings_have_no_lm_head(hf_checkpoint, tmp_path):
    src = hf_checkpoint("qwen3_moe", tie_word_embeddings=True)
    with ColibriFile(convert(src, tmp_path / "m.colibri", progress=False)) as cf:
        assert "lm_head" not in cf.tensors and "tok_embeddings" in cf.tensors
        assert cf.arch["tie_word_embeddings"] is True


def test_qwen2_dense_and_sparse_layers(hf_checkpoint, reference, tmp_path):
    src = hf_checkpoint("qwen2_moe", num_hidden_layers=4, mlp_only_layers=[0],
                        decoder_sparse_step=2)
    with ColibriFile(convert(src, tmp_path / "m.colibri", progress=False)) as cf:
        assert cf.arch["moe_layers"] == [1, 3]
        ref = reference_tensors(load_hf_model(src))
        assert set(cf.tensors) == set(ref)
        for layer in (0, 2):
            assert f"layers.{layer}.mlp.w_down" in cf.tensors
            assert f"layers.{layer}.moe.router" not in cf.tensors
        np.testing.assert_array_equal(cf.to_float32("layers.2.mlp.w_up"), ref["layers.2.mlp.w_up"])
        assert f"layers.3.moe.shared_gate" in cf.tensors


@pytest.mark.parametrize("family", ["mixtral", "qwen3_moe"])
def test_fused_expert_checkpoint(hf_checkpoint, tmp_path, family):
    """transformers 5's fused (E, 2I, D) / (E, D, I) keys give the same file contents."""
    src = hf_checkpoint(family)
    fused = fuse_experts(src, tmp_path / "fused")
    a = convert(src, tmp_path / "a.colibri", quant="q8", group_size=32, progress=False)
    b = convert(fused, tmp_path / "b.colibri", quant="q8", group_size=32, progress=False)
    with ColibriFile(a) as ca, ColibriFile(b) as cb:
        assert list(ca.tensors) == list(cb.tensors)
        for name, info in ca.tensors.items():
            assert ca.buffer[info.offset: info.offset + info.nbytes] == \
                cb.buffer[cb.tensors[name].offset: cb.tensors[name].offset + info.nbytes], name


def test_dst_folder_and_force(hf_checkpoint, tmp_path):
    src = hf_checkpoint("mixtral")
    out = convert(src, tmp_path, progress=False)
    assert out == tmp_path / f"{src.name}.colibri" and out.exists()
    with pytest.raises(ColibriError, match="already exists.*--force"):
        convert(src, out, progress=False)
    before = out.stat().st_mtime_ns
    convert(src, out, force=True, dtype="bf16", progress=False)
    assert out.stat().st_mtime_ns >= before
    with ColibriFile(out) as cf:
        assert cf.metadata["converter"]["dtype"] == "bf16"


def test_refuses_to_overwrite_its_source(hf_checkpoint, tmp_path):
    src = copy_checkpoint(hf_checkpoint("mixtral"), tmp_path / "m")
    for victim in ("model.safetensors", "config.json", "tokenizer.json"):
        with pytest.raises(ColibriError, match="source checkpoint"):
            convert(src, src / victim, force=True, progress=False)
    assert (src / "model.safetensors").stat().st_size > 0
    convert(src, src / "model.colibri", progress=False)    # a new file inside SRC is fine


# --- errors -----------------------------------------------------------------------------------

@pytest.fixture
def editable(hf_checkpoint, tmp_path):
    """A private copy of a tiny checkpoint: editable(family, **kw) -> folder."""
    def get(family="olmoe", **kw):
        return copy_checkpoint(hf_checkpoint(family, **kw), tmp_path / "src")
    return get


def edit_config(folder, **fields):
    cfg = json.loads((folder / "config.json").read_text())
    cfg.update(fields)
    (folder / "config.json").write_text(json.dumps(cfg))


def test_unsupported_family(editable, tmp_path):
    src = editable()
    edit_config(src, model_type="llama")
    with pytest.raises(ColibriError, match="'llama'.*mixtral.*olmoe.*qwen2_moe.*qwen3_moe"):
        convert(src, tmp_path / "x.colibri", progress=False)
    assert not (tmp_path / "x.colibri").exists()


def test_bad_config_field_is_named_before_anything_is_written(editable, tmp_path):
    src = editable("qwen2_moe")
    edit_config(src, norm_topk_prob="yes")
    with pytest.raises(ConfigError, match="config.json: field 'norm_topk_prob' must be true or "
                                          "false, found 'yes'"):
        convert(src, tmp_path / "x.colibri", progress=False)
    assert os.listdir(tmp_path) == ["src"]


def test_missing_shard_is_named(editable, tmp_path):
    src = editable("qwen2_moe", sharded=True)
    index = json.loads((src / "model.safetensors.index.json").read_text())
    victim = sorted(set(index["weight_map"].values()))[1]
    (src / victim).unlink()
    with pytest.raises(ColibriError, match=f"shard '{victim}'.*missing"):
        convert(src, tmp_path / "x.colibri", progress=False)


def test_shape_mismatch_names_key_shapes_and_config_fields(editable, tmp_path):
    src = editable("mixtral")
    edit_config(src, intermediate_size=128)      # the checkpoint has 96
    with pytest.raises(ColibriError) as e:
        convert(src, tmp_path / "x.colibri", progress=False)
    msg = str(e.value)
    assert "model.layers.0.block_sparse_moe.experts.0.w1.weight" in msg
    assert "(96, 64)" in msg and "(128, 64)" in msg
    assert "intermediate_size=128" in msg and "hidden_size=64" in msg


def test_missing_and_unexpected_tensors(editable, tmp_path):
    src = editable("olmoe")
    tensors = load_file(str(src / "model.safetensors"))
    tensors["model.layers.0.self_attn.rotary_emb.inv_freq"] = np.ones(8, np.float32)  # ignorable
    save_file(tensors, str(src / "model.safetensors"))
    convert(src, tmp_path / "ok.colibri", progress=False)

    tensors["model.layers.0.mlp.extra.weight"] = np.ones((2, 2), np.float32)
    save_file(tensors, str(src / "model.safetensors"))
    with pytest.raises(ColibriError, match="model.layers.0.mlp.extra.weight"):
        convert(src, tmp_path / "x.colibri", progress=False)

    del tensors["model.layers.0.mlp.extra.weight"], tensors["model.norm.weight"]
    save_file(tensors, str(src / "model.safetensors"))
    with pytest.raises(ColibriError, match="no tensor for norm.*'model.norm.weight'"):
        convert(src, tmp_path / "x.colibri", progress=False)


def test_non_finite_values_are_named(editable, tmp_path):
    src = editable("olmoe")
    tensors = load_file(str(src / "model.safetensors"))
    tensors["model.layers.1.mlp.experts.2.up_proj.weight"][3, 5] = np.nan
    save_file(tensors, str(src / "model.safetensors"))
    with pytest.raises(ColibriError, match=r"layers\.1\.moe\.experts\.2\.w_up.*1 non-finite"):
        convert(src, tmp_path / "x.colibri", progress=False)
    assert os.listdir(tmp_path) == ["src"]


def test_f16_overflow_is_named(editable, tmp_path):
    src = editable("olmoe")
    tensors = load_file(str(src / "model.safetensors"))
    tensors["model.layers.0.self_attn.o_proj.weight"][1, 2] = 1e6       # beyond f16's 65504
    save_file(tensors, str(src / "model.safetensors"))
    with pytest.raises(ColibriError, match=r"layers\.0\.attn\.wo.*o_proj.*float16 range"):
        convert(src, tmp_path / "x.colibri", dtype="f16", progress=False)
    assert os.listdir(tmp_path) == ["src"]
    convert(src, tmp_path / "x.colibri", dtype="f32", progress=False)       # f32 holds it


def test_fp8_checkpoint_without_scales_is_refused(editable, tmp_path):
    import ml_dtypes
    src = editable("olmoe")
    tensors = load_file(str(src / "model.safetensors"))
    key = "model.layers.0.self_attn.q_proj.weight"
    tensors[key] = tensors[key].astype(ml_dtypes.float8_e4m3fn)
    save_file(tensors, str(src / "model.safetensors"))
    with pytest.raises(ColibriError, match=f"{key}.*F8_E4M3.*without its block scales"):
        convert(src, tmp_path / "x.colibri", progress=False)


def test_bad_options(hf_checkpoint, tmp_path):
    src = hf_checkpoint("olmoe")
    dst = tmp_path / "x.colibri"
    with pytest.raises(ColibriError, match="unknown quantize role 'expert'"):
        convert(src, dst, quant="q4", quantize="expert", progress=False)
    with pytest.raises(ColibriError, match="group_size 48"):
        convert(src, dst, quant="q4", group_size=48, progress=False)
    with pytest.raises(ColibriError, match="unknown dtype 'f64'"):
        convert(src, dst, dtype="f64", progress=False)
    with pytest.raises(ColibriError, match="not a folder"):
        convert(tmp_path / "nowhere", dst, progress=False)
    with pytest.raises(ColibriError, match="no config.json"):
        convert(tmp_path, dst, progress=False)


def test_default_group_size_shrinks_to_fit(hf_checkpoint, monkeypatch):
    monkeypatch.setattr(quant, "DEFAULT_GROUP_SIZE", 128)
    p = plan(hf_checkpoint("qwen2_moe"), quant="q4", quantize="experts,shared,dense")
    # input dims: experts w_down 32, others 64 or 96/128 -> the largest common multiple of 32
    assert p.group_size == 32
    p = plan(hf_checkpoint("qwen2_moe"), quant="q4", quantize="attn,head")    # all C = 64
    assert p.group_size == 64


def test_tokenizer_less_folder_converts_with_a_warning(hf_checkpoint, tmp_path):
    src = hf_checkpoint("mixtral", tokenizer=False)
    with pytest.warns(ConversionWarning, match="no tokenizer.json"):
        dst = convert(src, tmp_path / "m.colibri", progress=False)
    with ColibriFile(dst) as cf:
        files = cf.tokenizer_files or {}
        assert "tokenizer.json" not in files
    # and a folder with a tokenizer does not warn
    with warnings.catch_warnings():
        warnings.simplefilter("error", ConversionWarning)
        convert(hf_checkpoint("mixtral"), tmp_path / "n.colibri", progress=False)


@pytest.mark.parametrize("exc", [RuntimeError, KeyboardInterrupt])
def test_interrupted_conversion_leaves_nothing(hf_checkpoint, tmp_path, monkeypatch, exc):
    src = hf_checkpoint("qwen2_moe")
    dst = tmp_path / "m.colibri"
    dst.write_bytes(b"previous")                 # with --force it must survive a failure
    real_write, calls = ColibriWriter.write, []

    def failing_write(self, name, array, raw=False):
        calls.append(name)
        if len(calls) == 7:
            raise exc("injected")
        return real_write(self, name, array, raw=raw)

    monkeypatch.setattr(ColibriWriter, "write", failing_write)
    with pytest.raises(exc, match="injected"):
        convert(src, dst, force=True, progress=False)
    assert dst.read_bytes() == b"previous"
    assert no_temp_files(tmp_path) and os.listdir(tmp_path) == ["m.colibri"]
    dst.unlink()
    calls.clear()
    with pytest.raises(exc):
        convert(src, dst, progress=False)
    assert os.listdir(tmp_path) == []


def test_progress_bar_counts_bytes(hf_checkpoint, tmp_path, capsys):
    convert(hf_checkpoint("olmoe"), tmp_path / "m.colibri", progress=True)
    err = capsys.readouterr().err
    assert "convert" in err and "B" in err
    convert(hf_checkpoint("olmoe"), tmp_path / "n.colibri", progress=False)
    assert capsys.readouterr().err == ""


def test_peak_memory_is_a_small_multiple_of_the_largest_tensor(tmp_path):
    """Streaming: the Python/NumPy heap peak stays near the largest tensor (1 MiB here), far
    below the 14 MiB of weights."""
    src = make_hf_checkpoint(tmp_path / "big", "mixtral", vocab_size=4096,
                             intermediate_size=1024, num_hidden_layers=4)
    total = sum(f.stat().st_size for f in src.glob("*.safetensors"))
    largest = 4096 * 64 * 4
    assert total > 12 * largest
    convert(src, tmp_path / "warm.colibri", progress=False)    # imports out of the count
    tracemalloc.start()
    try:
        convert(src, tmp_path / "m.colibri", quant="q4", progress=False)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    # measured ~2.4x: safetensors' read buffer and the array made from it
    assert peak < 4 * largest, (peak, largest, total)
