#!/usr/bin/env python
"""Train the tiny Mixtral-architecture model that ships with colibri.

Corpus: the running interpreter's standard library source (``Lib/**/*.py``, PSF licence),
without test suites, site-packages and generated files (codec tables, pydoc topics); ~2 % of
the files, chosen by a hash of their relative path, are held out. Tokenizer: byte-level BPE
trained here with the `tokenizers` library on the training files only. Model:
``MixtralForCausalLM``, sized by what 2 cores can train in 30 minutes; the size of its
converted ``.colibri`` file (experts q4, the rest f16) is computed and asserted <= 16 MB.
Training: plain PyTorch (AdamW, warmup-stable-decay, grad clip, f32), random windows of the
token stream, as many steps as a wall-clock budget allows, measured on the machine it runs on.

    python scripts/train_tiny_moe.py --out DIR              # ~30 minutes on 2 cores
    python scripts/train_tiny_moe.py --out DIR --steps N    # reproduce a run (it prints the flags)
    python scripts/train_tiny_moe.py --out DIR --minutes 2  # smoke run

Writes DIR/hf/ (config.json, model.safetensors, tokenizer.json, tokenizer_config.json),
DIR/metrics.json and a log on stdout. ``scripts/tiny_moe_report.py DIR`` measures the result
(held-out perplexity, expert utilisation and specialisation, samples).

Shapes: B batch, S context, V vocab, D hidden, L layers, E experts, K experts per token.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import os
import platform
import re
import sys
import sysconfig
import time
from dataclasses import asdict, dataclass
from pathlib import Path

# Idle OpenMP threads must sleep, not spin: on a shared machine, spinning threads fight the
# other processes for the cores and training runs 2-15x slower (measured). Set before torch loads.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import numpy as np  # noqa: E402
import torch  # noqa: E402

# --------------------------------------------------------------------------------------------
# Corpus
# --------------------------------------------------------------------------------------------

# Directories that hold test suites, third-party packages or build artefacts.
EXCLUDED_DIRS = {"test", "tests", "idle_test", "site-packages", "__pycache__"}
# Generated files that are not representative Python: pydoc's topic index is 750 kB of prose
# in one string literal; _sysconfigdata_* holds the paths of the machine Python was built on.
EXCLUDED_FILES = {"pydoc_data/topics.py"}
# The character-mapping codecs (encodings/cp437.py, mac_roman.py, ... 70 files, 1.2 MB, 11 % of
# the bytes) are generated tables of near-identical lines; kept in, they dominate what a small
# model learns (greedy samples drift into "'\x80'  #  0x80 -> LATIN CAPITAL LETTER ...").
CODEC_TABLE = re.compile(r"^(decoding_table|decoding_map) = ", re.M)
VAL_PER_MILLE = 20  # ~2 % of the files are held out


@dataclass
class SourceFile:
    rel: str  # path relative to the stdlib directory, '/'-separated
    text: str


def is_held_out(rel: str) -> bool:
    """Deterministic ~2 % split by a hash of the relative path (independent of file order)."""
    h = int.from_bytes(hashlib.sha256(rel.encode()).digest()[:8], "big")
    return h % 1000 < VAL_PER_MILLE


def stdlib_files(root: str | None = None) -> tuple[list[SourceFile], list[SourceFile], dict]:
    """(train, val, info): the stdlib's *.py files in sorted order, split by `is_held_out`."""
    root = Path(root or sysconfig.get_paths()["stdlib"])
    rels = []
    for dirpath, dirnames, filenames in os.walk(root):
        # config-3.X-<platform>/ holds the build's python-config script
        dirnames[:] = [d for d in dirnames if d not in EXCLUDED_DIRS and not d.startswith("config-")]
        for name in filenames:
            if not name.endswith(".py") or name.startswith("test_") or name.startswith("_sysconfigdata"):
                continue
            rel = (Path(dirpath) / name).relative_to(root).as_posix()
            if rel not in EXCLUDED_FILES:
                rels.append(rel)
    rels.sort()
    train, val, skipped, tables = [], [], [], []
    digest = hashlib.sha256()
    for rel in rels:
        raw = (root / rel).read_bytes()
        try:
            text = raw.decode("utf-8")
        except UnicodeDecodeError:
            skipped.append(rel)
            continue
        if rel.startswith("encodings/") and CODEC_TABLE.search(text):
            tables.append(rel)
            continue
        digest.update(rel.encode() + b"\0" + raw + b"\0")
        (val if is_held_out(rel) else train).append(SourceFile(rel, text))
    info = {
        "python": platform.python_version(),
        "files_train": len(train),
        "files_val": len(val),
        "bytes_train": sum(len(f.text.encode()) for f in train),
        "bytes_val": sum(len(f.text.encode()) for f in val),
        "skipped_not_utf8": skipped,
        "skipped_codec_tables": len(tables),
        "val_files": [f.rel for f in val],
        "sha256": digest.hexdigest(),
    }
    return train, val, info


