"""What one rank holds of a Hugging Face MoE model: the parts of its layers, cut with HF's own modules.

``AttentionStage``: the attention parts (``attention_part.AttentionPart``) of the layers one A-group owns, plus the
embedding and the head (``attention_part.Head``). ``ExpertStage``: the expert shards (``expert_shard.ExpertShard``)
of the MoE layers one F-group owns. Their parameter names mirror HF's so checkpoints convert by a prefix map.
``compile_stage`` compiles either in place. Facts of the whole model (expert count, routing) are ``model_facts``'.

Shape suffixes: B batch, S sequence, H hidden.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import torch
from torch import nn

from disagmoe_ds.fp8.modules import convert_linears
from disagmoe_ds.fp8.shapes import BF16_WIDTH, EXPERT_BF16_WIDTH, experts_fp8_pay
from disagmoe_ds.models import hyper_connections as hc
from disagmoe_ds.models.attention_part import AttentionPart, Head
from disagmoe_ds.models.context import LayerContext, build_context
from disagmoe_ds.models.expert_shard import ExpertShard, slice_experts
from disagmoe_ds.models.families import family_of, is_moe_layer
from disagmoe_ds.models.grouped_experts import compiled_elementwise
from disagmoe_ds.models.hf_model import causal_lm
from disagmoe_ds.models.model_facts import expert_widths
from disagmoe_ds.models.moe_pattern import token_routed_layers


class AttentionStage(nn.Module):
    """The attention parts of the layers one A-group owns, plus embedding (A-group 0) and head (A-group L % p).

    ``residual_dims``: a token's residual, (H,), or (hc, H) with hyper-connections; ``token_routed``: some layer of
    the model routes by token id, so contexts carry the token ids and the residual hand-off too.
    """

    config: Any  # the model's HF config (family-specific fields)
    head: Head | None

    def __init__(self, model: nn.Module, layers: tuple[int, ...], *, with_embedding: bool, with_head: bool):
        super().__init__()
        model = causal_lm(model)
        self.config = model.config
        self.family = family_of(model.config)
        self.embed_tokens = model.model.embed_tokens if with_embedding else None
        self.rotary_emb = model.model.rotary_emb
        hf_layers = model.model.layers
        by_token = token_routed_layers(model.config.to_dict())
        self.token_routed = any(by_token)
        self.layers = nn.ModuleDict(
            {str(i): AttentionPart(hf_layers[i], self.family, i, token_routed=by_token[i]) for i in layers}
        )
        self.head = Head(model) if with_head else None
        self.streams = None if self.family.hyper is None else self.family.hyper.streams(model.config)
        hidden = model.config.hidden_size
        self.residual_dims = (hidden,) if self.streams is None else (self.streams, hidden)
        self._default_contexts: dict[tuple, LayerContext] = {}

    def embed(self, input_ids_BS: torch.Tensor) -> torch.Tensor:
        """The first layer's residual: the token embeddings (in every stream, with hyper-connections)."""
        if self.embed_tokens is None:
            raise ValueError("this attention stage holds no embedding (with_embedding: A-group 0's)")
        return hc.expand(self.embed_tokens(input_ids_BS), self.streams)

    def context(
        self, h_BSH: torch.Tensor, position_ids: torch.Tensor | None, token_ids: torch.Tensor | None = None
    ) -> LayerContext:
        """The micro-batch's context; with the default positions (None), one per shape, built once: its tensors
        are then the same every call, which a graphed part need not copy in, and no step rebuilds them. The token
        ids ([B, S]) join it where some layer routes by them."""
        if position_ids is not None or torch.is_inference_mode_enabled():
            ctx = build_context(self.config, self.rotary_emb, h_BSH, position_ids)
        else:
            key = (h_BSH.shape[:2], h_BSH.dtype, h_BSH.device, self.config._attn_implementation)
            if key not in self._default_contexts:
                with torch.no_grad():
                    self._default_contexts[key] = build_context(self.config, self.rotary_emb, h_BSH, None)
            ctx = self._default_contexts[key]
        return replace(ctx, token_ids=token_ids) if self.token_routed else ctx

    def part(self, layer: int) -> AttentionPart:
        part = self.layers[str(layer)]
        assert isinstance(part, AttentionPart)  # a ModuleDict's items are typed Module
        return part


class ExpertStage(nn.Module):
    """The expert shards ``[start, stop)`` of the MoE layers one F-group owns."""

    config: Any  # the model's HF config

    def __init__(self, model: nn.Module, layers: tuple[int, ...], start: int, stop: int):
        super().__init__()
        model = causal_lm(model)
        self.config = model.config
        family = family_of(model.config)
        hf_layers = model.model.layers
        self.first_expert, self.num_local = start, stop - start
        self.layers = nn.ModuleDict(
            {
                str(i): ExpertShard(
                    slice_experts(hf_layers[i].mlp.experts, model.config, family, start, stop),
                    start,
                    stop - start,
                    family.model_type,
                )
                for i in layers
                if is_moe_layer(hf_layers[i])
            }
        )

    def shard(self, layer: int) -> ExpertShard:
        shard = self.layers[str(layer)]
        assert isinstance(shard, ExpertShard)  # a ModuleDict's items are typed Module
        return shard


def compile_stage(module: nn.Module) -> None:
    """``torch.compile`` the parts of ``module`` in place (parameter names unchanged): every attention part, the
    head (norm, LM head and loss: compiled, the loss reads the bf16 logits once instead of writing and reading an
    fp32 copy of them, 2.5 GB per 4,096 tokens at a 152K vocabulary), and the elementwise middle of every expert
    shard (``grouped_experts.compiled_elementwise``)."""
    for sub in module.modules():
        if isinstance(sub, AttentionPart | Head):
            sub.compile()
        elif isinstance(sub, ExpertShard):
            sub.elementwise = compiled_elementwise()


def fp8_stage(module: nn.Module, bf16_width: int = BF16_WIDTH, expert_bf16_width: int = EXPERT_BF16_WIDTH) -> None:
    """The FP8 lever on ``module``'s parts, in place (parameter names unchanged): every attention part's projections
    (``fp8.modules.convert_linears``: attention, dense and shared-expert MLPs, LoRA's base products; not the router;
    not those with a width of at most ``bf16_width``, the config's ``"fp8_bf16_width"``) and every expert shard's
    GEMMs where the experts are wide enough (``fp8.shapes.experts_fp8_pay`` at ``expert_bf16_width``, the config's
    ``"fp8_expert_bf16_width"``). The head (LM head) stays in the model's dtype. After ``add_adapters``, whose
    ``LoraLinear`` wraps plain ``nn.Linear`` modules only."""
    for sub in module.modules():
        if isinstance(sub, AttentionPart):
            convert_linears(sub, skip=[sub.router] if sub.is_moe else [], bf16_width=bf16_width)
        elif isinstance(sub, ExpertStage) and experts_in_fp8(sub.config, expert_bf16_width):
            for layer in sub.layers:
                sub.shard(int(layer)).fp8 = True


def experts_in_fp8(config: Any, expert_bf16_width: int = EXPERT_BF16_WIDTH) -> bool:
    """Whether the FP8 lever runs the routed experts' GEMMs of the model of HF ``config`` in FP8 (its experts' widths
    past ``expert_bf16_width``, ``fp8.shapes.experts_fp8_pay``); their rows travel in FP8 either way."""
    return experts_fp8_pay(*expert_widths(config), expert_bf16_width)
