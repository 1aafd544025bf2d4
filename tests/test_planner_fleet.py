"""A fleet of two GPU types (issue 44): AF-Pipe with each side on its own hardware, against the homogeneous uses of
the same fleet (pure Python, one plan of Qwen3-30B-A3B on an H200 node and an A100 node)."""

from __future__ import annotations

import json
from dataclasses import replace
from functools import cache
from pathlib import Path

import pytest

from disagmoe_ds.config.sections import CostModel
from disagmoe_ds.errors import ConfigError
from disagmoe_ds.layout import Layout
from disagmoe_ds.planner.cli import main
from disagmoe_ds.planner.cluster import Efficiency, Fleet, preset
from disagmoe_ds.planner.fleet import FleetResult, fleet_request, fleets_of_hostfile, plan_fleet, report
from disagmoe_ds.planner.gemm_efficiency import shape_rates
from disagmoe_ds.planner.model import load_model_spec
from disagmoe_ds.planner.part_times import expert_call_s
from disagmoe_ds.planner.plans import PlanRequest
from disagmoe_ds.planner.runtime_costs import runtime_task_costs
from disagmoe_ds.planner.stages import af_roofline
from disagmoe_ds.planner.workload import Workload

MODEL = Path(__file__).resolve().parents[1] / "hf_models" / "Qwen3-30B-A3B"
FLEET = Fleet(preset("h200", 1), preset("a100", 1))


def _base() -> PlanRequest:
    spec = load_model_spec(MODEL)
    rates = shape_rates(FLEET.attention, Efficiency(), spec)
    return PlanRequest(spec=spec, cluster=FLEET.whole(), rates=rates, work=Workload(4096, 1), global_batch=128)


@cache
def _result() -> FleetResult:
    return plan_fleet(_base(), FLEET, Efficiency())


def test_the_split_is_the_fleet_and_each_side_computes_on_its_own_gpus():
    af = _result().af.af
    assert af is not None
    c, req = af.candidate, _result().af.request
    assert (c.layout.attention_gpus, c.layout.ffn_gpus) == (8, 8) and c.placement.kind == "contiguous"
    a100 = shape_rates(FLEET.ffn, Efficiency(), req.spec)
    assert req.rates.side("ffn") == a100 and req.rates.side("attention") is req.rates
    # the expert side's compute is the A100's: priced with the H200's rates on both sides it would be faster
    kw = dict(placement=c.placement, nics=c.nics, micro_batches=c.micro_batches, offloaded=(0.0, 0.0))
    mixed = af_roofline(req.spec, c.layout, c.work, rates=req.rates, **kw)
    h200 = af_roofline(req.spec, c.layout, c.work, rates=replace(req.rates, ffn=None), **kw)
    assert mixed.attention.compute_s == h200.attention.compute_s
    tokens, layer = 4096.0, req.spec.num_layers - 1
    slower = (
        expert_call_s(req.spec, a100, layer=layer, tokens=tokens, recompute="none")[0]
        / expert_call_s(req.spec, req.rates, layer=layer, tokens=tokens, recompute="none")[0]
    )
    assert slower > 2 and mixed.ffn.compute_s == pytest.approx(h200.ffn.compute_s * slower, rel=0.05)


def test_the_verdict_is_against_the_best_homogeneous_use_of_the_fleet():
    result = _result()
    labels = [label for label, _ in result.alternatives]
    assert labels == ["the whole fleet, at the weaker type", "the h200 nodes alone", "the a100 nodes alone"]
    weakest = result.alternatives[0][1].request.cluster
    assert weakest.world_size == 16 and weakest.peak_flops == 312e12 and weakest.hbm_bytes == FLEET.ffn.hbm_bytes
    best = max((r.baseline for _, r in result.alternatives if r.baseline), key=lambda b: b.tokens_per_s)
    assert result.af.af is not None and result.ratio == result.af.af.tokens_per_s / best.tokens_per_s
    text = report(result)
    assert f"({result.ratio:.2f}x the best homogeneous use: co-located on" in text


