"""Speed of a .colibri model, measured the way llama-bench measures llama.cpp.

    rows = run_bench("model.colibri", n_prompt=128, n_gen=64, threads=[1, 2], reps=5)
    print(format_markdown(rows))

Tests, per thread count (the names and the method follow llama.cpp's `llama-bench`, so the
two tables can be put side by side):

- ``pp{P}``: prompt processing. One forward pass over P random token ids into an empty KV
  cache, logits of the last position only (what a prefill computes); t/s = P / seconds.
- ``tg{N}``: text generation. N decode steps of one random token each, each a forward pass
  through the KV cache, starting at depth 0 (an empty cache, as llama-bench's tg does);
  t/s = N / seconds. Sampling is not timed (the next token is random, not sampled).
- with ``depth=D`` (llama-bench's ``-d``) both start after D random tokens were run into the
  cache, untimed (once per test: every repetition starts from the same cache cut back to D
  slots); the test is then called ``pp128 @ d512``. The cache is stored as ``kv_dtype``
  ("f16" by default; the ``kv`` column), and a decode step at depth D reads D slots of it.

Each test runs once untimed (warm-up), then `reps` times; t/s is reported as mean ± standard
deviation over the repetitions. Tokenization is never timed. The model is opened once per
thread count; the open time (ColibriFile + Model: read and check header, table and metadata,
mmap, build the weight views) is reported. Peak RSS is the process's high-water mark
(``getrusage``), interpreter included, read right after each test, before the bandwidth
measurement allocates its buffer. The share of time per stage comes from the model's timing
counters (Model.timings): router (router matmul + top-k), experts (routed experts, shared
expert, dense MLP layers), attention (norms, q/k/v/o, RoPE, attention over the cache), head
(final norm + output matmul); "other" is the rest of the wall time (input checks, embedding
lookup, cache bookkeeping, Python).

The roofline: decoding one token must read every weight it uses once (`bytes_per_token`:
attention, routers, the top-k experts of every MoE layer, shared experts, dense MLPs, norms,
the output head and one embedding row, from the file's tensor table). With the machine's
read bandwidth measured by `kernels.read_bandwidth` at the same thread count, the ceiling is
bandwidth / bytes per token, and tg t/s is reported as a fraction of it.
"""
from __future__ import annotations

import math
import os
import re
import resource
import sys
import time
from collections.abc import Callable, Iterable, Sequence
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import numpy as np

from .. import kernels
from ..api import default_model_path, load
from ..engine.decode_layer import decode_path
from ..engine.kv_cache import DEFAULT_KV_DTYPE, kv_dtype_name
from ..engine.model import DEFAULT_ACTIVATIONS
from ..errors import ColibriError
from ..experts.residency import fault_counts
from ..experts.telemetry import ExpertTelemetry
from ..format import ColibriFile
from ..kernels import runtime
from ..kernels.kernel_paths import format_kernel_paths, kernel_paths, matmul_formats
from ..version import __version__
from .inspect import model_config, totals

__all__ = ["run_bench", "bytes_per_token", "model_facts", "format_markdown", "format_roofline",
           "format_telemetry", "format_decode_paths",
           "format_machine_notes", "peak_rss_bytes", "json_ready", "DEFAULT_BANDWIDTH_BYTES"]

# Buffer of the bandwidth measurement: far beyond what the caches hold (a 64 MiB array already
# reads at DRAM speed on the reference machine, docs/benchmarks.md), small enough to allocate
# in a fraction of a second.
DEFAULT_BANDWIDTH_BYTES = 256 * 2**20

# Stages of Model.timings (colibri.kernels.runtime.STAGES) folded into the columns of the table.
SHARE_GROUPS = {"router": ("router",), "experts": ("experts", "shared", "dense"),
                "attention": ("attention",), "head": ("head",)}

_LAYER = re.compile(r"layers\.(\d+)\.(.+)")


# ---------------------------------------------------------------------------------------------
# what one decoded token reads
# ---------------------------------------------------------------------------------------------

