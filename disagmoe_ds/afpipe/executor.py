"""Execute one rank's AF-Pipe instruction stream inside its role DeepSpeed engine.

The executor decides nothing: it walks its worker's stream of the schedule's own instructions
(``schedule.instructions``) and dispatches every instruction type through one map to an ``_exec_*`` method
(DeepSpeed's ``_INSTRUCTION_MAP`` pattern). Compute goes to the role runner (``afpipe.runner.Runner``), transfers
to the mailbox; the only state here is the messages between the two: the ``Inbox`` of each task still to run,
filled by ``WaitRecv``, and the ``Outbox`` of each task that ran, emptied by ``Send``.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from contextlib import AbstractContextManager, nullcontext
from dataclasses import replace
from typing import TypeVar, cast

import torch
import torch.distributed as dist
from deepspeed import DeepSpeedEngine

from disagmoe_ds.afpipe.mailbox import Mailbox
from disagmoe_ds.afpipe.offload import ActivationOffloader
from disagmoe_ds.afpipe.runner import Batch, Inbox, Outbox, Runner
from disagmoe_ds.comm.routing import Capacity, pads
from disagmoe_ds.fp8.weight_cache import cast_once_per_step, weights_changed
from disagmoe_ds.launch.watchdog import StallWatch
from disagmoe_ds.runtime.deepspeed_role import GradNorm, discard_gradients, zero_grads_of_untouched
from disagmoe_ds.runtime.step import EvalResult, StepResult, evaluating
from disagmoe_ds.schedule import (
    BackwardAttn,
    BackwardExperts,
    ComputeInstruction,
    ForwardAttn,
    ForwardExperts,
    Instruction,
    OptimizerStep,
    PostRecv,
    ReduceGrads,
    Send,
    Task,
    TimelineEvent,
    WaitRecv,
    WeightGradAttn,
    WeightGradExperts,
    forward_stream,
)
from disagmoe_ds.schedule.trace import Category

_CATEGORY: Mapping[type[Instruction], Category] = {
    PostRecv: "recv",
    WaitRecv: "wait",
    Send: "send",
    ReduceGrads: "optimizer",
    OptimizerStep: "optimizer",
}


logger = logging.getLogger(__name__)


class _Outgrown(Exception):
    """Some m2n message of this step wanted more than the exchange capacity (every rank raises it together)."""

    def __init__(self, capacity: Capacity) -> None:
        super().__init__(capacity)
        self.capacity = capacity  # the one to run the step again at


class AFPipeExecutor:
    """Runs ``train_batch`` for one rank: attention or FFN side, any layout, any number of micro-batches.

    Args:
        stream: the rank's worker's instruction stream (``Schedule.streams[worker]``); an evaluation runs its
            forwards alone (``schedule.forward_stream``).
    """

    def __init__(
        self,
        *,
        engine: DeepSpeedEngine,
        runner: Runner,
        mailbox: Mailbox,
        stream: Sequence[Instruction],
        grad_norm: GradNorm,
        name: str,
        comm_timeout_s: float | None = None,
        offloader: ActivationOffloader | None = None,
        before_step: Callable[[], None] | None = None,
        fp8_cast_once: bool = False,
    ):
        self.engine = engine
        self.fp8_cast_once = fp8_cast_once  # each FP8 weight cast once per step (``fp8.weight_cache``)
        self.before_step = before_step  # after the step's backwards, before DeepSpeed reduces (tensor parallel sums)
        self.offloader = offloader  # saved activations of chosen chunks to host memory (``"offload"``)
        self.runner = runner
        self.mailbox = mailbox
        self.stream, self.forwards = tuple(stream), forward_stream(tuple(stream))
        self.grad_norm = grad_norm
        self.name = name
        self.timeline: list[TimelineEvent] | None = None
        self.stall_watch = StallWatch.before_timeout(comm_timeout_s)  # this rank's stacks if an instruction stalls
        self.reruns = 0  # steps run again at a larger exchange capacity, in all
        self._batches: Sequence[Batch] | None = None  # this step's micro-batches, where this lane reads them
        self._inboxes: dict[Task, Inbox] = {}  # by the task that reads them
        self._outboxes: dict[Task, Outbox] = {}  # by the task that made them, until their sends
        self._evaluating = False  # inside ``eval_batch``: forwards alone, nothing kept for a backward

    def warm_up(self, seq_len: int, *, packed: bool = False, evaluates: bool = False) -> None:
        """Compile and load this rank's compiled kernels before the first step (``compile`` jobs): a kernel loaded
        inside a step can synchronise the GPU behind a receive posted ahead, whose sender waits for this rank.
        ``packed``: the batches carry position ids that may restart (the block-mask graphs too); ``evaluates``:
        ``eval_batch``'s forwards without autograd too."""
        self.runner.warm_up(seq_len, packed=packed, evaluates=evaluates)
        if self.engine.device.type == "cuda":
            torch.cuda.synchronize(self.engine.device)

    def record_timeline(self, enabled: bool = True) -> None:
        self.timeline = [] if enabled else None

    def train_batch(self, batches: list[Batch] | None = None) -> StepResult:
        """One optimizer step. ``batches`` (the micro-batches of input_ids/labels[/position_ids]) on A-group 0.

        A step whose messages outgrew the exchange capacity is discarded and run again, from the same random state,
        at the capacity it needed (``routing.Capacity``): the step's result is the dropless one."""
        start = time.perf_counter()
        random_state = _random_state(self.engine.device) if pads(self.mailbox.capacity) else None
        reruns = 0
        while True:
            try:
                self._run_stream(batches, self.stream)
                break
            except _Outgrown as outgrown:
                discard_gradients(self.engine)
                self._set_capacity(outgrown.capacity)
                _set_random_state(self.engine.device, random_state)
                reruns += 1
        if self._outboxes or self._inboxes:
            raise RuntimeError(f"{self.name}: the stream left messages unsent {list(self._outboxes)}")
        self.reruns += reruns
        return replace(self._result(time.perf_counter() - start), reruns=reruns)

    def eval_batch(self, batches: list[Batch] | None = None) -> EvalResult:
        """HF's LM loss of ``batches`` (as ``train_batch`` takes them), changing nothing a step reads: the step's
        forwards alone (``schedule.forward_stream``), without autograd or activation offload, the module in eval
        mode, each chunk dropped after its forward. A batch whose messages outgrew the exchange capacity runs again at
        the one it needed, and the step's capacity is restored after."""
        capacity = self.mailbox.capacity
        while True:
            try:
                self._run_forwards(batches)
                break
            except _Outgrown as outgrown:
                self._set_capacity(outgrown.capacity)
        if capacity is not None and self.mailbox.capacity != capacity:  # only a fixed capacity grows
            self._set_capacity(capacity)
        sums = torch.zeros(2, dtype=torch.float64, device=self.engine.device)
        token_sums = self.runner.stats.token_sums
        if token_sums is not None:
            sums += token_sums
        dist.all_reduce(sums)  # only the head lanes contribute
        return EvalResult(sums[0].item(), int(sums[1].item()))

    def _run_forwards(self, batches: list[Batch] | None) -> None:
        self._evaluating = True
        try:
            with evaluating(self.engine.module):
                self._run_stream(batches, self.forwards)
            self.mailbox.flush(backward=False)
            self._check_capacity()
        finally:
            self._evaluating = False

    def _run_stream(self, batches: list[Batch] | None, stream: Iterable[Instruction]) -> None:
        self._batches = self.runner.start_step(batches)
        try:
            with cast_once_per_step() if self.fp8_cast_once else contextlib.nullcontext():
                for instruction in stream:
                    self.stall_watch.tick()
                    self._execute(instruction)
        finally:
            self.stall_watch.stop()
            self._batches = None

    def _check_capacity(self) -> None:
        """All ranks together (after every send has left): raise ``_Outgrown`` if some message wanted more."""
        capacity = self.mailbox.capacity
        if not pads(capacity):
            return
        need_2 = self.runner.capacity_need()
        dist.all_reduce(need_2, op=dist.ReduceOp.MAX)
        rows, pairs = need_2.tolist()
        if not capacity.holds(rows, pairs):
            grown = capacity.grown(rows, pairs)
            if dist.get_rank() == 0:
                logger.warning(
                    "a message of this step needed %d rows and %d routed pairs, beyond the exchange capacity %s: "
                    "running the step again at %s (capacity_factor %.2f)",
                    rows, pairs, capacity.sizes, grown.sizes, capacity.factor,
                )  # fmt: skip
            raise _Outgrown(grown)

    def _set_capacity(self, capacity: Capacity) -> None:
        self.mailbox.capacity = capacity
        self.runner.capacity = capacity

    def _execute(self, instruction: Instruction) -> None:
        handler = _INSTRUCTION_MAP.get(type(instruction))
        if handler is None:
            raise RuntimeError(f"{type(self).__name__} has no handler for instruction {instruction!r}")
        t0 = time.perf_counter()
        handler(self, instruction)
        if self.timeline is not None:
            category = _CATEGORY.get(type(instruction), "compute")
            self.timeline.append(TimelineEvent(self.name, repr(instruction), category, t0, time.perf_counter(), {}))

    # ----- transfers -----
    def _exec_post_recv(self, instruction: PostRecv) -> None:
        self.mailbox.post(instruction.transfer)

    def _exec_wait_recv(self, instruction: WaitRecv) -> None:
        transfer = instruction.transfer
        self._inboxes.setdefault(transfer.dst, Inbox()).put(transfer.kind, self.mailbox.wait(transfer))

    def _exec_send(self, instruction: Send) -> None:
        transfer = instruction.transfer
        outbox = self._outboxes[transfer.src]
        self.mailbox.send(transfer, outbox.take(transfer.kind))
        if outbox.empty:
            del self._outboxes[transfer.src]

    # ----- compute -----
    def _exec_forward(self, instruction: ForwardAttn | ForwardExperts) -> None:
        inbox = self._inbox_of(instruction)
        if isinstance(instruction, ForwardAttn) and self._batches is not None:
            inbox.batch = self._batches[instruction.micro_batch]
        with self._offloading(instruction):
            outbox = self.runner.forward(instruction.layer, instruction.micro_batch, inbox)
        if self._evaluating:  # no backward follows
            self.runner.drop_chunk(instruction.layer, instruction.micro_batch)
        self._computed(instruction, outbox)

    def _exec_backward(self, instruction: BackwardAttn | BackwardExperts) -> None:
        inbox = self._inbox_of(instruction)
        with self._offloading(instruction):
            outbox = self.runner.backward(instruction.layer, instruction.micro_batch, inbox)
        self._computed(instruction, outbox)

    def _exec_weight_grad(self, instruction: WeightGradAttn | WeightGradExperts) -> None:
        # Outside the offload hooks: B brought the chunk's saved tensors back, and they stay until this frees them.
        self.runner.weight_grad(instruction.layer, instruction.micro_batch)
        self.mailbox.pump()

    def _inbox_of(self, instruction: ComputeInstruction) -> Inbox:
        """The messages waited for ``instruction``'s task (an empty inbox where it receives none)."""
        return self._inboxes.pop(instruction.task, None) or Inbox()

    def _computed(self, instruction: ComputeInstruction, outbox: Outbox) -> None:
        if not outbox.empty:
            self._outboxes[instruction.task] = outbox
        self.mailbox.pump()  # headers that came in while computing: post their payload receives now

    def _offloading(self, instruction: ComputeInstruction) -> AbstractContextManager[None]:
        if self.offloader is None or self._evaluating:  # without autograd nothing is saved
            return nullcontext()
        forward = isinstance(instruction, ForwardAttn | ForwardExperts)
        phase = self.offloader.forward if forward else self.offloader.backward
        return phase((instruction.layer, instruction.micro_batch))

    # ----- step -----
    def _exec_reduce_grads(self, instruction: ReduceGrads) -> None:
        # With managed_gradient_accumulation off, DeepSpeed reduces inside step(): nothing to send here.
        self.mailbox.flush()
        self._check_capacity()
        zero_grads_of_untouched(self.engine)
        if self.before_step is not None:
            self.before_step()

    def _exec_optimizer_step(self, instruction: OptimizerStep) -> None:
        weights_changed()
        self.engine.step()

    def _result(self, seconds: float) -> StepResult:
        stats = self.runner.stats
        sums = torch.zeros(4, dtype=torch.float64, device=self.engine.device)  # NCCL reduces device tensors
        if stats.sums is not None:
            sums[:3] = stats.sums
            sums[3] = stats.micro_batches
        dist.all_reduce(sums)  # only the head lanes contribute
        return StepResult.of_sums(sums, self.grad_norm.last_norm, seconds, self.runner.expert_counts())


