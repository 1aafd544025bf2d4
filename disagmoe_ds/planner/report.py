"""What the planner tells the user: the plan's table, the co-located baseline and the verdict with its reasons
(``verdict.py``). The JSON plan is ``plan_json.py``'s, the ds_config and hostfile ``runtime_files.py``'s."""

from __future__ import annotations

from disagmoe_ds.fp8.shapes import harmonic_width
from disagmoe_ds.planner.attention_lanes import data_lanes
from disagmoe_ds.planner.fp8_costs import experts_in_fp8
from disagmoe_ds.planner.lora import adapter_params
from disagmoe_ds.planner.model import ModelSpec
from disagmoe_ds.planner.plans import AfPlan, PlanResult
from disagmoe_ds.planner.verdict import baseline_name, verdict
from disagmoe_ds.planner.workload import Workload

GB = 1e9


def _fp8_text(spec: ModelSpec, work: Workload) -> str:
    """What ``--fp8`` puts in FP8 on this model, for the workload line (the runtime's shape rules)."""
    if not work.fp8:
        return ""
    if experts_in_fp8(spec, work):
        return ", FP8 GEMMs and token dispatch (--fp8)"
    width = f"harmonic width {harmonic_width(spec.hidden_size, spec.expert_intermediate):,.0f}"
    width += f" <= {work.fp8_expert_bf16_width:,}"
    return f", FP8 token dispatch and wide projections (--fp8; the experts' GEMMs stay bf16: {width})"


def to_text(result: PlanResult) -> str:
    """The human-readable table and its reasoning."""
    req, af, base = result.request, result.af, result.baseline
    spec, cl = req.spec, req.cluster
    lines = [
        f"model    {spec.name} ({spec.model_type}): {spec.num_layers} layers ({spec.num_moe_layers} MoE), "
        f"{spec.num_experts} experts top-{spec.top_k}, {spec.total_params() / 1e9:.1f}B parameters",
        f"workload seq {req.work.seq_len} x micro-batch {req.work.micro_batch_size} per lane, global batch "
        f"{req.global_batch} sequences, ZeRO-{req.work.zero_stage} {req.work.precision}{_fp8_text(spec, req.work)}",
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
            f"co-located EP+DP 1F1B: {baseline_name(base)}, {b.micro_batches} micro-batches",
            f"  step {base.step_time_s:.3f} s ({base.tokens_per_s:,.0f} tokens/s, MFU "
            f"{result.mfu(base.step_time_s, b.tokens):.1%}); compute {sim.compute_fraction:.0%}, exposed all-to-all "
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
            f"{lay.depth} x EP {lay.ep_size} x EDP {lay.expert_data_parallel}"
            + (f", a message per node of {lay.node_dedup}" if lay.node_dedup > 1 else ""),
        ),
        ("compute s/step", f"{ra.compute_s:.3f}", f"{rf.compute_s:.3f}"),
        ("network s/step", f"{ra.network_s:.3f}", f"{rf.network_s:.3f}"),
        ("optimizer s/step", f"{c.optimizer_s[0]:.3f}", f"{c.optimizer_s[1]:.3f}"),
        ("bound", ra.bound, rf.bound),
        ("memory/rank", f"{mem_a / GB:.1f} GB", f"{mem_f / GB:.1f} GB (of {usable / GB:.1f})"),
    ]
    width = max(24, 2 + max(len(b) for _, b, _ in rows))  # A-lanes of SP x TP can outgrow the column
    table = [f"  {a:<18}{b:<{width}}{d}" for a, b, d in rows]
    return [
        "AF-Pipe plan",
        *table,
        f"  depth p={lay.depth} ({lay.layers_per_group} layers per group), {c.micro_batches} micro-batches "
        f"({af.in_flight} in flight), {c.work.variant}",
        f"  placement {c.placement.describe(lay.attention_gpus)}",
        f"  roofline T* {c.roofline.bottleneck_s:.3f} s; simulated step {af.sim.step_time_s:.3f} s; step "
        f"{af.step_time_s:.3f} s with gradient sync {c.exposed_sync_s:.3f} s exposed and optimizer step "
        f"{c.optimizer_step_s:.3f} s -> {af.tokens_per_s:,.0f} tokens/s, MFU "
        f"{result.mfu(af.step_time_s, c.tokens):.1%}",
        "",
    ]
