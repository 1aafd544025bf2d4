"""The optimizer step that ends every training step, for both systems (pure Python).

The step is memory-bound: a rank streams the gradients, master weights and Adam moments of the parameters whose
optimizer state it holds (its ZeRO shard) through HBM a few times, so it takes

    parameters of the shard x bytes moved per parameter / (HBM bandwidth x hbm efficiency)

It starts after the global gradient norm (clipping needs it), so after the last backward of every rank:

* AF-Pipe: the A lanes and the F ranks step in parallel once the pipeline has drained; the step waits for the
  slower side, usually an F rank holding the state of many experts (``af_optimizer_s``); with the F side's optimizer
  in host memory its step is the copies over PCIe and the host's pass over the state (``host_optimizer_step_s``);
* co-located: every rank steps its own shard; the rank of the heaviest stage decides (``baseline_optimizer_s``).

Under FP8 a rank's step also carries the casts of its expert weights, once a step (``fp8_costs.weight_cast_s``).

>>> from disagmoe_ds.planner.cluster import Efficiency, Rates, preset
>>> rates = Rates.from_cluster(preset("h200", nodes=1), Efficiency())
>>> round(optimizer_step_s(4.832e9, precision="bf16", rates=rates), 3)  # AF-Pipe's F rank on 2 H200s: 104 ms
0.104
>>> round(optimizer_step_s(state_params(4.832e9, replicas=2, zero_stage=1), precision="bf16", rates=rates), 3)
0.052
"""

from __future__ import annotations

from disagmoe_ds.layout import Layout
from disagmoe_ds.planner.attention_lanes import param_replicas, rank_params
from disagmoe_ds.planner.cluster import HBM_BW_H200, Efficiency, Rates
from disagmoe_ds.planner.colocated_costs import Shape
from disagmoe_ds.planner.fp8_costs import cast_expert_weights, keeps_expert_copies, weight_cast_s
from disagmoe_ds.planner.lora import Params
from disagmoe_ds.planner.model import ModelSpec
from disagmoe_ds.planner.training_state import HOST_GRAD_BYTES, baseline_stage_params, busiest_group_params
from disagmoe_ds.planner.workload import Workload

# HBM bytes one mixed-precision Adam step moves per parameter of a rank's shard, as DeepSpeed's ZeRO-1/2 bf16
# optimizer runs it with torch's fused AdamW and gradient clipping. Counted, per parameter:
#   the global norm reads the bf16 gradient                                      2
#   the gradient partition is cast to fp32 (read bf16 2, write fp32 4)           6
#   clipping scales the fp32 gradient in place (read 4, write 4)                 8
#   fused AdamW reads fp32 param, grad, m, v (16) and writes param, m, v (12)   28
#   the updated fp32 partition is copied into the bf16 parameters (read 4, write 2)  6
# = 50 B. fp32 training has no cast and no bf16 copy, and its norm reads 4 B: 4 + 8 + 28 = 40 B.
COUNTED_BYTES_PER_PARAM = {"bf16": 50.0, "fp32": 40.0}
# Calibration: on 2 H200s (bench_e2e, compiled, AF-Pipe 1 A + 1 F; docs/planner.md section 5) the F rank, which
# holds all 4.832B expert parameters of the balanced model, spends 104 ms of its host timeline in the optimizer step.
# At 4.8 TB/s x 0.9 that is 93 B per parameter, 1.86x the count. The difference was not measured apart: DeepSpeed's
# step is not one streaming pass per line above (per-tensor norm kernels, the flatten, allocations), and the host
# time also holds the wait for the global norm's all-reduce. The constant is the calibrated 93 B; fp32 keeps the
# counted ratio to it.
_F_RANK_PARAMS, _F_RANK_STEP_S = 4.832e9, 0.104
BYTES_PER_PARAM = {
    name: counted * _F_RANK_STEP_S * HBM_BW_H200 * Efficiency().hbm / _F_RANK_PARAMS / COUNTED_BYTES_PER_PARAM["bf16"]
    for name, counted in COUNTED_BYTES_PER_PARAM.items()
}


