"""JSON from untrusted sources (a model file's metadata, a checkpoint's config.json) parsed
with a bounded nesting depth.

json.loads recurses once per nesting level: a few thousand '[' raise RecursionError (or, in
a thread with a small stack, worse). nesting_depth() measures the depth with vector ops over
the bytes before anything is parsed, so a hostile document is refused with a plain message.
"""
from __future__ import annotations

import json
from typing import Any

import numpy as np

MAX_DEPTH = 64   # real metadata and config.json files nest < 10 levels


def nesting_depth(text: str | bytes) -> int:
    """The deepest nesting of objects / arrays in a JSON text, brackets inside strings not
    counted (a quote is a string boundary unless an odd run of backslashes precedes it)."""
    raw = text.encode("utf-8", "surrogatepass") if isinstance(text, str) else text
    b = np.frombuffer(raw, np.uint8)
    if b.size == 0:
        return 0
    pos = np.arange(b.size)
    backslash = b == 0x5C
    last_plain = np.maximum.accumulate(np.where(backslash, -1, pos))   # last non-backslash <= i
    run_before = np.empty(b.size, np.int64)                           # backslashes just before i
    run_before[0] = 0
    run_before[1:] = pos[:-1] - last_plain[:-1]
    quote = (b == 0x22) & (run_before % 2 == 0)
    outside = np.cumsum(quote) % 2 == 0          # quotes themselves don't matter: not brackets
    step = (((b == 0x7B) | (b == 0x5B)).astype(np.int64)
            - ((b == 0x7D) | (b == 0x5D)).astype(np.int64)) * outside
    return int(np.cumsum(step).max(initial=0))


def loads(text: str | bytes, what: str, max_depth: int = MAX_DEPTH, **kwargs: Any) -> Any:
    """json.loads(text, **kwargs) after the depth check; ValueError naming `what` when the
    text nests deeper than max_depth (json.JSONDecodeError, a ValueError, when invalid)."""
    depth = nesting_depth(text)
    if depth > max_depth:
        raise ValueError(f"{what} nests {depth} levels deep (at most {max_depth} allowed)")
    return json.loads(text, **kwargs)
