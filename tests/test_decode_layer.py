"""The compiled decode step (colibri.engine.decode_layer: every layer of one token in one call)
against the Python step it replaces (layer_loop.run_layers over a TokenStep, its
specification).

The compiled layers run the same C functions in the same order as the Python step, so a
decode through them gives the same bits: logits and every cache plane, step after step
(past a sliding window), for each family whose layers they cover (GQA attention with plain,
biased, per-head or full q/k norms, clip_qkv, partial RoPE, sliding windows, attention
sinks; DeepSeek's latent attention with and without a q LoRA; routed experts under the
softmax, top-k-softmax, softmax-group and sigmoid-group rules, plain or biased swigluoai
experts (GPT-OSS, q8 / q4 / bf16 / f32 and MXFP4 as released), shared experts gated or not,
dense layers; Granite's multipliers; PhiMoE's and DBRX's LayerNorm), every weight format,
activation setting, KV cache dtype, thread count and ISA path. What they do not cover takes
the Python step: chosen when the model is built (uncovered: e.g. unfused q / k / v) or per
step (routing traces, an expert source the compiled step cannot run, colibri.experts.expert_source).
"""
from __future__ import annotations

import os
import subprocess
import sys
import threading

import numpy as np
import pytest

transformers = pytest.importorskip("transformers")

import colibri.api as api  # noqa: E402
from colibri import _kernels
from colibri.kernels import runtime  # noqa: E402
from colibri.convert import convert  # noqa: E402
from colibri.engine.decode_layer import compile_layers, decode_path, uncovered  # noqa: E402
from colibri.experts.expert_source import ExpertSource, without  # noqa: E402
from colibri.errors import NonFiniteError  # noqa: E402
from colibri.engine.norms import layer_norm  # noqa: E402
from family_parity import make_checkpoint  # noqa: E402
from hf_factory import tiny_config  # noqa: E402
from kernel_helpers import on_each_model_forced  # noqa: E402
from step_counter import python_steps  # noqa: E402
from test_family_gpt_oss import _mxfp4_checkpoint  # noqa: E402

_SMALL = dict(vocab_size=320, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, max_position_embeddings=256, bos_token_id=1,
              eos_token_id=2, pad_token_id=0, initializer_range=0.15)

# family case -> a transformers config; each exercises the quirks named
CONFIGS = {
    "mixtral": lambda: tiny_config("mixtral", initializer_range=0.15),
    # sliding window 4 on every layer: the steps below go past it
    "mixtral-window": lambda: tiny_config("mixtral", initializer_range=0.15, sliding_window=4),
    # a gated shared expert (NumPy's exp loop), a dense layer, a window on layer 0 only
    "qwen2_moe": lambda: tiny_config("qwen2_moe", initializer_range=0.15,
                                     use_sliding_window=True, sliding_window=4,
                                     max_window_layers=1),
    # per-head q/k norms, head_dim unlike hidden / heads, renormalised top-k
    "qwen3_moe": lambda: tiny_config("qwen3_moe", initializer_range=0.15),
    # full q/k norms and clip_qkv (0.5: reached by most of q, k, v)
    "olmoe": lambda: tiny_config("olmoe", initializer_range=0.15, clip_qkv=0.5),
    # partial RoPE, q/k/v biases, per-head norms, sigmoid group routing with a correction
    # bias and a scaling factor, an ungated shared expert, a dense first layer
    "glm4_moe": lambda: tiny_config("glm4_moe", initializer_range=0.15),
    # the muP multipliers (embedding, attention, residual, logits), q/k/v/o biases
    "granitemoe": lambda: transformers.GraniteMoeConfig(
        **_SMALL, intermediate_size=32, num_local_experts=4, num_experts_per_tok=2,
        tie_word_embeddings=False, embedding_multiplier=3.0, attention_multiplier=0.1,
        residual_multiplier=0.5, logits_scaling=2.5, attention_bias=True),
    # attention sinks, sliding (window 4) and full layers alternating, q/k/v/o biases, the
    # router bias, top-k then softmax, biased swigluoai experts (a limit they reach), YaRN
    "gpt_oss": lambda: transformers.GptOssConfig(
        **dict(_SMALL, num_hidden_layers=3), head_dim=16, intermediate_size=32,
        num_local_experts=4, num_experts_per_tok=2, sliding_window=4, swiglu_limit=1.0),
    # MLA with a q LoRA, a dense first layer, 2 ungated shared experts, group-limited
    # softmax routing with a scaling factor
    "deepseek_v2": lambda: tiny_config("deepseek_v2", initializer_range=0.15),
    # MLA with a plain q projection, sigmoid group routing with the correction bias,
    # renormalised, a shared expert
    "deepseek_v3": lambda: tiny_config("deepseek_v3", initializer_range=0.15),
    # LayerNorm without biases, clip_qkv, the fused Wqkv
    "dbrx": lambda: transformers.DbrxConfig(
        d_model=64, n_heads=4, n_layers=2, max_seq_len=256, vocab_size=320,
        attn_config=dict(kv_n_heads=2, clip_qkv=0.5, rope_theta=5e5),
        ffn_config=dict(ffn_hidden_size=32, moe_num_experts=4, moe_top_k=2),
        initializer_range=0.15, bos_token_id=1, eos_token_id=2, pad_token_id=0),
    # LayerNorm with biases, q/k/v/o biases, sparsemixer routing
    "phimoe": lambda: transformers.PhimoeConfig(
        **_SMALL, intermediate_size=32, num_local_experts=4, num_experts_per_tok=2),
}
FORMATS = {"f32": dict(dtype="f32"), "bf16": dict(dtype="bf16"),
           "q8": dict(dtype="f32", quant="q8", quantize="experts,shared,attn,head,dense"),
           "q4": dict(dtype="f32", quant="q4", quantize="experts,shared,attn,head,dense")}
