"""The message for an optional dependency that is not installed: which extra brings it.

    raise missing_extra("eval", "lm-eval", "colibri eval") from None
"""
from __future__ import annotations

__all__ = ["missing_extra"]


def missing_extra(extra: str, package: str, what: str) -> ModuleNotFoundError:
    """A ModuleNotFoundError saying that `what` needs `package`, from colibri's `extra`, and
    the pip command that installs it."""
    return ModuleNotFoundError(
        f"{what} needs {package}, which is not installed; it comes with colibri's [{extra}] "
        f"extra: pip install 'colibri[{extra}]' (from a checkout: pip install '.[{extra}]')",
        name=package)
