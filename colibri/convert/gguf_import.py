"""A llama.cpp GGUF file -> one .colibri file, read in place with the `gguf` package.

    convert_gguf("model.gguf", "out.colibri", quant="auto")      # colibri.convert does this too

1. The metadata becomes the config.json of the same model (gguf_config.hf_config) and the
   family turns that into the ModelConfig, as for a Hugging Face folder; the canonical tensors
   follow from it (families/tensors.py). Each canonical tensor is found under its GGUF name
   (`blk.N.attn_q.weight`, one expert of `blk.N.ffn_gate_exps.weight`, ...: TENSOR_KINDS);
   a GGUF tensor nobody claims is an error.
2. Row orders: llama.cpp permutes the q / k rows of `llama` models for its interleaved RoPE
   (convert_hf_to_gguf.py, LlamaModel.permute); they are put back in Hugging Face order. The
   family's own transform (DeepSeek's de-interleaved RoPE rows) then applies as for a
   checkpoint. Both only move whole rows, so they move quantized rows unchanged.
3. Weights (docs/format.md §14): F32 / F16 / BF16 stay as they are; Q8_0, Q4_0 and
   MXFP4 blocks are re-laid into colibri's q8 / q4 (group 32, f16 scales) and mxfp4 rows bit
   for bit; every other type (K-quants, IQ*, Q4_1, Q5_*) is dequantized by gguf.quants and
   requantized to `quant` ("auto": q8 from 5 bits per weight on, q4 below), and one warning
   line per tensor class reports the error. Norms, biases and routers are stored f32.
   DeepSeek's `attn_k_b` / `attn_v_b` (kv_b split for llama.cpp's absorbed MLA, k_b
   transposed) are joined back into kv_b in f32, which holds their values exactly.
4. Written with ColibriWriter: a temporary file beside DST, renamed at the end.
"""
from __future__ import annotations

import datetime
import os
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Mapping

import gguf
import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, GGUFReader, quants

from .. import dtypes
from ..config import ConfigError, ModelConfig
from ..errors import ColibriError
from ..families import canonical_tensors, get_family
from ..families.tensors import CanonicalTensor
from ..format import ColibriWriter, TensorSpec, quant as qmod
from ..version import __version__
from .checks import ConversionWarning, check_finite, check_meta
from .gguf_config import GGUFMeta, hf_config, tokenizer_files

QUANTS = ("auto", "q8", "q4", "f32", "f16", "bf16")

# canonical kind -> (GGUF tensor base name, suffix); gguf.TENSOR_NAMES spells the bases
TENSOR_KINDS: dict[str, tuple[str, str]] = {
    "tok_embeddings": ("TOKEN_EMBD", "weight"), "norm": ("OUTPUT_NORM", "weight"),
    "lm_head": ("OUTPUT", "weight"),
    "attn_norm": ("ATTN_NORM", "weight"), "ffn_norm": ("FFN_NORM", "weight"),
    "attn.wq": ("ATTN_Q", "weight"), "attn.wk": ("ATTN_K", "weight"),
    "attn.wv": ("ATTN_V", "weight"), "attn.wo": ("ATTN_OUT", "weight"),
    "attn.bq": ("ATTN_Q", "bias"), "attn.bk": ("ATTN_K", "bias"), "attn.bv": ("ATTN_V", "bias"),
    "attn.q_norm": ("ATTN_Q_NORM", "weight"), "attn.k_norm": ("ATTN_K_NORM", "weight"),
    "attn.wq_a": ("ATTN_Q_A", "weight"), "attn.q_a_norm": ("ATTN_Q_A_NORM", "weight"),
    "attn.wq_b": ("ATTN_Q_B", "weight"), "attn.wkv_a": ("ATTN_KV_A_MQA", "weight"),
    "attn.kv_a_norm": ("ATTN_KV_A_NORM", "weight"), "attn.wkv_b": ("ATTN_KV_B", "weight"),
    "moe.router": ("FFN_GATE_INP", "weight"), "moe.correction_bias": ("FFN_EXP_PROBS_B", "bias"),
    "moe.experts.w_gate": ("FFN_GATE_EXP", "weight"), "moe.experts.w_up": ("FFN_UP_EXP", "weight"),
    "moe.experts.w_down": ("FFN_DOWN_EXP", "weight"),
    "moe.shared.w_gate": ("FFN_GATE_SHEXP", "weight"),
    "moe.shared.w_up": ("FFN_UP_SHEXP", "weight"),
    "moe.shared.w_down": ("FFN_DOWN_SHEXP", "weight"),
    "moe.shared_gate": ("FFN_GATE_INP_SHEXP", "weight"),
    "mlp.w_gate": ("FFN_GATE", "weight"), "mlp.w_up": ("FFN_UP", "weight"),
    "mlp.w_down": ("FFN_DOWN", "weight"),
}
_F32_KINDS = ("attn_norm", "ffn_norm", "norm", "attn.q_norm", "attn.k_norm", "attn.bq",
              "attn.bk", "attn.bv", "attn.q_a_norm", "attn.kv_a_norm", "moe.correction_bias",
              "moe.router", "moe.shared_gate")
