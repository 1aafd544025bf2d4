"""Per-rank memory of a disaggregated layout and of the co-located baseline (pure Python).

Training state per parameter (ZeRO paper, Rajbhandari et al. 2020, section 3): bf16 mixed precision keeps
a bf16 parameter (2 B) and gradient (2 B) plus fp32 master weights and Adam m, v (12 B) = 16 B; fp32
training keeps 4 + 4 + 8 = 16 B. ZeRO-1 shards the master weights and moments over the data-parallel
group, ZeRO-2 also the gradients. The data-parallel group is the d lanes of an A-group (times the s Ulysses ranks
of a lane, ``attention_lanes.py``), the expert-DP replicas of an F-group, and, in the baseline, the DP (attention)
or expert-DP (experts) ranks of a stage.

Activations are kept per in-flight micro-batch for every layer a rank owns (``ModelSpec`` per-token
bytes); with full recompute only the layer inputs stay, plus one layer's full set while it is recomputed.

Selective recompute drops the tensors ``recompute.py`` lists. Resend keeps nothing on the F side (its backward
gets the tokens again and re-runs the expert forward). Offload keeps a share of a micro-batch's
activations in host memory between its forward and backward, holding two layers' worth on the GPU as the
copy window. ZeRO-3 also shards the bf16 parameters and holds two gathered layers (current and prefetch).

LoRA fine-tuning (``lora.py``) freezes every base weight: it keeps its parameter bytes (sharded only by ZeRO-3), no
gradient, master copy or optimizer state; the adapters keep the full state by the rules above. Its activations add
the adapters' r-wide intermediates per token (A side) and per (token, expert) assignment (F side).

>>> Precision.named("bf16").per_param(zero_stage=1, dp=4)
7.0
>>> Precision.named("bf16").per_param(zero_stage=3, dp=4)
4.0
>>> Precision.named("bf16").state_bytes(Params(frozen=8, trained=1), zero_stage=1, dp=4)  # 8 x 2 B + 1 x 7 B
23.0
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace
from functools import lru_cache
from typing import Any, Protocol

from disagmoe_ds.errors import ConfigError
from disagmoe_ds.layout import Layout
from disagmoe_ds.planner.attention_lanes import data_lanes, param_replicas, rank_params, rank_tokens
from disagmoe_ds.planner.lora import (
    FULL,
    TARGETS,
    LoRA,
    Params,
    a_side_adapter_bytes,
    a_side_split,
    base_split,
    check_adapts,
    expert_adapter_bytes,
    expert_split,
)
from disagmoe_ds.planner.model import ACT_BYTES, ModelSpec
from disagmoe_ds.planner.pipeline_split import chunk_layers, stage_layers
from disagmoe_ds.planner.recompute import Recompute, a_side_saved_bytes, expert_saved_bytes_per_assignment

__all__ = ["Recompute"]  # re-exported: the allocator and CLI import the policy type from here
LOGIT_BYTES = 6  # per logit on the head rank: bf16 logits + their fp32 upcast inside the loss


@dataclass(frozen=True)
class Precision:
    """Bytes per parameter of each kind of training state."""

    name: str
    param: float
    grad: float
    master: float
    optim: float

    @classmethod
    def named(cls, name: str) -> Precision:
        if name not in _PRECISIONS:
            raise ConfigError(f"precision {name!r} is not one of {sorted(_PRECISIONS)}")
        return _PRECISIONS[name]

    @classmethod
    def megatron(cls, name: str) -> Precision:
        """Megatron-Core's bf16 training accumulates and reduces gradients in fp32 (a 4 B main-grad buffer per
        parameter, ``--accumulate-allreduce-grads-in-fp32``): 2 + 4 + 12/d B with the distributed optimizer,
        where DeepSpeed keeps bf16 gradients (2 B). fp32 training is the same in both."""
        base = cls.named(name)
        return replace(base, name=f"{name}, fp32 grads", grad=4) if name == "bf16" else base

    def per_param(self, *, zero_stage: int, dp: int) -> float:
        """Bytes per parameter on one rank of a ``dp``-way data-parallel group at ``zero_stage`` (0 to 3)."""
        if zero_stage not in (0, 1, 2, 3):
            raise ConfigError(f"zero stage must be 0, 1, 2 or 3, got {zero_stage!r}")
        param = self.param / dp if zero_stage >= 3 else self.param
        grad = self.grad / dp if zero_stage >= 2 else self.grad
        state = (self.master + self.optim) / dp if zero_stage >= 1 else self.master + self.optim
        return param + grad + state

    def frozen_per_param(self, *, zero_stage: int, dp: int) -> float:
        """Bytes per frozen parameter: its value only, which only ZeRO-3 shards."""
        return self.param / dp if zero_stage >= 3 else self.param

    def state_bytes(self, params: Params, *, zero_stage: int, dp: int) -> float:
        """Training-state bytes of ``params`` on one rank of a ``dp``-way data-parallel group."""
        frozen = params.frozen * self.frozen_per_param(zero_stage=zero_stage, dp=dp) if params.frozen else 0.0
        return frozen + params.trained * self.per_param(zero_stage=zero_stage, dp=dp)


_PRECISIONS = {"bf16": Precision("bf16", 2, 2, 4, 8), "fp32": Precision("fp32", 4, 4, 0, 8)}


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


@dataclass(frozen=True)
class Workload:
    """What one step trains and how: sequence length, micro-batch per lane, precision, ZeRO stage, recompute,
    and the AF-Pipe variants (ignored by the co-located baseline).

    Args:
        resend: the F side keeps nothing between a micro-batch's forward and its backward: the A side (which keeps
            the tokens as its post-attention norm output) sends them again with the backward's gradient, and F
            re-runs the expert forward from them before its backward (one more expert forward per micro-batch and
            layer, whatever ``recompute`` is; with "full" that is the recompute F pays anyway, not a second one).
            With p > 1 the tokens go to A_next with the residual hand-off (it sends the backward's gradient) and
            wait there: more resid bytes and A memory (``DisagMoEConfig.resend``).
        offload: (A, F) share of a micro-batch's kept activations moved to host memory between its forward
            and its backward.
        split_backward: each backward runs as an input-gradient task on the critical path and a weight-gradient
            task that fills idle time (zero-bubble pipelining on the A/F ring).
        attention_zero_stage, ffn_zero_stage: per-side ZeRO stage (None: ``zero_stage``).
        sequence_parallel, tensor_parallel: s and t of an A-lane of s x t ranks (``attention_lanes.py``): DeepSpeed-
            Ulysses over s ranks, Megatron-style TP+SP over t; the lane's micro-batch is split over its s x t ranks.
        lora_rank, lora_targets, lora_train_router: LoRA fine-tuning (``lora.LoRA``; rank 0: full fine-tuning).
    """

    seq_len: int
    micro_batch_size: int
    zero_stage: int = 1
    precision: str = "bf16"
    recompute: Recompute = "none"
    resend: bool = False
    offload: tuple[float, float] = (0.0, 0.0)
    split_backward: bool = False
    attention_zero_stage: int | None = None
    ffn_zero_stage: int | None = None
    sequence_parallel: int = 1
    tensor_parallel: int = 1
    lora_rank: int = 0
    lora_targets: tuple[str, ...] = TARGETS
    lora_train_router: bool = False

    def __post_init__(self) -> None:
        # validated once; the targets kept in canonical order so that equal runs hash equal
        try:
            lora = _lora(self.lora_rank, self.lora_targets, self.lora_train_router)
        except TypeError:  # unhashable targets (a list): LoRA checks and normalises them
            lora = LoRA(self.lora_rank, self.lora_targets, self.lora_train_router)
        object.__setattr__(self, "lora_targets", lora.targets)

    @property
    def lora(self) -> LoRA:
        return _lora(self.lora_rank, self.lora_targets, self.lora_train_router)

    @property
    def lane_size(self) -> int:
        """Ranks of one A-lane: s x t."""
        return self.sequence_parallel * self.tensor_parallel

    @property
    def tokens_per_micro_batch(self) -> int:
        return self.seq_len * self.micro_batch_size

    def zero_of(self, side: str) -> int:
        """ZeRO stage of the "attention" or "ffn" side."""
        stage = self.attention_zero_stage if side == "attention" else self.ffn_zero_stage
        return self.zero_stage if stage is None else stage

    @property
    def ffn_recompute(self) -> Recompute:
        """The recompute the F side's backward pays for: with ``resend`` it re-runs the whole expert forward (the
        compute of full recompute, charged once), otherwise the global policy."""
        return "full" if self.resend else self.recompute

    @property
    def variant(self) -> str:
        """Short name of the AF-Pipe variant, e.g. "recompute selective, resend, ZeRO 1/3"."""
        parts = [f"recompute {self.recompute}"]
        parts += ["resend"] if self.resend else []
        a, f = self.offload
        parts += [f"offload A {a:.0%} F {f:.0%}"] if a or f else []
        parts += ["split backward"] if self.split_backward else []
        parts += [f"SP {self.sequence_parallel} x TP {self.tensor_parallel}"] if self.lane_size > 1 else []
        return ", ".join(parts + [f"ZeRO {self.zero_of('attention')}/{self.zero_of('ffn')}"])


@lru_cache(maxsize=64, typed=True)  # typed: True is no LoRA rank, and must not hit rank 1's entry
def _lora(rank: int, targets: tuple[str, ...], train_router: bool) -> LoRA:
    """``Workload.lora``, validated once: the search builds and asks for hundreds of thousands of workloads."""
    return LoRA(rank, targets, train_router)


@lru_cache(maxsize=65536)
def attention_lane_params(spec: ModelSpec, layout: Layout, group: int, lora: LoRA = FULL) -> Params:
    """Parameters on a lane of A-group ``group``: its layers' A parts, the embedding (A_0), the head (A_{L%p})."""
    params = sum((a_side_split(spec, i, lora) for i in layout.layers_of_group(group)), Params())
    params += base_split(spec.embedding_params(), lora) if group == 0 else Params()
    return params + (base_split(spec.head_params(), lora) if group == layout.head_group else Params())


