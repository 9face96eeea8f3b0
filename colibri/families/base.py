"""What every family shares: the checkpoint names, and the Family record.

A family is data, not code paths: `model_config(hf)` turns a Hugging Face config.json into the
ModelConfig the runtime reads (built in config_json.py, stating only what the family does
differently), and `name_map` says which checkpoint key holds each canonical tensor (docs/format.md §7).
Which canonical tensors a model has, and their shapes, follow from the ModelConfig alone and
are the same for every family (tensors.py).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Mapping

from ..config import ModelConfig
from ..errors import ColibriError
from .config_json import HFConfig
from .tensors import CanonicalTensor, canonical_tensors, eval_dim

# Checkpoint names the families share (per-layer keys relative to "model.layers.{i}."); each
# family's NAME_MAP is these plus its own, so a family module shows only what is its own.
LLAMA_NAMES = {
    "tok_embeddings": "model.embed_tokens.weight",
    "norm": "model.norm.weight",
    "lm_head": "lm_head.weight",
    "attn_norm": "input_layernorm.weight",
    "ffn_norm": "post_attention_layernorm.weight",
    "attn.wq": "self_attn.q_proj.weight",
    "attn.wk": "self_attn.k_proj.weight",
    "attn.wv": "self_attn.v_proj.weight",
    "attn.wo": "self_attn.o_proj.weight",
}
QK_NORM_NAMES = {
    "attn.q_norm": "self_attn.q_norm.weight",
    "attn.k_norm": "self_attn.k_norm.weight",
}
# Qwen-style routed experts (Qwen2-MoE, Qwen3-MoE, OLMoE)
QWEN_EXPERT_NAMES = {
    "moe.router": "mlp.gate.weight",
    "moe.experts.w_gate": "mlp.experts.{e}.gate_proj.weight",
    "moe.experts.w_up": "mlp.experts.{e}.up_proj.weight",
    "moe.experts.w_down": "mlp.experts.{e}.down_proj.weight",
}
DENSE_MLP_NAMES = {
    "mlp.w_gate": "mlp.gate_proj.weight",
    "mlp.w_up": "mlp.up_proj.weight",
    "mlp.w_down": "mlp.down_proj.weight",
}

LAYER_PREFIX = "model.layers.{i}."

# Keys a checkpoint may carry that hold no weights the runtime needs (buffers saved by old
# transformers versions). Matched with str.endswith.
IGNORABLE_SUFFIXES = (".rotary_emb.inv_freq",)


# --- the family record ----------------------------------------------------------------------

@dataclass(frozen=True)
class Source:
    """Where a canonical tensor's values are in the checkpoint.

    `index` is applied to the checkpoint tensor (numpy basic indexing) when one checkpoint
    tensor holds several canonical ones (fused experts); `shape` is then the expected shape of
    the whole checkpoint tensor and `dims` its ModelConfig-field expressions.
    """
    key: str
    index: tuple = ()
    shape: tuple[int, ...] | None = None
    dims: tuple[str, ...] | None = None
    transpose: bool = False            # the indexed block is the canonical tensor transposed
    post: tuple = ()                   # numpy index applied after reading (steps)
    scales: "Source | None" = None     # MXFP4: the blocks are `key`, the E8M0 scales here


@dataclass(frozen=True)
class Rows:
    """A name-map entry: the canonical tensor is one block of rows of a fused 2-D checkpoint
    tensor (Granite's shared input_linear, DBRX's Wqkv and expert stacks).

    key: the checkpoint key template (as a name-map string). blocks: the row count of each
    block, top to bottom, as ModelConfig expressions; part: the tensor's block, an int or "e"
    for the expert's own (the blocks then repeat once per expert, expert 0 first).
    transposed: the block holds the tensor's transpose (DBRX's w2: (I, D) for a (D, I) down).
    """
    key: str
    blocks: tuple[str, ...]
    part: int | str = 0
    transposed: bool = False

    def source(self, t: CanonicalTensor, key: str, cfg: ModelConfig) -> Source:
        blocks = self.blocks
        if self.part == "e":
            part = t.expert * len(blocks)
            blocks = blocks * cfg.num_experts
        else:
            part = self.part
        sizes = [eval_dim(b, cfg) for b in blocks]
        start = sum(sizes[:part])
        cols = t.dims[0] if self.transposed else t.dims[-1]
        # the whole tensor's rows as one expression: "num_experts*x" or "a+b+c" unrolled
        rows = (f"num_experts*{self.blocks[0]}" if self.part == "e" and len(self.blocks) == 1
                else "+".join(self.blocks))
        return Source(key, (slice(start, start + sizes[part]),),
                      (sum(sizes), eval_dim(cols, cfg)), (rows, cols), self.transposed)


@dataclass(frozen=True)
class Slice:
    """A name-map entry: the canonical tensor is `stack[index]` of a checkpoint tensor, then
    transposed if `transposed` (GPT-OSS's (E, D, 2I) gate_up with gate / up interleaved).

    dims: the checkpoint tensor's shape as ModelConfig expressions; index: a numpy index
    whose first entry may be "e" (the expert number, read through the checkpoint's slicing;
    the rest is applied after reading, so steps are allowed)."""
    key: str
    dims: tuple[str, ...]
    index: tuple = ()
    transposed: bool = False

    def source(self, t: CanonicalTensor, key: str, cfg: ModelConfig) -> Source:
        read = (t.expert,) if self.index[:1] == ("e",) else ()
        return Source(key, read, tuple(eval_dim(d, cfg) for d in self.dims), self.dims,
                      self.transposed, tuple(self.index[len(read):]))


@dataclass(frozen=True)
class MxSlice:
    """A name-map entry: the canonical matrix (R, C) is stored in the checkpoint as MXFP4
    (GPT-OSS's released experts) and is kept so: `blocks` (..., R', C/32, 16) and `scales`
    (..., R', C/32) uint8, both indexed by `index` (as Slice: "e" first, then e.g. a row step
    for gate / up interleaved); dims: the blocks' shape as ModelConfig expressions."""
    blocks: str
    scales: str
    dims: tuple[str, ...]
    index: tuple = ()

    def source(self, t: CanonicalTensor, key: str, cfg: ModelConfig) -> Source:
        read = (t.expert,) if self.index[:1] == ("e",) else ()
        post = tuple(self.index[len(read):])
        prefix = key[:len(key) - len(self.blocks)]
        shape = tuple(eval_dim(d, cfg) for d in self.dims)
        return Source(key, read, shape, self.dims, False, post,
                      Source(prefix + self.scales, read, shape[:-1], self.dims[:-1], False,
                             post))

    @property
    def key(self) -> str:
        return self.blocks


@dataclass(frozen=True)
class Family:
    """A model family: config.json → ModelConfig, and the checkpoint name of every canonical
    tensor.

    name_map: canonical kind → checkpoint key template, or a tuple of alternative templates
      (the first one present in the checkpoint is used). Templates may use {i} (layer) and
      {e} (expert); per-layer keys are relative to `layer_prefix`, the others absolute.
    fused_experts: (gate_up, down) checkpoint keys relative to `layer_prefix`, holding all
      experts of a layer as gate_up (E, 2I, D), gate rows first, and down (E, D, I); accepted
      as an alternative to the per-expert keys.
    config_fields: ModelConfig field → config.json field, where the names differ (error
      messages).
    transform: (canonical tensor, config, config.json, values) → the values to store, for a
      family whose file layout differs from its checkpoint's (DeepSeek's interleaved RoPE
      rows); None: stored as read.
    ignores: (checkpoint key, config) → True for keys the runtime does not use beyond
      IGNORABLE_SUFFIXES (DeepSeek-V3's multi-token-prediction layers); None: none.
    """
    model_type: str
    model_config: Callable[[HFConfig], ModelConfig]
    name_map: Mapping[str, str | Rows | tuple[str | Rows, ...]]
    fused_experts: tuple[str, str] | None = ("mlp.experts.gate_up_proj", "mlp.experts.down_proj")
    layer_prefix: str = LAYER_PREFIX
    config_fields: Mapping[str, str] = field(default_factory=dict)
    description: str = ""
    transform: Callable[[CanonicalTensor, ModelConfig, HFConfig, Any], Any] | None = None
    ignores: Callable[[str, ModelConfig], bool] | None = None

    def expected_shapes(self, cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
        """canonical name → shape implied by config.json."""
        return {t.name: t.shape for t in canonical_tensors(cfg)}

    def sources(self, t: CanonicalTensor, cfg: ModelConfig) -> tuple[Source, ...]:
        """Alternative checkpoint locations of canonical tensor `t`, preferred first."""
        templates = self.name_map.get(t.kind)
        if templates is None:
            raise ColibriError(f"family {self.model_type!r} has no checkpoint name for "
                               f"{t.name!r}")
        if isinstance(templates, (str, Rows, Slice, MxSlice)):
            templates = (templates,)
        prefix = self.layer_prefix.format(i=t.layer) if t.layer is not None else ""
        subs = {"i": t.layer, "e": t.expert}
        found = [tpl.source(t, prefix + tpl.key.format(**subs), cfg)
                 if isinstance(tpl, (Rows, Slice, MxSlice))
                 else Source(prefix + tpl.format(**subs)) for tpl in templates]
        if t.expert is not None and self.fused_experts is not None:
            found.append(self._fused_source(t, prefix, cfg))
        return tuple(found)

    def _fused_source(self, t: CanonicalTensor, prefix: str, cfg: ModelConfig) -> Source:
        n_exp, inter, hidden = cfg.num_experts, cfg.moe_intermediate_size, cfg.hidden_size
        gate_up, down = self.fused_experts
        if t.proj == "w_down":                                   # (E, D, I)
            return Source(prefix + down, (t.expert,), (n_exp, hidden, inter),
                          ("num_experts", "hidden_size", "moe_intermediate_size"))
        rows = slice(0, inter) if t.proj == "w_gate" else slice(inter, 2 * inter)
        return Source(prefix + gate_up, (t.expert, rows), (n_exp, 2 * inter, hidden),
                      ("num_experts", "2*moe_intermediate_size", "hidden_size"))

    def tensor_map(self, cfg: ModelConfig) -> list[tuple[str, str]]:
        """(checkpoint_key, canonical_name) pairs with the preferred (per-expert) keys."""
        return [(self.sources(t, cfg)[0].key, t.name) for t in canonical_tensors(cfg)]

    def explain(self, dims: tuple[str, ...], cfg: ModelConfig) -> str:
        """'num_attention_heads*head_dim=4*16, hidden_size=32' with config.json field names."""
        parts = []
        for expr in dims:
            terms = [t.split("*") for t in expr.split("+")]
            names = "+".join("*".join(self.config_fields.get(f, f) for f in t) for t in terms)
            values = "+".join("*".join(str(eval_dim(f, cfg)) for f in t) for t in terms)
            parts.append(f"{names}={values}")
        return ", ".join(parts)
