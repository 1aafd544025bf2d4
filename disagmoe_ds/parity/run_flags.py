"""The flags both verifies share (model, batches, optimizer, routing, outputs), torch-free: a verify's ``--help`` and
a malformed flag answer before it loads torch. The layout flags are each mode's (``config.add_section_flags``)."""

from __future__ import annotations

import argparse

from disagmoe_ds.models.lora_settings import add_lora_args


def add_run_args(p: argparse.ArgumentParser, *, zero_help: str) -> None:
    """The flags both verifies share: model, batches, optimizer, routing, outputs (the layout flags are each mode's)."""
    p.add_argument("--model", default="hf_models/tiny-qwen3-moe", help="HF model directory or config-only directory")
    p.add_argument("--micro-batch-size", type=int, default=1, help="sequences per micro-batch")
    p.add_argument("--zero", type=int, default=0, choices=(0, 1, 2), help=zero_help)
    p.add_argument("--steps", type=int, default=2, help="optimizer steps")
    p.add_argument(
        "--dtype", choices=("bf16", "fp32"), default="fp32",
        help="dtype of the ranks and of the HF reference; bf16 is compared at a tolerance of 5e-2, fp32 at 1e-5",
    )  # fmt: skip
    p.add_argument("--seq-len", type=int, default=16, help="tokens per sequence of the random batches")
    p.add_argument("--clip", type=float, default=1.0, help="global-norm gradient clipping (0: off)")
    p.add_argument("--lr", type=float, default=1e-3, help="AdamW learning rate of the ranks and the reference")
    p.add_argument(
        "--seed", type=int, default=0, help="seeds the batches, a config-only model's weights and the LoRA adapters"
    )
    p.add_argument(
        "--skew", action="store_true",
        help="every token of the i-th MoE layer picks expert i first: the worst imbalance, another expert per layer",
    )  # fmt: skip
    p.add_argument("--packed", action="store_true", help="two documents per sequence (position ids restart)")
    p.add_argument(
        "--zero-offload", action="store_true",
        help="DeepSpeed's ZeRO-Offload on every engine: the optimizer state and its step in host memory (needs --zero "
        "1 or more; --offload-optimizer A F sets it per side)",
    )  # fmt: skip
    p.add_argument("--timeline", metavar="PATH", help="write the last step's Chrome/Perfetto trace of all ranks")
    p.add_argument("--json", action="store_true", help="print the JSON summary on one line")
    add_lora_args(p)
    p.add_argument("--local_rank", type=int, default=None, help=argparse.SUPPRESS)  # set by the deepspeed launcher
