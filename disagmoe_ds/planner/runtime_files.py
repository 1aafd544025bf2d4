"""What the runtime launches a plan from: a ds_config that ``run_pretrain.py --deepspeed_config FILE`` runs as it
is, and a DeepSpeed hostfile whose order places the ranks; which plan they are for (``launch_choice``: the AF-Pipe
plan, or a co-located one the runtime runs); and what of a plan's variant the runtime refuses."""

from __future__ import annotations

import copy
from collections.abc import Sequence
from typing import Any

from disagmoe_ds.capabilities.rules import LEVERS, Job, fired
from disagmoe_ds.errors import ConfigError
from disagmoe_ds.fp8.shapes import BF16_WIDTH, EXPERT_BF16_WIDTH
from disagmoe_ds.layout import RankRole
from disagmoe_ds.planner.allocator import best_runnable_colocated, colocated_refusal
from disagmoe_ds.planner.colocated import ColocatedCandidate
from disagmoe_ds.planner.pipeline_split import chunk_sizes
from disagmoe_ds.planner.plans import AfPlan, BaselinePlan, PlanRequest, PlanResult
from disagmoe_ds.planner.verdict import baseline_name
from disagmoe_ds.planner.workload import Workload

# Which of "sequence_parallel" and "tensor_parallel" (an A-lane of s x t ranks) the runtime's ``DisagMoEConfig``
# reads. It cannot be imported here (it imports torch); tests/test_planner_ds_config.py holds this to its fields.
RUNTIME_LANE_FIELDS: frozenset[str] = frozenset({"sequence_parallel", "tensor_parallel"})

# The optimizer and schedule of the shipped GPU configs (ds_configs/1node-8gpu-bf16.json; a test holds them equal),
# as the planner has no flags for them: AdamW at peak lr 3e-4 (run_pretrain.py's --lr sets it), 2,000 linear
# warm-up steps, then a cosine decay to 0.1 x lr at run_pretrain.py's --steps (it fills total_num_steps).
TRAINING: dict[str, Any] = {
    "optimizer": {"type": "AdamW", "params": {"lr": 3e-4, "betas": [0.9, 0.95], "eps": 1e-8, "weight_decay": 0.1}},
    "scheduler": {
        "type": "WarmupCosineLR",
        "params": {"warmup_num_steps": 2000, "warmup_min_ratio": 0.0, "warmup_type": "linear", "cos_min_ratio": 0.1},
    },
    "gradient_clipping": 1.0,
}

# --write-mode: which system the written files run (``launch_choice``).
WRITE_MODES = ("auto", "disaggregated", "colocated")


def _refused(job: Job) -> str | None:
    """The levers of ``job`` the runtime refuses beside each other (``capabilities.rules``, the table its preflight
    checks), each as "X beside Y", or None."""
    rules = fired(job)
    return " and ".join(f"{LEVERS[r.beside]} beside {LEVERS[r.lever]}" for r in rules) or None


def lane_refusal(work: Workload) -> str | None:
    """What of the A-lane of ``work`` the runtime does not run yet (None: it runs it): the levers its capabilities
    table refuses beside tensor parallelism."""
    t = work.tensor_parallel
    why = _refused(Job.of(None, tensor_parallel=t, zero3_attention=work.zero_of("attention") == 3,
                          lora=work.lora.enabled))  # fmt: skip
    return None if why is None else f"TP {t} lanes: {why}: pass --tensor-parallel 1 or a variant without it"


def runtime_refusal(work: Workload) -> str | None:
    """What of the variant ``work`` the runtime refuses (None: it runs all of it, at any depth): the levers it turns
    on that the runtime's capabilities table refuses beside each other."""
    return _refused(
        Job.of(
            None,
            **_recompute_levers(work),
            split_backward=work.split_backward,
            offload=any(share > 0 for share in work.offload),
            offload_ffn=work.offload[1] > 0,
            zero3_ffn=work.zero_of("ffn") == 3,
            offload_optimizer=work.ffn_optimizer_on_host,
        )
    )


def _recompute_levers(work: Workload) -> dict[str, bool]:
    """The runtime's recompute levers of ``work``: the per-side key where the sides differ, else the switch (a switch
    sets both sides, and the two may not be combined)."""
    if work.per_side_recompute:
        return {"recompute": True}
    policy = work.recompute_of("attention")
    return {"activation_checkpointing": policy == "full", "selective_recompute": policy == "selective"}


