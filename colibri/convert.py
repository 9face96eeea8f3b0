"""Hugging Face checkpoint folder -> one .colibri file, streamed tensor by tensor.

    convert(src, dst, dtype="auto", quant="none", quantize=("experts", "shared"))

Two stages:
1. plan(): read config.json, pick the family, derive the ModelConfig, list the canonical tensors
   with the shapes config.json implies, and match every one to a checkpoint key (shapes and
   dtypes come from the safetensors headers; no tensor data is read). Every mismatch is an
   error that names the checkpoint key, the config fields and expected vs found; a checkpoint
   key nobody claims is an error too.
2. convert(): a ColibriWriter is planned from the TensorSpecs; then each tensor is read (one
   at a time, shard by shard), checked for non-finite values, encoded and written, and
   dropped. Peak memory is a small multiple of the largest tensor. The writer writes a temp
   file beside DST and renames it at the end, so an interrupted conversion leaves no DST,
   and converting onto a file a server maps is safe: DST is never opened for writing, the
   server keeps the old inode's bytes until it reloads (format/writer.py), and the temp
   files of killed conversions of the same DST are removed by the next one.

Target dtype of each tensor:
- norms, biases: f32. Routers and the shared-expert gate: `router_dtype` (f32 by default;
  routing decisions are sensitive to error).
- everything else: `quant` (q8/q4) when its role is in `quantize`, else `dtype`;
  dtype "auto" keeps the checkpoint's dtype (bf16 stays bf16, bit-exact).
Roles: experts (routed experts), shared (shared expert), attn (wq/wk/wv/wo), head (lm_head),
dense (the mlp of dense layers). The embedding is never quantized.
"""
from __future__ import annotations

import datetime
import json
import math
import os
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable, Mapping

import numpy as np

from . import __version__, dtypes
from . import quant as qmod
from .config import ModelConfig
from .errors import ColibriError
from .families import Family, canonical_tensors, get_family
from .families.base import IGNORABLE_SUFFIXES, Source
from .families.tensors import CanonicalTensor
from .format import ColibriWriter, TensorSpec

DTYPES = ("auto", "f32", "f16", "bf16")
QUANTS = ("none", "q8", "q4")
ROLES = ("experts", "shared", "attn", "head", "dense")
DEFAULT_QUANTIZE = ("experts", "shared")
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
                   "generation_config.json", "chat_template.jinja")
INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"

# safetensors dtype -> colibri dtype of the values (what "auto" keeps)
_SOURCE_DTYPES = {"F32": "f32", "F16": "f16", "BF16": "bf16"}
_SMALL_KINDS = ("attn_norm", "ffn_norm", "norm", "attn.q_norm", "attn.k_norm",
                "attn.bq", "attn.bk", "attn.bv")
_GATE_KINDS = ("moe.router", "moe.shared_gate")


class ConversionWarning(UserWarning):
    """Something the conversion survived but the user should know (e.g. no tokenizer)."""


# --- reading the checkpoint -------------------------------------------------------------------

@dataclass(frozen=True)
class CheckpointTensor:
    key: str
    shard: str                      # file name inside SRC
    shape: tuple[int, ...]
    dtype: str                      # safetensors dtype string: "F32", "BF16", ...


def read_json(path: Path, what: str) -> Any:
    try:
        with open(path, encoding="utf-8") as f:
            return json.load(f)
    except FileNotFoundError:
        raise ColibriError(f"{path}: {what} not found") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ColibriError(f"{path}: {what} is not valid JSON ({e})") from None


def _safe_open(path: Path):
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
        with _safe_open(src / shard) as f:
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


# --- the plan ---------------------------------------------------------------------------------

