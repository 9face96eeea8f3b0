"""Benchmarks of colibri.kernels at the shapes of the benchmark models (issue 4), per ISA
path and thread count: time_* (seconds), peakmem_* (bytes), track_*_gbs (weight bytes
streamed per second, best of 5).

    asv continuous -b kernels main HEAD             # compare two commits
    asv run --quick -b kernels --python=same        # one pass on the installed package

Shapes (rows x cols of one matrix): mixtral-mini attention 1024 x 1024, its expert gate/up
3584 x 1024 and down 1024 x 3584; OLMoE-1B-7B experts 1024 x 2048 / 2048 x 1024 (64 experts,
top-8; 16 experts here so the setup stays small: a decode step reads 8 of them either way).

`activations` ("f32", "int8", "int16"): the kernels' activations option; "int8" / "int16"
only change q4/q8 weights (a bf16 case with them would repeat the f32 one, so it is skipped).
"""
import numpy as np

from colibri import kernels as K

from .common import ISAS, THREADS, best_seconds, nbytes, use, weight

ACTIVATIONS = tuple(a for a in ("f32", "int8", "int16") if a in K.ACTIVATIONS)


def use_activations(fmt: str, activations: str) -> None:
    """Skip (NotImplementedError) a plain-format case with quantized activations: the same
    path as "f32"."""
    if activations != "f32" and fmt not in ("q4", "q8"):
        raise NotImplementedError(f"activations={activations!r} does not change {fmt} weights")

LINEAR_SHAPES = {"attn-1024x1024": (1024, 1024), "gate-3584x1024": (3584, 1024),
                 "down-1024x3584": (1024, 3584), "head-32000x1024": (32000, 1024)}
FFN_GEOMETRY = {"mixtral-mini": (8, 2, 1024, 3584), "olmoe": (16, 8, 2048, 1024)}  # E, K, D, I


def setup_linear(bench, shape: str, fmt: str, isa: str, threads: int, activations: str,
                 tokens: int) -> None:
    """The common setup of the linear benchmarks: bench.w (shape, fmt), bench.x (tokens, C),
    bench.threads, bench.act; skips the cases use() / use_activations() skip."""
    use(isa, threads)
    use_activations(fmt, activations)
    R, C = LINEAR_SHAPES[shape]
    bench.w = weight((R, C), fmt)
    bench.x = np.random.default_rng(1).standard_normal((tokens, C)).astype(np.float32)
    bench.threads, bench.act = threads, activations


class Linear:
    """Decode GEMV: one token against one matrix."""
    params = (list(LINEAR_SHAPES), ["q4", "q8", "bf16"], list(ISAS), list(THREADS),
              list(ACTIVATIONS))
    param_names = ["shape", "format", "isa", "threads", "activations"]
    timeout = 300

    def setup(self, shape, fmt, isa, threads, activations):
        setup_linear(self, shape, fmt, isa, threads, activations, tokens=1)
        self.out = np.empty((1, self.w.rows), np.float32)

    def _run(self):
        K.linear(self.x, self.w, threads=self.threads, out=self.out, activations=self.act)

    def time_linear(self, *params):
        self._run()

    def peakmem_linear(self, *params):
        self._run()

    def track_linear_gbs(self, *params):
        s = best_seconds(self._run, repeat=5, number=5)
        return nbytes(self.w) / s / 1e9
    track_linear_gbs.unit = "GB/s"


class LinearPrefill:
    """128 tokens against one matrix (the prefill path: token blocks reuse each row)."""
    params = (["attn-1024x1024", "gate-3584x1024"], ["q4", "bf16"], list(ISAS), list(THREADS),
              list(ACTIVATIONS))
    param_names = ["shape", "format", "isa", "threads", "activations"]
    timeout = 300

    def setup(self, shape, fmt, isa, threads, activations):
        setup_linear(self, shape, fmt, isa, threads, activations, tokens=128)

    def _run(self):
        K.linear(self.x, self.w, threads=self.threads, activations=self.act)

    def time_linear_128(self, *params):
        self._run()

    def track_gmacs(self, *params):
        s = best_seconds(self._run, repeat=3)
        return self.w.rows * self.w.cols * 128 / s / 1e9
    track_gmacs.unit = "GMAC/s"


