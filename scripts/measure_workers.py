"""Memory of N worker processes over one model file: total RSS and PSS, bounded in time.

    python scripts/measure_workers.py MODEL [--workers 1,4] [--tokens 16]      # engine only
    python scripts/measure_workers.py MODEL --serve [--workers 1,4] [--requests 16]
    python scripts/measure_workers.py MODEL --spread [--workers 4] [--requests 48]

Engine only (no server): the page cache is warmed with the whole file, then for each worker
count N and each way of sharing the file:
- inherit: the parent maps the file (colibri.open) and forks; each child builds its Model
  from the inherited mapping;
- own: the parent forks without touching the file; each child maps it read-only itself;
each child generates --tokens tokens (touching the weights it routes to) and waits; the
figures are the sums over the parent and its children of Rss and Pss from
/proc/<pid>/smaps_rollup (and its Shared/Private split), then the children are killed.

--serve: `colibri serve MODEL --workers N` on a free loopback port, --requests streaming
requests spread over --clients connections, then the same sums over the supervisor and its
workers, and how many requests each worker answered (the x-colibri-worker header).

--spread: how requests spread over N forked servers (ModelHolder + create_app + serve, the
public API) listening either on one socket created before the fork and shared by all
("shared") or each on its own SO_REUSEPORT socket of the same port ("reuseport"), for 1 and
--clients concurrent clients sending --requests streaming requests: the requests each server
answered (largest first) and the wall time.

Figures are kB; PSS divides each shared page among the processes mapping it, so the PSS
total is the memory the N processes really take together.
"""
from __future__ import annotations

import argparse
import http.client
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections import Counter

import numpy as np

FIELDS = ("Rss", "Pss", "Shared_Clean", "Shared_Dirty", "Private_Clean", "Private_Dirty",
          "Anonymous")


def smaps_rollup(pid: int) -> dict[str, int]:
    """kB per field of /proc/<pid>/smaps_rollup."""
    out = {}
    with open(f"/proc/{pid}/smaps_rollup") as f:
        for line in f:
            parts = line.split()
            if len(parts) >= 3 and parts[0].rstrip(":") in FIELDS:
                out[parts[0].rstrip(":")] = int(parts[1])
    return out


def total(pids: list[int]) -> dict[str, int]:
    sums = dict.fromkeys(FIELDS, 0)
    for pid in pids:
        for k, v in smaps_rollup(pid).items():
            sums[k] += v
    return sums


def warm(path: str) -> None:
    with open(path, "rb") as f:
        while f.read(1 << 24):
            pass


def fork_engines(path: str, n: int, mode: str, tokens: int) -> list[int]:
    """n children, each with a Model of `path` (mode inherit | own), after `tokens` tokens."""
    import colibri                                       # no kernel has run in this process
    shared = colibri.open(path) if mode == "inherit" else None
    pids, ready = [], []
    for _ in range(n):
        r, w = os.pipe()
        pid = os.fork()
        if pid == 0:
            os.close(r)
            model = colibri.Model(shared if shared is not None else path)
            ids = np.arange(1, 9) % model.vocab_size
            colibri.generate(model, ids, max_new_tokens=tokens)
            os.write(w, b"1")
            signal.pause()
            os._exit(0)
        os.close(w)
        pids.append(pid)
        ready.append(r)
    for r in ready:
        if os.read(r, 1) != b"1":
            raise RuntimeError("a worker died before it was ready")
        os.close(r)
    return pids


def stop(pids: list[int]) -> None:
    for pid in pids:
        os.kill(pid, signal.SIGKILL)
    for pid in pids:
        os.waitpid(pid, 0)


def measure_engine(args) -> None:
    warm(args.model)
    print(f"{'mode':>8} {'workers':>7} {'RSS kB':>10} {'PSS kB':>10} {'shared kB':>10} "
          f"{'private kB':>10}  (sums over the parent and the workers)")
    for n in args.workers:
        for mode in ("inherit", "own"):
            # each measurement in a fresh process, so no kernel pool exists when it forks
            cmd = [sys.executable, __file__, args.model, "--_engine", mode, "--workers",
                   str(n), "--tokens", str(args.tokens)]
            t = json.loads(subprocess.run(cmd, check=True, capture_output=True,
                                          text=True).stdout)
            shared = t["Shared_Clean"] + t["Shared_Dirty"]
            private = t["Private_Clean"] + t["Private_Dirty"]
            print(f"{mode:>8} {n:>7} {t['Rss']:>10} {t['Pss']:>10} {shared:>10} {private:>10}")


# --- the real server ------------------------------------------------------------------------

