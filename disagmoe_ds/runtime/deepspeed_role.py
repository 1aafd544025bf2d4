"""One DeepSpeed engine per rank over its role's module (attention stage or expert stage).

Why role engines: DeepSpeed's PipelineEngine assumes a Cartesian pipe x data grid (equal rank counts per stage)
and ZeRO <= 1, while the allocator needs unequal attention/FFN groups and ZeRO-2. Each rank therefore builds a
plain ``DeepSpeedEngine`` with a role mpu whose data-parallel group is:

* attention rank: the lanes of its A-group (the attention parameters' replicas);
* FFN rank: the expert-data-parallel replicas of its expert shard. An FFN engine holds nothing but its shard, so
  the role's data-parallel group *is* DeepSpeed's expert-data-parallel group: ZeRO shards the optimizer state and
  averages the gradients over it, exactly what DeepSpeed's MoE parameter groups do inside a mixed engine.

Two corrections make the result equal to one HF model trained on the whole batch:

* expert gradients are sums over the tokens of all d lanes of the A-group, while DeepSpeed averages over the
  ``edp`` replicas only; a gradient hook scales them by ``edp / d``;
* gradient clipping must use the norm over *all* unique parameters. Each engine computes its role's norm as
  usual; ``GlobalGradNorm`` combines them with one world all-reduce and hands the global norm back to DeepSpeed's
  own clipping code.

The co-located mode builds its engine here too (``build_engine``), over a module that holds both kinds of
parameters (DeepSpeed's MoE conventions, ``colocated.model``), with its own ``GradNorm`` (``colocated.executor``).
"""

from __future__ import annotations

import copy
import logging
import warnings
from collections.abc import Iterable, Iterator
from contextlib import contextmanager, nullcontext
from typing import Any, Protocol

import deepspeed
import torch
import torch.distributed as dist
from deepspeed import DeepSpeedEngine
from deepspeed.moe.utils import is_moe_param
from deepspeed.runtime.bf16_optimizer import BF16_Optimizer
from deepspeed.runtime.zero.stage_1_and_2 import DeepSpeedZeroOptimizer
from torch import nn

from disagmoe_ds.config import SECTION, effective_zero_stage
from disagmoe_ds.errors import ConfigError
from disagmoe_ds.jsonfile import JsonObject
from disagmoe_ds.models.expert_shard import ExpertShard
from disagmoe_ds.models.tensor_parallel import shard_of
from disagmoe_ds.runtime import ds_patches


class RoleMPU:
    """The ``mpu`` DeepSpeed consults: data parallel = the role's replica group, no model parallelism."""

    def __init__(self, data_parallel_group: dist.ProcessGroup):
        self._dp = data_parallel_group

    def get_data_parallel_group(self) -> dist.ProcessGroup:
        return self._dp

    def get_data_parallel_world_size(self) -> int:
        return dist.get_world_size(self._dp)

    def get_data_parallel_rank(self) -> int:
        return dist.get_rank(self._dp)

    def get_model_parallel_group(self) -> None:
        return None

    def get_model_parallel_world_size(self) -> int:
        return 1

    def get_model_parallel_rank(self) -> int:
        return 0

    get_tensor_model_parallel_group = get_model_parallel_group
    get_tensor_model_parallel_world_size = get_model_parallel_world_size
    get_tensor_model_parallel_rank = get_model_parallel_rank


MONITOR_SECTIONS = ("tensorboard", "wandb", "csv_monitor", "comet")  # DeepSpeed's monitors


