"""Triton kernels that fold the expert path's permutation and SwiGLU into its grouped GEMMs (CUDA, bf16).

``grouped_experts`` runs the routed experts as gathers around ``torch._grouped_mm`` (CUTLASS). Each gather and
the elementwise middle is a memory-bound kernel of its own: at Qwen3-30B-A3B sizes (8,192 tokens, top-8 of 128)
they are a quarter of the expert path's time. The kernels here read the gathered rows straight from their source
and finish the SwiGLU in the GEMM's epilogue:

* ``gate_up_swiglu``: ``gate_up = x[rows] W_gu[e]^T`` and ``hidden = silu(gate) * up * w``, one kernel (the
  permuted ``x`` is never written);
* ``down_dgrad_swiglu``: ``grad_hidden = grad[rows] W_d[e]`` with the SwiGLU backward in the epilogue, giving the
  gate/up gradient and the routing weight's (the un-permute's backward gather is never written);
* ``grouped_wgrad``: ``sum over expert e's pairs p of left[p]^T right[p]``, either side gathered, the weight
  gradients of both GEMMs.

The remaining two GEMMs (the down projection forward and the gate/up input gradient) keep CUTLASS: their outputs
are summed per row, which a GEMM epilogue could only do with atomics.

Tiles: pairs are sorted by expert; a tile of ``BLOCK_M`` pairs never straddles two experts, so the grid has
``ceil(P / BLOCK_M) + e`` row tiles (a host-known bound) and each program finds its expert from the end offsets
in registers; the surplus tiles return at once. No host sync.

Shape suffixes as in ``grouped_experts``: R rows, H hidden, P pairs, I (``inter``) expert intermediate, e experts.
"""

from __future__ import annotations

import functools

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only installs: the grouped path keeps CUTLASS / torch gathers
    triton = None


@functools.cache
def available() -> bool:
    """Triton is importable and a CUDA device is there (the kernels need both)."""
    return triton is not None and torch.cuda.is_available()


