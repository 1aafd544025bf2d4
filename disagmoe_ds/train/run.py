"""The training job of ``run_pretrain.py``, once its command line is read: the preflight (layout, data, checkpoint;
no rank started, nothing allocated), the ranks started here or joined under a launcher, and on every rank its
engine and the loop. The mode (``train.modes``) decides the preflight, the banner's layout lines and the build; the
loop is the same for both. ``run_pretrain.py`` reads the flags first (``train.flags``, torch-free), so ``--help``
answers before this module loads torch and DeepSpeed.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

from disagmoe_ds.checkpoint.export import export_hf
from disagmoe_ds.checkpoint.resume import Freezing, ResumePoint, check_resume, effective_freezing, locate, restore, save
from disagmoe_ds.config import DisagMoEConfig
from disagmoe_ds.data.loader import to_device
from disagmoe_ds.errors import ConfigError, DisagMoEError
from disagmoe_ds.launch import RankFailedError, detect_launcher, init_from_env, spawn_local
from disagmoe_ds.launch.hostfile import (
    check_gpu_types,
    check_hostfile,
    check_node_groups,
    deepspeed_command,
    describe,
    filters_slots,
    strip_launch_flags,
)
from disagmoe_ds.layout import JobLayout
from disagmoe_ds.models.fp8_base import base_fp8_line
from disagmoe_ds.models.loading import load_config
from disagmoe_ds.plot import write_loss_plot
from disagmoe_ds.runtime.rank import RankRuntime
from disagmoe_ds.runtime.step import StepResult
from disagmoe_ds.runtime.timeline import start_clock, write_job_timeline
from disagmoe_ds.train.args import TrainArgs, resolve_command_line
from disagmoe_ds.train.balance import bias_update_rate, expert_load, imbalance, update_expert_bias
from disagmoe_ds.train.data import TrainData, check_data_args, eval_batches, lane_loader, prepare_data
from disagmoe_ds.train.evaluation import EvalLoss, Evaluator, is_eval_step, weights_of
from disagmoe_ds.train.failures import job_key, report_launched_failure, report_rank_failure
from disagmoe_ds.train.interrupt import STOPPED_EXIT, StopRequest, parent_waits_for_ranks
from disagmoe_ds.train.job import launched_rank_and_world, local_backend, rank_device, seed_step, share_cores
from disagmoe_ds.train.metrics import Throughput, model_facts, peak_tflops
from disagmoe_ds.train.model import check_train_model, load_train_model
from disagmoe_ds.train.modes import build, mode_of, schedule_costs
from disagmoe_ds.train.plan import JobPlan
from disagmoe_ds.train.progress import Progress, banner, training_state_line
from disagmoe_ds.train.resources import check_resources


def run_job(ns: argparse.Namespace, argv: list[str], *, root: Path, script: Path) -> int:
    """``run_pretrain.py``'s job for its command line ``ns`` (read from ``argv``): check, then train here, as a
    launcher's rank, or relaunched under ``deepspeed --hostfile`` (``script``: the file to relaunch). The exit code:
    0 done, 2 refused (one line), 1 a rank failed, ``STOPPED_EXIT`` stopped on request after its save."""
    try:
        args = resolve_command_line(ns, root=root)
        if ns.check_hostfile is not None or ns.hostfile is not None:
            return check_or_relaunch(args, ns, argv, script)
        if detect_launcher() is None:
            stopped = run_local(args)  # no launcher: validate, then fork the ranks here
        else:
            stopped = run_launched(args)  # torchrun, deepspeed, mpirun: this process is one rank
    except DisagMoEError as err:
        print(f"run_pretrain.py: error: {err}", file=sys.stderr)
        return 2
    except RankFailedError as err:
        print(f"run_pretrain.py: {report_rank_failure(err)}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("run_pretrain.py: aborted", file=sys.stderr)
        return STOPPED_EXIT
    return STOPPED_EXIT if stopped else 0


def preflight_run(args: TrainArgs, world_size: int, *, hashes: bool = True, local: bool = False) -> JobPlan:
    """What can be checked before any rank starts: layout vs model and world size, ZeRO rules, the weights of
    ``--init-from``, data paths and lengths, the balancing setting, host memory (``local``: the ranks are CPU
    processes of this machine) and disk space for a checkpoint, and that the checkpoint to resume is intact
    (``hashes``: its files' sha256 too, not only their sizes) and belongs to this mode, model, layout, seed and
    freezing, with steps left to train.

    Returns:
        The job's plan: the run's settings (with the freezing the checkpoint records), the model's HF config, the
        mode's layout, the task costs of its schedule (the disaggregated mode's), and the checkpoint to resume
        from, if any.
    """
    config = load_config(args.model)
    mode = mode_of(args)
    layout = mode.preflight(config, args.cfg, args.ds_config, world_size, seq_len=args.seq_len)
    costs = schedule_costs(args, config, layout)
    check_train_model(args, config)
    check_data_args(args, config)
    bias_update_rate(args.bias_update_rate, config)
    check_resources(args, config, layout, cpu_ranks_here=local and not torch.cuda.is_available())
    if args.resume is None:
        return JobPlan(args, config, layout, costs, None)
    point = _check_resume(args, config, layout, num_samples=None, hashes=hashes)
    if point.step >= args.steps and not args.eval_only:
        raise ConfigError(
            f"checkpoint {point.path} is at step {point.step} and --steps is {args.steps}: nothing left to train; "
            f"pass --steps above {point.step} (the run's total, not the steps to add)"
        )
    frozen = effective_freezing(point, args.freeze_router, args.freeze_attention)
    args = dataclasses.replace(args, freeze_router=frozen["router"], freeze_attention=frozen["attention"])
    return JobPlan(args, config, layout, costs, point)


def _check_resume(args: TrainArgs, config, layout, *, num_samples: int | None, hashes: bool = True) -> ResumePoint:
    if args.resume is None:
        raise ValueError("_check_resume needs --resume")
    root, tag = locate(args.resume, args.save_dir)
    return check_resume(root, tag, config, layout, num_samples=num_samples, seed=args.seed, frozen=_freezing(args),
                        ds_config=args.ds_config, hashes=hashes)  # fmt: skip


def run_local(args: TrainArgs) -> bool:
    """Fork the job's ranks here and train; True when the run stopped on request (after its save)."""
    plan = preflight_run(args, args.cfg.world_size, local=True)
    backend = local_backend(plan.layout.world_size)
    data = prepare_data(plan.args, plan.config)  # once, here: the forked ranks inherit the samples
    if plan.resume is not None and data.dataset is not None and not args.eval_only:  # it trains on the same samples
        _check_resume(plan.args, plan.config, plan.layout, num_samples=len(data.dataset), hashes=False)
    with parent_waits_for_ranks("run_pretrain.py: stopping after this step and saving; Ctrl-C again to abort"):
        stopped = spawn_local(
            train,
            plan.layout.world_size,
            args=(plan, data),
            timeout_s=None,
            comm_timeout_s=args.cfg.comm_timeout_s,
            backend=backend,
        )
    return any(stopped)


