"""The compiled decode step over T consecutive rows of one sequence (DecodeBinding.rows,
CompiledLayers.run_rows, layer_loop.SequenceRows, Model.forward_rows: a speculative
verification) against the Python layer loop over the same rows (run_layers over the
one-segment RaggedBatch, what forward_ragged runs), on the families the compiled step covers
(test_decode_layer's configs: GQA with sinks and windows, MLA, biased experts, shared
experts and their gates, dense layers, LayerNorm, the muP multipliers).

Over a cache that already holds tokens the loop attends row by row through the decode step's
attention, and its projections and experts take the same kernel calls over the T rows, so
the two agree bit for bit on every activation setting; over an empty cache the loop's
attention is NumPy's (its summation order): within F32_TOL there.
"""
from __future__ import annotations

import numpy as np
import pytest

pytest.importorskip("transformers")

import colibri.api as api  # noqa: E402
from colibri import _kernels  # noqa: E402
from colibri.engine.layer_loop import DECODE_MAX_ROWS  # noqa: E402
from colibri.generation.speculative import MAX_DRAFT_TOKENS, verify  # noqa: E402
from colibri.kernels import runtime  # noqa: E402
from kernel_helpers import on_each_model_forced  # noqa: E402
from test_decode_layer import CONFIGS, converted  # noqa: E402,F401

PROMPT = 3
F32_TOL = 1e-5       # empty cache: the loop's NumPy attention against the compiled one
# where the compiled rows run row by row what the loop runs over the T rows, the order of
# the sums differs: GPT-OSS's biased experts (the one-token call per row against the grouped
# call: measured up to 3e-5 of the largest logit, q4 with f32 activations, 3e-6 elsewhere, 0
# on the integer activations) and MLA (its absorbed attention per row
# against the loop's expanded NumPy attention of the segment), of the largest logit per
# activation setting (int16 quantizes those differences again in the next layer; on int8 they
# flip a group-limited routing choice now and then: DeepSeek-V2's logits then differ by 0.1,
# so int8 is held to the decode step's bits only where the rows run as the loop)
ROWWISE_TOL = {"f32": 1e-4, "int16": 2e-3}
# With a 16-bit cache the two sides' keys and values, a few f32 ulp apart, can round to
# neighbouring 16-bit values (2^-9 relative for bf16): the logits then move by more than the
# f32 rows do (gpt_oss q4, f32 activations, bf16 cache, on an AVX2 CPU: 1.1e-4 of the largest)
CACHE16_TOL = 1e-3


def _python_rows(m, cache, ids):
    """forward_rows through the Python layer loop (the compiled step switched off)."""
    compiled = m.compiled_step
    m.compiled_step = None
    try:
        return m.forward_rows(cache, ids)
    finally:
        m.compiled_step = compiled


def _pair(m, prompt: int, seed: int = 0):
    """Two caches holding the same `prompt` random tokens, and 9 more tokens."""
    tokens = np.random.default_rng(seed).integers(3, m.vocab_size, size=prompt + 9)
    caches = [m.new_cache(ctx=prompt + 12) for _ in range(2)]
    if prompt:
        for c in caches:
            api.forward(m, tokens[:prompt], cache=c)
    return caches, tokens[prompt:]


def _widen(a: np.ndarray) -> np.ndarray:
    """A cache plane as float32 (bf16 is stored as its uint16 bits)."""
    if a.dtype == np.uint16:
        return (a.astype(np.uint32) << 16).view(np.float32)
    return a.astype(np.float32)


def _rowwise(m) -> bool:
    """Whether the compiled rows run a part of m's layers row by row (ROWWISE_TOL)."""
    return m.config.is_mla or any(getattr(layer.ffn, "biased_experts", None) is not None
                                  for layer in m.layers)


