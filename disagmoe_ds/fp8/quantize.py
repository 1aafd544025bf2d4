"""FP8 (e4m3) values with their scales: ``data * scale`` is the tensor they stand for.

Rowwise (per-channel) scaling along one dimension: each slice along ``dim`` (a GEMM's reduction dimension) gets
one scale, the smallest power of two that maps its absolute maximum into e4m3's range (448). A power of two makes
the scaling exact: the only rounding is e4m3's own (3 mantissa bits, a relative error up to 2^-4 per element), and
dequantizing is exact in float32. An all-zero slice gets scale 1.

>>> q = quantize(torch.tensor([[1.0, -3.0, 0.5]]), dim=-1)
>>> q.scale.item(), dequantize(q).tolist()
(0.0078125, [[1.0, -3.0, 0.5]])

Quantizing what ``dequantize`` returns gives the same values again (a row's largest value may take the next smaller
scale, and every value is then still exact), so rows sent in FP8 (``round_trip``: the values the routed experts see)
cost the expert GEMMs nothing more: their own rowwise quantization of those rows changes none of them.

On CUDA, outside a compiled region, the rowwise quantization runs compiled (``fused_on_cuda``: a reduction and one
cast kernel, no float32 copy of the operand), as it would inside one;
eagerly they cost more than the FP8 GEMMs save, and a float32 copy of a large model's expert weights does not fit.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, TypeVar

import torch

F = TypeVar("F", bound=Callable[..., Any])

E4M3 = torch.float8_e4m3fn
E4M3_MAX = torch.finfo(E4M3).max  # 448
SMALLEST_SCALE = torch.finfo(torch.float32).tiny  # 2^-126, a power of two


@dataclass(frozen=True)
class Quantized:
    """An FP8 tensor and its float32 scales (broadcastable to it, size 1 along the scaled dimension)."""

    data: torch.Tensor
    scale: torch.Tensor

    @property
    def shape(self) -> torch.Size:
        return self.data.shape

    def t(self) -> Quantized:
        """The transpose of a 2-D value (a view: ``torch._scaled_mm`` wants its second operand column-major)."""
        return Quantized(self.data.t(), self.scale.t())

    def rows(self, index: torch.Tensor) -> Quantized:
        """The rows ``index`` of a rowwise value, its bytes and scales (gathered as bytes: not every backend gathers
        e4m3)."""
        data = self.data.view(torch.uint8).index_select(0, index).view(self.data.dtype)
        return Quantized(data, self.scale.index_select(0, index))


def fused_on_cuda(fn: F) -> F:
    """``fn`` compiled (dynamic shapes, on first use) where its first argument is a CUDA tensor and nothing is being
    compiled around it; as it is elsewhere."""
    compiled: Callable[..., Any] | None = None

    @functools.wraps(fn)
    def call(x: torch.Tensor, *args: Any) -> Any:
        nonlocal compiled
        if not x.is_cuda or torch.compiler.is_compiling():
            return fn(x, *args)
        if compiled is None:
            compiled = torch.compile(fn, dynamic=True)
        return compiled(x, *args)

    return call  # type: ignore[return-value]


def quantize(x: torch.Tensor, dim: int) -> Quantized:
    """``x`` in e4m3 with one power-of-two scale per slice along ``dim`` (``dim`` kept, size 1, in the scales); not
    differentiable (``round_trip`` passes gradients through)."""
    x = x.detach()
    if dim in (-1, x.dim() - 1):
        return Quantized(*rowwise(x))
    return cast(x, scale_of(x.abs().amax(dim=dim, keepdim=True)))


@fused_on_cuda
def rowwise(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``quantize(x, -1)``'s data (contiguous: the FP8 kernels read a transposed weight's rows from memory, and this is
    where the copy fuses into the cast) and scales."""
    q = cast(x, scale_of(x.abs().amax(dim=-1, keepdim=True)))
    return q.data.contiguous(), q.scale


def scale_of(amax: torch.Tensor) -> torch.Tensor:
    """The smallest power of two that maps ``amax`` into e4m3's range (float32; 1 where ``amax`` is 0), at least
    float32's smallest normal number: below it ``amax / 448`` underflows to 0 (a slice of denormal gradients, say),
    whose scale 0 would make every value NaN; such a slice quantizes to zeros. Exact on every backend: the
    logarithm's guess is corrected by products with powers of two, which do not round."""
    amax = amax.float()
    scale = torch.exp2(torch.ceil(torch.log2(amax / E4M3_MAX)))  # right, or off by a factor of 2 at a boundary
    scale = torch.where(amax > E4M3_MAX * scale, scale * 2, scale)
    scale = torch.where(amax <= E4M3_MAX * 0.5 * scale, scale * 0.5, scale)
    return torch.where(amax > 0, scale.clamp(min=SMALLEST_SCALE), 1.0)  # log2(0) = -inf: an all-zero slice


def cast(x: torch.Tensor, scale: torch.Tensor) -> Quantized:
    """``x`` in e4m3 at ``scale`` (broadcastable to ``x``), saturating at e4m3's largest value."""
    return Quantized((x.float() / scale).clamp(-E4M3_MAX, E4M3_MAX).to(E4M3), scale)


def dequantize(q: Quantized, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """The tensor ``q`` stands for, in ``dtype``: exact in float32 and bfloat16 (3 mantissa bits times a power of
    two), so it is computed in ``dtype`` itself (on CUDA one kernel: eagerly a cast and a multiply, each as slow as
    a pass over a wider tensor)."""
    exact = dtype if dtype in (torch.float32, torch.bfloat16) else torch.float32
    return _scaled(q.data, q.scale, exact).to(dtype)


@fused_on_cuda
def _scaled(data: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return data.to(dtype) * scale.to(dtype)


def round_trip(x: torch.Tensor) -> torch.Tensor:
    """The values ``x``'s rows stand for in FP8 (``quantize`` along the last dimension, dequantized to ``x``'s dtype);
    the gradient passes through unchanged (straight through, as a quantized wire's receiver sends it back)."""
    return _RoundTrip.apply(x)


class _RoundTrip(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
        return dequantize(quantize(x, -1), x.dtype)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
        return grad
