"""Build one rank of either mode, in a fixed order on every rank (collective steps run on all of them).

    1. the rank's model (``partial_load.rank_model``; a meta model allocates nothing) and the layout: the one the
       job's preflight derived, or else derived from the model config alone as the preflight does, checked against
       the world size, the model and ZeRO;
    2. the job's process groups (``groups.build_process_groups``);
    3. the rank's module cut from the model (with LoRA over a checkpoint in FP8 blocks, its base kept in FP8:
       ``fp8_base``), its parts placed on the device (pretrained values, or initialised from the seed and the
       rank), with ``fp8``, its projections in FP8 (``parts.fp8_stage``) and, with ``compile``,
       compiled (``parts.compile_stage``);
    4. its DeepSpeed engine (``deepspeed_role.build_engine``) and the global gradient norm it clips with;
    5. the executor whose ``train_batch`` runs a step.

A mode decides only its ``RankMode`` steps: the layout and its checks, what it adds to the groups, the module, the
gradient scale and norm, and the executor (``afpipe.build.Disaggregated``, ``colocated.build.Colocated``). Each
mode's ``build_rank`` and ``preflight`` are one ``RankBuilder``.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Generic, Protocol, TypeVar, cast

import torch
import torch.distributed as dist
from deepspeed import DeepSpeedEngine
from torch import nn
from transformers import PretrainedConfig

from disagmoe_ds.capabilities.rules import check
from disagmoe_ds.config.levers import job_of
from disagmoe_ds.errors import ConfigError, UnsupportedModelError
from disagmoe_ds.groups import ProcessGroups
from disagmoe_ds.jsonfile import JsonObject
from disagmoe_ds.launch.env import process_device
from disagmoe_ds.layout import JobLayout, RankRole
from disagmoe_ds.models.adapters import add_adapters
from disagmoe_ds.models.attention_kernel import attention_refusal, use_attention
from disagmoe_ds.models.fp8_base import check_fp8_base, keep_base_fp8
from disagmoe_ds.models.loading import load_config
from disagmoe_ds.models.lora_settings import LoraSettings
from disagmoe_ds.models.model_facts import RoutingFacts, routing_facts
from disagmoe_ds.models.moe_pattern import moe_layer_pattern
from disagmoe_ds.models.partial_load import PretrainedWeights, rank_model
from disagmoe_ds.models.parts import compile_stage, fp8_stage
from disagmoe_ds.runtime.deepspeed_role import GradNorm, build_engine
from disagmoe_ds.runtime.step import Executor
from disagmoe_ds.schedule import Costs

LayoutT = TypeVar("LayoutT", bound=JobLayout)  # one mode's layout


class ModeConfig(Protocol):
    """What the builder reads of a mode's config (``DisagMoEConfig``, ``ColocatedConfig``) itself: the sections both
    modes share (``config.sections``' ``Accumulation``, ``Watchdog``, ``Kernels``, ``FineTuning``) and its ZeRO
    stage per side."""

    @property
    def micro_batches(self) -> int: ...

    def zero_stage_of(self, side: str, ds_config: JsonObject) -> int: ...

    def offload_optimizer_of(self, side: str, ds_config: JsonObject) -> bool: ...

    @property
    def comm_timeout_s(self) -> float: ...

    @property
    def compile(self) -> bool: ...

    @property
    def cuda_graphs(self) -> bool: ...

    @property
    def fp8(self) -> bool: ...

    @property
    def fp8_bf16_width(self) -> int: ...

    @property
    def fp8_expert_bf16_width(self) -> int: ...

    @property
    def attention(self) -> str: ...

    @property
    def lora(self) -> LoraSettings | None: ...


ConfigT = TypeVar("ConfigT", bound=ModeConfig)  # one mode's config


@dataclass
class RankRuntime:
    """Everything one rank built, in either mode; ``executor.train_batch`` runs a step. The training loop, its
    checkpoints and its balancing read these fields and never ask which mode built them."""

    layout: JobLayout
    role: RankRole
    executor: Executor
    module: nn.Module
    engine: DeepSpeedEngine


@dataclass(frozen=True)
class RankParts(Generic[LayoutT]):
    """What the shared steps built for this rank, handed to the mode's executor."""

    rank: int
    layout: LayoutT
    role: RankRole
    groups: ProcessGroups
    module: nn.Module
    engine: DeepSpeedEngine
    grad_norm: GradNorm
    routing: RoutingFacts
    dtype: torch.dtype
    device: torch.device
    micro_batch_size: int
    seq_len: int | None
    schedule_costs: Costs | None


class RankMode(Protocol[LayoutT]):
    """One mode's own steps of ``RankBuilder`` (made from the mode's config)."""

    def layout(self, config: PretrainedConfig) -> LayoutT:
        """The validated layout from the HF config alone (the preflight and the build derive it the same way)."""
        ...

    def check(self, layout: LayoutT, config: PretrainedConfig, ds_config: JsonObject, *, seq_len: int | None) -> None:
        """Refuse a layout the model, the ZeRO stage or the sequence length (when known) cannot run, with the fix."""
        ...

    def describe(self, layout: LayoutT, config: PretrainedConfig, schedule_costs: Costs | None) -> list[str]:
        """The start banner's lines about ``layout`` and the mode's pipeline (``schedule_costs``: the job plan's)."""
        ...

    def warm_up(self, executor: Executor, seq_len: int, *, evaluates: bool) -> None:
        """Before the first step, what must not happen inside one (compiled kernels loaded, CUDA graphs captured);
        ``evaluates``: evaluation's forwards too."""
        ...

    def groups(
        self,
        layout: LayoutT,
        rank: int,
        *,
        timeout: timedelta,
        device: torch.device,
        tokens_per_micro_batch: int | None,
    ) -> ProcessGroups:
        """``groups.build_process_groups`` and what the mode adds (exchange communicators, DeepSpeed's registry);
        ``tokens_per_micro_batch``: a lane's B x S when known (fixed-size messages need no header)."""
        ...

    def module(
        self,
        model: nn.Module,
        layout: LayoutT,
        groups: ProcessGroups,
        role: RankRole,
        *,
        device: torch.device,
        seed: int,
        weights: PretrainedWeights | None,
    ) -> nn.Module:
        """The rank's module cut from ``model``, its parts placed on ``device`` (``partial_load.place``: filled from
        ``weights``, or initialised from ``seed``)."""
        ...

    def zero_stage(self, role: RankRole, ds_config: JsonObject) -> int:
        """The ZeRO stage of the rank's engine (its side's, in the disaggregated mode)."""
        ...

    def offload_optimizer(self, role: RankRole, ds_config: JsonObject) -> bool:
        """Whether the rank's engine keeps its optimizer in host memory (its side's, in the disaggregated mode)."""
        ...

    def grad_scale(self, layout: LayoutT, role: RankRole) -> float:
        """The factor on the rank's gradients before DeepSpeed averages them over the data-parallel group."""
        ...

    def grad_norm(self, layout: LayoutT, groups: ProcessGroups) -> GradNorm:
        """The global gradient norm the rank's engine clips with (installed by the builder)."""
        ...

    def executor(self, parts: RankParts[LayoutT]) -> Executor:
        """What runs a step: ``train_batch(batches) -> StepResult``."""
        ...


class RankBuilder(Generic[LayoutT, ConfigT]):
    """One mode, as everything outside it uses it: ``preflight`` before any rank starts, ``describe`` for the start
    banner, then on every rank the build (call it) and ``warm_up``."""

    def __init__(self, mode: Callable[[ConfigT], RankMode[LayoutT]]):
        self.mode = mode

    def __call__(
        self,
        model_dir: str | Path,
        ds_config: JsonObject,
        cfg: ConfigT,
        *,
        micro_batch_size: int,
        dtype: torch.dtype = torch.float32,
        device: torch.device | None = None,
        model: nn.Module | None = None,
        weights: str | Path | None = None,
        seed: int = 0,
        seq_len: int | None = None,
        layout: LayoutT | None = None,
        schedule_costs: Costs | None = None,
    ) -> RankRuntime:
        """Build this rank's part of the job (collective: every rank calls it).

        ``model`` may be passed to skip loading ``model_dir``; ``weights`` is then the HF directory whose safetensors
        fill the parts cut from a meta ``model`` (``--init-from``). Without ``model``, ``model_dir``'s own weights
        fill them (``partial_load.model_to_cut``). A model on the meta device is never materialised whole: each rank
        allocates only the parts it owns, then reads their pretrained values or initialises them (from ``seed`` and
        its rank; DeepSpeed then broadcasts the replicas' first copy). ``seq_len``: the length of every micro-batch
        when known (fixed-size messages). ``layout``: the one the job's preflight derived from the same config
        (``preflight``), so that the rank does not derive and check it again. ``schedule_costs``: the task costs the
        AF-Pipe schedule is generated from, computed before the ranks start (the job plan's, or
        ``planner.runtime_costs.job_costs``); without them every task costs one unit. The co-located mode has no
        schedule to cost.
        """
        mode = self.mode(cfg)
        rank = dist.get_rank()
        device = device or process_device()
        if cfg.cuda_graphs:
            if device.type != "cuda":
                raise ConfigError(
                    f'"cuda_graphs" replays parts as CUDA graphs; rank {rank} runs on {device.type}: turn it off there'
                )
            # The whole rank computes on a stream of its own, and parts are captured on it: DeepSpeed keeps every
            # parameter's gradient accumulator from its set-up on, tied to the stream current then, and a capture on
            # another stream than that one cannot run a backward into it (the legacy stream would wait on capture).
            torch.cuda.set_stream(torch.cuda.Stream(device))
        model, pretrained = rank_model(model_dir, dtype=dtype, model=model, weights=weights)
        use_attention(model, cfg.attention, device)  # before the cut: the parts share the model's config
        if cfg.lora is not None and pretrained is not None and pretrained.block is not None:
            check_fp8_base(cfg.fp8)
            keep_base_fp8(model, pretrained)  # before the cut: each rank allocates and reads its base in FP8
        if layout is None:
            config = cast(PretrainedConfig, model.config)
            layout = self.preflight(config, cfg, ds_config, dist.get_world_size(), seq_len=seq_len)
        else:
            layout.check_world_size(dist.get_world_size())
        role = layout.role_of(rank)
        # A rank waiting longer than this for a peer fails (and the launcher ends the job) instead of hanging.
        tokens = None if seq_len is None else seq_len * micro_batch_size
        timeout = timedelta(seconds=cfg.comm_timeout_s)
        groups = mode.groups(layout, rank, timeout=timeout, device=device, tokens_per_micro_batch=tokens)
        routing = routing_facts(model)
        # Freshly initialised replicas differ until DeepSpeed broadcasts them; pretrained ones start identical.
        module = mode.module(model, layout, groups, role, device=device, seed=seed * 100_003 + rank, weights=pretrained)
        del model
        if cfg.lora is not None:  # the same adapters in every layout: drawn from the run's seed, not the rank's
            add_adapters(module, cfg.lora, seed=seed)
        if cfg.fp8:  # after the adapters: they wrap plain nn.Linear modules
            fp8_stage(module, cfg.fp8_bf16_width, cfg.fp8_expert_bf16_width)
        if cfg.compile:
            compile_stage(module)
        engine = build_engine(
            module,
            ds_config,
            micro_batches=cfg.micro_batches,
            micro_batch_size=micro_batch_size,
            data_parallel_group=groups.data_parallel,
            grad_scale=mode.grad_scale(layout, role),
            zero_stage=mode.zero_stage(role, ds_config),
            offload_optimizer=mode.offload_optimizer(role, ds_config),
        )
        grad_norm = mode.grad_norm(layout, groups)
        grad_norm.install(engine)
        parts = RankParts(  # in field order
            rank,
            layout,
            role,
            groups,
            module,
            engine,
            grad_norm,
            routing,
            dtype,
            device,
            micro_batch_size,
            seq_len,
            schedule_costs,
        )
        return RankRuntime(layout, role, mode.executor(parts), module, engine)

    def preflight(
        self,
        model: str | Path | PretrainedConfig,
        cfg: ConfigT,
        ds_config: JsonObject,
        world_size: int,
        *,
        seq_len: int | None = None,
    ) -> LayoutT:
        """The layout the ranks will build, validated before any rank starts against the model's config (``model``: it,
        or the HF directory it is read from; no weights read), the world size, the ds_config and, when known, the
        sequence length."""
        config = model if isinstance(model, PretrainedConfig) else load_config(model)
        mode = self.mode(cfg)
        if not any(moe_layer_pattern(config.to_dict())):
            raise UnsupportedModelError(
                f"the {config.model_type} config has no MoE layer (every MLP is dense); DisagMoE-DS trains MoE models"
            )
        layout = mode.layout(config)
        layout.check_world_size(world_size)
        check(job_of(config.model_type, cfg, ds_config))  # every lever beside the others and the family, once
        problem = attention_refusal(config, cfg.attention)
        if problem is not None:
            raise ConfigError(problem)
        mode.check(layout, config, ds_config, seq_len=seq_len)
        return layout

    def describe(
        self, cfg: ConfigT, layout: LayoutT, config: PretrainedConfig, schedule_costs: Costs | None
    ) -> list[str]:
        """The start banner's lines about ``layout`` (this mode's ``preflight``) and the pipeline."""
        return self.mode(cfg).describe(layout, config, schedule_costs)

    def warm_up(self, runtime: RankRuntime, cfg: ConfigT, seq_len: int, *, evaluates: bool = False) -> None:
        """Before the first step (every rank): what the mode must not do inside one (``RankMode.warm_up``)."""
        self.mode(cfg).warm_up(runtime.executor, seq_len, evaluates=evaluates)
