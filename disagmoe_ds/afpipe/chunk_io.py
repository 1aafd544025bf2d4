"""What both sides' runners share: a chunk's inputs as fresh leaves, its forward as it is or checkpointed, and
the gradients of its inputs for the backward that starts upstream (``afpipe.attention_runner``,
``afpipe.expert_runner``)."""

from __future__ import annotations

from collections.abc import Callable
from typing import TypeVar

import torch
from torch.utils.checkpoint import checkpoint

R = TypeVar("R")


def run(fn: Callable[..., R], *args: object) -> R:
    return fn(*args)


def checkpointed(fn: Callable[..., R], *args: object) -> R:
    # Non-reentrant: works with the chunk-level backward (engine.backward of a pseudo-loss) and any outputs.
    out: R = checkpoint(fn, *args, use_reentrant=False)
    return out


def leaf(t: torch.Tensor) -> torch.Tensor:
    return t.detach().requires_grad_()


def grad_of_inputs(outputs: list[torch.Tensor | None], inputs: list[torch.Tensor]) -> None:
    """Run the backward from random output gradients to ``inputs`` only: parameters' ``.grad`` and DeepSpeed's
    gradient hooks are untouched (a compiled backward still computes, and so compiles, every gradient)."""
    differentiable = [t for t in outputs if t is not None and t.requires_grad]
    if differentiable:
        grads = [torch.randn_like(t) for t in differentiable]
        torch.autograd.grad(differentiable, inputs, grads, allow_unused=True)


def grad_or_zeros(t: torch.Tensor) -> torch.Tensor:
    return t.grad if t.grad is not None else torch.zeros_like(t)
