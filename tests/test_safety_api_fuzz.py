"""Hypothesis fuzzing of the public call surface (issue 15): forward, generate, new_cache,
Sampler and SamplingParams get arguments of every type, shape and range; each call either
works or raises a ColibriError, ValueError or TypeError with a message -- never another
exception, a hang or an allocation attempted before it is sized.

Bounded for CI: COLIBRI_API_FUZZ_EXAMPLES per test (default 40). The long run, whose
figures docs/safety-api.md records:
    COLIBRI_API_FUZZ_EXAMPLES=1000 python -m pytest -q -s -p no:cacheprovider \
        tests/test_safety_api_fuzz.py
"""
from __future__ import annotations

import os
import warnings
from collections import Counter

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings, strategies as st
from hypothesis.extra import numpy as hnp

import colibri
from colibri.generation.batching import SamplingParams
from colibri.errors import ColibriError
from colibri.generation.sampling import Sampler

EXAMPLES = int(os.environ.get("COLIBRI_API_FUZZ_EXAMPLES", "40"))
FUZZ = settings(max_examples=EXAMPLES, deadline=None, derandomize=True,
                suppress_health_check=list(HealthCheck))
CLEAN = (ColibriError, ValueError, TypeError)
COUNTS: Counter = Counter()
KINDS: Counter = Counter()      # which errors, for the report

# scalars of every kind a caller might pass by mistake
scalars = st.one_of(
    st.none(), st.booleans(), st.integers(-3, 5), st.integers(-2**70, 2**70),
    st.sampled_from([2**31, 2**63 - 1, 2**63, 2**64 - 1, 10**12]),
    st.floats(allow_nan=True, allow_infinity=True), st.sampled_from([0.5, 2.5, 1.0, 0.0]),
    st.text(max_size=4), st.binary(max_size=4), st.lists(st.integers(0, 5), max_size=3))

def mostly(valid: st.SearchStrategy) -> st.SearchStrategy:
    """valid values about three times in four, anything else the rest (flatmap: one_of
    would flatten the many branches of `scalars` and draw them far more often)."""
    return st.integers(0, 3).flatmap(lambda k: scalars if k == 0 else valid)


INT_DTYPES = st.sampled_from([np.int8, np.int16, np.int32, np.int64, np.uint8, np.uint16,
                              np.uint32, np.uint64])
valid_ids = hnp.arrays(np.int64, st.tuples(st.integers(1, 2), st.integers(1, 3)),
                       elements=st.integers(0, 4095))
arrays = st.one_of(
    hnp.arrays(INT_DTYPES, hnp.array_shapes(min_dims=0, max_dims=3, min_side=0, max_side=3)),
    hnp.arrays(st.sampled_from([np.float16, np.float32, np.float64, np.bool_]),
               hnp.array_shapes(min_dims=0, max_dims=3, min_side=0, max_side=3)),
    hnp.arrays(np.int64, st.tuples(st.integers(1, 2), st.integers(1, 3)),
               elements=st.integers(0, 4095)))


@pytest.fixture(scope="module")
def model():
    m = colibri.load(threads=1)
    yield m
    m.close()
    print(f"\napi fuzz: {sum(COUNTS.values())} calls; " +
          ", ".join(f"{k} {v}" for k, v in sorted(COUNTS.items())))
    print("errors: " + ", ".join(f"{k} {v}" for k, v in sorted(KINDS.items())))


