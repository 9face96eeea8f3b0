"""The model that ships inside the package (colibri/models/tiny-moe.colibri).

It is part of the product: the README's first command runs it. A missing or broken file is a
packaging bug, so these tests fail (never skip) without it.
"""
from __future__ import annotations

import pytest

import colibri
from colibri.api import default_model_path
from colibri.tools.perplexity import perplexity

# Python that is not in the training corpus (written for this test).
SNIPPET = '''
class LRUCache:
    """A small least-recently-used cache."""

    def __init__(self, capacity=128):
        self.capacity = capacity
        self.data = {}
        self.order = []

    def get(self, key, default=None):
        if key not in self.data:
            return default
        self.order.remove(key)
        self.order.append(key)
        return self.data[key]

    def put(self, key, value):
        if key in self.data:
            self.order.remove(key)
        elif len(self.data) >= self.capacity:
            oldest = self.order.pop(0)
            del self.data[oldest]
        self.data[key] = value
        self.order.append(key)


def fibonacci(n):
    a, b = 0, 1
    for _ in range(n):
        a, b = b, a + b
    return a
'''


@pytest.fixture(scope="module")
def model():
    return colibri.load(threads=1)


def test_file_is_small_valid_and_complete():
    path = default_model_path()
    assert path.stat().st_size <= 16_000_000                 # the budget: 16 MB
    with colibri.open(path) as f:
        assert f.validate() == []                            # structure, CRC32s, no NaN/inf
        assert f.arch["family"] == "mixtral" and f.arch["num_experts"] >= 4
        assert "tokenizer.json" in (f.tokenizer_files or {})
        assert {"q4"} <= {f.info(n).dtype for n in f.names() if ".experts." in n}


def test_knows_python(model):
    # A uniform guess over the 4096-token vocabulary would score 4096; the shipped model
    # scores about 9 on this unseen snippet (docs/tiny-model.md has held-out figures).
    assert perplexity(model, SNIPPET, ctx=128).ppl < 40


def test_generates_python_looking_text(model):
    # a function header must be followed by an indented body (docstring, comment or code)
    text = model.generate("def fibonacci(n):", max_new_tokens=48, temperature=0)
    assert len(text) > 40
    assert text.lstrip("\n").startswith("    "), text
    assert any(mark in text for mark in ('"""', "#", "return", "self", "if ", " = "))


def test_every_expert_is_used_and_none_takes_over(model):
    stats = colibri.routing_stats(model, SNIPPET)
    util = stats.utilisation                                 # (layers, experts), 1 = fair share
    assert util.min() > 0.05, f"an expert is (nearly) dead: {util.min():.2f}"
    assert util.max() < 3.0, f"one expert takes over a layer: {util.max():.2f}"