@lru_cache(maxsize=65536)
def ffn_rank_params(spec: ModelSpec, layout: Layout, group: int, lora: LoRA = FULL) -> Params:
    """Parameters on a rank of F-group ``group``: E/ep experts of each of its MoE layers."""
    moe = sum(spec.moe_layers[i] for i in layout.layers_of_group(group))
    return expert_split(spec, lora).scaled(moe * layout.experts_per_rank)


@lru_cache(maxsize=4096)  # every candidate of a layout asks (roofline, sync, optimizer step)
def busiest_group_params(spec: ModelSpec, layout: Layout, lora: LoRA = FULL) -> tuple[Params, Params]:
    """(A lane, F rank) parameters of the group holding the most of each kind: what a per-rank sync (the trained
    ones) or ZeRO gather (all) waits for."""
    groups = range(layout.depth)
    return (
        Params.most(attention_lane_params(spec, layout, g, lora) for g in groups),
        Params.most(ffn_rank_params(spec, layout, g, lora) for g in groups),
    )


@lru_cache(maxsize=65536)  # the co-located search asks for every stage of every shape, policy and dispatcher
def baseline_stage_params(
    spec: ModelSpec, *, pp: int, vpp: int, ep: int, stage: int, lora: LoRA = FULL
) -> tuple[tuple[int, ...], Params, Params]:
    """(layers, dense params, expert params) of a co-located rank of pipeline stage ``stage`` (interleaved chunks)."""
    layers = tuple(stage_layers(spec.num_layers, pp, vpp, stage))
    dense = sum((a_side_split(spec, i, lora) for i in layers), Params())
    dense += base_split(spec.embedding_params(), lora) if stage == 0 else Params()
    dense += base_split(spec.head_params(), lora) if stage == pp - 1 else Params()
    experts = expert_split(spec, lora).scaled(sum(spec.moe_layers[i] for i in layers) * (spec.num_experts // ep))
    return layers, dense, experts


def attention_state_bytes(spec: ModelSpec, layout: Layout, work: Workload, group: int) -> float:
    """Training state of a rank of A-group ``group``: 1/t of the lane's parameters (TP shards them all), ZeRO over
    the d x s ranks holding the same shard (``attention_lanes.py``)."""
    lane = attention_lane_params(spec, layout, group, work.lora)
    params = Params(rank_params(lane.frozen, work), rank_params(lane.trained, work))
    precision = Precision.named(work.precision)
    return precision.state_bytes(params, zero_stage=work.zero_of("attention"), dp=param_replicas(layout, work))


def ffn_state_bytes(spec: ModelSpec, layout: Layout, work: Workload, group: int) -> float:
    """Training state of a rank of F-group ``group``: ZeRO over the expert-DP replicas."""
    params = ffn_rank_params(spec, layout, group, work.lora)
    precision = Precision.named(work.precision)
    return precision.state_bytes(params, zero_stage=work.zero_of("ffn"), dp=layout.expert_data_parallel)


def attention_rank_memory(spec: ModelSpec, layout: Layout, work: Workload, in_flight: int = 1) -> RankMemory:
    """Worst A-group rank: its v layers' A parts (+ embedding, + head on the head group). In a lane of s x t ranks
    (``attention_lanes.py``) it holds 1/t of the parameters, ZeRO-sharded over the d x s ranks holding the same
    shard, and 1/(s t) of the lane's activations and logits."""
    zero, lora = work.zero_of("attention"), work.lora
    worst: RankMemory | None = None
    for g in range(layout.depth):
        layers = layout.layers_of_group(g)
        tokens = rank_tokens(work)
        per_full, per_saved, biggest = _a_side_per_token(spec, tuple(layers), lora)
        full = [b * tokens for b in per_full]
        saved = [b * tokens for b in per_saved]
        act = _kept(full, saved, spec.layer_input_bytes() * tokens, work.recompute)
        act += _resent(spec, layout, work, layers)
        logits = tokens * spec.vocab_size * LOGIT_BYTES if g == layout.head_group else 0
        share = work.offload[0]
        working = _working(full, saved, work.recompute) + logits + _offload_window(act, len(layers), share)
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
    per_token = spec.wire_bytes_per_token(layout.ep_size).m2n
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
    zero, lora = work.zero_of("ffn"), work.lora
    per_assignment = spec.f_side_activation_bytes_per_assignment() + expert_adapter_bytes(spec, lora)
    tokens_per_replica = data_lanes(layout, work) * work.tokens_per_micro_batch / layout.expert_data_parallel
    assignments = tokens_per_replica * spec.top_k / layout.ep_size
    received = tokens_per_replica * spec.distinct_ranks_per_token(layout.ep_size) / layout.ep_size
    worst: RankMemory | None = None
    for g in range(layout.depth):
        moe = [i for i in layout.layers_of_group(g) if spec.moe_layers[i]]
        layer_full = assignments * per_assignment + received * ACT_BYTES * spec.hidden_size
        full = [layer_full] * len(moe)
        saved = [assignments * expert_saved_bytes_per_assignment(spec)] * len(moe)
        if work.resend:  # nothing kept; the backward rematerialises one layer at a time, tokens included
            act, working = 0.0, max(full, default=0.0)
        else:
            act = _kept(full, saved, received * ACT_BYTES * spec.hidden_size, work.recompute)
            working = _working(full, saved, work.recompute)
        share = work.offload[1]
        working += _offload_window(act, len(moe), share)
        working += _gathered(layout.experts_per_rank * expert_split(spec, lora).total, zero, work.precision)
        mem = RankMemory(ffn_state_bytes(spec, layout, work, g), act * (1 - share), working, in_flight, act * share)
        worst = mem if worst is None or mem.total > worst.total else worst
    assert worst is not None
    return worst


@lru_cache(maxsize=65536)  # the same shapes come back for every bandwidth of a sweep and every dispatcher
def baseline_rank_memory(
    spec: ModelSpec,
    work: Workload,
    *,
    world_size: int,
    pp: int,
    vpp: int,
    ep: int,
    chunks_alive: int,
    tp: int = 1,
    cp: int = 1,
    fp32_grads: bool = True,
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
    precision = Precision.megatron(work.precision) if fp32_grads else Precision.named(work.precision)
    lora = work.lora
    tokens = work.tokens_per_micro_batch / (tp * cp)
    chunks = chunk_layers(spec.num_layers, pp, vpp)
    assert chunks is not None, f"{spec.num_layers} layers do not split over PP {pp} x VPP {vpp}"
    worst: RankMemory | None = None
    for stage in range(pp):
        layers, dense, experts = baseline_stage_params(spec, pp=pp, vpp=vpp, ep=ep, stage=stage, lora=lora)
        full = [tokens * _colocated_bytes(spec, i, lora) for i in layers]
        saved = [tokens * _colocated_saved_bytes(spec, i) for i in layers]
        mine = [c for k, c in enumerate(chunks) if k % pp == stage]  # the largest chunk bounds the activations
        if work.recompute == "full":
            act = tokens * spec.layer_input_bytes() * max(len(c) for c in mine)
        elif work.recompute == "selective":
            act = max(
                tokens * sum(_colocated_bytes(spec, i, lora) - _colocated_saved_bytes(spec, i) for i in c) for c in mine
            )
        else:
            act = max(tokens * sum(_colocated_bytes(spec, i, lora) for i in c) for c in mine)
        logits = tokens * spec.vocab_size * LOGIT_BYTES if stage == pp - 1 else 0
        state = baseline_state_bytes(
            precision,
            dense.scaled(1 / tp),
            experts,
            zero_stage=work.zero_stage,
            dense_dp=world_size // (pp * tp),
            expert_dp=world_size // (pp * ep),
        )
        mem = RankMemory(state, act, _working(full, saved, work.recompute) + logits, chunks_alive)
        worst = mem if worst is None or mem.total > worst.total else worst
    assert worst is not None
    return worst


@lru_cache(maxsize=65536)
def _colocated_saved_bytes(spec: ModelSpec, layer: int) -> float:
    """Per token of a co-located layer: what selective recompute drops (A part plus top_k expert assignments)."""
    routed = spec.top_k * expert_saved_bytes_per_assignment(spec) if spec.moe_layers[layer] else 0
    return a_side_saved_bytes(spec, layer) + routed


def baseline_state_bytes(
    precision: Precision, dense: Params, experts: Params, *, zero_stage: int, dense_dp: int, expert_dp: int
) -> float:
    """A co-located rank's training state: its dense parameters ZeRO-sharded over ``dense_dp`` ranks, its expert
    shard over its ``expert_dp`` replicas."""
    return precision.state_bytes(dense, zero_stage=zero_stage, dp=dense_dp) + precision.state_bytes(
        experts, zero_stage=zero_stage, dp=expert_dp
    )


@lru_cache(maxsize=65536)
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


# ----- the runtime's banner -----
class ColocatedShape(Protocol):
    """What ``rank_state_bytes`` reads of ``colocated.layout.ColocatedLayout`` (which imports the runtime's config,
    which imports the planner)."""

    @property
    def world_size(self) -> int: ...

    @property
    def ep_size(self) -> int: ...

    @property
    def num_experts(self) -> int: ...

    @property
    def expert_data_parallel(self) -> int: ...


def rank_state_bytes(
    config_dict: dict[str, Any],
    layout: Layout | ColocatedShape,
    *,
    precision: str,
    zero_stage_a: int,
    zero_stage_f: int,
    lora_rank: int = 0,
    lora_targets: Sequence[str] = TARGETS,
    lora_train_router: bool = False,
) -> dict[str, float]:
    """Static training-state bytes (parameters, gradients, optimizer state; no activations) of the worst rank of
    each kind for a run of the model ``config_dict`` (a config.json dict): ``{"attention": ..., "ffn": ...}`` for a
    disaggregated ``Layout`` (A lanes of one TP rank, sequence parallel as the layout says), ``{"colocated": ...}``
    for a co-located layout (one DeepSpeed engine: ``zero_stage_a`` must equal ``zero_stage_f``)."""
    spec = ModelSpec.from_config(config_dict)
    layers = layout.num_layers if isinstance(layout, Layout) else spec.num_layers
    if (layers, layout.num_experts) != (spec.num_layers, spec.num_experts):
        raise ConfigError(
            f"the layout has {layers} layers of {layout.num_experts} experts, {spec.name} "
            f"{spec.num_layers} of {spec.num_experts}: pass the layout of this model"
        )
    work = Workload(  # the state depends on neither the sequence nor the micro-batch
        1,
        1,
        zero_stage=zero_stage_a,
        ffn_zero_stage=zero_stage_f,
        precision=precision,
        sequence_parallel=layout.sequence_parallel if isinstance(layout, Layout) else 1,
        lora_rank=lora_rank,
        lora_targets=tuple(lora_targets),
        lora_train_router=lora_train_router,
    )
    check_adapts(spec, work.lora)
    if isinstance(layout, Layout):
        groups = range(layout.depth)
        return {
            "attention": max(attention_state_bytes(spec, layout, work, g) for g in groups),
            "ffn": max(ffn_state_bytes(spec, layout, work, g) for g in groups),
        }
    return {"colocated": _colocated_state_bytes(spec, layout, work)}


def _colocated_state_bytes(spec: ModelSpec, layout: ColocatedShape, work: Workload) -> float:
    """Every co-located rank holds the dense parameters (ZeRO over all W ranks) and E/ep experts of each MoE layer
    (ZeRO over their W/ep replicas), with DeepSpeed's bf16 gradients."""
    if work.zero_of("attention") != work.zero_of("ffn"):
        raise ConfigError(
            f"a co-located rank has one DeepSpeed engine over both kinds of parameters: zero_stage_a "
            f"({work.zero_of('attention')}) and zero_stage_f ({work.zero_of('ffn')}) must be equal"
        )
    _, dense, experts = baseline_stage_params(spec, pp=1, vpp=1, ep=layout.ep_size, stage=0, lora=work.lora)
    return baseline_state_bytes(
        Precision.named(work.precision),
        dense,
        experts,
        zero_stage=work.zero_stage,
        dense_dp=layout.world_size,
        expert_dp=layout.expert_data_parallel,
    )
