"""Every DeepSpeed method DisagMoE-DS replaces, in one module, with the internals each one relies on.

Written against DeepSpeed 0.19.8 (``PINNED``, what setup.py installs). ``INTERNALS`` names, per patch, the
attributes of the DeepSpeed object it reads or replaces (most of them not public API); each patch checks them
before it changes anything, so that a DeepSpeed whose internals moved fails at engine build in one line naming the
attribute and the pinned version, not inside a training step. ``tests/test_ds_patches.py`` checks the table against
the installed DeepSpeed on real engines of every ZeRO stage.

They are applied by ``deepspeed_role`` (role and co-located engines) and ``colocated.executor``.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING

import deepspeed
import torch
import torch.distributed as dist
from deepspeed.runtime.utils import combine_grad_norm_groups

from disagmoe_ds.errors import DisagMoEError

if TYPE_CHECKING:  # the objects patched (DeepSpeed is untyped: to a type checker, documentation)
    from deepspeed import DeepSpeedEngine
    from deepspeed.runtime.zero.stage3 import DeepSpeedZeroOptimizer_Stage3
    from deepspeed.runtime.zero.stage_1_and_2 import DeepSpeedZeroOptimizer

PINNED = "0.19.8"

# The attributes each patch reads or replaces on the DeepSpeed object it is given.
INTERNALS: dict[str, tuple[str, ...]] = {
    "allow_backward_without_gradients": (  # ZeRO-2 optimizer
        "reduce_ipg_grads",
        "ipg_buckets",
        "extra_large_param_to_reduce",
        "contiguous_gradients",
    ),
    "combine_zero_norm": ("scaled_global_norm",),  # ZeRO-1/2 optimizer
    "combine_zero_group_norms": (  # ZeRO-1/2 optimizer
        "scaled_global_norm",
        "get_grad_norm_direct",
        "complete_grad_norm_calculation_for_cpu_offload",
    ),
    "combine_zero3_norm": ("_get_norm_groups",),  # ZeRO-3 optimizer
    "replace_fp32_clipping": ("clip_fp32_gradients",),  # engine without a ZeRO optimizer
    "step_as_overflow": ("check_grad_overflow", "check_overflow", "overflow", "step"),  # ZeRO-1/2 optimizer
    "accumulate_across_backwards": ("partition_grads", "micro_step_id", "grad_partitions_flat_buffer", "step"),
    "accumulate_offloaded_across_backwards": (  # ZeRO-1/2 optimizer with cpu_offload
        "async_accumulate_grad_in_cpu_via_gpu",
        "accumulated_grads_in_cpu",
        "micro_step_id",
        "step",
    ),
    "barriers_within": ("barrier",),  # deepspeed.comm
}


class DeepSpeedInternalsError(DisagMoEError):
    """The installed DeepSpeed lacks an internal that a patch relies on."""


def require(obj: object, patch: str) -> None:
    """Raise unless ``obj`` has every attribute ``patch`` relies on (``INTERNALS``)."""
    missing = [name for name in INTERNALS[patch] if not hasattr(obj, name)]
    if missing:
        raise DeepSpeedInternalsError(
            f"DeepSpeed {deepspeed.__version__}'s {type(obj).__name__} has no {', '.join(missing)}, which "
            f"DisagMoE-DS's {patch} patch relies on (disagmoe_ds/runtime/ds_patches.py, written against DeepSpeed "
            f"{PINNED}); install deepspeed=={PINNED}"
        )


def allow_backward_without_gradients(optimizer: DeepSpeedZeroOptimizer) -> None:
    """Let a ZeRO-2 backward reach no parameter of the engine.

    ZeRO-2 allocates its gradient buckets at a backward's first parameter gradient and frees them when the backward
    ends, where it reduces the last bucket unconditionally. A backward that produces no parameter gradient (a chunk
    whose trainable parameters it does not reach) would make DeepSpeed index a bucket that was never allocated
    (``IndexError`` in ``reduce_ipg_grads``). With nothing in any bucket there is nothing to reduce, so that call is
    skipped; every other call is DeepSpeed's. Expert shards never need it: their forward reaches every parameter
    even with no token routed to them (``ExpertShard.forward``), so that their replicas reduce the same buckets.
    """
    require(optimizer, "allow_backward_without_gradients")
    reduce = optimizer.reduce_ipg_grads

    def reduce_allocated(comm_dtype: torch.dtype | None = None) -> None:
        buckets = optimizer.ipg_buckets.values()
        nothing = all(not b.buffer and b.elements == 0 for b in buckets) and not optimizer.extra_large_param_to_reduce
        if optimizer.contiguous_gradients and nothing:
            return
        reduce(comm_dtype)

    optimizer.reduce_ipg_grads = reduce_allocated


def combine_zero_norm(optimizer: DeepSpeedZeroOptimizer, combine: Callable[[torch.Tensor], torch.Tensor]) -> None:
    """ZeRO-1/2: DeepSpeed clips with ``combine`` of the norm it computed."""
    require(optimizer, "combine_zero_norm")
    own = optimizer.scaled_global_norm
    optimizer.scaled_global_norm = lambda *a, **k: combine(own(*a, **k))


def combine_zero_group_norms(
    optimizer: DeepSpeedZeroOptimizer, combine: Callable[[list[torch.Tensor]], torch.Tensor]
) -> None:
    """ZeRO-1/2: DeepSpeed clips with ``combine`` of the norms it computed for each parameter group, in group order
    (recorded as ``scaled_global_norm`` computes them; its own combination is dropped)."""
    require(optimizer, "combine_zero_group_norms")
    own = optimizer.scaled_global_norm
    recorded: list[torch.Tensor] = []

    def recording(method: Callable[..., torch.Tensor]) -> Callable[..., torch.Tensor]:
        def record(*args: object, **kwargs: object) -> torch.Tensor:
            norm = method(*args, **kwargs)
            recorded.append(norm)
            return norm

        return record

    optimizer.get_grad_norm_direct = recording(optimizer.get_grad_norm_direct)
    offloaded = optimizer.complete_grad_norm_calculation_for_cpu_offload
    optimizer.complete_grad_norm_calculation_for_cpu_offload = recording(offloaded)

    def scaled_global_norm(*args: object, **kwargs: object) -> torch.Tensor:
        recorded.clear()
        own(*args, **kwargs)
        return combine(list(recorded))

    optimizer.scaled_global_norm = scaled_global_norm


def combine_zero3_norm(
    optimizer: DeepSpeedZeroOptimizer_Stage3, combine: Callable[[torch.Tensor], torch.Tensor]
) -> None:
    """ZeRO-3: ``step()`` clips with the L2 combination of the group norms; it gets ``combine`` of it instead."""
    require(optimizer, "combine_zero3_norm")
    own = optimizer._get_norm_groups
    optimizer._get_norm_groups = lambda: [combine(combine_grad_norm_groups(own()))]


def replace_fp32_clipping(engine: DeepSpeedEngine, clip: Callable[[], None]) -> None:
    """An engine without a ZeRO optimizer clips through ``clip`` instead of torch's ``clip_grad_norm_``."""
    require(engine, "replace_fp32_clipping")
    engine.clip_fp32_gradients = clip


