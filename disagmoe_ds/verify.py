"""disagmoe-verify: train a few steps disaggregated and compare with the single-process HF model.

    disagmoe-verify --model hf_models/tiny-qwen2-moe --attention-gpus 2 --ffn-gpus 2 --micro-batches 3 --json

Without a launcher it starts attention_gpus + ffn_gpus CPU ranks itself (gloo); under ``deepspeed`` or
``torchrun`` it runs as one of the launched ranks. The reference is the HF model on the same batches: the mean
loss over lanes and micro-batches, global-norm clipping, the same AdamW. It prints a JSON summary with the max
abs difference of the losses, the gradient norms and the parameters after every step; exit code 0 only on pass.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable
from dataclasses import dataclass, fields
from typing import Any

import torch
import torch.distributed as dist

from disagmoe_ds.comm.transport import TRANSPORTS
from disagmoe_ds.config import SIDES, DisagMoEConfig
from disagmoe_ds.data.loader import to_device
from disagmoe_ds.engine import build as engine_build
from disagmoe_ds.engine.ds_state import gathered
from disagmoe_ds.engine.timeline import start_clock, write_job_timeline
from disagmoe_ds.errors import DisagMoEError
from disagmoe_ds.launch.env import detect_launcher, init_from_env
from disagmoe_ds.launch.local import spawn_local
from disagmoe_ds.models.loading import load_model
from disagmoe_ds.models.lora import LoraSettings, add_lora_args, lora_of
from disagmoe_ds.models.naming import attention_name_to_hf, expert_name_to_hf
from disagmoe_ds.models.skew import skew_router
from disagmoe_ds.models.split import hf_reference_loss

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
# fp32: only the order of sums differs from the reference (expert partials, lane reduction); bf16: see README.
TOLERANCE = {"fp32": 1e-5, "bf16": 5e-2}
# Adam's first steps move each weight by about lr * g / (|g| + eps): where |g| is near eps, an ulp-level change of g
# (another summation order) changes the update by up to lr * dg / eps, and later steps inherit it. lr / eps = 10
# keeps that below the tolerance; the gradients of every step are compared directly as well.
ADAM_EPS = 1e-4


@dataclass(frozen=True)
class VerifyArgs:
    """One verification run; the defaults are the command line's."""

    model: str
    cfg: DisagMoEConfig
    zero: int = 0
    steps: int = 2
    dtype: str = "fp32"
    seq_len: int = 16
    micro_batch_size: int = 1
    clip: float = 1.0
    lr: float = 1e-3
    seed: int = 0
    skew: bool = False
    timeline: str | None = None
    packed: bool = False  # two documents per sequence: position ids restart mid-sequence (block-diagonal mask)

    def ds_config(self) -> dict[str, Any]:
        config: dict[str, Any] = {
            "disagmoe": self.cfg.to_dict(),
            "zero_optimization": {"stage": self.zero},
            "gradient_clipping": self.clip,
            # torch's AdamW, the reference's optimizer (DeepSpeed's FusedAdam would also JIT-compile on GPUs)
            "optimizer": {
                "type": "AdamW",
                "params": {"lr": self.lr, "weight_decay": 0.0, "eps": ADAM_EPS, "torch_adam": True},
            },
        }
        if self.dtype == "bf16":
            config["bf16"] = {"enabled": True}
        return config


def make_batches(args: VerifyArgs, vocab_size: int, step: int, lane: int) -> list[dict[str, torch.Tensor]]:
    """The K micro-batches lane ``lane`` trains on at ``step`` (deterministic, shared with the reference)."""
    gen = torch.Generator().manual_seed(args.seed * 1_000_003 + step * 1009 + lane)
    batches = []
    for _ in range(args.cfg.micro_batches):
        ids = torch.randint(3, vocab_size, (args.micro_batch_size, args.seq_len), generator=gen)
        batch = {"input_ids": ids, "labels": ids.clone()}
        if args.packed:
            first = args.seq_len // 2 + 1
            positions = torch.cat([torch.arange(first), torch.arange(args.seq_len - first)])
            batch["position_ids"] = positions.expand(args.micro_batch_size, -1).contiguous()
        batches.append(batch)
    return batches