@dataclass
class PlannedTensor:
    """One output tensor: what to write (name, dtype, shape) and where its values come from."""
    canon: CanonicalTensor
    source: Source
    ckpt: CheckpointTensor
    dtype: str                      # colibri dtype written
    group_size: int = 0
    role: str | None = None         # quantization role, None for tensors no role covers

    @property
    def name(self) -> str:
        return self.canon.name

    @property
    def source_nbytes(self) -> int:
        # the source (a whole checkpoint tensor or one expert's slice) has the canonical shape
        return math.prod(self.canon.shape) * (4 if self.ckpt.dtype == "F32" else 2)

    def spec(self):
        c = self.canon
        role = "router" if c.kind == "moe.router" else "expert" if c.expert is not None \
            else "dense"
        return TensorSpec(c.name, self.dtype, c.shape, self.group_size, role,
                          c.layer if role != "dense" else None, c.expert, c.proj)


@dataclass
class Plan:
    src: Path
    family: Family
    hf_config: dict                 # config.json as read
    config: ModelConfig             # stored as the file's "arch" metadata
    tensors: list[PlannedTensor]
    dtype: str                      # resolved default dtype of weight matrices
    quant: str
    group_size: int
    quantized: list[str]            # roles actually quantized
    router_dtype: str
    tokenizer: dict | None = None
    ignored: list[str] = field(default_factory=list)

    def specs(self) -> list:
        return [t.spec() for t in self.tensors]

    def metadata(self, user: Mapping[str, str] | None = None) -> dict:
        return {
            "config": self.hf_config,
            "arch": self.config.to_metadata(),
            "tokenizer": self.tokenizer,
            "user": dict(user or {}),
            "converter": {
                "colibri_version": __version__,
                "source": self.src.name,
                "date": datetime.datetime.now(datetime.timezone.utc).isoformat(
                    timespec="seconds"),
                "dtype": self.dtype,
                "quant": self.quant,
                "group_size": self.group_size,
                "quantized": list(self.quantized),
                "router_dtype": self.router_dtype,
            },
        }


def quant_role(kind: str) -> str | None:
    """Which --quantize role covers a canonical tensor kind (None: never quantized)."""
    if kind.startswith("moe.experts."):
        return "experts"
    if kind.startswith("moe.shared."):
        return "shared"
    if kind in ("attn.wq", "attn.wk", "attn.wv", "attn.wo"):
        return "attn"
    if kind == "lm_head":
        return "head"
    if kind.startswith("mlp."):
        return "dense"
    return None


def _parse_roles(quantize: Iterable[str] | str) -> tuple[str, ...]:
    if isinstance(quantize, str):
        quantize = [r for r in quantize.split(",") if r.strip()]
    roles = tuple(r.strip() for r in quantize)
    bad = [r for r in roles if r not in ROLES]
    if bad:
        raise ColibriError(f"unknown quantize role {bad[0]!r}; roles: {', '.join(ROLES)}")
    return roles


def _match(t: CanonicalTensor, family: Family, cfg: ModelConfig,
           ckpt: Mapping[str, CheckpointTensor]) -> tuple[Source, CheckpointTensor]:
    """The checkpoint tensor holding canonical tensor t, shape-checked against config.json."""
    sources = family.sources(t, cfg)
    for s in sources:
        if s.key in ckpt:
            break
    else:
        looked = ", ".join(repr(s.key) for s in sources)
        raise ColibriError(f"checkpoint has no tensor for {t.name} (looked for {looked})")
    c = ckpt[s.key]
    want, dims = (s.shape, s.dims) if s.index else (t.shape, t.dims)
    if c.shape != want:
        raise ColibriError(
            f"checkpoint tensor {s.key!r} has shape {c.shape}, but config.json implies "
            f"{want} ({family.explain(dims, cfg)})")
    if c.dtype not in _SOURCE_DTYPES:
        extra = " (FP8 checkpoints are not supported)" if c.dtype.startswith("F8") else ""
        raise ColibriError(f"checkpoint tensor {s.key!r} has dtype {c.dtype}, unsupported"
                           f"{extra}; supported: {', '.join(_SOURCE_DTYPES)}")
    return s, c