PROMPT, STEPS = 3, 9          # 12 tokens: past the window of 4 by far


@pytest.fixture(scope="module")
def converted(tmp_path_factory):
    """converted(case, fmt) -> the path of that case's file in that format (made once);
    fmt "mxfp4" (gpt_oss): the experts as the released checkpoints store them."""
    made: dict = {}

    def get(case: str, fmt: str):
        if (case, fmt) not in made:
            d = tmp_path_factory.mktemp(f"declayer-{case}")
            hf = made.get(case) or make_checkpoint(d / "hf", CONFIGS[case]())
            made[case] = hf
            made[case, fmt] = d / f"{fmt}.colibri"
            if fmt == "mxfp4":
                folders, _ = _mxfp4_checkpoint(type("Ref", (), {"path": hf}), d / "mx")
                convert(folders["mxfp4"], made[case, fmt], progress=False, dtype="f32")
            else:
                convert(hf, made[case, fmt], progress=False, **FORMATS[fmt])
        return made[case, fmt]

    return get


def _lockstep(m, steps: int = STEPS, prompt: int = PROMPT, seed: int = 0):
    """Decode the same tokens through two caches, one step on the compiled layers and one on
    the Python ones; assert logits and caches equal bit for bit at every step."""
    assert m.compiled_step is not None, uncovered(m)
    tokens = np.random.default_rng(seed).integers(3, m.vocab_size, size=prompt + steps)
    fast, slow = m.new_cache(ctx=prompt + steps), m.new_cache(ctx=prompt + steps)
    for c in (fast, slow):
        api.forward(m, tokens[:prompt], cache=c)
    compiled = m.compiled_step
    for t in tokens[prompt:]:
        a = api.forward(m, np.array([t]), cache=fast)
        m.compiled_step = None
        try:
            b = api.forward(m, np.array([t]), cache=slow)
        finally:
            m.compiled_step = compiled
        np.testing.assert_array_equal(a.view(np.uint32), b.view(np.uint32))
    for x, y in zip(fast.k + fast.v, slow.k + slow.v):
        np.testing.assert_array_equal(x, y)
    assert fast.length == slow.length == prompt + steps


CASES = [(case, fmt) for case in CONFIGS for fmt in FORMATS] + [("gpt_oss", "mxfp4")]


