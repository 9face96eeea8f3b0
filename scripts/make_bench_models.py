"""Write the benchmark models of issue 4: random weights at fixed geometries, as Hugging Face
folders, then converted to .colibri at q4, q8 and bf16.

    python scripts/make_bench_models.py --out bench-models                  # both full models
    python scripts/make_bench_models.py --out bench-models --only mixtral-mini
    python scripts/make_bench_models.py --out bench-models --small          # CI-scale variants
    python scripts/make_bench_models.py --out bench-models --only tiny-moe  # shipped geometry

Models (geometry; parameters total / active per token):
  mixtral-mini   Mixtral, hidden 1024, expert intermediate 3584, 8 layers, 16 heads / 4 KV
                 heads, 8 experts top-2, vocab 32000, untied head      (0.79 B / 0.23 B)
  olmoe-16L      the OLMoE-1B-7B geometry: hidden 2048, expert intermediate 1024 (set
                 explicitly: OlmoeConfig's default is 2048), 16 layers, 16 heads, 64 experts
                 top-8, q/k norms, vocab 50304, untied head              (6.92 B / 1.18 B)
  deepseek-v2-lite-8L
                 DeepSeek-V2-Lite's geometry, 8 of its 27 layers: hidden 2048, MLA (16 heads,
                 kv_lora_rank 512, q without LoRA, nope 128 + rope 64, v 128), layer 0 dense
                 (intermediate 10944), then 64 routed experts top-6 (intermediate 1408) plus 2
                 shared, greedy softmax routing, vocab 102400            (4.59 B / 1.08 B)
  gpt-oss-20b-8L GPT-OSS-20B's geometry, 8 of its 24 layers: hidden 2880, 64 heads of 64 / 8
                 KV heads with sinks, sliding (128) and full layers alternating, 32 experts
                 top-4 (intermediate 2880) stored as released, MXFP4 blocks + E8M0 scales,
                 vocab 201088                                            (7.74 B / 2.17 B)
  tiny-moe       the shipped model's geometry (hidden 256, intermediate 512, 6 layers, 8 heads
                 / 2 KV, 8 experts top-2, vocab 4096, tied): the small-matrix case
  --small        mixtral-mini-small / olmoe-small: the same families and routing at a size a
                 CI job converts in seconds

Layout of OUT/<name>/:
  hf/                          config.json (from transformers' config class), generation_config,
                               tokenizer.json + tokenizer_config.json, bf16 safetensors shards
                               (one per layer) with model.safetensors.index.json
  <name>-q4.colibri            every matrix q4 (attention, experts, head; group 32)
  <name>-q8.colibri            every matrix q8
  <name>-bf16.colibri          every matrix bf16 (the checkpoint, bit-exact)
Routers and norms stay f32 and the embedding keeps the checkpoint dtype, as in any colibri
conversion; quantizing attention and head too (not only the experts, colibri's default) makes
the bytes per token comparable with llama.cpp's Q4_0 / Q8_0 files of the same weights.

Memory: the weights are never a torch model and never f32 as a whole: each tensor is drawn
in f32 (N(0, 0.02), the transformers init; norm weights 1), rounded to bf16 and the f32
copy dropped; one shard (one layer, ~0.84 GB for olmoe-16L) is held at a time and written
with safetensors.numpy. Peak RSS stays near 1.5 GB for olmoe-16L.
Disk: olmoe-16L takes 13.8 GB (HF) + 3.9 (q4) + 7.4 (q8) + 13.8 GB (bf16).

The tokenizer is a synthetic byte-level BPE of exactly vocab_size tokens (the 256 byte symbols,
then merges of earlier tokens; the special tokens at the ids config.json names). It encodes
any text; the benchmarks feed token ids, so its quality does not matter.

`--verify` loads each HF folder with transformers (on the meta device where possible) and
fails if any checkpoint key is missing or unexpected: the folder is what save_pretrained
would have written.
"""
from __future__ import annotations

import argparse
import json
import shutil
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

