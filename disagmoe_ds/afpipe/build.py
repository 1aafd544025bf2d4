"""Build everything one rank needs for disaggregated training: ``build_rank`` (and its ``preflight``).

The steps and their order are ``runtime.rank.RankBuilder``'s, shared with the co-located mode; this mode's own:

    layout   ``DisagMoEConfig.layout`` (M attention ranks in p A-groups, N FFN ranks in p F-groups), every
             F-group owning an MoE layer;
    groups   data parallel = the lanes of an A-group or the replicas of an expert shard, plus the exchange
             communicators (``comm.exchange``) over the configured transport;
    module   the rank's role stage cut from the HF model (``AttentionStage`` or ``ExpertStage``);
    engine   expert gradients scaled by ``edp / d``, the norm made global over role domains (``GlobalGradNorm``);
    executor the AF-Pipe schedule of its worker, mailbox and runner (``AFPipeExecutor``); the schedule is generated
             from task costs the rank receives as data (``RankBuilder``'s ``schedule_costs``), so nothing here
             imports the planner.
"""

from __future__ import annotations

from datetime import timedelta

import torch
from torch import nn
from transformers import PretrainedConfig

from disagmoe_ds.afpipe.attention_runner import AttentionRunner
from disagmoe_ds.afpipe.chunk_settings import ChunkSettings
from disagmoe_ds.afpipe.executor import AFPipeExecutor
from disagmoe_ds.afpipe.expert_runner import ExpertRunner
from disagmoe_ds.afpipe.job_schedule import job_schedule, schedule_lines
from disagmoe_ds.afpipe.mailbox import Mailbox
from disagmoe_ds.afpipe.node_fanout import NodeFanOut
from disagmoe_ds.afpipe.offload import ActivationOffloader, offloaded_layers
from disagmoe_ds.comm.exchange import ExchangeComms, ffn_lanes
from disagmoe_ds.comm.routing import Capacity
from disagmoe_ds.comm.transport import make_transport
from disagmoe_ds.config import DisagMoEConfig
from disagmoe_ds.errors import LayoutError
from disagmoe_ds.groups import ProcessGroups, build_process_groups
from disagmoe_ds.jsonfile import JsonObject
from disagmoe_ds.layout import Layout, RankRole
from disagmoe_ds.models.adapters import check_lora
from disagmoe_ds.models.graphs import StageGraphs, graph_stages
from disagmoe_ds.models.model_facts import num_experts_of, residual_shape
from disagmoe_ds.models.moe_pattern import moe_layer_pattern
from disagmoe_ds.models.partial_load import PretrainedWeights, place
from disagmoe_ds.models.parts import AttentionStage, ExpertStage
from disagmoe_ds.models.recompute import apply_selective_recompute
from disagmoe_ds.models.split import aux_loss_enabled
from disagmoe_ds.models.tensor_parallel import check_lane
from disagmoe_ds.runtime.deepspeed_role import GlobalGradNorm
from disagmoe_ds.runtime.lanes import lane_of, split_attention, tensor_parallel_grads
from disagmoe_ds.runtime.rank import RankBuilder, RankParts
from disagmoe_ds.runtime.step import Executor
from disagmoe_ds.schedule import (
    BackwardAttn,
    BackwardExperts,
    Costs,
    Schedule,
    WeightGradAttn,
    WeightGradExperts,
    Worker,
    check_streams,
    layer_in_flight,
    size_sources,
)

__all__ = ["Disaggregated", "build_rank", "preflight"]


