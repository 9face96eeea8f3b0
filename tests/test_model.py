"""Parity of colibri's forward pass with transformers, for every family and weight format.

For each family a tiny random checkpoint is made with transformers (hf_factory), converted
with colibri.convert, and run on the same batch of left-padded prompts by both:
  - f32: logits within 1e-4 of the largest |logit| (full prompt and step by step through the
    KV cache), greedy generation of 32 tokens identical, routing (ids and weights) identical
    to transformers' router top-k;
  - f16 / bf16 / q8 / q4: max logit error, top-1 agreement and mean KL against the f32
    transformers logits, each within the bound docs/accuracy.md documents for the format;
  - int8 activations (q8 / q4 files run with activations="int8"): the same measures, with
    the bounds docs/accuracy.md documents, and within INT8_TOL of transformers given the
    file's weights (what the int8 activations alone cost);
  - int16 activations (activations="int16"): the format's bounds, and within INT16_TOL of
    transformers given the file's weights (~100x closer than int8);
  - prefill == token by token, batch > 1 == separate runs, 1 thread == 2 threads;
  - the default: int16 activations for q4/q8 matrices; plain formats unaffected.
Every model here is loaded with its activations named (Ref.model: "f32" unless the format
says "-int8" / "-int16"), since the default, int16, is not exact.
"""
from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

import colibri.api as api  # noqa: E402
from colibri.convert import convert  # noqa: E402
from colibri.engine.kv_cache import CacheOverflowError  # noqa: E402
from colibri.engine.model import DEFAULT_ACTIVATIONS, Model  # noqa: E402
from hf_factory import FAMILY_NAMES  # noqa: E402

F32_TOL = 1e-4           # max |logit error| / max |logit|, f32 weights
INIT_RANGE = 0.15        # large enough that the logits are far from flat

# Per weight format: (max relative logit error, min top-1 agreement, max mean KL in nats,
# min routing agreement = fraction of (token, layer) whose top-k expert set equals f32's).
# Measured values and the reasoning behind the margins: docs/accuracy.md.
BOUNDS = {
    "f16": (5e-3, 0.95, 1e-5, 0.98),
    "bf16": (5e-2, 0.90, 5e-4, 0.95),
    "q8": (2e-1, 0.90, 1e-3, 0.95),
    "q4": (1.0, 0.55, 1e-1, 0.85),
    "q4-all": (1.5, 0.30, 4e-1, 0.70),
    "q8-int8": (2e-1, 0.90, 1e-3, 0.95),
    "q4-int8": (1.0, 0.55, 1e-1, 0.85),
    "q4-all-int8": (1.5, 0.30, 4e-1, 0.70),
}
INT8 = "-int8"           # suffix: the same file, run with activations="int8"
INT8_TOL = 5e-2          # max relative logit error of int8 activations vs exact f32 ones
INT16 = "-int16"         # suffix: the same file, run with activations="int16"
INT16_TOL = 3e-4         # max relative logit error of int16 activations vs exact f32 ones
FORMATS = {   # name -> convert() keyword arguments
    "f16": dict(dtype="f16"),
    "bf16": dict(dtype="bf16"),
    "q8": dict(dtype="f32", quant="q8"),
    "q4": dict(dtype="f32", quant="q4"),
    "q4-all": dict(dtype="f32", quant="q4", quantize="experts,shared,attn,head,dense"),
}
FORMATS.update({f + INT8: FORMATS[f] for f in ("q8", "q4", "q4-all")})
FORMATS.update({f + INT16: FORMATS[f] for f in ("q8", "q4", "q4-all")})
BOUNDS.update({f + INT16: BOUNDS[f] for f in ("q8", "q4", "q4-all")})


def _file_and_activations(fmt: str) -> tuple[str, str]:
    """'q4-int8' -> ('q4', 'int8'); 'q4' -> ('q4', 'f32'): exact activations named
    explicitly, the default being int16."""
    for suffix in (INT8, INT16):
        if fmt.endswith(suffix):
            return fmt.removesuffix(suffix), suffix[1:]
    return fmt, "f32"

LENGTHS = (11, 7, 3)     # prompt lengths of the batch (left padded to 11)
EVAL_SHAPE = (4, 32)     # prompts x tokens on which the formats' accuracy is measured


