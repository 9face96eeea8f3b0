"""colibri perplexity: windows, perplexity against a direct NumPy computation from
colibri.forward logits, KL statistics against a base model, the command line."""
from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest

pytest.importorskip("transformers")

import colibri  # noqa: E402
from cli_helpers import run as run_cli  # noqa: E402
from colibri.convert import ConversionWarning, convert  # noqa: E402
from colibri.errors import ColibriError  # noqa: E402
from colibri.tools.perplexity import (check_same_vocabulary, format_markdown, perplexity,  # noqa: E402
                                plan_windows)

TEXT = ("The hummingbird is small, fast and frugal. Mixture of experts models route each "
        "token to a few experts; the router picks them. def fibonacci(n): return n. ") * 4


@pytest.fixture(scope="module")
def files(hf_checkpoint, tmp_path_factory):
    """f32 and q4 (experts, shared expert, attention, head, dense) conversions of one
    checkpoint whose logits are spread out (initializer_range 0.15)."""
    src = hf_checkpoint("qwen2_moe", initializer_range=0.15)
    where = tmp_path_factory.mktemp("ppl")
    f32 = convert(src, where / "f32.colibri", dtype="f32", progress=False)
    q4 = convert(src, where / "q4.colibri", dtype="f32", quant="q4", group_size=32,
                 quantize="experts,shared,attn,head,dense", progress=False)
    return SimpleNamespace(f32=f32, q4=q4, where=where)


@pytest.fixture(scope="module")
def model(files):
    m = colibri.load(files.f32, threads=1, kv_dtype="f32")    # no cache: forward's logits
    yield m
    m.close()


@pytest.fixture(scope="module")
def ids():
    return np.random.default_rng(7).integers(0, 320, 70)


def log_softmax(x: np.ndarray) -> np.ndarray:
    x = x.astype(np.float64)
    m = x.max(axis=-1, keepdims=True)
    return x - m - np.log(np.exp(x - m).sum(axis=-1, keepdims=True))


# --------------------------------------------------------------------------------------------
# windows
# --------------------------------------------------------------------------------------------

def test_chunk_windows_score_the_second_half():
    assert plan_windows(20, 8) == [(0, 5), (8, 5)]              # tail of 4 tokens dropped
    assert plan_windows(16, 16) == [(0, 9)]


@pytest.mark.parametrize("n, ctx, stride", [(20, 8, 3), (20, 8, 7), (8, 8, 1), (37, 10, 4),
                                            (100, 16, 16 - 1), (9, 4, 2)])
def test_stride_windows_score_every_token_once(n, ctx, stride):
    seen = np.zeros(n, int)
    for j, (begin, first) in enumerate(plan_windows(n, ctx, stride)):
        assert 0 <= begin and begin + ctx <= n and 1 <= first < ctx
        seen[begin + first:begin + ctx] += 1
        if j:                                          # context behind every scored token
            assert first >= ctx - stride
    assert seen[0] == 0 and (seen[1:] == 1).all()


@pytest.mark.parametrize("args, match", [
    ((10, 3), "ctx must be at least 4"),
    ((7, 8), "7 tokens, fewer than one window of ctx 8"),
    ((20, 8, 8), r"stride must be in \[1, ctx\)"),
    ((20, 8, 0), r"stride must be in \[1, ctx\)"),
])
def test_window_errors(args, match):
    with pytest.raises(ValueError, match=match):
        plan_windows(*args)


# --------------------------------------------------------------------------------------------
# perplexity, exactly
# --------------------------------------------------------------------------------------------

