"""Stage times of an AF-Pipe plan (paper section 5.3) and per-task costs for both simulators (pure Python).

Roofline of one training step (paper-notes.md section 5.3, with per-side NIC pools M_a + M_f = NICs):

    T_a = max(C_a / (M * P_a), V_a / (M_a * B)),    T_f = max(C_f / (N * P_f), V_f / (M_f * B))

C are the step's FLOPs of each side (3x forward, 4x with full recompute) and P the achievable FLOP/s per
GPU; here C/(M P) is computed as the busiest group's sum of per-call times (``cluster.PartModel``: peak x
efficiency, or a measured profile with its per-call overhead). B is the achievable bandwidth per NIC and V the
bytes per direction that cross NICs: A <-> F tokens (m2n and n2m_grad one way, n2m and m2n_grad the other),
plus on the A side the residual hand-off A_g -> A_g+1 when p > 1. Traffic between two GPUs of one node goes
over NVLink instead (see ``placement.py`` for which pairs share a node).

The variants add, from first principles:

* selective recompute: the backward re-runs the forward FLOPs ``recompute.py`` lists (full: the whole forward);
* resend: the A -> F direction carries each token's m2n payload a second time, with the backward;
* ZeRO-2 / ZeRO-3 on a side: each micro-batch reduce-scatters its gradients over the side's replicas, and
  ZeRO-3 all-gathers the parameters before the forward and the backward ((r - 1)/r of the bytes leave a
  rank), over NICs when the replicas span nodes, else NVLink;
* offload: each GPU's PCIe link to its switch carries the offloaded bytes (out after the forward, back before
  the backward, one each way) on top of the GPU's NIC traffic (GPUDirect RDMA crosses the same link);
* split backward: the weight-gradient half of each GEMM's backward (the dgrad and wgrad GEMMs cost the same)
  becomes its own task (``zerobubble.py``).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import lru_cache

from disagmoe_ds.layout import Layout
from disagmoe_ds.planner.cluster import Cluster, Rates
from disagmoe_ds.planner.memory import (
    Precision,
    Workload,
    attention_lane_params,
    baseline_stage_params,
    ffn_rank_params,
)
from disagmoe_ds.planner.model import ACT_BYTES, ModelSpec
from disagmoe_ds.planner.placement import Placement
from disagmoe_ds.planner.recompute import (
    Recompute,
    a_side_recompute_flops,
    expert_recompute_flops_per_assignment,
    recompute_flops_per_token,
)


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


def compute_multiplier(work: Workload) -> int:
    """Forward passes' worth of matmul work per step: fwd + 2x bwd, plus one more forward under full recompute
    (selective recompute adds a fraction, counted exactly in ``af_roofline``)."""
    return 4 if work.recompute == "full" else 3


@lru_cache(maxsize=4096)
def cross_node_share(layout: Layout, placement: Placement) -> tuple[float, float]:
    """(A<->F, A->A) shares of rank pairs on different nodes: lane j of A_g talks to the ep ranks of its F_g
    replica and to lane j of A_g+1."""
    m = layout.attention_gpus
    node = [placement.node_of(r, attention_gpus=m) for r in range(layout.world_size)]
    af_pairs = af_cross = res_cross = 0
    for g in range(layout.depth):
        nxt = (g + 1) % layout.depth
        for j, a in enumerate(layout.attention_ranks(g)):
            peers = layout.ep_group_ranks(g, j % layout.expert_data_parallel)
            af_pairs += len(peers)
            af_cross += sum(node[a] != node[f] for f in peers)
            res_cross += node[a] != node[layout.attention_ranks(nxt)[j]]
    return af_cross / af_pairs, res_cross / m if layout.depth > 1 else 0.0


def attention_call_s(
    spec: ModelSpec, rates: Rates, *, seq_len: int, layer: int, tokens: float, recompute: Recompute
) -> tuple[float, float]:
    """(forward, backward) seconds of one A part of ``layer`` on ``tokens`` tokens; the backward includes what
    ``recompute`` re-runs (full: the forward; selective: Q/K/V projections, core and gate/up GEMMs)."""
    core = tokens * spec.attention_core_flops(seq_len, layer)
    linear = tokens * spec.attention_side_flops(seq_len, layer) - core
    fwd = rates.attention_fwd.seconds(linear, core)
    bwd = rates.attention_bwd.seconds(linear, core)
    if recompute == "full":
        return fwd, bwd + fwd
    if recompute == "selective":
        rc_linear, rc_core = a_side_recompute_flops(spec, seq_len, layer)
        return fwd, bwd + rates.attention_fwd.seconds(tokens * rc_linear, tokens * rc_core, calls=0)
    return fwd, bwd


def attention_wgrad_s(spec: ModelSpec, rates: Rates, *, seq_len: int, layer: int, tokens: float) -> float:
    """The weight-gradient GEMMs of one A part: half the backward of its projections (dgrad = wgrad FLOPs);
    the attention core has no weights, so its backward stays whole on the input-gradient side."""
    linear = tokens * (spec.attention_side_flops(seq_len, layer) - spec.attention_core_flops(seq_len, layer))
    return rates.attention_bwd.per_flop * linear / 2


def expert_call_s(
    spec: ModelSpec, rates: Rates, *, layer: int, tokens: float, recompute: Recompute
) -> tuple[float, float]:
    """(forward, backward) seconds of the routed experts of ``layer`` for ``tokens`` tokens' top_k assignments."""
    flops = tokens * spec.expert_side_flops(layer)
    if flops == 0:
        return 0.0, 0.0
    fwd = rates.experts_fwd.seconds(flops)
    bwd = rates.experts_bwd.seconds(flops)
    if recompute == "full":
        return fwd, bwd + fwd
    if recompute == "selective":
        extra = tokens * spec.top_k * expert_recompute_flops_per_assignment(spec)
        return fwd, bwd + rates.experts_fwd.seconds(extra, calls=0)
    return fwd, bwd


