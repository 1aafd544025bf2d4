"""The DeepSpeed-reachable co-located baseline (issue 44): what a DeepSpeed user runs on an HF MoE model, AutoEP's
expert parallelism over ZeRO data parallelism with DeepSpeed-Ulysses and AutoTP and no pipeline stages, priced as
DeepSpeed runs it; and the study's three-baseline table (pure Python)."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest

from disagmoe_ds.planner.allocator import best_baseline
from disagmoe_ds.planner.attention_lanes import ulysses_forward_bytes
from disagmoe_ds.planner.cluster import Efficiency, preset
from disagmoe_ds.planner.colocated import deepspeed_shapes
from disagmoe_ds.planner.colocated_costs import Shape, tp_cp_exposed_s
from disagmoe_ds.planner.gemm_efficiency import shape_rates
from disagmoe_ds.planner.model import load_model_spec
from disagmoe_ds.planner.study import BASELINES, Cell, baselines_row, cell_request
from disagmoe_ds.planner.tensor_parallel import tp_exposed_s
from disagmoe_ds.planner.workload import Workload

MODELS = Path(__file__).resolve().parents[1] / "hf_models"


def test_deepspeed_runs_no_pipeline_autoeps_transports_and_bf16_grads():
    spec, cluster = load_model_spec(MODELS / "Qwen3-30B-A3B"), preset("h800", 4)
    found = list(deepspeed_shapes(spec, cluster, 16384, ep=None))
    assert found and all((s.pp, s.vpp, s.fp32_grads, s.ulysses) == (1, 1, False, True) for s in found)
    # AutoEP's DeepEP transport ("comm_backend": "deepep") beside its all-to-all, never with AutoTP
    assert {s.dispatcher for s in found if s.tp == 1 and s.ep > 1} == {"alltoall", "deepep"}
    assert {s.dispatcher for s in found if s.tp > 1 or s.ep == 1} == {"alltoall"}
    assert {s.tp for s in found} >= {1, 2, 4} and {s.cp for s in found} >= {1, 2, 4}  # with and without AutoTP
    assert all(32 % (s.tp * s.cp) == 0 for s in found)  # Ulysses splits a TP rank's 32 / t query heads
    # DeepSpeed 0.19's AutoEP refuses AutoTP with Ulysses, and AutoTP over an expert-parallel group of one rank
    assert all(s.cp == 1 and s.ep > 1 for s in found if s.tp > 1) and any(s.ep == 1 for s in found if s.tp == 1)


def test_ulysses_all_to_alls_are_exposed_where_ring_cp_hides_behind_the_core():
    spec, cluster = load_model_spec(MODELS / "Qwen3-30B-A3B"), preset("h800", 4)
    rates, work = shape_rates(cluster, Efficiency(), spec), Workload(32768, 1)
    ring = Shape(1, 1, 2, 4, 8, "partial")
    ulysses = replace(ring, ulysses=True)
    fwd, bwd = tp_cp_exposed_s(spec, work, ulysses, layer=5, cluster=cluster, rates=rates)
    tp_fwd, tp_bwd = tp_exposed_s(spec, rates, work, layer=5, tp=2, groups=4)
    a2a = ulysses_forward_bytes(spec, replace(work, sequence_parallel=4, tensor_parallel=2)) / rates.nvlink_bw
    # the Ulysses all-to-alls come on top of TP's exposed share, twice in the backward
    assert a2a > 0 and fwd == pytest.approx(tp_fwd + a2a, rel=1e-6) and bwd == pytest.approx(tp_bwd + 2 * a2a, rel=1e-6)
    assert tp_cp_exposed_s(spec, work, ring, layer=5, cluster=cluster, rates=rates)[0] < fwd  # ring CP: hidden


def test_the_deepspeed_baseline_is_slower_than_the_strongest_practice_and_the_study_sets_them_side_by_side():
    req = cell_request(Cell("Qwen3-30B-A3B", 4, 4096), MODELS, per_variant_set=1)
    strongest, deepspeed = (best_baseline(replace(req, **options))[0] for _, options in BASELINES[:2])
    assert strongest is not None and deepspeed is not None
    assert deepspeed.candidate.shape.pp == 1 and deepspeed.step_time_s > strongest.step_time_s
    row = baselines_row(Cell("Qwen3-30B-A3B", 4, 4096), MODELS, per_variant_set=1).strip("|").split("|")
    assert len(row) == 4 + 2 * len(BASELINES) and row[5].strip().startswith("TP ") and "Ulysses" in row[5]
    assert all(cell.strip().endswith("x") for cell in row[-3:])


def test_deepspeeds_zero2_reduces_every_micro_batch_and_is_tried_before_recompute():
    from disagmoe_ds.planner.colocated import _memory_options
    from disagmoe_ds.planner.grad_sync import baseline_sync_s

    spec, cluster = load_model_spec(MODELS / "Qwen3-30B-A3B"), preset("h800", 4)
    rates, shape = shape_rates(cluster, Efficiency(), spec), Shape(1, 1, 1, 1, 8, "partial", ulysses=True)
    kw = dict(cluster=cluster, rates=rates, micro_batches=4)
    zero1 = baseline_sync_s(spec, Workload(4096, 1), shape, **kw)
    zero2 = baseline_sync_s(spec, Workload(4096, 1, zero_stage=2), shape, **kw)
    assert zero1 > 0 and zero2 == pytest.approx(zero1 / 2 * (1 + 4))  # 4 reduce-scatters and one all-gather
    megatron = replace(shape, ulysses=False)  # the distributed optimizer reduces once a step at any stage
    assert baseline_sync_s(spec, Workload(4096, 1, zero_stage=2), megatron, **kw) == pytest.approx(zero1)
    order = [(w.recompute, w.zero_stage) for w in _memory_options(Workload(4096, 1), ("none", "full"), zero2=True)]
    assert order == [("none", 1), ("none", 2), ("full", 1), ("full", 2)]
