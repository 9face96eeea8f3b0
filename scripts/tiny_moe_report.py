#!/usr/bin/env python
"""Measure the tiny model trained by scripts/train_tiny_moe.py, on the held-out stdlib files.

    python scripts/tiny_moe_report.py DIR      # DIR as given to train_tiny_moe.py --out

Prints (and writes to DIR/report.md, DIR/report.json):
- held-out loss, perplexity per token and bits per byte, recomputed from the saved folder
  (saved tokenizer.json + model.safetensors, so it also checks what was saved);
- expert utilisation per layer: share of the top-k assignments each expert receives;
- specialisation: each held-out token is given a kind from Python's own `tokenize` module
  (keyword, identifier, string, docstring, comment, number, punctuation, whitespace); for each
  expert, lift = P(expert | kind) / P(expert), and the mutual information between the chosen
  expert and the kind, compared with the same model at initialisation (a random router
  already sorts tokens by their embeddings, so the untrained model is the right baseline);
- the tokens each expert of the most specialised layer takes most exclusively;
- greedy and sampled continuations of a few prompts.

Shapes: T tokens, L layers, E experts, K experts per token, C token kinds.
"""

from __future__ import annotations

import argparse
import io
import json
import keyword
import math
import sys
import time
import tokenize
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import train_tiny_moe as tt  # noqa: E402  (also sets OMP_WAIT_POLICY before torch loads)

import numpy as np  # noqa: E402
import torch  # noqa: E402

KINDS = ["keyword", "identifier", "string", "docstring", "comment", "number", "punctuation",
         "whitespace", "special"]
# "def " ends with a lone space token, which training text has only before other blanks
# (it has `def`, `" name"`): a boundary problem of GPT-2-style BPE, kept in to show it.
PROMPTS = ["def ", "import os\n", "class Stack:\n"]


# --------------------------------------------------------------------------------------------
# Token kinds
# --------------------------------------------------------------------------------------------

def char_kinds(text: str) -> np.ndarray:
    """(len(text),) kind index of every character, from Python's tokenizer. Characters outside
    any token (indentation, blank space) are whitespace."""
    kinds = np.full(len(text), KINDS.index("whitespace"), dtype=np.int8)
    line_start = [0]
    for line in text.splitlines(keepends=True):
        line_start.append(line_start[-1] + len(line))

    def pos(rc):
        return line_start[rc[0] - 1] + rc[1]

    try:
        toks = list(tokenize.generate_tokens(io.StringIO(text).readline))
    except (tokenize.TokenError, SyntaxError, IndentationError):
        return kinds
    structural = {tokenize.NEWLINE, tokenize.NL, tokenize.INDENT, tokenize.DEDENT, tokenize.ENCODING}
    prev = None
    for i, t in enumerate(toks):
        kind = None
        if t.type == tokenize.NAME:
            # soft keywords (match, case, _) are identifiers far more often than not in the stdlib
            kind = "keyword" if keyword.iskeyword(t.string) else "identifier"
        elif t.type == tokenize.STRING:
            nxt = toks[i + 1].type if i + 1 < len(toks) else tokenize.ENDMARKER
            alone = (prev is None or prev in structural) and nxt in (tokenize.NEWLINE, tokenize.ENDMARKER)
            kind = "docstring" if alone else "string"
        elif t.type == tokenize.COMMENT:
            kind = "comment"
        elif t.type == tokenize.NUMBER:
            kind = "number"
        elif t.type == tokenize.OP:
            kind = "punctuation"
        if kind is not None:
            kinds[pos(t.start): pos(t.end)] = KINDS.index(kind)
        if t.type not in (tokenize.NL, tokenize.COMMENT):
            prev = t.type
    return kinds


def stream_with_kinds(tok, files) -> tuple[np.ndarray, np.ndarray]:
    """(T,) token ids '<s> file </s> ...' exactly as in training, and (T,) their kinds: the kind of
    the token's first non-blank character (its first character if it is all blank)."""
    bos, eos = tok.token_to_id(tt.BOS), tok.token_to_id(tt.EOS)
    special = KINDS.index("special")
    ids, kinds = [], []
    for f in files:
        enc = tok.encode(f.text, add_special_tokens=False)
        ck = char_kinds(f.text)
        k = np.empty(len(enc.ids), dtype=np.int8)
        for j, (s, e) in enumerate(enc.offsets):
            piece = f.text[s:e]
            off = len(piece) - len(piece.lstrip()) if piece.strip() else 0
            k[j] = ck[min(s + off, len(ck) - 1)]
        ids += [bos] + enc.ids + [eos]
        kinds.append(np.concatenate([[special], k, [special]]))
    return np.asarray(ids, dtype=np.int32), np.concatenate(kinds).astype(np.int8)


