"""Data-parallel gradient synchronisation per step, for both systems: ring reduce-scatter and all-gather over a
group's replicas, per ZeRO stage, and the share of it the backward cannot hide (pure Python).
"""

from __future__ import annotations

from dataclasses import replace
from functools import lru_cache

from disagmoe_ds.layout import Layout
from disagmoe_ds.planner.attention_lanes import param_replicas, rank_params
from disagmoe_ds.planner.cluster import Cluster, Rates
from disagmoe_ds.planner.colocated_costs import Shape
from disagmoe_ds.planner.model import ModelSpec
from disagmoe_ds.planner.placement import Placement
from disagmoe_ds.planner.training_state import Precision, baseline_stage_params, busiest_group_params
from disagmoe_ds.planner.workload import Workload

DP_OVERLAP = 0.8  # share of the gradient sync that can hide behind backward compute (Megatron overlap_grad_reduce)


def ring_sync_s(num_params: float, replicas: int, *, grad_bytes: float, bytes_per_s: float) -> float:
    """ZeRO reduce-scatter of gradients + all-gather of parameters over ``replicas`` ranks (ring):
    2 (r - 1) / r of the rank's gradient bytes leave each rank."""
    if replicas <= 1:
        return 0.0
    return 2 * (replicas - 1) / replicas * num_params * grad_bytes / bytes_per_s


def exposed_sync_s(sync_s: float, backward_s: float) -> float:
    """What the step waits for: at least (1 - DP_OVERLAP) of the sync, or all that outlasts the backward."""
    return max((1 - DP_OVERLAP) * sync_s, sync_s - backward_s, 0.0)


def step_sync_s(params: float, replicas: int, zero_stage: int, *, precision: str, bytes_per_s: float) -> float:
    """Once-per-step sync of a ``replicas``-way group: ZeRO-0/1 reduce-scatter the accumulated gradients and
    all-gather the parameters (``ring_sync_s``); ZeRO-2 reduced every micro-batch already and only gathers the
    updated parameters; ZeRO-3 gathers them on use, so nothing is left at the step's end."""
    if zero_stage >= 3:
        return 0.0
    grad = Precision.named(precision).grad
    full = ring_sync_s(params, replicas, grad_bytes=grad, bytes_per_s=bytes_per_s)
    return full / 2 if zero_stage == 2 else full


def af_sync_s(
    spec: ModelSpec, layout: Layout, work: Workload, *, placement: Placement, rates: Rates, nics: tuple[int, int]
) -> tuple[float, float]:
    """(A rank, F rank) gradient-sync seconds per step: over the ranks of an A-group that hold the same parameter
    shard (its d lanes x s Ulysses ranks, 1/t of the parameters each: ``attention_lanes.py``) and over the expert-DP
    replicas of an F-group, through the side's NIC share when the replicas span nodes, else NVLink. Only trained
    parameters have gradients to reduce and updates to gather (LoRA: the adapters)."""
    return _af_sync_s(spec, layout, _sync_work(work), placement, rates, nics)


@lru_cache(maxsize=4096)
def _sync_work(work: Workload) -> Workload:
    """``work`` without what the sync does not read (recompute, resend, offload, split backward), so that the
    search's variants of a layout share ``_af_sync_s``."""
    return replace(work.with_recompute("none", "none"), resend=False, offload=(0.0, 0.0), split_backward=False)


@lru_cache(maxsize=65536)
def _af_sync_s(
    spec: ModelSpec, layout: Layout, work: Workload, placement: Placement, rates: Rates, nics: tuple[int, int]
) -> tuple[float, float]:
    m = layout.attention_gpus

    def rate(ranks: tuple[int, ...], nic_share: float, side: Rates) -> float:
        return nic_share * side.nic_bw if placement.spans_nodes(ranks, attention_gpus=m) else side.nvlink_bw

    a_params, f_params = busiest_group_params(spec, layout, work.lora)
    a = step_sync_s(
        rank_params(a_params.trained, work),
        param_replicas(layout, work),
        work.zero_of("attention"),
        precision=work.precision,
        bytes_per_s=rate(layout.attention_ranks(0), nics[0] / m, rates),
    )
    f = step_sync_s(
        f_params.trained,
        layout.expert_data_parallel,
        work.zero_of("ffn"),
        precision=work.precision,
        bytes_per_s=rate(layout.edp_group_ranks(0, 0), nics[1] / layout.ffn_gpus, rates.side("ffn")),
    )
    return a, f


def baseline_sync_s(
    spec: ModelSpec, work: Workload, shape: Shape, *, cluster: Cluster, rates: Rates, micro_batches: int = 1
) -> float:
    """Co-located gradient sync per step on the worst stage: dense parameters (split over tp) over the stage's
    W/(pp tp) data- and context-parallel ranks, expert shards over their (W/pp)/ep replicas (strided by tp and
    ep, so they share a node only while the stride stays inside it); trained parameters only. DeepSpeed's ZeRO-2
    (a ``Shape.ulysses`` shape at ZeRO stage 2) reduce-scatters every micro-batch's gradients, ``micro_batches``
    times a step, and gathers the parameters once."""
    pp, vpp, ep, tp = shape.pp, shape.vpp, shape.ep, shape.tp
    precision = Precision.megatron if shape.fp32_grads else Precision.named  # Megatron: fp32 main grads
    grad = precision(work.precision).grad
    dp, g = cluster.world_size // (pp * tp), cluster.gpus_per_node
    nic = rates.nic_bw_per_gpu(cluster)
    worst = 0.0
    for stage in range(pp):
        _, dense, experts = baseline_stage_params(spec, pp=pp, vpp=vpp, ep=ep, stage=stage, lora=work.lora)
        dense_rate = nic if dp * tp > g else rates.nvlink_bw
        dense_s = ring_sync_s(dense.trained / tp, dp, grad_bytes=grad, bytes_per_s=dense_rate)
        edp = cluster.world_size // (pp * ep)
        expert_rate = nic if edp > max(1, g // ep) else rates.nvlink_bw
        worst = max(worst, dense_s + ring_sync_s(experts.trained, edp, grad_bytes=grad, bytes_per_s=expert_rate))
    if shape.ulysses and work.zero_stage == 2:  # ring_sync_s: a reduce-scatter and an all-gather of equal size
        return worst / 2 * (1 + micro_batches)
    return worst
