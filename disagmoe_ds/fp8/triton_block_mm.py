"""Grouped GEMMs with a frozen block-scaled FP8 weight read as it is stored, one Triton kernel (CUDA).

A LoRA run over an FP8 checkpoint multiplies the routed experts' activations by the frozen base ``W`` [e, N, K]
(e4m3 ``data`` with a float32 scale per (bn, bk) block, ``fp8.blocks``) forward (``y = x W_e^T``) and backward
(``dx = dy W_e``). Dequantizing ``W`` for every call, as the generic path does, writes a bf16 copy of the whole shard
and reads it back: for one DeepSeek-V3 layer's gate/up on one GPU 14 GiB and 173 ms a call on an H100, against about
4 ms of GEMM and more memory than the layer's FP8 base saves (docs/performance-log.md section 29). Here each program
loads its weight tiles as e4m3 bytes and multiplies them by their block's scale in registers, so the weight is read
once, at one byte per value, and no copy of it exists.

The operands are the generic path's: each weight value is ``data * scale`` rounded to the activations' dtype, the
products accumulated in float32, one rounding at the output; only the order of the sums differs. Row group ``i`` is
the rows up to ``offsets[i]`` (``torch.nn.functional.grouped_mm``'s ``offs``). A program takes ``BLOCK_M`` rows of
one group and ``BLOCK_OUT`` output columns; it finds its group by walking the groups' row counts (no host sync, so a
CUDA graph may hold it). ``BLOCK_RED`` and ``BLOCK_OUT`` divide the block's sides, so a weight tile has one scale.
"""

from __future__ import annotations

import functools

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only installs: the generic path dequantizes
    triton = None

# (rows, output columns, reduction) of a program's tile; warps; software pipeline stages
TILES = {"BLOCK_M": 64, "BLOCK_OUT": 128, "BLOCK_RED": 128, "num_warps": 4, "num_stages": 3}  # bench_block_mm.py


@functools.cache
def available() -> bool:
    """Triton imports and the CUDA device converts e4m3 in registers (compute capability 8.9 and up: Ada, Hopper)."""
    return triton is not None and torch.cuda.is_available() and torch.cuda.get_device_capability() >= (8, 9)


def fits(block: tuple[int, int], tiles: dict | None = None) -> bool:
    """The tiles divide the weight's blocks (each weight tile then has one scale)."""
    t = tiles or TILES
    return all(side % t[tile] == 0 for side in block for tile in ("BLOCK_OUT", "BLOCK_RED"))


def runs(x: torch.Tensor, block: tuple[int, int]) -> bool:
    """The kernel takes this call: CUDA with Triton, 16-bit activations (a float32 run keeps torch's exact float32
    products: ``tl.dot`` would take TF32) and tiles that fit the blocks."""
    return x.is_cuda and x.dtype in (torch.bfloat16, torch.float16) and available() and fits(block)


