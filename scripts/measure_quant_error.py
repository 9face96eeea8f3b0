"""Measure the error of colibri's weight encodings on real-shaped weights.

Compares, per group size G in {32, 64, 128}:
  q4 sym   - the .colibri q4 format (colibri.format.quant: scale = m/-8, no zero point, Q4_0)
  q4 sym G32 search - the same q4 bytes from an error-minimising scale search (converter-only
             option, not implemented in colibri.format.quant)
  q4 asym  - scale + minimum per group (llama.cpp Q4_1 style; both f16), for comparison only
  q8       - the .colibri q8 format (scale = max|w|/127)
and bf16 as a reference, on expert-shaped matrices (R, C) = (1024, 3584) and (2048, 1024)
with three weight distributions: Gaussian, Student-t (nu=4, heavy tails) and Gaussian with a
few outlier input columns (as real LLM weights have).

Reported per (distribution, shape, encoding):
  bpw      bits per weight, scales included
  relRMS   ||W - W_hat||_F / ||W||_F
  SNR      -20 log10(relRMS), dB
  dB/bit   SNR / bpw
  max      max |w - w_hat| in units of the weight standard deviation
  matvec   ||(W - W_hat) x|| / ||W x|| for Gaussian x (16 vectors, pooled)

Usage:  python scripts/measure_quant_error.py [--seed 0]     (prints Markdown)
Runtime: well under a minute on 2 cores.
"""
from __future__ import annotations

import argparse
import math
import time

import numpy as np

from colibri.format import quant

SHAPES = [(1024, 3584), (2048, 1024)]       # (R, C): an expert's w_gate/w_up and w_down
GROUPS = [32, 64, 128]
N_X = 16                                    # Gaussian input vectors for the matvec error


