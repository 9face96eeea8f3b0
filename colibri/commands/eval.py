"""colibri eval [MODEL] --tasks T[,T...]: lm-evaluation-harness tasks on a .colibri file.

lm-eval's own evaluator (lm_eval.simple_evaluate) over colibri.evaluate.ColibriLM, with
lm-eval's options (both spellings: --num-fewshot and lm_eval's --num_fewshot), its results
table on stdout and, with --output-path, its own results_*.json and samples_*.jsonl files
(lm_eval.loggers.EvaluationTracker), so the files of `lm_eval --model hf` and of this
command compare line by line. docs/evaluation.md.
"""
from __future__ import annotations

import argparse
import os

from ..errors import ColibriError
from ..extras import require_extra
from .common import (ACTIVATIONS_HELP, SHIPPED_MODEL, add_activations_arg, add_kv_dtype_arg,
                     add_memory_args, add_model_arg, add_threads_arg, check_at_least,
                     open_model)

# lm-eval's default seeds: python random, numpy, torch, few-shot sampling
DEFAULT_SEEDS = (0, 1234, 1234, 1234)


def seed_list(text: str) -> list[int | None]:
    """argparse type, lm-eval's --seed: one integer for all four seeds, or four values
    (python,numpy,torch,fewshot), 'None' leaving that one unset."""
    items = []
    for item in text.split(","):
        item = item.strip()
        if item.lower() == "none":
            items.append(None)
            continue
        try:
            items.append(int(item))
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r}: seeds are integers or None") from None
    if len(items) == 1:
        return items * 4
    if len(items) != 4:
        raise argparse.ArgumentTypeError(f"{text!r}: give one seed or four "
                                         f"(python,numpy,torch,fewshot)")
    return items


def batch_size_arg(text: str) -> str:
    """argparse type: a positive integer, 'auto' or 'auto:N' (lm-eval's spellings)."""
    if text == "auto" or text.startswith("auto:") or (text.isdigit() and int(text) >= 1):
        return text
    raise argparse.ArgumentTypeError(f"{text!r} is not a positive integer or 'auto'")


def _add(p, name: str, **kwargs) -> None:
    """--name-with-hyphens and lm_eval's --name_with_underscores for one option."""
    flags = [f"--{name}"] + ([f"--{name.replace('-', '_')}"] if "-" in name else [])
    p.add_argument(*flags, **kwargs)