if triton is not None:

    @triton.jit
    def _tile_of(pid_m, ends_ptr, NUM_EXPERTS: tl.constexpr, E_POW2: tl.constexpr, BLOCK_M: tl.constexpr):
        """(expert, first pair, end pair) of row tile ``pid_m``; expert == NUM_EXPERTS past the last tile."""
        ids = tl.arange(0, E_POW2)
        ends = tl.load(ends_ptr + ids, mask=ids < NUM_EXPERTS, other=0).to(tl.int32)
        starts = tl.load(ends_ptr + ids - 1, mask=(ids > 0) & (ids < NUM_EXPERTS), other=0).to(tl.int32)
        tiles = tl.where(ids < NUM_EXPERTS, (ends - starts + BLOCK_M - 1) // BLOCK_M, 0)
        after = tl.cumsum(tiles, 0)  # tiles up to and including each expert
        expert = tl.sum((after <= pid_m).to(tl.int32), 0)
        mine = ids == expert
        first_tile = tl.sum(tl.where(mine, after - tiles, 0), 0)
        start = tl.sum(tl.where(mine, starts, 0), 0) + (pid_m - first_tile) * BLOCK_M
        return expert, start, tl.sum(tl.where(mine, ends, 0), 0)

    @triton.jit
    def _swizzled(num_n_blocks, GROUP_M: tl.constexpr):
        """(row tile, N block) of this program: ``GROUP_M`` row tiles (about one expert's) sweep every N block
        together, so their rows and the expert's weights stay in L2."""
        pid = tl.program_id(0)
        in_group = GROUP_M * num_n_blocks
        first_m = (pid // in_group) * GROUP_M
        return first_m + pid % GROUP_M, (pid % in_group) // GROUP_M

    @triton.jit
    def _gate_up_swiglu_kernel(
        x_ptr, rows_ptr, w_ptr, wgu_ptr, ends_ptr, gu_ptr, h_ptr,
        H, inter, stride_x, stride_we, stride_wf, num_n_blocks,
        NUM_EXPERTS: tl.constexpr, E_POW2: tl.constexpr,
        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
    ):  # fmt: skip
        pid_m, pid_n = _swizzled(num_n_blocks, GROUP_M)
        expert, start, end = _tile_of(pid_m, ends_ptr, NUM_EXPERTS, E_POW2, BLOCK_M)
        if expert >= NUM_EXPERTS:
            return
        offs_m = start + tl.arange(0, BLOCK_M)
        mask_m = offs_m < end
        rows = tl.load(rows_ptr + offs_m, mask=mask_m, other=0).to(tl.int64)
        offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        mask_n = offs_n < inter
        offs_k = tl.arange(0, BLOCK_K)
        a_ptrs = x_ptr + rows[:, None] * stride_x + offs_k[None, :]
        b_ptrs = wgu_ptr + expert.to(tl.int64) * stride_we + offs_n[None, :] * stride_wf + offs_k[:, None]
        up_shift = inter * stride_wf
        acc_g = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        acc_u = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for k in range(0, H, BLOCK_K):
            k_ok = offs_k < H - k
            a = tl.load(a_ptrs, mask=mask_m[:, None] & k_ok[None, :], other=0.0)
            b_mask = k_ok[:, None] & mask_n[None, :]
            acc_g = tl.dot(a, tl.load(b_ptrs, mask=b_mask, other=0.0), acc_g)
            acc_u = tl.dot(a, tl.load(b_ptrs + up_shift, mask=b_mask, other=0.0), acc_u)
            a_ptrs += BLOCK_K
            b_ptrs += BLOCK_K
        gate = acc_g.to(gu_ptr.dtype.element_ty)
        up = acc_u.to(gu_ptr.dtype.element_ty)
        out_mask = mask_m[:, None] & mask_n[None, :]
        gu_ptrs = gu_ptr + offs_m.to(tl.int64)[:, None] * (2 * inter) + offs_n[None, :]
        tl.store(gu_ptrs, gate, mask=out_mask)
        tl.store(gu_ptrs + inter, up, mask=out_mask)
        w = tl.load(w_ptr + offs_m, mask=mask_m, other=0.0).to(tl.float32)
        g = gate.to(tl.float32)
        hidden = g * tl.sigmoid(g) * up.to(tl.float32) * w[:, None]
        h_ptrs = h_ptr + offs_m.to(tl.int64)[:, None] * inter + offs_n[None, :]
        tl.store(h_ptrs, hidden.to(h_ptr.dtype.element_ty), mask=out_mask)

    @triton.jit
    def _down_dgrad_swiglu_kernel(
        g_ptr, rows_ptr, wd_ptr, ends_ptr, gu_ptr, w_ptr, dgu_ptr, dw_ptr,
        H, inter, stride_g, stride_we, stride_wh, num_n_blocks,
        NUM_EXPERTS: tl.constexpr, E_POW2: tl.constexpr,
        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
    ):  # fmt: skip
        pid_m, pid_n = _swizzled(num_n_blocks, GROUP_M)
        expert, start, end = _tile_of(pid_m, ends_ptr, NUM_EXPERTS, E_POW2, BLOCK_M)
        if expert >= NUM_EXPERTS:
            return
        offs_m = start + tl.arange(0, BLOCK_M)
        mask_m = offs_m < end
        rows = tl.load(rows_ptr + offs_m, mask=mask_m, other=0).to(tl.int64)
        offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        mask_n = offs_n < inter
        offs_k = tl.arange(0, BLOCK_K)
        a_ptrs = g_ptr + rows[:, None] * stride_g + offs_k[None, :]
        # down_eHI[e, h, i]: the K index h walks the rows of the expert's [H, I] matrix
        b_ptrs = wd_ptr + expert.to(tl.int64) * stride_we + offs_k[:, None] * stride_wh + offs_n[None, :]
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for k in range(0, H, BLOCK_K):
            k_ok = offs_k < H - k
            a = tl.load(a_ptrs, mask=mask_m[:, None] & k_ok[None, :], other=0.0)
            b = tl.load(b_ptrs, mask=k_ok[:, None] & mask_n[None, :], other=0.0)
            acc = tl.dot(a, b, acc)
            a_ptrs += BLOCK_K
            b_ptrs += BLOCK_K * stride_wh
        # The SwiGLU backward on the rounded gradient of hidden, as autograd would see it.
        grad_h = acc.to(dgu_ptr.dtype.element_ty).to(tl.float32)
        out_mask = mask_m[:, None] & mask_n[None, :]
        gu_ptrs = gu_ptr + offs_m.to(tl.int64)[:, None] * (2 * inter) + offs_n[None, :]
        gate = tl.load(gu_ptrs, mask=out_mask, other=0.0).to(tl.float32)
        up = tl.load(gu_ptrs + inter, mask=out_mask, other=0.0).to(tl.float32)
        w = tl.load(w_ptr + offs_m, mask=mask_m, other=0.0).to(tl.float32)
        sig = tl.sigmoid(gate)
        act = gate * sig
        grad_act = grad_h * w[:, None]
        d_gate = grad_act * up * sig * (1.0 + gate * (1.0 - sig))
        d_up = grad_act * act
        dgu_ptrs = dgu_ptr + offs_m.to(tl.int64)[:, None] * (2 * inter) + offs_n[None, :]
        tl.store(dgu_ptrs, d_gate.to(dgu_ptr.dtype.element_ty), mask=out_mask)
        tl.store(dgu_ptrs + inter, d_up.to(dgu_ptr.dtype.element_ty), mask=out_mask)
        # Routing weight: a partial sum per N block, summed by the caller (deterministic, no atomics).
        partial = tl.sum(tl.where(out_mask, grad_h * act * up, 0.0), 1)
        tl.store(dw_ptr + offs_m.to(tl.int64) * num_n_blocks + pid_n, partial, mask=mask_m)

    @triton.jit
    def _grouped_wgrad_kernel(
        l_ptr, l_rows_ptr, r_ptr, r_rows_ptr, ends_ptr, out_ptr,
        M, N, stride_l, stride_r, num_n_blocks,
        L_GATHERED: tl.constexpr, R_GATHERED: tl.constexpr, NUM_EXPERTS: tl.constexpr,
        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    ):  # fmt: skip
        pid = tl.program_id(0)  # consecutive programs: one expert's tiles, which share its rows in L2
        expert = tl.program_id(1)
        offs_m = (pid // num_n_blocks) * BLOCK_M + tl.arange(0, BLOCK_M)
        offs_n = (pid % num_n_blocks) * BLOCK_N + tl.arange(0, BLOCK_N)
        mask_m = offs_m < M
        mask_n = offs_n < N
        end = tl.load(ends_ptr + expert).to(tl.int32)
        start = tl.load(ends_ptr + expert - 1, mask=expert > 0, other=0).to(tl.int32)
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for p0 in range(start, end, BLOCK_K):
            offs_p = p0 + tl.arange(0, BLOCK_K)
            mask_p = offs_p < end
            if L_GATHERED:
                l_rows = tl.load(l_rows_ptr + offs_p, mask=mask_p, other=0).to(tl.int64)
            else:
                l_rows = offs_p.to(tl.int64)
            if R_GATHERED:
                r_rows = tl.load(r_rows_ptr + offs_p, mask=mask_p, other=0).to(tl.int64)
            else:
                r_rows = offs_p.to(tl.int64)
            a = tl.load(l_ptr + l_rows[None, :] * stride_l + offs_m[:, None], mask=mask_m[:, None] & mask_p[None, :],
                        other=0.0)  # fmt: skip
            b = tl.load(r_ptr + r_rows[:, None] * stride_r + offs_n[None, :], mask=mask_p[:, None] & mask_n[None, :],
                        other=0.0)  # fmt: skip
            acc = tl.dot(a, b, acc)
        out_ptrs = out_ptr + expert.to(tl.int64) * M * N + offs_m[:, None] * N + offs_n[None, :]
        tl.store(out_ptrs, acc.to(out_ptr.dtype.element_ty), mask=mask_m[:, None] & mask_n[None, :])


# Tile sizes per kernel; bench/bench_experts.py --tune times the alternatives on the device.
GATE_UP_TILES = {"BLOCK_M": 128, "BLOCK_N": 64, "BLOCK_K": 64, "GROUP_M": 4, "num_warps": 8, "num_stages": 3}
DGRAD_TILES = {"BLOCK_M": 128, "BLOCK_N": 64, "BLOCK_K": 64, "GROUP_M": 4, "num_warps": 8, "num_stages": 3}
WGRAD_TILES = {"BLOCK_M": 128, "BLOCK_N": 128, "BLOCK_K": 64, "num_warps": 8, "num_stages": 3}


def _row_tiles(num_pairs: int, num_experts: int, block_m: int, group_m: int) -> int:
    """Row tiles to launch: each expert's last tile may be partial; rounded up to whole swizzle groups."""
    return triton.cdiv(triton.cdiv(num_pairs, block_m) + num_experts, group_m) * group_m


def gate_up_swiglu(
    x_RH: torch.Tensor, rows_P: torch.Tensor, w_P: torch.Tensor, gate_up_eFH: torch.Tensor, ends_e: torch.Tensor,
    tiles: dict | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    """``(gate_up_PF, hidden_PI)`` of the sorted pairs: ``x_RH[rows_P] @ W_gu[e]^T`` and its SwiGLU times ``w_P``."""
    t = dict(GATE_UP_TILES if tiles is None else tiles)
    num_experts, F, H = gate_up_eFH.shape
    inter, P = F // 2, rows_P.numel()
    gate_up_PF = x_RH.new_empty(P, F)
    hidden_PI = x_RH.new_empty(P, inter)
    n_blocks = triton.cdiv(inter, t["BLOCK_N"])
    grid = (_row_tiles(P, num_experts, t["BLOCK_M"], t["GROUP_M"]) * n_blocks,)
    _gate_up_swiglu_kernel[grid](
        x_RH, rows_P, w_P, gate_up_eFH, ends_e, gate_up_PF, hidden_PI,
        H, inter, x_RH.stride(0), gate_up_eFH.stride(0), gate_up_eFH.stride(1), n_blocks,
        NUM_EXPERTS=num_experts, E_POW2=triton.next_power_of_2(num_experts), **t,
    )  # fmt: skip
    return gate_up_PF, hidden_PI


def down_dgrad_swiglu(
    grad_RH: torch.Tensor, rows_P: torch.Tensor, down_eHI: torch.Tensor, gate_up_PF: torch.Tensor,
    w_P: torch.Tensor, ends_e: torch.Tensor, tiles: dict | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    """``(grad_gate_up_PF, grad_w_P)``: ``grad_RH[rows_P] @ W_d[e]`` through the SwiGLU's backward."""
    t = dict(DGRAD_TILES if tiles is None else tiles)
    num_experts, H, inter = down_eHI.shape
    P = rows_P.numel()
    n_blocks = triton.cdiv(inter, t["BLOCK_N"])
    grad_gate_up_PF = gate_up_PF.new_empty(P, 2 * inter)
    partial_PN = torch.empty(P, n_blocks, device=grad_RH.device, dtype=torch.float32)
    grid = (_row_tiles(P, num_experts, t["BLOCK_M"], t["GROUP_M"]) * n_blocks,)
    _down_dgrad_swiglu_kernel[grid](
        grad_RH, rows_P, down_eHI, ends_e, gate_up_PF, w_P, grad_gate_up_PF, partial_PN,
        H, inter, grad_RH.stride(0), down_eHI.stride(0), down_eHI.stride(1), n_blocks,
        NUM_EXPERTS=num_experts, E_POW2=triton.next_power_of_2(num_experts), **t,
    )  # fmt: skip
    return grad_gate_up_PF, partial_PN.sum(1).to(w_P.dtype)


def grouped_wgrad(
    left: torch.Tensor, left_rows: torch.Tensor | None, right: torch.Tensor, right_rows: torch.Tensor | None,
    ends_e: torch.Tensor, tiles: dict | None = None,
) -> torch.Tensor:  # fmt: skip
    """``out[e] = sum over expert e's pairs p of left[l(p)]^T right[r(p)]``, ``[e, M, N]``; ``l(p)`` is
    ``left_rows[p]`` (a gathered side) or ``p``, likewise ``r``. An expert without pairs gets zeros."""
    t = dict(WGRAD_TILES if tiles is None else tiles)
    num_experts = ends_e.numel()
    M, N = left.shape[1], right.shape[1]
    out = left.new_empty(num_experts, M, N)
    n_blocks = triton.cdiv(N, t["BLOCK_N"])
    grid = (triton.cdiv(M, t["BLOCK_M"]) * n_blocks, num_experts)
    _grouped_wgrad_kernel[grid](
        left, left_rows if left_rows is not None else ends_e, right, right_rows if right_rows is not None else ends_e,
        ends_e, out, M, N, left.stride(0), right.stride(0), n_blocks,
        L_GATHERED=left_rows is not None, R_GATHERED=right_rows is not None, NUM_EXPERTS=num_experts, **t,
    )  # fmt: skip
    return out
