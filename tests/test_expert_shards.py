"""Experts sharded over Ray actors (colibri.experts.expert_shards): the logits and greedy tokens of
every family bit-identical to one process for N = 1, 2, 4 shards, through a real local Ray
instance; the plan; the refusals; an actor killed in the middle of a call."""
from __future__ import annotations

import os
import signal
import threading
import time

import numpy as np
import pytest

ray = pytest.importorskip("ray")
torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

import colibri  # noqa: E402
from colibri.convert import convert  # noqa: E402
from colibri.experts.expert_cache import MemoryBudgetError, memory_plan  # noqa: E402
from colibri.experts.expert_shards import ExpertShardError, capacity_check, plan, shard_experts  # noqa: E402
from colibri.ray_local import start_local_ray  # noqa: E402
from family_parity import make_checkpoint  # noqa: E402
from hf_factory import FAMILY_NAMES, OTHER_FAMILY_NAMES  # noqa: E402


def _config_families() -> dict:
    """The families whose tiny configs live in their own parity files."""
    import test_family_dbrx as dbrx
    import test_family_gpt_oss as gpt_oss
    import test_family_granitemoe as granite
    import test_family_phimoe as phimoe
    return {"dbrx": dbrx.dbrx_config, "gpt_oss": gpt_oss.gpt_oss_config,
            "granitemoeshared": granite.VARIANTS["granitemoeshared"],
            "phimoe": lambda: transformers.PhimoeConfig(**phimoe.BASE,
                                                        **next(iter(phimoe.VARIANTS.values())))}


CONFIG_FAMILIES = ("dbrx", "gpt_oss", "granitemoeshared", "phimoe")
FAMILIES = FAMILY_NAMES + OTHER_FAMILY_NAMES + CONFIG_FAMILIES
# q4 with the default int16 activations (the integer kernels) and plain f32 (the f32 ones)
FORMATS = {"q4": (dict(dtype="f32", quant="q4"), "int16"), "f32": (dict(dtype="f32"), "f32")}


@pytest.fixture(scope="module")
def local_ray(tmp_path_factory):
    """A local Ray started away from the checkout: Ray puts the driver's working folder on
    its workers' sys.path, where the source colibri (without its compiled kernels) would
    shadow the installed one."""
    if ray.is_initialized():
        ray.shutdown()
    here = os.getcwd()
    os.chdir(tmp_path_factory.mktemp("ray"))
    try:
        start_local_ray(num_cpus=8)
    finally:
        os.chdir(here)
    yield
    ray.shutdown()


@pytest.fixture(scope="module")
def colibri_file(tmp_path_factory, hf_checkpoint):
    made: dict = {}

    def get(family: str, fmt: str = "q4"):
        if (family, fmt) not in made:
            where = tmp_path_factory.mktemp(f"shards-{family}")
            if family in CONFIG_FAMILIES:
                src = make_checkpoint(where / "hf", _config_families()[family]())
            else:
                src = hf_checkpoint(family, initializer_range=0.15)
            dst = where / f"{family}-{fmt}.colibri"
            convert(src, dst, progress=False, **FORMATS[fmt][0])
            made[family, fmt] = dst
        return made[family, fmt]
    return get


def _run(model, vocab: int) -> list[np.ndarray]:
    """Logits of: a padded batch of two prompts, a two-token prompt, then four decode steps
    of one sequence fed its own greedy tokens."""
    rng = np.random.default_rng(7)
    ids = rng.integers(3, vocab, size=(2, 9))
    mask = np.ones_like(ids)
    mask[1, :3] = 0
    out = [colibri.forward(model, ids, attention_mask=mask)]
    out.append(colibri.forward(model, ids[:1, :2]))
    cache = model.new_cache(32)
    logits = colibri.forward(model, ids[:1], cache=cache)
    out.append(logits)
    for _ in range(4):
        tok = np.array([[int(logits[0, -1].argmax())]])
        logits = colibri.forward(model, tok, cache=cache)
        out.append(logits)
    return out