# --------------------------------------------------------------------------------------------
# One pass over the held-out set: loss and routing
# --------------------------------------------------------------------------------------------

@torch.no_grad()
def routing_pass(model, stream: np.ndarray, context: int, byte_len: np.ndarray, max_windows=None):
    """Loss over the held-out windows (same windows as train_tiny_moe.evaluate) and the top-k
    experts of every input token in every layer: (T', L, K) int8, T' = tokens routed."""
    model.eval()
    K = model.config.num_experts_per_tok
    wins = tt.eval_windows(stream, context)[:max_windows]
    nll_sum, n_tok, n_bytes, chosen = 0.0, 0, 0, []
    for w in wins:
        x = torch.from_numpy(w.astype(np.int64))[None]  # (1, S+1)
        nll, out = tt.lm_forward(model, x, with_router=True)
        n = x.shape[1] - 1
        nll_sum += nll.item() * n
        n_tok += n
        n_bytes += int(byte_len[w[1:]].sum())
        # router_logits: L x (S, E); transformers' rule: softmax then top-k
        top = torch.stack([rl.softmax(-1).topk(K, dim=-1).indices for rl in out.router_logits], 1)
        chosen.append(top.numpy().astype(np.int8))  # (S, L, K)
    loss = nll_sum / n_tok
    stats = {"loss_per_token": loss, "ppl_per_token": math.exp(loss), "tokens": n_tok, "bytes": n_bytes,
             "bits_per_byte": nll_sum / n_bytes / math.log(2)}
    return stats, np.concatenate(chosen)


def routing_stats(chosen: np.ndarray, kinds: np.ndarray, E: int) -> dict:
    """chosen (T, L, K), kinds (T,) -> counts and derived statistics per layer."""
    T, L, K = chosen.shape
    C = len(KINDS)
    counts = np.zeros((L, E, C), dtype=np.int64)  # top-k assignments per (layer, expert, kind)
    for l in range(L):
        for k in range(K):
            np.add.at(counts[l], (chosen[:, l, k], kinds), 1)
    share = counts.sum(2) / (T * K)  # (L, E), sums to 1 per layer
    n_kind = np.bincount(kinds, minlength=C)  # (C,)
    with np.errstate(divide="ignore", invalid="ignore"):
        rate = counts / (n_kind[None, None, :] * K)  # P(expert | kind), per assignment
        lift = rate / share[:, :, None]
        # mutual information between expert and kind, over assignments, normalised by H(kind)
        p = counts / (T * K)
        pe, pc = p.sum(2, keepdims=True), p.sum(1, keepdims=True)
        mi = np.sum(p * np.log(np.where(p > 0, p / (pe * pc), 1.0)), axis=(1, 2))
    pk = n_kind / n_kind.sum()
    h_kind = -np.sum(pk[pk > 0] * np.log(pk[pk > 0]))
    ent = -np.sum(share * np.log(np.where(share > 0, share, 1.0)), axis=1) / math.log(E)
    lift = np.nan_to_num(lift, nan=0.0, posinf=0.0)  # an expert nobody chose prefers nothing
    return {"counts": counts, "share": share, "lift": lift, "n_kind": n_kind,
            "mi_over_h": mi / h_kind, "balance_entropy": ent}


def top_tokens(chosen: np.ndarray, ids: np.ndarray, layer: int, E: int, tok, min_count: int = 30, n: int = 6):
    """For each expert of `layer`: the tokens (seen >= min_count times) it receives most
    exclusively, as (token, fraction of that token's occurrences routed to the expert)."""
    K = chosen.shape[2]
    V = tok.get_vocab_size()
    c = np.zeros((V, E), dtype=np.int64)
    for k in range(K):
        np.add.at(c, (ids, chosen[:, layer, k]), 1)
    tot = np.bincount(ids, minlength=V)
    out = []
    for e in range(E):
        frac = np.where(tot >= min_count, c[:, e] / np.maximum(tot, 1), -1)
        best = np.argsort(-frac, kind="stable")[:n]
        out.append([(tok.id_to_token(int(i)), float(frac[i])) for i in best if frac[i] > 0])
    return out


