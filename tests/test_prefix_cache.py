"""colibri.engine.prefix_cache and its users: a cached prefix gives the bits of the cache it was
copied from (random tiny models of several families: MLA, a sliding window), the same
greedy tokens as a cold run; LRU order (tails first, referenced blocks kept), the byte bound
alone and inside the Scheduler's KV budget, n > 1 prefilled once, model versions apart;
prompt log-probabilities served from scored blocks."""
from __future__ import annotations

import shutil
from types import SimpleNamespace

import numpy as np
import pytest

import colibri
import colibri.api as api
from colibri.generation.batching import SamplingParams, Scheduler
from colibri.convert import convert
from colibri.engine.kv_cache import KVCache
from colibri.engine.prefix_cache import PrefixCache, model_namespace, unsupported_reason

# family -> transformers overrides: mixtral with a sliding window shorter than the prompts,
# qwen3_moe (per-head q/k norms), deepseek_v2 (MLA: the latent cache)
FAMILIES = {"mixtral": dict(sliding_window=12), "qwen3_moe": {}, "deepseek_v2": {}}
# a cold single pass over the whole prompt sums in another order than prefix + suffix
# (kernels.linear's token blocks; docs/prefix-caching.md): logits this close, relative
COLD_TOL = {"f32": 1e-4, "f16": 2e-3}


@pytest.fixture(scope="module", params=list(FAMILIES))
def family(request, hf_checkpoint, tmp_path_factory):
    src = hf_checkpoint(request.param, initializer_range=0.15, **FAMILIES[request.param])
    dst = convert(src, tmp_path_factory.mktemp("prefix") / "m.colibri", dtype="f32",
                  progress=False)
    yield request.param, dst


def _rel(got, want) -> float:
    return float(np.abs(got - want).max() / np.abs(want).max())


@pytest.mark.parametrize("kv_dtype", ["f32", "f16"])
def test_hit_gives_the_bits_of_the_cache_it_came_from(family, kv_dtype):
    name, path = family
    with api.load(path, threads=1, activations="f32", kv_dtype=kv_dtype) as m:
        if name == "mixtral":
            assert m.config.sliding_window == 12
        rng = np.random.default_rng(1)
        shared = rng.integers(3, m.vocab_size, 37)
        a = np.concatenate([shared, rng.integers(3, m.vocab_size, 9)])     # 46 tokens
        b = np.concatenate([shared, rng.integers(3, m.vocab_size, 6)])     # 43 tokens
        pc = m.prefix_cache
        # request A: one pass over its prompt, its whole blocks kept (2 of 16: 32 tokens)
        ca = m.new_cache(ctx=64)
        m.forward(a, cache=ca, last_only=True)
        assert len(pc.store(a, ca)) == 2 and pc.nbytes == 2 * pc.block_bytes
        if name == "deepseek_v2":          # the latent (Rkv) and rotary key (Dr), one "head"
            L, _, rkv, dr = m.cache_dims
            assert pc.block_bytes == L * 16 * (rkv + dr) * ca.itemsize
        # request B from the cache, against B continuing A's own cache cut at 32 tokens
        cb = m.new_cache(ctx=64)
        assert pc.reuse(b, cb) == 32
        ref = ca.prefix_copy(32)
        for got, want in zip(cb.k + cb.v, ref.k + ref.v):
            assert np.array_equal(got[:, :, :32], want[:, :, :32])
        assert np.array_equal(cb.pos[0, :32], np.arange(32)) and cb.valid[0, :32].all()
        warm = m.forward(b[32:], cache=cb, last_only=True)[-1]
        want = m.forward(b[32:], cache=ref, last_only=True)[-1]
        assert np.array_equal(warm, want)
        cold = m.forward(b, cache=m.new_cache(ctx=64), last_only=True)[-1]
        assert _rel(warm, cold) < COLD_TOL[kv_dtype]


