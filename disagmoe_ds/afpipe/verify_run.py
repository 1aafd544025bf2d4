"""disagmoe-verify's work once its command line is read (``afpipe.verify``): every rank trains a few steps
disaggregated, and the result is compared with the single-process HF model.

A verify run has no job plan: each rank costs its schedule's tasks itself (``planner.runtime_costs.job_costs``, from
the same inputs on every rank) and hands them to the build, as a training job's plan does.
"""

from __future__ import annotations

from disagmoe_ds.afpipe import build
from disagmoe_ds.checkpoint.ds_state import gathered
from disagmoe_ds.fp8.frozen import held_values
from disagmoe_ds.jsonfile import JsonObject
from disagmoe_ds.launch.local import spawn_local
from disagmoe_ds.models.loading import load_config
from disagmoe_ds.parity.compare import RankRecord, capture_grads, compare, hf_named
from disagmoe_ds.parity.harness import build_for_verify, train_steps
from disagmoe_ds.parity.reference import VerifyArgs, make_batches, reference
from disagmoe_ds.planner.runtime_costs import job_costs
from disagmoe_ds.schedule import Costs


def verify_costs(args: VerifyArgs) -> Costs:
    """The task costs of the verify run's schedule: the planner's for its model, layout and sequence length."""
    layout = build.preflight(args.model, args.cfg, args.ds_config(), args.cfg.world_size)
    config = load_config(args.model)
    return job_costs(config.to_dict(), layout, args.cfg, seq_len=args.seq_len, micro_batch_size=args.micro_batch_size)


def rank_main(rank: int, args: VerifyArgs) -> RankRecord:
    """One rank: build, train ``steps`` steps, return losses, grad norms and its parameters under HF names."""
    # build.build_rank is looked up per call: tests wrap it
    runtime = build_for_verify(build.build_rank, args, schedule_costs=verify_costs(args))
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
        values = {n: p.detach() for n, p in runtime.module.named_parameters()} | held_values(runtime.module)
        params = hf_named(runtime, values) if writer else {}  # a frozen FP8 base (``fp8.frozen``): what it stands for
    return {"rank": rank, "losses": losses, "grad_norms": norms, "params": params, "grads": grads if writer else []}


def run_verify(args: VerifyArgs, *, timeout_s: float = 600.0) -> JsonObject:
    """Start the ranks on this machine (CPU, gloo), then compare with the reference."""
    build.preflight(args.model, args.cfg, args.ds_config(), args.cfg.world_size)
    ranks = spawn_local(rank_main, args.cfg.world_size, args=(args,), timeout_s=timeout_s)
    return compare(ranks, reference(args, args.cfg.batch_lanes), args)
