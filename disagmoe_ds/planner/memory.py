"""Per-rank memory of a disaggregated layout and of the co-located baseline (pure Python).

Training state per parameter (ZeRO paper, Rajbhandari et al. 2020, section 3): bf16 mixed precision keeps
a bf16 parameter (2 B) and gradient (2 B) plus fp32 master weights and Adam m, v (12 B) = 16 B; fp32
training keeps 4 + 4 + 8 = 16 B. ZeRO-1 shards the master weights and moments over the data-parallel
group, ZeRO-2 also the gradients. The data-parallel group is the d lanes of an A-group, the expert-DP
replicas of an F-group, and, in the baseline, the DP (attention) or expert-DP (experts) ranks of a stage.

Activations are kept per in-flight micro-batch for every layer a rank owns (``ModelSpec`` per-token
bytes); with full recompute only the layer inputs stay, plus one layer's full set while it is recomputed.

>>> Precision.named("bf16").per_param(zero_stage=1, dp=4)
7.0
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from disagmoe_ds.errors import ConfigError
from disagmoe_ds.layout import Layout
from disagmoe_ds.planner.model import ACT_BYTES, ModelSpec

Recompute = Literal["none", "full"]
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
        table = {"bf16": cls("bf16", 2, 2, 4, 8), "fp32": cls("fp32", 4, 4, 0, 8)}
        if name not in table:
            raise ConfigError(f"precision {name!r} is not one of {sorted(table)}")
        return table[name]

    def per_param(self, *, zero_stage: int, dp: int) -> float:
        """Bytes per parameter on one rank of a ``dp``-way data-parallel group at ``zero_stage`` (0, 1 or 2)."""
        if zero_stage not in (0, 1, 2):
            raise ConfigError(f"zero stage must be 0, 1 or 2 (ZeRO-3 is not supported), got {zero_stage!r}")
        grad = self.grad / dp if zero_stage >= 2 else self.grad
        state = (self.master + self.optim) / dp if zero_stage >= 1 else self.master + self.optim
        return self.param + grad + state


@dataclass(frozen=True)
class RankMemory:
    """Peak bytes on one rank: static training state plus activations of ``in_flight`` micro-batches."""

    state: float
    activations_per_micro_batch: float
    working: float  # one layer rematerialised (full recompute) and the head's logits
    in_flight: int

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
    """What one step trains: sequence length, micro-batch per lane, precision, ZeRO stage, recompute."""

    seq_len: int
    micro_batch_size: int
    zero_stage: int = 1
    precision: str = "bf16"
    recompute: Recompute = "none"

    @property
    def tokens_per_micro_batch(self) -> int:
        return self.seq_len * self.micro_batch_size


def attention_lane_params(spec: ModelSpec, layout: Layout, group: int) -> int:
    """Parameters on a lane of A-group ``group``: its layers' A parts, the embedding (A_0), the head (A_{L%p})."""
    params = sum(spec.a_side_params(i) for i in layout.layers_of_group(group))
    params += spec.embedding_params() if group == 0 else 0
    return params + (spec.head_params() if group == layout.head_group else 0)


def ffn_rank_params(spec: ModelSpec, layout: Layout, group: int) -> int:
    """Parameters on a rank of F-group ``group``: E/ep experts of each of its MoE layers."""
    moe = sum(spec.moe_layers[i] for i in layout.layers_of_group(group))
    return moe * layout.experts_per_rank * spec.expert_params()


