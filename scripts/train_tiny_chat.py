#!/usr/bin/env python
"""Fine-tune the shipped tiny model into a chat model: a template, three role tokens, and a
short run on the chat corpus of scripts/chat_corpus.py mixed with the code it learnt from.

    python scripts/train_tiny_chat.py --base BASE.colibri --out DIR              # ~25 min, 2 cores
    python scripts/train_tiny_chat.py --base BASE.colibri --out DIR --steps N   # reproduce a run
    python scripts/train_tiny_chat.py --base BASE.colibri --out DIR --minutes 2 # smoke run

BASE is the base model made by scripts/train_tiny_moe.py and converted (experts q4): its
weights are read back through colibri (dequantized to float32), checked against colibri's own
logits in transformers, then trained further. The tokenizer gains `<|system|>`, `<|user|>`,
`<|assistant|>` (ids V, V+1, V+2; their embeddings start at the mean embedding) and the chat
template below; a turn ends with `</s>`. The loss is the next-token loss on the assistant
turns only (the user's words are context), and a share of the windows are plain code from the
base's training files at full loss, so the model keeps writing Python. Schedule as the
base's: warmup, a constant rate re-planned from the measured speed, a linear decay over the
last 25 % (`--steps N` reproduces a run; it prints N).

Writes DIR/hf/ (the Hugging Face folder), DIR/tiny-moe.colibri (experts q4, the rest f16, as
shipped), DIR/metrics.json (losses before and after on held-out chat and code, timings,
samples through colibri).
"""
from __future__ import annotations

import argparse
import json
import math
import os
import platform
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")    # see train_tiny_moe.py

import numpy as np  # noqa: E402
import torch  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
from chat_corpus import split_conversations  # noqa: E402
from train_tiny_moe import (BOS, EOS, Plan, TrainConfig, cpu_name, evaluate, load_balancing_loss,  # noqa: E402
                            log, lr_at, make_optimizer, stdlib_files, token_byte_lengths,
                            token_stream, wrap_tokenizer)

ROLES = ("system", "user", "assistant")
ROLE_TOKENS = [f"<|{r}|>" for r in ROLES]

# The template: <s><|user|>\nHi!</s><|assistant|>\nHello! ...</s> (the newline after a role
# token separates it from the text). One line, whitespace-controlled: it renders the same
# with or without trim_blocks / lstrip_blocks.
CHAT_TEMPLATE = (
    "{{- bos_token -}}"
    "{%- for message in messages -%}"
    "{%- if message['role'] not in ['system', 'user', 'assistant'] -%}"
    "{{- raise_exception('roles are system, user and assistant, not ' ~ message['role']) -}}"
    "{%- endif -%}"
    "{{- '<|' ~ message['role'] ~ '|>\\n' ~ message['content'] ~ eos_token -}}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- '<|assistant|>\\n' -}}{%- endif -%}"
)

MODEL_CARD = """\
# colibri tiny MoE (chat)

A small Mixtral-architecture model of Python, made by colibri's `scripts/train_tiny_moe.py`
(the base: Python source) and `scripts/train_tiny_chat.py` (a chat fine-tune on questions and
answers made from the standard library's docstrings and code; docs/tiny-model.md). Its chat
template is `<s><|user|>\\n...</s><|assistant|>\\n...</s>`; as a base model it still continues
Python source (encoding adds `<s>`; `</s>` ends a file or a turn).

Training data: the source of the Python {python} standard library (`Lib/**/*.py`, test
suites excluded), used under the PSF License Agreement. Copyright (c) 2001-2023 Python
Software Foundation; All Rights Reserved. Summary of changes: no source is distributed;
the weights and the byte-level BPE tokenizer (vocabulary {vocab}) were learnt from it.
"""

SAMPLE_CHATS = ["Hi!", "What does `os.path.join` do?", "Write a function that reverses a list.",
                "Which module defines `OrderedDict`?", "How do I read a file?"]


