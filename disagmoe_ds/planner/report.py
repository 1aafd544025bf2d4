"""What the planner tells the user: the table with its reasoning, the JSON plan, a ds_config and a hostfile.

The reasoning follows the paper's roofline (paper-notes.md section 5.2): a side's arithmetic intensity
I = FLOPs / NIC bytes against its turning point I_hat = (GPUs x FLOP/s) / (NICs x bytes/s); I > I_hat means
compute-bound. Disaggregation pays when the co-located baseline loses more to exposed all-to-all and
bubbles than AF-Pipe loses to imbalance, bubbles and its own transfers.
"""

from __future__ import annotations

from typing import Any

from disagmoe_ds.errors import ConfigError
from disagmoe_ds.layout import RankRole
from disagmoe_ds.planner.allocator import PAYS_THRESHOLD, AfPlan, BaselinePlan, PlanResult
from disagmoe_ds.planner.attention_lanes import data_lanes
from disagmoe_ds.planner.lora import adapter_params
from disagmoe_ds.planner.memory import Workload
from disagmoe_ds.planner.stages import SideTimes

GB = 1e9


def verdict(result: PlanResult) -> tuple[str, list[str]]:
    """One-line verdict and the reasons behind it."""
    af, base, s = result.af, result.baseline, result.speedup
    if af is None and base is None:
        return "nothing fits: neither AF-Pipe nor co-located EP fits in memory on this cluster", _no_fit(result)
    if af is None:
        return "disaggregation does not fit: use co-located EP (" + _baseline_name(base) + ")", _no_fit(result)
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
        f"disaggregation does not pay ({s:.2f}x): use co-located EP ({_baseline_name(base)})",
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


def _baseline_name(base: BaselinePlan | None) -> str:
    if base is None:
        return "none fits"
    b = base.candidate
    return f"{b.shape.describe()}, DP {b.replicas}, recompute {b.work.recompute}"


def mfu(result: PlanResult, step_s: float, tokens: int) -> float:
    req = result.request
    flops = req.spec.step_flops_per_token(req.work.seq_len) * tokens
    return flops / (step_s * req.cluster.world_size * req.cluster.peak_flops)


def to_json(result: PlanResult) -> dict[str, Any]:
    """The plan as a JSON object (keys of the issue plus detail); null where a system does not fit."""
    req, af, base = result.request, result.af, result.baseline
    head, reasons = verdict(result)
    out: dict[str, Any] = {
        "model": req.spec.name,
        "model_type": req.spec.model_type,
        "seq_len": req.work.seq_len,
        "micro_batch_size": req.work.micro_batch_size,
        "global_batch_size": req.global_batch,
        "cluster": req.cluster.name,
        "nodes": req.cluster.nodes,
        "world_size": req.cluster.world_size,
        "zero_stage": req.work.zero_stage,
        "lora": _lora_json(result),
        "rates": req.rates.source,
        "attention_gpus": None,
        "ffn_gpus": None,
        "attention_nics": None,
        "ffn_nics": None,
        "depth": None,
        "micro_batches": None,
        "step_time_s": None,
        "baseline_step_time_s": base.step_time_s if base else None,
        "baseline_tokens_per_s_per_gpu": base.tokens_per_s / req.cluster.world_size if base else None,
        "baseline_tflops_per_gpu": (
            base.tokens_per_s * req.spec.step_flops_per_token(req.work.seq_len) / req.cluster.world_size / 1e12
            if base
            else None
        ),
        "speedup": result.speedup,
        "pays": result.pays,
        "verdict": head,
        "reasons": reasons,
    }
    if af is not None:
        out.update(_af_json(result, af))
    if base is not None:
        out["baseline"] = _baseline_json(result, base)
    return out


def _lora_json(result: PlanResult) -> dict[str, Any] | None:
    """The LoRA run planned (None: full fine-tuning)."""
    spec, lora = result.request.spec, result.request.work.lora
    if not lora.enabled:
        return None
    return {
        "rank": lora.rank,
        "targets": list(lora.targets),
        "train_router": lora.train_router,
        "adapter_params": adapter_params(spec, lora),
    }