def bytes_per_token(cf: ColibriFile) -> dict[str, int]:
    """Bytes of weights a decode step at batch 1 reads, by part, from the tensor table.

    attention: q/k/v/o (and their biases, q/k norms) of every layer; router: every MoE layer's
    router; experts: w_gate + w_up + w_down of top-k experts in every MoE layer (all experts of
    a layer have the same size); shared: the shared expert and its gate; dense: the MLP of
    layers without routed experts; norms: the RMSNorm weights; head: lm_head, or the whole
    tied embedding matrix; embedding: one row of tok_embeddings. "total" sums them.
    The KV cache is not counted (it depends on the context, not on the weights).
    """
    config = model_config(cf)
    t = cf.tensors
    k = config.num_experts_per_tok if config is not None else 0
    parts = dict.fromkeys(("attention", "router", "experts", "shared", "dense", "norms", "head",
                           "embedding"), 0)
    expert_layers: set[int] = set()
    for name, info in t.items():
        m = _LAYER.fullmatch(name)
        if name == "tok_embeddings":
            parts["embedding"] += info.nbytes // info.shape[0]
        elif name == "lm_head":
            parts["head"] += info.nbytes
        elif name == "norm":
            parts["norms"] += info.nbytes
        elif m is None:
            continue                                # not a tensor the runtime reads
        else:
            rest = m.group(2)
            if rest.startswith("attn."):
                parts["attention"] += info.nbytes
            elif rest in ("attn_norm", "ffn_norm"):
                parts["norms"] += info.nbytes
            elif rest == "moe.router":
                parts["router"] += info.nbytes
            elif rest.startswith("moe.shared"):     # moe.shared.* and moe.shared_gate
                parts["shared"] += info.nbytes
            elif rest.startswith("mlp."):
                parts["dense"] += info.nbytes
            elif rest.startswith("moe.experts."):
                expert_layers.add(int(m.group(1)))
    if "lm_head" not in t and "tok_embeddings" in t:    # tied: the head is the embedding
        parts["head"] += t["tok_embeddings"].nbytes
    if expert_layers and k < 1:
        raise ColibriError(f"{cf.path}: the file has routed experts but its arch metadata has "
                           f"no num_experts_per_tok")
    for layer in sorted(expert_layers):
        one = sum(t[f"layers.{layer}.moe.experts.0.{p}"].nbytes
                  for p in ("w_gate", "w_up", "w_down"))
        parts["experts"] += min(k, cf.n_experts) * one
    parts["total"] = sum(parts.values())
    return parts


# ---------------------------------------------------------------------------------------------
# facts about the model (the left columns of the table)
# ---------------------------------------------------------------------------------------------

def model_facts(cf: ColibriFile) -> dict[str, Any]:
    """Name, family, file size, parameters (total and active per token), format label."""
    tot = totals(cf)
    config = model_config(cf)
    by_dtype = {d: v["bytes"] for d, v in tot["by_dtype"].items()}
    nbytes = sum(by_dtype.values()) or 1
    # dtypes holding at least 5 % of the weight bytes, largest first: "q4+f16"
    label = "+".join(d for d, b in sorted(by_dtype.items(), key=lambda kv: -kv[1])
                     if b / nbytes >= 0.05)
    return {
        "model": Path(cf.path).stem,
        "model_path": str(cf.path),
        "family": config.family if config is not None else None,
        "size_bytes": cf.file_size,
        "n_params": tot["parameters"],
        "n_params_active": tot["active_parameters_per_token"],
        "n_experts": config.num_experts if config is not None else None,
        "n_experts_used": config.num_experts_per_tok if config is not None else None,
        "format": label,
        "bytes_by_dtype": by_dtype,
        "matmul_formats": matmul_formats(cf.tensors),
    }


def peak_rss_bytes() -> int:
    """High-water mark of this process's resident memory, in bytes."""
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return int(peak if sys.platform == "darwin" else peak * 1024)   # Linux reports KiB


# ---------------------------------------------------------------------------------------------
# the measurements
# ---------------------------------------------------------------------------------------------

def _as_list(x: int | Sequence[int] | None, name: str, minimum: int) -> list[int]:
    items = [x] if x is None or isinstance(x, (int, np.integer)) else list(x)
    out = []
    for v in items:
        if v is None:
            v = runtime.default_threads() if name == "threads" else v
        if isinstance(v, bool) or not isinstance(v, (int, np.integer)) or v < minimum:
            raise ValueError(f"{name} must be integers >= {minimum}, got {x!r}")
        out.append(int(v))
    if not out:
        raise ValueError(f"{name} is empty")
    return out


