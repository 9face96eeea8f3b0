"""Expert shards on Ray actors (colibri.experts.expert_shards), measured on this machine's loopback.

    python scripts/bench_expert_shards.py                             # the shipped model
    python scripts/bench_expert_shards.py MODEL.colibri --shards 1,2 --gen 32 --latency-ms 2

Prints, from one run (a local Ray instance bound to loopback; every actor on 1 thread):
  1. the transport: the round trip of one Ray actor call carrying a hidden state x (B, D)
     float32 and returning K rows, against Ray's compiled graph (shared-memory channels) of
     the same call, for B = 1, 8, 64 (microseconds, median of --calls calls);
  2. decode tokens/s of one process against N shards (greedy, the same tokens checked),
     and the overhead per MoE layer and token that the shards add, by batch size (B
     sequences decoding together: forward_ragged over B one-token segments);
  3. memory per actor: PSS (/proc/PID/smaps_rollup) after the run, against its share of the
     expert bytes;
  4. a model of tokens/s for 2 / 4 / 8 nodes at 10 / 25 / 100 GbE from the measured costs
     (the formula is printed), and its check: the model's prediction for an injected delay
     (--latency-ms, slept by each actor per call) against the measured run with it;
  5. with --budget-fraction F (default 0.5): N = 2 shards, each under a memory budget of F of
     its experts, against one process with the same total expert budget (decode tokens/s).

`uptime` before and after says how loaded the machine was: rerun when the load was not ~0.
Bounded: --gen tokens per run, --calls calls per transport figure.
"""
from __future__ import annotations

import argparse
import os
import subprocess
import time

import numpy as np
import ray

import colibri
from colibri.experts.expert_cache import memory_plan
from colibri.experts.expert_shards import shard_experts
from colibri.ray_local import start_local_ray


def _uptime() -> str:
    try:
        return subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip()
    except OSError:
        return " ".join(f"{v:.2f}" for v in os.getloadavg())


def pss_bytes(pid: int) -> int:
    with open(f"/proc/{pid}/smaps_rollup") as f:
        for line in f:
            if line.startswith("Pss:"):
                return int(line.split()[1]) * 1024
    return 0


@ray.remote(num_cpus=0)
class Echo:
    """The transport alone: returns k rows of its input's width."""

    def run(self, x: np.ndarray, k: int) -> np.ndarray:
        return np.zeros((k * x.shape[0], x.shape[1]), np.float32)


def transport(D: int, K: int, calls: int) -> dict[int, tuple[float, float]]:
    """{B: (plain call us, compiled graph us)}: median round trips of x (B, D) -> (B*K, D)."""
    from ray.dag import InputNode
    a = Echo.remote()
    ray.get(a.run.remote(np.zeros((1, D), np.float32), K))
    out = {}
    with InputNode() as inp:
        dag = a.run.bind(inp[0], inp[1])
    compiled = dag.experimental_compile()
    try:
        for B in (1, 8, 64):
            x = np.random.default_rng(0).standard_normal((B, D)).astype(np.float32)
            plain, graph = [], []
            for _ in range(calls):
                t0 = time.perf_counter()
                ray.get(a.run.remote(x, K))
                plain.append(time.perf_counter() - t0)
                t0 = time.perf_counter()
                ray.get(compiled.execute(x, K))
                graph.append(time.perf_counter() - t0)
            out[B] = (float(np.median(plain)) * 1e6, float(np.median(graph)) * 1e6)
    finally:
        compiled.teardown()
        ray.kill(a)
    return out


def decode(model, prompt: np.ndarray, gen: int) -> tuple[float, list[int]]:
    """Greedy decode of gen tokens after prompt: (tokens/s of the decode steps, tokens)."""
    cache = model.new_cache(len(prompt) + gen + 1)
    logits = colibri.forward(model, prompt[None], cache=cache)
    toks = [int(logits[0, -1].argmax())]
    t0 = time.perf_counter()
    for _ in range(gen - 1):
        logits = colibri.forward(model, np.array([[toks[-1]]]), cache=cache)
        toks.append(int(logits[0, -1].argmax()))
    return (gen - 1) / (time.perf_counter() - t0), toks


