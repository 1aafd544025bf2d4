"""The FP8 lever on ``nn.Linear`` modules: which projections compute in FP8, and how they are switched over.

A plain ``nn.Linear`` becomes an ``Fp8Linear`` by a class swap: the same module object with the same parameters,
hooks and state_dict names, only its ``forward`` differs, so checkpoints, ZeRO's hooks and a recompute's re-run
forward (which calls the same modules again) are unchanged. The project's own ``nn.Linear`` subclasses keep their
forward and compute their base product with ``linear`` (``models.lora.LoraLinear``: the base GEMM in FP8, its two
adapter GEMMs in the model's dtype; ``models.tensor_parallel``'s cut output projection), switched by their ``fp8``
attribute. Which projections: ``fp8_eligible`` (by shape: ``shapes.fp8_pays``). The LM head and the router never
pass through here.

>>> lin = nn.Linear(32, 16, bias=False)
>>> convert_linears(nn.Sequential(lin), bf16_width=0), type(lin).__name__, [n for n, _ in lin.named_parameters()]
(1, 'Fp8Linear', ['weight'])
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
import torch.nn.functional as F
from torch import nn

from disagmoe_ds.fp8.projections import fp8_linear
from disagmoe_ds.fp8.shapes import BF16_WIDTH, fp8_pays


class Fp8Linear(nn.Linear):
    """An ``nn.Linear`` whose product runs in FP8 (``fp8_linear``); made by ``convert_linears``'s class swap."""

    fp8 = True

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return fp8_linear(x, self.weight, self.bias)


def linear(module: nn.Module, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``F.linear``, in FP8 where ``module.fp8`` is set (an ``nn.Linear`` subclass's base product)."""
    return fp8_linear(x, weight, bias) if getattr(module, "fp8", False) else F.linear(x, weight, bias)


def fp8_eligible(name: str, module: nn.Linear, bf16_width: int = BF16_WIDTH) -> bool:
    """A projection the lever puts in FP8: not a gate (a router, a shared expert's sigmoid gate: a 1- or E-wide
    output whose small logits decide the routing) and wide enough to pay, both dimensions aligned for the FP8 kernels
    (``shapes.fp8_pays``: past ``bf16_width``, a rule measured at one shape; the planner prices the same)."""
    is_gate = name.rsplit(".", 1)[-1].endswith("gate")
    return not is_gate and aligned(module) and fp8_pays(*whole_features(module), bf16_width)


def aligned(module: nn.Linear) -> bool:
    """Both dimensions of the GEMM this module runs (a TP shard's own) aligned for the FP8 kernels."""
    return fp8_pays(module.in_features, module.out_features, bf16_width=0)


def whole_features(module: nn.Linear) -> tuple[int, int]:
    """``(in_features, out_features)`` of the model's projection: of the whole one where ``module`` is a tensor-parallel
    shard (``models.tensor_parallel`` marks its cut weight with ``disagmoe_tp``, a ``Shard``), so that every rank, the
    single-process reference and the planner apply the shape rule to the same shape."""
    out_features, in_features = module.weight.shape
    shard = getattr(module.weight, "disagmoe_tp", None)
    if shard is not None:
        out_features, in_features = (
            (out_features * shard.size, in_features) if shard.dim == 0 else (out_features, in_features * shard.size)
        )
    return in_features, out_features


def convert_linears(root: nn.Module, skip: Iterable[nn.Module] = (), bf16_width: int = BF16_WIDTH) -> int:
    """Switch every eligible ``nn.Linear`` under ``root`` to FP8 (``fp8_eligible`` at ``bf16_width``, the config's
    ``"fp8_bf16_width"``), except those under a module of ``skip``; returns how many. A plain one becomes an
    ``Fp8Linear``, a subclass with an ``fp8`` switch gets it set; any other subclass is refused (it would silently
    stay in high precision)."""
    skipped = {id(m) for s in skip for m in s.modules()}
    converted = 0
    for name, sub in root.named_modules():
        if not isinstance(sub, nn.Linear) or id(sub) in skipped or not fp8_eligible(name, sub, bf16_width):
            continue
        if type(sub) is nn.Linear:
            sub.__class__ = Fp8Linear
        elif hasattr(type(sub), "fp8"):
            sub.fp8 = True  # type: ignore[assignment]
        else:
            raise TypeError(f"{name}: {type(sub).__name__} has no FP8 switch (an fp8 attribute read by its forward)")
        converted += 1
    return converted
