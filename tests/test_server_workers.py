"""`colibri serve --workers 2`: real processes, real signals.

One supervisor and two workers behind one port serve a copy of the shipped model: requests
reach both workers (the x-colibri-worker header names the pid that answered); SIGHUP to the
supervisor makes every worker reload a file replaced by rename; a killed worker is replaced
and logged; SIGTERM stops them all and removes the pid file.
"""
from __future__ import annotations

import http.client
import json
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

pytest.importorskip("fastapi", reason="the server extra is not installed "
                    "(pip install 'colibri[server]')")

from colibri.api import default_model_path  # noqa: E402
from server_helpers import children, free_port  # noqa: E402

WORKER_HEADER = "x-colibri-worker"
VERSION_HEADER = "x-colibri-model-version"


def alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(")")[-1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def until(what: str, check, timeout: float = 60.0, every: float = 0.1):
    deadline = time.monotonic() + timeout
    while True:
        value = check()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"{what}: not within {timeout} s")
        time.sleep(every)


def complete(port: int, max_tokens: int = 4) -> tuple[str, str, str]:
    """(worker pid, model version header, system_fingerprint) of one completion request."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
    try:
        conn.request("POST", "/v1/completions", body=json.dumps(
            {"prompt": "Hello", "max_tokens": max_tokens}),
            headers={"Content-Type": "application/json"})
        r = conn.getresponse()
        body = r.read()
        assert r.status == 200, body
        return (r.getheader(WORKER_HEADER), r.getheader(VERSION_HEADER),
                json.loads(body).get("system_fingerprint"))
    finally:
        conn.close()


def healthy(port: int) -> bool:
    try:
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=5)
        conn.request("GET", "/health")
        return conn.getresponse().status == 200
    except OSError:
        return False


class Served:
    """`colibri serve MODEL --workers 2` in a subprocess; its log lines are collected."""

    def __init__(self, tmp: Path, workers: int = 2):
        self.model = tmp / "served.colibri"
        shutil.copyfile(default_model_path(), self.model)
        self.pid_file = tmp / "serve.pid"
        self.port = free_port()
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "colibri", "serve", str(self.model), "--port",
             str(self.port), "--workers", str(workers), "--parallel", "2", "--ctx", "128",
             "--pid-file", str(self.pid_file)],
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
            text=True)
        self.log: list[str] = []
        threading.Thread(target=self._read, daemon=True).start()
        until("two workers and /health", lambda: len(children(self.proc.pid)) == workers
              and healthy(self.port), timeout=120)

    def _read(self) -> None:
        for line in self.proc.stdout:
            self.log.append(line)

    def workers(self) -> list[int]:
        return children(self.proc.pid)

    def replace_model(self) -> None:
        """A new inode at the served path, as `colibri convert --force` makes."""
        tmp = self.model.with_name(".served.colibri.new")
        shutil.copyfile(self.model, tmp)
        os.replace(tmp, self.model)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                for pid in self.workers():
                    os.kill(pid, signal.SIGKILL)
                self.proc.kill()
                self.proc.wait()


@pytest.fixture
def served(tmp_path):
    s = Served(tmp_path)
    yield s
    s.stop()


def seen_workers(s: Served, want: set[str], timeout: float = 60.0, **kw) -> dict[str, tuple]:
    """Requests until every pid in `want` answered; pid -> (version header, fingerprint)."""
    seen: dict[str, tuple] = {}

    def more():
        for _ in range(4):
            pid, version, fingerprint = complete(s.port, **kw)
            seen[pid] = (version, fingerprint)
        return want <= set(seen)

    until(f"answers from workers {sorted(want)} (seen {sorted(seen)})", more, timeout,
          every=0)
    return seen


def test_workers_share_the_port_reload_restart_and_stop(served):
    s = served
    assert int(s.pid_file.read_text()) == s.proc.pid
    workers = s.workers()
    assert len(workers) == 2
    assert any("kernel threads per worker" in line for line in s.log), "".join(s.log[:10])

    # requests spread over both workers, all on the same model version
    seen = seen_workers(s, {str(p) for p in workers})
    assert set(seen) == {str(p) for p in workers}
    (old_version, old_fp), = set(seen.values())
    assert old_fp.endswith(old_version)

    # SIGHUP to the supervisor: every worker reloads the replaced file
    s.replace_model()
    s.proc.send_signal(signal.SIGHUP)

    def all_reloaded():
        seen = seen_workers(s, {str(p) for p in workers})
        return all(v != old_version for v, _ in seen.values()) and seen
    seen = until("both workers on the new version", all_reloaded, timeout=60, every=0.2)
    (new_version, _), = set(seen.values())
    assert s.workers() == workers                 # reloaded in place, not restarted

    # a worker that dies is replaced, and the supervisor says so
    victim = workers[0]
    os.kill(victim, signal.SIGKILL)
    until("a replacement worker", lambda: len(s.workers()) == 2 and victim not in s.workers())
    until("the replacement healthy", lambda: healthy(s.port))
    assert any(f"worker {victim} exited" in line and "SIGKILL" in line for line in s.log), \
        "".join(s.log[-20:])
    replacement = (set(s.workers()) - {victim}).pop()
    seen = seen_workers(s, {str(replacement)})
    assert seen[str(replacement)][0] == new_version   # it maps the file served now

    # SIGTERM stops the supervisor and every worker; the pid file goes
    current = s.workers()
    s.proc.send_signal(signal.SIGTERM)
    assert s.proc.wait(timeout=60) == 0
    assert not any(alive(p) for p in current)
    assert not s.pid_file.exists()


def test_workers_dying_at_start_stop_the_supervisor(tmp_path):
    """Workers that keep dying right after they start: the supervisor gives up with status 1
    instead of restarting them forever (each replacement is killed as soon as it appears)."""
    s = Served(tmp_path)
    try:
        killed: set[int] = set()
        deadline = time.monotonic() + 90
        while s.proc.poll() is None and time.monotonic() < deadline and len(killed) < 12:
            for pid in s.workers():
                if pid not in killed:
                    os.kill(pid, signal.SIGKILL)
                    killed.add(pid)
            time.sleep(0.05)
        assert s.proc.wait(timeout=60) == 1, "".join(s.log[-20:])
        assert any("in a row died within" in line for line in s.log), "".join(s.log[-20:])
        assert not s.pid_file.exists()
    finally:
        s.stop()
