"""GGUF import (colibri/convert/gguf_import.py, gguf_config.py) against transformers.

Each tiny checkpoint of hf_factory is written as a GGUF in llama.cpp's layout
(tests/gguf_factory.py), converted with colibri.convert and run; the oracle is transformers
given the GGUF's dequantized weights (gguf's own quantize / dequantize, in Hugging Face
layout). Checked: logits (f32, Q8_0, Q4_0 at 1e-4 relative), the Q8_0 / Q4_0 / MXFP4 blocks
stored bit for bit, the tokenizer and chat template, K-quants requantized with the error
reported, and the errors for files colibri cannot take.
"""
from __future__ import annotations

import json
import shutil
import warnings

import gguf
import numpy as np
import pytest
import torch
import transformers
from gguf import GGMLQuantizationType as T
from safetensors.numpy import save_file

import colibri
import colibri.api as api
from colibri.convert import ConversionWarning
from colibri.errors import ColibriError
from colibri.format import ColibriFile
from colibri.convert.gguf_import import gguf_mxfp4_rows, unpermute_rows
from colibri.format.mxfp4 import dequantize as mxfp4_dequantize
from cli_helpers import run
from gguf_factory import GGUF_OVERRIDES, permute, write_gguf
from hf_factory import make_hf_checkpoint
from test_model import F32_TOL, _rel_err

FAMILIES = ("mixtral", "qwen2_moe", "qwen3_moe", "olmoe", "deepseek_v2", "deepseek_v3")
QTYPES = ("F32", "BF16", "Q8_0", "Q4_0")
SAMPLE = "Hello world! The hummingbird is small, fast and frugal.\n def f(n): return n"
IDS = np.array([[5, 17, 99, 3, 250, 41, 7, 120, 64, 11, 200, 33]])


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    cache = {}

    def get(family):
        if family not in cache:
            path = tmp_path_factory.mktemp(family) / "hf"
            cache[family] = make_hf_checkpoint(path, family, **GGUF_OVERRIDES.get(family, {}))
        return cache[family]
    return get


@pytest.fixture(scope="module")
def imported(ckpt, tmp_path_factory):
    """(family, qtype) -> (gguf path, colibri path, reference state dict)."""
    cache = {}

    def get(family, qtype):
        if (family, qtype) not in cache:
            out = tmp_path_factory.mktemp(f"{family}-{qtype}")
            src, ref = write_gguf(ckpt(family), out / "model.gguf", qtype)
            dst = colibri.convert(src, out / "model.colibri", progress=False)
            cache[family, qtype] = (src, dst, ref)
        return cache[family, qtype]
    return get


def hf_logits(hf_dir, ref, tmp_path) -> np.ndarray:
    """transformers' float32 logits for IDS with the weights `ref` (HF keys)."""
    folder = tmp_path / "ref"
    folder.mkdir()
    shutil.copy(hf_dir / "config.json", folder / "config.json")
    save_file({k: np.ascontiguousarray(v) for k, v in ref.items()},
              folder / "model.safetensors")
    transformers.utils.logging.disable_progress_bar()
    model = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    with torch.no_grad():
        return model.eval()(torch.from_numpy(IDS)).logits.numpy()


@pytest.mark.parametrize("qtype", QTYPES)
@pytest.mark.parametrize("family", FAMILIES)
def test_logits_match_transformers_on_the_gguf_weights(family, qtype, ckpt, imported,
                                                       tmp_path):
    _, dst, ref = imported(family, qtype)
    want = hf_logits(ckpt(family), ref, tmp_path)
    with colibri.load(dst, threads=1, activations="f32") as model:
        got = api.forward(model, IDS)
    assert want.std() > 1e-3
    err = _rel_err(got, want)
    assert err <= F32_TOL, f"{family} {qtype}: max relative logit error {err:.2e}"


def test_f32_gguf_is_the_checkpoint(ckpt, imported, tmp_path):
    """The F32 GGUF's reference is the checkpoint itself: the layout round trip is exact."""
    from safetensors.numpy import load_file
    _, _, ref = imported("mixtral", "F32")
    sd = load_file(ckpt("mixtral") / "model.safetensors")
    assert sorted(ref) == sorted(sd)
    for k in sd:
        np.testing.assert_array_equal(ref[k], sd[k])


