"""The optional dependencies (pyproject.toml's extras), imported where they are needed, with
an error that names the extra and the command that installs it."""
from __future__ import annotations

import importlib
from types import ModuleType

from .errors import ColibriError


class MissingExtra(ColibriError, ImportError):
    """An optional module is not installed; the message says which extra brings it. A
    ColibriError, so the CLI prints it as one `error:` line; an ImportError, so library
    callers that catch ImportError keep working."""


def require_extra(module: str, extra: str, what: str | None = None) -> ModuleType:
    """The imported `module`, or MissingExtra naming `extra` and `pip install 'colibri[extra]'`.
    what: the feature that needs it, for the message (default: the module's name)."""
    try:
        return importlib.import_module(module)
    except ImportError as e:
        missing = e.name or module
        raise MissingExtra(f"{what or module} needs the {extra} extra ({missing} is not "
                           f"installed): pip install 'colibri[{extra}]'",
                           name=missing) from None
