"""Seconds of one call of a layer part on one GPU, forward and backward: the attention part, the routed experts
and the LM head, from their FLOPs and the ``cluster.PartModel`` time models in ``Rates`` (pure Python).

The backward includes what the recompute policy re-runs (``recompute.py``); with a split backward the
weight-gradient GEMMs become their own tasks (``*_wgrad_s``: dgrad and wgrad GEMMs cost the same).
"""

from __future__ import annotations

from disagmoe_ds.planner.cluster import Rates
from disagmoe_ds.planner.model import ModelSpec
from disagmoe_ds.planner.recompute import Recompute, a_side_recompute_flops, expert_recompute_flops_per_assignment


def attention_call_s(
    spec: ModelSpec,
    rates: Rates,
    *,
    seq_len: int,
    layer: int,
    tokens: float,
    recompute: Recompute,
    whole_blocks: bool = False,
) -> tuple[float, float]:
    """(forward, backward) seconds of one A part of ``layer`` on ``tokens`` tokens; the backward includes what
    ``recompute`` re-runs (full: the forward; selective: Q/K/V projections, core and gate/up GEMMs, or with
    ``whole_blocks`` every projection of the attention block and the shared/dense SwiGLU: AF-Pipe's runtime)."""
    core = tokens * spec.attention_core_flops(seq_len, layer)
    linear = tokens * spec.attention_side_flops(seq_len, layer) - core
    fwd = rates.attention_fwd.seconds(linear, core)
    bwd = rates.attention_bwd.seconds(linear, core)
    if recompute == "full":
        return fwd, bwd + fwd
    if recompute == "selective":
        rc_linear, rc_core = a_side_recompute_flops(spec, seq_len, layer, whole_blocks=whole_blocks)
        return fwd, bwd + rates.attention_fwd.seconds(tokens * rc_linear, tokens * rc_core, calls=0)
    return fwd, bwd


def attention_wgrad_s(spec: ModelSpec, rates: Rates, *, seq_len: int, layer: int, tokens: float) -> float:
    """The weight-gradient GEMMs of one A part: half the backward of its projections (dgrad = wgrad FLOPs);
    the attention core has no weights, so its backward stays whole on the input-gradient side."""
    linear = tokens * (spec.attention_side_flops(seq_len, layer) - spec.attention_core_flops(seq_len, layer))
    return rates.attention_bwd.per_flop * linear / 2


def expert_call_s(
    spec: ModelSpec, rates: Rates, *, layer: int, tokens: float, recompute: Recompute
) -> tuple[float, float]:
    """(forward, backward) seconds of the routed experts of ``layer`` for ``tokens`` tokens' top_k assignments."""
    flops = tokens * spec.expert_side_flops(layer) * rates.routing_imbalance  # the busiest rank sets the pace
    if flops == 0:
        return 0.0, 0.0
    fwd = rates.experts_fwd.seconds(flops)
    bwd = rates.experts_bwd.seconds(flops)
    if recompute == "full":
        return fwd, bwd + fwd
    if recompute == "selective":
        extra = tokens * spec.top_k * expert_recompute_flops_per_assignment(spec) * rates.routing_imbalance
        return fwd, bwd + rates.experts_fwd.seconds(extra, calls=0)
    return fwd, bwd


def expert_wgrad_s(spec: ModelSpec, rates: Rates, *, layer: int, tokens: float) -> float:
    """The weight-gradient half of the experts' backward (every expert FLOP is a GEMM)."""
    return rates.experts_bwd.per_flop * tokens * spec.expert_side_flops(layer) * rates.routing_imbalance / 2


def head_call_s(spec: ModelSpec, rates: Rates, *, tokens: float) -> tuple[float, float]:
    """LM head GEMM (final norm and loss are elementwise), at the attention part's per-FLOP speed."""
    flops = tokens * spec.head_flops()
    return rates.attention_fwd.per_flop * flops, rates.attention_bwd.per_flop * flops
