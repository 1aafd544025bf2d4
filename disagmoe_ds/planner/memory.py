"""Per-rank peak memory of a disaggregated layout and of the co-located baseline (pure Python): the training
state (``training_state.py``) plus the activations of the micro-batches in flight.

Activations are kept per in-flight micro-batch for every layer a rank owns (``ModelSpec`` per-token
bytes); with full recompute only the layer inputs stay, plus one layer's full set while it is recomputed.

Each side has its own recompute policy (``Workload.recompute_of``). Selective recompute drops the tensors
``recompute.py`` lists. Resend keeps nothing on the F side (its backward
gets the tokens again and re-runs the expert forward). Offload keeps a share of a micro-batch's
activations in host memory between its forward and backward, holding two layers' worth on the GPU as the
copy window. ZeRO-3 holds two gathered layers (current and prefetch).

LoRA (``lora.py``) adds the adapters' r-wide intermediates per token (A side) and per (token, expert) assignment
(F side).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from functools import lru_cache

from disagmoe_ds.layout import Layout
from disagmoe_ds.planner.attention_lanes import data_lanes, rank_params, rank_tokens
from disagmoe_ds.planner.colocated_costs import Shape
from disagmoe_ds.planner.fp8_costs import CAST_COPIES, cast_expert_weights, experts_in_fp8, keeps_expert_copies
from disagmoe_ds.planner.lora import (
    FULL,
    LoRA,
    Params,
    a_side_adapter_bytes,
    a_side_split,
    expert_adapter_bytes,
    expert_split,
)
from disagmoe_ds.planner.model import ACT_BYTES, FP8_ROW_SCALE_BYTES, ModelSpec
from disagmoe_ds.planner.pipeline_split import chunk_layers
from disagmoe_ds.planner.rank_state import rank_state_bytes
from disagmoe_ds.planner.recompute import Recompute, a_side_saved_bytes, expert_saved_bytes_per_assignment
from disagmoe_ds.planner.training_state import (
    Precision,
    attention_state_bytes,
    baseline_stage_params,
    baseline_state_bytes,
    ffn_rank_params,
    ffn_state_bytes,
)
from disagmoe_ds.planner.workload import Workload

__all__ = ["rank_state_bytes"]  # its old place: the runtime's banner (train.progress) imports it from here
LOGIT_BYTES = 6  # per logit on the head rank: bf16 logits + their fp32 upcast inside the loss


@dataclass(frozen=True)
class RankMemory:
    """Peak bytes on one rank: static training state plus activations of ``in_flight`` micro-batches."""

    state: float
    activations_per_micro_batch: float
    working: float  # one layer rematerialised (full recompute) and the head's logits
    in_flight: int
    offloaded_per_micro_batch: float = 0.0  # bytes of each micro-batch held in host memory instead

    @property
    def total(self) -> float:
        return self.total_at(self.in_flight)

    def total_at(self, in_flight: int) -> float:
        return self.state + self.working + in_flight * self.activations_per_micro_batch

    def max_in_flight(self, usable: float) -> int:
        """Most micro-batches that fit in ``usable`` bytes (0 if even the state does not fit)."""
        free = usable - self.state - self.working
        if free < 0:
            return 0
        return int(free // self.activations_per_micro_batch) if self.activations_per_micro_batch else 10**6


def attention_rank_memory(spec: ModelSpec, layout: Layout, work: Workload, in_flight: int = 1) -> RankMemory:
    """Worst A-group rank: its v layers' A parts (+ embedding, + head on the head group). In a lane of s x t ranks
    (``attention_lanes.py``) it holds 1/t of the parameters, ZeRO-sharded over the d x s ranks holding the same
    shard, and 1/(s t) of the lane's activations and logits."""
    zero, lora, recompute = work.zero_of("attention"), work.lora, work.recompute_of("attention")
    worst: RankMemory | None = None
    for g in range(layout.depth):
        layers = layout.layers_of_group(g)
        tokens = rank_tokens(work)
        per_full, per_saved, biggest = _a_side_per_token(spec, tuple(layers), lora)
        full = [b * tokens for b in per_full]
        saved = [b * tokens for b in per_saved]
        act = _kept(full, saved, spec.layer_input_bytes() * tokens, recompute)
        act += _resent(spec, layout, work, layers)
        logits = tokens * spec.vocab_size * LOGIT_BYTES if g == layout.head_group else 0
        share = work.offload[0]
        working = _working(full, saved, recompute) + logits + _offload_window(act, len(layers), share)
        working += _gathered(rank_params(biggest, work), zero, work.precision)
        state = attention_state_bytes(spec, layout, work, g)
        mem = RankMemory(state, act * (1 - share), working, in_flight, act * share)
        worst = mem if worst is None or mem.total > worst.total else worst
    assert worst is not None
    return worst