def _rows_are_the_loop(m, T_values=range(1, 10)):
    """The compiled rows against the loop, T rows after PROMPT tokens, for each T: the same
    bits (within ROWWISE_TOL of the largest value where the rows run apart)."""
    assert m.compiled_step is not None
    exact = not _rowwise(m)
    if not exact and m.activations not in ROWWISE_TOL:
        return
    tol = ROWWISE_TOL.get(m.activations)
    for T in T_values:
        (fast, slow), new = _pair(m, PROMPT, seed=T)
        a = m.forward_rows(fast, new[:T])
        assert m.compiled_step.declined is None
        b = _python_rows(m, slow, new[:T])
        assert a.shape == (T, m.vocab_size)
        assert fast.length == slow.length == PROMPT + T
        if exact:
            np.testing.assert_array_equal(a.view(np.uint32), b.view(np.uint32), err_msg=f"T {T}")
            for x, y in zip(fast.k + fast.v, slow.k + slow.v):
                np.testing.assert_array_equal(x, y)
        else:
            f32_cache = fast.k[0].dtype == np.float32
            ltol = tol if f32_cache else max(tol, CACHE16_TOL)
            np.testing.assert_allclose(a, b, rtol=0, atol=ltol * np.abs(b).max(), err_msg=f"T {T}")
            for x, y in zip(fast.k + fast.v, slow.k + slow.v):
                x, y = _widen(x), _widen(y)      # a 16-bit cache: within its last place too
                rtol = 0 if f32_cache else 2 ** -7
                np.testing.assert_allclose(x, y, rtol=rtol, atol=tol * np.abs(y).max())


CASES = [(case, fmt) for case in CONFIGS for fmt in ("f32", "q4")] + [("gpt_oss", "mxfp4")]


@pytest.mark.parametrize("case,fmt", CASES)
def test_rows_are_the_python_loop(converted, case, fmt):
    """T = 1..9 rows after a cache of 3 tokens (past the windows of 4): the loop's logits and
    cache contents, bit for bit, on each activation setting and cache dtype."""
    for activations in ("f32", "int16", "int8"):
        for kv in ("f32", "bf16"):
            m = api.load(converted(case, fmt), threads=2, activations=activations, kv_dtype=kv)
            try:
                _rows_are_the_loop(m, range(1, 10) if kv == "f32" else (2, 7))
            finally:
                m.close()


@pytest.mark.parametrize("case", ["mixtral-window", "gpt_oss", "deepseek_v2", "qwen2_moe"])
def test_rows_over_an_empty_cache(converted, case):
    """The first rows of a sequence (the loop's attention is NumPy's then): within F32_TOL
    (an f32 cache: a 16-bit one rounds those differences to a unit of its last place)."""
    m = api.load(converted(case, "f32"), threads=1, activations="f32", kv_dtype="f32")
    try:
        for T in (1, 4, 9):
            (fast, slow), new = _pair(m, 0, seed=T)
            a = m.forward_rows(fast, new[:T])
            b = _python_rows(m, slow, new[:T])
            np.testing.assert_allclose(a, b, rtol=0, atol=F32_TOL * max(1, np.abs(b).max()))
            for x, y in zip(fast.k + fast.v, slow.k + slow.v):
                np.testing.assert_allclose(x, y, rtol=0, atol=F32_TOL)
    finally:
        m.close()


