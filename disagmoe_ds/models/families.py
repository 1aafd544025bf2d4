"""How the runtime calls each family's modules: its facts (``capabilities.facts``, one record per family) with
the functions that compute its shared experts and call its router.

Qwen2-MoE, Qwen3-MoE, Mixtral, OLMoE, GPT-OSS, DeepSeek-V2, DeepSeek-V3, GLM-4.5-style MoE (``glm4_moe``),
Qwen3-Next and Qwen3.5-MoE (its text model, ``qwen3_5_moe_text``), ERNIE-4.5-MoE, Hunyuan-MoE (v1), dots.llm1,
MiniMax-M2 and DeepSeek-V4.

Every supported family builds its decoder layer from the same template (a token mixer, ``mlp``, two norms), and
its MoE block holds a router module that returns ``(router_logits, top_k_weights, top_k_index)`` plus a fused
``experts`` module. What differs is data (``capabilities.facts.FACTS``) plus the few functions here its kinds
name, so that splitting a layer never branches on class names.

The token mixer is ``self_attn`` (softmax attention), or, in the hybrid Qwen3-Next / Qwen3.5 layers whose
``config.layer_types[i]`` is ``"linear_attention"``, ``linear_attn`` (Gated DeltaNet); ``mixer_attr`` says which.

DeepSeek-V4 adds four facts: a residual of several streams (``hyper``: hyper-connections,
``models.hyper_connections``), rotary tables by name instead of one (``rotary_tables``), layer types that share
another type's mask (``mask_types``), and a token id -> experts table for the first layers, which choose their
experts by token id (``token_table``; ``moe_pattern.token_routed_layers``: the router takes the token ids, ``route``).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol, cast

import torch
import torch.nn.functional as F
from torch import nn

from disagmoe_ds.capabilities.facts import FACTS, VISION_LANGUAGE, FamilyFacts
from disagmoe_ds.capabilities.uncut import check_uncut
from disagmoe_ds.errors import UnsupportedModelError
from disagmoe_ds.models.hyper_connections import HyperConnections

SharedFn = Callable[[nn.Module, torch.Tensor], torch.Tensor | None]
# (block, x_TH, token_ids_T or None) -> (router_logits, top_k_weights, top_k_index)
RouteFn = Callable[[nn.Module, torch.Tensor, torch.Tensor | None], tuple[torch.Tensor, torch.Tensor, torch.Tensor]]


# The HF MoE blocks these functions are given, by what each reads of them: nn.Module's ``__getattr__`` types every
# attribute ``Tensor | Module``, so each function views its block as the shape HF builds (``cast``: no runtime cost).
class _GatedSharedBlock(Protocol):
    shared_expert: nn.Module
    shared_expert_gate: nn.Module


class _SharedExpertsBlock(Protocol):
    shared_experts: nn.Module | None  # ERNIE-4.5 builds none when moe_num_shared_experts is 0


class _SharedMlpBlock(Protocol):
    shared_mlp: nn.Module


class _BiasArgumentBlock(Protocol):
    gate: nn.Module
    e_score_correction_bias: torch.Tensor


class _TokenRoutedBlock(Protocol):
    gate: nn.Module
    is_hash: bool


def _qwen2_shared(block: nn.Module, x_TH: torch.Tensor) -> torch.Tensor:
    # Qwen2-MoE gates its shared expert per token with a sigmoid.
    gated = cast(_GatedSharedBlock, block)
    return F.sigmoid(gated.shared_expert_gate(x_TH)) * gated.shared_expert(x_TH)


def _deepseek_shared(block: nn.Module, x_TH: torch.Tensor) -> torch.Tensor | None:
    shared = cast(_SharedExpertsBlock, block).shared_experts
    return None if shared is None else shared(x_TH)


def _hunyuan_shared(block: nn.Module, x_TH: torch.Tensor) -> torch.Tensor:
    return cast(_SharedMlpBlock, block).shared_mlp(x_TH)


def _minimax_route(
    block: nn.Module, x_TH: torch.Tensor, token_ids_T: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    # MiniMax-M2 keeps its correction bias on the MoE block and hands it to the router.
    biased = cast(_BiasArgumentBlock, block)
    return biased.gate(x_TH, biased.e_score_correction_bias)


def _deepseek_v4_route(
    block: nn.Module, x_TH: torch.Tensor, token_ids_T: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    # DeepSeek-V4's hash-routed blocks (``is_hash``) take the token ids: their experts are ``tid2eid[input_ids]``.
    routed = cast(_TokenRoutedBlock, block)
    if routed.is_hash:
        if token_ids_T is None:
            raise RuntimeError("a hash-routed DeepSeek-V4 layer needs the token ids (LayerContext.token_ids)")
        return routed.gate(x_TH, token_ids_T)
    return routed.gate(x_TH)


@dataclass(frozen=True)
class Family(FamilyFacts):
    """One family's facts (``capabilities.facts.FamilyFacts``: names, kinds, what it cannot run with) and how the
    runtime calls its modules, chosen by the kinds the facts name.

    Attributes:
        shared: computes the shared-expert contribution on the attention side (None where a layer has none), or
            None (``FamilyFacts.shared_experts``).
        route: how the MoE block calls its router, where it is not ``router(x_TH)``, or None
            (``FamilyFacts.router_call``).
        hyper: the residual's streams (hyper-connections, ``models.hyper_connections``), or None
            (``FamilyFacts.hyper_connections``).
    """

    shared: SharedFn | None = None
    route: RouteFn | None = None
    hyper: HyperConnections | None = None


_SHARED: dict[str, SharedFn] = {"gated": _qwen2_shared, "experts": _deepseek_shared, "mlp": _hunyuan_shared}
_ROUTES: dict[str, RouteFn] = {"bias_argument": _minimax_route, "token_ids": _deepseek_v4_route}


def _family(facts: FamilyFacts) -> Family:
    return Family(
        **vars(facts),
        shared=None if facts.shared_experts is None else _SHARED[facts.shared_experts],
        route=None if facts.router_call is None else _ROUTES[facts.router_call],
        hyper=HyperConnections() if facts.hyper_connections else None,
    )


FAMILIES: dict[str, Family] = {model_type: _family(facts) for model_type, facts in FACTS.items()}
# config.json model_types that name a family by another model_type: Qwen3.5-MoE's Hub config is its vision-language
# model, whose ``text_config`` (``qwen3_5_moe_text``) is the language model ``AutoModelForCausalLM`` builds.
ALIASES = VISION_LANGUAGE


def family_of(config) -> Family:
    """The family adapter for an HF config, or a one-line error: the layer and the reason for a family known but
    not cut yet (``uncut``), else what is supported."""
    model_type: str | None = getattr(config, "model_type", None)
    model_type = model_type if model_type is None else ALIASES.get(model_type, model_type)
    if model_type not in FAMILIES:
        if hasattr(config, "to_dict"):  # an HF config (the benches build one-layer models from one)
            check_uncut(config.to_dict())
        raise UnsupportedModelError(
            f"model_type {model_type!r} is not supported by DisagMoE-DS; supported: "
            f"{', '.join(sorted([*FAMILIES, *ALIASES]))}"
        )
    return FAMILIES[model_type]


def is_moe_layer(layer: nn.Module) -> bool:
    """A built decoder layer is MoE iff its ``mlp`` holds routed experts: what HF built, where
    ``moe_pattern.moe_layer_pattern`` is the rule read from the config (a test holds the two equal for every config in
    hf_models/)."""
    return hasattr(layer.mlp, "experts")


def router_of(family: Family, layer: nn.Module) -> nn.Module:
    return getattr(layer.mlp, family.router_attr)


def route(
    family: Family, block: nn.Module, x_TH: torch.Tensor, token_ids_T: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(router_logits, top_k_weights, top_k_index)`` of the MoE block ``block`` for tokens ``x_TH`` (their ids
    ``token_ids_T`` where the layer routes by token id), its router called as the block calls it."""
    if family.route is not None:
        return family.route(block, x_TH, token_ids_T)
    return getattr(block, family.router_attr)(x_TH)


