"""Which kernel path each class of matrix product runs on, and why no wider one.

`colibri bench` prints it above its table and `colibri inspect --kernels FILE` prints it for
a file: per class (decode matvec, prefill GEMM, grouped expert FFN, head) the ISA path, the
body (row kernel, small-M row kernel, integer / f32 GEMM, AMX tiles) and from how many tokens
per matrix the GEMM takes over; then, per path wider than the current one, why it was not
chosen (the CPU, the OS, the build, the AMX self-check, or COLIBRI_ISA / runtime.set_isa).
The choices mirror the kernels' own (colibri/pyx/weights.pxi, runtime.pxi).
"""
from __future__ import annotations

from typing import Any, Mapping

from .. import _kernels
from . import runtime

INTEGER_FORMATS = ("q4", "q8", "mxfp4")        # the formats the int8 / int16 codes apply to
_FMT_CODES = {"q8": 3, "q4": 4, "mxfp4": 6}    # csrc/types.h
_BASE = {"avx512vnni": "avx512vnni", "amx-emu": "avx512vnni", "amx": "avx512vnni"}


def matmul_formats(tensors: Mapping[str, Any]) -> dict[str, str]:
    """{"dense", "experts", "head"} -> the dtype name of that kind of matrix in a file's
    tensor table (name -> TensorInfo): the first attention projection, the first expert
    matrix, the head (lm_head, else the tied embedding)."""
    out: dict[str, str] = {}
    for name, t in tensors.items():
        if len(t.shape) < 2:
            continue
        if "experts" in name:
            out.setdefault("experts", t.dtype)
        elif ".attn" in name or "attention" in name:
            out.setdefault("dense", t.dtype)
    for name in ("lm_head", "output", "tok_embeddings"):
        if name in tensors:
            out["head"] = tensors[name].dtype
            break
    out.setdefault("dense", out.get("experts", "f32"))
    out.setdefault("experts", out["dense"])
    out.setdefault("head", out["dense"])
    return out


def wider_not_chosen(isa: str | None = None) -> list[str]:
    """For every path above `isa` (default: the current one) in runtime.ISAS order, "name:
    why it is not used" (amx-emu, the tile emulation, is a test path chosen only by name)."""
    isa = isa or runtime.get_isa()
    out = []
    for code in range(runtime.ISAS.index(isa) + 1, len(runtime.ISAS)):
        name = runtime.ISAS[code]
        why = _kernels.isa_why_not(code)
        if not why:
            if name == "amx-emu":
                why = "runs here: the tile emulation, a test path chosen only by name"
            else:
                why = f"runs here, not selected (COLIBRI_ISA / runtime.set_isa chose {isa})"
        out.append(f"{name}: {why}")
    return out


def _bodies(isa: str, fmt: str, activations: str) -> tuple[str, str, int | None]:
    """(row-kernel body, GEMM body, tokens per matrix from which the GEMM runs or None)."""
    if activations != "f32" and fmt in INTEGER_FORMATS:
        wide = activations == "int16"
        base = _BASE.get(isa, isa)
        small = _kernels.idot_small_m(runtime.ISAS.index(isa), _FMT_CODES[fmt], wide)
        row = f"{base} {'small-M row kernel' if small else 'row kernel'} ({activations} codes)"
        start = runtime.igemm_min_tokens() or runtime.igemm_crossover(isa, activations)
        gemm = f"{base} integer GEMM"
        if isa in ("amx", "amx-emu"):
            tiles = "AMX tiles" if isa == "amx" else "emulated AMX tiles (amx-emu)"
            gemm += f", {tiles} from {_kernels.amx_min_tokens()} tokens per pass"
        return row, gemm, start
    base = {"avxvnni": "avx2", "avx512vnni": "avx512", "amx-emu": "avx512", "amx": "avx512"}
    name = base.get(isa, isa)
    note = "" if fmt not in INTEGER_FORMATS else " (f32 activations)"
    return (f"{name} f32 row kernel{note}", f"{name} f32 GEMM{note}",
            runtime.gemm_min_tokens())


def kernel_paths(formats: Mapping[str, str], activations: str = "int16",
                 isa: str | None = None) -> list[dict[str, Any]]:
    """One record per matmul class: class, format, path (the ISA path), body (what runs,
    from how many tokens), for formats {"dense", "experts", "head"} -> dtype name."""
    isa = isa or runtime.get_isa()
    rows = []
    for cls, kind, tokens in (("decode matvec", "dense", "1 token per matrix"),
                              ("prefill GEMM", "dense", None),
                              ("grouped expert FFN", "experts", None),
                              ("head", "head", "1 token per sequence")):
        fmt = formats[kind]
        row, gemm, start = _bodies(isa, fmt, activations)
        if tokens is not None:
            body = f"{row}, {tokens}"
        elif start is None:
            body = f"{row} at every token count (no GEMM body beats it on this path)"
        elif cls == "prefill GEMM":
            body = f"{gemm} from {start} tokens per matrix ({row} below)"
        else:
            body = (f"{row} for 1-{start - 1} tokens per expert, {gemm} from {start}"
                    if start > 1 else f"{gemm} at every token count")
        rows.append({"class": cls, "format": fmt, "path": isa, "body": body})
    return rows


def format_kernel_paths(formats: Mapping[str, str], activations: str = "int16",
                        isa: str | None = None) -> list[str]:
    """The text lines of kernel_paths and wider_not_chosen."""
    isa = isa or runtime.get_isa()
    rows = kernel_paths(formats, activations, isa)
    width = max(len(r["class"]) for r in rows)
    lines = [f"kernels: ISA {isa}, {activations} activations"]
    lines += [f"  {r['class']:<{width}}  {r['format']:<5} {r['body']}" for r in rows]
    wider = wider_not_chosen(isa)
    if wider:
        lines.append("  wider paths not chosen: " + "; ".join(wider))
    return lines
