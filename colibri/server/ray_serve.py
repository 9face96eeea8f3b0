"""colibri on Ray Serve: the same OpenAI routes, replicated over a Ray cluster.

    colibri serve MODEL --ray [--replicas 2] [--port 8000]          # a local or joined cluster
    serve run colibri.server.ray_serve:build model=/models/m.colibri replicas=2
    serve deploy serve_config.yaml                                  # docs/serving.md has one

Each replica is an ordinary colibri server inside a Ray actor: `ColibriDeployment` builds
the FastAPI app with `create_app(settings)` when the replica starts (Ray's late-bound ingress,
`__serve_build_asgi_app__`), and the app's lifespan opens the model file -- the path in the
settings, read from the disk of the node the replica runs on (every node needs the file at
that path; nothing is shipped through Ray's object store) -- and starts its scheduler. Ray's
HTTP proxy on each node forwards /v1/completions, /v1/chat/completions, /v1/models, /health
and /metrics to a replica (streaming responses pass through as they are produced).

Autoscaling: give `autoscaling` (Ray's AutoscalingConfig fields) instead of a fixed replica
count, for example {"min_replicas": 1, "max_replicas": 4, "target_ongoing_requests":
parallel}: a replica holds `parallel` requests in its batch at once, so that many ongoing
requests per replica is full use; `max_ongoing_requests` is set to parallel + max_queue,
what a replica admits before it would answer 429 itself, so Ray queues the excess in front
of the replicas instead. Replicas of one node share the model file's page cache, so more
replicas on a node cost their KV caches and Python heaps, not more copies of the weights.

Reloading: a new model version is rolled out the Ray way -- deploy again (`serve deploy`,
or `serve.run` with the same name), and Ray replaces the replicas one by one while the old
ones finish their requests. SIGHUP and POST /admin/reload reach one replica only, so they
are not the way to reload a Ray deployment.

ray is an optional dependency (the `ray` extra): this module imports it at the top, and
nothing else in colibri imports this module unless --ray is given.

Binding: the local Ray instance `run` starts (no address given) binds every service it starts
-- GCS, raylet, object manager, the replicas' workers, the agents -- to 127.0.0.1, unless
`node_ip` names another address (the one other nodes reach this one at). Ray binds its gRPC
servers to loopback only when the node address is 127.0.0.1, and replaces a loopback
address asked for by the machine's outward one unless its single-machine switch is off
(RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0, ray_constants.ENABLE_RAY_CLUSTER): start_local_ray
turns it off while Ray starts, in the environment Ray's processes inherit too, and checks
the address Ray reports.
"""
from __future__ import annotations

import logging
import signal
import threading
from dataclasses import asdict, replace
from typing import Any

import ray
from ray import serve

from ..ray_local import LOOPBACK, is_loopback, start_local_ray
from .app import create_app
from .settings import Settings, parse_bytes
from .workers import WorkerHeader

__all__ = ["ColibriDeployment", "deployment", "build", "run"]

log = logging.getLogger("colibri.server.ray")

DEPLOYMENT_NAME = "colibri"


def _replica_grpc_on_loopback() -> None:
    """Ray Serve binds each replica's inter-deployment gRPC server to [::]:0, every
    interface, whatever the node's address; on a node bound to loopback this binds it to
    127.0.0.1 instead. Called in the replica, before Ray starts that server (after the
    deployment's constructor); without the hook (another Ray) nothing changes."""
    from ray.serve._private import replica
    original = getattr(replica, "add_port_to_grpc_server", None)
    if original is None or getattr(original, "colibri_loopback", False):
        return

    def bind(server, address: str):
        return original(server, f"{LOOPBACK}:0" if address == "[::]:0" else address)
    bind.colibri_loopback = True
    replica.add_port_to_grpc_server = bind