def _af_json(result: PlanResult, af: AfPlan) -> dict[str, Any]:
    c = af.candidate
    return {
        "attention_gpus": c.layout.attention_gpus,
        "ffn_gpus": c.layout.ffn_gpus,
        "attention_nics": c.nics[0],
        "ffn_nics": c.nics[1],
        "depth": c.layout.depth,
        "layers_per_group": c.layout.layers_per_group,
        "lanes": data_lanes(c.layout, c.work),
        "sequence_parallel": c.work.sequence_parallel,
        "tensor_parallel": c.work.tensor_parallel,
        "expert_parallel": c.layout.ep_size,
        "expert_data_parallel": c.layout.expert_data_parallel,
        "micro_batches": c.micro_batches,
        "max_in_flight": af.in_flight,
        "recompute": c.work.recompute,
        "variant": c.work.variant,
        "placement": c.placement.kind,
        "tokens_per_step": c.tokens,
        "step_time_s": af.step_time_s,
        "roofline_step_time_s": c.roofline.bottleneck_s,
        "simulated_step_time_s": af.sim.step_time_s,
        "tokens_per_s": af.tokens_per_s,
        "mfu": mfu(result, af.step_time_s, c.tokens),
        "exposed_sync_s": c.exposed_sync_s,
        "optimizer_step_s": c.optimizer_step_s,
        "attention": _side_json(c.roofline.attention, c.memory_attention.total_at(af.in_flight), c.optimizer_s[0]),
        "ffn": _side_json(c.roofline.ffn, c.memory_ffn.total_at(af.in_flight), c.optimizer_s[1]),
        "compute_fraction": af.sim.compute_fraction,
        "exposed_comm_fraction": af.sim.exposed_comm_fraction,
        "bubble_fraction": af.sim.bubble_fraction,
    }


def _side_json(side: SideTimes, memory: float, optimizer_s: float) -> dict[str, Any]:
    return {
        "compute_s": side.compute_s,
        "network_s": side.network_s,
        "optimizer_s": optimizer_s,
        "bound": side.bound,
        "memory_bytes_per_rank": memory,
    }


def _baseline_json(result: PlanResult, base: BaselinePlan) -> dict[str, Any]:
    b = base.candidate
    return {
        "pipeline_parallel": b.shape.pp,
        "virtual_stages": b.shape.vpp,
        "tensor_parallel": b.shape.tp,
        "context_parallel": b.shape.cp,
        "alltoall_overlap": b.shape.overlap,
        "dispatcher": b.shape.dispatcher,
        "fp32_grads": b.shape.fp32_grads,
        "data_parallel": b.replicas,
        "expert_parallel": b.shape.ep,
        "micro_batches": b.micro_batches,
        "recompute": b.work.recompute,
        "tokens_per_step": b.tokens,
        "step_time_s": base.step_time_s,
        "exposed_sync_s": b.exposed_sync_s,
        "optimizer_step_s": b.optimizer_step_s,
        "tokens_per_s": base.tokens_per_s,
        "mfu": mfu(result, base.step_time_s, b.tokens),
        "memory_bytes_per_rank": b.memory.total,
        "compute_fraction": base.sim.compute_fraction,
        "exposed_comm_fraction": base.sim.exposed_comm_fraction,
        "bubble_fraction": base.sim.bubble_fraction,
        "alltoall_s_per_layer": b.costs.a2a_per_layer_s,
    }


def to_text(result: PlanResult) -> str:
    """The human-readable table and its reasoning."""
    req, af, base = result.request, result.af, result.baseline
    spec, cl = req.spec, req.cluster
    lines = [
        f"model    {spec.name} ({spec.model_type}): {spec.num_layers} layers ({spec.num_moe_layers} MoE), "
        f"{spec.num_experts} experts top-{spec.top_k}, {spec.total_params() / 1e9:.1f}B parameters",
        f"workload seq {req.work.seq_len} x micro-batch {req.work.micro_batch_size} per lane, global batch "
        f"{req.global_batch} sequences, ZeRO-{req.work.zero_stage} {req.work.precision}",
        *_lora_lines(result),
        f"cluster  {cl.nodes} x {cl.gpus_per_node} {cl.name} = {cl.world_size} GPUs, {cl.total_nics} NICs x "
        f"{cl.nic_bw / GB:.3g} GB/s; rates from {req.rates.source}",
        _per_token_line(result),
        "",
    ]
    if af is not None:
        lines += _af_table(result, af)
    if base is not None:
        b, sim = base.candidate, base.sim
        lines += [
            f"co-located EP+DP 1F1B: {_baseline_name(base)}, {b.micro_batches} micro-batches",
            f"  step {base.step_time_s:.3f} s ({base.tokens_per_s:,.0f} tokens/s, MFU "
            f"{mfu(result, base.step_time_s, b.tokens):.1%}); compute {sim.compute_fraction:.0%}, exposed all-to-all "
            f"{sim.exposed_comm_fraction:.0%}, bubble {sim.bubble_fraction:.0%}; {b.memory.total / GB:.1f} GB per rank",
            f"  = simulated {sim.step_time_s:.3f} s + gradient sync {b.exposed_sync_s:.3f} s exposed + optimizer step "
            f"{b.optimizer_step_s:.3f} s",
            "",
        ]
    head, reasons = verdict(result)
    return "\n".join(lines + [f"verdict  {head}"] + [f"  - {r}" for r in reasons]) + "\n"


