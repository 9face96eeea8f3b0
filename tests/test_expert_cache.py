"""The memory budget (colibri.experts.expert_cache): the same logits with and without a budget
(every policy, both modes, with prefetch, decode and prefill), the plan's arithmetic and its error,
the flags, and the prefetcher's recall."""
from __future__ import annotations

import mmap
import os
import shutil

import numpy as np
import pytest

import colibri
from colibri.experts import expert_cache, residency
from colibri.cli import main
from colibri.commands.common import byte_size
from colibri.experts.eviction import POLICIES
from colibri.experts.expert_cache import MemoryBudgetError, memory_plan
from colibri.errors import ColibriError
from colibri.format import ColibriFile

TOKENS = [5, 7, 9, 11, 3, 5, 7, 100, 200, 300, 5, 7, 9, 41, 42]


@pytest.fixture(scope="module")
def plan():
    with ColibriFile(colibri.api.default_model_path()) as f:
        return memory_plan(f)


@pytest.fixture(scope="module")
def reference():
    """(prefill logits, decode logits per step) of the shipped model without a budget."""
    m = colibri.load(threads=1)
    pre = m.forward(np.arange(12))
    cache = m.new_cache()
    steps = [m.forward(np.array([t]), cache=cache) for t in TOKENS]
    m.close()
    return pre, steps


def run(model):
    pre = model.forward(np.arange(12))
    cache = model.new_cache()
    return pre, [model.forward(np.array([t]), cache=cache) for t in TOKENS]


def same(a, b) -> bool:
    return np.array_equal(a[0], b[0]) and all(np.array_equal(x, y) for x, y in zip(a[1], b[1]))