def _auto_dtype(matched: list[tuple[CanonicalTensor, CheckpointTensor]]) -> str:
    """The checkpoint dtype holding the most parameters (all of them, in a usual checkpoint)."""
    count: dict[str, int] = {}
    for t, c in matched:
        count[c.dtype] = count.get(c.dtype, 0) + math.prod(t.shape)
    return _SOURCE_DTYPES[max(count, key=count.get)]


def _pick_group_size(tensors: list[PlannedTensor], group_size: int | None) -> int:
    """An explicit group size must suit every quantized tensor; the default is
    DEFAULT_GROUP_SIZE, lowered (by multiples of 32) until it divides every input dimension."""
    quantized = [t for t in tensors if t.role is not None]
    if not quantized:
        return 0
    block = 32
    for t in quantized:
        if t.canon.shape[-1] % block:
            raise ColibriError(
                f"tensor {t.name}: input dimension {t.canon.shape[-1]} is not a multiple of "
                f"{block}, so it cannot be quantized; leave role {t.role!r} out of --quantize")
    if group_size is not None:
        for t in quantized:
            try:
                dtypes.check_group_size(t.canon.shape[-1], group_size, t.name)
            except ValueError as e:
                raise ColibriError(f"--group-size: {e}") from None
        return group_size
    g = qmod.DEFAULT_GROUP_SIZE
    while g > block and any(t.canon.shape[-1] % g for t in quantized):
        g -= block
    return g


def plan(src: str | os.PathLike, *, dtype: str = "auto", quant: str = "none",
         group_size: int | None = None, quantize: Iterable[str] | str = DEFAULT_QUANTIZE,
         router_dtype: str = "f32") -> Plan:
    """Everything convert() will do, checked against the checkpoint; reads headers only."""
    src = Path(src)
    if dtype not in DTYPES:
        raise ColibriError(f"unknown dtype {dtype!r}; choose from {', '.join(DTYPES)}")
    if quant not in QUANTS:
        raise ColibriError(f"unknown quant {quant!r}; choose from {', '.join(QUANTS)}")
    if router_dtype not in DTYPES:
        raise ColibriError(f"unknown router dtype {router_dtype!r}; choose from "
                           f"{', '.join(DTYPES)}")
    roles = _parse_roles(quantize) if quant != "none" else ()
    if not src.is_dir():
        raise ColibriError(f"{src}: not a folder (expected a Hugging Face model folder)")
    if not (src / "config.json").is_file():
        raise ColibriError(f"{src}: no config.json (expected a Hugging Face model folder)")
    hf_config = read_json(src / "config.json", "config.json")
    if not isinstance(hf_config, dict):
        raise ColibriError(f"{src / 'config.json'}: expected a JSON object")
    family = get_family(hf_config.get("model_type"))
    cfg = family.model_config(hf_config)
    ckpt = scan_checkpoint(src)

    matched, used = [], set()
    for t in canonical_tensors(cfg):
        s, c = _match(t, family, cfg, ckpt)
        matched.append((t, s, c))
        used.add(s.key)
    ignorable = [k for k in ckpt if k not in used and (
        k.endswith(IGNORABLE_SUFFIXES) or (k == "lm_head.weight" and cfg.tie_word_embeddings))]
    extra = sorted(set(ckpt) - used - set(ignorable))
    if extra:
        more = f" and {len(extra) - 5} more" if len(extra) > 5 else ""
        raise ColibriError(f"{src}: {len(extra)} checkpoint tensors are not part of a "
                           f"{family.model_type} model as config.json describes it: "
                           f"{', '.join(extra[:5])}{more}")

    base = _auto_dtype([(t, c) for t, _, c in matched]) if dtype == "auto" else dtype
    gate = base if router_dtype == "auto" else router_dtype
    tensors = []
    for t, s, c in matched:
        role = quant_role(t.kind)
        if role is not None and role in roles:
            tensors.append(PlannedTensor(t, s, c, quant, 0, role))
        elif t.kind in _SMALL_KINDS:
            tensors.append(PlannedTensor(t, s, c, "f32"))
        elif t.kind in _GATE_KINDS:
            tensors.append(PlannedTensor(t, s, c, gate))
        else:
            tensors.append(PlannedTensor(t, s, c, base))
    g = _pick_group_size(tensors, group_size)
    for t in tensors:
        if t.role is not None:
            t.group_size = g
    quantized = sorted({t.role for t in tensors if t.role is not None}, key=ROLES.index)
    return Plan(src, family, hf_config, cfg, tensors, base, quant, g, quantized, gate,
                ignored=ignorable)