# --------------------------------------------------------------------------------------------
# Tokenizer
# --------------------------------------------------------------------------------------------

BOS, EOS, UNK, PAD = "<s>", "</s>", "<unk>", "<pad>"
SPECIAL_TOKENS = [BOS, EOS, UNK, PAD]  # ids 0, 1, 2, 3


def train_tokenizer(files: list[SourceFile], vocab_size: int):
    """Byte-level BPE (GPT-2 style pre-tokenizer, no normalizer): lossless on any text,
    indentation included. Encoding adds <s> in front (each training file starts with it).

    Every newline is a token of its own. GPT-2's pattern glues a newline to the indentation
    that follows it ("\n       " + " return"); a prompt that ends with a newline then ends with
    a token that, in training, is only ever followed by column-0 code, and the model dutifully
    dedents ("class Stack:\n" -> "\n\n"). Isolated, "\n" is followed by the indentation
    ("       ", " def") as in training. It costs about one token per indented line."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tok = Tokenizer(models.BPE())  # no unk: every byte is in the base alphabet
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex("\n"), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
    ])
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        min_frequency=2,
        show_progress=False,
    )
    tok.train_from_iterator((f.text for f in files), trainer=trainer, length=len(files))
    tok.post_processor = processors.TemplateProcessing(
        single=f"{BOS} $A", pair=f"{BOS} $A {BOS} $B", special_tokens=[(BOS, tok.token_to_id(BOS))]
    )
    return tok


def wrap_tokenizer(tok, context: int):
    """The transformers view of the tokenizer, as saved next to the model."""
    from transformers import PreTrainedTokenizerFast

    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token=BOS,
        eos_token=EOS,
        unk_token=UNK,
        pad_token=PAD,
        model_max_length=context,
        clean_up_tokenization_spaces=False,  # never touch spaces: this is Python source
    )


def check_round_trip(hf_tok, files: list[SourceFile]) -> int:
    """decode(encode(x)) == x on every file; returns the number of files checked."""
    for f in files:
        ids = hf_tok(f.text, add_special_tokens=False)["input_ids"]
        back = hf_tok.decode(ids, skip_special_tokens=False, clean_up_tokenization_spaces=False)
        if back != f.text:
            i = next((i for i, (a, b) in enumerate(zip(back, f.text)) if a != b), min(len(back), len(f.text)))
            raise AssertionError(f"tokenizer round trip fails on {f.rel} at char {i}: {f.text[i-20:i+20]!r}")
    return len(files)


def token_stream(tok, files: list[SourceFile]) -> np.ndarray:
    """<s> file </s> <s> file </s> ... as one int32 array."""
    bos, eos = tok.token_to_id(BOS), tok.token_to_id(EOS)
    encs = tok.encode_batch([f.text for f in files], add_special_tokens=False)
    parts = []
    for e in encs:
        parts.append(np.asarray([bos] + e.ids + [eos], dtype=np.int32))
    return np.concatenate(parts)


def token_byte_lengths(tok) -> np.ndarray:
    """(V,) UTF-8 bytes each token stands for (0 for special tokens). In byte-level BPE
    every character of a token's string is one byte."""
    vocab = tok.get_vocab()
    out = np.zeros(len(vocab), dtype=np.int64)
    for s, i in vocab.items():
        out[i] = 0 if s in SPECIAL_TOKENS else len(s)
    return out


