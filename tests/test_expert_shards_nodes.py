"""Expert shards on two Ray nodes: a real two-raylet Ray cluster on this machine
(ray.cluster_utils.Cluster: a head and a second node, each its own raylet, object store and
worker pool, one CPU each), joined by address as a user joins a cluster; each shard lands
on its own node, maps the file there, and the logits and greedy tokens are one process's."""
from __future__ import annotations

import os

import numpy as np
import pytest

ray = pytest.importorskip("ray")

import colibri  # noqa: E402
from colibri.api import default_model_path  # noqa: E402
from colibri.experts.expert_shards import ExpertShardError  # noqa: E402


@pytest.fixture(scope="module")
def two_nodes(tmp_path_factory):
    """A head node and one more, one CPU each (so two 1-CPU shards need both nodes); started
    away from the checkout (Ray puts the driver's folder on its workers' sys.path)."""
    from ray.cluster_utils import Cluster
    if ray.is_initialized():
        ray.shutdown()
    here = os.getcwd()
    os.chdir(tmp_path_factory.mktemp("ray-nodes"))
    try:
        cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 1,
                                                                "include_dashboard": False})
        cluster.add_node(num_cpus=1)
        cluster.wait_for_nodes()
    finally:
        os.chdir(here)
    yield cluster
    ray.shutdown()
    cluster.shutdown()


def test_two_shards_on_two_nodes_give_one_process_logits_and_tokens(two_nodes):
    path = default_model_path()
    prompt = np.array([[5, 17, 99, 3, 42, 7]])
    with colibri.load(path, threads=1) as one:
        want_logits = colibri.forward(one, prompt)
        want_tokens = one.generate(prompt[0].tolist(), max_new_tokens=12, temperature=0)
    with colibri.load(path, threads=1, expert_shards=2, shard_threads=1,
                      ray_address=two_nodes.address) as sharded:
        nodes = [s["node"] for s in sharded.expert_shards.stats()["per_shard"]]
        assert len(ray.nodes()) == 2
        assert len({n.split("/")[1] for n in nodes}) == 2, nodes    # one shard per node
        np.testing.assert_array_equal(colibri.forward(sharded, prompt), want_logits)
        np.testing.assert_array_equal(
            sharded.generate(prompt[0].tolist(), max_new_tokens=12, temperature=0), want_tokens)
        per_shard = sharded.expert_shards.stats()["per_shard"]
        assert all(s["calls"] > 0 and s["failures"] == 0 for s in per_shard), per_shard


def test_more_shards_than_the_nodes_hold_are_refused_at_once(two_nodes):
    """Three 1-CPU shards on two 1-CPU nodes: refused before any actor starts, naming the
    count and each node's CPUs, not left pending until the start timeout."""
    import time
    t0 = time.perf_counter()
    with pytest.raises(ExpertShardError, match=r"3 shards of 1 Ray CPU.*holds 2"):
        colibri.load(default_model_path(), threads=1, expert_shards=3, shard_threads=1,
                     ray_address=two_nodes.address)
    assert time.perf_counter() - t0 < 60
    deadline = time.perf_counter() + 60                     # nothing left reserved (the
    while ray.available_resources().get("CPU", 0) < 2:      # last test's actors go async)
        assert time.perf_counter() < deadline, ray.available_resources()
        time.sleep(0.2)