def _prompts(vocab: int, seed: int = 0) -> tuple[np.ndarray, np.ndarray, list[np.ndarray]]:
    """ids int64 (B, S) left padded with 0, mask (B, S), and the unpadded prompts."""
    rng = np.random.default_rng(seed)
    seqs = [rng.integers(3, vocab, size=n) for n in LENGTHS]
    S = max(LENGTHS)
    ids = np.zeros((len(seqs), S), np.int64)
    mask = np.zeros((len(seqs), S), np.int64)
    for b, s in enumerate(seqs):
        ids[b, S - len(s):] = s
        mask[b, S - len(s):] = 1
    return ids, mask, seqs


def _positions(mask: np.ndarray) -> np.ndarray:
    return np.clip(np.cumsum(mask, axis=1) - 1, 0, None)


def _rel_err(got: np.ndarray, want: np.ndarray) -> float:
    return float(np.abs(got - want).max() / np.abs(want).max())


def _log_softmax(x: np.ndarray) -> np.ndarray:
    x = x.astype(np.float64)
    x = x - x.max(axis=-1, keepdims=True)
    return x - np.log(np.exp(x).sum(axis=-1, keepdims=True))


def quality(got: np.ndarray, want: np.ndarray) -> tuple[float, float, float]:
    """(max relative error, top-1 agreement, mean KL(want || got)) over rows of (N, V) logits."""
    lw, lg = _log_softmax(want), _log_softmax(got)
    kl = float((np.exp(lw) * (lw - lg)).sum(axis=-1).mean())
    top1 = float((got.argmax(-1) == want.argmax(-1)).mean())
    return _rel_err(got, want), top1, kl


_ATTN = {"wq": "q_proj.weight", "wk": "k_proj.weight", "wv": "v_proj.weight", "wo": "o_proj.weight",
         "bq": "q_proj.bias", "bk": "k_proj.bias", "bv": "v_proj.bias", "q_norm": "q_norm.weight",
         "k_norm": "k_norm.weight",
         # multi-head latent attention (DeepSeek-V2/V3)
         "wq_a": "q_a_proj.weight", "q_a_norm": "q_a_layernorm.weight", "wq_b": "q_b_proj.weight",
         "wkv_a": "kv_a_proj_with_mqa.weight", "kv_a_norm": "kv_a_layernorm.weight",
         "wkv_b": "kv_b_proj.weight"}
_MLP = {"w_gate": "gate_proj.weight", "w_up": "up_proj.weight", "w_down": "down_proj.weight"}


def _hf_param(name: str, hf, shared: str = "shared_expert") -> tuple[str, tuple]:
    """transformers parameter name (and index into it) holding canonical tensor `name`;
    shared: the shared expert's module ("shared_expert" in Qwen2-MoE, "shared_experts" in
    DeepSeek / GLM-4-MoE)."""
    top = {"tok_embeddings": "model.embed_tokens.weight", "norm": "model.norm.weight",
           "lm_head": "lm_head.weight"}
    if name in top:
        return top[name], ()
    _, i, rest = name.split(".", 2)
    p = f"model.layers.{i}."
    if rest == "attn_norm":
        return p + "input_layernorm.weight", ()
    if rest == "ffn_norm":
        return p + "post_attention_layernorm.weight", ()
    kind, _, sub = rest.partition(".")
    if kind == "attn":
        return p + "self_attn." + _ATTN[sub], ()
    if kind == "mlp":
        return p + "mlp." + _MLP[sub], ()
    if sub == "router":
        return p + "mlp.gate.weight", ()
    if sub == "correction_bias":
        return p + "mlp.gate.e_score_correction_bias", ()
    if sub == "shared_gate":
        return p + "mlp.shared_expert_gate.weight", ()
    if sub.startswith("shared."):
        return p + f"mlp.{shared}." + _MLP[sub.split(".")[1]], ()
    _, e, proj = sub.split(".")                              # experts.{e}.{proj}
    e = int(e)
    inter = hf.model.layers[int(i)].mlp.experts.down_proj.shape[-1]
    if proj == "w_down":
        return p + "mlp.experts.down_proj", (e,)
    half = slice(0, inter) if proj == "w_gate" else slice(inter, 2 * inter)
    return p + "mlp.experts.gate_up_proj", (e, half)