@lru_cache(maxsize=65536)
def _a_side_per_token(
    spec: ModelSpec, layers: tuple[int, ...], lora: LoRA = FULL
) -> tuple[tuple[float, ...], tuple[float, ...], float]:
    """Per token of each of ``layers``: the A-side activation bytes (with the adapters' intermediates, which
    selective recompute is taken to keep) and what selective recompute drops, and the largest layer's A-side
    parameters, adapters included (cached: the allocator asks for the same groups for every split)."""
    full = tuple(float(spec.a_side_activation_bytes(i) + a_side_adapter_bytes(spec, i, lora)) for i in layers)
    saved = tuple(float(a_side_saved_bytes(spec, i)) for i in layers)
    return full, saved, max(a_side_split(spec, i, lora).total for i in layers)


def _resent(spec: ModelSpec, layout: Layout, work: Workload, layers: tuple[int, ...]) -> float:
    """Bytes a lane keeps per micro-batch for resend at p > 1: the m2n messages of each MoE layer before one of its
    layers, which it sends again with that layer's n2m_grad."""
    if not (work.resend and layout.depth > 1):
        return 0.0
    per_token = spec.wire_bytes_per_token(layout.exchange_peers).m2n
    return sum(per_token * rank_tokens(work) for i in layers if i > 0 and spec.moe_layers[i - 1])


def ffn_rank_memory(spec: ModelSpec, layout: Layout, work: Workload, in_flight: int = 1) -> RankMemory:
    """Worst F-group rank: E/ep experts of its v MoE layers, ZeRO over the expert-DP replicas.

    A micro-batch brings d * B * S tokens to the F-group (d data-parallel lanes); a replica sees 1/edp of them,
    and each of its ep ranks receives a token once per chosen local expert set and keeps top_k/ep assignments per
    token.
    With ``resend`` the F side keeps nothing in flight, whatever the recompute policy: the forward runs without
    autograd and the backward gets the tokens again and re-runs the forward, so one layer's full set (tokens,
    gathered copies and every expert tensor) is working memory.
    """
    zero, lora, recompute = work.zero_of("ffn"), work.lora, work.recompute_of("ffn")
    tokens_per_replica = data_lanes(layout, work) * work.tokens_per_micro_batch / layout.expert_data_parallel
    assignments = tokens_per_replica * spec.top_k / layout.ep_size
    received = tokens_per_replica * spec.distinct_ranks_per_token(layout.ep_size) / layout.ep_size
    fp8_saving = _fp8_rows_saving(spec, work, received / assignments)
    per_assignment = spec.f_side_activation_bytes_per_assignment() + expert_adapter_bytes(spec, lora) - fp8_saving
    if layout.node_dedup > 1:  # a gateway keeps its lanes' rows of the node besides the rows it computes
        received += tokens_per_replica * spec.distinct_ranks_per_token(layout.exchange_peers) / layout.ep_size
    worst: RankMemory | None = None
    for g in range(layout.depth):
        moe = [i for i in layout.layers_of_group(g) if spec.moe_layers[i]]
        layer_full = assignments * per_assignment + received * ACT_BYTES * spec.hidden_size
        full = [layer_full] * len(moe)
        saved = [assignments * expert_saved_bytes_per_assignment(spec)] * len(moe)
        if work.resend:  # nothing kept; the backward rematerialises one layer at a time, tokens included
            act, working = 0.0, max(full, default=0.0)
        else:
            act = _kept(full, saved, received * ACT_BYTES * spec.hidden_size, recompute)
            working = _working(full, saved, recompute)
        share = work.offload[1]
        working += _offload_window(act, len(moe), share)
        working += _gathered(layout.experts_per_rank * expert_split(spec, lora).total, zero, work.precision)
        state = ffn_state_bytes(spec, layout, work, g) + _fp8_copies(spec, ffn_rank_params(spec, layout, g, lora), work)
        mem = RankMemory(state, act * (1 - share), working, in_flight, act * share)
        worst = mem if worst is None or mem.total > worst.total else worst
    assert worst is not None
    return worst


