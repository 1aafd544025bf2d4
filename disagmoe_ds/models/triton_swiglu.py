"""The routed experts' SwiGLU middle, ``silu(gate) * up * w``, as two Triton kernels (forward, backward).

The backward is the one that matters: the gate/up gradient is elementwise, the routing weight's gradient is a sum
over each pair's I columns. Inductor compiles the two as separate kernels (a pointwise one and a reduction reading
the same inputs again): 0.33 ms per backward at Qwen3-30B-A3B sizes on an H200 (65,536 pairs, I = 768). Here one
program walks a block of pairs' columns once and does both: 0.12 ms, about what its 0.5 GB take at HBM speed.

Grouped GEMMs with the permutation and this middle in their prologue/epilogue were tried too (Triton, pointer
loads): the fusion saved the gathers, but the GEMMs themselves ran 25-70% slower than CUTLASS's ``grouped_mm`` on
the H200 (``docs/performance.md`` section 10), so the GEMMs stay CUTLASS.

Math as ``grouped_experts._gated_eager`` under ``torch.compile``: everything in fp32 from the bf16 (or fp32)
inputs, one rounding at the output. Shape suffixes: P pairs, I expert intermediate, F = 2I (gate columns first).
"""

from __future__ import annotations

import functools

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only installs: the middle stays compiled by inductor
    triton = None


@functools.cache
def available() -> bool:
    """Triton imports and a CUDA device is there."""
    return triton is not None and torch.cuda.is_available()


if triton is not None:

    @triton.jit
    def _swiglu_forward_kernel(
        gu_ptr, w_ptr, h_ptr, num_pairs, inter,
        BLOCK_P: tl.constexpr, BLOCK_I: tl.constexpr,
    ):  # fmt: skip
        pairs = tl.program_id(0) * BLOCK_P + tl.arange(0, BLOCK_P)
        cols = tl.program_id(1) * BLOCK_I + tl.arange(0, BLOCK_I)
        mask = (pairs < num_pairs)[:, None] & (cols < inter)[None, :]
        gate_ptrs = gu_ptr + pairs.to(tl.int64)[:, None] * (2 * inter) + cols[None, :]
        gate = tl.load(gate_ptrs, mask=mask, other=0.0).to(tl.float32)
        up = tl.load(gate_ptrs + inter, mask=mask, other=0.0).to(tl.float32)
        w = tl.load(w_ptr + pairs, mask=pairs < num_pairs, other=0.0).to(tl.float32)
        hidden = gate * tl.sigmoid(gate) * up * w[:, None]
        h_ptrs = h_ptr + pairs.to(tl.int64)[:, None] * inter + cols[None, :]
        tl.store(h_ptrs, hidden.to(h_ptr.dtype.element_ty), mask=mask)

    @triton.jit
    def _swiglu_backward_kernel(
        gu_ptr, w_ptr, dh_ptr, dgu_ptr, dw_ptr, num_pairs, inter,
        BLOCK_P: tl.constexpr, BLOCK_I: tl.constexpr,
    ):  # fmt: skip
        pairs = tl.program_id(0) * BLOCK_P + tl.arange(0, BLOCK_P)
        pair_ok = pairs < num_pairs
        w = tl.load(w_ptr + pairs, mask=pair_ok, other=0.0).to(tl.float32)
        row_gu = pairs.to(tl.int64)[:, None] * (2 * inter)
        row_h = pairs.to(tl.int64)[:, None] * inter
        d_w = tl.zeros((BLOCK_P,), dtype=tl.float32)
        for start in range(0, inter, BLOCK_I):
            cols = start + tl.arange(0, BLOCK_I)
            mask = pair_ok[:, None] & (cols < inter)[None, :]
            gate = tl.load(gu_ptr + row_gu + cols[None, :], mask=mask, other=0.0).to(tl.float32)
            up = tl.load(gu_ptr + row_gu + inter + cols[None, :], mask=mask, other=0.0).to(tl.float32)
            d_hidden = tl.load(dh_ptr + row_h + cols[None, :], mask=mask, other=0.0).to(tl.float32)
            sig = tl.sigmoid(gate)
            act = gate * sig
            d_w += tl.sum(d_hidden * act * up, 1)
            d_act = d_hidden * w[:, None]
            d_gate = d_act * up * sig * (1.0 + gate * (1.0 - sig))
            tl.store(dgu_ptr + row_gu + cols[None, :], d_gate.to(dgu_ptr.dtype.element_ty), mask=mask)
            tl.store(dgu_ptr + row_gu + inter + cols[None, :], (d_act * act).to(dgu_ptr.dtype.element_ty), mask=mask)
        tl.store(dw_ptr + pairs, d_w.to(dw_ptr.dtype.element_ty), mask=pair_ok)


def _tiles(inter: int) -> dict:
    """Tiles of both kernels, by width (the best of 11 on an H200, within 3% of each width's best: forward and
    backward at I = 768, 2,048 and 14,336, docs/performance.md section 10)."""
    if inter >= 2048:
        return {"BLOCK_P": 2, "BLOCK_I": 1024, "num_warps": 8}
    return {"BLOCK_P": 8, "BLOCK_I": 256, "num_warps": 4}


def swiglu_forward(gate_up_PF: torch.Tensor, w_P: torch.Tensor, tiles: dict | None = None) -> torch.Tensor:
    """``silu(gate) * up * w`` per pair, ``[P, I]`` in ``gate_up_PF``'s dtype."""
    num_pairs, inter = gate_up_PF.shape[0], gate_up_PF.shape[1] // 2
    t = _tiles(inter) if tiles is None else tiles
    hidden_PI = gate_up_PF.new_empty(num_pairs, inter)
    grid = (triton.cdiv(num_pairs, t["BLOCK_P"]), triton.cdiv(inter, t["BLOCK_I"]))
    _swiglu_forward_kernel[grid](gate_up_PF, w_P, hidden_PI, num_pairs, inter, **t)
    return hidden_PI


def swiglu_backward(
    gate_up_PF: torch.Tensor, w_P: torch.Tensor, d_hidden_PI: torch.Tensor, tiles: dict | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(d_gate_up_PF, d_w_P)`` of ``swiglu_forward`` for the gradient ``d_hidden_PI``."""
    num_pairs, inter = gate_up_PF.shape[0], gate_up_PF.shape[1] // 2
    t = _tiles(inter) if tiles is None else tiles
    d_gate_up_PF = torch.empty_like(gate_up_PF)
    d_w_P = torch.empty_like(w_P)
    grid = (triton.cdiv(num_pairs, t["BLOCK_P"]),)
    _swiglu_backward_kernel[grid](gate_up_PF, w_P, d_hidden_PI.contiguous(), d_gate_up_PF, d_w_P, num_pairs, inter, **t)
    return d_gate_up_PF, d_w_P


class SwiGLU(torch.autograd.Function):
    """``swiglu_forward`` with ``swiglu_backward`` as its gradient; saves its two inputs."""

    @staticmethod
    def forward(ctx, gate_up_PF: torch.Tensor, w_P: torch.Tensor) -> torch.Tensor:
        gate_up_PF, w_P = gate_up_PF.contiguous(), w_P.contiguous()
        ctx.save_for_backward(gate_up_PF, w_P)
        return swiglu_forward(gate_up_PF, w_P)

    @staticmethod
    def backward(ctx, d_hidden_PI: torch.Tensor):
        gate_up_PF, w_P = ctx.saved_tensors
        d_gate_up_PF, d_w_P = swiglu_backward(gate_up_PF, w_P, d_hidden_PI)
        return d_gate_up_PF, d_w_P
