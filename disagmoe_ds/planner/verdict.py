"""Whether disaggregation pays, in one line, and the reasons behind it.

The reasoning follows the DisagMoE paper's roofline: a side's arithmetic intensity
I = FLOPs / NIC bytes against its turning point I_hat = (GPUs x FLOP/s) / (NICs x bytes/s); I > I_hat means
compute-bound. Disaggregation pays when the co-located baseline loses more to exposed all-to-all and
bubbles than AF-Pipe loses to imbalance, bubbles and its own transfers.
"""

from __future__ import annotations

from disagmoe_ds.planner.plans import PAYS_THRESHOLD, AfPlan, BaselinePlan, PlanResult
from disagmoe_ds.planner.stages import SideTimes


def verdict(result: PlanResult) -> tuple[str, list[str]]:
    """One-line verdict and the reasons behind it."""
    af, base, s = result.af, result.baseline, result.speedup
    if af is None and base is None:
        return "nothing fits: neither AF-Pipe nor co-located EP fits in memory on this cluster", _no_fit(result)
    if af is None:
        return "disaggregation does not fit: use co-located EP (" + baseline_name(base) + ")", _no_fit(result)
    reasons = [
        _side_reason("attention", af, af.candidate.roofline.attention),
        _side_reason("FFN", af, af.candidate.roofline.ffn),
    ]
    if af.candidate.exposed_sync_s > 0:
        reasons.append(
            f"AF-Pipe gradient sync: {af.candidate.exposed_sync_s:.3f} s exposed per step (A lanes "
            f"{af.candidate.sync_s[0]:.3f} s, F replicas {af.candidate.sync_s[1]:.3f} s before overlap)"
        )
    if base is None:
        return (
            "AF-Pipe fits but no co-located EP configuration does: disaggregation is the only option",
            reasons + _af_diagnostics(af),
        )
    reasons += _comparison(af, base)
    if s is not None and s >= PAYS_THRESHOLD:
        return f"disaggregation pays: {s:.2f}x over the co-located baseline", reasons
    return (
        f"disaggregation does not pay ({s:.2f}x): use co-located EP ({baseline_name(base)})",
        reasons + _why_not(af, base),
    )


def _side_reason(name: str, af: AfPlan, side: SideTimes) -> str:
    c = af.candidate
    gpus, nics = (c.layout.attention_gpus, c.nics[0]) if name == "attention" else (c.layout.ffn_gpus, c.nics[1])
    if side.nic_bytes == 0:
        return (
            f"{name} side: {gpus} GPUs, no traffic crosses NICs -> {side.bound}-bound (compute {side.compute_s:.2f} s, "
            f"NVLink {side.nvlink_s:.2f} s per step)"
        )
    intensity = side.flops / side.nic_bytes
    turning = intensity * side.network_s / side.compute_s if side.compute_s else float("inf")
    relation = ">" if side.bound == "compute" else "<"
    return (
        f"{name} side: {gpus} GPUs / {nics} NICs, intensity {intensity:,.0f} FLOP/B {relation} turning point "
        f"{turning:,.0f} FLOP/B -> {side.bound}-bound (compute {side.compute_s:.2f} s, network {side.network_s:.2f} s "
        "per step)"
    )


def _comparison(af: AfPlan, base: BaselinePlan) -> list[str]:
    b, sim = base.candidate, base.sim
    a2a = b.costs.a2a_per_layer_s
    return [
        f"co-located EP {b.shape.ep}: each dispatch/combine takes {a2a * 1e3:.2f} ms per layer and micro-batch; "
        f"{sim.exposed_comm_fraction:.0%} of its step is exposed all-to-all, {sim.bubble_fraction:.0%} pipeline bubble",
        f"AF-Pipe: {af.sim.compute_fraction:.0%} of GPU time computes, {af.sim.exposed_comm_fraction:.0%} waits on "
        f"transfers, {af.sim.bubble_fraction:.0%} is bubble or imbalance (A vs F) in the simulated schedule",
    ]


def _why_not(af: AfPlan, base: BaselinePlan) -> list[str]:
    c = af.candidate
    roof, out = c.roofline, []
    if roof.attention.bound == "network" and roof.ffn.bound == "network":
        out.append("bandwidth dead zone: cross-node bandwidth bounds both sides, so no GPU/NIC split balances them")
    if c.exposed_sync_s > 0.1 * af.step_time_s:
        out.append(
            f"gradient sync adds {c.exposed_sync_s:.3f} s per step: the A lanes or the expert-DP replicas "
            f"span nodes and sync through NICs (co-located: {base.candidate.exposed_sync_s:.3f} s)"
        )
    if base.sim.exposed_comm_fraction < 0.1:
        where = "inside a node over NVLink" if base.candidate.shape.ep <= 8 else "with little exposure"
        out.append(
            f"co-located EP {base.candidate.shape.ep} keeps its all-to-all {where}; AF-Pipe sends tokens between groups"
        )
    return out + _af_diagnostics(af)


def _af_diagnostics(af: AfPlan) -> list[str]:
    """Where AF-Pipe itself loses time: a starved ring, or sides the split cannot balance."""
    c, out = af.candidate, []
    roof = c.roofline
    if af.sim.bubble_fraction > 0.2:
        limit = "memory admits only" if af.in_flight == c.max_in_flight < c.micro_batches else "it runs"
        out.append(
            f"AF-Pipe bubble {af.sim.bubble_fraction:.0%}: {limit} {af.in_flight} micro-batches in flight "
            f"on a {2 * c.layout.depth}-stage ring; each micro-batch crosses all {c.layout.num_layers} layers "
            f"and their transfers before its backward starts"
        )
    balance = min(roof.attention.stage_s, roof.ffn.stage_s) / roof.bottleneck_s
    if balance < 0.7:
        out.append(
            f"the sides stay unbalanced (the lighter one is busy {balance:.0%} of T*): no split that divides "
            "and fits memory balances them better"
        )
    return out


def _no_fit(result: PlanResult) -> list[str]:
    out = [f"AF-Pipe rejected: {dict(result.rejected)}"] if result.rejected else []
    if result.baseline_rejected:
        out.append(f"co-located rejected: {dict(result.baseline_rejected)}")
    return out + ["try more nodes, ZeRO-2 (--zero-stage 2), full recompute or GPUs with more memory"]


def baseline_name(base: BaselinePlan | None) -> str:
    if base is None:
        return "none fits"
    b = base.candidate
    return f"{b.shape.describe()}, DP {b.replicas}, recompute {b.work.recompute}"
