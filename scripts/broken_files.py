"""The broken-file campaign: one hand-built broken file per format invariant (every numeric
header / tensor-record / expert-index field at boundary and random values, byte flips in each
section, truncations) and per metadata field (every arch field retyped, out of range or
removed; top-level keys removed or retyped; tokenizer files cut or broken), x seeds, each
opened, validated and loaded. Prints tried / refused / accepted / crashes per category.

    python scripts/broken_files.py --seeds 5

The generator is tests/broken_files.py (its CI subset: tests/test_safety_file_campaign.py).
"""
from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
import broken_files  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--seeds", type=int, default=3)
    args = ap.parse_args()
    start = time.monotonic()
    with tempfile.TemporaryDirectory() as work:
        r = broken_files.campaign(args.seeds, Path(work))
    tried = refused = accepted = 0
    for category, c in sorted(r["by"].items()):
        n = sum(c.values())
        tried += n
        refused += c["refused"] + c["refused by writer"]
        accepted += c["accepted"]
        print(f"  {category:<10} {n:5d} tried  " + ", ".join(f"{k} {v}" for k, v in
                                                           sorted(c.items())))
    print(f"broken_files: {tried} files tried in {time.monotonic() - start:.0f} s, "
          f"{refused} refused with a clean error, {accepted} accepted (benign), "
          f"{len(r['crashes'])} crashes / wrongly accepted")
    for c in r["crashes"][:20]:
        print("  ", c)
    return 1 if r["crashes"] else 0


if __name__ == "__main__":
    sys.exit(main())
