"""Stopping: the model's end-of-sequence ids, stop arguments split into ids and strings, and
the text guard that holds back what might be the start of a stop string (shared by
colibri.generation.generate and colibri.generation.batching).
"""
from __future__ import annotations

import numpy as np

__all__ = ["default_stop_ids", "split_stop", "StopText"]


def default_stop_ids(model) -> list[int]:
    """End-of-sequence ids: the config's eos_token_id plus the tokenizer's/generation config's."""
    ids: set[int] = set()
    eos = model.config.eos_token_id
    if eos is not None:
        ids.update(eos if isinstance(eos, tuple) else [eos])
    if model.file.tokenizer_files and model.tokenizer is not None:
        ids.update(model.tokenizer.eos_token_ids)
    return sorted(int(i) for i in ids)


def split_stop(stop) -> tuple[list[int], list[str]]:
    """(token ids, strings) of a stop argument: None, an id, a string, or a list of them."""
    if stop is None:
        return [], []
    if isinstance(stop, (bool, np.bool_)) or not isinstance(
            stop, (int, str, np.integer, list, tuple, np.ndarray)):
        raise TypeError(f"stop must be None, a token id, a string or a list of them, got "
                        f"{type(stop).__name__}")
    items = [stop] if isinstance(stop, (int, str, np.integer)) else list(stop)
    ids = [int(s) for s in items if isinstance(s, (int, np.integer))]
    texts = [s for s in items if isinstance(s, str)]
    bad = [s for s in items if isinstance(s, (bool, np.bool_))
           or not isinstance(s, (int, np.integer, str))]
    if bad or any(t == "" for t in texts):
        raise ValueError(f"stop must be token ids and/or non-empty strings, got {stop!r}")
    return ids, texts


class StopText:
    """Holds back text that might be the start of a stop string; says when one appeared."""

    def __init__(self, stops: list[str]):
        self.stops = stops
        self.pending = ""
        self.done = False

    def feed(self, piece: str) -> str:
        if not self.stops:
            return piece
        self.pending += piece
        cut = min((self.pending.find(s) for s in self.stops if s in self.pending), default=-1)
        if cut >= 0:
            self.done = True
            out, self.pending = self.pending[:cut], ""
            return out
        hold = 0                                  # longest suffix that is a stop's prefix
        for s in self.stops:
            for n in range(min(len(s) - 1, len(self.pending)), 0, -1):
                if self.pending.endswith(s[:n]):
                    hold = max(hold, n)
                    break
        out = self.pending[:len(self.pending) - hold]
        self.pending = self.pending[len(self.pending) - hold:]
        return out

    def flush(self) -> str:
        out, self.pending = self.pending, ""
        return out
