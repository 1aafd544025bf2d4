"""What runs a rank's steps and what one step reports, whichever mode ran it."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol

import torch

from disagmoe_ds.schedule import TimelineEvent


@dataclass(frozen=True)
class StepResult:
    """One optimizer step, identical on every rank."""

    loss: float  # mean over lanes and micro-batches of (LM loss + coef * aux loss), as HF reports it
    lm_loss: float
    aux_loss: float
    grad_norm: float | None  # global, over every unique parameter (None when clipping is off with ZeRO-0)
    seconds: float
    reruns: int = 0  # times the step ran again at a larger exchange capacity (``routing.Capacity``)


class Executor(Protocol):
    """What runs a rank's steps, in either mode (``afpipe.executor.AFPipeExecutor``,
    ``colocated.executor.ColocatedExecutor``)."""

    timeline: list[TimelineEvent] | None  # the last recorded step's events (``record_timeline``)
    runner: Any  # the mode's compute; an attention rank's has ``step_expert_counts()`` (expert balancing)

    def train_batch(self, batches: list[dict[str, torch.Tensor]] | None = None) -> StepResult:
        """One optimizer step over ``batches`` (the micro-batches of this rank's lane; None where it reads none)."""
        ...

    def record_timeline(self, enabled: bool = True) -> None: ...

    def warm_up(self, seq_len: int, *, packed: bool = False) -> None:
        """Compile or capture before the first step, so no exchange waits on it."""
        ...
