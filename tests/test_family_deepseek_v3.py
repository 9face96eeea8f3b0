"""DeepSeek-V3 against transformers (tests/family_parity.py), plus what is V3's own: sigmoid
routing with the correction bias in groups, half-split RoPE (rope_interleave false), the
multi-token-prediction layers skipped, and FP8 block-scaled checkpoints."""
from __future__ import annotations

import json

import numpy as np
import pytest

pytest.importorskip("transformers")
import torch  # noqa: E402

import colibri.api as api  # noqa: E402
from colibri.convert import convert, plan  # noqa: E402
from colibri.errors import ColibriError  # noqa: E402
from colibri.families import get_family  # noqa: E402
from family_parity import *  # noqa: E402,F401,F403 - the shared parity tests
from family_parity import FamilyRef, gate_routers  # noqa: E402
from hf_factory import copy_checkpoint, load_hf_model, tiny_config  # noqa: E402
from test_model import F32_TOL, _rel_err  # noqa: E402

FAMILY = "deepseek_v3"
INIT_RANGE = 0.15


@pytest.fixture(scope="module")
def ref(hf_checkpoint, tmp_path_factory):
    r = FamilyRef(hf_checkpoint(FAMILY, initializer_range=INIT_RANGE),
                  tmp_path_factory.mktemp(FAMILY), gate_routers, flips_spread=True)
    yield r
    r.close()


def test_model_config_fields():
    hf = json.loads(tiny_config(FAMILY).to_json_string())
    cfg = get_family(FAMILY).model_config(hf)
    assert cfg.router == "sigmoid_group_topk" and (cfg.n_group, cfg.topk_group) == (4, 2)
    assert cfg.norm_topk_prob and cfg.routed_scaling_factor == 2.5 and cfg.q_lora_rank == 0
    assert cfg.moe_layers == (1, 2) and cfg.shared_expert_intermediate_size == 32
    names = {name for _, name in get_family(FAMILY).tensor_map(cfg)}
    assert "layers.1.moe.correction_bias" in names and "layers.0.moe.correction_bias" not in names


def test_router_bias_changes_the_choice(ref):
    """The correction bias is read (hf_factory gives it noise): zeroing it in transformers
    changes which experts are chosen."""
    gate = ref.hf.model.layers[1].mlp.gate
    saved = gate.e_score_correction_bias.clone()
    try:
        with torch.no_grad():
            gate.e_score_correction_bias.zero_()
        _, routing = ref.hf_forward(ref.ids, ref.mask)
    finally:
        with torch.no_grad():
            gate.e_score_correction_bias.copy_(saved)
    assert not np.array_equal(routing[0][0], ref.routing[0][0])


def _f32_parity(path, tmp_path, dtype="f32"):
    r = FamilyRef(path, tmp_path, gate_routers)
    m = r.model()
    got = api.forward(m, r.ids, attention_mask=r.mask)
    assert _rel_err(got[r.valid], r.logits[r.valid]) <= F32_TOL
    cache = m.new_cache(ctx=16)
    prompt = r.seqs[0]
    steps = [api.forward(m, prompt[i:i + 1], cache=cache) for i in range(len(prompt))]
    assert _rel_err(np.concatenate(steps), r.logits[0, r.valid[0]]) <= F32_TOL
    r.close()


def test_half_split_rope(hf_checkpoint, tmp_path):
    path = hf_checkpoint(FAMILY, initializer_range=INIT_RANGE, rope_interleave=False,
                         q_lora_rank=32)
    _f32_parity(path, tmp_path)


def test_mtp_layers_are_skipped(hf_checkpoint, tmp_path):
    """A release checkpoint's multi-token-prediction layer (model.layers.N, N =
    num_hidden_layers) is not part of the model: skipped, not an error."""
    from safetensors.numpy import load_file, save_file
    src = copy_checkpoint(hf_checkpoint(FAMILY), tmp_path / "ckpt")
    tensors = load_file(str(src / "model.safetensors"))
    tensors["model.layers.3.eh_proj.weight"] = np.zeros((64, 128), np.float32)
    save_file(tensors, str(src / "model.safetensors"), metadata={"format": "pt"})
    p = plan(src)
    assert "model.layers.3.eh_proj.weight" in p.ignored


# --- FP8 block-scaled checkpoints ------------------------------------------------------------

FP8_BLOCK = (48, 32)        # ragged at the edges of the tiny matrices (64 rows: 48 + 16)