def _stage_delta(before: dict[str, float], after: dict[str, float]) -> dict[str, float]:
    return {k: after[k] - before[k] for k in after}


class _DepthCache:
    """The caches of one model's tests: one filled to the deepest depth once (untimed); per
    test a copy of it cut back to the test's depth (KVCache.truncate: the first D slots are
    the same random tokens for every D), and cut back again before each repetition, so no
    repetition prefills again; ctx = the deepest depth + the longest test."""

    def __init__(self, model, depth: int, ctx: int, dtype: str, rng: np.random.Generator):
        self.full = model.new_cache(ctx=ctx, dtype=dtype)
        if depth:
            model.forward(rng.integers(0, model.vocab_size, depth), cache=self.full,
                          last_only=True)
        self.depth, self.cache = depth, self.full

    def at(self, depth: int) -> "_DepthCache":
        """The copy for a test at `depth` (the filled cache itself is never written)."""
        self.depth, self.cache = depth, self.full.copy()
        self.cache.truncate(depth)
        return self

    def ready(self):
        self.cache.truncate(self.depth)
        return self.cache


def _pp_once(model, n: int, deep: _DepthCache, rng) -> tuple[float, dict[str, float]]:
    """One pp repetition: seconds and stage seconds of the timed part."""
    cache = deep.ready()
    ids = rng.integers(0, model.vocab_size, n)                               # (S,)
    before = model.timings.copy()
    t0 = time.perf_counter()
    model.forward(ids, cache=cache, last_only=True)
    dt = time.perf_counter() - t0
    return dt, _stage_delta(before, model.timings.copy())


def _tg_once(model, n: int, deep: _DepthCache, rng) -> tuple[float, dict[str, float]]:
    """One tg repetition: n single-token steps through the cache, from its depth."""
    cache = deep.ready()
    ids = rng.integers(0, model.vocab_size, n)         # drawn up front: not timed
    before = model.timings.copy()
    t0 = time.perf_counter()
    for tok in ids:
        model.forward(np.array([tok]), cache=cache, last_only=True)
    dt = time.perf_counter() - t0
    return dt, _stage_delta(before, model.timings.copy())


def _shares(stages: dict[str, float], wall: float) -> dict[str, float]:
    wall = wall or 1.0
    out = {g: sum(stages.get(s, 0.0) for s in members) / wall
           for g, members in SHARE_GROUPS.items()}
    out["other"] = max(0.0, 1.0 - sum(out.values()))
    return out


def _test_name(kind: str, n: int, depth: int) -> str:
    return f"{kind}{n}" + (f" @ d{depth}" if depth else "")


def _as_activations(x: str | Sequence[str]) -> list[str]:
    items = [x] if isinstance(x, str) else list(x)
    bad = [a for a in items if a not in kernels.ACTIVATIONS]
    if bad or not items:
        raise ValueError(f"activations must be among {', '.join(kernels.ACTIVATIONS)}, "
                         f"got {x!r}")
    return items


def _load_average() -> float | None:
    try:
        return os.getloadavg()[0]
    except OSError:                          # not available on this platform
        return None


