"""Schema fuzzing of every endpoint of `colibri serve` from its own OpenAPI document.

schemathesis generates requests from /openapi.json -- valid ones and, as hypothesis explores,
ones with wrong types, out-of-range numbers, missing fields -- and sends each to a real
`colibri serve --workers 2` (the shipped model, on loopback, with an api key so /admin/* is
reachable). Every response must be a non-5xx answer and no worker may die (the same two
worker pids throughout); after the run both workers must be healthy with every slot idle.

Bounded: COLIBRI_FUZZ_EXAMPLES requests per operation (default 15: the CI setting, seconds);
`COLIBRI_FUZZ_EXAMPLES=500 python -m pytest tests/test_server_fuzz.py` is the long run.
"""
from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
import urllib.request
from collections import Counter
from concurrent.futures import ThreadPoolExecutor

import pytest

schemathesis = pytest.importorskip("schemathesis", reason="schemathesis is not installed "
                                   "(pip install schemathesis)")
pytest.importorskip("fastapi", reason="the server extra is not installed "
                    "(pip install 'colibri[server]')")
from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis.errors import Unsatisfiable  # noqa: E402
from schemathesis import GenerationMode  # noqa: E402
from server_helpers import children, free_port  # noqa: E402

EXAMPLES = int(os.environ.get("COLIBRI_FUZZ_EXAMPLES", "15"))
API_KEY = "fuzz-key-0123456789"
AUTH = {"Authorization": f"Bearer {API_KEY}"}


def get(url: str, timeout: float = 5.0) -> tuple[int, str, str | None]:
    """(status, body, the answering worker's pid) of a GET."""
    req = urllib.request.Request(url, headers=AUTH)
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return r.status, r.read().decode(), r.headers.get("X-Colibri-Worker")
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode(), e.headers.get("X-Colibri-Worker")


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    """(supervisor process, base url, worker pids) of `colibri serve --workers 2` of the
    shipped model. It runs away from the checkout (a module fixture starts before
    conftest's per-test chdir): `python -m colibri` there would import the source folder,
    which has no compiled kernels when the package is installed from it."""
    port = free_port()
    proc = subprocess.Popen(
        [sys.executable, "-m", "colibri", "serve", "--port", str(port), "--parallel", "2",
         "--ctx", "256", "--max-queue", "8", "--api-key", API_KEY, "--workers", "2"],
        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
        cwd=tmp_path_factory.mktemp("fuzz-server"))
    base = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 120
    while True:
        if proc.poll() is not None:
            pytest.fail(f"colibri serve exited: {proc.stderr.read()[-2000:]}")
        try:
            if get(f"{base}/health")[0] == 200 and len(children(proc.pid)) == 2:
                break
        except OSError:
            pass
        if time.monotonic() > deadline:
            proc.kill()
            pytest.fail("colibri serve did not become healthy in 120 s")
        time.sleep(0.2)
    yield proc, base, children(proc.pid)
    proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(timeout=30)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


def operations(base: str) -> list:
    schema = schemathesis.openapi.from_url(f"{base}/openapi.json", headers=AUTH)
    return [result.ok() for result in schema.get_all_operations()]


@pytest.mark.parametrize("mode", [GenerationMode.POSITIVE, GenerationMode.NEGATIVE],
                         ids=["valid", "invalid"])
def test_no_input_gives_a_5xx(server, mode):
    """Every operation of the OpenAPI document, EXAMPLES generated requests each (valid
    bodies, or bodies that break the schema), against the real server."""
    proc, base, workers = server
    ops = operations(base)
    paths = {op.path for op in ops}
    assert {"/v1/completions", "/v1/chat/completions", "/v1/models", "/health", "/metrics",
            "/admin/reload"} <= paths, paths
    sent: Counter = Counter()
    without_input: list[str] = []
    for op in ops:
        @given(case=op.as_strategy(generation_mode=mode))
        @settings(max_examples=EXAMPLES, deadline=None, derandomize=True, database=None,
                  suppress_health_check=list(HealthCheck))
        def fuzz(case):
            response = case.call(base_url=base, headers=AUTH, timeout=60)
            sent[op.label] += 1
            assert response.status_code < 500, (
                f"{case.method} {case.path} -> {response.status_code}: "
                f"{response.text[:500]}\nbody: {case.body!r}")
            assert proc.poll() is None and children(proc.pid) == workers, "a worker died"
        try:
            fuzz()
        except Unsatisfiable:
            # no input breaks the schema: no parameters (GET /health), or only strings
            assert mode is GenerationMode.NEGATIVE, op.label
            without_input.append(op.label)
    assert all(sent[op.label] > 0 for op in ops if op.label not in without_input), sent
    assert sum(sent.values()) > 0
    print(f"{mode.value}: {sum(sent.values())} requests over {len(ops)} operations "
          f"({len(without_input)} without inputs to break)")


def test_workers_alive_and_idle_after_the_fuzzing(server):
    proc, base, workers = server
    assert proc.poll() is None and children(proc.pid) == workers
    deadline = time.monotonic() + 30
    idle: set[str] = set()
    while idle != {str(p) for p in workers}:
        assert time.monotonic() < deadline, f"only workers {idle} idle 30 s after the fuzzing"
        # several requests at once, so that both workers answer some
        with ThreadPoolExecutor(8) as pool:
            answers = list(pool.map(lambda _: get(f"{base}/metrics"), range(8)))
        for status, text, worker in answers:
            assert status == 200
            busy = re.search(r"^colibri_slots_busy\S*\s+(\S+)", text, re.M)
            assert busy, "no colibri_slots_busy in /metrics"
            if float(busy.group(1)) == 0:
                idle.add(worker)
        time.sleep(0.1)
    assert get(f"{base}/health")[0] == 200