# --------------------------------------------------------------------------------------------
# Model and its size once converted
# --------------------------------------------------------------------------------------------

MB = 1_000_000
SIZE_LIMIT = 16 * MB  # the shipped .colibri file (the stricter reading of "16 MB")
Q4_BITS = 4.5  # 4-bit weights + one f16 scale per group of 32 (or scale+zero per 64)
DENSE_BYTES = 2  # f16 for attention, embeddings, head; q8 would be ~1.06
FP32_BYTES = 4  # router and norms stay f32


def model_config(vocab_size: int, context: int, **overrides):
    from transformers import MixtralConfig

    kw = dict(
        vocab_size=vocab_size,
        # Sized by the time budget, not the 16 MB cap: ~2-3 M tokens is all 2 shared cores see in
        # 30 minutes, and at that budget this model (2.0 M active parameters) beats D=256/I=512
        # (6.8 M active, 2.4x slower per token) by 0.3 bits/byte at equal wall-clock (measured).
        hidden_size=128,  # D
        intermediate_size=256,  # I, per expert
        num_hidden_layers=6,  # L
        num_attention_heads=4,  # head_dim 32
        num_key_value_heads=2,  # GQA 2:1
        num_local_experts=8,  # E
        num_experts_per_tok=2,  # K
        max_position_embeddings=context,
        rope_theta=10000.0,
        rms_norm_eps=1e-5,
        tie_word_embeddings=True,  # budget and sample efficiency: rare tokens learn from both ends
        router_aux_loss_coef=0.01,  # Switch Transformer's value
        router_jitter_noise=0.0,
        output_router_logits=False,  # turned on explicitly in training and analysis
        initializer_range=0.02,
        bos_token_id=SPECIAL_TOKENS.index(BOS),
        eos_token_id=SPECIAL_TOKENS.index(EOS),
        pad_token_id=SPECIAL_TOKENS.index(PAD),
        use_cache=True,
    )
    kw.update(overrides)
    return MixtralConfig(**kw)


def param_counts(cfg) -> dict:
    """Parameter counts by role, from the config alone (matches the torch module)."""
    D, I, L, E, K, V = (cfg.hidden_size, cfg.intermediate_size, cfg.num_hidden_layers,
                        cfg.num_local_experts, cfg.num_experts_per_tok, cfg.vocab_size)
    Dh = getattr(cfg, "head_dim", None) or D // cfg.num_attention_heads
    attn = L * (D * cfg.num_attention_heads * Dh * 2 + D * cfg.num_key_value_heads * Dh * 2)
    experts = L * E * 3 * D * I
    router = L * E * D
    norms = (2 * L + 1) * D
    embed = V * D
    head = 0 if cfg.tie_word_embeddings else V * D
    total = attn + experts + router + norms + embed + head
    active = total - experts + L * K * 3 * D * I
    return dict(attention=attn, experts=experts, router=router, norms=norms, embedding=embed,
                lm_head=head, total=total, active_per_token=active)


def converted_size(cfg, tokenizer_json_bytes: int) -> dict:
    """Bytes of the .colibri file with experts in q4 and the dense matrices in f16, plus the
    metadata (config + tokenizer.json) and a generous allowance for header, tensor table and
    alignment padding."""
    p = param_counts(cfg)
    n_tensors = 3 + cfg.num_hidden_layers * (4 + 2 + 1 + 3 * cfg.num_local_experts)
    overhead = 64 * 1024 + n_tensors * (256 + 4096)  # record + worst-case page alignment
    parts = {
        "experts_q4": math.ceil(p["experts"] * Q4_BITS / 8),
        "dense_f16": (p["attention"] + p["embedding"] + p["lm_head"]) * DENSE_BYTES,
        "router_norms_f32": (p["router"] + p["norms"]) * FP32_BYTES,
        "tokenizer_config": tokenizer_json_bytes + 16 * 1024,
        "header_table_padding": overhead,
    }
    parts["total"] = sum(parts.values())
    return parts


