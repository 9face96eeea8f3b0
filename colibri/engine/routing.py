"""RoutingTrace: which experts each token chose, per MoE layer, as Model.forward records it.

Model.forward(..., return_routing=True) appends each MoE layer's routing to one (trace_layer)
and returns it beside the logits; colibri.tools.trace and colibri.tools.stats build on it.
Shapes as in the package docstring.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from .. import kernels
from .moe import MoE

__all__ = ["RoutingTrace", "trace_layer", "drop_batch", "decode_ids"]


@dataclass
class RoutingTrace:
    """Which experts each token chose, per MoE layer.

    layers: the MoE layer numbers, in order; ids[j] int32 (B, S, K) and weights[j] float32
    (B, S, K) belong to layers[j] (B is dropped for 1-D input); shared_gate[j] float32 (B, S)
    is sigmoid(x·g) of the shared expert when the model has one, else the list is empty;
    logits[j] float32 (B, S, E) are the raw router logits (the full distribution is their
    softmax; colibri.trace builds on them).
    """
    layers: list[int]
    ids: list[np.ndarray]
    weights: list[np.ndarray]
    shared_gate: list[np.ndarray] = field(default_factory=list)
    logits: list[np.ndarray] = field(default_factory=list)

    def __getitem__(self, layer: int) -> tuple[np.ndarray, np.ndarray]:
        """(ids, weights) of MoE layer number `layer`."""
        try:
            j = self.layers.index(layer)
        except ValueError:
            raise KeyError(f"layer {layer} has no routed experts (MoE layers: {self.layers})") from None
        return self.ids[j], self.weights[j]

    def stacked(self) -> tuple[np.ndarray, np.ndarray]:
        """ids int32 (n_moe_layers, [B,] S, K) and weights float32 of the same shape."""
        return np.stack(self.ids), np.stack(self.weights)

    def __repr__(self) -> str:
        shape = self.ids[0].shape if self.ids else ()
        return f"RoutingTrace(layers={self.layers}, ids/weights per layer {shape})"


def trace_layer(trace: RoutingTrace, i: int, moe: MoE, x: np.ndarray, ids: np.ndarray,
                wts: np.ndarray, gate: np.ndarray | None, B: int, S: int, threads: int) -> None:
    """Append MoE layer i's routing (ids, weights (T, K), shared gate (T,), x (T, D)) to
    trace, shaped (B, S, ...)."""
    trace.layers.append(i)
    trace.ids.append(ids.reshape(B, S, -1).astype(np.int32, copy=False))
    trace.weights.append(wts.reshape(B, S, -1).astype(np.float32, copy=False))
    if gate is not None:
        trace.shared_gate.append(gate.reshape(B, S))
    # the router matmul again, outside the timed stages: same kernel, same input, so the
    # same logits the routing above was computed from
    trace.logits.append(kernels.linear(x, moe.router, moe.router_bias, threads=threads
                                       ).reshape(B, S, -1))


def drop_batch(trace: RoutingTrace) -> None:
    """The trace of 1-D input: every array without its batch axis (B = 1)."""
    trace.ids = [a[0] for a in trace.ids]
    trace.weights = [a[0] for a in trace.weights]
    trace.shared_gate = [a[0] for a in trace.shared_gate]
    trace.logits = [a[0] for a in trace.logits]


def decode_ids(trace: RoutingTrace, k: int) -> np.ndarray:
    """The ids of a one-token pass's trace (1-D input) as Model.forward_ragged gives a
    segment's routing: int32 (M, 1, K), M the MoE layers (K = k when there are none)."""
    if not trace.ids:
        return np.zeros((0, 1, k), np.int32)
    return np.stack(trace.ids).astype(np.int32, copy=False).reshape(len(trace.ids), 1, -1)
