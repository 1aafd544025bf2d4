"""The routed experts in FP8 from rows to rows as one autograd node: the permutation, both projections with the
SwiGLU middle between them, and the weighted un-permute, where the Triton middle writes the FP8 operands of the GEMMs
after it (``triton_swiglu.swiglu_fp8_forward`` / ``_backward``).

The same recipe as ``grouped_experts``' unfused FP8 path (``_Permute``, ``fp8.projections.fp8_grouped_mm`` twice, the
Triton SwiGLU, ``_WeightedUnpermute``: the routing weight after the down projection), its values bit for bit, with
the passes over the P pair rows that the split into nodes made:

- the routed rows are quantized as the R rows they are (a pair row is a copy of its row, and a rowwise quantization
  commutes with copying rows), and their e4m3 bytes and scales are gathered into pair order: no rowwise reduction over
  the K-times larger pair rows, half the gather's bytes;
- autograd keeps the R rows' bytes for the gate/up weight's gradient, which dequantizes them in the backward and
  gathers the pairs' rows from them, instead of every pair's bytes (and a dequantization K times as large);
- the down GEMM's input ``hidden_PI`` and the gate/up input-gradient GEMM's ``d_gate_up_PF`` are quantized by the
  Triton kernels that produce them (the row's amax, then its e4m3 values, in one launch), and the down
  input-gradient GEMM's ``d_out_PH`` by the compiled kernel that makes it from the rows' gradient
  (``weighted_pair_grads``).

(DeepSeek-V3's FP8 layer on an H100 at 1 x 4,096 tokens: 43.69 ms before, 40.93-42.57 with the node, 1.23-1.26x
ours bf16, docs/performance-log.md section 35; at 2 x 4,096 1.12x, section 36.)

What else autograd keeps: the gate/up output for the middle's backward, the bf16 ``hidden_PI`` for the down weight's
gradient (high precision, as ``fp8.gemm.grouped_weight_grad`` computes every expert dW and as the FP8 reference does),
the unweighted outputs for the routing weights' gradient. ``recompute``: not the gate/up output, which the backward
re-runs from the kept rows, as the unfused path's ``torch.utils.checkpoint`` around it does. Shape suffixes: R rows,
P pairs, H hidden, I intermediate, F = 2I, e experts.
"""

from __future__ import annotations

from typing import Any

import torch

from disagmoe_ds.fp8.gemm import grouped_weight_grad, scaled_grouped_mm
from disagmoe_ds.fp8.projections import viewed, wanted
from disagmoe_ds.fp8.quantize import Quantized, dequantize, fused_on_cuda, quantize
from disagmoe_ds.fp8.weight_cache import quantized_weight
from disagmoe_ds.models import triton_swiglu


def fp8_routed_experts(
    x_RH: torch.Tensor,
    w_P: torch.Tensor,
    w_RK: torch.Tensor,
    gate_up_eFH: torch.Tensor,
    down_eHI: torch.Tensor,
    offsets_e: torch.Tensor,
    slots: Any,
    recompute: bool,
) -> torch.Tensor:
    """Each row's sum over its pairs of ``w_P * fp8_grouped_mm(silu(gate) * up, down)``, ``gate_up =
    fp8_grouped_mm(x_PH, gate_up_eFH)`` per expert group (HF's fused layouts ``[e, 2I, H]`` and ``[e, H, I]``), the
    pairs ``slots``' (``grouped_experts._Slots``: ``rows_P`` and ``sum_slots``), the sum's coefficients ``w_RK``
    (``w_P`` per row and choice, detached, zero where a pair is dropped)."""
    x_RH, w_P, gate_up_eFH, down_eHI = viewed(x_RH, w_P, gate_up_eFH, down_eHI)
    return _Fp8RoutedExperts.apply(x_RH, w_P, gate_up_eFH, down_eHI, offsets_e, w_RK, slots, recompute)