def _lora_lines(result: PlanResult) -> list[str]:
    """What a LoRA plan trains (nothing for full fine-tuning, whose table is unchanged)."""
    spec, lora = result.request.spec, result.request.work.lora
    if not lora.enabled:
        return []
    adapters = adapter_params(spec, lora)
    return [
        f"training {lora.describe()}: {adapters / 1e6:,.1f}M adapter parameters ({adapters / spec.total_params():.2%} "
        "of the model) keep the training state; the base weights are frozen (parameter bytes only)"
    ]


def _per_token_line(result: PlanResult) -> str:
    req = result.request
    spec, s = req.spec, req.work.seq_len
    layer = spec.moe_layers.index(True)
    a = spec.attention_side_flops(s, layer)
    core = spec.attention_core_flops(s, layer)
    return (
        f"per token, one MoE layer, forward: A side {a / 1e6:,.1f} MFLOP (attention core {core / a:.0%}), "
        f"F side {spec.expert_side_flops(layer) / 1e6:,.1f} MFLOP"
    )


def _af_table(result: PlanResult, af: AfPlan) -> list[str]:
    c = af.candidate
    usable = result.request.rates.usable_hbm
    mem_a, mem_f = c.memory_attention.total_at(af.in_flight), c.memory_ffn.total_at(af.in_flight)
    lay, ra, rf = c.layout, c.roofline.attention, c.roofline.ffn
    rows = [
        ("", "attention (A)", "experts (F)"),
        ("GPUs / NICs", f"{lay.attention_gpus} / {c.nics[0]}", f"{lay.ffn_gpus} / {c.nics[1]}"),
        (
            "groups",
            f"{lay.depth} x {data_lanes(lay, c.work)} lanes of SP {c.work.sequence_parallel} x TP "
            f"{c.work.tensor_parallel}",
            f"{lay.depth} x EP {lay.ep_size} x EDP {lay.expert_data_parallel}",
        ),
        ("compute s/step", f"{ra.compute_s:.3f}", f"{rf.compute_s:.3f}"),
        ("network s/step", f"{ra.network_s:.3f}", f"{rf.network_s:.3f}"),
        ("optimizer s/step", f"{c.optimizer_s[0]:.3f}", f"{c.optimizer_s[1]:.3f}"),
        ("bound", ra.bound, rf.bound),
        ("memory/rank", f"{mem_a / GB:.1f} GB", f"{mem_f / GB:.1f} GB (of {usable / GB:.1f})"),
    ]
    table = [f"  {a:<18}{b:<24}{d}" for a, b, d in rows]
    return [
        "AF-Pipe plan",
        *table,
        f"  depth p={lay.depth} ({lay.layers_per_group} layers per group), {c.micro_batches} micro-batches "
        f"({af.in_flight} in flight), {c.work.variant}",
        f"  placement {c.placement.describe(lay.attention_gpus)}",
        f"  roofline T* {c.roofline.bottleneck_s:.3f} s; simulated step {af.sim.step_time_s:.3f} s; step "
        f"{af.step_time_s:.3f} s with gradient sync {c.exposed_sync_s:.3f} s exposed and optimizer step "
        f"{c.optimizer_step_s:.3f} s -> {af.tokens_per_s:,.0f} tokens/s, MFU "
        f"{mfu(result, af.step_time_s, c.tokens):.1%}",
        "",
    ]


# Which of "sequence_parallel" and "tensor_parallel" (an A-lane of s x t ranks) the runtime's ``DisagMoEConfig``
# reads. It cannot be imported here (it imports torch); tests/test_planner_ds_config.py holds this to its fields.
RUNTIME_LANE_FIELDS: frozenset[str] = frozenset({"sequence_parallel"})