def call(name: str, fn, *args, **kwargs):
    """fn(...): counted as "<name> ok" or "<name> clean"; anything else fails the test."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        try:
            fn(*args, **kwargs)
        except CLEAN as e:
            assert str(e), f"{type(e).__name__} without a message"
            COUNTS[f"{name} clean"] += 1
            KINDS[f"{name} {type(e).__name__}"] += 1
            return
    COUNTS[f"{name} ok"] += 1


@FUZZ
@given(ids=st.integers(0, 2).flatmap(lambda k: valid_ids if k else st.one_of(arrays, scalars)), positions=st.one_of(st.none(), st.none(), arrays, scalars),
       mask=st.one_of(st.none(), st.none(), arrays), ctx=st.sampled_from([None, 1, 2, 8, 0]),
       batch=st.sampled_from([1, 2]), embeds=st.booleans())
def test_forward(model, ids, positions, mask, ctx, batch, embeds):
    cache = None if ctx in (None, 0) else model.new_cache(ctx=ctx, batch=batch)
    if embeds:
        call("forward", model.forward, input_embeds=ids, cache=cache, positions=positions,
             attention_mask=mask)
    else:
        call("forward", model.forward, ids, cache=cache, positions=positions,
             attention_mask=mask)


# generation lengths kept small where they are valid: the fuzzing is of the checks
lengths = st.sampled_from([0, 1, 2, 3, 0, 1, 2, 3, -1, 2.5, 10**12, 2**63, True, "3", None])


@FUZZ
@given(prompt=st.integers(0, 4).flatmap(lambda k: [
           st.lists(st.integers(0, 4095), min_size=1, max_size=4), st.text(max_size=6),
           st.lists(st.lists(st.integers(0, 4095), min_size=1, max_size=3), min_size=2,
                    max_size=3),
           st.lists(st.integers(-2, 4100), max_size=4), st.one_of(arrays, scalars)][k]),
       n=lengths, ctx=st.one_of(st.none(), st.none(), st.integers(4, 16), lengths),
       temperature=mostly(st.floats(0, 2)), top_k=mostly(st.integers(0, 50)),
       top_p=mostly(st.floats(0.01, 1)), seed=mostly(st.integers(0, 2**32)),
       stop=st.one_of(st.none(), st.none(), scalars, st.lists(st.text(min_size=1, max_size=3),
                                                   max_size=2)))
def test_generate(model, prompt, n, ctx, temperature, top_k, top_p, seed, stop):
    call("generate", model.generate, prompt, max_new_tokens=n, ctx=ctx,
         temperature=temperature, top_k=top_k, top_p=top_p, seed=seed, stop=stop)


@FUZZ
@given(ctx=st.one_of(scalars, lengths), batch=scalars)
def test_new_cache(model, ctx, batch):
    call("new_cache", model.new_cache, ctx=ctx, batch=batch)


SAMPLER_ARGS = st.tuples(mostly(st.floats(0, 2)), mostly(st.integers(0, 50)),
                         mostly(st.floats(0.01, 1)), mostly(st.floats(0, 1)),
                         mostly(st.floats(0.5, 2)), mostly(st.integers(0, 2**32)),
                         mostly(st.floats(-2, 2)), mostly(st.floats(-2, 2)))
LOGITS = hnp.arrays(np.float32, st.integers(1, 50),
                    elements=st.floats(width=32, allow_nan=True, allow_infinity=True))


@FUZZ
@given(args=SAMPLER_ARGS, logits=st.one_of(LOGITS, LOGITS, arrays, scalars))
def test_sampler(args, logits):
    try:
        sampler = Sampler(*args)
    except CLEAN as e:
        assert str(e)
        COUNTS["Sampler clean"] += 1
        return
    COUNTS["Sampler ok"] += 1
    call("Sampler()", sampler, logits)


FIELDS = ["max_tokens", "temperature", "top_k", "top_p", "min_p", "repetition_penalty",
          "presence_penalty", "frequency_penalty", "seed", "stop", "stop_ids", "logprobs",
          "return_routing"]


@FUZZ
@given(values=st.fixed_dictionaries({}, optional={f: mostly(st.sampled_from([0, 1]))
                                                 if f != "stop" else scalars
                                                 for f in FIELDS}))
def test_sampling_params(values):
    call("SamplingParams", lambda: SamplingParams(**values).check())
