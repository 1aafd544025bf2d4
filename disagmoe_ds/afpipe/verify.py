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
from typing import TYPE_CHECKING

from disagmoe_ds.config import LAYOUT_KEYS, LEVER_KEYS, DisagMoEConfig, add_section_flags, section_values
from disagmoe_ds.models.lora_settings import lora_of
from disagmoe_ds.parity.run_flags import add_run_args

if TYPE_CHECKING:
    from disagmoe_ds.parity.reference import VerifyArgs


# The section keys disagmoe-verify takes as flags (config.SECTION_FLAGS: the same flags as run_pretrain.py's and
# bench_e2e.py's for the same keys).
VERIFY_KEYS = (
    *LAYOUT_KEYS,
    "micro_batches",
    "activation_checkpointing",
    "transport",
    "attention",
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
    from disagmoe_ds.parity.harness import run_args
    from disagmoe_ds.parity.reference import VerifyArgs

    a = build_parser().parse_args(argv)
    cfg = DisagMoEConfig(**section_values(a, VERIFY_KEYS), lora=lora_of(a))
    return run_args(VerifyArgs, a, cfg)


def main(argv: list[str] | None = None) -> int:
    build_parser().parse_args(argv)  # --help and a malformed flag answer here, before the imports below load torch
    from disagmoe_ds.afpipe.build import preflight
    from disagmoe_ds.afpipe.verify_run import rank_main, run_verify
    from disagmoe_ds.parity.harness import cli

    return cli(argv, parse_args, run_verify, prog="disagmoe-verify", rank_fn=rank_main, preflight_fn=preflight)


if __name__ == "__main__":
    sys.exit(main())
