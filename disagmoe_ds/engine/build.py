"""Build everything one rank needs for disaggregated training, in a fixed order on every rank.

Order (each step collective where it creates process groups, so every rank runs all of them):
    1. layout from the model and the ``disagmoe`` section, checked against the world size;
    2. data-parallel groups (lanes of each A-group, replicas of each expert shard) and the exchange groups;
    3. the rank's role module cut from the HF model (attention stage or expert stage);
    4. its DeepSpeed engine (``deepspeed_role``), the AF-Pipe schedule of its worker, mailbox and runner.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from disagmoe_ds.comm.exchange import build_exchange_comms
from disagmoe_ds.comm.transport import make_transport
from disagmoe_ds.config import DisagMoEConfig
from disagmoe_ds.engine.deepspeed_role import build_role_engine
from disagmoe_ds.engine.executor import AFPipeExecutor
from disagmoe_ds.engine.instructions import AFPipeSchedule
from disagmoe_ds.engine.mailbox import Mailbox
from disagmoe_ds.engine.runners import AttentionRunner, ExpertRunner
from disagmoe_ds.errors import ConfigError, LayoutError
from disagmoe_ds.launch.env import process_device
from disagmoe_ds.layout import Layout, RankRole
from disagmoe_ds.models.families import family_of, router_of
from disagmoe_ds.models.loading import load_config
from disagmoe_ds.models.partial_load import place, rank_model
from disagmoe_ds.models.parts import AttentionStage, ExpertStage, compile_stage, moe_layers, num_routed_experts
from disagmoe_ds.models.split import aux_loss_enabled
from disagmoe_ds.planner.runtime_costs import runtime_costs
from disagmoe_ds.schedule import Costs, PipeShape, Worker, check_streams, generate


@dataclass(frozen=True)
class DataParallelGroups:
    """The group whose ranks hold replicas of this rank's parameters (DeepSpeed's data-parallel group)."""

    group: dist.ProcessGroup
    size: int


def build_data_parallel_groups(layout: Layout, rank: int, timeout: timedelta | None = None) -> DataParallelGroups:
    """Lanes of every A-group, then the replicas of every expert shard; created on every rank in this order."""
    mine = None
    candidates = [layout.attention_ranks(g) for g in range(layout.depth)]
    candidates += [layout.edp_group_ranks(g, e) for g in range(layout.depth) for e in range(layout.ep_size)]
    for ranks in candidates:
        group = dist.new_group(list(ranks), timeout=timeout)
        if rank in ranks:
            mine = DataParallelGroups(group, len(ranks))
    return mine


@dataclass
class RankRuntime:
    """Everything one rank built; ``executor.train_batch`` runs a step."""

    layout: Layout
    role: RankRole
    executor: AFPipeExecutor
    module: nn.Module
    engine: Any


def build_rank(
    model_dir: str | Path,
    ds_config: dict[str, Any],
    cfg: DisagMoEConfig,
    *,
    micro_batch_size: int,
    dtype: torch.dtype = torch.float32,
    device: torch.device | None = None,
    model: nn.Module | None = None,
    weights: str | Path | None = None,
    seed: int = 0,
    seq_len: int | None = None,
) -> RankRuntime:
    """Build this rank's part of the disaggregated job.

    ``model`` may be passed to skip loading ``model_dir``; ``weights`` is then the HF directory whose safetensors
    fill the parts cut from a meta ``model`` (``--init-from``). Without ``model``, ``model_dir``'s own weights fill
    them (``partial_load.model_to_cut``). A model on the meta device is never materialised whole: each rank
    allocates only the parts it owns, then reads their pretrained values or initialises them. ``seq_len`` gives the
    schedule the planner's task costs (``schedule_costs``); without it every task costs one unit.
    """
    rank = dist.get_rank()
    device = device or process_device()
    model, pretrained = rank_model(model_dir, dtype=dtype, model=model, weights=weights)
    layout = cfg.layout(num_layers=model.config.num_hidden_layers, num_experts=num_routed_experts(model))
    layout.check_world_size(dist.get_world_size())
    moe = moe_layers(model)
    _check_layout_fits(layout, moe, ds_config)
    role = layout.role_of(rank)
    # A rank waiting longer than this for a peer fails (and the launcher ends the job) instead of hanging.
    timeout = timedelta(seconds=cfg.comm_timeout_s)
    dp = build_data_parallel_groups(layout, rank, timeout)
    exchange = build_exchange_comms(layout, make_transport(cfg.transport, timeout), device=device)
    top_k, weight_dtype = _router_facts(model, moe)
    stage = _build_stage(model, layout, role)
    # Freshly initialised replicas differ until DeepSpeed broadcasts them; pretrained ones start identical.
    place(stage, model, device, seed=seed * 100_003 + rank, weights=pretrained)
    del model
    if cfg.compile:
        compile_stage(stage)
    engine, global_norm = build_role_engine(
        stage,
        ds_config,
        cfg,
        data_parallel_group=dp.group,
        micro_batch_size=micro_batch_size,
        norm_domain_size=dp.size,
        # Expert grads sum over the tokens of all lanes; DeepSpeed averages over the edp replicas only.
        grad_scale=1.0 if role.is_attention else layout.expert_data_parallel / layout.lanes,
    )
    costs = schedule_costs(stage.config.to_dict(), layout, cfg, seq_len=seq_len, micro_batch_size=micro_batch_size)
    schedule = generate(
        PipeShape(layout.depth, layout.num_layers, moe), cfg.micro_batches, costs=costs, max_in_flight=cfg.max_in_flight
    )
    check_streams(schedule.streams)
    worker = Worker("A" if role.is_attention else "F", role.group)
    mailbox = Mailbox(
        exchange,
        hidden=stage.config.hidden_size,
        top_k=top_k,
        dtype=dtype,
        weight_dtype=weight_dtype,
        device=device,
        comm_stream=cfg.comm_stream,
        resend=cfg.resend,
    )
    if role.is_attention:
        aux_coef = stage.config.router_aux_loss_coef if aux_loss_enabled(stage.config) else None
        runner = AttentionRunner(
            engine,
            stage,
            layout,
            moe_layers=moe,
            top_k=top_k,
            num_micro_batches=cfg.micro_batches,
            micro_batch_size=micro_batch_size,
            aux_coef=aux_coef,
            activation_checkpointing=cfg.activation_checkpointing,
            resend=cfg.resend,
        )
    else:
        runner = ExpertRunner(
            engine,
            stage,
            top_k=top_k,
            weight_dtype=weight_dtype,
            activation_checkpointing=cfg.activation_checkpointing,
            resend=cfg.resend,
        )
    name = f"rank {rank} {worker} {'lane' if role.is_attention else 'ffn'} {role.index}"
    executor = AFPipeExecutor(
        engine=engine,
        runner=runner,
        mailbox=mailbox,
        schedule=AFPipeSchedule(schedule, worker),
        global_norm=global_norm,
        name=name,
        comm_timeout_s=cfg.comm_timeout_s,
    )
    return RankRuntime(layout, role, executor, stage, engine)


def schedule_costs(
    config: dict[str, Any], layout: Layout, cfg: DisagMoEConfig, *, seq_len: int | None, micro_batch_size: int
) -> Costs | None:
    """The planner's per-task seconds for this job (same inputs on every rank, so the same schedule everywhere);
    None (unit costs) when the sequence length is not known."""
    if seq_len is None:
        return None
    return runtime_costs(
        config,
        layout,
        seq_len=seq_len,
        micro_batch_size=micro_batch_size,
        cluster=cfg.cluster,
        profile=cfg.profile,
        resend=cfg.resend,
    )


def preflight(model_dir: str | Path, cfg: DisagMoEConfig, ds_config: dict[str, Any], world_size: int) -> Layout:
    """Validate the layout against the model config and the world size before any rank starts (no weights read)."""
    config = load_config(model_dir)
    family = family_of(config)
    layout = cfg.layout(num_layers=config.num_hidden_layers, num_experts=getattr(config, family.num_experts_attr))
    layout.check_world_size(world_size)
    _check_layout_fits(layout, _moe_pattern(config), ds_config)
    return layout


def _moe_pattern(config) -> tuple[bool, ...]:
    """Which layers have routed experts, from the config alone (the rules of hf-notes section 1)."""
    L = config.num_hidden_layers
    if hasattr(config, "first_k_dense_replace"):
        return tuple(i >= config.first_k_dense_replace for i in range(L))
    if hasattr(config, "mlp_only_layers"):
        step = getattr(config, "decoder_sparse_step", 1) or 1
        return tuple(i not in config.mlp_only_layers and (i + 1) % step == 0 for i in range(L))
    return (True,) * L


def _check_layout_fits(layout: Layout, moe: tuple[bool, ...], ds_config: dict[str, Any]) -> None:
    for g in range(layout.depth):
        if not any(moe[layer] for layer in layout.layers_of_group(g)):
            raise LayoutError(
                f"F-group {g} would own no MoE layer (layers {layout.layers_of_group(g)} are dense); "
                "choose a depth whose groups all contain an MoE layer"
            )
    _check_zero(layout, ds_config)


def _check_zero(layout: Layout, ds_config: dict[str, Any]) -> None:
    stage = ds_config.get("zero_optimization", {}).get("stage", 0)
    if stage >= 2 and layout.expert_data_parallel > 1:
        raise ConfigError(
            "ZeRO stage 2 with expert_data_parallel > 1 is not supported: replicas routing different tokens "
            "produce gradients in different orders; use zero_optimization.stage 1"
        )


def _build_stage(model: nn.Module, layout: Layout, role: RankRole) -> nn.Module:
    layers = layout.layers_of_group(role.group)
    if role.is_attention:
        return AttentionStage(model, layers, with_embedding=role.group == 0, with_head=role.group == layout.head_group)
    experts = layout.expert_range(role.ep_rank)
    return ExpertStage(model, layers, experts.start, experts.stop)


def _router_facts(model: nn.Module, moe: tuple[bool, ...]) -> tuple[int, torch.dtype]:
    """Top-k and the dtype of the routing weights (fp32 for Mixtral/DeepSeek even in bf16 models)."""
    layer = model.model.layers[moe.index(True)]
    router = router_of(family_of(model.config), layer)
    param = next(model.parameters())
    with torch.no_grad():
        _, weights, _ = router(torch.zeros(1, model.config.hidden_size, dtype=param.dtype, device=param.device))
    return router.top_k, weights.dtype
