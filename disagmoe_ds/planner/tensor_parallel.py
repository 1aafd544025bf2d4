"""Tensor parallel (Megatron-style, with sequence parallel) inside a node: which sizes a model allows, the K/V bytes a
TP rank holds and the communication a TP block does not hide (pure Python). One model for both systems: the
co-located baseline's TP (``colocated_costs.py``) and an AF-Pipe A-lane's (``attention_lanes.py``).

Per TP block (attention; the shared or dense MLP) the forward does an all-gather and a reduce-scatter of the
block's input and output, the backward three; each moves (t - 1)/t of the TP group's tokens x hidden bf16 bytes
over NVLink and hides behind the block's GEMMs where they last longer (Megatron's tp-comm-overlap).
"""

from __future__ import annotations

from disagmoe_ds.planner.cluster import Rates
from disagmoe_ds.planner.fp8_costs import projection_saved_flops
from disagmoe_ds.planner.model import ACT_BYTES, ModelSpec
from disagmoe_ds.planner.workload import Workload


def tp_options(spec: ModelSpec, gpus_per_node: int) -> list[int]:
    """TP sizes inside a node that divide the query heads and (GQA) the KV heads, as Megatron requires."""
    a = spec.attention
    heads = (a.num_heads, a.num_kv_heads) if a.kind == "gqa" else (a.num_heads,)
    return [t for t in (1, 2, 4, 8) if t <= gpus_per_node and all(h % t == 0 for h in heads)]


def kv_bytes_per_token(spec: ModelSpec, tp: int) -> float:
    """K and V of one token on one TP rank, the tensors ring attention passes around (bf16)."""
    a = spec.attention
    if a.kind == "gqa":
        return 2 * ACT_BYTES * a.num_kv_heads * a.head_dim / tp
    return ACT_BYTES * a.num_heads * (a.head_dim + a.v_head_dim) / tp


def tp_exposed_s(
    spec: ModelSpec, rates: Rates, work: Workload, *, layer: int, tp: int, groups: int
) -> tuple[float, float]:
    """(forward, backward) seconds of one layer's TP all-gathers and reduce-scatters not hidden behind its GEMMs.

    ``groups``: the TP groups a micro-batch is split over (an A-lane's s Ulysses ranks, the baseline's CP ranks).
    Each holds 1/groups of the tokens (their hidden states are gathered and scattered), a rank 1/(groups tp) of
    them, whose projection GEMMs the communication hides behind."""
    seq_len, group_tokens = work.seq_len, work.tokens_per_micro_batch / groups
    tokens = work.tokens_per_micro_batch / (groups * tp)
    core_flops = tokens * spec.attention_core_flops(seq_len, layer)
    linear_flops = tokens * spec.attention_side_flops(seq_len, layer) - core_flops
    if work.fp8:  # FP8 projections are shorter and hide less
        linear_flops -= tokens * projection_saved_flops(spec, layer, work.fp8_bf16_width)
    linear = rates.attention_fwd.seconds(linear_flops, calls=0)
    blocks = 1 + (1 if spec.shared_intermediate or not spec.moe_layers[layer] else 0)
    tp_bytes = blocks * 2 * (tp - 1) / tp * group_tokens * ACT_BYTES * spec.hidden_size
    tp_s = tp_bytes / rates.nvlink_bw
    return max(0.0, tp_s - linear), max(0.0, 1.5 * tp_s - 2 * linear)