# --- streaming --------------------------------------------------------------------------------

class _ShardReader:
    """safe_open over one shard, reopened after `budget` bytes so the pages of the shard's
    mapping that reads touched (file-backed RSS) are released: resident memory stays bounded
    by the budget, not by the shard size."""

    def __init__(self, path: Path, budget: int):
        self.path, self.budget = path, budget
        self._f, self._ctx, self._read = None, None, 0

    def get(self, key: str, index: tuple) -> np.ndarray:
        if self._f is None or self._read >= self.budget:
            self.close()
            self._ctx = _safe_open(self.path)
            self._f = self._ctx.__enter__()
            self._read = 0
        a = self._f.get_slice(key)[index] if index else self._f.get_tensor(key)
        self._read += a.nbytes
        return a

    def close(self) -> None:
        if self._ctx is not None:
            self._ctx.__exit__(None, None, None)
        self._f = self._ctx = None


def _check_finite(a: np.ndarray, name: str, key: str, chunk: int = 1 << 22) -> None:
    """Raise naming the tensor if `a` (f32/f16/bf16 values) holds an inf or NaN.

    Looks at the exponent bits (all ones = inf/NaN), chunk by chunk: bounded temporaries, and
    the same test for every float format, bf16 included.
    """
    if a.itemsize == 4:
        uint, exponent = np.uint32, 0x7F800000
    else:
        uint, exponent = np.uint16, 0x7C00 if a.dtype == np.float16 else 0x7F80
    flat = a.reshape(-1).view(uint)
    count, first = 0, -1
    for start in range(0, flat.size, chunk):
        bad = (flat[start: start + chunk] & exponent) == exponent
        n = int(np.count_nonzero(bad))
        if n and first < 0:
            first = start + int(np.argmax(bad))
        count += n
    if count:
        value = float(a.reshape(-1)[first].astype(np.float32))
        raise ColibriError(f"tensor {name} (checkpoint {key!r}) has {count} non-finite "
                           f"values (first at flat index {first}: {value})")


def _encode(t: PlannedTensor, a: np.ndarray) -> tuple[np.ndarray, bool]:
    """(array for ColibriWriter.write, raw?). bf16 -> bf16 goes through as raw bits."""
    if t.dtype == "bf16" and a.dtype.name == "bfloat16":
        return np.ascontiguousarray(a).reshape(-1).view(np.uint16).view(np.uint8), True
    return a, False


def _resolve_dst(p: Plan, dst: Path, force: bool) -> Path:
    src = p.src
    if dst.is_dir():
        dst = dst / f"{src.resolve().name}.colibri"
    real, src_real = dst.resolve(), src.resolve()
    inputs = {"config.json", INDEX_FILE, *TOKENIZER_FILES, *(t.ckpt.shard for t in p.tensors)}
    if real == src_real or (real.parent == src_real and real.name in inputs):
        raise ColibriError(f"{dst}: refusing to write over {real.name}, a file of the source "
                           f"checkpoint {src}")
    if not real.parent.is_dir():
        raise ColibriError(f"{dst}: folder {dst.parent} does not exist")
    if dst.exists() and not force:
        raise ColibriError(f"{dst}: already exists (use --force to overwrite)")
    return dst


