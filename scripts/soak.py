"""A bounded soak of `colibri serve` on loopback: does it hold for an hour?

    python scripts/soak.py [MODEL] [--minutes 60] [--workers 1] [--clients 4]
        [--interval 60] [--reload-every 30] [--drop-every 5] [--max-tokens 24]

Starts `colibri serve` (the shipped model without MODEL; a copy of the file in a temporary
directory, so reloads can replace it) on a free 127.0.0.1 port, then for --minutes:

- steady load: --clients threads, each sending requests back to back with the official
  openai client, alternating streamed and non-streamed /v1/completions (and
  /v1/chat/completions when the model has a chat template), seeded sampling;
- reloads: every --reload-every seconds the served file is replaced by rename with a fresh
  copy (a new inode) and the server is sent SIGHUP (every worker reloads);
- client drops: every --drop-every seconds a client opens a stream, reads two chunks and
  closes the connection mid-stream;
- sampling: every --sample seconds, RSS, open file descriptors and threads summed over the
  server's processes (psutil: the supervisor and its workers).

Prints one row per --interval: requests, failures, p50 / p99 latency of the whole request
(and of the first streamed token), reloads, drops, RSS / fds / threads; then the verdict:
0 failures and flat resources over the samples after the first interval (the warm-up:
allocator arenas, first compiled paths): the median of the last third of them minus the
median of the first third within --max-rss-growth MiB, --max-fd-growth fds and
--max-thread-growth threads (medians, so the connections and threads of the requests in
flight at a sampling instant do not count); the least-squares slope per hour is printed too. Exit status 0 when all hold, 1 otherwise. The server is stopped at the
end (and on Ctrl-C).
"""
from __future__ import annotations

import argparse
import os
import shutil
import signal
import statistics
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import openai

from colibri.api import default_model_path
from serve_harness import Server, Usage, percentile

PROMPTS = ("The hummingbird is small, fast and frugal.", "def fibonacci(n):",
           "Mixture of experts models route each token to", "Once upon a time")


@dataclass
class Interval:
    """What happened in one reporting interval."""
    latency: list[float] = field(default_factory=list)      # seconds, whole request
    first_token: list[float] = field(default_factory=list)  # seconds, streamed requests
    requests: int = 0
    failures: list[str] = field(default_factory=list)
    reloads: int = 0
    drops: int = 0
    usage: list[Usage] = field(default_factory=list)