class _Fp8RoutedExperts(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x_RH, w_P, gate_up_eFH, down_eHI, offsets_e, w_RK, slots, recompute: bool) -> torch.Tensor:
        x_R = quantize(x_RH, -1)
        gate_up_PF = scaled_grouped_mm(x_R.rows(slots.rows_P), quantized_weight(gate_up_eFH), offsets_e, x_RH.dtype)
        hidden_PI, hidden_q = triton_swiglu.swiglu_fp8_forward(gate_up_PF)
        y_PH = scaled_grouped_mm(hidden_q, quantized_weight(down_eHI), offsets_e, x_RH.dtype)
        kept = () if recompute else (gate_up_PF,)
        ctx.save_for_backward(gate_up_eFH, down_eHI, offsets_e, x_R.data, x_R.scale, hidden_PI, y_PH, w_P, *kept)
        ctx.slots = slots
        return slots.sum_slots(y_PH, w_RK)

    @staticmethod
    def backward(ctx: Any, grad_RH: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        gate_up_eFH, down_eHI, offsets_e, x_data, x_scale, hidden_PI, y_PH, w_P, *kept = ctx.saved_tensors
        need_x, need_w, need_gate_up, need_down = (wanted(ctx, i) for i in range(4))
        rows_P, dtype = ctx.slots.rows_P, y_PH.dtype
        d_x = d_w = d_gate_up = d_down = None
        d_out_PH, d_out_data, d_out_scale, d_w = weighted_pair_grads(grad_RH, rows_P, y_PH, w_P, True)
        if need_down:
            d_down = grouped_weight_grad(d_out_PH, hidden_PI, offsets_e).to(down_eHI.dtype)
        if need_x or need_gate_up:
            x_R = Quantized(x_data, x_scale)
            if kept:
                (gate_up_PF,) = kept
            else:
                gate_up_PF = scaled_grouped_mm(x_R.rows(rows_P), quantized_weight(gate_up_eFH), offsets_e, dtype)
            d_out_q = Quantized(d_out_data, d_out_scale)
            d_hidden_PI = scaled_grouped_mm(d_out_q, quantized_weight(down_eHI, transposed=True), offsets_e, dtype)
            d_gate_up_PF, d_gate_up_q = triton_swiglu.swiglu_fp8_backward(gate_up_PF, d_hidden_PI, quantized=need_x)
            if d_gate_up_q is not None:
                gate_up_t = quantized_weight(gate_up_eFH, transposed=True)
                d_x = ctx.slots.sum_slots(scaled_grouped_mm(d_gate_up_q, gate_up_t, offsets_e, dtype))
            if need_gate_up:
                x_PH = dequantize(x_R, dtype).index_select(0, rows_P)  # the R rows, then the K-times more pairs
                d_gate_up = grouped_weight_grad(d_gate_up_PF, x_PH, offsets_e).to(gate_up_eFH.dtype)
        return d_x, d_w if need_w else None, d_gate_up, d_down, None, None, None, None


@fused_on_cuda
def weighted_pair_grads(
    grad_RH: torch.Tensor, rows_P: torch.Tensor, y_PH: torch.Tensor, w_P: torch.Tensor, quantized: bool = False
) -> tuple[torch.Tensor, ...]:
    """The gradients of ``sum_k w y`` for each pair: its row's gradient times its weight (in ``y_PH``'s dtype), where
    ``quantized`` followed by its rowwise e4m3 bytes and scales, and the dot product of that gradient with its output
    (float32; one gather and one reduction, the quantization with them, fused on CUDA)."""
    g_PH = grad_RH.index_select(0, rows_P).float()
    d_y_PH = (g_PH * w_P.unsqueeze(1)).to(y_PH.dtype)
    d_w_P = (g_PH * y_PH.float()).sum(-1).to(w_P.dtype)
    if not quantized:
        return d_y_PH, d_w_P
    d_y_q = quantize(d_y_PH, -1)
    return d_y_PH, d_y_q.data, d_y_q.scale, d_w_P
