"""colibri.tools.trace: the routing a forward pass used, per token and MoE layer, as arrays.

Checked against Model.forward(return_routing=True) (the same ids and weights), against
transformers' router_logits and aux_loss on tiny checkpoints, across chunk sizes, windows,
files read piece by piece and several texts. The notebook HTML is in test_display.py.
"""
from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("transformers")

import colibri.api as api  # noqa: E402
import colibri.tools.trace as trace_mod  # noqa: E402
from routing_models import converted, mixtral, qwen  # noqa: F401,E402 (fixtures)
from colibri.convert import ConversionWarning, convert  # noqa: E402
from colibri.format.tokenizer import NoTokenizerError  # noqa: E402
from colibri.tools.stats import RoutingStats  # noqa: E402
from colibri.tools.trace import (Trace, UnknownLayerError, iter_trace, routing_stats,  # noqa: E402
                                 softmax, trace)

TEXT = "def fibonacci(n):\n    if n < 2:\n        return n\n    return fibonacci(n - 1)\n"


@pytest.fixture(scope="module")
def mixtral_trace(mixtral):
    return trace(mixtral[1], TEXT)


# --------------------------------------------------------------------------------------------
# the same routing as the forward pass and as transformers
# --------------------------------------------------------------------------------------------

@pytest.mark.parametrize("which", ["qwen", "mixtral"])
def test_trace_is_the_forward_pass_routing(which, request):
    _, m = request.getfixturevalue(which)
    ids = np.asarray(m.tokenizer.encode(TEXT))
    tr = trace(m, TEXT)
    _, rt = m.forward(ids, return_routing=True)
    c = m.config
    T, L, K, E = len(ids), len(c.moe_layer_ids), c.num_experts_per_tok, c.num_experts
    assert tr.layers == rt.layers == list(c.moe_layer_ids)
    assert tr.experts.shape == (T, L, K) and tr.experts.dtype == np.int32
    assert tr.weights.shape == (T, L, K) and tr.weights.dtype == np.float32
    assert tr.probs.shape == (T, L, E) and tr.probs.dtype == np.float32
    assert tr.logits.shape == (T, L, E) and tr.logits.dtype == np.float32
    np.testing.assert_array_equal(tr.token_ids, ids)
    np.testing.assert_array_equal(tr.positions, np.arange(T))
    for j in range(L):
        np.testing.assert_array_equal(tr.experts[:, j], rt.ids[j])
        np.testing.assert_array_equal(tr.weights[:, j], rt.weights[j])
        np.testing.assert_array_equal(tr.logits[:, j], rt.logits[j])
    np.testing.assert_allclose(tr.probs.sum(-1), 1.0, rtol=1e-5)
    # the chosen experts are the top-k of the distribution, their weights its values
    top = np.take_along_axis(tr.probs, tr.experts, -1)
    assert (top.min(-1) >= np.sort(tr.probs, -1)[..., -K] - 1e-7).all()
    want = top / top.sum(-1, keepdims=True) if m.config.norm_topk_prob else top
    np.testing.assert_allclose(tr.weights, want, rtol=1e-5, atol=1e-7)
    if which == "qwen":
        assert tr.shared_gate.shape == (T, L) and tr.shared_gate.dtype == np.float32
        np.testing.assert_array_equal(tr.shared_gate[:, 0], rt.shared_gate[0])
        assert ((tr.shared_gate > 0) & (tr.shared_gate < 1)).all()
    else:
        assert tr.shared_gate is None