def test_perplexity_equals_numpy_from_forward_logits(model, ids):
    ctx = 16
    res = perplexity(model, ids, ctx=ctx)
    nll = []
    for c in range(len(ids) // ctx):                          # llama-perplexity's scheme
        window = ids[c * ctx:(c + 1) * ctx]
        lp = log_softmax(colibri.forward(model, window))      # (ctx, V)
        for pos in range(ctx // 2 + 1, ctx):                  # second half scored
            nll.append(-lp[pos - 1, window[pos]])
    np.testing.assert_allclose(res.nll, nll, rtol=1e-12, atol=0)
    assert res.n_scored == 4 * 7 and len(res.windows) == 4
    assert res.ppl == pytest.approx(np.exp(np.mean(nll)), rel=1e-12)
    assert res.ppl_stderr == pytest.approx(res.ppl * np.std(nll, ddof=1) / np.sqrt(len(nll)))


def test_stride_perplexity_from_forward_logits(model, ids):
    ctx, stride = 12, 5
    res = perplexity(model, ids, ctx=ctx, stride=stride)
    assert res.n_scored == len(ids) - 1
    want = {}
    for begin, first in res.windows:
        window = ids[begin:begin + ctx]
        lp = log_softmax(colibri.forward(model, window))
        for pos in range(first, ctx):
            want[begin + pos] = -lp[pos - 1, window[pos]]
    assert sorted(want) == list(range(1, len(ids)))           # every token once, in order
    np.testing.assert_allclose(res.nll, [want[t] for t in sorted(want)], rtol=1e-12, atol=0)


def test_batch_and_text_input(model, files, ids):
    one = perplexity(model, ids, ctx=16, batch=1)
    three = perplexity(model, ids, ctx=16, batch=3)           # 4 windows: batches of 3 and 1
    np.testing.assert_allclose(three.nll, one.nll, rtol=1e-4, atol=1e-5)
    text = perplexity(files.f32, TEXT, ctx=16, threads=1,     # a path: opened and closed here
                      kv_dtype="f32")
    by_ids = perplexity(model, np.array(model.tokenizer.encode(TEXT)), ctx=16)
    np.testing.assert_array_equal(text.nll, by_ids.nll)
    assert text.n_tokens == len(model.tokenizer.encode(TEXT))


# --------------------------------------------------------------------------------------------
# BOS at the start of every window (llama-perplexity's add_bos)
# --------------------------------------------------------------------------------------------

SHIPPED = Path(colibri.__file__).parent / "models" / "tiny-moe.colibri"


@pytest.fixture(scope="module")
def shipped():
    """The shipped model: its tokenizer puts BOS (id 0) first, as a Llama-style one does."""
    m = colibri.load(SHIPPED, threads=1, kv_dtype="f32")
    yield m
    m.close()


def test_windows_start_with_bos_when_the_tokenizer_puts_one_first(shipped):
    """Default scheme, text in: every window's first token is replaced by BOS (the others and
    the scored positions as they are); the nll is the one computed here from forward on
    those windows; --no-bos's windows are the stream as it is, and differ."""
    ctx = 16
    ids = np.array(shipped.tokenizer.encode(TEXT))
    bos = shipped.tokenizer.bos_token_id
    assert shipped.tokenizer.adds_bos and ids[0] == bos
    res = perplexity(shipped, TEXT, ctx=ctx)
    cut = perplexity(shipped, TEXT, ctx=ctx, bos=False)
    assert res.bos == bos and cut.bos is None and res.windows == cut.windows
    want = {True: [], False: []}
    for c in range(len(ids) // ctx):
        for put_bos in (True, False):
            window = ids[c * ctx:(c + 1) * ctx].copy()
            if put_bos:
                window[0] = bos
            lp = log_softmax(colibri.forward(shipped, window))
            want[put_bos] += [-lp[pos - 1, window[pos]] for pos in range(ctx // 2 + 1, ctx)]
    np.testing.assert_allclose(res.nll, want[True], rtol=1e-12, atol=0)
    np.testing.assert_allclose(cut.nll, want[False], rtol=1e-12, atol=0)
    assert not np.array_equal(res.nll, cut.nll)       # windows after the first start with BOS
    assert res.to_dict()["window_bos"] == bos and f"BOS ({bos})" in format_markdown(res)


def test_window_bos_rule(shipped, model, bare, ids):
    """No BOS by default with --stride or for a tokenizer that puts none first (the test
    checkpoints' Qwen-style one); bos=True puts the tokenizer's BOS anyway; a model without
    a BOS token refuses bos=True, naming the file."""
    assert perplexity(shipped, TEXT, ctx=16, stride=8).bos is None
    assert not model.tokenizer.adds_bos and model.tokenizer.bos_token_id is not None
    assert perplexity(model, ids, ctx=16).bos is None
    forced = perplexity(model, ids, ctx=16, bos=True)
    by_hand = ids.copy()
    by_hand[::16] = model.tokenizer.bos_token_id          # every window's first token
    assert forced.bos == model.tokenizer.bos_token_id
    np.testing.assert_array_equal(forced.nll, perplexity(model, by_hand, ctx=16).nll)
    with colibri.load(bare, threads=1, kv_dtype="f32") as m:
        with pytest.raises(ValueError, match=r"bos=True, but .*bare.colibri has no BOS token"):
            perplexity(m, ids, ctx=16, bos=True)
        assert perplexity(m, ids, ctx=16).bos is None


# --------------------------------------------------------------------------------------------
# KL against a base model
# --------------------------------------------------------------------------------------------

def test_kl_of_a_model_against_itself_is_zero(model, files, ids):
    res = perplexity(model, ids, ctx=16, base=files.f32, threads=1)
    k = res.kl
    assert k.kl.shape == res.nll.shape and (k.kl == 0).all()
    assert k.same_top == 1.0 and k.ppl_ratio == 1.0 and k.ppl_base == res.ppl
    assert k.mean == k.max == k.median == 0.0


def test_q4_against_f32(files, ids):
    res = perplexity(files.q4, ids, ctx=16, base=files.f32, threads=1, kv_dtype="f32")
    k = res.kl
    assert k.mean > 0 and 0 < k.same_top <= 1
    qs = [k.median] + [k.quantile(q) for q in (0.9, 0.95, 0.99, 0.999)] + [k.max]
    assert qs == sorted(qs)
    assert k.ppl_ratio == pytest.approx(res.ppl / k.ppl_base)
    # every window's KL values and top tokens, computed here from both models' logits
    kl, same = [], []
    with colibri.load(files.q4, threads=1, kv_dtype="f32") as q, \
            colibri.load(files.f32, threads=1, kv_dtype="f32") as f:
        for begin, first in res.windows:
            w = ids[begin:begin + 16]
            lq = log_softmax(colibri.forward(q, w))[first - 1:15]
            lf = log_softmax(colibri.forward(f, w))[first - 1:15]
            kl.append((np.exp(lf) * (lf - lq)).sum(-1))
            same.append(lq.argmax(-1) == lf.argmax(-1))
    np.testing.assert_allclose(k.kl, np.concatenate(kl), rtol=1e-9, atol=1e-15)
    assert k.same_top == np.concatenate(same).mean()
    d = res.to_dict()
    assert d["kl"]["kl_q99_9"] == k.quantile(0.999) and d["kl"]["same_top"] == k.same_top
    text = format_markdown(res, source="ids")
    assert "KL(base ‖ model)" in text and "same top" in text and "(base)" in text


def test_int8_activations_against_the_same_file(files, ids, capsys, tmp_path):
    """activations="int8" applies to the model only: the same q4 file as its own base
    measures what the int8 activations cost (KL > 0, small), and the CLI passes -a on."""
    res = perplexity(files.q4, ids, ctx=16, base=files.q4, threads=1, activations="int8")
    assert 0 < res.kl.mean < 0.05 and res.kl.same_top > 0.8
    with colibri.load(files.q4, threads=1, activations="int8") as m:
        np.testing.assert_array_equal(perplexity(m, ids, ctx=16, threads=1).nll, res.nll)
    np.save(tmp_path / "ids.npy", ids)
    code, out, _ = run(capsys, files.q4, "-f", tmp_path / "ids.npy", "--ctx", 16, "--kl-base",
                       files.q4, "-a", "int8", "-o", "json")
    assert code == 0 and json.loads(out)["kl"]["kl_mean"] > 0


def test_default_activations_against_the_same_file(files, ids):
    """Without activations= the model (a path) runs the default, int16, and a base given as
    a path exact f32: the same q4 file as its own base measures int16's cost (KL > 0, tiny);
    activations="f32" gives KL 0."""
    res = perplexity(files.q4, ids, ctx=16, base=files.q4, threads=1)
    assert 0 < res.kl.mean < 1e-4 and res.kl.same_top == 1.0
    with colibri.load(files.q4, threads=1, activations="int16") as m:
        np.testing.assert_array_equal(perplexity(m, ids, ctx=16, threads=1).nll, res.nll)
    exact = perplexity(files.q4, ids, ctx=16, base=files.q4, threads=1, activations="f32",
                       kv_dtype="f32")
    assert exact.kl.mean == 0.0 and exact.kl.same_top == 1.0


def test_vocabulary_must_match():
    def fake(v, tok):
        return SimpleNamespace(vocab_size=v, file=SimpleNamespace(
            path=f"m{v}.colibri", tokenizer_files=None if tok is None else {"tokenizer.json": tok}))
    check_same_vocabulary(fake(320, "a"), fake(320, "a"))
    with pytest.raises(ColibriError, match="vocab_size 352 vs 320"):
        check_same_vocabulary(fake(320, "a"), fake(352, "a"))
    with pytest.raises(ColibriError, match="tokenizers .*differ"):
        check_same_vocabulary(fake(320, "a"), fake(320, "b"))
    with pytest.raises(ColibriError, match="only one of them carries a tokenizer"):
        check_same_vocabulary(fake(320, "a"), fake(320, None))


# --------------------------------------------------------------------------------------------
# the command
# --------------------------------------------------------------------------------------------

def run(capsys, *argv) -> tuple[int, str, str]:
    return run_cli(capsys, "perplexity", *argv)


def test_cli_markdown_and_json(files, capsys, tmp_path):
    text = tmp_path / "t.txt"
    text.write_text(TEXT, encoding="utf-8")
    code, out, _ = run(capsys, files.q4, "-f", text, "--ctx", 16, "--kl-base", files.f32,
                       "-t", 1)
    assert code == 0
    assert "| q4.colibri " in out and "| f32.colibri (base) " in out and "same top" in out
    code, out, _ = run(capsys, files.q4, "-f", text, "--ctx", 16, "--kl-base", files.f32,
                       "-t", 1, "-o", "json", "--batch", 2)
    d = json.loads(out)
    want = perplexity(files.q4, TEXT, ctx=16, base=files.f32, threads=1)
    assert d["ppl"] == pytest.approx(want.ppl, rel=1e-5) and d["n_scored"] == want.n_scored
    assert set(d["kl"]) >= {"kl_mean", "kl_median", "kl_q90", "kl_q95", "kl_q99", "kl_q99_9",
                            "kl_max", "same_top", "ppl_base", "ppl_ratio"}
    ids = np.array(colibri.load(files.f32).tokenizer.encode(TEXT), dtype=np.int32)
    np.save(tmp_path / "ids.npy", ids)
    code, out2, _ = run(capsys, files.q4, "-f", tmp_path / "ids.npy", "--ctx", 16, "--kl-base",
                        files.f32, "-t", 1, "-o", "json", "--batch", 2)
    assert code == 0 and json.loads(out2)["ppl"] == d["ppl"]


@pytest.fixture(scope="module")
def bare(hf_checkpoint, files):
    """A file of the same vocabulary size without a tokenizer."""
    with pytest.warns(ConversionWarning, match="tokenizer"):
        return convert(hf_checkpoint("olmoe", tokenizer=False), files.where / "bare.colibri",
                       dtype="f32", progress=False)


@pytest.mark.parametrize("argv, match", [
    ([], "the following arguments are required: -f/--file"),
    (["-f", "TEXT", "--ctx", "2"], "--ctx 2 is out of range"),
    (["-f", "TEXT", "--ctx", "16", "--stride", "16"], "stride must be in [1, ctx)"),
    (["-f", "SHORT", "--ctx", "16"], "fewer than one window of ctx 16"),
    (["-f", "TEXT", "--ctx", "9999"], "longer than the model's context 256"),
    (["-f", "TEXT", "--batch", "0"], "--batch 0 is out of range"),
    (["-f", "MISSING"], "No such file or directory"),
    (["-f", "BINARY"], "not UTF-8 text"),
    (["-f", "FLOATS"], "expected a 1-D integer array"),
    (["-f", "TEXT", "--kl-base", "BARE"], "do not share a tokenizer"),
    (["-f", "TEXT", "-o", "csv"], "invalid choice: 'csv'"),
])
def test_cli_errors_are_one_line(files, bare, tmp_path, capsys, argv, match):
    (tmp_path / "t.txt").write_text(TEXT, encoding="utf-8")
    (tmp_path / "s.txt").write_text("a few words", encoding="utf-8")
    (tmp_path / "b.txt").write_bytes(b"\xff\xfe\x00abc\xff")
    np.save(tmp_path / "f.npy", np.zeros(40, np.float32))
    subst = {"TEXT": tmp_path / "t.txt", "MISSING": tmp_path / "none.txt",
             "BINARY": tmp_path / "b.txt", "FLOATS": tmp_path / "f.npy", "BARE": bare,
             "SHORT": tmp_path / "s.txt"}
    code, _, err = run(capsys, files.f32, *[subst.get(a, a) for a in argv])
    assert code == 2
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("colibri perplexity: error: "), err
    assert match in lines[0]


def test_cli_bos_flags(shipped, capsys, tmp_path):
    text = tmp_path / "t.txt"
    text.write_text(TEXT, encoding="utf-8")
    got = {}
    for flag in ((), ("--no-bos",), ("--bos", "--stride", "8")):
        code, out, _ = run(capsys, SHIPPED, "-f", text, "--ctx", 16, "-t", 1, "-o", "json",
                           "--kv-dtype", "f32",
                           *flag)
        assert code == 0
        got[flag] = json.loads(out)
    assert got[()]["window_bos"] == shipped.tokenizer.bos_token_id
    assert got[()]["ppl"] == pytest.approx(perplexity(shipped, TEXT, ctx=16).ppl, rel=1e-6)
    assert got[("--no-bos",)]["window_bos"] is None
    assert got[("--no-bos",)]["ppl"] == pytest.approx(
        perplexity(shipped, TEXT, ctx=16, bos=False).ppl, rel=1e-6)
    assert got[("--bos", "--stride", "8")]["window_bos"] == shipped.tokenizer.bos_token_id
