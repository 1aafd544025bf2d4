"""Issue 26: the co-located baseline against published Megatron-Core runs, the terms behind it, --baseline-layout,
the AF-Pipe search's monotonicity in the variants, and the sweep (all pure Python, a few seconds)."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest

from disagmoe_ds.errors import ConfigError
from disagmoe_ds.planner.allocator import PlanRequest, best_af
from disagmoe_ds.planner.baseline_layout import check_layout, parse_layout
from disagmoe_ds.planner.calibration import HELD_OUT, RUNS, TOLERANCE, predict
from disagmoe_ds.planner.cli import main
from disagmoe_ds.planner.cluster import Cluster, Efficiency, Rates, preset
from disagmoe_ds.planner.colocated_costs import Shape, alltoall_s
from disagmoe_ds.planner.gemm_efficiency import expert_efficiency, shape_rates
from disagmoe_ds.planner.memory import baseline_rank_memory
from disagmoe_ds.planner.model import load_model_spec
from disagmoe_ds.planner.pipeline_split import chunk_sizes
from disagmoe_ds.planner.training_state import Precision
from disagmoe_ds.planner.variants import PAPER, VARIANTS
from disagmoe_ds.planner.workload import Workload
from tests.test_planner import mid_model

ROOT = Path(__file__).resolve().parents[1]
MODELS = ROOT / "hf_models"


@pytest.mark.parametrize("run", [*RUNS, *HELD_OUT], ids=[r.name for r in (*RUNS, *HELD_OUT)])
def test_published_runs_are_predicted_within_tolerance_at_their_layout(run):
    p = predict(run, MODELS)
    assert p.plan is not None, f"{run.name}: the layout does not fit the planner's memory model"
    if run.unmodelled:  # the table says why; if the planner learns the term, the row moves into the tolerance
        assert abs(p.error) > TOLERANCE, f"{run.name} is now within {TOLERANCE:.0%}: drop its unmodelled note"
    else:
        assert abs(p.error) <= TOLERANCE, f"{run.name}: {p.error:+.1%}"
    if run.tokens_per_s_per_gpu is not None and not run.unmodelled:
        assert p.tokens_per_s_per_gpu == pytest.approx(run.tokens_per_s_per_gpu, rel=TOLERANCE)


def test_most_published_rows_are_modelled():
    assert sum(1 for r in RUNS if not r.unmodelled) >= len(RUNS) - 2


def test_the_1f1b_overlap_gain_is_megatrons_not_max_of_compute_and_a2a():
    plain, paired = (predict(r, MODELS) for r in RUNS[:2])
    assert "overlap=paired" in RUNS[1].layout and RUNS[0].layout + ",overlap=paired" == RUNS[1].layout
    gain = plain.step_s / paired.step_s
    assert 1.04 <= gain <= 1.2  # Megatron measured +12.7% on this run, +3.7-7.8% on a DeepSeek-V3 proxy


def test_uneven_first_and_last_stages_split_any_layer_count():
    for layers, pp, vpp in ((94, 8, 4), (61, 16, 1), (94, 32, 3), (48, 4, 2)):
        sizes = chunk_sizes(layers, pp, vpp)
        assert sizes is not None and sum(sizes) == layers and len(sizes) == pp * vpp
        middle = set(sizes[1:-1])
        assert len(middle) <= 1 and sizes[0] <= max(middle) and sizes[-1] <= max(middle)
    assert chunk_sizes(1, 4, 1) is None


def test_megatron_keeps_fp32_main_grads():
    assert Precision.megatron("bf16").per_param(zero_stage=1, dp=4) == 2 + 4 + 12 / 4
    assert Precision.named("bf16").per_param(zero_stage=1, dp=4) == 2 + 2 + 12 / 4
    spec = load_model_spec(MODELS / "Qwen3-30B-A3B")
    kw = {"world_size": 8, "chunks_alive": 1}
    shape = Shape(pp=1, vpp=1, tp=1, cp=1, ep=8, overlap="none")
    fp32 = baseline_rank_memory(spec, Workload(4096, 1), shape, **kw)
    bf16 = baseline_rank_memory(spec, Workload(4096, 1), replace(shape, fp32_grads=False), **kw)
    experts = 48 * 128 * spec.expert_params()
    dense = spec.total_params() - experts
    assert fp32.state - bf16.state == pytest.approx(2 * (experts / 8 + dense))  # 2 more bytes on every local param


def test_deepep_sends_a_token_once_per_destination_node():
    spec = load_model_spec(MODELS / "Qwen3-235B-A22B")
    cluster = preset("h100", 32)
    rates = replace(Rates.from_cluster(cluster, Efficiency()), nvlink_bw=1e18)  # the NIC leg alone
    work = Workload(4096, 1)
    plain = alltoall_s(spec, work, ep=32, cluster=cluster, rates=rates)
    deepep = alltoall_s(spec, work, ep=32, cluster=cluster, rates=rates, dispatcher="deepep")
    # top-8 over 4 nodes: 8 x 24/32 = 6.0 cross-node copies per token, against 2.7 distinct remote nodes
    assert plain / deepep == pytest.approx(6.0 / 2.73, rel=0.02)
    busy = replace(rates, routing_imbalance=1.5)
    assert alltoall_s(spec, work, ep=32, cluster=cluster, rates=busy, dispatcher="deepep") == pytest.approx(
        1.5 * deepep
    )


def test_fine_grained_experts_run_at_a_lower_share_of_peak():
    assert expert_efficiency(768) < expert_efficiency(1536) < expert_efficiency(14336)
    spec = load_model_spec(MODELS / "Qwen3-30B-A3B")
    rates = shape_rates(preset("h100", 1), Efficiency(), spec)
    assert rates.experts_fwd.per_flop > rates.attention_fwd.per_flop  # experts slower per FLOP than dense GEMMs


def test_baseline_layout_errors_are_one_line(capsys):
    for bad in ("tp2,pp8", "tp=2,pp=eight", "tp=2,tp=4", "tp=2,foo=1", "tp=2,overlap=always"):
        with pytest.raises(ConfigError):
            parse_layout(bad)
    spec, cluster = load_model_spec(MODELS / "Qwen3-235B-A22B"), preset("h100", 32)
    check_layout(parse_layout("tp=2,pp=8,vpp=4,ep=32"), spec, cluster, 4096)
    for bad in ("tp=2,pp=3", "tp=2,pp=8,ep=64", "tp=3", "tp=2,pp=8,vpp=4,ep=32,cp=3"):
        with pytest.raises(ConfigError):
            check_layout(parse_layout(bad), spec, cluster, 4096)
    model = str(MODELS / "tiny-qwen3-moe")
    for bad in ("tp=1,pp=x", "tp=1,pp=3"):
        rc = main(["--model", model, "--seq-len", "256", "--cluster", "h100", "--nodes", "1", "--baseline-layout", bad])
        err = capsys.readouterr().err
        assert rc == 2 and err.count("\n") == 1 and "--baseline-layout" in err


def test_baseline_layout_prices_the_baseline_there(capsys):
    args = ["--model", str(MODELS / "tiny-qwen3-moe"), "--seq-len", "256", "--cluster", "h100", "--nodes", "1"]
    rc = main(
        [
            *args,
            "--json",
            "--global-batch-size",
            "32",
            "--recompute",
            "selective",
            "--variants",
            "paper",
            "--baseline-layout",
            "tp=1,pp=2,vpp=2,ep=4",
        ]
    )
    out = json.loads(capsys.readouterr().out)
    assert rc == 0
    base = out["baseline"]
    assert (base["tensor_parallel"], base["pipeline_parallel"], base["expert_parallel"]) == (1, 2, 4)
    assert out["baseline_tokens_per_s_per_gpu"] * 8 * out["baseline_step_time_s"] == pytest.approx(
        base["tokens_per_step"], rel=1e-6
    )
    assert out["baseline_tflops_per_gpu"] > 0


def small_cluster() -> Cluster:
    return Cluster(
        "test",
        nodes=2,
        gpus_per_node=4,
        peak_flops=400e12,
        hbm_bytes=20e9,
        nvlink_bw=200e9,
        nics_per_node=4,
        nic_bw=5e9,
    )


def test_more_variants_never_give_a_slower_af_pipe_plan():
    spec, cluster = mid_model(), small_cluster()
    req = PlanRequest(
        spec,
        cluster,
        Rates.from_cluster(cluster, Efficiency()),
        Workload(4096, 1),
        global_batch=32,
        simulate_per_variant_set=1,
    )
    sets = [PAPER, frozenset({"offload"}), frozenset({"resend"}), frozenset({"offload", "resend"}), frozenset(VARIANTS)]
    rate = {}
    for allowed in sets:
        af, _ = best_af(replace(req, af_variants=allowed))
        rate[allowed] = af.tokens_per_s if af else 0.0
    for small in sets:
        for big in sets:
            if small <= big:
                assert rate[big] >= rate[small] * (1 - 1e-9), (sorted(small), sorted(big))


def test_shortlist_of_a_variant_subset_is_the_full_shortlist_restricted_to_it():
    import itertools
    import random
    from types import SimpleNamespace

    from disagmoe_ds.planner.allocator import shortlist

    def fake(used: frozenset[str], filled: bool) -> SimpleNamespace:
        work = Workload(
            4096,
            1,
            recompute="selective" if "selective" in used else "none",
            resend="resend" in used,
            offload=(0.5, 0.0) if "offload" in used else (0.0, 0.0),
        )
        return SimpleNamespace(
            work=work, max_in_flight=5 if filled else 1, micro_batches=8, layout=SimpleNamespace(depth=2)
        )

    names = ("selective", "resend", "offload")
    subsets = [frozenset(c) for r in range(4) for c in itertools.combinations(names, r)]
    rng = random.Random(0)
    for _ in range(50):
        ranked = [fake(rng.choice(subsets), rng.random() < 0.7) for _ in range(rng.randint(1, 14))]
        ranked.sort(key=lambda c: c.max_in_flight < 5)  # ring-filling first, as the allocator ranks them
        for top in (1, 2):
            full = shortlist(ranked, top)
            for allowed in subsets:
                mine = [c for c in ranked if not (variants_of(c) - allowed)]
                assert shortlist(mine, top) == [c for c in full if c in mine]


def variants_of(c) -> frozenset[str]:
    from disagmoe_ds.planner.variants import variants_used

    return variants_used(c.work)


def test_sweep_writes_a_row_per_point_and_a_png(tmp_path, capsys):
    pytest.importorskip("matplotlib")
    from disagmoe_ds.planner.sweep import main as sweep_main

    out = tmp_path / "map"
    model = str(MODELS / "tiny-qwen3-moe")
    rc = sweep_main(
        ["--model", f"{model}:1", "--seq-len", "256", "--bandwidth", "3,50", "--workers", "1", "--out", str(out)]
    )
    assert rc == 0 and "tiny-qwen3-moe at 1 nodes: 2 cells in" in capsys.readouterr().out
    doc = json.loads(out.with_suffix(".json").read_text())
    assert [(r["seq_len"], r["bandwidth_gb_s"]) for r in doc["rows"]] == [(256, 3.0), (256, 50.0)]
    assert all(r["speedup"] is not None and r["af_step_s"] > 0 for r in doc["rows"])
    assert out.with_suffix(".png").stat().st_size > 0


def test_sweep_cell_gives_every_gpu_its_bandwidth():
    from disagmoe_ds.planner.sweep import Cell, plan_cell

    slow = plan_cell(Cell(MODELS / "tiny-qwen3-moe", 2, 256, 1.0, "h800", 1, 2))
    fast = plan_cell(Cell(MODELS / "tiny-qwen3-moe", 2, 256, 100.0, "h800", 1, 2))
    assert fast["af_step_s"] < slow["af_step_s"]  # AF-Pipe's A -> F traffic crosses the nodes' NICs
