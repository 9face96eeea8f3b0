"""The experts of one model spread over several Ray actors (expert parallelism on CPUs).

    model = colibri.load("big.colibri", expert_shards=4)            # a local Ray instance
    model = colibri.load("big.colibri", expert_shards=4, ray_address="auto")   # a cluster
    colibri serve big.colibri --expert-shards 4 [--ray-address HOST:6379]

The driver (this process) keeps the dense part: embeddings, attention, norms, routers, shared
experts, the head. Each of N actors owns a disjoint set of the experts of every MoE layer
(`plan`: balanced by a routing trace's counts, else round-robin) and maps the model file
from its own node's disk (the path the driver was given; every node needs the file there, as
with `--ray --replicas`); it touches only its own experts' byte ranges, so its memory is its
share of the experts.

Per MoE layer and forward call the driver sends every actor that owns one of the chosen
experts, in one call, the layer's input rows x (T, D) and the (token, k) slots it owns; the
actor runs the same expert kernels the single process runs, each slot with weight 1, and
returns one output row per slot. The driver then adds the slots' outputs per token in the
single process's order (k order for the fused kernel, ascending expert id for
BiasedExperts), each product rounded and then added as the kernels do, so the logits are
bit-identical to one process (tests/test_expert_shards.py, every family, N = 1, 2, 4).
While the actors work, the driver runs the layer's shared expert.

Failure: an actor that dies is restarted by Ray (max_restarts) and maps its shard again; a
call that was in flight on it raises ExpertShardError naming the shard and the layer (no
hang: every wait has a timeout), and later calls reach the restarted actor. Figures per
shard (calls, slots, seconds waited) in `stats()` and the server's /metrics.

Shapes: T token rows, K experts per token, D hidden size, M MoE layers, E experts,
N shards.
"""
from __future__ import annotations

import os
import threading
import time
from dataclasses import dataclass, field

import numpy as np

from .expert_source import ShardedExperts, without
from .shard_worker import ExpertShardError, ShardWorker, fingerprint

__all__ = ["DEFAULT_TIMEOUT", "MAX_SHARDS", "ExpertShardError", "ExpertShards", "ShardWorker",
           "budget_check", "capacity_check", "fingerprint", "plan", "shard_experts"]

MAX_SHARDS = 256
TRANSPORTS = ("graph", "call")   # Ray's compiled graph (the faster: docs/serving.md), actor calls
DEFAULT_TIMEOUT = 300.0          # seconds a layer's call may take (a restart reloads a shard)


