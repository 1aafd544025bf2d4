"""The routed experts' weight gradient in FP8: ``dW_g = dy_g^T x_g`` for each expert g, whose reduction runs over
that expert's tokens, so both operands are scaled per column over each expert's rows (one scale per (expert,
channel)), the recipe of DeepSeek-V3's and torchao's FP8 MoE training for this GEMM.

``quantize_group_columns`` writes an operand as torch's FP8 grouped GEMM wants it for groups along the reduction
(``torch._scaled_grouped_mm`` with both operands 2-D): transposed, each expert's rows starting at a multiple of 16
(its kernel loads 16-byte aligned runs of e4m3 bytes), the gaps zero, so that dropless groups of any size fit. On
CUDA one Triton kernel reads the operand twice (amax per column, then its e4m3 bytes, ``fp8.triton_e4m3``'s recipe)
and writes it once; elsewhere torch computes the same bytes. Values and scales are ``fp8.quantize``'s: a power-of-two
scale per slice, e4m3 rounded to nearest even.

Measured, not run in training: torch 2.11's FP8 grouped GEMM for this layout is slower than its bf16 one at our
shapes, so this dW lost to bf16 at every shape timed (0.21-0.71x on an H100, performance-log section 31) and the
runtime keeps ``fp8.gemm.grouped_weight_grad`` in bf16. ``bench/bench_weight_grad.py`` re-times it on a newer torch.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from disagmoe_ds.fp8.quantize import E4M3, cast, scale_of

try:
    import triton
    import triton.language as tl

    from disagmoe_ds.fp8.triton_e4m3 import amax_stats, e4m3_bits, inverse_scale, pow2, scale_exponent
except ImportError:  # CPU-only installs: torch computes the same bytes
    triton = None

TILES = {"BLOCK_R": 64, "BLOCK_C": 64, "num_warps": 4}  # rows, columns of a program's tile
ALIGN = 16  # rows: torch's FP8 grouped GEMM reads each group's e4m3 run from a 16-byte boundary


@dataclass(frozen=True)
class GroupColumns:
    """An operand [P, C] of a grouped weight gradient in FP8: ``data`` [C, W] e4m3 (transposed: group g's rows at
    columns ``offsets[g - 1]`` up to ``offsets[g]``, padded with zeros to a multiple of 16), ``scale`` [G, C] float32
    (group g's column c is ``data[c, its columns] * scale[g, c]``), ``offsets`` [G] int32 (the padded groups' ends)."""

    data: torch.Tensor
    scale: torch.Tensor
    offsets: torch.Tensor

    def dequantize(self) -> torch.Tensor:
        """The [C, W] float32 values (exact: power-of-two scales); columns past the last group's end are zero."""
        width = self.data.shape[1]
        group = torch.searchsorted(self.offsets, torch.arange(width, device=self.data.device), right=True)
        scale = self.scale.t()[:, group.clamp(max=self.scale.shape[0] - 1)]
        return self.data.float() * scale


def runs_on(t: torch.Tensor) -> bool:
    """The Triton kernel takes ``t``: CUDA with Triton (the interpreter's tests replace this to run on the CPU)."""
    return triton is not None and t.is_cuda


def quantize_group_columns(x_PC: torch.Tensor, offsets_G: torch.Tensor) -> GroupColumns:
    """``x_PC``'s rows in groups (group g: the rows up to the end offset ``offsets_G[g]``, the rows after the last
    one ignored) as a ``GroupColumns``: each group's columns scaled over its rows."""
    rows, groups = x_PC.shape[0], offsets_G.shape[0]
    counts = torch.diff(offsets_G, prepend=offsets_G.new_zeros(1))
    padded_counts = (counts + ALIGN - 1) // ALIGN * ALIGN
    ends = padded_counts.cumsum(0).to(torch.int32)
    width = (rows + ALIGN - 1) // ALIGN * ALIGN + ALIGN * groups  # a bound: no group size is read back to the host
    if runs_on(x_PC):
        return _quantize_triton(x_PC.contiguous(), offsets_G, ends, width)
    row = torch.arange(rows, device=x_PC.device)
    group = torch.searchsorted(offsets_G, row, right=True)  # ``groups`` for the rows after the last group
    amax = torch.zeros(groups + 1, x_PC.shape[1], dtype=torch.float32, device=x_PC.device)
    amax.scatter_reduce_(0, group[:, None].expand(-1, x_PC.shape[1]), x_PC.detach().abs().float(), "amax")
    scale = scale_of(amax[:groups])
    kept = group < groups
    row, group = row[kept], group[kept]
    column = row - (offsets_G - counts)[group] + (ends - padded_counts)[group]
    data = torch.zeros(x_PC.shape[1], width, dtype=torch.uint8, device=x_PC.device)
    data[:, column] = cast(x_PC.detach()[row], scale[group]).data.view(torch.uint8).t()
    return GroupColumns(data.view(E4M3), scale, ends)


