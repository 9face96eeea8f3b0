"""What scripts/soak.py and scripts/chaos.py share: a `colibri serve` subprocess on a free
loopback port, its process tree (psutil), and percentiles.

Only loopback: the server binds 127.0.0.1 and every client connects there.
"""
from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from dataclasses import dataclass

import psutil

HOST = "127.0.0.1"


def free_port() -> int:
    with socket.socket() as s:
        s.bind((HOST, 0))
        return s.getsockname()[1]


def percentile(values: list[float], q: float) -> float | None:
    """The q-th percentile (0..100, nearest rank) of values; None when there are none."""
    if not values:
        return None
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, round(q / 100 * len(ordered) + 0.5) - 1))]


@dataclass
class Usage:
    """Resources of the server's processes at one instant (summed over them)."""
    processes: int
    rss: int          # bytes (shared pages count once per process)
    fds: int
    threads: int


class Server:
    """`python -m colibri serve [MODEL] --host 127.0.0.1 --port P --workers W ...` started
    now; wait() until /health answers; stop() with SIGTERM (SIGKILL after `grace`)."""

    def __init__(self, model: str | None, workers: int = 1, parallel: int = 4,
                 threads: int | None = 1, extra: list[str] | None = None,
                 log_path: str | None = None):
        self.port = free_port()
        self.url = f"http://{HOST}:{self.port}"
        self.cmd = [sys.executable, "-m", "colibri", "serve", *([model] if model else []),
                    "--host", HOST, "--port", str(self.port), "--workers", str(workers),
                    "--parallel", str(parallel), "--log-level", "warning",
                    *(["--threads", str(threads)] if threads else []), *(extra or [])]
        self.log = open(log_path or os.devnull, "w")
        self.proc = subprocess.Popen(self.cmd, stdout=self.log, stderr=subprocess.STDOUT)
        self.root = psutil.Process(self.proc.pid)

    def wait(self, timeout: float = 120.0, workers: int | None = None) -> None:
        """Until /health answers 200 (and, with workers, that many worker processes run)."""
        deadline = time.monotonic() + timeout
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError(f"colibri serve exited with {self.proc.returncode}")
            try:
                with urllib.request.urlopen(self.url + "/health", timeout=2) as r:
                    if r.status == 200 and (workers is None or len(self.workers()) >= workers):
                        return
            except OSError:
                pass
            if time.monotonic() > deadline:
                raise RuntimeError(f"colibri serve not healthy after {timeout:.0f} s")
            time.sleep(0.2)

    def workers(self) -> list[psutil.Process]:
        """The worker processes (the supervisor's children; [] for a single server)."""
        try:
            return self.root.children()
        except psutil.NoSuchProcess:
            return []

    def processes(self) -> list[psutil.Process]:
        return [self.root, *self.workers()]

    def usage(self) -> Usage:
        rss = fds = threads = n = 0
        for p in self.processes():
            try:
                with p.oneshot():
                    rss += p.memory_info().rss
                    fds += p.num_fds()
                    threads += p.num_threads()
                n += 1
            except psutil.NoSuchProcess:
                pass
        return Usage(n, rss, fds, threads)

    def signal(self, sig: int) -> None:
        os.kill(self.proc.pid, sig)

    def stop(self, grace: float = 30.0) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=grace)
            except subprocess.TimeoutExpired:
                for p in self.processes():
                    try:
                        p.kill()
                    except psutil.NoSuchProcess:
                        pass
                self.proc.wait()
        self.log.close()
        return self.proc.returncode
