"""Model: the weights of a .colibri file as views over its mapping, and the forward pass.

Nothing is copied at load time: dense matrices and expert stacks become WeightRefs (byte
offsets into the mapping) that the kernels read in place, whatever their format (f32, f16,
bf16, q8, q4); norm weights and biases are small float32 views. Every dimension and rule
comes from the typed config (Model.config, a colibri.config.ModelConfig). The forward pass
is written once, in colibri.engine.layer_loop:

    embed -> per layer [RMSNorm -> attention -> + -> RMSNorm -> MoE or dense MLP -> +]
          -> RMSNorm -> head -> float32 logits

over rows of the residual stream; what the rows are is one of three descriptions:
  - PaddedBatch (Model._general): any B and S, padding, masks, with or without a cache;
    NumPy attention over the whole batch (colibri.engine.attention);
  - TokenStep (Model._step): one new token of one sequence through a cache without
    padding, what every generation step is; every vector in the cache's RunState, and all
    layers in one compiled call where colibri.engine.decode_layer covers them (the loop is its
    specification). A plain call (token ids, no mask) gets there directly (decode_call),
    without the general input checks; any other such step (input_embeds, a mask of ones,
    explicit positions) after the checks;
  - RaggedBatch (Model.forward_ragged, colibri.engine.ragged): several sequences of different
    lengths, each through its own cache, attention per sequence; what continuous batching
    runs.
q, k and v, adjacent in the file, are one kernel call (one WeightRef over the three matrices).
Shapes as in the package docstring.
"""
from __future__ import annotations

import os
import time
from contextlib import ExitStack, nullcontext
from dataclasses import dataclass

import numpy as np

from .. import kernels
from ..experts.expert_cache import (DEFAULT_POLICY, check_memory_budget, hold_weights, memory_plan,
                                    weights_buffer)
from ..experts.expert_shards import shard_experts
from ..format import ColibriFile, QuantizedTensor, quant, router_name
from ..format.tokenizer import tokenizer_from_files
from ..format.validation import check_loadable
from ..kernels.biased_experts import BiasedExperts
from ..kernels.runtime import MAX_THREADS, Timings, blas_on_one_thread, default_threads
from ..kernels.weights import WeightRef, expert_ref, fused_ref, vector, weight_ref
from .attention import Attention
from .checks import check_inputs, warn_past_context
from .decode_layer import compile_layers
from .kv_cache import DEFAULT_KV_DTYPE, DEFAULT_MAX_CTX, KVCache, kv_dtype_name
from .layer_loop import PaddedBatch, TokenStep, forward_pass, is_token_step, tracer
from .mla import MLA, softmax_scale
from .moe import DenseMLP, MoE
from .norms import layer_norm
from .prefix_cache import PrefixCache
from .ragged import forward_ragged, forward_rows
from .rope import Rope
from .routing import RoutingTrace, drop_batch
from .run_state import RunState

__all__ = ["Model", "DEFAULT_ACTIVATIONS"]

# What q4/q8/mxfp4 matrices are multiplied with unless told (colibri.load documents the settings):
# 16-bit activation codes (W4A16), within ~1e-4 of the exact "f32" at about twice its decode
# speed; "int8" is the fastest. Plain-format matrices and routers always see f32.
DEFAULT_ACTIVATIONS = "int16"


# ---------------------------------------------------------------------------------------------
# the model
# ---------------------------------------------------------------------------------------------

_norm_rows = kernels.rms_norm_rows_into        # (x (N, C), weight (C,), eps, out (N, C))


@dataclass
class _Layer:
    attn_norm: np.ndarray
    attn: Attention | MLA
    ffn_norm: np.ndarray
    ffn: MoE | DenseMLP
    attn_norm_bias: np.ndarray | None = None       # LayerNorm biases (config.norm_bias)
    ffn_norm_bias: np.ndarray | None = None


