"""Shared helpers of the benchmarks: ISA and thread parameters, random weights at real shapes,
a small synthetic model file, a best-of timer for the track_* GB/s figures.

    asv continuous -b kernels -b model main HEAD    # compare two commits
    asv run --quick --python=same                   # one pass on the installed package

Nothing here needs torch or transformers: the model is written with colibri's own writer
from the family's ModelConfig of the config, with random weights.
"""
from __future__ import annotations

import os
import tempfile
import time

import numpy as np

from colibri.kernels import runtime
from colibri.kernels.weights import WeightRef

ISAS = ("scalar", "avx2", "avx512")
THREADS = (1, 2)


def use(isa: str, threads: int) -> None:
    """Select the ISA path (NotImplementedError, which asv reports as a skip, when this
    machine lacks it) and check the thread count is sane."""
    if isa not in runtime.available_isas():
        raise NotImplementedError(f"this CPU/OS does not run the {isa} path")
    if threads > (os.cpu_count() or 1):
        raise NotImplementedError(f"{threads} threads > {os.cpu_count()} CPUs")
    runtime.set_isa(isa)


def weight(shape: tuple[int, ...], fmt: str, seed: int = 0, group_size: int = 32) -> WeightRef:
    """A WeightRef of random N(0, 0.02) weights, (R, C) or (E, R, C), encoded as fmt.

    Large stacks are built by tiling one encoded 256-row block (encoding is slow in NumPy;
    the kernels' speed does not depend on the values)."""
    rng = np.random.default_rng(seed)
    gs = group_size if fmt in ("q8", "q4", "mxfp4") else 0
    *lead, R, C = shape
    E = lead[0] if lead else 1
    rows = min(R, 256)
    block = WeightRef.from_array((rng.standard_normal((rows, C)) * 0.02).astype(np.float32),
                                 fmt, gs)
    reps = -(-E * R // rows)
    buf = np.tile(block.buf, reps)[:E * R * block.row_stride]
    return WeightRef(np.ascontiguousarray(buf), 0, fmt, R, C, gs, block.row_stride, E)


def nbytes(w: WeightRef, n_matrices: int = 1) -> int:
    """Bytes of n_matrices matrices of w (what one pass streams)."""
    return n_matrices * w.rows * w.row_stride


def best_seconds(fn, repeat: int = 5, number: int = 1) -> float:
    """Best wall time of `number` calls, over `repeat` rounds (after one warm-up call)."""
    fn()
    best = float("inf")
    for _ in range(repeat):
        t0 = time.perf_counter()
        for _ in range(number):
            fn()
        best = min(best, (time.perf_counter() - t0) / number)
    return best


# ---------------------------------------------------------------------------------------------
# a small synthetic model

SMALL_MIXTRAL = dict(model_type="mixtral", vocab_size=4096, hidden_size=512,
                     intermediate_size=1024, num_hidden_layers=4, num_attention_heads=8,
                     num_key_value_heads=2, num_local_experts=8, num_experts_per_tok=2,
                     max_position_embeddings=1024, rms_norm_eps=1e-5, rope_theta=1e6,
                     tie_word_embeddings=False)


def make_model(path: str, config: dict | None = None, quant: str = "q4", seed: int = 0) -> str:
    """Write a .colibri file with random weights for `config` (an HF config dict), every
    matrix in `quant` (routers and norms f32, embedding f16); return its path."""
    from colibri import format as cf
    from colibri.families import canonical_tensors, get_family

    config = dict(config or SMALL_MIXTRAL)
    model_config = get_family(config["model_type"]).model_config(config)
    rng = np.random.default_rng(seed)
    specs, arrays = [], {}
    for t in canonical_tensors(model_config):
        if len(t.shape) == 1:
            dtype, a = "f32", np.ones(t.shape, np.float32)
        else:
            a = (rng.standard_normal(t.shape) * 0.02).astype(np.float32)
            dtype = ("f32" if t.kind in ("moe.router", "moe.shared_gate")
                     else "f16" if t.kind == "tok_embeddings" else quant)
        gs = 32 if dtype in ("q8", "q4") else 0
        specs.append(cf.TensorSpec.infer(t.name, dtype, t.shape, group_size=gs))
        arrays[t.name] = a
    meta = {"config": config, "arch": model_config.to_metadata(), "tokenizer": None, "user": {}}
    with cf.ColibriWriter(path, specs, meta, n_layers=model_config.num_hidden_layers,
                          n_experts=model_config.num_experts, checksums=False) as w:
        for name, a in arrays.items():
            w.write(name, a)
    return path


def model_folder() -> str:
    return tempfile.mkdtemp(prefix="colibri-asv-")
