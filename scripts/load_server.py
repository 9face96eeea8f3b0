"""A bounded load campaign against `colibri serve` on loopback; prints its figures.

    python scripts/load_server.py [MODEL] [--url http://127.0.0.1:8080] [--clients 1,2,4,8]
        [--duration 10] [--max-tokens 32] [--parallel 4] [--workers 1]
        [--phases load,reload,drop] [--reload-every 3] [--drop 8]

Without --url it starts `colibri serve MODEL` itself on a free loopback port (the shipped
model when MODEL is omitted) and stops it at the end. Three phases, each bounded in time:

- load: for each client count C in --clients, C threads each send streaming
  /v1/completions requests back to back for --duration seconds. Per phase: requests,
  failures (a status other than 200, a broken stream, no `data: [DONE]`), time to first
  token p50/p99, inter-token latency p50/p99 (gaps between chunks), total tokens/s
  (generated tokens of all streams / wall time), and how the requests spread over the
  serving processes (the x-colibri-worker response header, with --workers).
- reload: --reload-clients streams for --duration seconds while the server is sent SIGHUP
  every --reload-every seconds; with --swap, each reload first replaces the served file by
  rename with a fresh copy of itself (a new inode, as `colibri convert --force` does).
  Expect 0 failures, and every response's chunks carrying exactly one model version (the
  `system_fingerprint` field).
- drop: --drop clients open streams (--drop-max-tokens each), read --drop-after chunks and
  close their socket; then /metrics is read until no slot is busy (at most --settle
  seconds). Expect slots idle afterwards = slots total, and far fewer tokens generated
  (colibri_completion_tokens) than were asked for.

Only the standard library: http.client over one connection per request.
"""
from __future__ import annotations

import argparse
import http.client
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.parse
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

from colibri.api import default_model_path

PROMPT = "The hummingbird is small, fast and frugal. Mixture of experts models"
WORKER_HEADER = "x-colibri-worker"


# --- one streaming request ------------------------------------------------------------------

@dataclass
class Stream:
    """What one streaming request did. Times in seconds from sending the request."""
    ok: bool = False
    error: str | None = None
    ttft: float | None = None
    gaps: list[float] = field(default_factory=list)
    tokens: int = 0
    versions: set = field(default_factory=set)
    worker: str | None = None
    finish_reason: str | None = None


@dataclass
class Target:
    host: str
    port: int
    api_key: str | None = None
    timeout: float = 60.0

    def connect(self) -> http.client.HTTPConnection:
        return http.client.HTTPConnection(self.host, self.port, timeout=self.timeout)

    def headers(self) -> dict:
        h = {"Content-Type": "application/json"}
        if self.api_key:
            h["Authorization"] = f"Bearer {self.api_key}"
        return h

    def get(self, path: str) -> tuple[int, str]:
        conn = self.connect()
        try:
            conn.request("GET", path, headers=self.headers())
            r = conn.getresponse()
            return r.status, r.read().decode("utf-8", "replace")
        finally:
            conn.close()


def stream_completion(target: Target, body: dict, drop_after: int | None = None) -> Stream:
    """POST a streaming /v1/completions request and read its SSE chunks.

    drop_after: close the socket after that many chunks (a client that goes away)."""
    out = Stream()
    conn = target.connect()
    start = time.perf_counter()
    last = None
    try:
        conn.request("POST", "/v1/completions", body=json.dumps(body), headers=target.headers())
        r = conn.getresponse()
        out.worker = r.getheader(WORKER_HEADER)
        if r.status != 200:
            out.error = f"HTTP {r.status}: {r.read()[:200]!r}"
            return out
        chunks = 0
        while True:
            line = r.readline()
            if not line:
                out.error = "stream ended without data: [DONE]"
                return out
            line = line.strip()
            if not line.startswith(b"data:"):
                continue
            data = line[5:].strip()
            if data == b"[DONE]":
                out.ok = True
                return out
            chunk = json.loads(data)
            if "error" in chunk:
                out.error = f"error event: {chunk['error']}"
                return out
            now = time.perf_counter() - start
            out.versions.add(chunk.get("system_fingerprint"))
            for choice in chunk.get("choices", []):
                if choice.get("finish_reason"):
                    out.finish_reason = choice["finish_reason"]
                if choice.get("text"):
                    out.tokens += 1
                    if out.ttft is None:
                        out.ttft = now
                    else:
                        out.gaps.append(now - last)
                    last = now
            chunks += 1
            if drop_after is not None and chunks >= drop_after:
                conn.sock.shutdown(socket.SHUT_RDWR)
                out.ok = True
                return out
    except (OSError, http.client.HTTPException, ValueError) as e:
        out.error = f"{type(e).__name__}: {e}"
        return out
    finally:
        conn.close()