def run_launched(args: TrainArgs) -> bool:
    """This process is one rank of a launcher's job; True when the run stopped on request (after its save)."""
    rank, world_size = launched_rank_and_world()
    try:
        plan = preflight_run(args, world_size, hashes=rank == 0)  # one rank reads every file
    except DisagMoEError:
        if rank == 0:
            raise
        sys.exit(2)  # every rank found the same problem; rank 0 reports it
    share_cores()
    init_from_env(comm_timeout_s=plan.args.cfg.comm_timeout_s)
    key = job_key()
    try:
        stopped = train(dist.get_rank(), plan, None)
    except Exception as err:  # one line from the first failing rank, every traceback in a file
        line = report_launched_failure(key, dist.get_rank(), err)
        if line is not None:
            print(f"run_pretrain.py: {line}", file=sys.stderr, flush=True)
        os._exit(1)  # no teardown: the peers are failing or blocked, and the launcher ends them
    dist.barrier()
    dist.destroy_process_group()
    return stopped


def check_or_relaunch(args: TrainArgs, ns: argparse.Namespace, argv: list[str], script: Path) -> int:
    """``--check-hostfile``: validate and exit. ``--hostfile``: validate, then become ``deepspeed --hostfile``."""
    if ns.check_hostfile is not None:
        hosts = check_hostfile(ns.check_hostfile, world_size=args.cfg.world_size)
        check_placement(ns.check_hostfile, hosts, args, preflight_run(args, args.cfg.world_size).layout)
        print(f"{ns.check_hostfile}: ok, {describe(hosts)} = {args.cfg.world_size} ranks")
        return 0
    subset = filters_slots(ns.launcher_args)
    hosts = check_hostfile(ns.hostfile, world_size=None if subset else args.cfg.world_size)
    plan = preflight_run(args, args.cfg.world_size)
    if not subset:  # the slots are the ranks' hosts
        check_placement(ns.hostfile, hosts, args, plan.layout)
    command = deepspeed_command(ns.hostfile, ns.launcher_args, str(script), strip_launch_flags(argv))
    os.execvp(command[0], command)