@pytest.mark.parametrize("case", ["mixtral", "gpt_oss", "deepseek_v3", "phimoe"])
def test_one_row_is_the_decode_step(converted, case):
    """T = 1 through CompiledLayers.run_rows is the decode step's bits (the last layer's
    residual stream, the cache it leaves); forward_rows of one token is the step itself."""
    m = api.load(converted(case, "q4"), threads=2, activations="int16")
    try:
        (a_cache, b_cache), new = _pair(m, PROMPT)
        fast = m.compiled_step
        for t in new[:4]:
            pos = a_cache.length                          # no padding: the slot's position
            h = np.ascontiguousarray(m.embed(np.array([[t]]))[0])                 # (1, D)
            cos, sin = m.rope.cos_sin_one(pos)
            assert fast.run_rows(m.run_state(a_cache), a_cache, h, cos[None], sin[None],
                                 m.timings)
            a_cache.commit_one(pos)
            api.forward(m, np.array([t]), cache=b_cache)
            np.testing.assert_array_equal(h.view(np.uint32),
                                          b_cache.run_state.h.view(np.uint32))
        for x, y in zip(a_cache.k + a_cache.v, b_cache.k + b_cache.v):
            np.testing.assert_array_equal(x, y)
        a = m.forward_rows(a_cache, new[4:5])
        b = api.forward(m, new[4:5], cache=b_cache)
        np.testing.assert_array_equal(a.view(np.uint32), b.view(np.uint32))
    finally:
        m.close()


def test_rows_are_feeding_the_tokens_one_by_one(converted):
    """Each row's logits are those of the decode steps fed the tokens one by one, up to the
    projections' summation order over T rows (f32: tight)."""
    m = api.load(converted("qwen2_moe", "f32"), threads=1, activations="f32")
    try:
        (a_cache, b_cache), new = _pair(m, PROMPT)
        a = m.forward_rows(a_cache, new)
        b = np.concatenate([api.forward(m, np.array([t]), cache=b_cache) for t in new])
        np.testing.assert_allclose(a, b, rtol=0, atol=F32_TOL * max(1, np.abs(b).max()))
    finally:
        m.close()


def test_too_many_rows(converted):
    """DecodeBinding.rows takes at most DECODE_MAX_ROWS (a ValueError beyond); forward_rows
    runs longer inputs through the loop."""
    assert DECODE_MAX_ROWS == MAX_DRAFT_TOKENS + 1
    m = api.load(converted("mixtral", "f32"), threads=1, activations="f32")
    try:
        T = DECODE_MAX_ROWS + 1
        c = m.new_cache(ctx=64)
        api.forward(m, np.array([5, 6, 7]), cache=c)
        m.forward_rows(c, np.array([8]))
        b = c.decode_binding
        h = np.zeros((T, m.config.hidden_size), np.float32)
        cs = np.zeros((T, len(m.rope.cos_sin_one(0)[0])), np.float32)
        with pytest.raises(ValueError, match=f"1 <= T <= {DECODE_MAX_ROWS}"):
            b.rows(c.k, c.v, c.length, cs, cs, h)
        with pytest.raises(ValueError, match="outside the cache"):
            b.rows(c.k, c.v, 60, cs[:8], cs[:8], h[:8])
        tokens = np.arange(3, 3 + T)
        d = c.copy()
        a = m.forward_rows(c, tokens)
        r = m.forward_ragged([(d, tokens)], logits_rows=[np.arange(T)])
        np.testing.assert_array_equal(a, r)
    finally:
        m.close()


def test_verify_takes_the_rows_and_routing_the_loop(converted):
    """speculative.verify: the compiled rows (the loop's bits); with routing, the loop."""
    m = api.load(converted("qwen3_moe", "q4"), threads=2, activations="int16")
    try:
        (a_cache, b_cache), new = _pair(m, PROMPT)
        a = verify(m, a_cache, new[:5])
        b = _python_rows(m, b_cache, new[:5])
        np.testing.assert_array_equal(a, b)
        a_cache.truncate(PROMPT)
        c, routing = verify(m, a_cache, new[:5], return_routing=True)
        np.testing.assert_array_equal(c, b)
        assert routing.shape == (m.config.num_hidden_layers, 5, m.config.num_experts_per_tok)
    finally:
        m.close()


