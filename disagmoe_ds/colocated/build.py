"""Build everything one co-located rank needs: ``build_colocated_rank`` (and ``preflight_colocated``).

The steps and their order are ``runtime.rank.RankBuilder``'s, shared with the disaggregated mode; this mode's own:

    layout   ``ColocatedConfig.layout`` (W ranks in pipeline stages, EP groups of ep_size inside a stage, s x t
             lanes of a stage holding a micro-batch in slices);
    groups   per stage, data parallel (its ranks, or those of each TP rank), expert parallel and expert data
             parallel, registered as DeepSpeed's expert groups (``colocated.groups``), the lanes' SP and TP groups;
             with stages, the links between them (``pipeline.StageLinks``);
    module   the attention side of the stage's layers (the embedding on the first, the head on the last; cut for
             TP, Ulysses around its cores: ``runtime.lanes``), the rank's expert slice of them dressed as DeepSpeed
             MoE, and its dispatcher (``ColocatedModel``);
    engine   gradients scaled by 1 / t (the loss shares count t times and DeepSpeed averages over D / t replicas),
             the norm over attention and expert parameters of every stage (``ColocatedGradNorm``);
    executor forward and backward of each micro-batch in turn (``ColocatedExecutor``), or in 1F1B order with the
             other stages (``PipelineExecutor``).
"""

from __future__ import annotations

from datetime import timedelta
from typing import Any, cast

import torch
import torch.distributed as dist
from torch import nn
from transformers import PretrainedConfig

from disagmoe_ds.colocated.executor import ColocatedExecutor, ColocatedGradNorm
from disagmoe_ds.colocated.groups import register_with_deepspeed
from disagmoe_ds.colocated.layout import ColocatedConfig, ColocatedLayout
from disagmoe_ds.colocated.model import ColocatedModel, ExpertStageMoE
from disagmoe_ds.colocated.pipeline import PipelineExecutor, StageLinks
from disagmoe_ds.comm.dispatch import AllToAllDispatcher, LocalDispatcher
from disagmoe_ds.comm.transport import make_transport
from disagmoe_ds.errors import ConfigError
from disagmoe_ds.groups import ProcessGroups, build_process_groups
from disagmoe_ds.layout import RankRole
from disagmoe_ds.models.adapters import check_lora
from disagmoe_ds.models.model_facts import num_experts_of
from disagmoe_ds.models.partial_load import PretrainedWeights, place
from disagmoe_ds.models.parts import AttentionStage, ExpertStage
from disagmoe_ds.models.recompute import apply_selective_recompute
from disagmoe_ds.models.split import aux_loss_enabled
from disagmoe_ds.models.tensor_parallel import check_lane
from disagmoe_ds.runtime.lanes import lane_of, split_attention, tensor_parallel_grads
from disagmoe_ds.runtime.rank import RankBuilder, RankParts
from disagmoe_ds.runtime.step import Executor
from disagmoe_ds.schedule import Costs


