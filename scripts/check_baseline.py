"""A saved baseline of the engine's outputs, and the exact comparison against it: what proves
a redesign kept every bit.

    python scripts/check_baseline.py save DIR      # the models (once) and the outputs
    python scripts/check_baseline.py compare DIR   # the outputs again, compared bit for bit
    COLIBRI_ISA=avx2 python scripts/check_baseline.py compare DIR     # on one ISA path
    python scripts/check_baseline.py steps FILE [--prefill 8] [--decode 10]

`save` makes, in DIR/models, tiny random checkpoints of every family (transformers, seeded:
mixtral with and without a sliding window, qwen2_moe, qwen3_moe, olmoe, glm4_moe,
granitemoe, gpt_oss, deepseek_v2, deepseek_v3, dbrx, phimoe) converted to f32, bf16, f16,
q8 and q4 (q4 / q8 over every role; GPT-OSS also its MXFP4 experts as released), plus the
shipped model; the files are made once and reused, so save and compare see the same bytes.
Then, per file and per activation setting (f32, int16, int8) and KV cache dtype (f16, bf16,
f32), DIR/<ISA>/<case>.npz holds: the logits of a prefill and of decode steps (one with
its routing), the KV cache bytes, valid slots and positions, a stateless forward, a padded
batch (left padding, its routing ids and weights, a batched decode step after it), a
ragged step (a decode segment beside a prefill chunk, its routing, then both decoding), a
prefill and a step given as embeddings, greedy tokens of generate for one prompt and for a
list, seeded sampled tokens; and for int16 / f16: two threads, a memory budget (decode,
generate, its expert cache's hit counts) and the expert telemetry on. `compare` recomputes
every array and names each one that differs in a single bit (or in shape / dtype), per case.

`steps` runs only a prefill of P tokens and N decode steps of FILE (1 thread, nothing
timed): the run to count instructions of with callgrind, e.g.
`PYTHONHASHSEED=0 COLIBRI_ISA=avx2 valgrind --tool=callgrind --callgrind-out-file=cg.out
python scripts/check_baseline.py steps FILE --decode 10` and again with --decode 2: the
difference over 8 steps is the count of one decode step (--prefill 16 against 8 likewise).
"""
from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))

import colibri  # noqa: E402
from colibri.kernels import runtime  # noqa: E402

_SMALL = dict(vocab_size=320, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, max_position_embeddings=256, bos_token_id=1,
              eos_token_id=2, pad_token_id=0, initializer_range=0.15)
FORMATS = {"f32": dict(dtype="f32"), "bf16": dict(dtype="bf16"), "f16": dict(dtype="f16"),
           "q8": dict(dtype="f32", quant="q8", quantize="experts,shared,attn,head,dense"),
           "q4": dict(dtype="f32", quant="q4", quantize="experts,shared,attn,head,dense")}
ACTIVATIONS = ("f32", "int16", "int8")
KV_DTYPES = ("f16", "bf16", "f32")


def _configs() -> dict:
    """family case -> a transformers config (the quirks each exercises as in
    tests/test_decode_layer.py)."""
    import transformers
    from hf_factory import tiny_config
    return {
        "mixtral": tiny_config("mixtral", initializer_range=0.15),
        "mixtral-window": tiny_config("mixtral", initializer_range=0.15, sliding_window=4),
        "qwen2_moe": tiny_config("qwen2_moe", initializer_range=0.15, use_sliding_window=True,
                                 sliding_window=4, max_window_layers=1),
        "qwen3_moe": tiny_config("qwen3_moe", initializer_range=0.15),
        "olmoe": tiny_config("olmoe", initializer_range=0.15, clip_qkv=0.5),
        "glm4_moe": tiny_config("glm4_moe", initializer_range=0.15),
        "granitemoe": transformers.GraniteMoeConfig(
            **_SMALL, intermediate_size=32, num_local_experts=4, num_experts_per_tok=2,
            tie_word_embeddings=False, embedding_multiplier=3.0, attention_multiplier=0.1,
            residual_multiplier=0.5, logits_scaling=2.5, attention_bias=True),
        "gpt_oss": transformers.GptOssConfig(
            **dict(_SMALL, num_hidden_layers=3), head_dim=16, intermediate_size=32,
            num_local_experts=4, num_experts_per_tok=2, sliding_window=4, swiglu_limit=1.0),
        "deepseek_v2": tiny_config("deepseek_v2", initializer_range=0.15),
        "deepseek_v3": tiny_config("deepseek_v3", initializer_range=0.15),
        "dbrx": transformers.DbrxConfig(
            d_model=64, n_heads=4, n_layers=2, max_seq_len=256, vocab_size=320,
            attn_config=dict(kv_n_heads=2, clip_qkv=0.5, rope_theta=5e5),
            ffn_config=dict(ffn_hidden_size=32, moe_num_experts=4, moe_top_k=2),
            initializer_range=0.15, bos_token_id=1, eos_token_id=2, pad_token_id=0),
        "phimoe": transformers.PhimoeConfig(
            **_SMALL, intermediate_size=32, num_local_experts=4, num_experts_per_tok=2),
    }


