"""Stage times of an AF-Pipe plan (paper section 5.3): the roofline T_a, T_f of one step (pure Python). The
per-call part times it sums are in ``part_times.py``, the simulator's per-task costs in ``task_costs.py``, the
gradient sync in ``grad_sync.py``.

Roofline of one training step (the DisagMoE paper's, with per-side NIC pools M_a + M_f = NICs):

    T_a = max(C_a / (M * P_a), V_a / (M_a * B)),    T_f = max(C_f / (N * P_f), V_f / (M_f * B))

C are the step's FLOPs of each side (3x forward, 4x with full recompute on that side, ``Workload.recompute_of``; F
also 4x with resend) and P the
achievable FLOP/s per GPU; here C/(M P) is computed as the busiest group's sum of per-call times
(``cluster.PartModel``: peak x efficiency, or a measured profile with its per-call overhead). B is the
achievable bandwidth per NIC and V the bytes per direction that cross NICs: A <-> F tokens (m2n and n2m_grad
one way, n2m and m2n_grad the other), plus on the A side the residual hand-off A_g -> A_g+1 when p > 1. Traffic
between two GPUs of one node goes over NVLink instead (see ``placement.py`` for which pairs share a node).

The variants add, from first principles:

* selective recompute: the backward re-runs the forward FLOPs ``recompute.py`` lists (full: the whole forward), each
  side under its own policy;
* resend: the A -> F direction carries each token's m2n payload a second time, with the backward, and the F
  side's backward re-runs the expert forward (one more forward on F, as with full recompute, charged once);
* ZeRO-2 / ZeRO-3 on a side: each micro-batch reduce-scatters its gradients over the side's replicas, and
  ZeRO-3 all-gathers the parameters before the forward and the backward ((r - 1)/r of the bytes leave a
  rank), over NICs when the replicas span nodes, else NVLink;
* offload: each GPU's PCIe link to its switch carries the offloaded bytes (out after the forward, back before
  the backward, one each way) on top of the GPU's NIC traffic (GPUDirect RDMA crosses the same link);
* split backward moves work between tasks, not into the step's totals: it changes the schedule
  (``task_costs.py``, ``zerobubble.py``), not the roofline.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

from disagmoe_ds.layout import Layout
from disagmoe_ds.planner.attention_lanes import (
    data_lanes,
    lane_attention_call_s,
    lane_bytes_per_s,
    param_replicas,
    rank_params,
    rank_tokens,
)
from disagmoe_ds.planner.cluster import Rates
from disagmoe_ds.planner.fp8_costs import Fp8, expert_lever
from disagmoe_ds.planner.lora import LoRA
from disagmoe_ds.planner.model import ModelSpec
from disagmoe_ds.planner.part_times import expert_call_s, head_call_s
from disagmoe_ds.planner.placement import Placement
from disagmoe_ds.planner.recompute import Recompute, expert_recompute_flops_per_assignment, recompute_flops_per_token
from disagmoe_ds.planner.training_state import Precision, busiest_group_params
from disagmoe_ds.planner.workload import Workload


@dataclass(frozen=True)
class SideTimes:
    """One side's step time split: compute-bound part, NIC part, NVLink part (seconds per step)."""

    compute_s: float
    nic_s: float
    nvlink_s: float
    flops: float
    nic_bytes: float
    pcie_s: float = 0.0

    @property
    def network_s(self) -> float:
        return max(self.nic_s, self.nvlink_s, self.pcie_s)

    @property
    def stage_s(self) -> float:
        return max(self.compute_s, self.network_s)

    @property
    def bound(self) -> str:
        return "compute" if self.compute_s >= self.network_s else "network"


@dataclass(frozen=True)
class AfRoofline:
    attention: SideTimes
    ffn: SideTimes

    @property
    def bottleneck_s(self) -> float:
        """T* = max(T_a, T_f): the step time of a perfectly overlapped, bubble-free AF-Pipe."""
        return max(self.attention.stage_s, self.ffn.stage_s)


def compute_multiplier(work: Workload, side: str = "attention") -> int:
    """Forward passes' worth of matmul work per step on the "attention" or "ffn" side: fwd + 2x bwd, plus one
    more forward under full recompute or, on the F side, resend (selective recompute adds a fraction, counted
    exactly in ``af_roofline``)."""
    policy = work.ffn_rerun if side == "ffn" else work.recompute_of("attention")
    return 4 if policy == "full" else 3