def baseline_stage_params(spec: ModelSpec, *, pp: int, vpp: int, ep: int, stage: int) -> tuple[list[int], int, int]:
    """(layers, dense params, expert params) of a co-located rank of pipeline stage ``stage`` (interleaved chunks)."""
    per_chunk = spec.num_layers // (pp * vpp)
    layers = [i for i in range(spec.num_layers) if (i // per_chunk) % pp == stage]
    dense = sum(spec.a_side_params(i) for i in layers)
    dense += spec.embedding_params() if stage == 0 else 0
    dense += spec.head_params() if stage == pp - 1 else 0
    experts = sum(spec.moe_layers[i] for i in layers) * (spec.num_experts // ep) * spec.expert_params()
    return layers, dense, experts


def attention_rank_memory(spec: ModelSpec, layout: Layout, work: Workload, in_flight: int = 1) -> RankMemory:
    """Worst A-group lane: its v layers' A parts (+ embedding, + head on the head group), ZeRO over d lanes."""
    per_param = Precision.named(work.precision).per_param(zero_stage=work.zero_stage, dp=layout.lanes)
    worst: RankMemory | None = None
    for g in range(layout.depth):
        layers = layout.layers_of_group(g)
        params = attention_lane_params(spec, layout, g)
        tokens = work.tokens_per_micro_batch
        full = [spec.a_side_activation_bytes(i) * tokens for i in layers]
        act = _kept(full, spec.layer_input_bytes() * tokens, work.recompute)
        logits = tokens * spec.vocab_size * LOGIT_BYTES if g == layout.head_group else 0
        mem = RankMemory(params * per_param, act, _working(full, work.recompute) + logits, in_flight)
        worst = mem if worst is None or mem.total > worst.total else worst
    assert worst is not None
    return worst


def ffn_rank_memory(spec: ModelSpec, layout: Layout, work: Workload, in_flight: int = 1) -> RankMemory:
    """Worst F-group rank: E/ep experts of its v MoE layers, ZeRO over the expert-DP replicas.

    A micro-batch brings d * B * s tokens to the F-group; a replica sees 1/edp of them, and each of its ep
    ranks receives a token once per chosen local expert set and keeps top_k/ep assignments per token.
    """
    per_param = Precision.named(work.precision).per_param(zero_stage=work.zero_stage, dp=layout.expert_data_parallel)
    tokens_per_replica = layout.lanes * work.tokens_per_micro_batch / layout.expert_data_parallel
    assignments = tokens_per_replica * spec.top_k / layout.ep_size
    received = tokens_per_replica * spec.distinct_ranks_per_token(layout.ep_size) / layout.ep_size
    worst: RankMemory | None = None
    for g in range(layout.depth):
        moe = [i for i in layout.layers_of_group(g) if spec.moe_layers[i]]
        params = ffn_rank_params(spec, layout, g)
        kept_input = received * ACT_BYTES * spec.hidden_size
        layer_full = assignments * spec.f_side_activation_bytes_per_assignment() + kept_input
        full = [layer_full] * len(moe)
        act = _kept(full, kept_input, work.recompute)
        mem = RankMemory(params * per_param, act, _working(full, work.recompute), in_flight)
        worst = mem if worst is None or mem.total > worst.total else worst
    assert worst is not None
    return worst


def baseline_rank_memory(
    spec: ModelSpec, work: Workload, *, world_size: int, pp: int, vpp: int, ep: int, chunks_alive: int
) -> RankMemory:
    """Worst stage of co-located EP+DP with pp stages of vpp chunks: every rank holds attention + E/ep experts.

    ``chunks_alive`` is the peak number of (chunk, micro-batch) activations on the first stage (Megatron's
    interleaved warm-up + 1); ``in_flight`` of the result counts chunks, not micro-batches.
    """
    precision = Precision.named(work.precision)
    dp = world_size // pp
    dense_pp = precision.per_param(zero_stage=work.zero_stage, dp=dp)
    expert_pp = precision.per_param(zero_stage=work.zero_stage, dp=dp // ep)
    per_chunk = spec.num_layers // (pp * vpp)
    tokens = work.tokens_per_micro_batch
    worst: RankMemory | None = None
    for stage in range(pp):
        layers, dense, experts = baseline_stage_params(spec, pp=pp, vpp=vpp, ep=ep, stage=stage)
        full = [tokens * _colocated_bytes(spec, i) for i in layers]
        chunk_full = [sum(full[j : j + per_chunk]) for j in range(0, len(full), per_chunk)]
        if work.recompute == "full":
            act = tokens * spec.layer_input_bytes() * per_chunk
        else:
            act = max(chunk_full)
        logits = tokens * spec.vocab_size * LOGIT_BYTES if stage == pp - 1 else 0
        state = dense * dense_pp + experts * expert_pp
        mem = RankMemory(state, act, _working(full, work.recompute) + logits, chunks_alive)
        worst = mem if worst is None or mem.total > worst.total else worst
    assert worst is not None
    return worst


def _colocated_bytes(spec: ModelSpec, layer: int) -> float:
    """Per token of a co-located layer: the A-side set plus top_k expert assignments (balanced routing)."""
    routed = spec.top_k * spec.f_side_activation_bytes_per_assignment() if spec.moe_layers[layer] else 0
    return spec.a_side_activation_bytes(layer) + routed


def _kept(full: list[float], inputs_per_layer: float, recompute: Recompute) -> float:
    """Bytes one micro-batch keeps until its backward: every tensor, or only layer inputs with full recompute."""
    if recompute == "full":
        return inputs_per_layer * len(full)
    return float(sum(full))


def _working(full: list[float], recompute: Recompute) -> float:
    """Full recompute rematerialises one layer (or chunk) at a time during backward."""
    return max(full, default=0.0) if recompute == "full" else 0.0