def load_for_verify(args: VerifyArgs):

    model = load_model(args.model, dtype=DTYPES[args.dtype], seed=args.seed)
    if args.skew:
        skew_router(model, spread=True)
    return model


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
        params = _hf_named(runtime, {n: p.detach() for n, p in runtime.module.named_parameters()}) if writer else {}
    return {"rank": rank, "losses": losses, "grad_norms": norms, "params": params, "grads": grads if writer else []}


def build_for_verify(build: Callable[..., Any], args: VerifyArgs):
    """``build`` (either mode's rank builder, ``engine.rank.RankBuilder``) on the verify run's model and shapes;
    with ``cuda_graphs``, the graphs captured."""
    runtime = build(
        args.model,
        args.ds_config(),
        args.cfg,
        micro_batch_size=args.micro_batch_size,
        dtype=DTYPES[args.dtype],
        model=load_for_verify(args),
        seed=args.seed,
        seq_len=args.seq_len,
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


def capture_grads(runtime) -> list[dict[str, tuple[int, torch.Tensor]]]:
    """Record, at every step, the gradients the optimizer is about to apply (reduced and clipped), by HF name."""
    optimizer = runtime.engine.optimizer
    inner = getattr(optimizer, "optimizer", optimizer)  # ZeRO wraps a torch optimizer
    captured: list[dict[str, tuple[int, torch.Tensor]]] = []

    def hook(*_):
        named = {n: _full_grad(optimizer, p) for n, p in runtime.module.named_parameters()}
        captured.append(_hf_named(runtime, {n: g for n, g in named.items() if g is not None}))

    inner.register_step_pre_hook(hook)
    return captured


def _full_grad(optimizer, param: torch.Tensor) -> torch.Tensor | None:
    """The reduced, clipped gradient the optimizer applies to ``param`` (assembled from ZeRO partitions)."""
    if hasattr(optimizer, "fp32_partitioned_groups_flat"):  # ZeRO-3: the param's rows of its fp32 partition's grad
        if len(optimizer.fp32_partitioned_groups_flat) > 1:
            raise RuntimeError("verify reads ZeRO-3 gradients of one optimizer sub-group (raise sub_group_size)")
        group, offset, numel = optimizer.grad_position[optimizer.get_param_id(param)]
        grad = optimizer.fp32_partitioned_groups_flat[group].grad.narrow(0, offset, numel)
        return optimizer._fp32_state_allgather(param, grad)
    mapping = getattr(param, "_hp_mapping", "plain")
    if mapping == "plain":
        return param.grad
    full = torch.zeros(param.numel(), dtype=torch.float32, device=param.device)
    if mapping is not None:  # this rank's ZeRO partition holds a fragment of the parameter
        flat = optimizer.single_partition_of_fp32_groups[mapping.param_group_index].grad
        hp, lp = mapping.hp_fragment_address, mapping.lp_fragment_address
        full.narrow(0, lp.start, lp.numel).copy_(flat.narrow(0, hp.start, hp.numel))
    torch.distributed.all_reduce(full, group=param._dp_group)
    return full.view_as(param)


def _hf_named(runtime, tensors: dict[str, torch.Tensor]) -> dict[str, tuple[int, torch.Tensor]]:
    """This rank's tensors under HF names; expert slices carry their first expert id (to reassemble them)."""
    if runtime.role.is_attention:
        return {attention_name_to_hf(n): (0, t.float().clone()) for n, t in tensors.items()}
    return {expert_name_to_hf(n): (runtime.module.first_expert, t.float().clone()) for n, t in tensors.items()}


def reference(args: VerifyArgs, lanes: int) -> dict[str, Any]:
    """The single-process HF model trained on the same batches; with LoRA, under PEFT, from the adapters the ranks
    start from."""
    model = load_for_verify(args)
    lora = args.cfg.lora
    if lora is not None:
        from disagmoe_ds.models import peft_format

        model = peft_format.peft_model(model, lora, peft_format.initial_adapters(model, lora, seed=args.seed))
    model.train()
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=args.lr, weight_decay=0.0, eps=ADAM_EPS)
    losses, norms, grads = [], [], []
    vocab = model.config.vocab_size
    for step in range(args.steps):
        opt.zero_grad()
        total = 0.0
        count = lanes * args.cfg.micro_batches
        for lane in range(lanes):
            for batch in make_batches(args, vocab, step, lane):
                out = model(
                    input_ids=batch["input_ids"],
                    labels=batch["labels"],
                    position_ids=batch.get("position_ids"),
                    use_cache=False,
                )
                loss = hf_reference_loss(model if lora is None else model.get_base_model(), out)
                (loss / count).backward()
                total += loss.item() / count
        losses.append(total)
        norm = torch.nn.utils.clip_grad_norm_(params, args.clip if args.clip > 0 else float("inf"))
        norms.append(norm.item())
        grads.append(
            _ours(
                {n: p.grad.detach().float().clone() for n, p in model.named_parameters() if p.grad is not None},
                model,
                lora,
            )
        )
        opt.step()
    params = _ours({n: p.detach().float() for n, p in model.named_parameters()}, model, lora)
    return {"losses": losses, "grad_norms": norms, "grads": grads, "params": params}


