"""The .colibri reader: metadata, the tensor table and zero-copy views, expert stacks, the
mapping's lifetime, the typed model config, open time."""
from __future__ import annotations

import os
import time
from pathlib import Path

import numpy as np
import pytest

from colibri.config import ConfigError, ModelConfig
from colibri.errors import ColibriError
from colibri.format import ColibriFile, QuantizedTensor, save
from colibri import format as fmt

from format_helpers import model_tensors, METADATA, model_path, D, I, E, L


def test_metadata_roundtrip(model_path):
    with ColibriFile(model_path) as cf:
        assert cf.metadata == METADATA
        assert list(cf.metadata) == list(METADATA)                 # order kept
        assert cf.config == METADATA["config"] and cf.arch == METADATA["arch"]
        assert cf.user_metadata == METADATA["user"]
        assert cf.tokenizer_files == METADATA["tokenizer"]["files"]
        raw = bytes(cf.buffer[cf.header["metadata_offset"]:][:cf.header["metadata_size"]])
        assert "γειά".encode() in raw                              # ensure_ascii=False


def test_empty_file_is_valid(tmp_path):
    p = tmp_path / "empty.colibri"
    save(p, {}, {"user": {"a": "b"}})
    with ColibriFile(p) as cf:
        assert len(cf.tensors) == 0 and cf.names() == []
        assert cf.file_size == cf.header["data_offset"] == 4096 == os.path.getsize(p)
        assert cf.header["routing_offset"] == 4096 and cf.user_metadata == {"a": "b"}
        assert cf.tokenizer_files is None and cf.config == {}
        assert cf.validate() == []


def test_reader_api(model_path):
    cf = fmt.open(model_path)
    st = os.stat(model_path)
    assert cf.identity == (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns)
    assert (cf.version, cf.n_layers, cf.n_experts, cf.file_size) == (1, L, E, st.st_size)
    assert "norm" in cf and "nope" not in cf and len(cf) == len(model_tensors())
    assert cf.names() == list(cf.tensors)
    with pytest.raises(KeyError, match="nope"):
        cf.tensor("nope")
    with pytest.raises(KeyError):
        cf.expert_block(0, E)
    with pytest.raises(ValueError, match="which"):
        cf.expert_stack(0, "w_sideways")
    assert cf.buffer.readonly and len(cf.buffer) == cf.file_size
    np.testing.assert_array_equal(cf.to_float32("positions"), np.arange(5) - 2)


def test_close_keeps_views_alive(model_path):
    cf = ColibriFile(model_path)
    view, stack = cf.tensor("lm_head"), cf.expert_stack(1, "w_up")
    qstack = cf.expert_stack(0, "w_down")
    head = cf.buffer[:4]
    copy, qcopy = view.copy(), qstack.dequantize()
    cf.close()
    cf.close()                                  # idempotent
    np.testing.assert_array_equal(view, copy)   # still mapped: the view holds the mapping
    np.testing.assert_array_equal(qstack.dequantize(), qcopy)
    assert bytes(head) == b"COLI"
    assert stack.shape == (E, I, D)
    with pytest.raises(ColibriError, match="closed"):
        cf.tensor("lm_head")
    with ColibriFile(model_path) as cf2:
        pass
    assert cf2.buffer is None


@pytest.mark.parametrize("layer", range(L))
def test_expert_stack_is_a_zero_copy_strided_view(model_path, layer):
    with ColibriFile(model_path) as cf:
        for which in ("w_gate", "w_up", "w_down"):
            stack = cf.expert_stack(layer, which)
            singles = [cf.tensor(f"layers.{layer}.moe.experts.{e}.{which}") for e in range(E)]
            stride = cf.expert_stride(layer)
            assert stride % 4096 == 0
            if isinstance(stack, QuantizedTensor):
                assert stack.shape == (E,) + singles[0].shape
                for e in range(E):
                    np.testing.assert_array_equal(stack.data[e], singles[e].data)
                    np.testing.assert_array_equal(stack.scales[e], singles[e].scales)
                assert stack.data.strides[0] == stride
                assert np.shares_memory(stack.data, singles[1].data)
                np.testing.assert_array_equal(
                    stack.dequantize(), np.stack([s.dequantize() for s in singles]))
            else:
                assert stack.shape == (E,) + singles[0].shape and stack.strides[0] == stride
                np.testing.assert_array_equal(stack, np.stack(singles))
                assert np.shares_memory(stack, singles[2]) and not stack.flags.writeable


def test_open_is_fast_for_many_tensors(tmp_path):
    layers, experts = 8, 64
    t = {}
    for la in range(layers):
        t[f"layers.{la}.moe.router"] = np.ones((experts, 32), np.float32)
        for e in range(experts):
            for proj in ("w_gate", "w_up", "w_down"):
                t[f"layers.{la}.moe.experts.{e}.{proj}"] = np.ones((1, 32), np.float16)
    p = tmp_path / "many.colibri"
    save(p, t)
    best = min(_timed_open(p) for _ in range(3))
    assert len(t) == 1544
    assert best < 0.25, f"opening {len(t)} tensors took {best * 1e3:.0f} ms"


def _timed_open(p: Path) -> float:
    t0 = time.perf_counter()
    ColibriFile(p).close()
    return time.perf_counter() - t0


def test_model_config_is_the_typed_arch(model_path, tmp_path):
    with ColibriFile(model_path) as cf:
        cfg = cf.model_config
        assert isinstance(cfg, ModelConfig) and cfg is cf.model_config     # built once
        assert (cfg.family, cfg.hidden_size, cfg.num_experts) == ("toy", D, E)
        assert cfg.to_metadata() == {**cfg.to_metadata(), **METADATA["arch"]}
    p = tmp_path / "no-arch.colibri"
    save(p, {"x": np.zeros(4, np.float32)}, {"arch": {"family": "toy"}})
    with ColibriFile(p) as cf:
        with pytest.raises(ConfigError, match="lacks the field 'vocab_size'") as info:
            cf.model_config
        assert str(p) in str(info.value)