@pytest.mark.parametrize("case,fmt", CASES)
def test_compiled_step_is_the_python_step(converted, case, fmt):
    """Every activation setting, cache dtype and thread count: the same bits."""
    path = converted(case, fmt)
    for activations in ("f32", "int16", "int8"):
        for kv in ("f16", "bf16", "f32"):
            for threads in (1, 2):
                m = api.load(path, threads=threads, activations=activations, kv_dtype=kv)
                try:
                    _lockstep(m, steps=5 if threads == 2 else STEPS)
                finally:
                    m.close()


# the ISA runs: the cases with most of the arithmetic a path changes (q4 / q8 / MXFP4 rows
# on every activation setting, shared-expert gates, MLA's transposed product, sinks)
ISA_CASES = [(c, f) for c in ("qwen2_moe", "olmoe", "glm4_moe", "deepseek_v2", "deepseek_v3",
                              "gpt_oss") for f in ("q4", "q8")] + [("gpt_oss", "mxfp4"),
                                                                   ("phimoe", "q4")]


@pytest.mark.parametrize("isa", runtime.available_isas())
def test_each_isa_path(converted, isa):
    """Each ISA path forced (as COLIBRI_ISA does), the compiled layers reloading their row
    kernels when the path changes under them."""
    on_each_model_forced(converted, isa, ISA_CASES, lambda m: _lockstep(m, steps=5))


def test_a_knob_change_regrows_the_scratch(converted):
    """gemm_min_tokens 1 puts one token on the GEMM path (more scratch): still the same bits
    as the Python step, on the same binding."""
    m = api.load(converted("qwen2_moe", "q4"), threads=2, activations="f32")
    before = runtime.gemm_min_tokens()
    try:
        _lockstep(m, steps=3)
        runtime.set_gemm_min_tokens(1)
        _lockstep(m, steps=3)
    finally:
        runtime.set_gemm_min_tokens(before)
        m.close()


def test_a_copied_or_rewound_cache(converted):
    """A cache truncated and decoded again, and a copy of it (new planes, a new binding),
    decode as the Python step does."""
    m = api.load(converted("mixtral-window", "q4"), threads=1)
    try:
        tokens = np.random.default_rng(3).integers(3, m.vocab_size, size=10)
        c = m.new_cache(ctx=16)
        api.forward(m, tokens[:4], cache=c)
        for t in tokens[4:]:
            api.forward(m, np.array([t]), cache=c)
        c.truncate(5)
        twin = c.copy()
        compiled = m.compiled_step
        for t in tokens[5:]:
            a = api.forward(m, np.array([t]), cache=c)
            b = api.forward(m, np.array([t]), cache=twin)
            np.testing.assert_array_equal(a, b)
        assert c.decode_binding is not twin.decode_binding
        m.compiled_step = None
        c.truncate(5)
        want = [api.forward(m, np.array([t]), cache=c) for t in tokens[5:]]
        m.compiled_step = compiled
        c.truncate(5)
        got = [api.forward(m, np.array([t]), cache=c) for t in tokens[5:]]
        np.testing.assert_array_equal(np.stack(got), np.stack(want))
    finally:
        m.close()


@pytest.mark.parametrize("case", ["qwen2_moe", "deepseek_v2", "gpt_oss"])
def test_two_caches_decoding_at_once(converted, case):
    """Two Python threads, each decoding its own cache through the compiled layers (the GIL
    released for the whole step, each binding with its own scratch, MLA's vectors too): the
    bits of decoding them one after the other."""
    m = api.load(converted(case, "q4"), threads=2)
    try:
        rng = np.random.default_rng(5)
        prompts = [rng.integers(3, m.vocab_size, size=12) for _ in range(2)]

        def decode(tokens, out):
            c = m.new_cache(ctx=len(tokens))
            api.forward(m, tokens[:2], cache=c)
            for t in tokens[2:]:
                out.append(api.forward(m, np.array([t]), cache=c))

        want = [[], []]
        for tokens, out in zip(prompts, want):
            decode(tokens, out)
        got = [[], []]
        workers = [threading.Thread(target=decode, args=(tokens, out))
                   for tokens, out in zip(prompts, got)]
        for w in workers:
            w.start()
        for w in workers:
            w.join()
        for a, b in zip(got, want):
            np.testing.assert_array_equal(np.stack(a), np.stack(b))
    finally:
        m.close()


# ---------------------------------------------------------------------------------------------
# what takes the Python step
# ---------------------------------------------------------------------------------------------

