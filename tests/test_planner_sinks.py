"""Issue 44: GPT-OSS's sink attention priced per system. This project's runtime (and HF's model under DeepSpeed) runs
the learned sinks through flex_attention, measured at 0.05-0.20 of peak; a Megatron-style baseline runs Transformer
Engine's fused kernel, priced as any fused core (pure Python, a few seconds)."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest

from disagmoe_ds.planner.allocator import PlanRequest
from disagmoe_ds.planner.cluster import Efficiency, preset
from disagmoe_ds.planner.colocated_costs import Shape, colocated_costs
from disagmoe_ds.planner.gemm_efficiency import ATTENTION_CORE, FLEX_SINK_CORE, interpolated, shape_rates
from disagmoe_ds.planner.model import load_model_spec
from disagmoe_ds.planner.part_times import attention_call_s, core_slowdown
from disagmoe_ds.planner.workload import Workload

MODELS = Path(__file__).resolve().parents[1] / "hf_models"
# The compiled flex attention part of a full-attention GPT-OSS-120B layer, forward + backward, one H100, 2026-12-06
# (docs/planner.md section 8): the measurements the table was derived from.
MEASURED_H100_MS = {2048: 2.60, 4096: 4.84, 8192: 12.33, 16384: 38.05}


@pytest.fixture(scope="module")
def gpt_oss():
    return load_model_spec(MODELS / "GPT-OSS-120B")


def full_attention(spec, layer: int = 0):
    return replace(spec, windows=spec.windows[:layer] + (0,) + spec.windows[layer + 1 :])


@pytest.mark.parametrize("seq_len", sorted(MEASURED_H100_MS))
def test_flex_sink_attention_part_is_priced_as_measured(gpt_oss, seq_len):
    spec = full_attention(gpt_oss)
    rates = shape_rates(preset("h100", 1), Efficiency(), spec)
    fwd, bwd = attention_call_s(spec, rates, seq_len=seq_len, layer=0, tokens=seq_len, recompute="none")
    assert (fwd + bwd) * 1e3 == pytest.approx(MEASURED_H100_MS[seq_len], rel=0.05)


def test_only_models_with_sinks_pay_the_flex_core():
    qwen = load_model_spec(MODELS / "Qwen3-30B-A3B")
    assert shape_rates(preset("h800", 1), Efficiency(), qwen).sink_core == ()
    rates = replace(shape_rates(preset("h800", 1), Efficiency(), qwen), sink_core=((2048, 0.25),))
    assert core_slowdown(qwen, rates, 4096, 0) == 4.0  # the slowdown is the rates', whatever the model


def test_a_windowed_layer_is_priced_at_its_window(gpt_oss):
    rates = shape_rates(preset("h800", 1), Efficiency(), gpt_oss)
    window = gpt_oss.windows[0]
    assert window == 128 and gpt_oss.windows[1] == 0
    short = ATTENTION_CORE / FLEX_SINK_CORE[0][1]
    assert core_slowdown(gpt_oss, rates, 16384, 0) == pytest.approx(short)  # 128 keys: the table's low end
    assert core_slowdown(gpt_oss, rates, 16384, 1) == pytest.approx(ATTENTION_CORE / 0.20)
    assert core_slowdown(gpt_oss, rates, 6000, 1) == pytest.approx(ATTENTION_CORE / interpolated(6000, FLEX_SINK_CORE))


@pytest.mark.parametrize("baseline,flex", [("strongest", False), ("ep", False), ("deepspeed", True)])
def test_each_baseline_runs_its_own_sink_kernel(gpt_oss, baseline, flex):
    clus = preset("h800", 2)
    req = PlanRequest(
        spec=gpt_oss,
        cluster=clus,
        rates=shape_rates(clus, Efficiency(), gpt_oss),
        work=Workload(16384, 1),
        global_batch=32,
        baseline=baseline,
    )
    assert bool(req.baseline_rates.sink_core) is flex
    assert replace(req, baseline_sinks="flex").baseline_rates.sink_core  # this project's co-located runtime
    shape = Shape(pp=4, vpp=1, tp=2, cp=2, ep=4, overlap="partial")
    kwargs = dict(cluster=clus, overlap=0.0)
    fused = colocated_costs(gpt_oss, req.work, shape, rates=replace(req.rates, sink_core=()), **kwargs)
    priced = colocated_costs(gpt_oss, req.work, shape, rates=req.baseline_rates, **kwargs)
    assert (sum(priced.bwd_compute) > sum(fused.bwd_compute)) is flex
