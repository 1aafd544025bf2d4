"""``disagmoe-plan``: size the attention and FFN sides of a disaggregated MoE job and say whether it pays.

    disagmoe-plan --model hf_models/Qwen3-235B-A22B --seq-len 8192 --micro-batch-size 1 --cluster h800 --nodes 16
    disagmoe-plan --model hf_models/Qwen3-30B-A3B --seq-len 4096 --nodes 1 --lora-rank 16   # LoRA fine-tuning
    disagmoe-plan profile --model hf_models/Qwen3-30B-A3B --seq-len 4096 --out profile.json
    disagmoe-plan study [--models Qwen3-235B-A22B] [--seq-len 4096,16384] [--ablate]
    disagmoe-plan calibrate                       # the baseline against published Megatron-Core runs
    disagmoe-plan fleet --model M --seq-len S --attention-cluster h200 --attention-nodes 8 \
        --ffn-cluster a100 --ffn-nodes 8          # two GPU types: each side on its own, against homogeneous uses
    disagmoe-plan sweep --model hf_models/Qwen3-30B-A3B --out docs/sweep   # where AF-Pipe pays: JSON + PNG

Console-script entry point: ``disagmoe-plan = disagmoe_ds.planner.cli:main``.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from dataclasses import replace

from disagmoe_ds.capabilities.rules import Job, refusals
from disagmoe_ds.errors import ConfigError, DisagMoEError
from disagmoe_ds.planner.allocator import PlanRequest, plan
from disagmoe_ds.planner.attention_lanes import DEGREES, lane_refusal
from disagmoe_ds.planner.baseline_layout import check_layout, parse_layout
from disagmoe_ds.planner.cluster import PRESETS, Efficiency, Rates, load_cluster
from disagmoe_ds.planner.colocated_costs import DISPATCHERS
from disagmoe_ds.planner.gemm_efficiency import shape_rates
from disagmoe_ds.planner.hf_config import read_model_config
from disagmoe_ds.planner.inputs import check_at_least_one
from disagmoe_ds.planner.lora import DEFAULT_TARGETS, TARGETS, LoRA, check_adapts, ships_fp8_blocks
from disagmoe_ds.planner.model import load_model_spec
from disagmoe_ds.planner.plan_json import to_json
from disagmoe_ds.planner.plan_outputs import write_outputs, writes_launch
from disagmoe_ds.planner.profile_fit import load_profile, profile_warnings, rates_from_profile
from disagmoe_ds.planner.report import to_text
from disagmoe_ds.planner.runtime_files import WRITE_MODES
from disagmoe_ds.planner.variants import PAPER, VARIANTS
from disagmoe_ds.planner.workload import Workload

_EPILOG = """\
Subcommands: `disagmoe-plan profile --help` measures per-layer attention/expert times on this machine and writes
a profile JSON for --profile; `disagmoe-plan study --help` prints the issue-16 table (best AF-Pipe variant
against the strongest co-located baseline; docs/planner.md); `disagmoe-plan calibrate` prices published Megatron
runs at their layouts; `disagmoe-plan sweep --help` maps where AF-Pipe pays over bandwidth, length and nodes;
`disagmoe-plan fleet --help` plans a fleet of two GPU types, each side on its own.

