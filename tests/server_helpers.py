"""Running the colibri server for tests: a real uvicorn on a free loopback port, in a thread
(`running_server`) or as a `colibri serve` subprocess (`ServerProcess`), and small clients."""
from __future__ import annotations

import contextlib
import http.client
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import openai
import uvicorn

from colibri.api import default_model_path
from colibri.format import ColibriFile
from colibri.server import Settings, create_app

KEY = "test-key-0123456789"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def children(pid: int) -> list[int]:
    """The pids of pid's children (a `colibri serve --workers N` supervisor's workers)."""
    try:
        with open(f"/proc/{pid}/task/{pid}/children") as f:
            return sorted(int(x) for x in f.read().split())
    except FileNotFoundError:
        return []


@contextlib.contextmanager
def running_server(settings: Settings):
    """(base url, app) of a uvicorn serving create_app(settings) in a thread; stopped after."""
    app = create_app(settings)
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning", lifespan="on"))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started:
        if not thread.is_alive() or time.monotonic() > deadline:
            raise RuntimeError("the test server did not start")
        time.sleep(0.01)
    try:
        yield f"http://127.0.0.1:{port}", app
    finally:
        server.should_exit = True
        thread.join(timeout=30)
        sock.close()


def client(url: str, key: str | None = None) -> openai.OpenAI:
    """The official client, unchanged: no retries (a 429 must reach the test)."""
    return openai.OpenAI(base_url=f"{url}/v1", api_key=key or "none", max_retries=0,
                         timeout=60)


def wait_for(predicate, timeout: float = 10.0, what: str = "condition"):
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.02)


def copy_model(dst: Path) -> Path:
    """A copy of the shipped model at dst (a new inode: a new model version when renamed
    over a served path)."""
    shutil.copyfile(default_model_path(), dst)
    return dst


def replace_by_rename(src: Path, served: Path) -> None:
    """How a model file is replaced under a server: a new file renamed over the name."""
    os.replace(src, served)


def broken_copy(dst: Path) -> Path:
    """The shipped model with one byte of tok_embeddings flipped: it opens, but its checksum
    (validate) fails."""
    data = bytearray(default_model_path().read_bytes())
    with ColibriFile(default_model_path()) as f:
        offset = f.info("tok_embeddings").offset + 100
    data[offset] ^= 0xFF
    dst.write_bytes(bytes(data))
    return dst


def request(url: str, method: str, path: str, body=None, headers: dict | None = None,
            timeout: float = 30) -> tuple[int, dict, object]:
    """(status, headers, JSON body or text) of one plain HTTP request (the stdlib client:
    raw bodies, no retries). body: a dict (sent as JSON), bytes or str."""
    host, port = url.removeprefix("http://").split(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=timeout)
    try:
        data = json.dumps(body).encode() if isinstance(body, dict) else body
        hdrs = {"Content-Type": "application/json", **(headers or {})}
        conn.request(method, path, body=data, headers=hdrs)
        resp = conn.getresponse()
        raw = resp.read().decode()
        try:
            payload = json.loads(raw)
        except ValueError:
            payload = raw
        return resp.status, {k.lower(): v for k, v in resp.getheaders()}, payload
    finally:
        conn.close()


@contextlib.contextmanager
def open_stream(url: str, path: str, body: dict, headers: dict | None = None):
    """A streaming request left open: yields the response (read it line by line with
    readline()); closing the connection is how a client 'disconnects'."""
    host, port = url.removeprefix("http://").split(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=30)
    try:
        conn.request("POST", path, body=json.dumps(body).encode(),
                     headers={"Content-Type": "application/json", **(headers or {})})
        yield conn.getresponse()
    finally:
        conn.close()


def sse_events(resp) -> list:
    """Every `data:` payload of an SSE response until [DONE] (inclusive, as the string)."""
    out = []
    for raw in resp:
        line = raw.decode().strip()
        if not line.startswith("data: "):
            continue
        data = line[len("data: "):]
        out.append(data if data == "[DONE]" else json.loads(data))
        if data == "[DONE]":
            break
    return out


class ServerProcess:
    """`python -m colibri serve ARGS --port P` as a subprocess; stop() sends SIGTERM."""

    def __init__(self, *args: str, env: dict | None = None):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "colibri", "serve", *args, "--port", str(self.port),
             "--threads", "1"], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
            env=dict(os.environ, **(env or {})))
        self.lines: list[str] = []
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()
        wait_for(self._up, timeout=60, what="colibri serve to answer /health")

    def _read(self) -> None:
        for line in self.proc.stdout:
            self.lines.append(line)

    def _up(self) -> bool:
        if self.proc.poll() is not None:
            raise AssertionError(f"colibri serve exited {self.proc.returncode}:\n"
                                 + "".join(self.lines))
        try:
            return request(self.url, "GET", "/health", timeout=1)[0] == 200
        except OSError:
            return False

    def health(self) -> dict:
        return request(self.url, "GET", "/health")[2]

    def signal(self, sig: signal.Signals) -> None:
        self.proc.send_signal(sig)

    def log(self) -> str:
        return "".join(self.lines)

    def stop(self) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self._reader.join(timeout=5)
        return self.proc.returncode