# name -> (transformers config class, config kwargs)
MODELS: dict[str, tuple[str, dict]] = {
    "mixtral-mini": ("MixtralConfig", dict(
        hidden_size=1024, intermediate_size=3584, num_hidden_layers=8,
        num_attention_heads=16, num_key_value_heads=4, num_local_experts=8,
        num_experts_per_tok=2, vocab_size=32000, tie_word_embeddings=False,
        max_position_embeddings=4096, rope_theta=1e6)),
    "olmoe-16L": ("OlmoeConfig", dict(
        hidden_size=2048, intermediate_size=1024, num_hidden_layers=16,
        num_attention_heads=16, num_key_value_heads=16, num_experts=64,
        num_experts_per_tok=8, vocab_size=50304, tie_word_embeddings=False,
        max_position_embeddings=4096)),
    "deepseek-v2-lite-8L": ("DeepseekV2Config", dict(
        hidden_size=2048, intermediate_size=10944, moe_intermediate_size=1408,
        num_hidden_layers=8, num_attention_heads=16, num_key_value_heads=16,
        n_shared_experts=2, n_routed_experts=64, num_experts_per_tok=6,
        first_k_dense_replace=1, kv_lora_rank=512, q_lora_rank=None, qk_nope_head_dim=128,
        qk_rope_head_dim=64, v_head_dim=128, topk_method="greedy", norm_topk_prob=False,
        routed_scaling_factor=1.0, vocab_size=102400, tie_word_embeddings=False,
        max_position_embeddings=4096, bos_token_id=100000, eos_token_id=100001)),
    "gpt-oss-20b-8L": ("GptOssConfig", dict(
        hidden_size=2880, intermediate_size=2880, num_hidden_layers=8,
        num_attention_heads=64, num_key_value_heads=8, head_dim=64, num_local_experts=32,
        num_experts_per_tok=4, vocab_size=201088, sliding_window=128,
        tie_word_embeddings=False, max_position_embeddings=4096,
        bos_token_id=199998, eos_token_id=200002, pad_token_id=199999)),
    "tiny-moe": ("MixtralConfig", dict(
        hidden_size=256, intermediate_size=512, num_hidden_layers=6,
        num_attention_heads=8, num_key_value_heads=2, num_local_experts=8,
        num_experts_per_tok=2, vocab_size=4096, tie_word_embeddings=True,
        max_position_embeddings=1024, rope_theta=10000.0, rms_norm_eps=1e-5,
        bos_token_id=1, eos_token_id=2, pad_token_id=0)),
    "mixtral-mini-small": ("MixtralConfig", dict(
        hidden_size=256, intermediate_size=896, num_hidden_layers=4,
        num_attention_heads=4, num_key_value_heads=1, num_local_experts=8,
        num_experts_per_tok=2, vocab_size=4096, tie_word_embeddings=False,
        max_position_embeddings=1024, rope_theta=1e6)),
    "olmoe-small": ("OlmoeConfig", dict(
        hidden_size=512, intermediate_size=256, num_hidden_layers=4,
        num_attention_heads=8, num_key_value_heads=8, num_experts=64,
        num_experts_per_tok=8, vocab_size=8192, tie_word_embeddings=False,
        max_position_embeddings=1024, eos_token_id=8191, pad_token_id=1)),
}
FULL = ("mixtral-mini", "olmoe-16L")
SMALL = ("mixtral-mini-small", "olmoe-small")
QUANTS = ("q4", "q8", "bf16")
ALL_ROLES = ("experts", "shared", "attn", "head", "dense")
INIT_STD = 0.02                     # transformers' initializer_range default


@dataclass
class Written:
    name: str
    folder: Path
    params: int = 0
    files: dict[str, Path] = field(default_factory=dict)
    seconds: dict[str, float] = field(default_factory=dict)


# ---------------------------------------------------------------------------------------------
# config and tokenizer


def make_config(name: str):
    import transformers
    cls_name, kwargs = MODELS[name]
    cfg = getattr(transformers, cls_name)(**kwargs)
    cfg.architectures = [cls_name.replace("Config", "ForCausalLM")]
    cfg.dtype = "bfloat16"
    if cfg.model_type == "gpt_oss":     # the experts ship as MXFP4 (what converters look for)
        cfg.quantization_config = {"quant_method": "mxfp4", "modules_to_not_convert": [
            "model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens",
            "lm_head"]}
    return cfg


def _special_ids(cfg) -> dict[int, str]:
    """id -> special token text for the ids config.json names (bos, eos, pad)."""
    out: dict[int, str] = {0: "<unk>"}
    for attr, text in (("bos_token_id", "<s>"), ("eos_token_id", "</s>"),
                       ("pad_token_id", "<pad>")):
        tid = getattr(cfg, attr, None)
        if isinstance(tid, list):
            tid = tid[0] if tid else None
        if tid is not None and tid not in out:
            out[int(tid)] = text
    return out


