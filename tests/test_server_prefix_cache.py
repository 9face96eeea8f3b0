"""The server's prefix cache through the official openai client: n=4 sharing a prompt,
chat turns with a shared system prompt, /metrics, --prefix-cache, and a reload never
serving the previous version's blocks."""
from __future__ import annotations

import re

import pytest

import colibri.api as api
from colibri.cli import build_parser
from colibri.commands.serve import settings_from_args
from colibri.server import Settings
from colibri.server.engine import ModelHolder
from colibri.generation.batching import SamplingParams
from server_helpers import client, copy_model, replace_by_rename, request, running_server

SYSTEM = ("You are a careful assistant for a small bakery. Answer in one short sentence, "
          "name prices in euros, and never invent opening hours. ") * 6


def metric(url: str, name: str) -> float:
    status, _, text = request(url, "GET", "/metrics")
    assert status == 200
    m = re.search(rf"^{name} (\S+)$", text, re.M)
    assert m, f"{name} not in /metrics"
    return float(m.group(1))


@pytest.fixture(scope="module")
def served():
    with running_server(Settings(threads=1, parallel=4)) as (url, app):
        yield url, client(url)


def test_n4_shares_the_prompt_and_answers_as_without(served):
    url, oa = served
    prompt = SYSTEM + "Question: what is a croissant?"
    before = metric(url, "colibri_prefix_cache_hits_total")
    out = oa.completions.create(model="tiny-moe", prompt=prompt, n=4, max_tokens=12,
                                  temperature=0)
    texts = [c.text for c in out.choices]
    with api.load(threads=1, prefix_cache=0) as m:
        want = m.generate(prompt, max_new_tokens=12)
        cached = (len(m.tokenizer.encode(prompt)) - 1) // 16 * 16
    assert texts == [want] * 4
    assert metric(url, "colibri_prefix_cache_hits_total") - before >= 3 * cached
    assert metric(url, "colibri_prefix_cache_bytes") > 0
    for name in ("misses_total", "lookups_total", "evictions_total", "capacity_bytes",
                 "blocks"):
        metric(url, f"colibri_prefix_cache_{name}")


def test_a_second_turn_reuses_the_first(served):
    """The shipped model has no chat template: a transcript through /v1/completions is the
    same token stream a chat turn is (system prompt, question, answer, question)."""
    url, oa = served
    turn1 = SYSTEM + "User: Do you sell rye bread?\nAssistant:"
    first = oa.completions.create(model="tiny-moe", prompt=turn1, max_tokens=10,
                                  temperature=0).choices[0].text
    hits = metric(url, "colibri_prefix_cache_hits_total")
    turn2 = turn1 + first + "\nUser: And how much is it?\nAssistant:"
    second = oa.completions.create(model="tiny-moe", prompt=turn2, max_tokens=10,
                                  temperature=0)
    with api.load(threads=1, prefix_cache=0) as m:
        n1 = len(m.tokenizer.encode(turn1))
        assert second.choices[0].text == m.generate(turn2, max_new_tokens=10)
    assert metric(url, "colibri_prefix_cache_hits_total") - hits >= n1 - 16


def test_the_flag_sizes_or_switches_it_off():
    parse = build_parser().parse_args
    assert settings_from_args(parse(["serve", "--prefix-cache", "off"])).prefix_cache == 0
    assert settings_from_args(parse(["serve", "--prefix-cache", "64MiB"])).prefix_cache == 64 << 20
    assert settings_from_args(parse(["serve"])).prefix_cache is None
    with running_server(Settings(threads=1, prefix_cache=0)) as (url, _):
        client(url).completions.create(model="tiny-moe", prompt=SYSTEM, max_tokens=2)
        assert metric(url, "colibri_prefix_cache_capacity_bytes") == 0
        assert metric(url, "colibri_prefix_cache_hits_total") == 0


def test_a_reload_never_serves_the_old_versions_blocks(tmp_path):
    served = copy_model(tmp_path / "served.colibri")
    holder = ModelHolder(Settings(model=str(served), threads=1))
    holder.start()
    try:
        old = holder.current
        ids = old.tokenizer.encode(SYSTEM)
        for _ in range(2):
            list(old.scheduler.submit(ids, SamplingParams(max_tokens=2)))
        assert old.scheduler.stats()["prefix_cache"]["hits"] > 0
        replace_by_rename(copy_model(tmp_path / "new.colibri"), served)   # same bytes, new file
        assert holder.reload().reloaded
        new = holder.current
        assert new.scheduler.prefix_cache.namespace != old.scheduler.prefix_cache.namespace
        list(new.scheduler.submit(ids, SamplingParams(max_tokens=2)))
        assert new.scheduler.stats()["prefix_cache"]["hits"] == 0
    finally:
        holder.stop()
    assert len(old.scheduler.prefix_cache) == 0          # cleared once its requests finished
