"""Public functions: load a model, run a forward pass, generate.

    import colibri
    model = colibri.load("model.colibri", threads=2)
    logits = colibri.forward(model, ids)                       # (S, V) or (B, S, V) float32
    logits, trace = colibri.forward(model, ids, return_routing=True)
    text = colibri.generate(model, "Once upon a time", max_new_tokens=32)
"""
from __future__ import annotations

import os
from pathlib import Path

import numpy as np

from .engine.kv_cache import DEFAULT_KV_DTYPE, KVCache
from .engine.model import DEFAULT_ACTIVATIONS, Model
from .engine.routing import RoutingTrace
from .errors import ColibriError
from .generation.generate import generate as _generate

__all__ = ["load", "forward", "generate", "stream", "default_model_path", "Model", "RoutingTrace",
           "KVCache"]

DEFAULT_MODEL = "tiny-moe.colibri"


def default_model_path() -> Path:
    """The small model shipped inside the package (colibri/models/tiny-moe.colibri)."""
    path = Path(__file__).resolve().parent / "models" / DEFAULT_MODEL
    if not path.is_file():
        raise ColibriError(f"the bundled model colibri/models/{DEFAULT_MODEL} is not part of this "
                           f"installation (it is made by scripts/train_tiny_moe.py); "
                           f"give the path of a .colibri file instead")
    return path


def load(path: str | os.PathLike | None = None, threads: int | None = None,
         activations: str = DEFAULT_ACTIVATIONS, *, memory_budget: int | None = None,
         mlock: bool = False, mmap: bool = True, kv_dtype: str = DEFAULT_KV_DTYPE,
         prefix_cache: int | None = None, expert_shards: int = 0,
         ray_address: str | None = None, shard_threads: int | None = None,
         shard_counts: np.ndarray | None = None, **cache_options) -> Model:
    """Map a .colibri file and return a Model; nothing is copied or parsed beyond the header.

    path: the .colibri file (None: the bundled model, see default_model_path()).
    threads: kernel threads (default: physical cores, OMP_NUM_THREADS/COLIBRI_NUM_THREADS).
    activations: what the q4/q8 weight matrices are multiplied with (W4A16: 4-bit weights,
        16-bit activations).
        "int16" (default): each token's activations as 16-bit integer codes in blocks of 32
        values with one f32 scale, dotted with the weight codes in integer arithmetic: logits
        within 4e-5..1.2e-4 of the f32 path (relative to the largest; KL 2.7e-7 nats on the
        shipped model, docs/accuracy.md), decode ~2x faster than f32.
        "f32": the activations as they are; exact to the stored weights (the setting the
        parity tests against transformers use).
        "int8": 8-bit codes (as llama.cpp's Q8_0): the fastest, at a small accuracy cost
        measured in docs/accuracy.md (~1e-2 of the logits).
        Routers and plain-format (f32/f16/bf16) matrices always multiply f32 activations, so
        a file without q4/q8 matrices gives the same logits under every setting.
    memory_budget: bytes the weights may use (None: no limit, the page cache decides): the
        dense part stays resident, the experts live in a cache of what is left
        (colibri.experts.expert_cache, docs/memory.md); the same logits as without a budget.
        MemoryBudgetError, naming the numbers, when it is below the dense part plus one
        layer's experts.
    mlock: lock the resident weights in memory (all of them without a budget) where the
        system allows (model.memory_locked says whether it did).
    mmap: False reads the weights into anonymous memory instead of mapping them (with a
        budget, only the dense part; the experts are read into the cache).
    kv_dtype: the storage of the KV caches model.new_cache makes (and generate, the
        server, perplexity and bench through it): "f16" (default; IEEE half: half the bytes
        of f32, and a decode step at depth reads half), "bf16" (bfloat16: f32's range, fewer
        mantissa bits) or "f32" (exact; what the f32 parity tests pin). Each write rounds to
        nearest-even; attention computes in f32; the logits cost is measured in
        docs/accuracy.md. "fp16"/"float16"/"half", "bfloat16", "fp32"/"float32" are accepted.
    prefix_cache: bytes of KV that generate keeps of the prompts it ran, reused by a later
        call whose prompt starts with the same tokens (colibri.engine.prefix_cache,
        docs/prefix-caching.md): None (default) 4096 tokens' worth, 0 off. On by default as
        in vLLM and llama.cpp's server; the Scheduler and the server have their own.
    expert_shards: N > 0 spreads the experts of every MoE layer over N Ray actors (the ray
        extra; colibri.experts.expert_shards, docs/serving.md): this process keeps the dense part,
        the logits are bit-identical to one process. ray_address: the cluster to join
        ("auto", "HOST:PORT"; None: the running Ray of this process or a new local one on
        loopback); shard_threads: kernel threads per actor (default: threads);
        shard_counts: int (M, E) routing counts (a Trace's expert_counts) to balance the
        shards by, else round-robin. With expert_shards, memory_budget is each actor's: the
        bytes its experts may hold (an expert cache per actor; the dense part stays here).
        model.close() stops the actors.
    cache_options: of the expert cache: cache_policy ("lru", "lfu", "least-stale",
        "freq-weighted"), cache_mode ("arena" or "madvise"), prefetch (None, "router",
        "previous" or "both"; colibri.experts.prefetch).
    """
    return Model(default_model_path() if path is None else path, threads=threads,
                 activations=activations, memory_budget=memory_budget, mlock=mlock, mmap=mmap,
                 kv_dtype=kv_dtype, prefix_cache=prefix_cache, expert_shards=expert_shards,
                 ray_address=ray_address, shard_threads=shard_threads,
                 shard_counts=shard_counts, **cache_options)


