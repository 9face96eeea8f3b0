"""JSON from untrusted sources (a model file's metadata, a checkpoint's config.json) parsed
with a bounded nesting depth.

json.loads recurses once per nesting level: a few thousand '[' raise RecursionError (or, in
a thread with a small stack, worse). nesting_depth() measures the depth with vector ops over
the bytes, 1 MB at a time (bounded temporaries whatever the size), before anything is parsed,
so a hostile document is refused with a plain message.
"""
from __future__ import annotations

import json
from typing import Any

import numpy as np

MAX_DEPTH = 64   # real metadata and config.json files nest < 10 levels
_CHUNK = 1 << 18      # 256 KB: ~2 MB of temporaries


def nesting_depth(text: str | bytes) -> int:
    """The deepest nesting of objects / arrays in a JSON text, brackets inside strings not
    counted (a quote is a string boundary unless an odd run of backslashes precedes it)."""
    raw = text.encode("utf-8", "surrogatepass") if isinstance(text, str) else text
    deepest = depth = 0
    in_string, run = 0, 0             # carried across chunks: string parity, backslash run
    for start in range(0, len(raw), _CHUNK):
        b = np.frombuffer(raw, np.uint8, min(_CHUNK, len(raw) - start), start)
        n = b.size
        pos = np.arange(n, dtype=np.int32)
        backslash = b == 0x5C
        last_plain = np.maximum.accumulate(np.where(backslash, np.int32(-1), pos))
        before = np.empty(n, np.int32)                    # backslashes just before i
        before[0] = run
        before[1:] = pos[:-1] - last_plain[:-1] + np.where(last_plain[:-1] < 0, run, 0)
        quote = (b == 0x22) & (before % 2 == 0)
        inside = (np.cumsum(quote, dtype=np.int32) + in_string) % 2 == 1
        step = ((b == 0x7B) | (b == 0x5B)).astype(np.int32) \
            - ((b == 0x7D) | (b == 0x5D)).astype(np.int32)
        step[inside] = 0
        levels = np.cumsum(step, dtype=np.int64) + depth
        deepest = max(deepest, int(levels.max()))
        depth = int(levels[-1])
        in_string = (in_string + int(np.count_nonzero(quote))) % 2
        run = run + n if last_plain[-1] < 0 else n - 1 - int(last_plain[-1])
    return deepest


def check_depth(text: str | bytes, what: str, max_depth: int = MAX_DEPTH) -> None:
    """ValueError naming `what` when the JSON text nests deeper than max_depth."""
    depth = nesting_depth(text)
    if depth > max_depth:
        raise ValueError(f"{what} nests {depth} levels deep (at most {max_depth} allowed)")


def loads(text: str | bytes, what: str, max_depth: int = MAX_DEPTH, **kwargs: Any) -> Any:
    """json.loads(text, **kwargs) after the depth check (ValueError naming `what`;
    json.JSONDecodeError, a ValueError, when the text is not JSON)."""
    check_depth(text, what, max_depth)
    return json.loads(text, **kwargs)
