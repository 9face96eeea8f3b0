"""The .colibri layout as data: magic, version, the header / tensor-record / expert-record
layouts, alignment, and the canonical tensor names (docs/format.md §1-§4, §7).

Everything else in the package (checks, reader, writer) reads its numbers from here; the
weight formats (dtype codes, bits, row strides) are colibri.dtypes'.
"""
from __future__ import annotations

import re
import struct
from typing import Iterable

import numpy as np

FORMAT_VERSION = 1
MAGIC = b"COLI"
HEADER_SIZE = 128
RECORD_SIZE = 160
EXPERT_RECORD_SIZE = 32
ALIGNMENT = 64           # every tensor starts at a multiple of this
PAGE_SIZE = 4096         # data_offset and every expert block start at a multiple of this
MAX_NAME_BYTES = 95      # the name field is 96 bytes, NUL-terminated

# Reader limits (docs/format.md §8 step 7): what a reader reads before mapping is bounded by
# these, whatever a (possibly sparse, possibly hostile) file declares.
MAX_TENSORS = 1 << 20                 # DeepSeek-V3: ~47k tensors
MAX_METADATA_BYTES = 128 << 20        # the largest tokenizer.json files are ~35 MB
MAX_PREFIX_PADDING = 2 * PAGE_SIZE    # zero bytes of [128, data_offset) outside the sections
# The last key of the metadata JSON colibri writes: the CRC32 of the bytes before it (§5).
METADATA_CRC_KEY = "metadata_crc32"

HEADER_FLAG_CRC = 1  # header flags bit 0: per-tensor CRC32s present
RECORD_FLAG_CRC = 1  # record flags bit 0: this record's crc32 is valid

# Header (§2): magic, version, n_experts, n_layers, header_size, tensor_count, routing_offset,
# data_offset, table_offset, record_size, alignment, expert_index_offset,
# expert_record_size, expert_count, metadata_offset, metadata_size, file_size, page_size,
# flags, reserved[20], header_crc32.
HEADER_STRUCT = struct.Struct("<4sIIIIIQQQIIQIIQQQII20sI")
HEADER_FIELDS = (
    "magic", "version", "n_experts", "n_layers", "header_size", "tensor_count",
    "routing_offset", "data_offset", "table_offset", "record_size", "alignment",
    "expert_index_offset", "expert_record_size", "expert_count", "metadata_offset",
    "metadata_size", "file_size", "page_size", "flags", "reserved", "header_crc32",
)
# Tensor record (§3): name[96], dtype, ndim, reserved, group_size, shape[4], offset, nbytes,
# crc32, flags. Expert index record (§4): layer, expert, offset, size, reserved.
RECORD_STRUCT = struct.Struct("<96sBBHI4QQQII")
EXPERT_STRUCT = struct.Struct("<IIQQQ")
assert HEADER_STRUCT.size == HEADER_SIZE and RECORD_STRUCT.size == RECORD_SIZE
assert EXPERT_STRUCT.size == EXPERT_RECORD_SIZE

# The same records as numpy structured dtypes: validating 20k records is a few vector ops.
RECORD_DTYPE = np.dtype([
    ("name", "u1", (96,)), ("dtype", "u1"), ("ndim", "u1"), ("reserved", "<u2"),
    ("group_size", "<u4"), ("shape", "<u8", (4,)), ("offset", "<u8"), ("nbytes", "<u8"),
    ("crc32", "<u4"), ("flags", "<u4"),
])
EXPERT_DTYPE = np.dtype([
    ("layer", "<u4"), ("expert", "<u4"), ("offset", "<u8"), ("size", "<u8"),
    ("reserved", "<u8"),
])
assert RECORD_DTYPE.itemsize == RECORD_SIZE and EXPERT_DTYPE.itemsize == EXPERT_RECORD_SIZE

# Canonical names (§7): the reader finds routers and expert blocks by them.
PROJS = ("w_gate", "w_up", "w_down")   # order of the tensors inside an expert block
ROUTER_RE = re.compile(r"layers\.([0-9]+)\.moe\.router", re.ASCII)
EXPERT_RE = re.compile(r"layers\.([0-9]+)\.moe\.experts\.([0-9]+)\.(w_gate|w_up|w_down)",
                       re.ASCII)
LAYER_RE = re.compile(r"layers\.([0-9]+)\.", re.ASCII)


def round_up(x: int, multiple: int) -> int:
    return -(-x // multiple) * multiple


def router_name(layer: int) -> str:
    return f"layers.{layer}.moe.router"


def expert_name(layer: int, expert: int, proj: str) -> str:
    return f"layers.{layer}.moe.experts.{expert}.{proj}"


def layer_count(names: Iterable[str]) -> int:
    """1 + the largest i of the names 'layers.{i}.*' (0 when there are none): the header's
    n_layers."""
    ids = {n.split(".", 2)[1] for n in names if n.startswith("layers.")}
    return max((int(i) for i in ids if i.isascii() and i.isdigit()), default=-1) + 1