def expert_bias_of(family: Family, block: nn.Module) -> torch.Tensor | None:
    """The correction bias of an MoE block whose family has one (``expert_bias_path``); None for a block of it that
    has none (DeepSeek-V4's hash-routed blocks: a token's table chooses, nothing to balance)."""
    if family.expert_bias_path is None:
        raise UnsupportedModelError(f"model_type {family.model_type!r} has no router correction bias")
    owner_path, _, name = family.expert_bias_path.rpartition(".")
    return getattr(block.get_submodule(owner_path), name, None)


def token_table_of(family: Family, block: nn.Module) -> torch.Tensor | None:
    """The token id -> experts table ([V, K] int64) of a hash-routed MoE block (``Family.token_table``), else None."""
    if family.token_table is None:
        return None
    owner_path, _, name = family.token_table.rpartition(".")
    try:
        owner = block.get_submodule(owner_path)
    except AttributeError:  # a dense layer's MLP
        return None
    return getattr(owner, name, None)


def mixer_attr(layer: nn.Module) -> str:
    """The decoder layer's token mixer: ``linear_attn`` (Gated DeltaNet layers of Qwen3-Next / Qwen3.5) or
    ``self_attn``."""
    return "linear_attn" if hasattr(layer, "linear_attn") else "self_attn"


# Layer types the attention parts build a mask for (``context.build_context``).
LAYER_TYPES = ("full_attention", "sliding_attention", "linear_attention", "indexed_attention")


def check_cut(config) -> None:
    """Refuse, in one line naming the layer and the reason, a config the cut cannot hold (before any rank starts).

    * a layer type the attention parts have no mask for (``LAYER_TYPES``);
    * a per-layer expert count or top-k (Hunyuan's ``num_experts`` / ``moe_topk`` may be lists): every MoE
      layer's experts are sharded alike and every exchange carries one K.
    """
    family = family_of(config)
    for i, kind in enumerate(getattr(config, "layer_types", None) or ()):
        if family.mask_type(kind) not in LAYER_TYPES:
            raise UnsupportedModelError(
                f"layer {i} of the {config.model_type} config is a {kind!r} layer, which DisagMoE-DS cannot cut "
                f"(its attention parts handle {', '.join(LAYER_TYPES)})"
            )
    for attr in ("num_experts", "moe_topk"):
        value = getattr(config, attr, None)
        if isinstance(value, list | tuple):
            other = next((i for i, v in enumerate(value) if v != value[0]), 0)
            raise UnsupportedModelError(
                f"layer {other} of the {config.model_type} config has its own {attr} ({value[other]}; layer 0: "
                f"{value[0]}): DisagMoE-DS needs one {attr} for every MoE layer; write it as one number"
            )
