"""Run one co-located rank's step: 1F1B with pipeline depth 1 and gradient accumulation, in its DeepSpeed engine.

As in the AF-Pipe engine, the executor decides the order and the runner computes: each of the K micro-batches runs
forward then backward (``loss / K``) in ``ColocatedRunner``, which also keeps the step's sums (losses, expert load);
DeepSpeed reduces the gradients and steps once per batch (``managed_gradient_accumulation`` off, as in the role
engines). Gradient scaling needs no
correction: attention gradients are averaged over all W ranks; an expert slice's gradient is a sum over the tokens
of its EP group's ranks, all-reduced over its EDP replicas (which together saw every rank's tokens once) and
divided by DeepSpeed's data-parallel size W: again the mean over all W * K micro-batches.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable
from functools import partial
from typing import Any

import torch
import torch.distributed as dist
from deepspeed import DeepSpeedEngine
from deepspeed.moe.utils import is_moe_param

from disagmoe_ds.fp8.weight_cache import cast_once_per_step
from disagmoe_ds.launch.watchdog import StallWatch
from disagmoe_ds.models.model_facts import RoutingFacts
from disagmoe_ds.models.sequence_parallel import SequenceParallel, slice_batch
from disagmoe_ds.models.tensor_parallel import shard_of
from disagmoe_ds.runtime import ds_patches
from disagmoe_ds.runtime.deepspeed_role import GlobalGradNorm, GradNorm, clip_by_norm, zero_grads_of_untouched
from disagmoe_ds.runtime.step import EvalResult, StepResult, evaluating
from disagmoe_ds.schedule import TimelineEvent
from disagmoe_ds.schedule.trace import Category


class ColocatedGradNorm:
    """The global gradient norm of a co-located rank (a ``deepspeed_role.GradNorm``), over every stage.

    Its norm domains, the ranks holding one copy of a parameter: a stage's D ranks for the replicated attention
    parameters, with TP the D / t ranks of its TP rank for the attention-head shards, and its EDP replicas for an
    expert slice. ZeRO 1/2: DeepSpeed's norm of each parameter group, global within the rank's DeepSpeed job (its
    stage, or the stage's ranks of its TP rank), combined over the world by those domains (``GlobalGradNorm``: the
    first group is the replicated parameters, every later one holds shards or expert slices, each the same over the
    job). ZeRO 0: DeepSpeed's ``clip_grad_norm_`` averages per-rank *norms*, which is not the norm when ranks hold
    different slices, so the engine's clipping is replaced: every rank contributes each kind's ``|g|^2 / domain`` to
    one all-reduce over ``group`` (every rank of the job), counting every unique parameter once.
    """

    def __init__(
        self,
        group: dist.ProcessGroup,
        *,
        attention_replicas: int,
        expert_replicas: int,
        shard_replicas: int | None = None,
    ):
        self.group = group
        self.replicas = (attention_replicas, shard_replicas or attention_replicas, expert_replicas)
        self._jobs = GlobalGradNorm(attention_replicas, shard_domain=shard_replicas or attention_replicas)
        self._own_norm: float | None = None
        self._engine: DeepSpeedEngine | None = None

    def install(self, engine: DeepSpeedEngine) -> None:
        self._engine = engine
        if engine.zero_optimization():
            self._jobs.install(engine)
        else:
            ds_patches.replace_fp32_clipping(engine, lambda: self._clip_fp32(engine))

    @property
    def last_norm(self) -> float | None:
        """The norm of the last step (None with ZeRO 0 and clipping off: nothing computed it)."""
        assert self._engine is not None, "installed when the engine is built"
        return self._jobs.last_norm if self._engine.zero_optimization() else self._own_norm

    def _clip_fp32(self, engine) -> None:
        params = [p for p in engine.module.parameters() if p.grad is not None]
        squares = torch.zeros(3, dtype=torch.float64, device=params[0].grad.device)
        for p in params:
            kind = 2 if is_moe_param(p) else int(shard_of(p) is not None)
            squares[kind] += p.grad.detach().double().pow(2).sum()
        squares /= torch.tensor(self.replicas, dtype=torch.float64, device=squares.device)
        total = squares.sum()
        dist.all_reduce(total, group=self.group)
        self._own_norm = total.sqrt().item()
        clip_by_norm([p.grad for p in params], self._own_norm, engine.gradient_clipping())


class ColocatedRunner:
    """One micro-batch's forward and backward in the engine, and the step's sums (the ``AttentionRunner`` of this
    mode: its expert load goes on the step result as that one's does, so expert balancing reads either the same
    way)."""

    def __init__(self, engine, *, num_micro_batches: int):
        self.engine = engine
        self.num_micro_batches = num_micro_batches
        self.sums: torch.Tensor  # loss, lm loss, aux loss, micro-batches; float64 on the engine's device
        self.load_LE: torch.Tensor | None  # [L, E] summed over the step's micro-batches
        self.start_step()

    def start_step(self) -> None:
        self.sums = torch.zeros(4, dtype=torch.float64, device=self.engine.device)  # where the backend reduces
        self.load_LE = None

    def forward(self, batch: dict[str, torch.Tensor]):
        out = self.engine(**batch)
        self.add(out)
        return out

    def add(self, out) -> None:
        """A micro-batch's losses (an output with a loss: the head's) and expert load into the step's sums."""
        if hasattr(out, "loss"):
            one = torch.ones((), dtype=torch.float64, device=self.sums.device)
            aux = out.aux_loss if out.aux_loss is not None else one * 0
            # Summed on the device: no host sync per micro-batch (the step's all-reduce reads them once).
            self.sums += torch.stack([t.detach().double() for t in (out.loss, out.lm_loss, aux, one)])
        if out.load_LE is not None:
            self.load_LE = out.load_LE if self.load_LE is None else self.load_LE + out.load_LE

    def backward(self, out) -> None:
        self.engine.backward(out.loss / self.num_micro_batches, scale_wrt_gas=False)


