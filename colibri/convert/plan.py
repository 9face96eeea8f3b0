"""The plan of a Hugging Face conversion: config.json read, the family picked, the
ModelConfig derived, every canonical tensor matched to a checkpoint key (shapes and dtypes
from the safetensors headers; no tensor data is read) and given its stored format
(colibri/convert/__init__.py has the rules)."""
from __future__ import annotations

import datetime
import math
import os
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterable, Mapping

from .. import dtypes
from ..config import ConfigError, ModelConfig
from ..errors import ColibriError
from ..families import Family, canonical_tensors, get_family
from ..families.base import IGNORABLE_SUFFIXES, Source
from ..families.tensors import CanonicalTensor
from ..format import TensorSpec, mxfp4, quant as qmod
from ..version import __version__
from .checkpoint import (FP8, ITEM_BYTES, SCALE_SUFFIX, SOURCE_DTYPES, CheckpointTensor,
                         read_json, scan_checkpoint)
from .checks import ConversionWarning
from .fp8 import DEFAULT_FP8_BLOCK, fp8_block, fp8_scale

DTYPES = ("auto", "f32", "f16", "bf16")
QUANTS = ("none", "q8", "q4")
ROLES = ("experts", "shared", "attn", "head", "dense")
DEFAULT_QUANTIZE = ("experts", "shared")
_AUTO_FP8 = "bf16"
_SMALL_KINDS = ("attn_norm", "ffn_norm", "norm", "attn.q_norm", "attn.k_norm",
                "attn.bq", "attn.bk", "attn.bv", "attn.bo", "attn_norm_bias", "ffn_norm_bias",
                "norm_bias", "lm_head_bias", "attn.sinks", "moe.router_bias", "moe.b_gate",
                "moe.b_up", "moe.b_down", "attn.q_a_norm", "attn.kv_a_norm",
                "moe.correction_bias")
_ATTN_KINDS = ("attn.wq", "attn.wk", "attn.wv", "attn.wo",
               "attn.wq_a", "attn.wq_b", "attn.wkv_a", "attn.wkv_b")
_GATE_KINDS = ("moe.router", "moe.shared_gate")


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
        return math.prod(self.canon.shape) * ITEM_BYTES[self.ckpt.dtype]

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
    if c.dtype not in SOURCE_DTYPES and not (c.dtype == FP8 and s.key + SCALE_SUFFIX in ckpt):
        extra = (f" without its block scales {s.key + SCALE_SUFFIX!r}" if c.dtype == FP8
                 else " (FP8 checkpoints: F8_E4M3 with block scales)"
                 if c.dtype.startswith("F8") else "")
        raise ColibriError(f"checkpoint tensor {s.key!r} has dtype {c.dtype}, unsupported"
                           f"{extra}; supported: {', '.join(SOURCE_DTYPES)}, {FP8} with "
                           f"*{SCALE_SUFFIX}")
    return s, c, None


def _auto_dtype(matched: list[tuple[CanonicalTensor, CheckpointTensor]]) -> str:
    """The checkpoint dtype holding the most parameters (all of them, in a usual checkpoint);
    FP8 counts as bf16."""
    count: dict[str, int] = {}
    for t, c in matched:
        d = _AUTO_FP8 if c.dtype == FP8 else SOURCE_DTYPES[c.dtype]
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
            fp8_scales[t.name] = fp8_scale(s, c, ckpt, block)
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
