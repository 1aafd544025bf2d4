"""Build everything one co-located rank needs, in a fixed order on every rank.

Order (collective steps run on every rank):
    1. layout from the model and the ``ColocatedConfig``, checked against the world size and the ZeRO stage;
    2. process groups (data parallel, expert parallel, expert data parallel) and DeepSpeed's expert registry;
    3. the rank's module cut from the HF model: the whole attention side, its expert slice, its dispatcher (a model
       on the meta device is never materialised whole: the rank allocates only its parts, then reads their
       pretrained values or initialises them);
    4. its DeepSpeed engine (the user's ds_config adapted like a role engine's) and the executor.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from disagmoe_ds.colocated.dispatch import AllToAllDispatcher, LocalDispatcher
from disagmoe_ds.colocated.executor import ColocatedExecutor, ColocatedGradNorm
from disagmoe_ds.colocated.groups import ColocatedGroups, build_colocated_groups, register_with_deepspeed
from disagmoe_ds.colocated.layout import ColocatedConfig, ColocatedLayout, ColocatedRole
from disagmoe_ds.colocated.model import ColocatedModel, ExpertStageMoE
from disagmoe_ds.engine.deepspeed_role import RoleMPU, role_ds_config
from disagmoe_ds.errors import ConfigError
from disagmoe_ds.launch.env import process_device
from disagmoe_ds.models.families import family_of
from disagmoe_ds.models.loading import load_config
from disagmoe_ds.models.partial_load import PretrainedWeights, place, rank_model
from disagmoe_ds.models.parts import AttentionStage, ExpertStage, compile_stage, num_routed_experts
from disagmoe_ds.models.split import aux_loss_enabled


@dataclass
class ColocatedRuntime:
    """Everything one co-located rank built; ``executor.train_batch`` runs a step. The same fields as
    ``engine.build.RankRuntime``, so the training loop, its checkpoints and its balancing take either."""

    layout: ColocatedLayout
    role: ColocatedRole
    executor: ColocatedExecutor
    module: ColocatedModel
    engine: Any


def build_colocated_rank(
    model_dir: str | Path,
    ds_config: dict[str, Any],
    cfg: ColocatedConfig,
    *,
    micro_batch_size: int,
    dtype: torch.dtype = torch.float32,
    device: torch.device | None = None,
    model: nn.Module | None = None,
    weights: str | Path | None = None,
    seed: int = 0,
) -> ColocatedRuntime:
    """Build this rank's part of a co-located EP+DP job.

    ``model`` may be passed to skip loading ``model_dir``; ``weights`` is then the HF directory whose safetensors
    fill the parts cut from a meta ``model`` (``--init-from``). Without ``model``, ``model_dir``'s own weights fill
    them (``partial_load.model_to_cut``). A model on the meta device is never materialised whole: the rank
    allocates only its parts, then reads their pretrained values or initialises them (from ``seed`` and its rank;
    DeepSpeed then broadcasts the replicas' first copy).
    """
    rank = dist.get_rank()
    device = device or process_device()
    model, pretrained = rank_model(model_dir, dtype=dtype, model=model, weights=weights)
    layout = cfg.layout(num_experts=num_routed_experts(model))
    layout.check_world_size(dist.get_world_size())
    check_zero(layout, ds_config)
    groups = build_colocated_groups(layout, rank, timedelta(seconds=cfg.comm_timeout_s))
    register_with_deepspeed(groups, layout)
    module = build_colocated_model(
        model, layout, groups, rank, device=device, seed=seed * 100_003 + rank, weights=pretrained
    )
    del model
    if cfg.compile:
        compile_stage(module)
    engine = _build_engine(module, ds_config, cfg, groups, micro_batch_size)
    grad_norm = ColocatedGradNorm(
        groups.data_parallel, attention_replicas=layout.world_size, expert_replicas=layout.expert_data_parallel
    )
    grad_norm.install(engine)
    name = f"rank {rank} colocated ep {layout.ep_rank(rank)} edp {layout.edp_rank(rank)}"
    executor = ColocatedExecutor(
        engine=engine,
        num_micro_batches=cfg.micro_batches,
        grad_norm=grad_norm,
        group=groups.data_parallel,
        name=name,
        comm_timeout_s=cfg.comm_timeout_s,
    )
    return ColocatedRuntime(layout, layout.role_of(rank), executor, module, engine)


def build_colocated_model(
    model: nn.Module,
    layout: ColocatedLayout,
    groups: ColocatedGroups,
    rank: int,
    *,
    device: torch.device,
    seed: int,
    weights: PretrainedWeights | None = None,
) -> ColocatedModel:
    """Cut rank ``rank``'s module from the HF model onto ``device``: attention side of every layer, expert slice,
    dispatcher. Parts cut from a meta model are filled from ``weights``, or else initialised from ``2 * seed``
    (attention) and ``2 * seed + 1``."""
    layers = tuple(range(model.config.num_hidden_layers))
    experts = layout.expert_range(layout.ep_rank(rank))
    stage = ExpertStage(model, layers, experts.start, experts.stop)
    attention = AttentionStage(model, layers, with_embedding=True, with_head=True)
    for i, part in enumerate((attention, stage)):
        # Before ExpertStageMoE marks the expert parameters: materialising replaces meta parameters by new ones.
        place(part, model, device, seed=2 * seed + i, weights=weights)
    moe = ExpertStageMoE(
        stage, num_experts=layout.num_experts, ep_size=layout.ep_size, group_name=layout.expert_group_name
    )
    # The one place the exchange strategy is chosen; the model never branches on it.
    if layout.ep_size == 1:
        dispatcher = LocalDispatcher(experts_per_rank=layout.experts_per_rank)
    else:
        dispatcher = AllToAllDispatcher(
            groups.expert_parallel, ep_size=layout.ep_size, experts_per_rank=layout.experts_per_rank
        )
    aux_coef = model.config.router_aux_loss_coef if aux_loss_enabled(model.config) else None
    return ColocatedModel(attention, moe, dispatcher, aux_coef)


def _build_engine(
    module: ColocatedModel,
    ds_config: dict[str, Any],
    cfg: ColocatedConfig,
    groups: ColocatedGroups,
    micro_batch_size: int,
):
    import deepspeed

    mpu = RoleMPU(groups.data_parallel)
    # role_ds_config reads only cfg.micro_batches from our config.
    config = role_ds_config(
        ds_config, micro_batches=cfg.micro_batches, micro_batch_size=micro_batch_size, dp_size=cfg.world_size
    )
    params = [p for p in module.parameters() if p.requires_grad]
    engine, *_ = deepspeed.initialize(model=module, model_parameters=params, config=config, mpu=mpu)
    return engine


def check_zero(layout: ColocatedLayout, ds_config: dict[str, Any]) -> None:
    stage = ds_config.get("zero_optimization", {}).get("stage", 0)
    if stage >= 2 and layout.ep_size > 1:
        raise ConfigError(
            f"ZeRO stage {stage} with ep_size {layout.ep_size} is not supported in co-located mode: an expert slice "
            "that receives no token in a micro-batch produces no gradient, and DeepSpeed's stage-2 gradient buckets "
            "(shared by attention and expert parameters) then differ between ranks; use zero_optimization.stage 1"
        )


def preflight_colocated(
    model_dir: str | Path, cfg: ColocatedConfig, ds_config: dict[str, Any], world_size: int
) -> ColocatedLayout:
    """Validate the co-located layout against the model config and the world size before any rank starts."""
    config = load_config(model_dir)
    layout = cfg.layout(num_experts=getattr(config, family_of(config).num_experts_attr))
    layout.check_world_size(world_size)
    check_zero(layout, ds_config)
    return layout