@pytest.mark.parametrize("n", [1, 2, 4])
@pytest.mark.parametrize("family", FAMILIES)
def test_logits_and_greedy_tokens_bit_identical_to_one_process(local_ray, colibri_file, family,
                                                               n):
    fmt = "f32" if family in ("gpt_oss", "deepseek_v3") and n == 2 else "q4"
    path, act = colibri_file(family, fmt), FORMATS[fmt][1]
    with colibri.load(path, threads=1, activations=act) as one, \
            colibri.load(path, threads=1, activations=act, expert_shards=n) as sharded:
        stats = sharded.expert_shards.stats()["per_shard"]
        assert [s["experts"] for s in stats] == \
            [int((sharded.expert_shards.owner == s).sum()) for s in range(n)]
        assert sum(s["experts"] for s in stats) == len(one.moe_layers) * one.config.num_experts
        for a, b in zip(_run(one, one.vocab_size), _run(sharded, one.vocab_size)):
            np.testing.assert_array_equal(a, b)
        prompt = np.arange(3, 11)
        assert (one.generate(prompt, max_new_tokens=8).tolist()
                == sharded.generate(prompt, max_new_tokens=8).tolist())
        stats = sharded.expert_shards.stats()["per_shard"]
        assert all(s["calls"] > 0 and s["slots"] > 0 for s in stats)   # every shard worked
        pids = {s["pid"] for s in stats}
        assert len(pids) == n and os.getpid() not in pids          # n processes, not this one


def test_plan_round_robin_and_balanced_by_counts():
    np.testing.assert_array_equal(plan(2, 4, 2), [[0, 1, 0, 1], [0, 1, 0, 1]])
    counts = np.array([[100, 1, 1, 98, 50, 50, 0, 0]])
    owner = plan(1, 8, 2, counts)
    load = [counts[0][owner[0] == s].sum() for s in range(2)]
    assert sorted(load) == [150, 150]                 # heaviest first to the lighter shard
    assert sorted(np.bincount(owner[0])) == [4, 4]    # and never more than ceil(E / N) each
    for bad in (0, 9, 2.0, True):
        with pytest.raises(ValueError, match="expert_shards must be an integer in 1..8"):
            plan(1, 8, bad)
    with pytest.raises(ValueError, match=r"routing counts have shape \(2, 8\), expected "
                                         r"\(1, 8\)"):
        plan(1, 8, 2, np.zeros((2, 8)))


def test_capacity_counts_whole_shards_per_alive_node():
    def node(ip, cpus, alive=True):
        return {"Alive": alive, "NodeManagerAddress": ip, "Resources": {"CPU": cpus}}
    nodes = [node("10.0.0.1", 0), node("10.0.0.2", 3), node("10.0.0.3", 2),
             node("10.0.0.4", 8, alive=False)]
    capacity_check(nodes, 2, 2)                       # 3 // 2 + 2 // 2 = 2 shards fit
    capacity_check(nodes, 5, 1)
    with pytest.raises(ExpertShardError, match=r"3 shards of 2 Ray CPU\(s\) each do not fit "
                       r"the cluster, which holds 2 \(CPUs per node: 10.0.0.1: 0, 10.0.0.2: 3, "
                       r"10.0.0.3: 2\)"):
        capacity_check(nodes, 3, 2)                   # the dead node's 8 CPUs do not count
    with pytest.raises(ExpertShardError, match="no alive node"):
        capacity_check([], 1, 1)
    capacity_check([], 1, 0)                          # zero-CPU actors: Ray places them


def test_refusals_name_the_problem(local_ray, colibri_file):
    path = colibri_file("mixtral")
    with pytest.raises(ValueError, match=r"expert_shards must be an integer in 1..4 \(the "
                                         r"model has 4 experts per layer\), got 5"):
        colibri.load(path, threads=1, expert_shards=5)
    slot = memory_plan(colibri.ColibriFile(path)).slot_bytes
    with pytest.raises(MemoryBudgetError,
                       match=rf"memory budget {slot} bytes per expert shard is below what "
                             rf"shard 0 needs: its largest layer's experts, {2 * slot} bytes"):
        colibri.load(path, threads=1, expert_shards=2, memory_budget=slot)


