"""A fleet of two GPU types: the attention side on one type's nodes, the experts on the other's, each side
priced on its own hardware, against the best homogeneous use of the same fleet (pure Python).

Disaggregation can give each part of a layer the GPU that suits it: attention (compute-bound, little state) on the
newest GPUs, the experts (most of the parameters and their optimizer state) on older GPUs with memory to spare, as
HeterMoE does. A co-located job has no such choice: every rank holds both parts, so on a mixed fleet each stage and
EP rank runs at the slower GPU's pace and fits in the smaller memory.

The AF-Pipe plan takes the fleet's split, M = the attention type's GPUs and N = the expert type's, placed
contiguously with the attention nodes first (the order ``run_pretrain.py`` places ranks in, so the hostfile lists
the attention type's hosts first), and searches everything else as for one cluster, with each side's compute,
memory, optimizer step and links from its own hardware (``Rates.side``; the A->F transfers at the slower end's
NICs). Its alternatives, the homogeneous uses of the same fleet, are the strongest co-located job on the whole fleet
at the weaker type's rates and memory (``weakest``), and on each type's nodes alone; the verdict compares AF-Pipe's
tokens/s with the best of them. Both node types must have the same GPUs and NICs per node.

    disagmoe-plan fleet --model hf_models/DeepSeek-V3 --seq-len 4096 \\
        --attention-cluster h200 --attention-nodes 8 --ffn-cluster a100 --ffn-nodes 8
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import dataclass, replace
from pathlib import Path

from disagmoe_ds.errors import ConfigError
from disagmoe_ds.planner.allocator import best_af, best_baseline
from disagmoe_ds.planner.cluster import PRESETS, Cluster, Efficiency, load_cluster
from disagmoe_ds.planner.gemm_efficiency import shape_rates
from disagmoe_ds.planner.inputs import description
from disagmoe_ds.planner.model import load_model_spec
from disagmoe_ds.planner.plans import PAYS_THRESHOLD, BaselinePlan, PlanRequest, PlanResult
from disagmoe_ds.planner.runtime_files import hostfile, written_ds_config
from disagmoe_ds.planner.study import af_summary, baseline_summary
from disagmoe_ds.planner.workload import Workload

# what a node of each type must share for one placement to hold both
_SAME_PER_NODE = ("gpus_per_node", "nics_per_node")
# the hardware fields the whole fleet, run as one homogeneous cluster, gets at its weaker type's value
_WEAKEST = ("peak_flops", "hbm_bytes", "nvlink_bw", "nic_bw", "pcie_bw", "host_bytes", "host_mem_bw", "hbm_bw")


@dataclass(frozen=True)
class Fleet:
    """The attention type's nodes and the expert type's nodes."""

    attention: Cluster
    ffn: Cluster

    def __post_init__(self) -> None:
        for name in _SAME_PER_NODE:
            a, f = getattr(self.attention, name), getattr(self.ffn, name)
            if a != f:
                raise ConfigError(f"the fleet's node types differ in {name} ({a} and {f}): one placement needs them")

    @property
    def name(self) -> str:
        return f"{self.attention.nodes} x {self.attention.name} + {self.ffn.nodes} x {self.ffn.name}"

    def whole(self) -> Cluster:
        """Both types' nodes in one cluster, the attention type's first (its hardware fields name the A side's; the
        expert side's come from ``Rates.ffn``)."""
        hosts = tuple(_host(c, node) for c in (self.attention, self.ffn) for node in range(c.nodes))
        host_bytes = min(self.attention.host_bytes, self.ffn.host_bytes)
        nodes = self.attention.nodes + self.ffn.nodes
        return replace(self.attention, name=self.name, nodes=nodes, hosts=hosts, host_bytes=host_bytes)

    def weakest(self) -> Cluster:
        """The whole fleet as one homogeneous cluster: every rate and memory at the weaker type's value."""
        weaker = {f: min(getattr(self.attention, f), getattr(self.ffn, f)) for f in _WEAKEST}
        return replace(self.whole(), name=f"{self.name}, at the weaker type", **weaker)


def _host(cluster: Cluster, node: int) -> str:
    """A node's host name: the cluster's own, else its type and number (``h200-0``), so a hostfile says which."""
    return cluster.hosts[node] if cluster.hosts else f"{cluster.name}-{node}"


@dataclass(frozen=True)
class FleetResult:
    """The AF-Pipe plan on the fleet and the co-located alternatives, each a ``PlanResult`` of its own cluster."""

    fleet: Fleet
    af: PlanResult  # its baseline is None: the alternatives are below
    alternatives: tuple[tuple[str, PlanResult], ...]

    @property
    def best_alternative(self) -> tuple[str, BaselinePlan] | None:
        plans = [(label, r.baseline) for label, r in self.alternatives if r.baseline is not None]
        return max(plans, key=lambda lp: lp[1].tokens_per_s, default=None)

    @property
    def ratio(self) -> float | None:
        """AF-Pipe's tokens/s over the best alternative's (None where either has no plan)."""
        best = self.best_alternative
        if self.af.af is None or best is None:
            return None
        return self.af.af.tokens_per_s / best[1].tokens_per_s


def fleet_request(base: PlanRequest, fleet: Fleet, eff: Efficiency) -> PlanRequest:
    """``base`` (its model, work and search options) on ``fleet``: the split fixed, attention nodes first."""
    rates = replace(shape_rates(fleet.attention, eff, base.spec), ffn=shape_rates(fleet.ffn, eff, base.spec))
    return replace(
        base, cluster=fleet.whole(), rates=rates, attention_gpus=fleet.attention.world_size, placement="contiguous"
    )


def plan_fleet(base: PlanRequest, fleet: Fleet, eff: Efficiency) -> FleetResult:
    """AF-Pipe on ``fleet`` and the strongest co-located job on each homogeneous use of it."""
    req = fleet_request(base, fleet, eff)
    af, rejected = best_af(req)
    alternatives = []
    for label, cluster in (
        ("the whole fleet, at the weaker type", fleet.weakest()),
        (f"the {fleet.attention.name} nodes alone", fleet.attention),
        (f"the {fleet.ffn.name} nodes alone", fleet.ffn),
    ):
        alone = replace(base, cluster=cluster, rates=shape_rates(cluster, eff, base.spec), attention_gpus=None)
        baseline, baseline_rejected = best_baseline(alone)
        alternatives.append((label, PlanResult(alone, None, baseline, baseline_rejected=baseline_rejected)))
    return FleetResult(fleet, PlanResult(req, af, None, rejected), tuple(alternatives))


def report(result: FleetResult) -> str:
    """The fleet, the AF-Pipe plan, each alternative and the verdict."""
    af = result.af
    lines = [f"fleet    {result.fleet.name}: attention on the {result.fleet.attention.name} nodes, experts on the "
             f"{result.fleet.ffn.name} nodes", f"AF-Pipe  {af_summary(af)}"]  # fmt: skip
    if af.af is not None:
        lines.append(f"         {af.af.tokens_per_s:,.0f} tokens/s")
    for label, alt in result.alternatives:
        rate = f"; {alt.baseline.tokens_per_s:,.0f} tokens/s" if alt.baseline is not None else ""
        lines.append(f"co-located on {label}: {baseline_summary(alt)}{rate}")
    ratio, best = result.ratio, result.best_alternative
    if ratio is None or best is None:
        missing = "AF-Pipe does not fit" if af.af is None else "nothing co-located fits"
        lines.append(f"verdict  no comparison: {missing}")
    else:
        pays = "pays" if ratio >= PAYS_THRESHOLD else "does not pay"
        lines.append(f"verdict  the mixed fleet's disaggregation {pays} ({ratio:.2f}x the best homogeneous use: "
                     f"co-located on {best[0]})")  # fmt: skip
    return "\n".join(lines) + "\n"


def _cluster(name: str, nodes: int | None, flag: str) -> Cluster:
    try:
        return load_cluster(name, nodes)
    except ConfigError as err:
        raise ConfigError(f"{flag}: {err}") from err


def main(argv: list[str]) -> int:
    """``disagmoe-plan fleet``: AF-Pipe on a fleet of two GPU types against its homogeneous uses."""
    p = argparse.ArgumentParser(
        prog="disagmoe-plan fleet", description=description(__doc__), formatter_class=argparse.RawTextHelpFormatter
    )
    p.add_argument("--model", required=True, help="directory (or config.json) of the HF model")
    p.add_argument("--seq-len", type=int, required=True, help="tokens per sequence")
    p.add_argument("--micro-batch-size", type=int, default=1, help="sequences per micro-batch per lane (default 1)")
    p.add_argument("--global-batch-size", type=int, default=None, help="sequences per step (default 8 per GPU)")
    for side in ("attention", "ffn"):
        what = "attention side's" if side == "attention" else "expert side's"
        p.add_argument(f"--{side}-cluster", required=True, help=f"the {what} nodes: {', '.join(PRESETS)} or a JSON")
        p.add_argument(f"--{side}-nodes", type=int, default=None, help=f"how many of the {what} nodes")
    p.add_argument("--fp8", action="store_true", help="both systems with the FP8 lever (as the main command's --fp8)")
    p.add_argument("--write-hostfile", metavar="PATH", help="the AF-Pipe plan's hostfile: the attention nodes first")
    p.add_argument(
        "--write-ds-config",
        metavar="PATH",
        help="the AF-Pipe plan's ds_config (its schedule costed on the attention type's cluster)",
    )
    args = p.parse_args(argv)
    try:
        fleet = Fleet(
            _cluster(args.attention_cluster, args.attention_nodes, "--attention-cluster"),
            _cluster(args.ffn_cluster, args.ffn_nodes, "--ffn-cluster"),
        )
        spec = load_model_spec(Path(args.model))
        world = fleet.attention.world_size + fleet.ffn.world_size
        eff = Efficiency()
        base = PlanRequest(
            spec=spec,
            cluster=fleet.whole(),
            rates=shape_rates(fleet.attention, eff, spec),
            work=Workload(args.seq_len, args.micro_batch_size, fp8=args.fp8),
            global_batch=args.global_batch_size or 8 * world * args.micro_batch_size,
        )
        result = plan_fleet(base, fleet, eff)
    except ConfigError as err:
        print(f"disagmoe-plan fleet: error: {err}", file=sys.stderr)
        return 2
    print(report(result), end="")
    for note in _write(args, result):
        print(note, file=sys.stderr)
    return 0


def _write(args: argparse.Namespace, result: FleetResult) -> list[str]:
    """The files asked for, from the AF-Pipe plan; the notes that say what was written."""
    if not (args.write_hostfile or args.write_ds_config):
        return []
    if result.af.af is None:
        return ["note: no AF-Pipe plan fits the fleet: nothing written"]
    notes = []
    if args.write_hostfile:
        Path(args.write_hostfile).write_text(hostfile(result.af), encoding="utf-8")
        notes.append(f"wrote hostfile {args.write_hostfile}")
    if args.write_ds_config:
        config = written_ds_config(result.af, result.af.af, cluster=args.attention_cluster)
        Path(args.write_ds_config).write_text(json.dumps(config, indent=2) + "\n", encoding="utf-8")
        notes.append(f"wrote ds_config {args.write_ds_config} (AF-Pipe)")
    return notes