@pytest.mark.parametrize("which", ["qwen", "mixtral"])
def test_trace_matches_transformers_router_logits_and_aux_loss(which, request):
    import torch
    import transformers

    src, m = request.getfixturevalue(which)
    hf = transformers.AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32).eval()
    tr = trace(m, TEXT)
    with torch.no_grad():
        out = hf(input_ids=torch.from_numpy(tr.token_ids[None]), output_router_logits=True)
    want = np.stack([x.numpy() for x in out.router_logits], axis=1)            # (T, L, E)
    np.testing.assert_allclose(tr.logits, want, rtol=1e-4, atol=1e-5)
    p = torch.softmax(torch.from_numpy(want), -1)
    w, ids = torch.topk(p, m.config.num_experts_per_tok, dim=-1)
    np.testing.assert_array_equal(tr.experts, ids.numpy())
    np.testing.assert_allclose(tr.probs, p.numpy(), rtol=1e-4, atol=1e-6)
    st = tr.stats()
    assert st.aux_loss_total == pytest.approx(float(out.aux_loss), rel=1e-4)


# --------------------------------------------------------------------------------------------
# chunks, windows, files, several texts
# --------------------------------------------------------------------------------------------

def test_chunked_trace_equals_one_pass(mixtral, mixtral_trace):
    _, m = mixtral
    parts = list(iter_trace(m, TEXT, batch_size=7))
    assert [len(p) for p in parts[:-1]] == [7] * (len(parts) - 1) and len(parts[-1]) <= 7
    tr = Trace.concat(parts)
    np.testing.assert_array_equal(tr.experts, mixtral_trace.experts)
    np.testing.assert_allclose(tr.weights, mixtral_trace.weights, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(tr.logits, mixtral_trace.logits, rtol=1e-4, atol=1e-5)
    np.testing.assert_array_equal(tr.positions, mixtral_trace.positions)


def test_windows_restart_the_context(mixtral):
    _, m = mixtral
    ids = np.asarray(m.tokenizer.encode(TEXT))[:20]
    tr = trace(m, ids, window=8, batch_size=3)
    np.testing.assert_array_equal(tr.positions, np.arange(20) % 8)
    alone = trace(m, ids[8:16])                      # the second window, traced on its own
    np.testing.assert_array_equal(tr.experts[8:16], alone.experts)
    np.testing.assert_allclose(tr.weights[8:16], alone.weights, rtol=1e-5, atol=1e-6)
    with pytest.raises(ValueError, match=r"window must be an integer in \[1, 256\]"):
        trace(m, ids, window=1000)


def test_max_tokens_and_inputs(mixtral, mixtral_trace):
    _, m = mixtral
    tr = trace(m, TEXT, max_tokens=5, batch_size=2)
    assert len(tr) == 5
    np.testing.assert_array_equal(tr.experts, mixtral_trace.experts[:5])
    two = trace(m, ["Hello world", TEXT])            # two texts: positions restart
    n = len(m.tokenizer.encode("Hello world"))
    np.testing.assert_array_equal(two.positions[:n], np.arange(n))
    assert two.positions[n] == 0
    np.testing.assert_array_equal(two.experts[n:], mixtral_trace.experts)
    with pytest.raises(ValueError, match="no tokens"):
        trace(m, "")
    with pytest.raises(ValueError, match="token ids"):
        trace(m, np.array([0.5, 1.5]))


def test_file_streamed_in_pieces(mixtral, tmp_path, monkeypatch):
    _, m = mixtral
    path = tmp_path / "corpus.txt"
    text = (TEXT + "Hello world! Tokens, experts.\n") * 4
    path.write_text(text)
    whole = trace(m, Path(path))                     # one piece: the same as the text
    np.testing.assert_array_equal(whole.token_ids, m.tokenizer.encode(text))
    monkeypatch.setattr(trace_mod, "_FILE_PIECE", 40)    # force many pieces, cut at line ends
    parts = list(iter_trace(m, path, batch_size=16))
    tr = Trace.concat(parts)
    assert len(parts) > 6 and max(len(p) for p in parts) <= 16
    assert m.tokenizer.decode(tr.token_ids.tolist()) == text
    np.testing.assert_array_equal(tr.positions, np.arange(len(tr)))   # one sequence throughout
    s = routing_stats(m, path, batch_size=16)        # streamed statistics = those of the trace
    ref = RoutingStats.from_trace(tr)
    np.testing.assert_array_equal(s.counts, ref.counts)
    np.testing.assert_array_equal(s.coactivation, ref.coactivation)
    np.testing.assert_allclose(s.persistence, ref.persistence)
    with pytest.raises(Exception, match="no such text file"):
        trace(m, tmp_path / "missing.txt")


def test_no_tokenizer(hf_checkpoint, tmp_path):
    src = hf_checkpoint("olmoe", tokenizer=False)
    with pytest.warns(ConversionWarning):
        out = convert(src, tmp_path / "bare.colibri", dtype="f32", progress=False)
    with api.load(out, threads=1, kv_dtype="f32") as m:
        with pytest.raises(NoTokenizerError, match="no tokenizer"):
            trace(m, "text")
        tr = trace(m, np.array([5, 6, 7]))
        assert tr.tokens == ["[5]", "[6]", "[7]"]


# --------------------------------------------------------------------------------------------
# the Trace object
# --------------------------------------------------------------------------------------------

def test_tokens_selection_concat_and_save(mixtral, mixtral_trace, tmp_path):
    _, m = mixtral
    tr = mixtral_trace
    assert tr.tokens == [m.tokenizer.token_text(i) for i in tr.token_ids]
    one = tr.select_layers([1])
    assert one.layers == [1] and one.experts.shape == (len(tr), 1, 2)
    np.testing.assert_array_equal(one.probs[:, 0], tr.probs[:, 1])
    with pytest.raises(UnknownLayerError, match=r"layer 5 is not a MoE layer .*0, 1"):
        tr.select_layers([5])
    part = tr[3:6]
    assert len(part) == 3 and part.tokens == tr.tokens[3:6]
    np.testing.assert_array_equal(Trace.concat([tr[:3], tr[3:]]).experts, tr.experts)
    counts = tr.expert_counts
    assert counts.shape == (2, 4) and (counts.sum(1) == 2 * len(tr)).all()
    assert counts[1, tr.experts[0, 1, 0]] >= 1
    tr.save(tmp_path / "t.npz")
    back = Trace.load(tmp_path / "t.npz")
    for name in ("experts", "weights", "logits", "probs", "token_ids", "positions"):
        np.testing.assert_array_equal(getattr(back, name), getattr(tr, name))
    assert back.tokens == tr.tokens and back.layers == tr.layers


def test_format_table_and_json(mixtral_trace):
    tr = mixtral_trace
    lines = tr.format_table().splitlines()
    assert len(lines) == len(tr)
    e, w = tr.experts[0, 0], tr.weights[0, 0]
    assert lines[0].startswith("token ")
    assert f"→ L0 [{e[0]} {w[0]:.2f}, {e[1]} {w[1]:.2f}]" in lines[0]
    assert len({line.index("→") for line in lines}) == 1          # aligned
    assert len({line.index(" L1 [") for line in lines}) == 1
    assert tr.format_table(limit=3).splitlines()[-1] == f"… {len(tr) - 3} more tokens"
    d = tr.to_dict()
    assert d["layers"] == [0, 1] and len(d["tokens"]) == len(tr)
    r = d["tokens"][2]["routes"][1]
    assert r["layer"] == 1 and r["experts"] == tr.experts[2, 1].tolist()


def test_trace_validation():
    with pytest.raises(ValueError, match="shape"):
        Trace(np.zeros((3, 2)), np.zeros((3, 2)))
    with pytest.raises(ValueError, match=r"\[0, 4\)"):
        Trace(np.full((1, 1, 2), 4), np.ones((1, 1, 2)), probs=np.full((1, 1, 4), 0.25))
    np.testing.assert_allclose(softmax(np.array([0.0, np.log(3.0)])), [0.25, 0.75], rtol=1e-6)
