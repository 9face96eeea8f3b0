"""Two small converted models whose routing the trace, stats and display tests read:
qwen2_moe (a gated shared expert, one dense layer) and mixtral (two MoE layers, top-2)."""
from __future__ import annotations

import pytest

import colibri.api as api
from colibri.convert import convert


def converted(hf_checkpoint, tmp_path_factory, family: str, **overrides):
    """(HF folder, Model at f32 on one thread) of a tiny random `family` checkpoint."""
    src = hf_checkpoint(family, initializer_range=0.15, **overrides)
    out = convert(src, tmp_path_factory.mktemp(f"routing-{family}") / "m.colibri", dtype="f32",
                  progress=False)
    return src, api.load(out, threads=1, kv_dtype="f32")


@pytest.fixture(scope="module")
def qwen(hf_checkpoint, tmp_path_factory):
    """qwen2_moe: a shared expert with a sigmoid gate, layer 1 dense (MoE layers [0])."""
    src, m = converted(hf_checkpoint, tmp_path_factory, "qwen2_moe")
    yield src, m
    m.close()


@pytest.fixture(scope="module")
def mixtral(hf_checkpoint, tmp_path_factory):
    """mixtral: two MoE layers, top-2 renormalised."""
    src, m = converted(hf_checkpoint, tmp_path_factory, "mixtral")
    yield src, m
    m.close()
