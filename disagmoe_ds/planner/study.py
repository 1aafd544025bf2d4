"""``disagmoe-plan study``: best AF-Pipe variant against the strongest co-located baseline over a grid of
models, cluster sizes and sequence lengths, as a Markdown table with the numbers behind each result
(pure Python). ``--ablate`` adds, per cell, the paper's AF-Pipe and each variant switched on alone.

Every cell runs ``allocator.plan`` with the same defaults as a plain ``disagmoe-plan`` call (the per-shape
compute table of ``gemm_efficiency``, the calibrated co-located baseline, ZeRO-1 bf16, one sequence per
micro-batch, 8 x GPUs sequences per step).
"""

from __future__ import annotations

import argparse
from collections import Counter
from collections.abc import Iterator
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass, replace
from pathlib import Path

from disagmoe_ds.planner.allocator import BaselinePlan, PlanRequest, PlanResult, best_af, best_baseline, plan
from disagmoe_ds.planner.attention_lanes import DEGREES
from disagmoe_ds.planner.cluster import Efficiency, preset
from disagmoe_ds.planner.fp8_costs import fastest_speedup
from disagmoe_ds.planner.gemm_efficiency import shape_rates
from disagmoe_ds.planner.inputs import description
from disagmoe_ds.planner.model import load_model_spec
from disagmoe_ds.planner.variants import PAPER, VARIANTS
from disagmoe_ds.planner.workload import Workload

GB = 1e9
# The grid of issue 16: (model directory under hf_models/, nodes of 8 x H800).
ISSUE_16_GRID = (
    ("Qwen3-30B-A3B", 4),
    ("Qwen3-235B-A22B", 16),
    ("DeepSeek-V3", 32),
    ("DeepSeek-V3", 64),
)
SEQ_LENS = (4096, 16384, 32768)
Lanes = tuple[tuple[int, ...], tuple[int, ...]]  # the (s, t) degrees searched


@dataclass(frozen=True)
class Cell:
    model: str
    nodes: int
    seq_len: int


def cell_request(
    cell: Cell,
    models: Path,
    cluster: str = "h800",
    per_variant_set: int = 2,
    lanes: Lanes = (DEGREES, DEGREES),
    fp8: bool = False,
) -> PlanRequest:
    """The cell's request; ``lanes``: the A-lane degrees (s, t) to search (``attention_lanes.py``); ``fp8``: both
    systems with the FP8 lever (``fp8_costs.py``)."""
    spec = load_model_spec(models / cell.model)
    clus = preset(cluster, cell.nodes)
    return PlanRequest(
        spec=spec,
        cluster=clus,
        rates=shape_rates(clus, Efficiency(), spec),
        work=Workload(cell.seq_len, 1, fp8=fp8),
        global_batch=8 * clus.world_size,
        simulate_per_variant_set=per_variant_set,
        sequence_parallel=lanes[0],
        tensor_parallel=lanes[1],
    )


def af_summary(result: PlanResult) -> str:
    """The AF-Pipe plan in one cell: split, depth, variant, step and where its time goes."""
    af = result.af
    if af is None:
        return _nothing_fits(result.rejected)
    c, sim = af.candidate, af.sim
    mem_a, mem_f = c.memory_attention.total_at(af.in_flight), c.memory_ffn.total_at(af.in_flight)
    return (
        f"{c.layout.attention_gpus}:{c.layout.ffn_gpus} p={c.layout.depth} EP{c.layout.ep_size}xEDP"
        f"{c.layout.expert_data_parallel}, {af.in_flight}/{c.micro_batches} in flight, {c.work.variant}: "
        f"{af.step_time_s:.2f} s; compute {sim.compute_fraction:.0%} / wait {sim.exposed_comm_fraction:.0%} / "
        f"bubble {sim.bubble_fraction:.0%}; {mem_a / GB:.0f}/{mem_f / GB:.0f} GB"
    )


def baseline_summary(result: PlanResult) -> str:
    base = result.baseline
    if base is None:
        return _nothing_fits(result.baseline_rejected)
    b, sim = base.candidate, base.sim
    return (
        f"{b.shape.describe()}, recompute {b.work.recompute}: {base.step_time_s:.2f} s; compute "
        f"{sim.compute_fraction:.0%} / a2a {sim.exposed_comm_fraction:.0%} / bubble {sim.bubble_fraction:.0%}; "
        f"{b.memory.total / GB:.0f} GB"
    )


def _nothing_fits(rejected: Counter) -> str:
    """A cell without a plan, with the commonest reason its candidates were rejected."""
    top = rejected.most_common(1)
    return f"nothing fits ({top[0][0]})" if top else "nothing fits"


