"""The routed experts' SwiGLU middle, ``silu(gate) * up * w``, as two Triton kernels (forward, backward).

The backward is the one that matters: the gate/up gradient is elementwise, the routing weight's gradient is a sum
over each pair's I columns. Inductor compiles the two as separate kernels (a pointwise one and a reduction reading
the same inputs again): 0.33 ms per backward at Qwen3-30B-A3B sizes on an H200 (65,536 pairs, I = 768). Here one
program walks a block of pairs' columns once and does both: 0.12 ms, about what its 0.5 GB take at HBM speed.

Grouped GEMMs with the permutation and this middle in their prologue/epilogue were tried too (Triton, pointer
loads): the fusion saved the gathers, but the GEMMs themselves ran 25-70% slower than CUTLASS's ``grouped_mm`` on
the H200 (``docs/performance.md`` section 10), so the GEMMs stay CUTLASS.

Math as ``grouped_experts._gated_eager`` under ``torch.compile``: everything in fp32 from the bf16 (or fp32)
inputs, one rounding at the output; with DeepSeek-V4's clamp (``limit``) the gate and up values are clamped as they
are loaded and their gradients masked as torch's clamp masks them (``grouped_experts.ClampedGate``'s math). Shape
suffixes: P pairs, I expert intermediate, F = 2I (gate columns first).

The FP8 experts' middle (``swiglu_fp8_forward`` / ``swiglu_fp8_backward``, used by ``models.fp8_experts``) computes
the same rows without the routing weight and also writes them as the next GEMM's FP8 operand, what
``fp8.quantize.quantize(rows, -1)`` makes of them: a program per block of rows walks each row twice, once for its
amax, once for its e4m3 values (recomputed, not read back), with ``fp8.triton_e4m3``'s bit-exact recipe.
"""

from __future__ import annotations

import functools

import torch

from disagmoe_ds.fp8.quantize import E4M3, Quantized

try:
    import triton
    import triton.language as tl

    from disagmoe_ds.fp8.triton_e4m3 import amax_stats, e4m3_bits, inverse_scale, pow2, scale_exponent
except ImportError:  # CPU-only installs: the middle stays compiled by inductor
    triton = None


@functools.cache
def available() -> bool:
    """Triton imports and a CUDA device is there."""
    return triton is not None and torch.cuda.is_available()


def runs_on(t: torch.Tensor) -> bool:
    """The kernels run on ``t``'s device: CUDA with Triton (the interpreter's tests replace this to run on the CPU)."""
    return t.is_cuda and available()