def test_declined_sources_take_the_loop(converted, monkeypatch):
    """When the expert sources decline, the rows run through the loop (the same values)."""
    m = api.load(converted("mixtral", "q4"), threads=2, activations="int16")
    try:
        (a_cache, b_cache), new = _pair(m, PROMPT)
        monkeypatch.setattr(type(m.compiled_step), "sources_reason", lambda self: "a test")
        a = m.forward_rows(a_cache, new[:5])
        assert m.compiled_step.declined == "a test"
        assert a_cache.decode_binding is None
        b = _python_rows(m, b_cache, new[:5])
        np.testing.assert_array_equal(a, b)
    finally:
        m.close()


def test_stage_timings_are_kept(converted):
    m = api.load(converted("qwen2_moe", "q4"), threads=1, activations="int16")
    try:
        (c, _), new = _pair(m, PROMPT)
        m.timings.reset()
        m.forward_rows(c, new[:6])
        s = m.timings.seconds
        assert s["attention"] > 0 and s["experts"] > 0 and s["shared"] > 0
    finally:
        m.close()


ISA_CASES = [("qwen2_moe", "q4"), ("olmoe", "q8"), ("glm4_moe", "q4"), ("deepseek_v2", "q4"),
             ("gpt_oss", "mxfp4"), ("phimoe", "q8")]


@pytest.mark.parametrize("isa", runtime.available_isas())
def test_each_isa_path(converted, isa):
    """Each ISA path forced (as COLIBRI_ISA does): the loop's bits on each."""
    on_each_model_forced(converted, isa, ISA_CASES, lambda m: _rows_are_the_loop(m, (1, 3, 9)))


def test_max_rows_constant():
    assert _kernels.DECODE_MAX_ROWS == DECODE_MAX_ROWS


@pytest.mark.parametrize("case,fmt", [c for c in CASES if c[1] != "f32"])
def test_rows_record_the_loops_routing(converted, case, fmt):
    """forward_rows(return_routing=True) through the compiled rows gives each MoE layer's
    experts of each row, those the loop records (and its logits), T = 1, 5, 9; with no MoE
    layer the routing is (0, T, K)."""
    m = api.load(converted(case, fmt), threads=2, activations="int16")
    try:
        for T in (1, 5, 9):
            (fast, slow), new = _pair(m, PROMPT, seed=T)
            a, (ra,) = m.forward_rows(fast, new[:T], return_routing=True)
            assert fast.decode_binding is not None            # the compiled rows ran
            compiled, m.compiled_step = m.compiled_step, None
            try:
                b, (rb,) = m.forward_rows(slow, new[:T], return_routing=True)
            finally:
                m.compiled_step = compiled
            assert ra.dtype == np.int32 and ra.shape == rb.shape
            assert ra.shape[1:] == (T, m.config.num_experts_per_tok)
            if _rowwise(m):             # the summation order may flip a near tie
                assert (ra == rb).mean() > 0.9
                np.testing.assert_allclose(a, b, rtol=0, atol=2e-3 * np.abs(b).max())
            else:
                np.testing.assert_array_equal(ra, rb, err_msg=f"T {T}")
                np.testing.assert_array_equal(a, b)
    finally:
        m.close()


def test_rows_routing_must_fit(converted):
    """A routing array of the wrong shape or dtype is a ValueError naming what it expects."""
    m = api.load(converted("mixtral", "q4"), threads=1)
    try:
        (c, _), _ = _pair(m, PROMPT)
        b = m.compiled_step._binding(m.run_state(c), c)
        hr = len(m.rope.cos_sin_one(0)[0])
        h = np.zeros((2, m.config.hidden_size), np.float32)
        cs = np.zeros((2, hr), np.float32)
        K = m.config.num_experts_per_tok
        for bad in (np.zeros((1, 2, K), np.int32), np.zeros((2, 2, K), np.int64),
                    np.zeros((2, 2, K), np.int32)[:, ::-1]):
            with pytest.raises(ValueError, match=r"routing must be .* shape \(2, 2, 2\)"):
                b.rows(c.k, c.v, c.length, cs, cs, h, bad)
    finally:
        m.close()