@pytest.mark.parametrize("qtype", ("Q8_0", "Q4_0"))
@pytest.mark.parametrize("family", ("mixtral", "deepseek_v2"))
def test_blocks_are_kept_bit_for_bit(family, qtype, imported):
    """Every Q8_0 / Q4_0 tensor is stored as colibri q8 / q4 (group 32) whose codes and
    scales are the GGUF's bytes, so it decodes to exactly gguf's dequantization."""
    src, dst, _ = imported(family, qtype)
    reader = gguf.GGUFReader(src)
    f = ColibriFile(dst)
    cfg = f.model_config
    fmt = {"Q8_0": "q8", "Q4_0": "q4"}[qtype]
    checked = 0
    for g in reader.tensors:
        if g.tensor_type.name != qtype:
            continue
        want = gguf.quants.dequantize(g.data, g.tensor_type)
        layer = int(g.name.split(".")[1]) if g.name.startswith("blk.") else None
        base = g.name.split(".")[-2]
        if base.endswith("_exps"):
            proj = {"ffn_gate_exps": "w_gate", "ffn_up_exps": "w_up",
                    "ffn_down_exps": "w_down"}[base]
            pairs = [(f"layers.{layer}.moe.experts.{e}.{proj}", want[e])
                     for e in range(want.shape[0])]
        elif base == "attn_output":
            pairs = [(f"layers.{layer}.attn.wo", want)]
        elif base == "attn_q" and family == "mixtral":
            pairs = [(f"layers.{layer}.attn.wq", unpermute_rows(want, cfg.num_attention_heads))]
        elif base == "token_embd":
            pairs = [("tok_embeddings", want)]
        else:
            continue
        for name, values in pairs:
            t = f.tensor(name)
            assert t.dtype == fmt and t.group_size == 32, name
            np.testing.assert_array_equal(t.dequantize(), values, err_msg=name)
            checked += 1
    # the raw bytes: codes then scales, the GGUF block's d and qs re-laid
    g = next(t for t in reader.tensors if t.name == "blk.1.ffn_down_exps.weight")
    blocks = np.asarray(g.data[0]).reshape(g.data.shape[1], -1, 34 if qtype == "Q8_0" else 18)
    t = f.tensor("layers.1.moe.experts.0.w_down")
    np.testing.assert_array_equal(np.asarray(t.scales).view(np.uint8).reshape(blocks.shape[0], -1),
                                  blocks[:, :, :2].reshape(blocks.shape[0], -1))
    np.testing.assert_array_equal(np.asarray(t.data).reshape(blocks.shape[0], -1),
                                  blocks[:, :, 2:].reshape(blocks.shape[0], -1))
    f.close()
    assert checked > 10


def test_mxfp4_blocks_relaid_exactly():
    rng = np.random.default_rng(0)
    w = rng.standard_normal((6, 128)).astype(np.float32)
    blocks = gguf.quants.quantize(w, T.MXFP4)                      # (6, 4 * 17)
    rows = gguf_mxfp4_rows(blocks, 128)
    got = mxfp4_dequantize(rows[:, :64], rows[:, 64:])
    np.testing.assert_array_equal(got, gguf.quants.dequantize(blocks, T.MXFP4))


def test_unpermute_inverts_llamacpp_permute():
    w = np.arange(8 * 16 * 3, dtype=np.float32).reshape(128, 3)
    np.testing.assert_array_equal(unpermute_rows(permute(w, 8), 8), w)


@pytest.mark.parametrize("family", ("qwen3_moe", "mixtral"))
def test_tokenizer_and_chat_template(family, ckpt, imported):
    _, dst, _ = imported(family, "Q8_0")
    hf_tok = transformers.AutoTokenizer.from_pretrained(ckpt(family))
    with colibri.load(dst) as model:
        tok = model.tokenizer
        ids = tok.encode(SAMPLE)
        assert ids == hf_tok.encode(SAMPLE)
        assert tok.decode(ids) == SAMPLE
        chat = [{"role": "user", "content": "hi there"}]
        assert tok.apply_chat_template(chat) == hf_tok.apply_chat_template(
            chat, add_generation_prompt=True, tokenize=True, return_dict=False)
    meta = ColibriFile(dst).metadata
    assert meta["converter"]["source_format"] == "gguf"
    assert meta["config"]["eos_token_id"] == hf_tok.convert_tokens_to_ids("<|im_end|>")