def run_clients(target: Target, body: dict, clients: int,
                duration: float) -> tuple[list[Stream], float]:
    """`clients` threads sending requests back to back until `duration` has passed (a request
    running at the deadline finishes). Returns (every stream, wall seconds)."""
    results: list[Stream] = []
    lock = threading.Lock()
    deadline = time.perf_counter() + duration

    def client(k: int) -> None:
        n = 0
        while time.perf_counter() < deadline:
            s = stream_completion(target, dict(body, seed=1000 * k + n))
            n += 1
            with lock:
                results.append(s)

    start = time.perf_counter()
    threads = [threading.Thread(target=client, args=(k,)) for k in range(clients)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return results, time.perf_counter() - start


# --- figures --------------------------------------------------------------------------------

def percentile(values: list[float], q: float) -> float | None:
    if not values:
        return None
    v = sorted(values)
    return v[min(len(v) - 1, int(round(q / 100 * (len(v) - 1))))]


def ms(x: float | None) -> str:
    return "-" if x is None else f"{1000 * x:.1f}"


def summarize(streams: list[Stream], wall: float) -> dict:
    ttft = [s.ttft for s in streams if s.ok and s.ttft is not None]
    gaps = [g for s in streams if s.ok for g in s.gaps]
    tokens = sum(s.tokens for s in streams)
    return {
        "requests": len(streams), "failures": sum(not s.ok for s in streams),
        "ttft_p50": percentile(ttft, 50), "ttft_p99": percentile(ttft, 99),
        "itl_p50": percentile(gaps, 50), "itl_p99": percentile(gaps, 99),
        "tokens": tokens, "tokens_per_s": tokens / wall if wall else 0.0,
        "workers": dict(Counter(s.worker for s in streams if s.worker)),
        "errors": Counter(s.error for s in streams if s.error).most_common(3),
    }


def print_table(rows: list[tuple[str, dict]]) -> None:
    print(f"{'clients':>8} {'requests':>8} {'failed':>6} {'TTFT p50':>9} {'TTFT p99':>9} "
          f"{'ITL p50':>8} {'ITL p99':>8} {'tokens':>7} {'tok/s':>7}  (ms)")
    for name, f in rows:
        print(f"{name:>8} {f['requests']:>8} {f['failures']:>6} {ms(f['ttft_p50']):>9} "
              f"{ms(f['ttft_p99']):>9} {ms(f['itl_p50']):>8} {ms(f['itl_p99']):>8} "
              f"{f['tokens']:>7} {f['tokens_per_s']:>7.1f}")
        if f["workers"]:
            print(f"{'':>8} requests per worker pid: {f['workers']}")
        for err, n in f["errors"]:
            print(f"{'':>8} {n} x {err}")


def read_metrics(target: Target, workers: int = 1) -> dict[str, float]:
    """name -> value of the unlabelled samples of /metrics (labelled ones summed by name),
    summed over `workers` processes: /metrics is read until that many different pids
    (X-Colibri-Worker) answered, since each worker counts for itself."""
    by_worker: dict[str | None, dict[str, float]] = {}
    # several connections open at once: a worker takes one connection after another only
    # when they arrive together (one at a time, the idle worker that answered last wins)
    for _ in range(10):
        conns = [target.connect() for _ in range(4 * workers)]
        try:
            for conn in conns:
                conn.connect()
            for conn in conns:
                conn.request("GET", "/metrics", headers=target.headers())
            for conn in conns:
                r = conn.getresponse()
                text = r.read().decode("utf-8", "replace")
                if r.status != 200:
                    raise RuntimeError(f"/metrics answered {r.status}: {text[:200]}")
                values: dict[str, float] = {}
                for line in text.splitlines():
                    m = re.match(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{[^}]*\})?\s+(\S+)", line)
                    if m:
                        values[m.group(1)] = values.get(m.group(1), 0.0) + float(m.group(3))
                by_worker[r.getheader(WORKER_HEADER)] = values
        finally:
            for conn in conns:
                conn.close()
        if len(by_worker) >= workers:
            break
    else:
        raise RuntimeError(f"/metrics answered from {len(by_worker)} of {workers} workers")
    total: dict[str, float] = {}
    for values in by_worker.values():
        for k, v in values.items():
            total[k] = total.get(k, 0.0) + v
    return total