def convert(src: str | os.PathLike, dst: str | os.PathLike, *, dtype: str = "auto",
            quant: str = "none", group_size: int | None = None,
            quantize: Iterable[str] | str = DEFAULT_QUANTIZE, router_dtype: str = "f32",
            meta: Mapping[str, str] | None = None, force: bool = False,
            checksums: bool = True, progress: bool = True) -> Path:
    """Convert the Hugging Face model folder `src` into the .colibri file `dst`; return its path.

    dtype: "auto" (the checkpoint's dtype) | "f32" | "f16" | "bf16" for unquantized weights.
    quant: "none" | "q8" | "q4" for the tensors whose role is in `quantize` (roles: experts,
        shared, attn, head, dense; a list or a comma-separated string).
    group_size: scale group size of q8/q4 (default quant.DEFAULT_GROUP_SIZE, lowered to
        divide every quantized input dimension).
    router_dtype: dtype of routers and the shared-expert gate ("f32" default; "auto" follows
        dtype).
    meta: free-form user metadata, string -> string.
    force: overwrite an existing dst. dst may be a folder: <src name>.colibri inside it.
    Raises ColibriError (with names and numbers) on anything wrong with src, dst or the options.
    """

    src, dst = Path(src), Path(dst)
    user = _check_meta(meta)
    p = plan(src, dtype=dtype, quant=quant, group_size=group_size, quantize=quantize,
             router_dtype=router_dtype)
    dst = _resolve_dst(p, dst, force)
    p.tokenizer = read_tokenizer(src)
    metadata = p.metadata(user)

    by_shard: dict[str, list[PlannedTensor]] = {}
    for t in p.tensors:
        by_shard.setdefault(t.ckpt.shard, []).append(t)
    largest = max(t.source_nbytes for t in p.tensors)
    total = sum(t.source_nbytes for t in p.tensors)

    from tqdm.auto import tqdm
    bar = tqdm(total=total, unit="B", unit_scale=True, unit_divisor=1024,
               desc=f"convert {src.name}", disable=not progress, leave=False)
    try:
        with ColibriWriter(dst, p.specs(), metadata, n_layers=p.config.num_hidden_layers,
                           n_experts=p.config.num_experts, checksums=checksums,
                           overwrite=force) as writer:
            for shard, todo in by_shard.items():
                reader = _ShardReader(src / shard, budget=max(largest, 64 << 20))
                try:
                    for t in todo:
                        a = reader.get(t.ckpt.key, t.source.index)
                        _check_finite(a, t.name, t.ckpt.key)
                        data, raw = _encode(t, a)
                        try:
                            writer.write(t.name, data, raw=raw)
                        except ValueError as e:
                            raise ColibriError(f"tensor {t.name} (checkpoint "
                                               f"{t.ckpt.key!r}): {e}") from None
                        del a, data
                        bar.update(t.source_nbytes)
                finally:
                    reader.close()
    except (FileExistsError, IsADirectoryError) as e:
        raise ColibriError(str(e)) from None
    finally:
        bar.close()
    return dst


def _check_meta(meta: Mapping[str, str] | None) -> dict[str, str]:
    out = {}
    for k, v in (meta or {}).items():
        if not isinstance(k, str) or not k or not isinstance(v, str):
            raise ColibriError(f"metadata must map non-empty strings to strings, found "
                               f"{k!r}: {v!r}")
        out[k] = v
    return out


def parse_meta(items: Iterable[str]) -> dict[str, str]:
    """["licence=apache-2.0", "note=a=b"] -> {"licence": "apache-2.0", "note": "a=b"}."""
    out = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or not key.strip():
            raise ColibriError(f"--meta {item!r}: expected key=value")
        out[key.strip()] = value
    return out
