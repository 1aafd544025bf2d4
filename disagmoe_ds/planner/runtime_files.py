"""What the runtime launches a plan from: a ds_config whose "disagmoe" section ``run_pretrain.py`` reads, and a
DeepSpeed hostfile whose order places the ranks; and what of a plan's variant the runtime refuses."""

from __future__ import annotations

from typing import Any

from disagmoe_ds.errors import ConfigError
from disagmoe_ds.layout import RankRole
from disagmoe_ds.planner.plans import PlanResult
from disagmoe_ds.planner.workload import Workload

# Which of "sequence_parallel" and "tensor_parallel" (an A-lane of s x t ranks) the runtime's ``DisagMoEConfig``
# reads. It cannot be imported here (it imports torch); tests/test_planner_ds_config.py holds this to its fields.
RUNTIME_LANE_FIELDS: frozenset[str] = frozenset({"sequence_parallel", "tensor_parallel"})


def lane_refusal(work: Workload) -> str | None:
    """What of the A-lane of ``work`` the runtime does not run yet (None: it runs it): the levers
    ``afpipe.build.Disaggregated`` refuses beside tensor parallelism (the planner cannot import it)."""
    t = work.tensor_parallel
    if t == 1:
        return None
    levers = {
        "ZeRO 3 on the attention side": work.zero_of("attention") == 3,
        "LoRA": work.lora.enabled,
    }
    chosen = [name for name, on in levers.items() if on]
    if chosen:
        return f"TP {t} lanes with {' and '.join(chosen)}: pass --tensor-parallel 1 or a variant without it"
    return None


def runtime_refusal(work: Workload) -> str | None:
    """What of the variant ``work`` the runtime refuses (None: it runs all of it, at any depth). The runtime's own
    checks (``DisagMoEConfig``, ``afpipe.build.check_zero_stages``) cannot be imported here (afpipe imports the
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
    why = lane_refusal(w)
    if why is not None:
        raise ConfigError(f"the runtime does not run the plan's {why}")
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