def _rewrite(src, dst, arch=None, retype=None):
    """A copy of GGUF src with another architecture name and/or some tensors replaced:
    retype(name, tensor) -> (data, ggml type) or None (kept)."""
    r = gguf.GGUFReader(src)
    old = r.fields["general.architecture"].contents()
    w = gguf.GGUFWriter(dst, arch or old)
    for key, field in r.fields.items():
        if key.startswith("GGUF.") or key == "general.architecture":
            continue
        value, vtype = field.contents(), field.types[0]
        name = key.replace(old + ".", (arch or old) + ".", 1) if key.startswith(old + ".") else key
        if vtype == gguf.GGUFValueType.ARRAY:
            w.add_array(name, value)
        else:
            w.add_key_value(name, value, vtype)
    for t in r.tensors:
        new = retype(t.name, t) if retype else None
        data, qtype = new if new else (np.asarray(t.data), t.tensor_type)
        w.add_tensor(t.name, data, raw_dtype=qtype)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return dst


def _random_blocks(shape, qtype, rng):
    """Random bytes as `qtype` blocks of a (..., R, C) tensor, with small f16 super-scales."""
    block, nbytes = gguf.GGML_QUANT_SIZES[qtype]
    raw = rng.integers(0, 256, size=(*shape[:-1], shape[-1] // block, nbytes), dtype=np.uint8)
    d = np.frombuffer(np.float16(0.002).tobytes(), np.uint8)
    if qtype == T.Q6_K:
        raw[..., 208:210] = d                                     # d is last, int8 scales
    else:                                                         # Q4_K / Q5_K: d, dmin first
        raw[..., 0:2] = d
        raw[..., 2:4] = np.frombuffer(np.float16(0.001).tobytes(), np.uint8)
    return raw.reshape(*shape[:-1], -1)


@pytest.mark.parametrize("quant,formats", [("auto", {"Q4_K": "q4", "Q6_K": "q8"}),
                                           ("q8", {"Q4_K": "q8", "Q6_K": "q8"}),
                                           ("f32", {"Q4_K": "f32", "Q6_K": "f32"})])
def test_kquants_requantized_with_the_error_reported(quant, formats, tmp_path):
    hf = make_hf_checkpoint(tmp_path / "hf", "qwen3_moe", hidden_size=256,
                            moe_intermediate_size=256, head_dim=64)
    src, _ = write_gguf(hf, tmp_path / "f32.gguf", "F32")
    rng = np.random.default_rng(1)
    types = {"ffn_gate_exps": T.Q4_K, "ffn_up_exps": T.Q4_K, "ffn_down_exps": T.Q6_K}

    def retype(name, t):
        q = types.get(name.split(".")[-2])
        return (_random_blocks(tuple(reversed([int(d) for d in t.shape])), q, rng), q) \
            if q else None
    kq = _rewrite(src, tmp_path / "kq.gguf", retype=retype)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        dst = colibri.convert(kq, tmp_path / "kq.colibri", progress=False,
                              **({} if quant == "auto" else
                                 {"quant": quant} if quant[0] == "q" else {"dtype": quant}))
    lines = [str(w.message) for w in caught if issubclass(w.category, ConversionWarning)]
    reader = gguf.GGUFReader(kq)
    f = ColibriFile(dst)
    for g in reader.tensors:
        q = types.get(g.name.split(".")[-2])
        if q is None:
            continue
        want = gguf.quants.dequantize(g.data, q)[1]
        proj = {"ffn_gate_exps": "w_gate", "ffn_up_exps": "w_up", "ffn_down_exps": "w_down"}
        name = f"layers.{g.name.split('.')[1]}.moe.experts.1.{proj[g.name.split('.')[-2]]}"
        fmt = formats[q.name]
        assert f.info(name).dtype == fmt, name
        got = f.to_float32(name)
        rel = np.abs(got - want).max() / np.abs(want).max()
        if fmt == "f32":
            np.testing.assert_array_equal(got, want)
        else:
            assert 0 < rel < (0.01 if fmt == "q8" else 0.2), (name, rel)
            assert any(f"moe.experts.{proj[g.name.split('.')[-2]]} {q.name} -> {fmt}" in line
                       for line in lines), lines
    if quant == "f32":
        assert not lines
    f.close()
    with colibri.load(dst, threads=1) as model:
        assert np.isfinite(api.forward(model, IDS)).all()


def test_unsupported_architecture_is_named(imported, tmp_path):
    src, _, _ = imported("qwen3_moe", "F32")
    bad = _rewrite(src, tmp_path / "gemma.gguf", arch="gemma2")
    with pytest.raises(ColibriError, match=r"architecture 'gemma2' is not supported; "
                                           r"supported: deepseek2, llama, olmoe"):
        colibri.convert(bad, tmp_path / "x.colibri", progress=False)


def test_unsupported_tensor_type_is_named(imported, tmp_path):
    src, _, _ = imported("qwen3_moe", "F32")

    def retype(name, t):
        if name == "blk.0.attn_output.weight":
            return np.zeros(tuple(reversed([int(d) for d in t.shape])), np.int8), T.I8
    bad = _rewrite(src, tmp_path / "i8.gguf", retype=retype)
    with pytest.raises(ColibriError, match=r"'blk.0.attn_output.weight' has type I8, which "
                                           r"colibri cannot read; supported: F32, F16, BF16, "
                                           r"Q8_0, Q4_0, MXFP4 \(kept exactly\)"):
        colibri.convert(bad, tmp_path / "x.colibri", progress=False)


@pytest.mark.parametrize("cut", (0.5, 0.999, 100))
def test_truncated_gguf_is_a_clear_error(cut, imported, tmp_path):
    src, _, _ = imported("olmoe", "Q8_0")
    data = src.read_bytes()
    bad = tmp_path / "cut.gguf"
    bad.write_bytes(data[:int(len(data) * cut)] if cut < 1 else data[:int(cut)])
    with pytest.raises(ColibriError, match="cut.gguf"):
        colibri.convert(bad, tmp_path / "x.colibri", progress=False)
    assert not (tmp_path / "x.colibri").exists()
    assert [p.name for p in tmp_path.iterdir()] == ["cut.gguf"]


def test_corrupt_header_is_a_clear_error(imported, tmp_path):
    src, _, _ = imported("olmoe", "F32")
    data = bytearray(src.read_bytes())
    data[8:24] = b"\xff" * 16                                     # absurd counts
    bad = tmp_path / "corrupt.gguf"
    bad.write_bytes(bytes(data))
    with pytest.raises(ColibriError, match="corrupt.gguf"):
        colibri.convert(bad, tmp_path / "x.colibri", progress=False)


def test_not_a_gguf_file_is_named(tmp_path):
    bad = tmp_path / "fake.gguf"
    bad.write_bytes(b"GGML" + bytes(100))
    with pytest.raises(ColibriError, match=r"fake.gguf: not a GGUF file"):
        colibri.convert(bad, tmp_path / "x.colibri", progress=False)


def test_cli_convert_gguf(imported, tmp_path, capsys):
    src, _, _ = imported("olmoe", "Q4_0")
    code, out, _ = run(capsys, "convert", str(src), str(tmp_path / "cli.colibri"))
    assert code == 0 and "wrote" in out
    meta = ColibriFile(tmp_path / "cli.colibri").metadata
    assert meta["converter"]["tensor_types"]["Q4_0 -> q4"] > 0
    assert json.loads(json.dumps(meta["config"]))["model_type"] == "olmoe"


def test_q8_code_minus_128_is_requantized(imported, tmp_path):
    """Q8_0 code -128 is outside colibri's q8 range: that tensor is requantized (reported),
    the others stay bit for bit."""
    src, _, _ = imported("olmoe", "Q8_0")

    def retype(name, t):
        if name == "blk.0.ffn_up_exps.weight":
            a = np.array(t.data)
            a[..., 5] = 0x80                              # the first code of each row
            return a, T.Q8_0
    bad = _rewrite(src, tmp_path / "m128.gguf", retype=retype)
    with pytest.warns(ConversionWarning, match=r"moe.experts.w_up Q8_0 -> q8: .*\(4 tensors\)"):
        dst = colibri.convert(bad, tmp_path / "m128.colibri", progress=False)
    g = {t.name: t for t in gguf.GGUFReader(bad).tensors}
    with ColibriFile(dst) as f:
        want = gguf.quants.dequantize(g["blk.1.ffn_up_exps.weight"].data, T.Q8_0)[2]
        np.testing.assert_array_equal(f.to_float32("layers.1.moe.experts.2.w_up"), want)
        got = f.to_float32("layers.0.moe.experts.2.w_up")
        assert np.abs(f.tensor("layers.0.moe.experts.2.w_up").data.view(np.int8)).max() <= 127
        want = gguf.quants.dequantize(g["blk.0.ffn_up_exps.weight"].data, T.Q8_0)[2]
        assert np.abs(got - want).max() <= 0.01 * np.abs(want).max()
