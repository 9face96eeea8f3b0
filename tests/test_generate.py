"""Generation: tokenizer from the file, incremental text, stops, seeds, chat, the CLI command."""
from __future__ import annotations

import argparse

import numpy as np
import pytest

pytest.importorskip("transformers")

import colibri.api as api  # noqa: E402
from colibri.commands import generate as gen_cmd  # noqa: E402
from colibri.convert import ConversionWarning, convert  # noqa: E402
from colibri.errors import ColibriError  # noqa: E402
from colibri.format.tokenizer import IncrementalDecoder, NoTokenizerError  # noqa: E402

TEXT = "Hello wörld! 🙂 日本語 experts"


@pytest.fixture(scope="module")
def hf_path(hf_checkpoint):
    return hf_checkpoint("qwen2_moe", initializer_range=0.15)


@pytest.fixture(scope="module")
def model(hf_path, tmp_path_factory):
    out = convert(hf_path, tmp_path_factory.mktemp("gen") / "m.colibri", dtype="f32", progress=False)
    m = api.load(out, threads=1)
    yield m
    m.close()


@pytest.fixture(scope="module")
def bare_model(hf_checkpoint, tmp_path_factory):
    """A model whose file carries no tokenizer."""
    src = hf_checkpoint("olmoe", tokenizer=False)
    with pytest.warns(ConversionWarning, match="tokenizer"):
        out = convert(src, tmp_path_factory.mktemp("bare") / "m.colibri", dtype="f32", progress=False)
    m = api.load(out, threads=1)
    yield m
    m.close()


# --------------------------------------------------------------------------------------------
# tokenizer
# --------------------------------------------------------------------------------------------

def test_tokenizer_matches_transformers_autotokenizer(model, hf_path):
    from transformers import AutoTokenizer
    ref = AutoTokenizer.from_pretrained(hf_path)
    tok = model.tokenizer
    assert tok.encode(TEXT) == list(ref.encode(TEXT))
    assert tok.decode(tok.encode(TEXT)) == ref.decode(ref.encode(TEXT))
    msgs = [{"role": "user", "content": "hi there"}]
    want = ref.apply_chat_template(msgs, add_generation_prompt=True, tokenize=True, return_dict=False)
    assert tok.apply_chat_template(msgs) == list(want)
    assert tok.apply_chat_template("hi there") == list(want)
    assert model.config.eos_token_id in tok.eos_token_ids


def test_incremental_decoder_whole_characters(model):
    tok = model.tokenizer
    ids = tok.encode(TEXT)
    assert len(ids) > len(TEXT.split())            # multi-byte characters span several tokens
    dec = IncrementalDecoder(tok, ids[:2])
    pieces = [dec.push(i) for i in ids[2:]] + [dec.flush()]
    assert "".join(pieces) == tok.decode(ids[2:]) == TEXT[len(tok.decode(ids[:2])):]
    assert all("\ufffd" not in p for p in pieces)
    assert "" in pieces                               # some tokens held back half a character


def test_incremental_decoder_flushes_an_unfinished_character(model):
    tok = model.tokenizer
    emoji = tok.encode("🙂")
    assert len(emoji) > 1
    dec = IncrementalDecoder(tok)
    assert dec.push(emoji[0]) == ""
    assert "\ufffd" in dec.flush()


# --------------------------------------------------------------------------------------------
# generate
# --------------------------------------------------------------------------------------------

def test_text_in_text_out_and_stream_equals_whole(model):
    whole = model.generate("Hello world", max_new_tokens=12, stop=[])
    assert isinstance(whole, str)
    pieces = list(model.generate("Hello world", max_new_tokens=12, stop=[], stream=True))
    assert all(isinstance(p, str) for p in pieces)
    assert "".join(pieces) == whole
    st = model.last_stats
    assert st.generated_tokens == 12 and st.prompt_tokens == len(model.tokenizer.encode("Hello world"))
    assert st.finish_reason == "length"
    assert st.prompt_tps > 0 and st.generation_tps > 0
    # the text is the decoded ids
    ids = model.generate(np.array(model.tokenizer.encode("Hello world")), max_new_tokens=12, stop=[])
    assert whole == model.tokenizer.decode(ids, skip_special_tokens=True)


def test_ids_in_ids_out_and_stream(model):
    prompt = np.array([5, 17, 42, 99])
    ids = model.generate(prompt, max_new_tokens=10, stop=[])
    assert ids.dtype == np.int64 and ids.shape == (10,)
    assert list(model.generate(prompt, max_new_tokens=10, stop=[], stream=True)) == ids.tolist()
    assert api.generate(model, prompt.tolist(), max_new_tokens=10, stop=[]).tolist() == ids.tolist()
    assert model.generate(prompt, max_new_tokens=0).shape == (0,)


def test_greedy_is_argmax_of_forward(model):
    prompt = np.array([7, 8, 9, 10, 11])
    ids = model.generate(prompt, max_new_tokens=5, stop=[])
    seq = list(prompt)
    for t in ids:
        assert t == int(np.argmax(api.forward(model, np.array(seq))[-1]))
        seq.append(int(t))


