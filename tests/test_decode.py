"""The decode fast path of Model.forward against its general path.

A step of one token of one sequence through a cache with no padding takes the fast path
(Model.fast_decode; Attention.decode, DecodeWork): no mask, buffers reused, the residual
stream updated in place, the attention over the cache in one compiled call
(kernels.attend_decode, its own summation order). With that kernel the logits are within
FAST_TOL of the general path's and the routing is the same; with the NumPy attention instead
(attend_one None) the fast path performs the general path's operations on the same shapes
(its RMSNorms and RoPE in NumPy, or compiled with NumPy's arithmetic and summation order),
so logits and routing are bit-identical, for every family's attention variant (plain,
biased q/k/v, per-head and full q/k norms with clip_qkv) and weight format; only past a
sliding window (hidden slots left out instead of masked to zero) do the sums round
differently: 1e-5 of the largest logit there. The fused q/k/v projection (one kernel call over
the three adjacent matrices) is checked against the three separate calls, bit for bit.
"""
from __future__ import annotations

import numpy as np
import pytest

pytest.importorskip("torch")
pytest.importorskip("transformers")

import colibri.api as api  # noqa: E402
from colibri.convert import convert  # noqa: E402
from hf_factory import FAMILY_NAMES  # noqa: E402

CASES = {name: (name, {}) for name in FAMILY_NAMES} | {
    "mixtral-window": ("mixtral", dict(sliding_window=4)),
    "qwen2_moe-window-layer0": ("qwen2_moe", dict(use_sliding_window=True, sliding_window=4,
                                                  max_window_layers=1)),
}
FORMATS = {"f32": dict(dtype="f32"),
           "q4-all": dict(dtype="f32", quant="q4", quantize="experts,shared,attn,head,dense")}
WINDOW_TOL = 1e-5
FAST_TOL = 1e-5          # relative to the largest logit: the compiled attention's rounding
PROMPT, STEPS = 5, 9


@pytest.fixture(scope="module", params=[(c, f) for c in CASES for f in FORMATS],
                ids=lambda p: f"{p[0]}-{p[1]}")
def model(request, hf_checkpoint, tmp_path_factory):
    case, fmt = request.param
    family, overrides = CASES[case]
    path = hf_checkpoint(family, initializer_range=0.15, **overrides)
    dst = tmp_path_factory.mktemp("decode") / f"{case}-{fmt}.colibri"
    convert(path, dst, progress=False, **FORMATS[fmt])
    m = api.load(dst, threads=1)
    yield m
    m.close()


def _run(m, tokens, fast: bool, monkeypatch):
    """Prefill tokens[:PROMPT], then one token at a time: logits (S, V), traces, cache."""
    monkeypatch.setattr(m, "fast_decode", fast)
    cache = m.new_cache(ctx=len(tokens))
    logits, trace = api.forward(m, tokens[:PROMPT], cache=cache, return_routing=True)
    out, traces = [logits], [trace]
    for t in tokens[PROMPT:]:
        logits, trace = api.forward(m, np.array([t]), cache=cache, return_routing=True)
        out.append(logits)
        traces.append(trace)
    return np.concatenate(out), traces, cache


def _windowed(m) -> bool:
    return any(layer.attn.window and PROMPT + STEPS > layer.attn.window for layer in m.layers)


def test_fast_path_with_the_attention_kernel_matches_general_path(model, monkeypatch):
    m = model
    assert all(layer.attn.attend_one is not None for layer in m.layers)
    tokens = np.random.default_rng(0).integers(3, m.vocab_size, size=PROMPT + STEPS)
    fast, fast_traces, fast_cache = _run(m, tokens, True, monkeypatch)
    slow, slow_traces, slow_cache = _run(m, tokens, False, monkeypatch)
    assert "decode" in fast_cache.scratch
    err = float(np.abs(fast - slow).max() / np.abs(slow).max())
    assert err <= FAST_TOL, err
    for a, b in zip(fast_traces, slow_traces):
        for x, y in zip(a.ids, b.ids):
            np.testing.assert_array_equal(x, y)
    np.testing.assert_array_equal(fast_cache.pos, slow_cache.pos)


