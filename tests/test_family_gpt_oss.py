"""GPT-OSS against transformers (tests/family_parity.py): attention sinks, alternating
sliding-window layers, q/k/v/o biases, the router bias, top-k then softmax, the clamped
swigluoai experts with biases (gate / up interleaved in the checkpoint), YaRN."""
from __future__ import annotations

import json

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from colibri.families import get_family  # noqa: E402
from colibri.kernels.biased_experts import swigluoai  # noqa: E402
from family_parity import *  # noqa: E402,F401,F403 - the shared parity tests
from family_parity import FamilyRef  # noqa: E402

WINDOW = 6           # shorter than the prompts (11): the sliding layers must honour it


def gpt_oss_config(**kw):
    return transformers.GptOssConfig(**dict(dict(
        vocab_size=320, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, intermediate_size=32, num_local_experts=4,
        num_experts_per_tok=2, max_position_embeddings=131072, sliding_window=WINDOW,
        initializer_range=0.15, bos_token_id=1, eos_token_id=2, pad_token_id=0,
        # a limit the random activations reach, so the clamps are exercised
        swiglu_limit=1.0), **kw))


def gpt_oss_routers(hf):
    # GptOssTopKRouter returns (logits, weights, ids)
    return [(i, layer.mlp.router, lambda out: (out[2], out[1]))
            for i, layer in enumerate(hf.model.layers)]


@pytest.fixture(scope="module")
def ref(tmp_path_factory):
    r = FamilyRef.from_config(gpt_oss_config(), tmp_path_factory.mktemp("gpt_oss"),
                              gpt_oss_routers)
    with torch.no_grad():                       # sinks far from 0 so that they matter
        for layer in r.hf.model.layers:
            assert layer.self_attn.sinks.abs().max() > 0
    yield r
    r.close()


def test_config(ref):
    cfg = ref.model().config
    assert (cfg.router, cfg.router_bias, cfg.expert_bias) == ("topk_softmax", True, True)
    assert cfg.expert_activation == "swigluoai" and cfg.swiglu_limit == 1.0
    assert cfg.attention_sinks and cfg.attention_bias and cfg.attention_out_bias
    assert cfg.layer_types == ("sliding_attention", "full_attention")
    assert [cfg.layer_window(i) for i in range(2)] == [WINDOW, None]
    assert cfg.rope_scaling["rope_type"] == "yarn"
    hf = json.loads((ref.path / "config.json").read_text())
    assert get_family("gpt_oss").model_config(hf) == cfg


def test_swigluoai_matches_transformers():
    from transformers.models.gpt_oss.modeling_gpt_oss import GptOssExperts
    experts = GptOssExperts(gpt_oss_config(swiglu_limit=7.0))
    gate_up = torch.randn(50, 64) * 6
    want = experts._apply_gate(gate_up).numpy()
    g, u = gate_up[:, ::2].numpy(), gate_up[:, 1::2].numpy()
    np.testing.assert_allclose(swigluoai(g, u, 1.702, 7.0), want, rtol=1e-6, atol=1e-6)



# --- the released layout: MXFP4 experts, kept as they ship ------------------------------------