def test_plan_counts_the_dense_part_and_blocks(plan):
    f = ColibriFile(colibri.api.default_model_path())
    tied = f.model_config.tie_word_embeddings or "lm_head" not in f     # the head: resident
    dense = sum(-(-i.nbytes // 4096) * 4096 for n, i in f.tensors.items()
                if ".moe.experts." not in n and (tied or n != "tok_embeddings"))
    assert plan.dense_bytes == dense
    assert plan.slot_bytes == -(-f.expert_block(0, 0)[1] // 4096) * 4096
    assert plan.n_blocks == len(f.model_config.moe_layer_ids) * f.n_experts
    assert plan.minimum == dense + f.n_experts * plan.slot_bytes
    big = memory_plan(f, 10**9)
    assert big.n_slots == plan.n_blocks                       # never more slots than blocks
    assert memory_plan(f, plan.minimum + 3 * plan.slot_bytes + 7).n_slots == f.n_experts + 3


def test_budget_below_the_dense_part_fails_naming_the_numbers(plan):
    with pytest.raises(MemoryBudgetError) as e:
        colibri.load(memory_budget=plan.minimum - 1)
    msg = str(e.value)
    assert f"{plan.dense_bytes / 2**20:.1f} MiB" in msg and "at least" in msg
    assert f"{plan.minimum / 2**20:.1f} MiB" in msg


@pytest.mark.parametrize("policy", POLICIES)
def test_logits_identical_with_a_budget(policy, plan, reference):
    m = colibri.load(threads=1, memory_budget=plan.minimum + 2 * plan.slot_bytes,
                     cache_policy=policy)
    assert same(run(m), reference)
    st = m.expert_cache.stats()
    assert st["misses"] > 0 and st["policy"] == policy and st["slots"] == plan.n_experts + 2
    m.close()


@pytest.mark.parametrize("mode,prefetch", [("arena", "router"), ("arena", "previous"),
                                           ("arena", "both"), ("madvise", None),
                                           ("madvise", "both")])
def test_logits_identical_in_every_mode(mode, prefetch, plan, reference):
    m = colibri.load(threads=2, memory_budget=plan.minimum + 4 * plan.slot_bytes,
                     cache_mode=mode, prefetch=prefetch)
    assert same(run(m), reference)
    m.close()


def test_no_mmap_and_mlock(plan, reference):
    m = colibri.load(threads=1, mmap=False)
    assert same(run(m), reference) and m.buffer.flags.writeable      # a copy, not the mapping
    m.close()
    m = colibri.load(threads=1, memory_budget=plan.minimum, mmap=False, mlock=True)
    assert same(run(m), reference)
    assert m.expert_cache.stats()["locked"] in (True, False)     # where the system allows
    m.close()
    with pytest.raises(ValueError, match="madvise"):
        colibri.load(memory_budget=plan.minimum, mmap=False, cache_mode="madvise")


def test_reads_that_return_part_of_what_was_asked(plan, reference, monkeypatch):
    """One read returns at most ~2 GiB on Linux (and less when interrupted): mmap=False and
    the arena's reads go on until they have every byte (a 5.4 GB file once failed to load
    with "short read")."""
    calls = []
    real = expert_cache.os.preadv

    def short_preadv(fd, buffers, offset):
        calls.append(offset)
        return real(fd, [memoryview(buffers[0])[:4096]], offset)

    monkeypatch.setattr(expert_cache.os, "preadv", short_preadv)
    m = colibri.load(threads=1, mmap=False)
    assert same(run(m), reference) and len(calls) > 100
    m.close()
    m = colibri.load(threads=1, memory_budget=plan.minimum, mmap=False)
    reader = m.expert_cache._reader           # the buffered reads (O_DIRECT reads whole pages)
    if reader.direct >= 0:
        os.close(reader.direct)
        reader.direct = -1
    assert same(run(m), reference)
    m.close()


def test_a_file_truncated_under_mmap_false(tmp_path, reference):
    src = tmp_path / "m.colibri"
    shutil.copy(colibri.default_model_path(), src)
    f = ColibriFile(src)
    with open(src, "r+b") as fh:                      # the mapping stays valid
        fh.truncate(f.file_size // 2)
    with pytest.raises(ColibriError, match="short read"):
        expert_cache.read_dense(f, [(0, f.file_size)])


def test_prefetch_recall_per_layer(plan):
    m = colibri.load(threads=1, memory_budget=plan.minimum + 8 * plan.slot_bytes,
                     prefetch="both")
    cache = m.new_cache()
    for t in TOKENS:
        m.forward(np.array([t]), cache=cache)
    st = m.expert_cache.stats()["prefetch"]
    M = len(m.moe_layers)
    router, previous = st["recall"]["router"], st["recall"]["previous"]
    assert len(router) == len(previous) == M
    assert router[0] is None                       # the first layer has no router before it
    assert all(0 <= r <= 1 for r in router[1:]) and all(0 <= r <= 1 for r in previous)
    # the previous predictor's recall by hand: the share of a layer's experts it had at the
    # token before
    pf = m.expert_cache.prefetcher
    assert pf.recall_total["previous"][1] == (len(TOKENS) - 1) * m.config.num_experts_per_tok
    m.close()
    with pytest.raises(ValueError, match="prefetch must be one of"):
        colibri.load(memory_budget=plan.minimum, prefetch="psychic")


def test_sizes_and_flags(capsys, plan):
    assert byte_size("6GiB") == 6 * 2**30 and byte_size("1.5G") == int(1.5 * 2**30)
    assert byte_size("800MiB") == 800 * 2**20 and byte_size("4096") == 4096
    budget = f"{plan.minimum / 2**20 + 1:.2f}MiB"
    assert main(["generate", "-p", "Once", "-n", "4", "--temp", "0", "--memory-budget", budget,
                 "--mlock", "--verbose"]) == 0
    err = capsys.readouterr().err
    assert "memory: experts:" in err and "expert cache: " in err
    assert main(["generate", "-p", "Once", "-n", "2", "--memory-budget", "100KiB"]) == 2
    assert "below what the model needs" in capsys.readouterr().err
    assert main(["bench", "-p", "0", "-n", "4", "-r", "1", "--bw-mib", "0", "--telemetry",
                 "--memory-budget", budget, "--no-mmap", "--prefetch", "router"]) == 0
    out = capsys.readouterr().out
    assert "experts in memory" in out and "prefetch recall (router)" in out


def test_blocks_from_the_disk_and_from_the_page_cache(tmp_path, plan, reference):
    """A copy whose pages were dropped: blocks come from the disk (O_DIRECT where the file
    system allows); blocks the page cache holds are copied from it; the bytes add up."""
    path = tmp_path / "tiny.colibri"
    shutil.copy(colibri.api.default_model_path(), path)
    fd = os.open(path, os.O_RDONLY)
    os.fsync(fd)
    budget = plan.minimum + 40 * plan.slot_bytes          # every block fits
    m = colibri.load(path, threads=1, memory_budget=budget)
    # the dense part's faults read ahead into the experts: drop those pages
    buf = m.buffer
    residency.advise(buf, 0, len(buf), mmap.MADV_RANDOM)
    first = m.file.expert_block(0, 0)[0]
    residency.advise(buf, first, len(buf) - first, residency.DONTNEED)
    residency.drop_file_range(fd, first, 0)
    os.close(fd)
    f = m.file
    cold = sum(residency.resident_pages(buf, *f.expert_block(layer, e))[0] == 0
               for layer in m.moe_layers for e in range(f.n_experts))
    assert same(run(m), reference)
    st = m.expert_cache.stats()
    block = f.expert_block(0, 0)[1]
    assert st["bytes_read"] + st["bytes_from_page_cache"] == st["misses"] * block
    if cold == 0:
        pytest.skip("the kernel kept every page (tmpfs, or pages not yet on its LRU lists)")
    assert st["bytes_read"] > 0
    m.close()


def test_perplexity_and_routes_take_the_flags(tmp_path, capsys, plan):
    import json
    text = tmp_path / "t.txt"
    text.write_text("Once upon a time there was a little fox who lived in the woods. " * 12)
    budget = f"{plan.minimum / 2**20 + 0.5:.2f}MiB"
    ppl = []
    for extra in ([], ["--memory-budget", budget, "--mlock"]):
        assert main(["perplexity", "-f", str(text), "--ctx", "64", "-o", "json", *extra]) == 0
        ppl.append(json.loads(capsys.readouterr().out)["ppl"])
    assert ppl[0] == ppl[1]
    assert main(["routes", "-p", "Once upon a time", "--json", "--memory-budget", budget,
                 "--cache-policy", "lru", "--prefetch", "both"]) == 0
    assert json.loads(capsys.readouterr().out)["trace"]["tokens"]