def test_generate_reuses_across_calls_with_the_same_tokens(family):
    _, path = family
    rng = np.random.default_rng(2)
    with api.load(path, threads=1, activations="f32", prefix_cache=0) as off, \
            api.load(path, threads=1, activations="f32") as on:
        shared = rng.integers(3, on.vocab_size, 50)
        prompts = [np.concatenate([shared, rng.integers(3, on.vocab_size, 5)]) for _ in range(3)]
        want = [off.generate(p, max_new_tokens=10) for p in prompts]
        assert off.last_stats.cached_tokens == 0 and not off.prefix_cache.enabled
        got = []
        for p in prompts:
            got.append(on.generate(p, max_new_tokens=10))
            got.append(on.generate(p, max_new_tokens=10))             # the same prompt again
        assert all(np.array_equal(g, w) for g, w in zip(got, np.repeat(want, 2, axis=0)))
        s = on.prefix_cache.stats()
        assert s["hits"] >= 5 * 48 and s["lookups"] == 6
        # a chat turn: the next prompt holds the previous prompt and its answer
        turn = np.concatenate([prompts[0], want[0], rng.integers(3, on.vocab_size, 4)])
        on.generate(turn, max_new_tokens=4)
        assert on.last_stats.cached_tokens == (len(prompts[0]) + 10 - 1) // 16 * 16
        assert np.array_equal(on.generate(turn, max_new_tokens=4),
                              off.generate(turn, max_new_tokens=4))
        # a batch shares it too
        assert all(np.array_equal(g, w) for g, w in zip(on.generate(prompts, max_new_tokens=10),
                                                        want))


# ---------------------------------------------------------------------------------------------
# the cache itself: order, bound, references, keys
# ---------------------------------------------------------------------------------------------

def _filled(n: int, seed: int = 0) -> KVCache:
    """A one-sequence cache of n tokens at positions 0..n-1 with random contents."""
    c = KVCache(2, 1, 1, 64, 4, dtype="f32")
    rng = np.random.default_rng(seed)
    for plane in c.k + c.v:
        plane[:] = rng.standard_normal(plane.shape)
    c.commit(np.ones((1, n), bool), np.arange(n)[None])
    return c


def _small(blocks: int, bs: int = 4) -> PrefixCache:
    pc = PrefixCache(2, 1, 4, 4, "f32", 0, block_tokens=bs, namespace=b"test")
    pc.capacity = blocks * pc.block_bytes
    return pc


def test_lru_evicts_tails_first_and_keeps_referenced_blocks():
    pc = _small(5)
    x, y, z = list(range(100, 113)), list(range(200, 209)), list(range(300, 309))
    bx = pc.store(x, _filled(13, 1))                  # 3 blocks (12 of its 13 tokens)
    by = pc.store(y, _filled(9, 2))                   # 2 blocks: 5, the capacity
    assert (len(bx), len(by), len(pc), pc.evictions) == (3, 2, 5, 0)
    assert pc.match(x).tokens == 12 and pc.match(y).tokens == 8    # y most recent
    pc.acquire(by)
    bz = pc.store(z, _filled(9, 3))
    assert len(bz) == 2                               # x's last two blocks go, its first stays
    assert pc.evictions == 2 and pc.match(x).tokens == 4 and pc.match(y).tokens == 8
    pc.acquire(bz)
    assert len(pc.store(list(range(400, 409)), _filled(9, 4))) == 1   # only x's first can go
    assert pc.match(x).tokens == 0 and pc.match(y).tokens == 8 and pc.nbytes <= pc.capacity
    pc.release(by + bz)
    assert len(pc.store(list(range(500, 509)), _filled(9, 5))) == 2   # now the oldest, z, go
    assert pc.match(z).tokens == 0 and pc.evictions == 5
    assert pc.match(list(range(400, 409))).tokens == 4 and pc.match(y).tokens == 8
    with pytest.raises(RuntimeError, match="hold"):
        pc.acquire(pc.match(list(range(500, 509))).blocks)
        pc.clear()