def _mxfp4_checkpoint(ref, dst):
    """ref's checkpoint with its experts stored as the released GPT-OSS checkpoints store
    them (MXFP4 *_blocks / *_scales, rows = outputs, gate / up interleaved), and the oracle
    folder: the same experts decoded by transformers' own MXFP4 decoder, unquantized."""
    import shutil
    from safetensors.numpy import load_file, save_file
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors
    from colibri.format import mxfp4
    tensors = load_file(str(ref.path / "model.safetensors"))
    packed, oracle = {}, {}
    for key, value in tensors.items():
        if key.endswith(("experts.gate_up_proj", "experts.down_proj")):
            w = np.ascontiguousarray(value.transpose(0, 2, 1))           # (E, R, C)
            codes, scales = mxfp4.quantize(w)
            E, R, C = w.shape
            blocks = codes.reshape(E, R, C // 32, 16)
            packed[key + "_blocks"], packed[key + "_scales"] = blocks, scales
            oracle[key] = convert_moe_packed_tensors(
                torch.from_numpy(blocks), torch.from_numpy(scales),
                dtype=torch.float32).numpy()                             # (E, C, R)
        else:
            packed[key] = oracle[key] = value
    out = {}
    for name, tensors_ in (("mxfp4", packed), ("oracle", oracle)):
        folder = dst / name
        shutil.copytree(ref.path, folder)
        save_file(tensors_, str(folder / "model.safetensors"), metadata={"format": "pt"})
        out[name] = folder
    return out, packed


@pytest.fixture(scope="module")
def mx(ref, tmp_path_factory):
    from colibri.convert import convert
    import colibri.api as api
    folders, packed = _mxfp4_checkpoint(ref, tmp_path_factory.mktemp("gpt_oss_mxfp4"))
    path = convert(folders["mxfp4"], folders["mxfp4"].parent / "m.colibri", progress=False,
                   dtype="f32")
    hf = transformers.AutoModelForCausalLM.from_pretrained(
        folders["oracle"], dtype=torch.float32, attn_implementation="eager").eval()
    m = api.load(path, threads=1, activations="f32", kv_dtype="f32")
    yield m, hf, packed
    m.close()


def test_mxfp4_experts_are_stored_as_they_ship(mx):
    m, _, packed = mx
    from colibri.format import mxfp4
    f, I, D = m.file, m.config.moe_intermediate_size, m.config.hidden_size
    blocks = packed["model.layers.1.mlp.experts.gate_up_proj_blocks"]
    scales = packed["model.layers.1.mlp.experts.gate_up_proj_scales"]
    for e in (0, 3):
        info = f.info(f"layers.1.moe.experts.{e}.w_up")
        assert (info.dtype, info.group_size, info.shape) == ("mxfp4", 32, (I, D))
        stored = np.asarray(f.buffer)[info.offset:info.offset + info.nbytes].reshape(I, -1)
        codes, sc = mxfp4.split(stored, D)
        np.testing.assert_array_equal(codes, blocks[e, 1::2].reshape(I, D // 2))   # odd rows
        np.testing.assert_array_equal(sc, scales[e, 1::2])
    assert f.info("layers.0.moe.experts.2.w_down").dtype == "mxfp4"
    assert f.info("layers.0.attn.wq").dtype == "f32"


def test_mxfp4_model_matches_transformers_on_its_weights(mx, ref):
    """colibri multiplying the MXFP4 bytes directly = transformers on the same experts
    decoded by its MXFP4 decoder: full prompt with padding, and the decode step."""
    import colibri.api as api
    from test_model import F32_TOL, _positions, _rel_err
    m, hf, _ = mx
    with torch.no_grad():
        want = hf(input_ids=torch.from_numpy(ref.ids), attention_mask=torch.from_numpy(ref.mask),
                  position_ids=torch.from_numpy(_positions(ref.mask))).logits.numpy()
    got = api.forward(m, ref.ids, attention_mask=ref.mask)
    assert _rel_err(got[ref.valid], want[ref.valid]) <= F32_TOL
    seq = ref.seqs[0]
    with torch.no_grad():
        want1 = hf(input_ids=torch.from_numpy(seq[None])).logits.numpy()[0]
    cache = m.new_cache(ctx=32)
    steps = np.stack([api.forward(m, np.array([t]), cache=cache)[0] for t in seq])
    assert _rel_err(steps, want1) <= F32_TOL
    # and the MXFP4 rounding is visible: the unquantized model differs
    assert _rel_err(got[ref.valid], ref.logits[ref.valid]) > 10 * F32_TOL


@pytest.mark.parametrize("activations", ["int16", "int8"])
def test_mxfp4_model_quantized_activations_within_bounds(mx, ref, activations):
    """The MXFP4 experts on int16 / int8 activations (csrc/mxfp4.h's integer bodies) against
    transformers on the same weights: within test_model's INT16_TOL / INT8_TOL
    (docs/accuracy.md), and really another path (the decode step's logits move; a prompt's
    experts with many tokens take the integer GEMM path)."""
    import colibri.api as api
    from test_model import INT8_TOL, INT16_TOL, _positions, _rel_err
    m, hf, _ = mx
    with torch.no_grad():
        want = hf(input_ids=torch.from_numpy(ref.ids), attention_mask=torch.from_numpy(ref.mask),
                  position_ids=torch.from_numpy(_positions(ref.mask))).logits.numpy()
    seq = ref.seqs[0]
    cache = m.new_cache(ctx=32)
    exact = np.stack([api.forward(m, np.array([t]), cache=cache)[0] for t in seq])
    mq = api.load(m.file.path, threads=2, activations=activations, kv_dtype="f32")
    try:
        got = api.forward(mq, ref.ids, attention_mask=ref.mask)
        cache = mq.new_cache(ctx=32)
        steps = np.stack([api.forward(mq, np.array([t]), cache=cache)[0] for t in seq])
    finally:
        mq.close()
    with torch.no_grad():
        want1 = hf(input_ids=torch.from_numpy(seq[None])).logits.numpy()[0]
    tol = INT16_TOL if activations == "int16" else INT8_TOL
    err = _rel_err(got[ref.valid], want[ref.valid])
    print(f"\n[gpt-oss mxfp4 {activations}] prompt {err:.2e} decode {_rel_err(steps, want1):.2e}")
    assert err <= tol and _rel_err(steps, want1) <= tol
    assert _rel_err(steps, exact) > 0          # the decode step's experts: the integer bodies


# --- a memory budget: the experts in the expert cache's arena ----------------------------------

@pytest.mark.parametrize("fmt,activations", [("f32", "f32"), ("q4", "int16"),
                                             ("mxfp4", "int8")])
def test_memory_budget_arena_same_bits(ref, mx, fmt, activations):
    """GPT-OSS's experts (biases, swigluoai) run from the expert cache's arena (its slots
    as the stacks, the biases read by expert id) with the same bits as from the mapping: a
    prompt (several tokens per expert) and decode steps (the one-token compiled call), with
    a budget of fewer slots than blocks, so blocks are evicted and land in other slots."""
    import colibri.api as api
    from colibri.experts.expert_cache import memory_plan
    path = mx[0].file.path if fmt == "mxfp4" else ref.model(fmt).file.path
    plain = api.load(path, threads=2, activations=activations, kv_dtype="f32")
    plan = memory_plan(plain.file, None)
    cached = api.load(path, threads=2, activations=activations, kv_dtype="f32",
                      memory_budget=plan.minimum + plan.slot_bytes)
    try:
        assert cached.expert_cache.mode == "arena"
        assert cached.expert_cache.plan.n_slots < plan.n_blocks
        seq = ref.seqs[0]
        outs = []
        for m in (plain, cached):
            prompt = api.forward(m, ref.ids, attention_mask=ref.mask)
            cache = m.new_cache(ctx=32)
            steps = np.stack([api.forward(m, np.array([t]), cache=cache)[0] for t in seq])
            outs.append((prompt, steps))
        assert np.isfinite(outs[0][1]).all()
        np.testing.assert_array_equal(outs[0][0][ref.valid], outs[1][0][ref.valid])
        np.testing.assert_array_equal(outs[0][1], outs[1][1])
        stats = cached.expert_cache.stats()
        assert stats["misses"] > plan.n_blocks and stats["hits"] > 0     # evictions happened
    finally:
        plain.close()
        cached.close()
