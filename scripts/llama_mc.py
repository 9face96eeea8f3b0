"""llama.cpp's `llama-perplexity --multiple-choice` on given questions: the task file it reads,
one run, and what it reports (scripts/bench_eval.py's llama.cpp column).

    write_tasks("tasks.bin", [(question, [answer, ...], correct index), ...])
    r = run("llama-perplexity", "model-Q4_0.gguf", "tasks.bin", n_tasks=8, threads=2)
    r["eval_s"], r["tokens"], r["correct"]          # seconds decoding, tokens, per task 0/1

The task file is the binary format of llama.cpp's tools/perplexity (what its
multiple-choice validation files hold): uint32 task count, uint32 byte offset of each task,
then per task a string question and two answer sets (mc1, mc2); a string is uint32 length +
bytes, an answer set uint32 count, its strings, int32 labels (1: correct). mc2 is unused
(llama.cpp reads it, scores mc1 only), written empty.

How llama.cpp scores a task: each answer is tokenized as question + " " + answer with its
special tokens; the tokens all answers share are the context, evaluated once; an answer's
score is the mean log-probability of its tokens after the context; the highest scores.
From its llama_perf_context_print: eval_s, the "prompt eval time" (the decode calls only),
and total_s, the "total time" (from creating its context, after loading the model, to the
end: also the log-softmax of each answer's rows over its batch's logits buffer, which with
a large -np is n_ctx x vocab floats and costs more than the decode calls). The prompt
eval time is not always what it says: with -np 32 and one batch holding every task, some
runs report 3 ms of decode calls in a 14 s run; total_s is the figure to compare.
"""
from __future__ import annotations

import os
import re
import shutil
import struct
import subprocess
import tempfile
from pathlib import Path

__all__ = ["find_binary", "write_tasks", "run"]


def find_binary(explicit: str | None = None) -> str | None:
    """The llama-perplexity executable: `explicit`, else $LLAMA_PERPLEXITY, else on PATH."""
    for cand in (explicit, os.environ.get("LLAMA_PERPLEXITY")):
        if cand:
            return cand if Path(cand).is_file() else None
    return shutil.which("llama-perplexity")


def _string(s: str) -> bytes:
    b = s.encode("utf-8")
    return struct.pack("<I", len(b)) + b


def _task(question: str, answers: list[str], correct: int) -> bytes:
    if not question or not answers or not all(answers):
        raise ValueError("a task needs a question and non-empty answers (llama.cpp refuses "
                         "the file otherwise)")
    labels = [int(i == correct) for i in range(len(answers))]
    mc1 = (struct.pack("<I", len(answers)) + b"".join(map(_string, answers))
           + struct.pack(f"<{len(labels)}i", *labels))
    return _string(question) + mc1 + struct.pack("<I", 0)


def write_tasks(path: str | Path, tasks: list[tuple[str, list[str], int]]) -> None:
    """Write [(question, answers, index of the correct answer)] as llama.cpp's task file."""
    bodies = [_task(*t) for t in tasks]
    offsets, at = [], 4 + 4 * len(bodies)
    for b in bodies:
        offsets.append(at)
        at += len(b)
    tmp = Path(str(path) + ".tmp")
    tmp.write_bytes(struct.pack(f"<I{len(bodies)}I", len(bodies), *offsets) + b"".join(bodies))
    tmp.replace(path)


_EVAL = re.compile(r"prompt eval time =\s*([\d.]+) ms /\s*(\d+) tokens")
_TOTAL = re.compile(r"total time =\s*([\d.]+) ms")
_TASK = re.compile(r"^(\d+)\t([\d.]+)$", re.M)


def run(binary: str, gguf: str | Path, task_file: str | Path, n_tasks: int, threads: int,
        ctx: int = 512, extra: list[str] = (), timeout: float = 1800) -> dict:
    """One `llama-perplexity --multiple-choice` run over the file's n_tasks tasks, in order.

    Returns {"eval_s": seconds in decode calls, "total_s": seconds from creating its context
    to the end (the decode calls, taking each answer's log-probabilities from the logits,
    tokenizing), "tokens": tokens decoded, "correct": [0/1 per task, in file order], "log":
    the last 4000 characters of its output}. Raises
    RuntimeError with its output's tail when it fails or reports no timing."""
    cmd = [binary, "-m", str(gguf), "-bf", str(task_file), "--multiple-choice",
           "--multiple-choice-tasks", str(n_tasks), "-t", str(threads), "-tb", str(threads),
           "-c", str(ctx), "-v", *extra]            # -v: the perf lines are debug output
    with tempfile.TemporaryFile("w+") as log:
        p = subprocess.run(cmd, stdout=log, stderr=subprocess.STDOUT, timeout=timeout, text=True)
        log.seek(0)
        out = log.read()
    m, total = _EVAL.search(out), _TOTAL.search(out)
    if p.returncode != 0 or m is None or total is None:
        raise RuntimeError(f"{' '.join(cmd)} exited {p.returncode}:\n{out[-4000:]}")
    correct, before = [], 0
    for i, acc in _TASK.findall(out):       # running accuracy in % after task i
        hits = round(float(acc) * int(i) / 100)
        correct.append(hits - before)
        before = hits
    if len(correct) != n_tasks:
        raise RuntimeError(f"llama-perplexity scored {len(correct)} of {n_tasks} tasks:\n"
                           f"{out[-4000:]}")
    return {"eval_s": float(m.group(1)) / 1e3, "total_s": float(total.group(1)) / 1e3,
            "tokens": int(m.group(2)), "correct": correct, "log": out[-4000:]}