def _ours(tensors: dict[str, torch.Tensor], model, lora: LoraSettings | None) -> dict[str, torch.Tensor]:
    """The reference's tensors under the ranks' HF names (a PEFT model's renamed, its expert factors re-laid)."""
    if lora is None:
        return tensors
    from disagmoe_ds.models.peft_format import to_ours

    return to_ours(model, tensors)


def _assemble(pieces_by_rank: list[dict[str, tuple[int, torch.Tensor]]]) -> dict[str, torch.Tensor]:
    """Join the ranks' tensors into HF's: expert slices concatenated in expert order."""
    merged: dict[str, list[tuple[int, torch.Tensor]]] = {}
    for pieces in pieces_by_rank:
        for name, (first, value) in pieces.items():
            merged.setdefault(name, []).append((first, value))
    return {n: torch.cat([v for _, v in sorted(p, key=lambda x: x[0])]) for n, p in merged.items()}


def _max_diff(ours: dict[str, torch.Tensor], ref: dict[str, torch.Tensor]) -> float:
    missing = sorted(set(ref) - set(ours))
    if missing:
        raise RuntimeError(f"the disaggregated run has no values for {missing[:3]}...")
    return max((ours[n] - ref[n]).abs().max().item() for n in ref)


def compare(ranks: list[dict[str, Any]], ref: dict[str, Any], args: VerifyArgs) -> dict[str, Any]:
    param_diff = _max_diff(_assemble([r["params"] for r in ranks]), ref["params"])
    grad_diff = max(
        _max_diff(_assemble([r["grads"][step] for r in ranks if r["grads"]]), ref["grads"][step])
        for step in range(args.steps)
    )
    loss_diff = max(abs(a - b) for a, b in zip(ranks[0]["losses"], ref["losses"]))
    norms = ranks[0]["grad_norms"]
    norm_diff = max(abs(a - b) for a, b in zip(norms, ref["grad_norms"])) if all(n is not None for n in norms) else None
    tol = TOLERANCE[args.dtype]
    ok = (
        loss_diff <= tol
        and param_diff <= tol
        and grad_diff <= tol
        and (norm_diff is None or norm_diff <= tol * max(1.0, *norms))
    )
    return {
        "model": args.model,
        "layout": args.cfg.to_dict(),
        "zero": args.zero,
        "dtype": args.dtype,
        "steps": args.steps,
        "losses": ranks[0]["losses"],
        "reference_losses": ref["losses"],
        "grad_norms": norms,
        "reference_grad_norms": ref["grad_norms"],
        "max_abs_diff": {"loss": loss_diff, "grad_norm": norm_diff, "grads": grad_diff, "params": param_diff},
        "tolerance": tol,
        "pass": ok,
    }