if triton is not None:

    @triton.jit
    def _silu_mul(gate, up):
        """``silu(gate) * up`` in fp32: the one expression of every forward kernel here (the same bits in each)."""
        return gate * tl.sigmoid(gate) * up

    @triton.jit
    def _swiglu_grads(gate, up, d_act):
        """``(d_gate, d_up, silu(gate))`` for the gradient ``d_act`` of ``silu(gate) * up`` (the weight applied)."""
        sig = tl.sigmoid(gate)
        act = gate * sig
        return d_act * up * sig * (1.0 + gate * (1.0 - sig)), d_act * act, act

    @triton.jit
    def _clamp(gate, up, limit, CLAMP: tl.constexpr):
        """DeepSeek-V4's clamp (``swiglu_limit``) where ``CLAMP``: the gate at most ``limit``, up within +-``limit``;
        with the masks where each passes its gradient (torch's clamp: inside the bounds, inclusive)."""
        if CLAMP:
            gate_ok, up_ok = gate <= limit, (up >= -limit) & (up <= limit)
            return tl.minimum(gate, limit), tl.minimum(tl.maximum(up, -limit), limit), gate_ok, up_ok
        return gate, up, gate == gate, up == up  # the masks unused

    @triton.jit
    def _gate_up_tile(gu_ptr, row_gu, pair_ok, cols, inter):
        """``(mask, gate, up)``: the gate and up columns ``cols`` of a block of pairs' gate/up rows (``row_gu``: their
        offsets), in fp32, 0 where masked."""
        mask = pair_ok[:, None] & (cols < inter)[None, :]
        gate = tl.load(gu_ptr + row_gu + cols[None, :], mask=mask, other=0.0).to(tl.float32)
        up = tl.load(gu_ptr + row_gu + inter + cols[None, :], mask=mask, other=0.0).to(tl.float32)
        return mask, gate, up

    @triton.jit
    def _swiglu_forward_kernel(
        gu_ptr, w_ptr, h_ptr, num_pairs, inter, limit,
        BLOCK_P: tl.constexpr, BLOCK_I: tl.constexpr, CLAMP: tl.constexpr,
    ):  # fmt: skip
        pairs = tl.program_id(0) * BLOCK_P + tl.arange(0, BLOCK_P)
        cols = tl.program_id(1) * BLOCK_I + tl.arange(0, BLOCK_I)
        mask = (pairs < num_pairs)[:, None] & (cols < inter)[None, :]
        gate_ptrs = gu_ptr + pairs.to(tl.int64)[:, None] * (2 * inter) + cols[None, :]
        gate = tl.load(gate_ptrs, mask=mask, other=0.0).to(tl.float32)
        up = tl.load(gate_ptrs + inter, mask=mask, other=0.0).to(tl.float32)
        gate, up, _, _ = _clamp(gate, up, limit, CLAMP)
        w = tl.load(w_ptr + pairs, mask=pairs < num_pairs, other=0.0).to(tl.float32)
        hidden = _silu_mul(gate, up) * w[:, None]
        h_ptrs = h_ptr + pairs.to(tl.int64)[:, None] * inter + cols[None, :]
        tl.store(h_ptrs, hidden.to(h_ptr.dtype.element_ty), mask=mask)

    @triton.jit
    def _swiglu_backward_kernel(
        gu_ptr, w_ptr, dh_ptr, dgu_ptr, dw_ptr, num_pairs, inter, limit,
        BLOCK_P: tl.constexpr, BLOCK_I: tl.constexpr, CLAMP: tl.constexpr,
    ):  # fmt: skip
        pairs = tl.program_id(0) * BLOCK_P + tl.arange(0, BLOCK_P)
        pair_ok = pairs < num_pairs
        w = tl.load(w_ptr + pairs, mask=pair_ok, other=0.0).to(tl.float32)
        row_gu = pairs.to(tl.int64)[:, None] * (2 * inter)
        row_h = pairs.to(tl.int64)[:, None] * inter
        d_w = tl.zeros((BLOCK_P,), dtype=tl.float32)
        for start in range(0, inter, BLOCK_I):
            cols = start + tl.arange(0, BLOCK_I)
            mask, gate, up = _gate_up_tile(gu_ptr, row_gu, pair_ok, cols, inter)
            gate, up, gate_ok, up_ok = _clamp(gate, up, limit, CLAMP)
            d_hidden = tl.load(dh_ptr + row_h + cols[None, :], mask=mask, other=0.0).to(tl.float32)
            d_gate, d_up, act = _swiglu_grads(gate, up, d_hidden * w[:, None])
            if CLAMP:
                d_gate, d_up = tl.where(gate_ok, d_gate, 0.0), tl.where(up_ok, d_up, 0.0)
            d_w += tl.sum(d_hidden * act * up, 1)
            tl.store(dgu_ptr + row_gu + cols[None, :], d_gate.to(dgu_ptr.dtype.element_ty), mask=mask)
            tl.store(dgu_ptr + row_gu + inter + cols[None, :], d_up.to(dgu_ptr.dtype.element_ty), mask=mask)
        tl.store(dw_ptr + pairs, d_w.to(dw_ptr.dtype.element_ty), mask=pair_ok)

    # ----- the FP8 middle: the same math, each output row also quantized as fp8.quantize(x, -1) quantizes it -----
    @triton.jit
    def _swiglu_fp8_forward_kernel(
        gu_ptr, h_ptr, q_ptr, scale_ptr, num_pairs, inter,
        BLOCK_P: tl.constexpr, BLOCK_I: tl.constexpr,
    ):  # fmt: skip
        pairs = tl.program_id(0) * BLOCK_P + tl.arange(0, BLOCK_P)
        pair_ok = pairs < num_pairs
        row_gu = pairs.to(tl.int64)[:, None] * (2 * inter)
        row_h = pairs.to(tl.int64)[:, None] * inter
        amax = tl.zeros((BLOCK_P,), dtype=tl.float32)
        nan = tl.zeros((BLOCK_P,), dtype=tl.int32)
        for start in range(0, inter, BLOCK_I):  # the hidden row as the model's dtype holds it, and its amax
            cols = start + tl.arange(0, BLOCK_I)
            mask, gate, up = _gate_up_tile(gu_ptr, row_gu, pair_ok, cols, inter)
            hidden = _silu_mul(gate, up).to(h_ptr.dtype.element_ty)
            tl.store(h_ptr + row_h + cols[None, :], hidden, mask=mask)
            amax, nan = amax_stats(amax, nan, 1, hidden.to(tl.float32))
        exponent = scale_exponent(amax, nan)
        tl.store(scale_ptr + pairs, pow2(exponent), mask=pair_ok)
        inv_scale = inverse_scale(exponent)[:, None]
        for start in range(0, inter, BLOCK_I):  # again, recomputed (cheaper than reading back), in e4m3
            cols = start + tl.arange(0, BLOCK_I)
            mask, gate, up = _gate_up_tile(gu_ptr, row_gu, pair_ok, cols, inter)
            hidden = _silu_mul(gate, up).to(h_ptr.dtype.element_ty).to(tl.float32)
            q = e4m3_bits(hidden, inv_scale)
            tl.store(q_ptr + row_h + cols[None, :], q, mask=mask)

    @triton.jit
    def _swiglu_fp8_backward_kernel(
        gu_ptr, dh_ptr, dgu_ptr, q_ptr, scale_ptr, num_pairs, inter,
        BLOCK_P: tl.constexpr, BLOCK_I: tl.constexpr, QUANTIZE: tl.constexpr,
    ):  # fmt: skip
        pairs = tl.program_id(0) * BLOCK_P + tl.arange(0, BLOCK_P)
        pair_ok = pairs < num_pairs
        row_gu = pairs.to(tl.int64)[:, None] * (2 * inter)
        row_h = pairs.to(tl.int64)[:, None] * inter
        amax = tl.zeros((BLOCK_P,), dtype=tl.float32)
        nan = tl.zeros((BLOCK_P,), dtype=tl.int32)
        for start in range(0, inter, BLOCK_I):  # the gradient row (2I wide) in the model's dtype, and its amax
            cols = start + tl.arange(0, BLOCK_I)
            mask, gate, up = _gate_up_tile(gu_ptr, row_gu, pair_ok, cols, inter)
            d_hidden = tl.load(dh_ptr + row_h + cols[None, :], mask=mask, other=0.0).to(tl.float32)
            d_gate, d_up, _ = _swiglu_grads(gate, up, d_hidden)
            d_gate, d_up = d_gate.to(dgu_ptr.dtype.element_ty), d_up.to(dgu_ptr.dtype.element_ty)
            tl.store(dgu_ptr + row_gu + cols[None, :], d_gate, mask=mask)
            tl.store(dgu_ptr + row_gu + inter + cols[None, :], d_up, mask=mask)
            amax, nan = amax_stats(amax, nan, 1, d_gate.to(tl.float32))
            amax, nan = amax_stats(amax, nan, 1, d_up.to(tl.float32))
        if QUANTIZE:
            exponent = scale_exponent(amax, nan)
            tl.store(scale_ptr + pairs, pow2(exponent), mask=pair_ok)
            inv_scale = inverse_scale(exponent)[:, None]
            for start in range(0, inter, BLOCK_I):
                cols = start + tl.arange(0, BLOCK_I)
                mask, gate, up = _gate_up_tile(gu_ptr, row_gu, pair_ok, cols, inter)
                d_hidden = tl.load(dh_ptr + row_h + cols[None, :], mask=mask, other=0.0).to(tl.float32)
                d_gate, d_up, _ = _swiglu_grads(gate, up, d_hidden)
                d_gate = d_gate.to(dgu_ptr.dtype.element_ty).to(tl.float32)
                d_up = d_up.to(dgu_ptr.dtype.element_ty).to(tl.float32)
                q_gate = e4m3_bits(d_gate, inv_scale)
                q_up = e4m3_bits(d_up, inv_scale)
                tl.store(q_ptr + row_gu + cols[None, :], q_gate, mask=mask)
                tl.store(q_ptr + row_gu + inter + cols[None, :], q_up, mask=mask)


