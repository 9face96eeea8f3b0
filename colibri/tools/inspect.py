"""What is inside a .colibri file: header, metadata, tensor table, totals, rows, validation.

Functions return plain dicts (the `--json` output); `format_*` turn them into compact, aligned
text for `colibri inspect`. Nothing here reads tensor data except `tensor_rows` (the rows
asked for) and `validate` (everything). A file is reported whatever its metadata holds: the
counts that need the model's geometry use the typed config when the "arch" metadata makes
one (`model_config`), and the report prints the "arch" object as the file stores it.
"""
from __future__ import annotations

import difflib
import math
import re
from typing import Any

import numpy as np

from ..config import ConfigError, ModelConfig
from ..errors import ColibriError
from ..families import FAMILIES
from ..format import ColibriFile, QuantizedTensor, quant, validation

_EXPERT_RE = re.compile(r"layers\.(\d+)\.moe\.experts\.(\d+)\.(w_gate|w_up|w_down)")


# --- facts ------------------------------------------------------------------------------------

def model_config(cf: ColibriFile) -> ModelConfig | None:
    """The file's typed config, or None when its "arch" metadata is missing or not a valid one
    (a file is still worth inspecting then)."""
    try:
        return cf.model_config
    except ConfigError:
        return None


def totals(cf: ColibriFile) -> dict[str, Any]:
    """Parameter and byte counts; active parameters per token = every non-expert parameter +
    top_k routed experts in each MoE layer (the shared expert and dense layers always run)."""
    params = nbytes = expert_params = expert_bytes = 0
    by_dtype: dict[str, dict[str, int]] = {}
    expert_layers: set[int] = set()
    for info in cf.tensors.values():
        n = math.prod(info.shape)
        params += n
        nbytes += info.nbytes
        d = by_dtype.setdefault(info.dtype, {"tensors": 0, "parameters": 0, "bytes": 0})
        d["tensors"] += 1
        d["parameters"] += n
        d["bytes"] += info.nbytes
        m = _EXPERT_RE.fullmatch(info.name)
        if m:
            expert_params += n
            expert_bytes += info.nbytes
            expert_layers.add(int(m.group(1)))
    n_experts = cf.n_experts
    n_blocks = len(expert_layers) * n_experts
    per_expert_params = expert_params // n_blocks if n_blocks else 0
    config = model_config(cf)
    top_k = config.num_experts_per_tok if config is not None else None
    if top_k is not None:
        active = params - expert_params + len(expert_layers) * min(top_k, n_experts) * \
            per_expert_params
    else:       # no arch to say how many experts a token uses
        top_k, active = None, (params if not expert_layers else None)
    block = cf.expert_block(min(expert_layers), 0)[1] if expert_layers else 0
    return {
        "parameters": params,
        "active_parameters_per_token": active,
        "tensor_bytes": nbytes,
        "file_bytes": cf.file_size,
        "tensors": len(cf.tensors),
        "moe_layers": len(expert_layers),
        "experts_per_layer": n_experts if expert_layers else 0,
        "experts_per_token": top_k,
        "parameters_per_expert": per_expert_params,
        "bytes_per_expert": expert_bytes // n_blocks if n_blocks else 0,
        "expert_block_bytes": block,
        "by_dtype": by_dtype,
    }


def tokenizer_summary(cf: ColibriFile) -> dict[str, Any]:
    files = cf.tokenizer_files or {}
    return {"present": "tokenizer.json" in files, "files": sorted(files),
            "chat_template": "chat_template.jinja" in files or
            '"chat_template"' in files.get("tokenizer_config.json", "")}


def tensor_record(info) -> dict[str, Any]:
    """One TensorInfo as JSON-ready data."""
    return {"name": info.name, "dtype": info.dtype, "shape": list(info.shape),
            "offset": info.offset, "nbytes": info.nbytes, "group_size": info.group_size,
            "crc32": info.crc32}