@serve.ingress()
class ColibriDeployment:
    """One replica: the colibri app over settings (a Settings, or its fields as a dict)."""

    def __init__(self, settings: Settings | dict):
        if is_loopback(ray.util.get_node_ip_address()):
            _replica_grpc_on_loopback()
        if isinstance(settings, dict):
            settings = Settings(**settings)
        # the replica serves behind Ray's proxy: it binds nothing and writes no pid file
        self.settings = replace(settings, pid_file=None)

    def __serve_build_asgi_app__(self):
        """Called by Ray in the replica: the app, whose lifespan maps the model file."""
        app = create_app(self.settings)
        app.add_middleware(WorkerHeader)      # X-Colibri-Worker: the replica's pid
        return app


def deployment(settings: Settings, replicas: int = 1, autoscaling: dict | None = None,
               num_cpus: float | None = None):
    """The bound Ray Serve application of `settings`: `replicas` replicas, or `autoscaling`
    (a dict of Ray's AutoscalingConfig fields). num_cpus: the CPUs Ray reserves per replica
    (default: settings.threads, else 1)."""
    settings.check()
    options: dict[str, Any] = {
        "name": DEPLOYMENT_NAME,
        "max_ongoing_requests": settings.parallel + settings.max_queue,
        "ray_actor_options": {"num_cpus": num_cpus if num_cpus is not None
                              else (settings.threads or 1)},
        # a replica is healthy when its app answers; the model loads in the lifespan
        "health_check_period_s": 10,
    }
    if autoscaling:
        options["autoscaling_config"] = dict(autoscaling)
    else:
        options["num_replicas"] = replicas
    return serve.deployment(ColibriDeployment).options(**options).bind(asdict(settings))


def build(args: dict[str, str]):
    """The `serve run colibri.server.ray_serve:build key=value ...` builder.

    Keys: model (path on every node), replicas, parallel, ctx, kv_budget, prefix_cache, max_queue,
    threads, activations, kv_dtype, api_key, model_name, min_replicas / max_replicas /
    target_ongoing_requests (autoscaling instead of a fixed count), num_cpus."""
    args = dict(args)
    ints = ("parallel", "ctx", "max_queue", "threads", "prefill_chunk")
    fields = {k: (int(v) if k in ints else v) for k, v in args.items()
              if k in Settings.__dataclass_fields__}
    if "kv_budget" in fields:
        fields["kv_budget"] = parse_bytes(fields["kv_budget"])
    if "prefix_cache" in fields:
        v = fields["prefix_cache"]
        fields["prefix_cache"] = 0 if v.strip().lower() in ("0", "off") else parse_bytes(v)
    autoscaling = {k: float(args[k]) if k == "target_ongoing_requests" else int(args[k])
                   for k in ("min_replicas", "max_replicas", "target_ongoing_requests")
                   if k in args}
    unknown = set(args) - set(fields) - set(autoscaling) - {"replicas", "num_cpus"}
    if unknown:
        raise ValueError(f"unknown key(s) {', '.join(sorted(unknown))} for "
                         f"colibri.server.ray_serve:build")
    return deployment(Settings(**fields), replicas=int(args.get("replicas", 1)),
                      autoscaling=autoscaling or None,
                      num_cpus=float(args["num_cpus"]) if "num_cpus" in args else None)


def run(settings: Settings, replicas: int = 1, autoscaling: dict | None = None,
        address: str | None = None, num_cpus: float | None = None,
        node_ip: str = LOOPBACK) -> int:
    """`colibri serve --ray`: join the Ray cluster at `address` (None: start a local one,
    without the dashboard, its services bound to node_ip, loopback by default), serve the
    deployment through Ray's HTTP proxy on settings.host:settings.port, and block until
    SIGTERM / SIGINT; then shut Serve and Ray down."""
    if address is None:
        start_local_ray(node_ip)
    else:
        ray.init(address=address)
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    try:
        serve.start(http_options={"host": settings.host, "port": settings.port})
        serve.run(deployment(settings, replicas, autoscaling, num_cpus),
                  name=DEPLOYMENT_NAME, route_prefix="/")
        log.info("colibri on Ray Serve: http://%s:%d (%s)", settings.host, settings.port,
                 f"autoscaling {autoscaling}" if autoscaling else f"{replicas} replicas")
        stop.wait()
    finally:
        serve.shutdown()
        ray.shutdown()
    return 0
