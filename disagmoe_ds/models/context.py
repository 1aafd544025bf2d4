"""What every attention part of one micro-batch needs besides the hidden states: masks, rotary embeddings, positions
and, where a layer routes by token id, the token ids. Computed locally on every attention rank, as ``XModel.forward``
computes them (no KV cache, no padding mask)."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn
from transformers.masking_utils import create_causal_mask, create_sliding_window_causal_mask

from disagmoe_ds.models.families import family_of
from disagmoe_ds.models.hyper_connections import tokens_view


@dataclass(frozen=True)
class LayerContext:
    """What every attention part of one micro-batch needs besides the hidden states.

    ``token_ids`` [B, S]: the micro-batch's token ids, where some layer routes by them (DeepSeek-V4's hash-routed
    layers; ``moe_pattern.token_routed_layers``), else None.
    """

    position_ids: torch.Tensor
    position_embeddings: object  # (cos, sin) tuple, DeepSeek-V2's complex freqs, or a dict of them by table name
    masks: dict[str, object]  # keyed by layer type: "full_attention" / "sliding_attention" / "linear_attention"...
    token_ids: torch.Tensor | None = None

    def mask_for(self, config, layer: int):
        return self.masks[layer_type(config, layer)]


def layer_type(config, layer: int) -> str:
    layer_types = getattr(config, "layer_types", None)
    if layer_types:
        return layer_types[layer]
    return "sliding_attention" if getattr(config, "sliding_window", None) else "full_attention"


def build_context(config, rotary_emb: nn.Module, h: torch.Tensor, position_ids: torch.Tensor | None) -> LayerContext:
    """Masks and rotary embeddings exactly as ``XModel.forward`` builds them (no KV cache, no padding mask), for the
    residual ``h`` ([B, S, H], or [B, S, hc, H] with hyper-connections).

    Passing ``position_ids`` lets HF detect packed documents (position restarts) and build a block-diagonal mask;
    it reads them on the host to find out (a device sync), so pass None when the batch has the default positions.
    A layer type that takes another's mask (``Family.mask_types``) shares that one, built once.
    """
    family = family_of(config)
    h_BSH = tokens_view(h)
    given = position_ids
    if position_ids is None:
        position_ids = torch.arange(h_BSH.shape[1], device=h_BSH.device).unsqueeze(0)
    kinds = {layer_type(config, i) for i in range(config.num_hidden_layers)}
    builders = {
        "full_attention": create_causal_mask,
        "sliding_attention": create_sliding_window_causal_mask,
        "linear_attention": _no_padding_mask,
        "indexed_attention": _indexed_mask,
    }
    # The cache argument is passed positionally: it is named past_key_values in transformers 5.17, cache in 5.2x.
    built = {
        mask: builders[mask](config, h_BSH, None, None, position_ids=given)
        for mask in {family.mask_type(kind) for kind in kinds}
    }
    masks = {kind: built[family.mask_type(kind)] for kind in kinds}
    rotary_ids = position_ids[None].expand(3, *position_ids.shape) if family.mrope else position_ids
    if family.rotary_tables:  # one table per name, as DeepSeek-V4's model hands them to its attention
        tables = {name: rotary_emb(h_BSH, rotary_ids, layer_type=name) for name in family.rotary_tables}
        return LayerContext(position_ids, tables, masks)
    return LayerContext(position_ids, rotary_emb(h_BSH, rotary_ids), masks)


def _indexed_mask(*args, **kwargs):
    """DeepSeek-V3.2's mask, made as its model makes it: always a tensor (never skipped for SDPA's is_causal),
    since the indexer scores keys against it and folds its top-k choice into it."""
    return create_causal_mask(*args, allow_is_causal_skip=False, **kwargs)


def _no_padding_mask(*args, **kwargs) -> None:
    """A linear-attention layer's mask: HF's ``create_recurrent_attention_mask`` is the 2D padding mask, None
    without one, and the parts never get one (no padding mask, as above). Linear attention is causal by itself."""
    return None
