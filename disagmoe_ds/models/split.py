"""Single-process reference of the disaggregated data flow: attention parts + R expert shards per layer.

It runs exactly what the distributed runtime runs (same parts, same dispatch plan, same combine) but in one
process and one autograd graph, so it can be compared with the HF model itself on any input.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from torch import nn

from disagmoe_ds.comm.routing import combine, pack, plan_dispatch
from disagmoe_ds.errors import LayoutError
from disagmoe_ds.models.aux_loss import RouterStats, aux_loss_from_stats, balance_per_layer, router_stats
from disagmoe_ds.models.families import family_of
from disagmoe_ds.models.hf_model import causal_lm
from disagmoe_ds.models.hyper_connections import add_routed
from disagmoe_ds.models.model_facts import num_routed_experts
from disagmoe_ds.models.naming import attention_name_to_hf, expert_name_to_hf
from disagmoe_ds.models.parts import AttentionStage, ExpertStage

if TYPE_CHECKING:
    from transformers import PretrainedConfig


@dataclass
class SplitOutput:
    logits: torch.Tensor
    loss: torch.Tensor | None
    aux_loss: torch.Tensor | None


def aux_loss_enabled(config) -> bool:
    return family_of(config).has_aux_loss and bool(getattr(config, "output_router_logits", False))


def hf_reference_loss(model: nn.Module, out) -> torch.Tensor:
    """The loss of an HF model's output as our parts define it: HF's own, except that with per-layer balancing
    (``balance_per_layer``) its pooled aux term is replaced by the mean of HF's function on each layer alone."""
    model = causal_lm(model)
    config = model.config
    if not (aux_loss_enabled(config) and balance_per_layer(config)):
        return out.loss
    switch_loss = sys.modules[type(model).__module__].load_balancing_loss_func
    experts, top_k = model.num_experts, model.num_experts_per_tok
    per_layer = torch.stack([switch_loss((logits,), experts, top_k) for logits in out.router_logits]).mean()
    return out.loss + config.router_aux_loss_coef * (per_layer - out.aux_loss)


class SplitModel(nn.Module):
    """An HF MoE causal LM cut into attention parts and ``num_shards`` expert shards per MoE layer.

    Build it from a model you no longer need on its own: the attention side reuses its modules, the expert
    shards copy slices of its fused expert tensors.
    """

    config: PretrainedConfig
    attention: AttentionStage

    def __init__(self, model: nn.Module, num_shards: int):
        super().__init__()
        model = causal_lm(model)
        num_experts = num_routed_experts(model)
        if num_shards < 1 or num_experts % num_shards:
            raise LayoutError(
                f"num_experts ({num_experts}) must be divisible by the number of expert shards ({num_shards})"
            )
        self.config = model.config
        self.experts_per_shard = num_experts // num_shards
        layers = tuple(range(model.config.num_hidden_layers))
        per = self.experts_per_shard
        self.shards = nn.ModuleList(ExpertStage(model, layers, r * per, (r + 1) * per) for r in range(num_shards))
        self.attention = AttentionStage(model, layers, with_embedding=True, with_head=True)

    def forward(
        self, input_ids: torch.Tensor, labels: torch.Tensor | None = None, position_ids: torch.Tensor | None = None
    ) -> SplitOutput:
        h_BSH = self.attention.embed(input_ids)
        ctx = self.attention.context(h_BSH, position_ids, input_ids)
        stats: list[RouterStats] = []
        for layer in range(self.config.num_hidden_layers):
            part = self.attention.part(layer)
            out = part(h_BSH, ctx, self.config)
            if out.x_TH is None:
                h_BSH = out.residual_BSH
                continue
            if out.router_logits_TE is not None:  # a learned choice (not a token-routed layer)
                stats.append(router_stats(out.router_logits_TE, part.router_top_k))
            h_BSH = add_routed(out.residual_BSH, out.routed_w_BSC, self._experts(layer, out))
        if self.attention.head is None:
            raise AssertionError("the split's attention stage is built with the head")
        logits, loss = self.attention.head(h_BSH, labels)
        per_layer = balance_per_layer(self.config)
        aux = aux_loss_from_stats(stats, per_layer=per_layer) if aux_loss_enabled(self.config) else None
        if loss is not None and aux is not None:
            loss = loss + self.config.router_aux_loss_coef * aux
        return SplitOutput(logits, loss, aux)

    def _experts(self, layer: int, out) -> torch.Tensor:
        plan = plan_dispatch(out.topk_idx_TK, len(self.shards), self.experts_per_shard)
        ys = [
            stage.shard(layer)(x_RH, plan.local_idx_RK[r], w_RK, plan.pairs[r])
            for r, (stage, (x_RH, w_RK)) in enumerate(zip(self.expert_stages, pack(out.x_TH, out.topk_w_TK, plan)))
        ]
        return combine(ys, plan)

    @property
    def expert_stages(self) -> list[ExpertStage]:
        """``shards``, typed (a ModuleList's items are typed Module)."""
        stages = [stage for stage in self.shards if isinstance(stage, ExpertStage)]
        assert len(stages) == len(self.shards), "every shard is an ExpertStage (__init__)"
        return stages

    def hf_named_grads(self) -> dict[str, torch.Tensor | None]:
        """Gradients under HF's parameter names, expert slices concatenated back into fused tensors."""
        grads = {attention_name_to_hf(n): p.grad for n, p in self.attention.named_parameters()}
        pieces: dict[str, list[torch.Tensor]] = {}
        for stage in self.shards:
            for name, p in stage.named_parameters():
                # An expert shard no token reached has no gradient: it is zero, as in HF's fused tensor.
                pieces.setdefault(expert_name_to_hf(name), []).append(torch.zeros_like(p) if p.grad is None else p.grad)
        grads.update({name: torch.cat(parts) for name, parts in pieces.items()})
        return grads
