"""The attention side of one decoder layer, cut out of a Hugging Face MoE model with HF's own modules, and the head.

``AttentionPart``: input norm, the layer's token mixer (self-attention, or Gated DeltaNet linear attention in the
linear layers of Qwen3-Next / Qwen3.5), residual, post-attention norm, then either the dense MLP (dense layers) or
the router and shared experts (MoE layers); the routed experts are the expert side's (``expert_shard``).
``Head``: final norm, LM head and HF's causal-LM loss. Both keep HF's attribute names, so checkpoints convert by a
prefix map; ``parts`` gathers them into what one rank holds.

Shape suffixes: B batch, S sequence, T = B*S tokens, H hidden, E experts, K top-k, V vocabulary.
"""

from __future__ import annotations

import copy
from collections import OrderedDict
from dataclasses import dataclass

import torch
from torch import nn

from disagmoe_ds.models import hyper_connections as hc
from disagmoe_ds.models.context import LayerContext
from disagmoe_ds.models.families import Family, family_of, is_moe_layer, mixer_attr, route
from disagmoe_ds.models.hf_model import causal_lm


@dataclass
class AttentionOutput:
    """One attention part's results for one micro-batch.

    ``residual_BSH`` is everything of the layer's output except the routed experts' sum (for dense layers: the
    whole layer output; [B, S, hc, H] with hyper-connections). The rest is None on dense layers.
    ``router_logits_TE`` is None too where the layer routes by token id (no learned choice: no aux term, as HF
    records none); ``routed_w_BSC`` is the routed sum's weight per residual stream (hyper-connections), None where
    it is added as it is (``hyper_connections.add_routed``).
    """

    residual_BSH: torch.Tensor
    x_TH: torch.Tensor | None = None  # post-attention-norm tokens, sent to the experts
    topk_w_TK: torch.Tensor | None = None
    topk_idx_TK: torch.Tensor | None = None
    router_logits_TE: torch.Tensor | None = None
    routed_w_BSC: torch.Tensor | None = None