def run_bench(model_path: str | os.PathLike | None = None, *,
              n_prompt: int | Sequence[int] = 128, n_gen: int | Sequence[int] = 64,
              threads: int | Sequence[int] | None = None, reps: int = 5,
              depth: int | Sequence[int] = 0,
              warmup: bool = True, seed: int = 0,
              activations: str | Sequence[str] = DEFAULT_ACTIVATIONS,
              kv_dtype: str | Sequence[str] = DEFAULT_KV_DTYPE,
              bandwidth_bytes: int = DEFAULT_BANDWIDTH_BYTES,
              progress: Callable[[str], None] | None = None, telemetry: bool = False,
              load_options: dict[str, Any] | None = None) -> list[dict[str, Any]]:
    """Run pp/tg tests on a .colibri model; one dict per (activations, threads, test).

    model_path: the file (None: the bundled model, colibri.api.default_model_path()).
    n_prompt / n_gen: prompt lengths for pp tests / decode steps for tg tests (an int or a
        list; 0 skips that kind of test). threads: an int, a list, or None (physical cores).
    reps: timed repetitions per test (>= 1), after one untimed warm-up unless warmup=False.
    depth: tokens already in the KV cache when a test starts (llama-bench -d), or a list of
        depths, each test run at each (the cache is filled once, to the deepest).
    seed: of the random token ids. activations: "int16" (the default), "f32" (exact) or
        "int8" (the fastest): what q4/q8 weights multiply, see colibri.load; or a list of
        them, each run in turn (plain-format weights run f32 under all three).
    kv_dtype: the KV cache's storage, "f16" (the default), "bf16" or "f32", or a list of
        them, each run in turn (colibri.load's kv_dtype).
    bandwidth_bytes: buffer of the read-bandwidth measurement
        (0 skips it and the roofline ceiling).
    progress: called with a short line before each test (e.g. print to stderr).
    telemetry: record every timed token's expert hits / misses and bytes read
        (colibri.experts.telemetry: mincore on the blocks used, or the expert cache's counters) into
        the row's "telemetry" (TokenTelemetry.summary); page faults per token
        (major_faults_per_token, minor_faults_per_token, from getrusage) are in every row.
    load_options: more keyword arguments of colibri.load (memory_budget, mlock, mmap, ...).

    Each row: model facts (model_facts), the test (test, n_prompt, n_gen, n_depth, n_threads,
    activations, isa, reps), load_average (1-minute, when the test started: other work on the
    machine shows here), spin_us and pool_backoffs (the thread pool's spin time, and how
    often its workers found themselves preempted during the test: cores shared), decode_path
    (decode_layer.decode_path: the compiled layers, or the Python ones and why), samples_s /
    samples_ts (per repetition), avg_ts, stddev_ts, open_ms,
    peak_rss_bytes, stage_seconds (summed over the timed repetitions), time_share (router /
    experts / attention / head / other, fractions of wall time), bytes_per_token (+ _detail),
    read_bandwidth_gbs, ceiling_ts (bandwidth / bytes per token) and ceiling_fraction
    (tg rows: avg_ts / ceiling_ts; None for pp rows or without a bandwidth figure).
    """
    path = default_model_path() if model_path is None else Path(model_path)
    prompts = [p for p in _as_list(n_prompt, "n_prompt", 0) if p > 0]
    gens = [n for n in _as_list(n_gen, "n_gen", 0) if n > 0]
    thread_counts = _as_list(threads, "threads", 1)
    acts = _as_activations(activations)
    kvs = [kv_dtype_name(k) for k in ([kv_dtype] if isinstance(kv_dtype, str) else kv_dtype)]
    if not prompts and not gens:
        raise ValueError("nothing to run: n_prompt and n_gen are both 0")
    if isinstance(reps, bool) or not isinstance(reps, (int, np.integer)) or reps < 1:
        raise ValueError(f"reps must be an integer >= 1, got {reps!r}")
    depths = _as_list(depth, "depth", 0)
    if bandwidth_bytes < 0:
        raise ValueError(f"bandwidth_bytes must be >= 0, got {bandwidth_bytes}")
    say = progress or (lambda line: None)

    with ColibriFile(path) as cf:
        facts = model_facts(cf)
        per_token = bytes_per_token(cf)
    stamp = datetime.now(timezone.utc).isoformat(timespec="seconds")
    rows: list[dict[str, Any]] = []
    for a, kv, t in ((a, kv, t) for a in acts for kv in kvs for t in thread_counts):
        t0 = time.perf_counter()
        model = load(path, threads=t, activations=a, kv_dtype=kv, **(load_options or {}))
        open_ms = (time.perf_counter() - t0) * 1e3
        need = max(depths) + max(prompts + gens)    # past the model's context: new_cache warns
        try:
            filled = _DepthCache(model, max(depths), need, kv, np.random.default_rng(seed + 1))
            tests = [(d, "pp", n, _pp_once) for d in depths for n in prompts] + \
                    [(d, "tg", n, _tg_once) for d in depths for n in gens]
            for depth, kind, n, once in tests:
                name = _test_name(kind, n, depth)
                say(f"bench: {facts['model']} threads {t} activations {a} {name}")
                load_avg = _load_average()
                backoffs0 = runtime.pool_backoffs()
                rng = np.random.default_rng(seed)
                deep = filled.at(depth)
                if warmup:
                    once(model, n, deep, rng)
                samples, stages = [], dict.fromkeys(model.timings.seconds, 0.0)
                recorder = ExpertTelemetry(model) if telemetry else None
                decode = decode_path(model)          # with the telemetry's sources on
                faults0 = fault_counts()
                for _ in range(reps):
                    dt, st = once(model, n, deep, rng)
                    samples.append(dt)
                    for k, v in st.items():
                        stages[k] += v
                faults = [b - a for a, b in zip(faults0, fault_counts())]
                tel = None
                if recorder is not None:
                    tel = recorder.collect()[-n * reps:].summary()   # the timed tokens only
                    recorder.close()
                tps = [n / s for s in samples]
                rows.append({
                    **facts, "test": name, "n_prompt": n if kind == "pp" else 0,
                    "n_gen": n if kind == "tg" else 0, "n_depth": depth, "n_threads": t,
                    "activations": a, "kv_dtype": kv,
                    "kv_cache_bytes": deep.cache.bytes_per_token * need,
                    "isa": runtime.get_isa(), "reps": reps,
                    "kernel_paths": kernel_paths(facts["matmul_formats"], a),
                    "decode_path": decode,
                    "warmup": warmup, "load_average": load_avg,
                    "spin_us": runtime.spin_us(),
                    "pool_backoffs": runtime.pool_backoffs() - backoffs0,
                    "samples_s": samples, "samples_ts": tps,
                    "avg_ts": float(np.mean(tps)),
                    "stddev_ts": float(np.std(tps, ddof=1)) if reps > 1 else 0.0,
                    "open_ms": open_ms, "peak_rss_bytes": peak_rss_bytes(),
                    "stage_seconds": stages, "time_share": _shares(stages, sum(samples)),
                    "bytes_per_token": per_token["total"], "bytes_per_token_detail": per_token,
                    "minor_faults_per_token": faults[0] / (n * reps),
                    "major_faults_per_token": faults[1] / (n * reps), "telemetry": tel,
                    "expert_cache": (model.expert_cache.stats()
                                     if model.expert_cache is not None else None),
                    "colibri_version": __version__, "timestamp": stamp,
                })
        finally:
            model.close()
    # bandwidth last: its buffer would otherwise be part of every later peak RSS
    bandwidth: dict[int, float | None] = {}
    for t in thread_counts:
        if bandwidth_bytes:
            say(f"bench: read bandwidth, threads {t}, {bandwidth_bytes / 2**20:.0f} MiB")
        bandwidth[t] = (kernels.read_bandwidth(bandwidth_bytes, threads=t) if bandwidth_bytes
                        else None)
    for r in rows:
        bw = bandwidth[r["n_threads"]]
        ceiling = bw * 1e9 / r["bytes_per_token"] if bw and r["bytes_per_token"] else None
        r["read_bandwidth_gbs"] = bw
        r["ceiling_ts"] = ceiling
        r["ceiling_fraction"] = r["avg_ts"] / ceiling if ceiling and r["n_gen"] else None
    return rows