def test_byte_bound_and_shared_blocks_are_stored_once():
    pc = _small(7)
    rng = np.random.default_rng(0)
    stem = list(rng.integers(0, 50, 8))
    for i in range(40):
        toks = stem + list(rng.integers(0, 50, int(rng.integers(1, 20))))
        pc.store(toks, _filled(len(toks), i))
        assert pc.nbytes <= pc.capacity and pc.nbytes == len(pc) * pc.block_bytes
    assert pc.match(stem + [0]).tokens == 8          # the shared stem, most used, stays
    pc.capacity = pc.block_bytes
    assert pc.nbytes == pc.block_bytes and len(pc) == 1
    pc.capacity = 0
    assert not pc.enabled and pc.store(stem, _filled(8)) == [] and pc.match(stem).tokens == 0


def test_hit_keeps_the_last_token_and_checks_the_tokens():
    pc = _small(8)
    toks = list(range(1, 17))                         # 4 whole blocks of 4
    c = _filled(16)
    assert len(pc.store(toks, c)) == 4
    assert pc.match(toks).tokens == 12                # the 16th token is left to compute
    assert pc.match(toks + [99]).tokens == 16
    assert pc.match([1, 2, 3, 5] + toks[4:]).tokens == 0
    fresh = KVCache(2, 1, 1, 64, 4, dtype="f32")
    assert pc.reuse(toks + [99], fresh) == 16
    assert all(np.array_equal(f[0, :, :16], s[0, :, :16]) for f, s in zip(fresh.k, c.k))
    padded = _filled(16)
    padded.valid[0, 3] = False                        # not positions 0.. of real tokens
    assert pc.store([7] * 16, padded) == []
    with pytest.raises(ValueError, match="dtype f32"):
        pc.load(KVCache(2, 1, 1, 64, 4, dtype="f16"), pc.match(toks))


def test_namespaces_keep_models_apart(tmp_path):
    src = colibri.default_model_path()
    shutil.copyfile(src, tmp_path / "copy.colibri")
    with api.load(src, threads=1) as a, api.load(tmp_path / "copy.colibri", threads=1) as b, \
            api.load(src, threads=1, kv_dtype="f32") as a32:
        assert len({model_namespace(a), model_namespace(b), model_namespace(a32)}) == 3
        ids = list(range(5, 60))
        a.generate(ids, max_new_tokens=2)
        assert a.prefix_cache.match(ids).tokens == 48
        assert b.prefix_cache.chain(ids) != a.prefix_cache.chain(ids)
        with pytest.raises(ValueError, match="another model"):
            Scheduler(b, prefix_cache=a.prefix_cache)
        a.prefix_cache.rekey(model_namespace(b))
        assert len(a.prefix_cache) == 0 and a.prefix_cache.match(ids).tokens == 0


def test_bad_sizes_name_the_argument():
    for bad in (-1, 1.5, "1GiB", True):
        with pytest.raises(ValueError, match="prefix_cache must be"):
            api.load(colibri.default_model_path(), prefix_cache=bad)
    with api.load(colibri.default_model_path(), threads=1) as m:
        with pytest.raises(ValueError, match="prefix_cache must be"):
            Scheduler(m, prefix_cache=-5)
        with pytest.raises(ValueError, match="capacity must be"):
            m.prefix_cache.capacity = -1


def test_longrope_is_off_with_its_reason():
    cfg = SimpleNamespace(rope_scaling={"rope_type": "longrope"})
    assert "LongRoPE" in unsupported_reason(SimpleNamespace(config=cfg))
    assert unsupported_reason(SimpleNamespace(config=SimpleNamespace(rope_scaling=None))) is None
    pc = PrefixCache(1, 1, 4, 4, "f32", 1 << 20, unsupported="LongRoPE: ...")
    assert not pc.enabled and pc.stats()["capacity_bytes"] == 0


