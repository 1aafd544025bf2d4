"""An AF-Pipe A-lane of s x t ranks: DeepSpeed-Ulysses sequence parallel over s and Megatron-style tensor parallel
(with sequence parallel) over t inside the lane (issue 28; pure Python).

An A-group of M/p ranks holds d = M/(p s t) data-parallel lanes; lane j of A_g is ranks g M/p + j s t onwards, its
TP groups t consecutive ranks. A lane's micro-batch (T = B x S tokens) is split over its ranks:

* **tokens.** Each rank holds T/(s t) tokens at the layer boundaries: the norms, the router, the shared experts,
  the exchange with F (each rank sends and receives its own tokens, so the per-rank M2N/N2M bytes are 1/(s t) of a
  plain lane's), the residual hand-off and the head (vocabulary-parallel over t, on the rank's slice).
* **FLOPs** per rank are 1/(s t) of the lane's: Ulysses' all-to-all turns the rank's T/s tokens x H/t heads into T
  tokens x H/(s t) heads for the attention core and back; the projections run on T/s tokens split over t.
* **memory.** Activations 1/(s t) (the co-located baseline's TP x CP convention); the A-side parameters 1/t (all
  of them TP-sharded, as the baseline counts them); their ZeRO shards over the d x s ranks that hold the same
  TP shard: Ulysses replicates the weights over its s ranks, whose gradients DeepSpeed reduces over its
  sequence-data-parallel group. The gradient sync and the optimizer step use the same replicas.
* **communication.** Ulysses' four all-to-alls per layer forward (q, k, v in, the attention output back), twice that
  in the backward, and the forward's again where the backward re-runs it (full recompute, or selective, which
  re-runs the attention block): each moves (s - 1)/s of the rank's T/s tokens x its bytes per token, over NVLink
  when every lane sits in one node, else at the rank's share of the A side's NICs. They are exposed: DeepSpeed
  runs them on the compute stream between the projections and the core, which depend on them. TP's all-gathers
  and reduce-scatters are the co-located baseline's (``tensor_parallel.tp_exposed_s``, over NVLink: a TP group
  must sit in one node).
* **validity.** t divides the query and (GQA) KV heads (``tensor_parallel.tp_options``); s divides a TP rank's query
  heads (MLA: its heads); GQA KV heads per TP rank g either divide by s or are replicated up to s when fewer (s a
  multiple of g: DeepSpeed's ``UlyssesSPAttentionHF`` does that; the all-to-all then carries s/g copies of K and
  V); no linear-attention layer (Ulysses wraps softmax attention) when s > 1; at least ``MIN_ROWS_PER_RANK`` tokens
  per rank, as for the co-located TP x CP.
"""

from __future__ import annotations

from functools import lru_cache

from disagmoe_ds.layout import Layout
from disagmoe_ds.planner.cluster import Rates
from disagmoe_ds.planner.fp8_costs import lever
from disagmoe_ds.planner.gemm_efficiency import MIN_ROWS_PER_RANK
from disagmoe_ds.planner.model import ACT_BYTES, ModelSpec
from disagmoe_ds.planner.part_times import attention_call_s
from disagmoe_ds.planner.placement import Placement
from disagmoe_ds.planner.tensor_parallel import kv_bytes_per_token, tp_exposed_s, tp_options
from disagmoe_ds.planner.workload import Workload

DEGREES = (1, 2, 4, 8)  # the s and t the search tries


# ----- counts -----
def data_lanes(layout: Layout, work: Workload) -> int:
    """d: data-parallel lanes of an A-group (how many micro-batch slots of B sequences it holds)."""
    return layout.lanes // work.lane_size


def param_replicas(layout: Layout, work: Workload) -> int:
    """Ranks of an A-group holding the same A-side parameter shard: the d lanes x the s Ulysses ranks of each."""
    return data_lanes(layout, work) * work.sequence_parallel


def rank_tokens(work: Workload) -> float:
    """Tokens one A rank holds of its lane's micro-batch."""
    return work.tokens_per_micro_batch / work.lane_size


def rank_params(params: float, work: Workload) -> float:
    """A-side parameters on one rank of a lane holding ``params``: TP shards them all."""
    return params / work.tensor_parallel


