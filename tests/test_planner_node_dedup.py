"""The planner's node-deduplicated exchange (issue 44): the network carries a token once per destination node, the
in-node all-to-alls are charged to the expert side's compute, the search tries it beside each layout where a node
holds several expert ranks, and the written ds_config sets it (pure Python, seconds)."""

from __future__ import annotations

from dataclasses import replace

import pytest

from disagmoe_ds.layout import Layout
from disagmoe_ds.planner import Efficiency, Rates
from disagmoe_ds.planner.allocator import PlanRequest, af_candidates
from disagmoe_ds.planner.placement import Placement
from disagmoe_ds.planner.stages import af_roofline, cross_node_share, node_hop_s
from disagmoe_ds.planner.task_costs import af_task_costs
from disagmoe_ds.planner.workload import Workload
from tests.test_planner import mid_model, small_cluster
from tests.test_planner_ds_config import _runtime_accepts

WORK = Workload(4096, 1)


def _layouts() -> tuple[Layout, Layout]:
    """2 nodes of 4 GPUs: 4 attention ranks on node 0, the 4 expert ranks (EP 4) on node 1; plain and deduplicated."""
    plain = Layout(attention_gpus=4, ffn_gpus=4, num_layers=8, num_experts=16)
    return plain, Layout(attention_gpus=4, ffn_gpus=4, num_layers=8, num_experts=16, node_dedup=4)


def test_the_network_carries_a_token_once_per_node_and_the_node_pays_in_nvlink() -> None:
    spec, cluster = mid_model(num_experts=16), small_cluster()
    rates, place = Rates.from_cluster(cluster, Efficiency()), Placement.contiguous(2, 4)
    plain, dedup = _layouts()
    assert cross_node_share(plain, place) == cross_node_share(dedup, place) == (1.0, 0.0)  # every pair crosses
    roofs = [
        af_roofline(spec, lay, WORK, placement=place, rates=rates, nics=(4, 4), micro_batches=8) for lay in _layouts()
    ]
    ratio = spec.distinct_ranks_per_token(1) / spec.distinct_ranks_per_token(4)  # one node against 4 ranks
    assert roofs[1].attention.nic_bytes == pytest.approx(roofs[0].attention.nic_bytes * ratio, rel=0.02)
    assert roofs[1].ffn.compute_s > roofs[0].ffn.compute_s  # the in-node all-to-alls, on the compute stream
    assert node_hop_s(spec, plain, WORK, rates.nvlink_bw) == (0.0, 0.0)
    fwd, bwd = node_hop_s(spec, dedup, WORK, rates.nvlink_bw)
    assert fwd > 0 and bwd > 0
    assert node_hop_s(spec, dedup, replace(WORK, resend=True), rates.nvlink_bw)[1] == pytest.approx(bwd + fwd)
    costs = [af_task_costs(spec, lay, WORK, placement=place, rates=rates, nics=(4, 4)) for lay in _layouts()]
    assert costs[1].per_layer["m2n"][0] < costs[0].per_layer["m2n"][0]
    assert costs[1].per_layer["F_fwd"][0] == pytest.approx(costs[0].per_layer["F_fwd"][0] + fwd)


def test_the_search_tries_it_where_a_node_holds_several_expert_ranks() -> None:
    spec, cluster = mid_model(num_experts=16), small_cluster()
    req = PlanRequest(spec, cluster, Rates.from_cluster(cluster, Efficiency()), WORK, 32, attention_gpus=4,
                      sequence_parallel=(1,), tensor_parallel=(1,))  # fmt: skip
    candidates, rejected = af_candidates(req)
    nodes = {(c.layout.ep_size, c.layout.node_dedup) for c in candidates}
    assert {(4, 1), (4, 4), (2, 2)} <= nodes, nodes  # a node's GPUs of each expert-parallel group
    assert all(n in (1, min(ep, 4)) for ep, n in nodes)
    spread = [c for c in candidates if c.placement.kind == "spread" and c.layout.node_dedup > 1]
    assert all(c.layout.node_dedup <= c.placement.gpus_per_node - c.placement.attention_per_node for c in spread)


def test_the_written_ds_config_runs_it() -> None:
    from types import SimpleNamespace

    from disagmoe_ds.config import DisagMoEConfig
    from disagmoe_ds.planner.runtime_files import ds_config

    _, layout = _layouts()
    candidate = SimpleNamespace(layout=layout, micro_batches=8, work=WORK)
    request = SimpleNamespace(work=WORK, cluster=SimpleNamespace(name="h800"))
    ds = ds_config(SimpleNamespace(request=request, af=SimpleNamespace(candidate=candidate, in_flight=5)))
    assert ds["disagmoe"]["node_dedup"] == 4 and _runtime_accepts(ds)
    assert DisagMoEConfig.from_ds_config(ds).layout(num_layers=8, num_experts=16) == layout
