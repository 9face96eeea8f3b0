"""Routing fidelity (colibri.tools.fidelity, `colibri perplexity --kl-base`): hand-made traces
with known agreement, a model against itself, q8 / q4 conversions of a tiny checkpoint against
their f32 base checked against a plain per-token recomputation, and the command line."""
from __future__ import annotations

import json
from types import SimpleNamespace

import numpy as np
import pytest

import colibri
from cli_helpers import run as run_cli
from colibri.api import default_model_path
from colibri.errors import ColibriError
from colibri.tools.fidelity import RoutingFidelity, compare_routing, routing_fidelity
from colibri.tools.perplexity import format_markdown, perplexity
from colibri.tools.trace import Trace

SHIPPED = default_model_path()
TEXT = ("The hummingbird is small, fast and frugal. Mixture of experts models route each "
        "token to a few experts; the router picks them. def fibonacci(n): return n. ") * 3


def hand_traces():
    """Two 3-token, 2-layer, top-2-of-4 traces whose agreement is worked out by hand."""
    q = Trace(experts=[[[0, 1], [2, 3]], [[1, 0], [0, 1]], [[3, 2], [1, 2]]],
              weights=[[[0.6, 0.4], [0.7, 0.3]], [[0.5, 0.5], [0.9, 0.1]],
                       [[0.8, 0.2], [0.6, 0.4]]], n_experts=4)
    b = Trace(experts=[[[0, 1], [3, 2]], [[0, 2], [2, 3]], [[3, 2], [1, 0]]],
              weights=[[[0.5, 0.5], [0.6, 0.4]], [[0.7, 0.3], [0.9, 0.1]],
                       [[0.8, 0.2], [0.5, 0.5]]], n_experts=4)
    return q, b


def test_hand_made_traces_give_the_worked_numbers():
    fid = compare_routing(*hand_traces())
    # layer 0: sets {0,1}={0,1}, {0,1}∩{0,2}={0}, {2,3}={2,3} -> (1 + 0.5 + 1) / 3
    np.testing.assert_allclose(fid.set_agreement, [2.5 / 3, 1.5 / 3])
    # top-1: layer 0: 0=0, 1≠0, 3=3; layer 1: 2≠3, 0≠2, 1=1
    np.testing.assert_allclose(fid.top1, [2 / 3, 1 / 3])
    # |Δw| over shared experts: layer 0: token 0 (0.1 + 0.1) / 2, token 1 |0.5 - 0.7| on
    # expert 0, token 2 0 -> (0.1 + 0.2 + 0) / 3; layer 1: token 0 (|0.7-0.4| + |0.3-0.6|) / 2
    # = 0.3, token 1 none shared, token 2 |0.6 - 0.5| on expert 1 -> (0.3 + 0.1) / 2
    np.testing.assert_allclose(fid.weight_error, [0.3 / 3, 0.4 / 2])
    np.testing.assert_array_equal(fid.n_shared, [3, 2])
    # L1 of the dense weight vectors: layer 0: 0.2, 0.2 + 0.5 + 0.3 = 1.0, 0 -> 1.2 / 3;
    # layer 1: 0.6, 2.0 (disjoint), 0.1 + 0.5 + 0.4 = 1.0 -> 3.6 / 3
    np.testing.assert_allclose(fid.weight_l1, [1.2 / 3, 3.6 / 3])
    assert np.isnan(fid.prob_l1).all()                 # no router logits in these traces
    assert fid.mean()["set_agreement"] == pytest.approx((2.5 + 1.5) / 6)


def test_parts_add_up_to_the_whole():
    q, b = hand_traces()
    whole = compare_routing(q, b)
    parts = compare_routing(q[:1], b[:1]) + compare_routing(q[1:], b[1:])
    for name in ("set_agreement", "top1", "weight_error", "weight_l1"):
        np.testing.assert_allclose(getattr(parts, name), getattr(whole, name))
    assert parts.n_tokens == 3


def test_mismatched_traces_are_refused_with_the_shapes():
    q, b = hand_traces()
    with pytest.raises(ValueError, match=r"differ in shape .* model \(2, 2, 2\), base \(3, 2, 2\)"):
        compare_routing(q[:2], b)
    other = Trace(b.experts, b.weights, layers=[0, 5], n_experts=4)
    with pytest.raises(ValueError, match=r"different MoE layers: model \[0, 1\], base \[0, 5\]"):
        compare_routing(q, other)
    ids_q = Trace(q.experts, q.weights, token_ids=[1, 2, 3], n_experts=4)
    ids_b = Trace(b.experts, b.weights, token_ids=[1, 9, 3], n_experts=4)
    with pytest.raises(ValueError, match="different tokens: first difference at token 1"):
        compare_routing(ids_q, ids_b)
    with pytest.raises(ValueError, match="cannot add"):
        compare_routing(q, b) + RoutingFidelity([0], 2, 4)


def test_shipped_model_against_itself_is_exact():
    fid = routing_fidelity(SHIPPED, SHIPPED, TEXT, batch_size=64)
    assert fid.n_tokens > 50
    assert (fid.set_agreement == 1.0).all() and (fid.top1 == 1.0).all()
    assert (fid.weight_error == 0.0).all() and (fid.weight_l1 == 0.0).all()
    assert (fid.prob_l1 == 0.0).all()
    assert fid.layers == list(range(6))


