"""Everything `colibri serve` is configured with, in one dataclass, checked once.

`Settings` holds plain values only and imports neither fastapi nor uvicorn, so it can be
built (and pickled to worker processes or Ray replicas) without the server extra.
"""
from __future__ import annotations

import math
import os
import re
from dataclasses import dataclass, field
from pathlib import Path

from ..api import default_model_path
from ..engine.kv_cache import DEFAULT_KV_DTYPE, kv_dtype_name
from ..engine.model import DEFAULT_ACTIVATIONS
from ..errors import ColibriError
from ..generation.sampling import MAX_TOP_K, REAL_BOUNDS
from ..kernels import ACTIVATIONS
from ..ray_local import is_loopback

__all__ = ["Settings", "parse_bytes", "is_loopback", "SAMPLING_DEFAULTS"]

# request field -> (flag of `colibri serve`, lowest, highest, lowest excluded): the sampling
# bounds are colibri.generation.sampling's, which the request schemas (schemas.py) and the engine
# check too
SAMPLING_DEFAULTS = {"temperature": ("--temp", *REAL_BOUNDS["temperature"]),
                     "top_k": ("--top-k", 0, MAX_TOP_K, False),
                     "top_p": ("--top-p", *REAL_BOUNDS["top_p"]),
                     "min_p": ("--min-p", *REAL_BOUNDS["min_p"]),
                     "repetition_penalty": ("--repeat-penalty", *REAL_BOUNDS["repetition_penalty"]),
                     "seed": ("--seed", 0, None, False),
                     "max_tokens": ("-n", -1, 2**31 - 1, False)}

_UNITS = {"": 1, "b": 1, "k": 1000, "kb": 1000, "m": 1000**2, "mb": 1000**2, "g": 1000**3,
          "gb": 1000**3, "t": 1000**4, "tb": 1000**4, "kib": 1024, "mib": 1024**2,
          "gib": 1024**3, "tib": 1024**4}


def parse_bytes(text: str | int) -> int:
    """'6GiB' / '512MB' / '1.5g' / '1000000' -> bytes (int). SI units are powers of 1000,
    the -iB ones of 1024. ValueError naming the text for anything else."""
    if isinstance(text, int):
        value = text
    else:
        m = re.fullmatch(r"\s*([0-9]+(?:\.[0-9]*)?)\s*([a-zA-Z]*)\s*", str(text))
        unit = m.group(2).lower() if m else None
        if m is None or unit not in _UNITS:
            raise ValueError(f"{text!r} is not a size in bytes (examples: 6GiB, 512MB, 1000000)")
        value = float(m.group(1)) * _UNITS[unit]
        if not math.isfinite(value):
            raise ValueError(f"{text!r} is not a finite size")
        value = int(value)
    if value <= 0:
        raise ValueError(f"{text!r}: a size must be > 0 bytes")
    return value