# ---------------------------------------------------------------------------------------------
# the Scheduler
# ---------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def shipped():
    m = api.load(colibri.default_model_path(), threads=1, kv_dtype="f32")
    yield m
    m.close()


def _run(sched, prompts, check=None, **params):
    hs = [sched.submit(p, SamplingParams(**params)) for p in prompts]
    while sched.step():
        if check:
            check()
    return [[e.token for e in h if e.token >= 0] for h in hs]


def test_scheduler_n4_prefills_once_and_matches_the_plain_path(shipped):
    rng = np.random.default_rng(5)
    prompt = [int(t) for t in rng.integers(3, shipped.vocab_size, 203)]
    off = Scheduler(shipped, parallel=4, prefix_cache=0)
    want = _run(off, [prompt], max_tokens=8)[0]
    assert off.stats()["tokens_in"] == 203 and off.stats()["prefix_cache"]["lookups"] == 0
    on = Scheduler(shipped, parallel=4)
    got = _run(on, [prompt] * 4, max_tokens=8)
    assert got == [want] * 4
    s = on.stats()
    assert s["tokens_in"] == 203 + 3 * (203 - 192)    # the other three wait for its blocks
    assert s["prefix_cache"]["hits"] == 3 * 192 and s["prefix_cache"]["lookups"] == 4
    # a later request of the same system prompt and another question
    other = prompt[:150] + [7, 8, 9]
    assert _run(on, [other], max_tokens=8) == _run(off, [other], max_tokens=8)
    assert on.stats()["prefix_cache"]["hits"] == 3 * 192 + 144
    sampled = dict(max_tokens=8, temperature=0.9, seed=3)
    assert _run(on, [other], **sampled) == _run(off, [other], **sampled)


