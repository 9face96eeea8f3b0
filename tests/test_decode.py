"""The decode step (Model._step) against the general forward and against colibri.kernels._reference.

A step of one token of one sequence through a cache with no padding is the forward pass
specialised to one token: no mask, the vectors in the cache's RunState, the norms and RoPE
compiled (NumPy's arithmetic, the same bits), the attention over the cache in one compiled
call (its own summation order). So its logits are within STEP_TOL of the general path's for
the same tokens (a prefill, or a batch / padded call, which must take the general path), and
within REF_TOL of a plain-NumPy step built from the kernels' twins in colibri.kernels._reference
(float64 products), for every family's attention variant (plain, biased q/k/v, per-head and
full q/k norms with clip_qkv, sliding windows) and weight format. Every call that is such a
step takes it (routing requested, explicit positions, input_embeds, a mask of ones), with
the same bits as the plain call.
"""
from __future__ import annotations

import numpy as np
import pytest

pytest.importorskip("torch")
pytest.importorskip("transformers")

import colibri.kernels._reference as R  # noqa: E402
import colibri.api as api  # noqa: E402
from colibri.convert import convert  # noqa: E402
from colibri.engine.moe import MoE  # noqa: E402
from hf_factory import FAMILY_NAMES  # noqa: E402

CASES = {name: (name, {}) for name in FAMILY_NAMES} | {
    "mixtral-window": ("mixtral", dict(sliding_window=4)),
    "qwen2_moe-window-layer0": ("qwen2_moe", dict(use_sliding_window=True, sliding_window=4,
                                                  max_window_layers=1)),
}
FORMATS = {"f32": dict(dtype="f32"),
           "q4-all": dict(dtype="f32", quant="q4", quantize="experts,shared,attn,head,dense")}
STEP_TOL = 1e-5          # relative to the largest logit: the compiled attention's rounding
REF_TOL = 1e-4           # relative to the largest logit: float32 kernels vs float64 twins
PROMPT, STEPS = 5, 9


@pytest.fixture(scope="module", params=[(c, f) for c in CASES for f in FORMATS],
                ids=lambda p: f"{p[0]}-{p[1]}")
def model(request, hf_checkpoint, tmp_path_factory):
    case, fmt = request.param
    family, overrides = CASES[case]
    path = hf_checkpoint(family, initializer_range=0.15, **overrides)
    dst = tmp_path_factory.mktemp("decode") / f"{case}-{fmt}.colibri"
    convert(path, dst, progress=False, **FORMATS[fmt])
    m = api.load(dst, threads=1, activations="f32", kv_dtype="f32")   # exactness: f32
    yield m
    m.close()


def _rel(a: np.ndarray, b: np.ndarray) -> float:
    return float(np.abs(a - b).max() / np.abs(b).max())


def count_calls(m, method: str, monkeypatch) -> list:
    """Record each call of m's method (e.g. "_step", the decode step) in the returned list."""
    taken, real = [], getattr(m, method)

    def counted(*args):
        taken.append(1)
        return real(*args)

    monkeypatch.setattr(m, method, counted)
    return taken


def _decode(m, tokens, routing=False):
    """Prefill tokens[:PROMPT], then one token at a time: logits (S, V), traces, cache."""
    cache = m.new_cache(ctx=len(tokens))
    logits, trace = api.forward(m, tokens[:PROMPT], cache=cache, return_routing=True)
    out, traces = [logits], [trace]
    for t in tokens[PROMPT:]:
        got = api.forward(m, np.array([t]), cache=cache, return_routing=routing)
        logits, trace = got if routing else (got, None)
        out.append(logits)
        traces.append(trace)
    return np.concatenate(out), traces, cache


# ---------------------------------------------------------------------------------------------
# the step against the general path
# ---------------------------------------------------------------------------------------------

def test_step_matches_a_prefill_of_the_same_tokens(model, monkeypatch):
    m = model
    tokens = np.random.default_rng(0).integers(3, m.vocab_size, size=PROMPT + STEPS)
    taken = count_calls(m, "_step", monkeypatch)
    stepped, traces, cache = _decode(m, tokens, routing=True)
    assert len(taken) == STEPS and cache.run_state is not None
    full, full_trace = api.forward(m, tokens, return_routing=True)     # general path, no cache
    assert len(taken) == STEPS
    assert _rel(stepped, full) <= STEP_TOL
    for j, trace in enumerate(traces[1:]):                             # the same experts
        assert trace.layers == full_trace.layers == m.moe_layers
        for ids, want in zip(trace.ids, full_trace.ids):
            assert ids.shape == (1, m.config.num_experts_per_tok)
            np.testing.assert_array_equal(ids[0], want[PROMPT + j])
        for w, want in zip(trace.weights, full_trace.weights):
            np.testing.assert_allclose(w[0], want[PROMPT + j], rtol=1e-4, atol=1e-6)
    np.testing.assert_array_equal(cache.pos[0], np.arange(PROMPT + STEPS))
    assert cache.valid.all()


