"""colibri.tools.display: the notebook HTML of Model, Trace and RoutingStats (`_repr_html_`):
what it shows, text from the file escaped, tables kept small."""
from __future__ import annotations

import numpy as np
import pytest

pytest.importorskip("transformers")

import colibri.api as api  # noqa: E402
from routing_models import mixtral, qwen  # noqa: F401,E402 (fixtures)
from colibri.convert import convert  # noqa: E402
from colibri.tools.display import expert_colour, stats_html, tensor_groups, trace_html  # noqa: E402
from colibri.tools.trace import Trace, trace  # noqa: E402

TEXT = "def fibonacci(n):\n    if n < 2:\n        return n\n    return fibonacci(n - 1)\n"


def test_trace_html_escapes_and_colours(mixtral):
    _, m = mixtral
    tr = trace(m, "a<b> & 'c'")
    html = tr._repr_html_()
    assert html.count("<tr>") == len(tr) + 1 and "L0" in html and "L1" in html
    assert "&lt;" in html and "<b>" not in html.replace("<b>colibri Trace</b>", "")
    assert "background:hsl(" in html
    assert f"{len(tr)} tokens × 2 MoE layers, top-2 of 4 experts" in html
    long = trace(m, TEXT)._repr_html_()
    assert "more tokens" not in long
    assert "more tokens" in trace_html(trace(m, TEXT), max_tokens=4)


def test_model_html(qwen):
    _, m = qwen
    html = m._repr_html_()
    for needle in ("qwen2_moe", "Qwen2MoeForCausalLM", "2 (1 MoE, 1 dense)", "top-2",
                   "shared expert 96", "active per token", "per expert", "mmap", "router",
                   "routed experts", "shared expert", "dense mlp", "config.json",
                   "moe_intermediate_size"):
        assert needle in html, needle
    assert html.count("<table") == 2
    assert "KiB" in html                                 # the file size, human-readable


def test_tensor_groups_cover_the_file(qwen):
    _, m = qwen
    groups = tensor_groups(m.file)
    names = [g["group"] for g in groups]
    assert names[:2] == ["embedding", "head"] and "routed experts" in names
    assert "shared expert" in names and "dense mlp" in names and "norms" in names
    assert sum(g["tensors"] for g in groups) == len(m.file.tensors)
    assert sum(g["bytes"] for g in groups) == sum(i.nbytes for i in m.file.tensors.values())


def test_stats_html_shades_utilisation():
    experts = np.array([[[0, 1]], [[0, 2]], [[0, 1]]])                    # (T, M, K): 3 unused
    st = Trace(experts, np.full((3, 1, 2), 0.5), n_experts=4, layers=[5]).stats()
    html = stats_html(st)
    assert html == st._repr_html_()
    assert "3 tokens, top-2 of 4 experts" in html and "L5" in html
    assert 'title="expert 3: utilisation 0.00"' in html                   # dead: black cell
    assert 'title="expert 0: utilisation 2.00"' in html


def test_expert_colour():
    assert expert_colour(0, 4) != expert_colour(1, 4)
    assert expert_colour(2, 4, weight=1.0) != expert_colour(2, 4, weight=0.1)
    assert expert_colour(2, 4, weight=5.0) == expert_colour(2, 4, weight=1.0)   # clipped