@pytest.mark.parametrize("row_ops", [True, False], ids=["compiled-row-ops", "numpy-row-ops"])
def test_fast_path_equals_general_path(model, monkeypatch, row_ops):
    """With the NumPy attention (no kernel) the fast path is bit-identical, its norms and
    RoPE compiled (NumPy's arithmetic and summation order in C) or in NumPy."""
    m = model
    monkeypatch.setattr(m, "compiled_row_ops", row_ops)
    for layer in m.layers:
        monkeypatch.setattr(layer.attn, "attend_one", None)
    tokens = np.random.default_rng(0).integers(3, m.vocab_size, size=PROMPT + STEPS)
    fast, fast_traces, fast_cache = _run(m, tokens, True, monkeypatch)
    slow, slow_traces, slow_cache = _run(m, tokens, False, monkeypatch)
    assert "decode" in fast_cache.scratch and "decode" not in slow_cache.scratch
    assert (fast_cache.scratch["decode"].norm_rows is not None) == row_ops
    if _windowed(m):
        err = float(np.abs(fast - slow).max() / np.abs(slow).max())
        assert err <= WINDOW_TOL
    else:
        np.testing.assert_array_equal(fast, slow)
        np.testing.assert_array_equal(fast_cache.k[-1], slow_cache.k[-1])
        for a, b in zip(fast_traces, slow_traces):
            assert a.layers == b.layers
            for x, y in zip(a.ids + a.weights + a.logits + a.shared_gate,
                            b.ids + b.weights + b.logits + b.shared_gate):
                np.testing.assert_array_equal(x, y)
    np.testing.assert_array_equal(fast_cache.pos, slow_cache.pos)


@pytest.mark.parametrize("activations", ["int8", "int16"])
def test_fast_path_equals_general_path_with_quantized_activations(model, monkeypatch,
                                                                   activations):
    """The prepared calls of the fast and lean decode paths carry the activations setting:
    with the NumPy attention, the same bits as the general path (q4 files, where the setting
    changes the products)."""
    if str(model.file.path).endswith("-f32.colibri"):
        pytest.skip("no q4/q8 matrices: the activations setting changes nothing")
    with api.load(model.file.path, threads=1, activations=activations) as m:
        for layer in m.layers:
            monkeypatch.setattr(layer.attn, "attend_one", None)
        tokens = np.random.default_rng(6).integers(3, m.vocab_size, size=PROMPT + STEPS)
        fast, _, fast_cache = _run(m, tokens, True, monkeypatch)
        slow, _, _ = _run(m, tokens, False, monkeypatch)
        assert "decode" in fast_cache.scratch
        if _windowed(m):
            tol = 2e-2 if activations == "int8" else 1e-4   # a code may flip with the sums
            assert float(np.abs(fast - slow).max() / np.abs(slow).max()) <= tol
        else:
            np.testing.assert_array_equal(fast, slow)
        monkeypatch.setattr(m, "fast_decode", True)  # the lean entry (no routing requested)
        cache = m.new_cache(ctx=len(tokens))
        api.forward(m, tokens[:PROMPT], cache=cache)
        lean = np.concatenate([api.forward(m, np.array([t]), cache=cache)
                               for t in tokens[PROMPT:]])
        np.testing.assert_array_equal(lean, fast[PROMPT:])


def test_fused_qkv_equals_three_projections(model, monkeypatch):
    m = model
    assert all(layer.attn.wqkv is not None for layer in m.layers)   # the converter's layout
    tokens = np.random.default_rng(1).integers(3, m.vocab_size, size=PROMPT + 3)
    fused = [_run(m, tokens, fast, monkeypatch)[0] for fast in (True, False)]
    for layer in m.layers:
        monkeypatch.setattr(layer.attn, "wqkv", None)
    for fast, want in zip((True, False), fused):
        np.testing.assert_array_equal(_run(m, tokens, fast, monkeypatch)[0], want)