def metric(values: dict[str, float], suffix: str) -> float:
    names = [n for n in values if n.endswith(suffix)]
    if not names:
        raise RuntimeError(f"/metrics has no metric ending in {suffix!r}")
    return values[names[0]]


# --- the server under test ------------------------------------------------------------------

def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_healthy(target: Target, proc: subprocess.Popen | None, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:
            raise RuntimeError(f"colibri serve exited with status {proc.returncode}")
        try:
            if target.get("/health")[0] == 200:
                return
        except OSError:
            pass
        time.sleep(0.2)
    raise RuntimeError(f"no healthy server at {target.host}:{target.port} after {timeout} s")


def start_server(model: str | None, args, port: int) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "colibri", "serve", *([model] if model else []),
           "--host", "127.0.0.1", "--port", str(port), "--parallel", str(args.parallel),
           "--workers", str(args.workers), *args.serve_arg]
    print("server:", " ".join(cmd), flush=True)
    return subprocess.Popen(cmd, stdout=subprocess.DEVNULL if args.quiet_server else None,
                            stderr=subprocess.DEVNULL if args.quiet_server else None)


class Reloader(threading.Thread):
    """SIGHUP to the server every `every` seconds; with `served`, that file is first replaced
    by rename with a fresh copy of itself (a new inode, as `colibri convert --force` does)."""

    def __init__(self, pid: int, every: float, served: Path | None):
        super().__init__(daemon=True)
        self.pid, self.every, self.served = pid, every, served
        self.stop = threading.Event()
        self.count = 0

    def run(self) -> None:
        while not self.stop.wait(self.every):
            if self.served is not None:
                tmp = self.served.with_name(f".{self.served.name}.swap")
                shutil.copyfile(self.served, tmp)
                os.replace(tmp, self.served)
            os.kill(self.pid, signal.SIGHUP)
            self.count += 1


# --- the phases -----------------------------------------------------------------------------

def phase_load(target: Target, body: dict, args) -> None:
    print(f"\n== load: streaming clients for {args.duration} s each, max_tokens "
          f"{args.max_tokens}", flush=True)
    rows = []
    for c in args.clients:
        streams, wall = run_clients(target, body, c, args.duration)
        rows.append((str(c), summarize(streams, wall)))
    print_table(rows)


def phase_reload(target: Target, body: dict, args, pid: int, served: Path | None) -> bool:
    print(f"\n== reload: {args.reload_clients} clients for {args.duration} s, SIGHUP every "
          f"{args.reload_every} s{' (file swapped by rename first)' if served else ''}",
          flush=True)
    reloader = Reloader(pid, args.reload_every, served)
    reloader.start()
    streams, wall = run_clients(target, body, args.reload_clients, args.duration)
    reloader.stop.set()
    reloader.join()
    f = summarize(streams, wall)
    print_table([(str(args.reload_clients), f)])
    mixed = sum(len(s.versions) != 1 for s in streams if s.ok)
    seen = Counter(next(iter(s.versions)) for s in streams if s.ok and len(s.versions) == 1)
    print(f"reloads sent: {reloader.count}; failed requests: {f['failures']}; responses not "
          f"from exactly one model version: {mixed}; versions served: {len(seen)} "
          f"{dict(seen)}")
    return f["failures"] == 0 and mixed == 0