def check_placement(path: Path, hosts: dict[str, int], args: TrainArgs, layout: JobLayout) -> None:
    """What a hostfile's hosts must hold for this job: ``node_dedup``'s node groups on one host each and, on a
    disaggregated job whose hosts carry GPU types, each side's ranks on its type's hosts."""
    check_node_groups(path, hosts, layout.group_ranks().exchange_nodes)
    if isinstance(args.cfg, DisagMoEConfig):  # a co-located rank holds both sides
        sides = ["attention" if layout.role_of(r).is_attention else "ffn" for r in range(layout.world_size)]
        attention, ffn = args.cfg.side_clusters
        check_gpu_types(path, hosts, sides, {"attention": attention, "ffn": ffn})


def train(rank: int, plan: JobPlan, data: TrainData | None) -> bool:
    """One rank: build its engine, then run the steps. Every rank runs every step (they hold collectives).

    Returns:
        True when the run stopped on request (a signal, a lost launcher) before ``args.steps``, after its save.
    """
    stop = StopRequest().install()
    device = rank_device()
    args, config, layout, resume = plan.args, plan.config, plan.layout, plan.resume
    mode = mode_of(args)
    role = layout.role_of(rank)
    # the lanes of A-group 0 embed; every co-located rank reads (each pipeline stage builds its context from them)
    reads_data = role.is_attention and (role.group == 0 or layout.mode == "colocated")
    lane_data = None  # the samples, on the ranks that read them; under a launcher every lane builds the same
    if reads_data:
        lane_data = data if data is not None else prepare_data(args, config)
    facts = model_facts(args.model, args.seq_len)
    rate = bias_update_rate(args.bias_update_rate, config)
    if rank == 0 and lane_data is not None:  # rank 0 is lane 0 of A-group 0 in either mode: it reads the data
        layout_lines = mode.describe(args.cfg, layout, config, plan.schedule_costs)
        layout_lines.append(training_state_line(args, config, layout))
        lines = banner(
            args, config, layout_lines=layout_lines, facts=facts, data=lane_data, bias_rate=rate, resume=resume
        )
        print("\n".join(lines), flush=True)

    init = load_train_model(args)
    runtime = build(
        args, layout, schedule_costs=plan.schedule_costs, model=init.model, weights=init.weights, device=device
    )
    fp8_base = base_fp8_line(runtime.module)  # LoRA over a checkpoint in FP8 blocks: what the base takes here
    if fp8_base is not None:
        print(f"rank {rank}: {fp8_base}", flush=True)
    data_lane = args.cfg.batch_lane_of(role.index)  # SP or TP: s (t) lanes read one share, in slices
    loader = None
    if lane_data is not None and not args.eval_only:  # this rank trains on the data
        loader = lane_loader(lane_data, args, data_lane, pin_memory=device.type == "cuda")
    start = restore(runtime, resume.root, resume.tag, loader, lanes=args.lanes) if resume is not None else 0
    evaluator = None
    if args.evaluates:  # collective
        evaluator = Evaluator(
            runtime, eval_batches(lane_data, args, data_lane) if lane_data is not None else None, device
        )
    progress = Progress(args, start_step=start) if rank == 0 else None
    if evaluator is not None and args.eval_only:
        evaluate_only(evaluator, start, progress, weights_of(args, resume))
        return False
    peak = peak_tflops(device, args.peak_tflops)
    throughput = Throughput(args.tokens_per_step, facts.flops_per_token, layout.world_size, peak)
    timeline_step = min(start + 1, args.steps - 1)  # the run's second step: the first pays one-off costs

    known = lane_data if lane_data is not None else data  # the samples this rank holds, if any
    tokenizer = known.tok if known is not None else None
    first_loss = last = None
    evaluated: tuple[int, EvalLoss] | None = None  # the last evaluation, after which step
    started = time.perf_counter()
    step = start
    while step < args.steps:
        tic = time.perf_counter()
        lr = runtime.engine.get_lr()[0]  # the rate this step uses (the scheduler advances inside the step)
        seed_step(args.seed, step, rank)
        batches = to_device(next(loader), device) if loader is not None else None  # prefetched by a thread
        result = run_step(runtime, batches, timeline=args.timeline if step == timeline_step else None)
        load_LE = expert_load(runtime, result)  # collective: the whole batch's tokens per expert, every layer
        update_expert_bias(runtime, load_LE, rate)  # DeepSeek-V3 auxiliary-loss-free balancing (0: off)
        step += 1
        first_loss, last = result.loss if first_loss is None else first_loss, result
        seconds = time.perf_counter() - tic  # the step's, without its evaluation
        evaluation = evaluator() if evaluator is not None and is_eval_step(args, step) else None  # collective
        evaluated = (step, evaluation) if evaluation is not None else evaluated
        if progress is not None:
            record = throughput.record(step, result, lr=lr, seconds=seconds, imbalance=imbalance(load_LE),
                                       eval_loss=evaluation.loss if evaluation is not None else None)  # fmt: skip
            progress.step(record)
        stopping = stop.agreed(device)  # collective: every rank leaves after the same step
        periodic = args.save_every and step % args.save_every == 0
        if stopping or periodic or step == args.steps:
            save_and_export(runtime, args, step, loader, tokenizer, progress)
        if stopping:
            if progress is not None:
                hint = "; continue with --resume" if args.save_dir is not None else " (no --save-dir: nothing saved)"
                progress.print(f"stopped on request after step {step} of {args.steps}{hint}")
            break

    if loader is not None:
        loader.close()
    if progress is not None:
        progress.close()
        seconds = time.perf_counter() - started
        print(summary_line(args, start, step, first_loss, last, seconds, evaluated), flush=True)
        if args.metrics_file is not None and step > start:
            print(f"loss plot: {write_loss_plot(args.metrics_file)}", flush=True)
    return step < args.steps


