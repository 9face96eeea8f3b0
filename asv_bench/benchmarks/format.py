"""Benchmarks of the .colibri reader: open time and memory, first touch of an expert.

    asv continuous -b format main HEAD      # compare two commits
    asv run --quick -b format               # one pass on the current checkout

The file is synthetic (random bytes would do; zeros keep setup fast) but has the tensor
count of a real model, so the open cost (header, table, expert index, metadata) is real.
"""
import os
import tempfile

import numpy as np

from colibri.format import PROJS, ColibriFile, ColibriWriter, TensorSpec, expert_name, router_name

# name, layers, experts, hidden, expert intermediate (dims kept small: open cost scales
# with the number of records, not with the tensor sizes)
SHAPES = {
    "mixtral-like": (32, 8, 64, 64),
    "olmoe-like": (16, 64, 64, 32),
    "qwen3-30b-like": (48, 128, 64, 32),
}


def _write_model(path, n_layers, n_experts, d, i):
    specs, arrays = [], {}
    for layer in range(n_layers):
        name = router_name(layer)
        specs.append(TensorSpec.infer(name, "f32", (n_experts, d)))
        arrays[name] = np.zeros((n_experts, d), np.float32)
        for proj in ("wq", "wk", "wv", "wo"):
            name = f"layers.{layer}.attn.{proj}"
            specs.append(TensorSpec.infer(name, "f16", (d, d)))
            arrays[name] = np.zeros((d, d), np.float32)
        for e in range(n_experts):
            for proj, shape in zip(PROJS, ((i, d), (i, d), (d, i))):
                name = expert_name(layer, e, proj)
                specs.append(TensorSpec.infer(name, "q4", shape, group_size=32))
                arrays[name] = np.zeros(shape, np.float32)
    meta = {"config": {"model_type": "synthetic"}, "arch": {}, "tokenizer": None, "user": {}}
    with ColibriWriter(path, specs, meta, n_layers=n_layers, n_experts=n_experts,
                       checksums=False) as w:
        for name, a in arrays.items():
            w.write(name, a)


class Open:
    params = list(SHAPES)
    param_names = ["model"]
    timeout = 300

    def setup_cache(self):
        folder = tempfile.mkdtemp(prefix="colibri-asv-")
        paths = {}
        for key, dims in SHAPES.items():
            paths[key] = os.path.join(folder, f"{key}.colibri")
            _write_model(paths[key], *dims)
        return paths

    def time_open(self, paths, model):
        ColibriFile(paths[model]).close()

    def peakmem_open(self, paths, model):
        ColibriFile(paths[model]).close()

    def time_open_and_touch_one_expert(self, paths, model):
        f = ColibriFile(paths[model])
        q = f.expert_stack(0, "w_gate")
        int(q.data[0, 0, 0])
        f.close()

    def track_records(self, paths, model):
        with ColibriFile(paths[model]) as f:
            return len(f.tensors)