# Host memory bytes per parameter of a step with the optimizer in host memory (ZeRO-Offload, CPU Adam): the gradient
# copied down into an fp32 host buffer (the DMA writes 4), Adam over fp32 parameter, gradient and moments (reads 16,
# writes 12), the bf16 parameter written for the copy up (2) and read by it (2).
HOST_STEP_BYTES = HOST_GRAD_BYTES + 16 + 12 + 2 + 2
# PCIe bytes per parameter of that step: the fp32 gradient down, the bf16 parameter up (bf16 training).
PCIE_STEP_BYTES = HOST_GRAD_BYTES + 2


def host_optimizer_step_s(params: float, *, rates: Rates) -> float:
    """Seconds of the step of a rank whose optimizer state for ``params`` parameters is in host memory: the copies
    over its PCIe link, then the host's step (its share of the node's host memory bandwidth), not overlapped."""
    return params * PCIE_STEP_BYTES / rates.pcie_bw + params * HOST_STEP_BYTES / rates.host_mem_bw


def state_params(params: float, *, replicas: int, zero_stage: int) -> float:
    """Parameters whose optimizer state one rank holds: ZeRO-1 and up shard it over the group's replicas."""
    return params / replicas if zero_stage >= 1 else params


def optimizer_step_s(params: float, *, precision: str, rates: Rates) -> float:
    """Seconds one rank's optimizer step takes for the ``params`` parameters of its shard."""
    return params * BYTES_PER_PARAM[precision] / rates.hbm_bw


def af_optimizer_s(spec: ModelSpec, layout: Layout, work: Workload, rates: Rates) -> tuple[float, float]:
    """(A rank, F rank) optimizer step of the busiest group: A state (1/t of the parameters in a TP lane) sharded
    over the d lanes x s Ulysses ranks holding it (``attention_lanes.py``), F state over the expert-DP replicas;
    only trained parameters have optimizer state (LoRA: the adapters)."""
    a_params, f_params = busiest_group_params(spec, layout, work.lora)
    a_trained = rank_params(a_params.trained, work)
    a = state_params(a_trained, replicas=param_replicas(layout, work), zero_stage=work.zero_of("attention"))
    f = state_params(f_params.trained, replicas=layout.expert_data_parallel, zero_stage=work.zero_of("ffn"))
    f_rates = rates.side("ffn")
    if work.ffn_optimizer_on_host:
        f_step = host_optimizer_step_s(f, rates=f_rates)
    else:
        f_step = optimizer_step_s(f, precision=work.precision, rates=f_rates)
    f_step += _expert_casts_s(spec, f_params, work, f_rates)
    return optimizer_step_s(a, precision=work.precision, rates=rates), f_step


def _expert_casts_s(spec: ModelSpec, experts: Params, work: Workload, rates: Rates) -> float:
    """Under FP8, the step's casts of a rank's expert weights (``fp8_costs.weight_cast_s``), paid once a step like
    the optimizer step (at the first micro-batch; priced here, with it)."""
    return weight_cast_s(cast_expert_weights(experts, work.lora), rates) if keeps_expert_copies(spec, work) else 0.0


def baseline_optimizer_s(spec: ModelSpec, work: Workload, shape: Shape, *, world_size: int, rates: Rates) -> float:
    """Co-located optimizer step on the heaviest stage: dense parameters (split over tp) with their state over the
    W/(pp tp) data- and context-parallel ranks, expert shards over their W/(pp ep) replicas (the distributed
    optimizer, as ``memory.baseline_rank_memory`` counts it)."""
    pp, tp, ep, worst = shape.pp, shape.tp, shape.ep, 0.0
    for stage in range(pp):
        _, dense, experts = baseline_stage_params(spec, pp=pp, vpp=shape.vpp, ep=ep, stage=stage, lora=work.lora)
        params = state_params(dense.trained / tp, replicas=world_size // (pp * tp), zero_stage=work.zero_stage)
        params += state_params(experts.trained, replicas=world_size // (pp * ep), zero_stage=work.zero_stage)
        step = optimizer_step_s(params, precision=work.precision, rates=rates)
        step += _expert_casts_s(spec, experts, work, rates)
        worst = max(worst, step)
    return worst
