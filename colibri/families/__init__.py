"""Registry of the model families the converter knows.

Adding a family: write `colibri/families/<model_type>.py` exposing `FAMILY` (a `base.Family`:
config.json → ModelConfig, built with config_json.build from what the family does differently,
and the checkpoint name of each canonical tensor), list it in `_MODULES`, and add its tiny
checkpoint to tests/hf_factory.py.
"""
from __future__ import annotations

from ..errors import ColibriError
from . import (dbrx, deepseek_v2, deepseek_v3, glm4_moe, gpt_oss, granitemoe, mixtral, olmoe,
               phimoe, qwen2_moe, qwen3_moe)
from .base import Family
from .tensors import canonical_tensors

_MODULES = (mixtral, qwen2_moe, qwen3_moe, olmoe, granitemoe, dbrx, phimoe, gpt_oss,
            deepseek_v2, deepseek_v3, glm4_moe)

FAMILIES: dict[str, Family] = {m.FAMILY.model_type: m.FAMILY for m in _MODULES}
FAMILIES[granitemoe.SHARED_FAMILY.model_type] = granitemoe.SHARED_FAMILY


def get_family(model_type: str | None) -> Family:
    """The Family for a config.json `model_type`; ColibriError naming it otherwise."""
    try:
        return FAMILIES[model_type]
    except (KeyError, TypeError):
        raise ColibriError(f"unsupported model_type {model_type!r}; supported: "
                           f"{', '.join(sorted(FAMILIES))}") from None


__all__ = ["FAMILIES", "Family", "canonical_tensors", "get_family"]