def test_the_fleet_request_fixes_the_split_and_the_cli_refuses_unlike_nodes(capsys, tmp_path):
    req = fleet_request(_base(), FLEET, Efficiency())
    assert req.attention_gpus == 8 and req.cluster.nodes == 2 and req.rates.ffn is not None
    with pytest.raises(ConfigError, match="gpus_per_node"):
        Fleet(FLEET.attention, replace(FLEET.ffn, gpus_per_node=4))
    odd = tmp_path / "odd.json"
    odd.write_text(
        '{"name": "odd", "nodes": 1, "gpus_per_node": 4, "peak_flops": 3e14, "hbm_bytes": 8e10, '
        '"nvlink_bw": 3e11, "nics_per_node": 8, "nic_bw": 2.5e10}'
    )
    argv = ["fleet", "--model", str(MODEL), "--seq-len", "4096", "--attention-cluster", "h200"]
    rc = main([*argv, "--attention-nodes", "1", "--ffn-cluster", str(odd)])
    assert rc == 2 and "differ in gpus_per_node (8 and 4)" in capsys.readouterr().err


def test_the_hostfile_puts_the_attention_type_first_and_the_ds_config_runs(tmp_path, capsys):
    from disagmoe_ds.config import DisagMoEConfig

    hosts, ds = tmp_path / "hosts", tmp_path / "ds.json"
    argv = ["fleet", "--model", str(MODEL), "--seq-len", "4096", "--attention-cluster", "h200", "--attention-nodes"]
    argv += ["1", "--ffn-cluster", "a100", "--ffn-nodes", "1", "--write-hostfile", str(hosts)]
    assert main([*argv, "--write-ds-config", str(ds)]) == 0
    lines = [line for line in hosts.read_text().splitlines() if not line.startswith("#")]
    assert lines == ["h200-0 slots=8 gpu=h200", "a100-0 slots=8 gpu=a100"]
    cfg = DisagMoEConfig.from_ds_config(json.loads(ds.read_text()))
    assert (cfg.attention_gpus, cfg.ffn_gpus) == (8, 8) and cfg.side_clusters == ("h200", "a100")
    assert "wrote hostfile" in capsys.readouterr().err


def test_a_hostfile_with_gpu_types_is_the_fleet_either_way_round(tmp_path):
    hosts = tmp_path / "mixed"
    hosts.write_text("# two types\nold-0 slots=8 gpu=a100\nnew-0 slots=8 gpu=h200\nold-1 slots=8 gpu=A100\n")
    first, second = fleets_of_hostfile(hosts)
    assert (first.attention.name, first.attention.hosts, first.ffn.name, first.ffn.hosts) == (
        "a100",
        ("old-0", "old-1"),
        "h200",
        ("new-0",),
    )
    assert (second.attention, second.ffn) == (first.ffn, first.attention)
    assert second.whole().hosts == ("new-0", "old-0", "old-1")  # the written hostfile's order: attention first
    for text, message in [
        ("a slots=8 gpu=h200\nb slots=8 gpu=h200\n", "a fleet has two GPU types .* found h200"),
        ("a slots=8 gpu=h200\nb slots=4 gpu=a100\n", "b: slots other than the 8 GPUs of a gpu=a100 node"),
        ("a slots=8 gpu=h200\nb slots=8 gpu=v100\n", "gpu=v100"),
    ]:
        hosts.write_text(text)
        with pytest.raises(ConfigError, match=message):
            fleets_of_hostfile(hosts)


def test_the_runtime_schedule_prices_each_side_on_its_type():
    config = json.loads((MODEL / "config.json").read_text()) | {"num_hidden_layers": 4}
    layout = Layout(attention_gpus=8, ffn_gpus=8, num_layers=4, num_experts=config["num_experts"])
    kw = dict(seq_len=4096, micro_batch_size=1, cluster="h200")
    same, mixed = runtime_task_costs(config, layout, **kw), runtime_task_costs(config, layout, **kw, ffn_cluster="a100")
    assert mixed.per_layer["A_fwd"] == same.per_layer["A_fwd"]
    assert all(m > 2 * s for m, s in zip(mixed.per_layer["F_fwd"], same.per_layer["F_fwd"]) if s)
    with pytest.raises(ConfigError, match=r"attention_gpus \(4\) must be a multiple of a node's 8 GPUs"):
        runtime_task_costs(config, replace(layout, attention_gpus=4), **kw, ffn_cluster="a100")
    with pytest.raises(ConfigError, match="measures one GPU type"):
        CostModel(cluster="h200", ffn_cluster="a100", profile=str(MODEL / "config.json"))
