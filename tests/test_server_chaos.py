"""kill -9 of a worker mid-stream under `colibri serve --workers 2` (scripts/chaos.py, one
round, bounded): the killed worker's streams end with an error the client sees within 5 s,
the other worker's streams finish with every token, the supervisor starts a new worker
that answers, and later requests all succeed. Real processes, real signals, the official
openai client on loopback; ~15-25 s on 2 busy cores."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("openai", reason="the openai client is not installed")
pytest.importorskip("fastapi", reason="the server extra is not installed")

SCRIPT = Path(__file__).resolve().parent.parent / "scripts" / "chaos.py"


def test_a_worker_killed_mid_stream(tmp_path):
    log = tmp_path / "server.log"
    proc = subprocess.run(
        [sys.executable, str(SCRIPT), "--streams", "4", "--max-tokens", "200", "--after", "4",
         "--timeout", "40", "--restart-timeout", "30", "--server-log", str(log)],
        capture_output=True, text=True, timeout=110, env=dict(os.environ))
    report = proc.stdout + proc.stderr + "\nserver log:\n" + log.read_text()[-3000:]
    assert proc.returncode == 0, report
    assert "verdict: survived" in proc.stdout, report
    for check in ("the killed worker's streams ended with an error the client sees",
                  "the other worker's streams all finished", "the new worker answers",
                  "the supervisor started a new worker"):
        assert f"ok   {check}" in proc.stdout, report
    assert "exited with signal SIGKILL" in log.read_text(), report   # the supervisor saw it