def build_model(cfg, seed: int):
    """Fresh model, initialised from `seed` (the same seed gives the same weights)."""
    from transformers import MixtralForCausalLM

    torch.manual_seed(seed)
    cfg._experts_implementation = "eager"  # the reference loop; same speed as grouped_mm here
    model = MixtralForCausalLM(cfg)
    return model


# --------------------------------------------------------------------------------------------
# Losses and evaluation
# --------------------------------------------------------------------------------------------

def load_balancing_loss(router_logits: tuple, E: int, K: int) -> torch.Tensor:
    """Switch-Transformer balance loss, per layer then averaged (transformers' own function pools
    the counts of all layers, which lets one layer stay unbalanced if another compensates).
    Equals K when routing is perfectly balanced."""
    from transformers.models.mixtral.modeling_mixtral import load_balancing_loss_func

    return sum(load_balancing_loss_func((rl,), E, K) for rl in router_logits) / len(router_logits)


def lm_forward(model, x: torch.Tensor, with_router: bool):
    """x (B, S+1) int64 -> (mean NLL of x[:, 1:] under the model, out)."""
    out = model(input_ids=x[:, :-1], output_router_logits=with_router, use_cache=False)
    logits = out.logits.float()  # (B, S, V)
    nll = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), x[:, 1:].reshape(-1))
    return nll, out


def eval_windows(stream: np.ndarray, context: int) -> list[np.ndarray]:
    """Cut a token stream into windows of S+1 tokens overlapping by one, so that every token
    but the first is predicted exactly once, from up to S-1 tokens of context."""
    step = context
    return [stream[i: i + context + 1] for i in range(0, len(stream) - 1, step)]


@torch.no_grad()
def evaluate(model, stream: np.ndarray, context: int, byte_lengths: np.ndarray,
             max_windows: int | None = None, batch: int = 8) -> dict:
    """Held-out NLL per token and per byte over `stream` (or its first `max_windows` windows)."""
    model.eval()
    wins = eval_windows(stream, context)[:max_windows]
    total_nll, n_tok, n_bytes = 0.0, 0, 0
    for i in range(0, len(wins), batch):
        group = wins[i: i + batch]
        full = [w for w in group if len(w) == context + 1]
        rest = [w for w in group if len(w) != context + 1]  # the last, shorter window
        for ws in ([full] if full else []) + [[w] for w in rest]:
            x = torch.from_numpy(np.stack(ws).astype(np.int64))
            nll, _ = lm_forward(model, x, with_router=False)
            n = x[:, 1:].numel()
            total_nll += nll.item() * n
            n_tok += n
            n_bytes += int(byte_lengths[x[:, 1:].numpy()].sum())
    model.train()
    loss = total_nll / n_tok
    return {"loss_per_token": loss, "ppl_per_token": math.exp(loss), "tokens": n_tok, "bytes": n_bytes,
            "bits_per_byte": total_nll / n_bytes / math.log(2), "ppl_per_byte": math.exp(total_nll / n_bytes)}


# --------------------------------------------------------------------------------------------
# Training
# --------------------------------------------------------------------------------------------

@dataclass
class TrainConfig:
    context: int = 512  # S
    batch: int = 2  # B windows per step: 1024 tokens (2x the updates of B=4, ~same tokens/s)
    lr: float = 2e-3
    min_lr_ratio: float = 0.1
    warmup_steps: int = 50
    decay_frac: float = 0.2  # warmup-stable-decay: linear decay over the last 20 % of the steps
    replan_every: int = 50  # steps between re-measurements of the speed, until the decay starts
    eval_every: int = 200
    weight_decay: float = 0.1
    betas: tuple = (0.9, 0.95)
    grad_clip: float = 1.0
    safety: float = 0.95  # plan for 95 % of the measured speed: the machine is shared


@dataclass
class Plan:
    """How many steps, and where the decay starts. Until then the learning rate does not
    depend on the plan, so it can follow the measured speed of a shared machine without the
    run differing from `--steps total` (warmup-stable-decay, Hu et al. 2024, Hägele et al. 2024)."""
    total: int
    decay_start: int

    @classmethod
    def for_steps(cls, total: int, tc: TrainConfig) -> "Plan":
        return cls(total, max(tc.warmup_steps, int(total * (1 - tc.decay_frac))))


