"""colibri.format.tokenizer: the tokenizer rebuilt from the files a .colibri file embeds.

On the shipped model's tokenizer (byte-level BPE, <s> prepended, three role tokens and
a chat template) and on one
made here with the `tokenizers` package (special tokens given as AddedToken dicts, keys of
tokenizer_config.json that would send transformers looking for files, a chat template,
generation_config eos ids): encode/decode round trips, special and eos ids, the chat
template, streaming decode of multi-byte characters, and the errors.
"""
from __future__ import annotations

import json

import pytest

pytest.importorskip("transformers")

from colibri.api import load  # noqa: E402
from colibri.errors import ColibriError  # noqa: E402
from colibri.format.tokenizer import (IncrementalDecoder, NoTokenizerError, Tokenizer,  # noqa: E402
                                          tokenizer_from_files)

TEXTS = ["def fib(n):\n    return n", "héllo → 世界 🙂", "  two  spaces\n\ttab", "x"]
CHAT_TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n"
                 "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
SPECIALS = ["<s>", "</s>", "<unk>", "<|im_start|>", "<|im_end|>"]


@pytest.fixture(scope="module")
def shipped():
    model = load()
    yield model
    model.close()


def make_files(**extra: str) -> dict[str, str]:
    """Files of a byte-level BPE tokenizer trained here; special tokens get ids 0..4."""
    from tokenizers import Tokenizer as RustTokenizer, decoders, models, pre_tokenizers, trainers
    tok = RustTokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=400, special_tokens=SPECIALS, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(TEXTS * 20 + ["hello world, the user and the assistant"] * 20,
                            trainer=trainer)
    files = {
        "tokenizer.json": tok.to_str(),
        # keys that name files or classes: the in-memory build must ignore them
        "tokenizer_config.json": json.dumps({
            "tokenizer_class": "NoSuchTokenizer", "auto_map": {"AutoTokenizer": ["x.Y", None]},
            "name_or_path": "/nowhere", "model_max_length": 128, "unk_token": "<unk>",
            "clean_up_tokenization_spaces": False}),
        "special_tokens_map.json": json.dumps({
            "bos_token": {"content": "<s>", "lstrip": False, "rstrip": False},
            "eos_token": {"content": "<|im_end|>", "lstrip": False, "rstrip": False}}),
        "generation_config.json": json.dumps({"eos_token_id": [1, 4], "bos_token_id": 0}),
    }
    files.update(extra)
    return files


@pytest.fixture(scope="module")
def made() -> Tokenizer:
    return Tokenizer.from_files(make_files(**{"chat_template.jinja": CHAT_TEMPLATE}))


# --- the shipped model's tokenizer ------------------------------------------------------------

def test_shipped_round_trips(shipped):
    tok = shipped.tokenizer
    assert tok.vocab_size == shipped.vocab_size == 4096 + 3        # the base's, and 3 role tokens
    for text in TEXTS:
        ids = tok.encode(text)
        assert ids[0] == tok.bos_token_id == 0                # <s> prepended
        assert ids[1:] == tok.encode(text, add_special_tokens=False)
        assert tok.decode(ids) == "<s>" + text
        assert tok.decode(ids, skip_special_tokens=True) == text
    assert tok.encode("", add_special_tokens=False) == []


def test_shipped_special_ids(shipped):
    tok = shipped.tokenizer
    user = tok.hf.convert_tokens_to_ids("<|user|>")
    assert tok.eos_token_ids == [1, user]           # </s> ends a turn; a new user turn too
    assert [tok.token_text(i) for i in range(4)] == ["<s>", "</s>", "<unk>", "<pad>"]
    assert [tok.token_text(i) for i in range(4096, 4099)] == \
        ["<|system|>", "<|user|>", "<|assistant|>"]   # added after the base's 4096
    assert tok.decode([0, 1], skip_special_tokens=True) == ""
    ids = tok.encode("def fib", add_special_tokens=False)
    assert "".join(tok.token_text(i) for i in ids) == "def fib"
    assert repr(tok) == "Tokenizer(vocab=4099, eos=[1, 4097], chat_template=yes)"


def test_shipped_chat_template_renders_as_transformers(shipped, tmp_path):
    from transformers import AutoTokenizer
    tok = shipped.tokenizer
    assert tok.has_chat_template
    for name, text in shipped.file.tokenizer_files.items():    # the files the model embeds
        (tmp_path / name).write_text(text)
    ref = AutoTokenizer.from_pretrained(tmp_path)
    msgs = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi!"},
            {"role": "assistant", "content": "Hello."}, {"role": "user", "content": "sort?"}]
    want = ref.apply_chat_template(msgs, add_generation_prompt=True, tokenize=True,
                                   return_dict=False)
    assert tok.apply_chat_template(msgs) == list(want)
    assert tok.render_chat(msgs[1:2]) == "<s><|user|>\nHi!</s><|assistant|>\n"
    with pytest.raises(ColibriError, match="roles are system, user and assistant"):
        tok.apply_chat_template([{"role": "tool", "content": "x"}])


def test_tokenizer_from_the_embedded_files_is_the_models(shipped):
    again = tokenizer_from_files(shipped.file.tokenizer_files)
    assert isinstance(again, Tokenizer)
    for text in TEXTS:
        assert again.encode(text) == shipped.tokenizer.encode(text)


# --- a tokenizer made here --------------------------------------------------------------------

