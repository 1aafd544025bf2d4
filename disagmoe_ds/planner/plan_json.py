"""The plan as a JSON object (``disagmoe-plan --json``): the issue's keys plus detail, null where a system does
not fit."""

from __future__ import annotations

from typing import Any

from disagmoe_ds.planner.attention_lanes import data_lanes
from disagmoe_ds.planner.lora import adapter_params
from disagmoe_ds.planner.plans import SIDES, AfCandidate, AfPlan, BaselinePlan, PlanResult
from disagmoe_ds.planner.stages import SideTimes
from disagmoe_ds.planner.verdict import verdict


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
        "fp8": req.work.fp8,
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
        "node_dedup": c.layout.node_dedup,
        "micro_batches": c.micro_batches,
        "max_in_flight": af.in_flight,
        "recompute": "per side" if c.work.per_side_recompute else c.work.recompute_name,  # each in "attention", "ffn"
        "variant": c.work.variant,
        "placement": c.placement.kind,
        "tokens_per_step": c.tokens,
        "step_time_s": af.step_time_s,
        "roofline_step_time_s": c.roofline.bottleneck_s,
        "simulated_step_time_s": af.sim.step_time_s,
        "tokens_per_s": af.tokens_per_s,
        "mfu": result.mfu(af.step_time_s, c.tokens),
        "exposed_sync_s": c.exposed_sync_s,
        "optimizer_step_s": c.optimizer_step_s,
        "attention": _side_json(c, "attention", c.roofline.attention, c.memory_attention.total_at(af.in_flight)),
        "ffn": _side_json(c, "ffn", c.roofline.ffn, c.memory_ffn.total_at(af.in_flight)),
        "compute_fraction": af.sim.compute_fraction,
        "exposed_comm_fraction": af.sim.exposed_comm_fraction,
        "bubble_fraction": af.sim.bubble_fraction,
    }


def _side_json(c: AfCandidate, name: str, side: SideTimes, memory: float) -> dict[str, Any]:
    return {
        "recompute": c.work.recompute_of(name),
        "compute_s": side.compute_s,
        "network_s": side.network_s,
        "optimizer_s": c.optimizer_s[SIDES.index(name)],
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
        "mfu": result.mfu(base.step_time_s, b.tokens),
        "memory_bytes_per_rank": b.memory.total,
        "compute_fraction": base.sim.compute_fraction,
        "exposed_comm_fraction": base.sim.exposed_comm_fraction,
        "bubble_fraction": base.sim.bubble_fraction,
        "alltoall_s_per_layer": b.costs.a2a_per_layer_s,
    }