@lru_cache(maxsize=4096)
def cross_node_share(layout: Layout, placement: Placement) -> tuple[float, float]:
    """(A<->F, A->A) shares of rank pairs on different nodes: lane j of A_g talks to the ep ranks of its F_g
    replica (with ``node_dedup``: to its gateway on each node of them) and to lane j of A_g+1."""
    m = layout.attention_gpus
    node = [placement.node_of(r, attention_gpus=m) for r in range(layout.world_size)]
    af_pairs = af_cross = res_cross = 0
    for g in range(layout.depth):
        nxt = (g + 1) % layout.depth
        for j, a in enumerate(layout.attention_ranks(g)):
            peers = [layout.ffn_peer_of_lane(g, j, e) for e in range(layout.exchange_peers)]  # gateways: one a node
            af_pairs += len(peers)
            af_cross += sum(node[a] != node[f] for f in peers)
            res_cross += node[a] != node[layout.attention_ranks(nxt)[j]]
    return af_cross / af_pairs, res_cross / m if layout.depth > 1 else 0.0


def node_hop_s(spec: ModelSpec, layout: Layout, work: Workload, nvlink_bw: float) -> tuple[float, float]:
    """(forward, backward) seconds one F rank spends per micro-batch and MoE layer in the node-deduplicated
    exchange's all-to-alls (``afpipe.node_fanout``; on the compute stream, so not overlapped): each routed row from
    its gateway to the node's ranks that hold its experts and their outputs back ((d - 1) / d of the rows leave the
    gateway), the gradients likewise, in the activation dtype; with resend the backward re-runs the forward's."""
    d = layout.node_dedup
    if d == 1:
        return 0.0, 0.0
    wire = spec.wire_bytes_per_token(layout.ep_size)  # per ep rank: what the plain exchange sends over the network
    f_tokens = data_lanes(layout, work) * work.tokens_per_micro_batch / layout.ffn_ranks_per_group
    share = f_tokens * (d - 1) / d / nvlink_bw
    fwd = share * (wire.m2n + wire.n2m)
    return fwd, share * (wire.n2m_grad + wire.m2n_grad) + (fwd if work.resend else 0.0)


def _group_compute_s(
    spec: ModelSpec, layout: Layout, work: Workload, rates: Rates, micro_batches: int, lane_bw: float
) -> tuple[float, float]:
    """(A rank, F rank) compute seconds per step on the busiest group (F: with resend's re-run forward; A: with its
    lane's exposed Ulysses and TP communication, ``attention_lanes.py``)."""
    a, f = _group_compute_per_micro_batch(spec, layout, _compute_work(work), work.ffn_rerun, rates, lane_bw)
    return micro_batches * a, micro_batches * f


@lru_cache(maxsize=4096)
def _compute_work(work: Workload) -> Workload:
    """Only what the A side's compute depends on (its recompute policy as ``recompute``; F's goes apart), so that
    variants share ``_group_compute_per_micro_batch``'s cache."""
    return Workload(
        work.seq_len,
        work.micro_batch_size,
        recompute=work.recompute_of("attention"),
        sequence_parallel=work.sequence_parallel,
        tensor_parallel=work.tensor_parallel,
        fp8=work.fp8,
    ).with_lora(work.lora)


@lru_cache(maxsize=65536)
def _group_compute_per_micro_batch(
    spec: ModelSpec, layout: Layout, work: Workload, f_rc: Recompute, rates: Rates, lane_bw: float
) -> tuple[float, float]:
    f_tokens = data_lanes(layout, work) * work.tokens_per_micro_batch / layout.ffn_ranks_per_group
    a_layers = _attention_layer_s(spec, work, rates, lane_bw)
    f_fp8 = expert_lever(spec, work, layout.ep_size)
    f_layers = _expert_layer_s(spec, f_tokens, f_rc, rates.side("ffn"), work.lora, f_fp8)
    a_worst = f_worst = 0.0
    for g in range(layout.depth):
        layers = layout.layers_of_group(g)
        a = sum(a_layers[i] for i in layers)
        a += _head_s(spec, rates, rank_tokens(work), work.lora) if g == layout.head_group else 0.0
        f = sum(f_layers[i] for i in layers)
        a_worst, f_worst = max(a_worst, a), max(f_worst, f)
    return a_worst, f_worst


# Per-layer seconds, fwd + bwd, cached apart from the layout: the layouts of a lane shape (and, on F, of every lane
# shape with the same tokens per F rank) share them; the groups sum them in layer order as before.
@lru_cache(maxsize=4096)
def _attention_layer_s(spec: ModelSpec, work: Workload, rates: Rates, lane_bw: float) -> tuple[float, ...]:
    return tuple(
        sum(lane_attention_call_s(spec, rates, work, layer=i, lane_bw=lane_bw)) for i in range(spec.num_layers)
    )


