"""colibri chat [MODEL]: talk with a model in the terminal (colibri.chat_cli)."""
from __future__ import annotations

import argparse

from ..errors import ColibriError
from .common import (ACTIVATIONS_HELP, SHIPPED_MODEL, add_activations_arg, add_ctx_arg,
                     add_kv_dtype_arg, add_memory_args, add_model_arg, add_seed_arg,
                     add_threads_arg, check_at_least, open_model)


def register(subparsers, parents=()) -> None:
    p = subparsers.add_parser(
        "chat", parents=list(parents), help="chat with a model in the terminal",
        description="An interactive conversation using the model's chat template, each reply "
                    "streamed as it is sampled. /reset forgets the conversation, /routing "
                    "shows each token's experts, /help lists the commands, Ctrl-C stops a "
                    f"reply, Ctrl-D leaves. {SHIPPED_MODEL}")
    add_model_arg(p)
    p.add_argument("-sys", "--system", "--system-prompt", dest="system", default=None,
                   metavar="TEXT", help="a system prompt that opens the conversation")
    p.add_argument("-n", "--max-new-tokens", "--n-predict", type=int, default=256, metavar="N",
                   help="tokens per reply at most (default: %(default)s)")
    p.add_argument("--temp", type=float, default=0.7, metavar="T",
                   help="temperature; 0 = greedy (default: %(default)s)")
    p.add_argument("--top-k", type=int, default=40, metavar="K", help="(default: %(default)s)")
    p.add_argument("--top-p", type=float, default=0.95, metavar="P", help="(default: %(default)s)")
    p.add_argument("--min-p", type=float, default=0.05, metavar="P", help="(default: %(default)s)")
    p.add_argument("--ignore-eos", action="store_true",
                   help="do not stop a reply at the end-of-turn token (up to -n)")
    add_seed_arg(p, None, help="random seed (default: a fresh one)")
    add_threads_arg(p)
    add_ctx_arg(p, help="tokens the conversation may hold; its oldest exchanges are dropped "
                        "beyond (default: the model's context)")
    add_activations_arg(p, help=f"{ACTIVATIONS_HELP} (default: %(default)s)")
    add_kv_dtype_arg(p)
    add_memory_args(p)
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from ..chat_cli import ChatSession, run_chat
    check_at_least([("-n", args.max_new_tokens, 1), ("--top-k", args.top_k, 0),
                    ("-c", args.ctx, 2)])
    for name, value, ok in (("--temp", args.temp, 0 <= args.temp <= 2),
                            ("--top-p", args.top_p, 0 < args.top_p <= 1),
                            ("--min-p", args.min_p, 0 <= args.min_p <= 1)):
        if not ok:
            raise ColibriError(f"{name} {value} is out of range")
    model = open_model(args)
    session = ChatSession(model, system=args.system, max_new_tokens=args.max_new_tokens,
                          ctx=args.ctx,
                          sampling=dict(temperature=args.temp, top_k=args.top_k,
                                        top_p=args.top_p, min_p=args.min_p, seed=args.seed),
                          ignore_eos=args.ignore_eos)
    return run_chat(session)
