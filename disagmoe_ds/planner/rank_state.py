"""The runtime's banner: the static training state of the worst rank of each kind, for a model's config.json and
the layout a run was launched with (``train.progress``)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Protocol, runtime_checkable

from disagmoe_ds.errors import ConfigError
from disagmoe_ds.layout import Layout
from disagmoe_ds.planner.lora import TARGETS, LoRA, check_adapts, ships_fp8_blocks
from disagmoe_ds.planner.model import ModelSpec
from disagmoe_ds.planner.training_state import (
    Precision,
    attention_state_bytes,
    baseline_state_bytes,
    ffn_state_bytes,
    stage_params,
)
from disagmoe_ds.planner.workload import Workload


@runtime_checkable
class ColocatedShape(Protocol):
    """What ``rank_state_bytes`` reads of ``colocated.layout.ColocatedLayout`` (the planner imports no runtime
    folder: colocated imports DeepSpeed and the runtime's config, which imports the planner)."""

    @property
    def world_size(self) -> int: ...

    @property
    def ep_size(self) -> int: ...

    @property
    def num_experts(self) -> int: ...

    @property
    def expert_data_parallel(self) -> int: ...

    @property
    def pp_size(self) -> int: ...

    def chunk_layers(self, stage: int) -> tuple[range, ...]: ...  # the layers of each chunk of a pipeline stage


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
    )
    fp8_base = lora_rank > 0 and ships_fp8_blocks(config_dict)  # the runtime keeps such a base in FP8
    work = work.with_lora(LoRA(lora_rank, tuple(lora_targets), lora_train_router, fp8_base))
    check_adapts(spec, work.lora)
    if isinstance(layout, Layout):
        groups = range(layout.depth)
        return {
            "attention": max(attention_state_bytes(spec, layout, work, g) for g in groups),
            "ffn": max(ffn_state_bytes(spec, layout, work, g) for g in groups),
        }
    return {"colocated": _colocated_state_bytes(spec, layout, work)}


def _colocated_state_bytes(spec: ModelSpec, layout: ColocatedShape, work: Workload) -> float:
    """A co-located rank of the heaviest pipeline stage: the dense parameters of its chunks' layers (ZeRO over the
    stage's D ranks) and E/ep experts of each of its MoE layers (ZeRO over their D/ep replicas), with DeepSpeed's
    bf16 gradients; one stage holds every layer."""
    if work.zero_of("attention") != work.zero_of("ffn"):
        raise ConfigError(
            f"a co-located rank has one DeepSpeed engine over both kinds of parameters: zero_stage_a "
            f"({work.zero_of('attention')}) and zero_stage_f ({work.zero_of('ffn')}) must be equal"
        )
    stages = [tuple(range(spec.num_layers))]  # one stage of every layer, or each stage's chunks' layers
    if layout.pp_size > 1:
        stages = [tuple(i for chunk in layout.chunk_layers(s) for i in chunk) for s in range(layout.pp_size)]
    return max(
        baseline_state_bytes(
            Precision.named(work.precision),
            *stage_params(spec, layers, ep=layout.ep_size, first=s == 0, last=s == len(stages) - 1, lora=work.lora),
            zero_stage=work.zero_stage,
            dense_dp=layout.world_size // len(stages),
            expert_dp=layout.expert_data_parallel,
        )
        for s, layers in enumerate(stages)
    )
