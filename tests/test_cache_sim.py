"""The cache simulator (colibri.tools.cache_sim, colibri cache-sim): hand-computed traces per
policy, the predicted speed's arithmetic, and agreement with the live expert cache's own
counters on the same routing."""
from __future__ import annotations

import json

import numpy as np
import pytest

import colibri
from colibri.cli import main
from colibri.experts.eviction import CacheFullError
from colibri.experts.expert_cache import memory_plan
from colibri.tools.cache_sim import CacheGeometry, SimResult, format_table, simulate, sweep
from colibri.tools.trace import trace


def one_layer(seq) -> np.ndarray:
    """experts (T, 1, 1): one MoE layer, top-1, token t chose seq[t]."""
    return np.asarray(seq, np.int32).reshape(-1, 1, 1)


def misses(seq, slots, policy, E=8) -> list[int]:
    return simulate(one_layer(seq), slots, policy, n_experts=E).misses[:, 0].tolist()


# 2 slots, accesses a b a c b: LRU evicts b for c (a was used later), so b misses again;
# LFU keeps a (used twice) the same way; with a c a ... the policies part ways below.
def test_lru_by_hand():
    assert misses([0, 1, 0, 2, 1], 2, "lru") == [1, 1, 0, 1, 1]
    assert misses([0, 1, 2, 0], 2, "lru") == [1, 1, 1, 1]      # the cyclic scan LRU loses


def test_lfu_keeps_the_frequent_block():
    # a a b c a: at c, a has 2 uses and b 1 -> b goes; a hits at the end (LRU too, here)
    assert misses([0, 0, 1, 2, 0], 2, "lfu") == [1, 0, 1, 1, 0]
    # a a b a c b: LRU evicts b at c (a more recent) and misses b; LFU evicts b as well
    # (1 use vs 3); then a b c b ... c: after a a a, b c b: LFU keeps a, LRU evicts it
    seq = [0, 0, 0, 1, 2, 1, 0]
    assert misses(seq, 2, "lfu") == [1, 0, 0, 1, 1, 1, 0]
    assert misses(seq, 2, "lru") == [1, 0, 0, 1, 1, 0, 1]


def test_least_stale_evicts_the_running_layer_first():
    # two layers, top-1, 3 slots; token 0 uses (L0 e0, L1 e0), token 1 (L0 e1, L1 e1).
    # At token 1 layer 0, slots hold L0e0, L1e0 and one free: L0e1 takes the free one.
    # At token 1 layer 1: both old blocks were last used by token 0; the running layer is 1,
    # so L1e0 (its layer comes round last) goes, L0e0 stays: token 2 reusing L0e0 hits.
    ex = np.array([[[0], [0]], [[1], [1]], [[0], [1]]], np.int32)
    r = simulate(ex, 3, "least-stale", n_experts=2)
    assert r.misses.tolist() == [[1, 1], [1, 1], [0, 0]]
    r = simulate(ex, 3, "lru", n_experts=2)   # LRU evicts L0e0 (the oldest access) instead,
    assert r.misses.tolist() == [[1, 1], [1, 1], [1, 0]]     # then L1e0 for it at token 2


def test_freq_weighted_forgets():
    # a used 3 times long ago, b twice recently; one slot besides the running block: b stays
    # under freq-weighted (decayed count), a stays under LFU (raw count)
    seq = [0, 0, 0] + [3] * 100 + [1, 1, 2, 1, 0]
    fw = misses(seq, 3, "freq-weighted", E=4)
    lfu = misses(seq, 3, "lfu", E=4)
    # at 2, slots hold 0 (3 uses, stale), 3 (40 uses), 1: freq-weighted drops 0, LFU drops 1
    assert fw[-2:] == [0, 1] and lfu[-2:] == [1, 0]


def test_top_k_and_chunks_pin_the_running_layer():
    ex = np.array([[[0, 1]], [[2, 3]]], np.int32)           # T=2, M=1, K=2
    assert simulate(ex, 2, "lru").misses.tolist() == [[2], [2]]
    with pytest.raises(CacheFullError, match="2 slots"):
        simulate(ex, 2, "lru", chunk=2)                      # one call needs 4 blocks
    r = simulate(ex, 4, "lfu", chunk=2)
    assert r.misses.tolist() == [[2], [2]] and r.hit_rate == 0.0


