"""The engine behind the routes: the model version serving now, and the reload that swaps it.

    holder = ModelHolder(settings)                  # opens settings.model_path()
    holder = ModelHolder(settings, file=f)          # or over an already-opened ColibriFile
    holder.start()                                  # the scheduler thread (after any fork)
    engine = holder.current                         # Engine: model, scheduler, version
    result = holder.reload()                        # blocking: call it from a thread
    holder.stop()

An `Engine` is one model version: a Model over one mapping and the Scheduler that batches
its requests. A request keeps the Engine it was submitted to, so on reload the requests in
flight finish on the old mapping while new ones go to the new Engine; the old scheduler is
drained and stopped in a background thread, and the old mapping goes away with the last
view of it.

For process managers (`--workers N`, Ray Serve): ModelHolder does no I/O beyond opening the
file and starts no thread until start(), so a parent can open the file and build the holder,
fork, and let each child call start() (the app's lifespan does); the scheduler thread must
not exist before a fork.
"""
from __future__ import annotations

import hashlib
import logging
import threading
import time
from dataclasses import dataclass

from ..engine.model import Model
from ..errors import ColibriError
from ..format import ColibriFile
from ..format.validation import validate
from ..generation.batching import Scheduler
from .settings import Settings

__all__ = ["Engine", "ModelHolder", "ReloadResult", "version_of"]

log = logging.getLogger("colibri.server")


def version_of(file: ColibriFile) -> str:
    """A short id of what was mapped (device, inode, size, mtime): the same file gives the
    same id in every worker, a replaced file a new one."""
    return hashlib.blake2b(repr(file.identity).encode(), digest_size=6).hexdigest()


class Engine:
    """One model version: model (Model), scheduler (Scheduler), version (str), loaded_at."""

    def __init__(self, model: Model, settings: Settings):
        self.model = model
        self.version = version_of(model.file)
        self.path = model.file.path
        self.loaded_at = time.time()
        self.tokenizer = model.tokenizer          # built now, not on the first request
        sizes = dict(parallel=settings.parallel, ctx=settings.ctx,
                     kv_budget=settings.kv_budget, max_queue=settings.max_queue,
                     prefill_chunk=settings.prefill_chunk,
                     prefix_cache=settings.prefix_cache)
        if settings.draft is None:
            self.scheduler = Scheduler(model, **sizes)
        else:                                     # speculation in every slot
            from ..generation.speculative_batch import Speculation, SpeculativeScheduler
            self.scheduler = SpeculativeScheduler(
                model, Speculation(model, settings.draft, settings.draft_tokens), **sizes)
        self.ctx = self.scheduler.ctx

    @property
    def fingerprint(self) -> str:
        """What responses carry in system_fingerprint (and X-Colibri-Model-Version)."""
        return f"colibri-{self.version}"

    def start(self) -> None:
        self.scheduler.start()

    def retire(self) -> threading.Thread:
        """Finish the requests this engine holds, then stop it (in a background thread) and
        drop its prefix cache (keyed by this version: no later request could use it)."""
        def drain():
            self.scheduler.stop(drain=True)
            self.scheduler.prefix_cache.clear()
            if self.model.expert_shards is not None:     # its actors: the new version has its own
                self.model.expert_shards.close()
            log.info("model version %s retired (its requests finished)", self.version)
        t = threading.Thread(target=drain, name=f"colibri-retire-{self.version}", daemon=True)
        t.start()
        return t


@dataclass
class ReloadResult:
    """What a reload did: reloaded (a new version serves), unchanged (the same file: nothing
    to do), the versions, what happened (or why the file was refused)."""
    reloaded: bool
    unchanged: bool
    version: str
    previous: str
    message: str
    seconds: float

    def as_dict(self) -> dict:
        return {"reloaded": self.reloaded, "unchanged": self.unchanged, "version": self.version,
                "previous": self.previous, "message": self.message,
                "seconds": round(self.seconds, 3)}


def open_checked(path: str) -> ColibriFile:
    """Open `path` and validate it as `colibri inspect --validate` does (every byte:
    checksums, gaps, non-finite values; the typed config against the tensors and
    config.json; the tokenizer and chat template built and run once): ColibriError listing
    the first problems when the file is not healthy."""
    f = ColibriFile(path)
    problems = validate(f)
    if problems:
        f.close()
        more = f" (and {len(problems) - 3} more)" if len(problems) > 3 else ""
        raise ColibriError(f"{path}: {'; '.join(problems[:3])}{more}")
    return f


class ModelHolder:
    """The Engine serving now (`current`), built from settings, and its hot reload.

    settings: the server's Settings (model path, threads, activations, slots, budgets).
    file: an already-opened ColibriFile to serve instead of opening settings.model_path()
        (a pre-fork parent maps it once); it is not validated again here.
    validate: on the first open, read the whole file and check it (as reload always does).
    """

    def __init__(self, settings: Settings, file: ColibriFile | None = None,
                 validate: bool = False):
        self.settings = settings
        self.path = str(settings.model_path())
        if file is None:
            file = open_checked(self.path) if validate else ColibriFile(self.path)
        self.current = self._engine(file)
        self.reloads = 0
        self.failed_reloads = 0
        self._reload_lock = threading.Lock()
        self._retiring: list[threading.Thread] = []
        self._started = False

    def _engine(self, file: ColibriFile) -> Engine:
        s = self.settings
        return Engine(Model(file, threads=s.threads, activations=s.activations,
                            kv_dtype=s.kv_dtype, expert_shards=s.expert_shards,
                            ray_address=s.ray_address, shard_threads=s.shard_threads,
                            memory_budget=s.shard_memory_budget), s)

    def start(self) -> None:
        """Start the current engine's scheduler thread (idempotent)."""
        self._started = True
        self.current.start()

    def stop(self, drain: bool = False) -> None:
        """Stop serving: cancel (or, drain=True, finish) what runs; wait for retiring engines."""
        self.current.scheduler.stop(drain=drain)
        for t in self._retiring:
            t.join()
        if self.current.model.expert_shards is not None:
            self.current.model.expert_shards.close()

    def reload(self) -> ReloadResult:
        """Reopen the model file named at start: validate the new file fully, build its
        engine, swap it in, retire the old one. A file that fails validation (or cannot be
        opened) is refused with a log line and the old version keeps serving. An unchanged
        file (same device, inode, size and mtime) is not reloaded. Blocking (a full read of
        the file): call it from a thread. One reload at a time; a second caller waits."""
        t0 = time.perf_counter()
        with self._reload_lock:
            old = self.current

            def refused(e: Exception) -> ReloadResult:
                self.failed_reloads += 1
                msg = f"reload refused, version {old.version} keeps serving: {e}"
                log.error("%s", msg)
                return ReloadResult(False, False, old.version, old.version, msg,
                                    time.perf_counter() - t0)

            try:
                f = open_checked(self.path)
            except (ColibriError, OSError) as e:
                return refused(e)
            if version_of(f) == old.version:
                f.close()
                return ReloadResult(False, True, old.version, old.version,
                                    "the file is unchanged; nothing to reload",
                                    time.perf_counter() - t0)
            try:
                new = self._engine(f)
            except (ColibriError, ValueError) as e:
                return refused(e)
            if self._started:
                new.start()
            self.current = new                    # new requests go here from now on
            self.reloads += 1
            self._retiring = [t for t in self._retiring if t.is_alive()] + [old.retire()]
            seconds = time.perf_counter() - t0
            log.info("reloaded %s: version %s -> %s in %.2f s", self.path, old.version,
                     new.version, seconds)
            return ReloadResult(True, False, new.version, old.version, "reloaded", seconds)