class ColocatedExecutor:
    """``train_batch`` for one co-located rank (same contract as ``AFPipeExecutor.train_batch``)."""

    def __init__(
        self,
        *,
        engine,
        num_micro_batches: int,
        grad_norm: GradNorm,
        group,
        name: str,
        comm_timeout_s: float | None = None,
        micro_batch_size: int = 1,
        routing: RoutingFacts | None = None,
        fp8_cast_once: bool = False,
        lane: SequenceParallel | None = None,
        before_step: Callable[[], None] | None = None,
    ):
        self.engine = engine
        self.lane = lane  # the lanes holding this rank's micro-batches in slices: it trains on its slice of each
        self.before_step = before_step  # after the step's backwards, before DeepSpeed reduces (tensor parallel sums)
        self.fp8_cast_once = fp8_cast_once  # each FP8 weight cast once per step (``fp8.weight_cache``)
        self.micro_batch_size, self.routing = micro_batch_size, routing  # what ``warm_up`` captures graphs for
        self.runner = ColocatedRunner(engine, num_micro_batches=num_micro_batches)
        self.num_micro_batches = num_micro_batches
        self.grad_norm = grad_norm
        self.group = group  # all ranks: the losses are averaged over it
        self.name = name
        self.timeline: list[TimelineEvent] | None = None
        self.stall_watch = StallWatch.before_timeout(comm_timeout_s)  # stacks if a micro-batch or the step stalls

    def warm_up(self, seq_len: int, *, packed: bool = False, evaluates: bool = False) -> None:
        """Capture the CUDA graphs of the rank's parts (``cuda_graphs`` jobs), before the first step; ``packed``: the
        batches carry position ids (the contexts they give are captured too). ``evaluates``: nothing more (no
        receive is posted ahead here, so a kernel compiled inside an evaluation waits for nobody)."""
        del evaluates
        assert self.routing is not None, "the builder passes the model's routing facts"
        self.engine.module.capture_graphs(
            batch=self.micro_batch_size,
            seq_len=seq_len,
            top_k=self.routing.top_k,
            weight_dtype=self.routing.weight_dtype,
            packed=packed,
        )

    def record_timeline(self, enabled: bool = True) -> None:
        self.timeline = [] if enabled else None

    def train_batch(self, batches: list[dict[str, torch.Tensor]] | None = None) -> StepResult:
        """One optimizer step over this rank's K micro-batches (input_ids/labels[/position_ids] each)."""
        batches = self._checked(batches)
        start = time.perf_counter()
        self.runner.start_step()
        try:
            with self._cast_scope():
                for mb, batch in enumerate(batches):
                    out = self._timed(f"forward {mb}", "compute", partial(self.runner.forward, batch))
                    self._timed(f"backward {mb}", "compute", partial(self.runner.backward, out))
            self._timed("step", "optimizer", self._step)
        finally:
            self.stall_watch.stop()
        sums = self.runner.sums
        dist.all_reduce(sums, group=self.group)
        sums = sums.cpu()  # waits for the reduce, which the step's time includes
        seconds = time.perf_counter() - start
        return StepResult.of_sums(sums, self.grad_norm.last_norm, seconds, self.runner.load_LE)

    def eval_batch(self, batches: list[dict[str, torch.Tensor]] | None = None) -> EvalResult:
        """HF's LM loss of this rank's micro-batches (as ``train_batch`` takes them) summed over their labelled tokens,
        over all ranks: forwards alone, without autograd, the module in eval mode; the step's sums untouched."""
        batches = self._checked(batches)
        sums = torch.zeros(2, dtype=torch.float64, device=self.engine.device)
        try:
            with evaluating(self.engine.module), self._cast_scope():
                for mb, batch in enumerate(batches):
                    out = self._timed(f"eval {mb}", "compute", partial(self.engine, **batch))
                    sums += out.lm_token_sums(batch)
        finally:
            self.stall_watch.stop()
        dist.all_reduce(sums, group=self.group)
        return EvalResult(sums[0].item(), int(sums[1].item()))

    def _checked(self, batches: list[dict[str, torch.Tensor]] | None) -> list[dict[str, torch.Tensor]]:
        assert batches is not None, "every co-located rank reads its lane's data"
        if len(batches) != self.num_micro_batches:
            raise ValueError(f"{self.name}: got {len(batches)} micro-batches, it accumulates {self.num_micro_batches}")
        return batches if self.lane is None else [slice_batch(batch, self.lane) for batch in batches]

    def _cast_scope(self) -> contextlib.AbstractContextManager[None]:
        return cast_once_per_step() if self.fp8_cast_once else contextlib.nullcontext()

    def _step(self) -> None:
        zero_grads_of_untouched(self.engine)  # an expert slice nobody routed to: every replica reduces the same buffers
        if self.before_step is not None:
            self.before_step()
        self.engine.step()

    def _timed(self, name: str, category: Category, fn: Callable[[], Any]) -> Any:
        self.stall_watch.tick()
        t0 = time.perf_counter()
        result = fn()
        if self.timeline is not None:
            self.timeline.append(TimelineEvent(self.name, name, category, t0, time.perf_counter()))
        return result
