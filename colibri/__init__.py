"""colibri: run Mixture-of-Experts language models on ordinary CPUs, from one mmap'd file.

    import colibri
    model = colibri.load("model.colibri")                  # mmap; nothing is copied
    logits = colibri.forward(model, ids)                    # NumPy in, float32 logits out
    text = model.generate("def fib(n):", max_new_tokens=32)
    f = colibri.open("model.colibri")                       # the raw file: tensors as views

Shape alphabet, used in every docstring and comment of the package:
    B batch (sequences)          S new tokens per sequence     T = B*S token rows
    P cache slots (context)      L keys attended (slots in use + S)
    D hidden                     V vocabulary                  H / Hkv query / key-value heads
    G = H / Hkv                  Dh head dim                   Dr rotary dims (Dr/2 frequencies)
    E experts                    K experts per token           I expert intermediate
    Is shared-expert intermediate                              Id dense-mlp intermediate
    M MoE layers (the layer axis of a routing trace)
    R rows (outputs) and C columns (inputs) of a weight matrix
    Q quantization group size    NT tokens per kernel pass
docs/architecture.md draws the layers and the path of one token through them.
"""
from .version import __version__

from .errors import ColibriError, ColibriFormatError
from .resources import check_import_headroom

check_import_headroom()     # before NumPy: OpenBLAS would end the process under a tight RLIMIT_AS

from .api import default_model_path, forward, generate, load, stream
from .convert import convert   # binds the function, not the module, to colibri.convert
from .engine.kv_cache import CacheOverflowError, KVCache
from .engine.model import Model
from .engine.routing import RoutingTrace
from .format import ColibriFile, open
from .generation.sampling import Sampler, SamplingParams
from .kernels.runtime import reserve_blas_buffer
from .tools.stats import RoutingStats
from .tools.trace import Trace, iter_trace, routing_stats, trace

reserve_blas_buffer()       # under RLIMIT_AS: OpenBLAS's buffer mapped now, or a clean error


__all__ = [
    "CacheOverflowError", "ColibriError", "ColibriFile", "ColibriFormatError", "KVCache",
    "Model", "RoutingStats", "RoutingTrace", "Sampler", "SamplingParams", "Trace", "convert",
    "default_model_path", "forward", "generate", "iter_trace", "load", "open", "routing_stats",
    "stream", "trace", "__version__",
]
