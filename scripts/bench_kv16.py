"""Decode at depth with each KV cache dtype, in one process, alternating (docs/performance.md,
change 26).

    python scripts/bench_kv16.py MODEL.colibri [--depth 4096] [--steps 16] [--rounds 5]
                                 [--threads 1,2] [--dtypes f32,f16,bf16]
    python scripts/bench_kv16.py --kernel [--depth 4096] [--rounds 11] [--threads 1,2]

--kernel: the attention kernel alone (kernels.attend_cached_into) over random planes of
mixtral-mini's geometry (8 layers, 16 heads, 4 kv heads, Dh 64), each dtype on the avx2 and
avx512 paths in turn, a 64 MiB read between calls so that the cache comes from memory as in
a decode step (whose weights evict it); the median milliseconds per token.

One model per thread count; per dtype one cache filled to `depth` with the same random
tokens (untimed). Then `rounds` rounds, each running `steps` decode steps from that depth
for every dtype in turn (the cache cut back to `depth` before each), so load from other
work on the machine falls on every dtype alike. Prints, per (threads, dtype): the median
tokens/s over the rounds, the attention share of the step (Model.timings: norms,
projections, RoPE and the attention over the cache), the milliseconds of attention per token,
and the cache's bytes; the 1-minute load average before and after.
"""
from __future__ import annotations

import argparse
import os
import statistics
import time

import numpy as np

import colibri
from colibri import kernels
from colibri.kernels import runtime
from colibri.engine.kv_cache import to_storage


def kernel_only(depth: int, rounds: int, threads: list[int], dtypes: list[str]) -> None:
    H, Hkv, Dh, L = 16, 4, 64, 8
    rng = np.random.default_rng(0)
    f32 = [[rng.standard_normal((1, Hkv, depth, Dh)).astype(np.float32) for _ in range(2)]
           for _ in range(L)]
    planes = {dt: [[to_storage(a, dt) for a in kv] for kv in f32] for dt in dtypes}
    q = rng.standard_normal((H, Dh)).astype(np.float32)
    new = rng.standard_normal((Hkv, Dh)).astype(np.float32)
    out = np.empty((H, Dh), np.float32)
    flush = np.ones(64 << 20, np.uint8)
    paths = [i for i in ("avx2", "avx512") if i in runtime.available_isas()]
    for t in threads:
        ms: dict = {}
        for _ in range(rounds):
            for isa in paths:
                runtime.set_isa(isa)
                for dt, layers in planes.items():
                    flush.sum()
                    t0 = time.perf_counter()
                    for kc, vc in layers:
                        kernels.attend_cached_into(q, kc, vc, new, new, depth - 1, 0, 0.125,
                                                   out, t)
                    ms.setdefault((isa, dt), []).append((time.perf_counter() - t0) * 1e3)
        print(f"threads {t}, {depth} slots: " + "; ".join(
            f"{isa} {dt} {statistics.median(v):.2f}" for (isa, dt), v in ms.items())
            + " ms per token (8 layers)")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("model", nargs="?")
    p.add_argument("--kernel", action="store_true", help="the attention kernel alone")
    p.add_argument("--depth", type=int, default=4096)
    p.add_argument("--steps", type=int, default=16)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--threads", default="1,2")
    p.add_argument("--dtypes", default="f32,f16,bf16")
    a = p.parse_args()
    dtypes = a.dtypes.split(",")
    print(f"load before: {os.getloadavg()[0]:.2f}")
    if a.kernel:
        kernel_only(a.depth, a.rounds, [int(x) for x in a.threads.split(",")], dtypes)
        print(f"load after: {os.getloadavg()[0]:.2f}")
        return
    if a.model is None:
        p.error("MODEL is required without --kernel")
    for t in (int(x) for x in a.threads.split(",")):
        model = colibri.load(a.model, threads=t)
        rng = np.random.default_rng(0)
        fill = rng.integers(0, model.vocab_size, a.depth)
        caches = {}
        for dt in dtypes:
            c = model.new_cache(ctx=a.depth + a.steps, dtype=dt)
            if a.depth:
                model.forward(fill, cache=c, last_only=True)
            caches[dt] = c
        ids = rng.integers(0, model.vocab_size, a.steps)
        model.forward(ids[:1], cache=caches[dtypes[0]], last_only=True)   # warm-up
        tps = {dt: [] for dt in dtypes}
        attn = {dt: [] for dt in dtypes}
        for _ in range(a.rounds):
            for dt in dtypes:
                c = caches[dt]
                c.truncate(a.depth)
                before = model.timings.copy()
                t0 = time.perf_counter()
                for tok in ids:
                    model.forward(np.array([tok]), cache=c, last_only=True)
                dt_s = time.perf_counter() - t0
                after = model.timings.copy()
                tps[dt].append(a.steps / dt_s)
                attn[dt].append((after["attention"] - before["attention"]) / a.steps)
        for dt in dtypes:
            med = statistics.median(tps[dt])
            ms = statistics.median(attn[dt]) * 1e3
            print(f"threads {t} kv {dt:4s} depth {a.depth}: {med:7.1f} t/s (rounds: "
                  + ", ".join(f"{x:.1f}" for x in tps[dt])
                  + f"); attention {ms:.2f} ms/token = {ms * med / 10:.0f} % of the step; "
                  f"cache {caches[dt].nbytes / 2**20:.1f} MiB")
        model.close()
    print(f"load after: {os.getloadavg()[0]:.2f}")


if __name__ == "__main__":
    main()
