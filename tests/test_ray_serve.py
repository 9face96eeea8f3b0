"""colibri on Ray Serve: `colibri serve --ray --replicas 2` on a local Ray instance bound to
loopback (every socket its processes listen on); the official openai client through Ray's
HTTP proxy; both replicas answer and each maps the model file itself; SIGTERM shuts Serve
and Ray down.

Starting Ray takes ~20-30 s, so everything shares one instance (module scope).
"""
from __future__ import annotations

import http.client
import ipaddress
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time

import pytest

pytest.importorskip("ray", reason="ray is not installed (pip install 'colibri[ray]')")
pytest.importorskip("ray.serve", reason="ray[serve] is not installed (pip install "
                    "'colibri[ray]')")
openai = pytest.importorskip("openai", reason="the openai client is not installed")
psutil = pytest.importorskip("psutil", reason="psutil is not installed")

from colibri.api import default_model_path  # noqa: E402
from colibri.server.ray_serve import build  # noqa: E402
from server_helpers import free_port  # noqa: E402

WORKER_HEADER = "x-colibri-worker"


def get(port: int, path: str) -> tuple[int, dict, str | None]:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
    try:
        conn.request("GET", path)
        r = conn.getresponse()
        body = r.read()
        return r.status, (json.loads(body) if body[:1] == b"{" else {}), \
            r.getheader(WORKER_HEADER)
    finally:
        conn.close()


@pytest.fixture(scope="module")
def ray_server(tmp_path_factory):
    """(port, model path, process, log lines) of `colibri serve MODEL --ray --replicas 2`."""
    model = tmp_path_factory.mktemp("ray") / "m.colibri"
    shutil.copyfile(default_model_path(), model)
    port = free_port()
    env = dict(os.environ, RAY_USAGE_STATS_ENABLED="0")
    proc = subprocess.Popen(
        [sys.executable, "-m", "colibri", "serve", str(model), "--ray", "--replicas", "2",
         "--host", "127.0.0.1", "--port", str(port), "--parallel", "2", "--ctx", "128",
         "--threads", "1"],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env,
        cwd=model.parent)    # away from a checkout: the installed colibri, with its kernels
    log: list[str] = []
    threading.Thread(target=lambda: log.extend(proc.stdout), daemon=True).start()
    deadline = time.monotonic() + 180
    while True:
        if proc.poll() is not None:
            pytest.fail("colibri serve --ray exited:\n" + "".join(log[-40:]))
        try:
            if get(port, "/health")[0] == 200:
                break
        except OSError:
            pass
        if time.monotonic() > deadline:
            proc.kill()
            pytest.fail("colibri serve --ray not healthy after 180 s:\n" + "".join(log[-40:]))
        time.sleep(0.5)
    yield port, model, proc, log
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def test_openai_client_through_the_ray_proxy(ray_server):
    port = ray_server[0]
    client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="unused")
    [card] = client.models.list().data
    done = client.completions.create(model=card.id, prompt="Hello", max_tokens=5)
    assert done.choices[0].finish_reason in ("length", "stop")
    assert done.usage.completion_tokens >= 1
    chat = client.chat.completions.create(
        model=card.id, messages=[{"role": "user", "content": "Hi"}], max_tokens=4)
    assert chat.choices[0].message.role == "assistant" and chat.usage.completion_tokens >= 1
    # a role the shipped template refuses: the server's OpenAI error passes through
    with pytest.raises(openai.BadRequestError, match="roles are system, user and assistant"):
        client.chat.completions.create(
            model=card.id, messages=[{"role": "tool", "content": "Hi"}], max_tokens=4)
    chunks = list(client.completions.create(model=card.id, prompt="Hello", max_tokens=6,
                                            temperature=0, stream=True))
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    # the same tokens as the non-streamed greedy request through the same proxy
    again = client.completions.create(model=card.id, prompt="Hello", max_tokens=6,
                                      temperature=0)
    assert text == again.choices[0].text


