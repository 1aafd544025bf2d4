"""Which linear projections and routed experts the FP8 lever computes in FP8, by shape (pure Python: the planner prices
the same rules).

FP8 pays where a GEMM's saving, which grows with M x K x N, exceeds what the recipe adds around it: the rowwise
quantizations of its operands and their neighbours' casts, which grow with M x (K + N). So narrow projections lose.
Measured at one shape only (performance-log section 26, one H100, Qwen3-30B-A3B's attention at H = 2,048 and 4,096
tokens a micro-batch: q 2,048 -> 4,096, k and v 2,048 -> 512, o 4,096 -> 2,048): its 12 FP8 GEMMs (forward and both
backward of the four projections) took 0.87 ms against bf16's 0.60. ``BF16_WIDTH`` keeps exactly such projections, with
an input or output width of at most 2,048, in bf16, and nothing wider. Checked on DeepSeek-V3's layer (section 36):
its q_a, q_b and shared-expert projections (a side of 1,536 or 2,048) in FP8 as well made the layer 0.6% slower at
1 x 4,096 tokens and no faster at 2 x 4,096.

The routed experts follow the same reasoning with their own measure, the harmonic width ``H I / (H + I)`` of hidden
size H and expert width I (a grouped GEMM's FLOPs per row grow with H x I, the quantizations around it with H + I),
measured on seven models' layers (performance-log section 33, one H100, one GPU's experts at 1 x 4,096 tokens, the
FP8 layer against bf16): FP8 paid at DeepSeek-V3's 1,593 (1.20x) and Mixtral-8x7B's 3,186 (1.13x) and lost at every
width below, Qwen3-235B-A22B's 1,117 (0.98x), GLM-4.5-Air's 1,048 (0.99x), DeepSeek-MoE-16B's 834 (0.90x),
Qwen3-30B-A3B's 559 (0.73x) and Qwen3.5-35B-A3B's 410 (0.93x). No width between 1,117 and 1,593 was measured;
``EXPERT_BF16_WIDTH`` keeps the experts bf16 up to 1,536, short of the smallest width seen paying. Under expert
parallelism each expert sees ep times more rows, where FP8's grouped GEMMs gain more (section 26): the rule is
conservative there.

>>> fp8_pays(2048, 4096), fp8_pays(16384, 7168), fp8_pays(64, 96, bf16_width=0)
(False, True, True)
>>> experts_fp8_pay(7168, 2048), experts_fp8_pay(2048, 768), experts_fp8_pay(64, 32, bf16_width=0)
(True, False, True)
"""

from __future__ import annotations

# torch._scaled_mm's operands: both GEMM dimensions of a weight multiples of 16 bytes of FP8.
ALIGNMENT = 16
# A projection whose in_features or out_features is at most this stays in bf16 (the ``"fp8_bf16_width"`` default).
BF16_WIDTH = 2048
# Routed experts whose harmonic width is at most this stay in bf16 (the ``"fp8_expert_bf16_width"`` default).
EXPERT_BF16_WIDTH = 1536


def fp8_pays(in_features: int, out_features: int, bf16_width: int = BF16_WIDTH) -> bool:
    """Whether a projection ``in_features -> out_features`` runs in FP8: both widths past ``bf16_width`` (0: every
    width) and aligned for the FP8 kernels."""
    aligned = in_features % ALIGNMENT == 0 and out_features % ALIGNMENT == 0
    return aligned and min(in_features, out_features) > bf16_width


def harmonic_width(hidden: int, intermediate: int) -> float:
    """``hidden * intermediate / (hidden + intermediate)``: the experts' measure of ``experts_fp8_pay``."""
    return hidden * intermediate / (hidden + intermediate)


def experts_fp8_pay(hidden: int, intermediate: int, bf16_width: int = EXPERT_BF16_WIDTH) -> bool:
    """Whether routed experts of hidden size ``hidden`` and width ``intermediate`` run their grouped GEMMs in FP8:
    their ``harmonic_width`` past ``bf16_width`` (0: always); compared in integers, as it is a ratio."""
    return hidden * intermediate > bf16_width * (hidden + intermediate)