def tensor_table(cf: ColibriFile) -> list[dict[str, Any]]:
    return [tensor_record(i) for i in cf.tensors.values()]


def summary(cf: ColibriFile) -> dict[str, Any]:
    """Everything `colibri inspect FILE --json` prints (tensor data untouched)."""
    header = {k: v for k, v in cf.header.items() if k != "reserved"}
    meta = cf.metadata
    return {
        "file": cf.path,
        "header": header,
        "arch": cf.arch,
        "config": cf.config,
        "user": cf.user_metadata,
        "converter": meta.get("converter"),
        "tokenizer": tokenizer_summary(cf),
        "tensors": tensor_table(cf),
        "totals": totals(cf),
    }


def suggest(cf: ColibriFile, name: str) -> str:
    close = difflib.get_close_matches(name, list(cf.tensors), n=3, cutoff=0.5)
    hint = f"; did you mean {', '.join(close)}?" if close else \
        f" ({len(cf.tensors)} tensors; `colibri inspect FILE` lists them)"
    return f"{cf.path}: no tensor named {name!r}{hint}"


def tensor_rows(cf: ColibriFile, name: str, rows: int = 4) -> np.ndarray:
    """float32 (min(rows, R), C): the first rows of tensor `name`, widened or dequantized.

    The leading dimensions are flattened (R = prod(shape[:-1])); a 1-D tensor is one row.
    Only those rows are read.
    """
    if name not in cf.tensors:
        raise ColibriError(suggest(cf, name))
    if rows < 1:
        raise ColibriError(f"--rows must be >= 1, found {rows}")
    info = cf.tensors[name]
    view = cf.tensor(name)
    cols = info.shape[-1]
    if isinstance(view, QuantizedTensor):
        data = view.data.reshape(-1, view.data.shape[-1])[:rows]
        scales = view.scales.reshape(-1, view.scales.shape[-1])[:rows]
        deq = quant.dequantize_q8 if info.dtype == "q8" else quant.dequantize_q4
        if info.dtype == "q8":
            data = data.view(np.int8)
        return deq(data, scales, info.group_size)
    part = np.asarray(view).reshape(-1, cols)[:rows]
    if info.dtype == "bf16":
        return quant.bf16_to_f32(part)
    return part.astype(np.float32)


def check_arch(cf: ColibriFile) -> list[str]:
    """Problems between the metadata's arch dict and the tensor table (missing / extra tensors,
    shapes, layer and expert counts); nothing when the arch names no known family."""
    arch = cf.arch
    family = arch.get("family") if isinstance(arch, dict) else None
    if not isinstance(family, str) or family not in FAMILIES:
        return [] if not arch else [f"metadata arch names unknown family "
                                    f"{arch.get('family')!r}"]
    try:
        config = cf.model_config
    except (KeyError, TypeError, ValueError) as e:       # ConfigError is a ValueError
        return [f"metadata arch is incomplete ({type(e).__name__}: {e})"]
    return validation.config_vs_tensors(cf, config)


def validate(cf: ColibriFile, progress: bool = False) -> list[str]:
    """Every problem a full read and a trial use find (colibri.format.validation.validate):
    checksums, padding, non-finite values, the typed config against the tensors and against
    config.json, the tokenizer and chat template. (Structure is checked at open.)"""
    return validation.validate(cf, progress=progress)


# --- text -------------------------------------------------------------------------------------

def human_bytes(n: int) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if n < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    raise AssertionError


