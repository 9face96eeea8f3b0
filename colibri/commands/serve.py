"""colibri serve [MODEL]: the OpenAI-compatible HTTP server (colibri/server, docs/server.md).

The server needs the `server` extra (fastapi, pydantic, uvicorn, prometheus-client); it is
imported when the command runs, so the rest of the CLI works without it.
"""
from __future__ import annotations

import argparse

from ..errors import ColibriError
from ..server.settings import SAMPLING_DEFAULTS, Settings, parse_bytes
from ..extras import require_extra
from .common import (ACTIVATIONS_HELP, SHIPPED_MODEL, add_activations_arg, add_ctx_arg,
                     add_kv_dtype_arg, add_model_arg, add_seed_arg, add_threads_arg)


def _bytes(text: str) -> int:
    """argparse type: '6GiB', '512MB', '1000000' -> bytes."""
    try:
        return parse_bytes(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def _bytes_or_off(text: str) -> int:
    """argparse type: a size as _bytes, or 0 / off for none."""
    return 0 if text.strip().lower() in ("0", "off", "none") else _bytes(text)


def register(subparsers, parents=()) -> None:
    p = subparsers.add_parser(
        "serve", parents=list(parents), help="serve a model over an OpenAI-compatible HTTP API",
        description="Serve a .colibri model over HTTP: /v1/completions, /v1/chat/completions, "
                    "/v1/models, /health, /metrics and a chat page with the live routing at / "
                    "(off with --no-webui), with continuous batching over --parallel "
                    "slots. SIGHUP or SIGUSR1 reloads MODEL (validated first; the old model "
                    f"keeps serving if the new file is broken). {SHIPPED_MODEL} Needs the "
                    "server extra: pip install 'colibri[server]'.")
    add_model_arg(p)
    p.add_argument("--host", default="127.0.0.1",
                   help="address to bind (default: %(default)s; a non-loopback address needs "
                        "--api-key or --insecure)")
    p.add_argument("--port", type=int, default=8080, help="port (default: %(default)s; 0: any "
                                                           "free port)")
    p.add_argument("--parallel", "-np", type=int, default=4, metavar="N",
                   help="slots decoded together in each forward pass (default: %(default)s)")
    add_ctx_arg(p, help="tokens per request, prompt + completion (default: the model's "
                        "context, capped at 4096)")
    p.add_argument("--kv-budget", type=_bytes, default=None, metavar="BYTES",
                   help="KV cache bytes all requests may hold at once, e.g. 6GiB (default: "
                        "parallel x ctx x bytes per token)")
    p.add_argument("--max-queue", type=int, default=64, metavar="N",
                   help="requests that may wait for a slot; past it 429 (default: "
                        "%(default)s)")
    p.add_argument("--prefill-chunk", type=int, default=64, metavar="N",
                   help="prompt tokens per step, so running streams keep their pace "
                        "(default: %(default)s)")
    p.add_argument("--prefix-cache", type=_bytes_or_off, default=None, metavar="BYTES",
                   help="KV of prompt prefixes kept for later requests (shared system "
                        "prompts, chat turns, n > 1), e.g. 512MiB, inside --kv-budget; 0 or "
                        "off: none (default: whatever the budget's running requests leave)")
    p.add_argument("--api-key", default=None, metavar="KEY",
                   help="require 'Authorization: Bearer KEY' on every route but /health; "
                        "enables POST /admin/reload")
    p.add_argument("--insecure", action="store_true",
                   help="allow a non-loopback --host without --api-key")
    p.add_argument("--pid-file", default=None, metavar="FILE",
                   help="write the process id here at start (removed at exit)")
    p.add_argument("--max-body", type=_bytes, default=1 << 20, metavar="BYTES",
                   help="largest request body; past it 413 (default: 1MiB)")
    p.add_argument("--model-name", default=None, metavar="NAME",
                   help="the model id /v1/models lists (default: the file name's stem)")
    add_threads_arg(p)
    add_activations_arg(p, help=f"{ACTIVATIONS_HELP} (default: %(default)s)")
    add_kv_dtype_arg(p)
    p.add_argument("--draft", metavar="MODEL|prompt-lookup", default=None,
                   help="speculative decoding in every slot: drafts from n-gram matches in "
                        "the prompt and output (prompt-lookup) or from a smaller .colibri model "
                        "with the same tokenizer, verified in the batched pass")
    p.add_argument("--draft-tokens", type=int, default=4, metavar="K",
                   help="the most draft tokens per verification, 1..32 (default: %(default)s)")
    add_sampling_defaults(p)
    p.add_argument("--log-level", default="info",
                   choices=("critical", "error", "warning", "info", "debug"),
                   help="log level of the server (default: %(default)s)")
    p.add_argument("--no-webui", dest="webui", action="store_false",
                   help="do not serve the chat and routing page at / (docs/serving.md)")
    p.add_argument("--workers", type=int, default=1, metavar="N",
                   help="server processes behind the one port, over one mapping of MODEL "
                        "(default: %(default)s); SIGHUP/SIGUSR1 to the parent reload them "
                        "all, a worker that dies is restarted")
    p.add_argument("--ray", action="store_true",
                   help="serve through Ray Serve (the ray extra): --replicas replicas, each "
                        "mapping MODEL from its node's disk, behind Ray's HTTP proxy on "
                        "--host:--port")
    p.add_argument("--replicas", type=int, default=1, metavar="N",
                   help="Ray Serve replicas with --ray (default: %(default)s)")
    p.add_argument("--expert-shards", type=int, default=0, metavar="N",
                   help="put the experts of every MoE layer on N Ray actors (the ray extra; "
                        "not with --workers / --replicas): this server keeps the dense part, "
                        "each actor maps "
                        "MODEL from its node's disk and holds 1/N of the experts "
                        "(docs/serving.md#experts-on-several-machines)")
    p.add_argument("--shard-threads", type=int, default=None, metavar="N",
                   help="kernel threads per expert shard (default: --threads)")
    p.add_argument("--shard-memory-budget", type=_bytes, default=None, metavar="BYTES",
                   help="with --expert-shards: bytes of experts each shard may hold, e.g. "
                        "2GiB (an expert cache per shard; default: no limit)")
    p.add_argument("--ray-address", default=None, metavar="ADDRESS",
                   help="the Ray cluster to join with --ray or --expert-shards (default: "
                        "start a local one)")
    p.add_argument("--ray-node-ip", default="127.0.0.1", metavar="ADDRESS",
                   help="the address the services of the local Ray instance (GCS, raylet, "
                        "object manager, workers) bind and advertise, with --ray and no "
                        "--ray-address (default: %(default)s, this machine only; give the "
                        "machine's address for other nodes to join)")
    p.set_defaults(func=run)


def add_sampling_defaults(p: argparse.ArgumentParser) -> None:
    """llama-server's sampling flags: the values of the fields a request leaves out."""
    g = p.add_argument_group("request defaults", "as llama-server: what a request that "
                             "leaves the field out gets (default: the OpenAI API's)")
    g.add_argument("-n", "--n-predict", "--max-tokens", dest="max_tokens", type=int,
                   default=None, metavar="N",
                   help="max_tokens; -1: the rest of the context (OpenAI's: 16 on "
                        "/v1/completions, the rest of the context on chat)")
    g.add_argument("--temp", dest="temperature", type=float, default=None, metavar="T",
                   help="temperature; 0 = greedy (OpenAI's: 1)")
    g.add_argument("--top-k", dest="top_k", type=int, default=None, metavar="K",
                   help="top_k; 0 = off (default: 0)")
    g.add_argument("--top-p", dest="top_p", type=float, default=None, metavar="P",
                   help="top_p; 1 = off (OpenAI's: 1)")
    g.add_argument("--min-p", dest="min_p", type=float, default=None, metavar="P",
                   help="min_p; 0 = off (default: 0)")
    g.add_argument("--repeat-penalty", dest="repetition_penalty", type=float, default=None,
                   metavar="R", help="repetition_penalty; 1 = off (default: 1)")
    add_seed_arg(g, None, help="seed of requests without one (choice j of a request gets "
                               "seed + j; default: a fresh one per request)")


def settings_from_args(args: argparse.Namespace) -> Settings:
    """The server's Settings for the parsed arguments."""
    return Settings(model=args.model, host=args.host, port=args.port, parallel=args.parallel,
                    ctx=args.ctx, kv_budget=args.kv_budget, max_queue=args.max_queue,
                    prefill_chunk=args.prefill_chunk, prefix_cache=args.prefix_cache,
                    api_key=args.api_key,
                    insecure=args.insecure, pid_file=args.pid_file, max_body=args.max_body,
                    threads=args.threads, activations=args.activations, kv_dtype=args.kv_dtype,
                    model_name=args.model_name, log_level=args.log_level,
                    draft=args.draft, draft_tokens=args.draft_tokens,
                    webui=args.webui, expert_shards=args.expert_shards,
                    ray_address=args.ray_address, shard_threads=args.shard_threads,
                    shard_memory_budget=args.shard_memory_budget,
                    defaults={k: getattr(args, k) for k in SAMPLING_DEFAULTS
                              if getattr(args, k) is not None})


def run(args: argparse.Namespace) -> int:
    settings = settings_from_args(args)
    settings.check()                     # before importing uvicorn: a bad flag fails fast
    for module in ("fastapi", "uvicorn", "pydantic", "prometheus_client"):  # the server extra
        require_extra(module, "server", "colibri serve")
    from ..server.run import serve
    if args.workers < 1 or args.replicas < 1:
        raise ColibriError(f"--workers {args.workers} / --replicas {args.replicas}: must be "
                           f">= 1")
    if args.expert_shards:
        require_extra("ray", "ray", "colibri serve --expert-shards")
        if args.replicas > 1 or args.workers > 1:
            raise ColibriError("--expert-shards serves one model from one process over its "
                               "shards: not with --replicas or --workers")
        serve(settings)              # the model's experts on Ray actors (colibri.load)
        return 0
    if args.ray:
        require_extra("ray.serve", "ray", "colibri serve --ray")
        from ..server.ray_serve import run as run_on_ray
        return run_on_ray(settings, replicas=args.replicas, address=args.ray_address,
                          node_ip=args.ray_node_ip)
    if args.workers > 1:
        from ..server.workers import run_workers
        return run_workers(settings, args.workers)
    serve(settings)
    return 0