class Disaggregated:
    """The disaggregated mode's steps of ``RankBuilder``."""

    def __init__(self, cfg: DisagMoEConfig):
        self.cfg = cfg

    def layout(self, config: PretrainedConfig) -> Layout:
        return self.cfg.layout(num_layers=config.num_hidden_layers, num_experts=num_experts_of(config))

    def check(self, layout: Layout, config: PretrainedConfig, ds_config: JsonObject, *, seq_len: int | None) -> None:
        del ds_config  # the levers it turns on: the preflight's capabilities table (runtime.rank)
        check_lane(config, layout.sequence_parallel, layout.tensor_parallel, seq_len)
        if self.cfg.lora is not None:
            check_lora(config, self.cfg.lora, needs=("attention", "expert"))
        moe = moe_layer_pattern(config.to_dict())
        for g in range(layout.depth):
            if not any(moe[layer] for layer in layout.layers_of_group(g)):
                raise LayoutError(
                    f"F-group {g} would own no MoE layer (layers {layout.layers_of_group(g)} are dense); "
                    "choose a depth whose groups all contain an MoE layer"
                )

    def describe(self, layout: Layout, config: PretrainedConfig, schedule_costs: Costs | None) -> list[str]:
        return schedule_lines(config.to_dict(), layout, self.cfg, schedule_costs)

    def warm_up(self, executor: Executor, seq_len: int, *, evaluates: bool) -> None:
        if self.cfg.compile or self.cfg.cuda_graphs:  # kernels loaded, graphs captured before any exchange
            executor.warm_up(seq_len, packed=True, evaluates=evaluates)  # packed data: positions may restart

    def groups(
        self, layout: Layout, rank: int, *, timeout: timedelta, device: torch.device, tokens_per_micro_batch: int | None
    ) -> ProcessGroups:
        return build_process_groups(
            layout,
            rank,
            timeout=timeout,
            transport=make_transport(self.cfg.transport, timeout),
            device=device,
            # Fixed-size messages need no header: one ep rank, or messages padded to a capacity.
            headerless=tokens_per_micro_batch is not None
            and (layout.exchange_peers == 1 or self.cfg.capacity_factor is not None),
        )

    def module(
        self,
        model: nn.Module,
        layout: Layout,
        groups: ProcessGroups,
        role: RankRole,
        *,
        device: torch.device,
        seed: int,
        weights: PretrainedWeights | None,
    ) -> nn.Module:
        layers = layout.layers_of_group(role.group)
        stage: AttentionStage | ExpertStage
        if role.is_attention:
            stage = AttentionStage(
                model, layers, with_embedding=role.group == 0, with_head=role.group == layout.head_group
            )
        else:
            experts = layout.expert_range(role.ep_rank)
            stage = ExpertStage(model, layers, experts.start, experts.stop)
        place(stage, model, device, seed=seed, weights=weights)
        if isinstance(stage, AttentionStage):
            split_attention(stage, groups)
        if self.cfg.recompute_of("attention" if role.is_attention else "ffn") == "selective":
            apply_selective_recompute(stage)
        return stage

    def zero_stage(self, role: RankRole, ds_config: JsonObject) -> int:
        return self.cfg.zero_stage_of("attention" if role.is_attention else "ffn", ds_config)

    def offload_optimizer(self, role: RankRole, ds_config: JsonObject) -> bool:
        return self.cfg.offload_optimizer_of("attention" if role.is_attention else "ffn", ds_config)

    def grad_scale(self, layout: Layout, role: RankRole) -> float:
        # Expert grads sum over the tokens of all lanes; DeepSpeed averages over the edp replicas only. With TP the
        # loss shares count t times (as with SP) and DeepSpeed averages an attention rank's over d / t replicas.
        return 1.0 / layout.tensor_parallel if role.is_attention else layout.expert_data_parallel / layout.lanes

    def grad_norm(self, layout: Layout, groups: ProcessGroups) -> GlobalGradNorm:
        # A norm domain: the replicas of this rank's parameters (with TP: the whole A-group's lanes for the
        # replicated ones, those of the rank's TP rank for the head shards).
        if groups.tensor_parallel is None:
            return GlobalGradNorm(groups.data_parallel_size)
        return GlobalGradNorm(layout.lanes, shard_domain=groups.data_parallel_size)

    def executor(self, parts: RankParts[Layout]) -> AFPipeExecutor:
        cfg, layout, role, stage = self.cfg, parts.layout, parts.role, _stage(parts)
        schedule = job_schedule(stage.config.to_dict(), layout, cfg, parts.schedule_costs)
        check_streams(schedule.streams)
        worker = Worker("A" if role.is_attention else "F", role.group)
        capacity = self._capacity(parts)
        mailbox = Mailbox(
            _exchange(parts),
            worker=worker,
            size_sources=size_sources(schedule.graph),
            hidden=stage.config.hidden_size,
            top_k=parts.routing.top_k,
            dtype=parts.dtype,
            weight_dtype=parts.routing.weight_dtype,
            device=parts.device,
            comm_stream=cfg.comm_stream,
            resend=cfg.resend,
            moe_layers=parts.routing.moe_layers,
            capacity=capacity,
            residual=residual_shape(stage.config),
            fp8=cfg.fp8,
        )
        graphs = self._graphs(parts, schedule, worker, capacity)
        return AFPipeExecutor(
            engine=parts.engine,
            runner=self._runner(parts, split_layers=split_layers(schedule, worker), graphs=graphs, capacity=capacity),
            mailbox=mailbox,
            stream=schedule.streams[worker],
            grad_norm=parts.grad_norm,
            name=f"rank {parts.rank} {worker} {'lane' if role.is_attention else 'ffn'} {role.index}",
            comm_timeout_s=cfg.comm_timeout_s,
            offloader=self._offloader(parts, schedule, worker),
            before_step=tensor_parallel_grads(parts.engine, parts.module, parts.groups) if role.is_attention else None,
            fp8_cast_once=cfg.fp8_cast_once,
        )

    def _offloader(self, parts: RankParts[Layout], schedule: Schedule, worker: Worker) -> ActivationOffloader | None:
        """The side's offload share of this rank's chunk layers (None: nothing offloaded), prefetching in the order
        the worker's stream runs its backward chunks."""
        side = "attention" if parts.role.is_attention else "ffn"
        layers = [
            layer
            for layer in parts.layout.layers_of_group(parts.role.group)
            if parts.role.is_attention or parts.routing.moe_layers[layer]  # F chunks: the MoE layers only
        ]
        chosen = offloaded_layers(layers, self.cfg.offload_share(side))
        if not chosen:
            return None
        backwards = [i for i in schedule.streams[worker] if isinstance(i, (BackwardAttn, BackwardExperts))]
        return ActivationOffloader(
            chosen,
            device=parts.device,
            params=[*parts.module.parameters(), *parts.module.buffers()],  # a frozen FP8 base's (buffers) stay
            backward_order=[(i.layer, i.micro_batch) for i in backwards],
        )

    def _capacity(self, parts: RankParts[Layout]) -> Capacity | None:
        """The fixed sizes of the m2n messages where the exchange goes without headers (None: it has headers)."""
        if not _exchange(parts).headerless:
            return None
        assert parts.seq_len is not None, "fixed message sizes need the sequence length the ranks were built with"
        return Capacity.initial(
            tokens=parts.seq_len * parts.micro_batch_size // parts.layout.lane_slices,  # a lane's slice
            top_k=parts.routing.top_k,
            ep_size=parts.layout.exchange_peers,
            experts_per_rank=parts.layout.experts_per_peer,
            factor=self.cfg.capacity_factor or 1.0,
        )

    def _graphs(
        self, parts: RankParts[Layout], schedule: Schedule, worker: Worker, capacity: Capacity | None
    ) -> StageGraphs | None:
        """With ``cuda_graphs``: graphs of the rank's parts, each with a slot per micro-batch its stream holds in
        flight for that layer; expert shards only where their rows are fixed (one ep rank, or a capacity)."""
        if not self.cfg.cuda_graphs:
            return None
        in_flight = layer_in_flight(schedule.streams[worker])
        slots = lambda layer: in_flight.get(layer, 1)  # noqa: E731 (a layer the stream never runs: one, unused)
        stage = _stage(parts)
        if isinstance(stage, AttentionStage):
            return graph_stages(slots, attention=stage)
        if capacity is None or parts.layout.node_dedup > 1:
            return None  # rows vary with the routing (or the node's all-to-all): the shards run as they are
        return graph_stages(slots, experts=stage)

    def _runner(
        self,
        parts: RankParts[Layout],
        *,
        split_layers: frozenset[int],
        graphs: StageGraphs | None,
        capacity: Capacity | None,
    ) -> AttentionRunner | ExpertRunner:
        cfg, stage, routing = self.cfg, _stage(parts), parts.routing
        settings = ChunkSettings(
            routing.top_k,
            routing.weight_dtype,
            cfg.recompute_of("attention" if parts.role.is_attention else "ffn") == "full",
            cfg.resend,
            split_layers,
            graphs,
            capacity,
            cfg.fp8,
        )
        if isinstance(stage, ExpertStage):
            lanes = len(ffn_lanes(parts.layout, parts.rank))
            return ExpertRunner(parts.engine, stage, settings, lanes=lanes, fanout=_node_fanout(parts))
        return AttentionRunner(
            parts.engine,
            stage,
            parts.layout,
            settings,
            moe_layers=routing.moe_layers,
            num_micro_batches=cfg.micro_batches,
            micro_batch_size=parts.micro_batch_size,
            aux_coef=stage.config.router_aux_loss_coef if aux_loss_enabled(stage.config) else None,
            sp=lane_of(parts.groups),
        )


