"""Rich notebook display: `_repr_html_` of Model, Trace and RoutingStats, as plain HTML strings.

IPython shows the string a `_repr_html_` returns; nothing here imports IPython. Every piece of
text that comes from a file (names, config values, token texts) goes through html.escape, so a
token like "<script>" shows as text. Styles are inline (a notebook strips <style> blocks in some
front ends) and tables are small: the trace table shows at most `max_tokens` rows.
"""
from __future__ import annotations

import json
import math
import re
from html import escape

import numpy as np

from .inspect import human_bytes, mla_summary, router_summary, totals

__all__ = ["model_html", "trace_html", "stats_html", "tensor_groups", "expert_colour"]

_TABLE = ("border-collapse:collapse;font-family:ui-monospace,SFMono-Regular,Menlo,monospace;"
          "font-size:12px")
_CELL = "padding:1px 6px;border:1px solid #ddd;text-align:left;vertical-align:top"
_HEAD = _CELL + ";background:#f3f3f3;font-weight:600"

# tensor name (canonical, docs/format.md §7) -> group shown in the model card
_GROUPS = (
    ("embedding", re.compile(r"tok_embeddings")),
    ("head", re.compile(r"lm_head")),
    ("router", re.compile(r"layers\.\d+\.moe\.router")),
    ("routed experts", re.compile(r"layers\.\d+\.moe\.experts\..*")),
    ("shared expert", re.compile(r"layers\.\d+\.moe\.shared.*")),
    ("dense mlp", re.compile(r"layers\.\d+\.mlp\..*")),
    ("attention", re.compile(r"layers\.\d+\.attn\.(wq|wk|wv|wo|bq|bk|bv|bo)")),
    ("norms", re.compile(r"(.*norm.*)")),
)


def _e(x) -> str:
    return escape(str(x), quote=True)


def _table(rows: list[tuple], header: tuple | None = None) -> str:
    out = [f'<table style="{_TABLE}">']
    if header:
        out.append("<tr>" + "".join(f'<th style="{_HEAD}">{_e(h)}</th>' for h in header) + "</tr>")
    for r in rows:
        out.append("<tr>" + "".join(f'<td style="{_CELL}">{c}</td>' for c in r) + "</tr>")
    out.append("</table>")
    return "".join(out)


def _bytes(n: int) -> str:
    return human_bytes(int(n))


