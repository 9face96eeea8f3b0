"""SIGKILL (or another signal) of `colibri convert` at K random moments: counts partial
destinations, temporary files left, files that validate, and whether the next run cleans up.

    python scripts/kill_convert.py --kills 30 [--signal KILL|TERM|INT] [--seed 0]

The checkpoint is a tiny random Mixtral made with tests/hf_factory.py (8 experts, hidden 128);
a fifth of the moments are uniform over [0, 1.2 x] the time one conversion takes (start-up
included), the rest uniform over [0, 1.2 x] the life of its temp file (write, fsyncs, validation)
after the temp file appears: most kills land while the file is written, some after the
rename.
A CI subset with K=3 per signal is tests/test_safety_file_convert.py.
"""
from __future__ import annotations

import argparse
import signal
import subprocess
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
from hf_factory import make_hf_checkpoint  # noqa: E402

from colibri.convert import convert  # noqa: E402
from colibri.errors import ColibriError  # noqa: E402
from colibri.format import ColibriFile  # noqa: E402
from colibri.format.validation import validate  # noqa: E402

CONVERT = [sys.executable, "-m", "colibri", "convert", "-q", "--force"]


def temps(folder: Path, dst: Path) -> list[Path]:
    return [p for p in folder.iterdir() if p.name.startswith(f".{dst.name}.tmp-")]


def valid(path: Path) -> bool:
    try:
        with ColibriFile(path) as cf:
            return validate(cf) == []
    except ColibriError:
        return False


def wait_for_temp(folder: Path, dst: Path, proc, limit: float) -> float:
    """Seconds until dst's temp file appears (or the process ends / the limit passes)."""
    t0 = time.monotonic()
    while not temps(folder, dst) and proc.poll() is None and time.monotonic() - t0 < limit:
        time.sleep(0.0005)
    return time.monotonic() - t0


def timing(src: Path, folder: Path) -> tuple[float, float]:
    """(seconds of one conversion in a subprocess, seconds its temp file exists: the write,
    the fsyncs and the validation before the rename)."""
    folder.mkdir()
    dst = folder / "m.colibri"
    t0 = time.monotonic()
    proc = subprocess.Popen(CONVERT + [str(src), str(dst)], cwd=folder)
    to_temp = wait_for_temp(folder, dst, proc, 600)
    while temps(folder, dst) and proc.poll() is None:     # until the rename
        time.sleep(0.0005)
    lifetime = time.monotonic() - t0 - to_temp
    proc.wait()
    return time.monotonic() - t0, max(lifetime, 0.01)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--kills", type=int, default=30)
    ap.add_argument("--signal", default="KILL", choices=("KILL", "TERM", "INT"))
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--hidden", type=int, default=256, help="hidden size of the checkpoint "
                    "(8 experts of 2x hidden; 256: a 25 MB file)")
    args = ap.parse_args()
    sig = getattr(signal, "SIG" + args.signal)
    rng = np.random.default_rng(args.seed)
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        src = make_hf_checkpoint(tmp / "ck", "mixtral", hidden_size=args.hidden,
                                 intermediate_size=2 * args.hidden, num_local_experts=8)
        seconds, writing = timing(src, tmp / "t")
        phases, partial, validating_temps, left, left_after_next = Counter(), 0, 0, 0, 0
        for k in range(args.kills):
            folder = tmp / f"k{k}"
            folder.mkdir()
            dst = folder / "m.colibri"
            proc = subprocess.Popen(CONVERT + [str(src), str(dst)], cwd=folder,
                                    stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
            if rng.uniform() < 0.2:                    # anywhere, start-up included
                time.sleep(float(rng.uniform(0, 1.2)) * seconds)
            else:                                      # inside the write (and just after)
                wait_for_temp(folder, dst, proc, 3 * seconds)
                time.sleep(float(rng.uniform(0, 1.2)) * writing)
            had_temp = bool(temps(folder, dst))
            proc.send_signal(sig)
            rc = proc.wait()
            phases["finished before the signal" if rc == 0 else
                   "killed after the rename" if dst.exists() else
                   "during the write (temp file present)" if had_temp else
                   "before the temp file existed"] += 1
            if dst.exists() and not valid(dst):
                partial += 1
            ts = temps(folder, dst)
            left += len(ts)
            validating_temps += sum(valid(t) for t in ts)
            convert(src, dst, progress=False, force=True)
            left_after_next += len(temps(folder, dst))
            assert valid(dst)
    print(f"kill_convert: SIG{args.signal} x {args.kills} kills (one conversion takes "
          f"{seconds:.2f} s, its temp file lives {writing:.2f} s): " + ", ".join(f"{v} {k}" for k, v in phases.items()))
    print(f"  partial destinations {partial}, temp files left {left}, of which validate "
          f"{validating_temps}, temp files after the next run {left_after_next}")
    return 1 if partial or validating_temps or left_after_next else 0


if __name__ == "__main__":
    sys.exit(main())