def _stage(parts: RankParts[Layout]) -> AttentionStage | ExpertStage:
    """The rank's role stage, as ``Disaggregated.module`` cut it."""
    assert isinstance(parts.module, AttentionStage | ExpertStage)
    return parts.module


def _node_fanout(parts: RankParts[Layout]) -> NodeFanOut | None:
    """An F rank's fan-out inside its node with the node-deduplicated exchange (None without)."""
    group, layout = parts.groups.exchange_node, parts.layout
    if group is None:
        return None
    return NodeFanOut(group, ranks_per_node=layout.node_dedup, experts_per_rank=layout.experts_per_rank)


def _exchange(parts: RankParts[Layout]) -> ExchangeComms:
    """The exchange communicators, which ``build_process_groups`` makes for every disaggregated layout."""
    assert parts.groups.exchange is not None
    return parts.groups.exchange


def split_layers(schedule: Schedule, worker: Worker) -> frozenset[int]:
    """The layers whose backward the worker splits: those its stream runs W tasks of (split backward)."""
    return frozenset(i.layer for i in schedule.streams[worker] if isinstance(i, WeightGradAttn | WeightGradExperts))


build_rank: RankBuilder[Layout, DisagMoEConfig] = RankBuilder(Disaggregated)
preflight = build_rank.preflight