def ragged_step(model, B: int, reps: int) -> float:
    """Seconds of one decode step of B sequences together (best of reps)."""
    caches = [model.new_cache(64) for _ in range(B)]
    rng = np.random.default_rng(B)
    for c in caches:
        colibri.forward(model, rng.integers(3, model.vocab_size, size=(1, 8)), cache=c)
    best = float("inf")
    for _ in range(reps):
        segs = [(c, np.array([int(rng.integers(3, model.vocab_size))])) for c in caches]
        t0 = time.perf_counter()
        model.forward_ragged(segs)
        best = min(best, time.perf_counter() - t0)
    return best


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("model", nargs="?", default=None, help="a .colibri file (default: shipped)")
    p.add_argument("--shards", default="1,2", help="shard counts (default: %(default)s)")
    p.add_argument("--gen", type=int, default=32, help="decode tokens per run")
    p.add_argument("--calls", type=int, default=200, help="calls per transport figure")
    p.add_argument("--latency-ms", type=float, default=2.0,
                   help="the injected per-call delay of the model check (default: 2)")
    p.add_argument("--budget-fraction", type=float, default=0.5,
                   help="each shard's budget as a fraction of its experts (0: skip)")
    a = p.parse_args(argv)
    print("load before:", _uptime())
    start_local_ray(num_cpus=16)
    one = colibri.load(a.model, threads=1)
    c = one.config
    M, D, K, E = len(one.moe_layers), c.hidden_size, c.num_experts_per_tok, c.num_experts
    prompt = np.random.default_rng(0).integers(3, one.vocab_size, size=16)
    print(f"model {one.file.path}: {M} MoE layers, D {D}, K {K} of E {E}; 1 thread each")

    print("\n1. transport: round trip of x (B, D) -> (B*K, D) float32, median us")
    tr = transport(D, K, a.calls)
    print(f"{'B':>4} {'actor call':>11} {'compiled graph':>15}")
    for B, (pl, gr) in tr.items():
        print(f"{B:>4} {pl:>11.0f} {gr:>15.0f}")

    print("\n2. decode tokens/s, one process against N shards (greedy, tokens compared)")
    base, want = decode(one, prompt, a.gen)
    base_step = {B: ragged_step(one, B, 5) for B in (1, 4, 16)}
    print(f"one process: {base:.1f} tok/s; ragged step ms B=1/4/16: "
          + " / ".join(f"{base_step[B] * 1e3:.1f}" for B in base_step))
    rows = {}
    for n in [int(s) for s in a.shards.split(",")]:
        m = colibri.load(a.model, threads=1)
        shard_experts(m, n, threads=1)
        tps, toks = decode(m, prompt, a.gen)
        step = {B: ragged_step(m, B, 5) for B in base_step}
        per_layer = {B: (step[B] - base_step[B]) / M * 1e6 for B in step}
        pss = [pss_bytes(s["pid"]) for s in m.expert_shards.stats()["per_shard"]]
        rows[n] = (tps, per_layer, pss)
        print(f"N={n}: {tps:.1f} tok/s ({tps / base:.2f}x one process), tokens "
              f"{'identical' if toks == want else 'DIFFER'}; overhead per MoE layer and "
              f"step, us, B=1/4/16: " + " / ".join(f"{per_layer[B]:.0f}" for B in per_layer))
        m.close()
    if 2 in rows:                     # the other transport, for the same decode
        m = colibri.load(a.model, threads=1)
        shard_experts(m, 2, threads=1, transport="call")
        tps, toks = decode(m, prompt, a.gen)
        m.close()
        print(f"N=2 over plain actor calls: {tps:.1f} tok/s ({tps / base:.2f}x one process), "
              f"tokens {'identical' if toks == want else 'DIFFER'}")

    print("\n3. memory per actor (PSS after the run) against its share of the expert bytes")
    expert_bytes = memory_plan(one.file).slot_bytes * M * E
    for n, (_, _, pss) in rows.items():
        print(f"N={n}: share {expert_bytes / n / 2**20:.1f} MiB; PSS "
              + ", ".join(f"{b / 2**20:.1f}" for b in pss) + " MiB")

    print("\n4. a model of decode tokens/s across machines, from the figures above")
    t_tok = 1 / base                                  # one process, one token
    # the software cost per MoE layer: what N=2 added per layer at B=1 (call, combine, the
    # driver's waits) on loopback, without a wire; else one compiled-graph round trip
    t_rpc = rows[2][1][1] * 1e-6 if 2 in rows else tr[1][1] * 1e-6
    # the experts' share of a token's time, from the one-process stage timings
    one.timings.reset()
    decode(one, prompt, a.gen)
    sec = one.timings.seconds
    f_exp = sec.get("experts", 0.0) / max(sum(sec.values()), 1e-12)
    t_exp, t_dense = t_tok * f_exp, t_tok * (1 - f_exp)
    print("t(token) = t_dense + t_experts / min(N, K) + M * (o + rtt + bytes / bw)")
    print(f"  measured: t_dense {t_dense * 1e3:.2f} ms, t_experts {t_exp * 1e3:.2f} ms "
          f"(one process), o {t_rpc * 1e6:.0f} us (N=2's overhead per layer), M {M}; "
          f"bytes per layer = "
          f"(1 + K) * D * 4 = {(1 + K) * D * 4} (x out, K rows back; the shards in parallel)")
    links = {"10GbE": (10e9 / 8, 50e-6), "25GbE": (25e9 / 8, 30e-6), "100GbE": (100e9 / 8, 15e-6)}
    print("  stated network: round trip 50 / 30 / 15 us, 10 / 25 / 100 Gbit/s")
    nbytes = (1 + K) * D * 4

    def model_tps(n: int, rtt: float, bw: float) -> float:
        return 1 / (t_dense + t_exp / min(n, K) + M * (t_rpc + rtt + nbytes / bw))
    print(f"{'nodes':>6} " + " ".join(f"{k:>8}" for k in links))
    for n in (2, 4, 8):
        print(f"{n:>6} " + " ".join(f"{model_tps(n, rtt, bw):>8.1f}"
                                    for bw, rtt in links.values()))
    lat = a.latency_ms * 1e-3
    m = colibri.load(a.model, threads=1)
    shard_experts(m, 2, threads=1, latency=lat)
    got, _ = decode(m, prompt, max(4, a.gen // 4))
    m.close()
    # on one machine the two actors share its cores: their expert work does not overlap
    want_tps = 1 / (t_tok + M * (t_rpc + lat))
    print(f"  check, N=2 on loopback with {a.latency_ms:g} ms injected per call: model "
          f"{want_tps:.1f} tok/s (no parallel speed-up on one machine), measured {got:.1f} "
          f"({got / want_tps:.2f}x the model)")

    if a.budget_fraction > 0:
        print(f"\n5. N=2 shards each under {a.budget_fraction:g} of its experts, against one "
              f"process with the same total expert budget")
        mp = memory_plan(one.file)
        per_shard = int(a.budget_fraction * mp.slot_bytes * M * E / 2)
        per_shard = max(per_shard, -(-E // 2) * mp.slot_bytes)
        single = colibri.load(a.model, threads=1,
                              memory_budget=mp.dense_bytes + 2 * per_shard)
        s_tps, s_toks = decode(single, prompt, a.gen)
        single.close()
        m = colibri.load(a.model, threads=1, expert_shards=2, shard_threads=1,
                         memory_budget=per_shard)
        m_tps, m_toks = decode(m, prompt, a.gen)
        hits = [ray.get(x.cache_stats.remote()) for x in m.expert_shards.actors]
        m.close()
        print(f"one process, budget {(mp.dense_bytes + 2 * per_shard) / 2**20:.1f} MiB: "
              f"{s_tps:.1f} tok/s; 2 shards x {per_shard / 2**20:.1f} MiB: {m_tps:.1f} tok/s "
              f"({m_tps / s_tps:.2f}x), tokens {'identical' if m_toks == s_toks else 'DIFFER'}"
              f"; shard hit rates " + ", ".join(f"{h['hit_rate']:.2f}" for h in hits))
    one.close()
    ray.shutdown()
    print("\nload after:", _uptime())
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
