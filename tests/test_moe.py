"""colibri.engine.moe: MoE (router, top-k, routed experts, gated shared expert) and DenseMLP against
a float64 NumPy computation of the same weights."""
from __future__ import annotations

import numpy as np
import pytest

from colibri.kernels import WeightRef
from colibri.engine.moe import DenseMLP, MoE
from colibri.kernels.runtime import STAGES, Timings

TOL = 2e-5               # relative to the largest |y|: float32 kernels vs float64 NumPy
T, D, E, K, I, Is = 7, 64, 6, 2, 32, 48


def _ref(w: np.ndarray) -> WeightRef:
    """A float32 WeightRef over w (R, C) or a stack (E, R, C)."""
    w = np.ascontiguousarray(w, dtype=np.float32)
    buf = w.reshape(-1).view(np.uint8)
    if w.ndim == 3:
        return WeightRef(buf, 0, "f32", w.shape[1], w.shape[2], n_experts=w.shape[0])
    return WeightRef(buf, 0, "f32", *w.shape)


def _silu(z):
    return z / (1.0 + np.exp(-z))


def _swiglu(x, g, u, d):
    """down(silu(gate x) * up x) in float64, x (T, D), g / u (I, D), d (D, I)."""
    return (_silu(x @ g.T) * (x @ u.T)) @ d.T


def _softmax(z):
    e = np.exp(z - z.max(axis=-1, keepdims=True))
    return e / e.sum(axis=-1, keepdims=True)


def _close(got, want):
    err = float(np.abs(got - want).max() / np.abs(want).max())
    assert err <= TOL, err


@pytest.fixture
def weights():
    rng = np.random.default_rng(0)
    w = {
        "router": rng.normal(0, 0.3, (E, D)), "gate": rng.normal(0, 0.2, (E, I, D)),
        "up": rng.normal(0, 0.2, (E, I, D)), "down": rng.normal(0, 0.2, (E, D, I)),
        "s_gate": rng.normal(0, 0.2, (Is, D)), "s_up": rng.normal(0, 0.2, (Is, D)),
        "s_down": rng.normal(0, 0.2, (D, Is)), "g": rng.normal(0, 0.3, (1, D)),
    }
    w = {k: v.astype(np.float32) for k, v in w.items()}
    x = rng.normal(0, 1, (T, D)).astype(np.float32)
    return w, x


def _moe(w, norm_topk_prob=False, shared=False, gate=False, threads=1) -> MoE:
    return MoE(_ref(w["router"]), _ref(w["gate"]), _ref(w["up"]), _ref(w["down"]), top_k=K,
               norm_topk_prob=norm_topk_prob, threads=threads,
               shared=(_ref(w["s_gate"]), _ref(w["s_up"]), _ref(w["s_down"])) if shared else None,
               shared_gate=_ref(w["g"]) if gate else None)


def _routing(w, x, norm_topk_prob):
    """ids (T, K) by descending softmax probability and their weights, in float64."""
    p = _softmax(x.astype(np.float64) @ w["router"].T.astype(np.float64))       # (T, E)
    ids = np.argsort(-p, axis=1, kind="stable")[:, :K]
    wts = np.take_along_axis(p, ids, axis=1)
    if norm_topk_prob:
        wts = wts / wts.sum(axis=1, keepdims=True)
    return ids, wts


def _routed(w, x, ids, wts):
    x64 = x.astype(np.float64)
    y = np.zeros((T, D))
    for t in range(T):
        for k in range(K):
            e = ids[t, k]
            y[t] += wts[t, k] * _swiglu(x64[t:t + 1], w["gate"][e].astype(np.float64),
                                        w["up"][e].astype(np.float64),
                                        w["down"][e].astype(np.float64))[0]
    return y


@pytest.mark.parametrize("norm_topk_prob", [False, True])
def test_routed_experts_match_numpy(weights, norm_topk_prob):
    w, x = weights
    tm = Timings()
    y, ids, wts, gate = _moe(w, norm_topk_prob)(x, tm)
    want_ids, want_wts = _routing(w, x, norm_topk_prob)
    assert ids.dtype == np.int32 and ids.shape == (T, K) and wts.dtype == np.float32
    np.testing.assert_array_equal(ids, want_ids)
    np.testing.assert_allclose(wts, want_wts, rtol=1e-5)
    if norm_topk_prob:
        np.testing.assert_allclose(wts.sum(axis=1), 1.0, rtol=1e-6)
    assert gate is None
    assert y.dtype == np.float32 and y.shape == (T, D)
    _close(y, _routed(w, x, want_ids, want_wts))
    assert tm.seconds["router"] > 0 and tm.seconds["experts"] > 0 and tm.seconds["shared"] == 0


@pytest.mark.parametrize("gated", [False, True])
def test_shared_expert_with_and_without_gate(weights, gated):
    w, x = weights
    tm = Timings()
    y, ids, wts, gate = _moe(w, shared=True, gate=gated)(x, tm)
    s = _swiglu(x.astype(np.float64), *(w[k].astype(np.float64)
                                        for k in ("s_gate", "s_up", "s_down")))
    if gated:
        z = x.astype(np.float64) @ w["g"][0].astype(np.float64)                  # (T,)
        want_gate = 1.0 / (1.0 + np.exp(-z))
        assert gate.dtype == np.float32 and gate.shape == (T,)
        np.testing.assert_allclose(gate, want_gate, rtol=1e-5)
        s = s * want_gate[:, None]
    else:
        assert gate is None
    want_ids, want_wts = _routing(w, x, False)
    np.testing.assert_array_equal(ids, want_ids)
    _close(y, _routed(w, x, want_ids, want_wts) + s)
    assert tm.seconds["shared"] > 0
    # the shared expert changes the output: without it, y is the routed part alone
    alone = _moe(w)(x, Timings())[0]
    assert not np.allclose(alone, y)


def test_out_buffer_threads_and_a_single_token(weights):
    w, x = weights
    moe = _moe(w, shared=True, gate=True)
    y = moe(x, Timings())[0]
    out = np.full((T, D), np.nan, np.float32)
    got = moe(x, Timings(), out=out)[0]
    assert got is out
    np.testing.assert_array_equal(out, y)
    for t in (0, T - 1):        # one token (the decode step's call; row kernels, not GEMM)
        _close(moe(x[t:t + 1], Timings())[0], y[t:t + 1].astype(np.float64))
    two = _moe(w, shared=True, gate=True, threads=2)(x, Timings())[0]
    np.testing.assert_array_equal(two, y)       # results do not depend on the thread count


def test_dense_mlp_matches_numpy(weights):
    w, x = weights
    tm = Timings()
    mlp = DenseMLP(_ref(w["s_gate"]), _ref(w["s_up"]), _ref(w["s_down"]), threads=1)
    y = mlp(x, tm)
    assert y.dtype == np.float32 and y.shape == (T, D)
    _close(y, _swiglu(x.astype(np.float64), *(w[k].astype(np.float64)
                                              for k in ("s_gate", "s_up", "s_down"))))
    assert tm.seconds["dense"] > 0 and set(tm.seconds) == set(STAGES)
