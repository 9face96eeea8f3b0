"""The layers of a decode step compiled: every layer in one call without the GIL
(CompiledLayers), instead of the one layer loop (colibri.engine.layer_loop.run_layers over a
TokenStep, its specification).

That loop makes per layer about eleven calls into the compiled module
(RMSNorm rows, the fused q|k|v projection, q/k norms, RoPE, the cache write and attention,
the output projection, the residual add, RMSNorm, the router, top-k, the experts, the
shared expert, the add), each with its argument checks and the GIL taken back in between.
colibri._kernels.DecodeLayers holds every layer's weights and settings, checked once when
the model is built; DecodeBinding binds them to one cache and its RunState and runs all
layers in one nogil call, through the same C functions in the same order
(pyx/decode_layer.pxi). So its results are the loop's, bit for bit, on every weight
format, activation setting, cache dtype, thread count and ISA path (the sigmoid of
Qwen2-MoE's shared-expert gate calls NumPy's own float32 exp loop: libm's expf differs from
it in the last bit for ~40 % of arguments). DeepSeek's latent attention (MLA.decode: the q
projection or q LoRA, kv_a, the latent norms, RoPE, the absorbed attention of
kernels.prepare_mla_absorbed) and GPT-OSS's attention sinks and biased swigluoai experts
(kernels.prepare_biased_experts' one-token call) are compiled the same way, and PhiMoE's and
DBRX's LayerNorm (norms.layer_norm's operations in NumPy's summation order)
(pyx/decode_families.pxi).

The same call runs T <= DECODE_MAX_ROWS consecutive new tokens of one sequence
(CompiledLayers.run_rows, layer_loop.SequenceRows: a speculative verification): each
projection, the router and the experts one call over the T rows, each row's attention over
the cache up to its own slot (the biased experts row by row); the decode step is its
T = 1 case.

What the compiled layers do not do, the loop does (the fallback), chosen when the
model is built (`uncovered`: the reason, or None): a norm other than RMSNorm / LayerNorm,
q / k / v that are not one fused projection, an expert activation other than silu /
swigluoai, a shared-expert gate where NumPy's exp loop is not found; or per step (two cheap checks, no exception handling): a
step that records its routing (return_routing), a model whose MoE layers' expert sources
(colibri.experts.expert_source: an expert cache, remote shards, the residency telemetry) it cannot
run; it asks each source (compiled_reason) and keeps the answer (CompiledLayers.declined),
and decode_path says which path a decode step takes and why (colibri bench prints it).
"""
from __future__ import annotations

import numpy as np

from .. import _kernels
from ..kernels.weights import WeightRef
from .attention import Attention
from .checks import layer_nan_error
from .mla import LATENT_NORM_EPS, MLA
from .moe import DenseMLP, MoE
from .run_state import RunState

__all__ = ["CompiledLayers", "compile_layers", "uncovered", "decode_path"]

_STAGES = _kernels.STAGE_NAMES      # the stages of DecodeBinding.seconds (Model.timings keys)


_MLA_PROJECTIONS = ("wq", "wq_a", "wq_b", "wkv_a", "wo")


def _linear_of(p) -> tuple[WeightRef, np.ndarray | None] | None:
    """A projection's (weight, bias) when it is a linear over the file (model._Linear:
    .w a WeightRef, .b float32 or None), else None."""
    w = getattr(p, "w", None)
    return (w, getattr(p, "b", None)) if isinstance(w, WeightRef) else None