@dataclass
class ChatConfig(TrainConfig):
    lr: float = 1e-3
    min_lr_ratio: float = 0.1
    warmup_steps: int = 30
    decay_frac: float = 0.25
    code_share: float = 0.3        # windows of plain code, at full loss


# --------------------------------------------------------------------------------------------
# The base model, back from its .colibri file
# --------------------------------------------------------------------------------------------

def hf_names(n_layers: int, n_experts: int) -> dict[str, str]:
    """colibri's tensor names -> the Mixtral checkpoint's (colibri.families.mixtral)."""
    from colibri.families.mixtral import NAME_MAP
    first = {k: (v[0] if isinstance(v, tuple) else v) for k, v in NAME_MAP.items()}
    out = {"tok_embeddings": first["tok_embeddings"], "norm": first["norm"]}
    for i in range(n_layers):
        pre = f"model.layers.{i}."
        for kind in ("attn_norm", "ffn_norm", "attn.wq", "attn.wk", "attn.wv", "attn.wo",
                     "moe.router"):
            out[f"layers.{i}.{kind}"] = pre + first[kind]
        for e in range(n_experts):
            for w in ("w_gate", "w_up", "w_down"):
                out[f"layers.{i}.moe.experts.{e}.{w}"] = pre + first[f"moe.experts.{w}"].format(e=e)
    return out


def base_to_hf(path: Path, out: Path) -> Path:
    """A Hugging Face folder (float32 safetensors, config, tokenizer files) of the .colibri
    file `path`, its quantized weights dequantized."""
    import colibri
    from safetensors.numpy import save_file
    out.mkdir(parents=True, exist_ok=True)
    with colibri.open(path) as f:
        if f.arch.get("family") != "mixtral":
            raise SystemExit(f"{path}: a mixtral file is expected, found {f.arch.get('family')}")
        names = hf_names(f.n_layers, f.n_experts)
        missing = sorted(set(f.names()) - set(names))
        if missing:
            raise SystemExit(f"{path}: tensors without a checkpoint name: {missing[:5]}")
        save_file({names[n]: np.ascontiguousarray(f.to_float32(n)) for n in f.names()},
                  str(out / "model.safetensors"))
        (out / "config.json").write_text(json.dumps(f.config, indent=1))
        for name, text in f.tokenizer_files.items():
            (out / name).write_text(text)
    return out


@torch.no_grad()
def check_against_colibri(model, path: Path, text: str) -> float:
    """Largest |transformers - colibri| logit over `text` relative to the largest logit (f32
    activations and cache on colibri's side): the weights came back right."""
    import colibri
    cm = colibri.load(path, threads=1, activations="f32", kv_dtype="f32")
    ids = cm.tokenizer.encode(text)
    ours = colibri.forward(cm, np.asarray([ids]))[0]
    theirs = model(input_ids=torch.tensor([ids])).logits[0].float().numpy()
    err = float(np.abs(ours - theirs).max() / np.abs(theirs).max())
    if err > 1e-3:
        raise SystemExit(f"the base's weights do not reproduce colibri's logits (error {err:.2e})")
    return err


def add_role_tokens(hf_dir: Path, model, context: int):
    """The tokenizer with the role tokens and the chat template, and the model's embedding
    grown to match (new rows: the mean embedding)."""
    from tokenizers import Tokenizer
    tok = Tokenizer.from_file(str(hf_dir / "tokenizer.json"))
    V = tok.get_vocab_size()
    tok.add_special_tokens(ROLE_TOKENS)
    assert [tok.token_to_id(t) for t in ROLE_TOKENS] == list(range(V, V + len(ROLES)))
    emb = model.get_input_embeddings().weight
    mean = emb.detach().mean(0)
    model.resize_token_embeddings(V + len(ROLES), mean_resizing=False)
    with torch.no_grad():
        model.get_input_embeddings().weight[V:] = mean
    hf_tok = wrap_tokenizer(tok, context)
    hf_tok.chat_template = CHAT_TEMPLATE
    return tok, hf_tok


# --------------------------------------------------------------------------------------------
# The chat stream: tokens and which of them the loss counts
# --------------------------------------------------------------------------------------------