def _recompute_keys(work: Workload) -> dict[str, Any]:
    """The "disagmoe" keys that run ``work``'s recompute: ``"recompute": {"attention", "ffn"}`` where the sides
    differ, else the two switches as before the sides had their own policies."""
    if work.per_side_recompute:
        return {"recompute": {side: work.recompute_of(side) for side in ("attention", "ffn")}}
    return dict(_recompute_levers(work))


def _refusal(candidate: ColocatedCandidate, model_type: str) -> str | None:
    """``allocator.colocated_refusal`` of a candidate's shape and job."""
    return colocated_refusal(candidate.shape, model_type, lora=candidate.work.lora.enabled)


def launch_choice(result: PlanResult, mode: str = "auto") -> tuple[AfPlan | BaselinePlan, str | None]:
    """The plan the files are written for under ``--write-mode mode``, and the line that says why where it is not
    the verdict's. ``auto``: the verdict's system; where that is a co-located layout the runtime does not run
    (``allocator.colocated_refusal``), the faster of the AF-Pipe plan and the best co-located layout it runs.
    ``disaggregated``: the AF-Pipe plan. ``colocated``: the verdict's co-located layout where the runtime runs it,
    else the best one it runs."""
    af, base = result.af, result.baseline
    if mode == "disaggregated" or (mode == "auto" and (result.pays or base is None)):
        if af is None:
            raise ConfigError("no AF-Pipe plan fits, so there is no disaggregated ds_config or hostfile to write")
        return _launchable(af), None
    model_type = result.request.spec.model_type
    if base is not None and _refusal(base.candidate, model_type) is None:
        return base, None
    runnable = best_runnable_colocated(result.request)
    faster = af if runnable is None or (af is not None and af.tokens_per_s > runnable.tokens_per_s) else runnable
    chosen = runnable if mode == "colocated" else faster
    if chosen is None:
        nor = "" if mode == "colocated" else " (nor an AF-Pipe plan)"
        raise ConfigError(f"no co-located EP x DP layout the runtime runs fits memory{nor}: there is no ds_config or "
                          "hostfile to write")  # fmt: skip
    other = af if chosen is runnable else runnable
    return _launchable(chosen), None if base is None else _not_run_line(base, chosen, other, model_type)


def _launchable(chosen: AfPlan | BaselinePlan) -> AfPlan | BaselinePlan:
    """``chosen``, refused where a launch cannot place its ranks: DeepSpeed and torchrun number them node by node in
    hostfile order and the runtime's layout rank is that number, so a spread AF-Pipe placement is not launched."""
    if isinstance(chosen, AfPlan) and chosen.candidate.placement.kind == "spread":
        raise ConfigError(
            "the plan's placement is spread (both sides on every node), which no DeepSpeed or torchrun launch gives: "
            "they number ranks node by node and the runtime's layout rank is that number; plan with --placement "
            "contiguous (or auto, which means contiguous when writing files)"
        )
    return chosen


def _not_run_line(
    base: BaselinePlan, chosen: AfPlan | BaselinePlan, other: AfPlan | BaselinePlan | None, model_type: str
) -> str:
    """One line: the verdict's co-located layout does not run here, what was written instead and the alternative."""
    if other is None:
        beside = "no co-located layout it runs fits" if isinstance(chosen, AfPlan) else "no AF-Pipe plan fits"
    else:
        name = _name(other) if isinstance(other, AfPlan) else f"the best co-located layout it runs, {_ep(other)}"
        beside = f"{name}: {other.step_time_s:.4g} s"
    return (
        f"the verdict's co-located layout ({baseline_name(base)}: {base.step_time_s:.4g} s/step) is not one "
        f"DisagMoE-DS runs ({_refusal(base.candidate, model_type)}; its co-located mode is EP x DP under ZeRO "
        f"in 1F1B pipeline stages, with Ulysses and TP lanes); the files are for {_name(chosen)} "
        f"instead: {chosen.step_time_s:.4g} s/step predicted ({beside})"
    )