def reference(tq: Trace, tb: Trace) -> dict[str, np.ndarray]:
    """The metrics token by token with Python sets and dicts (no shared code)."""
    T, M, K = tq.experts.shape
    out = {k: np.zeros(M) for k in ("set", "top1", "err", "l1", "p1")}
    shared = np.zeros(M)
    for m in range(M):
        for t in range(T):
            wq = dict(zip(tq.experts[t, m].tolist(), tq.weights[t, m].tolist()))
            wb = dict(zip(tb.experts[t, m].tolist(), tb.weights[t, m].tolist()))
            common = set(wq) & set(wb)
            out["set"][m] += len(common) / K
            out["top1"][m] += tq.experts[t, m, 0] == tb.experts[t, m, 0]
            if common:
                out["err"][m] += sum(abs(wq[e] - wb[e]) for e in common) / len(common)
                shared[m] += 1
            out["l1"][m] += sum(abs(wq.get(e, 0.0) - wb.get(e, 0.0)) for e in set(wq) | set(wb))
            out["p1"][m] += np.abs(tq.probs[t, m].astype(np.float64) - tb.probs[t, m]).sum()
    res = {k: v / T for k, v in out.items()}
    res["err"] = out["err"] / np.maximum(shared, 1)
    return res


@pytest.fixture(scope="module")
def files(hf_checkpoint, tmp_path_factory):
    """f32, q8 and q4 (group 32; experts, shared expert, attention) of one tiny checkpoint."""
    pytest.importorskip("transformers")
    from colibri.convert import convert
    src = hf_checkpoint("mixtral", initializer_range=0.15)
    where = tmp_path_factory.mktemp("fidelity")
    out = {"f32": convert(src, where / "f32.colibri", dtype="f32", progress=False)}
    for q in ("q8", "q4"):
        out[q] = convert(src, where / f"{q}.colibri", dtype="f32", quant=q, group_size=32,
                         quantize="experts,shared,attn", progress=False)
    return SimpleNamespace(**out)


@pytest.mark.parametrize("quant", ["q8", "q4"])
def test_quantized_against_f32_matches_a_per_token_recomputation(files, quant):
    ids = np.random.default_rng(3).integers(0, 300, 96)
    with colibri.load(getattr(files, quant), threads=1, activations="f32",
                       kv_dtype="f32") as mq, \
            colibri.load(files.f32, threads=1, activations="f32", kv_dtype="f32") as mb:
        fid = routing_fidelity(mq, mb, ids, batch_size=32)
        ref = reference(colibri.trace(mq, ids, batch_size=32),
                        colibri.trace(mb, ids, batch_size=32))
    np.testing.assert_allclose(fid.set_agreement, ref["set"], rtol=1e-12)
    np.testing.assert_allclose(fid.top1, ref["top1"], rtol=1e-12)
    np.testing.assert_allclose(fid.weight_error, ref["err"], rtol=1e-6, atol=1e-9)
    np.testing.assert_allclose(fid.weight_l1, ref["l1"], rtol=1e-6, atol=1e-9)
    np.testing.assert_allclose(fid.prob_l1, ref["p1"], rtol=1e-6, atol=1e-9)
    # quantization moves the router's input: the weights differ, the sets mostly agree
    assert (fid.prob_l1 > 0).all() and (fid.weight_l1 > 0).all()
    assert 0.5 < fid.mean()["set_agreement"] <= 1.0


def test_q8_routes_closer_to_f32_than_q4(files):
    ids = np.random.default_rng(4).integers(0, 300, 128)
    err = {q: routing_fidelity(getattr(files, q), files.f32, ids, batch_size=64).mean()
           for q in ("q8", "q4")}
    assert err["q8"]["prob_l1"] < err["q4"]["prob_l1"]
    assert err["q8"]["weight_l1"] < err["q4"]["weight_l1"]


def test_perplexity_kl_base_reports_the_same_routing(files, tmp_path, capsys):
    ids = np.random.default_rng(5).integers(0, 300, 80)
    res = perplexity(files.q4, ids, ctx=16, base=files.f32, activations="f32", kv_dtype="f32")
    # the windows are 5 x 16 tokens, each from an empty cache: what trace does with window=16
    direct = routing_fidelity(files.q4, files.f32, ids, batch_size=16, window=16)
    assert res.routing.n_tokens == direct.n_tokens == 80
    for name in ("set_agreement", "top1", "weight_error", "weight_l1", "prob_l1"):
        np.testing.assert_allclose(getattr(res.routing, name), getattr(direct, name),
                                   rtol=1e-6, atol=1e-9)
    assert "routing of q4.colibri against f32.colibri: 80 tokens, top-2 of 4" in \
        format_markdown(res)
    np.save(tmp_path / "ids.npy", ids)
    code, out, _ = run_cli(capsys, "perplexity", str(files.q4), "-f", str(tmp_path / "ids.npy"),
                           "--ctx", "16", "--kl-base", str(files.f32), "-a", "f32",
                           "--kv-dtype", "f32", "-o", "json")
    assert code == 0
    routing = json.loads(out)["routing"]
    np.testing.assert_allclose(routing["set_agreement"], res.routing.set_agreement)
    assert routing["mean"]["top1"] == pytest.approx(res.routing.mean()["top1"])
    code, out, _ = run_cli(capsys, "perplexity", str(files.q4), "-f", str(tmp_path / "ids.npy"),
                           "--ctx", "16", "-o", "json")
    assert json.loads(out)["routing"] is None                    # no base, no routing


def test_different_tokenizers_are_refused(files):
    with pytest.raises(ColibriError, match="tiny-moe.colibri and .*q4.colibri"):
        routing_fidelity(files.q4, SHIPPED, np.arange(20))