def write_tokenizer(cfg, folder: Path) -> None:
    """A byte-level BPE tokenizer.json of exactly cfg.vocab_size tokens (see the module doc)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from tokenizers.pre_tokenizers import ByteLevel

    V = int(cfg.vocab_size)
    specials = _special_ids(cfg)
    byte_symbols = sorted(ByteLevel.alphabet())                      # 256 printable stand-ins
    if V < len(byte_symbols) + len(specials):
        raise ValueError(f"vocab_size {V} is too small for 256 byte symbols + specials")
    vocab: dict[str, int] = {}
    merges: list[tuple[str, str]] = []
    free = (i for i in range(V) if i not in specials)
    for s in byte_symbols:
        vocab[s] = next(free)
    # merges of (earlier token, byte symbol): every new token is the concatenation of two
    # tokens already in the vocabulary, so the BPE model is valid
    tokens = list(byte_symbols)
    k = 0
    while len(vocab) + len(specials) < V:
        a, b = tokens[k // len(byte_symbols)], byte_symbols[k % len(byte_symbols)]
        k += 1
        if a + b in vocab:
            continue
        vocab[a + b] = next(free)
        merges.append((a, b))
        tokens.append(a + b)
    for tid, text in specials.items():
        vocab[text] = tid
    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(list(specials.values()))
    assert tok.get_vocab_size() == V, (tok.get_vocab_size(), V)
    tok.save(str(folder / "tokenizer.json"))
    names = {v: k for k, v in specials.items()}
    tcfg = {"tokenizer_class": "PreTrainedTokenizerFast", "model_max_length":
            int(cfg.max_position_embeddings), "unk_token": "<unk>",
            "bos_token": "<s>" if "<s>" in names else None,
            "eos_token": "</s>" if "</s>" in names else None,
            "pad_token": "<pad>" if "<pad>" in names else None}
    (folder / "tokenizer_config.json").write_text(json.dumps(tcfg, indent=2) + "\n")


# ---------------------------------------------------------------------------------------------
# weights


def _tensor_plan(cfg) -> list[tuple[str, tuple[int, ...], int | None]]:
    """(checkpoint key, shape, layer or None) of every tensor, from colibri's family name map
    (the preferred, per-expert keys: what save_pretrained writes)."""
    from colibri.families import canonical_tensors, get_family
    cdict = cfg.to_dict()
    fam = get_family(cdict["model_type"])
    model_config = fam.model_config(cdict)
    keys = dict((canon, key) for key, canon in fam.tensor_map(model_config))
    return [(keys[t.name], t.shape, t.layer) for t in canonical_tensors(model_config)]


# MXFP4 experts as released: random FP4 codes (uniform bytes: both nibbles uniform over the
# 16 codes, symmetric about 0, RMS 2.93) times 2^(MX_SCALE - 127), so std ~ 0.023 ~ INIT_STD
MX_SCALE = 120


def _mxfp4_plan(cfg, plan):
    """GPT-OSS: each fused expert key of the plan (listed once per expert slice) once, in the
    released layout, uint8 blocks (E, R, C/32, 16) and scales (E, R, C/32) per projection."""
    E, D, I = cfg.num_local_experts, cfg.hidden_size, cfg.intermediate_size
    mx = {"gate_up_proj": (2 * I, D), "down_proj": (D, I)}
    out, seen = [], set()
    for key, shape, layer in plan:
        if key in seen:
            continue
        seen.add(key)
        name = key.rsplit(".", 1)[-1]
        for proj, (rows, cols) in mx.items():
            if name in (proj, proj + "_blocks"):
                stem = key.rsplit(".", 1)[0] + "." + proj
                out.append((stem + "_blocks", (E, rows, cols // 32, 16), layer))
                out.append((stem + "_scales", (E, rows, cols // 32), layer))
                break
        else:
            if name == "gate_up_proj_bias":      # the plan holds one interleaved half
                shape = (E, 2 * I)
            out.append((key, shape, layer))
    return out


def _draw(rng: np.random.Generator, key: str, shape: tuple[int, ...]) -> np.ndarray:
    """bf16 values of one tensor: norm weights 1, everything else N(0, INIT_STD); MXFP4
    blocks uniform bytes and scales MX_SCALE (see MX_SCALE)."""
    import ml_dtypes
    if key.endswith("_blocks"):
        return rng.integers(0, 256, size=shape, dtype=np.uint8)
    if key.endswith("_scales"):
        return np.full(shape, MX_SCALE, dtype=np.uint8)
    if key.endswith("norm.weight") or "layernorm" in key:
        return np.ones(shape, dtype=ml_dtypes.bfloat16)
    a = rng.standard_normal(shape, dtype=np.float32)
    a *= np.float32(INIT_STD)
    return a.astype(ml_dtypes.bfloat16)


def write_weights(cfg, folder: Path, seed: int) -> int:
    """bf16 safetensors shards (embedding + head in their own shards, one per layer) and the
    index; returns the parameter count."""
    from safetensors.numpy import save_file

    plan = _tensor_plan(cfg)
    if cfg.model_type == "gpt_oss":
        plan = _mxfp4_plan(cfg, plan)
    groups: dict[str, list[tuple[str, tuple[int, ...]]]] = {}
    for key, shape, layer in plan:
        group = f"layer{layer:03d}" if layer is not None else (
            "embed" if "embed" in key else "head")
        groups.setdefault(group, []).append((key, shape))
    order = ["embed"] + sorted(g for g in groups if g.startswith("layer")) + ["head"]
    order = [g for g in order if g in groups]
    n = len(order)
    weight_map, total_bytes, params = {}, 0, 0
    rng = np.random.default_rng(seed)
    for i, g in enumerate(order, 1):
        fname = f"model-{i:05d}-of-{n:05d}.safetensors"
        shard = {}
        for key, shape in groups[g]:
            shard[key] = _draw(rng, key, shape)
            weight_map[key] = fname
            total_bytes += shard[key].nbytes
            params += shard[key].size
        save_file(shard, str(folder / fname), metadata={"format": "pt"})
        del shard
    index = {"metadata": {"total_size": total_bytes, "total_parameters": params},
             "weight_map": dict(sorted(weight_map.items()))}
    (folder / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")
    return params


def write_hf(name: str, folder: Path, seed: int) -> int:
    from transformers import GenerationConfig
    folder.mkdir(parents=True, exist_ok=True)
    cfg = make_config(name)
    cfg.save_pretrained(folder)
    GenerationConfig.from_model_config(cfg).save_pretrained(folder)
    write_tokenizer(cfg, folder)
    return write_weights(cfg, folder, seed)


def verify_hf(folder: Path) -> None:
    """Load the folder with transformers; raise if keys are missing or unexpected."""
    import torch
    from transformers import AutoModelForCausalLM
    model, info = AutoModelForCausalLM.from_pretrained(
        folder, dtype=torch.bfloat16, output_loading_info=True)
    bad = {k: v for k, v in info.items() if v and k in ("missing_keys", "unexpected_keys",
                                                          "mismatched_keys")}
    if bad:
        raise SystemExit(f"{folder}: transformers does not load it cleanly: {bad}")
    del model


# ---------------------------------------------------------------------------------------------
# driver


def make(name: str, out: Path, quants: tuple[str, ...], seed: int, force: bool,
         verify: bool) -> Written:
    from colibri.convert import convert
    root = out / name
    hf = root / "hf"
    w = Written(name, root)
    if force and hf.exists():
        shutil.rmtree(hf)
    if not (hf / "model.safetensors.index.json").exists():
        t0 = time.perf_counter()
        w.params = write_hf(name, hf, seed)
        w.seconds["hf"] = time.perf_counter() - t0
        print(f"{name}: HF folder, {w.params / 1e9:.3f} B params, "
              f"{w.seconds['hf']:.0f} s", flush=True)
    else:
        print(f"{name}: HF folder exists, kept (--force to rewrite)", flush=True)
    if verify:
        verify_hf(hf)
        print(f"{name}: transformers loads it with no missing/unexpected keys", flush=True)
    for q in quants:
        dst = root / f"{name}-{q}.colibri"
        if dst.exists() and not force:
            print(f"{name}: {dst.name} exists, kept", flush=True)
            w.files[q] = dst
            continue
        t0 = time.perf_counter()
        if q == "bf16":
            convert(hf, dst, dtype="bf16", quant="none", force=True, progress=False,
                    meta={"source": f"make_bench_models {name} seed {seed}"})
        else:
            convert(hf, dst, dtype="bf16", quant=q, quantize=ALL_ROLES, force=True,
                    progress=False, meta={"source": f"make_bench_models {name} seed {seed}"})
        w.seconds[q] = time.perf_counter() - t0
        w.files[q] = dst
        print(f"{name}: {dst.name} {dst.stat().st_size / 1e9:.3f} GB, {w.seconds[q]:.0f} s",
              flush=True)
    return w


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default="bench-models", help="output folder (default %(default)s)")
    ap.add_argument("--only", action="append", choices=sorted(MODELS), default=None,
                    help="make only this model (repeatable)")
    ap.add_argument("--small", action="store_true",
                    help=f"the CI-scale variants ({', '.join(SMALL)}) instead of the full ones")
    ap.add_argument("--quants", default=",".join(QUANTS),
                    help="comma-separated subset of q4,q8,bf16 (default all)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--force", action="store_true", help="rewrite existing folders and files")
    ap.add_argument("--verify", action="store_true",
                    help="load each HF folder with transformers and check its keys")
    args = ap.parse_args(argv)
    names = args.only or list(SMALL if args.small else FULL)
    quants = tuple(q.strip() for q in args.quants.split(",") if q.strip())
    bad = [q for q in quants if q not in QUANTS]
    if bad:
        ap.error(f"unknown --quants {bad}; expected a subset of {', '.join(QUANTS)}")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    free = shutil.disk_usage(out).free
    print(f"writing {', '.join(names)} to {out} ({free / 1e9:.0f} GB free)", flush=True)
    for name in names:
        make(name, out, quants, args.seed, args.force, args.verify)
    return 0


if __name__ == "__main__":
    sys.exit(main())