@lru_cache(maxsize=4096)
def _expert_layer_s(
    spec: ModelSpec, tokens: float, f_rc: Recompute, rates: Rates, lora: LoRA, fp8: Fp8 | None
) -> tuple[float, ...]:
    return tuple(
        sum(expert_call_s(spec, rates, layer=i, tokens=tokens, recompute=f_rc, lora=lora, fp8=fp8))
        for i in range(spec.num_layers)
    )


@lru_cache(maxsize=4096)
def _head_s(spec: ModelSpec, rates: Rates, tokens: float, lora: LoRA) -> float:
    return sum(head_call_s(spec, rates, tokens=tokens, lora=lora))


def side_flops(spec: ModelSpec, work: Workload) -> tuple[float, float]:
    """(A, F) FLOPs per token of one step: 3x forward (+ the head on A) plus what each side's recompute policy
    re-runs; with resend F re-runs its whole forward (once, whatever its policy)."""
    return _side_flops(spec, work.seq_len, work.recompute_of("attention"), work.ffn_rerun)


@lru_cache(maxsize=4096)
def _side_flops(spec: ModelSpec, s: int, a_policy: Recompute, f_policy: Recompute) -> tuple[float, float]:
    a_fwd = sum(spec.attention_side_flops(s, i) for i in range(spec.num_layers))
    f_fwd = sum(spec.expert_side_flops(i) for i in range(spec.num_layers))
    a_rc = _rerun_flops(spec, s, a_policy, "attention", a_fwd)
    return 3 * (a_fwd + spec.head_flops()) + a_rc, 3 * f_fwd + _rerun_flops(spec, s, f_policy, "ffn", f_fwd)


def _rerun_flops(spec: ModelSpec, s: int, policy: Recompute, side: str, forward: float) -> float:
    """Per token, the forward FLOPs ``side``'s backward re-runs under ``policy``: its whole forward, or its share of
    the selective re-run as the runtime recomputes (the experts' gate/up GEMMs on F, the rest on A)."""
    if policy == "full":
        return forward
    if policy == "none":
        return 0.0
    experts = spec.num_moe_layers * spec.top_k * expert_recompute_flops_per_assignment(spec)
    return experts if side == "ffn" else recompute_flops_per_token(spec, s, policy, whole_blocks=True) - experts


def zero_micro_batch_bytes(
    params: float, replicas: int, zero_stage: int, precision: str, *, frozen: float = 0.0
) -> float:
    """Bytes a rank sends per micro-batch for ZeRO-2 (reduce-scatter of that micro-batch's gradients) and
    ZeRO-3 (plus an all-gather of the parameters before the forward and another before the backward); a
    ring moves (r - 1)/r of the tensor out of each rank. ZeRO-0/1 reduce once per step (``af_sync_s``).
    ``params`` are trained, ``frozen`` ones (LoRA's base weights) have no gradient but are gathered too."""
    if replicas <= 1 or zero_stage < 2:
        return 0.0
    prec, share = Precision.named(precision), (replicas - 1) / replicas
    gathered = 2 * prec.param * (params + frozen) if zero_stage >= 3 else 0.0
    return share * (params * prec.grad + gathered)


def _zero_bytes(spec: ModelSpec, layout: Layout, work: Workload, placement: Placement) -> tuple[dict, dict]:
    """Per-rank ZeRO-2/3 bytes per micro-batch of each side, keyed by the link they use ("nic" or "nvlink")."""
    m = layout.attention_gpus
    a_params, f_params = busiest_group_params(spec, layout, work.lora)
    # ZeRO-3 gathers the high-precision frozen weights; an FP8 base is held whole on every rank
    a_trained, a_frozen = rank_params(a_params.trained, work), rank_params(a_params.frozen - a_params.fp8, work)
    a_zero, f_zero = work.zero_of("attention"), work.zero_of("ffn")
    a = zero_micro_batch_bytes(a_trained, param_replicas(layout, work), a_zero, work.precision, frozen=a_frozen)
    f = zero_micro_batch_bytes(
        f_params.trained, layout.expert_data_parallel, f_zero, work.precision, frozen=f_params.frozen - f_params.fp8
    )
    a_link = "nic" if placement.spans_nodes(layout.attention_ranks(0), attention_gpus=m) else "nvlink"
    f_link = "nic" if placement.spans_nodes(layout.edp_group_ranks(0, 0), attention_gpus=m) else "nvlink"
    return {a_link: a}, {f_link: f}