@dataclass
class Settings:
    """The server's configuration (the flags of `colibri serve`).

    model: the .colibri file served and reloaded (None: the shipped model).
    parallel: slots decoded together in each forward pass (continuous batching).
    ctx: tokens per slot, prompt + completion (None: the model's, capped at 4096).
    kv_budget: bytes of KV cache all slots may hold (None: parallel x ctx x bytes per token;
        the bytes per token follow kv_dtype: half of f32's for f16 / bf16).
    kv_dtype: the storage of the slots' KV caches, "f16" (default), "bf16" or "f32"
        (colibri.load; other spellings such as "fp16" are normalised by check()).
    max_queue: requests waiting for a slot beyond the running ones; past it 429.
    prefix_cache: bytes of prompt prefixes' KV kept for later requests, inside kv_budget's
        part the running requests do not hold (None: all of that part; 0: off;
        docs/prefix-caching.md).
    api_key: bearer token for /v1/* , /metrics and /admin/*; None: no auth (loopback only,
        unless insecure).
    max_body: bytes a request body may hold (413 past it).
    max_n: choices per request at most (n x prompts).
    model_name: the id /v1/models lists and responses carry (None: the file's stem).
    draft: speculative decoding in every slot (colibri.generation.speculative_batch):
    "prompt-lookup" or
        a draft .colibri file with the model's tokenizer; None: off. draft_tokens: the most
        drafts per verification (1..32).
    webui: serve the chat and routing page at / (webui.py); False: / is a 404.
    expert_shards: N > 0 puts the experts on N Ray actors (colibri.experts.expert_shards), joining
        the cluster at ray_address (None: a local instance on loopback); shard_threads:
        kernel threads per actor (None: threads); shard_memory_budget: bytes of experts
        each actor may hold (an expert cache per actor; None: no limit; needs expert_shards).
    defaults: the sampling values of the fields a request leaves out, as llama-server's
        --temp / --top-k / -n set them (serve's flags): keys of SAMPLING_DEFAULTS; without a
        key, the OpenAI default. max_tokens -1: the rest of the context.
    """
    model: str | None = None
    host: str = "127.0.0.1"
    port: int = 8080
    parallel: int = 4
    ctx: int | None = None
    kv_budget: int | None = None
    max_queue: int = 64
    prefill_chunk: int = 64
    prefix_cache: int | None = None
    api_key: str | None = None
    insecure: bool = False
    pid_file: str | None = None
    max_body: int = 1 << 20
    max_n: int = 16
    max_stop: int = 16
    max_top_logprobs: int = 20
    threads: int | None = None
    activations: str = DEFAULT_ACTIVATIONS
    kv_dtype: str = DEFAULT_KV_DTYPE
    model_name: str | None = None
    log_level: str = "info"
    draft: str | None = None
    draft_tokens: int = 4
    webui: bool = True
    expert_shards: int = 0
    ray_address: str | None = None
    shard_threads: int | None = None
    shard_memory_budget: int | None = None
    defaults: dict = field(default_factory=dict)

    def model_path(self) -> Path:
        """The file to open (and to reopen on reload): `model`, or the shipped model."""
        if self.model is None:
            return default_model_path()
        return Path(self.model)

    def served_name(self) -> str:
        return self.model_name or self.model_path().stem

    def check(self) -> None:
        """ColibriError naming the setting for any value out of range, and for a
        non-loopback host without an api key (unless insecure)."""
        for name, value, minimum in (("parallel", self.parallel, 1), ("max_queue", self.max_queue, 0),
                                     ("ctx", self.ctx, 2), ("kv_budget", self.kv_budget, 1),
                                     ("prefill_chunk", self.prefill_chunk, 1),
                                     ("prefix_cache", self.prefix_cache, 0),
                                     ("max_body", self.max_body, 64), ("max_n", self.max_n, 1),
                                     ("threads", self.threads, 1), ("port", self.port, 0),
                                     ("draft_tokens", self.draft_tokens, 1)):
            if value is not None and value < minimum:
                raise ColibriError(f"{name} {value} is out of range (must be >= {minimum})")
        if isinstance(self.expert_shards, bool) or not isinstance(self.expert_shards, int) \
                or not 0 <= self.expert_shards <= 256:
            raise ColibriError(f"expert_shards {self.expert_shards!r} is out of range "
                               f"(0..256; 0: the experts in this process)")
        if self.shard_threads is not None and not 1 <= self.shard_threads <= 1024:
            raise ColibriError(f"shard_threads {self.shard_threads} is out of range (1..1024)")
        if self.shard_memory_budget is not None and (not self.expert_shards or isinstance(
                self.shard_memory_budget, bool) or not isinstance(self.shard_memory_budget, int)
                or self.shard_memory_budget < 0):
            raise ColibriError(f"shard_memory_budget {self.shard_memory_budget!r}: a number of "
                               f"bytes >= 0, with expert_shards (here {self.expert_shards})")
        if self.draft_tokens > 32:
            raise ColibriError(f"draft_tokens {self.draft_tokens} is out of range (1..32)")
        if self.draft is not None and self.draft != "prompt-lookup" and not Path(
                self.draft).is_file():
            raise ColibriError(f"draft {self.draft}: no such file (give a .colibri model or "
                               f"prompt-lookup)")
        for key, value in self.defaults.items():
            if key not in SAMPLING_DEFAULTS:
                raise ColibriError(f"unknown sampling default {key!r} (expected among "
                                   f"{', '.join(SAMPLING_DEFAULTS)})")
            flag, low, high, open_low = SAMPLING_DEFAULTS[key]
            if (not math.isfinite(value) or value < low or (open_low and value == low)
                    or (high is not None and value > high) or (key == "max_tokens" and value == 0)):
                raise ColibriError(f"{flag} {value} is out of range (must be "
                                   f"{'>' if open_low else '>='} {low}"
                                   + (f" and <= {high}" if high is not None else "")
                                   + (", not 0" if key == "max_tokens" else "") + ")")
        if not 0 <= self.port <= 65535:
            raise ColibriError(f"port {self.port} is out of range [0, 65535]")
        if self.activations not in ACTIVATIONS:
            raise ColibriError(f"activations must be one of {', '.join(ACTIVATIONS)}, got "
                               f"{self.activations!r}")
        try:
            self.kv_dtype = kv_dtype_name(self.kv_dtype)
        except ValueError as e:
            raise ColibriError(str(e)) from None
        if self.api_key is not None and len(self.api_key) < 8:
            raise ColibriError("the api key must have at least 8 characters")
        if self.api_key is None and not self.insecure and not is_loopback(self.host):
            raise ColibriError(f"refusing to serve on {self.host}, which is not a loopback "
                               f"address, without --api-key; give a key, or --insecure to "
                               f"serve without one")
        if self.model is not None and not os.path.isfile(self.model):
            raise ColibriError(f"{self.model}: no such file")
