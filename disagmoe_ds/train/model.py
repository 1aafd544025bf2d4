"""The HF model a rank cuts its role from: freshly initialised or pretrained, with parts frozen on request.

Freezing happens on the whole HF model before ``build_rank`` cuts it: the attention stages and expert shards
keep ``requires_grad``, and each role engine's DeepSpeed optimizer receives only the trainable parameters.
Gradients still flow *through* frozen modules (the router's input is trainable), only their weights stay put.
"""

from __future__ import annotations

from dataclasses import dataclass

from torch import nn

from disagmoe_ds.models.families import family_of, is_moe_layer, router_of
from disagmoe_ds.models.loading import build_meta_model, load_model
from disagmoe_ds.train.args import TrainArgs


@dataclass(frozen=True)
class Frozen:
    """How many parameters ``freeze`` fixed, for the start banner."""

    router: int
    attention: int


def load_train_model(args: TrainArgs) -> tuple[nn.Module, Frozen]:
    """``--init-from``: the pretrained weights; otherwise ``--model``'s config on the meta device.

    From scratch, no rank ever holds the whole model: ``build_rank`` materialises and initialises (HF's
    ``_init_weights``) only the parts the rank owns. A ``--model`` directory that holds weights is still
    initialised fresh: pretraining starts from scratch unless ``--init-from`` says otherwise.
    """
    if args.pretrained:
        model = load_model(args.model, dtype=args.torch_dtype, require_weights=True)
    else:
        model = build_meta_model(args.model, dtype=args.torch_dtype)
    return model, freeze(model, router=args.freeze_router, attention=args.freeze_attention)


def freeze(model: nn.Module, *, router: bool, attention: bool) -> Frozen:
    """Set ``requires_grad=False`` on every MoE router (``router``) and every self-attention block and its
    input norm (``attention``); returns the number of parameters frozen in each."""
    family = family_of(model.config)
    counts = {"router": 0, "attention": 0}
    for layer in model.model.layers:
        parts = []
        if router and is_moe_layer(layer):
            parts.append(("router", router_of(family, layer)))
        if attention:
            parts += [("attention", layer.self_attn), ("attention", layer.input_layernorm)]
        for kind, module in parts:
            for param in module.parameters():
                param.requires_grad_(False)
                counts[kind] += param.numel()
    return Frozen(**counts)