if triton is not None:

    @triton.jit
    def _group_tile(offsets_ptr, tile, GROUPS: tl.constexpr, BLOCK_M: tl.constexpr):
        """(group, first row, end row) of row tile ``tile`` when each group's rows are cut in BLOCK_M tiles; a tile
        past the last one gets an empty row range."""
        group, row0, row_end = 0, 0, 0
        seen, start = 0, 0
        for g in range(GROUPS):
            end = tl.load(offsets_ptr + g).to(tl.int32)
            tiles = tl.cdiv(end - start, BLOCK_M)
            mine = (tile >= seen) & (tile < seen + tiles)
            group = tl.where(mine, g, group)
            row0 = tl.where(mine, start + (tile - seen) * BLOCK_M, row0)
            row_end = tl.where(mine, end, row_end)
            seen += tiles
            start = end
        return group, row0, row_end

    @triton.jit
    def _grouped_block_mm_kernel(
        a_ptr, w_ptr, s_ptr, c_ptr, offsets_ptr,
        RED, OUT,
        stride_am, stride_ar,
        stride_we, stride_wr, stride_wo,
        stride_se, stride_sr, stride_so,
        stride_cm, stride_co,
        BLOCK_SCALE_RED: tl.constexpr, BLOCK_SCALE_OUT: tl.constexpr, GROUPS: tl.constexpr,
        BLOCK_M: tl.constexpr, BLOCK_OUT: tl.constexpr, BLOCK_RED: tl.constexpr,
    ):  # fmt: skip
        group, row0, row_end = _group_tile(offsets_ptr, tl.program_id(0), GROUPS, BLOCK_M)
        if row0 >= row_end:
            return
        rows = row0 + tl.arange(0, BLOCK_M)
        cols = tl.program_id(1) * BLOCK_OUT + tl.arange(0, BLOCK_OUT)
        red = tl.arange(0, BLOCK_RED)
        # 64-bit offsets: a layer's expert weights and a step's rows pass 2**31 elements (256 x 4096 x 7168)
        a_tile = a_ptr + rows.to(tl.int64)[:, None] * stride_am + red[None, :] * stride_ar
        w_tile = w_ptr + group.to(tl.int64) * stride_we + red[:, None] * stride_wr + cols[None, :] * stride_wo
        s_col = s_ptr + group * stride_se + (tl.program_id(1) * BLOCK_OUT // BLOCK_SCALE_OUT) * stride_so
        acc = tl.zeros((BLOCK_M, BLOCK_OUT), dtype=tl.float32)
        for r0 in range(0, RED, BLOCK_RED):
            in_red = r0 + red < RED
            a = tl.load(a_tile, mask=(rows[:, None] < row_end) & in_red[None, :], other=0.0)
            w = tl.load(w_tile, mask=in_red[:, None] & (cols[None, :] < OUT), other=0.0)
            scale = tl.load(s_col + (r0 // BLOCK_SCALE_RED) * stride_sr)
            acc += tl.dot(a, (w.to(tl.float32) * scale).to(a.dtype))  # the generic path's dequantized operand
            a_tile += BLOCK_RED * stride_ar
            w_tile += BLOCK_RED * stride_wr
        c = c_ptr + rows.to(tl.int64)[:, None] * stride_cm + cols[None, :] * stride_co
        tl.store(c, acc.to(c_ptr.dtype.element_ty), mask=(rows[:, None] < row_end) & (cols[None, :] < OUT))


def grouped_block_mm(
    x: torch.Tensor,
    data: torch.Tensor,
    scale_inv: torch.Tensor,
    block: tuple[int, int],
    offsets: torch.Tensor,
    *,
    transposed: bool,
    tiles: dict | None = None,
) -> torch.Tensor:
    """Row group i of ``x`` times the weight ``data * scale_inv`` [e, N, K] of group i: ``x W_i^T`` (x [P, K] ->
    [P, N]) with ``transposed``, else ``x W_i`` (x [P, N] -> [P, K]). Rows past ``offsets[-1]`` come out zero."""
    t = {**TILES, **(tiles or {})}
    assert fits(block, t), f"tiles {t} do not divide the FP8 blocks {block}"
    groups = data.shape[0]
    bn, bk = block
    # the weight and its scales as [group, reduction, output]: W_i^T reduces over K, W_i over N
    w, s, block_red, block_out = (
        (data.transpose(1, 2), scale_inv.transpose(1, 2), bk, bn) if transposed else (data, scale_inv, bn, bk)
    )
    red, out = w.shape[1:]
    assert x.shape[-1] == red, f"x has {x.shape[-1]} columns, the weight's reduction side is {red}"
    c = torch.zeros(x.shape[0], out, dtype=x.dtype, device=x.device)
    grid = (triton.cdiv(x.shape[0], t["BLOCK_M"]) + groups, triton.cdiv(out, t["BLOCK_OUT"]))
    _grouped_block_mm_kernel[grid](
        x, w, s, c, offsets,
        red, out,
        *x.stride(), *w.stride(), *s.stride(), *c.stride(),
        BLOCK_SCALE_RED=block_red, BLOCK_SCALE_OUT=block_out, GROUPS=groups,
        **t,
    )  # fmt: skip
    return c


def block_mm(x: torch.Tensor, data: torch.Tensor, scale_inv: torch.Tensor, block: tuple[int, int], *, transposed: bool):
    """``grouped_block_mm`` with one weight [N, K] for every row of ``x`` [..., K or N] (a dense projection)."""
    rows = x.reshape(-1, x.shape[-1])
    every_row = torch.full((1,), rows.shape[0], dtype=torch.int32, device=x.device)
    out = grouped_block_mm(rows, data[None], scale_inv[None], block, every_row, transposed=transposed)
    return out.view(*x.shape[:-1], out.shape[-1])
