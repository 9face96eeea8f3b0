"""What every conversion (Hugging Face or GGUF) checks beyond the file format, and what keeps
an interrupted or broken one from leaving anything behind.

  - what it is given: the user metadata (--meta), the values (no inf / NaN), and the warning
    class of what it survives;
  - signals that raise (so that the writer's cleanup runs), and the finished temporary file
    validated (colibri.format.validation) before the rename (docs/safety.md).
"""
from __future__ import annotations

import contextlib
import os
import signal
import threading
from typing import Iterable, Mapping

import numpy as np

from ..errors import ColibriError
from ..format import ColibriFile, validation


class ConversionWarning(UserWarning):
    """Something the conversion survived but the user should know (e.g. no tokenizer)."""


def check_finite(a: np.ndarray, name: str, key: str, chunk: int = 1 << 22) -> None:
    """Raise naming the tensor if `a` (f32/f16/bf16 values) holds an inf or NaN.

    Looks at the exponent bits (all ones = inf/NaN), chunk by chunk: bounded temporaries, and
    the same test for every float format, bf16 included.
    """
    if a.itemsize == 4:
        uint, exponent = np.uint32, 0x7F800000
    else:
        uint, exponent = np.uint16, 0x7C00 if a.dtype == np.float16 else 0x7F80
    flat = a.reshape(-1).view(uint)
    count, first = 0, -1
    for start in range(0, flat.size, chunk):
        bad = (flat[start: start + chunk] & exponent) == exponent
        n = int(np.count_nonzero(bad))
        if n and first < 0:
            first = start + int(np.argmax(bad))
        count += n
    if count:
        value = float(a.reshape(-1)[first].astype(np.float32))
        raise ColibriError(f"tensor {name} (checkpoint {key!r}) has {count} non-finite "
                           f"values (first at flat index {first}: {value})")


def check_meta(meta: Mapping[str, str] | None) -> dict[str, str]:
    out = {}
    for k, v in (meta or {}).items():
        if not isinstance(k, str) or not k or not isinstance(v, str):
            raise ColibriError(f"metadata must map non-empty strings to strings, found "
                               f"{k!r}: {v!r}")
        out[k] = v
    return out


def parse_meta(items: Iterable[str]) -> dict[str, str]:
    """["licence=apache-2.0", "note=a=b"] -> {"licence": "apache-2.0", "note": "a=b"}."""
    out = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or not key.strip():
            raise ColibriError(f"--meta {item!r}: expected key=value")
        out[key.strip()] = value
    return out


class ConversionInterrupted(ColibriError):
    """SIGTERM / SIGHUP during a conversion: the temporary file was removed, DST untouched."""


@contextlib.contextmanager
def signals_raise():
    """While converting, SIGTERM and SIGHUP raise ConversionInterrupted (SIGINT already raises
    KeyboardInterrupt), so the writer's cleanup runs and no temporary file is left; the
    previous handlers come back afterwards. Only in the main thread, and only for signals
    left at their default (an application's own handlers are not replaced). SIGKILL cannot be
    caught: the next conversion of the same DST removes what it leaves."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def handler(signum, frame):
        raise ConversionInterrupted(f"conversion interrupted by {signal.Signals(signum).name}; "
                                    f"the temporary file was removed")

    previous = {}
    for name in ("SIGTERM", "SIGHUP"):
        sig = getattr(signal, name, None)
        if sig is not None and signal.getsignal(sig) is signal.SIG_DFL:
            previous[sig] = signal.signal(sig, handler)
    try:
        yield
    finally:
        for sig, old in previous.items():
            signal.signal(sig, old)


def verify_converted(tmp: str, dst: str | os.PathLike, header: bytes) -> None:
    """The finished temporary file read back and validated in full before it is renamed
    onto dst (colibri.format.validation.validate): ColibriError listing the first problems."""
    with ColibriFile(tmp, pending_header=header) as cf:
        problems = validation.validate(cf)
    if problems:
        more = f" (and {len(problems) - 3} more)" if len(problems) > 3 else ""
        raise ColibriError(f"{dst}: the converted file fails validation and was not written: "
                           f"{'; '.join(problems[:3])}{more}")