def role_ds_config(
    ds_config: JsonObject,
    *,
    micro_batches: int,
    micro_batch_size: int,
    dp_size: int,
    stage: int | None = None,
    offload_optimizer: bool | None = None,
) -> JsonObject:
    """The user's ds_config adapted to one role engine, at ZeRO ``stage``: its side's effective stage (the mode's
    ``zero_stage_of``, which checked it), or None for the ds_config's own, checked here; ``offload_optimizer``: its
    side's ZeRO-Offload (host memory, the ds_config's settings of it where it has them), or None for the ds_config's.

    Gradient accumulation is owned by the AF-Pipe executor (one ``step()`` per batch after many partial
    backwards), so ``managed_gradient_accumulation`` is off and the batch sizes are made consistent. At stage 3
    every parameter is sharded (DeepSpeed keeps parameters under 1e5 elements whole by default; the ones an expert
    shard has are its biases) unless the ds_config says otherwise. The monitor sections are the job's (rank 0
    writes every step's scalars there, ``train.progress``): an engine of its own would log on another x axis.
    """
    config = copy.deepcopy(ds_config)
    for section in (SECTION, *MONITOR_SECTIONS):
        config.pop(section, None)
    if config.get("fp16", {}).get("enabled"):
        raise ConfigError('"fp16" is not supported by DisagMoE-DS; use "bf16": {"enabled": true} or fp32')
    config["train_micro_batch_size_per_gpu"] = micro_batch_size
    config["gradient_accumulation_steps"] = micro_batches
    config["train_batch_size"] = micro_batch_size * micro_batches * dp_size
    config["managed_gradient_accumulation"] = False
    config.setdefault("steps_per_print", 10**9)
    config.setdefault("gradient_clipping", 0.0)
    optimizer = config.setdefault("optimizer", {"type": "AdamW", "params": {"lr": 1e-3}})
    if not torch.cuda.is_available() and optimizer.get("type", "").lower() in ("adam", "adamw"):
        optimizer.setdefault("params", {})["torch_adam"] = True  # FusedAdam would JIT-compile for minutes on CPU
    if stage is None:  # one engine over every parameter: the ds_config's own stage
        stage = effective_zero_stage(config)
    zero = config.setdefault("zero_optimization", {})
    zero["stage"] = stage
    if offload_optimizer is False:
        zero.pop("offload_optimizer", None)
    elif offload_optimizer:
        zero["offload_optimizer"] = {**zero.get("offload_optimizer", {}), "device": "cpu"}
    if stage == 3:
        zero.setdefault("stage3_param_persistence_threshold", 0)
    return config


def scale_gradients(module: nn.Module, factor: float) -> None:
    """Multiply every parameter gradient by ``factor`` as autograd produces it (before DeepSpeed sees it)."""
    if factor == 1.0:
        return
    for param in module.parameters():
        if param.requires_grad:
            param.register_hook(lambda grad, f=factor: grad * f)


class GradNorm(Protocol):
    """The gradient norm a rank's engine clips with: over every unique parameter of the job, the same on every rank.

    ``install(engine)`` once, after ``deepspeed.initialize``; after each ``step()``, ``last_norm`` is that step's
    norm (None where nothing computed it: ZeRO 0 with clipping off). ``GlobalGradNorm`` (a role engine),
    ``colocated.executor.ColocatedGradNorm`` (a co-located engine).
    """

    def install(self, engine: DeepSpeedEngine) -> None: ...

    @property
    def last_norm(self) -> float | None: ...


class GlobalGradNorm:
    """Turns each role engine's norm into the norm over all unique parameters of the model (a ``GradNorm``).

    Every rank of a *norm domain* (the ranks that hold the same role norm: the lanes of an A-group, or the
    replicas of an expert shard) contributes ``norm**2 / domain_size`` to one world all-reduce, so every unique
    parameter is counted exactly once. ``shard_domain``: an attention rank with tensor parallelism, whose engine's
    second parameter group holds its head shards (``tensor_parallel_groups``), replicated over fewer ranks (the
    lanes of its TP rank) than the first group (a co-located rank's later groups, its expert slices, too); ZeRO
    1/2's norm of each group then counts with its own domain.
    """

    def __init__(self, domain_size: int, shard_domain: int | None = None):
        self.domain_size = domain_size
        self.shard_domain = shard_domain
        self.last_norm: float | None = None

    def combine(self, role_norm: torch.Tensor) -> torch.Tensor:
        return self._combined([role_norm], [self.domain_size])

    def combine_groups(self, group_norms: list[torch.Tensor]) -> torch.Tensor:
        """The norms of the replicated parameters' group, then of groups that each hold shards (or expert slices)."""
        assert self.shard_domain is not None, "replicated and sharded groups"
        return self._combined(group_norms, [self.domain_size] + [self.shard_domain] * (len(group_norms) - 1))

    def _combined(self, norms: list[torch.Tensor], domains: list[int]) -> torch.Tensor:
        total = sum(n.detach().double().reshape(1).to(norms[0].device) ** 2 / d for n, d in zip(norms, domains))
        assert isinstance(total, torch.Tensor)
        dist.all_reduce(total)
        norm = total.sqrt().to(norms[0].dtype).reshape(norms[0].shape)
        self.last_norm = norm.item()
        return norm

    def install(self, engine: DeepSpeedEngine) -> None:
        """Route the engine's clipping norm through ``combine`` (ZeRO optimizer, or the fp32 engine path)."""
        stage = engine.zero_optimization_stage()
        if stage in (1, 2) and self.shard_domain is not None:
            ds_patches.combine_zero_group_norms(engine.optimizer, self.combine_groups)
        elif stage in (1, 2):
            ds_patches.combine_zero_norm(engine.optimizer, self.combine)
        elif stage == 3:
            ds_patches.combine_zero3_norm(engine.optimizer, self.combine)
        else:  # plain fp32 engine: DeepSpeed clips with torch's clip_grad_norm_ in clip_fp32_gradients
            ds_patches.replace_fp32_clipping(engine, lambda: self._clip_fp32(engine))

    def _clip_fp32(self, engine: DeepSpeedEngine) -> None:
        params = [p for p in engine.module.parameters() if p.grad is not None]
        by_kind = [[p.grad for p in params if (shard_of(p) is not None) is sharded] for sharded in (False, True)]
        norms = [_norm(grads, like=params[0].grad) for grads in by_kind]  # whole parameters, then head shards
        norm = self.combine(norms[0]) if self.shard_domain is None else self.combine_groups(norms)
        clip_by_norm([p.grad for p in params], norm, engine.gradient_clipping())


