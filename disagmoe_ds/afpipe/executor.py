"""Execute one rank's AF-Pipe instruction stream inside its role DeepSpeed engine.

The executor decides nothing: it walks the DeepSpeed ``PipeSchedule`` of its worker and maps every instruction
type to an ``_exec_*`` method (DeepSpeed's ``_INSTRUCTION_MAP`` pattern). Compute goes to the role runner,
communication to the mailbox; the only state here is the messages between the two.
"""

from __future__ import annotations

import logging
import time
from collections import defaultdict
from collections.abc import Callable, Iterator
from contextlib import nullcontext
from dataclasses import replace
from typing import Any, ClassVar

import torch
import torch.distributed as dist
from deepspeed.runtime.pipe import schedule as ds_schedule

from disagmoe_ds.afpipe import instructions as ins
from disagmoe_ds.afpipe.mailbox import Key, Mailbox
from disagmoe_ds.afpipe.offload import ActivationOffloader
from disagmoe_ds.comm.routing import Capacity, pads
from disagmoe_ds.launch.watchdog import StallWatch
from disagmoe_ds.runtime.deepspeed_role import GradNorm, discard_gradients, zero_grads_of_untouched
from disagmoe_ds.runtime.step import EvalResult, StepResult, evaluating
from disagmoe_ds.schedule import Task, TimelineEvent
from disagmoe_ds.schedule.tasks import TaskKind
from disagmoe_ds.schedule.trace import Category

_CATEGORY: dict[type, Category] = {
    ins.PostRecv: "recv",
    ins.WaitRecv: "wait",
    ins.SendMessage: "send",
    ds_schedule.ReduceGrads: "optimizer",
    ds_schedule.OptimizerStep: "optimizer",
}


logger = logging.getLogger(__name__)


class _Outgrown(Exception):
    """Some m2n message of this step wanted more than the exchange capacity (every rank raises it together)."""

    def __init__(self, capacity: Capacity) -> None:
        super().__init__(capacity)
        self.capacity = capacity  # the one to run the step again at