class Ref:
    """transformers model + colibri model of one family, and the oracle's outputs."""

    def __init__(self, family: str, hf_path, out_dir):
        self.family = family
        self.path = hf_path
        self.out_dir = out_dir
        self.hf = transformers.AutoModelForCausalLM.from_pretrained(
            hf_path, dtype=torch.float32, attn_implementation="eager").eval()
        self.vocab = self.hf.config.vocab_size
        self.ids, self.mask, self.seqs = _prompts(self.vocab)
        self.valid = self.mask.astype(bool)
        self.logits, self.routing = self.hf_forward(self.ids, self.mask)
        self.models: dict[str, api.Model] = {}
        self._eval = None

    def eval_set(self):
        """Random unpadded prompts EVAL_SHAPE, their f32 transformers logits and routing."""
        if self._eval is None:
            ids = np.random.default_rng(1).integers(3, self.vocab, size=EVAL_SHAPE)
            logits, routing = self.hf_forward(ids, np.ones_like(ids))
            self._eval = ids, logits, routing
        return self._eval

    def hf_forward(self, ids, mask):
        """transformers logits (B, S, V) and per-MoE-layer (ids, weights) (B, S, K)."""
        captured = []
        hooks = []
        for layer in self.hf.model.layers:
            gate = getattr(layer.mlp, "gate", None)
            if gate is not None and hasattr(gate, "top_k"):
                hooks.append(gate.register_forward_hook(
                    lambda mod, inp, out: captured.append((out[2].numpy().copy(), out[1].numpy().copy()))))
        try:
            with torch.no_grad():
                out = self.hf(input_ids=torch.from_numpy(ids), attention_mask=torch.from_numpy(mask),
                              position_ids=torch.from_numpy(_positions(mask)))
        finally:
            for h in hooks:
                h.remove()
        B, S = ids.shape
        routing = [(i.reshape(B, S, -1), w.reshape(B, S, -1)) for i, w in captured]
        return out.logits.numpy(), routing

    def hf_greedy(self, prompt: np.ndarray, n: int) -> np.ndarray:
        """n greedy tokens, recomputing the whole sequence each step (no cache to trust)."""
        ids = torch.from_numpy(prompt[None].astype(np.int64))
        saved = torch.get_num_threads()
        torch.set_num_threads(1)          # tiny ops: threads only add overhead on a busy machine
        try:
            with torch.no_grad():
                for _ in range(n):
                    nxt = self.hf(input_ids=ids).logits[0, -1].argmax()
                    ids = torch.cat([ids, nxt.view(1, 1)], dim=1)
        finally:
            torch.set_num_threads(saved)
        return ids[0, len(prompt):].numpy()

    def hf_with_file_weights(self, m: api.Model):
        """A copy of the transformers model holding the weights exactly as the file stores
        them (rounded / quantized, widened back to float32): the oracle of a format's path."""
        import copy
        hf = copy.deepcopy(self.hf)
        params = dict(hf.named_parameters())
        f = m.file
        with torch.no_grad():
            for name in f.names():
                w = torch.from_numpy(f.to_float32(name))
                target, index = _hf_param(name, hf)
                params[target][index] = w.reshape(params[target][index].shape)
        return hf

    def model(self, fmt: str = "f32", threads: int = 1) -> api.Model:
        key = f"{fmt}/{threads}"
        if key not in self.models:
            file_fmt, activations = _file_and_activations(fmt)
            dst = self.out_dir / f"{self.family}-{file_fmt}.colibri"
            if not dst.exists():
                kwargs = dict(dtype="f32") if fmt == "f32" else FORMATS[fmt]
                convert(self.path, dst, progress=False, **kwargs)
            self.models[key] = api.load(dst, threads=threads, activations=activations,
                                          kv_dtype="f32")
        return self.models[key]


@pytest.fixture(scope="module", params=FAMILY_NAMES)
def ref(request, hf_checkpoint, tmp_path_factory):
    path = hf_checkpoint(request.param, initializer_range=INIT_RANGE)
    r = Ref(request.param, path, tmp_path_factory.mktemp(f"colibri-{request.param}"))
    yield r
    for m in r.models.values():
        m.close()


# ---------------------------------------------------------------------------------------------
# f32 parity with transformers
# ---------------------------------------------------------------------------------------------

def test_logits_not_flat(ref):
    """The oracle is informative: logits spread and differ between positions."""
    lg = ref.logits[ref.valid]
    assert lg.std(axis=-1).mean() > 0.5
    assert len(set(lg.argmax(-1).tolist())) > 3