def test_padding_batches_and_no_cache_take_the_general_path(model):
    m = model
    tokens = np.random.default_rng(2).integers(3, m.vocab_size, size=6)
    # a left-padded sequence: its cache holds a padding slot, so every step needs the mask
    cache = m.new_cache(ctx=8)
    mask = np.array([0, 1, 1, 1, 1])
    api.forward(m, tokens[:5], cache=cache, attention_mask=mask)
    got = api.forward(m, tokens[5:], cache=cache)
    assert "decode" not in cache.scratch
    alone = api.forward(m, tokens[1:])[-1:]
    np.testing.assert_allclose(got, alone, rtol=1e-5, atol=1e-5 * np.abs(alone).max())
    # a batch of two, and a step without a cache
    cache2 = m.new_cache(ctx=8, batch=2)
    api.forward(m, np.stack([tokens[:5]] * 2), cache=cache2)
    api.forward(m, np.stack([tokens[5:]] * 2), cache=cache2)
    assert "decode" not in cache2.scratch
    api.forward(m, tokens[:1])


def test_work_buffers_are_reused_and_results_not_aliased(model):
    m = model
    tokens = np.random.default_rng(3).integers(3, m.vocab_size, size=4)
    cache = m.new_cache(ctx=8)
    api.forward(m, tokens[:2], cache=cache)
    a = api.forward(m, tokens[2:3], cache=cache)
    work = cache.scratch["decode"]
    a_copy = a.copy()
    b = api.forward(m, tokens[3:4], cache=cache)
    assert cache.scratch["decode"] is work
    np.testing.assert_array_equal(a, a_copy)            # the logits of a step are its own
    assert not np.shares_memory(a, b)
    # the buffers belong to the cache: a copy starts without them
    assert "decode" not in cache.copy().scratch


def test_lean_decode_step_equals_the_fast_path(model, monkeypatch):
    """A decode call without routing takes Model._decode_step (no BLAS limit, fewer NumPy
    calls): the fast path's logits bit for bit, the same cache, (S,) and (1, S) inputs."""
    m = model
    taken = []
    lean = m._decode_step

    def counted(*args):
        logits = lean(*args)
        taken.append(logits is not None)
        return logits

    monkeypatch.setattr(m, "_decode_step", counted)
    tokens = np.random.default_rng(4).integers(3, m.vocab_size, size=PROMPT + STEPS)
    caches, outs = [], []
    for routing in (False, True):
        cache = m.new_cache(ctx=len(tokens))
        api.forward(m, tokens[:PROMPT], cache=cache)
        out = []
        for j, t in enumerate(tokens[PROMPT:]):
            ids = np.array([t]) if j % 2 else np.array([[t]])
            got = api.forward(m, ids, cache=cache, return_routing=routing)
            got = got[0] if routing else got
            assert got.shape == ((1, m.vocab_size) if j % 2 else (1, 1, m.vocab_size))
            out.append(got.reshape(1, -1))
        caches.append(cache)
        outs.append(np.concatenate(out))
    assert sum(taken) == STEPS                 # every step without routing, none with it
    np.testing.assert_array_equal(outs[0], outs[1])
    for a, b in ((caches[0].k, caches[1].k), (caches[0].v, caches[1].v)):
        for x, y in zip(a, b):
            np.testing.assert_array_equal(x, y)
    np.testing.assert_array_equal(caches[0].pos, caches[1].pos)
    np.testing.assert_array_equal(caches[0].valid, caches[1].valid)


@pytest.mark.parametrize("dtype", ["f32", "f16", "bf16"])
def test_embed_row_equals_embed(model, monkeypatch, dtype):
    m = model
    rng = np.random.default_rng(5)
    table = rng.standard_normal((m.vocab_size, m.hidden_size)).astype(np.float32)
    if dtype == "f16":
        table = table.astype(np.float16)
    elif dtype == "bf16":
        table = (table.view(np.uint32) >> 16).astype(np.uint16)
    monkeypatch.setattr(m, "embedding", table)
    out = np.empty((1, m.hidden_size), np.float32)
    for token in (0, 7, m.vocab_size - 1):
        np.testing.assert_array_equal(m._embed_row(token, out), m.embed(np.array([[token]]))[0])