class ExpertFFN:
    """The routed experts of one MoE layer, decode (T=1) and prefill (T=128), q4."""
    params = (list(FFN_GEOMETRY), [1, 128], list(ISAS), list(THREADS), list(ACTIVATIONS))
    param_names = ["geometry", "tokens", "isa", "threads", "activations"]
    timeout = 600

    def setup(self, geometry, tokens, isa, threads, activations):
        use(isa, threads)
        self.act = activations
        E, Kk, D, I = FFN_GEOMETRY[geometry]
        self.wg, self.wu = weight((E, I, D), "q4", 1), weight((E, I, D), "q4", 2)
        self.wd = weight((E, D, I), "q4", 3)
        rng = np.random.default_rng(4)
        self.x = rng.standard_normal((tokens, D)).astype(np.float32)
        self.ids = np.argsort(rng.random((tokens, E)), axis=1)[:, :Kk].astype(np.int32)
        self.weights = rng.random((tokens, Kk)).astype(np.float32)
        self.threads = threads
        n_used = len(np.unique(self.ids))
        self.bytes = n_used * (nbytes(self.wg) + nbytes(self.wu) + nbytes(self.wd))

    def _run(self):
        K.expert_ffn(self.x, self.ids, self.weights, self.wg, self.wu, self.wd,
                     threads=self.threads, activations=self.act)

    def time_expert_ffn(self, *params):
        self._run()

    def peakmem_expert_ffn(self, *params):
        self._run()

    def track_expert_ffn_gbs(self, *params):
        """Expert weight bytes per second (decode: the bandwidth figure that matters)."""
        return self.bytes / best_seconds(self._run, repeat=5) / 1e9
    track_expert_ffn_gbs.unit = "GB/s"


class RouteTopk:
    params = ([(1, 8, 2), (1, 64, 8), (128, 64, 8)], list(THREADS))
    param_names = ["T_E_K", "threads"]

    def setup(self, tek, threads):
        T, E, self.k = tek
        self.logits = np.random.default_rng(5).standard_normal((T, E)).astype(np.float32)
        self.threads = threads

    def time_route_topk(self, tek, threads):
        K.route_topk(self.logits, self.k, norm_topk_prob=True, threads=self.threads)


class AttendDecode:
    """One token's attention over a KV cache slice (the decode fast path), mixtral-mini heads
    (16 query / 4 kv heads, Dh 64), as the model passes it: a strided view of a larger cache."""
    params = ([32, 1024, 4096], list(ISAS), list(THREADS))
    param_names = ["keys", "isa", "threads"]

    def setup(self, keys, isa, threads):
        use(isa, threads)
        rng = np.random.default_rng(6)
        self.q = rng.standard_normal((16, 64)).astype(np.float32)
        self.k = rng.standard_normal((4, keys + 64, 64)).astype(np.float32)[:, :keys]
        self.v = rng.standard_normal((4, keys + 64, 64)).astype(np.float32)[:, :keys]
        self.out = np.empty((16, 64), np.float32)
        self.threads = threads

    def time_attend_decode(self, keys, isa, threads):
        K.attend_decode(self.q, self.k, self.v, 0.125, out=self.out, threads=self.threads)


class Dequantize:
    params = (["q4", "q8"],)
    param_names = ["format"]

    def setup(self, fmt):
        self.w = weight((1024, 1024), fmt)

    def time_dequantize(self, fmt):
        K.dequantize(self.w)

    def peakmem_dequantize(self, fmt):
        K.dequantize(self.w)


class ReadBandwidth:
    """The machine's read bandwidth, the roofline's denominator (64 MiB: past the caches)."""
    params = (list(THREADS),)
    param_names = ["threads"]
    timeout = 120

    def track_read_gbs(self, threads):
        return K.read_bandwidth(64 * 2**20, threads=threads, repeats=5)
    track_read_gbs.unit = "GB/s"
