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
from disagmoe_ds.config import LAYOUT_KEYS, LEVER_KEYS, DisagMoEConfig, add_section_flags, section_values
from disagmoe_ds.launch.local import spawn_local
from disagmoe_ds.models.lora_settings import lora_of
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
    # One copy of every parameter: the first lane of each TP rank (it leaves out what the first one has), the first
    # replica of an expert shard.
    writer = role.index < runtime.layout.tensor_parallel if role.is_attention else role.edp_rank == 0
    with gathered(runtime.engine, runtime.module):  # ZeRO-3: every replica gathers, the writer keeps them
        params = hf_named(runtime, {n: p.detach() for n, p in runtime.module.named_parameters()}) if writer else {}
    return {"rank": rank, "losses": losses, "grad_norms": norms, "params": params, "grads": grads if writer else []}


def run_verify(args: VerifyArgs, *, timeout_s: float = 600.0) -> dict[str, Any]:
    """Start the ranks on this machine (CPU, gloo), then compare with the reference."""
    engine_build.preflight(args.model, args.cfg, args.ds_config(), args.cfg.world_size)
    ranks = spawn_local(rank_main, args.cfg.world_size, args=(args,), timeout_s=timeout_s)
    return compare(ranks, reference(args, args.cfg.batch_lanes), args)


# The section keys disagmoe-verify takes as flags (config.SECTION_FLAGS: the same flags as run_pretrain.py's and
# bench_e2e.py's for the same keys).
VERIFY_KEYS = (
    *LAYOUT_KEYS,
    "micro_batches",
    "activation_checkpointing",
    "transport",
    *LEVER_KEYS,
    "comm_timeout_s",
)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="disagmoe-verify", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    add_section_flags(p, VERIFY_KEYS, cli="verify")
    add_run_args(p, zero_help="ZeRO stage inside each group")
    return p


def parse_args(argv: list[str] | None) -> VerifyArgs:
    a = build_parser().parse_args(argv)
    cfg = DisagMoEConfig(**section_values(a, VERIFY_KEYS), lora=lora_of(a))
    return run_args(VerifyArgs, a, cfg)


def main(argv: list[str] | None = None) -> int:
    return cli(
        argv, parse_args, run_verify, prog="disagmoe-verify", rank_fn=rank_main, preflight_fn=engine_build.preflight
    )


if __name__ == "__main__":
    sys.exit(main())