def encode_conversation(tok, conv: list[dict]) -> tuple[list[int], list[bool]]:
    """(ids, counted) of one conversation as the template renders it: counted marks the
    assistant's tokens and the </s> that ends each of its turns."""
    role = {r: tok.token_to_id(t) for r, t in zip(ROLES, ROLE_TOKENS)}
    ids, counted = [tok.token_to_id(BOS)], [False]
    for m in conv:
        body = tok.encode("\n" + m["content"], add_special_tokens=False).ids + [tok.token_to_id(EOS)]
        ids += [role[m["role"]]] + body
        counted += [False] + [m["role"] == "assistant"] * len(body)
    return ids, counted


def chat_stream(tok, convs: list[list[dict]]) -> tuple[np.ndarray, np.ndarray]:
    ids, counted = [], []
    for c in convs:
        a, b = encode_conversation(tok, c)
        ids += a
        counted += b
    return np.asarray(ids, dtype=np.int32), np.asarray(counted, dtype=bool)


def windows(ids: np.ndarray, counted: np.ndarray | None, context: int, g: torch.Generator):
    """One random window (S+1,) of a stream and its labels (S,) (-100 where not counted)."""
    s = int(torch.randint(0, len(ids) - context - 1, (1,), generator=g))
    x = torch.from_numpy(ids[s: s + context + 1].astype(np.int64))
    y = x[1:].clone()
    if counted is not None:
        y[~torch.from_numpy(counted[s + 1: s + context + 1])] = -100
    return x[:-1], y


def masked_loss(model, x: torch.Tensor, y: torch.Tensor, with_router: bool):
    out = model(input_ids=x, output_router_logits=with_router, use_cache=False)
    logits = out.logits.float()
    return torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1),
                                             ignore_index=-100), out


@torch.no_grad()
def chat_eval(model, tok, convs: list[list[dict]], max_convs: int | None = None) -> dict:
    """Mean loss per counted (assistant) token over whole held-out conversations."""
    model.eval()
    total, n = 0.0, 0
    for conv in convs[:max_convs]:
        ids, counted = encode_conversation(tok, conv)
        ids, counted = ids[:513], counted[:513]
        x = torch.tensor([ids[:-1]])
        y = torch.tensor([ids[1:]])
        y[0, ~torch.tensor(counted[1:])] = -100
        k = int((y != -100).sum())
        if k:
            loss, _ = masked_loss(model, x, y, False)
            total += loss.item() * k
            n += k
    model.train()
    return {"loss_per_token": total / n, "ppl_per_token": math.exp(total / n), "tokens": n}


# --------------------------------------------------------------------------------------------
# Training
# --------------------------------------------------------------------------------------------

