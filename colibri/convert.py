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
- a quantized tensor whose input dimension the group size does not divide falls back, per
  tensor, to the nearest format that holds it (smaller groups of the same format, else
  `dtype`), with one warning line listing them (llama.cpp's behaviour); the file's converter
  metadata lists them under "fallback".
Roles: experts (routed experts), shared (shared expert), attn (wq/wk/wv/wo and MLA's
projections), head (lm_head), dense (the mlp of dense layers). The embedding is never
quantized.

FP8 checkpoints (DeepSeek-V3's release: float8_e4m3fn weights, each with a float32
`<key>_scale_inv` per block of config.json's quantization_config.weight_block_size, 128 x 128)
are dequantized on reading, value * scale_inv of its block, then stored as above; "auto"
stores them as bf16 (the checkpoint's other tensors' dtype). GPT-OSS's MXFP4 experts are
stored as they ship (format mxfp4).
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

from . import __version__, dtypes, mxfp4, safe_json, validation
from . import quant as qmod
from .config import ConfigError, ModelConfig
from .convert_guard import ConversionInterrupted, signals_raise, verify_converted  # noqa: F401
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
GGUF_MAGIC = b"GGUF"

# safetensors dtype -> colibri dtype of the values (what "auto" keeps)
_SOURCE_DTYPES = {"F32": "f32", "F16": "f16", "BF16": "bf16"}
FP8 = "F8_E4M3"                   # block-scaled: dequantized on reading
_AUTO_FP8 = "bf16"
_ITEM_BYTES = {"F32": 4, "F16": 2, "BF16": 2, FP8: 1}
SCALE_SUFFIX = "_scale_inv"
DEFAULT_FP8_BLOCK = (128, 128)
_SMALL_KINDS = ("attn_norm", "ffn_norm", "norm", "attn.q_norm", "attn.k_norm",
                "attn.bq", "attn.bk", "attn.bv", "attn.bo", "attn_norm_bias", "ffn_norm_bias",
                "norm_bias", "lm_head_bias", "attn.sinks", "moe.router_bias", "moe.b_gate",
                "moe.b_up", "moe.b_down", "attn.q_a_norm", "attn.kv_a_norm",
                "moe.correction_bias")
_ATTN_KINDS = ("attn.wq", "attn.wk", "attn.wv", "attn.wo",
               "attn.wq_a", "attn.wq_b", "attn.wkv_a", "attn.wkv_b")
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
            return safe_json.loads(f.read(), what)
    except FileNotFoundError:
        raise ColibriError(f"{path}: {what} not found") from None
    except (ValueError, UnicodeDecodeError) as e:      # JSONDecodeError, too deep
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
    fp8_scale: CheckpointTensor | None = None    # the block scales of an FP8 tensor
    fp8_block: tuple[int, int] = DEFAULT_FP8_BLOCK
    scales: CheckpointTensor | None = None    # MXFP4 sources: the E8M0 scales tensor

    @property
    def name(self) -> str:
        return self.canon.name

    @property
    def source_nbytes(self) -> int:
        # the source (a whole checkpoint tensor or one expert's slice) has the canonical shape
        if self.scales is not None:                          # MXFP4 codes and scales
            return dtypes.tensor_nbytes("mxfp4", self.canon.shape, mxfp4.BLOCK)
        return math.prod(self.canon.shape) * _ITEM_BYTES[self.ckpt.dtype]

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
    fallback: dict[str, str] = field(default_factory=dict)   # tensor -> format it fell back to

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
                **({"fallback": dict(self.fallback)} if self.fallback else {}),
            },
        }


