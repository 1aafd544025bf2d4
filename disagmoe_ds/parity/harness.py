"""How either mode's verify runs: build a rank on the run's model, train its steps, gather the ranks' results
(launched or local), the flags both verifies share, and the command line's exit codes."""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable
from dataclasses import fields
from typing import Any, TypeVar

import torch
import torch.distributed as dist

from disagmoe_ds.data.loader import to_device
from disagmoe_ds.errors import DisagMoEError
from disagmoe_ds.launch.env import detect_launcher, init_from_env
from disagmoe_ds.parity.compare import compare
from disagmoe_ds.parity.reference import (
    DTYPES,
    VerifyArgs,
    load_for_verify,
    reads_fp8_blocks,
    reference,
)
from disagmoe_ds.runtime.timeline import start_clock, write_job_timeline


def build_for_verify(build: Callable[..., Any], args: VerifyArgs, **extra: Any):
    """``build`` (either mode's rank builder, ``runtime.rank.RankBuilder``) on the verify run's model and shapes
    (``extra``: one mode's own arguments); with ``cuda_graphs``, the graphs captured."""
    runtime = build(
        args.model,
        args.ds_config(),
        args.cfg,
        micro_batch_size=args.micro_batch_size,
        dtype=DTYPES[args.dtype],
        model=None if reads_fp8_blocks(args) else load_for_verify(args),  # an FP8 checkpoint: read by the ranks
        seed=args.seed,
        seq_len=args.seq_len,
        **extra,
    )
    if args.cfg.cuda_graphs:
        runtime.executor.warm_up(args.seq_len, packed=args.packed)
    return runtime


def train_steps(
    runtime, args: VerifyArgs, batches_of: Callable[[int], list[dict[str, torch.Tensor]] | None]
) -> tuple[list[float], list[float | None]]:
    """Train ``args.steps`` steps, step s on ``batches_of(s)`` (moved to the rank's device); the last step is
    written as a job timeline when ``args.timeline`` is set. Returns the losses and global grad norms."""
    losses, norms = [], []
    for step in range(args.steps):
        last = step == args.steps - 1
        batches = batches_of(step)
        if batches is not None:
            batches = to_device(batches, runtime.engine.device)
        runtime.executor.record_timeline(bool(args.timeline) and last)
        t0 = start_clock()
        result = runtime.executor.train_batch(batches)
        losses.append(result.loss)
        norms.append(result.grad_norm)
        if args.timeline and last:
            write_job_timeline(runtime.executor.timeline, t0, args.timeline)
    return losses, norms


def run_launched(
    args: VerifyArgs, *, rank_fn: Callable[[int, Any], dict[str, Any]], preflight_fn: Callable[..., Any]
) -> dict[str, Any] | None:
    """Run as one rank of a job a launcher started (``rank_fn``, after ``preflight_fn``: the mode's); the summary
    on global rank 0, None elsewhere."""
    init_from_env(comm_timeout_s=args.cfg.comm_timeout_s)
    preflight_fn(args.model, args.cfg, args.ds_config(), dist.get_world_size())
    result = rank_fn(dist.get_rank(), args)
    gathered: list[Any] | None = [None] * dist.get_world_size() if dist.get_rank() == 0 else None
    dist.gather_object(_to_cpu(result), gathered, dst=0)
    summary = compare(gathered, reference(args, args.cfg.batch_lanes), args) if gathered is not None else None
    # Tear the groups down together, once rank 0 has its summary: a rank that exits first and leaves its many
    # process groups to the interpreter's finalisation can abort in their threads' destructors, and the launcher
    # then kills rank 0 before it prints.
    dist.barrier()
    dist.destroy_process_group()
    return summary


def _to_cpu(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return value.cpu()
    if isinstance(value, dict):
        return {k: _to_cpu(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(_to_cpu(v) for v in value)
    return value


Args = TypeVar("Args", bound=VerifyArgs)  # a mode's verify arguments


def run_args(cls: type[Args], a: argparse.Namespace, cfg: Any) -> Args:
    """``cls`` (``VerifyArgs`` or a subclass) from ``add_run_args``'s flags and the mode's config."""
    return cls(cfg=cfg, **{f.name: getattr(a, f.name) for f in fields(VerifyArgs) if f.name != "cfg"})


def cli(
    argv: list[str] | None,
    parse: Callable[[list[str] | None], Args],
    run_local: Callable[[Args], dict[str, Any]],
    *,
    prog: str,
    **launched: Any,
) -> int:
    """Parse, run here (``run_local``) or as a launcher's rank (``run_launched(**launched)``), print the summary.

    Exit code 0 on pass, 1 on a mismatch, 2 on a configuration error (one line on stderr).
    """
    try:
        args = parse(argv)
        summary = run_launched(args, **launched) if detect_launcher() else run_local(args)
    except DisagMoEError as err:
        print(f"{prog}: error: {err}", file=sys.stderr)
        return 2
    if summary is None:  # not global rank 0 of a launched job
        return 0
    one_line = "--json" in (argv if argv is not None else sys.argv)
    print(json.dumps(summary, indent=None if one_line else 2))
    return 0 if summary["pass"] else 1