def baseline_rank_memory(
    spec: ModelSpec, work: Workload, shape: Shape, *, world_size: int, chunks_alive: int
) -> RankMemory:
    """Worst stage of co-located EP+DP with pp stages of vpp chunks: every rank holds attention + E/ep experts.

    ``chunks_alive`` is the peak number of (chunk, micro-batch) activations on the first stage (Megatron's
    interleaved warm-up + 1); ``in_flight`` of the result counts chunks, not micro-batches.

    Tensor parallel ``tp`` (with sequence parallel) and context parallel ``cp`` follow Megatron's MoE parallel
    folding: the dense parameters (attention, shared experts, dense MLPs, vocabulary) are split over tp and
    their optimizer state over the W/(pp tp) data- and context-parallel ranks (the distributed optimizer); the
    experts are split over ep (expert tensor parallel 1) with their state over the W/(pp ep) expert-DP ranks.
    Every activation, expert assignments included, is split over tp x cp (sequence parallel shards the
    tokens), and the vocabulary-parallel logits over tp x cp as well.
    """
    # The a2a overlap and the dispatcher move no byte: shapes that differ only in them share one cache entry.
    return _baseline_rank_memory(spec, work, replace(shape, overlap="", dispatcher=""), world_size, chunks_alive)


@lru_cache(maxsize=65536)  # the same shapes come back for every bandwidth of a sweep and every dispatcher
def _baseline_rank_memory(
    spec: ModelSpec, work: Workload, shape: Shape, world_size: int, chunks_alive: int
) -> RankMemory:
    pp, vpp, ep, tp, cp = shape.pp, shape.vpp, shape.ep, shape.tp, shape.cp
    precision = Precision.megatron(work.precision) if shape.fp32_grads else Precision.named(work.precision)
    lora = work.lora
    tokens = work.tokens_per_micro_batch / (tp * cp)
    chunks = chunk_layers(spec.num_layers, pp, vpp)
    assert chunks is not None, f"{spec.num_layers} layers do not split over PP {pp} x VPP {vpp}"
    # FP8 experts keep their input rows for dW in e4m3, one per assignment (the grouped GEMM's permuted input)
    fp8_rows = spec.top_k * _fp8_rows_saving(spec, work, rows_per_assignment=1.0)

    def kept(i: int) -> float:  # per token of layer i
        return _colocated_bytes(spec, i, lora) - (fp8_rows if spec.moe_layers[i] else 0.0)

    worst: RankMemory | None = None
    for stage in range(pp):
        layers, dense, experts = baseline_stage_params(spec, pp=pp, vpp=vpp, ep=ep, stage=stage, lora=lora)
        full = [tokens * kept(i) for i in layers]
        saved = [tokens * _colocated_saved_bytes(spec, i) for i in layers]
        mine = [c for k, c in enumerate(chunks) if k % pp == stage]  # the largest chunk bounds the activations
        if work.recompute == "full":
            act = tokens * spec.layer_input_bytes() * max(len(c) for c in mine)
        elif work.recompute == "selective":
            act = max(tokens * sum(kept(i) - _colocated_saved_bytes(spec, i) for i in c) for c in mine)
        else:
            act = max(tokens * sum(kept(i) for i in c) for c in mine)
        logits = tokens * spec.vocab_size * LOGIT_BYTES if stage == pp - 1 else 0
        state = baseline_state_bytes(
            precision,
            dense.scaled(1 / tp),
            experts,
            zero_stage=work.zero_stage,
            dense_dp=world_size // (pp * tp),
            expert_dp=world_size // (pp * ep),
        ) + _fp8_copies(spec, experts, work)
        mem = RankMemory(state, act, _working(full, saved, work.recompute) + logits, chunks_alive)
        worst = mem if worst is None or mem.total > worst.total else worst
    assert worst is not None
    return worst


