"""Hot reload: POST /admin/reload with requests in flight finishing on the old model and new
ones on the new, a broken file refused while the old keeps serving; SIGHUP / SIGUSR1 and the
pid file of a `colibri serve` subprocess."""
from __future__ import annotations

import os
import signal
import time

import pytest

from colibri.server import VERSION_HEADER, Settings

from server_helpers import (KEY, ServerProcess, broken_copy, client, copy_model, open_stream,
                            replace_by_rename, request, running_server, sse_events, wait_for)

PROMPT = "def fibonacci(n):"


def auth() -> dict:
    return {"Authorization": f"Bearer {KEY}"}


@pytest.fixture
def served(tmp_path):
    """The path a server serves: a copy of the shipped model."""
    return copy_model(tmp_path / "served.colibri")


def test_reload_endpoint_in_flight_new_and_broken(served, tmp_path, monkeypatch):
    settings = Settings(model=str(served), parallel=2, ctx=256, api_key=KEY, threads=1)
    with running_server(settings) as (url, app):
        holder = app.state.holder
        old = holder.current
        for name in ("forward_ragged", "forward"):    # a step of one request runs forward
            fast = getattr(old.model, name)

            def slow(*args, fast=fast, **kwargs):   # the old model's steps take 20 ms
                time.sleep(0.02)
                return fast(*args, **kwargs)
            monkeypatch.setattr(old.model, name, slow)
        body = {"prompt": PROMPT, "max_tokens": 40, "stream": True, "temperature": 0,
                "stop": ["never-seen-zzz"]}
        with open_stream(url, "/v1/completions", body, auth()) as in_flight:
            assert in_flight.getheader(VERSION_HEADER) == old.version
            first = in_flight.readline()
            assert first.startswith(b"data: ")

            replace_by_rename(copy_model(tmp_path / "new.colibri"), served)
            status, _, result = request(url, "POST", "/admin/reload", headers=auth())
            assert status == 200 and result["reloaded"] is True, result
            assert result["previous"] == old.version and result["version"] != old.version
            new_version = result["version"]
            assert holder.current.version == new_version

            r = client(url, KEY).completions.with_raw_response.create(
                model="served", prompt=PROMPT, max_tokens=3)
            assert r.headers[VERSION_HEADER] == new_version
            assert r.parse().system_fingerprint == f"colibri-{new_version}"

            events = sse_events(in_flight)         # the rest of the stream, on the old model
        chunks = [e for e in events if e != "[DONE]"]
        assert events[-1] == "[DONE]"
        assert {c["system_fingerprint"] for c in chunks} == {f"colibri-{old.version}"}
        assert chunks[-1]["choices"][0]["finish_reason"] == "length"
        wait_for(lambda: old.scheduler._thread is not None and
                 not old.scheduler._thread.is_alive(), what="the old engine to retire")

        # the same file again: nothing to do
        status, _, result = request(url, "POST", "/admin/reload", headers=auth())
        assert status == 200 and result["reloaded"] is False and result["unchanged"] is True

        # a broken file is refused; the current version keeps serving
        replace_by_rename(broken_copy(tmp_path / "broken.colibri"), served)
        status, _, body = request(url, "POST", "/admin/reload", headers=auth())
        assert status == 409, body
        assert body["error"]["code"] == "reload_refused"
        assert "crc32" in body["error"]["message"] and new_version in body["error"]["message"]
        assert holder.current.version == new_version
        r = client(url, KEY).completions.create(model="served", prompt=PROMPT, max_tokens=2)
        assert r.system_fingerprint == f"colibri-{new_version}"
        _, _, metrics = request(url, "GET", "/metrics", headers=auth())
        assert "colibri_reload_failures_total 1.0" in metrics
        assert "colibri_reloads_total 1.0" in metrics

        # the reload route needs a key: it does not answer unauthenticated requests
        assert request(url, "POST", "/admin/reload")[0] == 401


def test_reload_endpoint_is_off_without_a_key(served):
    with running_server(Settings(model=str(served), threads=1)) as (url, _):
        status, _, body = request(url, "POST", "/admin/reload")
        assert status == 403 and body["error"]["code"] == "admin_disabled"


def test_reload_by_signal_and_pid_file(served, tmp_path):
    pid_file = tmp_path / "colibri.pid"
    server = ServerProcess(str(served), "--pid-file", str(pid_file), "--parallel", "1",
                           "--ctx", "128", "--log-level", "info")
    try:
        assert int(pid_file.read_text()) == server.proc.pid
        v1 = server.health()["version"]

        replace_by_rename(copy_model(tmp_path / "new.colibri"), served)
        server.signal(signal.SIGHUP)
        v2 = wait_for(lambda: (v := server.health()["version"]) != v1 and v, timeout=30,
                      what="SIGHUP to reload the model")
        r = client(server.url).completions.create(model="served", prompt=PROMPT, max_tokens=2)
        assert r.system_fingerprint == f"colibri-{v2}"

        replace_by_rename(broken_copy(tmp_path / "broken.colibri"), served)
        server.signal(signal.SIGUSR1)
        wait_for(lambda: "reload refused" in server.log(), timeout=30,
                 what="the refusal in the log")
        assert "crc32 mismatch" in server.log()
        assert server.health()["version"] == v2
        r = client(server.url).completions.create(model="served", prompt=PROMPT, max_tokens=2)
        assert r.system_fingerprint == f"colibri-{v2}"
    finally:
        code = server.stop()
    assert code == 0, server.log()
    assert not pid_file.exists()
    assert not os.path.exists(f"/proc/{server.proc.pid}")