def phase_drop(target: Target, body: dict, args) -> bool:
    print(f"\n== drop: {args.drop} clients close their stream after {args.drop_after} "
          f"chunks", flush=True)
    results: list[Stream] = []
    before = metric(read_metrics(target, args.workers), "completion_tokens_total")
    threads = [threading.Thread(target=lambda: results.append(
        stream_completion(target, dict(body, max_tokens=args.drop_max_tokens),
                          drop_after=args.drop_after))) for _ in range(args.drop)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    dropped = sum(s.ok for s in results)
    deadline = time.monotonic() + args.settle
    start = time.monotonic()
    while True:
        m = read_metrics(target, args.workers)
        busy, total = metric(m, "slots_busy"), metric(m, "slots_total")
        if busy == 0 or time.monotonic() > deadline:
            break
        time.sleep(0.1)
    generated = metric(m, "completion_tokens_total") - before
    print(f"dropped mid-stream: {dropped} of {args.drop}; slots idle afterwards "
          f"{total - busy:.0f} of {total:.0f} (after {time.monotonic() - start:.1f} s); "
          f"tokens generated for them {generated:.0f} of the {args.drop * args.drop_max_tokens}"
          f" asked for")
    return busy == 0


# --- main -----------------------------------------------------------------------------------

def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("model", nargs="?", help=".colibri file to serve (default: the shipped model)")
    p.add_argument("--url", help="an already running server (default: start one)")
    p.add_argument("--api-key", default=os.environ.get("COLIBRI_API_KEY"))
    p.add_argument("--pid", type=int, help="pid to send SIGHUP to (with --url)")
    p.add_argument("--clients", default="1,2,4,8",
                   type=lambda s: [int(c) for c in s.split(",")])
    p.add_argument("--duration", type=float, default=10.0, help="seconds per load step")
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--temperature", type=float, default=0.8)
    p.add_argument("--prompt", default=PROMPT)
    p.add_argument("--phases", default="load,reload,drop")
    p.add_argument("--reload-every", type=float, default=3.0)
    p.add_argument("--reload-clients", type=int, default=4)
    p.add_argument("--swap", action="store_true",
                   help="each reload first swaps the served file by rename (needs the server "
                        "started here)")
    p.add_argument("--drop", type=int, default=8)
    p.add_argument("--drop-after", type=int, default=2)
    p.add_argument("--drop-max-tokens", type=int, default=256,
                   help="max_tokens of the dropped streams (they end long before)")
    p.add_argument("--settle", type=float, default=10.0,
                   help="seconds to wait for the slots to be idle after the drops")
    p.add_argument("--parallel", type=int, default=4, help="slots of the started server")
    p.add_argument("--workers", type=int, default=1,
                   help="workers of the started server (or of the one at --url)")
    p.add_argument("--serve-arg", action="append", default=[],
                   help="extra argument for the started `colibri serve` (repeatable)")
    p.add_argument("--quiet-server", action="store_true", help="discard the server's logs")
    p.add_argument("--startup-timeout", type=float, default=120.0)
    return p.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    phases = [x.strip() for x in args.phases.split(",") if x.strip()]
    body = {"prompt": args.prompt, "max_tokens": args.max_tokens, "stream": True,
            "temperature": args.temperature}
    proc, tmpdir, served = None, None, None
    if args.url:
        u = urllib.parse.urlsplit(args.url)
        target = Target(u.hostname, u.port or 80, args.api_key)
        pid = args.pid
    else:
        model = args.model
        if args.swap:
            tmpdir = Path(tempfile.mkdtemp(prefix="colibri-load-"))
            served = tmpdir / "served.colibri"
            shutil.copyfile(model or default_model_path(), served)
            model = str(served)
        port = free_port()
        target = Target("127.0.0.1", port, args.api_key)
        proc = start_server(model, args, port)
        pid = proc.pid
    print(f"load: {os.uname().nodename}, {os.cpu_count()} CPUs, load average "
          f"{os.getloadavg()[0]:.2f}", flush=True)
    ok = True
    try:
        wait_healthy(target, proc, args.startup_timeout)
        if "load" in phases:
            phase_load(target, body, args)
        if "reload" in phases:
            if pid is None:
                print("reload: skipped (give --pid with --url)")
            else:
                ok &= phase_reload(target, body, args, pid, served)
        if "drop" in phases:
            ok &= phase_drop(target, body, args)
    finally:
        if proc is not None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                proc.kill()
        if tmpdir is not None:
            shutil.rmtree(tmpdir, ignore_errors=True)
    print(f"\nload average at the end {os.getloadavg()[0]:.2f}; checks "
          f"{'passed' if ok else 'FAILED'}")
    return 0 if ok else 1



if __name__ == "__main__":
    sys.exit(main())