def lr_at(step: int, plan: Plan | None, tc: TrainConfig) -> float:
    if step < tc.warmup_steps:
        return tc.lr * (step + 1) / tc.warmup_steps
    if plan is None or step < plan.decay_start:
        return tc.lr
    p = min(1.0, (step - plan.decay_start) / max(1, plan.total - plan.decay_start))
    return tc.lr * (1 - (1 - tc.min_lr_ratio) * p)


def make_optimizer(model, tc: TrainConfig):
    """AdamW; no weight decay on norms, router (tiny, and decay would flatten routing) or the
    embedding (tied to the head)."""
    decay, no_decay = [], []
    for name, p in model.named_parameters():
        (decay if p.ndim >= 2 and "embed" not in name and "gate.weight" not in name else no_decay).append(p)
    return torch.optim.AdamW([{"params": decay, "weight_decay": tc.weight_decay},
                              {"params": no_decay, "weight_decay": 0.0}], lr=tc.lr, betas=tc.betas)


def batches(stream: np.ndarray, tc: TrainConfig, seed: int):
    """Endless random windows (B, S+1) of the training stream, from a seeded generator."""
    g = torch.Generator().manual_seed(seed)
    data = torch.from_numpy(stream.astype(np.int64))
    hi = len(data) - tc.context - 1
    while True:
        starts = torch.randint(0, hi, (tc.batch,), generator=g)
        yield torch.stack([data[s: s + tc.context + 1] for s in starts.tolist()])


def log(msg: str):
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)