def test_step_matches_a_batch_and_a_padded_sequence(model, monkeypatch):
    """The same tokens as the second row of a batch of two, and behind a padding slot:
    every step of those takes the general path (the mask), within STEP_TOL of the step's."""
    m = model
    rng = np.random.default_rng(1)
    tokens = rng.integers(3, m.vocab_size, size=PROMPT + STEPS)
    stepped = _decode(m, tokens)[0][PROMPT:]
    taken = count_calls(m, "_step", monkeypatch)
    other = rng.integers(3, m.vocab_size, size=PROMPT + STEPS)
    batch = m.new_cache(ctx=PROMPT + STEPS, batch=2)
    padded = m.new_cache(ctx=PROMPT + STEPS + 1)
    api.forward(m, np.stack([other[:PROMPT], tokens[:PROMPT]]), cache=batch)
    api.forward(m, np.concatenate([[0], tokens[:PROMPT]]), cache=padded,
                attention_mask=np.array([0] + [1] * PROMPT))
    for j, t in enumerate(tokens[PROMPT:]):
        got = api.forward(m, np.array([[other[PROMPT + j]], [t]]), cache=batch)[1, 0]
        assert _rel(got, stepped[j]) <= STEP_TOL
        got = api.forward(m, np.array([t]), cache=padded)[0]
        assert _rel(got, stepped[j]) <= STEP_TOL
    assert not taken and batch.run_state is None and padded.run_state is None
    api.forward(m, tokens[:1])                                          # no cache: general
    assert not taken


def test_every_call_that_is_a_step_takes_it_with_the_same_bits(model, monkeypatch):
    """Plain ids ((1,) and (1, 1)), routing requested, explicit positions (the cache's next
    or any other), input_embeds, a mask of ones, a list: the step, bit for bit the plain
    call's logits, the same cache."""
    m = model
    tokens = np.random.default_rng(2).integers(3, m.vocab_size, size=PROMPT + 7)
    plain, other = m.new_cache(ctx=len(tokens)), m.new_cache(ctx=len(tokens))
    for c in (plain, other):
        api.forward(m, tokens[:PROMPT], cache=c)
    taken = count_calls(m, "_step", monkeypatch)
    variants = [
        lambda t, n: api.forward(m, np.array([[t]]), cache=other)[0],
        lambda t, n: api.forward(m, np.array([t]), cache=other, return_routing=True)[0],
        lambda t, n: api.forward(m, np.array([t]), cache=other, positions=np.array([n])),
        lambda t, n: api.forward(m, np.array([t]), cache=other,
                                 attention_mask=np.ones(n + 1, dtype=int)),
        lambda t, n: api.forward(m, input_embeds=m.embed(np.array([[t]]))[0], cache=other),
        lambda t, n: api.forward(m, [int(t)], cache=other),
        lambda t, n: api.forward(m, np.array([t]), cache=other, positions=[n + 3]),
    ]
    for j, (t, variant) in enumerate(zip(tokens[PROMPT:], variants)):
        n = plain.length
        pos = n + 3 if j == len(variants) - 1 else n
        want = api.forward(m, np.array([t]), cache=plain, positions=[pos])
        got = variant(t, n)
        assert got.shape == (1, m.vocab_size)
        np.testing.assert_array_equal(got, want)
    assert len(taken) == 2 * len(variants)
    for a, b in zip(plain.k + plain.v, other.k + other.v):
        np.testing.assert_array_equal(a, b)
    np.testing.assert_array_equal(plain.pos, other.pos)
    assert plain.pos[0, plain.length - 1] == plain.length + 2


def test_step_with_quantized_activations(model):
    """The step's prepared calls carry the activations setting: int8 / int16 steps differ
    from f32 ones on q4 files, and stay within the setting's rounding of the general path."""
    if str(model.file.path).endswith("-f32.colibri"):
        pytest.skip("no q4/q8 matrices: the activations setting changes nothing")
    tokens = np.random.default_rng(3).integers(3, model.vocab_size, size=PROMPT + STEPS)
    exact = _decode(model, tokens)[0][PROMPT:]
    for activations, tol in (("int8", 5e-2), ("int16", 5e-4)):
        with api.load(model.file.path, threads=1, activations=activations,
                      kv_dtype="f32") as m:
            stepped = _decode(m, tokens)[0][PROMPT:]
            full = api.forward(m, tokens)[PROMPT:]
        assert not np.array_equal(stepped, exact)
        assert _rel(stepped, full) <= tol, activations


def test_fused_qkv_equals_three_projections(model, monkeypatch):
    m = model
    assert all(layer.attn.wqkv is not None for layer in m.layers)   # the converter's layout
    tokens = np.random.default_rng(4).integers(3, m.vocab_size, size=PROMPT + 3)
    fused = _decode(m, tokens)[0]
    for layer in m.layers:
        monkeypatch.setattr(layer.attn, "wqkv", None)
    np.testing.assert_array_equal(_decode(m, tokens)[0], fused)