class Colocated:
    """The co-located mode's steps of ``RankBuilder``."""

    def __init__(self, cfg: ColocatedConfig):
        self.cfg = cfg
        self.links: StageLinks | None = None  # with pipeline stages: made with the groups

    def layout(self, config) -> ColocatedLayout:
        return self.cfg.layout(num_experts=num_experts_of(config), num_layers=config.num_hidden_layers)

    def check(self, layout: ColocatedLayout, config, ds_config: dict[str, Any], *, seq_len: int | None) -> None:
        check_lane(config, layout.sequence_parallel, layout.tensor_parallel, seq_len)  # any ep_size (ExpertShard)
        if self.cfg.lora is not None:
            check_lora(config, self.cfg.lora, needs=("expert",))  # DeepSpeed's MoE engine needs an expert group
        self.cfg.zero_stage_of("ffn", ds_config)  # checked: one stage for both kinds of parameters
        if self.cfg.cuda_graphs:  # graphs are captured for one micro-batch at a time, every part whole
            if layout.pp_size > 1:
                raise ConfigError(
                    '"disagmoe.cuda_graphs" does not run with co-located pipeline stages yet; turn it off or use one '
                    "stage (pp_size 1)"
                )
            if any(self.cfg.recompute_of(side) != "none" for side in ("attention", "ffn")):
                raise ConfigError(
                    '"disagmoe.cuda_graphs" replays whole parts and cannot recompute inside them in co-located mode; '
                    "turn off the recompute or the CUDA graphs"
                )

    def describe(self, layout: ColocatedLayout, config, schedule_costs: Costs | None) -> list[str]:
        del config, schedule_costs  # no AF-Pipe schedule: one micro-batch at a time, or the pipeline's order
        if layout.ep_size > 1:
            exchange = f"dispatch and combine all-to-alls over {layout.ep_size} ranks on the critical path"
        else:
            exchange = "no token exchange (every rank holds every expert)"
        if layout.pp_size == 1:
            order = "one at a time (forward, backward)"
        elif layout.virtual_stages == 1:
            order = f"1F1B over {layout.pp_size} stages (up to {layout.pp_size} in flight on the first)"
        else:
            order = f"interleaved 1F1B over {layout.pp_size} stages x {layout.virtual_stages} chunks"
        return [
            f"layout: {layout.describe()}",
            f"pipeline: {self.cfg.micro_batches} micro-batches per rank per step, {order}; {exchange}",
        ]

    def warm_up(self, executor: Executor, seq_len: int, *, evaluates: bool) -> None:
        if self.cfg.cuda_graphs:  # captured before the first step (no exchange waits here: compile need not warm)
            executor.warm_up(seq_len, packed=True, evaluates=evaluates)

    def zero_stage(self, role: RankRole, ds_config: dict[str, Any]) -> int:
        del role  # one engine over both kinds of parameters: one stage
        return self.cfg.zero_stage_of("attention", ds_config)

    def offload_optimizer(self, role: RankRole, ds_config: dict[str, Any]) -> bool:
        del role
        return self.cfg.offload_optimizer_of("attention", ds_config)

    def groups(
        self,
        layout: ColocatedLayout,
        rank: int,
        *,
        timeout: timedelta,
        device: torch.device,
        tokens_per_micro_batch: int | None,
    ) -> ProcessGroups:
        del tokens_per_micro_batch  # no exchange
        groups = build_process_groups(layout, rank, timeout=timeout)
        register_with_deepspeed(groups, layout)  # before deepspeed.initialize looks its expert groups up
        if layout.pp_size > 1:
            self.links = StageLinks(make_transport(self.cfg.transport, timeout), layout, rank)
            self.links.warm_up(device)
        return groups

    def module(
        self,
        model: nn.Module,
        layout: ColocatedLayout,
        groups: ProcessGroups,
        role: RankRole,
        *,
        device: torch.device,
        seed: int,
        weights: PretrainedWeights | None,
    ) -> ColocatedModel:
        """Attention side of the stage's layers (every layer with one stage), the expert slice of ``role``, the
        dispatcher. Parts cut from a meta model are filled from ``weights``, or else initialised from ``2 * seed``
        (attention) and ``2 * seed + 1``."""
        config = cast(PretrainedConfig, model.config)
        chunks = layout.chunk_layers(role.group) if layout.pp_size > 1 else (range(config.num_hidden_layers),)
        layers = tuple(layer for chunk in chunks for layer in chunk)
        experts = layout.expert_range(role.ep_rank)
        stage = ExpertStage(model, layers, experts.start, experts.stop)
        first, last = role.group == 0, role.group == layout.pp_size - 1
        attention = AttentionStage(model, layers, with_embedding=first, with_head=last)
        for i, part in enumerate((attention, stage)):
            # Before ExpertStageMoE marks the expert parameters: materialising replaces meta parameters by new ones.
            place(part, model, device, seed=2 * seed + i, weights=weights)
        split_attention(attention, groups)  # TP shards and Ulysses on lanes that share micro-batches
        for side, part in (("attention", attention), ("ffn", stage)):
            if self.cfg.recompute_of(side) == "selective":
                apply_selective_recompute(part)
        moe = None
        if stage.layers:  # a pipeline stage of dense layers alone holds no experts (nor tells DeepSpeed of any)
            moe = ExpertStageMoE(
                stage, num_experts=layout.num_experts, ep_size=layout.ep_size, group_name=layout.expert_group_name
            )
        # The one place the exchange strategy is chosen; the model never branches on it.
        if layout.ep_size == 1:
            dispatcher = LocalDispatcher(experts_per_rank=layout.experts_per_rank, fp8=self.cfg.fp8)
        else:
            assert groups.expert_parallel is not None  # made for ep_size > 1
            dispatcher = AllToAllDispatcher(
                groups.expert_parallel,
                ep_size=layout.ep_size,
                experts_per_rank=layout.experts_per_rank,
                fp8=self.cfg.fp8,
            )
        aux_coef = config.router_aux_loss_coef if aux_loss_enabled(config) else None
        full = frozenset(side for side in ("attention", "ffn") if self.cfg.recompute_of(side) == "full")
        return ColocatedModel(
            attention,
            moe,
            dispatcher,
            aux_coef,
            num_experts=layout.num_experts,
            chunks=tuple(map(tuple, chunks)),
            full_recompute=full,
            lane=lane_of(groups),
        )

    def grad_scale(self, layout: ColocatedLayout, role: RankRole) -> float:
        del role
        # Without TP already the mean over all D * K micro-batches of a stage (colocated.executor); with it the loss
        # shares count t times and DeepSpeed averages over a TP rank's D / t ranks, experts included.
        return 1.0 / layout.tensor_parallel

    def grad_norm(self, layout: ColocatedLayout, groups: ProcessGroups) -> ColocatedGradNorm:
        del groups  # every stage's parameters: the norm spans the world
        return ColocatedGradNorm(
            _world(),
            attention_replicas=layout.stage_size,
            expert_replicas=layout.expert_data_parallel,
            shard_replicas=layout.stage_size // layout.tensor_parallel,
        )

    def executor(self, parts: RankParts[ColocatedLayout]) -> ColocatedExecutor:
        role = parts.role
        common = dict(
            engine=parts.engine,
            num_micro_batches=self.cfg.micro_batches,
            grad_norm=parts.grad_norm,
            name=f"rank {parts.rank} colocated ep {role.ep_rank} edp {role.edp_rank}",
            comm_timeout_s=self.cfg.comm_timeout_s,
            micro_batch_size=parts.micro_batch_size,
            routing=parts.routing,
            fp8_cast_once=self.cfg.fp8_cast_once,
            lane=lane_of(parts.groups),
            before_step=tensor_parallel_grads(parts.engine, cast(ColocatedModel, parts.module).attention, parts.groups),
        )
        if self.links is None:
            return ColocatedExecutor(group=_world(), **common)
        common["name"] = f"rank {parts.rank} colocated stage {role.group} ep {role.ep_rank} edp {role.edp_rank}"
        return PipelineExecutor(
            layout=parts.layout, rank=parts.rank, links=self.links, world=_world(), dtype=parts.dtype, **common
        )


def _world() -> dist.ProcessGroup:
    """The default group (every rank), once the job's process group is up."""
    world = dist.group.WORLD
    assert world is not None, "the process group is initialised before the rank is built"
    return world


build_colocated_rank: RankBuilder[ColocatedLayout, ColocatedConfig] = RankBuilder(Colocated)
preflight_colocated = build_colocated_rank.preflight
