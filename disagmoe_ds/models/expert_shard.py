"""The expert side of one decoder layer: a contiguous slice of its routed experts, held in HF's own experts module.

Gated families compute with grouped GEMMs (``grouped_experts.py``, the same math); others (GPT-OSS) and the
reference path call HF's module itself. ``parts.ExpertStage`` holds the shards of the layers one rank owns.

Shape suffixes: H hidden, K top-k, R rows received by an expert shard, P (row, expert) pairs routed to local
experts.
"""

from __future__ import annotations

import contextlib
import copy

import torch
from torch import nn

from disagmoe_ds.fp8.blocks import BlockScaled
from disagmoe_ds.fp8.frozen import copy_held, dequantized, held_weights, weight_of
from disagmoe_ds.fp8.hf import Fp8Experts
from disagmoe_ds.models.families import Family
from disagmoe_ds.models.grouped_experts import EAGER, grouped_gated_experts, supports_grouped
from disagmoe_ds.models.lora import expert_adapters, merged_expert_weights


class ExpertShard(nn.Module):
    """Routed experts ``[first_expert, first_expert + num_local)`` of one layer, stored in HF's experts module.

    ``forward`` takes the R tokens this shard received, their local expert ids (``num_local`` is the sentinel for
    experts held elsewhere) and routing weights, and returns each token's weighted sum over its local experts:
    with grouped GEMMs where the family and dtype allow, else (and in ``forward_hf``) through HF's module. Only
    real (row, expert) pairs are computed, so no work is spent on sentinels and HF versions that do not know the
    sentinel work too. ``elementwise``: the grouped path's elementwise functions (``compile_stage`` fuses them);
    ``recompute``: the grouped path keeps only its permuted inputs for the backward (``models.recompute``);
    ``fp8``: its GEMMs in FP8 (the lever, ``models.parts.fp8_stage``), HF's module then under ``fp8.hf.Fp8Experts``.
    """

    experts: nn.Module  # HF's experts module, its fused weights sliced to this shard's experts

    def __init__(self, experts: nn.Module, first_expert: int, num_local: int, family: str):
        super().__init__()
        self.experts = experts
        self.first_expert = first_expert
        self.num_local = num_local
        self.family = family
        self.elementwise = EAGER
        self.recompute = False
        self.fp8 = False

    def forward(
        self,
        x_RH: torch.Tensor,
        local_idx_RK: torch.Tensor,
        w_RK: torch.Tensor,
        num_pairs: int | None = None,
        bounded: bool = False,
    ) -> torch.Tensor:
        """``num_pairs``: the non-sentinel ids in ``local_idx_RK`` when the host knows it (saves a host sync);
        ``bounded``: at most that many (messages at a fixed capacity, ``routing.Capacity``).

        With no pair here the result still reaches every parameter (``_untouched``; the bounded grouped GEMMs
        always do), so a backward always gives the whole shard a gradient, in the same order, however the tokens
        were routed.
        """
        grouped = supports_grouped(self.family, self.experts, x_RH.dtype, x_RH.device)
        if bounded and grouped:
            return self._pairs(x_RH, local_idx_RK, w_RK, num_pairs, bounded=True)
        if num_pairs is None or bounded:
            num_pairs = int((local_idx_RK < self.num_local).sum())  # host sync
        if num_pairs == 0:
            return x_RH * 0 + self._untouched(x_RH, local_idx_RK, w_RK)
        return self._pairs(x_RH, local_idx_RK, w_RK, num_pairs)

    def _pairs(
        self, x_RH: torch.Tensor, local_idx_RK: torch.Tensor, w_RK: torch.Tensor, num_pairs: int | None, bounded=False
    ):
        if supports_grouped(self.family, self.experts, x_RH.dtype, x_RH.device):
            e = self.experts
            return grouped_gated_experts(
                x_RH,
                local_idx_RK,
                w_RK,
                weight_of(e, "gate_up_proj"),  # a parameter, or a frozen FP8 base (``fp8.frozen``)
                weight_of(e, "down_proj"),
                e.get_submodule("act_fn"),
                num_pairs,
                self.elementwise,
                self.recompute,
                bounded,
                expert_adapters(e),
                getattr(e, "limit", None),  # the SwiGLU's clamp where HF's experts have one (DeepSeek-V4)
                self.fp8,
            )
        return self.forward_hf(x_RH, local_idx_RK, w_RK)

    def capturable(self, dtype: torch.dtype, device: torch.device) -> bool:
        """Whether its forward on rows of ``dtype`` on ``device`` runs on the device alone, as a CUDA graph needs: the
        grouped GEMMs do; HF's module (GPT-OSS's experts, fp32 on CUDA) finds its pairs on the host (``nonzero``)."""
        return supports_grouped(self.family, self.experts, dtype, device)

    def _untouched(self, x_RH: torch.Tensor, local_idx_RK: torch.Tensor, w_RK: torch.Tensor) -> torch.Tensor:
        """An exact zero [1, H] that depends on every parameter as a routed pair does: one zero row to local expert
        0 with weight 0, through the same path (the warm-up's one-pair case, so no new compiled graph).

        Why: ZeRO-2 reduces gradients during each backward, bucket by bucket in the order they are produced, so the
        replicas of a shard must produce the same parameters' gradients in the same order in every backward, also
        the replica no token reached (its gradients are then exactly zero: every term carries the weight 0). The
        zero row is made from ``x_RH`` so that it lies on the input path: a split backward's W then reaches every
        parameter here as it does on a busy replica (``afpipe.split_backward``).
        """
        top_k = local_idx_RK.shape[1]
        idx_1K = local_idx_RK.new_full((1, top_k), self.num_local)
        idx_1K[0, 0] = 0
        zero_1H = x_RH.sum(0, keepdim=True) * 0
        return self._pairs(zero_1H, idx_1K, w_RK.new_zeros(1, top_k), 1)

    def forward_hf(self, x_RH: torch.Tensor, local_idx_RK: torch.Tensor, w_RK: torch.Tensor) -> torch.Tensor:
        """Through HF's own experts module (its configured implementation): the reference path. With LoRA adapters
        (``models.lora``) it runs on the merged weights, as PEFT's ``target_parameters`` does; a frozen FP8 base
        (``fp8.frozen``) on its dequantized values."""
        rows_P, slots_P = (local_idx_RK < self.num_local).nonzero(as_tuple=True)
        args = (
            x_RH.index_select(0, rows_P),
            local_idx_RK[rows_P, slots_P].unsqueeze(1),
            w_RK[rows_P, slots_P].unsqueeze(1),
        )
        with Fp8Experts() if self.fp8 else contextlib.nullcontext():
            held = held_weights(self.experts)
            if expert_adapters(self.experts) is not None:
                out_PH = torch.func.functional_call(self.experts, merged_expert_weights(self.experts), args)
            elif held:
                weights = {name: dequantized(self.experts, name) for name in held}
                out_PH = torch.func.functional_call(self.experts, weights, args)
            else:
                out_PH = self.experts(*args)
        return torch.zeros_like(x_RH).index_add(0, rows_P, out_PH.to(x_RH.dtype))


def slice_experts(experts: nn.Module, config, family: Family, start: int, stop: int) -> nn.Module:
    """A new HF experts module of the same class holding experts ``[start, stop)`` (copied, not views)."""
    local_config = copy.deepcopy(config)
    setattr(local_config, family.num_experts_attr, stop - start)
    with torch.device("meta"):
        shard = type(experts)(local_config)
    for name, param in experts.named_parameters(recurse=False):
        setattr(shard, name, nn.Parameter(param.detach()[start:stop].clone(), requires_grad=param.requires_grad))
    for name, held in held_weights(experts).items():  # a frozen FP8 base (``fp8.frozen``), scales sliced alike
        copy_held(experts, shard, name, BlockScaled(held.data[start:stop].clone(), held.scale_inv[start:stop].clone(),
                                                    held.block))  # fmt: skip
    return shard
