"""What runs a rank's steps and what one step (or one evaluation batch) reports, whichever mode ran it."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Protocol

import torch
from torch import nn

from disagmoe_ds.schedule import TimelineEvent


@dataclass(frozen=True)
class StepResult:
    """One optimizer step: the losses and norm identical on every rank, the router statistics this rank's own."""

    loss: float  # mean over lanes and micro-batches of (LM loss + coef * aux loss), as HF reports it
    lm_loss: float
    aux_loss: float
    grad_norm: float | None  # global, over every unique parameter (None when clipping is off with ZeRO-0)
    seconds: float
    reruns: int = 0  # times the step ran again at a larger exchange capacity (``routing.Capacity``)
    # [L, E] int64: tokens this rank routed to each expert in the step, per layer (top-k choices); None where it routes
    # none (an FFN rank). Summed over every rank, the whole batch's load of every layer (``train.balance``).
    expert_counts_LE: torch.Tensor | None = None

    @classmethod
    def of_sums(
        cls, sums: torch.Tensor, grad_norm: float | None, seconds: float, expert_counts_LE: torch.Tensor | None
    ) -> StepResult:
        """The step whose [loss, LM loss, aux loss] sums over its micro-batches and their count are ``sums`` (all
        ranks' reduced)."""
        loss, lm, aux, count = sums.tolist()
        return cls(loss / count, lm / count, aux / count, grad_norm, seconds, expert_counts_LE=expert_counts_LE)


@dataclass(frozen=True)
class EvalResult:
    """One evaluation batch (every lane's micro-batches), identical on every rank."""

    lm_loss_sum: float  # HF's LM loss (no aux loss) summed over the batch's labelled tokens
    tokens: int  # those tokens


def summed_lm_loss(lm_loss: torch.Tensor, over: torch.Tensor, tokens: torch.Tensor | None = None) -> torch.Tensor:
    """float64 [LM loss summed over the labelled tokens, their count] of a micro-batch whose HF loss ``lm_loss`` is
    a sum divided by ``over`` tokens; ``tokens``: those to count here (a slice's own; default ``over``). No labelled
    token gives 0, not HF's 0 / 0."""
    summed = torch.where(over > 0, lm_loss.detach().double() * over, 0.0)
    return torch.stack([summed, (over if tokens is None else tokens).double()])


@contextmanager
def evaluating(module: nn.Module) -> Iterator[None]:
    """Forward passes that leave ``module`` as they found it: no autograd graph, and eval mode (no dropout, no
    router jitter), every submodule's own mode restored after."""
    modes = [(sub, sub.training) for sub in module.modules()]
    module.train(False)
    try:
        with torch.no_grad():
            yield
    finally:
        for sub, training in modes:
            sub.training = training


class Executor(Protocol):
    """What runs a rank's steps, in either mode (``afpipe.executor.AFPipeExecutor``,
    ``colocated.executor.ColocatedExecutor``)."""

    timeline: list[TimelineEvent] | None  # the last recorded step's events (``record_timeline``)

    def train_batch(self, batches: list[dict[str, torch.Tensor]] | None = None) -> StepResult:
        """One optimizer step over ``batches`` (the micro-batches of this rank's lane; None where it reads none)."""
        ...

    def eval_batch(self, batches: list[dict[str, torch.Tensor]] | None = None) -> EvalResult:
        """The LM loss of ``batches`` (as ``train_batch`` takes them), changing nothing a training step reads."""
        ...

    def record_timeline(self, enabled: bool = True) -> None: ...

    def warm_up(self, seq_len: int, *, packed: bool = False, evaluates: bool = False) -> None:
        """Compile or capture before the first step, so no exchange waits on it (``evaluates``: the forward-only
        variants ``eval_batch`` runs too)."""
        ...
