"""Frozen block-scaled FP8 weights, the layout DeepSeek-V3 / V3.2 ship their checkpoints in: each weight ``[..., N, K]``
is e4m3 ``data`` with a float32 ``scale_inv`` per block of ``block = (bn, bk)`` elements (``[..., ceil(N / bn),
ceil(K / bk)]``; the last blocks of a row or column may be partial), and stands for ``data * scale_inv`` blockwise.

A LoRA run over such a checkpoint keeps its base in this form (``models.fp8_base``): about one byte per parameter
instead of two. The products with it are differentiable in the activations only (the base is frozen: no dW):

    forward   y  = x W^T
    input     dx = dy W

each computed from the FP8 data in every call; nothing but the e4m3 data and the scales is kept between calls. On
CUDA in 16-bit activations one Triton kernel reads the e4m3 tiles and scales them in registers
(``fp8.triton_block_mm``); elsewhere (the CPU, float32 runs) the weight is dequantized transiently inside the call, in
the activations' dtype, and freed when the call returns.

The float32 reference of a weight is ``dequantize`` (each e4m3 value times its block's float32 scale, rounded once
to float32); a product in float32 multiplies exactly those values. transformers' own CPU dequantization agrees where
the blocks are whole and was seen to differ on partial edge blocks (a 24-wide weight in 16-wide blocks), which is why
the verifies' reference reads such a checkpoint as the ranks do (``parity.reference.load_for_verify``).

>>> w = torch.arange(12.0).view(3, 4) - 6
>>> q = quantize_blocks(w, (2, 2))
>>> q.data.dtype, tuple(q.scale_inv.shape), bool((q.dequantize() - w).abs().max() <= 6 / 16)
(torch.float8_e4m3fn, (2, 2), True)
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from disagmoe_ds.fp8 import triton_block_mm
from disagmoe_ds.fp8.projections import viewed, wanted
from disagmoe_ds.fp8.quantize import E4M3, E4M3_MAX, fused_on_cuda


@dataclass(frozen=True)
class BlockScaled:
    """A frozen weight ``[..., N, K]`` in e4m3 with a float32 ``scale_inv`` per ``block`` (rows, columns)."""

    data: torch.Tensor
    scale_inv: torch.Tensor
    block: tuple[int, int]

    @property
    def shape(self) -> torch.Size:
        return self.data.shape

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """The weight it stands for: each value times its block's scale in float32, then in ``dtype``."""
        return dequantize_blocks(self.data, self.scale_inv, self.block).to(dtype)


def block_scales(scale_inv: torch.Tensor, block: tuple[int, int], rows: int, cols: int) -> torch.Tensor:
    """``scale_inv`` expanded to one scale per element of a ``[..., rows, cols]`` weight."""
    expanded = scale_inv.repeat_interleave(block[0], dim=-2).repeat_interleave(block[1], dim=-1)
    return expanded[..., :rows, :cols]


def dequantize_blocks(data: torch.Tensor, scale_inv: torch.Tensor, block: tuple[int, int]) -> torch.Tensor:
    """``data * scale_inv`` blockwise, in float32 (whole blocks: the scales broadcast over a view, not expanded)."""
    rows, cols = data.shape[-2:]
    if rows % block[0] or cols % block[1]:  # partial blocks at the edges
        return data.float() * block_scales(scale_inv.float(), block, rows, cols)
    tiles = data.unflatten(-1, (-1, block[1])).unflatten(-3, (-1, block[0]))  # [..., Nb, bn, Kb, bk]
    return (tiles.float() * scale_inv.float()[..., :, None, :, None]).flatten(-4, -3).flatten(-2, -1)


def quantize_blocks(weight: torch.Tensor, block: tuple[int, int]) -> BlockScaled:
    """``weight`` in e4m3 with a scale per block, DeepSeek's recipe: each block's absolute maximum maps to 448 (an
    all-zero block gets scale 1). For writing checkpoints in that layout; training never quantizes its base."""
    rows, cols = weight.shape[-2:]
    pad_r, pad_c = -rows % block[0], -cols % block[1]
    padded = F.pad(weight.detach().float(), (0, pad_c, 0, pad_r))
    tiles = padded.unflatten(-1, (-1, block[1])).unflatten(-3, (-1, block[0]))  # [..., Nb, bn, Kb, bk]
    amax = tiles.abs().amax(dim=(-3, -1))
    scale_inv = torch.where(amax > 0, amax / E4M3_MAX, 1.0)
    scales = block_scales(scale_inv, block, rows, cols)
    data = (weight.float() / scales).clamp(-E4M3_MAX, E4M3_MAX).to(E4M3)
    return BlockScaled(data, scale_inv, block)