# --------------------------------------------------------------------------------------------
# Samples
# --------------------------------------------------------------------------------------------

@torch.no_grad()
def samples(model, hf_tok, max_new_tokens: int, seed: int) -> list[dict]:
    model.eval()
    out = []
    for prompt in PROMPTS:
        x = hf_tok(prompt, return_tensors="pt")["input_ids"]  # starts with <s>, as in training
        for mode in ("greedy", "sampled"):
            torch.manual_seed(seed)
            kw = dict(do_sample=False) if mode == "greedy" else dict(do_sample=True, temperature=0.8, top_k=40)
            y = model.generate(x, max_new_tokens=max_new_tokens, eos_token_id=hf_tok.eos_token_id,
                               pad_token_id=hf_tok.pad_token_id, **kw)
            text = hf_tok.decode(y[0], skip_special_tokens=True, clean_up_tokenization_spaces=False)
            out.append({"prompt": prompt, "mode": mode, "text": text})
    return out


# --------------------------------------------------------------------------------------------
# Report
# --------------------------------------------------------------------------------------------

def fmt_token(s: str) -> str:
    """A byte-level token string, shown as the text it stands for."""
    from tokenizers import decoders

    text = decoders.ByteLevel().decode([s])
    return repr(text)[1:-1].replace("|", "\\|").replace("`", "'")