def expert_wgrad_s(spec: ModelSpec, rates: Rates, *, layer: int, tokens: float) -> float:
    """The weight-gradient half of the experts' backward (every expert FLOP is a GEMM)."""
    return rates.experts_bwd.per_flop * tokens * spec.expert_side_flops(layer) / 2


def head_call_s(spec: ModelSpec, rates: Rates, *, tokens: float) -> tuple[float, float]:
    """LM head GEMM (final norm and loss are elementwise), at the attention part's per-FLOP speed."""
    flops = tokens * spec.head_flops()
    return rates.attention_fwd.per_flop * flops, rates.attention_bwd.per_flop * flops


def _group_compute_s(
    spec: ModelSpec, layout: Layout, work: Workload, rates: Rates, micro_batches: int
) -> tuple[float, float]:
    """(A lane, F rank) compute seconds per step on the busiest group."""
    a, f = _group_compute_per_micro_batch(spec, layout, work.recompute, work.seq_len, work.micro_batch_size, rates)
    return micro_batches * a, micro_batches * f


@lru_cache(maxsize=65536)
def _group_compute_per_micro_batch(
    spec: ModelSpec, layout: Layout, rc: Recompute, seq_len: int, micro_batch_size: int, rates: Rates
) -> tuple[float, float]:
    tokens = seq_len * micro_batch_size
    f_tokens = layout.lanes * tokens / layout.ffn_ranks_per_group
    a_worst = f_worst = 0.0
    for g in range(layout.depth):
        layers = layout.layers_of_group(g)
        a = sum(
            sum(attention_call_s(spec, rates, seq_len=seq_len, layer=i, tokens=tokens, recompute=rc)) for i in layers
        )
        a += sum(head_call_s(spec, rates, tokens=tokens)) if g == layout.head_group else 0.0
        f = sum(sum(expert_call_s(spec, rates, layer=i, tokens=f_tokens, recompute=rc)) for i in layers)
        a_worst, f_worst = max(a_worst, a), max(f_worst, f)
    return a_worst, f_worst


