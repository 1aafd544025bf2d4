"""Per-family facts as data: where HF keeps the router, the shared experts and the expert count.

Qwen2-MoE, Qwen3-MoE, Mixtral, OLMoE, GPT-OSS, DeepSeek-V2, DeepSeek-V3, GLM-4.5-style MoE (``glm4_moe``),
Qwen3-Next and Qwen3.5-MoE (its text model, ``qwen3_5_moe_text``).

Every supported family builds its decoder layer from the same template (a token mixer, ``mlp``, two norms), and
its MoE block holds a router module that returns ``(router_logits, top_k_weights, top_k_index)`` plus a fused
``experts`` module. What differs is captured here, so that splitting a layer never branches on class names.

The token mixer is ``self_attn`` (softmax attention), or, in the hybrid Qwen3-Next / Qwen3.5 layers whose
``config.layer_types[i]`` is ``"linear_attention"``, ``linear_attn`` (Gated DeltaNet); ``mixer_attr`` says which.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from disagmoe_ds.errors import UnsupportedModelError

SharedFn = Callable[[nn.Module, torch.Tensor], torch.Tensor]


def _qwen2_shared(block: nn.Module, x_TH: torch.Tensor) -> torch.Tensor:
    # Qwen2-MoE gates its shared expert per token with a sigmoid.
    return F.sigmoid(block.shared_expert_gate(x_TH)) * block.shared_expert(x_TH)


def _deepseek_shared(block: nn.Module, x_TH: torch.Tensor) -> torch.Tensor:
    return block.shared_experts(x_TH)


@dataclass(frozen=True)
class Family:
    """How one HF MoE family lays out its MoE block.

    Attributes:
        model_type: ``config.model_type``.
        router_attr: attribute of the MoE block holding the router (``gate``, or ``router`` for GPT-OSS).
        num_experts_attr: config attribute that sets the experts module's expert count.
        shared: computes the shared-expert contribution on the attention side, or None.
        has_aux_loss: HF adds ``router_aux_loss_coef * load_balancing_loss`` when ``output_router_logits``.
        expert_bias_attr: router buffer of DeepSeek-V3 style auxiliary-loss-free balancing, or None.
    """

    model_type: str
    router_attr: str = "gate"
    num_experts_attr: str = "num_experts"
    shared: SharedFn | None = None
    has_aux_loss: bool = True
    expert_bias_attr: str | None = None


FAMILIES: dict[str, Family] = {
    f.model_type: f
    for f in (
        Family("qwen2_moe", shared=_qwen2_shared),
        Family("qwen3_moe", num_experts_attr="num_local_experts"),
        Family("mixtral", num_experts_attr="num_local_experts"),
        Family("olmoe"),
        Family("gpt_oss", router_attr="router", num_experts_attr="num_local_experts"),
        Family("deepseek_v2", num_experts_attr="n_routed_experts", shared=_deepseek_shared, has_aux_loss=False),
        Family(
            "deepseek_v3",
            num_experts_attr="n_routed_experts",
            shared=_deepseek_shared,
            has_aux_loss=False,
            expert_bias_attr="e_score_correction_bias",
        ),
        # GLM-4.5 / 4.6 / 4.7 (Air too): DeepSeek-V3's router (sigmoid, grouped top-k, a correction bias) and shared
        # experts, dense first layers, GQA attention with partial rotary embeddings.
        Family(
            "glm4_moe",
            num_experts_attr="n_routed_experts",
            shared=_deepseek_shared,
            has_aux_loss=False,
            expert_bias_attr="e_score_correction_bias",
        ),
        # Qwen3-Next and Qwen3.5-MoE: Qwen2-MoE's softmax router and sigmoid-gated shared expert; layers alternate
        # Gated DeltaNet linear attention (``linear_attn``) and gated softmax attention (``self_attn``).
        Family("qwen3_next", shared=_qwen2_shared),
        Family("qwen3_5_moe_text", shared=_qwen2_shared),
    )
}
# config.json model_types that name a family by another model_type: Qwen3.5-MoE's Hub config is its vision-language
# model, whose ``text_config`` (``qwen3_5_moe_text``) is the language model ``AutoModelForCausalLM`` builds.
ALIASES = {"qwen3_5_moe": "qwen3_5_moe_text"}


def family_of(config) -> Family:
    """The family adapter for an HF config, or a one-line error listing what is supported."""
    model_type = getattr(config, "model_type", None)
    model_type = ALIASES.get(model_type, model_type)
    if model_type not in FAMILIES:
        raise UnsupportedModelError(
            f"model_type {model_type!r} is not supported by DisagMoE-DS; supported: "
            f"{', '.join(sorted([*FAMILIES, *ALIASES]))}"
        )
    return FAMILIES[model_type]


def is_moe_layer(layer: nn.Module) -> bool:
    """A decoder layer is MoE iff its ``mlp`` holds routed experts (robust across dense-layer rules)."""
    return hasattr(layer.mlp, "experts")


def router_of(family: Family, layer: nn.Module) -> nn.Module:
    return getattr(layer.mlp, family.router_attr)


def mixer_attr(layer: nn.Module) -> str:
    """The decoder layer's token mixer: ``linear_attn`` (Gated DeltaNet layers of Qwen3-Next / Qwen3.5) or
    ``self_attn``."""
    return "linear_attn" if hasattr(layer, "linear_attn") else "self_attn"
