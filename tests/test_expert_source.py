"""The explicit expert source of each MoE layer (colibri.experts.expert_source): the residency
telemetry composed over the budgeted expert cache (both counting, the logits unchanged,
either taken out first), and the decode path that follows from the sources, which
`colibri bench` prints."""
from __future__ import annotations

import numpy as np

import colibri
from colibri.engine.decode_layer import decode_path, uncovered
from colibri.experts.expert_cache import memory_plan
from colibri.experts.expert_source import CachedExperts, MappedExperts, WatchedExperts
from colibri.format import ColibriFile
from colibri.experts.telemetry import ExpertTelemetry
from colibri.tools.bench import format_markdown, run_bench
from colibri.tools.cache_sim import simulate
from colibri.tools.trace import trace
from step_counter import python_steps

TOKENS = [5, 7, 9, 11, 3, 5, 7, 100, 200, 300, 5, 7, 9, 41, 42]
POLICY = "lru"


def _decode(model) -> list[np.ndarray]:
    cache = model.new_cache()
    return [model.forward(np.array([t]), cache=cache) for t in TOKENS]


_python_steps = python_steps


def _sources(model) -> list:
    return [model.layers[layer].ffn.expert_source for layer in model.moe_layers]


def test_telemetry_over_the_budgeted_cache_composes(monkeypatch):
    plain = colibri.load(threads=1)
    want = _decode(plain)
    routing = trace(plain, np.array(TOKENS), batch_size=1).experts          # (T, M, K)
    plain.close()
    with ColibriFile(colibri.api.default_model_path()) as f:
        plan = memory_plan(f)
    m = colibri.load(threads=1, memory_budget=plan.minimum + 3 * plan.slot_bytes,
                     cache_policy=POLICY)
    try:
        cache = m.expert_cache
        cached = _sources(m)
        assert all(isinstance(s, CachedExperts) for s in cached)
        python_steps = _python_steps(m, monkeypatch)
        with ExpertTelemetry(m) as rec:
            assert cache.telemetry is rec
            assert all(isinstance(s, WatchedExperts) and s.inner is c
                       for s, c in zip(_sources(m), cached))
            got = _decode(m)
            tel = rec.collect()
            # the decode steps took the Python layers, and the path says so, naming both
            assert len(python_steps) == len(TOKENS)
            path = decode_path(m)
            assert path.startswith("Python layers (") and "telemetry" in path
            assert CachedExperts.compiled_reason in path
        assert all(np.array_equal(a, b) for a, b in zip(got, want))
        # the telemetry's rows are the cache's own lookups: those a simulator of the same
        # policy and slots finds on the routing, and the cache's counters
        sim = simulate(routing, cache.plan.n_slots, POLICY, n_experts=m.file.n_experts)
        np.testing.assert_array_equal(tel.misses, sim.misses)
        np.testing.assert_array_equal(tel.hits, sim.hits)
        assert tel.misses.sum() > 0 and tel.hits.sum() > 0
        st = cache.stats()
        assert (st["hits"], st["misses"]) == (tel.hits.sum(), tel.misses.sum())
        assert st["bytes_read"] == tel.bytes_read.sum()
        # closed: the cache's sources again, the cache still counting, nothing recorded
        assert _sources(m) == cached and cache.telemetry is None
        assert decode_path(m) == f"Python layers ({CachedExperts.compiled_reason})"
        assert all(np.array_equal(a, b) for a, b in zip(_decode(m), want))
        assert cache.stats()["misses"] > st["misses"] and len(rec.collect()) == 0
        # the other order: the cache closed under the telemetry leaves it over the mapping
        rec = ExpertTelemetry(m)
        cache.close()
        m.expert_cache = None
        assert all(isinstance(s, WatchedExperts) and isinstance(s.inner, MappedExperts)
                   for s in _sources(m))
        assert all(np.array_equal(a, b) for a, b in zip(_decode(m), want))
        tel = rec.collect()
        np.testing.assert_array_equal(tel.hits + tel.misses,
                                      np.full(routing.shape[:2], routing.shape[2]))
        rec.close()
        assert all(isinstance(s, MappedExperts) for s in _sources(m))
        assert decode_path(m) == "compiled layers"
    finally:
        m.close()


def test_bench_says_why_decode_is_not_compiled():
    m = colibri.load(threads=1)
    assert uncovered(m) is None                 # the shipped model's layers are covered
    m.close()
    with ColibriFile(colibri.api.default_model_path()) as f:
        budget = memory_plan(f).minimum + 2 * memory_plan(f).slot_bytes
    kw = dict(n_prompt=0, n_gen=2, threads=1, reps=1, bandwidth_bytes=0)
    lines = {}
    for name, extra in (("plain", {}), ("telemetry", dict(telemetry=True)),
                        ("budget", dict(load_options=dict(memory_budget=budget)))):
        rows = run_bench(None, **kw, **extra)
        text = format_markdown(rows)
        found = [ln for ln in text.splitlines() if ln.startswith("decode: ")]
        assert len(found) == 1 and found[0] == f"decode: {rows[0]['decode_path']}"
        lines[name] = found[0]
    assert lines["plain"] == "decode: compiled layers"
    assert lines["telemetry"].startswith("decode: Python layers (") and \
        "telemetry" in lines["telemetry"]
    assert lines["budget"] == f"decode: Python layers ({CachedExperts.compiled_reason})"