def runtime_refusal(work: Workload) -> str | None:
    """What of the variant ``work`` the runtime refuses (None: it runs all of it, at any depth). The runtime's own
    checks (``DisagMoEConfig``, ``afpipe.build.check_zero_stages``) cannot be imported here (engine imports the
    planner); a test holds the two to the same answers."""
    if work.zero_of("ffn") == 3 and work.offload[1] > 0:
        return "offload on an expert side at ZeRO-3"
    return None


def ds_config(result: PlanResult, cluster: str | None = None) -> dict[str, Any]:
    """A ds_config whose "disagmoe" section ``run_pretrain.py`` reads as it is: the layout, the in-flight cap, the
    cluster (preset or JSON path) the runtime's schedule costs assume and, where the runtime runs it
    (``runtime_refusal``), the plan's variant: recompute (full: activation checkpointing), resend, split backward,
    the offload shares and each side's ZeRO stage. A plan with A-lanes of s x t > 1 ranks raises ``ConfigError``
    while the runtime does not run them (``RUNTIME_LANE_FIELDS``); the degrees it runs go into the section. A LoRA
    plan writes ``"lora": {"rank", "targets"}`` (and ``"train_router": true`` where the plan trains the routers).

    The NIC split and placement are not runtime settings: the hostfile's order places the ranks.
    """
    req, af = result.request, result.af
    assert af is not None
    c, w = af.candidate, af.candidate.work
    degrees = {"sequence_parallel": w.sequence_parallel, "tensor_parallel": w.tensor_parallel}
    not_run = [name for name, degree in degrees.items() if degree > 1 and name not in RUNTIME_LANE_FIELDS]
    if not_run:
        raise ConfigError(
            f"the plan's A-lanes are SP {w.sequence_parallel} x TP {w.tensor_parallel}, but the runtime does not run "
            f"{' or '.join(n.replace('_', ' ') for n in not_run)} yet: pass "
            f"{' '.join('--' + n.replace('_', '-') + ' 1' for n in not_run)} for a plan it runs"
        )
    section = {
        "attention_gpus": c.layout.attention_gpus,
        "ffn_gpus": c.layout.ffn_gpus,
        "depth": c.layout.depth,
        "micro_batches": c.micro_batches,
        "expert_data_parallel": c.layout.expert_data_parallel,
        "max_in_flight": af.in_flight,
        "cluster": cluster or req.cluster.name,
    }
    if runtime_refusal(w) is None:
        section |= {
            "activation_checkpointing": w.recompute == "full",
            "selective_recompute": w.recompute == "selective",
            "resend": w.resend,
            "split_backward": w.split_backward,
            "offload": {"attention": round(w.offload[0], 6), "ffn": round(w.offload[1], 6)},
            "zero_stage": {"attention": w.zero_of("attention"), "ffn": w.zero_of("ffn")},
        }
    section |= {name: degree for name, degree in degrees.items() if degree > 1}
    if w.lora.enabled:  # the runtime's LoRA section; alpha and dropout stay the runtime's defaults
        lora: dict[str, Any] = {"rank": w.lora.rank, "targets": list(w.lora.targets)}
        section["lora"] = lora | ({"train_router": True} if w.lora.train_router else {})
    return {
        "train_micro_batch_size_per_gpu": req.work.micro_batch_size,
        "gradient_accumulation_steps": c.micro_batches,
        "bf16": {"enabled": req.work.precision == "bf16"},
        "zero_optimization": {"stage": req.work.zero_stage},
        "disagmoe": section,
    }


def hostfile(result: PlanResult) -> str:
    """DeepSpeed hostfile, one line per node in launch order: the nodes holding attention ranks come first."""
    req, af = result.request, result.af
    assert af is not None
    c, cl = af.candidate, req.cluster
    m = c.layout.attention_gpus
    lines = [f"# disagmoe-plan: {c.layout.describe()}", f"# placement: {c.placement.describe(m)}"]
    for node in range(cl.nodes):
        ranks = [c.placement.launcher_to_layout_rank(node, k, attention_gpus=m) for k in range(cl.gpus_per_node)]
        roles = ", ".join(_role(c.layout.role_of(r)) for r in ranks)
        lines += [f"# {cl.host(node)}: layout ranks {ranks}: {roles}", f"{cl.host(node)} slots={cl.gpus_per_node}"]
    return "\n".join(lines) + "\n"


def _role(role: RankRole) -> str:
    if role.is_attention:
        return f"A{role.group}.lane{role.index}"
    return f"F{role.group}.ep{role.ep_rank}.edp{role.edp_rank}"
