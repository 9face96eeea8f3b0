"""Coverage-guided fuzzing of the .colibri reader (header, tensor table, expert index,
metadata) with atheris, for a bounded time; prints executions and crashes.

    python scripts/fuzz_format.py --seconds 120          # the campaign (docs/safety.md)
    python scripts/fuzz_format.py --replay DIR           # run every file of DIR through probe

Each input is written to a file in /dev/shm (or the temp folder) and opened with
colibri.format.ColibriFile; a file that opens is also validated (the full-read checks, the
config, the tokenizer). The only acceptable outcomes are "opens" and a ColibriError (every
colibri error, ColibriFormatError and ConfigError included); anything else (IndexError,
KeyError, RecursionError, MemoryError, a hang past --timeout) is a crash, saved under
tests/fuzz_regressions/ where tests/test_safety_file_fuzz.py replays it in CI.

The seed corpus: small valid files made with colibri.format.save (a tiny MoE layout with q4,
q8, bf16, f16, f32 tensors and metadata with an arch and a tokenizer) and the first bytes of
the shipped model.
"""
from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
REGRESSIONS = ROOT / "tests" / "fuzz_regressions"
_WORK = Path("/dev/shm") if Path("/dev/shm").is_dir() else Path(tempfile.gettempdir())


def probe(data: bytes, path: Path) -> None:
    """Write data to path, open it (and validate it when it opens). Raises only what is a
    bug: a ColibriError is the expected answer to a broken file."""
    import colibri
    from colibri.format import ColibriFile
    from colibri.format.validation import validate
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        os.write(fd, data)
    finally:
        os.close(fd)
    try:
        with ColibriFile(path) as cf:
            validate(cf)
    except colibri.ColibriError:
        pass


def seeds() -> list[bytes]:
    """Small valid files covering every section and dtype."""
    import numpy as np
    from colibri.format import save
    out = []
    rng = np.random.default_rng(0)
    with tempfile.TemporaryDirectory() as tmp:
        for k, (dt, meta) in enumerate([
                ("q4", {"arch": {"family": "toy"}, "user": {"note": "hi"}}),
                ("q8", {"tokenizer": {"files": {"tokenizer.json": "{}"}}, "user": {}}),
                ("bf16", {}), ("f16", {"config": {"model_type": "mixtral"}})]):
            t = {"layers.0.moe.router": rng.standard_normal((2, 32)).astype(np.float32),
                 "norm": (rng.standard_normal(4).astype(np.float32), "bf16")}
            for e in range(2):
                for p in ("w_gate", "w_up", "w_down"):
                    t[f"layers.0.moe.experts.{e}.{p}"] = (
                        rng.standard_normal((32, 32)).astype(np.float32), dt)
            path = Path(tmp) / f"s{k}.colibri"
            save(path, t, meta, group_size=32)
            out.append(path.read_bytes())
    shipped = ROOT / "colibri" / "models" / "tiny-moe.colibri"
    if shipped.exists():
        with open(shipped, "rb") as f:
            out.append(f.read(8192))
    return out


def child(seconds: int, timeout: int, corpus: Path) -> None:
    """The atheris process (libFuzzer's own flags after the script's)."""
    import atheris
    with atheris.instrument_imports():
        import colibri.format.checks  # noqa: F401
        import colibri.format.reader  # noqa: F401
        import colibri.format.safe_json  # noqa: F401
        import colibri.config  # noqa: F401
        import colibri.format.validation  # noqa: F401
    path = _WORK / f"fuzz-{os.getpid()}.colibri"

    def one(data: bytes) -> None:
        probe(data, path)

    atheris.Setup([sys.argv[0], str(corpus), f"-max_total_time={seconds}",
                   f"-timeout={timeout}", "-rss_limit_mb=2048", "-max_len=65536",
                   f"-artifact_prefix={REGRESSIONS}/", "-print_final_stats=1"], one)
    atheris.Fuzz()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--seconds", type=int, default=60, help="fuzzing time (default 60)")
    ap.add_argument("--timeout", type=int, default=10, help="seconds per input before it "
                    "counts as a hang (default 10)")
    ap.add_argument("--replay", metavar="DIR", help="probe every file of DIR instead")
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--corpus", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.replay:
        files = sorted(p for p in Path(args.replay).iterdir() if p.is_file())
        with tempfile.TemporaryDirectory() as tmp:
            for p in files:
                probe(p.read_bytes(), Path(tmp) / "r.colibri")
        print(f"replayed {len(files)} files: no crash")
        return 0
    if args.child:
        child(args.seconds, args.timeout, Path(args.corpus))
        return 0
    REGRESSIONS.mkdir(parents=True, exist_ok=True)
    before = set(REGRESSIONS.iterdir())
    with tempfile.TemporaryDirectory() as corpus:
        for k, s in enumerate(seeds()):
            (Path(corpus) / f"seed{k}").write_bytes(s)
        start = time.monotonic()
        r = subprocess.run([sys.executable, __file__, "--child", "--seconds",
                            str(args.seconds), "--timeout", str(args.timeout), "--corpus",
                            corpus], capture_output=True, text=True)
        wall = time.monotonic() - start
    log = r.stdout + r.stderr
    runs = re.findall(r"stat::number_of_executed_units:\s*(\d+)", log)
    cov = re.findall(r"#\d+\s+(?:DONE|pulse|NEW|REDUCE)\s+cov: (\d+) ft: (\d+)", log)
    crashes = sorted(set(REGRESSIONS.iterdir()) - before)
    print(f"fuzz_format: {runs[-1] if runs else '?'} executions in {wall:.0f} s, "
          f"coverage {cov[-1][0] if cov else '?'} edges / {cov[-1][1] if cov else '?'} "
          f"features, {len(crashes)} crashes (exit {r.returncode})")
    for c in crashes:
        print(f"  crash saved: {c.relative_to(ROOT)}")
    if r.returncode and not crashes:
        print(log[-3000:])
    return 1 if crashes else 0


if __name__ == "__main__":
    sys.exit(main())