@lru_cache(maxsize=65536)
def _colocated_saved_bytes(spec: ModelSpec, layer: int) -> float:
    """Per token of a co-located layer: what selective recompute drops (A part plus top_k expert assignments)."""
    routed = spec.top_k * expert_saved_bytes_per_assignment(spec) if spec.moe_layers[layer] else 0
    return a_side_saved_bytes(spec, layer) + routed


@lru_cache(maxsize=65536)  # every co-located shape asks for every layer
def _colocated_bytes(spec: ModelSpec, layer: int, lora: LoRA = FULL) -> float:
    """Per token of a co-located layer: the A-side set plus top_k expert assignments (balanced routing), with the
    adapters' intermediates."""
    per_assignment = spec.f_side_activation_bytes_per_assignment() + expert_adapter_bytes(spec, lora)
    routed = spec.top_k * per_assignment if spec.moe_layers[layer] else 0
    return spec.a_side_activation_bytes(layer) + a_side_adapter_bytes(spec, layer, lora) + routed


def _kept(full: list[float], saved: list[float], inputs_per_layer: float, recompute: Recompute) -> float:
    """Bytes one micro-batch keeps until its backward: every tensor, all but the selectively recomputed ones,
    or only layer inputs with full recompute."""
    if recompute == "full":
        return inputs_per_layer * len(full)
    if recompute == "selective":
        return float(sum(full) - sum(saved))
    return float(sum(full))


def _working(full: list[float], saved: list[float], recompute: Recompute) -> float:
    """Recompute rematerialises one layer (or chunk) at a time during backward: all of it, or its dropped part."""
    if recompute == "full":
        return max(full, default=0.0)
    return max(saved, default=0.0) if recompute == "selective" else 0.0


def _offload_window(kept: float, layers: int, share: float) -> float:
    """Two layers of one micro-batch stay on the GPU while offloading: one being copied out, one prefetched."""
    return 2 * share * kept / layers if share and layers else 0.0


def _gathered(layer_params: float, zero_stage: int, precision: str) -> float:
    """ZeRO-3 gathers a layer's parameters before use and prefetches the next: two layers in full."""
    return 2 * layer_params * Precision.named(precision).param if zero_stage >= 3 else 0.0


def _fp8_rows_saving(spec: ModelSpec, work: Workload, rows_per_assignment: float) -> float:
    """Bytes per assignment the FP8 lever saves on an expert rank: the gate/up input is kept for dW as e4m3 rows and
    scales, H + 4 bytes a row (``rows_per_assignment`` of them per assignment: the received rows, each once, in our
    FP8 node, ``models.fp8_experts``; one a pair in Megatron's) instead of 2H a pair, unless LoRA's adapter GEMMs (the
    unfused path) or bf16 expert GEMMs (the shape rule) keep the pairs' bf16 rows."""
    if not experts_in_fp8(spec, work) or work.lora.enabled:
        return 0.0
    return ACT_BYTES * spec.hidden_size - (spec.hidden_size + FP8_ROW_SCALE_BYTES) * rows_per_assignment


def _fp8_copies(spec: ModelSpec, experts: Params, work: Workload) -> float:
    """Under FP8, the bytes of the FP8 copies of a rank's expert weights, kept for the step (``fp8.weight_cache``)."""
    return cast_expert_weights(experts, work.lora) * CAST_COPIES if keeps_expert_copies(spec, work) else 0.0
