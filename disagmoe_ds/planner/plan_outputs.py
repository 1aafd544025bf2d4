"""What ``disagmoe-plan`` writes beside the plan it prints: the ds_config (``--write-ds-config``) and the hostfile
(``--write-hostfile``) the runtime launches the chosen system from (their content: ``runtime_files.py``), and the
predicted timelines (``--timeline``). Each file written is told in one note line."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from disagmoe_ds.errors import DisagMoEError
from disagmoe_ds.planner.plans import AfPlan, BaselinePlan, PlanResult
from disagmoe_ds.planner.runtime_files import hostfile, launch_choice, runtime_refusal, written_ds_config
from disagmoe_ds.planner.simulate import simulate_af, simulate_baseline, write_timeline
from disagmoe_ds.planner.task_costs import af_task_costs


def writes_launch(args: argparse.Namespace) -> bool:
    """Whether the command line asks for launch files (then only contiguous placements are planned)."""
    return bool(args.write_ds_config or args.write_hostfile)


def write_outputs(args: argparse.Namespace, result: PlanResult) -> list[str]:
    """Write the files the command line asks for from ``result``; the notes that tell what was written."""
    notes = []
    if args.timeline and result.af is None:
        raise DisagMoEError("no AF-Pipe plan fits, so there is no timeline to draw")
    if writes_launch(args):
        chosen, why = launch_choice(result, args.write_mode)
        notes += [f"note: {why}"] if why else []
        if args.write_ds_config:
            notes += _write_ds_config(args, result, chosen)
        if args.write_hostfile:
            Path(args.write_hostfile).write_text(hostfile(result, chosen), encoding="utf-8")
            notes.append(f"wrote hostfile {args.write_hostfile}")
    if args.timeline:
        notes += _write_timelines(result, Path(args.timeline))
    return notes


def _write_ds_config(args: argparse.Namespace, result: PlanResult, chosen: AfPlan | BaselinePlan) -> list[str]:
    cluster = str(Path(args.cluster).resolve()) if Path(args.cluster).is_file() else args.cluster
    text = json.dumps(written_ds_config(result, chosen, cluster=cluster), indent=2) + "\n"
    Path(args.write_ds_config).write_text(text, encoding="utf-8")
    notes = [f"wrote ds_config {args.write_ds_config} ({'AF-Pipe' if isinstance(chosen, AfPlan) else 'co-located'})"]
    work = chosen.candidate.work
    refusal = runtime_refusal(work) if isinstance(chosen, AfPlan) else None
    if refusal is not None:
        notes.append(
            f"note: the plan's variant ({work.variant}) is simulated only: the runtime does not run "
            f"{refusal} yet, so the ds_config carries the layout alone (plan with --variants paper to match)"
        )
    return notes


def _write_timelines(result: PlanResult, path: Path) -> list[str]:
    req, af = result.request, result.af
    assert af is not None
    c = af.candidate
    costs = af_task_costs(req.spec, c.layout, c.work, placement=c.placement, rates=req.rates, nics=c.nics)
    sim = simulate_af(
        req.spec, c.layout, costs, micro_batches=c.micro_batches, max_in_flight=af.in_flight, exposed_comm=False
    )
    lay = c.layout
    title = (
        f"AF-Pipe {req.spec.name} seq {req.work.seq_len}: M={lay.attention_gpus} N={lay.ffn_gpus} p={lay.depth}, "
        f"{c.micro_batches} micro-batches, {af.in_flight} in flight"
    )
    write_timeline(sim.events, path, title=title)
    notes = [f"wrote AF-Pipe timeline {path}"]
    if result.baseline is not None:
        b = result.baseline.candidate
        base_path = path.with_name(f"{path.stem}-baseline{path.suffix}")
        base = simulate_baseline(b.costs, pp=b.shape.pp, vpp=b.shape.vpp, micro_batches=b.micro_batches)
        drawn = " (drawn as plain 1F1B, without the fused pairs)" if b.shape.overlap == "paired" else ""
        write_timeline(base.events, base_path, title=f"co-located {req.spec.name}: {b.shape.describe()}{drawn}")
        notes.append(f"wrote baseline timeline {base_path}")
    return notes
