"""Speculative decoding against plain decoding, interleaved in one process, temperature 0.

    python scripts/bench_speculative.py                               # the shipped model
    python scripts/bench_speculative.py MODEL.colibri [MODEL ...] --tokens 128 --reps 3

For each model, two prompts: a code-editing one (the continuation repeats much of the
prompt: a function to be rewritten, given twice) and a plain one (prose with little to look
up). Each (model, prompt) runs plain, then with draft="prompt-lookup" (and --draft MODEL: with
that draft model too), --reps times alternating; the output must be the same token for token
(asserted). Printed per row: decode tokens/s of each, the ratio (median over the reps of
speculative / plain of the same rep), the acceptance rate, the verification passes and the
experts read per generated token (plain decoding reads MoE layers x K). Ends with the
lines `code-editing ratio` / `plain ratio` per model.
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

CODE = '''def compute_totals(orders, tax_rate):
    totals = []
    for order in orders:
        subtotal = 0.0
        for item in order.items:
            subtotal += item.price * item.quantity
        tax = subtotal * tax_rate
        totals.append(subtotal + tax)
    return totals


def summarize(orders, tax_rate):
    totals = compute_totals(orders, tax_rate)
    return {"count": len(totals), "sum": sum(totals), "max": max(totals)}
'''
CODE_PROMPT = ("Rename compute_totals to order_totals and keep everything else as it is.\n\n"
               + CODE + "\n# after the change:\n\n" + CODE.replace("compute_totals",
                                                                  "order_totals")[:200])
PLAIN_PROMPT = ("Write a short story about a hummingbird that travels across the mountains "
                "in winter, looking for the flowers it remembers from its youth.")


def _run(model, prompt, n, draft, k):
    t = time.perf_counter()
    out = model.generate(prompt, max_new_tokens=n, temperature=0.0, stop=[],
                         **({} if draft is None else dict(draft=draft, num_draft_tokens=k)))
    wall = time.perf_counter() - t
    st = model.last_stats
    tps = max(st.generated_tokens - 1, 0) / st.decode_seconds
    return out, tps, wall, st


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("models", nargs="*", help=".colibri files (default: the shipped model)")
    ap.add_argument("--tokens", type=int, default=128, help="tokens generated per run")
    ap.add_argument("--reps", type=int, default=3, help="alternating repetitions")
    ap.add_argument("--draft-tokens", type=int, default=4, help="num_draft_tokens")
    ap.add_argument("--draft", help="also a draft .colibri model (same tokenizer)")
    ap.add_argument("--threads", type=int, default=None)
    args = ap.parse_args(argv)
    import colibri
    paths = args.models or [str(colibri.default_model_path())]
    print(f"load: {os.getloadavg()[0]:.2f}; {args.tokens} tokens, {args.reps} reps, "
          f"k={args.draft_tokens}", flush=True)
    summary = []
    for path in paths:
        model = colibri.load(path, threads=args.threads)
        M, K = len(model.moe_layers), model.config.num_experts_per_tok
        drafts = {"prompt-lookup": "prompt-lookup"}
        if args.draft:
            drafts[os.path.basename(args.draft)] = colibri.load(args.draft, threads=args.threads)
        name = os.path.basename(path)
        for label, prompt in (("code-editing", CODE_PROMPT), ("plain", PLAIN_PROMPT)):
            for dname, draft in drafts.items():
                _run(model, prompt, 8, None, 1)                       # warm the pages
                ratios, plain_tps, spec_tps = [], [], []
                for _ in range(args.reps):
                    want, p_tps, _, _ = _run(model, prompt, args.tokens, None, 1)
                    got, s_tps, _, st = _run(model, prompt, args.tokens, draft,
                                             args.draft_tokens)
                    assert got == want, f"{name} {label} {dname}: output differs from plain"
                    ratios.append(s_tps / p_tps)
                    plain_tps.append(p_tps)
                    spec_tps.append(s_tps)
                ratio = statistics.median(ratios)
                print(f"{name:28s} {label:12s} {dname:16s} plain {statistics.median(plain_tps):7.1f} "
                      f"tok/s  spec {statistics.median(spec_tps):7.1f} tok/s  ratio {ratio:.2f}x  "
                      f"accepted {100 * st.acceptance_rate:5.1f}% of {st.draft_tokens:3d}  "
                      f"{st.verify_passes:3d} verify passes  experts/token "
                      f"{st.experts_per_token:5.1f} (plain {M * K})", flush=True)
                summary.append(f"{label} ratio {name} {dname}: {ratio:.2f}x")
        model.close()
    print("\n".join(summary))
    print(f"load: {os.getloadavg()[0]:.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