# ---------------------------------------------------------------------------------------------
# text
# ---------------------------------------------------------------------------------------------

def _size(n: int) -> str:
    return f"{n / 2**30:.2f} GiB" if n >= 2**30 else f"{n / 2**20:.2f} MiB"


def _count(n: int | None) -> str:
    if n is None:
        return "?"
    if n >= 1e9:
        return f"{n / 1e9:.2f} B"
    return f"{n / 1e6:.2f} M" if n >= 1e6 else f"{n / 1e3:.1f} K"


def _fraction(x: float) -> str:
    return f"{x:.2f}" if x >= 0.01 else f"{x:.1e}"


def _pct(x: float) -> str:
    return f"{100 * x:.0f}%"


COLUMNS = ("model", "size", "params", "active", "format", "acts", "kv", "threads", "test", "t/s",
           "peak RSS", "router", "experts", "attn", "head", "other")
_RIGHT = {"size", "params", "active", "threads", "t/s", "peak RSS", "router", "experts",
          "attn", "head", "other"}


def _cells(r: dict[str, Any]) -> list[str]:
    sh = r["time_share"]
    return [f"{r['model']} ({r['family']})" if r.get("family") else r["model"],
            _size(r["size_bytes"]), _count(r["n_params"]), _count(r["n_params_active"]),
            r["format"], r.get("activations", "f32"), r.get("kv_dtype", "f32"),
            str(r["n_threads"]), r["test"],
            f"{r['avg_ts']:.2f} ± {r['stddev_ts']:.2f}", _size(r["peak_rss_bytes"]),
            _pct(sh["router"]), _pct(sh["experts"]), _pct(sh["attention"]), _pct(sh["head"]),
            _pct(sh["other"])]


