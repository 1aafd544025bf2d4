"""Parameters and their training state on one rank, per side and ZeRO stage (pure Python).

Training state per parameter (ZeRO paper, Rajbhandari et al. 2020, section 3): bf16 mixed precision keeps
a bf16 parameter (2 B) and gradient (2 B) plus fp32 master weights and Adam m, v (12 B) = 16 B; fp32
training keeps 4 + 4 + 8 = 16 B. ZeRO-1 shards the master weights and moments over the data-parallel
group, ZeRO-2 also the gradients, ZeRO-3 also the bf16 parameters. The data-parallel group is the d lanes of an
A-group (times the s Ulysses ranks of a lane, ``attention_lanes.py``), the expert-DP replicas of an F-group, and,
in the baseline, the DP (attention) or expert-DP (experts) ranks of a stage.

LoRA fine-tuning (``lora.py``) freezes every base weight: it keeps its parameter bytes (sharded only by ZeRO-3), no
gradient, master copy or optimizer state; the adapters keep the full state by the rules above.

>>> Precision.named("bf16").per_param(zero_stage=1, dp=4)
7.0
>>> Precision.named("bf16").per_param(zero_stage=3, dp=4)
4.0
>>> Precision.named("bf16").state_bytes(Params(frozen=8, trained=1), zero_stage=1, dp=4)  # 8 x 2 B + 1 x 7 B
23.0
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from functools import lru_cache

from disagmoe_ds.errors import ConfigError
from disagmoe_ds.layout import Layout
from disagmoe_ds.planner.attention_lanes import param_replicas, rank_params
from disagmoe_ds.planner.lora import FULL, LoRA, Params, a_side_split, base_split, expert_split
from disagmoe_ds.planner.model import ModelSpec
from disagmoe_ds.planner.pipeline_split import stage_layers
from disagmoe_ds.planner.workload import Workload


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
        """Training-state bytes of ``params`` on one rank of a ``dp``-way data-parallel group (an FP8 base: its
        ``FP8_BASE_BYTES`` per parameter on every rank, which ZeRO-3 does not shard: the runtime holds it whole)."""
        high = params.frozen - params.fp8
        frozen = high * self.frozen_per_param(zero_stage=zero_stage, dp=dp) if high else 0.0
        return frozen + params.fp8 * FP8_BASE_BYTES + params.trained * self.per_param(zero_stage=zero_stage, dp=dp)


# ZeRO-Offload copies each gradient partition into an fp32 host buffer, where the CPU optimizer reads it.
HOST_GRAD_BYTES = 4
# A weight in FP8 blocks: one e4m3 byte per parameter and a float32 scale per 128 x 128 block (DeepSeek-V3's layout).
FP8_BASE_BYTES = 1 + 4 / (128 * 128)
_PRECISIONS = {"bf16": Precision("bf16", 2, 2, 4, 8), "fp32": Precision("fp32", 4, 4, 0, 8)}


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
    return (layers, *stage_params(spec, layers, ep=ep, first=stage == 0, last=stage == pp - 1, lora=lora))


def stage_params(
    spec: ModelSpec, layers: tuple[int, ...], *, ep: int, first: bool, last: bool, lora: LoRA = FULL
) -> tuple[Params, Params]:
    """(dense params, expert params) of a co-located rank holding ``layers`` (``first``: the embedding too,
    ``last``: the head) and 1/ep of their experts."""
    dense = sum((a_side_split(spec, i, lora) for i in layers), Params())
    dense += base_split(spec.embedding_params(), lora) if first else Params()
    dense += base_split(spec.head_params(), lora) if last else Params()
    experts = expert_split(spec, lora).scaled(sum(spec.moe_layers[i] for i in layers) * (spec.num_experts // ep))
    return dense, experts


def attention_state_bytes(spec: ModelSpec, layout: Layout, work: Workload, group: int) -> float:
    """Training state of a rank of A-group ``group``: 1/t of the lane's parameters (TP shards them all), ZeRO over
    the d x s ranks holding the same shard (``attention_lanes.py``)."""
    lane = attention_lane_params(spec, layout, group, work.lora)
    params = Params(rank_params(lane.frozen, work), rank_params(lane.trained, work), rank_params(lane.fp8, work))
    precision = Precision.named(work.precision)
    return precision.state_bytes(params, zero_stage=work.zero_of("attention"), dp=param_replicas(layout, work))


def ffn_state_bytes(spec: ModelSpec, layout: Layout, work: Workload, group: int) -> float:
    """Training state of a rank of F-group ``group`` on its GPU: ZeRO over the expert-DP replicas; with the optimizer
    on the host (``Workload.ffn_optimizer_on_host``) without the master weights and moments."""
    params = ffn_rank_params(spec, layout, group, work.lora)
    precision = Precision.named(work.precision)
    if work.ffn_optimizer_on_host:
        precision = replace(precision, master=0.0, optim=0.0)
    return precision.state_bytes(params, zero_stage=work.zero_of("ffn"), dp=layout.expert_data_parallel)


def ffn_host_state_bytes(spec: ModelSpec, layout: Layout, work: Workload, group: int) -> float:
    """What an F rank of ``group`` keeps in host memory with its optimizer there: the master weights, the moments
    and an fp32 gradient of its ZeRO shard of the trained parameters (0 without)."""
    if not work.ffn_optimizer_on_host:
        return 0.0
    precision = Precision.named(work.precision)
    trained = ffn_rank_params(spec, layout, group, work.lora).trained / layout.expert_data_parallel
    return trained * (precision.master + precision.optim + HOST_GRAD_BYTES)


def baseline_state_bytes(
    precision: Precision, dense: Params, experts: Params, *, zero_stage: int, dense_dp: int, expert_dp: int
) -> float:
    """A co-located rank's training state: its dense parameters ZeRO-sharded over ``dense_dp`` ranks, its expert
    shard over its ``expert_dp`` replicas."""
    return precision.state_bytes(dense, zero_stage=zero_stage, dp=dense_dp) + precision.state_bytes(
        experts, zero_stage=zero_stage, dp=expert_dp
    )