def grouped_weight_grad(dy_PN: torch.Tensor, x_PK: torch.Tensor, offsets_G: torch.Tensor) -> torch.Tensor:
    """``dy_g^T x_g`` for each row group g of ``dy_PN`` and ``x_PK`` (``F.grouped_mm``'s ``offs``): [G, N, K] in
    ``dy_PN``'s dtype, an FP8 GEMM of the two ``GroupColumns`` (torch's kernel on CUDA; elsewhere their values
    multiplied in float32, the product the kernel computes up to the order of its sums). A group without rows gets
    zeros."""
    dy, x = quantize_group_columns(dy_PN, offsets_G), quantize_group_columns(x_PK, offsets_G)
    if dy.data.is_cuda:
        return torch._scaled_grouped_mm(
            dy.data,
            x.data.t(),
            scale_a=dy.scale.flatten(),
            scale_b=x.scale.flatten(),
            offs=dy.offsets,
            out_dtype=dy_PN.dtype,
        )
    return F.grouped_mm(dy.dequantize(), x.dequantize().t(), offs=dy.offsets).to(dy_PN.dtype)


if triton is not None:

    @triton.jit
    def _group_columns_kernel(
        x_ptr, offsets_ptr, ends_ptr, q_ptr, scale_ptr, columns, stride_x, stride_q,
        BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr,
    ):  # fmt: skip
        """Group ``program_id(0)``'s BLOCK_C columns: their amax over the group's rows, their scales, then the rows
        again as e4m3 bytes at the group's padded columns of the transposed output (zeros in its padding)."""
        g = tl.program_id(0)
        cols = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
        col_ok = cols < columns
        start = tl.load(offsets_ptr + g - 1, mask=g > 0, other=0)
        end = tl.load(offsets_ptr + g)
        out_start = tl.load(ends_ptr + g - 1, mask=g > 0, other=0)
        out_count = tl.load(ends_ptr + g) - out_start
        amax = tl.zeros((BLOCK_C,), dtype=tl.float32)
        nan = tl.zeros((BLOCK_C,), dtype=tl.int32)
        for r in range(start, end, BLOCK_R):
            rows = r + tl.arange(0, BLOCK_R)
            mask = (rows < end)[:, None] & col_ok[None, :]
            values = tl.load(x_ptr + rows.to(tl.int64)[:, None] * stride_x + cols[None, :], mask=mask, other=0.0)
            amax, nan = amax_stats(amax, nan, 0, values.to(tl.float32))
        exponent = scale_exponent(amax, nan)
        tl.store(scale_ptr + g * columns + cols, pow2(exponent), mask=col_ok)
        inv_scale = inverse_scale(exponent)[None, :]
        for r in range(0, out_count, BLOCK_R):
            local = r + tl.arange(0, BLOCK_R)
            rows = start + local
            mask = (rows < end)[:, None] & col_ok[None, :]
            values = tl.load(x_ptr + rows.to(tl.int64)[:, None] * stride_x + cols[None, :], mask=mask, other=0.0)
            q = e4m3_bits(values.to(tl.float32), inv_scale)  # 0 in the padding
            out = q_ptr + cols.to(tl.int64)[None, :] * stride_q + (out_start + local)[:, None]
            tl.store(out, q, mask=(local < out_count)[:, None] & col_ok[None, :])


def _quantize_triton(x_PC, offsets_G, ends, width) -> GroupColumns:
    groups, columns = offsets_G.shape[0], x_PC.shape[1]
    data = torch.empty(columns, width, dtype=torch.uint8, device=x_PC.device)  # past the last end: never read
    scale = torch.empty(groups, columns, dtype=torch.float32, device=x_PC.device)
    grid = (groups, triton.cdiv(columns, TILES["BLOCK_C"]))
    _group_columns_kernel[grid](
        x_PC, offsets_G, ends, data, scale, columns, x_PC.stride(0), data.stride(0), **TILES
    )  # fmt: skip
    return GroupColumns(data.view(E4M3), scale, ends)