def test_run_state_is_reused_and_results_not_aliased(model):
    m = model
    tokens = np.random.default_rng(5).integers(3, m.vocab_size, size=4)
    cache = m.new_cache(ctx=8)
    api.forward(m, tokens[:2], cache=cache)
    a = api.forward(m, tokens[2:3], cache=cache)
    state = cache.run_state
    a_copy = a.copy()
    b = api.forward(m, tokens[3:4], cache=cache)
    assert cache.run_state is state
    np.testing.assert_array_equal(a, a_copy)            # the logits of a step are its own
    assert not np.shares_memory(a, b)
    assert cache.copy().run_state is None        # the buffers belong to the cache


@pytest.mark.parametrize("dtype", ["f32", "f16", "bf16"])
def test_embed_row_equals_embed(model, monkeypatch, dtype):
    m = model
    rng = np.random.default_rng(6)
    table = rng.standard_normal((m.vocab_size, m.hidden_size)).astype(np.float32)
    if dtype == "f16":
        table = table.astype(np.float16)
    elif dtype == "bf16":
        table = (table.view(np.uint32) >> 16).astype(np.uint16)
    monkeypatch.setattr(m, "embedding", table)
    out = np.empty((1, m.hidden_size), np.float32)
    for token in (0, 7, m.vocab_size - 1):
        np.testing.assert_array_equal(m.embed_row(token, out), m.embed(np.array([[token]]))[0])


# ---------------------------------------------------------------------------------------------
# the step against a plain-NumPy step from the kernels' twins (colibri.kernels._reference)
# ---------------------------------------------------------------------------------------------

def _ref_step(m, token: int, position: int, kv: list) -> np.ndarray:
    """One decode step of m in float64 NumPy from the twins in colibri.kernels._reference; kv: per
    layer the lists of keys and values so far (Hkv, Dh), appended to. Logits (1, V)."""
    c = m.config
    H, Hkv, Dh = c.num_attention_heads, c.num_key_value_heads, c.head_dim
    x = m.embed(np.array([[token]]))[0]                                   # (1, D)
    cos, sin = m.rope.cos_sin_one(position)
    for i, layer in enumerate(m.layers):
        at = layer.attn
        a = R.rms_norm_rows_ref(x, layer.attn_norm, c.rms_norm_eps)
        q, k, v = (R.linear_ref(a, p.w, p.b) for p in (at.wq, at.wk, at.wv))
        if c.qk_norm == "full":
            q = R.rms_norm_rows_ref(q, at.q_norm, c.rms_norm_eps)
            k = R.rms_norm_rows_ref(k, at.k_norm, c.rms_norm_eps)
        if c.clip_qkv is not None:
            q, k, v = (np.clip(z, -c.clip_qkv, c.clip_qkv) for z in (q, k, v))
        q, k, v = q.reshape(H, Dh), k.reshape(Hkv, Dh), v.reshape(Hkv, Dh)
        if c.qk_norm == "per_head":
            q = R.rms_norm_rows_ref(q, at.q_norm, c.rms_norm_eps)
            k = R.rms_norm_rows_ref(k, at.k_norm, c.rms_norm_eps)
        q, k = R.rope_rows_ref(q, cos, sin), R.rope_rows_ref(k, cos, sin)
        keys, values = kv[i]
        keys.append(k)
        values.append(v)
        window = c.layer_window(i) or len(keys)
        K, V = (np.stack(z[-window:], axis=1) for z in (keys, values))  # (Hkv, L, Dh)
        o = R.attend_decode_ref(q, K, V, Dh ** -0.5).astype(np.float32).reshape(1, H * Dh)
        x = x + R.linear_ref(o, at.wo.w, at.wo.b)
        f = R.rms_norm_rows_ref(x, layer.ffn_norm, c.rms_norm_eps)
        ffn = layer.ffn
        if isinstance(ffn, MoE):
            ids, w = R.route_topk_ref(R.linear_ref(f, ffn.router), c.num_experts_per_tok,
                                      norm_topk_prob=c.norm_topk_prob)
            y = R.expert_ffn_ref(f, ids, w, ffn.w_gate, ffn.w_up, ffn.w_down)
            if ffn.shared is not None:
                s = R.swiglu_ref(f, *ffn.shared).astype(np.float64)
                if ffn.shared_gate is not None:
                    s *= 1.0 / (1.0 + np.exp(-R.linear_ref(f, ffn.shared_gate)[:, :1]))
                y = y + s
        else:
            y = R.swiglu_ref(f, ffn.w_gate, ffn.w_up, ffn.w_down)
        x = (x + y).astype(np.float32)
    return R.linear_ref(R.rms_norm_rows_ref(x, m.final_norm, c.rms_norm_eps), m.head)


def test_step_matches_the_reference(model):
    m = model
    tokens = np.random.default_rng(7).integers(3, m.vocab_size, size=PROMPT + STEPS)
    stepped = _decode(m, tokens)[0]
    kv = [([], []) for _ in m.layers]
    for j, t in enumerate(tokens):
        want = _ref_step(m, int(t), j, kv)[0]
        if j >= PROMPT:
            assert _rel(stepped[j], want) <= REF_TOL, j
