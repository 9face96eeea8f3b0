"""Shared by the tests/test_safety_file*.py files and scripts/: re-saving a model file with
edited metadata, and the shipped tiny model."""
from __future__ import annotations

import copy
from pathlib import Path
from typing import Callable

import numpy as np

import colibri
from colibri.format import ColibriFile, ColibriWriter, TensorSpec

SHIPPED = Path(colibri.__file__).parent / "models" / "tiny-moe.colibri"


def resave(src: str | Path, dst: str | Path, edit: Callable[[dict], None] | None = None) -> Path:
    """dst = src's tensors (bytes unchanged) with its metadata passed through edit(meta),
    written by ColibriWriter (so the metadata checksum matches the edited metadata)."""
    with ColibriFile(src) as cf:
        meta = copy.deepcopy(cf.metadata)
        if edit is not None:
            edit(meta)
        infos = list(cf.tensors.values())
        specs = [TensorSpec.infer(i.name, i.dtype, i.shape, i.group_size) for i in infos]
        with ColibriWriter(dst, specs, meta, n_layers=cf.n_layers, n_experts=cf.n_experts,
                           overwrite=True) as w:
            for i in infos:
                w.write(i.name, np.frombuffer(cf.buffer[i.offset: i.offset + i.nbytes],
                                              np.uint8), raw=True)
    return Path(dst)