_python_steps = python_steps


def test_routing_traces_and_expert_sources_take_the_python_step(converted, monkeypatch):
    m = api.load(converted("qwen2_moe", "q4"), threads=1)
    try:
        taken = _python_steps(m, monkeypatch)
        c = m.new_cache(ctx=8)
        api.forward(m, np.array([5, 6]), cache=c)
        api.forward(m, np.array([7]), cache=c)
        assert taken == []                              # the compiled layers
        logits, trace = api.forward(m, np.array([8]), cache=c, return_routing=True)
        assert taken == [1] and trace.ids[0].shape == (1, 2)
        assert m.compiled_step.declined is None and decode_path(m) == "compiled layers"
        moe = next(layer.ffn for layer in m.layers if layer.ffn.__class__.__name__ == "MoE")
        seen = []

        class Seen(ExpertSource):             # a source the compiled step does not know
            inner = moe.expert_source

            def __call__(self, x, ids, weights, y):
                seen.append(ids.copy())
                self.inner(x, ids, weights, y)

        watcher = moe.expert_source = Seen()
        api.forward(m, np.array([9]), cache=c)
        assert taken == [1, 1] and len(seen) == 1
        why = "an expert source the compiled step does not know"
        assert m.compiled_step.declined == why and decode_path(m) == f"Python layers ({why})"
        moe.expert_source = without(moe.expert_source, watcher)
        api.forward(m, np.array([10]), cache=c)
        assert taken == [1, 1] and m.compiled_step.declined is None
    finally:
        m.close()


@pytest.mark.parametrize("case", ["qwen2_moe", "deepseek_v2"])
def test_stage_timings_are_kept(converted, case):
    m = api.load(converted(case, "q4"), threads=1)
    try:
        c = m.new_cache(ctx=8)
        api.forward(m, np.array([5, 6]), cache=c)
        m.timings.reset()
        api.forward(m, np.array([7]), cache=c)
        s = m.timings.seconds
        assert all(s[k] > 0 for k in ("attention", "router", "experts", "shared", "dense",
                                      "head"))
    finally:
        m.close()


def test_uncovered_names_the_layer_and_the_reason(converted):
    """What the compiled step leaves to the Python one, per layer: biased experts over an
    expert cache's slots, more experts per token than the call takes, another activation;
    an MLA projection that is not a linear over the file."""
    m = api.load(converted("gpt_oss", "q4"), threads=1)
    try:
        assert uncovered(m) is None
        moe = m.layers[1].ffn
        be = moe.biased_experts
        for field, value, reason in (
                ("n_experts", 4, "layer 1: biased experts over an expert cache's slots"),
                ("activation", "gelu", "layer 1: the expert activation 'gelu'")):
            before = getattr(be, field)
            setattr(be, field, value)
            try:
                assert uncovered(m) == reason
            finally:
                setattr(be, field, before)
        k = moe.top_k
        moe.top_k = _kernels.BIASED_TOP_K_MAX + 1
        try:
            assert uncovered(m) == f"layer 1: {moe.top_k} biased experts per token"
        finally:
            moe.top_k = k
    finally:
        m.close()
    m = api.load(converted("deepseek_v3", "q4"), threads=1)
    try:
        assert uncovered(m) is None
        attn = m.layers[2].attn
        wkv_a = attn.wkv_a
        attn.wkv_a = lambda x, out=None: wkv_a(x, out)
        assert uncovered(m) == "layer 2: MLA's wkv_a is not a linear over the file"
    finally:
        m.close()


def test_a_model_the_compiled_step_does_not_cover_takes_the_python_step(converted,
                                                                         monkeypatch):
    """q, k and v not one fused projection: uncovered says so for that layer, the model gets
    no compiled layers, and its decode steps take the Python loop."""
    m = api.load(converted("mixtral", "q4"), threads=1)
    try:
        m.layers[1].attn.wqkv = None
        assert uncovered(m) == "layer 1: q, k and v are not one fused projection"
        m.compiled_step = compile_layers(m)
        assert m.compiled_step is None
        taken = _python_steps(m, monkeypatch)
        c = m.new_cache(ctx=8)
        api.forward(m, np.array([5, 6]), cache=c)
        api.forward(m, np.array([7]), cache=c)
        assert taken == [1]
    finally:
        m.close()


