"""API edges of issue 15, each a clear error naming the argument, expected and found (or a
working call): positions out of range in any integer dtype, the context warning, sampling
arguments of the wrong type, generate([]), allocations sized before they are made, a KV cache
of another model, one cache on two threads, and NaN traced to the stage it came from."""
from __future__ import annotations

import shutil
import threading
import warnings

import numpy as np
import pytest

import colibri
from colibri.errors import ColibriError
from colibri.engine.checks import MAX_POSITION
from colibri.errors import CacheBusyError, ForeignCacheError, NonFiniteError
from colibri.resources import ResourceError, check_allocation, memory_available
from colibri.generation.sampling import Sampler

SHIPPED = colibri.default_model_path()


@pytest.fixture(scope="module")
def model():
    m = colibri.load(SHIPPED, threads=1)
    yield m
    m.close()


def patched(tmp_path, name: str, tensor: str, row: slice | None = None):
    """A copy of the shipped model with NaN written into `tensor` (f16/f32; all of it, or
    the rows `row`)."""
    path = tmp_path / name
    shutil.copyfile(SHIPPED, path)
    with colibri.open(path) as f:
        info = f.info(tensor)
    width = {"f32": 4, "f16": 2}[info.dtype]
    values = np.full(info.nbytes // width, np.nan, dtype=np.float32 if width == 4 else np.float16)
    start = 0
    if row is not None:
        cols = info.shape[-1]
        start, stop = row.start * cols * width, row.stop * cols * width
        values = values[: (stop - start) // width]
    with open(path, "r+b") as fh:
        fh.seek(info.offset + start)
        fh.write(values.tobytes())
    return colibri.load(path, threads=1)


# --- positions and the context ----------------------------------------------------------------

@pytest.mark.parametrize("positions, found", [
    (np.array([2**64 - 1], dtype=np.uint64), str(2**64 - 1)),
    (np.array([2**63 - 1], dtype=np.int64), str(2**63 - 1)),
    (np.array([MAX_POSITION + 1], dtype=np.uint32), str(MAX_POSITION + 1)),
    (np.array([-1]), "-1"),
])
def test_positions_out_of_range_are_refused_in_their_own_dtype(model, positions, found):
    cache = model.new_cache(ctx=8)
    with pytest.raises(ValueError, match=f"positions must be in \\[0, {MAX_POSITION}\\].*{found}"):
        model.forward(np.array([1]), cache=cache, positions=positions)
    assert cache.length == 0
    model.forward(np.array([1, 2]), cache=cache)        # the cache still counts from 0
    assert cache.pos[0, :2].tolist() == [0, 1]


def test_the_largest_position_works_and_the_next_one_counts_on(model):
    cache = model.new_cache(ctx=4)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model.forward(np.array([1]), cache=cache, positions=np.array([MAX_POSITION - 1]))
        model.forward(np.array([2]), cache=cache)
    assert cache.pos[0, :2].tolist() == [MAX_POSITION - 1, MAX_POSITION]


def test_past_max_position_embeddings_warns_once_per_model():
    m = colibri.load(SHIPPED, threads=1)
    n = m.config.max_position_embeddings
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        m.new_cache(ctx=n)                               # up to n - 1: no warning
        m.new_cache(ctx=n + 1)
        m.forward(np.array([1]), positions=np.array([n + 5]))
    msgs = [str(w.message) for w in seen if "max_position_embeddings" in str(w.message)]
    assert len(msgs) == 1 and str(n) in msgs[0]
    m.close()


# --- argument types -----------------------------------------------------------------------------

@pytest.mark.parametrize("kwargs, error, words", [
    (dict(top_k=2.7, temperature=1.0), TypeError, "top_k must be an integer, got 2.7"),
    (dict(temperature="0.5"), TypeError, "temperature must be a number, got '0.5'"),
    (dict(top_p=None), TypeError, "top_p must be a number"),
    (dict(seed=-1), ValueError, "seed"),
    (dict(seed=1.5), TypeError, "seed must be an integer"),
    (dict(max_new_tokens=2.5), TypeError, "max_new_tokens must be an integer, got 2.5"),
    (dict(max_new_tokens=True), TypeError, "max_new_tokens must be an integer"),
    (dict(max_new_tokens=-1), ValueError, "max_new_tokens must be >= 0"),
    (dict(ctx=2.5), TypeError, "ctx must be an integer"),
    (dict(ctx=0), ValueError, "ctx must be >= 1"),
])
def test_generate_names_the_argument(model, kwargs, error, words):
    kwargs.setdefault("max_new_tokens", 2)
    with pytest.raises(error, match=words):
        model.generate(np.array([1, 2]), **kwargs)


@pytest.mark.parametrize("prompt", [[], np.array([], dtype=np.int64), np.zeros((1, 0), int)])
def test_generate_of_nothing_says_the_prompt_is_empty(model, prompt):
    with pytest.raises(ValueError, match="the prompt is empty"):
        model.generate(prompt, max_new_tokens=2)


def test_sampler_refuses_a_truncating_top_k():
    with pytest.raises(TypeError, match="top_k"):
        Sampler(temperature=1.0, top_k=2.7)
    assert Sampler(temperature=1.0, top_k=np.int64(3)).top_k == 3


@pytest.mark.parametrize("kwargs", [dict(ctx=2.5), dict(ctx=True), dict(batch=0),
                                    dict(ctx="8")])
def test_new_cache_names_the_argument(model, kwargs):
    with pytest.raises(ValueError, match="new_cache: (ctx|batch) must be a positive integer"):
        model.new_cache(**kwargs)


# --- allocations sized first ----------------------------------------------------------------------

@pytest.mark.parametrize("kwargs", [dict(max_new_tokens=10**12), dict(ctx=10**12)])
def test_a_huge_generation_is_refused_with_the_numbers(model, kwargs):
    kwargs.setdefault("max_new_tokens", 2)
    with pytest.raises(ResourceError, match=r"needs \d+ bytes .* \d+ bytes .* available") as e:
        model.generate(np.array([1, 2]), **kwargs)
    assert isinstance(e.value, MemoryError) and isinstance(e.value, ColibriError)


def test_a_cache_larger_than_memory_is_refused(model):
    avail, _ = memory_available()
    per_token = model.new_cache(ctx=1).bytes_per_token
    with pytest.raises(ResourceError, match="KV cache"):
        model.new_cache(ctx=int(avail // per_token) + 10)
    check_allocation(1 << 20, "a small buffer")          # fits: no error


# --- caches: ownership and threads ------------------------------------------------------------------

def test_a_cache_of_another_model_is_refused(model, tmp_path):
    other_path = tmp_path / "other.colibri"
    shutil.copyfile(SHIPPED, other_path)                 # same shapes, another file
    other = colibri.load(other_path, threads=1)
    cache = other.new_cache(ctx=8)
    other.forward(np.array([1, 2]), cache=cache)
    for call in (lambda: model.forward(np.array([3]), cache=cache),
                 lambda: model.forward(np.array([3, 4]), cache=cache)):
        with pytest.raises(ForeignCacheError, match="another model file"):
            call()
    assert cache.length == 2
    same = colibri.load(SHIPPED, threads=1)              # the same file: the same weights
    mine = model.new_cache(ctx=8)
    model.forward(np.array([1]), cache=mine)
    same.forward(np.array([2]), cache=mine)
    same.close()
    other.close()


def test_one_cache_on_two_threads_refuses_the_second(model):
    cache = model.new_cache(ctx=64)
    with cache.claim():                                  # as a forward pass on a thread holds it
        errors = []
        t = threading.Thread(target=lambda: errors.append(
            pytest.raises(CacheBusyError, model.forward, np.array([1]), cache=cache)))
        t.start()
        t.join()
        assert errors and "another thread" in str(errors[0].value)
    assert cache.length == 0
    model.forward(np.array([1]), cache=cache)            # released: works again


def test_decoding_on_a_shared_cache_works_or_refuses(model):
    cache = model.new_cache(ctx=200)
    model.forward(np.array([1]), cache=cache)
    outcomes = {"ok": 0, "busy": 0}
    lock = threading.Lock()

    def decode():
        for _ in range(40):
            try:
                model.forward(np.array([5]), cache=cache)
                with lock:
                    outcomes["ok"] += 1
            except CacheBusyError:
                with lock:
                    outcomes["busy"] += 1

    threads = [threading.Thread(target=decode) for _ in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert outcomes["ok"] + outcomes["busy"] == 120
    assert cache.length == 1 + outcomes["ok"]            # every success took one slot
    assert cache.pos[0, :cache.length].tolist() == list(range(cache.length))


# --- NaN named where it came from -------------------------------------------------------------------

@pytest.mark.parametrize("tensor, row, stage", [
    ("norm", None, "the final norm"),
    ("tok_embeddings", slice(4000, 4001), "the head"),
    ("layers.1.attn.wo", None, "layer 1's attention"),
    ("layers.1.moe.router", None, "layer 1's router"),
    ("layers.0.attn_norm", None, "the input of layer 0"),
])
@pytest.mark.parametrize("path", ["decode", "prefill"])
def test_nan_is_named_by_its_stage(tmp_path, tensor, row, stage, path):
    m = patched(tmp_path, "nan.colibri", tensor, row)
    cache = m.new_cache(ctx=8)
    ids = np.array([1]) if path == "decode" else np.array([1, 2, 3])
    with pytest.raises(NonFiniteError, match=stage) as e:
        m.forward(ids, cache=cache)
    if "router" not in stage:
        assert "router" not in str(e.value)
    m.close()


@pytest.mark.parametrize("call, error, words", [
    (lambda m: colibri.load(123), TypeError, "the model must be a path"),
    (lambda m: colibri.load(memory_budget="6G"), ValueError, "memory_budget must be None"),
    (lambda m: colibri.load(memory_budget=-1), ValueError, "memory_budget must be None"),
    (lambda m: colibri.load(threads=2.5), ValueError, "threads must be an integer in 1..127"),
    (lambda m: m.generate([1, 2], max_new_tokens=2, stop={"a": 1}), TypeError, "stop must be"),
    (lambda m: m.generate([1, 2], max_new_tokens=2, stop=[True]), ValueError, "stop must be"),
])
def test_other_public_calls_name_the_argument(model, call, error, words):
    with pytest.raises(error, match=words):
        call(model)
