"""The .colibri model file (docs/format.md is the full specification).

One little-endian file per model:

    header (128 B) | tensor table (160 B / tensor) | expert index (32 B / expert block)
    | metadata (UTF-8 JSON) | zero padding to a page | data: routers, dense, expert blocks

The modules, in data-flow order:

    spec           the layout as data: magic, version, record layouts, alignment, tensor names
    checks         what a reader verifies before mapping a file (§8), and validate()'s full read
    reader         ColibriFile: the checked read-only mapping and its zero-copy views
    writer         TensorSpec, ColibriWriter (planned layout, atomic write), save()

and what the metadata's text makes (imported on use, not by this package):

    tokenizer      the Tokenizer rebuilt from the embedded tokenizer files
    chat_template  the embedded chat template, rendered in a bounded sandbox
    validation     --validate: config vs tensors and config.json, the tokenizer, every byte

The weight formats (dtype codes, bits, row strides) are colibri.dtypes'; their encodings
colibri.format.quant's.
"""
from .spec import (
    ALIGNMENT, EXPERT_RE, FORMAT_VERSION, MAGIC, PAGE_SIZE, PROJS, ROUTER_RE, expert_name,
    router_name,
)
from .checks import check_metadata
from .reader import ColibriFile, QuantizedTensor, TensorInfo, TensorTable, open
from .writer import ROLES, ColibriWriter, TensorSpec, save

__all__ = [
    "ALIGNMENT", "EXPERT_RE", "FORMAT_VERSION", "MAGIC", "PAGE_SIZE", "PROJS", "ROUTER_RE",
    "expert_name", "router_name", "check_metadata", "ColibriFile", "QuantizedTensor",
    "TensorInfo", "TensorTable", "open", "ROLES", "ColibriWriter", "TensorSpec", "save",
]
