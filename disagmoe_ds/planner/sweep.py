"""``disagmoe-plan sweep``: where disaggregation pays. For each model, sequence length, node count and per-GPU
cross-node bandwidth, the best AF-Pipe plan over the strongest calibrated co-located baseline, as a JSON and a
PNG (matplotlib), with the measured multi-GPU points of docs/performance.md overlaid where they exist.

    disagmoe-plan sweep --model hf_models/Qwen3-30B-A3B:4 --model hf_models/GPT-OSS-120B:16 --out docs/sweep

Each cell is a preset cluster whose NICs give every GPU the cell's bandwidth one way (``nic_bw`` = bandwidth x
GPUs / NICs per node), planned as ``disagmoe-plan`` would (per-shape compute table, all AF-Pipe variants, the
DeepEP dispatcher for the baseline), with two sequences per GPU and step and the best simulated family of each
variant set (``--simulate-per-variant-set``): both systems are compared per token, so the smaller step changes
the fill of both pipelines alike and keeps a model's sweep under a minute on two idle cores.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, TypedDict

from disagmoe_ds.errors import ConfigError
from disagmoe_ds.planner.allocator import PlanRequest, plan
from disagmoe_ds.planner.cluster import Efficiency, preset
from disagmoe_ds.planner.gemm_efficiency import shape_rates
from disagmoe_ds.planner.inputs import description
from disagmoe_ds.planner.model import load_model_spec
from disagmoe_ds.planner.study import af_summary, baseline_summary
from disagmoe_ds.planner.workload import Workload

GB = 1e9
BANDWIDTHS = (3.0, 6.0, 12.0, 25.0, 50.0, 100.0)  # GB/s per GPU, one way: from socket-class to 8 x 400 Gb/s per node
SEQ_LENS = (4096, 16384)
# Measured AF-Pipe / best co-located throughput (docs/performance.md section 6: 2 H200s, the balanced 8-layer
# Qwen3-30B-A3B, 8 x 4,096 tokens per step, compiled). The link between the two GPUs plays the cross-node link:
# NCCL's socket transport at its measured 3.8 GB/s one way, NVLink at the 280 GB/s the planner's cluster JSON uses.


class MeasuredPoint(TypedDict):
    model: str
    bandwidth_gb_s: float
    speedup: float
    label: str


MEASURED: tuple[MeasuredPoint, ...] = (
    {"model": "Qwen3-30B-A3B", "bandwidth_gb_s": 3.8, "speedup": 1.79, "label": "2 H200, socket (perf. sec. 6)"},
    {"model": "Qwen3-30B-A3B", "bandwidth_gb_s": 280.0, "speedup": 0.73, "label": "2 H200, NVLink (perf. sec. 6)"},
)


@dataclass(frozen=True)
class Cell:
    model: Path
    nodes: int
    seq_len: int
    bandwidth: float  # GB/s per GPU, one way
    cluster: str
    simulate_per_variant_set: int
    sequences_per_gpu: int


def plan_cell(cell: Cell) -> dict[str, Any]:
    """One cell's plan as a JSON-ready row."""
    spec = load_model_spec(cell.model)
    base = preset(cell.cluster, cell.nodes)
    clus = replace(base, nic_bw=cell.bandwidth * GB * base.gpus_per_node / base.nics_per_node)
    req = PlanRequest(
        spec=spec,
        cluster=clus,
        rates=shape_rates(clus, Efficiency(), spec),
        work=Workload(cell.seq_len, 1),
        global_batch=cell.sequences_per_gpu * clus.world_size,
        simulate_per_variant_set=cell.simulate_per_variant_set,
    )
    start = time.perf_counter()
    result = plan(req)
    return {
        "model": spec.name or cell.model.name,
        "nodes": cell.nodes,
        "seq_len": cell.seq_len,
        "bandwidth_gb_s": cell.bandwidth,
        "af_step_s": result.af.step_time_s if result.af else None,
        "baseline_step_s": result.baseline.step_time_s if result.baseline else None,
        "speedup": result.speedup,
        "af_plan": af_summary(result),
        "baseline_plan": baseline_summary(result),
        "seconds": time.perf_counter() - start,
    }


def _model_arg(text: str, nodes: list[int]) -> list[tuple[Path, int]]:
    path, sep, count = text.rpartition(":")
    if sep and count.isdigit():
        return [(Path(path), int(count))]
    return [(Path(text), n) for n in nodes]