def block_linear(x: torch.Tensor, weight: BlockScaled, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``F.linear(x, W, bias)`` for the frozen ``W`` that ``weight`` stands for (``x`` [..., K], W [N, K]); the
    gradient reaches ``x`` (and ``bias``) only."""
    (x,) = viewed(x)
    y = _BlockLinear.apply(x, weight.data, weight.scale_inv, weight.block)
    return y if bias is None else y + bias


def block_grouped_mm(x_PK: torch.Tensor, weight: BlockScaled, offsets: torch.Tensor) -> torch.Tensor:
    """Row group i of ``x_PK`` (rows up to the end offset ``offsets[i]``) times ``W[i]^T``, for the frozen expert
    weights ``W`` [e, N, K] that ``weight`` stands for (scales [e, ceil(N / bn), ceil(K / bk)]); the gradient reaches
    ``x_PK`` only."""
    (x_PK,) = viewed(x_PK)
    return _BlockGroupedLinear.apply(x_PK, weight.data, weight.scale_inv, weight.block, offsets)


@fused_on_cuda
def _dequantized(data: torch.Tensor, scale_inv: torch.Tensor, block: tuple[int, int], dtype: torch.dtype):
    """``dequantize_blocks`` in ``dtype``: on CUDA compiled, so that no float32 copy of the weight is made."""
    return dequantize_blocks(data, scale_inv, block).to(dtype)


def _times_weight(
    x: torch.Tensor,
    data: torch.Tensor,
    scale_inv: torch.Tensor,
    block: tuple[int, int],
    offsets: torch.Tensor | None,
    *,
    transposed: bool,
) -> torch.Tensor:
    """``x W^T`` (``transposed``) or ``x W`` for the frozen ``W`` = ``data * scale_inv``: one weight [N, K]
    (``offsets`` None) or row groups of ``x`` times weights [e, N, K]. The Triton kernel where it runs, else the
    weight dequantized for this call."""
    if triton_block_mm.runs(x, block):
        if offsets is None:
            return triton_block_mm.block_mm(x, data, scale_inv, block, transposed=transposed)
        return triton_block_mm.grouped_block_mm(x, data, scale_inv, block, offsets, transposed=transposed)
    w = _dequantized(data, scale_inv, block, x.dtype)
    if offsets is None:
        return F.linear(x, w) if transposed else x @ w
    return F.grouped_mm(x, w.transpose(-2, -1) if transposed else w, offs=offsets)


class _BlockLinear(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x, data, scale_inv, block: tuple[int, int]) -> torch.Tensor:
        ctx.save_for_backward(data, scale_inv)
        ctx.block = block
        return _times_weight(x, data, scale_inv, block, None, transposed=True)

    @staticmethod
    def backward(ctx: Any, dy: torch.Tensor):
        data, scale_inv = ctx.saved_tensors  # unpacked once: a checkpointed region allows no more
        dx = _times_weight(dy, data, scale_inv, ctx.block, None, transposed=False) if wanted(ctx, 0) else None
        return dx, None, None, None


class _BlockGroupedLinear(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x_PK, data, scale_inv, block: tuple[int, int], offsets) -> torch.Tensor:
        ctx.save_for_backward(offsets, data, scale_inv)
        ctx.block = block
        return _times_weight(x_PK, data, scale_inv, block, offsets, transposed=True)

    @staticmethod
    def backward(ctx: Any, dy_PN: torch.Tensor):
        offsets, data, scale_inv = ctx.saved_tensors  # unpacked once: a checkpointed region allows no more
        dx = _times_weight(dy_PN, data, scale_inv, ctx.block, offsets, transposed=False) if wanted(ctx, 0) else None
        return dx, None, None, None, None