class _Linear:
    """x (N, C) -> x @ W^T (+ b) through kernels.linear; a projection for Attention.

    out: float32 (N, R) to write into (the decode step passes its buffers, 2-D and
    contiguous as x: then the call is the prepared one, the weight checked at load)."""

    __slots__ = ("w", "b", "threads", "activations", "prepared")

    def __init__(self, w: WeightRef, b: np.ndarray | None, threads: int, activations: str):
        self.w, self.b, self.threads, self.activations = w, b, threads, activations
        self.prepared = kernels.prepare_linear(w, b, threads=threads, activations=activations)

    def __call__(self, x: np.ndarray, out: np.ndarray | None = None) -> np.ndarray:
        if out is None:
            return kernels.linear(x, self.w, self.b, threads=self.threads,
                                  activations=self.activations)
        self.prepared(x, out)
        return out


def _fused_linear(projs: tuple[_Linear, ...], threads: int) -> _Linear | None:
    """q, k, v projections as one _Linear when their matrices are adjacent in the file (the
    converter writes them so) and all or none have a bias: one kernel call instead of three,
    the same values (each output row is one row-kernel call, whatever the matrix around it)."""
    ref = fused_ref([p.w for p in projs])
    biases = [p.b for p in projs]
    if ref is None or (any(b is None for b in biases) and any(b is not None for b in biases)):
        return None
    bias = None if biases[0] is None else np.concatenate(biases).astype(np.float32, copy=False)
    return _Linear(ref, bias, threads, projs[0].activations)