def _name(chosen: AfPlan | BaselinePlan) -> str:
    return "the AF-Pipe plan" if isinstance(chosen, AfPlan) else f"co-located {_ep(chosen)}"


def _ep(base: BaselinePlan) -> str:
    shape = base.candidate.shape
    stages = f" x PP {shape.pp}" if shape.pp > 1 else ""
    stages += f" x v {shape.vpp}" if shape.vpp > 1 else ""
    lanes = "".join(f", {name} {n}" for name, n in (("SP", shape.cp), ("TP", shape.tp)) if n > 1)
    return f"EP {shape.ep} x EDP {base.candidate.replicas * shape.tp * shape.cp // shape.ep}{stages}{lanes}"


def written_ds_config(
    result: PlanResult, chosen: AfPlan | BaselinePlan, cluster: str | None = None, ffn_cluster: str | None = None
) -> dict[str, Any]:
    """The ds_config of ``chosen`` (``launch_choice``); ``ffn_cluster``: the expert side's GPU type on a fleet."""
    if isinstance(chosen, AfPlan):
        return ds_config(result, cluster, ffn_cluster)
    return colocated_ds_config(result.request, chosen)


def ds_config(result: PlanResult, cluster: str | None = None, ffn_cluster: str | None = None) -> dict[str, Any]:
    """A ds_config for the AF-Pipe plan whose "disagmoe" section ``run_pretrain.py`` reads as it is: the layout, the
    in-flight cap, the cluster (preset or JSON path) the runtime's schedule costs assume and, where the runtime runs
    it (``runtime_refusal``), the plan's variant: recompute (full: activation checkpointing; sides that differ: the
    per-side ``"recompute"`` key instead of the switches), resend, split backward,
    the offload shares and each side's ZeRO stage. A plan with A-lanes of s x t > 1 ranks raises ``ConfigError``
    while the runtime does not run them (``RUNTIME_LANE_FIELDS``); the degrees it runs go into the section. A LoRA
    plan writes ``"lora": {"rank", "targets"}`` (and ``"train_router": true`` where the plan trains the routers), an
    FP8 plan ``"fp8": true``.

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
    why = lane_refusal(w)
    if why is not None:
        raise ConfigError(f"the runtime does not run the plan's {why}")
    section = {
        "attention_gpus": c.layout.attention_gpus,
        "ffn_gpus": c.layout.ffn_gpus,
        "depth": c.layout.depth,
        "micro_batches": c.micro_batches,
        "expert_data_parallel": c.layout.expert_data_parallel,
        "node_dedup": c.layout.node_dedup,
        "max_in_flight": af.in_flight,
        "cluster": cluster or req.cluster.name,
    }
    section |= {"ffn_cluster": ffn_cluster} if ffn_cluster not in (None, section["cluster"]) else {}
    if runtime_refusal(w) is None:
        section |= _recompute_keys(w) | {
            "resend": w.resend,
            "split_backward": w.split_backward,
            "offload": {"attention": round(w.offload[0], 6), "ffn": round(w.offload[1], 6)},
            "zero_stage": {"attention": w.zero_of("attention"), "ffn": w.zero_of("ffn")},
        }
        section |= {"offload_optimizer": {"ffn": True}} if w.ffn_optimizer_on_host else {}
    section |= {name: degree for name, degree in degrees.items() if degree > 1}
    return _engine_keys(req.work) | {"disagmoe": section | _lora(w) | _fp8(w)}


def colocated_ds_config(req: PlanRequest, base: BaselinePlan) -> dict[str, Any]:
    """A ds_config for a co-located layout the runtime runs (``allocator.colocated_refusal`` None): its "disagmoe"
    section's ``"colocated"`` makes ``run_pretrain.py`` run co-located on the cluster's ranks at the layout's EP
    size."""
    c = base.candidate
    refusal = _refusal(c, req.spec.model_type)
    assert refusal is None, refusal
    placed: dict[str, Any] = {"world_size": req.cluster.world_size, "ep_size": c.shape.ep}
    lanes = {"sequence_parallel": c.shape.cp, "tensor_parallel": c.shape.tp}
    placed |= {name: degree for name, degree in lanes.items() if degree > 1}
    if c.shape.pp > 1:  # the stages and their layers as the plan priced them (Megatron's split)
        sizes = chunk_sizes(req.spec.num_layers, c.shape.pp, c.shape.vpp) or ()
        placed |= {"pp_size": c.shape.pp, "virtual_stages": c.shape.vpp, "stage_layers": list(sizes)}
    section = {"colocated": placed, "micro_batches": c.micro_batches} | _recompute_keys(c.work)
    return _engine_keys(req.work) | {"disagmoe": section | _lora(c.work) | _fp8(c.work)}


def _engine_keys(work: Workload) -> dict[str, Any]:
    """DeepSpeed's keys: the micro-batch, precision, ZeRO stage and the shipped training settings (``TRAINING``).
    Not the batch keys (``gradient_accumulation_steps``, ``train_batch_size``): ``run_pretrain.py`` derives them
    from the section's ``micro_batches``, which ``--micro-batches`` overrides."""
    return {
        "train_micro_batch_size_per_gpu": work.micro_batch_size,
        "bf16": {"enabled": work.precision == "bf16"},
        "zero_optimization": {"stage": work.zero_stage},
        **copy.deepcopy(TRAINING),
    }


