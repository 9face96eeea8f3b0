"""Parity of one model family with transformers: the tests every tests/test_family_<name>.py
runs (`from family_parity import *`, with a module-scoped `ref` fixture of its own).

    @pytest.fixture(scope="module")
    def ref(tmp_path_factory):
        r = FamilyRef.from_config(config, tmp_path_factory.mktemp("x"), routers)
        yield r
        r.close()

A tiny random checkpoint (made here from a transformers config with `make_checkpoint`, or
by hf_factory's `hf_checkpoint` fixture) is converted with colibri.convert into each weight
format and run on the same prompts by both engines:
  - f32: the left-padded batch's logits (full prompt; prompt + step by step through the KV
    cache), one sequence through the decode step (token by token, and after a prefill), the
    ragged step of continuous batching, the routing (layers, ids, weights) against
    transformers' router, greedy tokens;
  - f16 / bf16 / q8 / q4: each format's code path exact (transformers given the file's
    rounded / quantized weights gives colibri's logits within F32_TOL and its experts), and
    its error against the f32 transformers logits within test_model.BOUNDS
    (docs/accuracy.md) or the family's own bounds;
  - `colibri routes` and colibri.trace on the converted file.
Tolerances and helpers are test_model.py's, so every family is held to the same numbers.

`routers(hf_model)` lists (layer index, module, extract) per MoE layer: extract(module
output) -> (ids, weights) as torch tensors (T, K); forward hooks capture them.
"""
from __future__ import annotations

import shutil

import numpy as np
import pytest
import torch
import transformers

import colibri.api as api
from colibri.convert import convert
from colibri.families import canonical_tensors, get_family
from colibri.families.deepseek import deinterleave_rows
from colibri.tools.trace import trace
from cli_helpers import run as run_cli
from hf_factory import make_tokenizer
from test_model import BOUNDS, F32_TOL, _positions, _prompts, _rel_err, quality

__all__ = ["FORMATS", "FamilyRef", "gate_routers", "test_full_prompt_batch_with_padding",
           "test_cached_decode", "test_decode_step", "test_ragged_step",
           "test_routing_matches_transformers", "test_greedy_tokens_identical",
           "test_format_path_is_exact", "test_format_within_bounds", "test_routes_command"]

FORMATS = {"f16": dict(dtype="f16"), "bf16": dict(dtype="bf16"),
           "q8": dict(dtype="f32", quant="q8"), "q4": dict(dtype="f32", quant="q4")}
EVAL_SHAPE = (4, 32)   # prompts x tokens on which a format's error is measured
WEIGHT_JUMP = 0.02     # a routing weight further than this from f32's: routed otherwise
PREFILL = 5            # test_cached_decode's prompt part
GREEDY_TOKENS = 12
ROUTES_RUNS = {        # `colibri routes` prompt, and the cache dtype given (None: the default)
    "default-kv": ("def fibonacci(n): return n", None),
    "f32-kv": ("Hello world! Tokens, experts", "f32"),
}


def make_checkpoint(path, config, seed: int = 0, noise: float = 0.02):
    """save_pretrained of a random model of `config` into path, every parameter (norm weights
    and biases included) with its own noise, and the test tokenizer; returns path."""
    transformers.utils.logging.disable_progress_bar()
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config)
    gen = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=gen) * noise)
    model.save_pretrained(path)
    make_tokenizer(path)
    return path


def gate_routers(hf) -> list:
    """The routers of the DeepSeek / GLM-4-MoE layout: each MoE layer's mlp.gate (a dense
    layer has none), returning (logits, weights, ids)."""
    return [(i, layer.mlp.gate, lambda out: (out[2], out[1]))
            for i, layer in enumerate(hf.model.layers)
            if hasattr(getattr(layer.mlp, "gate", None), "top_k")]


