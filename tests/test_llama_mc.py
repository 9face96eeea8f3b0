"""scripts/llama_mc.py and the llama.cpp table of scripts/bench_eval.py: the task file must be
what llama.cpp's tools/perplexity reads, its report must be read back per task, and the text
questions must be split into context and answers as llama-perplexity splits them.

The file is read here by a transcription of perplexity.cpp's deserializers (multiple_choice_
task::deserialize: string question, then two answer sets of uint32 count, strings, int32
labels; a string uint32 length + bytes) after the header (uint32 count, uint32 offset of each
task). The report parser runs on a stand-in executable that prints the lines llama-perplexity
prints; with $LLAMA_PERPLEXITY and $LLAMA_MC_GGUF set, the real one scores a written file.
"""
from __future__ import annotations

import os
import struct
import sys
from pathlib import Path

import numpy as np
import pytest

import colibri

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "scripts"))
import bench_eval  # noqa: E402
import llama_mc  # noqa: E402


def _read(data: bytes):
    """perplexity.cpp's reading of a task file: [(question, answers, labels)], offsets."""
    at = 0

    def u32():
        nonlocal at
        (v,) = struct.unpack_from("<I", data, at)
        at += 4
        return v

    def string():
        nonlocal at
        n = u32()
        s = data[at:at + n].decode("utf-8")
        at += n
        return s

    def answers():
        nonlocal at
        n = u32()
        assert n <= 100
        a = [string() for _ in range(n)]
        labels = list(struct.unpack_from(f"<{n}i", data, at))
        at += 4 * n
        return a, labels

    n = u32()
    offsets = [u32() for _ in range(n)]
    tasks, starts = [], []
    for _ in range(n):
        starts.append(at)
        q = string()
        a, labels = answers()
        assert answers() == ([], [])                    # mc2: written empty
        tasks.append((q, a, labels))
    assert at == len(data)
    return tasks, offsets, starts


def test_task_file_is_what_perplexity_cpp_reads(tmp_path):
    tasks = [("the cat sat", [" on", "under the mat", "é"], 1), ("q", ["a", "b"], 0)]
    path = tmp_path / "t.bin"
    llama_mc.write_tasks(path, tasks)
    got, offsets, starts = _read(path.read_bytes())
    assert offsets == starts
    assert got == [("the cat sat", [" on", "under the mat", "é"], [0, 1, 0]),
                   ("q", ["a", "b"], [1, 0])]
    assert not Path(str(path) + ".tmp").exists()


@pytest.mark.parametrize("bad", [("", ["a"], 0), ("q", [], 0), ("q", ["a", ""], 0)])
def test_task_file_refuses_what_llama_cpp_refuses(tmp_path, bad):
    path = tmp_path / "t.bin"
    path.write_bytes(b"kept")
    with pytest.raises(ValueError, match="non-empty answers"):
        llama_mc.write_tasks(path, [bad])
    assert path.read_bytes() == b"kept"


_REPORT = """\
llama_context: n_ctx = 2048
task\tacc_norm
1\t100.00000000
2\t50.00000000
3\t66.66666667
4\t50.00000000
5\t60.00000000

0.01.0 I Final result: 60.0000 +/- 24.4949
0.01.1 I llama_perf_context_print:        load time =     335.93 ms
0.01.1 I llama_perf_context_print: prompt eval time =    5958.84 ms /  3123 tokens (    1.91 ms per token,   524.10 tokens per second)
0.01.1 I llama_perf_context_print:       total time =    8278.07 ms /  3124 tokens
"""


def _stand_in(tmp_path, report: str, rc: int = 0) -> str:
    """An executable that records its arguments and prints `report`."""
    (tmp_path / "report.txt").write_text(report)
    exe = tmp_path / "llama-perplexity"
    exe.write_text(f"#!{sys.executable}\nimport sys, pathlib\n"
                   f"pathlib.Path({str(tmp_path / 'argv.txt')!r}).write_text('\\n'.join("
                   f"sys.argv[1:]))\nsys.stdout.write(pathlib.Path("
                   f"{str(tmp_path / 'report.txt')!r}).read_text())\nsys.exit({rc})\n")
    exe.chmod(0o755)
    return str(exe)