def forward(model: Model, input_ids: np.ndarray | None = None, cache: KVCache | None = None,
            positions: np.ndarray | None = None, return_routing: bool = False,
            input_embeds: np.ndarray | None = None, attention_mask: np.ndarray | None = None
            ) -> np.ndarray | tuple[np.ndarray, RoutingTrace]:
    """Logits of every position.

    input_ids: int (B, S) or (S,), values in [0, vocab_size); or input_embeds float (B, S, D)
        / (S, D) instead (exactly one of the two).
    cache: a KVCache from model.new_cache(ctx, batch); the new tokens' keys/values are appended
        and attention covers everything already in it. Without a cache the call is stateless.
    positions: int (B, S) or (S,) RoPE positions; default: continue from the cache, counting
        only unmasked tokens (so left padding gets the positions it would have unpadded).
    attention_mask: 0/1 (B, S) (or (B, past + S)), 0 = padding; padding is remembered in the cache.
    return_routing: also return a RoutingTrace (per MoE layer: ids int32 (B, S, K), weights
        float32 (B, S, K)).
    Returns float32 logits (B, S, V), or (S, V) for 1-D input.
    Raises ValueError naming the numbers for ids out of range, non-integer ids, a wrong ndim,
    a cache of another batch size, and CacheOverflowError when the cache is full.
    """
    return model.forward(input_ids, cache=cache, positions=positions, return_routing=return_routing,
                         input_embeds=input_embeds, attention_mask=attention_mask)


def generate(model: Model, prompt_or_ids, max_new_tokens: int = 64, **kwargs):
    """Continue a text prompt (-> text) or token ids (-> int64 ids); also
    `model.generate(prompt_or_ids, ...)`. A list of prompts runs them together (continuous
    batching) and returns a list; with stream=True it yields (index, piece) pairs.

    Keyword arguments: temperature, top_k, top_p, min_p, repetition_penalty, presence_penalty,
    frequency_penalty, seed, stop, stream, chat, ctx, return_routing, input_embeds, parallel,
    json_schema / regex / grammar (structured output), draft and num_draft_tokens
    (speculative decoding); colibri.generation.generate.generate documents each.
    """
    return _generate(model, prompt_or_ids, max_new_tokens=max_new_tokens, **kwargs)


def stream(model: Model, prompt_or_ids, max_new_tokens: int = 64, **kwargs):
    """generate(..., stream=True): an iterator of text pieces (or ids) as they are produced."""
    return generate(model, prompt_or_ids, max_new_tokens=max_new_tokens, stream=True, **kwargs)


# model.generate(...) is generate(model, ...). It is attached here, above both, and not written
# in engine/model.py: generation/ runs over the engine, so the engine never imports it.
Model.generate = generate