def by_id(ids: np.ndarray, weights: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(ids, weights) (..., K) with each row's experts in ascending id (transformers' and
    colibri's top-k orders differ)."""
    order = np.argsort(ids, axis=-1, kind="stable")
    return np.take_along_axis(ids, order, -1), np.take_along_axis(weights, order, -1)


def interleave_back(name: str, w: np.ndarray, hf_config) -> np.ndarray:
    """The rows of file tensor `name` in the checkpoint's order: undoes the converter's
    de-interleaving of DeepSeek's RoPE rows (families/deepseek.py); other tensors as given."""
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
    """A family's transformers model (the oracle), its converted colibri files and the
    oracle's outputs on the test prompts.

    bounds: the family's own format bounds in test_model.BOUNDS' layout (a router with
    thresholds makes its weights jump). flips_spread: a routing flip moves the logits of
    every later token too (the group routers' near ties, through attention), so a format's
    error is measured only on tokens that attend to tokens routed as in f32 alone."""

    def __init__(self, path, out_dir, routers, bounds: dict | None = None,
                 flips_spread: bool = False):
        self.path, self.dir, self.routers = path, out_dir, routers
        self.bounds, self.flips_spread = bounds or BOUNDS, flips_spread
        self.hf = self.load_hf(path)
        self.name = self.hf.config.model_type
        self.vocab = self.hf.config.vocab_size
        self.ids, self.mask, self.seqs = _prompts(self.vocab)
        self.valid = self.mask.astype(bool)
        self.logits, self.routing = self.hf_forward(self.ids, self.mask)
        self.models: dict[str, api.Model] = {}
        self._eval = None

    @classmethod
    def from_config(cls, config, out_dir, routers, seed: int = 0, **kw) -> "FamilyRef":
        """The oracle of a random checkpoint of `config` (make_checkpoint) in out_dir/hf."""
        return cls(make_checkpoint(out_dir / "hf", config, seed), out_dir, routers, **kw)

    @staticmethod
    def load_hf(path):
        return transformers.AutoModelForCausalLM.from_pretrained(
            path, dtype=torch.float32, attn_implementation="eager").eval()

    def hf_forward(self, ids: np.ndarray, mask: np.ndarray, hf=None):
        """transformers logits (B, S, V) and per MoE layer (ids int, weights float32)
        (B, S, K) in ascending expert id, of self.hf (or of hf, with self.hf's layout)."""
        hf = self.hf if hf is None else hf
        captured, hooks = [], []
        for _, module, extract in self.routers(hf):
            def hook(mod, inp, out, extract=extract):
                i, w = extract(out)
                captured.append((i.numpy().copy(), w.float().numpy().copy()))
            hooks.append(module.register_forward_hook(hook))
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
        """EVAL_SHAPE random ids, unpadded, and the oracle's logits and routing on them."""
        if self._eval is None:
            ids = np.random.default_rng(1).integers(3, self.vocab, size=EVAL_SHAPE)
            self._eval = (ids, *self.hf_forward(ids, np.ones_like(ids)))
        return self._eval

    def model(self, fmt: str = "f32") -> api.Model:
        """The checkpoint converted to `fmt`, loaded with exact activations and cache."""
        if fmt not in self.models:
            dst = self.dir / f"model-{fmt}.colibri"
            convert(self.path, dst, progress=False,
                    **(dict(dtype="f32") if fmt == "f32" else FORMATS[fmt]))
            self.models[fmt] = api.load(dst, threads=1, activations="f32", kv_dtype="f32")
        return self.models[fmt]

    def hf_with_file_weights(self, fmt: str):
        """transformers loaded from a copy of the checkpoint holding the weights exactly as
        the `fmt` file stores them (rounded / quantized, widened to float32), each written at
        the checkpoint key (and rows, transposed or not, RoPE rows interleaved back) the
        family's name map reads it from (the f32 parity checks that map): the oracle of a
        format's code path."""
        from safetensors.numpy import load_file, save_file
        m = self.model(fmt)
        fam = get_family(m.config.family)
        tensors = {k: v.astype(np.float32) for k, v in
                   load_file(str(self.path / "model.safetensors")).items()}
        for t in canonical_tensors(m.config):
            src = next(s for s in fam.sources(t, m.config) if s.key in tensors)
            value = interleave_back(t.name, m.file.to_float32(t.name), self.hf.config)
            if src.transpose:
                value = value.T
            if src.index or src.post:
                tensors[src.key][src.index][src.post] = value      # views: writes through
            else:
                tensors[src.key] = value.reshape(tensors[src.key].shape)
        out = self.dir / f"hf-{fmt}"
        shutil.rmtree(out, ignore_errors=True)
        shutil.copytree(self.path, out)
        save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
        return self.load_hf(out)

    def close(self) -> None:
        for m in self.models.values():
            m.close()


# ---------------------------------------------------------------------------------------------
# f32 parity
# ---------------------------------------------------------------------------------------------

def test_full_prompt_batch_with_padding(ref):
    lg = ref.logits[ref.valid]
    # the oracle is informative: logits far from flat, several different top tokens
    assert lg.std() > 0.05 * np.abs(lg).max() and lg.std(axis=-1).mean() > 0.3
    assert len(set(lg.argmax(-1).tolist())) > 3
    got = api.forward(ref.model(), ref.ids, attention_mask=ref.mask)
    assert got.shape == ref.logits.shape and np.isfinite(got).all()
    err = _rel_err(got[ref.valid], lg)
    assert err <= F32_TOL, f"{ref.name}: max relative logit error {err:.2e}"


def test_cached_decode(ref):
    """The padded batch: a prefill of PREFILL tokens, then one column at a time."""
    m = ref.model()
    cache = m.new_cache(ctx=32, batch=len(ref.seqs))
    parts = [api.forward(m, ref.ids[:, :PREFILL], cache=cache,
                         attention_mask=ref.mask[:, :PREFILL])]
    for s in range(PREFILL, ref.ids.shape[1]):
        parts.append(api.forward(m, ref.ids[:, s:s + 1], cache=cache,
                                 attention_mask=ref.mask[:, :s + 1]))
    got = np.concatenate(parts, axis=1)
    err = _rel_err(got[ref.valid], ref.logits[ref.valid])
    assert err <= F32_TOL, f"{ref.name}: cached batch decoding error {err:.2e}"


def test_decode_step(ref):
    """One unpadded sequence through a cache: every call the decode step (Model._step), from
    the first token and after a prefill of 4; the general path on the same cache state gives
    the same next logits."""
    m, seq = ref.model(), ref.seqs[0]
    want, _ = ref.hf_forward(seq[None], np.ones((1, len(seq)), np.int64))
    cache = m.new_cache(ctx=32)
    got = np.stack([api.forward(m, np.array([t]), cache=cache)[0] for t in seq])
    err = _rel_err(got, want[0])
    assert err <= F32_TOL, f"{ref.name}: decode step error {err:.2e}"

    cache = m.new_cache(ctx=len(seq))
    first = api.forward(m, seq[:4], cache=cache)
    steps = [api.forward(m, seq[i:i + 1], cache=cache) for i in range(4, len(seq))]
    err = _rel_err(np.concatenate([first] + steps), ref.logits[0, ref.valid[0]])
    assert err <= F32_TOL, f"{ref.name}: decode step after a prefill, error {err:.2e}"
    assert cache.bytes_per_token == m.new_cache(ctx=1).nbytes

    cache = m.new_cache(ctx=32)
    api.forward(m, seq[None, :-1], cache=cache)
    last = api.forward(m, seq[None, -1:], cache=cache, attention_mask=np.ones((1, 1)))
    assert _rel_err(last[0, 0], got[-1]) <= 1e-5


def test_ragged_step(ref):
    """Continuous batching's ragged step (Model.forward_ragged): the sequences, each in its
    own cache, prompts of different lengths in one pass, then their decode tokens together,
    give transformers' logits of each sequence."""
    m = ref.model()
    seqs = [(b, s) for b, s in enumerate(ref.seqs) if len(s) > 3]
    caches = [m.new_cache(ctx=len(s)) for _, s in seqs]
    got = [[row] for row in m.forward_ragged([(c, s[:-3]) for c, (_, s) in zip(caches, seqs)])]
    for t in (3, 2, 1):
        rows = m.forward_ragged([(c, s[len(s) - t:len(s) - t + 1])
                                 for c, (_, s) in zip(caches, seqs)])
        for j, row in enumerate(rows):
            got[j].append(row)
    for j, (b, s) in enumerate(seqs):
        want = ref.logits[b, ref.valid[b]][len(s) - 4:]
        err = _rel_err(np.stack(got[j]), want)
        assert err <= F32_TOL, f"{ref.name}: ragged step error {err:.2e} (sequence {b})"


def test_routing_matches_transformers(ref):
    _, tr = api.forward(ref.model(), ref.ids, attention_mask=ref.mask, return_routing=True)
    assert tr.layers == [i for i, _, _ in ref.routers(ref.hf)]
    assert len(tr.ids) == len(ref.routing) > 0
    for (want_i, want_w), got_i, got_w in zip(ref.routing, tr.ids, tr.weights):
        got_i, got_w = by_id(got_i, got_w)
        np.testing.assert_array_equal(got_i[ref.valid], want_i[ref.valid])
        np.testing.assert_allclose(got_w[ref.valid], want_w[ref.valid], rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("prompt", [0, 1])
def test_greedy_tokens_identical(ref, prompt):
    prompt = ref.seqs[prompt]
    ids = torch.from_numpy(prompt[None].astype(np.int64))
    with torch.no_grad():
        for _ in range(GREEDY_TOKENS):
            nxt = ref.hf(input_ids=ids).logits[0, -1].argmax()
            ids = torch.cat([ids, nxt.view(1, 1)], dim=1)
    got = ref.model().generate(prompt, max_new_tokens=GREEDY_TOKENS, temperature=0.0, stop=[])
    np.testing.assert_array_equal(got, ids[0, len(prompt):].numpy())


# ---------------------------------------------------------------------------------------------
# the weight formats
# ---------------------------------------------------------------------------------------------

@pytest.mark.parametrize("fmt", list(FORMATS))
def test_format_path_is_exact(ref, fmt):
    """colibri reading the `fmt` file = transformers given the file's weights: the logits
    within F32_TOL and the same experts (the format's path computes what it stores)."""
    want, want_routing = ref.hf_forward(ref.ids, ref.mask, hf=ref.hf_with_file_weights(fmt))
    got, tr = api.forward(ref.model(fmt), ref.ids, attention_mask=ref.mask,
                          return_routing=True)
    err = _rel_err(got[ref.valid], want[ref.valid])
    assert err <= F32_TOL, f"{ref.name} {fmt}: error vs transformers on the same weights {err:.2e}"
    assert len(tr.ids) == len(want_routing)
    for (want_i, _), got_i in zip(want_routing, tr.ids):
        np.testing.assert_array_equal(np.sort(got_i, -1)[ref.valid], want_i[ref.valid])


@pytest.mark.parametrize("fmt", list(FORMATS))
def test_format_within_bounds(ref, fmt):
    """The format's error on EVAL_SHAPE tokens against f32 transformers, within the bounds
    (max relative logit error, top-1 agreement, mean KL, routing agreement).

    The max relative error is measured on the tokens routed as in f32: on a token whose
    routing flipped, the logits jump by whatever the other expert gives (the routing
    agreement, top-1 and KL bound those). Routed as in f32: in every layer the same experts
    with weights within WEIGHT_JUMP (a router with thresholds, sparsemixer, can jump its
    weights without changing the experts); with ref.flips_spread, the same experts for the
    token and every earlier one. Over all tokens the error is capped at the loosest bound
    (q4's). Top-1 and KL: over all tokens, or with ref.flips_spread over the measured ones."""
    ids, want, want_routing = ref.eval_set()
    got, tr = api.forward(ref.model(fmt), ids, return_routing=True)
    V = want.shape[-1]
    same = np.stack([np.all(np.sort(g, -1) == w, axis=-1)
                     for g, (w, _) in zip(tr.ids, want_routing)])            # (M, B, S)
    if ref.flips_spread:
        alike = np.cumprod(same.all(axis=0), axis=1).astype(bool)           # (B, S)
    else:
        close = np.stack([np.abs(by_id(g, gw)[1] - ww).max(-1) <= WEIGHT_JUMP
                          for g, gw, (_, ww) in zip(tr.ids, tr.weights, want_routing)])
        alike = (same & close).all(axis=0)
    err_all, top1, kl = quality(got.reshape(-1, V), want.reshape(-1, V))
    err = _rel_err(got[alike], want[alike]) if alike.any() else 0.0
    if ref.flips_spread:       # a flip's later tokens differ as much as the flipped one
        _, top1, kl = quality(got[alike], want[alike])
    routing = float(same.mean())
    print(f"\n[accuracy] {ref.name:11s} {fmt:4s} max_rel_err={err:.3e} (all tokens "
          f"{err_all:.3e}) top1={top1:.3f} mean_kl={kl:.3e} routing_agreement={routing:.3f} "
          f"(tokens measured {alike.mean():.3f})")
    max_err, min_top1, max_kl, min_routing = ref.bounds[fmt]
    assert err <= max_err, f"{ref.name} {fmt}: max relative error {err:.3e} > {max_err}"
    assert err_all <= BOUNDS["q4"][0], f"{ref.name} {fmt}: max relative error {err_all:.3e}"
    assert top1 >= min_top1, f"{ref.name} {fmt}: top-1 agreement {top1:.3f} < {min_top1}"
    assert kl <= max_kl, f"{ref.name} {fmt}: mean KL {kl:.3e} > {max_kl}"
    assert routing >= min_routing, f"{ref.name} {fmt}: routing agreement {routing:.3f}"


# ---------------------------------------------------------------------------------------------
# introspection
# ---------------------------------------------------------------------------------------------

@pytest.mark.parametrize("run", list(ROUTES_RUNS))
def test_routes_command(ref, capsys, run):
    """`colibri routes FILE -p TEXT` prints the trace colibri.tools.trace computes on the
    model loaded as the command loads it: a row per token, a column per MoE layer."""
    prompt, kv_dtype = ROUTES_RUNS[run]
    path = ref.model().file.path
    args = () if kv_dtype is None else ("--kv-dtype", kv_dtype)
    code, out, err = run_cli(capsys, "routes", path, "-p", prompt, "--threads", "1", *args)
    assert code == 0 and err == "", err
    with api.load(path, threads=1, **({} if kv_dtype is None else dict(kv_dtype=kv_dtype))) as m:
        tr = trace(m, prompt)
        moe = [i for i in range(m.n_layers) if m.config.is_moe_layer(i)]
        assert tr.layers == moe and len(moe) == len(ref.routing)
        assert tr.experts.shape[1:] == (len(moe), m.config.num_experts_per_tok)
    assert out.startswith(tr.format_table() + "\n\n")