def train(args) -> None:
    t_start = time.time()
    deadline = t_start + args.minutes * 60
    torch.set_num_threads(args.threads)
    import transformers
    from transformers import MixtralForCausalLM
    transformers.logging.set_verbosity_error()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    tc = ChatConfig()

    base_dir = base_to_hf(Path(args.base), out / "base-hf")
    torch.manual_seed(args.seed)
    model = MixtralForCausalLM.from_pretrained(base_dir, dtype=torch.float32,
                                               experts_implementation="eager")
    err = check_against_colibri(model, Path(args.base), "def fibonacci(n):\n    a, b = 0, 1\n")
    log(f"base {args.base}: weights back in transformers, logits within {err:.1e} of colibri's")
    tok, hf_tok = add_role_tokens(base_dir, model, tc.context)
    cfg = model.config

    train_convs, val_convs, corpus = split_conversations(args.seed)
    c_ids, c_counted = chat_stream(tok, train_convs)
    rendered = hf_tok.apply_chat_template(train_convs[0], tokenize=True, return_dict=False)
    assert list(rendered) == encode_conversation(tok, train_convs[0])[0], "template != stream"
    train_files, val_files, _ = stdlib_files()
    code = token_stream(tok, train_files)
    val_code = token_stream(tok, val_files)
    byte_len = np.concatenate([token_byte_lengths(tok)[: tok.get_vocab_size() - len(ROLES)],
                               np.zeros(len(ROLES), np.int64)])
    log(f"chat corpus: {len(train_convs)} conversations, {len(c_ids)} tokens "
        f"({int(c_counted.sum())} counted); {len(val_convs)} held out; code {len(code)} tokens")

    def measure(full: bool) -> dict:
        return {"chat": chat_eval(model, tok, val_convs, None if full else 64),
                "code": evaluate(model, val_code, tc.context, byte_len,
                                 max_windows=None if full else 16)}
    t0 = time.time()
    before = measure(True)
    reserve = (time.time() - t0) * 1.5 + 60       # the final evaluation, saving, conversion
    train_deadline = deadline - reserve
    log(f"before: held-out chat loss {before['chat']['loss_per_token']:.3f}, code "
        f"{before['code']['bits_per_byte']:.3f} bits/byte; reserve {reserve:.0f} s")

    opt = make_optimizer(model, tc)
    g = torch.Generator().manual_seed(args.seed + 1)
    E, K = cfg.num_local_experts, cfg.num_experts_per_tok
    plan = Plan.for_steps(args.steps, tc) if args.steps else None
    step, t_train, t_mark, history, curve = 0, time.time(), time.time(), [], []
    stopped_early = False
    while plan is None or step < plan.total:
        if args.stop_after is not None and step >= args.stop_after:
            break                                  # a run the budget cut short, reproduced
        if time.time() >= train_deadline:
            stopped_early = True
            log(f"wall-clock budget reached at step {step}")
            break
        lr = lr_at(step, plan, tc)
        for group in opt.param_groups:
            group["lr"] = lr
        pairs = [windows(code, None, tc.context, g) if torch.rand(1, generator=g).item()
                 < tc.code_share else windows(c_ids, c_counted, tc.context, g)
                 for _ in range(tc.batch)]
        x, y = torch.stack([p[0] for p in pairs]), torch.stack([p[1] for p in pairs])
        nll, o = masked_loss(model, x, y, True)
        aux = load_balancing_loss(o.router_logits, E, K)
        opt.zero_grad(set_to_none=True)
        (nll + cfg.router_aux_loss_coef * aux).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), tc.grad_clip)
        opt.step()
        step += 1
        history.append({"step": step, "lr": lr, "loss": nll.item(), "aux": aux.item()})
        if not args.steps and step >= tc.warmup_steps and step % tc.replan_every == 0 and (
                plan is None or step < plan.decay_start):
            sec = (time.time() - t_mark) / tc.replan_every
            t_mark = time.time()
            plan = Plan.for_steps(step + int((train_deadline - time.time()) / sec * tc.safety), tc)
            if plan.decay_start <= step:
                plan = Plan(plan.total, step)
            log(f"{sec:.2f} s/step: plan {plan.total} steps, decay from {plan.decay_start}")
        if step % 25 == 0:
            log(f"step {step}/{plan.total if plan else '?'} lr {lr:.2e} loss {nll.item():.3f} "
                f"aux {aux.item():.3f} | {(time.time() - t_train) / 60:.1f} min")
        if step % tc.eval_every == 0:
            m = measure(False)
            curve.append({"step": step, "chat": m["chat"]["loss_per_token"],
                          "code_bpb": m["code"]["bits_per_byte"]})
            log(f"held-out (part): chat {curve[-1]['chat']:.3f}, code {curve[-1]['code_bpb']:.3f} bpb")
    train_seconds = time.time() - t_train
    after = measure(True)
    log(f"after: held-out chat loss {after['chat']['loss_per_token']:.3f}, code "
        f"{after['code']['bits_per_byte']:.3f} bits/byte")
    reproduce = f"--steps {plan.total}" + (f" --stop-after {step}" if step < plan.total else "") \
        if plan else None
    if reproduce and not args.steps:
        log(f"reproduce with {reproduce}")
    colibri_file, samples = save(model, tok, hf_tok, out, corpus, args)
    metrics = {
        "command": " ".join(["python", "scripts/train_tiny_chat.py"] + sys.argv[1:]),
        "steps": step, "planned_steps": plan.total if plan else None, "reproduce": reproduce,
        "stopped_by_budget": stopped_early, "train_seconds": train_seconds,
        "total_seconds": time.time() - t_start, "seed": args.seed, "threads": args.threads,
        "train_config": asdict(tc), "before": before, "after": after, "curve": curve,
        "train_curve": history[::10] + history[-1:], "samples": samples,
        "chat_corpus": {"conversations": len(train_convs), "tokens": len(c_ids),
                        "counted": int(c_counted.sum()), "held_out": len(val_convs)},
        "file_bytes": colibri_file.stat().st_size,
        "machine": {"cpu": cpu_name(), "torch": torch.__version__,
                    "transformers": transformers.__version__, "python": platform.python_version()},
    }
    (out / "metrics.json").write_text(json.dumps(metrics, indent=1))
    log(f"{step} steps in {train_seconds / 60:.1f} min, {metrics['total_seconds'] / 60:.1f} min in "
        f"all; {colibri_file} {colibri_file.stat().st_size} bytes")