def _tiles(inter: int) -> dict:
    """Tiles of both kernels, by width (the best of 11 on an H200, within 3% of each width's best: forward and
    backward at I = 768, 2,048 and 14,336, docs/performance.md section 10)."""
    if inter >= 2048:
        return {"BLOCK_P": 2, "BLOCK_I": 1024, "num_warps": 8}
    return {"BLOCK_P": 8, "BLOCK_I": 256, "num_warps": 4}


def _clamp_args(limit: float | None) -> dict:
    """The bf16 kernels' clamp arguments: ``limit`` (unused without one) and the ``CLAMP`` switch."""
    return {"limit": 0.0 if limit is None else limit, "CLAMP": limit is not None}


def swiglu_forward(
    gate_up_PF: torch.Tensor, w_P: torch.Tensor, tiles: dict | None = None, limit: float | None = None
) -> torch.Tensor:
    """``silu(gate) * up * w`` per pair, ``[P, I]`` in ``gate_up_PF``'s dtype; ``limit``: gate and up clamped first
    (``grouped_experts.ClampedGate``)."""
    num_pairs, inter = gate_up_PF.shape[0], gate_up_PF.shape[1] // 2
    t = _tiles(inter) if tiles is None else tiles
    hidden_PI = gate_up_PF.new_empty(num_pairs, inter)
    grid = (triton.cdiv(num_pairs, t["BLOCK_P"]), triton.cdiv(inter, t["BLOCK_I"]))
    clamp = _clamp_args(limit)
    _swiglu_forward_kernel[grid](gate_up_PF, w_P, hidden_PI, num_pairs, inter, **clamp, **t)
    return hidden_PI


