"""What every conversion (Hugging Face or GGUF) checks in what it is given beyond the file
format: the user metadata (--meta), the values (no inf / NaN), and the warning class of
what it survives."""
from __future__ import annotations

from typing import Iterable, Mapping

import numpy as np

from ..errors import ColibriError


class ConversionWarning(UserWarning):
    """Something the conversion survived but the user should know (e.g. no tokenizer)."""


def check_finite(a: np.ndarray, name: str, key: str, chunk: int = 1 << 22) -> None:
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


def check_meta(meta: Mapping[str, str] | None) -> dict[str, str]:
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
