"""The CI subset of the broken-file campaign (tests/broken_files.py; the full one is
scripts/broken_files.py): every hand-built broken file is refused with a ColibriError or a
validate() problem, never a crash, and no changed arch value or broken tokenizer file is
accepted."""
from __future__ import annotations

import broken_files


def test_broken_files_are_refused_cleanly(tmp_path):
    r = broken_files.campaign(seeds=1, work=tmp_path, every=7)
    tried = sum(sum(c.values()) for c in r["by"].values())
    refused = sum(c["refused"] + c["refused by writer"] for c in r["by"].values())
    print(f"broken files: {tried} tried, {refused} refused, crashes {len(r['crashes'])}")
    assert tried > 100
    assert r["crashes"] == []
    assert r["by"]["header"]["refused"] and r["by"]["arch"]["refused"]
    for category in ("header", "expert", "truncated", "arch", "tokenizer"):
        c = r["by"].get(category)
        assert c is None or c["accepted"] == 0, (category, c)
