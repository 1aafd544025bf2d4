"""FP8 GEMMs with rowwise scales, and the differentiable linear and grouped projections built from them.

Each GEMM operand is quantized along the GEMM's reduction dimension (``quantize.quantize``), the recipe of torchao's
rowwise float8 training and of its FP8 grouped GEMM for MoE, applied to all three GEMMs of a projection:

    forward   y  = x W^T          x per row (token),        W per output channel
    input     dx = dy W           dy per row (token),       W per input channel
    weight    dW = dy^T x         dy and x per channel, over the tokens; the experts' grouped dW in high precision

The master weights, their gradients and the optimizer state stay in the model's dtype; only the GEMM operands are
FP8, quantized again in every forward and backward from the high-precision values autograd saved.

On CUDA the GEMMs are torch's FP8 kernels (``torch._scaled_mm``, ``torch._scaled_grouped_mm``). Elsewhere they are
emulated exactly: the FP8 operands dequantized (exact: power-of-two scales) and multiplied in float32, which is the
product the FP8 kernels compute with float32 accumulation, up to the order of the sums.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from disagmoe_ds.fp8.quantize import Quantized, dequantize


def scaled_mm(a: Quantized, b: Quantized, out_dtype: torch.dtype) -> torch.Tensor:
    """``a @ b^T`` for ``a`` [M, K] scaled per row and ``b`` [N, K] scaled per row: [M, N] in ``out_dtype``."""
    if a.data.is_cuda:
        a_data, b_data = a.data.contiguous(), b.data.contiguous()  # row-major a, column-major b^T
        return torch._scaled_mm(a_data, b_data.t(), scale_a=a.scale, scale_b=b.scale.t(), out_dtype=out_dtype)
    # torch's CPU kernel takes per-tensor scales only before torch 2.13
    return (dequantize(a) @ dequantize(b).t()).to(out_dtype)


def scaled_grouped_mm(a: Quantized, b: Quantized, offsets: torch.Tensor, out_dtype: torch.dtype) -> torch.Tensor:
    """Row group i of ``a`` [P, K] (rows up to the end offset ``offsets[i]``) times ``b[i]^T`` (``b`` [e, N, K]),
    both scaled per row: [P, N] in ``out_dtype``."""
    if not a.data.is_cuda:
        return F.grouped_mm(dequantize(a), dequantize(b).transpose(-2, -1), offs=offsets).to(out_dtype)
    a_data, b_data, b_scale = a.data.contiguous(), b.data.contiguous(), b.scale.squeeze(-1).contiguous()
    e, n, k = b_data.shape
    r = tile_split(a_data.shape[0], e, n, k)
    if r > 1:  # r groups per expert, the r - 1 after it empty: the same product, on torch's small tile
        groups = r * e - (r - 1)
        b_data = b_data.as_strided((groups, n, k), (n * k // r, k, 1))
        b_scale = b_scale.as_strided((groups, n), (n // r, 1))
        offsets = offsets.repeat_interleave(r)[:groups]
    return torch._scaled_grouped_mm(
        a_data,
        b_data.transpose(-2, -1),
        scale_a=a.scale.squeeze(-1),
        scale_b=b_scale,
        offs=offsets,
        out_dtype=out_dtype,
    )


def tile_split(rows: int, experts: int, n: int, k: int) -> int:
    """How many groups to show torch's FP8 grouped GEMM for each expert (1: as they are).

    torch (``ScaledGroupMM.cu``, 2.8 to 2.11 at least) picks its CUTLASS tile from the mean rows per group M = rows
    / groups, N and K: 64 x 128 where M or N is at most 128, 128 x 128 where two of M, N, K reach 2,048, else
    128 x 256 x 64, which runs at half the rate of bf16 ``grouped_mm`` at Qwen3-30B-A3B's experts (M 256, N 1,536,
    K 2,048: 0.50x on an H200) where the 64 x 128 tile runs 1.05-1.35x (H100, ``bench/fp8_grouped_gemms.py
    --candidates``). Showing each expert as r groups, the r - 1 after it empty (their weights a view into the
    next expert's, never read), brings M down to 128 without copying anything."""
    m = rows // experts
    if m <= 128 or n <= 128 or sum(d >= 2048 for d in (m, n, k)) >= 2 or experts < 2:
        return 1
    for r in range(2, 17):
        if rows // (r * experts - (r - 1)) <= 128:
            return r if n % r == 0 and (n * k // r) % 16 == 0 else 1  # each view's rows 16-byte aligned
    return 1


def grouped_weight_grad(dy: torch.Tensor, x: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    """``dy_g^T x_g`` for each row group g of ``dy`` [P, N] and ``x`` [P, K]: [e, N, K], in the operands' own dtype.

    The experts' weight gradient stays in high precision (torchao's ``rowwise_with_gw_hp`` recipe): torch 2.11's FP8
    kernel for this layout (both operands 2-D, the groups along the reduction) runs slower than bf16 ``grouped_mm``
    at our shapes before any quantization is paid (DeepSeek-V3's gate_up 9.8 against 6.6 ms on an H100), so the FP8
    dW of ``fp8.group_columns`` lost at every shape timed (0.21-0.71x, performance-log section 31)."""
    return F.grouped_mm(dy.t(), x, offs=offsets)
