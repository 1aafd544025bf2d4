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
    disagmoe-plan fleet --model hf_models/DeepSeek-V3 --seq-len 4096 --hostfile hostfiles/mixed

With ``--hostfile`` the fleet is the hostfile's: hosts carrying ``gpu=TYPE`` (a preset), two types, both ways of
giving them the sides planned, the better first; the written hostfile lists its hosts, the attention type's first.
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import dataclass, replace
from pathlib import Path

from disagmoe_ds.errors import ConfigError
from disagmoe_ds.launch.hostfile import gpu_types, parse_hostfile
from disagmoe_ds.planner.allocator import best_af, best_baseline
from disagmoe_ds.planner.cluster import PRESETS, Cluster, Efficiency, Fleet, load_cluster
from disagmoe_ds.planner.gemm_efficiency import shape_rates
from disagmoe_ds.planner.inputs import description
from disagmoe_ds.planner.model import load_model_spec
from disagmoe_ds.planner.plans import PAYS_THRESHOLD, BaselinePlan, PlanRequest, PlanResult
from disagmoe_ds.planner.runtime_files import hostfile, written_ds_config
from disagmoe_ds.planner.study import af_summary, baseline_summary
from disagmoe_ds.planner.workload import Workload


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


def fleets_of_hostfile(path: Path) -> tuple[Fleet, Fleet]:
    """The fleet a hostfile describes (each host ``HOST slots=N gpu=TYPE``, TYPE a preset), either way round."""
    if not path.is_file():
        raise ConfigError(f"--hostfile {path} does not exist")
    lines = path.read_text(encoding="utf-8").splitlines()
    slots, types = parse_hostfile(lines, str(path)), gpu_types(lines, str(path))
    kinds = list(dict.fromkeys(types.values()))
    if len(kinds) != 2:
        found = ", ".join(kinds) or "none"
        raise ConfigError(f"--hostfile {path}: a fleet has two GPU types (each host's gpu=TYPE); found {found}")
    sides = []
    for kind in kinds:
        hosts = tuple(host for host, gpu in types.items() if gpu == kind)
        cluster = replace(_cluster(kind, len(hosts), f"--hostfile {path}: gpu={kind}"), hosts=hosts)
        uneven = [host for host in hosts if slots[host] != cluster.gpus_per_node]
        if uneven:
            raise ConfigError(
                f"--hostfile {path}: {', '.join(uneven)}: slots other than the {cluster.gpus_per_node} GPUs of a "
                f"gpu={kind} node; the planner places whole nodes"
            )
        sides.append(cluster)
    return Fleet(sides[0], sides[1]), Fleet(sides[1], sides[0])


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
        p.add_argument(f"--{side}-cluster", help=f"the {what} nodes: {', '.join(PRESETS)} or a JSON")
        p.add_argument(f"--{side}-nodes", type=int, default=None, help=f"how many of the {what} nodes")
    p.add_argument(
        "--hostfile",
        metavar="PATH",
        help="instead of the four flags above: a DeepSpeed hostfile whose hosts carry gpu=TYPE (two presets); "
        "both ways of giving the types the sides are planned",
    )
    p.add_argument("--fp8", action="store_true", help="both systems with the FP8 lever (as the main command's --fp8)")
    p.add_argument("--write-hostfile", metavar="PATH", help="the AF-Pipe plan's hostfile: the attention nodes first")
    p.add_argument(
        "--write-ds-config",
        metavar="PATH",
        help='the AF-Pipe plan\'s ds_config ("cluster": the attention type, "ffn_cluster": the experts\')',
    )
    args = p.parse_args(argv)
    try:
        results = [plan_fleet(_request(args, fleet), fleet, Efficiency()) for fleet in _fleets(args)]
    except ConfigError as err:
        print(f"disagmoe-plan fleet: error: {err}", file=sys.stderr)
        return 2
    results.sort(key=lambda r: r.af.af.tokens_per_s if r.af.af is not None else 0.0, reverse=True)
    print("\n".join(report(r) for r in results), end="")
    for note in _write(args, results[0]):
        print(note, file=sys.stderr)
    return 0


def _fleets(args: argparse.Namespace) -> tuple[Fleet, ...]:
    """The fleet of the hostfile (both ways round) or of the four flags."""
    clusters = (args.attention_cluster, args.ffn_cluster)
    if args.hostfile:
        if any(clusters):
            raise ConfigError("--hostfile gives the fleet: drop --attention-cluster and --ffn-cluster")
        return fleets_of_hostfile(Path(args.hostfile))
    if not all(clusters):
        raise ConfigError("give --attention-cluster and --ffn-cluster (with their --*-nodes), or --hostfile")
    return (
        Fleet(
            _cluster(args.attention_cluster, args.attention_nodes, "--attention-cluster"),
            _cluster(args.ffn_cluster, args.ffn_nodes, "--ffn-cluster"),
        ),
    )


def _request(args: argparse.Namespace, fleet: Fleet) -> PlanRequest:
    spec = load_model_spec(Path(args.model))
    world = fleet.attention.world_size + fleet.ffn.world_size
    return PlanRequest(
        spec=spec,
        cluster=fleet.whole(),
        rates=shape_rates(fleet.attention, Efficiency(), spec),
        work=Workload(args.seq_len, args.micro_batch_size, fp8=args.fp8),
        global_batch=args.global_batch_size or 8 * world * args.micro_batch_size,
    )


def _write(args: argparse.Namespace, result: FleetResult) -> list[str]:
    """The files asked for, from the AF-Pipe plan; the notes that say what was written."""
    if not (args.write_hostfile or args.write_ds_config):
        return []
    if result.af.af is None:
        return ["note: no AF-Pipe plan fits the fleet: nothing written"]
    notes = []
    fleet = result.fleet
    if args.write_hostfile:
        types = [fleet.attention.name] * fleet.attention.nodes + [fleet.ffn.name] * fleet.ffn.nodes
        Path(args.write_hostfile).write_text(hostfile(result.af, gpu_types=types), encoding="utf-8")
        notes.append(f"wrote hostfile {args.write_hostfile}")
    if args.write_ds_config:
        clusters = (args.attention_cluster, args.ffn_cluster) if not args.hostfile else (None, None)
        attention, ffn = (given or side.name for given, side in zip(clusters, (fleet.attention, fleet.ffn)))
        config = written_ds_config(result.af, result.af.af, cluster=attention, ffn_cluster=ffn)
        Path(args.write_ds_config).write_text(json.dumps(config, indent=2) + "\n", encoding="utf-8")
        notes.append(f"wrote ds_config {args.write_ds_config} (AF-Pipe)")
    return notes