# GGUF types colibri holds bit for bit, and the colibri format of each
_EXACT = {"F32": "f32", "F16": "f16", "BF16": "bf16", "Q8_0": "q8", "Q4_0": "q4",
          "MXFP4": "mxfp4"}


def open_gguf(path: str | os.PathLike) -> GGUFReader:
    """gguf.GGUFReader over `path` (memory-mapped), every tensor's bytes checked to lie in the
    file; ColibriError naming the file when it is truncated or corrupt."""
    try:
        reader = GGUFReader(os.fspath(path), "r")
    except Exception as e:                       # noqa: BLE001 - the reader raises anything
        raise ColibriError(f"{path}: not a readable GGUF file ({type(e).__name__}: {e})"
                           ) from None
    for t in reader.tensors:
        if t.data.nbytes != t.n_bytes:
            raise ColibriError(f"{path}: GGUF tensor {t.name!r} needs {t.n_bytes} bytes, the "
                               f"file holds {t.data.nbytes} (truncated?)")
    return reader


# --- the plan -----------------------------------------------------------------------------

@dataclass
class GGUFTensor:
    """One output tensor: where its values are in the GGUF and how they are stored."""
    canon: CanonicalTensor
    sources: tuple[Any, ...]         # gguf ReaderTensors (two for a split kv_b)
    dtype: str                       # colibri format written
    exact: bool                      # stored bit for bit (else dequantized first)

    @property
    def name(self) -> str:
        return self.canon.name

    @property
    def gguf_type(self) -> str:
        return "+".join(s.tensor_type.name for s in self.sources)

    def spec(self) -> TensorSpec:
        c = self.canon
        g = dtypes.BLOCK if self.dtype in dtypes.QUANTIZED else 0
        role = ("router" if c.kind == "moe.router" else
                "expert" if c.expert is not None else "dense")
        return TensorSpec(c.name, self.dtype, c.shape, g, role,
                          c.layer if role != "dense" else None, c.expert, c.proj)


@dataclass
class GGUFPlan:
    src: Path
    arch: str
    hf_config: dict
    config: ModelConfig
    family: Any
    tensors: list[GGUFTensor]
    quant: str
    errors: dict[str, tuple[float, float, int]] = field(default_factory=dict)


def gguf_tensor_name(kind: str, layer: int | None) -> str:
    """llama.cpp's name of a canonical tensor kind (of layer `layer`): "blk.3.attn_q.weight"."""
    base, suffix = TENSOR_KINDS[kind]
    return gguf.TENSOR_NAMES[getattr(gguf.MODEL_TENSOR, base)].format(bid=layer) + "." + suffix


def _logical(t) -> tuple[int, ...]:
    return tuple(int(d) for d in reversed(t.shape))


def _nearest(gguf_type: str) -> str:
    """The colibri format a non-exact GGUF type is requantized to under quant="auto"."""
    block, nbytes = GGML_QUANT_SIZES[GGMLQuantizationType[gguf_type]]
    return "q8" if 8 * nbytes / block >= 5 else "q4"


