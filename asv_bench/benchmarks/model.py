"""Benchmarks of a whole model: open, one decode step, a 128-token prefill, decode tokens/s,
on a small synthetic Mixtral-like model (random weights, common.SMALL_MIXTRAL: hidden 512,
expert intermediate 1024, 4 layers, 8 experts top-2, vocab 4096) at q4 and bf16, with the
q4 matrices on f32 (exact), int8 or int16 activations.

    asv continuous -b model main HEAD               # compare two commits
    asv run --quick -b model --python=same          # one pass on the installed package
"""
import os

import numpy as np

import colibri
from .common import THREADS, make_model, model_folder


def decode_one(model, token: int, cache) -> None:
    """One decode step as colibri bench's tg loop runs it (colibri.forward of one token on
    the cache): a call every commit of the suite has."""
    model.forward(np.array([token]), cache=cache, last_only=True)


class Model:
    params = (["q4", "bf16"], list(THREADS), ["f32", "int8", "int16"])
    param_names = ["format", "threads", "activations"]
    timeout = 600

    def setup_cache(self):
        folder = model_folder()
        return {q: make_model(os.path.join(folder, f"small-{q}.colibri"), quant=q)
                for q in ("q4", "bf16")}

    def setup(self, paths, fmt, threads, activations):
        if threads > (os.cpu_count() or 1):
            raise NotImplementedError(f"{threads} threads > {os.cpu_count()} CPUs")
        if activations != "f32" and fmt != "q4":
            raise NotImplementedError("quantized activations apply to q4/q8 matrices only")
        if activations not in getattr(colibri.kernels, "ACTIVATIONS", ("f32",)):
            raise NotImplementedError(f"activations={activations!r}: not in this commit")
        # the keyword whenever the commit has the option (its default is int16 from the
        # 16-bit-activations change on, f32 before); f32 without it: commits before the
        # option still run this suite
        has_option = hasattr(colibri.kernels, "ACTIVATIONS")
        kw = {"activations": activations} if has_option else {}
        self.model = colibri.load(paths[fmt], threads=threads, **kw)
        self.prompt = np.random.default_rng(0).integers(0, self.model.vocab_size, 128)
        self.cache = self.model.new_cache(ctx=1024)
        self.model.forward(self.prompt[:16], cache=self.cache, last_only=True)

    def teardown(self, paths, fmt, threads, activations):
        if getattr(self, "model", None) is not None:      # None: setup skipped the case
            self.model.close()

    def time_open(self, paths, fmt, threads, activations):
        colibri.load(paths[fmt], threads=threads).close()

    def time_decode_step(self, paths, fmt, threads, activations):
        if self.cache.remaining < 1:
            self.cache.truncate(16)
        decode_one(self.model, 7, self.cache)

    def time_prefill_128(self, paths, fmt, threads, activations):
        self.model.forward(self.prompt, cache=self.model.new_cache(ctx=128), last_only=True)

    def peakmem_prefill_128(self, paths, fmt, threads, activations):
        self.model.forward(self.prompt, cache=self.model.new_cache(ctx=128), last_only=True)

    def track_decode_tps(self, paths, fmt, threads, activations):
        """Tokens per second over 32 decode steps from a 16-token context."""
        import time
        cache = self.model.new_cache(ctx=64)
        self.model.forward(self.prompt[:16], cache=cache, last_only=True)
        t0 = time.perf_counter()
        for tok in self.prompt[16:48]:
            decode_one(self.model, int(tok), cache)
        return 32 / (time.perf_counter() - t0)
    track_decode_tps.unit = "tokens/s"