InstructionT = TypeVar("InstructionT", bound=Instruction)
_Handler = Callable[[AFPipeExecutor, Instruction], None]


def _handles(
    instruction: type[InstructionT], handler: Callable[[AFPipeExecutor, InstructionT], None]
) -> tuple[type[Instruction], _Handler]:
    """One entry of the map: ``handler`` takes exactly the instructions of type ``instruction``, which ``_execute``
    looks up by the instruction's type, so the narrowing cast is safe."""
    return instruction, cast(_Handler, handler)


_INSTRUCTION_MAP: Mapping[type[Instruction], _Handler] = dict(
    [
        _handles(PostRecv, AFPipeExecutor._exec_post_recv),
        _handles(WaitRecv, AFPipeExecutor._exec_wait_recv),
        _handles(Send, AFPipeExecutor._exec_send),
        _handles(ForwardAttn, AFPipeExecutor._exec_forward),
        _handles(ForwardExperts, AFPipeExecutor._exec_forward),
        _handles(BackwardAttn, AFPipeExecutor._exec_backward),
        _handles(BackwardExperts, AFPipeExecutor._exec_backward),
        _handles(WeightGradAttn, AFPipeExecutor._exec_weight_grad),
        _handles(WeightGradExperts, AFPipeExecutor._exec_weight_grad),
        _handles(ReduceGrads, AFPipeExecutor._exec_reduce_grads),
        _handles(OptimizerStep, AFPipeExecutor._exec_optimizer_step),
    ]
)


def _random_state(device: torch.device) -> tuple[torch.Tensor, torch.Tensor | None]:
    cuda = torch.cuda.get_rng_state(device) if device.type == "cuda" else None
    return torch.get_rng_state(), cuda


def _set_random_state(device: torch.device, state: tuple[torch.Tensor, torch.Tensor | None] | None) -> None:
    """Back to ``state`` (None: nothing was drawn that a rerun must repeat)."""
    if state is None:
        return
    torch.set_rng_state(state[0])
    if state[1] is not None:
        torch.cuda.set_rng_state(state[1], device)
