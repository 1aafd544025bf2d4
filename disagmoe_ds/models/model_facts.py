"""Facts of the whole model, from its config (the preflight knows no more) or, for the router's output, its modules:
the routed experts, a token's residual in the hand-off, and what a rank's runners need to know of the routing.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from disagmoe_ds.capabilities.facts import FACTS
from disagmoe_ds.models.families import family_of, route
from disagmoe_ds.models.hf_model import causal_lm
from disagmoe_ds.models.moe_pattern import moe_layer_pattern, token_routed_layers


def num_experts_of(config) -> int:
    """E, the routed experts of every MoE layer, from the HF config."""
    return getattr(config, family_of(config).num_experts_attr)


def expert_widths(config) -> tuple[int, int]:
    """(H, I): the hidden size and a routed expert's intermediate size, from the HF config."""
    return config.hidden_size, getattr(config, FACTS[config.model_type].expert_width_field)


def residual_shape(config) -> tuple[int, int, int]:
    """A token's residual in the hand-off (``comm.messages.Dims``): its streams, the routed sum's weights (one per
    stream with hyper-connections, else none) and its token-id columns (one where some layer routes by token id)."""
    hyper = family_of(config).hyper
    streams = 1 if hyper is None else hyper.streams(config)
    return streams, 0 if hyper is None else streams, int(any(token_routed_layers(config.to_dict())))


def num_routed_experts(model: nn.Module) -> int:
    """E of ``model`` (its config's ``num_experts_of``)."""
    return num_experts_of(model.config)


@dataclass(frozen=True)
class RoutingFacts:
    """What a rank's runners need to know of the whole model's routing once its own parts are cut.

    Attributes:
        moe_layers: one bool per layer, True where it routes (``moe_pattern.moe_layer_pattern`` of the config).
        top_k: K, experts chosen per token.
        weight_dtype: dtype of the routing weights (fp32 for Mixtral/DeepSeek even in bf16 models).
    """

    moe_layers: tuple[bool, ...]
    top_k: int
    weight_dtype: torch.dtype


def routing_facts(model: nn.Module) -> RoutingFacts:
    """The ``RoutingFacts`` of ``model`` (on the meta device too): its first router runs once on a zero token."""
    model = causal_lm(model)
    moe = moe_layer_pattern(model.config.to_dict())
    family = family_of(model.config)
    block = model.model.layers[moe.index(True)].mlp
    router = getattr(block, family.router_attr)
    param = next(model.parameters())
    with torch.no_grad():
        x_1H = torch.zeros(1, model.config.hidden_size, dtype=param.dtype, device=param.device)
        token_1 = torch.zeros(1, dtype=torch.long, device=param.device)  # for a router that reads token ids
        _, weights, _ = route(family, block, x_1H, token_1)
    return RoutingFacts(moe, router.top_k, weights.dtype)
