"""Run one co-located rank's step: 1F1B with pipeline depth 1 and gradient accumulation, in its DeepSpeed engine.

Each of the K micro-batches runs forward then backward (``loss / K``); DeepSpeed reduces the gradients and steps
once per batch (``managed_gradient_accumulation`` off, as in the role engines). Gradient scaling needs no
correction: attention gradients are averaged over all W ranks; an expert slice's gradient is a sum over the tokens
of its EP group's ranks, all-reduced over its EDP replicas (which together saw every rank's tokens once) and
divided by DeepSpeed's data-parallel size W: again the mean over all W * K micro-batches.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from deepspeed.moe.utils import is_moe_param

from disagmoe_ds.engine.executor import StepResult
from disagmoe_ds.schedule import TimelineEvent


class ColocatedGradNorm:
    """The global gradient norm of a rank that holds replicated attention parameters and one expert slice.

    ZeRO 1/2: DeepSpeed's MoE norm path is already global (expert partitions are summed over the data-parallel
    group, then averaged over identical EDP values); it is read back after the step. ZeRO 0 (fp32): DeepSpeed's
    ``clip_grad_norm_`` averages per-rank *norms*, which is not the norm when ranks hold different expert slices,
    so the engine's clipping is replaced: every rank contributes ``|g_attn|^2 / W + |g_experts|^2 / EDP`` to one
    all-reduce, counting every unique parameter once.
    """

    def __init__(self, group: dist.ProcessGroup, *, attention_replicas: int, expert_replicas: int):
        self.group = group
        self.attention_replicas = attention_replicas
        self.expert_replicas = expert_replicas
        self._own_norm: float | None = None
        self._engine = None

    def install(self, engine) -> None:
        self._engine = engine
        if not engine.zero_optimization():
            engine.clip_fp32_gradients = lambda: self._clip_fp32(engine)

    def last_norm(self) -> float | None:
        """The norm of the last step (None with ZeRO 0 and clipping off: nothing computed it)."""
        if not self._engine.zero_optimization():
            return self._own_norm
        norm = self._engine.get_global_grad_norm()
        return float(norm) if norm is not None else None

    def _clip_fp32(self, engine) -> None:
        params = [p for p in engine.module.parameters() if p.grad is not None]
        squares = torch.zeros(2, dtype=torch.float64, device=params[0].grad.device)
        for p in params:
            squares[int(is_moe_param(p))] += p.grad.detach().double().pow(2).sum()
        squares /= torch.tensor(
            [self.attention_replicas, self.expert_replicas], dtype=torch.float64, device=squares.device
        )
        total = squares.sum()
        dist.all_reduce(total, group=self.group)
        norm = total.sqrt()
        self._own_norm = norm.item()
        coef = engine.gradient_clipping() / (self._own_norm + 1e-6)  # torch.nn.utils.clip_grad_norm_'s formula
        if coef < 1:
            for p in params:
                p.grad.mul_(coef)


class ColocatedExecutor:
    """``train_batch`` for one co-located rank (same contract as ``AFPipeExecutor.train_batch``)."""

    def __init__(self, *, engine, num_micro_batches: int, grad_norm: ColocatedGradNorm, group, name: str):
        self.engine = engine
        self.num_micro_batches = num_micro_batches
        self.grad_norm = grad_norm
        self.group = group  # all ranks: the losses are averaged over it
        self.name = name
        self.timeline: list[TimelineEvent] | None = None

    def record_timeline(self, enabled: bool = True) -> None:
        self.timeline = [] if enabled else None

    def train_batch(self, batches: list[dict[str, torch.Tensor]]) -> StepResult:
        """One optimizer step over this rank's K micro-batches (input_ids/labels[/position_ids] each)."""
        if len(batches) != self.num_micro_batches:
            raise ValueError(f"{self.name}: got {len(batches)} micro-batches, it accumulates {self.num_micro_batches}")
        start = time.perf_counter()
        # loss, lm loss, aux loss, micro-batches; on the engine's device, where the backend can reduce it
        sums = torch.zeros(4, dtype=torch.float64, device=self.engine.device)
        for mb, batch in enumerate(batches):
            out = self._timed(f"forward {mb}", "compute", lambda b=batch: self.engine(**b))
            self._timed(f"backward {mb}", "compute", lambda o=out: self._backward(o.loss))
            aux = out.aux_loss.item() if out.aux_loss is not None else 0.0
            sums += torch.tensor(
                [out.loss.item(), out.lm_loss.item(), aux, 1.0], dtype=torch.float64, device=sums.device
            )
        self._timed("step", "optimizer", self._step)
        dist.all_reduce(sums, group=self.group)
        loss, lm, aux, count = sums.tolist()
        return StepResult(
            loss / count, lm / count, aux / count, self.grad_norm.last_norm(), time.perf_counter() - start
        )

    def _backward(self, loss: torch.Tensor) -> None:
        self.engine.backward(loss / self.num_micro_batches, scale_wrt_gas=False)

    def _step(self) -> None:
        # Parameters no token reached this step (an expert slice nobody routed to) get a zero gradient, so every
        # replica reduces the same buffers.
        for param in self.engine.module.parameters():
            if param.requires_grad and param.grad is None:
                param.grad = torch.zeros_like(param)
        self.engine.step()

    def _timed(self, name: str, category: str, fn: Callable[[], Any]) -> Any:
        t0 = time.perf_counter()
        result = fn()
        if self.timeline is not None:
            self.timeline.append(TimelineEvent(self.name, name, category, t0, time.perf_counter()))
        return result