def _norm(grads: list[torch.Tensor], *, like: torch.Tensor) -> torch.Tensor:
    """The L2 norm of ``grads`` together (0 for none)."""
    if not grads:
        return like.new_zeros(())
    norm: torch.Tensor = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g) for g in grads]))
    return norm  # (torch's linalg functions are untyped builtins)


def clip_by_norm(grads: Iterable[torch.Tensor], norm: torch.Tensor | float, max_norm: float) -> None:
    """Scale ``grads`` in place as ``torch.nn.utils.clip_grad_norm_`` does when their total norm is ``norm``."""
    coef = max_norm / (norm + 1e-6)
    if coef < 1:
        for grad in grads:
            grad.mul_(coef)


def zero_grads_of_untouched(engine: DeepSpeedEngine) -> None:
    """Give the parameters no token reached this step (an expert nobody chose) a zero gradient, before ``step()``.

    Replicas must reduce the same buckets; a zero backward through DeepSpeed (not ``p.grad = 0``) also sets up its
    reduction buffers on a rank where no gradient was produced at all. ZeRO-2 reduces (and clears ``p.grad``)
    during each backward instead, and every backward of an expert shard reaches all its parameters
    (``ExpertShard.forward``), so it needs none of this.
    """
    if engine.zero_optimization_stage() >= 2:
        return
    missing = [p for p in engine.module.parameters() if p.requires_grad and p.grad is None]
    if missing:
        engine.backward(torch.stack([p.reshape(-1)[0] for p in missing]).sum() * 0, scale_wrt_gas=False)


def discard_gradients(engine: DeepSpeedEngine) -> None:
    """Drop every gradient of the step so far without stepping, so that the step can run again from the same
    weights (a step that outgrew the exchange capacity: ``routing.Capacity``).

    ZeRO 1/2: as ``engine.step()`` would (ZeRO-2 first reduces what the step's backwards accumulated), then through
    DeepSpeed's own path for a step with an fp16 overflow (``step()`` finding an overflow clears the 16-bit
    gradients and ZeRO-2's reduced partitions, and updates nothing), the check forced to find one; the BF16
    optimizer (ZeRO-0 with bf16): its fp32 accumulators too; otherwise the parameters' ``.grad``. ZeRO-3 and
    optimizer offload are refused with ``capacity_factor`` by the config.
    """
    optimizer = engine.optimizer
    if isinstance(optimizer, DeepSpeedZeroOptimizer):
        if engine.zero_optimization_partition_gradients():  # ZeRO-2 holds the step's backwards unreduced so far
            optimizer.finalize_gradient_accumulation_boundary()  # (a collective: every replica discards together)
        ds_patches.step_as_overflow(optimizer)
    elif isinstance(optimizer, BF16_Optimizer):
        optimizer.zero_grad(set_to_none=True)
    for param in engine.module.parameters():
        param.grad = None


def gather_read_parameters(module: nn.Module) -> None:
    """Make ZeRO-3 gather what each ``ExpertShard`` of ``module`` reads around its forward and backward.

    ZeRO-3 gathers a module's own parameters in hooks around that module's forward and backward; a shard's forward
    reads its HF experts module's fused tensors itself (grouped GEMMs) instead of calling that module, whose hooks
    would then not fire. Registered as the shard's external parameters, they are gathered with the shard (HF's
    module untouched; where the shard does call it, as GPT-OSS does, its own hooks find them gathered).
    """
    for shard in module.modules():
        if isinstance(shard, ExpertShard):
            for param in shard.experts.parameters():
                deepspeed.zero.register_external_parameter(shard, param)


