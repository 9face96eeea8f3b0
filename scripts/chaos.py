"""Chaos check of `colibri serve --workers 2`: kill -9 a worker mid-stream, on loopback.

    python scripts/chaos.py [MODEL] [--streams 6] [--max-tokens 400] [--rounds 1]

Starts `colibri serve --workers 2` (the shipped model without MODEL) on a free 127.0.0.1
port and, each round:

1. opens --streams concurrent streamed /v1/completions with the official openai client
   (each notes the worker that answers it, the X-Colibri-Worker header) and waits until
   every one has received tokens and both workers hold streams;
2. sends SIGKILL to one worker (found among the supervisor's children with psutil);
3. checks, each within a bounded time (no hang): the killed worker's streams end with an
   error the client sees (the connection closes mid-stream: no finish_reason, an exception
   from the client), the other worker's streams all finish normally (finish_reason
   "length"/"stop", every token), the supervisor starts a new worker (a new pid among its
   children) and, once it is up, --after requests (streamed and not) all succeed and the
   new worker answers some of them.

Prints the timeline (seconds from the start of the round) and a verdict; exit status 0 when
every check holds, 1 otherwise. The server is stopped at the end.
"""
from __future__ import annotations

import argparse
import sys
import threading
import time
from dataclasses import dataclass, field

import openai
import psutil

from serve_harness import Server

WORKER_HEADER = "x-colibri-worker"
PROMPT = "The hummingbird is small, fast and frugal. Mixture of experts models"


@dataclass
class StreamResult:
    """One streamed request: who served it, what came, how it ended."""
    index: int
    worker: int | None = None
    tokens: int = 0
    finish: str | None = None
    error: str | None = None
    ended: float | None = None          # seconds from the round's start
    first: threading.Event = field(default_factory=threading.Event)
    done: threading.Event = field(default_factory=threading.Event)


class Timeline:
    def __init__(self):
        self.start = time.monotonic()
        self.events: list[tuple[float, str]] = []
        self.lock = threading.Lock()

    def t(self) -> float:
        return time.monotonic() - self.start

    def note(self, text: str, at: float | None = None) -> None:
        at = self.t() if at is None else at
        with self.lock:
            self.events.append((at, text))
        print(f"  {at:7.2f} s  {text}", flush=True)


def run_stream(client: openai.OpenAI, model: str, r: StreamResult, max_tokens: int,
               line: Timeline) -> None:
    try:
        raw = client.completions.with_raw_response.create(
            model=model, prompt=PROMPT, max_tokens=max_tokens, temperature=0.8,
            seed=r.index, stream=True)
        r.worker = int(raw.headers.get(WORKER_HEADER, 0)) or None
        for chunk in raw.parse():
            if chunk.choices:
                r.tokens += 1
                r.first.set()
                r.finish = chunk.choices[0].finish_reason or r.finish
    except Exception as e:              # noqa: BLE001 - what the client sees is the result
        r.error = f"{type(e).__name__}: {str(e)[:160]}"
    finally:
        r.ended = line.t()
        r.first.set()
        r.done.set()


def one_request(client: openai.OpenAI, model: str, i: int) -> tuple[bool, int | None, str]:
    """A request after the restart: (ok, worker pid, what went wrong)."""
    try:
        if i % 2:
            raw = client.completions.with_raw_response.create(
                model=model, prompt=PROMPT, max_tokens=8, stream=True)
            finish = None
            for chunk in raw.parse():
                if chunk.choices:
                    finish = chunk.choices[0].finish_reason or finish
        else:
            raw = client.completions.with_raw_response.create(model=model, prompt=PROMPT,
                                                              max_tokens=8)
            finish = raw.parse().choices[0].finish_reason
        pid = int(raw.headers.get(WORKER_HEADER, 0)) or None
        return finish in ("length", "stop"), pid, f"finish_reason {finish!r}"
    except Exception as e:              # noqa: BLE001
        return False, None, f"{type(e).__name__}: {str(e)[:160]}"


def seen(results, pids) -> bool:
    return any(pid in pids for _, pid, _ in results)


def wait_until(predicate, timeout: float, step: float = 0.05) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(step)
    return predicate()