def test_scheduler_keeps_the_cache_inside_the_kv_budget(shipped):
    bpt = shipped.new_cache(ctx=1).nbytes
    # two running requests hold 258 tokens' bytes: the cache gets the other 142 at most
    sched = Scheduler(shipped, parallel=2, ctx=160, kv_budget=400 * bpt)
    rng = np.random.default_rng(6)
    stems = [[int(t) for t in rng.integers(3, shipped.vocab_size, 80)] for _ in range(3)]
    prompts = [stems[i // 4] + [int(t) for t in rng.integers(3, shipped.vocab_size, 9)]
               for i in range(12)]

    def check():
        s = sched.stats()
        assert s["kv_bytes_in_use"] + s["prefix_cache"]["bytes"] <= sched.kv_budget

    _run(sched, prompts, check, max_tokens=40, stop_ids=[])   # every request its 40 tokens
    s = sched.stats()
    assert s["requests_finished"] == 12 and s["prefix_cache"]["evictions"] > 0
    assert s["prefix_cache"]["hits"] >= 8 * 80 and s["kv_bytes_in_use"] == 0


def _scored(sched, prompts, k):
    hs = [sched.submit(p, SamplingParams(max_tokens=1, prompt_logprobs=k)) for p in prompts]
    while sched.step():
        pass
    for h in hs:
        list(h)
    return [h.prompt_logprobs for h in hs]


def _close(got, want, tol):
    """Entries equal in ids, their logprobs within tol (None where want has None)."""
    assert len(got) == len(want)
    for g, w in zip(got, want):
        if w is None:
            assert g is None
            continue
        assert abs(g[0] - w[0]) <= tol
        assert (g[1] is None) == (w[1] is None)
        if w[1] is not None:
            assert [i for i, _ in g[1]] == [i for i, _ in w[1]]
            assert max(abs(a - b) for (_, a), (_, b) in zip(g[1], w[1])) <= tol


def test_prompt_logprobs_requests_share_scored_blocks(shipped):
    """The choices of a multiple-choice question (one context, four continuations) score the
    context once: its entries the bits of a request computing it all, the continuations'
    within the cold tolerance; blocks a plain request stored carry no scores and serve none;
    fewer tops come from blocks that keep more, more tops are computed and kept."""
    rng = np.random.default_rng(7)
    ctx = [int(t) for t in rng.integers(3, shipped.vocab_size, 128)]
    choices = [ctx + [int(t) for t in rng.integers(3, shipped.vocab_size, 8)]
               for _ in range(4)]
    off = Scheduler(shipped, parallel=4, prefix_cache=0)
    want = [_scored(off, [c], 1)[0] for c in choices]
    on = Scheduler(shipped, parallel=4)
    pc = on.prefix_cache
    _run(on, [ctx + [5]], max_tokens=1)                 # a plain request: KV, no scores
    assert len(pc) == 8 and all(b.scores is None for b in pc._blocks.values())
    hits = pc.hits
    got = _scored(on, choices, 1)
    assert pc.hits - hits == 3 * 128                    # the first computes, three take
    assert on.stats()["tokens_in"] == 129 + 136 + 3 * 8
    for g, w in zip(got, want):
        assert g[:129] == w[:129]                       # the context: the same bits
        _close(g, w, 1e-4)
    assert all(b.scores is not None and b.scores.k == 1 for b in pc._blocks.values())
    assert pc.nbytes == sum(b.nbytes for b in pc._blocks.values()) > 8 * pc.block_bytes
    # no tops, from blocks keeping one: the same logprobs
    hits = pc.hits
    (none,) = _scored(on, [choices[0]], 0)
    assert pc.hits - hits == 128
    assert none[1:] == [(w[0], None) for w in want[0][1:]]
    # three tops: not in the blocks, computed (and kept); then two tops come from them
    hits = pc.hits
    (three,) = _scored(on, [choices[1]], 3)
    assert pc.hits == hits and all(b.scores.k == 3 for b in pc._blocks.values())
    (two,) = _scored(on, [choices[2]], 2)
    assert pc.hits - hits == 128
    (ref,) = _scored(off, [choices[2]], 2)
    assert two[:129] == ref[:129]
    _close(two, ref, 1e-4)
    assert three[1][1][:2] == _scored(off, [choices[1]], 2)[0][1][1]


def test_scores_are_bounded_with_the_blocks(shipped):
    """Scores count in a block's bytes; a block's scores that do not fit are not kept (its
    keys and values stay)."""
    from colibri.generation.prompt_logprobs import BlockScores
    bs = 16
    tokens = list(range(3, 3 + 2 * bs + 1))
    cache = shipped.new_cache(ctx=64)
    shipped.forward(np.array(tokens), cache=cache)

    def scores(i):
        return BlockScores(1, np.zeros(bs - 1), np.zeros((bs - 1, 1), np.int64),
                           np.zeros((bs - 1, 1)), np.zeros(shipped.vocab_size, np.float32))
    size = scores(0).nbytes
    pc = PrefixCache.for_model(shipped, capacity=0)
    pc.capacity = 2 * pc.block_bytes + size
    blocks = pc.store(tokens, cache, scores=scores)
    assert len(blocks) == 2 and blocks[0].scores is not None and blocks[1].scores is None
    assert pc.nbytes == 2 * pc.block_bytes + size <= pc.capacity
    hit = pc.match(tokens, scored=1)
    assert len(hit.blocks) == 1 and len(pc.match(tokens).blocks) == 2
    assert len(pc.match(tokens, scored=2).blocks) == 0


def test_a_prompt_of_embeddings_leaves_the_prefix_cache_alone(shipped):
    """Slots filled from embeddings are no tokens' slots: no lookup, and nothing kept, not
    even a block of the generated tokens (which sit after the embeddings, not at 0)."""
    pc = shipped.prefix_cache
    before = pc.stats()
    x = shipped.embed(np.arange(3, 40)[None])[0]
    shipped.generate(None, input_embeds=x, max_new_tokens=20, stop=[])
    assert shipped.last_stats.generated_tokens == 20
    after = pc.stats()
    assert (after["lookups"], after["stored"]) == (before["lookups"], before["stored"])
