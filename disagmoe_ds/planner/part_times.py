"""Seconds of one call of a layer part on one GPU, forward and backward: the attention part, the routed experts
and the LM head, from their FLOPs and the ``cluster.PartModel`` time models in ``Rates`` (pure Python).

The backward includes what the recompute policy re-runs (``recompute.py``); with a split backward the
weight-gradient GEMMs become their own tasks (``*_wgrad_s``: dgrad and wgrad GEMMs cost the same).

The GEMM FLOPs come from ``lora.GemmFlops``: under LoRA the frozen base weights skip their wgrad and the adapters
add theirs. The backward time models (``Rates.*_bwd``) price a full backward (dgrad + wgrad, 2x the forward) per
forward FLOP, so they are given half a part's backward FLOPs. Selective recompute re-runs base GEMMs only: the
adapters' share of the re-run (r (in + out) against in x out per projection, about 1% at r=16 on a 2,048-wide
model) is left out.

With the FP8 lever (``fp8``, ``fp8_costs.py``) the GEMMs it covers enter the time models as bf16-equivalent FLOPs and
its quantize passes are added; a selective re-run pays the forward's passes in the share of the FLOPs it re-runs.
"""

from __future__ import annotations

from disagmoe_ds.planner.cluster import Rates
from disagmoe_ds.planner.fp8_costs import (
    Fp8,
    a_side_fp8_gemms,
    a_side_passes,
    expert_fp8_gemms,
    expert_passes,
    expert_rerun_share,
    projection_flops,
    projection_rerun_share,
)
from disagmoe_ds.planner.gemm_efficiency import interpolated
from disagmoe_ds.planner.lora import FULL, GemmFlops, LoRA, a_side_gemm_flops, expert_gemm_flops, head_gemm_flops
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
    lora: LoRA = FULL,
    fp8: Fp8 | None = None,
) -> tuple[float, float]:
    """(forward, backward) seconds of one A part of ``layer`` on ``tokens`` tokens; the backward includes what
    ``recompute`` re-runs (full: the forward; selective: Q/K/V projections, core and gate/up GEMMs, or with
    ``whole_blocks`` every projection of the attention block and the shared/dense SwiGLU: AF-Pipe's runtime)."""
    core = tokens * priced_core_flops(spec, rates, seq_len, layer)
    gemm = _a_side_gemms(spec, layer, lora, fp8)
    passes = a_side_passes(spec, rates, layer=layer, tokens=tokens, lora=lora, fp8=fp8)
    fwd = rates.attention_fwd.seconds(tokens * gemm.fwd, core) + passes.fwd
    bwd = rates.attention_bwd.seconds(tokens * _bwd_units(gemm), core) + passes.bwd
    if recompute == "full":
        return fwd, bwd + fwd
    if recompute == "selective":
        rc_linear, rc_core = a_side_recompute_flops(spec, seq_len, layer, whole_blocks=whole_blocks)
        rc_core *= core_slowdown(spec, rates, seq_len, layer)
        share = projection_rerun_share(spec, layer, fp8)
        rerun = rates.attention_fwd.seconds(tokens * rc_linear * share, tokens * rc_core, calls=0)
        fp8_flops = projection_flops(spec, layer, fp8.bf16_width) if fp8 else 0.0
        rerun += passes.fwd * min(1.0, rc_linear / fp8_flops) if fp8_flops else 0.0
        return fwd, bwd + rerun
    return fwd, bwd


def priced_core_flops(spec: ModelSpec, rates: Rates, seq_len: int, layer: int) -> float:
    """``layer``'s attention-core FLOPs per token as ``rates``' core model prices them: the model's FLOPs times the
    kernel's slowdown (``core_slowdown``)."""
    return spec.attention_core_flops(seq_len, layer) * core_slowdown(spec, rates, seq_len, layer)


def core_slowdown(spec: ModelSpec, rates: Rates, seq_len: int, layer: int) -> float:
    """How much longer ``layer``'s attention core takes than ``rates``' core model says: the inverse of
    ``Rates.sink_core``'s relative speed at the keys a query attends (the window, or the sequence); 1 without it."""
    if not rates.sink_core:
        return 1.0
    window = spec.windows[layer]
    return 1 / interpolated(min(window, seq_len) if window else seq_len, rates.sink_core)


def _a_side_gemms(spec: ModelSpec, layer: int, lora: LoRA, fp8: Fp8 | None) -> GemmFlops:
    """``layer``'s A-part GEMM FLOPs, bf16-equivalent under the FP8 lever."""
    gemm = a_side_gemm_flops(spec, layer, lora)
    return gemm if fp8 is None else a_side_fp8_gemms(spec, layer, lora, gemm, fp8)


