"""The parity tests of one family against transformers, shared by the DeepSeek-V2 / V3 and
GLM-4-MoE test files (tests/test_family_<name>.py).

A family's test file makes a module-scoped `ref` fixture (a FamilyRef over a tiny random
checkpoint of hf_factory) and imports the tests below (`from family_oracle import *`);
they then run against that family:
  - f32: full prompt of a left-padded batch, the same batch step by step through a KV
    cache (the general path), one sequence token by token (the decode step), routing ids
    and weights against the transformers router, greedy tokens identical;
  - f16 / bf16 / q8 / q4: exact against transformers given the file's (rounded/quantized)
    weights, and within the bounds of tests/test_model.py (docs/accuracy.md) against the
    f32 transformers logits;
  - `colibri routes` and colibri.trace on the converted file.
Bounds and helpers are test_model.py's, so every family is held to the same numbers.
"""
from __future__ import annotations

import copy

import numpy as np
import pytest
import torch
import transformers

import colibri.api as api
from colibri.convert import convert
from colibri.config import ConfigError
from colibri.families import get_family
from colibri.families.deepseek import deinterleave_rows
from colibri.tools.trace import trace
from cli_helpers import run as run_cli
from test_model import (BOUNDS, F32_TOL, _hf_param, _positions, _prompts, _rel_err,
                        quality)

__all__ = ["FamilyRef", "PARITY_FORMATS", "test_f32_full_prompt_batch_with_padding",
           "test_f32_batch_step_by_step_with_cache", "test_f32_decode_step",
           "test_f32_ragged_step_matches_transformers",
           "test_f32_routing_matches_transformers_router", "test_f32_greedy_tokens_identical",
           "test_format_matches_transformers_with_the_same_weights",
           "test_format_error_within_documented_bounds", "test_routes_and_trace",
           "test_config_defaults_agree_with_transformers"]

PARITY_FORMATS = {   # name -> convert() keyword arguments (test_model.FORMATS' plain ones)
    "f16": dict(dtype="f16"),
    "bf16": dict(dtype="bf16"),
    "q8": dict(dtype="f32", quant="q8"),
    "q4": dict(dtype="f32", quant="q4"),
}
EVAL_SHAPE = (4, 32)


def hf_name(name: str, hf) -> tuple[str, tuple]:
    """transformers parameter/buffer name (and index into it) of canonical tensor `name`,
    for the DeepSeek / GLM-4-MoE module layout (shared_experts, gate.e_score_correction_bias)."""
    return _hf_param(name, hf, shared="shared_experts")


def interleave_back(name: str, w: np.ndarray, hf_config) -> np.ndarray:
    """The rows of a file tensor in the checkpoint's order: undoes the converter's
    de-interleaving of DeepSeek's RoPE rows (families/deepseek.py)."""
    c = hf_config
    if not c.model_type.startswith("deepseek") or not getattr(c, "rope_interleave", True):
        return w
    rope = c.qk_rope_head_dim
    if name.endswith((".attn.wq", ".attn.wq_b")):
        block = c.qk_nope_head_dim + rope
    elif name.endswith(".attn.wkv_a"):
        block = c.kv_lora_rank + rope
    else:
        return w
    order = deinterleave_rows(np.arange(w.shape[0])[:, None], block, rope)[:, 0]
    out = np.empty_like(w)
    out[order] = w
    return out


