"""Telemetry (colibri.experts.telemetry): hits / misses / bytes read / page faults per token,
against a hand count on a copy of the shipped model whose pages were dropped from the page cache,
and in the trace API, `colibri bench` and `generate --verbose`."""
from __future__ import annotations

import mmap
import os
import shutil

import numpy as np
import pytest

import colibri
from colibri.experts import residency
from colibri.cli import main
from colibri.experts.telemetry import ExpertTelemetry, TokenTelemetry
from colibri.tools.bench import format_markdown, run_bench
from colibri.tools.trace import Trace, trace

PROMPT = "Once upon a time there was a little fox"


@pytest.fixture()
def cold_model(tmp_path):
    """The shipped model copied to disk, none of its pages in memory, readahead off: a block
    is in memory exactly when a token used it before."""
    path = tmp_path / "tiny.colibri"
    shutil.copy(colibri.api.default_model_path(), path)
    fd = os.open(path, os.O_RDONLY)
    os.fsync(fd)                                 # clean pages: the kernel may drop them
    model = colibri.load(path, threads=1)
    buf = model.buffer
    residency.advise(buf, 0, len(buf), mmap.MADV_RANDOM)
    residency.advise(buf, 0, len(buf), residency.DONTNEED)
    residency.drop_file_range(fd, 0, 0)
    os.close(fd)
    if residency.resident_pages(buf, 0, len(buf))[0]:
        model.close()
        pytest.skip("this file system keeps the pages (tmpfs?): residency cannot be reset")
    yield model
    model.close()


def first_use_misses(experts: np.ndarray) -> np.ndarray:
    """int (T, M): accesses of each token whose (layer, expert) no earlier token used."""
    seen: set = set()
    out = np.zeros(experts.shape[:2], np.int64)
    for t in range(experts.shape[0]):
        for j in range(experts.shape[1]):
            for e in experts[t, j]:
                if (j, int(e)) not in seen:
                    seen.add((j, int(e)))
                    out[t, j] += 1
    return out


def test_cold_decode_counts_match_first_use(cold_model):
    tr = trace(cold_model, PROMPT, batch_size=1, telemetry=True)
    tel = tr.telemetry
    T, M, K = tr.experts.shape
    want = first_use_misses(tr.experts)
    np.testing.assert_array_equal(tel.misses, want)
    np.testing.assert_array_equal(tel.hits + tel.misses, np.full((T, M), K))
    f = cold_model.file
    block = f.expert_block(0, 0)[1]
    pages = -(-block // residency.PAGE)
    np.testing.assert_array_equal(tel.bytes_read, want.sum(1) * pages * residency.PAGE)
    # every missed page is a major fault of the forward call that read it (plus dense pages)
    assert tel.major_faults.sum() >= tel.bytes_read.sum() // residency.PAGE
    assert tel.major_faults[0] > 0 and tel.misses[0].sum() == M * K


def test_prefill_counts_a_shared_block_once(cold_model):
    tr = trace(cold_model, PROMPT, telemetry=True)             # one call of all the tokens
    np.testing.assert_array_equal(tr.telemetry.misses, first_use_misses(tr.experts))
    assert tr.telemetry.minor_faults[:-1].sum() == 0            # faults go to the last token


def test_warm_model_hits_everything(cold_model):
    trace(cold_model, PROMPT, batch_size=1)                    # brings the used blocks in
    tr = trace(cold_model, PROMPT, batch_size=1, telemetry=True)
    assert tr.telemetry.misses.sum() == 0 and tr.telemetry.bytes_read.sum() == 0
    assert tr.telemetry.hit_rate == 1.0


def test_watchers_are_removed_and_logits_unchanged(cold_model):
    ids = np.arange(5)
    plain = cold_model.forward(ids)
    sources = [cold_model.layers[i].ffn.expert_source for i in cold_model.moe_layers]
    with ExpertTelemetry(cold_model) as rec:
        watched = cold_model.forward(ids)
        assert len(rec.collect()) == 5
        assert [cold_model.layers[i].ffn.expert_source.inner
                for i in cold_model.moe_layers] == sources
    np.testing.assert_array_equal(plain, watched)
    assert [cold_model.layers[i].ffn.expert_source for i in cold_model.moe_layers] == sources


def test_trace_keeps_telemetry_through_its_operations(cold_model, tmp_path):
    tr = trace(cold_model, PROMPT, batch_size=1, telemetry=True)
    part = tr[2:5]
    np.testing.assert_array_equal(part.telemetry.misses, tr.telemetry.misses[2:5])
    sel = tr.select_layers([tr.layers[1]])
    np.testing.assert_array_equal(sel.telemetry.hits, tr.telemetry.hits[:, 1:2])
    both = Trace.concat([tr[:3], tr[3:]])
    np.testing.assert_array_equal(both.telemetry.bytes_read, tr.telemetry.bytes_read)
    tr.save(tmp_path / "t.npz")
    back = Trace.load(tmp_path / "t.npz")
    for k in TokenTelemetry.FIELDS:
        np.testing.assert_array_equal(getattr(back.telemetry, k), getattr(tr.telemetry, k))
    with pytest.raises(ValueError, match="telemetry"):
        Trace(tr.experts, tr.weights, telemetry=tr.telemetry[:2])


def test_bench_rows_carry_telemetry():
    rows = run_bench(None, n_prompt=0, n_gen=4, threads=1, reps=2, bandwidth_bytes=0,
                     telemetry=True)
    r = rows[0]
    m = colibri.load(threads=1)
    M, K = len(m.moe_layers), m.config.num_experts_per_tok
    tel = r["telemetry"]
    assert tel["tokens"] == 8 and tel["hits"] + tel["misses"] == 8 * M * K
    assert r["major_faults_per_token"] >= 0 and r["minor_faults_per_token"] >= 0
    assert "experts in memory" in format_markdown(rows)


def test_generate_verbose_shows_memory(capsys):
    assert main(["generate", "-p", "Once", "-n", "3", "--temp", "0", "--verbose"]) == 0
    err = capsys.readouterr().err
    assert err.count("in memory, read") == 3
    assert "memory: experts:" in err and "hit rate" in err