class Soak:
    def __init__(self, args, server: Server, served: Path):
        self.args, self.server, self.served = args, server, served
        self.start = time.monotonic()
        self.end = self.start + args.minutes * 60
        self.intervals: list[Interval] = [Interval()]
        self.samples: list[tuple[float, Usage]] = []       # (seconds since start, usage)
        self.lock = threading.Lock()
        self.stop = threading.Event()
        self.client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused",
                                    timeout=args.request_timeout, max_retries=0)
        self.model = self.client.models.list().data[0].id
        self.chat = self._chat_works()

    def now(self) -> Interval:
        with self.lock:
            return self.intervals[-1]

    def _chat_works(self) -> bool:
        try:
            self.client.chat.completions.create(
                model=self.model, messages=[{"role": "user", "content": "Hi"}], max_tokens=2)
            return True
        except openai.BadRequestError:      # no chat template in the file
            return False

    # -- the load ------------------------------------------------------------------------
    def one_request(self, k: int, i: int) -> None:
        a = self.args
        stream, chat = i % 2 == 1, self.chat and i % 4 >= 2
        kw = dict(model=self.model, max_tokens=a.max_tokens, temperature=0.8, seed=k * 7919 + i,
                  stream=stream)
        t0 = time.monotonic()
        first = None
        try:
            if chat:
                out = self.client.chat.completions.create(
                    messages=[{"role": "user", "content": PROMPTS[i % len(PROMPTS)]}], **kw)
            else:
                out = self.client.completions.create(prompt=PROMPTS[i % len(PROMPTS)], **kw)
            if stream:
                finish = None
                for chunk in out:
                    if first is None:
                        first = time.monotonic() - t0
                    if chunk.choices and chunk.choices[0].finish_reason:
                        finish = chunk.choices[0].finish_reason
            else:
                finish = out.choices[0].finish_reason
                if not out.usage.completion_tokens and finish != "stop":   # EOS first is fine
                    raise RuntimeError(f"no tokens generated (finish_reason {finish!r})")
            if finish not in ("stop", "length"):
                raise RuntimeError(f"finish_reason {finish!r}")
        except Exception as e:              # noqa: BLE001 - every failure is counted and shown
            iv = self.now()
            with self.lock:
                iv.failures.append(f"{'stream' if stream else 'whole'} "
                                   f"{'chat' if chat else 'completion'}: "
                                   f"{type(e).__name__}: {str(e)[:200]}")
                iv.requests += 1
            return
        iv = self.now()
        with self.lock:
            iv.requests += 1
            iv.latency.append(time.monotonic() - t0)
            if first is not None:
                iv.first_token.append(first)

    def client_loop(self, k: int) -> None:
        i = k
        while not self.stop.is_set() and time.monotonic() < self.end:
            self.one_request(k, i)
            i += 1

    def drop_one(self) -> None:
        """A stream closed by the client after two chunks (the socket goes away mid-stream)."""
        try:
            out = self.client.completions.create(model=self.model, prompt=PROMPTS[0],
                                                 max_tokens=200, stream=True)
            for n, _ in enumerate(out):
                if n == 1:
                    break
            out.close()
        except Exception as e:              # noqa: BLE001
            with self.lock:
                self.intervals[-1].failures.append(f"drop: {type(e).__name__}: {e}"[:200])
            return
        with self.lock:
            self.intervals[-1].drops += 1

    def reload_once(self) -> None:
        tmp = self.served.with_name(f".{self.served.name}.swap")
        shutil.copyfile(self.served, tmp)
        os.replace(tmp, self.served)            # a new inode, as `colibri convert --force`
        self.server.signal(signal.SIGHUP)
        with self.lock:
            self.intervals[-1].reloads += 1

    def every(self, seconds: float, action) -> None:
        while not self.stop.wait(seconds) and time.monotonic() < self.end:
            action()

    def sampler(self) -> None:
        while not self.stop.wait(self.args.sample) and time.monotonic() < self.end:
            u = self.server.usage()
            if self.server.proc.poll() is not None:
                with self.lock:
                    self.intervals[-1].failures.append(
                        f"the server exited with {self.server.proc.returncode}")
                self.stop.set()
                return
            with self.lock:
                self.samples.append((time.monotonic() - self.start, u))
                self.intervals[-1].usage.append(u)

    def run(self) -> None:
        a = self.args
        threads = [threading.Thread(target=self.client_loop, args=(k,), daemon=True)
                   for k in range(a.clients)]
        threads += [threading.Thread(target=self.every, args=(a.reload_every, self.reload_once),
                                     daemon=True),
                    threading.Thread(target=self.every, args=(a.drop_every, self.drop_one),
                                     daemon=True),
                    threading.Thread(target=self.sampler, daemon=True)]
        for t in threads:
            t.start()
        print_header()
        try:
            while time.monotonic() < self.end and not self.stop.is_set():
                edge = min(self.end, self.start + a.interval * len(self.intervals))
                self.stop.wait(max(0.0, edge - time.monotonic()))
                with self.lock:
                    done = self.intervals[-1]
                    self.intervals.append(Interval())
                print_row(len(self.intervals) - 1, edge - self.start, done)
        finally:
            self.stop.set()
            for t in threads:
                t.join(timeout=a.request_timeout + 5)
        with self.lock:
            tail = self.intervals.pop()
        if tail.requests or tail.failures:           # requests that finished after the end
            self.intervals.append(tail)


# --- the report -----------------------------------------------------------------------------

def ms(x: float | None) -> str:
    return "-" if x is None else f"{x * 1000:.0f}"


def print_header() -> None:
    print(f"{'#':>3} {'t min':>6} {'req':>5} {'fail':>4} {'p50 ms':>7} {'p99 ms':>7} "
          f"{'ttft50':>6} {'ttft99':>6} {'reload':>6} {'drop':>4} {'RSS MiB':>8} {'fds':>5} "
          f"{'thr':>4}", flush=True)


def print_row(n: int, t: float, iv: Interval) -> None:
    u = iv.usage[-1] if iv.usage else None
    print(f"{n:>3} {t / 60:>6.1f} {iv.requests:>5} {len(iv.failures):>4} "
          f"{ms(percentile(iv.latency, 50)):>7} {ms(percentile(iv.latency, 99)):>7} "
          f"{ms(percentile(iv.first_token, 50)):>6} {ms(percentile(iv.first_token, 99)):>6} "
          f"{iv.reloads:>6} {iv.drops:>4} "
          f"{(f'{u.rss / 2**20:.1f}' if u else '-'):>8} {(u.fds if u else '-'):>5} "
          f"{(u.threads if u else '-'):>4}", flush=True)
    for f in iv.failures[:5]:
        print(f"    failure: {f}", flush=True)


def slope_per_hour(points: list[tuple[float, float]]) -> float:
    """Least-squares slope of (seconds, value) points, in value per hour (0 for < 3 points)."""
    if len(points) < 3:
        return 0.0
    return statistics.linear_regression([t for t, _ in points],
                                        [v for _, v in points]).slope * 3600


def growth(values: list[float]) -> float:
    """Median of the last third minus median of the first third (0 for < 3 values)."""
    third = len(values) // 3
    if third < 1:
        return 0.0
    return statistics.median(values[-third:]) - statistics.median(values[:third])