def _count(n: int) -> str:
    for unit, div in (("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if n >= div:
            return f"{n / div:.2f}{unit}"
    return str(n)


def tensor_groups(cf) -> list[dict]:
    """Per tensor group (embedding, attention, router, routed experts, ...): dtypes, count,
    parameters, bytes; in the order of _GROUPS, empty groups left out."""
    acc: dict[str, dict] = {}
    for info in cf.tensors.values():
        group = next((g for g, rx in _GROUPS if rx.fullmatch(info.name)), "other")
        d = acc.setdefault(group, {"group": group, "dtypes": set(), "tensors": 0,
                                   "parameters": 0, "bytes": 0})
        d["dtypes"].add(info.dtype + (f"/g{info.group_size}" if info.group_size else ""))
        d["tensors"] += 1
        d["parameters"] += math.prod(info.shape)
        d["bytes"] += info.nbytes
    order = [g for g, _ in _GROUPS] + ["other"]
    return [dict(acc[g], dtypes=sorted(acc[g]["dtypes"])) for g in order if g in acc]


def model_html(model) -> str:
    """Model card: family, layers, experts, attention, sizes, formats per tensor group, file."""
    cf, c = model.file, model.config
    t = totals(cf)
    archs = ", ".join((model.hf_config or {}).get("architectures") or [])
    n_layers, moe = c.num_hidden_layers, c.moe_layer_ids
    shared = c.shared_expert_intermediate_size
    active = t["active_parameters_per_token"]
    facts = [
        ("family", f"{c.family}" + (f" ({archs})" if archs else "")),
        ("layers", f"{n_layers} ({len(moe)} MoE"
         + (f", {n_layers - len(moe)} dense" if n_layers - len(moe) else "") + ")"),
        ("experts", f"{c.num_experts} × {c.moe_intermediate_size} per MoE layer, "
         f"top-{c.num_experts_per_tok}, "
         + ("renormalised" if c.norm_topk_prob else "not renormalised")
         + (f", shared expert {shared}" + (" (sigmoid gate)" if c.shared_expert_gate
                                          else "") if shared else "")
         + router_summary(c.to_metadata())),
        ("attention", mla_summary(c.to_metadata()) if c.is_mla else
         f"hidden {c.hidden_size}, heads {c.num_attention_heads}/"
         f"{c.num_key_value_heads} × {c.head_dim}, qk_norm {c.qk_norm}"),
        ("vocab / context", f"{c.vocab_size} / {model.max_context}"),
        ("parameters", f"{_count(t['parameters'])} total"
         + (f", {_count(active)} active per token ({active / max(1, t['parameters']):.1%})"
            if active is not None else "")),
        ("per expert", f"{t['parameters_per_expert']:,} parameters, "
         f"{_bytes(t['bytes_per_expert'])} ({t['bytes_per_expert']:,} B; block "
         f"{t['expert_block_bytes']:,} B)"),
        ("file", f"{cf.path} — {_bytes(cf.file_size)}, format v{cf.version}"),
        ("mapping", "mmap, read-only, zero-copy: resident memory grows with the experts the "
                    "router touches"),
        ("tokenizer", "embedded" if cf.tokenizer_files else "none (token ids only)"),
        ("threads", str(model.threads)),
    ]
    conv = cf.metadata.get("converter") or {}
    if conv:
        facts.append(("converted", f"colibri {conv.get('colibri_version')} from "
                      f"{conv.get('source')}, {conv.get('date')}"))
    groups = [(_e(g["group"]), _e(", ".join(g["dtypes"])), str(g["tensors"]),
               _e(_count(g["parameters"])), _e(_bytes(g["bytes"]))) for g in tensor_groups(cf)]
    config = json.dumps(model.hf_config, indent=1, sort_keys=True, default=str)
    return (
        f'<div style="font-family:sans-serif;font-size:13px">'
        f"<b>colibri Model</b> {_e(c.family)}"
        + _table([(f"<b>{_e(k)}</b>", _e(v)) for k, v in facts])
        + "<details><summary>formats per tensor group</summary>"
        + _table(groups, ("group", "format", "tensors", "parameters", "bytes")) + "</details>"
        + f"<details><summary>config.json</summary><pre>{_e(config)}</pre></details></div>")


def expert_colour(e: int, n_experts: int, weight: float = 1.0) -> str:
    """A background colour per expert id (hue around the wheel), paler for a lower weight."""
    hue = (360.0 * int(e) / max(1, n_experts) + 20.0) % 360.0
    light = 92 - 20 * min(1.0, max(0.0, float(weight)))
    return f"hsl({hue:.0f},70%,{light:.0f}%)"


def trace_html(trace, max_tokens: int = 64) -> str:
    """Tokens × MoE layers; each cell lists the chosen experts, coloured by the top expert,
    with weights (and probabilities when known) in the tooltip."""
    T, E = len(trace), trace.n_experts
    n = min(T, max_tokens)
    head = ("#", "token") + tuple(f"L{layer}" for layer in trace.layers)
    rows = []
    for t in range(n):
        cells = [str(t), f"<code>{_e(repr(trace.tokens[t]))}</code>"]
        for j, layer in enumerate(trace.layers):
            ids, w = trace.experts[t, j], trace.weights[t, j]
            tip = ", ".join(f"{int(e)}: w {float(x):.3f}" for e, x in zip(ids, w))
            if trace.shared_gate is not None:
                tip += f"; shared gate {float(trace.shared_gate[t, j]):.3f}"
            colour = expert_colour(ids[0], E, w[0] / max(float(w.sum()), 1e-9))
            cells.append(f'<span style="background:{colour};display:block;padding:0 3px" '
                         f'title="{_e(tip)}">{_e(" ".join(str(int(e)) for e in ids))}</span>')
        rows.append(tuple(cells))
    more = f"<div>… {T - n} more tokens</div>" if T > n else ""
    return (f'<div style="font-family:sans-serif;font-size:13px"><b>colibri Trace</b>: '
            f"{T} tokens × {trace.n_layers} MoE layers, top-{trace.top_k} of {E} experts "
            f"(cells: expert ids by weight; hover for weights)"
            + _table(rows, head) + more + "</div>")


def stats_html(stats) -> str:
    """The summary table of RoutingStats, utilisation cells shaded."""
    s = stats.summary()
    f = lambda x, nd=2: "-" if x is None else f"{x:.{nd}f}"  # noqa: E731
    head = ("layer", "cv", "aux loss", "entropy", "marginal", "util min..max", "dead", "rare",
            "persistence") + tuple(f"LRU {n}" for n in s["lru_sizes"])
    rows = []
    for r in s["per_layer"]:
        rows.append((f"L{r['layer']}", f(r["cv"]), f(r["aux_loss"]), f(r["entropy"]),
                     f(r["marginal_entropy"]),
                     f"{f(r['utilisation_min'])}..{f(r['utilisation_max'])}",
                     _e(",".join(map(str, r["dead"])) or "-"),
                     _e(",".join(map(str, r["rare"])) or "-"), f(r["persistence"]))
                    + tuple(f(r["lru_hit_rate"][str(n)]) for n in s["lru_sizes"]))
    u = np.asarray(stats.utilisation)
    grid = []
    for j, layer in enumerate(s["layers"]):
        cells = [f"L{layer}"]
        for e in range(s["n_experts"]):
            v = float(u[j, e])
            shade = ("#000" if v == 0 else
                     f"hsl({0 if v > 1 else 220},70%,{100 - 35 * min(1.0, abs(v - 1)):.0f}%)")
            cells.append(f'<span style="background:{shade};display:block;min-width:2em;'
                         f'color:{"#fff" if v == 0 else "#000"}" title="expert {e}: '
                         f'utilisation {v:.2f}">{v:.2f}</span>')
        grid.append(tuple(cells))
    return (f'<div style="font-family:sans-serif;font-size:13px"><b>colibri RoutingStats</b>: '
            f"{s['tokens']} tokens, top-{s['top_k']} of {s['n_experts']} experts, aux loss "
            f"{f(s['aux_loss'], 3)} (balanced = {s['top_k']}), entropy in nats (max "
            f"{f(s['max_entropy'])})" + _table(rows, head)
            + "<details><summary>utilisation per expert (load / fair share)</summary>"
            + _table(grid, ("layer",) + tuple(str(e) for e in range(s["n_experts"])))
            + "</details></div>")