class AFPipeExecutor:
    """Runs ``train_batch`` for one rank: attention or FFN side, any layout, any number of micro-batches."""

    def __init__(
        self,
        *,
        engine,
        runner,
        mailbox: Mailbox,
        schedule: ins.AFPipeSchedule,
        grad_norm: GradNorm,
        name: str,
        comm_timeout_s: float | None = None,
        offloader: ActivationOffloader | None = None,
        before_step: Callable[[], None] | None = None,
    ):
        self.engine = engine
        self.before_step = before_step  # after the step's backwards, before DeepSpeed reduces (tensor parallel sums)
        self.offloader = offloader  # saved activations of chosen chunks to host memory (``"offload"``)
        self.runner = runner
        self.mailbox = mailbox
        self.schedule = schedule
        self.grad_norm = grad_norm
        self.name = name
        self.timeline: list[TimelineEvent] | None = None
        self.stall_watch = StallWatch.before_timeout(comm_timeout_s)  # this rank's stacks if an instruction stalls
        self.reruns = 0  # steps run again at a larger exchange capacity, in all
        self._incoming: dict[Task, dict[str, Any]] = defaultdict(dict)  # by the task that reads them, then kind
        self._outgoing: dict[Key, Any] = {}  # made by a compute, not sent yet
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

    def train_batch(self, batches: list[dict[str, torch.Tensor]] | None = None) -> StepResult:
        """One optimizer step. ``batches`` (K micro-batches of input_ids/labels[/position_ids]) on A-group 0.

        A step whose messages outgrew the exchange capacity is discarded and run again, from the same random state,
        at the capacity it needed (``routing.Capacity``): the step's result is the dropless one."""
        start = time.perf_counter()
        random_state = _random_state(self.engine.device) if pads(self.mailbox.capacity) else None
        reruns = 0
        while True:
            try:
                self._run_stream(batches, self.schedule.steps())
                break
            except _Outgrown as outgrown:
                discard_gradients(self.engine)
                self._set_capacity(outgrown.capacity)
                _set_random_state(self.engine.device, random_state)
                reruns += 1
        if self._outgoing or self._incoming:
            raise RuntimeError(f"{self.name}: the stream left messages unsent {list(self._outgoing)}")
        self.reruns += reruns
        return replace(self._result(time.perf_counter() - start), reruns=reruns)

    def eval_batch(self, batches: list[dict[str, torch.Tensor]] | None = None) -> EvalResult:
        """HF's LM loss of ``batches`` (as ``train_batch`` takes them), changing nothing a step reads: the step's
        forwards alone (``AFPipeSchedule.forward_steps``), without autograd or activation offload, the module in eval
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
        stats = getattr(self.runner, "stats", None)
        sums = torch.zeros(2, dtype=torch.float64, device=self.engine.device)
        if stats is not None and stats.token_sums is not None:
            sums += stats.token_sums
        dist.all_reduce(sums)  # only the head lanes contribute
        return EvalResult(sums[0].item(), int(sums[1].item()))

    def _run_forwards(self, batches: list[dict[str, torch.Tensor]] | None) -> None:
        self._evaluating = True
        try:
            with evaluating(self.engine.module):
                self._run_stream(batches, self.schedule.forward_steps())
            self.mailbox.flush(backward=False)
            self._check_capacity()
        finally:
            self._evaluating = False

    def _run_stream(
        self, batches: list[dict[str, torch.Tensor]] | None, steps: Iterator[list[ds_schedule.PipeInstruction]]
    ) -> None:
        self.runner.start_step(batches)
        try:
            for step in steps:
                for cmd in step:
                    self.stall_watch.tick()
                    self._execute(cmd)
        finally:
            self.stall_watch.stop()

    def _check_capacity(self) -> None:
        """All ranks together (after every send has left): raise ``_Outgrown`` if some message wanted more."""
        if not pads(self.mailbox.capacity):
            return
        need = getattr(self.runner, "capacity_need", None)
        need_2 = need() if need else torch.zeros(2, dtype=torch.int64, device=self.engine.device)
        dist.all_reduce(need_2, op=dist.ReduceOp.MAX)
        rows, pairs = need_2.tolist()
        capacity = self.mailbox.capacity
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

    def _execute(self, cmd: ds_schedule.PipeInstruction) -> None:
        handler = self._INSTRUCTION_MAP.get(type(cmd))
        if handler is None:
            raise RuntimeError(f"{type(self).__name__} has no handler for instruction {cmd!r}")
        t0 = time.perf_counter()
        handler(self, **cmd.kwargs)
        if self.timeline is not None:
            category = _CATEGORY.get(type(cmd), "compute")
            self.timeline.append(TimelineEvent(self.name, repr(cmd), category, t0, time.perf_counter(), {}))

    # ----- communication -----
    def _exec_post_recv(self, message) -> None:
        self.mailbox.post(message)

    def _exec_wait_recv(self, message) -> None:
        self._incoming[message.dst][message.kind] = self.mailbox.wait(message)

    def _exec_send(self, message) -> None:
        self.mailbox.send(message, self._outgoing.pop(message.key))

    # ----- compute -----
    def _compute(self, kind: TaskKind, fn, layer: int, micro_batch: int) -> None:
        incoming = self._incoming.pop(Task(kind, layer, micro_batch), {})
        with self._offloading(kind, layer, micro_batch):
            outgoing = fn(layer, micro_batch, incoming)
        if self._evaluating:  # no backward follows
            self.runner.drop_chunk(layer, micro_batch)
        for msg_kind, payload in outgoing.items():
            self._outgoing[(msg_kind, layer, micro_batch)] = payload
        self.mailbox.pump()  # headers that came in while computing: post their payload receives now

    def _offloading(self, kind: str, layer: int, micro_batch: int):
        if self.offloader is None or self._evaluating:  # without autograd nothing is saved
            return nullcontext()
        phase = self.offloader.forward if kind.endswith("fwd") else self.offloader.backward
        return phase((layer, micro_batch))

    def _exec_forward_attn(self, layer: int, micro_batch: int) -> None:
        self._compute("A_fwd", self.runner.forward, layer, micro_batch)

    def _exec_backward_attn(self, layer: int, micro_batch: int) -> None:
        self._compute("A_bwd", self.runner.backward, layer, micro_batch)

    def _exec_forward_experts(self, layer: int, micro_batch: int) -> None:
        self._compute("F_fwd", self.runner.forward, layer, micro_batch)

    def _exec_backward_experts(self, layer: int, micro_batch: int) -> None:
        self._compute("F_bwd", self.runner.backward, layer, micro_batch)

    def _exec_weight_grad(self, layer: int, micro_batch: int) -> None:
        # Outside the offload hooks: B brought the chunk's saved tensors back, and they stay until this frees them.
        self.runner.weight_grad(layer, micro_batch)
        self.mailbox.pump()

    # ----- step -----
    def _exec_reduce_grads(self) -> None:
        # With managed_gradient_accumulation off, DeepSpeed reduces inside step(): nothing to send here.
        self.mailbox.flush()
        self._check_capacity()
        zero_grads_of_untouched(self.engine)
        if self.before_step is not None:
            self.before_step()

    def _exec_optimizer_step(self) -> None:
        self.engine.step()

    def _result(self, seconds: float) -> StepResult:
        stats = getattr(self.runner, "stats", None)
        sums = torch.zeros(4, dtype=torch.float64, device=self.engine.device)  # NCCL reduces device tensors
        if stats is not None and stats.sums is not None:
            sums[:3] = stats.sums
            sums[3] = stats.micro_batches
        dist.all_reduce(sums)  # only the head lanes contribute
        loss, lm, aux, count = sums.tolist()
        return StepResult(loss / count, lm / count, aux / count, self.grad_norm.last_norm, seconds)

    _INSTRUCTION_MAP: ClassVar[dict[type, Callable[..., None]]] = {
        ins.PostRecv: _exec_post_recv,
        ins.WaitRecv: _exec_wait_recv,
        ins.SendMessage: _exec_send,
        ins.ForwardAttn: _exec_forward_attn,
        ins.BackwardAttn: _exec_backward_attn,
        ins.ForwardExperts: _exec_forward_experts,
        ins.BackwardExperts: _exec_backward_experts,
        ins.WeightGradAttn: _exec_weight_grad,
        ins.WeightGradExperts: _exec_weight_grad,
        ds_schedule.ReduceGrads: _exec_reduce_grads,
        ds_schedule.OptimizerStep: _exec_optimizer_step,
    }


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