def evaluate_only(evaluator: Evaluator, step: int, progress: Progress | None, weights: str) -> None:
    """``--eval-only``: one evaluation of the loaded ``weights`` (those of ``step``), printed and recorded.
    Collective."""
    result = evaluator()
    if progress is not None:
        progress.evaluation(step, result.loss)
        progress.close()
        print(f"done: {result}, weights of {weights}", flush=True)


def save_and_export(
    runtime: RankRuntime, args: TrainArgs, step: int, loader, tokenizer, progress: Progress | None
) -> None:
    """The checkpoint (--save-dir) and the HF directory (--export-hf) of ``step``. Collective."""
    if args.save_dir is not None:
        path = save(runtime, args.save_dir, step, loader, keep_last=args.keep_last, seed=args.seed,
                    frozen=_freezing(args), tokenizer=tokenizer, ds_config=args.ds_config,
                    tokens_per_step=args.tokens_per_step)  # fmt: skip
        if progress is not None:
            progress.print(f"saved {path} (step {step})")
    lora = args.cfg.lora
    if args.export_hf is not None:
        export_hf(runtime, args.model, args.export_hf, dtype=args.torch_dtype, tokenizer=tokenizer, lora=lora)
        if progress is not None:
            loads = "AutoModelForCausalLM.from_pretrained" if lora is None else "PeftModel.from_pretrained(base, DIR)"
            progress.print(f"exported {args.export_hf} (step {step}; {loads} loads it)")
    if args.export_hf_merged is not None:
        export_hf(runtime, args.model, args.export_hf_merged, dtype=args.torch_dtype, tokenizer=tokenizer, lora=lora,
                  merged=True)  # fmt: skip
        if progress is not None:
            progress.print(f"exported {args.export_hf_merged} (step {step}; the adapters merged)")


def _freezing(args: TrainArgs) -> Freezing:
    """What the run freezes, as a checkpoint records it; a resume must repeat its LoRA settings."""
    lora = None if args.cfg.lora is None else args.cfg.lora.to_dict()
    return {"router": args.freeze_router, "attention": args.freeze_attention, "lora": lora}


def summary_line(
    args: TrainArgs,
    start: int,
    step: int,
    first_loss: float | None,
    last: StepResult | None,
    seconds: float,
    evaluated: tuple[int, EvalLoss] | None = None,
) -> str:
    """One line at the end of the run: steps, time, tokens, the loss from first to last step, the last evaluation,
    what was written."""
    steps = step - start
    tokens = steps * args.tokens_per_step
    loss = f"loss {first_loss:.4f} -> {last.loss:.4f}" if last is not None else "no step run"
    if evaluated is not None:
        loss += f"; {evaluated[1]} after step {evaluated[0]}"
    written = [f"checkpoint {args.save_dir / f'step{step}'}"] if args.save_dir is not None else []
    written += [f"HF {'model' if args.cfg.lora is None else 'adapter'} {args.export_hf}"] if args.export_hf else []
    written += [f"merged HF model {args.export_hf_merged}"] if args.export_hf_merged is not None else []
    return (
        f"done: steps {start + 1}-{step} of {args.steps} ({steps} step{'s' if steps != 1 else ''}, {tokens:,} tokens) "
        f"in {seconds:.1f} s, "
        f"{tokens / max(seconds, 1e-9):,.0f} tokens/s; {loss}" + (f"; wrote {', '.join(written)}" if written else "")
    )


def run_step(runtime: RankRuntime, batches, *, timeline: Path | None) -> StepResult:
    """One optimizer step; with ``timeline``, every rank records it and rank 0 writes the Chrome trace."""
    if timeline is None:
        return runtime.executor.train_batch(batches)
    runtime.executor.record_timeline(True)
    t0 = start_clock()  # a barrier: every rank's clock starts together
    result = runtime.executor.train_batch(batches)
    events = runtime.executor.timeline
    assert events is not None, "record_timeline(True) above"
    write_job_timeline(events, t0, timeline)  # collective; rank 0 writes
    runtime.executor.record_timeline(False)
    return result