def chaos_round(server: Server, args, n: int) -> list[tuple[str, bool, str]]:
    """One kill; the (check, ok, detail) list."""
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0,
                           timeout=args.timeout)
    model = client.models.list().data[0].id
    line = Timeline()
    print(f"round {n}:", flush=True)
    before = {p.pid for p in server.workers()}
    line.note(f"workers {sorted(before)}")
    streams: list[StreamResult] = []
    threads: list[threading.Thread] = []

    def open_streams(count: int) -> None:
        for _ in range(count):
            r = StreamResult(len(streams))
            streams.append(r)
            t = threading.Thread(target=run_stream, args=(client, model, r, args.max_tokens,
                                                          line), daemon=True)
            threads.append(t)
            t.start()

    open_streams(args.streams)
    while True:                         # tokens flowing on every stream, both workers used
        for r in streams:
            r.first.wait(args.timeout)
        live = [r for r in streams if not r.done.is_set() and r.worker]
        if len({r.worker for r in live}) >= 2 or len(streams) >= 4 * args.streams:
            break
        open_streams(2)                 # the kernel gave them all to one worker: more
    live = [r for r in streams if not r.done.is_set() and r.worker]
    by_worker = {w: [r.index for r in live if r.worker == w] for w in {r.worker for r in live}}
    line.note(f"{len(live)} streams live, by worker: {by_worker}")
    checks: list[tuple[str, bool, str]] = []
    if len(by_worker) < 2:
        return [("streams on both workers", False, f"{by_worker}")]
    victim = max(by_worker, key=lambda w: len(by_worker[w]))
    open_at_kill = {r.index for r in streams if not r.done.is_set()}
    psutil.Process(victim).kill()                       # SIGKILL
    kill_t = line.t()
    line.note(f"kill -9 worker {victim} ({len(by_worker[victim])} streams on it)", kill_t)
    # a stream of the victim that finished before the kill counts with the others
    killed = [r for r in streams if r.worker == victim and r.index in open_at_kill]
    others = [r for r in streams if r not in killed]
    ended = all(r.done.wait(max(0.1, args.timeout - line.t())) for r in streams)
    for r in sorted(streams, key=lambda r: r.ended or 1e9):
        line.note(f"stream {r.index} (worker {r.worker}) ended: {r.tokens} tokens, "
                  + (f"error {r.error}" if r.error else f"finish {r.finish}"), r.ended)
    checks.append(("every stream ended within the timeout (no hang)", ended,
                   f"{sum(not r.done.is_set() for r in streams)} still open"))
    bad_kill = [r.index for r in killed if r.finish is not None or r.error is None]
    checks.append(("the killed worker's streams ended with an error the client sees",
                   not bad_kill, f"streams {bad_kill} did not"))
    bad_other = [f"{r.index}: {r.error or r.finish}" for r in others
                 if r.error is not None or r.finish not in ("length", "stop")]
    slow = [r.index for r in killed if r.ended is None or r.ended - kill_t > args.error_within]
    checks.append((f"... within {args.error_within:g} s of the kill", not slow,
                   f"streams {slow} later"))
    checks.append(("the other worker's streams all finished", not bad_other,
                   "; ".join(bad_other)))
    short = [r.index for r in others if r.finish == "length" and r.tokens < args.max_tokens]
    checks.append(("... with every token asked for", not short, f"streams {short} short"))
    restarted = wait_until(lambda: len({p.pid for p in server.workers()} - before) >= 1
                           and len(server.workers()) == 2, args.restart_timeout)
    new = sorted({p.pid for p in server.workers()} - before)
    line.note(f"workers now {sorted(p.pid for p in server.workers())} (new: {new})")
    checks.append(("the supervisor started a new worker", restarted and victim not in
                   {p.pid for p in server.workers()}, f"new {new}"))
    # batches of concurrent requests: one at a time, the idle old worker would take them all
    results: list[tuple[bool, int | None, str]] = []
    deadline = time.monotonic() + args.restart_timeout
    while len(results) < args.after or (new and not seen(results, new)
                                         and time.monotonic() < deadline):
        batch: list = [None] * max(2, args.parallel)
        workers = [threading.Thread(target=lambda j: batch.__setitem__(
            j, one_request(client, model, len(results) + j)), args=(j,), daemon=True)
            for j in range(len(batch))]
        for t in workers:
            t.start()
        for t in workers:
            t.join(args.timeout)
        results += [b or (False, None, "no answer within the timeout") for b in batch]
    seen_new = seen(results, new)
    failed = [why for ok, _, why in results if not ok]
    line.note(f"{len(results)} requests after the restart: {len(results) - len(failed)} ok, "
              f"answered by {sorted({pid for _, pid, _ in results if pid})}")
    checks.append(("requests after the restart all succeeded", not failed,
                   "; ".join(failed[:3])))
    checks.append(("the new worker answers", seen_new, f"no answer from {new}"))
    for t in threads:
        t.join(timeout=1)
    return checks


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("model", nargs="?", help=".colibri file (default: the shipped model)")
    p.add_argument("--streams", type=int, default=6, help="concurrent streams (default: 6)")
    p.add_argument("--max-tokens", type=int, default=400,
                   help="tokens per stream: long enough to outlive the kill (default: 400)")
    p.add_argument("--parallel", type=int, default=4, help="colibri serve --parallel (default: 4)")
    p.add_argument("--rounds", type=int, default=1, help="kills, one per round (default: 1)")
    p.add_argument("--after", type=int, default=6,
                   help="requests after the restart (default: 6)")
    p.add_argument("--timeout", type=float, default=60.0,
                   help="seconds any stream may take, from its round's start (default: 60)")
    p.add_argument("--error-within", type=float, default=5.0,
                   help="seconds after the kill by which its streams must have ended "
                        "(default: 5)")
    p.add_argument("--restart-timeout", type=float, default=60.0,
                   help="seconds the supervisor may take to start a new worker (default: 60)")
    p.add_argument("--server-log", default=None, help="write the server's log here")
    return p.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    server = Server(args.model, workers=2, parallel=args.parallel, threads=1,
                    log_path=args.server_log)
    print("server:", " ".join(server.cmd), flush=True)
    checks: list[tuple[str, bool, str]] = []
    try:
        server.wait(workers=2)
        for n in range(1, args.rounds + 1):
            checks += chaos_round(server, args, n)
    finally:
        code = server.stop()
    checks.append(("the supervisor stopped cleanly on SIGTERM", code == 0, f"status {code}"))
    print()
    for name, ok, detail in checks:
        print(f"  {'ok  ' if ok else 'FAIL'} {name}" + ("" if ok else f": {detail}"))
    ok = all(ok for _, ok, _ in checks)
    print("verdict:", "survived" if ok else "FAILED")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
