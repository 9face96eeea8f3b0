"""Parity of one model family with transformers: the harness tests/test_family_<name>.py share.

    ref = FamilyRef(config, tmp_path_factory.mktemp("x"), routers=granite_routers)
    ref.check_full_prompt(); ref.check_cached_decode(); ref.check_decode_step(); ...

A tiny random checkpoint is made from a transformers config object (save_pretrained, so the
checkpoint keys are the ones the family ships), converted with colibri.convert into each weight
format, and run on the same prompts by both engines:
  - f32: the left-padded batch's logits (full prompt, and prompt + step-by-step through the
    KV cache), one sequence token by token through the decode step, the routing (ids and
    weights) against transformers' router, 8 greedy tokens;
  - f16 / bf16 / q8 / q4: max logit error (on the tokens routed as in f32, see
    check_format), top-1 agreement, mean KL and routing agreement against the f32
    transformers logits, within test_model.BOUNDS (docs/accuracy.md);
  - each format's code path exact: transformers given the file's (rounded / quantized)
    weights gives colibri's logits within F32_TOL and its experts;
  - `colibri routes` on the converted file.
`routers(hf_model)` lists (module, extract) pairs: extract(module output) -> (ids, weights)
as torch tensors (T, K); the hooks capture them per MoE layer.
"""
from __future__ import annotations

import numpy as np
import pytest
import torch
import transformers

import colibri.api as api
from colibri.convert import convert
from colibri.tools.trace import trace
from hf_factory import make_tokenizer
from test_model import BOUNDS, F32_TOL, LENGTHS, _positions, _prompts, _rel_err, quality

__all__ = ["FORMATS", "FamilyRef", "test_full_prompt_batch_with_padding", "test_cached_decode",
           "test_decode_step", "test_ragged_step", "test_routing_matches_transformers",
           "test_greedy_tokens_identical", "test_format_within_bounds",
           "test_format_path_is_exact", "test_routes_command"]

FORMATS = {"f16": dict(dtype="f16"), "bf16": dict(dtype="bf16"),
           "q8": dict(dtype="f32", quant="q8"), "q4": dict(dtype="f32", quant="q4")}
EVAL_SHAPE = (4, 32)
WEIGHT_JUMP = 0.02   # a routing weight further than this from f32's: the token was routed otherwise


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