def side_flops(spec: ModelSpec, work: Workload) -> tuple[float, float]:
    """(A, F) FLOPs per token of one step: 3x forward (+ the head on A) plus what the recompute policy re-runs."""
    return _side_flops(spec, work.seq_len, work.recompute)


@lru_cache(maxsize=4096)
def _side_flops(spec: ModelSpec, s: int, recompute: Recompute) -> tuple[float, float]:
    a_fwd = sum(spec.attention_side_flops(s, i) for i in range(spec.num_layers))
    f_fwd = sum(spec.expert_side_flops(i) for i in range(spec.num_layers))
    both = recompute_flops_per_token(spec, s, recompute)
    if recompute == "full":
        a_rc, f_rc = a_fwd, f_fwd
    else:
        f_rc = spec.num_moe_layers * spec.top_k * expert_recompute_flops_per_assignment(spec) if both else 0.0
        a_rc = both - f_rc
    return 3 * (a_fwd + spec.head_flops()) + a_rc, 3 * f_fwd + f_rc


def zero_micro_batch_bytes(params: float, replicas: int, zero_stage: int, precision: str) -> float:
    """Bytes a rank sends per micro-batch for ZeRO-2 (reduce-scatter of that micro-batch's gradients) and
    ZeRO-3 (plus an all-gather of the parameters before the forward and another before the backward); a
    ring moves (r - 1)/r of the tensor out of each rank. ZeRO-0/1 reduce once per step (``af_sync_s``)."""
    if replicas <= 1 or zero_stage < 2:
        return 0.0
    prec, share = Precision.named(precision), (replicas - 1) / replicas
    return share * params * (prec.grad + (2 * prec.param if zero_stage >= 3 else 0.0))


def _spans_nodes(ranks: tuple[int, ...], placement: Placement, attention_gpus: int) -> bool:
    return len({placement.node_of(r, attention_gpus=attention_gpus) for r in ranks}) > 1


