"""Load + generate (ids and text) of the shipped model under RLIMIT_AS from LO to HI MiB in
STEP MiB steps, one subprocess each; prints each outcome and the counts (ok / clean error /
crash). Bounded: (HI - LO) / STEP runs of ~1-2 s.

    python scripts/safety_rlimit_sweep.py [LO HI STEP]     (default 40 320 10)
"""
from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "tests"))
from test_safety_api_rlimit import outcome, run_child  # noqa: E402


def main() -> int:
    lo, hi, step = (int(a) for a in (sys.argv[1:4] if len(sys.argv) >= 4 else (40, 320, 10)))
    counts = {"ok": 0, "clean": 0, "crash": 0}
    for mib in range(lo, hi + 1, step):
        got = outcome(run_child(mib))
        counts[got if got in counts else "crash"] += 1
        print(f"{mib:5d} MiB  {got}")
    print(f"runs {sum(counts.values())}: ok {counts['ok']}, clean errors {counts['clean']}, "
          f"crashes {counts['crash']}")
    return 1 if counts["crash"] else 0


if __name__ == "__main__":
    sys.exit(main())
