"""Differentiable FP8 projections: a linear layer's ``x W^T`` and the experts' grouped ``x_g W_g^T``, each of their
three GEMMs in FP8 (``gemm``), everything else (inputs, weights, gradients) in the caller's dtype.

Each backward computes only the gradients the running autograd pass reaches, as torch's own GEMM nodes do: a split
backward's B (input gradients only) skips the weight GEMM and its W (``afpipe.split_backward``: the parameters only)
the input GEMM. A custom Function's ``needs_input_grad`` is fixed at its forward, so the operands enter through a view
each, a node of their own that the engine reports on (``torch._C._will_engine_execute_node``; a leaf's gradient
accumulator cannot be asked under ``autograd.grad``). A compiled region's backward is traced once for every pass and
computes what ``needs_input_grad`` says.

The routed experts' weights get their FP8 copies from ``weight_cache`` (cast once per optimizer step inside an
executor's step); a linear layer's are cast in every call (small weights, most of them inside compiled parts, where
the cast fuses with the GEMM's other operand's; the planner prices them so).
"""

from __future__ import annotations

from typing import Any

import torch

from disagmoe_ds.fp8.gemm import grouped_weight_grad, scaled_grouped_mm, scaled_mm
from disagmoe_ds.fp8.quantize import Quantized, dequantize, quantize
from disagmoe_ds.fp8.weight_cache import quantized_weight


def fp8_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``F.linear(x, weight, bias)`` with its GEMMs in FP8 (``x`` [..., K], ``weight`` [N, K])."""
    y = _Linear.apply(*viewed(x, weight))
    return y if bias is None else y + bias


def fp8_grouped_mm(
    x: torch.Tensor, weight: torch.Tensor, offsets: torch.Tensor, *, fp8_rows: bool = False
) -> torch.Tensor:
    """``F.grouped_mm(x, weight.transpose(1, 2), offs=offsets)`` with its GEMMs in FP8: row group i of ``x`` [P, K]
    times ``weight[i]^T`` (``weight`` [e, N, K], the HF layout of fused expert projections). ``fp8_rows``: ``x``'s
    rows are FP8 values already (routed tokens, sent in FP8): autograd keeps them for dW as their e4m3 bytes and
    scales, half the memory of ``x``, from which it gets back exactly ``x`` (quantizing FP8 values changes none)."""
    return _GroupedLinear.apply(*viewed(x, weight), offsets, fp8_rows)


def viewed(*tensors: torch.Tensor) -> tuple[torch.Tensor, ...]:
    return tuple(t.view_as(t) if t.requires_grad and not torch.compiler.is_compiling() else t for t in tensors)


def wanted(ctx: Any, i: int) -> bool:
    """Whether the running backward pass needs the gradient of input ``i`` (see the module docstring)."""
    if not ctx.needs_input_grad[i]:
        return False
    if torch.compiler.is_compiling():
        return True
    node = ctx.next_functions[i][0]
    if node is None or type(node).__name__ == "AccumulateGrad":
        return True
    return torch._C._will_engine_execute_node(node)


class _Linear(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        x_MK = x.reshape(-1, x.shape[-1])
        ctx.save_for_backward(x_MK, weight)
        ctx.shape = x.shape
        y_MN = scaled_mm(quantize(x_MK, -1), quantize(weight, -1), x.dtype)
        return y_MN.view(*x.shape[:-1], weight.shape[0])

    @staticmethod
    def backward(ctx: Any, dy: torch.Tensor) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        x_MK, weight = ctx.saved_tensors
        dy_MN = dy.reshape(-1, dy.shape[-1])
        dx = dw = None
        if wanted(ctx, 0):
            dx = scaled_mm(quantize(dy_MN, -1), quantize(weight.t(), -1), dy.dtype).view(ctx.shape)
        if wanted(ctx, 1):
            dw = scaled_mm(quantize(dy_MN.t(), -1), quantize(x_MK.t(), -1), weight.dtype)
        return dx, dw


class _GroupedLinear(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, weight: torch.Tensor, offsets: torch.Tensor, fp8_rows: bool) -> torch.Tensor:
        q = quantize(x, -1)
        ctx.save_for_backward(weight, offsets, *((q.data, q.scale) if fp8_rows else (x,)))
        ctx.dtype = x.dtype
        return scaled_grouped_mm(q, quantized_weight(weight), offsets, x.dtype)

    @staticmethod
    def backward(ctx: Any, dy: torch.Tensor) -> tuple[torch.Tensor | None, torch.Tensor | None, None, None]:
        weight, offsets, *kept = ctx.saved_tensors
        dx = dw = None
        if wanted(ctx, 0):
            w_t = quantized_weight(weight, transposed=True)
            dx = scaled_grouped_mm(quantize(dy, -1), w_t, offsets, dy.dtype)
        if wanted(ctx, 1):
            x = dequantize(Quantized(*kept), ctx.dtype) if len(kept) == 2 else kept[0]
            dw = grouped_weight_grad(dy, x, offsets).to(weight.dtype)
        return dx, dw, None, None
