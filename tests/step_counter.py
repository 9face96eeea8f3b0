"""Counting the decode steps that run the Python layer loop (layer_loop.run_layers over a
TokenStep) instead of the compiled layers."""
from __future__ import annotations

from colibri.engine import layer_loop


def python_steps(model, monkeypatch) -> list:
    """A list that gets one entry per decode step of `model` through the Python loop."""
    taken, real = [], layer_loop.run_layers

    def counted(m, batch, *args):
        if m is model and isinstance(batch, layer_loop.TokenStep):
            taken.append(1)
        return real(m, batch, *args)

    monkeypatch.setattr(layer_loop, "run_layers", counted)
    return taken