def _expert_gemms(spec: ModelSpec, lora: LoRA, fp8: Fp8 | None) -> GemmFlops:
    """One assignment's expert GEMM FLOPs, bf16-equivalent under the FP8 lever."""
    gemm = expert_gemm_flops(spec, lora)
    return gemm if fp8 is None else expert_fp8_gemms(spec, gemm)


def _bwd_units(gemm: GemmFlops) -> float:
    """A backward's GEMM FLOPs in the backward time models' unit: forward FLOPs of a full (2x) backward."""
    return gemm.bwd / 2


def attention_wgrad_s(
    spec: ModelSpec, rates: Rates, *, layer: int, tokens: float, lora: LoRA = FULL, fp8: Fp8 | None = None
) -> float:
    """The weight-gradient GEMMs of one A part (full fine-tuning: half the backward of its projections; LoRA: the
    adapters' and a trained router's only), with their quantize passes under FP8; the attention core has no
    weights, so its backward stays whole on the input-gradient side."""
    passes = a_side_passes(spec, rates, layer=layer, tokens=tokens, lora=lora, fp8=fp8)
    return rates.attention_bwd.per_flop * tokens * _a_side_gemms(spec, layer, lora, fp8).wgrad / 2 + passes.wgrad


def _assignments(spec: ModelSpec, rates: Rates, *, layer: int, tokens: float) -> float:
    """(token, expert) assignments of ``layer`` on the busiest F rank, which sets the pace (0 on a dense layer)."""
    return tokens * spec.top_k * rates.routing_imbalance if spec.moe_layers[layer] else 0.0


def expert_call_s(
    spec: ModelSpec,
    rates: Rates,
    *,
    layer: int,
    tokens: float,
    recompute: Recompute,
    lora: LoRA = FULL,
    fp8: Fp8 | None = None,
) -> tuple[float, float]:
    """(forward, backward) seconds of the routed experts of ``layer`` for ``tokens`` tokens' top_k assignments."""
    assignments = _assignments(spec, rates, layer=layer, tokens=tokens)
    if assignments == 0:
        return 0.0, 0.0
    gemm = _expert_gemms(spec, lora, fp8)
    passes = expert_passes(spec, rates, assignments=assignments, fp8=fp8, lora=lora)
    fwd = rates.experts_fwd.seconds(assignments * gemm.fwd) + passes.fwd
    bwd = rates.experts_bwd.seconds(assignments * _bwd_units(gemm)) + passes.bwd
    if recompute == "full":
        return fwd, bwd + fwd
    if recompute == "selective":
        per_assignment = expert_recompute_flops_per_assignment(spec)
        extra = tokens * spec.top_k * per_assignment * rates.routing_imbalance
        rerun = rates.experts_fwd.seconds(extra * expert_rerun_share(spec, fp8), calls=0)
        rerun += passes.fwd * per_assignment / (6 * spec.hidden_size * spec.expert_intermediate) if fp8 else 0.0
        return fwd, bwd + rerun
    return fwd, bwd


def expert_wgrad_s(
    spec: ModelSpec, rates: Rates, *, layer: int, tokens: float, lora: LoRA = FULL, fp8: Fp8 | None = None
) -> float:
    """The experts' weight-gradient GEMMs (full fine-tuning: half their backward, every expert FLOP is a GEMM;
    LoRA: the adapters' only), with their quantize passes under FP8."""
    assignments = _assignments(spec, rates, layer=layer, tokens=tokens)
    passes = expert_passes(spec, rates, assignments=assignments, fp8=fp8, lora=lora)
    return rates.experts_bwd.per_flop * assignments * _expert_gemms(spec, lora, fp8).wgrad / 2 + passes.wgrad


def head_call_s(spec: ModelSpec, rates: Rates, *, tokens: float, lora: LoRA = FULL) -> tuple[float, float]:
    """LM head GEMM (final norm and loss are elementwise), at the attention part's per-FLOP speed."""
    gemm = head_gemm_flops(spec, lora)
    return rates.attention_fwd.per_flop * tokens * gemm.fwd, rates.attention_bwd.per_flop * tokens * _bwd_units(gemm)


def head_wgrad_s(spec: ModelSpec, rates: Rates, *, tokens: float, lora: LoRA = FULL) -> float:
    """The LM head's weight gradient (none under LoRA: the head is frozen)."""
    return rates.attention_bwd.per_flop * tokens * head_gemm_flops(spec, lora).wgrad / 2
