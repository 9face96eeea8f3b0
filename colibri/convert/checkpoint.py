"""A Hugging Face checkpoint folder read: its safetensors shards (the tensor table from the
headers only, then tensors one at a time), config.json and the tokenizer files."""
from __future__ import annotations

import json
import os
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from ..errors import ColibriError
from ..format import safe_json
from .checks import ConversionWarning

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
                   "generation_config.json", "chat_template.jinja")
INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"
GGUF_MAGIC = b"GGUF"

# safetensors dtype -> colibri dtype of the values (what "auto" keeps)
SOURCE_DTYPES = {"F32": "f32", "F16": "f16", "BF16": "bf16"}
FP8 = "F8_E4M3"                   # block-scaled: dequantized on reading
ITEM_BYTES = {"F32": 4, "F16": 2, "BF16": 2, FP8: 1}
SCALE_SUFFIX = "_scale_inv"


@dataclass(frozen=True)
class CheckpointTensor:
    key: str
    shard: str                      # file name inside SRC
    shape: tuple[int, ...]
    dtype: str                      # safetensors dtype string: "F32", "BF16", ...


def read_json(path: Path, what: str) -> Any:
    try:
        with open(path, encoding="utf-8") as f:
            return safe_json.loads(f.read(), what)
    except FileNotFoundError:
        raise ColibriError(f"{path}: {what} not found") from None
    except (ValueError, UnicodeDecodeError) as e:      # JSONDecodeError, too deep
        raise ColibriError(f"{path}: {what} is not valid JSON ({e})") from None


def open_shard(path: Path):
    # on first use: `import colibri` should not pay for the checkpoint readers (~0.4 s)
    import ml_dtypes  # noqa: F401  - registers bfloat16 with NumPy for safetensors
    from safetensors import safe_open
    try:
        return safe_open(str(path), framework="np")
    except FileNotFoundError:
        raise ColibriError(f"{path}: checkpoint shard not found") from None
    except Exception as e:          # safetensors raises its own error types on bad headers
        raise ColibriError(f"{path}: not a readable safetensors file ({e})") from None


def scan_checkpoint(src: Path) -> dict[str, CheckpointTensor]:
    """Every tensor of the checkpoint (key -> shard, shape, dtype), from the headers only."""
    index_path = src / INDEX_FILE
    if index_path.exists():
        index = read_json(index_path, INDEX_FILE)
        weight_map = index.get("weight_map") if isinstance(index, dict) else None
        if not isinstance(weight_map, dict) or not weight_map:
            raise ColibriError(f"{index_path}: no 'weight_map' object")
        shards = sorted(set(weight_map.values()))
        for shard in shards:
            if not isinstance(shard, str) or os.path.basename(shard) != shard:
                raise ColibriError(f"{index_path}: bad shard file name {shard!r}")
            if not (src / shard).is_file():
                raise ColibriError(f"{src}: shard {shard!r} listed in {INDEX_FILE} is missing")
    elif (src / SINGLE_FILE).is_file():
        weight_map, shards = None, [SINGLE_FILE]
    else:
        other = sorted(p.name for p in src.glob("*.bin")) if src.is_dir() else []
        hint = f" (found {other[0]}: PyTorch .bin checkpoints are not supported)" if other else ""
        raise ColibriError(f"{src}: no {SINGLE_FILE} or {INDEX_FILE}{hint}")
    found: dict[str, CheckpointTensor] = {}
    for shard in shards:
        with open_shard(src / shard) as f:
            for key in f.keys():
                sl = f.get_slice(key)
                if key in found:
                    raise ColibriError(f"{src}: tensor {key!r} is in both {found[key].shard} "
                                       f"and {shard}")
                found[key] = CheckpointTensor(key, shard, tuple(sl.get_shape()), sl.get_dtype())
    if weight_map is not None:
        for key, shard in weight_map.items():
            if key not in found:
                raise ColibriError(f"{src}: {INDEX_FILE} places {key!r} in {shard}, which "
                                   f"does not contain it")
    return found


def is_gguf(path: str | os.PathLike) -> bool:
    """True when `path` is a file starting with the GGUF magic (a llama.cpp model file)."""
    try:
        with open(path, "rb") as f:
            return f.read(4) == GGUF_MAGIC
    except OSError:                   # a folder, a missing path, no permission
        return False


def read_tokenizer(src: Path) -> dict | None:
    """{"files": {name: text}} of the tokenizer files present, or None when there are none."""
    files = {}
    for name in TOKENIZER_FILES:
        path = src / name
        if path.is_file():
            try:
                files[name] = path.read_text(encoding="utf-8")
            except UnicodeDecodeError:
                raise ColibriError(f"{path}: not UTF-8 text") from None
    if "tokenizer.json" not in files:
        warnings.warn(f"{src.name}: no tokenizer.json; the converted model can be used with "
                      f"token ids only", ConversionWarning, stacklevel=3)
    return {"files": files} if files else None


class ShardReader:
    """safe_open over one shard, reopened after `budget` bytes so the pages of the shard's
    mapping that reads touched (file-backed RSS) are released: resident memory stays bounded
    by the budget, not by the shard size."""

    def __init__(self, path: Path, budget: int):
        self.path, self.budget = path, budget
        self._f, self._ctx, self._read = None, None, 0
        self._header = None             # (data start, parsed header) for get_fp8

    def get(self, key: str, index: tuple) -> np.ndarray:
        if self._f is None or self._read >= self.budget:
            self.close()
            self._ctx = open_shard(self.path)
            self._f = self._ctx.__enter__()
            self._read = 0
        a = self._f.get_slice(key)[index] if index else self._f.get_tensor(key)
        self._read += a.nbytes
        return a

    def get_fp8(self, key: str) -> np.ndarray:
        """An F8_E4M3 tensor as float32 (safetensors' NumPy reader has no float8 type: the
        bytes are read at the offsets of the file's header, safetensors' documented layout;
        the header is parsed once per shard)."""
        import ml_dtypes
        if self._header is None:
            with open(self.path, "rb") as f:
                n = int.from_bytes(f.read(8), "little")
                self._header = (8 + n, json.loads(f.read(n)))
        start, header = self._header
        info = header[key]
        begin, end = info["data_offsets"]
        with open(self.path, "rb") as f:
            f.seek(start + begin)
            raw = np.frombuffer(f.read(end - begin), dtype=np.uint8)
        self._read += raw.nbytes
        return raw.view(ml_dtypes.float8_e4m3fn).astype(np.float32).reshape(info["shape"])

    def close(self) -> None:
        if self._ctx is not None:
            self._ctx.__exit__(None, None, None)
        self._f = self._ctx = None