def _target(kind: str, cols: int, gguf_type: str, quant: str) -> tuple[str, bool]:
    """(colibri format, stored bit for bit?) of a tensor of GGUF type `gguf_type`."""
    if kind in _F32_KINDS:
        return "f32", gguf_type == "F32"
    if gguf_type in _EXACT:
        return _EXACT[gguf_type], True
    fmt = _nearest(gguf_type) if quant == "auto" else quant
    if fmt in ("q8", "q4") and cols % dtypes.BLOCK:
        fmt = "f32"
    return fmt, False


def plan_gguf(src: str | os.PathLike, quant: str = "auto") -> GGUFPlan:
    """Everything convert_gguf() will do, checked against the file's metadata and tensor
    table; reads no tensor data."""
    src = Path(src)
    if quant not in QUANTS:
        raise ColibriError(f"unknown quant {quant!r} for a GGUF source; choose from "
                           f"{', '.join(QUANTS)}")
    reader = open_gguf(src)
    meta = GGUFMeta(src, reader)
    hf = hf_config(meta)
    family = get_family(hf["model_type"])
    try:
        cfg = family.model_config(hf)
    except ConfigError as e:
        raise ColibriError(f"{src}: the GGUF metadata describes an invalid "
                           f"{hf['model_type']} model: {e}") from None
    by_name = {t.name: t for t in reader.tensors}
    used: set[str] = set()
    tensors = []
    for t in canonical_tensors(cfg):
        sources = _sources(src, t, cfg, by_name)
        used.update(s.name for s in sources)
        types = {s.tensor_type.name for s in sources}
        if len(sources) > 1:                        # kv_b from k_b and v_b: joined in f32
            fmt, exact = "f32", types == {"F32"}
        else:
            fmt, exact = _target(t.kind, t.shape[-1], types.pop(), quant)
        tensors.append(GGUFTensor(t, sources, fmt, exact))
    extra = sorted(set(by_name) - used)
    if extra:
        more = f" and {len(extra) - 5} more" if len(extra) > 5 else ""
        raise ColibriError(f"{src}: {len(extra)} GGUF tensors are not part of a "
                           f"{hf['model_type']} model as the metadata describes it: "
                           f"{', '.join(extra[:5])}{more}")
    _check_types(src, tensors)
    return GGUFPlan(src, meta.arch, hf, cfg, family, tensors, quant)


def _sources(src: Path, t: CanonicalTensor, cfg: ModelConfig, by_name: Mapping[str, Any]
             ) -> tuple[Any, ...]:
    """The GGUF tensor(s) holding canonical tensor t, shape-checked."""
    if t.kind == "attn.wkv_b" and gguf_tensor_name("attn.wkv_b", t.layer) not in by_name:
        kb, vb = (f"blk.{t.layer}.attn_k_b.weight", f"blk.{t.layer}.attn_v_b.weight")
        if kb in by_name and vb in by_name:
            H, dn, dv, r = (cfg.num_attention_heads, cfg.qk_nope_head_dim, cfg.v_head_dim,
                            cfg.kv_lora_rank)
            _check_shape(src, by_name[kb], (H, r, dn), t.name)
            _check_shape(src, by_name[vb], (H, dv, r), t.name)
            return by_name[kb], by_name[vb]
    name = gguf_tensor_name(t.kind, t.layer)
    if name not in by_name:
        raise ColibriError(f"{src}: GGUF has no tensor {name!r} (for {t.name})")
    g = by_name[name]
    shape = _logical(g)
    if t.expert is not None:
        want = (cfg.num_experts,) + t.shape
    elif t.kind == "moe.shared_gate":               # (1, D): GGUF may drop the 1
        want = t.shape if len(shape) == 2 else t.shape[1:]
    else:
        want = t.shape
    _check_shape(src, g, want, t.name)
    return (g,)


def _check_shape(src: Path, g, want: tuple[int, ...], name: str) -> None:
    if _logical(g) != tuple(want):
        raise ColibriError(f"{src}: GGUF tensor {g.name!r} has shape {_logical(g)} (NumPy "
                           f"order), but the metadata implies {tuple(want)} for {name}")


