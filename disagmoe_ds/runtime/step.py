"""What one optimizer step reports, whichever mode ran it."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class StepResult:
    """One optimizer step, identical on every rank."""

    loss: float  # mean over lanes and micro-batches of (LM loss + coef * aux loss), as HF reports it
    lm_loss: float
    aux_loss: float
    grad_norm: float | None  # global, over every unique parameter (None when clipping is off with ZeRO-0)
    seconds: float
    reruns: int = 0  # times the step ran again at a larger exchange capacity (``routing.Capacity``)