def test_f32_full_prompt_batch_with_padding(ref):
    got = api.forward(ref.model(), ref.ids, attention_mask=ref.mask)
    assert got.dtype == np.float32 and got.shape == ref.logits.shape
    assert np.isfinite(got).all()
    err = _rel_err(got[ref.valid], ref.logits[ref.valid])
    assert err <= F32_TOL, f"{ref.family}: max relative logit error {err:.2e}"


def test_f32_step_by_step_with_cache(ref):
    m = ref.model()
    cache = m.new_cache(ctx=32, batch=len(LENGTHS))
    split = 5
    parts = [api.forward(m, ref.ids[:, :split], cache=cache, attention_mask=ref.mask[:, :split])]
    for s in range(split, ref.ids.shape[1]):
        # transformers-style masks that cover the past and the new column are accepted too
        parts.append(api.forward(m, ref.ids[:, s:s + 1], cache=cache,
                                 attention_mask=ref.mask[:, :s + 1]))
    got = np.concatenate(parts, axis=1)
    assert len(cache) == ref.ids.shape[1]
    err = _rel_err(got[ref.valid], ref.logits[ref.valid])
    assert err <= F32_TOL, f"{ref.family}: cached decoding error {err:.2e}"


def test_f32_routing_matches_transformers_router(ref):
    m = ref.model()
    _, trace = api.forward(m, ref.ids, attention_mask=ref.mask, return_routing=True)
    moe_layers = [i for i, layer in enumerate(ref.hf.model.layers)
                  if hasattr(getattr(layer.mlp, "gate", None), "top_k")]
    assert trace.layers == moe_layers
    assert len(trace.ids) == len(ref.routing)
    for (want_ids, want_w), got_ids, got_w in zip(ref.routing, trace.ids, trace.weights):
        assert got_ids.dtype == np.int32 and got_w.dtype == np.float32
        np.testing.assert_array_equal(got_ids[ref.valid], want_ids[ref.valid])
        np.testing.assert_allclose(got_w[ref.valid], want_w[ref.valid], rtol=1e-4, atol=1e-5)
    if ref.family == "qwen2_moe":
        assert trace.layers == [0]                         # layer 1 is dense (mlp_only_layers)
        assert len(trace.shared_gate) == 1 and trace.shared_gate[0].shape == ref.ids.shape


def test_f32_greedy_32_tokens_identical(ref):
    m = ref.model()
    for prompt in ref.seqs[:2]:
        want = ref.hf_greedy(prompt, 32)
        got = m.generate(prompt, max_new_tokens=32, temperature=0.0, stop=[])
        np.testing.assert_array_equal(got, want)


# ---------------------------------------------------------------------------------------------
# reduced precision: measured error against documented bounds
# ---------------------------------------------------------------------------------------------

@pytest.mark.parametrize("fmt", list(FORMATS))
def test_format_matches_transformers_with_the_same_weights(ref, fmt):
    """Each format's code path is exact: transformers given the file's (rounded/quantized)
    weights produces the same logits and routing as colibri reading that file."""
    m = ref.model(fmt)
    oracle = Ref.__new__(Ref)
    oracle.hf = ref.hf_with_file_weights(m)
    want, want_routing = Ref.hf_forward(oracle, ref.ids, ref.mask)
    got, trace = api.forward(m, ref.ids, attention_mask=ref.mask, return_routing=True)
    err = _rel_err(got[ref.valid], want[ref.valid])
    if fmt.endswith((INT8, INT16)):   # not exact: quantized activations; routing flips allowed
        tol, min_same = (INT8_TOL, 0.9) if fmt.endswith(INT8) else (INT16_TOL, 0.98)
        same = np.mean([np.mean(np.all(np.sort(g[ref.valid], -1) == np.sort(w[ref.valid], -1),
                                       axis=-1)) for (w, _), g in zip(want_routing, trace.ids)])
        print(f"\n[activations] {ref.family:9s} {fmt:12s} rel_err_vs_same_weights={err:.3e} "
              f"routing_agreement={same:.3f}")
        assert err <= tol, f"{ref.family} {fmt}: error vs the same weights {err:.2e}"
        assert same >= min_same, f"{ref.family} {fmt}: routing agreement {same:.3f}"
        return
    assert err <= F32_TOL, f"{ref.family} {fmt}: error vs transformers on the same weights {err:.2e}"
    for (want_ids, _), got_ids in zip(want_routing, trace.ids):
        np.testing.assert_array_equal(got_ids[ref.valid], want_ids[ref.valid])