def train(args):
    t_start = time.time()
    deadline = t_start + args.minutes * 60
    torch.set_num_threads(args.threads)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    tc = TrainConfig()
    import transformers
    import tokenizers
    transformers.logging.set_verbosity_error()

    # ---- corpus and tokenizer
    train_files, val_files, corpus = stdlib_files()
    log(f"corpus: Python {corpus['python']} stdlib, {corpus['files_train']} train files "
        f"({corpus['bytes_train'] / MB:.2f} MB), {corpus['files_val']} held out ({corpus['bytes_val'] / MB:.2f} MB)")
    tok = train_tokenizer(train_files, args.vocab_size)
    hf_tok = wrap_tokenizer(tok, tc.context)
    hf_tok.model_max_length = 10**9  # only while checking whole files
    check_round_trip(hf_tok, val_files)
    hf_tok.model_max_length = tc.context
    train_stream = token_stream(tok, train_files)
    val_stream = token_stream(tok, val_files)
    byte_len = token_byte_lengths(tok)
    assert int(byte_len[val_stream].sum()) == corpus["bytes_val"]
    log(f"tokenizer: byte-level BPE, vocab {tok.get_vocab_size()}, round trip exact on {len(val_files)} held-out "
        f"files; {len(train_stream)} train tokens ({corpus['bytes_train'] / len(train_stream):.2f} bytes/token), "
        f"{len(val_stream)} held-out tokens")

    # ---- model and its budget
    overrides = {k: json.loads(v) for k, v in (kv.split("=", 1) for kv in args.config)}
    cfg = model_config(tok.get_vocab_size(), tc.context, **overrides)
    counts = param_counts(cfg)
    size = converted_size(cfg, len(tok.to_str(pretty=True).encode()))  # as saved
    log(f"model: Mixtral D={cfg.hidden_size} L={cfg.num_hidden_layers} E={cfg.num_local_experts} "
        f"K={cfg.num_experts_per_tok} I={cfg.intermediate_size} H={cfg.num_attention_heads}/{cfg.num_key_value_heads} "
        f"S={tc.context} V={cfg.vocab_size}; params {counts['total'] / 1e6:.2f} M total, "
        f"{counts['active_per_token'] / 1e6:.2f} M active; converted (q4 experts, f16 rest) ≈ {size['total'] / MB:.2f} MB")
    assert size["total"] <= SIZE_LIMIT, f"converted size {size['total']} B exceeds {SIZE_LIMIT} B"
    model = build_model(cfg, args.seed)
    assert sum(p.numel() for p in model.parameters()) == counts["total"]
    model.train()
    opt = make_optimizer(model, tc)
    E, K = cfg.num_local_experts, cfg.num_experts_per_tok
    data = batches(train_stream, tc, args.seed + 1)

    # ---- time left for training: keep room for the final evaluation and saving
    t0 = time.time()
    probe = evaluate(model, val_stream, tc.context, byte_len, max_windows=8)
    eval_rate = probe["tokens"] / (time.time() - t0)  # held-out tokens/s, no grad
    reserve = len(val_stream) / eval_rate * 1.5 + 20  # the machine's load varies
    train_deadline = deadline - reserve
    log(f"initial held-out loss {probe['loss_per_token']:.3f}; final evaluation reserve {reserve:.0f} s")

    def one_step(step: int, plan: Plan | None) -> dict:
        lr = lr_at(step, plan, tc)
        for group in opt.param_groups:
            group["lr"] = lr
        x = next(data)
        nll, o = lm_forward(model, x, with_router=True)
        aux = load_balancing_loss(o.router_logits, E, K)
        loss = nll + cfg.router_aux_loss_coef * aux
        opt.zero_grad(set_to_none=True)
        loss.backward()
        gnorm = torch.nn.utils.clip_grad_norm_(model.parameters(), tc.grad_clip)
        opt.step()
        return {"lr": lr, "loss": nll.item(), "aux": aux.item(), "gnorm": gnorm.item()}

    # ---- the number of steps: given, or re-measured every `replan_every` steps until the decay
    plan = Plan.for_steps(args.steps, tc) if args.steps else None
    history, val_curve = [], [{"step": 0, "train_tokens": 0, **probe}]
    step, tokens, stopped_early = 0, 0, False
    t_train = t_mark = time.time()
    while (plan is None or step < plan.total) and (args.stop_after is None or step < args.stop_after):
        if time.time() >= train_deadline:
            stopped_early = True
            log(f"wall-clock budget reached at step {step}" + (f" of {plan.total}" if plan else ""))
            break
        rec = one_step(step, plan)
        step += 1
        tokens += tc.batch * tc.context
        history.append({"step": step, **rec})
        if not args.steps and step >= tc.warmup_steps and step % tc.replan_every == 0 and (
                plan is None or step < plan.decay_start):
            sec_per_step = (time.time() - t_mark) / tc.replan_every  # evaluations included
            t_mark = time.time()
            total = step + int((train_deadline - time.time()) / sec_per_step * tc.safety)
            plan = Plan.for_steps(total, tc)
            if plan.decay_start <= step:  # the machine slowed down a lot: decay from here
                plan = Plan(total, step)
            log(f"speed {tc.batch * tc.context / sec_per_step:.0f} tokens/s ({sec_per_step:.2f} s/step): "
                f"plan {plan.total} steps, decay from step {plan.decay_start}")
        if step % 10 == 0 or step == 1:
            el = time.time() - t_train
            log(f"step {step}/{plan.total if plan else '?'} lr {rec['lr']:.2e} loss {rec['loss']:.3f} "
                f"aux {rec['aux']:.3f} gnorm {rec['gnorm']:.2f} | {tokens / el:.0f} tok/s, {el / 60:.1f} min")
        if step % tc.eval_every == 0 and (plan is None or step < plan.total):
            v = evaluate(model, val_stream, tc.context, byte_len, max_windows=16)
            val_curve.append({"step": step, "train_tokens": tokens, **v})
            log(f"held-out (first 16 windows) loss {v['loss_per_token']:.3f} ppl {v['ppl_per_token']:.1f} "
                f"bpb {v['bits_per_byte']:.3f}")
    if plan and not args.steps:
        how = f"--steps {plan.total}" + (f" --stop-after {step}" if step < plan.total else "")
        exact = plan == Plan.for_steps(plan.total, tc)
        log(f"reproduce with {how}" + ("" if exact else " (approximately: the machine slowed down so much "
                                                        "that the decay started early)"))
    train_seconds = time.time() - t_train

    # ---- final held-out evaluation and save
    final = evaluate(model, val_stream, tc.context, byte_len)
    log(f"held-out: loss/token {final['loss_per_token']:.4f}  ppl/token {final['ppl_per_token']:.2f}  "
        f"bits/byte {final['bits_per_byte']:.4f}  ({final['tokens']} tokens, {final['bytes']} bytes)")
    hf_dir = out / "hf"
    model.config.output_router_logits = False
    model.save_pretrained(hf_dir, safe_serialization=True)
    hf_tok.save_pretrained(hf_dir)
    # transformers 5 writes "TokenizersBackend"; the 4.x name loads in both
    tc_path = hf_dir / "tokenizer_config.json"
    tc_json = json.loads(tc_path.read_text())
    tc_json["tokenizer_class"] = "PreTrainedTokenizerFast"
    tc_path.write_text(json.dumps(tc_json, indent=2) + "\n")
    (hf_dir / "README.md").write_text(MODEL_CARD.format(python=corpus["python"], vocab=tok.get_vocab_size()))
    metrics = {
        "command": " ".join(["python", "scripts/train_tiny_moe.py"] + sys.argv[1:]),
        "steps": step, "planned_steps": plan.total if plan else None,
        "decay_start": plan.decay_start if plan else None, "stopped_by_budget": stopped_early,
        "reproduce": (f"--steps {plan.total}" + (f" --stop-after {step}" if step < plan.total else ""))
        if plan else None,
        "tokens_seen": tokens,
        "epochs": tokens / len(train_stream), "train_seconds": train_seconds,
        "total_seconds": time.time() - t_start,
        "tokens_per_second": tokens / train_seconds, "seed": args.seed, "threads": args.threads,
        "train_config": asdict(tc), "model_config": cfg.to_dict(), "params": counts, "converted_size": size,
        "tokenizer": {"vocab_size": tok.get_vocab_size(), "train_tokens": len(train_stream),
                      "val_tokens": len(val_stream),
                      "bytes_per_token_train": corpus["bytes_train"] / len(train_stream),
                      "bytes_per_token_val": corpus["bytes_val"] / len(val_stream)},
        "corpus": corpus, "heldout": final, "val_curve": val_curve,
        "train_curve": history[::10] + history[-1:],
        "machine": {"cpu": cpu_name(), "logical_cpus": os.cpu_count(), "torch": torch.__version__,
                    "transformers": transformers.__version__, "tokenizers": tokenizers.__version__,
                    "python": platform.python_version()},
    }
    (out / "metrics.json").write_text(json.dumps(metrics, indent=1))
    log(f"saved {hf_dir} and {out / 'metrics.json'}; {step} steps, {tokens} tokens in "
        f"{train_seconds / 60:.1f} min of training, {metrics['total_seconds'] / 60:.1f} min in all")