def uncovered(model) -> str | None:
    """Why the compiled step cannot run `model`'s layers, or None when it can."""
    c = model.config
    if c.norm not in ("rms_norm", "layer_norm"):
        return f"{c.norm} norms"
    kind = MLA if c.is_mla else Attention
    scales = {np.float32(layer.attn.scale) for layer in model.layers
              if isinstance(layer.attn, kind)}
    if len(scales) > 1:
        return "attention scales that differ between layers"
    for i, layer in enumerate(model.layers):
        a, f = layer.attn, layer.ffn
        if type(a) is not kind:
            return f"layer {i}: attention of type {type(a).__name__}"
        if kind is MLA:
            for name in _MLA_PROJECTIONS:
                p = getattr(a, name)
                if p is not None and _linear_of(p) is None:
                    return f"layer {i}: MLA's {name} is not a linear over the file"
        elif a.wqkv is None:
            return f"layer {i}: q, k and v are not one fused projection"
        if type(f) is MoE:
            be = f.biased_experts
            if be is not None and be.activation not in ("swigluoai", "silu"):
                return f"layer {i}: the expert activation {be.activation!r}"
            if be is not None and be.n_experts is not None:
                return f"layer {i}: biased experts over an expert cache's slots"
            if be is not None and f.top_k > _kernels.BIASED_TOP_K_MAX:
                return f"layer {i}: {f.top_k} biased experts per token"
            if f.shared_gate is not None and not _kernels.EXP_LOOP:
                return f"layer {i}: a shared-expert gate (NumPy's float32 exp loop not found)"
        elif type(f) is not DenseMLP:
            return f"layer {i}: a feed-forward of type {type(f).__name__}"
    return None


def _spec(layer) -> dict:
    """One layer's weights and settings, as DecodeLayers reads them."""
    a, f = layer.attn, layer.ffn
    spec = dict(attn_norm=layer.attn_norm, ffn_norm=layer.ffn_norm,
                attn_norm_bias=layer.attn_norm_bias, ffn_norm_bias=layer.ffn_norm_bias,
                wo=a.wo.w, wo_bias=a.wo.b, gate=f.w_gate, up=f.w_up, down=f.w_down,
                moe=isinstance(f, MoE), mla=isinstance(a, MLA))
    if isinstance(a, MLA):
        for name in _MLA_PROJECTIONS[:4]:
            w, b = _linear_of(getattr(a, name)) or (None, None)
            spec.update({name: w, name + "_bias": b})
        spec.update(q_a_norm=a.q_a_norm, kv_a_norm=a.kv_a_norm, kv_b=a.kv_b)
    else:
        spec.update(qkv=a.wqkv.w, qkv_bias=a.wqkv.b, qk_norm=a.qk_norm, q_norm=a.q_norm,
                    k_norm=a.k_norm, clip=a.clip_qkv, window=a.window or 0,
                    sinks=a._sinks32)
    if isinstance(f, MoE):
        spec.update(router=f.router, router_bias=f.router_bias, k=f.top_k, rule=f.rule,
                    norm_topk=f.norm_topk_prob, jitter=f.jitter_eps,
                    corr_bias=f.correction_bias, n_group=f.n_group, topk_group=f.topk_group,
                    rscale=float(np.float32(f.routed_scaling_factor)), shared=f.shared,
                    shared_gate=f.shared_gate, biased=f.biased_experts is not None)
        be = f.biased_experts
        if be is not None:          # its stacks, biases flattened (E*I, E*I, E*D), activation
            spec.update(gate=be.w_gate, up=be.w_up, down=be.w_down,
                        swiglu_oai=be.activation == "swigluoai", alpha=float(be.alpha),
                        limit=float(be.limit),
                        **{k: None if b is None else
                           np.ascontiguousarray(b, dtype=np.float32).reshape(-1)
                           for k, b in (("b_gate", be.b_gate), ("b_up", be.b_up),
                                        ("b_down", be.b_down))})
    return spec


