"""Tensor parallelism in the search: the C++ search over the groups of `Cluster.tensor_parallel_groups(t)`, one per
degree, and the best of the degrees, equal a brute force over every (t, d, p, b, m, schedule, ZeRO stage,
placement; ZeRO-3 in one stage) that lays each group's GPUs out one by one (consecutive GPUs of a node: links and
data-parallel rings from the GPUs' own nodes, every GPU paid)."""

from __future__ import annotations

import random
from dataclasses import replace

import pytest

from pyplan.hardware import Cluster
from tests.cpp.test_search import REL, _chain, _close, _search
from tests.solve.reference_search import Hardware, Space, search_brute_force


def _instance(seed: int) -> tuple[dict[int, object], Hardware, Space, Cluster]:
    rng = random.Random(1000 + seed)
    num_blocks = rng.randint(2, 5)
    gpus_per_node = rng.choice((2, 4, 8))
    num_gpus = gpus_per_node * rng.choice((1, 2))
    degrees = [t for t in (1, 2, 4, 8) if gpus_per_node % t == 0]
    chains = {t: _chain(rng, num_blocks) for t in degrees}  # one rank's blocks at each degree: any figures
    whole = 16 * sum(chains[1].params) + 8 * sum(chains[1].act_per_sample_bytes)
    cluster = Cluster.from_catalog("a100-80g", num_gpus, gpus_per_node=gpus_per_node)
    group = cluster.groups[0]
    hw = Hardware(
        num_gpus=num_gpus,
        gpus_per_node=gpus_per_node,
        gpu_mem_bytes=rng.uniform(0.1, 1.0) * whole,
        mem_bw_bytes_per_s=rng.uniform(1e11, 1e12),
        intra=(group.intra_link.latency_s, group.intra_link.bw_bytes_per_s),
        inter=(group.inter_link.latency_s, group.inter_link.bw_bytes_per_s),
        price_per_gpu_s=cluster.price_per_gpu_second().amount if group.price_per_gpu_hour else 1e-3,
    )
    space = Space(
        global_batch=rng.choice((4, 8, 16)),
        bytes_per_param=(2.0, 2.0, 12.0),
        allow_fewer_gpus=rng.random() < 0.5,
        objective=rng.choice(("time", "cost")),
        zero_stages=(0, 1, 3),  # ZeRO-3 beside tp as pyplan.search plans it: one stage, gathered units at 2 bytes
        zero3_single_stage=True,
        zero3_gather_bytes=2.0,
        zero3_reduce_bytes=4.0,
    )
    return chains, hw, space, cluster


@pytest.mark.parametrize("seed", range(30))
def test_the_search_over_tensor_parallel_groups_equals_brute_force(seed: int) -> None:
    chains, hw, space, cluster = _instance(seed)
    found, brute = [], []
    for t, chain in chains.items():
        groups = cluster.tensor_parallel_groups(t)
        price = hw.price_per_gpu_s * t  # a group's GPUs are all paid (the catalog GPU has no price of its own)
        hw_t = replace(hw, num_gpus=groups.gpus, gpus_per_node=groups.gpus_per_node, price_per_gpu_s=price)
        result = _search(chain, hw_t, space, top_k=3)
        found += [(c.objective, c.num_gpus * t, t) for c in result.top]
        brute += [(x.objective, x.dp * x.pp * t, t) for x in search_brute_force(chain, hw, space, tp=t).feasible]
    found.sort()
    brute.sort()
    assert bool(found) == bool(brute)
    if brute:
        assert _close(found[0][0], brute[0][0])
        # the best three of all degrees: each degree's search keeps its own best three
        assert [f[0] for f in found[:3]] == pytest.approx([b[0] for b in brute[:3]], rel=REL)


def test_groups_of_a_degree_and_a_degree_the_nodes_cannot_hold() -> None:
    cluster = Cluster.from_catalog("a100-80g", 16, gpus_per_node=8)
    priced = Cluster((replace(cluster.groups[0], price_per_gpu_hour=2.0, currency="USD"),))
    groups = priced.tensor_parallel_groups(4)
    assert (groups.gpus, groups.gpus_per_node, groups.groups[0].price_per_gpu_hour) == (4, 2, 8.0)
    with pytest.raises(ValueError, match=r"^tensor parallelism 3 must divide the 8 GPUs of a node"):
        cluster.tensor_parallel_groups(3)