def test_seed_reproducible(model):
    kw = dict(max_new_tokens=16, temperature=1.0, top_k=50, top_p=0.95, stop=[])
    a = model.generate([3, 4, 5], seed=1, **kw)
    b = model.generate([3, 4, 5], seed=1, **kw)
    c = model.generate([3, 4, 5], seed=2, **kw)
    np.testing.assert_array_equal(a, b)
    assert not np.array_equal(a, c)


def test_stop_token_and_stop_text(model):
    prompt = np.array([5, 17, 42, 99])
    ids = model.generate(prompt, max_new_tokens=10, stop=[])
    k = next(i for i in range(1, 10) if ids[i] not in ids[:i])   # first new id after the start
    cut = model.generate(prompt, max_new_tokens=10, stop=[int(ids[k])])
    np.testing.assert_array_equal(cut, ids[:k])
    assert model.last_stats.finish_reason == "stop"
    text = model.generate("Hello world", max_new_tokens=16, stop=[])
    if len(text) >= 4:
        needle = text[len(text) // 2:len(text) // 2 + 2]
        got = model.generate("Hello world", max_new_tokens=16, stop=[needle])
        assert got == text[:text.index(needle)]
        pieces = model.generate("Hello world", max_new_tokens=16, stop=[needle], stream=True)
        assert "".join(pieces) == got


def test_default_stop_is_eos(model, monkeypatch):
    prompt = np.array([5, 6, 7])
    free = model.generate(prompt, max_new_tokens=6, stop=[])
    from colibri.generation.generate import default_stop_ids
    assert model.config.eos_token_id in default_stop_ids(model)
    # make the third greedy token the model's eos: default generation ends right before it
    k = next(i for i in range(2, 6) if free[i] not in free[:i])
    monkeypatch.setattr(model, "config", model.config.replace(eos_token_id=int(free[k])))
    np.testing.assert_array_equal(model.generate(prompt, max_new_tokens=6), free[:k])
    assert model.last_stats.finish_reason == "stop"


def test_chat_mode_uses_the_template(model):
    model.generate("hi there", max_new_tokens=2, chat=True, stop=[])
    n = len(model.tokenizer.apply_chat_template("hi there"))
    assert model.last_stats.prompt_tokens == n
    model.generate([{"role": "user", "content": "hi there"}], max_new_tokens=2, stop=[])
    assert model.last_stats.prompt_tokens == n
    with pytest.raises(ValueError, match="chat"):
        model.generate([1, 2, 3], chat=True)


def test_ctx_limits_generation(model):
    ids = model.generate(np.arange(3, 9), max_new_tokens=50, ctx=10, stop=[])
    assert len(ids) == 4 and model.last_stats.finish_reason == "ctx"
    with pytest.raises(ColibriError, match="ctx is 5"):
        model.generate(np.arange(3, 9), max_new_tokens=5, ctx=5)


def test_embeddings_prompt_equals_ids_prompt(model):
    prompt = np.array([12, 40, 41, 7])
    emb = model.embed(prompt[None])[0]
    a = model.generate(prompt, max_new_tokens=6, stop=[])
    b = model.generate(None, input_embeds=emb, max_new_tokens=6, stop=[])
    assert isinstance(b, str)                      # the model has a tokenizer: text out
    assert b == model.tokenizer.decode(a, skip_special_tokens=True)


def test_routing_steps(model):
    steps = model.generate(np.array([5, 6, 7]), max_new_tokens=4, stop=[], return_routing=True)
    toks = [s for s in steps if s.token >= 0]
    assert len(toks) == 4
    for s in toks:
        assert s.routing.layers == [0]
        ids, w = s.routing[0]
        assert ids.shape == (1, 2) and w.shape == (1, 2)
        assert (ids >= 0).all() and (ids < model.config.num_experts).all()


def test_no_tokenizer(bare_model):
    assert bare_model.tokenizer is None
    with pytest.raises(NoTokenizerError, match="no tokenizer"):
        bare_model.generate("some text", max_new_tokens=2)
    ids = bare_model.generate(np.array([1, 2, 3]), max_new_tokens=3, stop=[])
    assert ids.shape == (3,)


# --------------------------------------------------------------------------------------------
# forward: input validation
# --------------------------------------------------------------------------------------------

@pytest.mark.parametrize("bad, match", [
    (np.array([1, 2, 320]), r"out of range \[0, 320\).*max 320"),
    (np.array([1, -1, 2]), r"out of range.*min -1"),
    (np.array([1.0, 2.0]), "integers"),
    (np.zeros((1, 2, 3), np.int64), "ndim 3"),
    (np.zeros((0,), np.int64), "empty"),
])
def test_forward_rejects_bad_ids(model, bad, match):
    with pytest.raises(ValueError, match=match):
        api.forward(model, bad)


def test_forward_rejects_mismatched_cache_and_shapes(model):
    cache = model.new_cache(ctx=8, batch=2)
    with pytest.raises(ValueError, match="cache batch 2 does not match input batch 3"):
        api.forward(model, np.ones((3, 2), np.int64), cache=cache)
    with pytest.raises(ValueError, match="exactly one"):
        api.forward(model)
    with pytest.raises(ValueError, match="input_embeds must have shape"):
        api.forward(model, input_embeds=np.zeros((2, 5), np.float32))
    with pytest.raises(ValueError, match="attention_mask must have shape"):
        api.forward(model, np.ones((2, 3), np.int64), attention_mask=np.ones((2, 4)))
    assert len(cache) == 0                          # failed calls leave the cache untouched


def test_new_cache_default_ctx(model):
    c = model.new_cache()
    assert c.ctx == min(model.config.max_position_embeddings, 4096)
    assert c.k[0].shape == (1, model.n_kv_heads, c.ctx, model.head_dim)


# --------------------------------------------------------------------------------------------
# the CLI command
# --------------------------------------------------------------------------------------------

def _run_cli(argv):
    parser = argparse.ArgumentParser()
    gen_cmd.register(parser.add_subparsers(dest="command"))
    args = parser.parse_args(["generate", *argv])
    return args.func(args)


def test_cli_generate_verbose(model, capsys):
    rc = _run_cli([str(model.file.path), "-p", "Hello world", "-n", "5", "--temp", "0",
                   "--threads", "1", "--verbose"])
    assert rc == 0
    out, err = capsys.readouterr()
    want = model.generate("Hello world", max_new_tokens=5)
    assert out == want + "\n"
    lines = [l for l in err.splitlines() if l.startswith("token ")]
    assert len(lines) == len(model.last_stats and range(model.last_stats.generated_tokens))
    assert all("L0 → [" in l for l in lines)
    assert "tok/s" in err and "attention" in err and "experts" in err


def test_cli_generate_embeddings_and_errors(model, tmp_path, capsys):
    emb = model.embed(np.array([[4, 5, 6]]))[0]
    np.save(tmp_path / "e.npy", emb)
    assert _run_cli([str(model.file.path), "--embeddings", str(tmp_path / "e.npy"), "-n", "3",
                     "--temp", "0"]) == 0
    with pytest.raises(ColibriError, match="-p PROMPT"):
        _run_cli([str(model.file.path)])
    with pytest.raises(ColibriError, match="--top-p"):
        _run_cli([str(model.file.path), "-p", "x", "--top-p", "0"])
    np.save(tmp_path / "bad.npy", np.zeros((3, 7), np.float32))
    with pytest.raises(ColibriError, match=r"shape \(S, 64\)"):
        _run_cli([str(model.file.path), "--embeddings", str(tmp_path / "bad.npy")])


@pytest.mark.parametrize("activations", ["int8", "int16"])
def test_cli_generate_quantized_activations(capsys, activations):
    """--activations int8 / int16 reaches the model: the shipped (q4) model's greedy text
    equals colibri.load(activations=...).generate, and the option is checked."""
    path = api.default_model_path()
    assert _run_cli([str(path), "-p", "def f(x):", "-n", "8", "--temp", "0", "--threads", "1",
                     "--activations", activations]) == 0
    with api.load(path, threads=1, activations=activations) as m:
        assert m.activations == activations and f"activations={activations}" in repr(m)
        assert capsys.readouterr().out == m.generate("def f(x):", max_new_tokens=8) + "\n"
    with pytest.raises(SystemExit):
        _run_cli([str(path), "-p", "x", "--activations", "int4"])
    assert "invalid choice: 'int4'" in capsys.readouterr().err


def test_default_model_path(monkeypatch, tmp_path):
    p = api.default_model_path()                 # ships with the package
    assert p.name == "tiny-moe.colibri" and p.is_file()
    monkeypatch.setattr(api, "__file__", str(tmp_path / "api.py"))
    with pytest.raises(ColibriError, match="tiny-moe.colibri"):
        api.default_model_path()


def test_cli_main_one_line_error_and_success(model, monkeypatch, capsys):
    from colibri import cli
    if "generate" not in cli.COMMANDS:
        monkeypatch.setattr(cli, "COMMANDS", (*cli.COMMANDS, "generate"))
    assert cli.main(["generate", str(model.file.path), "-p", "Hi", "-n", "3", "--temp", "0"]) == 0
    assert capsys.readouterr().out == model.generate("Hi", max_new_tokens=3) + "\n"
    assert cli.main(["generate", str(model.file.path), "--ctx", "0", "-p", "Hi"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("colibri generate: error:") and "--ctx" in err[0]


def test_tokenizer_falls_back_to_files_on_disk(model, monkeypatch):
    import transformers
    from colibri.format.tokenizer import Tokenizer

    class Broken:
        def __init__(self, *a, **k):
            raise RuntimeError("in-memory construction unavailable")

    monkeypatch.setattr(transformers, "PreTrainedTokenizerFast", Broken)
    tok = Tokenizer.from_files(model.file.tokenizer_files)
    assert tok.encode(TEXT) == model.tokenizer.encode(TEXT)
    assert tok.apply_chat_template("hi") == model.tokenizer.apply_chat_template("hi")