@pytest.mark.parametrize("fmt", list(FORMATS))
def test_format_error_within_documented_bounds(ref, fmt):
    """Quantization/rounding error against the f32 transformers logits, on EVAL_SHAPE tokens."""
    ids, want, want_routing = ref.eval_set()
    got, trace = api.forward(ref.model(fmt), ids, return_routing=True)
    V = want.shape[-1]
    err, top1, kl = quality(got.reshape(-1, V), want.reshape(-1, V))
    same = [np.mean(np.all(np.sort(g, -1) == np.sort(w, -1), axis=-1))
            for g, (w, _) in zip(trace.ids, want_routing)]
    routing = float(np.mean(same))
    print(f"\n[accuracy] {ref.family:9s} {fmt:6s} max_rel_err={err:.3e} top1={top1:.3f} "
          f"mean_kl={kl:.3e} routing_agreement={routing:.3f}")
    max_err, min_top1, max_kl, min_routing = BOUNDS[fmt]
    assert err <= max_err, f"{ref.family} {fmt}: max relative error {err:.3e} > {max_err}"
    assert top1 >= min_top1, f"{ref.family} {fmt}: top-1 agreement {top1:.3f} < {min_top1}"
    assert kl <= max_kl, f"{ref.family} {fmt}: mean KL {kl:.3e} > {max_kl}"
    assert routing >= min_routing, f"{ref.family} {fmt}: routing agreement {routing:.3f} < {min_routing}"


# ---------------------------------------------------------------------------------------------
# internal consistency
# ---------------------------------------------------------------------------------------------

def test_prefill_equals_token_by_token(ref):
    m = ref.model()
    prompt = ref.seqs[0]
    full = api.forward(m, prompt)
    cache = m.new_cache(ctx=len(prompt))
    steps = np.concatenate([api.forward(m, prompt[i:i + 1], cache=cache) for i in range(len(prompt))])
    assert _rel_err(steps, full) <= 1e-5
    with pytest.raises(CacheOverflowError, match=f"ctx {len(prompt)}"):
        api.forward(m, prompt[:1], cache=cache)


def test_batch_equals_separate_runs(ref):
    m = ref.model()
    batch, trace = api.forward(m, ref.ids, attention_mask=ref.mask, return_routing=True)
    for b, prompt in enumerate(ref.seqs):
        alone, t1 = api.forward(m, prompt, return_routing=True)
        assert _rel_err(batch[b, ref.valid[b]], alone) <= 1e-5
        for ids_b, ids_1 in zip(trace.ids, t1.ids):
            np.testing.assert_array_equal(ids_b[b, ref.valid[b]], ids_1)


def test_thread_count_does_not_change_logits(ref):
    one = api.forward(ref.model("f32", threads=1), ref.ids, attention_mask=ref.mask)
    two = api.forward(ref.model("f32", threads=2), ref.ids, attention_mask=ref.mask)
    np.testing.assert_array_equal(one, two)
    for fmt in ("q4", "q4" + INT8, "q4" + INT16):
        q1 = api.forward(ref.model(fmt, threads=1), ref.ids, attention_mask=ref.mask)
        q2 = api.forward(ref.model(fmt, threads=2), ref.ids, attention_mask=ref.mask)
        np.testing.assert_array_equal(q1, q2)


def test_quantized_activations_take_another_path(ref):
    """activations="int8" / "int16" really quantize the activations of q4/q8 matrices (the
    logits move: within INT8_TOL for int8, within INT16_TOL and at least 20x less for int16),
    and leave a file without q4/q8 matrices exactly as it is."""
    exact = api.forward(ref.model("q4"), ref.ids, attention_mask=ref.mask)
    int8 = api.forward(ref.model("q4" + INT8), ref.ids, attention_mask=ref.mask)
    int16 = api.forward(ref.model("q4" + INT16), ref.ids, attention_mask=ref.mask)
    e8 = _rel_err(int8[ref.valid], exact[ref.valid])
    e16 = _rel_err(int16[ref.valid], exact[ref.valid])
    print(f"\n[activations] {ref.family:9s} q4 int8 {e8:.2e} int16 {e16:.2e} vs f32")
    assert 0 < e8 <= INT8_TOL
    assert 0 < e16 <= INT16_TOL and e16 < e8 / 20
    plain = ref.model("f32").file.path
    for activations in ("int8", "int16"):
        with api.load(plain, activations=activations) as m:
            np.testing.assert_array_equal(api.forward(m, ref.ids, attention_mask=ref.mask),
                                          api.forward(ref.model("f32"), ref.ids,
                                                      attention_mask=ref.mask))
    with pytest.raises(ValueError,
                       match="activations must be one of f32, int8, int16, got 'int4'"):
        api.load(plain, activations="int4")