def plan(n_layers: int, n_experts: int, n_shards: int,
         counts: np.ndarray | None = None) -> np.ndarray:
    """The owner of every expert: int32 (M, E), values in [0, N).

    counts: int (M, E) tokens that chose each expert (a routing trace's expert_counts), or
    None. With counts, each layer's experts go heaviest first to the shard with the least
    load so far (ties: the fewest experts, then the lowest shard), so the shards see about
    equal work; without, round-robin (expert e of every layer on shard e mod N). N may not
    exceed E: every shard owns at least one expert of every layer.
    """
    if isinstance(n_shards, bool) or not isinstance(n_shards, (int, np.integer)) \
            or not 1 <= n_shards <= min(n_experts, MAX_SHARDS):
        raise ValueError(f"expert_shards must be an integer in 1..{min(n_experts, MAX_SHARDS)} "
                         f"(the model has {n_experts} experts per layer), got {n_shards!r}")
    owner = np.empty((n_layers, n_experts), np.int32)
    if counts is None:
        owner[:] = np.arange(n_experts, dtype=np.int32) % n_shards
        return owner
    counts = np.asarray(counts)
    if counts.shape != (n_layers, n_experts):
        raise ValueError(f"routing counts have shape {counts.shape}, expected "
                         f"({n_layers}, {n_experts}) (MoE layers, experts)")
    for j in range(n_layers):
        load = np.zeros(n_shards, np.int64)
        held = np.zeros(n_shards, np.int64)
        for e in np.argsort(-counts[j], kind="stable"):
            free = np.flatnonzero(held < -(-n_experts // n_shards))   # at most ceil(E / N)
            s = free[np.lexsort((free, held[free], load[free]))[0]]
            owner[j, e] = s
            load[s] += int(counts[j, e])
            held[s] += 1
    return owner


def _first_line(e: BaseException) -> str:
    """The error's type and first line, and its last line when that differs (Ray puts the
    actor's own exception there)."""
    lines = [ln.strip() for ln in str(e).splitlines() if ln.strip()]
    text = lines[0][:300] if lines else ""
    if len(lines) > 1:
        text += f" ... {lines[-1][:300]}"
    return f"{type(e).__name__}: {text}"


def capacity_check(nodes: list[dict], n: int, cpus: float) -> None:
    """Refuse, before any actor starts, n shards of `cpus` Ray CPUs each that the cluster's
    alive nodes (ray.nodes()) cannot hold even when idle: Ray would leave the rest pending
    until the start timeout, saying nothing. Each node holds floor(its CPUs / cpus)."""
    if cpus <= 0:
        return
    alive = [nd for nd in nodes if nd.get("Alive")]
    fits = sum(int(nd.get("Resources", {}).get("CPU", 0) // cpus) for nd in alive)
    if fits < n:
        per_node = ", ".join(f"{nd.get('NodeManagerAddress', '?')}: "
                             f"{nd.get('Resources', {}).get('CPU', 0):g}" for nd in alive)
        raise ExpertShardError(
            f"expert shards: {n} shards of {cpus:g} Ray CPU(s) each do not fit the cluster, "
            f"which holds {fits} (CPUs per node: {per_node or 'no alive node'}); add nodes "
            f"(ray start --address ... --num-cpus T), or lower the shards or the threads per "
            f"shard (--shard-threads)")


def budget_check(owner: np.ndarray, slot_bytes: int, budget: int) -> None:
    """MemoryBudgetError unless `budget` bytes hold, on every shard, the most experts it
    owns in one layer (owner: plan()'s table; slot_bytes: one expert block, page-rounded)."""
    from .expert_cache import MemoryBudgetError, check_memory_budget
    check_memory_budget(budget)
    for s in range(int(owner.max()) + 1):
        need = int((owner == s).sum(axis=1).max()) * slot_bytes
        if budget < need:
            raise MemoryBudgetError(
                f"memory budget {budget} bytes per expert shard is below what shard {s} "
                f"needs: its largest layer's experts, {need} bytes "
                f"({need // slot_bytes} x {slot_bytes})")


@dataclass
class ShardStats:
    """Per shard: calls made, slots (token-expert pairs) sent, seconds from the call to its
    result (the round trip as the driver saw it), failures."""
    calls: np.ndarray
    slots: np.ndarray
    seconds: np.ndarray
    failures: np.ndarray
    lock: threading.Lock = field(default_factory=threading.Lock)

    @classmethod
    def zeros(cls, n: int) -> "ShardStats":
        return cls(np.zeros(n, np.int64), np.zeros(n, np.int64), np.zeros(n, np.float64),
                   np.zeros(n, np.int64))


class ExpertShards:
    """N Ray actors holding a model's experts; attach() routes every MoE layer through them.

    model: the driver's Model; n: shards; owner: plan()'s table or None (round-robin);
    threads: kernel threads per actor (None: its node's physical cores); num_cpus: Ray CPUs
    each actor reserves (default threads, 1 when None); timeout: seconds a call may take;
    latency: seconds each actor sleeps per call (an injected network delay, for measuring);
    memory_budget: bytes each actor's experts may hold (ShardWorker), None: no limit;
    transport: "graph" (default) sends each layer's call to every shard at once through a
    Ray compiled graph (shared-memory channels; each shard picks its own slots), "call" one
    actor call per shard that owns a chosen expert (scripts/bench_expert_shards.py measures
    both). Ray must be initialised (colibri.load does it).
    """

    def __init__(self, model, n: int, *, owner: np.ndarray | None = None,
                 threads: int | None = None, num_cpus: float | None = None,
                 timeout: float = DEFAULT_TIMEOUT, max_restarts: int = -1,
                 latency: float = 0.0, memory_budget: int | None = None,
                 transport: str = "graph"):
        import ray
        if transport not in TRANSPORTS:
            raise ValueError(f"transport must be one of {', '.join(TRANSPORTS)}, got "
                             f"{transport!r}")
        self.transport = transport
        self._ray = ray
        f = model.file
        layers = list(model.moe_layers)
        self.layers = layers
        self.n = int(n)
        self.owner = plan(len(layers), f.n_experts, self.n) if owner is None else owner
        self.timeout = float(timeout)
        self.version = fingerprint(f)
        self.stats_ = ShardStats.zeros(self.n)
        self.K = model.config.num_experts_per_tok
        cpus = (threads or 1) if num_cpus is None else num_cpus
        capacity_check(ray.nodes(), self.n, cpus)
        worker = ray.remote(ShardWorker).options(
            num_cpus=cpus,
            max_restarts=max_restarts, max_task_retries=0,
            scheduling_strategy="SPREAD",      # one shard per node while nodes last
            runtime_env={"env_vars": {"COLIBRI_NUM_THREADS": str(threads)}} if threads else None)
        path = os.path.abspath(f.path)
        t = threads or model.threads
        self.actors = []
        for s in range(self.n):
            owned = {layer: np.flatnonzero(self.owner[j] == s).tolist()
                     for j, layer in enumerate(layers)}
            self.actors.append(worker.remote(path, self.version, owned, t, model.activations,
                                             s, latency, memory_budget))
        self.pids = self._get([a.ready.remote() for a in self.actors], "start")
        self.nodes = self._get([a.node.remote() for a in self.actors], "start")  # host/node id
        self._suspect: set[int] = set()       # shards whose last call failed
        self._graph = self._compile() if transport == "graph" else None
        self._model = model
        self._attached = []             # (MoE, its ShardedExperts)
        self.attach(model)

    # -- the calls ----------------------------------------------------------------------------
    def _get(self, refs, what: str):
        """ray.get of the ready() refs at start, as ExpertShardError on failure or timeout."""
        ray = self._ray
        try:
            return ray.get(refs, timeout=self.timeout)
        except ray.exceptions.GetTimeoutError:
            raise ExpertShardError(f"expert shards: no answer to {what} within "
                                   f"{self.timeout:.0f} s") from None
        except ray.exceptions.RayError as e:
            raise ExpertShardError(f"expert shards failed {what}: {_first_line(e)}") from None

    def start(self, layer: int, j: int, x: np.ndarray, ids: np.ndarray):
        """Send layer `layer`'s (MoE index j) input x (T, D) and ids (T, K) to the shards
        owning the chosen experts; returns what finish() needs."""
        T, K = ids.shape
        if self.transport == "graph":
            if self._graph is None:              # torn down by a failure: the shards back
                for s in range(self.n):
                    self._await_restart(s)
                self._graph = self._compile()
            refs = self._graph.execute((layer, x, ids))
            return "graph", refs, T * K, x.shape[1], layer, time.perf_counter()
        flat = ids.reshape(-1)
        owner = self.owner[j][flat]                                      # (T*K,)
        xr = x if T == 1 else self._ray.put(x)
        calls = []
        for s in np.unique(owner).tolist():
            if s in self._suspect:
                self._await_restart(s)
            slots = np.flatnonzero(owner == s)
            calls.append((s, slots, self.actors[s].run.remote(layer, xr, slots, flat[slots],
                                                              K)))
        return "call", calls, T * K, x.shape[1], layer, time.perf_counter()

    def _result(self, s: int, ref, layer: int, deadline: float) -> np.ndarray:
        """Shard s's answer to ref; ExpertShardError when its actor died (or was
        restarting), it raised, or the timeout passed. The shard is then marked: the next
        call to it first waits for the actor Ray restarts."""
        ray = self._ray
        try:
            return ray.get(ref, timeout=max(0.0, deadline - time.perf_counter()))
        except ray.exceptions.GetTimeoutError:
            ray.cancel(ref, force=False)
            problem = f"no answer within {self.timeout:.0f} s"
        except ray.exceptions.RayError as e:
            problem = _first_line(e)
        with self.stats_.lock:
            self.stats_.failures[s] += 1
            self._suspect.add(s)
        raise ExpertShardError(f"expert shard {s} failed layer {layer}: {problem} (Ray "
                               f"restarts a dead actor; later calls reach it)")

    def _await_restart(self, s: int) -> None:
        """Before a call to a shard whose last call failed: wait (at most the timeout) until
        its actor answers again."""
        ray = self._ray
        deadline = time.perf_counter() + self.timeout
        while True:
            try:
                self.pids[s] = ray.get(self.actors[s].ready.remote(),
                                       timeout=max(0.0, deadline - time.perf_counter()))
                break
            except ray.exceptions.ActorUnavailableError as e:   # restarting: ask again
                if time.perf_counter() > deadline:
                    raise ExpertShardError(f"expert shard {s} has not come back within "
                                           f"{self.timeout:.0f} s: {_first_line(e)}") from None
                time.sleep(0.05)
            except ray.exceptions.RayError as e:
                raise ExpertShardError(f"expert shard {s} has not come back: "
                                       f"{_first_line(e)}") from None
        with self.stats_.lock:
            self._suspect.discard(s)

    def finish(self, pending) -> np.ndarray:
        """The slot outputs float32 (T*K, D) of a start()."""
        kind, calls, TK, D, layer, t0 = pending
        if kind == "graph":
            return self._finish_graph(calls, TK, D, layer, t0)
        deadline = t0 + self.timeout
        og = np.empty((TK, D), np.float32)
        st = self.stats_
        error = None
        for s, slots, ref in calls:
            try:
                og[slots] = self._result(s, ref, layer, deadline)
            except ExpertShardError as e:        # collect the others' answers first
                error = error or e
                continue
            dt = time.perf_counter() - t0
            with st.lock:
                st.calls[s] += 1
                st.slots[s] += slots.size
                st.seconds[s] += dt
        if error is not None:
            raise error
        return og

    def _compile(self):
        """The compiled graph: (layer, x, ids) to every shard's run_owned, all answers back."""
        from ray.dag import InputNode, MultiOutputNode
        with InputNode() as inp:
            node = MultiOutputNode([a.run_owned.bind(inp) for a in self.actors])
        return node.experimental_compile()

    def _finish_graph(self, refs, TK: int, D: int, layer: int, t0: float) -> np.ndarray:
        ray = self._ray
        og = np.empty((TK, D), np.float32)
        st = self.stats_
        for s, ref in enumerate(refs):
            try:
                slots, out = ray.get(ref, timeout=max(0.0, t0 + self.timeout
                                                      - time.perf_counter()))
            except Exception as e:   # noqa: BLE001 - the graph's errors are many: all end it
                why = _first_line(e)
            else:
                why = None
            if why is not None:
                # raised outside the except block, so the error carries no Ray exception: their
                # tracebacks hold the graph's zero-copy outputs, which must not outlive Ray
                # (freed after its shutdown, at exit, they crash the process)
                self._graph_failed(layer, why)
            og[slots] = out
            dt = time.perf_counter() - t0
            if slots.size:
                with st.lock:
                    st.calls[s] += 1
                    st.slots[s] += slots.size
                    st.seconds[s] += dt
        return og

    def _graph_failed(self, layer: int, why: str):
        """A graph call failed: find the shards that do not answer, tear the graph down
        (the next call waits for them and compiles it again), raise ExpertShardError."""
        ray = self._ray
        graph, self._graph = self._graph, None
        try:
            graph.teardown()
        except Exception:            # noqa: BLE001,S110 - a dead actor's graph: gone anyway
            pass
        bad = []                     # the shards that died (a new pid) or do not answer
        for s, a in enumerate(self.actors):
            try:
                pid = ray.get(a.ready.remote(), timeout=5)
            except ray.exceptions.RayError:
                bad.append(s)
                continue
            if pid != self.pids[s]:
                bad.append(s)
                self.pids[s] = pid
        with self.stats_.lock:
            for s in bad:
                self.stats_.failures[s] += 1
        who = (f"expert shard {bad[0]}" if len(bad) == 1 else
               f"expert shards {', '.join(map(str, bad))}" if bad else "the expert shards")
        raise ExpertShardError(f"{who} failed layer {layer}: {why} (Ray restarts "
                               f"a dead actor; later calls reach it)")

    # -- the model's side -----------------------------------------------------------------------
    def attach(self, model) -> None:
        """Every MoE layer of `model` runs its routed experts on the shards."""
        for j, layer in enumerate(self.layers):
            moe = model.layers[layer].ffn
            moe.expert_source = ShardedExperts(self, layer, j, moe.biased_experts is not None,
                                               moe.expert_source)
            self._attached.append((moe, moe.expert_source))

    def stats(self) -> dict:
        """Per shard: experts owned, actor pid, "host/Ray node id" where it started, calls,
        slots, seconds waited, failures."""
        st = self.stats_
        with st.lock:
            return {"shards": self.n, "per_shard": [
                {"shard": s, "pid": int(self.pids[s]), "node": self.nodes[s],
                 "experts": int((self.owner == s).sum()),
                 "calls": int(st.calls[s]), "slots": int(st.slots[s]),
                 "seconds": float(st.seconds[s]), "failures": int(st.failures[s])}
                for s in range(self.n)]}

    def close(self) -> None:
        """Detach from the model and stop the actors."""
        for moe, source in self._attached:
            moe.expert_source = without(moe.expert_source, source)
        self._attached = []
        graph, self._graph = getattr(self, "_graph", None), None
        if graph is not None:
            try:
                graph.teardown()
            except Exception:        # noqa: BLE001,S110 - Ray already shut down
                pass
        for a in self.actors:
            try:
                self._ray.kill(a, no_restart=True)
            except Exception:       # Ray already shut down
                pass
        self.actors = []


def shard_experts(model, n: int, *, ray_address: str | None = None,
                  threads: int | None = None, counts: np.ndarray | None = None,
                  timeout: float = DEFAULT_TIMEOUT, latency: float = 0.0,
                  memory_budget: int | None = None, transport: str = "graph"
                  ) -> ExpertShards:
    """Spread `model`'s experts over n Ray actors and route its MoE layers through them.

    ray_address: the Ray cluster to join ("auto", "HOST:PORT"); None: the running Ray of
    this process, else a new local instance bound to loopback (colibri.ray_local).
    threads: kernel threads per actor (None: the driver model's count); counts: int (M, E)
    routing counts to balance the shards by (a Trace's expert_counts), else round-robin;
    timeout: seconds a layer's call may take; latency: an injected per-call delay (seconds);
    memory_budget: bytes of experts each actor may hold (an expert cache per actor);
    transport: "graph" (Ray's compiled graph, the default) or "call" (ExpertShards).
    A model with shards already attached has them closed first.
    """
    from ..extras import require_extra
    require_extra("ray", "ray", "expert_shards")
    import ray
    if not model.moe_layers:
        raise ValueError(f"{model.file.path}: the model has no MoE layers to shard")
    owner = plan(len(model.moe_layers), model.file.n_experts, n, counts)
    if memory_budget is not None:
        from .expert_cache import memory_plan
        budget_check(owner, memory_plan(model.file).slot_bytes, memory_budget)
    if getattr(model, "expert_shards", None) is not None:
        model.expert_shards.close()
    if not ray.is_initialized():
        if ray_address is None:
            from ..ray_local import start_local_ray
            # logical CPUs enough for every actor's threads (one machine: they share it)
            start_local_ray(num_cpus=max(os.cpu_count() or 1, n * (threads or model.threads)))
        else:
            ray.init(address=ray_address)
    shards = ExpertShards(model, n, owner=owner, threads=threads or model.threads,
                          timeout=timeout, latency=latency, memory_budget=memory_budget,
                          transport=transport)
    model.expert_shards = shards
    return shards