def af_roofline(
    spec: ModelSpec,
    layout: Layout,
    work: Workload,
    *,
    placement: Placement,
    rates: Rates,
    nics: tuple[int, int],
    micro_batches: int,
    offloaded: tuple[float, float] = (0.0, 0.0),
) -> AfRoofline:
    """T_a and T_f of one step of ``micro_batches`` micro-batches (each d lanes x B sequences).

    ``offloaded``: bytes per micro-batch that one A rank and one F rank move to host and back. An A-lane's Ulysses
    and TP communication is exposed, so it counts in the A side's compute time, not in its network terms."""
    c_a, c_f, a_nic, f_nic, a_nvl, f_nvl = _step_volumes(spec, layout, work, placement, micro_batches)
    m, n = layout.attention_gpus, layout.ffn_gpus
    lane_bw = lane_bytes_per_s(layout, work, placement=placement, rates=rates, nics=nics)
    a_compute, f_compute = _group_compute_s(spec, layout, work, rates, micro_batches, lane_bw)
    hop_s = sum(node_hop_s(spec, layout, work, rates.side("ffn").nvlink_bw))
    f_compute += (micro_batches * hop_s * _most_moe_layers(spec, layout)) if hop_s else 0.0
    a_pcie = (a_nic / m + micro_batches * offloaded[0]) / rates.pcie_bw if offloaded[0] else 0.0
    f_rates = rates.side("ffn")
    f_pcie = (f_nic / n + micro_batches * offloaded[1]) / f_rates.pcie_bw if offloaded[1] else 0.0
    attention = SideTimes(
        a_compute, _per(a_nic, nics[0] * rates.nic_bw), a_nvl / (m * rates.nvlink_bw), c_a, a_nic, a_pcie
    )
    ffn = SideTimes(
        f_compute, _per(f_nic, nics[1] * f_rates.nic_bw), f_nvl / (n * f_rates.nvlink_bw), c_f, f_nic, f_pcie
    )
    return AfRoofline(attention, ffn)


@lru_cache(maxsize=65536)  # the NIC splits of a placement share them
def _step_volumes(
    spec: ModelSpec, layout: Layout, work: Workload, placement: Placement, micro_batches: int
) -> tuple[float, float, float, float, float, float]:
    """(C_a, C_f, A NIC bytes, F NIC bytes, A NVLink bytes, F NVLink bytes) of one step: what ``af_roofline``
    divides by the rates, none of it depending on the NIC split."""
    tokens = micro_batches * data_lanes(layout, work) * work.tokens_per_micro_batch
    a_flops, f_flops = side_flops(spec, work)
    c_a, c_f = tokens * a_flops, tokens * f_flops
    wire = spec.wire_bytes_per_token(layout.exchange_peers, fp8=work.fp8)
    af_cross, res_cross = cross_node_share(layout, placement)
    moe, res_layers = spec.num_moe_layers, (spec.num_layers if layout.depth > 1 else 0)
    a_to_f = wire.a_to_f + (wire.m2n if work.resend else 0.0)
    af_dir = tokens * moe * max(a_to_f, wire.f_to_a)
    res_dir = tokens * res_layers * (wire.resid + wire.resid_grad)
    res_dir += tokens * moe * wire.m2n if work.resend and layout.depth > 1 else 0.0  # the tokens again, to A_next
    a_zero, f_zero = _zero_bytes(spec, layout, work, placement)
    m, n = layout.attention_gpus, layout.ffn_gpus
    a_nic = af_dir * af_cross + res_dir * res_cross + micro_batches * m * a_zero.get("nic", 0.0)
    f_nic = af_dir * af_cross + micro_batches * n * f_zero.get("nic", 0.0)
    a_nvl = af_dir * (1 - af_cross) + res_dir * (1 - res_cross) + micro_batches * m * a_zero.get("nvlink", 0.0)
    f_nvl = af_dir * (1 - af_cross) + micro_batches * n * f_zero.get("nvlink", 0.0)
    return c_a, c_f, a_nic, f_nic, a_nvl, f_nvl


@lru_cache(maxsize=65536)
def _most_moe_layers(spec: ModelSpec, layout: Layout) -> int:
    """The MoE layers of the group that has the most."""
    return max(sum(spec.moe_layers[i] for i in layout.layers_of_group(g)) for g in range(layout.depth))


def _per(amount: float, rate: float) -> float:
    if amount == 0:
        return 0.0
    return amount / rate if rate > 0 else float("inf")