def step_as_overflow(optimizer: DeepSpeedZeroOptimizer) -> None:
    """ZeRO-1/2: one ``step()`` through DeepSpeed's path for an fp16 overflow (the gradients and ZeRO-2's reduced
    partitions cleared, nothing updated), the check forced to find one."""
    require(optimizer, "step_as_overflow")
    checking = optimizer.check_grad_overflow
    optimizer.check_grad_overflow = True
    optimizer.check_overflow = lambda *args, **kwargs: setattr(optimizer, "overflow", True)
    try:
        optimizer.step()
    finally:
        del optimizer.check_overflow  # the method again
        optimizer.check_grad_overflow, optimizer.overflow = checking, False


def accumulate_across_backwards(optimizer: DeepSpeedZeroOptimizer_Stage3) -> None:
    """Make ZeRO-3 sum the gradient partitions of every backward between two ``step()`` calls.

    ZeRO-3 copies a backward's reduced partitions into its gradient buffer while ``micro_step_id`` is 0 and adds
    them after that; only ``engine.forward`` advances the counter and only ``step()`` resets it. The AF-Pipe runs
    its chunks outside ``engine.forward``, and a backward reaches one layer's parameters: so every backward adds,
    into a buffer that is zero at the start of each step (it is allocated zero; ``step`` leaves it zero again).
    """
    require(optimizer, "accumulate_across_backwards")
    partition_grads, step = optimizer.partition_grads, optimizer.step

    def accumulating(params_to_release: object, grad_partitions: object) -> None:
        optimizer.micro_step_id = 1
        partition_grads(params_to_release, grad_partitions)

    def step_then_zero(*args: object, **kwargs: object) -> object:
        result = step(*args, **kwargs)
        optimizer.grad_partitions_flat_buffer.zero_()
        return result

    optimizer.partition_grads, optimizer.step = accumulating, step_then_zero


def accumulate_offloaded_across_backwards(optimizer: DeepSpeedZeroOptimizer) -> None:
    """Make ZeRO-1/2 with optimizer offload sum the gradients of every backward between two ``step()`` calls in
    its host copies.

    Each backward's reduced gradient of a parameter goes to the parameter's host buffer: copied there while
    ``micro_step_id`` is 0 (the step's first backward), added to it after. The AF-Pipe runs a backward per layer
    chunk, so most parameters get their first gradient of a step in a later backward, which added the previous
    step's buffer to it. So every backward adds, into buffers that are zero at the start of each step (allocated
    zero; zeroed again after each ``step``), as ``accumulate_across_backwards`` does for ZeRO-3.
    """
    require(optimizer, "accumulate_offloaded_across_backwards")
    to_host, step = optimizer.async_accumulate_grad_in_cpu_via_gpu, optimizer.step

    def accumulating(param: torch.nn.Parameter) -> None:
        optimizer.micro_step_id = max(optimizer.micro_step_id, 1)
        to_host(param)

    def step_then_zero(*args: object, **kwargs: object) -> object:
        result = step(*args, **kwargs)
        for buffer in optimizer.accumulated_grads_in_cpu.values():
            buffer.zero_()
        return result

    optimizer.async_accumulate_grad_in_cpu_via_gpu, optimizer.step = accumulating, step_then_zero


@contextmanager
def barriers_within(replicas: dist.ProcessGroup) -> Iterator[None]:
    """Inside it, DeepSpeed's world barriers (``group=None``) are barriers of ``replicas`` only.

    ZeRO-3's optimizer set-up places world barriers between its steps (sync points, nothing exchanged); the ranks of
    the other side build engines at another stage that issue none, so those barriers would wait forever. The engine's
    own data-parallel group (the replicas it partitions over) is the set of ranks that must be in step there.
    """
    require(deepspeed.comm, "barriers_within")
    barrier = deepspeed.comm.barrier

    def replica_barrier(group: dist.ProcessGroup | None = None, **kwargs: object) -> object:
        return barrier(group=group or replicas, **kwargs)

    deepspeed.comm.barrier = replica_barrier
    try:
        yield
    finally:
        deepspeed.comm.barrier = barrier