def af_ceiling(result: PlanResult) -> float | None:
    """The most any AF-Pipe schedule could gain over the co-located plan: its step against the same tokens'
    model FLOPs (3x forward, no recompute) computed by every GPU all the time at the planner's rate.

    Both systems run the same FLOPs at the same per-FLOP rates, so a ratio above this is impossible."""
    base = result.baseline
    if base is None:
        return None
    req = result.request
    flops = base.candidate.tokens * req.spec.step_flops_per_token(req.work.seq_len)
    per_flop = req.rates.attention_fwd.per_flop / (fastest_speedup() if req.work.fp8 else 1)  # FP8: its fastest GEMM
    ideal = flops * per_flop / req.cluster.world_size
    return base.step_time_s / ideal


def reason(result: PlanResult) -> str:
    """Why the ratio is what it is, from the plan's own numbers."""
    af, base = result.af, result.baseline
    if af is None:
        ceiling = af_ceiling(result)
        return "AF-Pipe does not fit memory" + (f"; ceiling {ceiling:.2f}x" if ceiling else "; nor does co-located")
    roof = af.candidate.roofline
    sides = []
    for name, side in (("A", roof.attention), ("F", roof.ffn)):
        link = "PCIe" if side.pcie_s >= max(side.nic_s, side.nvlink_s) and side.pcie_s else "net"
        sides.append(f"{name} compute {side.compute_s:.1f} s / {link} {side.network_s:.1f} s")
    text = f"AF T* {roof.bottleneck_s:.1f} s ({'; '.join(sides)})"
    if base is None:
        return text + "; co-located does not fit"
    ceiling = af_ceiling(result)
    return (
        text + f"; co-located computes {base.sim.compute_fraction:.0%} of its {base.step_time_s:.1f} s, so no "
        f"AF-Pipe schedule can beat it by more than {ceiling:.2f}x"
    )


def table_row(
    cell: Cell, models: Path, per_variant_set: int = 2, lanes: Lanes = (DEGREES, DEGREES), fp8: bool = False
) -> str:
    result = plan(cell_request(cell, models, per_variant_set=per_variant_set, lanes=lanes, fp8=fp8))
    ratio = f"{result.speedup:.2f}x" if result.speedup is not None else "-"
    return (
        f"| {cell.model} | {cell.nodes} | {cell.seq_len // 1024}K | {af_summary(result)} | "
        f"{baseline_summary(result)} | {ratio} | {reason(result)} |"
    )


def table_rows(
    cells: list[Cell],
    models: Path,
    per_variant_set: int = 2,
    workers: int = 1,
    lanes: Lanes = (DEGREES, DEGREES),
    fp8: bool = False,
) -> Iterator[str]:
    """The Markdown table, one row per cell in grid order (``workers`` processes plan cells side by side)."""
    yield "| model | nodes | seq | best AF-Pipe | strongest co-located | AF / co-located | reason |"
    yield "|---|---|---|---|---|---|---|"
    if workers <= 1:
        yield from (table_row(cell, models, per_variant_set, lanes, fp8) for cell in cells)
        return
    n = len(cells)
    with ProcessPoolExecutor(max_workers=workers) as pool:
        yield from pool.map(table_row, cells, [models] * n, [per_variant_set] * n, [lanes] * n, [fp8] * n)


BASELINES = (  # (column, the request's co-located search): the three baselines a study row sets side by side
    ("strongest practice", {"baseline": "strongest"}),
    ("DeepSpeed-reachable", {"baseline": "deepspeed"}),
    ("the paper's EP 16", {"baseline": "ep", "baseline_ep": 16}),
)


def baselines_row(
    cell: Cell, models: Path, per_variant_set: int = 2, lanes: Lanes = (DEGREES, DEGREES), fp8: bool = False
) -> str:
    """AF-Pipe's best plan and its step against each of ``BASELINES`` (a step each, and AF-Pipe's speedup)."""
    req = cell_request(cell, models, per_variant_set=per_variant_set, lanes=lanes, fp8=fp8)
    af, _ = best_af(req)
    steps, ratios = [], []
    for _, options in BASELINES:
        base, _ = best_baseline(replace(req, **options))
        steps.append(_baseline_step(base))
        ratios.append(f"{af.tokens_per_s / base.tokens_per_s:.2f}x" if af and base else "-")
    af_step = f"{af.step_time_s:.2f} s" if af else "does not fit"
    return f"| {cell.model} | {cell.nodes} | {cell.seq_len // 1024}K | {af_step} | " + " | ".join(steps + ratios) + " |"