def test_two_replicas_answer_each_over_its_own_mapping(ray_server):
    port, model, _, _ = ray_server
    pids: set[str] = set()
    deadline = time.monotonic() + 60
    while len(pids) < 2 and time.monotonic() < deadline:
        status, body, pid = get(port, "/health")
        assert status == 200 and body["status"] == "ok"
        pids.add(pid)
    assert len(pids) == 2, f"answers from replicas {pids} only"
    for pid in pids:
        with open(f"/proc/{pid}/maps") as f:
            assert str(model) in f.read(), f"replica {pid} does not map {model}"
    versions = {get(port, "/v1/models")[1]["data"][0]["colibri"]["version"]
                for _ in range(6)}
    assert len(versions) == 1


def outward_address() -> str | None:
    """This machine's address on its default route (no packet is sent), None if none."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        try:
            s.connect(("192.0.2.1", 9))
            return s.getsockname()[0]
        except OSError:
            return None


def test_the_http_proxy_listens_on_loopback_only(ray_server):
    port = ray_server[0]
    address = outward_address()
    if address is None or address.startswith("127."):
        pytest.skip("no non-loopback address to try")
    with pytest.raises(OSError):
        socket.create_connection((address, port), timeout=5).close()


def listening(proc: subprocess.Popen) -> list[tuple[int, str, str, int]]:
    """(pid, process name, address, port) of every TCP socket listening in `proc` and the
    processes it started (Ray's GCS, raylet, agents, replica workers)."""
    root = psutil.Process(proc.pid)
    out = []
    for p in [root] + root.children(recursive=True):
        try:
            out += [(p.pid, p.name(), c.laddr.ip, c.laddr.port)
                    for c in p.net_connections(kind="inet") if c.status == psutil.CONN_LISTEN]
        except psutil.NoSuchProcess:
            pass
    return out


def is_loopback_ip(text: str) -> bool:
    """127.0.0.0/8 and ::1, also as ::ffff:127.0.0.1 (IPv4 on a dual-stack socket)."""
    address = ipaddress.ip_address(text)
    return (getattr(address, "ipv4_mapped", None) or address).is_loopback


def test_the_local_ray_listens_on_loopback_only(ray_server):
    port, _, proc, _ = ray_server
    assert get(port, "/health")[0] == 200         # the replicas' workers are up
    sockets = listening(proc)
    names = {name for _, name, _, _ in sockets}
    assert {"gcs_server", "raylet"} <= names and len(sockets) >= 6, sockets
    assert any(p == port for *_, p in sockets)    # Ray's HTTP proxy is among them
    wide = [s for s in sockets if not is_loopback_ip(s[2])]
    assert not wide, f"listening beyond loopback: {wide}"


def test_sigterm_shuts_serve_and_ray_down(ray_server):
    port, _, proc, log = ray_server
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=90) == 0, "".join(log[-30:])
    with pytest.raises(OSError):
        get(port, "/health")


def test_serve_run_builder_keys_reach_the_deployment():
    with pytest.raises(ValueError, match="unknown key.*colour"):
        build({"model": str(default_model_path()), "colour": "blue"})
    d = build({"model": str(default_model_path()), "replicas": "2", "parallel": "3",
               "max_queue": "5", "kv_budget": "64MiB", "threads": "2"})._bound_deployment
    assert d.num_replicas == 2 and d.max_ongoing_requests == 3 + 5
    assert d.ray_actor_options["num_cpus"] == 2
    [settings] = d.init_args
    assert settings["parallel"] == 3 and settings["kv_budget"] == 64 << 20
    scaled = build({"model": str(default_model_path()), "min_replicas": "1",
                    "max_replicas": "3", "target_ongoing_requests": "4"})._bound_deployment
    auto = scaled._deployment_config.autoscaling_config
    assert (auto.min_replicas, auto.max_replicas, auto.target_ongoing_requests) == (1, 3, 4.0)