# ----- validity -----
def lane_refusal(spec: ModelSpec, s: int, t: int, *, tokens: int, gpus_per_node: int) -> str | None:
    """Why an A-lane of SP ``s`` x TP ``t`` cannot run this model on micro-batches of ``tokens`` (None: it can)."""
    a = spec.attention
    if t not in tp_options(spec, gpus_per_node):
        return f"TP {t} does not divide the heads or exceeds a node"
    if s > 1 and any(spec.linear_layers):
        return "Ulysses needs softmax attention in every layer (this model has linear-attention layers)"
    if s > 1 and spec.compressed is not None:  # as the runtime refuses it (capabilities.facts)
        return "Ulysses cannot split DeepSeek-V4's attention (its compressors pool windows of the whole sequence)"
    if (a.num_heads // t) % s:
        return f"SP {s} does not divide the {a.num_heads // t} query heads of a TP {t} rank"
    kv = a.num_kv_heads // t
    if a.kind == "gqa" and kv % s and s % kv:
        return f"SP {s} neither divides the {kv} KV heads of a TP {t} rank nor is a multiple of them (replication)"
    if tokens % (s * t) or tokens // (s * t) < min(tokens, MIN_ROWS_PER_RANK):
        return f"SP {s} x TP {t} leaves fewer than {MIN_ROWS_PER_RANK} tokens per rank"
    return None


def lane_options(
    spec: ModelSpec, *, tokens: int, gpus_per_node: int, sp: tuple[int, ...] = DEGREES, tp: tuple[int, ...] = DEGREES
) -> list[tuple[int, int]]:
    """The (s, t) pairs of ``sp`` x ``tp`` this model's A-lanes allow, smallest lane first."""
    valid = [
        (s, t) for s in sp for t in tp if lane_refusal(spec, s, t, tokens=tokens, gpus_per_node=gpus_per_node) is None
    ]
    return sorted(valid, key=lambda st: (st[0] * st[1], st))


# ----- Ulysses all-to-alls -----
def kv_replication(spec: ModelSpec, s: int, t: int) -> int:
    """Copies of each K/V head a TP rank's Ulysses all-to-all carries: s/g when its g KV heads are fewer than s."""
    kv = spec.attention.num_kv_heads // t if spec.attention.kind == "gqa" else spec.attention.num_heads // t
    return max(1, s // kv)


def ulysses_bytes_per_token(spec: ModelSpec, s: int, t: int) -> float:
    """Bytes per token a TP rank's Ulysses all-to-alls move for one layer's forward before the (s-1)/s share: its
    query heads, its K and V heads (replicated where fewer than s), and the attention output back."""
    a = spec.attention
    q = ACT_BYTES * a.num_heads * a.head_dim / t
    out = ACT_BYTES * a.num_heads * a.v_head_dim / t
    return q + kv_bytes_per_token(spec, t) * kv_replication(spec, s, t) + out


def ulysses_forward_bytes(spec: ModelSpec, work: Workload) -> float:
    """Bytes one rank sends in one layer's forward all-to-alls: (s-1)/s of its T/s tokens x its bytes per token."""
    s, t = work.sequence_parallel, work.tensor_parallel
    if s == 1:
        return 0.0
    return (s - 1) / s * work.tokens_per_micro_batch / s * ulysses_bytes_per_token(spec, s, t)


# ----- where a lane sits -----
@lru_cache(maxsize=65536)
def lane_spans(layout: Layout, placement: Placement, s: int, t: int) -> tuple[bool, bool]:
    """(some lane spans nodes, some TP group spans nodes) under ``placement``."""
    m, size = layout.attention_gpus, s * t
    if size == 1:
        return False, False
    lane_cross = tp_cross = False
    for g in range(layout.depth):
        ranks = layout.attention_ranks(g)
        for start in range(0, len(ranks), size):
            lane = ranks[start : start + size]
            lane_cross |= placement.spans_nodes(lane, attention_gpus=m)
            tp_cross |= any(placement.spans_nodes(lane[k : k + t], attention_gpus=m) for k in range(0, size, t))
    return lane_cross, tp_cross


def lane_bytes_per_s(
    layout: Layout, work: Workload, *, placement: Placement, rates: Rates, nics: tuple[int, int]
) -> float:
    """Bandwidth of a rank's Ulysses all-to-all: NVLink when every lane sits in one node, else its NIC share."""
    crosses, _ = lane_spans(layout, placement, work.sequence_parallel, work.tensor_parallel)
    return nics[0] / layout.attention_gpus * rates.nic_bw if crosses else rates.nvlink_bw


# ----- seconds -----
def lane_comm_s(spec: ModelSpec, work: Workload, rates: Rates, *, layer: int, lane_bw: float) -> tuple[float, float]:
    """(forward, backward) exposed seconds of one layer's Ulysses all-to-alls and TP communication on one rank."""
    s, t = work.sequence_parallel, work.tensor_parallel
    sp_fwd = ulysses_forward_bytes(spec, work) / lane_bw if s > 1 else 0.0
    rerun = work.recompute_of("attention") != "none"  # recompute re-runs the attention block's forward
    sp_bwd = (3 if rerun else 2) * sp_fwd
    tp_fwd, tp_bwd = tp_exposed_s(spec, rates, work, layer=layer, tp=t, groups=s)
    return sp_fwd + tp_fwd, sp_bwd + tp_bwd


def lane_attention_call_s(
    spec: ModelSpec, rates: Rates, work: Workload, *, layer: int, lane_bw: float
) -> tuple[float, float]:
    """(forward, backward) seconds of one rank's A part of ``layer`` for its lane's micro-batch: its 1/(s t) of the
    FLOPs (``attention_call_s`` on its tokens over the whole sequence's causal pairs) plus the lane's exposed
    communication."""
    fwd, bwd = attention_call_s(
        spec,
        rates,
        seq_len=work.seq_len,
        layer=layer,
        tokens=rank_tokens(work),
        recompute=work.recompute_of("attention"),
        whole_blocks=True,
        lora=work.lora,
        fp8=lever(work, work.tensor_parallel),
    )
    comm_fwd, comm_bwd = lane_comm_s(spec, work, rates, layer=layer, lane_bw=lane_bw)
    return fwd + comm_fwd, bwd + comm_bwd