def _baseline_step(base: BaselinePlan | None) -> str:
    """A baseline's shape, recompute policy, ZeRO stage and step (its stage: DeepSpeed's ZeRO-2 reduces every
    micro-batch)."""
    if base is None:
        return "does not fit"
    c = base.candidate
    return f"{c.shape.describe()}, recompute {c.work.recompute}, ZeRO {c.work.zero_stage}: {base.step_time_s:.2f} s"


def baselines_rows(
    cells: list[Cell], models: Path, per_variant_set: int, workers: int, lanes: Lanes, fp8: bool
) -> Iterator[str]:
    """The three-baseline table, one row per cell (``workers`` processes side by side)."""
    names = [name for name, _ in BASELINES]
    yield "| model | nodes | seq | AF-Pipe | " + " | ".join(names + [f"AF / {n}" for n in names]) + " |"
    yield "|---|---|---|---|" + "---|" * 2 * len(names)
    n = len(cells)
    args = (cells, [models] * n, [per_variant_set] * n, [lanes] * n, [fp8] * n)
    if workers <= 1:
        yield from map(baselines_row, *args)
        return
    with ProcessPoolExecutor(max_workers=workers) as pool:
        yield from pool.map(baselines_row, *args)


def ablation_rows(cells: list[Cell], models: Path) -> Iterator[str]:
    """Per cell: the paper's AF-Pipe, each variant alone, and all of them, against the strongest baseline."""
    yield "| model | nodes | seq | AF-Pipe variants | AF step (s) | AF / co-located | plan |"
    yield "|---|---|---|---|---|---|---|"
    sets = [("paper (recompute none/full)", PAPER)] + [(f"+ {v}", frozenset({v})) for v in VARIANTS]
    sets.append(("all", frozenset(VARIANTS)))
    for cell in cells:
        req = cell_request(cell, models)
        base, base_rejected = best_baseline(req)
        for label, allowed in sets:
            sub = replace(req, af_variants=allowed)
            af, rejected = best_af(sub)
            result = PlanResult(sub, af, base, rejected, base_rejected)
            step = f"{af.step_time_s:.2f}" if af else "-"
            ratio = f"{result.speedup:.2f}x" if result.speedup is not None else "-"
            yield (
                f"| {cell.model} | {cell.nodes} | {cell.seq_len // 1024}K | {label} | {step} | {ratio} | "
                f"{af_summary(result)} |"
            )


def main(argv: list[str]) -> int:
    """``disagmoe-plan study``: print the tables (Markdown) for docs/planner.md."""
    p = argparse.ArgumentParser(prog="disagmoe-plan study", description=description(__doc__))
    p.add_argument("--hf-models", default="hf_models", help="directory holding the model config directories")
    p.add_argument("--models", default="", help="comma-separated subset of the grid's models (default: all)")
    p.add_argument("--seq-len", default=",".join(map(str, SEQ_LENS)), help="comma-separated sequence lengths")
    p.add_argument("--ablate", action="store_true", help="per cell, each AF-Pipe variant alone (slower)")
    p.add_argument(
        "--baselines",
        action="store_true",
        help="AF-Pipe against three co-located baselines side by side: the strongest practice, what DeepSpeed runs "
        "on an HF MoE model (AutoEP x ZeRO, Ulysses, AutoTP; no pipeline), and the paper's EP 16",
    )
    p.add_argument(
        "--simulate-per-variant-set", type=int, default=2, help="AF-Pipe families simulated per variant set (default 2)"
    )
    p.add_argument("--workers", type=int, default=1, help="processes planning cells side by side (default 1)")
    p.add_argument("--fp8", action="store_true", help="both systems with the FP8 lever (disagmoe-plan --fp8)")
    for flag in ("--sequence-parallel", "--tensor-parallel"):
        p.add_argument(flag, default=",".join(map(str, DEGREES)), help="comma-separated A-lane degrees to search")
    args = p.parse_args(argv)
    lanes = (_degrees(args.sequence_parallel), _degrees(args.tensor_parallel))
    seqs = tuple(int(x) for x in args.seq_len.split(","))
    cells = [c for c in grid([m for m in args.models.split(",") if m]) if c.seq_len in seqs]
    models = Path(args.hf_models)
    if args.ablate:
        rows = ablation_rows(cells, models)
    elif args.baselines:
        rows = baselines_rows(cells, models, args.simulate_per_variant_set, args.workers, lanes, args.fp8)
    else:
        rows = table_rows(cells, models, args.simulate_per_variant_set, args.workers, lanes, args.fp8)
    for row in rows:
        print(row, flush=True)
    return 0


def _degrees(text: str) -> tuple[int, ...]:
    return tuple(int(x) for x in text.split(",") if x)


def grid(models: list[str] | None = None) -> list[Cell]:
    return [Cell(m, n, s) for m, n in ISSUE_16_GRID if not models or m in models for s in SEQ_LENS]
