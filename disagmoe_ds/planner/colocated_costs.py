"""Per-chunk costs of one rank of a co-located configuration (``Shape``): compute, the Megatron all-to-all
dispatch and combine, the exposed TP and CP communication and the stage-to-stage hand-off (pure Python).

``colocated.py`` describes the model these implement (TP+SP, CP ring attention, EP folding, a2a overlap) and
searches and simulates the shapes.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from disagmoe_ds.planner.attention_lanes import ulysses_forward_bytes
from disagmoe_ds.planner.cluster import Cluster, Rates
from disagmoe_ds.planner.fp8_costs import expert_lever, lever, shared_rerun_share
from disagmoe_ds.planner.model import ACT_BYTES, FP8_ROW_SCALE_BYTES, ModelSpec
from disagmoe_ds.planner.part_times import attention_call_s, expert_call_s, head_call_s, priced_core_flops
from disagmoe_ds.planner.pipeline_split import chunk_layers
from disagmoe_ds.planner.simulate import BaselineChunkCosts
from disagmoe_ds.planner.tensor_parallel import kv_bytes_per_token, tp_exposed_s, tp_options
from disagmoe_ds.planner.workload import Workload

__all__ = ["tp_options"]  # re-exported: the co-located search and --baseline-layout import it from here

DISPATCHERS = ("alltoall", "deepep")


@dataclass(frozen=True)
class Shape:
    """A co-located configuration: pipeline (pp x vpp), tensor, context and expert parallel, a2a overlap, and the
    token dispatcher (Megatron's all-to-all, or DeepEP/HybridEP's node-deduplicating one)."""

    pp: int
    vpp: int
    tp: int
    cp: int
    ep: int
    overlap: str
    dispatcher: str = "alltoall"
    fp32_grads: bool = True  # Megatron's fp32 main grads; False: 2 B gradients (DeepSpeed, FSDP2's 16 B/param total)
    ulysses: bool = False  # the cp ranks split the sequence as DeepSpeed-Ulysses (all-to-alls exposed), not ring CP

    @property
    def context(self) -> str:
        """The sequence split, "CP n" (ring) or "Ulysses n"."""
        return f"Ulysses {self.cp}" if self.ulysses else f"CP {self.cp}"

    def describe(self) -> str:
        return (
            f"TP {self.tp} {self.context} EP {self.ep} PP {self.pp} x v {self.vpp}, a2a overlap {self.overlap}, "
            f"{self.dispatcher} dispatcher"
        )


@dataclass(frozen=True)
class ColocatedCosts(BaselineChunkCosts):
    """Per-chunk costs with the raw all-to-all (for paired overlap) and the exposed TP/CP communication."""

    fwd_a2a: tuple[float, ...] = ()
    bwd_a2a: tuple[float, ...] = ()
    fwd_other: tuple[float, ...] = ()
    bwd_other: tuple[float, ...] = ()


def alltoall_s(
    spec: ModelSpec,
    work: Workload,
    *,
    ep: int,
    cluster: Cluster,
    rates: Rates,
    dispatcher: str = "alltoall",
    fp8: bool = False,
) -> float:
    """One dispatch (or combine) of one micro-batch on one rank; the EP group fills whole nodes. ``fp8``: a dispatch
    of the FP8 exchange, each copy's hidden state in e4m3 with a float32 scale (the combine stays bf16).

    ``alltoall`` (Megatron's all-to-all token dispatcher): each of the B*s tokens is sent top_k times, no
    de-duplication; (ep-1)/ep of the copies leave the GPU (V = (ep-1)/ep * B*s * top_k copies), the
    share (ep - g)/ep of them through the node's NICs (g GPUs per node), the rest over NVLink.

    ``deepep`` (DeepEP / HybridEP internode kernels): a token crosses the network once per destination node, to the
    GPU of its own local index there, which forwards it over NVLink once per destination GPU. Under uniform
    routing a token reaches (n-1)/n of the expected distinct nodes remotely (n nodes in the group; Qwen3-235B-A22B
    at EP 32: 2.7 copies against the plain dispatcher's 6.0), and its distinct ranks over NVLink.

    The busiest rank receives ``rates.routing_imbalance`` times the mean; NIC and NVLink legs pipeline (max).
    """
    if ep == 1:
        return 0.0
    hidden = spec.hidden_size + FP8_ROW_SCALE_BYTES if fp8 else ACT_BYTES * spec.hidden_size
    per_copy = hidden + 4  # hidden state + its routing probability
    g = cluster.gpus_per_node
    tokens = work.tokens_per_micro_batch * rates.routing_imbalance
    if dispatcher == "deepep":
        nodes = -(-ep // g)
        nic_copies = spec.distinct_ranks_per_token(nodes) * (nodes - 1) / nodes if nodes > 1 else 0.0
        nvlink_copies = spec.distinct_ranks_per_token(ep) * (min(ep, g) - 1) / min(ep, g)
    else:
        nic_copies = spec.top_k * max(ep - g, 0) / ep
        nvlink_copies = spec.top_k * (min(ep, g) - 1) / ep
    nic_s = tokens * nic_copies * per_copy / rates.nic_bw_per_gpu(cluster)
    return max(nic_s, tokens * nvlink_copies * per_copy / rates.nvlink_bw)


def tp_cp_exposed_s(
    spec: ModelSpec, work: Workload, shape: Shape, *, layer: int, cluster: Cluster, rates: Rates
) -> tuple[float, float]:
    """(forward, backward) seconds of TP and CP communication of one layer not hidden behind its compute."""
    t, c = shape.tp, shape.cp
    tokens = work.tokens_per_micro_batch / (t * c)
    core_flops = tokens * priced_core_flops(spec, rates, work.seq_len, layer)
    core = rates.attention_fwd.seconds(0.0, core_flops, calls=0)
    tp_fwd, tp_bwd = tp_exposed_s(spec, rates, work, layer=layer, tp=t, groups=c)
    cp_rate = rates.nvlink_bw if t * c <= cluster.gpus_per_node else rates.nic_bw_per_gpu(cluster)
    if shape.ulysses:  # four all-to-alls a layer forward, eight backward, none of them hidden
        sp_s = ulysses_forward_bytes(spec, replace(work, sequence_parallel=c, tensor_parallel=t)) / cp_rate
        return tp_fwd + sp_s, tp_bwd + 2 * sp_s
    cp_bytes = (c - 1) / c * work.tokens_per_micro_batch * kv_bytes_per_token(spec, t)
    cp_s = cp_bytes / cp_rate if c > 1 else 0.0
    fwd = tp_fwd + max(0.0, cp_s - core)
    bwd = tp_bwd + max(0.0, 2 * cp_s - 2 * core)
    return fwd, bwd


def colocated_costs(
    spec: ModelSpec, work: Workload, shape: Shape, *, cluster: Cluster, rates: Rates, overlap: float
) -> ColocatedCosts:
    """Per-chunk compute, exposed communication (alone) and raw all-to-all (paired) of one rank; ``a2a_per_layer_s``
    is the mean of a dispatch and a combine (equal in bf16; with FP8 the dispatch is the smaller)."""
    t, c = shape.tp, shape.cp
    tokens = work.tokens_per_micro_batch / (t * c)
    dispatch, combine = (
        alltoall_s(spec, work, ep=shape.ep, cluster=cluster, rates=rates, dispatcher=shape.dispatcher, fp8=fp8)
        / (t * c)
        for fp8 in (work.fp8, False)
    )
    both = dispatch + combine
    shared = rates.attention_fwd.per_flop * tokens * spec.shared_flops() * shared_rerun_share(spec, lever(work, t))
    alone = max(0.0, both - min(both, overlap * both + shared))
    lora, a_fp8, f_fp8 = work.lora, lever(work, t), expert_lever(spec, work, shape.ep)
    chunks = chunk_layers(spec.num_layers, shape.pp, shape.vpp)
    assert chunks is not None, f"{spec.num_layers} layers do not split over {shape.describe()}"
    rows: dict[str, list[float]] = {k: [] for k in ("fc", "bc", "fx", "bx", "fa", "ba", "fo", "bo")}
    for index, layers in enumerate(chunks):
        fc = bc = fo = bo = 0.0
        for i in layers:
            for fwd, bwd in (
                attention_call_s(
                    spec,
                    rates,
                    seq_len=work.seq_len,
                    layer=i,
                    tokens=tokens,
                    recompute=work.recompute,
                    lora=lora,
                    fp8=a_fp8,
                ),
                expert_call_s(spec, rates, layer=i, tokens=tokens, recompute=work.recompute, lora=lora, fp8=f_fp8),
            ):
                fc, bc = fc + fwd, bc + bwd
            other = tp_cp_exposed_s(spec, work, shape, layer=i, cluster=cluster, rates=rates)
            fo, bo = fo + other[0], bo + other[1]
        if index == len(chunks) - 1:
            head = head_call_s(spec, rates, tokens=tokens, lora=lora)
            fc, bc = fc + head[0], bc + head[1]
        moe = sum(spec.moe_layers[i] for i in layers)
        if shape.ep > 1:  # each MoE layer's dispatch and combine all-to-all calls, forward and backward
            fc, bc = fc + 2 * moe * rates.message_host_s, bc + 2 * moe * rates.message_host_s
        redo = 2 if work.recompute == "full" else 1  # full recompute re-runs the forward all-to-alls
        for key, value in zip(
            rows, (fc, bc, moe * alone + fo, redo * moe * alone + bo, moe * both, redo * moe * both, fo, bo)
        ):
            rows[key].append(value)
    p2p = _stage_p2p_s(spec, work, shape, cluster=cluster, rates=rates)
    r = {k: tuple(v) for k, v in rows.items()}
    return ColocatedCosts(r["fc"], r["bc"], r["fx"], r["bx"], both / 2, p2p, r["fa"], r["ba"], r["fo"], r["bo"])


def _stage_p2p_s(spec: ModelSpec, work: Workload, shape: Shape, *, cluster: Cluster, rates: Rates) -> float:
    """Stage-to-stage hand-off of a rank's B*s*H/(t c) slice: through NICs when a stage fills whole nodes."""
    if shape.pp == 1:
        return 0.0
    nbytes = work.tokens_per_micro_batch / (shape.tp * shape.cp) * ACT_BYTES * spec.hidden_size
    if cluster.world_size // shape.pp >= cluster.gpus_per_node:
        return nbytes / rates.nic_bw_per_gpu(cluster)
    return nbytes / rates.nvlink_bw
