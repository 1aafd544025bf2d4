"""The routed experts' FP8 projections with the SwiGLU middle between them as one autograd node, whose Triton middle
writes the FP8 operands of the GEMMs after it (``triton_swiglu.swiglu_fp8_forward`` / ``_backward``).

The same recipe as ``_projected_experts``' FP8 path (``fp8.projections.fp8_grouped_mm`` twice, the Triton SwiGLU
between them, the routing weight after the down projection), with two quantization passes gone: the down GEMM's
input ``hidden_PI`` and the gate/up input-gradient GEMM's ``d_gate_up_PF`` are quantized rowwise by the kernels that
produce them, which compute the row (its amax) and then its e4m3 values in one launch instead of an inductor reduction
and a cast reading them back (0.84 ms of quantizations in the FP8 step of performance-log section 26, five of them;
these were two). The values are those of the separate passes, bit for bit: the same bf16 rows, the same power-of-two
scales, e4m3 rounded to nearest even. What autograd keeps is unchanged: the routed rows as their e4m3 bytes, the
gate/up output for the middle's backward, the bf16 ``hidden_PI`` for the down weight's gradient (high precision, as
``fp8.gemm.grouped_weight_grad`` computes every expert dW and as the FP8 reference does).

``recompute``: keep the routed rows (e4m3) and ``hidden_PI`` only and re-run the gate/up GEMM in the backward, as the
unfused path's ``torch.utils.checkpoint`` around it does. Shape suffixes: P pairs, H hidden, I intermediate, F = 2I,
e experts.
"""

from __future__ import annotations

from typing import Any

import torch

from disagmoe_ds.fp8.gemm import grouped_weight_grad, scaled_grouped_mm
from disagmoe_ds.fp8.projections import viewed, wanted
from disagmoe_ds.fp8.quantize import Quantized, dequantize, quantize
from disagmoe_ds.fp8.weight_cache import quantized_weight
from disagmoe_ds.models import triton_swiglu


def fp8_swiglu_experts(
    x_PH: torch.Tensor, gate_up_eFH: torch.Tensor, down_eHI: torch.Tensor, offsets_e: torch.Tensor, recompute: bool
) -> torch.Tensor:
    """``fp8_grouped_mm(silu(gate) * up, down)`` of ``gate_up = fp8_grouped_mm(x_PH, gate_up_eFH, fp8_rows=True)``
    per expert group (HF's fused layouts ``[e, 2I, H]`` and ``[e, H, I]``), without the routing weight; ``x_PH``'s
    rows are FP8 values (the routed tokens as the lever sends them)."""
    return _Fp8SwiGLUExperts.apply(*viewed(x_PH, gate_up_eFH, down_eHI), offsets_e, recompute)


class _Fp8SwiGLUExperts(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x_PH, gate_up_eFH, down_eHI, offsets_e, recompute: bool) -> torch.Tensor:
        x_q = quantize(x_PH, -1)  # FP8 values already: the same values, kept as their bytes
        gate_up_PF = scaled_grouped_mm(x_q, quantized_weight(gate_up_eFH), offsets_e, x_PH.dtype)
        hidden_PI, hidden_q = triton_swiglu.swiglu_fp8_forward(gate_up_PF)
        kept = () if recompute else (gate_up_PF,)
        ctx.save_for_backward(gate_up_eFH, down_eHI, offsets_e, x_q.data, x_q.scale, hidden_PI, *kept)
        ctx.dtype = x_PH.dtype
        return scaled_grouped_mm(hidden_q, quantized_weight(down_eHI), offsets_e, x_PH.dtype)

    @staticmethod
    def backward(ctx: Any, d_out_PH: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        gate_up_eFH, down_eHI, offsets_e, x_data, x_scale, hidden_PI, *kept = ctx.saved_tensors
        need_x, need_gate_up, need_down = (wanted(ctx, i) for i in range(3))
        x_q, dtype = Quantized(x_data, x_scale), ctx.dtype
        d_x = d_gate_up = d_down = None
        if need_down:
            d_down = grouped_weight_grad(d_out_PH, hidden_PI, offsets_e).to(down_eHI.dtype)
        if need_x or need_gate_up:
            gate_up_PF = kept[0] if kept else scaled_grouped_mm(x_q, quantized_weight(gate_up_eFH), offsets_e, dtype)
            down_t = quantized_weight(down_eHI, transposed=True)
            d_hidden_PI = scaled_grouped_mm(quantize(d_out_PH, -1), down_t, offsets_e, dtype)
            d_gate_up_PF, d_gate_up_q = triton_swiglu.swiglu_fp8_backward(gate_up_PF, d_hidden_PI, quantized=need_x)
            if d_gate_up_q is not None:
                d_x = scaled_grouped_mm(d_gate_up_q, quantized_weight(gate_up_eFH, transposed=True), offsets_e, dtype)
            if need_gate_up:
                x_PH = dequantize(x_q, dtype)
                d_gate_up = grouped_weight_grad(d_gate_up_PF, x_PH, offsets_e).to(gate_up_eFH.dtype)
        return d_x, d_gate_up, d_down, None, None