def format_markdown(rows: Iterable[dict[str, Any]]) -> str:
    """The llama-bench table (plus MoE and time-share columns), then the open times, the
    roofline lines and a footer with the method."""
    rows = list(rows)
    if not rows:
        return "(no results)"
    lines = []
    body = [list(COLUMNS)] + [_cells(r) for r in rows]
    widths = [max(len(b[i]) for b in body) for i in range(len(COLUMNS))]
    for j, b in enumerate(body):
        cells = [c.rjust(w) if COLUMNS[i] in _RIGHT else c.ljust(w)
                 for i, (c, w) in enumerate(zip(b, widths))]
        lines.append("| " + " | ".join(cells) + " |")
        if j == 0:
            lines.append("| " + " | ".join(("-" * (w - 1) + ":") if COLUMNS[i] in _RIGHT
                                           else "-" * w for i, w in enumerate(widths)) + " |")
    lines.append("")
    opens = {}
    for r in rows:
        opens.setdefault(r["n_threads"], r["open_ms"])
    for a in dict.fromkeys(r["activations"] for r in rows if "matmul_formats" in r):
        lines += format_kernel_paths(rows[0]["matmul_formats"], a, rows[0]["isa"])  # the paths
    lines += format_decode_paths(rows)
    lines.append("open: " + ", ".join(f"{ms:.1f} ms (threads {t})" for t, ms in opens.items()))
    lines += format_roofline(rows)
    lines += format_telemetry(rows)
    lines += format_machine_notes(rows)
    r0 = rows[0]
    lines.append(f"colibri {r0['colibri_version']}, ISA {r0['isa']}; {r0['reps']} repetitions"
                 f"{' after 1 warm-up' if r0['warmup'] else ''}, mean ± sd; pp = one forward "
                 f"pass over random ids into the cache at the test's depth; tg = single-token "
                 f"steps from it; shares of wall time from the model's timing counters")
    return "\n".join(lines)


def format_decode_paths(rows: Iterable[dict[str, Any]]) -> list[str]:
    """'decode: compiled layers' or 'decode: Python layers (<why>)': one line when every
    row's decode step took the same path, else one more per row that differs from the
    first."""
    rows = [r for r in rows if r.get("decode_path")]       # rows from before the field: none
    if not rows:
        return []
    first = rows[0]["decode_path"]
    out = [f"decode: {first}"]
    out += [f"decode, threads {r['n_threads']}, activations {r.get('activations', 'f32')}, "
            f"{r['test']}: {r['decode_path']}" for r in rows[1:] if r["decode_path"] != first]
    return out


