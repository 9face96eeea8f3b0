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


class NonFiniteError(ColibriError, ValueError):
    """A forward pass produced NaN; the message names the layer and stage it came from."""


class ForeignCacheError(ColibriError, ValueError):
    """A KV cache was filled by another model (file) than the one it is given to."""


class CacheBusyError(ColibriError, RuntimeError):
    """A KV cache is in a forward pass on another thread."""