def verdict(soak: Soak, args) -> bool:
    ivs = soak.intervals
    failures = [f for iv in ivs for f in iv.failures]
    requests = sum(iv.requests for iv in ivs)
    latency = [x for iv in ivs for x in iv.latency]
    steady = [(t, u) for t, u in soak.samples if t >= args.interval] or soak.samples
    rss = slope_per_hour([(t, u.rss / 2**20) for t, u in steady])
    fds = slope_per_hour([(t, u.fds) for t, u in steady])
    thr = slope_per_hour([(t, u.threads) for t, u in steady])
    first, last = steady[0][1], steady[-1][1]
    grow = {name: growth([get(u) for _, u in steady]) for name, get in
            (("rss", lambda u: u.rss / 2**20), ("fds", lambda u: u.fds),
             ("threads", lambda u: u.threads))}
    print()
    print(f"{requests} requests in {args.minutes:g} min ({len(failures)} failed), "
          f"{sum(iv.reloads for iv in ivs)} reloads, {sum(iv.drops for iv in ivs)} client "
          f"drops, latency p50 {ms(percentile(latency, 50))} ms p99 "
          f"{ms(percentile(latency, 99))} ms")
    print(f"after the warm-up ({len(steady)} samples, {last.processes} processes): RSS "
          f"{first.rss / 2**20:.1f} -> {last.rss / 2**20:.1f} MiB (growth {grow['rss']:+.1f} "
          f"MiB, slope {rss:+.1f} MiB/h), fds {first.fds} -> {last.fds} (growth "
          f"{grow['fds']:+g}, {fds:+.1f}/h), threads {first.threads} -> {last.threads} "
          f"(growth {grow['threads']:+g}, {thr:+.1f}/h)")
    checks = [("0 failures", not failures),
              ("requests served", requests > 0),
              (f"RSS growth <= {args.max_rss_growth:g} MiB", grow["rss"] <= args.max_rss_growth),
              (f"fd growth <= {args.max_fd_growth:g}", grow["fds"] <= args.max_fd_growth),
              (f"thread growth <= {args.max_thread_growth:g}",
               grow["threads"] <= args.max_thread_growth)]
    for name, ok in checks:
        print(f"  {'ok  ' if ok else 'FAIL'} {name}")
    ok = all(ok for _, ok in checks)
    print("verdict:", "flat, 0 failures" if ok else "FAILED")
    return ok


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("model", nargs="?", help=".colibri file (default: the shipped model)")
    p.add_argument("--minutes", type=float, default=60.0, help="length (default: 60)")
    p.add_argument("--interval", type=float, default=60.0,
                   help="seconds per table row; the first is the warm-up (default: 60)")
    p.add_argument("--sample", type=float, default=5.0,
                   help="seconds between resource samples (default: 5)")
    p.add_argument("--workers", type=int, default=1, help="colibri serve --workers (default: 1)")
    p.add_argument("--parallel", type=int, default=4, help="colibri serve --parallel (default: 4)")
    p.add_argument("--threads", type=int, default=1,
                   help="kernel threads per server process (default: 1)")
    p.add_argument("--clients", type=int, default=4, help="concurrent clients (default: 4)")
    p.add_argument("--max-tokens", type=int, default=24, help="per request (default: 24)")
    p.add_argument("--reload-every", type=float, default=30.0,
                   help="seconds between reloads (default: 30)")
    p.add_argument("--drop-every", type=float, default=5.0,
                   help="seconds between client drops mid-stream (default: 5)")
    p.add_argument("--request-timeout", type=float, default=60.0,
                   help="seconds a request may take before it counts as failed (default: 60)")
    p.add_argument("--max-rss-growth", type=float, default=16.0,
                   help="MiB the server's RSS may grow, first to last third (default: 16)")
    p.add_argument("--max-fd-growth", type=float, default=2.0,
                   help="file descriptors, first to last third (default: 2)")
    p.add_argument("--max-thread-growth", type=float, default=1.0,
                   help="threads, first to last third (default: 1)")
    p.add_argument("--server-log", default=None, help="write the server's log here")
    args = p.parse_args(argv)
    if args.minutes <= 0 or args.interval <= 0 or args.clients < 1 or args.workers < 1:
        p.error("--minutes, --interval, --clients and --workers must be positive")
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="colibri-soak-") as tmp:
        served = Path(tmp) / "soak.colibri"
        shutil.copyfile(args.model or default_model_path(), served)
        server = Server(str(served), workers=args.workers, parallel=args.parallel,
                        threads=args.threads, log_path=args.server_log)
        print("server:", " ".join(server.cmd), flush=True)
        try:
            server.wait(workers=args.workers if args.workers > 1 else None)
            soak = Soak(args, server, served)
            print(f"soak: {args.minutes:g} min, {args.clients} clients "
                  f"({'completions and chat' if soak.chat else 'completions'}, streamed and "
                  f"not), reload every {args.reload_every:g} s, a client drop every "
                  f"{args.drop_every:g} s, {args.workers} worker(s)", flush=True)
            soak.run()
            ok = verdict(soak, args)
        finally:
            code = server.stop()
        if code != 0:
            print(f"the server exited with status {code} on SIGTERM")
            ok = False
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