def swiglu_backward(
    gate_up_PF: torch.Tensor,
    w_P: torch.Tensor,
    d_hidden_PI: torch.Tensor,
    tiles: dict | None = None,
    limit: float | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(d_gate_up_PF, d_w_P)`` of ``swiglu_forward`` (at the same ``limit``) for the gradient ``d_hidden_PI``."""
    num_pairs, inter = gate_up_PF.shape[0], gate_up_PF.shape[1] // 2
    t = _tiles(inter) if tiles is None else tiles
    d_gate_up_PF = torch.empty_like(gate_up_PF)
    d_w_P = torch.empty_like(w_P)
    grid = (triton.cdiv(num_pairs, t["BLOCK_P"]),)
    clamp = _clamp_args(limit)
    d_hidden_PI = d_hidden_PI.contiguous()
    _swiglu_backward_kernel[grid](gate_up_PF, w_P, d_hidden_PI, d_gate_up_PF, d_w_P, num_pairs, inter, **clamp, **t)
    return d_gate_up_PF, d_w_P


class SwiGLU(torch.autograd.Function):
    """``swiglu_forward`` with ``swiglu_backward`` as its gradient; saves its two inputs (the unclamped gate/up
    rows: the clamp is recomputed in the backward, as its masks are)."""

    @staticmethod
    def forward(ctx, gate_up_PF: torch.Tensor, w_P: torch.Tensor, limit: float | None = None) -> torch.Tensor:
        gate_up_PF, w_P = gate_up_PF.contiguous(), w_P.contiguous()
        ctx.save_for_backward(gate_up_PF, w_P)
        ctx.limit = limit
        return swiglu_forward(gate_up_PF, w_P, limit=limit)

    @staticmethod
    def backward(ctx, d_hidden_PI: torch.Tensor):
        gate_up_PF, w_P = ctx.saved_tensors
        d_gate_up_PF, d_w_P = swiglu_backward(gate_up_PF, w_P, d_hidden_PI, limit=ctx.limit)
        return d_gate_up_PF, d_w_P, None


def swiglu_fp8_forward(gate_up_PF: torch.Tensor, tiles: dict | None = None) -> tuple[torch.Tensor, Quantized]:
    """``silu(gate) * up`` per pair (no routing weight: the FP8 experts apply it after the down projection), ``[P, I]``
    in ``gate_up_PF``'s dtype, and those rows quantized for the down GEMM: ``quantize(hidden_PI, -1)``, bit for bit,
    from the same kernel (one pass for the row's amax, one for its e4m3 values) instead of a separate quantization."""
    gate_up_PF = gate_up_PF.contiguous()
    num_pairs, inter = gate_up_PF.shape[0], gate_up_PF.shape[1] // 2
    t = _tiles(inter) if tiles is None else tiles
    hidden_PI = gate_up_PF.new_empty(num_pairs, inter)
    data_PI = torch.empty(num_pairs, inter, dtype=E4M3, device=gate_up_PF.device)
    scale_P1 = torch.empty(num_pairs, 1, dtype=torch.float32, device=gate_up_PF.device)
    grid = (triton.cdiv(num_pairs, t["BLOCK_P"]),)
    bytes_PI = data_PI.view(torch.uint8)  # the kernel writes e4m3 bytes, not values (``fp8.triton_e4m3.e4m3_bits``)
    _swiglu_fp8_forward_kernel[grid](gate_up_PF, hidden_PI, bytes_PI, scale_P1, num_pairs, inter, **t)
    return hidden_PI, Quantized(data_PI, scale_P1)


def swiglu_fp8_backward(
    gate_up_PF: torch.Tensor, d_hidden_PI: torch.Tensor, quantized: bool = True, tiles: dict | None = None
) -> tuple[torch.Tensor, Quantized | None]:
    """``d_gate_up_PF`` of ``swiglu_fp8_forward`` for the gradient ``d_hidden_PI`` (in ``gate_up_PF``'s dtype, for
    the gate/up weight gradient) and, where ``quantized``, those rows quantized for the gate/up input-gradient GEMM
    (``quantize(d_gate_up_PF, -1)``, bit for bit: a second pass over the row, its 2I columns, at the row's scale)."""
    gate_up_PF = gate_up_PF.contiguous()
    num_pairs, inter = gate_up_PF.shape[0], gate_up_PF.shape[1] // 2
    t = _tiles(inter) if tiles is None else tiles
    d_gate_up_PF = torch.empty_like(gate_up_PF)
    q = None
    if quantized:
        data_PF = torch.empty(num_pairs, 2 * inter, dtype=E4M3, device=gate_up_PF.device)
        q = Quantized(data_PF, torch.empty(num_pairs, 1, dtype=torch.float32, device=gate_up_PF.device))
    # e4m3 bytes (``fp8.triton_e4m3.e4m3_bits``); without QUANTIZE nothing is written there
    outs = (d_gate_up_PF, d_gate_up_PF) if q is None else (q.data.view(torch.uint8), q.scale)
    grid = (triton.cdiv(num_pairs, t["BLOCK_P"]),)
    _swiglu_fp8_backward_kernel[grid](
        gate_up_PF, d_hidden_PI.contiguous(), d_gate_up_PF, *outs, num_pairs, inter, QUANTIZE=quantized, **t
    )
    return d_gate_up_PF, q