class FamilyRef:
    """transformers model + colibri models of one tiny checkpoint, and the oracle's outputs."""

    def __init__(self, family: str, hf_path, out_dir):
        self.family, self.path, self.out_dir = family, hf_path, out_dir
        self.hf = transformers.AutoModelForCausalLM.from_pretrained(
            hf_path, dtype=torch.float32, attn_implementation="eager").eval()
        self.vocab = self.hf.config.vocab_size
        self.ids, self.mask, self.seqs = _prompts(self.vocab)
        self.valid = self.mask.astype(bool)
        self.logits, self.routing = self.hf_forward(self.hf, self.ids, self.mask)
        self.models: dict[str, api.Model] = {}
        self._eval = None

    @staticmethod
    def hf_forward(hf, ids, mask):
        """transformers logits (B, S, V) and per-MoE-layer (ids, weights) (B, S, K), each
        token's experts listed in ascending id (transformers' top-k is unsorted)."""
        captured, hooks = [], []
        for layer in hf.model.layers:
            gate = getattr(layer.mlp, "gate", None)
            if gate is not None and hasattr(gate, "top_k"):
                hooks.append(gate.register_forward_hook(
                    lambda mod, inp, out: captured.append((out[2].numpy().copy(),
                                                           out[1].numpy().copy()))))
        try:
            with torch.no_grad():
                out = hf(input_ids=torch.from_numpy(ids), attention_mask=torch.from_numpy(mask),
                         position_ids=torch.from_numpy(_positions(mask)))
        finally:
            for h in hooks:
                h.remove()
        B, S = ids.shape
        return out.logits.numpy(), [by_id(i.reshape(B, S, -1), w.reshape(B, S, -1))
                                    for i, w in captured]

    def eval_set(self):
        if self._eval is None:
            ids = np.random.default_rng(1).integers(3, self.vocab, size=EVAL_SHAPE)
            logits, routing = self.hf_forward(self.hf, ids, np.ones_like(ids))
            self._eval = ids, logits, routing
        return self._eval

    def model(self, fmt: str = "f32") -> api.Model:
        if fmt not in self.models:
            dst = self.out_dir / f"{self.family}-{fmt}.colibri"
            kwargs = dict(dtype="f32") if fmt == "f32" else PARITY_FORMATS[fmt]
            convert(self.path, dst, progress=False, **kwargs)
            self.models[fmt] = api.load(dst, threads=1, activations="f32", kv_dtype="f32")
        return self.models[fmt]

    def hf_with_file_weights(self, m: api.Model):
        """A copy of the transformers model holding the weights as the file stores them."""
        hf = copy.deepcopy(self.hf)
        tensors = dict(hf.named_parameters()) | dict(hf.named_buffers())
        with torch.no_grad():
            for name in m.file.names():
                w = interleave_back(name, m.file.to_float32(name), hf.config)
                target, index = hf_name(name, hf)
                tensors[target][index] = torch.from_numpy(w).reshape(
                    tensors[target][index].shape)
        return hf

    def close(self) -> None:
        for m in self.models.values():
            m.close()