@pytest.mark.parametrize("n", [1, 5, 8, 13, 64, 127, 128, 129, 300, 1000, 2880, 4096, 6144])
def test_layer_norm_rows_are_numpys(n):
    """The compiled step's LayerNorm (PhiMoE, DBRX): norms.layer_norm's bits, with and
    without a bias, over row lengths on each side of NumPy's pairwise blocks."""
    rng = np.random.default_rng(n)
    x = (rng.standard_normal((3, n)) * np.float32([[1.0], [40.0], [1e-3]]) + 0.5
         ).astype(np.float32)
    w = rng.standard_normal(n).astype(np.float32)
    b = rng.standard_normal(n).astype(np.float32)
    for bias in (None, b):
        want = layer_norm(x, w, bias, np.float32(1e-5))
        got = np.empty_like(x)
        _kernels.layer_norm_rows(x, w, bias, np.float32(1e-5), got)
        np.testing.assert_array_equal(got.view(np.uint32), want.view(np.uint32))


def test_nan_router_logits_name_the_layer_as_the_python_step(converted):
    """NaN in a router's weights: the same NonFiniteError from both paths."""
    m = api.load(converted("mixtral", "f32"), threads=1, mmap=False)
    try:
        router = m.layers[1].ffn.router
        assert m.buffer.flags.writeable and router.dtype == "f32"
        m.buffer[router.offset:router.offset + 4] = np.frombuffer(
            np.float32(np.nan).tobytes(), np.uint8)
        messages = []
        for compiled in (m.compiled_step, None):
            m.compiled_step = compiled
            c = m.new_cache(ctx=8)
            with pytest.raises(NonFiniteError) as e:
                api.forward(m, np.array([7]), cache=c)
            messages.append(str(e.value))
        assert messages[0] == messages[1] and "layer 1's router" in messages[0]
    finally:
        m.close()


def test_gate_sigmoid_is_numpys():
    """The shared-expert gate: NumPy's float32 expression, the same bits (its exp loop)."""
    assert _kernels.EXP_LOOP
    rng = np.random.default_rng(0)
    z = np.concatenate([rng.standard_normal(4000).astype(np.float32) * 6,
                        np.float32([0.0, -0.0, 30.0, -30.0, 88.5, -88.5, 104.0, -104.0])])
    with np.errstate(over="ignore"):
        want = (np.float32(1.0) / (np.float32(1.0) + np.exp(-z))).astype(np.float32)
    got = np.array([_kernels.gate_sigmoid(float(v)) for v in z], dtype=np.float32)
    np.testing.assert_array_equal(got.view(np.uint32), want.view(np.uint32))


_ENV_CHECK = """
import sys, numpy as np, colibri.api as api
from colibri.kernels import runtime
assert runtime.get_isa() == sys.argv[1], runtime.get_isa()
for path in sys.argv[2:]:
    m = api.load(path, threads=2, activations="int16")
    assert m.compiled_step is not None
    tokens = np.arange(3, 15)
    fast, slow = m.new_cache(ctx=12), m.new_cache(ctx=12)
    for c in (fast, slow):
        api.forward(m, tokens[:3], cache=c)
    compiled = m.compiled_step
    for t in tokens[3:]:
        a = api.forward(m, np.array([t]), cache=fast)
        m.compiled_step = None
        b = api.forward(m, np.array([t]), cache=slow)
        m.compiled_step = compiled
        assert np.array_equal(a, b), path
print("same")
"""


@pytest.mark.parametrize("isa", runtime.available_isas())
def test_colibri_isa_forced_in_the_environment(converted, isa):
    """COLIBRI_ISA set before the import: the compiled layers on that path, the same bits."""
    files = [str(converted(*c)) for c in (("olmoe", "q4"), ("deepseek_v2", "q4"),
                                          ("gpt_oss", "mxfp4"))]
    res = subprocess.run([sys.executable, "-c", _ENV_CHECK, isa, *files],
                         env={**os.environ, "COLIBRI_ISA": isa}, capture_output=True,
                         text=True, timeout=120)
    assert res.returncode == 0 and res.stdout.strip() == "same", res.stderr