def _checkpoint(path: Path, config, seed: int = 0) -> Path:
    """save_pretrained of a random model of `config`, every parameter with its own noise,
    and the test tokenizer."""
    import torch
    import transformers
    from hf_factory import make_tokenizer
    transformers.utils.logging.disable_progress_bar()
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config)
    gen = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=gen) * 0.02)
        for name, b in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                b.add_(torch.randn(b.shape, generator=gen) * 0.05)
    model.save_pretrained(path)
    make_tokenizer(path)
    return path


def _mxfp4_folder(src: Path, dst: Path) -> Path:
    """src's GPT-OSS checkpoint with its experts as the released ones store them (MXFP4
    blocks and scales, rows = outputs)."""
    import shutil
    from safetensors.numpy import load_file, save_file
    from colibri.format import mxfp4
    tensors = load_file(str(src / "model.safetensors"))
    packed = {}
    for key, value in tensors.items():
        if key.endswith(("experts.gate_up_proj", "experts.down_proj")):
            w = np.ascontiguousarray(value.transpose(0, 2, 1))               # (E, R, C)
            codes, scales = mxfp4.quantize(w)
            E, R, C = w.shape
            packed[key + "_blocks"] = codes.reshape(E, R, C // 32, 16)
            packed[key + "_scales"] = scales
        else:
            packed[key] = value
    shutil.copytree(src, dst)
    save_file(packed, str(dst / "model.safetensors"), metadata={"format": "pt"})
    return dst


def make_models(folder: Path) -> dict[str, Path]:
    """case name -> .colibri file in folder (made when missing)."""
    from colibri.convert import convert
    folder.mkdir(parents=True, exist_ok=True)
    files = {"shipped": colibri.api.default_model_path()}
    for case, config in _configs().items():
        hf = folder / f"hf-{case}"
        for fmt, options in FORMATS.items():
            out = folder / f"{case}-{fmt}.colibri"
            if not out.exists():
                if not (hf / "config.json").exists():
                    _checkpoint(hf, config)
                convert(hf, out, progress=False, **options)
            files[f"{case}-{fmt}"] = out
        if case == "gpt_oss":
            out = folder / "gpt_oss-mxfp4.colibri"
            if not out.exists():
                convert(_mxfp4_folder(hf, folder / "hf-gpt_oss-mxfp4"), out, progress=False,
                        dtype="f32")
            files["gpt_oss-mxfp4"] = out
    return files


# ---------------------------------------------------------------------------------------------
# the outputs of one (file, activations, kv dtype)
# ---------------------------------------------------------------------------------------------

def _cache_arrays(out: dict, key: str, cache) -> None:
    n = cache.length
    for i, (k, v) in enumerate(zip(cache.k, cache.v)):
        out[f"{key}.k{i}"] = np.ascontiguousarray(k[:, :, :n])
        out[f"{key}.v{i}"] = np.ascontiguousarray(v[:, :, :n])
    out[f"{key}.valid"] = cache.valid[:, :n].copy()
    out[f"{key}.pos"] = cache.pos[:, :n].copy()


def _trace_arrays(out: dict, key: str, trace) -> None:
    for j, (ids, w) in enumerate(zip(trace.ids, trace.weights)):
        out[f"{key}.ids{j}"] = np.asarray(ids)
        out[f"{key}.w{j}"] = np.asarray(w)


def _core(m, tokens: np.ndarray, out: dict) -> None:
    """Prefill, decode steps, batches, ragged steps, embeddings, generate."""
    fwd = colibri.forward
    c = m.new_cache(ctx=40)
    out["prefill"] = fwd(m, tokens[:7], cache=c)
    out["decode"] = np.stack([fwd(m, np.array([t]), cache=c) for t in tokens[7:11]])
    logits, trace = fwd(m, np.array([tokens[11]]), cache=c, return_routing=True)
    out["decode_routed"] = logits
    _trace_arrays(out, "decode_routing", trace)
    out["decode_2d"] = fwd(m, np.array([[tokens[12]]]), cache=c)
    _cache_arrays(out, "cache", c)
    logits, trace = fwd(m, tokens[:6], return_routing=True)
    out["stateless"] = logits
    _trace_arrays(out, "stateless_routing", trace)
    # a padded batch: row 1 left-padded by 2
    ids = np.stack([tokens[:6], np.concatenate([[0, 0], tokens[20:24]])])
    mask = np.array([[1] * 6, [0, 0, 1, 1, 1, 1]])
    cb = m.new_cache(ctx=16, batch=2)
    logits, trace = fwd(m, ids, cache=cb, attention_mask=mask, return_routing=True)
    out["batch"] = logits
    _trace_arrays(out, "batch_routing", trace)
    out["batch_decode"] = fwd(m, tokens[24:26].reshape(2, 1), cache=cb)
    _cache_arrays(out, "batch_cache", cb)
    # ragged: a decoding sequence beside a prompt chunk, then both decoding
    c1, c2 = m.new_cache(ctx=16), m.new_cache(ctx=16)
    fwd(m, tokens[:5], cache=c1)
    logits, routing = m.forward_ragged([(c1, tokens[5:6]), (c2, tokens[10:14])],
                                       return_routing=True)
    out["ragged"] = logits
    for j, r in enumerate(routing):
        out[f"ragged_routing{j}"] = r
    out["ragged_decode"] = m.forward_ragged([(c1, tokens[6:7]), (c2, tokens[14:15])])
    out["ragged_one"] = m.forward_ragged([(c1, tokens[7:8])])
    _cache_arrays(out, "ragged_c1", c1)
    _cache_arrays(out, "ragged_c2", c2)
    # embeddings instead of ids
    ce = m.new_cache(ctx=16)
    out["embeds_prefill"] = fwd(m, input_embeds=m.embed(tokens[None, :5])[0], cache=ce)
    out["embeds_step"] = fwd(m, input_embeds=m.embed(tokens[None, 5:6])[0], cache=ce)
    out["positions_step"] = fwd(m, tokens[6:7], cache=ce, positions=np.array([6]))
    # generate: greedy, one prompt and a list; sampled with a seed
    p1, p2 = [int(t) for t in tokens[:5]], [int(t) for t in tokens[30:38]]
    out["gen_one"] = m.generate(p1, max_new_tokens=8, stop=[])
    for j, g in enumerate(m.generate([p1, p2], max_new_tokens=6, stop=[])):
        out[f"gen_list{j}"] = g
    out["gen_sampled"] = m.generate(p1, max_new_tokens=8, stop=[], temperature=0.9, top_k=20,
                                    top_p=0.95, min_p=0.01, repetition_penalty=1.2,
                                    presence_penalty=0.3, frequency_penalty=0.2, seed=7)
    out["gen_routing"] = np.stack([np.stack(s.routing.ids) for s in m.generate(
        p1, max_new_tokens=3, stop=[], return_routing=True) if s.routing is not None])


def _extras(path: Path, act: str, kv: str, tokens: np.ndarray, out: dict) -> None:
    """Two threads, a memory budget, the telemetry (each the same bits as the plain run)."""
    from colibri.experts.expert_cache import memory_plan
    from colibri.format import ColibriFile
    from colibri.experts.telemetry import ExpertTelemetry
    with colibri.load(path, threads=2, activations=act, kv_dtype=kv) as m:
        c = m.new_cache(ctx=24)
        out["t2.prefill"] = colibri.forward(m, tokens[:7], cache=c)
        out["t2.decode"] = np.stack([colibri.forward(m, np.array([t]), cache=c)
                                     for t in tokens[7:11]])
        out["t2.gen"] = m.generate([int(t) for t in tokens[:5]], max_new_tokens=6, stop=[])
    with ColibriFile(path) as f:
        plan = memory_plan(f)
    if not plan.layers:
        return
    budget = plan.minimum + 2 * plan.slot_bytes
    for mode in ("arena", "madvise"):
        with colibri.load(path, threads=1, activations=act, kv_dtype=kv, memory_budget=budget,
                          cache_mode=mode) as m:
            c = m.new_cache(ctx=24)
            out[f"budget_{mode}.prefill"] = colibri.forward(m, tokens[:7], cache=c)
            out[f"budget_{mode}.decode"] = np.stack([colibri.forward(m, np.array([t]), cache=c)
                                                     for t in tokens[7:11]])
            out[f"budget_{mode}.gen"] = m.generate([int(t) for t in tokens[:5]],
                                                   max_new_tokens=6, stop=[])
            st = m.expert_cache.stats()
            out[f"budget_{mode}.counts"] = np.array([st["hits"], st["misses"]])
    with colibri.load(path, threads=1, activations=act, kv_dtype=kv) as m:
        with ExpertTelemetry(m) as tel:
            c = m.new_cache(ctx=24)
            out["tel.prefill"] = colibri.forward(m, tokens[:7], cache=c)
            out["tel.decode"] = np.stack([colibri.forward(m, np.array([t]), cache=c)
                                          for t in tokens[7:11]])
            t = tel.collect()
            out["tel.accesses"] = (t.hits + t.misses).astype(np.int64)


def run_case(path: Path, act: str, kv: str) -> dict[str, np.ndarray]:
    tokens = np.random.default_rng(11).integers(3, 300, size=40)
    out: dict[str, np.ndarray] = {}
    with colibri.load(path, threads=1, activations=act, kv_dtype=kv) as m:
        tokens = tokens % m.config.vocab_size
        _core(m, tokens, out)
    if act == "int16" and kv == "f16":
        _extras(path, act, kv, tokens, out)
    return {k: np.asarray(v) for k, v in out.items()}


def _cases(files: dict[str, Path]):
    for name, path in files.items():
        for act in ACTIVATIONS:
            for kv in KV_DTYPES:
                yield f"{name}.{act}.{kv}", path, act, kv


def _differs(a: np.ndarray, b: np.ndarray) -> str | None:
    if a.shape != b.shape or a.dtype != b.dtype:
        return f"shape/dtype {a.shape} {a.dtype} -> {b.shape} {b.dtype}"
    if a.tobytes() != b.tobytes():
        if a.dtype.kind == "f":
            d = np.nanmax(np.abs(a.astype(np.float64) - b.astype(np.float64)))
            return f"values differ (max |diff| {d:.3g})"
        return "values differ"
    return None


def save_or_compare(folder: Path, compare: bool, only: str | None) -> int:
    import warnings
    warnings.simplefilter("ignore")
    files = make_models(folder / "models")
    out_dir = folder / runtime.get_isa()
    out_dir.mkdir(parents=True, exist_ok=True)
    bad = n = 0
    t0 = time.perf_counter()
    for case, path, act, kv in _cases(files):
        if only and only not in case:
            continue
        got = run_case(path, act, kv)
        n += 1
        target = out_dir / f"{case}.npz"
        if not compare:
            np.savez(target, **got)
            continue
        with np.load(target) as saved:
            want = {k: saved[k] for k in saved.files}
        problems = [f"{k}: missing now" for k in want if k not in got]
        problems += [f"{k}: new" for k in got if k not in want]
        problems += [f"{k}: {d}" for k in want if k in got
                     for d in [_differs(want[k], got[k])] if d]
        if problems:
            bad += 1
            print(f"DIFFERS {case}: " + "; ".join(problems[:8]))
    verb = "compared" if compare else "saved"
    print(f"{verb} {n} cases on {runtime.get_isa()} in {time.perf_counter() - t0:.0f} s"
          + (f": {bad} differ" if compare else ""))
    return 1 if bad else 0


def steps(path: str, prefill: int, decode: int) -> None:
    """Load, one prefill of `prefill` tokens, `decode` decode steps (1 thread)."""
    with colibri.load(path, threads=1) as m:
        tokens = np.arange(3, 3 + prefill + decode) % m.config.vocab_size
        c = m.new_cache(ctx=prefill + decode + 1)
        colibri.forward(m, tokens[:prefill], cache=c)
        for t in tokens[prefill:]:
            colibri.forward(m, np.array([t]), cache=c)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    for name in ("save", "compare"):
        s = sub.add_parser(name)
        s.add_argument("dir", type=Path)
        s.add_argument("--only", help="only the cases whose name contains this")
    s = sub.add_parser("steps")
    s.add_argument("file")
    s.add_argument("--prefill", type=int, default=8)
    s.add_argument("--decode", type=int, default=10)
    a = p.parse_args(argv)
    if a.cmd == "steps":
        steps(a.file, a.prefill, a.decode)
        return 0
    print(f"ISA {runtime.get_isa()}, load {os.getloadavg()[0]:.2f}")
    return save_or_compare(a.dir, a.cmd == "compare", a.only)


if __name__ == "__main__":
    sys.exit(main())