def test_counts_and_speed_arithmetic():
    r = SimResult("lru", 4, hits=np.array([[3, 1]]), misses=np.array([[1, 3]]),
                  slot_bytes=10**6)
    assert r.hit_rate == 0.5 and r.bytes_per_token == 4e6
    assert r.predicted_tps(bandwidth=1e9) == pytest.approx(250.0)
    assert r.predicted_tps(1e9, compute_tps=100) == pytest.approx(1 / (0.004 + 0.01))
    assert r.predicted_tps(1e9, compute_tps=100, overlapped=True) == pytest.approx(100)
    assert "50.0%" in format_table([r], 1e9, 100)


def test_geometry_matches_the_live_plan():
    path = colibri.api.default_model_path()
    geo = CacheGeometry.of_file(path)
    m = colibri.load(threads=1, memory_budget=geo.dense_bytes + 11 * geo.slot_bytes + 5)
    assert m.expert_cache.plan.n_slots == geo.slots_for(m.expert_cache.plan.budget) == 11
    m.close()


@pytest.mark.parametrize("policy", ["lru", "lfu", "least-stale", "freq-weighted"])
def test_simulator_agrees_with_the_live_cache(policy):
    path = colibri.api.default_model_path()
    plan = memory_plan(colibri.format.ColibriFile(path))
    budget = plan.minimum + 5 * plan.slot_bytes
    m = colibri.load(threads=1, memory_budget=budget, cache_policy=policy)
    tr = trace(m, "Once upon a time there was a little fox in the woods", batch_size=1,
               telemetry=True)
    sim = simulate(tr.experts, m.expert_cache.plan.n_slots, policy, n_experts=tr.n_experts,
                   slot_bytes=plan.slot_bytes)
    np.testing.assert_array_equal(sim.hits, tr.telemetry.hits)
    np.testing.assert_array_equal(sim.misses, tr.telemetry.misses)
    st = m.expert_cache.stats()
    assert st["hits"] == sim.hits.sum() and st["misses"] == sim.misses.sum()
    block = m.file.expert_block(0, 0)[1]
    assert st["bytes_read"] + st["bytes_from_page_cache"] == sim.misses.sum() * block
    m.close()


def test_sweep_orders_results():
    ex = np.random.default_rng(0).integers(0, 8, (50, 3, 2)).astype(np.int32)
    rs = sweep(ex, [4, 8, 24], ["lru", "lfu"], n_experts=8)
    assert [(r.policy, r.n_slots) for r in rs] == [("lru", 4), ("lru", 8), ("lru", 24),
                                                    ("lfu", 4), ("lfu", 8), ("lfu", 24)]
    assert rs[2].misses.sum() == 24                  # everything fits: first uses only
    assert rs[0].hit_rate <= rs[1].hit_rate <= rs[2].hit_rate


def test_cli(tmp_path, capsys):
    out = tmp_path / "t.npz"
    assert main(["routes", "-p", "Once upon a time", "--save", str(out)]) == 0
    capsys.readouterr()
    model = str(colibri.api.default_model_path())
    assert main(["cache-sim", str(out), "-m", model, "--budget", "2.2MiB,3MiB",
                 "--policy", "lru,lfu", "--bandwidth", "1.3", "--json"]) == 0
    d = json.loads(capsys.readouterr().out)
    assert [r["policy"] for r in d["results"]] == ["lru", "lru", "lfu", "lfu"]
    assert all("predicted_tps" in r for r in d["results"])
    assert main(["cache-sim", str(out), "--slots", "8,16"]) == 0
    assert "| lru" in capsys.readouterr().out
    assert main(["cache-sim", str(out), "--budget", "1GiB"]) == 2
    assert "--model" in capsys.readouterr().err
    with pytest.raises(SystemExit) as e:          # an argparse usage error
        main(["cache-sim", str(out), "--slots", "4", "--policy", "mru"])
    assert e.value.code == 2 and "unknown policy mru" in capsys.readouterr().err
