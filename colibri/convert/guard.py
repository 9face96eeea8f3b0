"""What keeps an interrupted or broken conversion from leaving anything behind: signals that
raise (so the writer's cleanup runs) and the finished temporary file validated before the
rename (docs/safety.md)."""
from __future__ import annotations

import contextlib
import os
import signal
import threading

from .. import validation
from ..errors import ColibriError
from ..format import ColibriFile

__all__ = ["ConversionInterrupted", "signals_raise", "verify_converted"]


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
    onto dst (colibri.validation.validate): ColibriError listing the first problems."""
    with ColibriFile(tmp, pending_header=header) as cf:
        problems = validation.validate(cf)
    if problems:
        more = f" (and {len(problems) - 3} more)" if len(problems) > 3 else ""
        raise ColibriError(f"{dst}: the converted file fails validation and was not written: "
                           f"{'; '.join(problems[:3])}{more}")
