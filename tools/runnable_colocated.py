"""How close the co-located layouts DisagMoE-DS runs come to the strongest practice, cell by cell of the planner's
study (docs/planner.md section 15): per model, nodes and sequence length, the strongest co-located configuration
(``allocator.best_baseline``: Megatron-Core's layouts, TP/CP/EP/PP/VPP, calibrated), the best one the runtime runs
(``allocator.best_runnable_colocated``: PP, virtual stages, EP inside a stage, TP and Ulysses lanes, recompute; no ring
CP) and the best it ran as plain EP x DP (no stages, no recompute), with their predicted step times. Pure Python,
about 5 minutes.

    python tools/runnable_colocated.py [--models Qwen3-30B-A3B,DeepSeek-V3]
"""

from __future__ import annotations

import argparse
from dataclasses import replace
from pathlib import Path

from disagmoe_ds.planner.allocator import best_baseline, best_runnable_colocated
from disagmoe_ds.planner.colocated import divisors
from disagmoe_ds.planner.colocated_costs import Shape
from disagmoe_ds.planner.plans import BaselinePlan, PlanRequest
from disagmoe_ds.planner.study import ISSUE_16_GRID, SEQ_LENS, Cell, cell_request

ROOT = Path(__file__).resolve().parents[1]


def plain_ep_dp(req: PlanRequest) -> BaselinePlan | None:
    """The best EP x DP layout without stages or recompute (what the co-located mode ran before its pipeline)."""
    eps = [e for e in divisors(req.spec.num_experts) if req.cluster.world_size % e == 0]
    shapes = [Shape(pp=1, vpp=1, tp=1, cp=1, ep=e, overlap="partial", dispatcher="alltoall") for e in eps]
    plans = [best_baseline(replace(req, baseline_layout=s, baseline_recompute="none"))[0] for s in shapes]
    return max((p for p in plans if p is not None), key=lambda p: p.tokens_per_s, default=None)


def describe(plan: BaselinePlan | None, strongest: BaselinePlan | None) -> str:
    if plan is None:
        return "does not fit"
    s, recompute = plan.candidate.shape, plan.candidate.work.recompute
    ratio = f", {strongest.step_time_s / plan.step_time_s:.2f}x" if strongest is not None else ""
    return f"{plan.step_time_s:.3g} s (TP {s.tp} {s.context} EP {s.ep} PP {s.pp} x v {s.vpp}, {recompute}{ratio})"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--models", default="", help="comma-separated model directory names (default: the study's)")
    a = p.parse_args()
    wanted = {m for m in a.models.split(",") if m}
    cells = [Cell(m, n, s) for m, n in ISSUE_16_GRID if not wanted or m in wanted for s in SEQ_LENS]
    print("| model | nodes | seq | strongest practice | runs now (vs strongest) | plain EP x DP (vs strongest) |")
    print("|---|---|---|---|---|---|")
    for cell in cells:
        req = cell_request(cell, ROOT / "hf_models")
        strongest, _ = best_baseline(req)
        now, before = best_runnable_colocated(req), plain_ep_dp(req)
        print(
            f"| {cell.model} | {cell.nodes} | {cell.seq_len // 1024}K | {describe(strongest, None)} | "
            f"{describe(now, strongest)} | {describe(before, strongest)} |",
            flush=True,
        )


if __name__ == "__main__":
    main()