def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def request(port: int, body: dict) -> str | None:
    """One streaming completion read to its end; the answering worker's pid (header)."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=120)
    try:
        conn.request("POST", "/v1/completions", body=json.dumps(body),
                     headers={"Content-Type": "application/json"})
        r = conn.getresponse()
        r.read()
        if r.status != 200:
            raise RuntimeError(f"HTTP {r.status}")
        return r.getheader("x-colibri-worker")
    finally:
        conn.close()


def send_requests(port: int, body: dict, n_requests: int, n_clients: int
                  ) -> tuple[Counter, float]:
    """n_requests requests shared among n_clients concurrent connections -> (requests per
    answering worker, wall seconds)."""
    seen: Counter = Counter()
    lock = threading.Lock()
    todo = list(range(n_requests))

    def client() -> None:
        while True:
            with lock:
                if not todo:
                    return
                todo.pop()
            w = request(port, body)
            with lock:
                seen[w] += 1

    start = time.perf_counter()
    threads = [threading.Thread(target=client) for _ in range(n_clients)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return seen, time.perf_counter() - start


def children(pid: int) -> list[int]:
    with open(f"/proc/{pid}/task/{pid}/children") as f:
        return [int(x) for x in f.read().split()]


def until_all_answer(port: int, n: int, body: dict, deadline: float) -> None:
    """Send 1-token requests until n different workers answered (or fail at deadline)."""
    while True:
        try:
            if len({request(port, dict(body, max_tokens=1)) for _ in range(4 * n)}) == n:
                return
        except OSError:
            pass
        if time.monotonic() > deadline:
            raise RuntimeError(f"not all of {n} servers answered")
        time.sleep(0.5)


def measure_serve(args) -> None:
    warm(args.model)
    print(f"{'workers':>7} {'RSS kB':>10} {'PSS kB':>10} {'shared kB':>10} {'private kB':>10} "
          f" requests per worker  (supervisor + workers)")
    for n in args.workers:
        port = free_port()
        proc = subprocess.Popen([sys.executable, "-m", "colibri", "serve", args.model,
                                 "--port", str(port), "--workers", str(n), "--parallel",
                                 str(args.parallel)], stdout=subprocess.DEVNULL,
                                stderr=subprocess.DEVNULL)
        try:
            deadline = time.monotonic() + args.startup_timeout
            while True:
                try:
                    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=5)
                    conn.request("GET", "/health")
                    if conn.getresponse().status == 200 and (
                            n == 1 or len(children(proc.pid)) == n):
                        break
                except OSError:
                    pass
                if time.monotonic() > deadline or proc.poll() is not None:
                    raise RuntimeError(f"colibri serve --workers {n} did not come up")
                time.sleep(0.5)
            body = {"prompt": "The hummingbird is small, fast and frugal.",
                    "max_tokens": args.tokens, "stream": True}
            if n > 1:       # every worker ready (started and answering), not just one
                until_all_answer(port, n, body, deadline)
            seen, _ = send_requests(port, body, args.requests, args.clients)
            pids = [proc.pid] + (children(proc.pid) if n > 1 else [])
            t = total(pids)
            shared = t["Shared_Clean"] + t["Shared_Dirty"]
            private = t["Private_Clean"] + t["Private_Dirty"]
            print(f"{n:>7} {t['Rss']:>10} {t['Pss']:>10} {shared:>10} {private:>10}  "
                  f"{dict(seen)}", flush=True)
        finally:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                proc.kill()


def spread_servers(model: str, n: int, sockets: str, port: int) -> list[int]:
    """n forked servers of `model` on `port`: one shared listening socket, or one
    SO_REUSEPORT socket each. Returns their pids."""
    from colibri.server import ModelHolder, Settings, create_app, serve
    from colibri.server.workers import WorkerHeader
    settings = Settings(model=model, port=port, parallel=2, log_level="warning")
    shared = None
    if sockets == "shared":
        shared = socket.socket()
        shared.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        shared.bind(("127.0.0.1", port))
        shared.listen(2048)
    pids = []
    for _ in range(n):
        pid = os.fork()
        if pid == 0:
            sock = shared
            if sock is None:
                sock = socket.socket()
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
                sock.bind(("127.0.0.1", port))
                sock.listen(2048)
            app = create_app(settings, ModelHolder(settings))
            app.add_middleware(WorkerHeader)
            serve(settings, sockets=[sock], app=app)
            os._exit(0)
        pids.append(pid)
    if shared is not None:
        shared.close()
    return pids


def measure_spread(args) -> None:
    warm(args.model)
    n = args.workers[-1]
    body = {"prompt": "The hummingbird is", "max_tokens": args.tokens, "stream": True}
    print(f"{'sockets':>9} {'clients':>7}  requests per server (largest first)  wall s")
    for sockets in ("shared", "reuseport"):
        for clients in (1, args.clients):
            port = free_port()
            pids = spread_servers(args.model, n, sockets, port)
            try:
                until_all_answer(port, n, body, time.monotonic() + args.startup_timeout)
                counts, wall = send_requests(port, body, args.requests, clients)
                print(f"{sockets:>9} {clients:>7}  {sorted(counts.values(), reverse=True)!s:<36}"
                      f" {wall:.1f}", flush=True)
            finally:
                for pid in pids:
                    os.kill(pid, signal.SIGTERM)
                for pid in pids:
                    os.waitpid(pid, 0)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("model")
    p.add_argument("--workers", default=[1, 4], type=lambda s: [int(x) for x in s.split(",")])
    p.add_argument("--tokens", type=int, default=16)
    p.add_argument("--serve", action="store_true", help="measure `colibri serve --workers N`")
    p.add_argument("--spread", action="store_true",
                   help="requests per server: one shared socket vs SO_REUSEPORT")
    p.add_argument("--requests", type=int, default=16)
    p.add_argument("--clients", type=int, default=4)
    p.add_argument("--parallel", type=int, default=2)
    p.add_argument("--startup-timeout", type=float, default=300.0)
    p.add_argument("--_engine", choices=("inherit", "own"), help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    print(f"load average {os.getloadavg()[0]:.2f}", file=sys.stderr)
    if args._engine:
        pids = fork_engines(args.model, args.workers[0], args._engine, args.tokens)
        try:
            print(json.dumps(total([os.getpid(), *pids])))
        finally:
            stop(pids)
    elif args.serve:
        measure_serve(args)
    elif args.spread:
        measure_spread(args)
    else:
        measure_engine(args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