def test_made_round_trips_and_specials(made):
    assert made.vocab_size == made.hf.backend_tokenizer.get_vocab_size() > 256
    for text in TEXTS:
        ids = made.encode(text)                     # no post-processor: nothing prepended
        assert ids == made.encode(text, add_special_tokens=False)
        assert made.decode(ids) == text
    assert made.bos_token_id == 0
    assert made.hf.eos_token == "<|im_end|>"        # from the AddedToken dict
    assert made.hf.unk_token == "<unk>"             # from tokenizer_config.json
    # generation_config's [1, 4] and the tokenizer's eos (<|im_end|> = 4), once each, sorted
    assert made.eos_token_ids == [1, 4]
    ids = made.encode("<|im_start|>hello<|im_end|>")
    assert ids[0] == 3 and ids[-1] == 4
    assert made.decode(ids, skip_special_tokens=True) == "hello"


def test_made_chat_template(made):
    assert made.has_chat_template
    rendered = "<|im_start|>user\nhello world<|im_end|>\n<|im_start|>assistant\n"
    want = made.encode(rendered, add_special_tokens=False)
    assert made.apply_chat_template("hello world") == want
    assert made.apply_chat_template([{"role": "user", "content": "hello world"}]) == want
    short = made.apply_chat_template("hello world", add_generation_prompt=False)
    assert short == made.encode(rendered[:rendered.index("<|im_start|>assistant")])
    assert repr(made) == f"Tokenizer(vocab={made.vocab_size}, eos=[1, 4], chat_template=yes)"


def test_chat_template_in_tokenizer_config():
    files = make_files()
    config = json.loads(files["tokenizer_config.json"])
    files["tokenizer_config.json"] = json.dumps(dict(config, chat_template=CHAT_TEMPLATE))
    tok = Tokenizer.from_files(files)
    assert tok.has_chat_template
    assert tok.decode(tok.apply_chat_template("x")) == \
        "<|im_start|>user\nx<|im_end|>\n<|im_start|>assistant\n"


def test_without_generation_config_eos_is_the_tokenizers():
    files = make_files()
    del files["generation_config.json"]
    tok = Tokenizer.from_files(files)
    assert tok.generation_config == {} and tok.eos_token_ids == [4]
    assert not tok.has_chat_template


def test_incremental_decoder_never_splits_a_character(made):
    text = "héllo → 世界 🙂 x"
    ids = made.encode(text)
    assert len(ids) > len(text.split())             # multi-byte characters span tokens
    dec = IncrementalDecoder(made)
    pieces = [dec.push(i) for i in ids]
    assert all("\ufffd" not in p for p in pieces)
    assert "".join(pieces) + dec.flush() == text
    # the prompt is context only: pieces are the continuation's text
    dec = IncrementalDecoder(made, context=made.encode("hello"))
    cont = made.encode(" world", add_special_tokens=False)
    assert "".join(dec.push(i) for i in cont) + dec.flush() == " world"


def test_incremental_decoder_flushes_an_unfinished_character(made):
    ids = made.encode("€")                          # not in the training text: one token a byte
    assert len(ids) == 3
    dec = IncrementalDecoder(made)
    assert [dec.push(i) for i in ids[:-1]] == [""] * (len(ids) - 1)
    assert dec.flush().endswith("\ufffd")


# --- errors -----------------------------------------------------------------------------------

def test_no_files_no_tokenizer():
    assert tokenizer_from_files(None) is None
    assert tokenizer_from_files({}) is None
    assert tokenizer_from_files({"tokenizer_config.json": "{}"}) is None


def test_files_without_tokenizer_json():
    with pytest.raises(ColibriError,
                       match=r"no tokenizer.json \(files: \['tokenizer_config.json'\]"):
        Tokenizer.from_files({"tokenizer_config.json": "{}"})


def test_broken_tokenizer_json_names_both_attempts():
    files = {"tokenizer.json": "{not json", "tokenizer_config.json": "{}"}
    with pytest.raises(ColibriError, match="cannot build the tokenizer from the embedded files "
                                           r"\['tokenizer.json', 'tokenizer_config.json'\]"
                                           ".*fallback"):
        Tokenizer.from_files(files)


def test_fallback_refuses_a_file_name_with_a_folder():
    files = {"tokenizer.json": "{not json", "../escape.json": "{}"}
    with pytest.raises(ColibriError, match="is not a plain file name"):
        Tokenizer.from_files(files)


def test_no_tokenizer_error_is_a_colibri_and_value_error():
    assert issubclass(NoTokenizerError, ColibriError)
    assert issubclass(NoTokenizerError, ValueError)


@pytest.mark.parametrize("which", ["shipped", "made"])
def test_decode_is_transformers_decode(which, request):
    """Tokenizer.decode (the Rust tokenizer's decode, called directly) gives transformers'
    decode(..., clean_up_tokenization_spaces=False) for any ids: special tokens, bytes cut
    mid-character, with and without skip_special_tokens."""
    import numpy as np
    tok = request.getfixturevalue(which)
    if which == "shipped":
        tok = tok.tokenizer
    assert tok._rust is not None
    rng = np.random.default_rng(0)
    n = len(tok.hf)
    cases = [[], [0], list(range(min(n, 300))), tok.encode(TEXTS[1])]
    cases += [rng.integers(0, n, int(rng.integers(1, 40))).tolist() for _ in range(300)]
    for ids in cases:
        for skip in (False, True):
            assert tok.decode(ids, skip_special_tokens=skip) == tok.hf.decode(
                ids, skip_special_tokens=skip, clean_up_tokenization_spaces=False), (ids, skip)
