"""Per-shape compute efficiency without a profile: the documented fallback table (pure Python).

One share of peak for every shape (``Efficiency.compute``) is too optimistic for fine-grained experts and too
pessimistic for big dense GEMMs. Without a profile of the GPU (``disagmoe-plan profile``, which measures the
model's own parts and replaces all of this), the planner times each kind of work at its own share of peak:

* dense GEMMs (attention projections, shared experts, dense MLPs, the LM head): ``DENSE_GEMM``;
* the attention core (fused flash/cuDNN attention, forward and backward): ``ATTENTION_CORE``; with learned sinks
  (GPT-OSS) through flex_attention, as this project's runtime and HF's model run them: ``FLEX_SINK_CORE``;
* the routed experts' grouped GEMMs with the permutation, activation and un-permutation around them, by expert
  width (the GEMMs' inner dimension I): ``EXPERT_PATH``, interpolated in log2(I) and flat outside the table.

Sources (Hopper, bf16; the H200 numbers are this project's measurements, docs/performance.md sections 1 and 11
among them, the H100 ones Megatron-Core's published runs, docs/planner.md section 8):

* cuBLAS reaches 794 of 989 TFLOP/s on an 8192^3 matmul; model-sized projections (4K-16K rows after sequence
  parallel, 2-8K columns) and their backward run at 60-65% on the H200 profiles: 0.62.
* cuDNN SDPA forward + backward, causal, 4K-32K: 480-575 TFLOP/s on an H200: 0.50 (the low end: H100 clocks).
* flex_attention with GPT-OSS's sinks, compiled, forward + backward of a full-attention GPT-OSS-120B layer's
  attention part on an H100 (2026-12-06, docs/planner.md section 8: 2.60 / 4.84 / 12.33 / 38.05 ms at 2K-16K), less
  its projections at ``DENSE_GEMM``: 0.05 / 0.11 / 0.16 / 0.20 of peak (flex's backward is 3.3x its forward). A
  sliding-window layer is priced at the share of its window's length (short key ranges: the table's low end).
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
Table = tuple[tuple[int, float], ...]
# (expert width I, share of peak) of the routed experts' whole path, ascending in I
EXPERT_PATH: Table = ((768, 0.30), (1536, 0.40), (2048, 0.42), (14336, 0.55))
# (keys a query attends, share of peak) of flex_attention's core with learned sinks, ascending in keys
FLEX_SINK_CORE: Table = ((2048, 0.05), (4096, 0.11), (8192, 0.16), (16384, 0.20))


def interpolated(x: int, table: Table) -> float:
    """``table``'s value at ``x``: log2-linear between its points, flat outside them.

    >>> interpolated(1536, EXPERT_PATH), interpolated(512, EXPERT_PATH), round(interpolated(2880, EXPERT_PATH), 3)
    (0.4, 0.3, 0.443)
    """
    if x <= table[0][0]:
        return table[0][1]
    for (x0, y0), (x1, y1) in zip(table, table[1:]):
        if x <= x1:
            return y0 + (y1 - y0) * math.log2(x / x0) / math.log2(x1 / x0)
    return table[-1][1]


def expert_efficiency(width: int) -> float:
    """Share of peak of the routed experts' path at expert width ``width``."""
    return interpolated(width, EXPERT_PATH)


def flex_sink_core() -> Table:
    """``Rates.sink_core`` for flex_attention: its core's share of peak over the fused core's, by keys."""
    return tuple((keys, share / ATTENTION_CORE) for keys, share in FLEX_SINK_CORE)


def shape_rates(cluster: Cluster, eff: Efficiency, spec: ModelSpec, *, routing_imbalance: float = 1.0) -> Rates:
    """``Rates`` with the fallback table's per-shape shares of peak for ``spec``'s parts (links and memory from
    ``eff``); ``routing_imbalance`` is the busiest rank's expert load over the mean (1: forced balance). A model with
    learned sinks gets flex_attention's core (``sink_core``), the kernel this project's runtime runs them with;
    Megatron-style baselines take it off (``PlanRequest.baseline_rates``)."""
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
        sink_core=flex_sink_core() if spec.attention.sinks else (),
        source=(
            f"shape table (dense GEMMs {DENSE_GEMM:g}, attention core {ATTENTION_CORE:g}"
            f"{' (sinks: flex_attention, 0.05-0.20)' if spec.attention.sinks else ''}, experts "
            f"{expert_share:.2f} at width {spec.expert_intermediate}; network {eff.network:g}, nvlink {eff.nvlink:g})"
        ),
    )