class CompiledLayers:
    """A model's layers for the compiled decode step (see the module docstring).

    run(state, cache, cos, sin, timings) runs every layer on the token in state.h (1, D),
    its key and value going to slot cache.length, as Model._step's loop does; False (nothing
    done) when this step must take the Python loop: an MoE layer's expert source the
    compiled step cannot run (only the mapping's kernel call, which it calls itself), the
    reason then in `declined` (None after a compiled step). run_rows: the same for T
    consecutive tokens (layer_loop.SequenceRows, a speculative verification).
    """
    declined: str | None = None

    def __init__(self, model):
        c = model.config
        self._moes = [layer.ffn for layer in model.layers if isinstance(layer.ffn, MoE)]
        rm = model.residual_mult
        a0, mla = model.layers[0].attn, None
        if c.is_mla:                # its geometry; q_rank 0: a plain q projection
            mla = (a0.nope_dim, a0.rope_dim, a0.v_dim, a0.kv_rank,
                   0 if a0.wq is not None else a0.wq_a.w.rows,
                   float(np.float32(LATENT_NORM_EPS)))
        scale = a0._scale if c.is_mla else a0._scale32
        self.layers = _kernels.DecodeLayers(
            [_spec(layer) for layer in model.layers], c.hidden_size, c.num_attention_heads,
            c.num_key_value_heads, c.head_dim, len(model.rope.cos_sin_one(0)[0]),
            float(np.float32(c.rms_norm_eps)), float(scale),
            None if rm is None else float(rm), model.threads, model.activations, mla,
            c.norm == "layer_norm")

    def _binding(self, state: RunState, cache) -> _kernels.DecodeBinding:
        """The cache's binding to these layers and its RunState (made on first use)."""
        b = cache.decode_binding
        if b is None or b.layers is not self.layers or b.state is not state:
            b = cache.decode_binding = _kernels.DecodeBinding(
                self.layers, state, cache.k, cache.v)
        return b

    def sources_reason(self) -> str | None:
        """Why the compiled step cannot run the MoE layers' expert sources as they are now
        (the first one's reason it cannot), or None when it can."""
        for moe in self._moes:
            why = moe.expert_source.compiled_reason
            if why is not None:
                return why
        return None

    def takes(self) -> bool:
        """Whether the compiled layers can run the expert sources as they are now; the
        reason they cannot kept in `declined` (None when they can)."""
        self.declined = self.sources_reason()
        return self.declined is None

    def run(self, state: RunState, cache, cos: np.ndarray, sin: np.ndarray, timings) -> bool:
        if not self.takes():
            return False
        b = self._binding(state, cache)
        bad = b.step(cache.k, cache.v, cache.length, cos, sin)
        seconds = timings.seconds
        for name, s in zip(_STAGES, b.seconds.tolist()):
            seconds[name] += s
        if bad >= 0:
            raise layer_nan_error(bad, state.xa, state.o, state.xf)
        return True


    @property
    def moe_layers(self) -> int:
        """How many of the layers are MoE layers (the first axis of run_rows' routing)."""
        return len(self._moes)

    def run_rows(self, state: RunState, cache, h: np.ndarray, cos: np.ndarray,
                 sin: np.ndarray, timings, routing: np.ndarray | None = None) -> bool:
        """Every layer on T consecutive new tokens of the cache's sequence: h float32 (T, D)
        their embeddings (updated in place to the last layer's residual stream), keys and
        values to slots cache.length.. cache.length + T - 1, cos / sin (T, Dr/2); each row
        attends causally; routing, when given, int32 (moe_layers, T, K) receives each MoE
        layer's experts of each row. As run, False (nothing done) when the expert sources
        decline."""
        if not self.takes():
            return False
        b = self._binding(state, cache)
        bad = b.rows(cache.k, cache.v, cache.length, cos, sin, h, routing)
        seconds = timings.seconds
        for name, s in zip(_STAGES, b.seconds.tolist()):
            seconds[name] += s
        if bad >= 0:
            raise layer_nan_error(bad, *b.nan_rows)
        return True


def decode_path(model) -> str:
    """Which layers a decode step of `model` runs now, and why not the compiled ones:
    "compiled layers" or "Python layers (<reason>)" (a step recording its routing always
    takes the Python layers)."""
    fast = getattr(model, "compiled_step", None)
    why = uncovered(model) if fast is None else fast.sources_reason()
    if fast is None and why is None:
        why = "the compiled step is off: model.compiled_step is None"
    return "compiled layers" if why is None else f"Python layers ({why})"


def compile_layers(model) -> CompiledLayers | None:
    """The compiled layers of `model`, or None when it has layers they do not cover."""
    if uncovered(model) is not None or not model.layers:
        return None
    return CompiledLayers(model)
