"""LoRA adapters on both sides of the cut, with PEFT's math, added to the parts a rank already holds.

Attention side: each adapted ``nn.Linear`` (token mixer projections, dense and shared MLPs) becomes a ``LoraLinear``
that keeps its ``weight`` and ``bias`` under the same names and adds PEFT's ``lora_A [r, in]``, ``lora_B [out, r]``:
``y = x W^T + b + s * dropout(x) A^T B^T`` with ``s = alpha / r``. Expert side: each routed expert projection
``P [E, out, in]`` of HF's fused experts module gets ``P_lora_A [E, r, in]`` and ``P_lora_B [E, out, r]`` beside it
(dim 0 the expert, like the weight, so an expert shard slices them with it), the per-expert form of PEFT's
``target_parameters`` (``delta_e = s * B_e A_e``); ``grouped_experts`` computes them as two more grouped GEMMs per
projection. PEFT takes no dropout on expert parameters, nor does this. ``models.adapters`` adds them to a rank.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from disagmoe_ds.fp8.modules import linear
from disagmoe_ds.models.lora_settings import EXPERT_PROJECTIONS, A, B

SCALING_ATTR = "lora_scaling"  # the adapters' scale, a float attribute of an adapted experts module


class LoraLinear(nn.Linear):
    """``base`` (its own ``weight`` and ``bias`` objects, under the same names) plus PEFT's low-rank update. ``fp8``
    (the lever, ``fp8.modules``): the base product in FP8, the adapters' two in the model's dtype."""

    fp8 = False

    def __init__(self, base: nn.Linear, rank: int, scaling: float, dropout: float):
        nn.Module.__init__(self)
        self.in_features, self.out_features = base.in_features, base.out_features
        self.weight, self.bias = base.weight, base.bias
        self.lora_A = nn.Parameter(base.weight.new_zeros(rank, base.in_features))
        self.lora_B = nn.Parameter(base.weight.new_zeros(base.out_features, rank))
        self.scaling = scaling
        self.lora_dropout = nn.Dropout(dropout) if dropout else nn.Identity()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        update = F.linear(F.linear(self.lora_dropout(x), self.lora_A), self.lora_B)
        return linear(self, x, self.weight, self.bias) + update * self.scaling

    def merged_weight(self) -> torch.Tensor:
        return self.weight + (self.lora_B @ self.lora_A) * self.scaling


@dataclass(frozen=True)
class ExpertAdapters:
    """The factors of one expert shard's two projections, ``(A [e, r, in], B [e, out, r])`` each, and s."""

    gate_up: tuple[torch.Tensor, torch.Tensor]
    down: tuple[torch.Tensor, torch.Tensor]
    scaling: float


def expert_adapters(experts: nn.Module) -> ExpertAdapters | None:
    """The adapters ``add_adapters`` put on an experts module, or None."""
    scaling = getattr(experts, SCALING_ATTR, None)
    if scaling is None:
        return None
    gate_up, down = ((getattr(experts, f"{p}_{A}"), getattr(experts, f"{p}_{B}")) for p in EXPERT_PROJECTIONS)
    return ExpertAdapters(gate_up, down, scaling=scaling)


def expert_delta(weight: torch.Tensor, a: torch.Tensor, b: torch.Tensor, scaling: float, transposed: bool):
    """``s * B_e A_e`` for every expert, laid out as HF stores ``weight`` (``[E, out, in]``, or ``[E, in, out]``
    where the experts module is transposed, GPT-OSS)."""
    delta = torch.bmm(b, a) * scaling
    return (delta.transpose(1, 2) if transposed else delta).to(weight.dtype)


def merged_expert_weights(experts: nn.Module) -> dict[str, torch.Tensor]:
    """The adapted projections of an experts module with their updates added (HF's layout)."""
    found = expert_adapters(experts)
    assert found is not None
    transposed = bool(getattr(experts, "is_transposed", False))
    return {
        name: getattr(experts, name) + expert_delta(getattr(experts, name), a, b, found.scaling, transposed)
        for name, (a, b) in zip(EXPERT_PROJECTIONS, (found.gate_up, found.down), strict=True)
    }


def is_adapter(name: str) -> bool:
    """Whether the parameter (or HF tensor) name is an adapter's."""
    leaf = name.rpartition(".")[2]
    return leaf in (A, B) or leaf.endswith((f"_{A}", f"_{B}"))
