"""The instructions of AF-Pipe streams: behaviour-free values that the executor dispatches on, type by type, to its
``_exec_*`` methods (``afpipe.executor``); the same objects from the generator to the executor.

A worker's stream is, for each compute task in order: ``WaitRecv`` for each remote input (and for messages sent
ahead of it on the same channel), the compute, ``Send`` for each remote output; ``PostRecv`` placed ahead of
need; then ``ReduceGrads`` and ``OptimizerStep``. With a split backward, ``WeightGrad*`` tasks (no messages) sit
between them where the worker would otherwise idle. Compute
instructions pair with nothing directly: their inputs arrive by ``WaitRecv`` and outputs leave by ``Send``. This
mirrors DeepSpeed's ``PipeInstruction`` classes but does not import deepspeed, so schedules stay testable anywhere.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from disagmoe_ds.schedule.tasks import Task, TaskKind, Transfer


@dataclass(frozen=True)
class Instruction:
    """Base class: one step of a worker's stream."""


@dataclass(frozen=True)
class CommInstruction(Instruction):
    """Base class of the instructions that move one transfer (a hand-off too: its ends are one worker)."""

    transfer: Transfer

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.transfer})"


@dataclass(frozen=True, repr=False)
class PostRecv(CommInstruction):
    """Post a non-blocking receive on the transfer's channel (at run time: counts first, then the payload).

    Pairs with ``Send`` on ``transfer.src_worker``, posted in its send order per channel: p2p matches FIFO, no tags.
    """


@dataclass(frozen=True, repr=False)
class WaitRecv(CommInstruction):
    """Block until the receive has landed; its tensors are held until the compute that reads them.

    Pairs with ``Send`` on ``transfer.src_worker``, in its send order per channel; needs ``PostRecv`` earlier.
    """


@dataclass(frozen=True, repr=False)
class Send(CommInstruction):
    """Start a non-blocking send of a computed tensor; it never blocks the stream.

    Pairs with ``PostRecv`` and ``WaitRecv`` of the same transfer on ``transfer.dst_worker``.
    """


@dataclass(frozen=True)
class ComputeInstruction(Instruction):
    """Base class of the instructions that run one task (a chunk of one micro-batch)."""

    kind: ClassVar[TaskKind]  # the task kind each subclass runs
    layer: int
    micro_batch: int

    @property
    def task(self) -> Task:
        """The task this instruction runs: what its transfers name as their ``src`` or ``dst``."""
        return Task(self.kind, self.layer, self.micro_batch)


@dataclass(frozen=True)
class ForwardAttn(ComputeInstruction):
    """A-side chunk forward: combine, attention, router, shared/dense MLP (``layer == L``: norm, head, loss)."""

    kind = "A_fwd"


@dataclass(frozen=True)
class BackwardAttn(ComputeInstruction):
    """Autograd through a ForwardAttn chunk; its activations live from that ForwardAttn until here."""

    kind = "A_bwd"


@dataclass(frozen=True)
class ForwardExperts(ComputeInstruction):
    """F-side forward: the routed experts of one MoE layer on the tokens received by M2N."""

    kind = "F_fwd"


@dataclass(frozen=True)
class BackwardExperts(ComputeInstruction):
    """Autograd through ForwardExperts: expert weight grads, and token grads for the A-group."""

    kind = "F_bwd"


@dataclass(frozen=True)
class WeightGradAttn(ComputeInstruction):
    """Split backward: the parameter gradients a BackwardAttn chunk deferred; its activations live until here.

    Pairs with nothing: no message in or out, and nothing but ``ReduceGrads`` waits for it.
    """

    kind = "A_wgt"


@dataclass(frozen=True)
class WeightGradExperts(ComputeInstruction):
    """Split backward: the expert weight gradients a BackwardExperts chunk deferred. Pairs with nothing."""

    kind = "F_wgt"


@dataclass(frozen=True)
class ReduceGrads(Instruction):
    """Reduce gradients inside the group (over lanes, or over expert-data-parallel replicas).

    Pairs with ``ReduceGrads`` on every other rank of the same group.
    """


@dataclass(frozen=True)
class OptimizerStep(Instruction):
    """Clip by the global grad norm and step the optimizer.

    Pairs with ``OptimizerStep`` on every worker, since the global norm spans all groups.
    """


_COMPUTES = (ForwardAttn, BackwardAttn, ForwardExperts, BackwardExperts, WeightGradAttn, WeightGradExperts)
COMPUTE_OF_KIND: dict[TaskKind, type[ComputeInstruction]] = {cls.kind: cls for cls in _COMPUTES}


def compute_of(task: Task) -> ComputeInstruction:
    """The instruction that runs ``task``."""
    return COMPUTE_OF_KIND[task.kind](task.layer, task.micro_batch)