def plot(rows: list[dict[str, Any]], path: Path) -> None:
    """One panel per model: AF-Pipe / co-located against bandwidth, a line per (sequence length, nodes)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    models = list(dict.fromkeys(r["model"] for r in rows))
    cols = min(2, len(models))
    grid = -(-len(models) // cols)
    fig, axes = plt.subplots(grid, cols, figsize=(5.2 * cols, 3.8 * grid), squeeze=False, sharey=True)
    for ax in axes.flat[len(models) :]:
        ax.set_visible(False)
    for ax, model in zip(axes.flat, models):
        mine = [r for r in rows if r["model"] == model]
        for seq, nodes in dict.fromkeys((r["seq_len"], r["nodes"]) for r in mine):
            line = [r for r in mine if r["seq_len"] == seq and r["nodes"] == nodes and r["speedup"] is not None]
            ax.plot(
                [r["bandwidth_gb_s"] for r in line],
                [r["speedup"] for r in line],
                marker="o",
                label=f"{seq // 1024}K, {nodes} nodes",
            )
        for m in (m for m in MEASURED if m["model"] == model):
            ax.scatter([m["bandwidth_gb_s"]], [m["speedup"]], marker="*", s=140, color="k", zorder=5)
            right = m["bandwidth_gb_s"] > 100  # label the far-right point on its left, inside the axes
            ax.annotate(
                m["label"],
                (m["bandwidth_gb_s"], m["speedup"]),
                fontsize=7,
                xytext=(-6 if right else 6, 6),
                textcoords="offset points",
                ha="right" if right else "left",
            )
        ax.axhline(1.0, color="grey", lw=0.8)
        ax.axhline(1.05, color="grey", lw=0.8, ls=":")
        ax.set_xscale("log")
        ax.set_title(model, fontsize=10)
        ax.set_xlabel("cross-node GB/s per GPU (one way)")
        ax.legend(fontsize=7)
    for row in axes:
        row[0].set_ylabel("AF-Pipe / best co-located (tokens/s)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="disagmoe-plan sweep", description=description(__doc__))
    p.add_argument("--model", action="append", required=True, help="model directory, optionally DIR:NODES (repeat)")
    p.add_argument("--nodes", default="16", help="comma-separated node counts for models given without :NODES")
    p.add_argument("--seq-len", default=",".join(map(str, SEQ_LENS)), help="comma-separated sequence lengths")
    p.add_argument(
        "--bandwidth", default=",".join(f"{b:g}" for b in BANDWIDTHS), help="comma-separated GB/s per GPU, one way"
    )
    p.add_argument("--cluster", default="h800", help="preset whose GPUs and NVLink the cells use (default h800)")
    p.add_argument(
        "--simulate-per-variant-set", type=int, default=1, help="AF-Pipe families simulated per variant set (default 1)"
    )
    p.add_argument("--sequences-per-gpu", type=int, default=2, help="sequences per GPU and step (default 2)")
    p.add_argument("--workers", type=int, default=os.cpu_count() or 1, help="processes (default: the CPU count)")
    p.add_argument("--out", default="sweep", help="writes OUT.json and OUT.png")
    args = p.parse_args(argv)
    try:
        nodes = [int(n) for n in args.nodes.split(",")]
        seqs = [int(s) for s in args.seq_len.split(",")]
        bands = [float(b) for b in args.bandwidth.split(",")]
    except ValueError as err:
        raise ConfigError(f"sweep: --nodes, --seq-len and --bandwidth take comma-separated numbers ({err})") from err
    models = [m for text in args.model for m in _model_arg(text, nodes)]
    cells = [
        Cell(path, n, s, b, args.cluster, args.simulate_per_variant_set, args.sequences_per_gpu)
        for path, n in models
        for s in seqs
        for b in bands
    ]
    rows: list[dict[str, Any]] = []
    seconds: dict[str, float] = {}
    with ProcessPoolExecutor(max_workers=max(1, args.workers)) as pool:
        for path, n in models:  # one model at a time, so each one's wall time is its own
            start = time.perf_counter()
            mine = [c for c in cells if c.model == path and c.nodes == n]
            # longest first (the longest sequences, then the slowest links), so no worker is left with the tail
            order = sorted(range(len(mine)), key=lambda i: (-mine[i].seq_len, mine[i].bandwidth))
            done = dict(zip(order, pool.map(plan_cell, [mine[i] for i in order])))
            rows += [done[i] for i in range(len(mine))]
            seconds[f"{path.name}:{n}"] = time.perf_counter() - start
            print(
                f"{path.name} at {n} nodes: {len(seqs) * len(bands)} cells in {seconds[f'{path.name}:{n}']:.0f} s",
                flush=True,
            )
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    doc = {"cluster": args.cluster, "rows": rows, "measured": list(MEASURED), "wall_seconds": seconds}
    out.with_suffix(".json").write_text(json.dumps(doc, indent=2) + "\n", encoding="utf-8")
    plot(rows, out.with_suffix(".png"))
    print(f"wrote {out.with_suffix('.json')} and {out.with_suffix('.png')}")
    return 0