def test_report_is_read_per_task(tmp_path):
    exe = _stand_in(tmp_path, _REPORT)
    r = llama_mc.run(exe, "m.gguf", "t.bin", n_tasks=5, threads=3, extra=["-np", "8"])
    assert r["correct"] == [1, 0, 1, 0, 1]
    assert r["eval_s"] == pytest.approx(5.95884) and r["total_s"] == pytest.approx(8.27807)
    assert r["tokens"] == 3123
    argv = (tmp_path / "argv.txt").read_text().split("\n")
    for flag, value in (("-m", "m.gguf"), ("-bf", "t.bin"), ("--multiple-choice-tasks", "5"),
                        ("-t", "3"), ("-tb", "3"), ("-np", "8")):
        assert argv[argv.index(flag) + 1] == value
    assert "--multiple-choice" in argv


@pytest.mark.parametrize("report, rc, match", [
    (_REPORT, 1, "exited 1"),
    (_REPORT.replace("prompt eval time", "eval"), 0, "exited 0"),
    (_REPORT.replace("5\t60.00000000\n", ""), 0, "scored 4 of 5"),
])
def test_a_failed_or_short_report_raises(tmp_path, report, rc, match):
    with pytest.raises(RuntimeError, match=match):
        llama_mc.run(_stand_in(tmp_path, report, rc), "m.gguf", "t.bin", 5, 1)


def test_find_binary(tmp_path, monkeypatch):
    exe = _stand_in(tmp_path, "")
    monkeypatch.setenv("LLAMA_PERPLEXITY", exe)
    assert llama_mc.find_binary() == exe
    assert llama_mc.find_binary(str(tmp_path / "missing")) is None
    monkeypatch.delenv("LLAMA_PERPLEXITY")
    monkeypatch.setenv("PATH", str(tmp_path))
    assert llama_mc.find_binary() == exe


@pytest.fixture(scope="module")
def shipped():
    m = colibri.load(None, threads=1)
    yield m
    m.close()


def test_text_questions_split_as_llama_perplexity_splits_them(shipped):
    """Each answer tokenized with the question (question + " " + answer, special tokens
    on); the tokens all answers share are the context, the rest each continuation."""
    tok = shipped.tokenizer
    tasks = bench_eval.text_tasks(tok, 3, 40, 4, 6, seed=1)
    assert tasks == bench_eval.text_tasks(tok, 3, 40, 4, 6, seed=1)
    for (q, answers), (ctx, conts) in zip(tasks, bench_eval.tokenized(tok, tasks)):
        assert q.replace(" ", "").isalpha() and len(answers) == 4
        assert len(tok.encode(q, add_special_tokens=False)) >= 40
        for a, k in zip(answers, conts):
            assert ctx + k == tok.encode(q + " " + a)
        assert len({k[0] for k in conts}) > 1           # the context is the longest shared
    with pytest.raises(ValueError, match="start with"):
        bench_eval.tokenized(tok, [("some words", ["here", "here and more"])])


def test_picks_take_the_best_mean_first_on_ties():
    items = [([1], [[2], [3, 4]]), ([5], [[6, 7], [8], [9]])]
    #        mean -1.0, -0.5 -> 1      -1.0, -2.0, -1.0 (tie: the first) -> 0
    assert bench_eval.picks(items, [-1.0, -1.0, -2.0, -2.0, -1.0]) == [1, 0]


@pytest.mark.skipif(not (os.environ.get("LLAMA_PERPLEXITY") and os.environ.get("LLAMA_MC_GGUF")),
                    reason="needs $LLAMA_PERPLEXITY and $LLAMA_MC_GGUF (a GGUF model)")
def test_real_llama_perplexity_scores_the_file(tmp_path):
    rng = np.random.default_rng(0)
    tasks = [(f"question {i} " + " ".join("abc"[j] * 3 for j in rng.integers(0, 3, 8)),
              ["yes", "no", "maybe so"], int(rng.integers(0, 3))) for i in range(4)]
    llama_mc.write_tasks(tmp_path / "t.bin", tasks)
    r = llama_mc.run(llama_mc.find_binary(), os.environ["LLAMA_MC_GGUF"], tmp_path / "t.bin",
                     len(tasks), threads=1)
    assert len(r["correct"]) == 4 and set(r["correct"]) <= {0, 1}
    assert r["tokens"] > 0 and r["total_s"] > 0