def test_default_activations_are_int16(ref):
    """Without the option a q4 file runs int16 activations (W4A16): the logits equal those of
    activations="int16" bit for bit and differ from the exact f32 ones; f32 and bf16 files
    give the same logits under the default and "f32" (their matrices always see f32)."""
    assert DEFAULT_ACTIVATIONS == "int16"
    run = lambda m: api.forward(m, ref.ids, attention_mask=ref.mask)   # noqa: E731
    with api.load(ref.model("q4").file.path, threads=1) as m:
        assert m.activations == "int16" and "activations=int16" in repr(m)
        default = run(m)
    with Model(ref.model("q4").file.path, threads=1) as m:
        assert m.activations == "int16"
    np.testing.assert_array_equal(default, run(ref.model("q4" + INT16)))
    exact = run(ref.model("q4"))
    assert not np.array_equal(default, exact)
    assert _rel_err(default[ref.valid], exact[ref.valid]) <= INT16_TOL
    for fmt in ("f32", "bf16"):
        with api.load(ref.model(fmt).file.path, threads=1) as m:
            assert m.activations == "int16"
            np.testing.assert_array_equal(run(m), run(ref.model(fmt)))   # ref: f32 named


def test_input_embeds_equal_ids(ref):
    m = ref.model()
    prompt = ref.seqs[1]
    emb = ref.hf.model.embed_tokens.weight.detach().numpy()[prompt]
    np.testing.assert_allclose(api.forward(m, input_embeds=emb), api.forward(m, prompt),
                               rtol=1e-6, atol=1e-6)


# ---------------------------------------------------------------------------------------------
# config variants: sliding windows, RoPE scaling, tied embeddings
# ---------------------------------------------------------------------------------------------

VARIANTS = {
    "mixtral-window": ("mixtral", dict(sliding_window=4)),
    "qwen2_moe-window-layer0": ("qwen2_moe", dict(use_sliding_window=True, sliding_window=4,
                                                  max_window_layers=1)),
    "qwen3_moe-rope-linear": ("qwen3_moe", dict(rope_parameters={
        "rope_type": "linear", "rope_theta": 1e6, "factor": 2.0})),
    "olmoe-tied-yarn": ("olmoe", dict(tie_word_embeddings=True, rope_parameters={
        "rope_type": "yarn", "rope_theta": 1e4, "factor": 4.0,
        "original_max_position_embeddings": 64})),
}


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_config_variants_match_transformers(variant, hf_checkpoint, tmp_path):
    family, overrides = VARIANTS[variant]
    path = hf_checkpoint(family, initializer_range=INIT_RANGE, **overrides)
    r = Ref(family, path, tmp_path)
    m = r.model()
    if "window" in variant:
        windows = [layer.attn.window for layer in m.layers]
        assert windows == ([4, 4] if family == "mixtral" else [4, None])
    if "tied" in variant:
        assert "lm_head" not in m.file
    got = api.forward(m, r.ids, attention_mask=r.mask)
    err = _rel_err(got[r.valid], r.logits[r.valid])
    assert err <= F32_TOL, f"{variant}: max relative logit error {err:.2e}"
    cache = m.new_cache(ctx=16, batch=len(LENGTHS))
    steps = [api.forward(m, r.ids[:, :6], cache=cache, attention_mask=r.mask[:, :6])]
    steps += [api.forward(m, r.ids[:, s:s + 1], cache=cache, attention_mask=r.mask[:, s:s + 1])
              for s in range(6, r.ids.shape[1])]
    got = np.concatenate(steps, axis=1)
    err = _rel_err(got[r.valid], r.logits[r.valid])
    assert err <= F32_TOL, f"{variant}: cached decoding error {err:.2e}"
    m.close()