def _count(n: int) -> str:
    for unit, div in (("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if n >= div:
            return f"{n / div:.2f}{unit}"
    return str(n)


def _shape(shape) -> str:
    return "x".join(str(d) for d in shape)


def _aligned(rows: list[tuple[str, ...]], right: set[int] = frozenset(), indent: str = "") -> str:
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    out = []
    for r in rows:
        cells = [c.rjust(w) if i in right else c.ljust(w) for i, (c, w) in
                 enumerate(zip(r, widths))]
        out.append(indent + "  ".join(cells).rstrip())
    return "\n".join(out)


def format_summary(s: dict[str, Any], full: bool = False) -> str:
    """The human report: overview, metadata, tensor table (experts folded unless full), totals."""
    a, h, t, conv = s["arch"] or {}, s["header"], s["totals"], s["converter"] or {}
    lines = [f"{s['file']}: colibri format v{h['version']}, {human_bytes(h['file_size'])}, "
             f"{h['tensor_count']} tensors"]
    facts: list[tuple[str, str]] = []
    if a:
        archs = ", ".join((s["config"] or {}).get("architectures") or [])
        facts.append(("family", f"{a.get('family')}" + (f" ({archs})" if archs else "")))
        moe = a.get("moe_layers", [])
        dense = a.get("num_hidden_layers", 0) - len(moe)
        facts.append(("layers", f"{a.get('num_hidden_layers')} ({len(moe)} MoE"
                      + (f", {dense} dense mlp {a.get('dense_intermediate_size')}" if dense
                         else "") + ")"))
        shared = a.get("shared_expert_intermediate_size") or 0
        facts.append(("experts", f"{a.get('num_experts')} x {a.get('moe_intermediate_size')}, "
                      f"top-{a.get('num_experts_per_tok')}, "
                      f"{'renormalised' if a.get('norm_topk_prob') else 'not renormalised'}"
                      + (f", shared expert {shared}" + (" (sigmoid gate)" if
                         a.get("shared_expert_gate") else "") if shared else "")
                      + router_summary(a)))
        if a.get("kv_lora_rank"):
            facts.append(("attention", mla_summary(a)))
        else:
            facts.append(_attention_fact(a))
        facts.append(("vocab", f"{a.get('vocab_size')}, context "
                      f"{a.get('max_position_embeddings')}, rope theta {a.get('rope_theta')}"
                      + (f" ({a['rope_scaling'].get('rope_type')})" if a.get("rope_scaling")
                         else "") + (", tied embeddings" if a.get("tie_word_embeddings")
                                     else "")))
    if conv:
        q = conv.get("quant", "none")
        quantized = (f", {q} g{conv.get('group_size')} on {','.join(conv.get('quantized', []))}"
                     if q != "none" else "")
        facts.append(("converter", f"colibri {conv.get('colibri_version')} from "
                      f"{conv.get('source')} on {conv.get('date')}: {conv.get('dtype')}"
                      f"{quantized}, router {conv.get('router_dtype', 'f32')}"))
    tok = s["tokenizer"]
    facts.append(("tokenizer", ", ".join(tok["files"]) if tok["files"] else
                  "none (token ids only)"))
    for k, v in sorted((s["user"] or {}).items()):
        facts.append((f"user.{k}", str(v)))
    facts.append(("header", f"data at {h['data_offset']}, routing at {h['routing_offset']}, "
                  f"{h['expert_count']} expert blocks, metadata {h['metadata_size']} B, "
                  f"checksums {'yes' if h['flags'] & 1 else 'no'}"))
    lines.append(_aligned(facts, indent="  "))

    lines.append("")
    rows = [("name", "dtype", "shape", "offset", "bytes")]
    notes: dict[int, str] = {}     # row index -> a folded-experts line printed after it
    for r in s["tensors"]:
        m = _EXPERT_RE.fullmatch(r["name"])
        if m and int(m.group(2)) > 0 and not full:
            continue            # experts 1.. of a layer repeat expert 0's layout
        dtype = r["dtype"] + (f"/g{r['group_size']}" if r["group_size"] else "")
        rows.append((r["name"], dtype, _shape(r["shape"]), str(r["offset"]), str(r["nbytes"])))
        if m and m.group(3) == "w_down" and not full and h["n_experts"] > 1:
            n = h["n_experts"] - 1
            notes[len(rows) - 1] = (f"layers.{m.group(1)}.moe.experts.{{1..{n}}}.*  ... {n} "
                                    f"more experts, same layout (--full lists them)")
    table = _aligned(rows, right={3, 4}).split("\n")
    for i, line in enumerate(table):
        lines.append(line)
        if i in notes:
            lines.append(notes[i])

    lines.append("")
    active = t["active_parameters_per_token"]
    active = "unknown (no arch metadata)" if active is None else \
        f"{active:,} ({active / max(1, t['parameters']):.1%})"
    tot = [("parameters", f"{t['parameters']:,} ({_count(t['parameters'])}), active per "
            f"token {active}"),
           ("bytes", f"{t['tensor_bytes']:,} in tensors, file {t['file_bytes']:,} "
            f"({human_bytes(t['file_bytes'])})")]
    if t["moe_layers"]:
        tot.append(("experts", f"{t['experts_per_layer']} per layer x {t['moe_layers']} MoE "
                    f"layers" + (f", top-{t['experts_per_token']}" if t["experts_per_token"]
                                 else "") + f"; {t['parameters_per_expert']:,} "
                    f"params, {t['bytes_per_expert']:,} B per expert (block "
                    f"{t['expert_block_bytes']:,} B)"))
    tot.append(("by dtype", ", ".join(f"{d} {human_bytes(v['bytes'])} ({v['tensors']})"
                                      for d, v in t["by_dtype"].items())))
    lines.append(_aligned(tot, indent="  "))
    return "\n".join(lines)


def format_rows(name: str, info, rows: np.ndarray) -> str:
    """Rows of one tensor, one line each, with min/max/mean|x| so large rows stay readable."""
    head = f"{name}: {info.dtype} {_shape(info.shape)}" + (
        f" (group {info.group_size}, dequantized)" if info.group_size else "")
    out = [head]
    with np.printoptions(precision=4, suppress=False, threshold=12, edgeitems=4,
                         linewidth=200):
        for i, r in enumerate(rows):
            stats = (f"min {r.min():.4g} max {r.max():.4g} mean|x| {np.abs(r).mean():.4g}"
                     if r.size else "")
            out.append(f"  [{i}] {np.array2string(r, separator=' ')}  {stats}")
    return "\n".join(out)


def router_summary(a: dict) -> str:
    """The routing rule beyond softmax top-k (DeepSeek / GLM group routers, scaling)."""
    rule = a.get("router", "softmax_topk")
    text = "" if rule == "softmax_topk" else f", router {rule}"
    if rule.endswith("_group_topk"):
        text += f" ({a.get('topk_group', 1)} of {a.get('n_group', 1)} groups)"
    scale = a.get("routed_scaling_factor", 1.0)
    return text + (f", weights x {scale}" if scale != 1.0 else "")


def mla_summary(a: dict) -> str:
    """Multi-head latent attention: latent and rotary widths, per-head dims."""
    q = f", q lora {a['q_lora_rank']}" if a.get("q_lora_rank") else ""
    return (f"hidden {a.get('hidden_size')}, MLA: heads {a.get('num_attention_heads')} x "
            f"(nope {a.get('qk_nope_head_dim')} + rope {a.get('head_dim')}), v "
            f"{a.get('v_head_dim')}, cached latent {a.get('kv_lora_rank')} + rope key "
            f"{a.get('head_dim')}{q}")


def _attention_fact(a: dict) -> tuple[str, str]:
    return ("attention", f"hidden {a.get('hidden_size')}, heads "
            f"{a.get('num_attention_heads')}/{a.get('num_key_value_heads')} x "
            f"{a.get('head_dim')}, qk_norm {a.get('qk_norm')}"
            + (f", rotary {a['partial_rotary_factor']}" if a.get("partial_rotary_factor", 1.0)
               != 1.0 else "")
            + (", qkv bias" if a.get("attention_bias") else "")
            + (f", clip_qkv {a['clip_qkv']}" if a.get("clip_qkv") else "")
            + (f", window {a['sliding_window']}" if a.get("sliding_window") else ""))