How it decides: T_a = max(C_a/(M P), V/(M_a B)) and T_f = max(C_f/(N P), V/(M_f B)) (DisagMoE paper, sec. 4.3)
rank every split that divides and fits memory; the best few are simulated with the AF-Pipe schedule generator
and compared with the best co-located EP+DP interleaved-1F1B configuration, simulated too. Both steps add the
exposed gradient sync and the optimizer step (memory-bound: each rank's ZeRO shard over the cluster's hbm_bw; in
AF-Pipe the slower side's). Details and the cluster JSON format: docs/planner.md.
"""

# ``Efficiency`` fields settable from the command line, with what each is a share of (defaults from the class)
_EFFICIENCY_FLAGS = {
    "compute": "achievable share of peak FLOP/s",
    "network": "achievable share of NIC bandwidth",
    "nvlink": "achievable share of NVLink bandwidth",
    "memory": "usable share of GPU memory",
    "hbm": "achievable share of HBM bandwidth (the optimizer step)",
    "host": "achievable share of a node's host memory bandwidth (an optimizer stepping there)",
}


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="disagmoe-plan",
        description=__doc__.split("\n")[0],
        epilog=_EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--model", required=True, help="HF model directory holding config.json (or the json itself)")
    p.add_argument("--seq-len", type=int, required=True, help="tokens per sequence")
    p.add_argument("--micro-batch-size", type=int, default=1, help="sequences per attention lane per micro-batch")
    p.add_argument(
        "--global-batch-size",
        type=int,
        default=None,
        help="sequences per step (default 8 x GPUs x micro-batch size); both systems are compared per token",
    )
    p.add_argument(
        "--cluster",
        default="h800",
        help=f"a preset ({', '.join(PRESETS)}: 8 GPUs, 8 x 400 Gb/s NICs per node) or a cluster JSON file",
    )
    p.add_argument("--nodes", type=int, default=None, help="number of nodes (required with a preset)")
    p.add_argument(
        "--profile",
        default=None,
        help="profile JSON from `disagmoe-plan profile`: measured part times replace peak x efficiency; its "
        "measured link bandwidths (nvlink_bytes_per_s, nic_bytes_per_s) replace a preset's nominal ones, never "
        "those of a --cluster JSON (which describes your links)",
    )
    p.add_argument("--json", action="store_true", help="print the plan as JSON instead of the table")
    p.add_argument(
        "--write-ds-config",
        metavar="PATH",
        help="write the ds_config that `run_pretrain.py --deepspeed_config PATH` runs as it is, for the system "
        '--write-mode picks: its "disagmoe" section, and the shipped configs\' optimizer and schedule (the planner '
        "has no flags for them): AdamW at lr 3e-4 (run_pretrain.py --lr sets it), 2,000 linear warm-up steps, then "
        'cosine decay to 0.1 x lr at run_pretrain.py\'s --steps (docs/planner.md, "Outputs")',
    )
    p.add_argument(
        "--write-hostfile",
        metavar="PATH",
        help="write the DeepSpeed hostfile for the same system: the launcher numbers ranks node by node in its "
        "order, which places them (AF-Pipe: attention ranks first)",
    )
    p.add_argument(
        "--write-mode",
        default="auto",
        choices=WRITE_MODES,
        help="which system the written files run: auto, the verdict's where DisagMoE-DS runs it, else (a co-located "
        "layout with PP, TP, CP or recompute, which its EP x DP co-located mode lacks) the faster of the AF-Pipe plan "
        "and the best co-located layout it runs, said in one line; disaggregated, the AF-Pipe plan; colocated, the "
        "best co-located layout it runs (default: auto)",
    )
    p.add_argument(
        "--timeline",
        metavar="PATH",
        help="draw the predicted AF-Pipe timeline (.png/.svg via matplotlib, .json Chrome trace); the "
        "baseline's goes next to it with a -baseline suffix",
    )
    p.add_argument("--zero-stage", type=int, default=1, choices=(0, 1, 2), help="ZeRO stage inside each group")
    p.add_argument("--precision", default="bf16", choices=("bf16", "fp32"), help="training precision")
    p.add_argument(
        "--fp8",
        action="store_true",
        help="price the runtime's FP8 lever in both systems: the attention side's projections, dense and shared MLPs "
        '(those with no side of at most 2,048, the runtime\'s shape rule "fp8_bf16_width")'
        " and the routed experts' forward and input-grad GEMMs (where their harmonic width H*I/(H+I) passes 1,536, "
        '"fp8_expert_bf16_width": narrower experts stay bf16) at the FP8/bf16 speedups measured on an H200 (the '
        "experts' weight grads stay at the bf16 rate), each quantize as one pass over its operand at HBM bandwidth "
        "(the expert weights once a step, their two FP8 copies held for it: 2 bytes a parameter), and the m2n rows "
        "and co-located dispatch in e4m3 (H + 4 bytes a row); --write-ds-config "
        'writes "fp8": true (docs/planner.md, "FP8")',
    )
    p.add_argument(
        "--recompute",
        default="auto",
        choices=("auto", "none", "selective", "full"),
        help="activation recomputation; auto searches none, selective and full, on each side apart with the "
        "per_side_recompute variant (the attention side may keep what the expert side rebuilds), costlier ones only "
        "where the cheaper do not fit; a policy given holds on both sides (with --baseline-layout it is also the "
        "baseline's)",
    )
    p.add_argument(
        "--placement",
        default="auto",
        choices=("auto", "contiguous", "spread"),
        help="contiguous: attention nodes first (plain hostfile); spread: both sides on every node with a "
        "per-node NIC split, which no DeepSpeed or torchrun launch gives (planned, not launched); auto: try both, "
        "or contiguous alone with --write-ds-config or --write-hostfile",
    )
    p.add_argument(
        "--split-granularity",
        default="gpu",
        choices=("gpu", "node"),
        help="contiguous splits move by one GPU or by whole nodes",
    )
    defaults = Efficiency()
    for name, what in _EFFICIENCY_FLAGS.items():
        if name == "compute":  # unset: the per-shape table (gemm_efficiency.py); a number: one share for all shapes
            p.add_argument(
                "--compute-efficiency",
                type=float,
                default=None,
                help=f"{what} for every shape (default: the per-shape table of docs/planner.md section 1)",
            )
            continue
        default = getattr(defaults, name)
        p.add_argument(f"--{name}-efficiency", type=float, default=default, help=f"{what} (default {default})")
    p.add_argument(
        "--routing-imbalance",
        type=float,
        default=1.0,
        help="busiest rank's expert load over the mean: 1 is forced-balanced routing (default), real dropless "
        "routing is above 1 (both systems wait for their busiest expert rank)",
    )
    p.add_argument(
        "--baseline-layout",
        default=None,
        metavar="tp=T,pp=P,vpp=V,ep=E,cp=C",
        help="price the co-located baseline at this layout instead of searching (optional keys: overlap=paired|"
        "partial, dispatcher=deepep|alltoall, grads=fp32|bf16); its recompute is --recompute (auto: cheapest fit)",
    )
    p.add_argument(
        "--baseline-dispatcher",
        default=None,
        choices=DISPATCHERS,
        help="co-located token dispatcher: deepep (one copy per destination node; default for the strongest "
        "baseline) or alltoall (top-k copies; default for --baseline ep)",
    )
    p.add_argument(
        "--baseline-overlap",
        type=float,
        default=0.0,
        help="share of the co-located all-to-all hidden behind compute outside the 1F1B overlap, besides shared "
        "experts (default 0: Megatron's dispatchers run on the compute stream)",
    )
    p.add_argument(
        "--baseline-ep",
        type=int,
        default=None,
        help="pin the co-located expert-parallel size (default: search; the paper used 16)",
    )
    p.add_argument(
        "--baseline",
        default="strongest",
        choices=("strongest", "ep", "deepspeed"),
        help="co-located baseline: strongest (TP, CP, selective recompute, all-to-all overlapped with the other "
        "micro-batch), ep (plain EP+DP interleaved 1F1B) or deepspeed (what DeepSpeed runs on an HF MoE model: "
        "AutoEP over ZeRO data parallelism with its all-to-all or DeepEP transport, Ulysses or AutoTP, no pipeline "
        "stages)",
    )
    for flag, what in (("sequence-parallel", "DeepSpeed-Ulysses ranks"), ("tensor-parallel", "tensor-parallel ranks")):
        p.add_argument(
            f"--{flag}",
            type=int,
            default=None,
            choices=DEGREES,
            help=f"fix the {what} of an attention lane (s x t ranks per lane; default: search {DEGREES} where the "
            "heads, the sequence and the A-groups allow; searching costs about twice the fixed lanes' time, e.g. 21 s "
            "for Qwen3-235B-A22B at 4K on 16 nodes against 10 s with --sequence-parallel 1 --tensor-parallel 1)",
        )
    p.add_argument(
        "--lora-rank",
        type=int,
        default=0,
        metavar="R",
        help="plan LoRA fine-tuning with adapters of rank R: base weights frozen (parameter bytes only), the "
        'adapters keep the training state; --write-ds-config writes "disagmoe": {"lora": ...} (default 0: full '
        "fine-tuning)",
    )
    p.add_argument(
        "--lora-targets",
        default=None,
        metavar=",".join(TARGETS),
        help="which projections get adapters (with --lora-rank): attention (every Linear of the token mixer), mlp "
        "(dense MLPs and shared experts), experts (every routed expert); default attention,experts, as the runtime's",
    )
    p.add_argument(
        "--lora-train-router",
        action="store_true",
        help="with --lora-rank: train the routers in full too (default: frozen like every base weight)",
    )
    p.add_argument(
        "--fp8-base",
        action="store_true",
        help="with --lora-rank: the base is a checkpoint shipped in FP8 blocks (DeepSeek-V3's layout), which LoRA "
        "keeps in FP8 on the ranks: its weight matrices at about 1 byte a parameter, held whole under ZeRO-3 (implied "
        "where --model's config.json has such a quantization_config)",
    )
    p.add_argument(
        "--variants",
        default="all",
        help=f"AF-Pipe variants to try: all, paper (none), or a comma list of {', '.join(VARIANTS)}",
    )
    return p


def _variants(text: str) -> frozenset[str]:
    if text == "all":
        return frozenset(VARIANTS)
    if text == "paper":
        return PAPER
    chosen = frozenset(v for v in text.split(",") if v)
    unknown = sorted(chosen - set(VARIANTS))
    if unknown:
        raise DisagMoEError(f"--variants: unknown {unknown}; use all, paper or some of {', '.join(VARIANTS)}")
    return chosen


def _lora(args: argparse.Namespace) -> LoRA:
    """The LoRA run the flags ask for; each error names its flag."""
    if not args.lora_rank and (args.lora_targets is not None or args.lora_train_router or args.fp8_base):
        given = "--lora-targets" if args.lora_targets is not None else "--lora-train-router"
        given = "--fp8-base" if args.fp8_base else given
        raise DisagMoEError(f"{given} needs --lora-rank R (R > 0); without it every weight trains")
    targets = (
        DEFAULT_TARGETS if args.lora_targets is None else tuple(t.strip() for t in args.lora_targets.split(",") if t)
    )
    flag = "--lora-rank" if args.lora_rank < 0 else "--lora-targets"
    try:
        fp8_base = args.fp8_base or (args.lora_rank > 0 and ships_fp8_blocks(read_model_config(args.model)[0]))
        return LoRA(args.lora_rank, targets, args.lora_train_router, fp8_base)
    except ConfigError as err:
        raise ConfigError(f"{flag}: {err}") from err


def _request(args: argparse.Namespace) -> tuple[PlanRequest, list[str]]:
    spec = load_model_spec(args.model)
    lora = _lora(args)
    refused = refusals(Job.of(spec.model_type, fp8=args.fp8))
    if refused:
        raise DisagMoEError(f"--fp8: {refused[0]}")
    check_adapts(spec, lora)
    cluster = load_cluster(args.cluster, args.nodes)
    chosen = {name: getattr(args, f"{name}_efficiency") for name in _EFFICIENCY_FLAGS}
    eff = Efficiency(**{k: v for k, v in chosen.items() if v is not None})
    if args.routing_imbalance < 1:
        raise DisagMoEError(f"--routing-imbalance must be >= 1 (1: forced balance), got {args.routing_imbalance}")
    warnings: list[str] = []
    if args.profile:
        profile = load_profile(args.profile)
        rates = rates_from_profile(profile, cluster, eff, measured_links=args.cluster in PRESETS)
        warnings = profile_warnings(profile, spec, args.seq_len)
    elif args.compute_efficiency is not None:
        rates = Rates.from_cluster(cluster, eff)
    else:
        rates = shape_rates(cluster, eff, spec)
    rates = replace(rates, routing_imbalance=args.routing_imbalance)
    layout = None
    if args.baseline_layout is not None:
        layout = parse_layout(args.baseline_layout)
        check_layout(layout, spec, cluster, args.seq_len)
    check_at_least_one(
        {
            "--seq-len": args.seq_len,
            "--micro-batch-size": args.micro_batch_size,
            "--global-batch-size": args.global_batch_size,
        }
    )
    if args.baseline_ep is not None and (args.baseline_ep < 1 or spec.num_experts % args.baseline_ep):
        raise DisagMoEError(f"--baseline-ep {args.baseline_ep} must divide the expert count ({spec.num_experts})")
    if not 0 <= args.baseline_overlap <= 1:
        raise DisagMoEError(f"--baseline-overlap must be in [0, 1], got {args.baseline_overlap}")
    global_batch = args.global_batch_size or 8 * cluster.world_size * args.micro_batch_size
    req = PlanRequest(
        spec=spec,
        cluster=cluster,
        rates=rates,
        work=Workload(
            args.seq_len, args.micro_batch_size, zero_stage=args.zero_stage, precision=args.precision, fp8=args.fp8
        ).with_lora(lora),
        global_batch=global_batch,
        recompute=args.recompute,
        granularity=cluster.gpus_per_node if args.split_granularity == "node" else 1,
        placement="contiguous" if args.placement == "auto" and writes_launch(args) else args.placement,
        baseline_overlap=args.baseline_overlap,
        baseline_ep=args.baseline_ep,
        baseline=args.baseline,
        af_variants=_variants(args.variants),
        baseline_dispatcher=args.baseline_dispatcher,
        baseline_layout=layout,
        baseline_recompute=args.recompute if layout is not None and args.recompute != "auto" else None,
        sequence_parallel=(args.sequence_parallel,) if args.sequence_parallel else DEGREES,
        tensor_parallel=(args.tensor_parallel,) if args.tensor_parallel else DEGREES,
    )
    if not req.lane_options:
        s, t = args.sequence_parallel or 1, args.tensor_parallel or 1
        why = lane_refusal(spec, s, t, tokens=req.work.tokens_per_micro_batch, gpus_per_node=cluster.gpus_per_node)
        raise DisagMoEError(f"--sequence-parallel {s} --tensor-parallel {t}: {why}; pick another or leave it searched")
    return req, warnings


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    try:
        if argv[:1] == ["profile"]:
            from disagmoe_ds.planner import profile

            return profile.main(argv[1:])
        if argv[:1] == ["study"]:
            from disagmoe_ds.planner import study

            return study.main(argv[1:])
        if argv[:1] == ["fleet"]:
            from disagmoe_ds.planner import fleet

            return fleet.main(argv[1:])
        if argv[:1] == ["calibrate"]:
            from disagmoe_ds.planner import calibration

            return calibration.main(argv[1:])
        if argv[:1] == ["sweep"]:
            from disagmoe_ds.planner import sweep

            return sweep.main(argv[1:])
        args = build_parser().parse_args(argv)
        req, warnings = _request(args)
        result = plan(req)
        notes = write_outputs(args, result)
    except DisagMoEError as err:
        print(f"disagmoe-plan: error: {err}", file=sys.stderr)
        return 2
    for w in warnings:
        print(f"disagmoe-plan: warning: {w}", file=sys.stderr)
    print(json.dumps(to_json(result), indent=2) if args.json else to_text(result), end="" if not args.json else "\n")
    for note in notes:
        print(note, file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