def _sorted_by_expert(ids: np.ndarray, w: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    order = np.argsort(ids, axis=-1, kind="stable")
    return np.take_along_axis(ids, order, -1), np.take_along_axis(w, order, -1)


class FamilyRef:
    """A family's transformers model, its converted colibri files and the oracle outputs."""

    def __init__(self, config, out_dir, routers, seed: int = 0, bounds: dict | None = None):
        self.dir = out_dir
        self.bounds = bounds          # the family's own format bounds (check_format)
        self.path = make_checkpoint(out_dir / "hf", config, seed)
        self.hf = transformers.AutoModelForCausalLM.from_pretrained(
            self.path, dtype=torch.float32, attn_implementation="eager").eval()
        self.routers = routers
        self.vocab = config.vocab_size
        self.ids, self.mask, self.seqs = _prompts(self.vocab)
        self.valid = self.mask.astype(bool)
        self.logits, self.routing = self.hf_forward(self.ids, self.mask)
        self.models: dict[str, api.Model] = {}

    # -- the oracle ------------------------------------------------------------------------------
    def hf_forward(self, ids: np.ndarray, mask: np.ndarray):
        """transformers logits (B, S, V) and per MoE layer (ids, weights) (B, S, K)."""
        captured, hooks = [], []
        for module, extract in self.routers(self.hf):
            def hook(mod, inp, out, extract=extract):
                i, w = extract(out)
                captured.append((i.numpy().copy(), w.float().numpy().copy()))
            hooks.append(module.register_forward_hook(hook))
        try:
            with torch.no_grad():
                out = self.hf(input_ids=torch.from_numpy(ids),
                              attention_mask=torch.from_numpy(mask),
                              position_ids=torch.from_numpy(_positions(mask)))
        finally:
            for h in hooks:
                h.remove()
        B, S = ids.shape
        return out.logits.numpy(), [(i.reshape(B, S, -1), w.reshape(B, S, -1))
                                    for i, w in captured]

    def model(self, fmt: str = "f32") -> api.Model:
        if fmt not in self.models:
            dst = self.dir / f"model-{fmt}.colibri"
            convert(self.path, dst, progress=False,
                    **(dict(dtype="f32") if fmt == "f32" else FORMATS[fmt]))
            self.models[fmt] = api.load(dst, threads=1, activations="f32", kv_dtype="f32")
        return self.models[fmt]

    def close(self) -> None:
        for m in self.models.values():
            m.close()

    # -- the checks ------------------------------------------------------------------------------
    def check_full_prompt(self) -> None:
        got = api.forward(self.model(), self.ids, attention_mask=self.mask)
        assert got.shape == self.logits.shape and np.isfinite(got).all()
        lg = self.logits[self.valid]
        assert lg.std() > 0.05 * np.abs(lg).max(), "the oracle's logits are flat"
        err = _rel_err(got[self.valid], lg)
        assert err <= F32_TOL, f"max relative logit error {err:.2e}"

    def check_cached_decode(self, split: int = 5) -> None:
        """The padded batch: a prefill of `split` tokens, then one column at a time."""
        m = self.model()
        cache = m.new_cache(ctx=32, batch=len(LENGTHS))
        parts = [api.forward(m, self.ids[:, :split], cache=cache,
                             attention_mask=self.mask[:, :split])]
        for s in range(split, self.ids.shape[1]):
            parts.append(api.forward(m, self.ids[:, s:s + 1], cache=cache,
                                     attention_mask=self.mask[:, :s + 1]))
        got = np.concatenate(parts, axis=1)
        err = _rel_err(got[self.valid], self.logits[self.valid])
        assert err <= F32_TOL, f"cached decoding error {err:.2e}"

    def check_decode_step(self) -> None:
        """One unpadded sequence token by token: every call is the decode step (Model._step)."""
        m = self.model()
        seq = self.seqs[0]
        want, _ = self.hf_forward(seq[None], np.ones((1, len(seq)), np.int64))
        cache = m.new_cache(ctx=32)
        got = np.stack([api.forward(m, np.array([t]), cache=cache)[0] for t in seq])
        err = _rel_err(got, want[0])
        assert err <= F32_TOL, f"decode step error {err:.2e}"
        # the general path on the same cache state gives the same next logits
        cache2 = m.new_cache(ctx=32)
        api.forward(m, seq[None, :-1], cache=cache2)
        last = api.forward(m, seq[None, -1:], cache=cache2, attention_mask=np.ones((1, 1)))
        assert _rel_err(last[0, 0], got[-1]) <= 1e-5

    def check_ragged(self) -> None:
        """Continuous batching's ragged step (Model.forward_ragged): the sequences, each in
        its own cache, prompts of different lengths in one pass, then their decode tokens
        together, give transformers' logits of each sequence."""
        m = self.model()
        seqs = [(b, s) for b, s in enumerate(self.seqs) if len(s) > 3]
        caches = [m.new_cache(ctx=len(s)) for _, s in seqs]
        got = [[row] for row in m.forward_ragged([(c, s[:-3]) for c, (_, s) in
                                                  zip(caches, seqs)])]
        for t in (3, 2, 1):
            rows = m.forward_ragged([(c, s[len(s) - t:len(s) - t + 1])
                                     for c, (_, s) in zip(caches, seqs)])
            for j, row in enumerate(rows):
                got[j].append(row)
        for j, (b, s) in enumerate(seqs):
            want = self.logits[b, self.valid[b]][len(s) - 4:]
            err = _rel_err(np.stack(got[j]), want)
            assert err <= F32_TOL, f"ragged step error {err:.2e} (sequence {b})"

    def check_routing(self) -> None:
        _, tr = api.forward(self.model(), self.ids, attention_mask=self.mask,
                            return_routing=True)
        assert len(tr.ids) == len(self.routing) > 0
        for (want_i, want_w), got_i, got_w in zip(self.routing, tr.ids, tr.weights):
            wi, ww = _sorted_by_expert(want_i[self.valid], want_w[self.valid])
            gi, gw = _sorted_by_expert(got_i[self.valid], got_w[self.valid])
            np.testing.assert_array_equal(gi, wi)
            np.testing.assert_allclose(gw, ww, rtol=1e-4, atol=1e-5)

    def check_greedy(self, n: int = 8) -> None:
        prompt = self.seqs[1]
        ids = torch.from_numpy(prompt[None].astype(np.int64))
        with torch.no_grad():
            for _ in range(n):
                nxt = self.hf(input_ids=ids).logits[0, -1].argmax()
                ids = torch.cat([ids, nxt.view(1, 1)], dim=1)
        got = self.model().generate(prompt, max_new_tokens=n, temperature=0.0, stop=[])
        np.testing.assert_array_equal(got, ids[0, len(prompt):].numpy())

    def check_format(self, fmt: str, bounds: dict | None = None) -> None:
        """The format's error on EVAL_SHAPE tokens against f32 transformers. The max relative
        logit error is measured on the tokens routed as in f32 (the same experts, weights
        within WEIGHT_JUMP: on a token whose routing flipped, the logits jump by whatever the
        other expert gives; the routing agreement, top-1 and KL bound those), and capped at
        the loosest bound (q4's) over all tokens. bounds: a family's own, in place of
        test_model.BOUNDS (a rule with thresholds makes the error of the weights jump)."""
        ids = np.random.default_rng(1).integers(3, self.vocab, size=EVAL_SHAPE)
        want, want_routing = self.hf_forward(ids, np.ones_like(ids))
        got, tr = api.forward(self.model(fmt), ids, return_routing=True)
        V = want.shape[-1]
        same = np.stack([np.all(np.sort(g, -1) == np.sort(w, -1), axis=-1)
                         for g, (w, _) in zip(tr.ids, want_routing)])       # (M, B, S)
        # routed alike: the same experts with about the same weights (a rule with thresholds,
        # sparsemixer, can jump its weights without changing the experts)
        close = np.stack([np.abs(_sorted_by_expert(g, gw)[1] - _sorted_by_expert(w, ww)[1]
                                 ).max(-1) <= WEIGHT_JUMP
                          for g, gw, (w, ww) in zip(tr.ids, tr.weights, want_routing)])
        routed_alike = (same & close).all(axis=0)
        err_all, top1, kl = quality(got.reshape(-1, V), want.reshape(-1, V))
        err = _rel_err(got[routed_alike], want[routed_alike]) if routed_alike.any() else 0.0
        routing = float(same.mean())
        print(f"\n[accuracy] {fmt:5s} max_rel_err={err:.3e} (all tokens {err_all:.3e}) "
              f"top1={top1:.3f} mean_kl={kl:.3e} routing_agreement={routing:.3f}")
        max_err, min_top1, max_kl, min_routing = (bounds or BOUNDS)[fmt]
        assert err <= max_err, f"{fmt}: max relative error {err:.3e} > {max_err}"
        assert err_all <= BOUNDS["q4"][0], f"{fmt}: max relative error {err_all:.3e}"
        assert top1 >= min_top1, f"{fmt}: top-1 agreement {top1:.3f} < {min_top1}"
        assert kl <= max_kl, f"{fmt}: mean KL {kl:.3e} > {max_kl}"
        assert routing >= min_routing, f"{fmt}: routing agreement {routing:.3f}"

    def hf_with_file_weights(self, fmt: str):
        """transformers loaded from a copy of the checkpoint holding the weights exactly as
        the `fmt` file stores them (rounded / quantized, widened to float32), each written at
        the checkpoint key (and rows, transposed or not) the family's name map reads it from
        (the f32 parity checks that map): the oracle of a format's code path."""
        import shutil
        from safetensors.numpy import load_file, save_file
        from colibri.families import canonical_tensors, get_family
        m = self.model(fmt)
        fam = get_family(m.config.family)
        tensors = {k: v.astype(np.float32) for k, v in
                   load_file(str(self.path / "model.safetensors")).items()}
        for t in canonical_tensors(m.config):
            src = next(s for s in fam.sources(t, m.config) if s.key in tensors)
            value = m.file.to_float32(t.name)
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
        return transformers.AutoModelForCausalLM.from_pretrained(
            out, dtype=torch.float32, attn_implementation="eager").eval()

    def check_same_weights(self, fmt: str) -> None:
        """colibri reading the `fmt` file = transformers given the file's weights: the logits
        within F32_TOL and the same experts (the format's path computes what it stores)."""
        oracle = FamilyRef.__new__(FamilyRef)
        oracle.hf, oracle.routers = self.hf_with_file_weights(fmt), self.routers
        want, want_routing = oracle.hf_forward(self.ids, self.mask)
        got, tr = api.forward(self.model(fmt), self.ids, attention_mask=self.mask,
                              return_routing=True)
        err = _rel_err(got[self.valid], want[self.valid])
        assert err <= F32_TOL, f"{fmt}: error vs transformers on the same weights {err:.2e}"
        for (want_i, _), got_i in zip(want_routing, tr.ids):
            np.testing.assert_array_equal(np.sort(got_i[self.valid], -1),
                                          np.sort(want_i[self.valid], -1))

    def check_routes_command(self, capsys) -> None:
        """`colibri routes FILE -p TEXT` prints the trace colibri.tools.trace computes."""
        from cli_helpers import run
        path = self.model().file.path
        prompt = "Hello world! Tokens, experts"
        code, out, err = run(capsys, "routes", path, "-p", prompt, "--threads", "1",
                             "--kv-dtype", "f32")
        assert code == 0 and err == "", err
        tr = trace(self.model(), prompt)
        assert out.startswith(tr.format_table() + "\n\n")
        assert tr.experts.shape[1] == len(self.routing)


# ---------------------------------------------------------------------------------------------
# the tests every family file runs (`from family_parity import *` with its own `ref` fixture)
# ---------------------------------------------------------------------------------------------

def test_full_prompt_batch_with_padding(ref):
    ref.check_full_prompt()


def test_cached_decode(ref):
    ref.check_cached_decode()


def test_decode_step(ref):
    ref.check_decode_step()


def test_ragged_step(ref):
    ref.check_ragged()


def test_routing_matches_transformers(ref):
    ref.check_routing()


def test_greedy_tokens_identical(ref):
    ref.check_greedy()


@pytest.mark.parametrize("fmt", list(FORMATS))
def test_format_within_bounds(ref, fmt):
    ref.check_format(fmt, ref.bounds)


@pytest.mark.parametrize("fmt", list(FORMATS))
def test_format_path_is_exact(ref, fmt):
    ref.check_same_weights(fmt)


def test_routes_command(ref, capsys):
    ref.check_routes_command(capsys)
