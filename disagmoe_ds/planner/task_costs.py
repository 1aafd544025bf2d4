"""Per-task seconds of an AF-Pipe step for the schedule generator and the simulator: each layer's A part and F
share per micro-batch, and each A <-> F and A -> A transfer (pure Python).

With a split backward the weight-gradient GEMMs of each backward (half of it in full fine-tuning, dgrad and wgrad
costing the same; under LoRA the adapters' only, ``lora.GemmFlops``) become their own task (``zerobubble.py``).
The same costs order the runtime's schedule (``runtime_costs.py``), so what the planner simulates is what runs.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from disagmoe_ds.layout import Layout
from disagmoe_ds.planner.attention_lanes import data_lanes, lane_attention_call_s, lane_bytes_per_s, rank_tokens
from disagmoe_ds.planner.cluster import Rates
from disagmoe_ds.planner.fp8_costs import expert_lever, lever
from disagmoe_ds.planner.model import ModelSpec
from disagmoe_ds.planner.part_times import (
    attention_wgrad_s,
    expert_call_s,
    expert_wgrad_s,
    head_call_s,
    head_wgrad_s,
)
from disagmoe_ds.planner.placement import Placement
from disagmoe_ds.planner.stages import cross_node_share, node_hop_s
from disagmoe_ds.planner.workload import Workload


@dataclass(frozen=True)
class AfTaskCosts:
    """Seconds per (layer, micro-batch) task and transfer; ``per_layer`` maps kind -> one value per layer.

    With a split backward, ``A_bwd``/``F_bwd`` (and ``head_bwd``) hold the input-gradient part only and
    ``wgrad`` maps "A"/"F" to the per-layer weight-gradient tasks (``head_wgrad`` for the LM head)."""

    per_layer: dict[str, tuple[float, ...]]
    head_fwd: float
    head_bwd: float
    wgrad: dict[str, tuple[float, ...]] = field(default_factory=dict)
    head_wgrad: float = 0.0


def af_task_costs(
    spec: ModelSpec, layout: Layout, work: Workload, *, placement: Placement, rates: Rates, nics: tuple[int, int]
) -> AfTaskCosts:
    """Per-task seconds for the schedule generator: an A rank's part, an F rank's share, and each transfer.

    An A task is one rank's share of its lane's micro-batch with the lane's exposed Ulysses and TP communication
    (``attention_lanes.py``). A transfer of one micro-batch moves d lanes' tokens (each A rank its own) through the
    group's NIC share (M_a/p on the A side, M_f/p on the F side; the slower end sets the time) or over NVLink for
    the intra-node share. With
    ``resend`` the backward's n2m_grad message also carries the layer's m2n payload again and each F backward
    re-runs the expert forward first (``Workload.ffn_rerun``: charged once, also under full recompute).
    With a split backward the expert side keeps its weight gradients in its backward at ZeRO-3, which gathers and
    releases the parameters around each backward (``afpipe.split_backward``); only the attention side splits then.
    """
    p, ranks, tokens = layout.depth, layout.lanes, rank_tokens(work)
    af_cross, res_cross = cross_node_share(layout, placement)
    f_rates = rates.side("ffn")
    nic_bw = min(nics[0] * rates.nic_bw, nics[1] * f_rates.nic_bw) / p  # the slower end's NICs
    af_link = _link(nic_bw, rates.nvlink_bw * min(ranks, layout.ffn_ranks_per_group), af_cross)
    res_link = _link(nics[0] / p * rates.nic_bw, rates.nvlink_bw * ranks, res_cross)
    lane_bw = lane_bytes_per_s(layout, work, placement=placement, rates=rates, nics=nics)
    wire = spec.wire_bytes_per_token(layout.exchange_peers, fp8=work.fp8)
    hop_fwd, hop_bwd = node_hop_s(spec, layout, work, f_rates.nvlink_bw)
    group_tokens = data_lanes(layout, work) * work.tokens_per_micro_batch  # every A rank sends its own T/(s t)
    f_tokens = group_tokens / layout.ffn_ranks_per_group
    per_layer: dict[str, list[float]] = {k: [] for k in ("A_fwd", "A_bwd", "F_fwd", "F_bwd")}
    wgrad: dict[str, list[float]] = {"A": [], "F": []}
    lora, a_fp8, f_fp8 = work.lora, lever(work, work.tensor_parallel), expert_lever(spec, work, layout.ep_size)
    for i in range(spec.num_layers):
        a_fwd, a_bwd = lane_attention_call_s(spec, rates, work, layer=i, lane_bw=lane_bw)
        f_fwd, f_bwd = expert_call_s(
            spec, f_rates, layer=i, tokens=f_tokens, recompute=work.ffn_rerun, lora=lora, fp8=f_fp8
        )
        a_w = attention_wgrad_s(spec, rates, layer=i, tokens=tokens, lora=lora, fp8=a_fp8)
        f_w = expert_wgrad_s(spec, f_rates, layer=i, tokens=f_tokens, lora=lora, fp8=f_fp8)
        if not work.split_backward:
            a_w = f_w = 0.0
        if work.zero_of("ffn") == 3:
            f_w = 0.0
        per_layer["A_fwd"].append(a_fwd)
        per_layer["A_bwd"].append(a_bwd - a_w)
        moe = spec.moe_layers[i]
        per_layer["F_fwd"].append(f_fwd + moe * hop_fwd)
        per_layer["F_bwd"].append(f_bwd - f_w + moe * hop_bwd)
        wgrad["A"].append(a_w)
        wgrad["F"].append(f_w)
    _add_message_host_time(per_layer, spec, layout, rates.message_host_s)
    costs = {k: tuple(v) for k, v in per_layer.items()}
    for kind in ("m2n", "n2m", "m2n_grad", "n2m_grad"):
        payload = getattr(wire, kind) + (wire.m2n if kind == "n2m_grad" and work.resend else 0.0)
        costs[kind] = (group_tokens * payload / af_link,) * spec.num_layers
    resent = [wire.m2n if work.resend and moe else 0.0 for moe in spec.moe_layers]  # p > 1: to A_next, see memory.py
    for kind in ("resid", "resid_grad"):
        per_layer_bytes = [getattr(wire, kind) + (extra if kind == "resid" else 0.0) for extra in resent]
        costs[kind] = tuple(group_tokens * b / res_link if p > 1 else 0.0 for b in per_layer_bytes)
    head_fwd, head_bwd = head_call_s(spec, rates, tokens=tokens, lora=lora)
    head_w = head_wgrad_s(spec, rates, tokens=tokens, lora=lora) if work.split_backward else 0.0
    wgrads = {k: tuple(v) for k, v in wgrad.items()} if work.split_backward else {}
    return AfTaskCosts(costs, head_fwd=head_fwd, head_bwd=head_bwd - head_w, wgrad=wgrads, head_wgrad=head_w)


def _add_message_host_time(
    per_layer: dict[str, list[float]], spec: ModelSpec, layout: Layout, message_host_s: float
) -> None:
    """Each task's exchange operations, issued by its rank's host: an MoE layer's A task sends one message and
    posts one receive (forward: m2n out, n2m in; backward: m2n_grad in, n2m_grad out), and so does its F task;
    with p > 1 every A task also sends and receives a residual hand-off."""
    for i, moe in enumerate(spec.moe_layers):
        a_ops = 2 * moe + (2 if layout.depth > 1 else 0)
        for kind, ops in (("A_fwd", a_ops), ("A_bwd", a_ops), ("F_fwd", 2 * moe), ("F_bwd", 2 * moe)):
            per_layer[kind][i] += ops * message_host_s


def _link(nic_rate: float, nvlink_rate: float, cross: float) -> float:
    """Effective bytes/s of a transfer whose ``cross`` share goes over NICs, the rest over NVLink, in parallel."""
    if cross == 0:
        return nvlink_rate
    if cross == 1:
        return nic_rate
    return min(nic_rate / cross, nvlink_rate / (1 - cross))
