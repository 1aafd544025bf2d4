"""disagmoe-verify: train a few steps disaggregated and compare with the single-process HF model.

    disagmoe-verify --model hf_models/tiny-qwen2-moe --attention-gpus 2 --ffn-gpus 2 --micro-batches 3 --json

Without a launcher it starts attention_gpus + ffn_gpus CPU ranks itself (gloo); under ``deepspeed`` or
``torchrun`` it runs as one of the launched ranks. The reference is the HF model on the same batches: the mean
loss over lanes and micro-batches, global-norm clipping, the same AdamW. It prints a JSON summary with the max
abs difference of the losses, the gradient norms and the parameters after every step; exit code 0 only on pass.
"""

from __future__ import annotations

import argparse
import sys
from typing import Any

from disagmoe_ds.afpipe import build as engine_build
from disagmoe_ds.checkpoint.ds_state import gathered
from disagmoe_ds.comm.transport import TRANSPORTS
from disagmoe_ds.config import SIDES, DisagMoEConfig
from disagmoe_ds.launch.local import spawn_local
from disagmoe_ds.models.lora import lora_of
from disagmoe_ds.parity.compare import capture_grads, compare, hf_named
from disagmoe_ds.parity.harness import add_run_args, build_for_verify, cli, run_args, train_steps
from disagmoe_ds.parity.reference import (
    VerifyArgs,
    make_batches,
    reference,
)


def rank_main(rank: int, args: VerifyArgs) -> dict[str, Any]:
    """One rank: build, train ``steps`` steps, return losses, grad norms and its parameters under HF names."""
    runtime = build_for_verify(engine_build.build_rank, args)  # looked up per call: tests wrap it
    role = runtime.role
    feeds = role.is_attention and role.group == 0  # A-group 0 embeds; the head reads labels there too
    vocab = runtime.module.config.vocab_size if feeds else 0
    grads = capture_grads(runtime)
    losses, norms = train_steps(
        runtime,
        args,
        lambda step: make_batches(args, vocab, step, args.cfg.batch_lane_of(role.index)) if feeds else None,
    )
    writer = role.index == 0 if role.is_attention else role.edp_rank == 0  # one copy of every parameter
    with gathered(runtime.engine, runtime.module):  # ZeRO-3: every replica gathers, the writer keeps them
        params = hf_named(runtime, {n: p.detach() for n, p in runtime.module.named_parameters()}) if writer else {}
    return {"rank": rank, "losses": losses, "grad_norms": norms, "params": params, "grads": grads if writer else []}


def run_verify(args: VerifyArgs, *, timeout_s: float = 600.0) -> dict[str, Any]:
    """Start the ranks on this machine (CPU, gloo), then compare with the reference."""
    engine_build.preflight(args.model, args.cfg, args.ds_config(), args.cfg.world_size)
    ranks = spawn_local(rank_main, args.cfg.world_size, args=(args,), timeout_s=timeout_s)
    return compare(ranks, reference(args, args.cfg.batch_lanes), args)


def parse_args(argv: list[str] | None) -> VerifyArgs:
    p = argparse.ArgumentParser(
        prog="disagmoe-verify", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--attention-gpus", type=int, default=1, help="M: attention ranks")
    p.add_argument("--ffn-gpus", type=int, default=1, help="N: FFN (expert) ranks")
    p.add_argument("--depth", type=int, default=1, help="p: A-groups = F-groups (must divide the layer count)")
    p.add_argument("--expert-data-parallel", type=int, default=1, help="replicas of each expert shard")
    p.add_argument(
        "--sequence-parallel", type=int, default=1, help="s: lanes holding one micro-batch in slices (Ulysses)"
    )
    p.add_argument("--micro-batches", type=int, default=2, help="micro-batches per step per lane")
    p.add_argument("--activation-checkpointing", action="store_true", help="recompute chunk activations in backward")
    p.add_argument(
        "--transport",
        choices=sorted(TRANSPORTS),
        default="auto",
        help="exchange transport: auto (NCCL on GPUs, gloo on CPUs) or rendezvous (CPU ranks; a send completes only "
        "once its receive has started, as on NCCL's network transport: shows deadlocks gloo hides)",
    )
    add_lever_args(p)
    p.add_argument(
        "--comm-timeout", type=float, default=300.0, help="seconds a rank may wait for a peer; stacks at half of it"
    )
    add_run_args(p, zero_help="ZeRO stage inside each group")
    a = p.parse_args(argv)
    cfg = DisagMoEConfig(
        attention_gpus=a.attention_gpus,
        ffn_gpus=a.ffn_gpus,
        depth=a.depth,
        micro_batches=a.micro_batches,
        expert_data_parallel=a.expert_data_parallel,
        sequence_parallel=a.sequence_parallel,
        activation_checkpointing=a.activation_checkpointing,
        transport=a.transport,
        comm_timeout_s=a.comm_timeout,
        lora=lora_of(a),
        **lever_settings(a),
    )
    return run_args(VerifyArgs, a, cfg)


def add_lever_args(p: argparse.ArgumentParser) -> None:
    """AF-Pipe's memory levers as flags (``lever_settings`` turns them into ``DisagMoEConfig`` fields); shared with
    ``bench/bench_e2e.py``."""
    p.add_argument("--resend", action="store_true", help="experts keep nothing between forward and backward")
    p.add_argument("--cuda-graphs", action="store_true", help="replay the parts as CUDA graphs (GPU ranks)")
    p.add_argument(
        "--capacity-factor",
        type=float,
        help="several ep ranks: m2n messages at a fixed capacity (balanced routing times this), no headers; a step "
        "that outgrows it runs again at a larger one",
    )
    p.add_argument(
        "--selective-recompute", action="store_true", help="recompute attention blocks, SwiGLUs, experts' gate/up"
    )
    p.add_argument(
        "--split-backward",
        action="store_true",
        help="each backward sends its input gradients first and runs its weight gradients when the rank would idle",
    )
    p.add_argument(
        "--offload",
        nargs=2,
        type=float,
        metavar=("A", "F"),
        default=(0.0, 0.0),
        help="share of each micro-batch's layers whose saved activations go to host memory, attention and FFN side",
    )
    p.add_argument(
        "--zero-stage",
        nargs=2,
        type=int,
        metavar=("A", "F"),
        help="ZeRO stage of the attention and the FFN side (F may be 3: expert parameters sharded), replacing --zero",
    )


def lever_settings(a: argparse.Namespace) -> dict[str, Any]:
    """The ``DisagMoEConfig`` fields of ``add_lever_args``' flags."""
    return {
        "resend": a.resend,
        "cuda_graphs": a.cuda_graphs,
        "capacity_factor": a.capacity_factor,
        "selective_recompute": a.selective_recompute,
        "split_backward": a.split_backward,
        "offload": dict(zip(SIDES, a.offload, strict=True)),
        "zero_stage": dict(zip(SIDES, a.zero_stage, strict=True)) if a.zero_stage else {},
    }


def main(argv: list[str] | None = None) -> int:
    return cli(
        argv, parse_args, run_verify, prog="disagmoe-verify", rank_fn=rank_main, preflight_fn=engine_build.preflight
    )


if __name__ == "__main__":
    sys.exit(main())