def register(subparsers, parents=()) -> None:
    p = subparsers.add_parser(
        "eval", parents=list(parents), help="score a model on lm-evaluation-harness tasks",
        description="Run lm-evaluation-harness tasks (multiple choice, rolling perplexity, "
                    "generation) on a .colibri file in process, through lm-eval's own "
                    "evaluator: the same requests, metrics, tables and output files as "
                    "`lm_eval --model hf` on the original checkpoint, with the same "
                    "conventions (BOS only where the tokenizer adds it, lm-eval's split of "
                    "context and continuation). Needs the eval extra. " + SHIPPED_MODEL)
    add_model_arg(p)
    _add(p, "tasks", required=True, metavar="T[,T...]",
         help="lm-eval task or group names, comma-separated (tasks lm-eval downloads need "
              "the network once; local YAML tasks via --include-path)")
    _add(p, "include-path", default=None, metavar="DIR",
         help="a folder of task YAML files to add to lm-eval's")
    _add(p, "limit", type=float, default=None, metavar="N",
         help="at most N documents per task (a fraction when below 1)")
    _add(p, "num-fewshot", type=int, default=None, metavar="K",
         help="few-shot examples in each context (default: the task's)")
    _add(p, "batch-size", type=batch_size_arg, default="16", metavar="B",
         help="sequences per forward pass when scoring and generation slots; 'auto' is 16 "
              "(default: %(default)s)")
    _add(p, "max-length", type=int, default=None, metavar="N",
         help="the longest sequence scored, in tokens (default: the model's context, as "
              "lm-eval's hf model)")
    _add(p, "output-path", default=None, metavar="PATH",
         help="folder (or .json file) for lm-eval's results file and, with --log-samples, "
              "its samples files")
    _add(p, "log-samples", action="store_true",
         help="keep every document's requests and answers (samples_*.jsonl)")
    _add(p, "apply-chat-template", nargs="?", const=True, default=False, metavar="NAME",
         help="render prompts with the model's chat template")
    _add(p, "fewshot-as-multiturn", action="store_true",
         help="with --apply-chat-template: few-shot examples as conversation turns")
    _add(p, "system-instruction", default=None, metavar="TEXT",
         help="a system message before each prompt")
    _add(p, "seed", type=seed_list, default=list(DEFAULT_SEEDS), metavar="S",
         help="lm-eval's seeds: one for all, or python,numpy,torch,fewshot (default: "
              + ",".join(map(str, DEFAULT_SEEDS)) + "); also the first sampled generation's")
    add_threads_arg(p)
    add_activations_arg(p, "-a", "--activations",
                        help=f"{ACTIVATIONS_HELP} (default: %(default)s; f32 with --kv-dtype "
                             f"f32 to score as the stored weights exactly)")
    add_kv_dtype_arg(p)
    add_memory_args(p)
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    require_extra("lm_eval", "eval", "colibri eval")
    check_at_least((("--num-fewshot", args.num_fewshot, 0), ("--max-length", args.max_length, 2)))
    if args.limit is not None and not args.limit > 0:
        raise ColibriError(f"--limit {args.limit} is out of range (must be > 0)")
    if args.fewshot_as_multiturn and not args.apply_chat_template:
        raise ColibriError("--fewshot-as-multiturn needs --apply-chat-template")
    if args.include_path is not None and not os.path.isdir(args.include_path):
        raise ColibriError(f"--include-path {args.include_path}: not a folder")
    tasks = [t.strip() for t in args.tasks.split(",") if t.strip()]
    if not tasks:
        raise ColibriError("--tasks: give at least one task name")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")     # as lm_eval's CLI

    import lm_eval
    from lm_eval.loggers import EvaluationTracker
    from lm_eval.tasks import TaskManager
    from lm_eval.utils import make_table

    from ..evaluate import ColibriLM

    manager = TaskManager(include_path=args.include_path)
    unknown = [t for t in tasks if t not in manager.all_tasks and not os.path.isfile(t)]
    if unknown:
        raise ColibriError(f"--tasks: unknown task {', '.join(map(repr, unknown))} (`lm_eval ls "
                           f"tasks` lists lm-eval's; local YAML tasks via --include-path)")
    seeds = args.seed
    limit = int(args.limit) if args.limit is not None and args.limit >= 1 else args.limit
    tracker = EvaluationTracker(output_path=args.output_path) if args.output_path else None
    model = open_model(args)
    # what lm-eval records of the model (results' config; the folder its files go in)
    model_args = (f"pretrained={model.file.path},threads={model.threads},"
                  f"activations={model.activations},kv_dtype={model.kv_dtype}")
    try:
        lm = ColibriLM(model, batch_size=args.batch_size, max_length=args.max_length,
                       seed=seeds[0] if seeds[0] is not None else DEFAULT_SEEDS[0])
        results = lm_eval.simple_evaluate(
            model=lm, tasks=tasks, num_fewshot=args.num_fewshot, limit=limit,
            model_args=model_args, log_samples=args.log_samples, evaluation_tracker=tracker,
            task_manager=manager,
            apply_chat_template=args.apply_chat_template,
            fewshot_as_multiturn=args.fewshot_as_multiturn,
            system_instruction=args.system_instruction,
            random_seed=seeds[0], numpy_random_seed=seeds[1], torch_random_seed=seeds[2],
            fewshot_random_seed=seeds[3])
    finally:
        model.close()
    samples = results.pop("samples", None)
    if tracker is not None:
        tracker.save_results_aggregated(results=results, samples=samples)
        if samples is not None:
            for task_name in results["configs"]:
                tracker.save_results_samples(task_name=task_name, samples=samples[task_name])
    print(f"colibri ({model_args}), limit: {args.limit}, num_fewshot: {args.num_fewshot}, "
          f"batch_size: {args.batch_size}")
    print(make_table(results))
    if "groups" in results:
        print(make_table(results, "groups"))
    return 0