def quant_role(kind: str) -> str | None:
    """Which --quantize role covers a canonical tensor kind (None: never quantized)."""
    if kind.startswith("moe.experts."):
        return "experts"
    if kind.startswith("moe.shared."):
        return "shared"
    if kind in _ATTN_KINDS:
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
           ckpt: Mapping[str, CheckpointTensor]
           ) -> tuple[Source, CheckpointTensor, CheckpointTensor | None]:
    """The checkpoint tensor holding canonical tensor t, shape-checked against config.json
    (and the scales tensor of an MXFP4 source, else None)."""
    sources = family.sources(t, cfg)
    for s in sources:
        if s.key in ckpt:
            break
    else:
        looked = ", ".join(repr(s.key) for s in sources)
        raise ColibriError(f"checkpoint has no tensor for {t.name} (looked for {looked})")
    c = ckpt[s.key]
    want, dims = (s.shape, s.dims) if s.shape is not None else (t.shape, t.dims)
    if c.shape != want:
        raise ColibriError(
            f"checkpoint tensor {s.key!r} has shape {c.shape}, but config.json implies "
            f"{want} ({family.explain(dims, cfg)})")
    if s.scales is not None:                          # MXFP4 blocks + scales, as they ship
        if s.scales.key not in ckpt:
            raise ColibriError(f"checkpoint has the MXFP4 blocks {s.key!r} but not their "
                               f"scales {s.scales.key!r}")
        sc = ckpt[s.scales.key]
        if sc.shape != s.scales.shape:
            raise ColibriError(
                f"checkpoint tensor {sc.key!r} has shape {sc.shape}, but config.json implies "
                f"{s.scales.shape} ({family.explain(s.scales.dims, cfg)})")
        for x in (c, sc):
            if x.dtype != "U8":
                raise ColibriError(f"checkpoint tensor {x.key!r} has dtype {x.dtype}; MXFP4 "
                                   f"blocks and scales are U8")
        return s, c, sc
    if c.dtype not in _SOURCE_DTYPES and not (c.dtype == FP8 and s.key + SCALE_SUFFIX in ckpt):
        extra = (f" without its block scales {s.key + SCALE_SUFFIX!r}" if c.dtype == FP8
                 else " (FP8 checkpoints: F8_E4M3 with block scales)"
                 if c.dtype.startswith("F8") else "")
        raise ColibriError(f"checkpoint tensor {s.key!r} has dtype {c.dtype}, unsupported"
                           f"{extra}; supported: {', '.join(_SOURCE_DTYPES)}, {FP8} with "
                           f"*{SCALE_SUFFIX}")
    return s, c, None


def fp8_block(hf_config: Mapping[str, Any]) -> tuple[int, int]:
    """The (rows, columns) of an FP8 checkpoint's scale blocks (quantization_config)."""
    q = hf_config.get("quantization_config") or {}
    block = q.get("weight_block_size", DEFAULT_FP8_BLOCK) if isinstance(q, dict) else None
    if (not isinstance(block, (list, tuple)) or len(block) != 2
            or not all(isinstance(b, int) and not isinstance(b, bool) and b > 0 for b in block)):
        raise ColibriError(f"config.json: quantization_config.weight_block_size must be two "
                           f"positive integers, found {block!r}")
    return int(block[0]), int(block[1])


