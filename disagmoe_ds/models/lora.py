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

from disagmoe_ds.fp8.blocks import block_linear
from disagmoe_ds.fp8.frozen import block_scaled, copy_held, dequantized, model_dtype_of
from disagmoe_ds.fp8.modules import linear
from disagmoe_ds.models.lora_settings import EXPERT_PROJECTIONS, A, B

SCALING_ATTR = "lora_scaling"  # the adapters' scale, a float attribute of an adapted experts module


class LoraLinear(nn.Linear):
    """``base`` (its own ``weight`` and ``bias`` objects, under the same names) plus PEFT's low-rank update. ``fp8``
    (the lever, ``fp8.modules``): the base product in FP8, the adapters' two in the model's dtype. A frozen FP8 base
    (``fp8.frozen.BlockFp8Linear``) keeps its FP8 buffers, and the adapters take the model's dtype."""

    fp8 = False

    def __init__(self, base: nn.Linear, rank: int, scaling: float, dropout: float):
        nn.Module.__init__(self)
        self.in_features, self.out_features = base.in_features, base.out_features
        if block_scaled(base, "weight") is None:
            self.weight = base.weight
        else:
            copy_held(base, self, "weight")
        self.bias = base.bias
        dtype, device = model_dtype_of(base, "weight"), base.weight.device  # an FP8 base's: the model's dtype
        self.lora_A = nn.Parameter(torch.zeros(rank, base.in_features, dtype=dtype, device=device))
        self.lora_B = nn.Parameter(torch.zeros(base.out_features, rank, dtype=dtype, device=device))
        self.scaling = scaling
        self.lora_dropout = nn.Dropout(dropout) if dropout else nn.Identity()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        update = F.linear(F.linear(self.lora_dropout(x), self.lora_A), self.lora_B)
        frozen = block_scaled(self, "weight")
        base = linear(self, x, self.weight, self.bias) if frozen is None else block_linear(x, frozen, self.bias)
        return base + update * self.scaling

    def merged_weight(self) -> torch.Tensor:
        return dequantized(self, "weight") + (self.lora_B @ self.lora_A) * self.scaling


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
    bases = {name: dequantized(experts, name) for name in EXPERT_PROJECTIONS}  # an FP8 base dequantized
    return {
        name: bases[name] + expert_delta(bases[name], a, b, found.scaling, transposed)
        for name, (a, b) in zip(EXPERT_PROJECTIONS, (found.gate_up, found.down), strict=True)
    }


def is_adapter(name: str) -> bool:
    """Whether the parameter (or HF tensor) name is an adapter's."""
    leaf = name.rpartition(".")[2]
    return leaf in (A, B) or leaf.endswith((f"_{A}", f"_{B}"))
