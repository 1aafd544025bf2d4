"""The FP8 lever on ``nn.Linear`` modules: which projections compute in FP8, and how they are switched over.

A plain ``nn.Linear`` becomes an ``Fp8Linear`` by a class swap: the same module object with the same parameters,
hooks and state_dict names, only its ``forward`` differs, so checkpoints, ZeRO's hooks and a recompute's re-run
forward (which calls the same modules again) are unchanged. The project's own ``nn.Linear`` subclasses keep their
forward and compute their base product with ``linear`` (``models.lora.LoraLinear``: the base GEMM in FP8, its two
adapter GEMMs in the model's dtype; ``models.tensor_parallel``'s cut output projection), switched by their ``fp8``
attribute. Which projections: ``fp8_eligible``. The LM head and the router never pass through here.

>>> lin = nn.Linear(32, 16, bias=False)
>>> convert_linears(nn.Sequential(lin)), type(lin).__name__, [n for n, _ in lin.named_parameters()]
(1, 'Fp8Linear', ['weight'])
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
import torch.nn.functional as F
from torch import nn

from disagmoe_ds.fp8.projections import fp8_linear

# torch._scaled_mm's operands: both GEMM dimensions of a weight multiples of 16 bytes of FP8.
ALIGNMENT = 16


class Fp8Linear(nn.Linear):
    """An ``nn.Linear`` whose product runs in FP8 (``fp8_linear``); made by ``convert_linears``'s class swap."""

    fp8 = True

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return fp8_linear(x, self.weight, self.bias)


def linear(module: nn.Module, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``F.linear``, in FP8 where ``module.fp8`` is set (an ``nn.Linear`` subclass's base product)."""
    return fp8_linear(x, weight, bias) if getattr(module, "fp8", False) else F.linear(x, weight, bias)


def fp8_eligible(name: str, module: nn.Linear) -> bool:
    """A projection the lever puts in FP8: not a gate (a router, a shared expert's sigmoid gate: a 1- or E-wide
    output whose small logits decide the routing) and both dimensions aligned for the FP8 kernels."""
    dims_aligned = module.in_features % ALIGNMENT == 0 and module.out_features % ALIGNMENT == 0
    return not name.rsplit(".", 1)[-1].endswith("gate") and dims_aligned


def convert_linears(root: nn.Module, skip: Iterable[nn.Module] = ()) -> int:
    """Switch every eligible ``nn.Linear`` under ``root`` to FP8, except those under a module of ``skip``; returns
    how many. A plain one becomes an ``Fp8Linear``, a subclass with an ``fp8`` switch gets it set; any other
    subclass is refused (it would silently stay in high precision)."""
    skipped = {id(m) for s in skip for m in s.modules()}
    converted = 0
    for name, sub in root.named_modules():
        if not isinstance(sub, nn.Linear) or id(sub) in skipped or not fp8_eligible(name, sub):
            continue
        if type(sub) is nn.Linear:
            sub.__class__ = Fp8Linear
        elif hasattr(type(sub), "fp8"):
            sub.fp8 = True  # type: ignore[assignment]
        else:
            raise TypeError(f"{name}: {type(sub).__name__} has no FP8 switch (an fp8 attribute read by its forward)")
        converted += 1
    return converted