def save(model, tok, hf_tok, out: Path, corpus: dict, args) -> tuple[Path, dict]:
    """DIR/hf (the folder), DIR/tiny-moe.colibri (converted as shipped) and samples of it."""
    import colibri
    from colibri.convert import convert
    hf_dir = out / "hf"
    model.config.output_router_logits = False
    model.save_pretrained(hf_dir, safe_serialization=True)
    hf_tok.save_pretrained(hf_dir)
    tc_path = hf_dir / "tokenizer_config.json"
    tc_json = json.loads(tc_path.read_text())
    tc_json["tokenizer_class"] = "PreTrainedTokenizerFast"      # loads in transformers 4 too
    tc_path.write_text(json.dumps(tc_json, indent=2) + "\n")
    gen_path = hf_dir / "generation_config.json"
    gen = json.loads(gen_path.read_text())
    gen["eos_token_id"] = [tok.token_to_id(EOS), tok.token_to_id("<|user|>")]  # a new turn ends it
    gen_path.write_text(json.dumps(gen, indent=2) + "\n")
    (hf_dir / "README.md").write_text(MODEL_CARD.format(python=corpus["python"],
                                                        vocab=tok.get_vocab_size()))
    dst = convert(hf_dir, out / "tiny-moe.colibri", dtype="f16", quant="q4", force=True,
                  progress=False,
                  meta={"licence": "PSF-2.0 (training corpus: CPython standard library source)",
                        "source": "scripts/train_tiny_moe.py, then scripts/train_tiny_chat.py"})
    m = colibri.load(dst, threads=args.threads)
    samples = {}
    for q in SAMPLE_CHATS:
        greedy = m.generate([{"role": "user", "content": q}], chat=True, max_new_tokens=80,
                            temperature=0)
        sampled = m.generate([{"role": "user", "content": q}], chat=True, max_new_tokens=80,
                             temperature=0.7, top_k=40, seed=0)
        samples[q] = {"greedy": greedy, "sampled": sampled}
        log(f"{q!r}\n  greedy : {greedy!r}\n  sampled: {sampled!r}")
    samples["def fibonacci(n):"] = m.generate("def fibonacci(n):", max_new_tokens=48, seed=0)
    return dst, samples


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--base", required=True, help="the base .colibri file (train_tiny_moe.py, converted)")
    ap.add_argument("--out", required=True, help="output directory")
    ap.add_argument("--minutes", type=float, default=25.0, help="wall-clock budget, everything included")
    ap.add_argument("--steps", type=int, default=None, help="optimizer steps (default: as many as fit)")
    ap.add_argument("--stop-after", type=int, default=None,
                    help="with --steps: stop after this many (reproduces a run cut by --minutes)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--threads", type=int, default=2)
    train(ap.parse_args(argv))


if __name__ == "__main__":
    main()
