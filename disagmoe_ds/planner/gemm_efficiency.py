"""Per-shape compute efficiency without a profile: the documented fallback table (pure Python).

One share of peak for every shape (``Efficiency.compute``) is too optimistic for fine-grained experts and too
pessimistic for big dense GEMMs. Without a profile of the GPU (``disagmoe-plan profile``, which measures the
model's own parts and replaces all of this), the planner times each kind of work at its own share of peak:

* dense GEMMs (attention projections, shared experts, dense MLPs, the LM head): ``DENSE_GEMM``;
* the attention core (fused flash/cuDNN attention, forward and backward): ``ATTENTION_CORE``;
* the routed experts' grouped GEMMs with the permutation, activation and un-permutation around them, by expert
  width (the GEMMs' inner dimension I): ``EXPERT_PATH``, interpolated in log2(I) and flat outside the table.

Sources (Hopper, bf16; the H200 numbers are this project's measurements, docs/performance.md sections 1 and 11
among them, the H100 ones Megatron-Core's published runs, docs/planner.md section 8):

* cuBLAS reaches 794 of 989 TFLOP/s on an 8192^3 matmul; model-sized projections (4K-16K rows after sequence
  parallel, 2-8K columns) and their backward run at 60-65% on the H200 profiles: 0.62.
* cuDNN SDPA forward + backward, causal, 4K-32K: 480-575 TFLOP/s on an H200: 0.50 (the low end: H100 clocks).
* Expert paths, measured on an H200 (``bench_experts.py``, grouped GEMMs with the permutation around them):
  Qwen3-30B-A3B's 768-wide experts 410 TFLOP/s for the GEMMs alone, 226 with HF's permutation; DeepSeek-V3's
  2048-wide experts 320 / 266; Mixtral's 14336-wide 611 / 488. Megatron's fused permutation (TE) keeps most of
  the GEMMs' rate, so the table sits between the two columns: 0.30 at 768, 0.40 at 2048 and 1536 (1536 is calibrated:
  the value Qwen3-235B-A22B's published 4K run at TP2 PP8 VPP4 EP32 needs, docs/planner.md section 8), 0.42 at
  2048, 0.55 at 14336.

Each entry is a share of the cluster's ``peak_flops``; backward is charged at the same share (2x the FLOPs).
"""

from __future__ import annotations

import math
from dataclasses import replace

from disagmoe_ds.planner.cluster import Cluster, Efficiency, PartModel, Rates
from disagmoe_ds.planner.model import ModelSpec

DENSE_GEMM = 0.62
ATTENTION_CORE = 0.50
# The planner's compute efficiency holds for GEMMs that fill the GPU: with 128 x 256 output tiles over 132 SMs a
# projection of N = 2048-8192 columns needs about 1K rows to give every SM a tile. TP x CP (co-located) and SP x TP
# (an AF-Pipe A-lane) shard the rows (tokens) of a micro-batch, so shapes leaving fewer than this many tokens per
# rank are not searched.
MIN_ROWS_PER_RANK = 1024
# (expert width I, share of peak) of the routed experts' whole path, ascending in I
EXPERT_PATH: tuple[tuple[int, float], ...] = ((768, 0.30), (1536, 0.40), (2048, 0.42), (14336, 0.55))


def expert_efficiency(width: int, table: tuple[tuple[int, float], ...] = EXPERT_PATH) -> float:
    """Share of peak of the routed experts' path at expert width ``width`` (log2-linear between table points).

    >>> expert_efficiency(1536), expert_efficiency(512), round(expert_efficiency(2880), 3)
    (0.4, 0.3, 0.443)
    """
    if width <= table[0][0]:
        return table[0][1]
    for (w0, e0), (w1, e1) in zip(table, table[1:]):
        if width <= w1:
            return e0 + (e1 - e0) * math.log2(width / w0) / math.log2(w1 / w0)
    return table[-1][1]


def shape_rates(cluster: Cluster, eff: Efficiency, spec: ModelSpec, *, routing_imbalance: float = 1.0) -> Rates:
    """``Rates`` with the fallback table's per-shape shares of peak for ``spec``'s parts (links and memory from
    ``eff``); ``routing_imbalance`` is the busiest rank's expert load over the mean (1: forced balance)."""
    base = Rates.from_cluster(cluster, eff)
    peak = cluster.peak_flops
    dense, core = 1 / (peak * DENSE_GEMM), 1 / (peak * ATTENTION_CORE)
    expert_share = expert_efficiency(spec.expert_intermediate)
    expert = 1 / (peak * expert_share)
    return replace(
        base,
        attention_fwd=PartModel(dense, core),
        attention_bwd=PartModel(2 * dense, 2 * core),
        experts_fwd=PartModel(expert, expert),
        experts_bwd=PartModel(2 * expert, 2 * expert),
        routing_imbalance=routing_imbalance,
        source=(
            f"shape table (dense GEMMs {DENSE_GEMM:g}, attention core {ATTENTION_CORE:g}, experts "
            f"{expert_share:.2f} at width {spec.expert_intermediate}; network {eff.network:g}, nvlink {eff.nvlink:g})"
        ),
    )
