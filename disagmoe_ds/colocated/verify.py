"""Co-located mode against the single-process HF model (the co-located twin of ``disagmoe-verify``).

    python -m disagmoe_ds.colocated.verify --model hf_models/tiny-qwen2-moe --world-size 4 --ep-size 2 --zero 1
    python -m disagmoe_ds.colocated.verify --world-size 4 --ep-size 2 --pp-size 2 --transport rendezvous

Starts ``world_size`` CPU ranks (gloo), or runs as one rank under ``torchrun``/``deepspeed``; trains ``steps``
steps and compares loss, global gradient norm, every gradient and every parameter with the HF model trained on
the same batches (rank r trains on lane r's batches). The batches, the reference and the comparison are
``disagmoe_ds.parity``'s, as for ``disagmoe-verify``; only the runtime differs.
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import dataclass
from typing import Any, cast

import torch

from disagmoe_ds.colocated.build import build_colocated_rank, preflight_colocated
from disagmoe_ds.colocated.layout import ColocatedConfig
from disagmoe_ds.colocated.model import ColocatedModel
from disagmoe_ds.config import SECTION, add_section_flags, section_values
from disagmoe_ds.fp8.frozen import held_values
from disagmoe_ds.launch.local import spawn_local
from disagmoe_ds.models.lora_settings import lora_of
from disagmoe_ds.models.tensor_parallel import shard_of
from disagmoe_ds.parity.compare import RankRecord, capture_grads, compare
from disagmoe_ds.parity.harness import build_for_verify, cli, run_args, train_steps
from disagmoe_ds.parity.reference import VerifyArgs, make_batches, reference
from disagmoe_ds.parity.run_flags import add_run_args
from disagmoe_ds.runtime.rank import RankRuntime

# the section keys taken as flags (config.SECTION_FLAGS: the same flags as run_pretrain.py's)
KEYS = ("micro_batches", "fp8", "attention", "transport", "activation_checkpointing", "selective_recompute",
        "recompute", "sequence_parallel", "tensor_parallel")  # fmt: skip


@dataclass(frozen=True)
class ColocatedVerifyArgs(VerifyArgs):
    """``VerifyArgs`` with the co-located config in place of the disaggregated layout."""

    cfg: ColocatedConfig  # type: ignore[assignment]  # the mode's own config: what the shared harness reads of it

    def ds_config(self) -> dict[str, Any]:
        config = super().ds_config()
        config.pop(SECTION)
        return config


def rank_main(rank: int, args: ColocatedVerifyArgs) -> RankRecord:
    """One rank: build, train, return losses, grad norms, and its share of the parameters and gradients."""
    runtime = build_for_verify(build_colocated_rank, args)
    grads = capture_grads(runtime, _written)
    vocab = runtime.module.config.vocab_size
    # the s x t ranks of a batch lane (and of every pipeline stage) read that lane's batches; each keeps its slice
    lane = args.cfg.batch_lane_of(runtime.role.index)
    losses, norms = train_steps(runtime, args, lambda step: make_batches(args, vocab, step, lane=lane))
    values = {n: p.detach() for n, p in runtime.module.named_parameters()} | held_values(runtime.module)  # FP8 base
    params = _written(runtime, values)
    return {"rank": rank, "losses": losses, "grad_norms": norms, "params": params, "grads": grads}


def _written(runtime: RankRuntime, tensors: dict[str, torch.Tensor]) -> dict[str, tuple]:
    """One copy of every parameter under HF names: expert slices from their first replica, attention-head shards
    (tensor parallel) as ``(rank, tensor, dim)`` from each stage's first TP group, and what a stage replicates from
    its lane 0."""
    hf_names = cast(ColocatedModel, runtime.module).hf_names()
    shards = {n: shard_of(p) for n, p in runtime.module.named_parameters()}
    role = runtime.role
    out: dict[str, tuple] = {}
    for name, value in tensors.items():
        hf_name, first = hf_names[name]
        shard = shards.get(name)
        if name.startswith("experts."):
            if role.edp_rank == 0:
                out[hf_name] = (first, value.float().clone())
        elif shard is not None:
            if role.index < shard.size:
                out[hf_name] = (shard.rank, value.float().clone(), shard.dim)
        elif role.index == 0:
            out[hf_name] = (first, value.float().clone())
    return out


def run_colocated_verify(args: ColocatedVerifyArgs, *, timeout_s: float = 600.0) -> dict[str, Any]:
    """Start the ranks on this machine (CPU, gloo), then compare with the reference."""
    preflight_colocated(args.model, args.cfg, args.ds_config(), args.cfg.world_size)
    ranks = spawn_local(rank_main, args.cfg.world_size, args=(args,), timeout_s=timeout_s)
    return compare(ranks, reference(args, args.cfg.batch_lanes), args)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m disagmoe_ds.colocated.verify",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--world-size", type=int, default=2, help="W: ranks, each with attention and an expert slice")
    p.add_argument("--ep-size", type=int, default=2, help="expert-parallel ranks per copy of the experts (divides W)")
    p.add_argument("--pp-size", type=int, default=1, help="pipeline stages over the decoder layers (divides W)")
    p.add_argument("--virtual-stages", type=int, default=1, help="chunks of layers per stage (interleaved 1F1B)")
    p.add_argument(
        "--stage-layers",
        type=lambda text: tuple(int(n) for n in text.split(",")),
        help="decoder layers per (virtual) pipeline stage, in execution order, e.g. 1,3 [as even as they go]",
    )
    add_section_flags(p, KEYS, cli="colocated_verify")
    add_run_args(p, zero_help="ZeRO stage")
    return p


def parse_args(argv: list[str] | None) -> ColocatedVerifyArgs:
    a = build_parser().parse_args(argv)
    cfg = ColocatedConfig(
        world_size=a.world_size,
        ep_size=a.ep_size,
        pp_size=a.pp_size,
        virtual_stages=a.virtual_stages,
        stage_layers=a.stage_layers,
        **section_values(a, KEYS),
        lora=lora_of(a),
    )
    return run_args(ColocatedVerifyArgs, a, cfg)


def main(argv: list[str] | None = None) -> int:
    return cli(
        argv,
        parse_args,
        run_colocated_verify,
        prog="colocated verify",
        rank_fn=rank_main,
        preflight_fn=preflight_colocated,
    )


if __name__ == "__main__":
    sys.exit(main())
