"""Exceptions raised by colibri."""


class ColibriError(Exception):
    """Base class of colibri's own errors."""


class ColibriFormatError(ColibriError, ValueError):
    """A .colibri file (or a checkpoint being converted) is malformed, truncated or foreign.

    The message names the file and says what was expected and what was found.
    """


class ColibriFileChangedError(ColibriFormatError):
    """A mapped .colibri file was changed in place (resized or rewritten) after it was opened:
    its pages may fault (SIGBUS) or hold other weights. Replace model files by rename."""