class AttentionPart(nn.Module):
    """Attention side of one decoder layer. Keeps HF's attribute names (``self_attn`` or ``linear_attn``,
    ``mlp.gate``, ``mlp.shared_expert``, DeepSeek-V4's ``attn_hc`` / ``ffn_hc``...).

    ``token_routed``: the layer chooses its experts by token id (``moe_pattern.token_routed_layers``); its router
    then reads ``LayerContext.token_ids``.
    """

    input_layernorm: nn.Module
    post_attention_layernorm: nn.Module
    mlp: nn.Module

    def __init__(self, layer: nn.Module, family: Family, layer_idx: int, *, token_routed: bool = False):
        super().__init__()
        self.layer_idx = layer_idx
        self.family = family
        self.is_moe = is_moe_layer(layer)
        self.token_routed = token_routed
        self.mixer_attr = mixer_attr(layer)
        self.input_layernorm = layer.get_submodule("input_layernorm")
        setattr(self, self.mixer_attr, layer.get_submodule(self.mixer_attr))
        self.post_attention_layernorm = layer.get_submodule("post_attention_layernorm")
        mlp = layer.get_submodule("mlp")
        self.mlp = _without_experts(mlp) if self.is_moe else mlp
        self.hyper = family.hyper
        if self.hyper is not None:  # the two HyperConnection modules, under HF's names
            for attr in (self.hyper.around_mixer, self.hyper.around_mlp):
                setattr(self, attr, getattr(layer, attr))

    @property
    def router(self) -> nn.Module:
        return getattr(self.mlp, self.family.router_attr)

    @property
    def router_top_k(self) -> int:
        """K, the experts the router picks per token (its HF attribute ``top_k``)."""
        top_k = self.router.top_k
        if not isinstance(top_k, int):
            raise TypeError(f"the router of layer {self.layer_idx} keeps no int top_k (got {type(top_k).__name__})")
        return top_k

    @property
    def mixer(self) -> nn.Module:
        """The token mixer: HF's attention module, or its Gated DeltaNet."""
        return getattr(self, self.mixer_attr)

    def _around(self, which: str) -> nn.Module | None:
        """The hyper-connection around the mixer or the MLP (None: a plain residual)."""
        return None if self.hyper is None else getattr(self, getattr(self.hyper, which))

    def _mix(self, x_BSH: torch.Tensor, ctx: LayerContext, config) -> torch.Tensor:
        """The token mixer called as HF's decoder layer calls it (no cache: training)."""
        mask = ctx.mask_for(config, self.layer_idx)
        if self.mixer_attr == "linear_attn":
            return self.mixer(hidden_states=x_BSH, attention_mask=mask)
        attn_BSH, _ = self.mixer(
            hidden_states=x_BSH,
            attention_mask=mask,
            position_embeddings=ctx.position_embeddings,
            position_ids=ctx.position_ids,
        )
        return attn_BSH

    def forward(self, h_BSH: torch.Tensor, ctx: LayerContext, config) -> AttentionOutput:
        x_BSH, around = hc.enter(self._around("around_mixer"), h_BSH)
        a_BSH = hc.leave(around, h_BSH, self._mix(self.input_layernorm(x_BSH), ctx, config))
        x_BSH, around = hc.enter(self._around("around_mlp"), a_BSH)
        x_BSH = self.post_attention_layernorm(x_BSH)
        if not self.is_moe:
            return AttentionOutput(residual_BSH=hc.leave(around, a_BSH, self.mlp(x_BSH)))
        x_TH = x_BSH.reshape(-1, x_BSH.shape[-1])
        jitter = getattr(self.mlp, "jitter_noise", 0.0)
        if self.training and jitter > 0:  # Mixtral's router jitter, as HF applies it (in place, before routing)
            x_TH = x_TH * torch.empty_like(x_TH).uniform_(1.0 - jitter, 1.0 + jitter)
        token_ids_T = ctx.token_ids.reshape(-1) if self.token_routed and ctx.token_ids is not None else None
        logits_TE, w_TK, idx_TK = route(self.family, self.mlp, x_TH, token_ids_T)
        shared_TH = None if self.family.shared is None else self.family.shared(self.mlp, x_TH)
        residual_BSH = hc.leave(around, a_BSH, None if shared_TH is None else shared_TH.view_as(x_BSH))
        learned_TE = None if self.token_routed else logits_TE
        return AttentionOutput(residual_BSH, x_TH, w_TK, idx_TK, learned_TE, hc.routed_weight(around, a_BSH.dtype))


def _without_experts(block: nn.Module) -> nn.Module:
    """A shallow copy of an MoE block that keeps its router and shared experts but not the routed experts.

    The routed experts live on the FFN side. The HF model itself is left intact, so the FFN side can still be cut
    from it.
    """
    pruned = copy.copy(block)
    pruned._modules = OrderedDict((name, m) for name, m in block._modules.items() if name != "experts")
    return pruned


class Head(nn.Module):
    """Final norm + LM head + HF's causal-LM loss; with hyper-connections, the streams collapsed first (HF's hyper
    head, under its name)."""

    norm: nn.Module
    lm_head: nn.Module

    def __init__(self, model: nn.Module):
        super().__init__()
        model = causal_lm(model)
        hyper = family_of(model.config).hyper
        self.hyper_head = None if hyper is None else hyper.head
        if self.hyper_head is not None:
            setattr(self, self.hyper_head, getattr(model.model, self.hyper_head))
        self.norm = model.model.norm
        self.lm_head = model.lm_head
        self._loss_function = model.loss_function
        self.vocab_size = model.config.vocab_size

    def forward(
        self,
        h_BSH: torch.Tensor,
        labels_BS: torch.Tensor | None,
        shift_labels_BS: torch.Tensor | None = None,
        num_items: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """``shift_labels_BS`` (labels already shifted) and ``num_items`` (what the sum is divided by): one slice's
        share of a micro-batch's loss (``models.sequence_parallel``)."""
        if self.hyper_head is not None:
            h_BSH = getattr(self, self.hyper_head)(h_BSH)
        logits_BSV = self.lm_head(self.norm(h_BSH))
        if labels_BS is None and shift_labels_BS is None:
            return logits_BSV, None
        loss = self._loss_function(
            logits_BSV, labels_BS, self.vocab_size, num_items_in_batch=num_items, shift_labels=shift_labels_BS
        )
        return logits_BSV, loss