def by_id(ids: np.ndarray, weights: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(ids, weights) (..., K) with each row's experts in ascending id."""
    order = np.argsort(ids, axis=-1, kind="stable")
    return (np.take_along_axis(ids, order, -1).astype(np.int32),
            np.take_along_axis(weights, order, -1))


# ---------------------------------------------------------------------------------------------
# f32 parity
# ---------------------------------------------------------------------------------------------

def test_f32_full_prompt_batch_with_padding(ref):
    lg = ref.logits[ref.valid]
    assert lg.std(axis=-1).mean() > 0.3 and len(set(lg.argmax(-1).tolist())) > 3  # informative
    got = api.forward(ref.model(), ref.ids, attention_mask=ref.mask)
    assert got.shape == ref.logits.shape and np.isfinite(got).all()
    err = _rel_err(got[ref.valid], lg)
    assert err <= F32_TOL, f"{ref.family}: max relative logit error {err:.2e}"


def test_f32_batch_step_by_step_with_cache(ref):
    m = ref.model()
    cache = m.new_cache(ctx=32, batch=len(ref.seqs))
    split = 5
    parts = [api.forward(m, ref.ids[:, :split], cache=cache, attention_mask=ref.mask[:, :split])]
    for s in range(split, ref.ids.shape[1]):
        parts.append(api.forward(m, ref.ids[:, s:s + 1], cache=cache,
                                 attention_mask=ref.mask[:, :s + 1]))
    got = np.concatenate(parts, axis=1)
    err = _rel_err(got[ref.valid], ref.logits[ref.valid])
    assert err <= F32_TOL, f"{ref.family}: cached batch decoding error {err:.2e}"


def test_f32_decode_step(ref):
    """One sequence through a cache token by token: the decode step (Model._step)."""
    m = ref.model()
    prompt = ref.seqs[0]
    cache = m.new_cache(ctx=len(prompt))
    first = api.forward(m, prompt[:4], cache=cache)
    steps = [api.forward(m, prompt[i:i + 1], cache=cache) for i in range(4, len(prompt))]
    got = np.concatenate([first] + steps)
    want = ref.logits[0, ref.valid[0]]
    err = _rel_err(got, want)
    assert err <= F32_TOL, f"{ref.family}: decode step error {err:.2e}"
    assert cache.bytes_per_token == m.new_cache(ctx=1).nbytes


def test_f32_ragged_step_matches_transformers(ref):
    """Continuous batching's ragged step (Model.forward_ragged): the sequences of the batch,
    each in its own cache, in one pass (prompts of different lengths, then decode tokens
    together) give transformers' logits of each sequence."""
    m = ref.model()
    seqs = [s for s in ref.seqs if len(s) > 3]
    caches = [m.new_cache(ctx=len(s)) for s in seqs]
    got = [[row] for row in m.forward_ragged([(c, s[:-3]) for c, s in zip(caches, seqs)])]
    for t in (3, 2, 1):
        for j, row in enumerate(m.forward_ragged([(c, s[-t:len(s) - t + 1])
                                                  for c, s in zip(caches, seqs)])):
            got[j].append(row)
    for j, s in enumerate(seqs):
        b = next(i for i, q in enumerate(ref.seqs) if q is s)
        want = ref.logits[b, ref.valid[b]][len(s) - 4:]
        err = _rel_err(np.stack(got[j]), want)
        assert err <= F32_TOL, f"{ref.family}: ragged step error {err:.2e} (sequence {b})"


def test_f32_routing_matches_transformers_router(ref):
    _, tr = api.forward(ref.model(), ref.ids, attention_mask=ref.mask, return_routing=True)
    moe_layers = [i for i, layer in enumerate(ref.hf.model.layers)
                  if hasattr(getattr(layer.mlp, "gate", None), "top_k")]
    assert tr.layers == moe_layers and len(tr.ids) == len(ref.routing)
    for (want_ids, want_w), got_ids, got_w in zip(ref.routing, tr.ids, tr.weights):
        got_ids, got_w = by_id(got_ids, got_w)
        np.testing.assert_array_equal(got_ids[ref.valid], want_ids[ref.valid])
        np.testing.assert_allclose(got_w[ref.valid], want_w[ref.valid], rtol=1e-4, atol=1e-5)


def test_f32_greedy_tokens_identical(ref):
    m, prompt = ref.model(), ref.seqs[0]
    ids = torch.from_numpy(prompt[None].astype(np.int64))
    with torch.no_grad():
        for _ in range(12):
            nxt = ref.hf(input_ids=ids).logits[0, -1].argmax()
            ids = torch.cat([ids, nxt.view(1, 1)], dim=1)
    got = m.generate(prompt, max_new_tokens=12, temperature=0.0, stop=[])
    np.testing.assert_array_equal(got, ids[0, len(prompt):].numpy())


# ---------------------------------------------------------------------------------------------
# the weight formats
# ---------------------------------------------------------------------------------------------

@pytest.mark.parametrize("fmt", list(PARITY_FORMATS))
def test_format_matches_transformers_with_the_same_weights(ref, fmt):
    m = ref.model(fmt)
    want, want_routing = FamilyRef.hf_forward(ref.hf_with_file_weights(m), ref.ids, ref.mask)
    got, tr = api.forward(m, ref.ids, attention_mask=ref.mask, return_routing=True)
    err = _rel_err(got[ref.valid], want[ref.valid])
    assert err <= F32_TOL, f"{ref.family} {fmt}: error vs the same weights {err:.2e}"
    for (want_ids, _), got_ids in zip(want_routing, tr.ids):
        np.testing.assert_array_equal(np.sort(got_ids, -1)[ref.valid], want_ids[ref.valid])


@pytest.mark.parametrize("fmt", list(PARITY_FORMATS))
def test_format_error_within_documented_bounds(ref, fmt):
    """test_model.py's bounds, the logit measures over the tokens that attend only to tokens
    routed as in f32 in every layer (themselves included): a tiny random model's group
    routing has near ties whose flips (bounded by the routing agreement) move the logits
    of the token and of every later one far more than the format's rounding does."""
    ids, want, want_routing = ref.eval_set()
    got, tr = api.forward(ref.model(fmt), ids, return_routing=True)
    same = np.stack([np.all(np.sort(g, -1) == w, axis=-1)
                     for g, (w, _) in zip(tr.ids, want_routing)])            # (M, B, S)
    routing = float(same.mean())
    kept = np.cumprod(same.all(axis=0), axis=1).astype(bool)                # (B, S)
    err, top1, kl = quality(got[kept], want[kept])
    print(f"\n[accuracy] {ref.family:11s} {fmt:4s} max_rel_err={err:.3e} top1={top1:.3f} "
          f"mean_kl={kl:.3e} routing_agreement={routing:.3f} (tokens kept {kept.mean():.3f})")
    max_err, min_top1, max_kl, min_routing = BOUNDS[fmt]
    assert err <= max_err and top1 >= min_top1 and kl <= max_kl and routing >= min_routing, \
        (ref.family, fmt, err, top1, kl, routing)


# ---------------------------------------------------------------------------------------------
# introspection
# ---------------------------------------------------------------------------------------------

def test_routes_and_trace(ref, capsys):
    m, text = ref.model(), "def fibonacci(n): return n"
    tr = trace(m, text)
    moe = [i for i in range(m.n_layers) if m.config.is_moe_layer(i)]
    assert tr.layers == moe and tr.experts.shape[1:] == (len(moe), m.config.num_experts_per_tok)
    code, out, err = run_cli(capsys, "routes", m.file.path, "-p", text, "--threads", "1")
    assert code == 0 and err == "", err
    assert out.startswith(tr.format_table() + "\n\n")


# ---------------------------------------------------------------------------------------------
# config.json -> ModelConfig
# ---------------------------------------------------------------------------------------------

OPTIONAL_KEYS = ("first_k_dense_replace", "moe_intermediate_size", "n_shared_experts",
                 "q_lora_rank", "n_routed_experts", "routed_scaling_factor", "kv_lora_rank",
                 "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim", "n_group", "topk_group",
                 "norm_topk_prob", "intermediate_size", "use_qk_norm", "attention_bias")


def _derived(hf) -> dict:
    """What transformers' config object implies, in ModelConfig's terms."""
    mla = hf.model_type.startswith("deepseek")
    out = dict(num_experts=hf.n_routed_experts, num_experts_per_tok=hf.num_experts_per_tok,
               moe_intermediate_size=hf.moe_intermediate_size,
               moe_layers=tuple(range(hf.first_k_dense_replace, hf.num_hidden_layers)),
               shared_expert_intermediate_size=hf.n_shared_experts * hf.moe_intermediate_size,
               routed_scaling_factor=hf.routed_scaling_factor, head_dim=hf.head_dim)
    if hf.first_k_dense_replace:
        out["dense_intermediate_size"] = hf.intermediate_size
    if mla:
        out.update(kv_lora_rank=hf.kv_lora_rank, q_lora_rank=hf.q_lora_rank or 0,
                   qk_nope_head_dim=hf.qk_nope_head_dim, v_head_dim=hf.v_head_dim)
    if hf.model_type != "deepseek_v2" or hf.topk_method == "group_limited_greedy":
        out.update(n_group=hf.n_group, topk_group=hf.topk_group)
    if hf.model_type != "deepseek_v2":
        out["norm_topk_prob"] = hf.norm_topk_prob
    if hf.model_type == "glm4_moe":
        out.update(qk_norm="per_head" if hf.use_qk_norm else "none",
                   attention_bias=hf.attention_bias)
    return out


def test_config_defaults_agree_with_transformers(ref):
    """Each field config.json may leave out takes the value transformers' config class
    gives it (one left out at a time), and the full config.json reads as transformers does."""
    import json
    full = json.loads(ref.hf.config.to_json_string())
    fam = get_family(full["model_type"])
    cls = type(ref.hf.config)
    checked = 0
    for key in (None, *OPTIONAL_KEYS):
        if key is not None and key not in full:
            continue
        # head_dim is derived from qk_rope_head_dim: without the one, leave out the other
        gone = (key, "head_dim") if key == "qk_rope_head_dim" else (key,)
        plain = {k: v for k, v in full.items() if k not in gone}
        try:
            hf = cls(**{k: v for k, v in plain.items()
                        if k not in ("architectures", "transformers_version", "model_type")})
        except Exception:            # a default that does not fit the rest of the tiny config
            continue
        if key is not None and getattr(hf, key, 0) is None and key != "q_lora_rank":
            with pytest.raises(ConfigError, match=key):   # transformers has no value either
                fam.model_config(plain)
            continue
        try:
            cfg = fam.model_config(plain)
        except ConfigError:          # e.g. V3's 8 default groups of 8 experts: groups of one,
            continue                 # which transformers' router cannot run either
        for name, value in _derived(hf).items():
            assert getattr(cfg, name) == value, (key, name, getattr(cfg, name), value)
        checked += 1
    assert checked > 8