def _lora(work: Workload) -> dict[str, Any]:
    """The runtime's LoRA section of a LoRA plan (alpha and dropout stay the runtime's defaults), else nothing."""
    if not work.lora.enabled:
        return {}
    lora: dict[str, Any] = {"rank": work.lora.rank, "targets": list(work.lora.targets)}
    return {"lora": lora | ({"train_router": True} if work.lora.train_router else {})}


def _fp8(work: Workload) -> dict[str, Any]:
    """The runtime's FP8 lever of a plan priced with FP8 (``--fp8``), else nothing."""
    if not work.fp8:
        return {}
    widths = {
        key: width
        for key, width, default in (
            ("fp8_bf16_width", work.fp8_bf16_width, BF16_WIDTH),
            ("fp8_expert_bf16_width", work.fp8_expert_bf16_width, EXPERT_BF16_WIDTH),
        )
        if width != default
    }
    return {"fp8": True} | ({"fp8_cast_per_call": True} if work.fp8_cast_per_call else {}) | widths


def hostfile(result: PlanResult, chosen: AfPlan | BaselinePlan | None = None, gpu_types: Sequence[str] = ()) -> str:
    """DeepSpeed hostfile, one line per node in launch order, for ``chosen`` (default: the AF-Pipe plan). The
    launcher numbers ranks node by node in this order, and the runtime's layout rank is that number: for AF-Pipe
    the nodes holding attention ranks come first (a contiguous placement). ``gpu_types``: each node's GPU type (a
    fleet), written as ``gpu=TYPE`` for ``run_pretrain.py``'s check."""
    gpu = [f" gpu={t}" for t in gpu_types] or [""] * result.request.cluster.nodes
    cl = result.request.cluster
    chosen = chosen or result.af
    assert chosen is not None
    if isinstance(chosen, BaselinePlan):
        ep = chosen.candidate.shape.ep
        lines = [f"# disagmoe-plan: {_name(chosen)}: every rank holds the attention side and 1/{ep} of the "
                 f"experts; an EP group is {ep} consecutive ranks"]  # fmt: skip
        return "\n".join(lines + [f"{cl.host(n)} slots={cl.gpus_per_node}{gpu[n]}" for n in range(cl.nodes)]) + "\n"
    c = chosen.candidate
    m = c.layout.attention_gpus
    lines = [f"# disagmoe-plan: {c.layout.describe()}", f"# placement: {c.placement.describe(m)}"]
    for node in range(cl.nodes):
        ranks = [c.placement.launcher_to_layout_rank(node, k, attention_gpus=m) for k in range(cl.gpus_per_node)]
        roles = ", ".join(_role(c.layout.role_of(r)) for r in ranks)
        lines += [
            f"# {cl.host(node)}: layout ranks {ranks}: {roles}",
            f"{cl.host(node)} slots={cl.gpus_per_node}{gpu[node]}",
        ]
    return "\n".join(lines) + "\n"


def _role(role: RankRole) -> str:
    if role.is_attention:
        return f"A{role.group}.lane{role.index}"
    return f"F{role.group}.ep{role.ep_rank}.edp{role.edp_rank}"