def markdown(res: dict) -> str:
    L, E = res["share"].shape
    lines = []
    h = res["heldout"]
    lines += ["### Held-out loss", "",
              f"{h['tokens']} tokens ({h['bytes']} bytes) of {res['files_val']} held-out files: "
              f"loss {h['loss_per_token']:.4f} nats/token, **perplexity {h['ppl_per_token']:.2f} per token**, "
              f"**{h['bits_per_byte']:.4f} bits per byte** (perplexity per byte "
              f"{math.exp(h['loss_per_token'] * h['tokens'] / h['bytes']):.3f}).", ""]
    lines += ["### Expert utilisation (share of top-2 assignments, held-out tokens, %)", "",
              "| layer | " + " | ".join(f"e{e}" for e in range(E)) + " | min–max | norm. entropy |",
              "|---|" + "---|" * E + "---|---|"]
    for l in range(L):
        s = res["share"][l] * 100
        lines.append(f"| {l} | " + " | ".join(f"{v:.1f}" for v in s) +
                     f" | {s.min():.1f}–{s.max():.1f} | {res['balance_entropy'][l]:.3f} |")
    lines += ["", "Uniform is 12.5 %; normalised entropy 1.0 is perfectly balanced.", ""]

    nk = res["n_kind"]
    lines += ["### Token kinds in the held-out text", "",
              "| " + " | ".join(KINDS) + " |", "|" + "---|" * len(KINDS),
              "| " + " | ".join(f"{100 * v / nk.sum():.1f} %" for v in nk) + " |", ""]

    lines += ["### Specialisation: the kind each expert prefers most", "",
              "lift = P(expert | kind) / P(expert); 1.0 = no preference. Kinds under 1 % of the tokens "
              "are left out of the ranking.", "",
              "| layer | " + " | ".join(f"e{e}" for e in range(E)) + " |", "|---|" + "---|" * E]
    ok = nk / nk.sum() >= 0.01
    for l in range(L):
        cells = []
        for e in range(E):
            lf = np.where(ok, res["lift"][l, e], -1)
            c = int(np.argmax(lf))
            cells.append(f"{KINDS[c]} ×{lf[c]:.1f}")
        lines.append(f"| {l} | " + " | ".join(cells) + " |")
    lines += ["", "Mutual information between the chosen expert and the token kind, as a fraction of "
              "the kind's entropy (0 = routing ignores the kind):", "",
              "| layer | " + " | ".join(str(l) for l in range(L)) + " |", "|---|" + "---|" * L,
              "| trained | " + " | ".join(f"{v:.3f}" for v in res["mi_over_h"]) + " |"]
    if "init_mi_over_h" in res:
        lines.append("| at initialisation | " + " | ".join(f"{v:.3f}" for v in res["init_mi_over_h"]) + " |")
    best = res["best_layer"]
    lines += ["", f"Lift of every expert for every kind in layer {best} (the most specialised layer):", "",
              "| expert | share | " + " | ".join(k for k, o in zip(KINDS, ok) if o) + " |",
              "|---|---|" + "---|" * int(ok.sum())]
    for e in range(E):
        lines.append(f"| e{e} | {100 * res['share'][best, e]:.1f} % | " +
                     " | ".join(f"{res['lift'][best, e, c]:.2f}" for c in range(len(KINDS)) if ok[c]) + " |")
    lines += ["", f"Tokens each expert of layer {best} takes most exclusively (fraction of the token's "
              "occurrences routed to it, tokens seen ≥ 30 times; with top-2 routing the maximum is 1.0):", "",
              "| expert | tokens |", "|---|---|"]
    for e, toks in enumerate(res["top_tokens"]):
        lines.append(f"| e{e} | " + ", ".join(f"`{fmt_token(s)}` {f:.2f}" for s, f in toks) + " |")
    lines += ["", "### Samples", ""]
    for s in res["samples"]:
        lines += [f"Prompt `{s['prompt']!r}`, {s['mode']}"
                  + ("" if s["mode"] == "greedy" else " (temperature 0.8, top-k 40, seed 0)") + ":", "",
                  "```python", s["text"].rstrip("\n"), "```", ""]
    return "\n".join(lines)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("dir", help="the --out directory of train_tiny_moe.py")
    ap.add_argument("--max-windows", type=int, default=None, help="evaluate only the first N windows")
    ap.add_argument("--no-baseline", action="store_true", help="skip the model-at-initialisation baseline")
    ap.add_argument("--max-new-tokens", type=int, default=96)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    from tokenizers import Tokenizer
    from transformers import AutoTokenizer, MixtralForCausalLM
    import transformers
    transformers.logging.set_verbosity_error()

    t0 = time.time()
    hf = Path(args.dir) / "hf"
    tok = Tokenizer.from_file(str(hf / "tokenizer.json"))
    hf_tok = AutoTokenizer.from_pretrained(hf)
    model = MixtralForCausalLM.from_pretrained(hf, dtype=torch.float32, experts_implementation="eager")
    cfg = model.config
    E, context = cfg.num_local_experts, cfg.max_position_embeddings

    _, val_files, corpus = tt.stdlib_files()
    metrics_path = Path(args.dir) / "metrics.json"
    if metrics_path.exists():
        trained_on = json.loads(metrics_path.read_text())["corpus"]
        if trained_on["sha256"] != corpus["sha256"]:
            print("warning: this interpreter's stdlib differs from the one the model was trained on", file=sys.stderr)
    ids, kinds = stream_with_kinds(tok, val_files)
    byte_len = tt.token_byte_lengths(tok)

    heldout, chosen = routing_pass(model, ids, context, byte_len, args.max_windows)
    T = chosen.shape[0]
    st = routing_stats(chosen, kinds[:T], E)
    best = int(np.argmax(st["mi_over_h"]))
    res = {"heldout": heldout, "files_val": len(val_files), **st, "best_layer": best,
           "top_tokens": top_tokens(chosen, ids[:T], best, E, tok)}
    if not args.no_baseline:
        seed = json.loads(metrics_path.read_text())["seed"] if metrics_path.exists() else 0
        init_cfg = type(cfg).from_dict(cfg.to_dict())
        init = tt.build_model(init_cfg, seed=seed)  # the trained model's own starting point
        init_loss, init_chosen = routing_pass(init, ids, context, byte_len, args.max_windows)
        res["init_mi_over_h"] = routing_stats(init_chosen, kinds[:T], E)["mi_over_h"]
        res["init_heldout"] = init_loss
    res["samples"] = samples(model, hf_tok, args.max_new_tokens, seed=0)

    md = markdown(res)
    print(md)
    (Path(args.dir) / "report.md").write_text(md + "\n")
    js = {k: (v.tolist() if isinstance(v, np.ndarray) else v) for k, v in res.items()}
    js["kinds"] = KINDS
    (Path(args.dir) / "report.json").write_text(json.dumps(js, indent=1))
    print(f"\n({time.time() - t0:.0f} s)", file=sys.stderr)


if __name__ == "__main__":
    main()