class Model:
    """A loaded .colibri model. `Model(path_or_file, threads=None, activations="int16")`; see
    colibri.load (activations: "int16" the default, "f32" exact, "int8" the fastest; they
    apply to q4/q8/mxfp4 matrices only; kv_dtype: the storage of the caches new_cache makes;
    prefix_cache: bytes of prompt prefixes' KV that generate keeps, model.prefix_cache).

    config: the typed geometry (ModelConfig); vocab_size, hidden_size, n_layers, n_heads,
    n_kv_heads, head_dim, eps, moe_layers are shorthands of its fields.

    model.generate(prompt_or_ids, ...) is colibri.generate(model, ...): colibri/api.py
    attaches it, since generation/ runs over the engine and the engine does not import it.
    """

    def __init__(self, file: str | os.PathLike | ColibriFile, threads: int | None = None,
                 activations: str = DEFAULT_ACTIVATIONS, *, memory_budget: int | None = None,
                 mlock: bool = False, mmap: bool = True, cache_policy: str = DEFAULT_POLICY,
                 cache_mode: str = "arena", prefetch: str | None = None,
                 kv_dtype: str = DEFAULT_KV_DTYPE, prefix_cache: int | None = None,
                 expert_shards: int = 0, ray_address: str | None = None,
                 shard_threads: int | None = None, shard_counts: np.ndarray | None = None):
        self.kv_dtype = kv_dtype_name(kv_dtype)
        if threads is not None and (isinstance(threads, bool) or not isinstance(
                threads, (int, np.integer)) or not 1 <= threads <= MAX_THREADS):
            raise ValueError(f"threads must be an integer in 1..{MAX_THREADS}, got {threads!r}")
        if activations not in kernels.ACTIVATIONS:
            raise ValueError(f"activations must be one of {', '.join(kernels.ACTIVATIONS)}, "
                             f"got {activations!r}")
        if not isinstance(file, (str, os.PathLike, ColibriFile)):
            raise TypeError(f"the model must be a path (str or os.PathLike) or a ColibriFile, "
                            f"got {type(file).__name__}")
        check_memory_budget(memory_budget)
        self.activations = activations
        self.file = file if isinstance(file, ColibriFile) else ColibriFile(file)
        self.file.check_unchanged()      # an already-open file rewritten in place: refuse
        self.threads = int(threads) if threads is not None else default_threads()
        # typed geometry (colibri.config.ModelConfig), refused when it contradicts the tensors
        c = self.config = check_loadable(self.file)
        self.hf_config = self.file.config         # the checkpoint's config.json, as converted
        self.vocab_size = c.vocab_size                                       # V
        self.hidden_size = c.hidden_size                                     # D
        self.n_layers = c.num_hidden_layers
        self.n_heads = c.num_attention_heads                                 # H
        self.n_kv_heads = c.num_key_value_heads                              # Hkv
        self.head_dim = c.head_dim                                           # Dh
        self.eps = c.rms_norm_eps
        self.eps32 = np.float32(c.rms_norm_eps)        # what the compiled norms take
        self.moe_layers = list(c.moe_layer_ids)
        self.timings = Timings()
        self.identity = self.file.identity        # what a KVCache is tagged with (checks)
        self.last_stats = None          # GenerationStats of the last generate() call
        self.warned_past_context = False     # checks.warn_past_context warns once per model
        self._tokenizer = None
        self._tokenizer_loaded = False
        # a memory budget (colibri.experts.expert_cache; with expert_shards, each shard's), checked
        # first
        self._plan = (None if memory_budget is None or expert_shards
                      else memory_plan(self.file, memory_budget))
        self._mapped = bool(mmap)
        self.memory_locked = False
        self._build()
        # KV of prompt prefixes that generate reuses across calls (colibri.engine.prefix_cache)
        self.prefix_cache = PrefixCache.for_model(self, prefix_cache)
        self.expert_cache = hold_weights(self, self._plan, mlock=mlock, mapped=self._mapped,
                                         policy=cache_policy, mode=cache_mode,
                                         prefetch=prefetch)
        # the experts on Ray actors (colibri.experts.expert_shards), the dense part here
        self.expert_shards = (shard_experts(self, expert_shards, ray_address=ray_address,
                                            threads=shard_threads, counts=shard_counts,
                                            memory_budget=memory_budget)
                              if expert_shards else None)

    # -- construction -----------------------------------------------------------------------
    def _build(self) -> None:
        f, c, t = self.file, self.config, self.threads
        self.buffer = weights_buffer(f, self._plan, self._mapped)  # the mapping (or a copy), 1-D
        self.rope = Rope.from_config(c)
        self.cache_dims = self._cache_geometry()       # (layers, kv heads, Dh, Dv)
        self._state_key = (c.hidden_size, c.num_attention_heads, c.num_key_value_heads,
                           c.head_dim, c.rms_norm_eps)       # the geometry of a RunState
        self.embedding = f.tensor("tok_embeddings")                                  # (V, D)
        head = "tok_embeddings" if c.tie_word_embeddings or "lm_head" not in f else "lm_head"
        self.head = weight_ref(f, self.buffer, head)                                   # (V, D)
        self.head_bias = vector(f, "lm_head_bias") if c.lm_head_bias else None       # (V,)
        self._head = kernels.prepare_linear(self.head, self.head_bias, threads=t,
                                            activations=self.activations)
        self.final_norm = vector(f, "norm")
        self.final_norm_bias = vector(f, "norm_bias") if c.norm_bias else None
        # the rules some families add (each None / False when the model does not use it)
        self._layer_norm = c.norm == "layer_norm"
        f32 = np.float32
        self.embedding_mult = (f32(c.embedding_multiplier) if c.embedding_multiplier != 1
                                else None)
        self.residual_mult = f32(c.residual_multiplier) if c.residual_multiplier != 1 else None
        self._logits_div = f32(c.logits_scaling) if c.logits_scaling != 1 else None
        self.layers = [self._layer(i) for i in range(c.num_hidden_layers)]
        self.compiled_step = compile_layers(self)    # the decode step's layers in one call, or None

    def _cache_geometry(self) -> tuple[int, int, int, int]:
        """(layers, kv heads, key width, value width) of this model's KV cache; MLA caches
        one latent (Rkv) and one rotary key (Dr) per token and layer."""
        c = self.config
        if c.is_mla:
            return c.num_hidden_layers, 1, c.kv_lora_rank, c.head_dim
        return c.num_hidden_layers, c.num_key_value_heads, c.head_dim, c.head_dim

    def _mla(self, i: int, proj) -> MLA:
        """Layer i's latent attention (colibri/engine/mla.py); proj(name) -> _Linear."""
        f, c, p = self.file, self.config, f"layers.{i}."
        lora = c.q_lora_rank > 0
        return MLA(
            wq=None if lora else proj("attn.wq", "attn.bq"),
            wq_a=proj("attn.wq_a", "attn.bq_a") if lora else None,
            q_a_norm=vector(f, p + "attn.q_a_norm") if lora else None,
            wq_b=proj("attn.wq_b", "attn.bq_b") if lora else None,
            wkv_a=proj("attn.wkv_a", "attn.bkv_a"), kv_a_norm=vector(f, p + "attn.kv_a_norm"),
            wkv_b=proj("attn.wkv_b", "attn.bkv_b"), wo=proj("attn.wo", "attn.bo"),
            kv_b=weight_ref(f, self.buffer, p + "attn.wkv_b"), n_heads=c.num_attention_heads,
            nope_dim=c.qk_nope_head_dim, rope_dim=c.head_dim, v_dim=c.v_head_dim,
            kv_rank=c.kv_lora_rank, scale=softmax_scale(c), threads=self.threads)

    def _layer(self, i: int) -> _Layer:
        """Layer i's weights (views and WeightRefs into the mapping) and settings."""
        f, c, buf, t, act = self.file, self.config, self.buffer, self.threads, self.activations
        p = f"layers.{i}."

        def proj(name: str, bias: str) -> _Linear:
            b = vector(f, p + bias) if (p + bias) in f else None
            return _Linear(weight_ref(f, buf, p + name), b, t, act)

        if c.is_mla:
            attn = self._mla(i, proj)
        else:
            attn = self._attention(i, proj)
        mlp = ("w_gate", "w_up", "w_down")
        if c.is_moe_layer(i):
            shared = gate = None
            if c.has_shared_expert:
                shared = tuple(weight_ref(f, buf, f"{p}moe.shared.{n}") for n in mlp)
                if c.shared_expert_gate:
                    gate = weight_ref(f, buf, p + "moe.shared_gate")
            stacks = [expert_ref(f, buf, i, n, c.num_experts) for n in mlp]
            biased = None
            if c.expert_bias or c.expert_activation != "silu":
                biases = ([vector(f, f"{p}moe.b_{n[2:]}") for n in mlp] if c.expert_bias
                          else [None] * 3)
                biased = BiasedExperts(*stacks, *biases, c.expert_activation, c.swiglu_alpha,
                                       c.swiglu_limit, t, act)
            correction = (vector(f, p + "moe.correction_bias")
                          if c.router == "sigmoid_group_topk" else None)
            ffn = MoE(weight_ref(f, buf, router_name(i)), *stacks,
                      top_k=c.num_experts_per_tok, norm_topk_prob=c.norm_topk_prob, threads=t,
                      shared=shared, shared_gate=gate, rule=c.router, activations=act,
                      jitter_eps=c.router_jitter_noise, biased_experts=biased,
                      router_bias=vector(f, p + "moe.router_bias") if c.router_bias else None,
                      correction_bias=correction, n_group=c.n_group, topk_group=c.topk_group,
                      routed_scaling_factor=c.routed_scaling_factor)
        else:
            ffn = DenseMLP(*(weight_ref(f, buf, f"{p}mlp.{n}") for n in mlp), threads=t,
                           activations=act)
        biases = ((vector(f, p + "attn_norm_bias"), vector(f, p + "ffn_norm_bias"))
                  if c.norm_bias else (None, None))
        return _Layer(vector(f, p + "attn_norm"), attn, vector(f, p + "ffn_norm"), ffn, *biases)

    # -- the norms and multipliers some families add -------------------------------------------
    def norm_rows_into(self, x: np.ndarray, weight: np.ndarray, bias: np.ndarray | None,
                        eps: np.float32, out: np.ndarray) -> None:
        """The model's norm of rows x float32 (N, D) into out (N, D) (may be x), compiled
        for RMSNorm (NumPy's operations and summation order: norms.rms_norm's bits)."""
        if self._layer_norm:
            layer_norm(x, weight, bias, eps, out=out)
        else:
            _norm_rows(x, weight, eps, out)

    def head_into(self, x: np.ndarray, logits: np.ndarray) -> np.ndarray:
        """The head of normed rows x float32 (N, D) into logits float32 (N, V), scaled as
        the family asks."""
        self._head(x, logits)
        return self._scale_logits(logits)

    def _scale_logits(self, logits: np.ndarray) -> np.ndarray:
        """logits / logits_scaling in place (Granite's muP), when the model has one."""
        if self._logits_div is not None:
            np.true_divide(logits, self._logits_div, out=logits)
        return logits

    def _attention(self, i: int, proj) -> Attention:
        """Layer i's attention (colibri/engine/attention.py); proj(name, bias) -> _Linear."""
        f, c, t, p = self.file, self.config, self.threads, f"layers.{i}."
        wq, wk, wv = (proj(f"attn.w{n}", f"attn.b{n}") for n in "qkv")
        qk_norm = c.qk_norm != "none"
        return Attention(
            wq, wk, wv, proj("attn.wo", "attn.bo"),
            n_heads=c.num_attention_heads, n_kv_heads=c.num_key_value_heads,
            head_dim=c.head_dim, eps=c.rms_norm_eps, qk_norm=c.qk_norm,
            q_norm=vector(f, p + "attn.q_norm") if qk_norm else None,
            k_norm=vector(f, p + "attn.k_norm") if qk_norm else None,
            clip_qkv=c.clip_qkv, window=c.layer_window(i), wqkv=_fused_linear((wq, wk, wv), t),
            threads=t, scale=c.attention_multiplier,
            sinks=vector(f, p + "attn.sinks") if c.attention_sinks else None)

    # -- helpers -------------------------------------------------------------------------------
    @property
    def tokenizer(self):
        """The model's Tokenizer (built on first use from the embedded files), or None."""
        if not self._tokenizer_loaded:
            self._tokenizer = tokenizer_from_files(self.file.tokenizer_files,
                                                   str(self.file.path))
            self._tokenizer_loaded = True
        return self._tokenizer

    @property
    def max_context(self) -> int:
        return self.config.max_position_embeddings

    def new_cache(self, ctx: int | None = None, batch: int = 1, dtype: str | None = None
                  ) -> KVCache:
        """A KV cache for `batch` sequences of up to `ctx` tokens, stored as `dtype` ("f32",
        "f16", "bf16"; None: the model's kv_dtype, see colibri.load). ctx defaults to the
        model's max_position_embeddings capped at DEFAULT_MAX_CTX (4096): a cache costs
        2 * layers * batch * Hkv * ctx * Dh * E bytes once filled, E = 4 (f32) or 2 (MLA:
        layers * batch * ctx * (Rkv + Dr) * E, the latent and the rotary key)."""
        if ctx is None:
            ctx = min(self.max_context, DEFAULT_MAX_CTX)
        for name, val in (("ctx", ctx), ("batch", batch)):
            if isinstance(val, bool) or not isinstance(val, (int, np.integer)) or val < 1:
                raise ValueError(f"new_cache: {name} must be a positive integer, got {val!r}")
        n_layers, heads, k_dim, v_dim = self.cache_dims
        cache = KVCache(n_layers, batch, heads, ctx, k_dim, value_dim=v_dim,
                        dtype=self.kv_dtype if dtype is None else kv_dtype_name(dtype, "dtype"))
        cache.owner = self.identity
        warn_past_context(self, int(ctx) - 1, f"a KV cache of ctx {ctx}")
        return cache

    def embed(self, ids: np.ndarray) -> np.ndarray:
        """Embedding rows of ids int (B, S) -> float32 (B, S, D); only those rows are decoded."""
        e = self.embedding
        flat = ids.reshape(-1)
        if isinstance(e, QuantizedTensor):
            rows = QuantizedTensor(e.data[flat], e.scales[flat], e.dtype,
                                   (flat.shape[0], e.shape[-1]), e.group_size).dequantize()
        elif e.dtype == np.uint16:                                           # bf16 bits
            rows = quant.bf16_to_f32(e[flat])
        else:
            rows = e[flat].astype(np.float32)
        return rows.reshape(*ids.shape, self.config.hidden_size)

    def embed_row(self, token: int, out: np.ndarray) -> np.ndarray:
        """The embedding row of one token into out float32 (1, D), as embed decodes it."""
        e = self.embedding
        if isinstance(e, np.ndarray) and e.dtype == np.uint16:                 # bf16 bits
            np.left_shift(e[token], 16, out=out.view(np.uint32), dtype=np.uint32)
        elif isinstance(e, np.ndarray) and e.dtype in (np.float32, np.float16):
            np.copyto(out[0], e[token])
        else:
            out[...] = self.embed(np.array([[token]]))[0]
        return out

    def run_state(self, cache: KVCache) -> RunState:
        """The cache's RunState for this model (made on first use, remade for another
        geometry)."""
        state = cache.run_state
        if state is None or state.key != self._state_key:
            state = cache.run_state = RunState(*self._state_key)
        return state

    # -- forward ----------------------------------------------------------------------------------
    def forward(self, input_ids=None, cache: KVCache | None = None, positions=None,
                return_routing: bool = False, input_embeds=None, attention_mask=None,
                last_only: bool = False):
        """Logits float32 (B, S, V), or (S, V) for 1-D input [, RoutingTrace]; see
        colibri.forward.

        last_only: compute the head for the last position only (logits (B, 1, V) / (1, V)),
        which is all a generation step needs.
        """
        if type(cache) is KVCache:
            with cache.claim():                 # one forward pass per cache at a time
                if input_embeds is None and attention_mask is None:
                    out = self.decode_call(input_ids, cache, positions, return_routing)
                    if out is not None:
                        return out
                with blas_on_one_thread():
                    return self._forward(input_ids, cache, positions, return_routing,
                                         input_embeds, attention_mask, last_only)
        with blas_on_one_thread():
            return self._forward(input_ids, cache, positions, return_routing, input_embeds,
                                 attention_mask, last_only)

    def decode_call(self, input_ids, cache: KVCache, positions, return_routing: bool):
        """forward's result for a plain decode step, or None when this call is not one (the
        general entry then checks, raises or runs it).

        It is one when input_ids is one integer token ((1,) or (1, 1) array, in range), the
        cache is for one sequence, has room, no padding and this model's shapes, and
        positions, if given, hold the position the cache's next token gets. Few Python and
        NumPy calls decide it: each costs several microseconds in a decode step, whose weight
        streaming has evicted the interpreter's code and data from the caches.
        """
        ids = input_ids
        if (not isinstance(ids, np.ndarray) or ids.size != 1 or ids.ndim not in (1, 2)
                or ids.dtype.kind not in "iu" or cache.owner is not self.identity
                or (cache.n_layers, cache.n_kv_heads, cache.head_dim, cache.value_dim)
                != self.cache_dims or not is_token_step(cache, 1)):
            return None
        token, n = int(ids.reshape(-1)[0]), cache.length
        if not 0 <= token < self.config.vocab_size:
            return None
        position = int(np.maximum.reduce(cache.pos[0, :n])) + 1 if n else 0   # no padding
        if positions is not None:
            p = np.asarray(positions)
            if (p.dtype.kind not in "iu" or p.shape not in ((1,), (1, 1))
                    or int(p.reshape(-1)[0]) != position):
                return None
        t0 = time.perf_counter()
        state = self.run_state(cache)
        self.embed_row(token, state.h)
        trace = RoutingTrace([], [], []) if return_routing else None
        logits = self._step(state, position, cache, trace, t0)
        if ids.ndim == 2:
            logits = logits.reshape(1, 1, self.config.vocab_size)
        elif trace is not None:
            drop_batch(trace)
        return (logits, trace) if return_routing else logits

    def _step(self, state: RunState, position: int, cache: KVCache,
              trace: RoutingTrace | None, t0: float) -> np.ndarray:
        """The decode step: the token embedded in state.h (1, D) at RoPE position
        `position`, through every layer and the head, its key and value written to the
        cache's next slot, which is committed. Logits float32 (1, V), a new array; the
        routing appended to trace (shaped (1, 1, ...)) when given. t0: the step's start."""
        cos, sin = self.rope.cos_sin_one(position)                               # (Dr/2,)
        step = TokenStep(cache, state, position, cos, sin)
        record = None if trace is None else tracer(trace, 1, 1, self.threads)
        return forward_pass(self, step, state.h, t0, record)

    def _forward(self, input_ids, cache, positions, return_routing, input_embeds,
                 attention_mask, last_only):
        """forward after the input checks: the decode step when the call is one, else the
        general path."""
        data, squeeze, valid, pos = check_inputs(self, input_ids, input_embeds, cache,
                                                 positions, attention_mask)
        trace = RoutingTrace([], [], []) if return_routing else None
        B, S = valid.shape
        if B == 1 and valid[0, 0] and is_token_step(cache, S):
            t0 = time.perf_counter()
            state = self.run_state(cache)
            if data.dtype == np.int64:
                self.embed_row(int(data[0, 0]), state.h)
            else:
                state.h[...] = data[0]
            logits = self._step(state, int(pos[0, 0]), cache, trace, t0)[None]   # (1, 1, V)
        else:
            logits = self._general(data, valid, pos, cache, trace, last_only)
        if squeeze:
            logits = logits[0]
            if trace is not None:
                drop_batch(trace)
        return (logits, trace) if return_routing else logits

    def _general(self, data: np.ndarray, valid: np.ndarray, pos: np.ndarray,
                 cache: KVCache | None, trace: RoutingTrace | None,
                 last_only: bool) -> np.ndarray:
        """The general path: ids int64 (B, S) or embeddings float32 (B, S, D) -> logits
        float32 (B, S, V) ((B, 1, V) with last_only); valid bool (B, S), pos int64 (B, S)."""
        t0 = time.perf_counter()
        B, S = valid.shape
        D, V = self.config.hidden_size, self.config.vocab_size
        h = (self.embed(data) if data.dtype == np.int64 else data.copy()).reshape(B * S, D)
        batch = PaddedBatch.of(self, valid, pos, cache)
        record = None if trace is None else tracer(trace, B, S, self.threads)
        rows = np.arange(S - 1, B * S, S) if last_only else None      # each sequence's last
        return forward_pass(self, batch, h, t0, record, rows).reshape(B, -1, V)

    def forward_ragged(self, segments, return_routing: bool = False, logits_rows=None):
        """Several sequences of different lengths in one step, each through its own cache
        (colibri.engine.ragged; the step of continuous batching, colibri.generation.batching).

        segments: [(cache_i, ids_i)], cache_i a KVCache of one sequence (batch 1) with room
        for its S_i new ids (int, 1-D, S_i >= 1), each cache in one segment only. Returns
        logits float32 (N, V) of the last new token of each segment [, routing: per segment
        int32 (M, S_i, K), the experts each token chose in every MoE layer]; every cache
        advances by its S_i tokens. logits_rows: per segment, the indices (int, within its S_i
        new tokens) of the rows whose logits to return instead of the last one, concatenated
        segment after segment: (sum R_i, V) (what scoring a prompt needs; the head then runs
        on those rows only). Each row gets the values of its own forward through its
        cache (up to the projections' summation order: kernels.linear's GEMM path).
        """
        with ExitStack() as held:                 # every cache claimed, as forward does
            claimed = set()                       # (a cache given twice: check_segments says)
            for seg in segments if isinstance(segments, (list, tuple)) else ():
                if isinstance(seg, (list, tuple)) and len(seg) == 2 \
                        and type(seg[0]) is KVCache and id(seg[0]) not in claimed:
                    claimed.add(id(seg[0]))
                    held.enter_context(seg[0].claim())
            return forward_ragged(self, segments, return_routing, logits_rows)

    def forward_rows(self, cache: KVCache, ids, return_routing: bool = False):
        """T new tokens ids int (T,) of one sequence through `cache` (batch 1) in one pass:
        logits float32 (T, V), row i predicting the token after ids[i] [, routing: a list of
        one int32 (M, T, K)]; the cache advances by T (colibri.engine.ragged.forward_rows: a
        speculative verification)."""
        with cache.claim() if type(cache) is KVCache else nullcontext():
            return forward_rows(self, cache, ids, return_routing)

    def close(self) -> None:
        for part in (self.expert_shards, self.expert_cache):    # the actors first
            if part is not None:
                part.close()
        self.expert_shards = None
        self.file.close()

    def __enter__(self) -> "Model":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _repr_html_(self) -> str:
        """Notebook display: config, sizes, formats, bytes per expert (colibri.tools.display)."""
        from ..tools.display import model_html   # notebook display, above the engine: on demand
        return model_html(self)

    def __repr__(self) -> str:
        c = self.config
        return (f"Model({c.family}, layers={c.num_hidden_layers}, hidden={c.hidden_size}, "
                f"experts={c.num_experts} top-{c.num_experts_per_tok}, "
                f"vocab={c.vocab_size}, threads={self.threads}, activations={self.activations}, "
                f"kv_dtype={self.kv_dtype}, file={self.file.path})")
