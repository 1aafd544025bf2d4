"""Hyper-connections (DeepSeek-V4's manifold-constrained mHC): a residual of several streams per token, cut like any
other residual.

A family with hyper-connections (``Family.hyper``) keeps ``hc`` residual streams per token, [B, S, hc, H], from the
embedding (which repeats each token's embedding into every stream) to the head (whose ``HyperHead`` collapses them
before the final norm). Around each block of a decoder layer (token mixer, MLP) one of HF's ``HyperConnection``
modules computes, from the streams, the block's input (``collapsed``) and two weights: ``post`` [B, S, hc], which
spreads the block's output over the streams, and ``comb`` [B, S, hc, hc], which mixes the streams themselves:

    out = post * block(collapsed) + comb^T @ streams        (HF's ``DeepseekV4DecoderLayer``, term for term)

The MLP block of an MoE layer is ``routed + shared``. The combine is linear in the routed sum, so the attention part
computes everything but it: ``residual = comb^T @ streams + post * shared`` and ``post`` (the experts' sum's weight
per stream), and where a plain residual adds the routed sum as it arrives, this one adds ``post * routed``
(``add_routed``). Only the routed sum's rounding differs from HF's ``post * (routed + shared)``; the weights and
streams are HF's own modules' outputs. Both travel in the residual hand-off (``comm.messages.Residual``: the
streams flattened to [T, hc * H], ``post`` as [T, hc]), and ``post``'s gradient comes back with the residual's.

Shape suffixes: B batch, S sequence, T = B*S tokens, C streams (hc), H hidden.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn


@dataclass(frozen=True)
class HyperConnections:
    """Where a family keeps its hyper-connections, by HF's attribute names (the parts keep them, so parameter names
    map to HF's by a prefix).

    Attributes:
        streams_attr: the config field with the number of residual streams (``hc_mult``).
        around_mixer: the decoder layer's ``HyperConnection`` around the token mixer (``attn_hc``).
        around_mlp: the one around the MLP or MoE block (``ffn_hc``).
        head: the base model's module collapsing the streams before the final norm (``hc_head``).
    """

    streams_attr: str = "hc_mult"
    around_mixer: str = "attn_hc"
    around_mlp: str = "ffn_hc"
    head: str = "hc_head"

    def streams(self, config) -> int:
        return int(getattr(config, self.streams_attr))


# What ``enter`` hands ``leave``: the block's (post, comb) weights, or None for a plain residual.
Around = tuple[torch.Tensor, torch.Tensor] | None


def enter(hc: nn.Module | None, h: torch.Tensor) -> tuple[torch.Tensor, Around]:
    """A block's input from the residual ``h``: ``h`` itself (plain), or the streams collapsed by ``hc``."""
    if hc is None:
        return h, None
    post_BSC, comb_BSCC, collapsed_BSH = hc(h)
    return collapsed_BSH, (post_BSC, comb_BSCC)


def leave(around: Around, h: torch.Tensor, out_BSH: torch.Tensor | None) -> torch.Tensor:
    """The residual after a block whose output is ``out_BSH`` (None: nothing of it here, e.g. an MoE layer without
    shared experts): ``h + out`` (plain), or ``post * out + comb^T @ h`` in HF's dtype casts and order."""
    if around is None:
        return h if out_BSH is None else h + out_BSH
    post_BSC, comb_BSCC = around
    mixed = torch.matmul(comb_BSCC.to(h.dtype).transpose(-1, -2), h)
    if out_BSH is None:
        return mixed
    return post_BSC.to(h.dtype).unsqueeze(-1) * out_BSH.unsqueeze(-2) + mixed


def routed_weight(around: Around, dtype: torch.dtype) -> torch.Tensor | None:
    """The routed experts' sum's weight per stream (``post``, [B, S, C] in the activations' dtype), or None: a plain
    residual adds the sum as it is."""
    return None if around is None else around[0].to(dtype)


def add_routed(residual: torch.Tensor, weight_BSC: torch.Tensor | None, routed_TH: torch.Tensor) -> torch.Tensor:
    """The layer's output: ``residual`` plus the routed experts' sum ([T, H]), weighed per stream where the
    residual has streams."""
    if weight_BSC is None:
        return residual + routed_TH.view_as(residual)
    B, S, _ = weight_BSC.shape
    return residual + weight_BSC.unsqueeze(-1) * routed_TH.view(B, S, 1, -1)


def expand(h_BSH: torch.Tensor, streams: int | None) -> torch.Tensor:
    """The embedding as the first layer's residual: each token's vector in every stream (HF's model), or as it is."""
    if streams is None:
        return h_BSH
    return h_BSH.unsqueeze(2).expand(-1, -1, streams, -1).contiguous()


def tokens_view(h: torch.Tensor) -> torch.Tensor:
    """A [B, S, H] tensor of the residual's batch, length, dtype and device (its first stream where it has
    several): what the masks and rotary tables are built from."""
    return h[:, :, 0] if h.dim() == 4 else h