def _quantize_fp8(w: np.ndarray, block) -> tuple[np.ndarray, np.ndarray]:
    """w float32 (R, C) -> float8_e4m3fn codes (R, C), scale_inv float32 per block: the
    release checkpoints' encoding (amax of the block maps to 448)."""
    import ml_dtypes
    R, C = w.shape
    br, bc = block
    scale = np.ones((-(-R // br), -(-C // bc)), np.float32)
    codes = np.empty((R, C), ml_dtypes.float8_e4m3fn)
    for i in range(scale.shape[0]):
        for j in range(scale.shape[1]):
            blk = w[i * br:(i + 1) * br, j * bc:(j + 1) * bc]
            scale[i, j] = max(float(np.abs(blk).max()), 1e-12) / 448.0
            codes[i * br:(i + 1) * br, j * bc:(j + 1) * bc] = (blk / scale[i, j]).astype(
                ml_dtypes.float8_e4m3fn)
    return codes, scale


def _fp8_checkpoint(src, dst, edit=None):
    """A copy of src with every projection's weight in FP8 (what the release quantizes: not
    the embedding, the head, the norms, the router); returns (folder, dequantized weights).
    edit(tensors) may change the tensors before they are written."""
    from safetensors.numpy import load_file, save_file
    dst = copy_checkpoint(src, dst)
    tensors = load_file(str(dst / "model.safetensors"))
    dequantized = {}
    for key in list(tensors):
        if key.endswith("proj.weight") or key.endswith("proj_with_mqa.weight"):
            codes, scale = _quantize_fp8(tensors[key], FP8_BLOCK)
            tensors[key], tensors[key + "_scale_inv"] = codes, scale
            br, bc = FP8_BLOCK
            full = np.repeat(np.repeat(scale, br, 0), bc, 1)[:codes.shape[0], :codes.shape[1]]
            dequantized[key] = codes.astype(np.float32) * full
    if edit is not None:
        edit(tensors)
    save_file(tensors, str(dst / "model.safetensors"), metadata={"format": "pt"})
    config = json.loads((dst / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "fp8", "fmt": "e4m3",
                                     "activation_scheme": "dynamic",
                                     "weight_block_size": list(FP8_BLOCK)}
    (dst / "config.json").write_text(json.dumps(config))
    return dst, dequantized


def _reshard(folder):
    """Move every *_scale_inv into a second shard with an index: the scales of a release
    checkpoint's tensors are not always in the tensor's shard."""
    from safetensors import safe_open
    from safetensors.numpy import save_file
    path = folder / "model.safetensors"
    with open(path, "rb") as f:                      # FP8 arrays: read the raw layout
        n = int.from_bytes(f.read(8), "little")
        header = json.loads(f.read(n))
        data = f.read()
    header.pop("__metadata__", None)
    import ml_dtypes
    kinds = {"F32": np.float32, "F8_E4M3": ml_dtypes.float8_e4m3fn}
    tensors = {k: np.frombuffer(data[v["data_offsets"][0]:v["data_offsets"][1]],
                                kinds[v["dtype"]]).reshape(v["shape"])
               for k, v in header.items()}
    path.unlink()
    shards = {"model-00001-of-00002.safetensors": {k: v for k, v in tensors.items()
                                                   if not k.endswith("_scale_inv")},
              "model-00002-of-00002.safetensors": {k: v for k, v in tensors.items()
                                                   if k.endswith("_scale_inv")}}
    weight_map = {}
    for name, part in shards.items():
        save_file(part, str(folder / name), metadata={"format": "pt"})
        weight_map.update({k: name for k in part})
    (folder / "model.safetensors.index.json").write_text(json.dumps(
        {"metadata": {}, "weight_map": weight_map}))
    with safe_open(str(folder / "model-00002-of-00002.safetensors"), "np") as f:
        assert all(k.endswith("_scale_inv") for k in f.keys())


def test_fp8_checkpoint_converts(hf_checkpoint, tmp_path):
    """colibri's logits on the converted FP8 checkpoint = transformers' with the dequantized
    weights; "auto" stores bf16."""
    src = hf_checkpoint(FAMILY, initializer_range=INIT_RANGE)
    fp8, dequantized = _fp8_checkpoint(src, tmp_path / "fp8")
    hf = load_hf_model(src)
    with torch.no_grad():
        # the in-memory model fuses experts: set them through the per-expert checkpoint keys
        state = hf.state_dict()
        for key, w in dequantized.items():
            layer_expert = key.split(".mlp.experts.")
            if len(layer_expert) == 2:
                e, proj = layer_expert[1].split(".")[:2]
                base = layer_expert[0] + ".mlp.experts."
                inter = state[base + "down_proj"].shape[-1]
                if proj == "down_proj":
                    state[base + "down_proj"][int(e)] = torch.from_numpy(w)
                else:
                    rows = slice(0, inter) if proj == "gate_proj" else slice(inter, 2 * inter)
                    state[base + "gate_up_proj"][int(e), rows] = torch.from_numpy(w)
            else:
                state[key].copy_(torch.from_numpy(w))
    ids = np.random.default_rng(3).integers(3, 320, size=(2, 9))
    with torch.no_grad():
        want = hf(input_ids=torch.from_numpy(ids)).logits.numpy()
    p = plan(fp8)
    assert p.dtype == "bf16"
    assert sum(t.fp8_scale is not None for t in p.tensors) == len(dequantized)
    dst = convert(fp8, tmp_path / "fp8.colibri", dtype="f32", progress=False)
    with api.load(dst, threads=1, activations="f32", kv_dtype="f32") as m:
        got = api.forward(m, ids)
    assert _rel_err(got, want) <= F32_TOL
    _reshard(fp8)                                     # the scales in another shard
    dst = convert(fp8, tmp_path / "fp8-sharded.colibri", dtype="f32", progress=False)
    with api.load(dst, threads=1, activations="f32", kv_dtype="f32") as m:
        np.testing.assert_array_equal(api.forward(m, ids), got)
    # the plain checkpoint gives other logits: the FP8 rounding was really applied
    with torch.no_grad():
        plain = load_hf_model(src)(input_ids=torch.from_numpy(ids)).logits.numpy()
    assert _rel_err(plain, want) > 10 * F32_TOL


def test_fp8_bad_scales_are_named(hf_checkpoint, tmp_path):
    key = "model.layers.1.self_attn.q_proj.weight_scale_inv"

    def cut(tensors):
        tensors[key] = tensors[key][:1]
    fp8, _ = _fp8_checkpoint(hf_checkpoint(FAMILY), tmp_path / "fp8", edit=cut)
    with pytest.raises(ColibriError, match=f"{key}.*needs \\(2, 2\\) floats"):
        plan(fp8)