@contextmanager
def _scheduler_start_unlogged() -> Iterator[None]:
    """DeepSpeed's warm-up schedulers read their own rate while they are built and warn that they have not started
    (once per rank: a line nobody can act on), and that a warm-up is longer than the run (the banner says that
    once); other messages pass."""

    def keep(record: logging.LogRecord) -> bool:
        message = record.getMessage()
        return "scheduler before it has started" not in message and "is less than warmup_num_steps" not in message

    ds_logger = logging.getLogger("DeepSpeed")
    ds_logger.addFilter(keep)
    try:
        yield
    finally:
        ds_logger.removeFilter(keep)


ParamGroups = list[nn.Parameter] | list[dict[str, Any]]  # ``deepspeed.initialize``'s model_parameters


def tensor_parallel_groups(module: nn.Module) -> ParamGroups:
    """The trained parameters for ``deepspeed.initialize``: one list, or with attention heads in shards
    (``models.tensor_parallel``) the replicated parameters, then the shards, then (a co-located rank) one group per
    expert group, already split as DeepSpeed's MoE engine would (it would add an empty expert group after the
    shards'). Their norms count over different replicas: ``GlobalGradNorm``."""
    params = [p for p in module.parameters() if p.requires_grad]
    shards = [p for p in params if shard_of(p) is not None]
    if not shards:
        return params
    experts: dict[str, list[nn.Parameter]] = {}
    for p in params:
        if is_moe_param(p):
            experts.setdefault(p.group_name, []).append(p)  # type: ignore[attr-defined]  # set by DeepSpeed MoE
    replicated = [p for p in params if shard_of(p) is None and not is_moe_param(p)]
    groups: list[dict[str, Any]] = [{"params": replicated, "name": "replicated"}, {"params": shards, "name": "shards"}]
    return groups + [{"params": ps, "name": name, "moe": True} for name, ps in experts.items()]


def build_engine(
    module: nn.Module,
    ds_config: JsonObject,
    *,
    micro_batches: int,
    micro_batch_size: int,
    data_parallel_group: dist.ProcessGroup,
    grad_scale: float = 1.0,
    zero_stage: int | None = None,
    offload_optimizer: bool | None = None,
) -> DeepSpeedEngine:
    """``deepspeed.initialize`` over one rank's module (a role stage, or a co-located model), with the corrections
    described in the module docstring; the caller installs the rank's ``GradNorm``.

    Args:
        data_parallel_group: the replicas of the module's parameters (the ``RoleMPU``'s group).
        grad_scale: every gradient is multiplied by it as autograd produces it (``scale_gradients``).
        zero_stage: the rank's side's ZeRO stage (default: the ds_config's); 3 shards the module's parameters.
        offload_optimizer: the rank's side's ZeRO-Offload of the optimizer to host memory (default: the ds_config's).
    """
    mpu = RoleMPU(data_parallel_group)
    config = role_ds_config(
        ds_config,
        micro_batches=micro_batches,
        micro_batch_size=micro_batch_size,
        dp_size=mpu.get_data_parallel_world_size(),
        stage=zero_stage,
        offload_optimizer=offload_optimizer,
    )
    scale_gradients(module, grad_scale)
    # DeepSpeed's ZeRO gathers call it under its old name; torch then warns once per rank about DeepSpeed's code.
    warnings.filterwarnings("ignore", message=r"`torch.distributed.all_gather_into_tensor` is deprecated")
    stage3 = config["zero_optimization"]["stage"] == 3
    if stage3:
        gather_read_parameters(module)
    barriers = ds_patches.barriers_within(data_parallel_group) if stage3 else nullcontext()
    with barriers, _scheduler_start_unlogged():
        engine, *_ = deepspeed.initialize(
            model=module, model_parameters=tensor_parallel_groups(module), config=config, mpu=mpu
        )
    if engine.zero_optimization_stage() in (1, 2) and engine.zero_cpu_offload():
        ds_patches.accumulate_offloaded_across_backwards(engine.optimizer)  # a backward per chunk: sum them all
    if engine.zero_optimization_stage() == 2:
        ds_patches.allow_backward_without_gradients(engine.optimizer)
    elif engine.zero_optimization_stage() == 3:
        ds_patches.accumulate_across_backwards(engine.optimizer)
    return engine