def run_verify(args: VerifyArgs, *, timeout_s: float = 600.0) -> dict[str, Any]:
    """Start the ranks on this machine (CPU, gloo), then compare with the reference."""
    engine_build.preflight(args.model, args.cfg, args.ds_config(), args.cfg.world_size)
    ranks = spawn_local(rank_main, args.cfg.world_size, args=(args,), timeout_s=timeout_s)
    return compare(ranks, reference(args, args.cfg.batch_lanes), args)


def run_launched(
    args: VerifyArgs, *, rank_fn: Callable[[int, Any], dict[str, Any]] = rank_main, preflight_fn=None
) -> dict[str, Any] | None:
    """Run as one rank of a job a launcher started; the summary on global rank 0, None elsewhere.

    ``rank_fn`` and ``preflight_fn`` default to the disaggregated runtime's (the co-located verify passes its own).
    """
    init_from_env(comm_timeout_s=args.cfg.comm_timeout_s)
    (preflight_fn or engine_build.preflight)(args.model, args.cfg, args.ds_config(), dist.get_world_size())
    result = rank_fn(dist.get_rank(), args)
    gathered = [None] * dist.get_world_size() if dist.get_rank() == 0 else None
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


def add_run_args(p: argparse.ArgumentParser, *, zero_help: str) -> None:
    """The flags both verifies share: model, batches, optimizer, routing, outputs (the layout flags are each mode's)."""
    p.add_argument("--model", default="hf_models/tiny-qwen3-moe", help="HF model directory or config-only directory")
    p.add_argument("--micro-batch-size", type=int, default=1, help="sequences per micro-batch")
    p.add_argument("--zero", type=int, default=0, choices=(0, 1, 2), help=zero_help)
    p.add_argument("--steps", type=int, default=2, help="optimizer steps")
    p.add_argument("--dtype", choices=sorted(DTYPES), default="fp32")
    p.add_argument("--seq-len", type=int, default=16)
    p.add_argument("--clip", type=float, default=1.0, help="global-norm gradient clipping (0: off)")
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--skew", action="store_true",
        help="every token of the i-th MoE layer picks expert i first: the worst imbalance, another expert per layer",
    )  # fmt: skip
    p.add_argument("--packed", action="store_true", help="two documents per sequence (position ids restart)")
    p.add_argument("--timeline", metavar="PATH", help="write the last step's Chrome/Perfetto trace of all ranks")
    p.add_argument("--json", action="store_true", help="print the JSON summary on one line")
    add_lora_args(p)
    p.add_argument("--local_rank", type=int, default=None, help=argparse.SUPPRESS)  # set by the deepspeed launcher


def run_args(cls: type[VerifyArgs], a: argparse.Namespace, cfg: Any) -> VerifyArgs:
    """``cls`` (``VerifyArgs`` or a subclass) from ``add_run_args``'s flags and the mode's config."""
    return cls(cfg=cfg, **{f.name: getattr(a, f.name) for f in fields(VerifyArgs) if f.name != "cfg"})


def main(argv: list[str] | None = None) -> int:
    return cli(argv, parse_args, run_verify, prog="disagmoe-verify")


def cli(
    argv: list[str] | None,
    parse: Callable[[list[str] | None], VerifyArgs],
    run_local: Callable[[VerifyArgs], dict[str, Any]],
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


if __name__ == "__main__":
    sys.exit(main())
