"""A deliberately skewed router for tests and ``disagmoe-verify --skew``: every token picks one expert first.

It changes the router's *input* through a forward pre-hook (a large push along hidden dim 0, with only the chosen
expert's router weight reading that dim), so everything after it is still HF's own routing math. A hash-routed
layer (DeepSeek-V4's ``tid2eid``) chooses by token id: its table sends every token to the chosen expert first and
the next ones after it.
"""

from __future__ import annotations

import torch
from torch import nn

from disagmoe_ds.models.families import family_of, is_moe_layer, router_of, token_table_of
from disagmoe_ds.models.hf_model import causal_lm

PUSH = 50.0


def _push(module: nn.Module, args: tuple) -> tuple:
    x = args[0]
    shift = torch.zeros(x.shape[-1], dtype=x.dtype, device=x.device)
    shift[0] = PUSH
    return (x + shift, *args[1:])


def skew_router(model: nn.Module, expert: int = 0, *, spread: bool = False) -> None:
    """Make every token of every MoE layer choose ``expert`` (with its highest score); ``spread``: the i-th MoE
    layer's tokens choose expert ``expert + i`` instead (modulo the router's experts), every layer collapsed onto an
    expert of its own, which a loss over all layers' rows pooled reads as balanced."""
    model = causal_lm(model)
    family = family_of(model.config)
    moe_layers = [layer for layer in model.model.layers if is_moe_layer(layer)]
    for i, layer in enumerate(moe_layers):
        router = router_of(family, layer)
        weight_EH = router.get_parameter(family.router_weight)
        chosen = (expert + i * spread) % weight_EH.shape[0]
        with torch.no_grad():
            weight_EH[:, 0] = 0.0
            weight_EH[chosen, 0] = 1.0
            table_VK = token_table_of(family, layer.mlp)
            if table_VK is not None:
                table_VK.copy_((chosen + torch.arange(table_VK.shape[1])) % weight_EH.shape[0])
        router.register_forward_pre_hook(_push)