@pytest.mark.parametrize("family", ["mixtral", "gpt_oss"])
def test_each_shard_under_a_memory_budget_gives_the_same_logits(local_ray, colibri_file,
                                                                family):
    """Two shards, each with room for 3 of its 4 experts (2 layers x 2 owned): blocks are
    read in and evicted, and the logits stay those of one process without a budget."""
    path = colibri_file(family)
    with colibri.load(path, threads=1) as one, \
            colibri.load(path, threads=1, expert_shards=2, shard_threads=1,
                         memory_budget=3 * memory_plan(
                             one.file).slot_bytes) as sharded:
        for a, b in zip(_run(one, one.vocab_size), _run(sharded, one.vocab_size)):
            np.testing.assert_array_equal(a, b)
        stats = [ray.get(a.cache_stats.remote()) for a in sharded.expert_shards.actors]
        assert all(s["misses"] > 4 and s["hits"] > 0 for s in stats)    # evictions happened


def test_an_actor_killed_mid_call_fails_that_call_cleanly_and_the_next_succeeds(
        local_ray, colibri_file):
    path = colibri_file("mixtral")
    prompt = np.arange(3, 12)[None]
    with colibri.load(path, threads=1) as one, colibri.load(path, threads=1) as model:
        want = colibri.forward(one, prompt)
        shards = shard_experts(model, 2, threads=1, latency=1.0, timeout=60)
        victim = shards.stats()["per_shard"][1]["pid"]
        threading.Timer(0.4, os.kill, (victim, signal.SIGKILL)).start()
        t0 = time.monotonic()
        with pytest.raises(ExpertShardError, match=r"expert shard 1 failed layer 0: .*Ray "
                                                   r"restarts a dead actor"):
            colibri.forward(model, prompt)
        assert time.monotonic() - t0 < 30                      # an error, not a hang
        np.testing.assert_array_equal(colibri.forward(model, prompt), want)   # restarted
        stats = shards.stats()["per_shard"]
        assert stats[1]["failures"] == 1 and stats[0]["failures"] == 0
        assert stats[1]["pid"] not in (victim, stats[0]["pid"])      # a new process


def _shard_processes() -> list:
    import psutil
    return [p for p in psutil.process_iter(["cmdline"])
            if any("ShardWorker" in part for part in (p.info["cmdline"] or []))]


def test_serve_expert_shards_answers_as_one_process_and_survives_a_killed_actor(colibri_file):
    """`colibri serve MODEL --expert-shards 2` with the official openai client: the greedy
    completion of one process, each shard under --shard-memory-budget (its experts in a
    cache of one layer's share), per-shard figures in /metrics; an actor killed between
    requests costs at most the next request (a clean 500, no hang), the one after answers."""
    from server_helpers import ServerProcess, client, request
    path = colibri_file("olmoe")
    with colibri.load(path, threads=1) as one:
        want = one.generate(np.arange(3, 11), max_new_tokens=12).tolist()
    if ray.is_initialized():
        ray.shutdown()
    with colibri.load(path, threads=1) as one:         # the least a shard may hold: one layer's
        budget = memory_plan(one.file).slot_bytes * -(-one.file.n_experts // 2)
    server = ServerProcess(str(path), "--expert-shards", "2", "--shard-threads", "1",
                           "--shard-memory-budget", str(budget))
    try:
        api = client(server.url)

        r = api.completions.create(model="olmoe-q4", prompt=list(range(3, 11)), max_tokens=12,
                                   temperature=0, timeout=60)
        assert r.usage.completion_tokens == 12
        text = r.choices[0].text
        with colibri.load(path, threads=1) as one:
            assert text == one.tokenizer.decode(want)
        status, _, metrics = request(server.url, "GET", "/metrics")
        assert status == 200
        for s in ("0", "1"):
            calls = [line for line in metrics.splitlines()
                     if line.startswith(f'colibri_expert_shard_calls_total{{shard="{s}"}}')]
            assert calls and float(calls[0].split()[-1]) > 0
        victims = _shard_processes()
        assert len(victims) == 2
        victims[0].kill()
        import openai
        try:
            after = api.completions.create(model="olmoe-q4", prompt=list(range(3, 11)),
                                           max_tokens=12, temperature=0, timeout=60).choices[0].text
            assert after == text
        except openai.InternalServerError as e:
            assert "engine" in str(e)
        again = api.completions.create(model="olmoe-q4", prompt=list(range(3, 11)), max_tokens=12,
                                       temperature=0, timeout=60).choices[0].text
        assert again == text
    finally:
        assert server.stop() == 0
    assert not _shard_processes()              # the server's actors went with it
