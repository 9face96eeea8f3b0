"""`colibri generate --embeddings FILE.npy` end to end: the model's own embedding rows for some
ids continue exactly as those ids do; bad files give one clear line."""
from __future__ import annotations

import numpy as np
import pytest

pytest.importorskip("transformers")

import colibri  # noqa: E402
from colibri.cli import main  # noqa: E402
from colibri.convert import ConversionWarning, convert  # noqa: E402
from colibri.format import ColibriFile  # noqa: E402

PROMPT = "Hello world! The hummingbird"


@pytest.fixture(scope="module")
def with_tokenizer(hf_checkpoint, tmp_path_factory):
    """q4 experts, bf16 elsewhere (so the rows are widened from bf16 on the way in)."""
    return convert(hf_checkpoint("qwen2_moe", initializer_range=0.15),
                   tmp_path_factory.mktemp("emb") / "m.colibri", dtype="bf16", quant="q4",
                   progress=False)


@pytest.fixture(scope="module")
def without_tokenizer(hf_checkpoint, tmp_path_factory):
    with pytest.warns(ConversionWarning, match="tokenizer"):
        return convert(hf_checkpoint("mixtral", tokenizer=False, initializer_range=0.15),
                       tmp_path_factory.mktemp("emb") / "bare.colibri", dtype="f32",
                       progress=False)


def rows_of(path, ids) -> np.ndarray:
    """The embedding rows of `ids`, read from the file's tensor, float32 (S, D)."""
    with ColibriFile(path) as cf:
        return cf.to_float32("tok_embeddings")[np.asarray(ids)]


def generate(capsys, *argv) -> tuple[int, str, str]:
    code = main(["generate", *map(str, argv), "--temp", "0", "--threads", "1"])
    out, err = capsys.readouterr()
    return code, out, err


def test_embeddings_continue_like_their_ids(with_tokenizer, tmp_path, capsys):
    with colibri.load(with_tokenizer) as m:
        ids = m.tokenizer.encode(PROMPT)
    np.save(tmp_path / "e.npy", rows_of(with_tokenizer, ids))
    code, by_text, _ = generate(capsys, with_tokenizer, "-p", PROMPT, "-n", 12, "--ctx", 64)
    assert code == 0 and by_text.strip()
    code, by_rows, _ = generate(capsys, with_tokenizer, "--embeddings", tmp_path / "e.npy",
                                "-n", 12, "--ctx", 64)
    assert code == 0 and by_rows == by_text
    # a (1, S, D) array and float16 rows are accepted too
    np.save(tmp_path / "e3.npy", rows_of(with_tokenizer, ids)[None].astype(np.float16))
    code, out, _ = generate(capsys, with_tokenizer, "--embeddings", tmp_path / "e3.npy", "-n", 12)
    assert code == 0 and out.strip()


def test_embeddings_without_tokenizer_print_ids(without_tokenizer, tmp_path, capsys):
    ids = np.array([5, 17, 200, 3, 99, 42])
    np.save(tmp_path / "e.npy", rows_of(without_tokenizer, ids))
    code, out, _ = generate(capsys, without_tokenizer, "--embeddings", tmp_path / "e.npy",
                            "-n", 8)
    assert code == 0
    with colibri.load(without_tokenizer, threads=1) as m:
        want = m.generate(ids, max_new_tokens=8)
    assert [int(t) for t in out.split()] == want.tolist() and len(want) > 0


@pytest.mark.parametrize("make, match", [
    (lambda p: np.save(p, np.full((2, 64), np.nan, np.float32)), "NaN or infinite"),
    (lambda p: np.save(p, np.zeros((0, 64), np.float32)), "has no rows"),
    (lambda p: np.save(p, np.zeros((3, 7), np.float32)), r"shape (S, 64), found float32 (3, 7)"),
    (lambda p: np.save(p, np.zeros((3, 64), np.int64)), "expected a float array"),
    (lambda p: np.save(p, np.array([{"a": 1}], dtype=object), allow_pickle=True),
     "not a plain .npy"),
    (lambda p: open(p, "w").write("just text"), "not a .npy file"),
    (lambda p: np.savez(open(p, "wb"), a=np.zeros((2, 64))), "an archive of 1 arrays"),
    (lambda p: None, "No such file or directory"),
])
def test_bad_embedding_files_are_one_line_errors(with_tokenizer, tmp_path, capsys, make, match):
    path = tmp_path / "x.npy"
    make(path)
    code, _, err = generate(capsys, with_tokenizer, "--embeddings", path, "-n", 2)
    assert code == 2
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("colibri generate: error: "), err
    assert match in lines[0]