def _check_types(src: Path, tensors: list[GGUFTensor]) -> None:
    for t in tensors:
        for s in t.sources:
            name = s.tensor_type.name
            if name not in _EXACT and name not in supported_dequantized():
                raise ColibriError(
                    f"{src}: GGUF tensor {s.name!r} has type {name}, which colibri cannot "
                    f"read; supported: {', '.join(_EXACT)} (kept exactly) and "
                    f"{', '.join(supported_dequantized())} (dequantized, requantized)")


def supported_dequantized() -> list[str]:
    """GGUF types gguf.quants can dequantize that colibri does not hold bit for bit."""
    out = []
    for q in GGMLQuantizationType:
        cls = getattr(quants, q.name, None)
        if q.name not in _EXACT and isinstance(cls, type) and hasattr(cls, "dequantize_blocks"):
            out.append(q.name)
    return out


# --- the bytes ------------------------------------------------------------------------------

def unpermute_rows(w: np.ndarray, heads: int) -> np.ndarray:
    """Undo llama.cpp's LlamaModel.permute of q / k rows (R, X) (values or quantized row
    bytes): per head, rows (Dh/2, 2) -> (2, Dh/2), i.e. interleaved RoPE pairs back to
    halves."""
    r = w.shape[0]
    return np.ascontiguousarray(
        w.reshape(heads, r // heads // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape))


def gguf_q8_rows(raw: np.ndarray, cols: int) -> np.ndarray:
    """GGUF Q8_0 rows uint8 (R, C/32*34: per block f16 d, 32 int8) -> colibri q8 rows
    (R, C + C/32*2: the C int8, then the C/32 f16 scales): the same bytes re-laid."""
    b = raw.reshape(raw.shape[0], cols // 32, 34)
    return np.concatenate([b[:, :, 2:].reshape(len(b), cols),
                           b[:, :, :2].reshape(len(b), cols // 16)], axis=1)


def gguf_q4_rows(raw: np.ndarray, cols: int) -> np.ndarray:
    """GGUF Q4_0 rows uint8 (R, C/32*18: per block f16 d, 16 bytes of nibbles) -> colibri q4
    rows (R, C/2 + C/32*2): the nibble bytes unchanged (both use byte i = element i low,
    element 16 + i high, value (nibble - 8) * d), then the scales."""
    b = raw.reshape(raw.shape[0], cols // 32, 18)
    return np.concatenate([b[:, :, 2:].reshape(len(b), cols // 2),
                           b[:, :, :2].reshape(len(b), cols // 16)], axis=1)


def gguf_mxfp4_rows(raw: np.ndarray, cols: int) -> np.ndarray:
    """GGUF MXFP4 rows uint8 (R, C/32*17: per block E8M0 e, 16 bytes: element i low nibble,
    16 + i high) -> colibri mxfp4 rows (R, C/2 + C/32: byte j = element 2j low, 2j + 1 high,
    then the E8M0 scales); the same FP4 codes and exponents, so the same values."""
    b = raw.reshape(raw.shape[0], cols // 32, 17)
    qs = b[:, :, 1:]
    nib = np.concatenate([qs & 0x0F, qs >> 4], axis=2)              # (R, C/32, 32) in order
    codes = (nib[:, :, 0::2] | (nib[:, :, 1::2] << 4)).reshape(len(b), cols // 2)
    return np.concatenate([codes, b[:, :, 0]], axis=1)


_RELAY = {"q8": gguf_q8_rows, "q4": gguf_q4_rows, "mxfp4": gguf_mxfp4_rows}
_BLOCK_BYTES = {"Q8_0": 34, "Q4_0": 18, "MXFP4": 17}


def _rows(g, expert: int | None) -> np.ndarray:
    """The 2-D rows of GGUF tensor g (of one expert): values for float types, row bytes
    for quantized ones (a view of the mapping)."""
    a = g.data if expert is None else g.data[expert]
    return a.reshape(-1, a.shape[-1]) if a.ndim != 2 else a


def _values(g, expert: int | None) -> np.ndarray:
    """Float32 values of GGUF tensor g (of one expert), (R, C), dequantized by gguf."""
    a = _rows(g, expert)
    if g.tensor_type.name == "BF16":                 # the reader gives BF16 as bytes
        bits = np.ascontiguousarray(a).view("<u2")
        return (bits.astype(np.uint32) << 16).view(np.float32)
    if g.tensor_type.name in ("F32", "F16"):
        return a.astype(np.float32)
    return quants.dequantize(a, g.tensor_type)


def _reorder(p: GGUFPlan, t: GGUFTensor, a: np.ndarray) -> np.ndarray:
    """Rows of t (values or row bytes) into colibri's order (see the module docstring)."""
    c = p.config
    if p.arch == "llama" and t.canon.kind in ("attn.wq", "attn.wk"):
        a = unpermute_rows(a, c.num_attention_heads if t.canon.kind == "attn.wq"
                           else c.num_key_value_heads)
    if p.family.transform is not None:
        a = p.family.transform(t.canon, c, p.hf_config, a)
    return a


def _has_q8_min(raw: np.ndarray) -> bool:
    """Whether GGUF Q8_0 rows (R, C/32*34) hold a code -128 (llama.cpp never writes one)."""
    return bool((raw.reshape(len(raw), -1, 34)[:, :, 2:] == 0x80).any())


def _kv_b(t: GGUFTensor, c: ModelConfig) -> np.ndarray:
    """kv_b (H*(Dn+Dv), Rkv) f32 from llama.cpp's k_b (H, Rkv, Dn) and v_b (H, Dv, Rkv)."""
    kb, vb = (_values(s, None) for s in t.sources)
    H = c.num_attention_heads
    kb = kb.reshape(H, c.kv_lora_rank, c.qk_nope_head_dim).transpose(0, 2, 1)
    vb = vb.reshape(H, c.v_head_dim, c.kv_lora_rank)
    return np.ascontiguousarray(np.concatenate([kb, vb], axis=1).reshape(t.canon.shape))


def tensor_data(p: GGUFPlan, t: GGUFTensor) -> tuple[np.ndarray, bool, np.ndarray | None]:
    """(array for ColibriWriter.write, raw?, the f32 values when they were requantized, else
    None: the stored values are then exactly the GGUF's)."""
    (g, *_), e = t.sources, t.canon.expert
    if len(t.sources) > 1:
        return _kv_b(t, p.config), False, None
    gtype = g.tensor_type.name
    if t.exact and gtype == "Q8_0" and _has_q8_min(_rows(g, e)):
        t.exact = False        # -128: outside colibri's q8 range [-127, 127], requantized
    if t.exact and t.dtype in _RELAY:
        rows = _reorder(p, t, _rows(g, e))
        if gtype == "MXFP4" and (rows.reshape(len(rows), -1, 17)[:, :, 0] == 255).any():
            raise ColibriError(f"{p.src}: GGUF tensor {g.name!r} has E8M0 scales of 255 "
                               f"(NaN)")
        if t.dtype != "mxfp4":                       # the f16 block scales must be finite
            d = np.ascontiguousarray(rows.reshape(len(rows), -1, _BLOCK_BYTES[gtype])[:, :, :2])
            check_finite(d.view("<f2"), t.name, g.name)
        return _RELAY[t.dtype](rows, t.canon.shape[-1]).reshape(-1), True, None
    if t.exact and gtype in ("F16", "BF16"):         # the 16-bit patterns as they are
        rows = np.ascontiguousarray(_reorder(p, t, _rows(g, e)))
        check_finite(rows.view("<f2" if gtype == "F16" else "<u2"), t.name, g.name)
        return rows.reshape(-1).view(np.uint8), True, None
    values = _reorder(p, t, _values(g, e)).reshape(t.canon.shape)
    if t.dtype == "f32":                            # f32 holds any dequantized value exactly
        return values, False, None
    group = t.spec().group_size
    try:
        data = qmod.encode(values, t.dtype, group, name=t.name)
    except ValueError as err:
        raise ColibriError(f"tensor {t.name} (GGUF {g.name!r}): {err}") from None
    return data, True, values


# --- converting -----------------------------------------------------------------------------

def convert_gguf(src: str | os.PathLike, dst: str | os.PathLike, *, quant: str = "auto",
                 meta: Mapping[str, str] | None = None, force: bool = False,
                 checksums: bool = True, progress: bool = True) -> Path:
    """Convert the GGUF file `src` into the .colibri file `dst`; return its path.

    quant: the format of tensors whose GGUF type colibri does not hold bit for bit (K-quants,
      IQ*, Q4_1, Q5_*): "auto" (q8 for 5 bits per weight and more, q4 below), "q8", "q4", or
      "f32" / "f16" / "bf16" (dequantized). Q8_0, Q4_0, MXFP4 and float tensors are kept.
    meta: free-form user metadata. force: overwrite dst. dst may be a folder.
    Raises ColibriError naming the file, tensor or field on anything wrong.
    """
    src, dst = Path(src), Path(dst)
    user = check_meta(meta)
    p = plan_gguf(src, quant)
    if dst.is_dir():
        dst = dst / f"{src.stem}.colibri"
    if dst.resolve() == src.resolve():
        raise ColibriError(f"{dst}: refusing to write over the source GGUF")
    if not dst.resolve().parent.is_dir():
        raise ColibriError(f"{dst}: folder {dst.parent} does not exist")
    if dst.exists() and not force:
        raise ColibriError(f"{dst}: already exists (use --force to overwrite)")
    files = tokenizer_files(src, GGUFMeta(src, open_gguf(src)))
    from tqdm.auto import tqdm
    bar = tqdm(total=len(p.tensors), desc=f"convert {src.name}", disable=not progress,
               leave=False)
    try:
        with ColibriWriter(dst, [t.spec() for t in p.tensors], _metadata(p, files, user),
                           n_layers=p.config.num_hidden_layers, n_experts=p.config.num_experts,
                           checksums=checksums, overwrite=force) as writer:
            for t in p.tensors:
                data, raw, values = tensor_data(p, t)
                if not raw:
                    check_finite(np.asarray(data), t.name, t.sources[0].name)
                try:
                    writer.write(t.name, data, raw=raw)
                except ValueError as e:
                    raise ColibriError(f"tensor {t.name} (GGUF {t.sources[0].name!r}): {e}"
                                       ) from None
                if values is not None:
                    _record_error(p, t, values, data)
                bar.update(1)
    except (FileExistsError, IsADirectoryError) as e:
        raise ColibriError(str(e)) from None
    finally:
        bar.close()
    if p.errors:
        lines = "; ".join(f"{k}: max|err|/max|w| {mx:.3g}, mean ||err||/||w|| {mean / n:.3g} "
                          f"({n} tensors)" for k, (mx, mean, n) in p.errors.items())
        warnings.warn(f"requantized (no colibri format holds these GGUF types exactly): "
                      f"{lines}", ConversionWarning, stacklevel=2)
    return dst


def _record_error(p: GGUFPlan, t: GGUFTensor, values: np.ndarray, enc: np.ndarray) -> None:
    """Per tensor class (kind, GGUF type -> format): the largest max|w - ŵ| / max|w| and the
    mean of ||w - ŵ|| / ||w|| (w the GGUF's dequantized values, ŵ what the file stores)."""
    back = qmod.decode(enc, t.dtype, values.shape, t.spec().group_size)
    diff = np.abs(back - values)
    peak = float(np.abs(values).max()) or 1.0
    norm = float(np.linalg.norm(values)) or 1.0
    key = f"{t.canon.kind} {t.gguf_type} -> {t.dtype}"
    mx, mean, n = p.errors.get(key, (0.0, 0.0, 0))
    p.errors[key] = (max(mx, float(diff.max()) / peak),
                     mean + float(np.linalg.norm(back - values)) / norm, n + 1)


def _metadata(p: GGUFPlan, files: dict[str, str] | None, user: dict) -> dict:
    types: dict[str, int] = {}
    for t in p.tensors:
        types[f"{t.gguf_type} -> {t.dtype}"] = types.get(f"{t.gguf_type} -> {t.dtype}", 0) + 1
    return {
        "config": p.hf_config,
        "arch": p.config.to_metadata(),
        "tokenizer": {"files": files} if files else None,
        "user": user,
        "converter": {
            "colibri_version": __version__,
            "source": p.src.name,
            "source_format": "gguf",
            "gguf_architecture": p.arch,
            "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "quant": p.quant,
            "group_size": dtypes.BLOCK,
            "tensor_types": types,
        },
    }