def _zero_bytes(spec: ModelSpec, layout: Layout, work: Workload, placement: Placement) -> tuple[dict, dict]:
    """Per-rank ZeRO-2/3 bytes per micro-batch of each side, keyed by the link they use ("nic" or "nvlink")."""
    m = layout.attention_gpus
    a_params = max(attention_lane_params(spec, layout, g) for g in range(layout.depth))
    f_params = max(ffn_rank_params(spec, layout, g) for g in range(layout.depth))
    a = zero_micro_batch_bytes(a_params, layout.lanes, work.zero_of("attention"), work.precision)
    f = zero_micro_batch_bytes(f_params, layout.expert_data_parallel, work.zero_of("ffn"), work.precision)
    a_link = "nic" if _spans_nodes(layout.attention_ranks(0), placement, m) else "nvlink"
    f_link = "nic" if _spans_nodes(layout.edp_group_ranks(0, 0), placement, m) else "nvlink"
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

    ``offloaded``: bytes per micro-batch that one A lane and one F rank move to host and back."""
    tokens = micro_batches * layout.lanes * work.tokens_per_micro_batch
    a_flops, f_flops = side_flops(spec, work)
    c_a, c_f = tokens * a_flops, tokens * f_flops
    wire = spec.wire_bytes_per_token(layout.ep_size)
    af_cross, res_cross = cross_node_share(layout, placement)
    moe, res_layers = spec.num_moe_layers, (spec.num_layers if layout.depth > 1 else 0)
    a_to_f = wire.a_to_f + (wire.m2n if work.resend else 0.0)
    af_dir = tokens * moe * max(a_to_f, wire.f_to_a)
    res_dir = tokens * res_layers * (wire.resid + wire.resid_grad)
    a_zero, f_zero = _zero_bytes(spec, layout, work, placement)
    m, n = layout.attention_gpus, layout.ffn_gpus
    a_nic = af_dir * af_cross + res_dir * res_cross + micro_batches * m * a_zero.get("nic", 0.0)
    f_nic = af_dir * af_cross + micro_batches * n * f_zero.get("nic", 0.0)
    a_nvl = af_dir * (1 - af_cross) + res_dir * (1 - res_cross) + micro_batches * m * a_zero.get("nvlink", 0.0)
    f_nvl = af_dir * (1 - af_cross) + micro_batches * n * f_zero.get("nvlink", 0.0)
    a_compute, f_compute = _group_compute_s(spec, layout, work, rates, micro_batches)
    a_pcie = (a_nic / m + micro_batches * offloaded[0]) / rates.pcie_bw if offloaded[0] else 0.0
    f_pcie = (f_nic / n + micro_batches * offloaded[1]) / rates.pcie_bw if offloaded[1] else 0.0
    attention = SideTimes(
        a_compute, _per(a_nic, nics[0] * rates.nic_bw), a_nvl / (m * rates.nvlink_bw), c_a, a_nic, a_pcie
    )
    ffn = SideTimes(f_compute, _per(f_nic, nics[1] * rates.nic_bw), f_nvl / (n * rates.nvlink_bw), c_f, f_nic, f_pcie)
    return AfRoofline(attention, ffn)


def _per(amount: float, rate: float) -> float:
    if amount == 0:
        return 0.0
    return amount / rate if rate > 0 else float("inf")


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
    """Per-task seconds for the schedule generator: a lane's A part, an F rank's share, and each transfer.

    A transfer of one micro-batch moves d lanes' tokens through the group's NIC share (M_a/p on the A side,
    M_f/p on the F side; the slower end sets the time) or over NVLink for the intra-node share. With
    ``resend`` the backward's n2m_grad message also carries the layer's m2n payload again.
    """
    p, d, tokens = layout.depth, layout.lanes, work.tokens_per_micro_batch
    rc = work.recompute
    af_cross, res_cross = cross_node_share(layout, placement)
    af_link = _link(
        min(nics) / p * rates.nic_bw, rates.nvlink_bw * min(layout.lanes, layout.ffn_ranks_per_group), af_cross
    )
    res_link = _link(nics[0] / p * rates.nic_bw, rates.nvlink_bw * d, res_cross)
    wire = spec.wire_bytes_per_token(layout.ep_size)
    group_tokens, f_tokens = d * tokens, d * tokens / layout.ffn_ranks_per_group
    per_layer: dict[str, list[float]] = {k: [] for k in ("A_fwd", "A_bwd", "F_fwd", "F_bwd")}
    wgrad: dict[str, list[float]] = {"A": [], "F": []}
    for i in range(spec.num_layers):
        a_fwd, a_bwd = attention_call_s(spec, rates, seq_len=work.seq_len, layer=i, tokens=tokens, recompute=rc)
        f_fwd, f_bwd = expert_call_s(spec, rates, layer=i, tokens=f_tokens, recompute=rc)
        a_w = attention_wgrad_s(spec, rates, seq_len=work.seq_len, layer=i, tokens=tokens)
        f_w = expert_wgrad_s(spec, rates, layer=i, tokens=f_tokens)
        if not work.split_backward:
            a_w = f_w = 0.0
        per_layer["A_fwd"].append(a_fwd)
        per_layer["A_bwd"].append(a_bwd - a_w)
        per_layer["F_fwd"].append(f_fwd)
        per_layer["F_bwd"].append(f_bwd - f_w)
        wgrad["A"].append(a_w)
        wgrad["F"].append(f_w)
    costs = {k: tuple(v) for k, v in per_layer.items()}
    for kind in ("m2n", "n2m", "m2n_grad", "n2m_grad"):
        payload = getattr(wire, kind) + (wire.m2n if kind == "n2m_grad" and work.resend else 0.0)
        costs[kind] = (group_tokens * payload / af_link,) * spec.num_layers
    for kind in ("resid", "resid_grad"):
        costs[kind] = (group_tokens * getattr(wire, kind) / res_link if p > 1 else 0.0,) * spec.num_layers
    head_fwd, head_bwd = head_call_s(spec, rates, tokens=tokens)
    head_w = head_bwd / 2 if work.split_backward else 0.0
    wgrads = {k: tuple(v) for k, v in wgrad.items()} if work.split_backward else {}
    return AfTaskCosts(costs, head_fwd=head_fwd, head_bwd=head_bwd - head_w, wgrad=wgrads, head_wgrad=head_w)


def _link(nic_rate: float, nvlink_rate: float, cross: float) -> float:
    """Effective bytes/s of a transfer whose ``cross`` share goes over NICs, the rest over NVLink, in parallel."""
    if cross == 0:
        return nvlink_rate
    if cross == 1:
        return nic_rate
    return min(nic_rate / cross, nvlink_rate / (1 - cross))


# ----- co-located EP + DP baseline -----
@dataclass(frozen=True)
class BaselineChunkCosts:
    """Seconds per (chunk, micro-batch) on one co-located rank: compute and exposed all-to-all, fwd and bwd."""

    fwd_compute: tuple[float, ...]
    bwd_compute: tuple[float, ...]
    fwd_comm: tuple[float, ...]
    bwd_comm: tuple[float, ...]
    a2a_per_layer_s: float  # one dispatch or combine of one MoE layer, before overlap
    p2p_s: float


def alltoall_s(spec: ModelSpec, work: Workload, *, ep: int, cluster: Cluster, rates: Rates) -> float:
    """One dispatch (or combine) of one micro-batch on one rank, Megatron's all-to-all token dispatcher.

    Each of the B*s tokens is sent top_k times (no de-duplication), (ep-1)/ep of the copies leave the GPU
    (paper-notes.md section 4: V = (EP-1)/EP * N * k); an EP group fills whole nodes, so the share
    (ep - g)/ep of copies goes through the node's NICs (g GPUs per node), the rest over NVLink.
    """
    if ep == 1:
        return 0.0
    copies = work.tokens_per_micro_batch * spec.top_k
    per_copy = ACT_BYTES * spec.hidden_size + 4  # hidden state + its routing probability
    g = cluster.gpus_per_node
    off_node = max(ep - g, 0) / ep
    on_node = (min(ep, g) - 1) / ep
    nic_per_gpu = cluster.nics_per_node * rates.nic_bw / g
    return max(copies * off_node * per_copy / nic_per_gpu, copies * on_node * per_copy / rates.nvlink_bw)


def baseline_chunk_costs(
    spec: ModelSpec,
    work: Workload,
    *,
    pp: int,
    vpp: int,
    ep: int,
    cluster: Cluster,
    rates: Rates,
    overlap: float,
) -> BaselineChunkCosts:
    """Per-chunk costs of co-located EP+DP: attention and experts on every rank, all-to-all on the critical path.

    Per MoE layer and direction there is a dispatch and a combine (two more of each under full recompute).
    Partial overlap (Megatron's shared-expert overlap and EP-communication overlap): the hidden part of the
    all-to-all is min(a2a, overlap * a2a + shared-expert compute); the rest is exposed.
    """
    a2a = alltoall_s(spec, work, ep=ep, cluster=cluster, rates=rates)
    tokens, per_chunk = work.tokens_per_micro_batch, spec.num_layers // (pp * vpp)
    rc = work.recompute
    shared = rates.attention_fwd.per_flop * tokens * spec.shared_flops()
    exposed = max(0.0, 2 * a2a - min(2 * a2a, overlap * 2 * a2a + shared))
    fwd_c, bwd_c, fwd_x, bwd_x = [], [], [], []
    for start in range(0, spec.num_layers, per_chunk):
        fwd = bwd = 0.0
        for i in range(start, start + per_chunk):
            calls = (
                attention_call_s(spec, rates, seq_len=work.seq_len, layer=i, tokens=tokens, recompute=rc),
                expert_call_s(spec, rates, layer=i, tokens=tokens, recompute=rc),
            )
            fwd += sum(c[0] for c in calls)
            bwd += sum(c[1] for c in calls)
        if start + per_chunk == spec.num_layers:
            head = head_call_s(spec, rates, tokens=tokens)
            fwd, bwd = fwd + head[0], bwd + head[1]
        moe = sum(spec.moe_layers[start : start + per_chunk])
        fwd_c.append(fwd)
        bwd_c.append(bwd)
        fwd_x.append(moe * exposed)
        bwd_x.append(moe * exposed * (2 if rc == "full" else 1))  # full recompute re-runs the forward all-to-alls
    p2p_s = _stage_p2p_s(spec, work, pp=pp, cluster=cluster, rates=rates)
    return BaselineChunkCosts(tuple(fwd_c), tuple(bwd_c), tuple(fwd_x), tuple(bwd_x), a2a, p2p_s)


def _stage_p2p_s(spec: ModelSpec, work: Workload, *, pp: int, cluster: Cluster, rates: Rates) -> float:
    """Activation (or gradient) hand-off between pipeline stages: through NICs when a stage fills whole nodes."""
    if pp == 1:
        return 0.0
    nbytes = work.tokens_per_micro_batch * ACT_BYTES * spec.hidden_size
    if cluster.world_size // pp >= cluster.gpus_per_node:
        return nbytes / (cluster.nics_per_node * rates.nic_bw / cluster.gpus_per_node)
    return nbytes / rates.nvlink_bw


# ----- data-parallel gradient synchronisation (both systems) -----
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
    """(A lane, F rank) gradient-sync seconds per step: over the d lanes of an A-group and over the expert-DP
    replicas of an F-group, through the side's NIC share when the replicas span nodes, else NVLink."""
    m = layout.attention_gpus

    def rate(ranks: tuple[int, ...], nic_share: float) -> float:
        return nic_share * rates.nic_bw if _spans_nodes(ranks, placement, m) else rates.nvlink_bw

    a_params = max(attention_lane_params(spec, layout, g) for g in range(layout.depth))
    f_params = max(ffn_rank_params(spec, layout, g) for g in range(layout.depth))
    a = step_sync_s(
        a_params,
        layout.lanes,
        work.zero_of("attention"),
        precision=work.precision,
        bytes_per_s=rate(layout.attention_ranks(0), nics[0] / m),
    )
    f = step_sync_s(
        f_params,
        layout.expert_data_parallel,
        work.zero_of("ffn"),
        precision=work.precision,
        bytes_per_s=rate(layout.edp_group_ranks(0, 0), nics[1] / layout.ffn_gpus),
    )
    return a, f


def baseline_sync_s(
    spec: ModelSpec, work: Workload, *, pp: int, vpp: int, ep: int, cluster: Cluster, rates: Rates, tp: int = 1
) -> float:
    """Co-located gradient sync per step on the worst stage: dense parameters (split over tp) over the stage's
    W/(pp tp) data- and context-parallel ranks, expert shards over their (W/pp)/ep replicas (strided by tp and
    ep, so they share a node only while the stride stays inside it)."""
    grad = Precision.named(work.precision).grad
    dp, g = cluster.world_size // (pp * tp), cluster.gpus_per_node
    nic = cluster.nics_per_node * rates.nic_bw / g
    worst = 0.0
    for stage in range(pp):
        _, dense, experts = baseline_stage_params(spec, pp=pp, vpp=vpp, ep=ep, stage=stage)
        dense_rate = nic if dp * tp > g else rates.nvlink_bw
        dense_s = ring_sync_s(dense / tp, dp, grad_bytes=grad, bytes_per_s=dense_rate)
        edp = cluster.world_size // (pp * ep)
        expert_rate = nic if edp > max(1, g // ep) else rates.nvlink_bw
        worst = max(worst, dense_s + ring_sync_s(experts, edp, grad_bytes=grad, bytes_per_s=expert_rate))
    return worst