def make_weights(kind: str, shape: tuple[int, int], rng: np.random.Generator) -> np.ndarray:
    """f32 (R, C) weights with std about 0.02 (the scale does not matter: errors are relative)."""
    R, C = shape
    if kind == "gauss":
        w = rng.standard_normal(shape)
    elif kind == "student_t4":
        w = rng.standard_t(4, size=shape) / math.sqrt(2.0)      # variance nu/(nu-2) = 2
    elif kind == "outlier_cols":
        # A few input channels (0.25 % of C, at least 4) with 16x larger weights.
        w = rng.standard_normal(shape)
        cols = rng.choice(C, max(4, C // 400), replace=False)
        w[:, cols] *= 16.0
    else:
        raise ValueError(kind)
    return (w * 0.02).astype(np.float32)


def q4_asym(w: np.ndarray, G: int) -> np.ndarray:
    """Q4_1-style round trip: per group d = (max - min)/15 and min, both f16; q in 0..15."""
    R, C = w.shape
    x = w.reshape(R, C // G, G)
    lo = x.min(-1).astype(np.float16).astype(np.float32)[..., None]
    hi = x.max(-1)[..., None]
    d = ((hi - lo) / 15).astype(np.float16).astype(np.float32)
    safe = np.where(d == 0, 1, d)
    q = np.clip(np.rint((x - lo) / safe), 0, 15)
    return (q * d + lo).reshape(R, C)


def q4_sym_search(w: np.ndarray, G: int) -> np.ndarray:
    """Same q4 format and decoder, a better quantizer: per group, the f16 scale from a small
    grid around m/-8, refined by least squares, that minimises the group's squared error.
    Decodes with the unchanged w = (nibble - 8) * scale; shown to bound what a smarter
    converter could gain without touching the file format or the kernels."""
    R, C = w.shape
    x = w.reshape(R, C // G, G).astype(np.float32)
    idx = np.abs(x).argmax(-1)[..., None]
    base = np.take_along_axis(x, idx, -1) / -8                            # (R, C/G, 1)
    best_err = np.full(base.shape, np.inf, np.float32)
    best_s = np.zeros_like(base)

    def try_scale(s):
        s = s.astype(np.float16).astype(np.float32)
        safe = np.where(s == 0, 1, s)
        q = np.clip(np.rint(x / safe), -8, 7)
        err = ((x - q * s) ** 2).sum(-1, keepdims=True)
        better = err < best_err
        best_err[better] = err[better]
        best_s[better] = s[better]
        return q

    for f in np.linspace(0.80, 1.10, 16):
        q = try_scale(base * np.float32(f))
        # Least-squares scale for these q values: sum(w q) / sum(q^2).
        qq = (q * q).sum(-1, keepdims=True)
        try_scale(np.where(qq > 0, (x * q).sum(-1, keepdims=True) / np.maximum(qq, 1), base))
    safe = np.where(best_s == 0, 1, best_s)
    return (np.clip(np.rint(x / safe), -8, 7) * best_s).reshape(R, C)


def encodings():
    """(label, bits per weight as a function of G (None: plain), round-trip function)."""
    out = [("bf16", lambda: 16.0,
            lambda w: quant.bf16_to_f32(quant.f32_to_bf16(w)))]
    for G in GROUPS:
        out.append((f"q8 G{G}", lambda G=G: 8 + 16 / G,
                    lambda w, G=G: quant.decode(quant.encode(w, "q8", G), "q8", w.shape, G)))
    for G in GROUPS:
        out.append((f"q4 sym G{G}", lambda G=G: 4 + 16 / G,
                    lambda w, G=G: quant.decode(quant.encode(w, "q4", G), "q4", w.shape, G)))
    out.append(("q4 sym G32 search", lambda: 4 + 16 / 32, lambda w: q4_sym_search(w, 32)))
    for G in GROUPS:
        out.append((f"q4 asym G{G}", lambda G=G: 4 + 32 / G, lambda w, G=G: q4_asym(w, G)))
    return out


def measure(w: np.ndarray, w_hat: np.ndarray, x: np.ndarray) -> dict:
    diff = (w.astype(np.float64) - w_hat)
    rel = float(np.linalg.norm(diff) / np.linalg.norm(w.astype(np.float64)))
    y = w.astype(np.float64) @ x                                 # (R, N_X)
    dy = diff @ x
    return {
        "rel_rms": rel,
        "snr_db": -20 * math.log10(rel) if rel > 0 else float("inf"),
        "max_err_std": float(np.abs(diff).max() / w.std()),
        "matvec": float(np.linalg.norm(dy) / np.linalg.norm(y)),
    }


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    rng = np.random.default_rng(args.seed)
    t0 = time.perf_counter()
    results = []                                 # (kind, shape, label, bpw, metrics)
    for kind in ("gauss", "student_t4", "outlier_cols"):
        for shape in SHAPES:
            w = make_weights(kind, shape, rng)
            x = rng.standard_normal((shape[1], N_X))
            for label, bpw, roundtrip in encodings():
                results.append((kind, shape, label, bpw(), measure(w, roundtrip(w), x)))

    print(f"# quantization error, seed {args.seed}, numpy {np.__version__}\n")
    for kind in ("gauss", "student_t4", "outlier_cols"):
        print(f"## {kind}\n")
        head = "| encoding | bpw |"
        rule = "|---|---:|"
        for R, C in SHAPES:
            head += f" relRMS {R}x{C} | SNR dB | dB/bit | max/std | matvec |"
            rule += "---:|---:|---:|---:|---:|"
        print(head)
        print(rule)
        for label, _, _ in encodings():
            rows = [r for r in results if r[0] == kind and r[2] == label]
            line = f"| {label} | {rows[0][3]:.3f} |"
            for _, _, _, bpw, m in rows:
                line += (f" {m['rel_rms']:.4%} | {m['snr_db']:.2f} | {m['snr_db'] / bpw:.2f} |"
                         f" {m['max_err_std']:.3f} | {m['matvec']:.4%} |")
            print(line)
        print()

    # Equal-byte comparisons: symmetric with the scale saved versus asymmetric, and the price
    # of each step in group size, in dB per extra bit (6.02 dB/bit is one more bit of mantissa).
    print("## trade-offs (mean SNR over both shapes, dB)\n")
    print("| distribution | q4 sym G32 (4.5) | q4 asym G64 (4.5) | q4 sym G64 (4.25) |"
          " q4 asym G128 (4.25) | q4 sym G128 (4.125) | dB/bit G128->G64 sym |"
          " dB/bit G64->G32 sym | q8 G32 (8.5) | q8 G128 (8.125) |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|")

    def snr(kind, label):
        return float(np.mean([r[4]["snr_db"] for r in results
                              if r[0] == kind and r[2] == label]))

    for kind in ("gauss", "student_t4", "outlier_cols"):
        s32, s64, s128 = (snr(kind, f"q4 sym G{G}") for G in GROUPS)
        print(f"| {kind} | {s32:.2f} | {snr(kind, 'q4 asym G64'):.2f} | {s64:.2f} |"
              f" {snr(kind, 'q4 asym G128'):.2f} | {s128:.2f} |"
              f" {(s64 - s128) / 0.125:.1f} | {(s32 - s64) / 0.25:.1f} |"
              f" {snr(kind, 'q8 G32'):.2f} | {snr(kind, 'q8 G128'):.2f} |")
    print(f"\n(elapsed {time.perf_counter() - t0:.1f} s)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