MODEL_CARD = """\
# colibri tiny MoE

A small Mixtral-architecture base model of Python code, made by colibri's
`scripts/train_tiny_moe.py` (recipe and measurements: colibri's `docs/tiny-model.md`).
No chat template: it continues Python source. Encoding adds `<s>`; `</s>` ends a file.

Training data: the source of the Python {python} standard library (`Lib/**/*.py`, test
suites excluded), used under the PSF License Agreement. Copyright (c) 2001-2023 Python
Software Foundation; All Rights Reserved. Summary of changes: no source is distributed;
the weights and the byte-level BPE tokenizer (vocabulary {vocab}) were learnt from it.
"""


def cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True, help="output directory (the model goes to OUT/hf)")
    ap.add_argument("--minutes", type=float, default=30.0, help="wall-clock budget, everything included")
    ap.add_argument("--steps", type=int, default=None,
                    help="number of optimizer steps (default: as many as fit in --minutes, measured)")
    ap.add_argument("--stop-after", type=int, default=None,
                    help="stop after this many steps, keeping the schedule of --steps (to reproduce a run "
                         "that the wall-clock budget cut short)")
    ap.add_argument("--vocab-size", type=int, default=4096)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--config", nargs="*", default=[], metavar="KEY=VALUE",
                    help="override MixtralConfig fields, e.g. hidden_size=192 (for experiments)")
    train(ap.parse_args(argv))


if __name__ == "__main__":
    main()
