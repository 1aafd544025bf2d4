"""Which linear projections the FP8 lever computes in FP8, by shape (pure Python: the planner prices the same rule).

FP8 pays where a GEMM's saving, which grows with M x K x N, exceeds what the recipe adds around it: the rowwise
quantizations of its operands and their neighbours' casts, which grow with M x (K + N). So narrow projections lose.
Measured at one shape only (performance-log section 26, one H100, Qwen3-30B-A3B's attention at H = 2,048 and 4,096
tokens a micro-batch: q 2,048 -> 4,096, k and v 2,048 -> 512, o 4,096 -> 2,048): its 12 FP8 GEMMs (forward and both
backward of the four projections) took 0.87 ms against bf16's 0.60. ``BF16_WIDTH`` keeps exactly such projections, with
an input or output width of at most 2,048, in bf16, and nothing wider: conservative, as no wider projection was
measured losing, and not a fitted boundary (the four were timed together, not one by one).

>>> fp8_pays(2048, 4096), fp8_pays(16384, 7168), fp8_pays(64, 96, bf16_width=0)
(False, True, True)
"""

from __future__ import annotations

# torch._scaled_mm's operands: both GEMM dimensions of a weight multiples of 16 bytes of FP8.
ALIGNMENT = 16
# A projection whose in_features or out_features is at most this stays in bf16 (the ``"fp8_bf16_width"`` default).
BF16_WIDTH = 2048


def fp8_pays(in_features: int, out_features: int, bf16_width: int = BF16_WIDTH) -> bool:
    """Whether a projection ``in_features -> out_features`` runs in FP8: both widths past ``bf16_width`` (0: every
    width) and aligned for the FP8 kernels."""
    aligned = in_features % ALIGNMENT == 0 and out_features % ALIGNMENT == 0
    return aligned and min(in_features, out_features) > bf16_width
