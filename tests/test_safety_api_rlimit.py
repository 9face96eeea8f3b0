"""Load and generate under a tight address-space limit (RLIMIT_AS), in subprocesses, just
below and above what they need: each run either works or ends with a clean MemoryError /
ColibriError (colibri.resources) -- never OpenBLAS's own exit, a Rust abort or a signal.
scripts/safety_rlimit_sweep.py runs the same child over a finer range (docs/safety-api.md)."""
from __future__ import annotations

import subprocess
import sys

import pytest

CHILD = r'''
import resource, sys
limit = int(sys.argv[1]) << 20
resource.setrlimit(resource.RLIMIT_AS, (limit, limit))
try:
    import colibri
    import numpy as np
    m = colibri.load(threads=1)
    ids = m.generate(np.array([1, 2, 3]), max_new_tokens=8)
    text = m.generate("Once upon a time", max_new_tokens=4)
    print("OK", len(ids))
except MemoryError as e:                      # ResourceError is one; NumPy's own too
    print("CLEAN", type(e).__name__, e)
    sys.exit(3)
except Exception as e:
    import colibri.errors
    if isinstance(e, colibri.errors.ColibriError):
        print("CLEAN", type(e).__name__, e)
        sys.exit(3)
    raise
'''


def run_child(mib: int) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", CHILD, str(mib)], capture_output=True,
                          text=True, timeout=120, env={"PATH": "/usr/bin:/bin",
                                                       "RUST_BACKTRACE": "0"})


def outcome(p: subprocess.CompletedProcess) -> str:
    """"ok", "clean" or a description of the crash."""
    out = p.stdout + p.stderr
    if p.returncode == 0 and out.startswith("OK"):
        return "ok"
    if p.returncode == 3 and "CLEAN" in p.stdout and "OpenBLAS error" not in out:
        return "clean"
    return f"crash (rc {p.returncode}): {out.strip().splitlines()[-3:]}"


# below the import, around OpenBLAS's buffer, around the tokenizer, above everything
@pytest.mark.parametrize("mib", [60, 130, 150, 180, 220, 250, 512])
def test_tight_address_space_gives_clean_errors_only(mib):
    got = outcome(run_child(mib))
    assert got in ("ok", "clean"), got
    if mib == 512:
        assert got == "ok"
    if mib == 60:
        assert got == "clean"