def format_roofline(rows: Iterable[dict[str, Any]]) -> list[str]:
    """One line per tg row: bytes per token, bandwidth, ceiling, fraction reached."""
    out, small = [], False
    for r in rows:
        if not r["n_gen"]:
            continue
        d = r["bytes_per_token_detail"]
        parts = ", ".join(f"{k} {d[k] / 1e6:.3g}" for k in
                          ("attention", "router", "experts", "shared", "dense", "norms", "head",
                           "embedding") if d[k])
        k = r.get("n_experts_used")
        acts = r.get("activations", "f32")      # rows from before the option: f32
        line = (f"roofline, threads {r['n_threads']}, activations {acts}, "
                f"{r['test']}: {d['total'] / 1e6:.3g} MB of "
                f"weights per token ({parts}"
                + (f"; experts = top-{k} of {r['n_experts']} per MoE layer" if k else "") + ")")
        if r.get("read_bandwidth_gbs"):
            line += (f"; read bandwidth {r['read_bandwidth_gbs']:.1f} GB/s -> ceiling "
                     f"{r['ceiling_ts']:.1f} t/s; {r['test']} {r['avg_ts']:.1f} t/s = "
                     f"{_fraction(r['ceiling_fraction'])} of the ceiling")
        else:
            line += "; bandwidth not measured"
        out.append(line)
        small = small or (d["total"] < 64 * 2**20 and bool(r.get("read_bandwidth_gbs")))
    if small:
        out.append(f"note: {d['total'] / 1e6:.3g} MB per token fits in the CPU caches, so the "
                   f"DRAM ceiling does not bind a model this small")
    return out


def format_telemetry(rows: Iterable[dict[str, Any]]) -> list[str]:
    """One line per row: page faults per token, and with telemetry the expert hit rate and
    the bytes read per token."""
    out = []
    for r in rows:
        if "major_faults_per_token" not in r:     # rows from before telemetry
            continue
        line = (f"memory, threads {r['n_threads']}, {r['test']}: page faults per token "
                f"{r['major_faults_per_token']:.1f} major, {r['minor_faults_per_token']:.1f} "
                f"minor")
        tel = r.get("telemetry")
        if tel:
            line += (f"; experts in memory {100 * tel['hit_rate']:.1f}% ({tel['hits']} hits, "
                     f"{tel['misses']} misses), {tel['bytes_read_per_token'] / 1e6:.2f} MB read "
                     f"per token")
        cache = r.get("expert_cache")
        if cache:
            line += (f"; expert cache {cache['slots']} slots of "
                     f"{cache['slot_bytes'] / 2**20:.2f} MiB, {cache['policy']}, {cache['mode']}")
            recall = (cache.get("prefetch") or {}).get("mean_recall") or {}
            line += "".join(f", prefetch recall ({k}) {v:.2f}" for k, v in recall.items()
                            if v is not None)
        out.append(line)
    return out


def format_machine_notes(rows: Iterable[dict[str, Any]]) -> list[str]:
    """The load average seen when the tests started, and a warning when more threads did not
    read memory faster (other processes hold the cores: thread scaling is then not the
    machine's)."""
    rows = list(rows)
    out = []
    loads = [r["load_average"] for r in rows if r.get("load_average") is not None]
    if loads:
        lo, hi = f"{min(loads):.2f}", f"{max(loads):.2f}"
        out.append(f"load average (1 min) when the tests started: {lo}"
                   + (f"-{hi}" if hi != lo else "")
                   + f" (this process counts 1 while it runs); worker spin "
                   f"{rows[0].get('spin_us')} us")
    preempted = [r for r in rows if r.get("pool_backoffs")]
    if preempted:
        tests = ", ".join(f"{r['test']} at {r['n_threads']} threads" for r in preempted)
        out.append(f"warning: worker threads were preempted while waiting for work ({tests}): "
                   f"other processes share the cores, so multi-thread rows do not show this "
                   f"machine's scaling")
    bw = sorted({(r["n_threads"], r["read_bandwidth_gbs"]) for r in rows
                 if r.get("read_bandwidth_gbs")})
    for (t0, b0), (t1, b1) in zip(bw, bw[1:]):
        if b1 <= 1.1 * b0:
            out.append(f"warning: read bandwidth with {t1} threads ({b1:.1f} GB/s) is not above "
                       f"{t0} thread{'s' if t0 > 1 else ''} ({b0:.1f} GB/s): other work shares "
                       f"the cores, so the {t1}-thread rows do not show this machine's scaling")
    return out


def json_ready(x: Any) -> Any:
    """NaN/inf -> None, recursively (JSON has neither)."""
    if isinstance(x, float) and not math.isfinite(x):
        return None
    if isinstance(x, dict):
        return {k: json_ready(v) for k, v in x.items()}
    if isinstance(x, list):
        return [json_ready(v) for v in x]
    return x