def _fp8_scale(s: Source, c: CheckpointTensor, ckpt: Mapping[str, CheckpointTensor],
               block: tuple[int, int]) -> CheckpointTensor:
    """The scale tensor of FP8 checkpoint tensor c, shape-checked: (ceil(R/br), ceil(C/bc))."""
    scale = ckpt[s.key + SCALE_SUFFIX]
    if s.index or len(c.shape) != 2:
        raise ColibriError(f"checkpoint tensor {s.key!r}: FP8 is supported for whole 2-D "
                           f"matrices only, found shape {c.shape}")
    want = tuple(-(-n // b) for n, b in zip(c.shape, block))
    if scale.shape != want or scale.dtype not in _SOURCE_DTYPES:
        raise ColibriError(f"checkpoint tensor {scale.key!r} has shape {scale.shape} and "
                           f"dtype {scale.dtype}; {s.key!r} {c.shape} in blocks of {block} "
                           f"needs {want} floats")
    return scale


def _auto_dtype(matched: list[tuple[CanonicalTensor, CheckpointTensor]]) -> str:
    """The checkpoint dtype holding the most parameters (all of them, in a usual checkpoint);
    FP8 counts as bf16."""
    count: dict[str, int] = {}
    for t, c in matched:
        d = _AUTO_FP8 if c.dtype == FP8 else _SOURCE_DTYPES[c.dtype]
        count[d] = count.get(d, 0) + math.prod(t.shape)
    return max(count, key=count.get)


def _pick_group_size(tensors: list[PlannedTensor], group_size: int | None) -> int:
    """The group size of the quantized tensors: an explicit one (a positive multiple of 32),
    or DEFAULT_GROUP_SIZE lowered (by multiples of 32) until it divides every input dimension
    that is a multiple of 32 (the others fall back, see _fall_back)."""
    quantized = [t for t in tensors if t.role is not None]
    if not quantized:
        return 0
    block = dtypes.BLOCK
    if group_size is not None:
        if isinstance(group_size, bool) or not isinstance(group_size, int) \
                or group_size <= 0 or group_size % block:
            raise ColibriError(f"--group-size: group_size {group_size!r} is not a positive "
                               f"multiple of {block}")
        return group_size
    g = qmod.DEFAULT_GROUP_SIZE
    while g > block and any(t.canon.shape[-1] % g for t in quantized
                            if t.canon.shape[-1] % block == 0):
        g -= block
    return g


def _fall_back(tensors: list[PlannedTensor], quant: str, group_size: int, base: str
               ) -> dict[str, str]:
    """Give each quantized tensor the group size, or, when its input dimension C cannot take
    it, the nearest format that holds it (llama.cpp's per-tensor fallback): the same format
    with the largest group size (a multiple of 32) dividing C when C is a multiple of 32,
    else `base`, the format of the unquantized weights. Returns {name: format stored} of the
    tensors that fell back, after one ConversionWarning line listing them."""
    fallen: dict[str, str] = {}
    for t in tensors:
        if t.role is None:
            continue
        cols = t.canon.shape[-1]
        if cols % group_size == 0:
            t.group_size = group_size
        elif cols % dtypes.BLOCK == 0:
            t.group_size = max(g for g in range(dtypes.BLOCK, group_size, dtypes.BLOCK)
                               if cols % g == 0)
            fallen[t.name] = f"{t.dtype} group {t.group_size}"
        else:
            t.dtype, t.group_size = base, 0
            fallen[t.name] = base
    if fallen:
        shown: dict[str, str] = {}
        for t in tensors:                     # one entry for all experts of a layer's matrix
            if t.name in fallen:
                key = t.name if t.canon.expert is None else t.name.replace(
                    f".experts.{t.canon.expert}.", ".experts.*.")
                shown.setdefault(key, f"{key} ({t.canon.shape[-1]} columns) -> {fallen[t.name]}")
        warnings.warn(
            f"{len(fallen)} tensors cannot take {quant} with group size {group_size} (their "
            f"input dimension is not a multiple of it) and are stored in the nearest format "
            f"that holds them: {'; '.join(shown.values())}", ConversionWarning, stacklevel=3)
    return fallen


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
        raise ColibriError(f"{src}: not a folder (expected a Hugging Face model folder or a "
                           f"GGUF file)")
    if not (src / "config.json").is_file():
        raise ColibriError(f"{src}: no config.json (expected a Hugging Face model folder)")
    hf_config = read_json(src / "config.json", "config.json")
    if not isinstance(hf_config, dict):
        raise ColibriError(f"{src / 'config.json'}: expected a JSON object")
    family = get_family(hf_config.get("model_type"))
    try:
        cfg = family.model_config(hf_config)
    except ConfigError as e:
        raise ConfigError(f"{src / 'config.json'}: {e}") from None
    except (KeyError, TypeError, ValueError, AttributeError) as e:   # a field of another type
        raise ColibriError(f"{src / 'config.json'}: cannot be read as a {family.model_type} "
                           f"config ({type(e).__name__}: {e})") from None
    ckpt = scan_checkpoint(src)

    matched, used, fp8_scales = [], set(), {}
    block = None
    for t in canonical_tensors(cfg):
        s, c, sc = _match(t, family, cfg, ckpt)
        matched.append((t, s, c, sc))
        used.add(s.key)
        if c.dtype == FP8:
            block = block or fp8_block(hf_config)
            fp8_scales[t.name] = _fp8_scale(s, c, ckpt, block)
            used.add(fp8_scales[t.name].key)
        if sc is not None:
            used.add(sc.key)
    ignorable = [k for k in ckpt if k not in used and (
        k.endswith(IGNORABLE_SUFFIXES) or (k == "lm_head.weight" and cfg.tie_word_embeddings)
        or (family.ignores is not None and family.ignores(k, cfg)))]
    extra = sorted(set(ckpt) - used - set(ignorable))
    if extra:
        more = f" and {len(extra) - 5} more" if len(extra) > 5 else ""
        raise ColibriError(f"{src}: {len(extra)} checkpoint tensors are not part of a "
                           f"{family.model_type} model as config.json describes it: "
                           f"{', '.join(extra[:5])}{more}")

    base = (_auto_dtype([(t, c) for t, _, c, sc in matched if sc is None])
            if dtype == "auto" else dtype)
    gate = base if router_dtype == "auto" else router_dtype
    tensors = []
    for t, s, c, sc in matched:
        role = quant_role(t.kind)
        if sc is not None:                            # MXFP4 as it ships: never requantized
            tensors.append(PlannedTensor(t, s, c, "mxfp4", mxfp4.BLOCK, scales=sc))
        elif role is not None and role in roles:
            tensors.append(PlannedTensor(t, s, c, quant, 0, role))
        elif t.kind in _SMALL_KINDS:
            tensors.append(PlannedTensor(t, s, c, "f32"))
        elif t.kind in _GATE_KINDS:
            tensors.append(PlannedTensor(t, s, c, gate))
        else:
            tensors.append(PlannedTensor(t, s, c, base))
    for t in tensors:
        t.fp8_scale = fp8_scales.get(t.name)
        t.fp8_block = block or DEFAULT_FP8_BLOCK
    g = _pick_group_size(tensors, group_size)
    fallen = _fall_back(tensors, quant, g, base)
    quantized = sorted({t.role for t in tensors if t.role is not None}, key=ROLES.index)
    return Plan(src, family, hf_config, cfg, tensors, base, quant, g, quantized, gate,
                ignored=ignorable, fallback=fallen)


# --- streaming --------------------------------------------------------------------------------

class _ShardReader:
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
            self._ctx = _safe_open(self.path)
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


def dequantize_fp8(w: np.ndarray, scale_inv: np.ndarray, block: tuple[int, int]) -> np.ndarray:
    """Block-scaled FP8 values float32 (R, C) times their block's scale_inv (ceil(R/br),
    ceil(C/bc)) -> float32 (R, C), as transformers' FP8 dequantization."""
    s = np.asarray(scale_inv, dtype=np.float32)
    full = np.repeat(np.repeat(s, block[0], axis=0), block[1], axis=1)[:w.shape[0], :w.shape[1]]
    return w * full


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


def _mxfp4_rows(src: Path, t: PlannedTensor, reader: _ShardReader) -> np.ndarray:
    """The stored bytes of an MXFP4 tensor: its rows' code bytes (the checkpoint's blocks,
    unchanged) then their E8M0 scales, uint8 1-D; a scale of 255 (NaN) is an error."""
    s = t.source
    blocks = reader.get(t.ckpt.key, s.index)
    if t.scales.shard == t.ckpt.shard:
        scales = reader.get(t.scales.key, s.scales.index)
    else:
        with _safe_open(src / t.scales.shard) as f:
            sl = f.get_slice(t.scales.key)
            scales = sl[s.scales.index] if s.scales.index else f.get_tensor(t.scales.key)
    if s.post:                                   # gate / up interleaved rows
        blocks, scales = blocks[s.post], scales[s.scales.post]
    rows, cols = t.canon.shape
    nan = np.flatnonzero(scales.reshape(-1) == 255)
    if nan.size:
        raise ColibriError(f"tensor {t.name} (checkpoint {t.scales.key!r}) has {nan.size} "
                           f"E8M0 scales of 255 (NaN), first at flat index {nan[0]}")
    codes = np.ascontiguousarray(blocks).reshape(rows, cols // 2)
    return mxfp4.rows(codes, np.asarray(scales).reshape(rows, cols // 32)).reshape(-1)


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
    """Convert the Hugging Face model folder (or llama.cpp GGUF file) `src` into the .colibri
    file `dst`; return its path.

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

    A GGUF file (gguf_import.convert_gguf): its Q8_0 / Q4_0 / MXFP4 / float tensors are kept
    as they are; `quant` (q8 / q4), else `dtype` (f32 / f16 / bf16), else the nearest format
    ("auto") holds the tensors of other GGUF types; group_size, quantize and router_dtype do
    not apply.
    """

    src, dst = Path(src), Path(dst)
    if is_gguf(src):
        from .extras import require_extra
        require_extra("gguf", "gguf", f"converting {src.name} (GGUF)")   # the optional package
        from .gguf_import import convert_gguf
        return convert_gguf(src, dst, quant=quant if quant != "none" else dtype, meta=meta,
                            force=force, checksums=checksums, progress=progress)
    if src.suffix.lower() == ".gguf" and src.is_file():
        raise ColibriError(f"{src}: not a GGUF file (it does not start with the GGUF magic "
                           f"{GGUF_MAGIC!r})")
    user = _check_meta(meta)
    p = plan(src, dtype=dtype, quant=quant, group_size=group_size, quantize=quantize,
             router_dtype=router_dtype)
    dst = _resolve_dst(p, dst, force)
    p.tokenizer = read_tokenizer(src)
    if p.tokenizer is not None:              # refused before any byte is written
        problems = validation.tokenizer_problems(p.tokenizer["files"], p.config.vocab_size)
        if problems:
            raise ColibriError(f"{src}: {'; '.join(problems[:3])}")
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
        with signals_raise(), \
                ColibriWriter(dst, p.specs(), metadata, n_layers=p.config.num_hidden_layers,
                              n_experts=p.config.num_experts, checksums=checksums,
                              overwrite=force) as writer:
            for shard, todo in by_shard.items():
                reader = _ShardReader(src / shard, budget=max(largest, 64 << 20))
                try:
                    for t in todo:
                        if t.scales is not None:
                            writer.write(t.name, _mxfp4_rows(src, t, reader), raw=True)
                            bar.update(t.source_nbytes)
                            continue
                        a = _read(reader, src, t)
                        if t.source.post:            # GPT-OSS: gate / up interleaved
                            a = a[t.source.post]
                        if t.source.transpose:       # DBRX's w2: the block is down^T
                            a = np.ascontiguousarray(a.T)
                        if p.family.transform is not None:
                            a = p.family.transform(t.canon, p.config, p.hf_config, a)
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
            writer.finish(verify=lambda tmp, header: verify_converted(tmp, dst, header))
    except (FileExistsError, IsADirectoryError) as e:
        raise ColibriError(str(e)) from None
    finally:
        bar.close()
    return dst


def _read(reader: _ShardReader, src: Path, t: PlannedTensor) -> np.ndarray:
    """The values of planned tensor t as the checkpoint holds them (FP8: dequantized)."""
    if t.fp8_scale is None:
        return reader.get(t.ckpt.key, t.source.index)
    if t.fp8_scale.shard == t.ckpt.shard:
        scale = reader.get(t.fp8_scale.key, ()).astype(np.float32)
    else:
        with _safe_open(src / t.fp8_scale.shard) as f:
            scale = f.get_tensor(t.fp8_scale.key).astype(np.float32)
    _check_finite(scale, t.name, t.fp8_scale.key)
    return dequantize_fp8(reader.get_fp8(t.ckpt.key), scale, t.fp8_block)


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
