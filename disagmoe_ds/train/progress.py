"""What rank 0 shows and writes: the start banner, a progress bar (or log lines), JSON lines, TensorBoard.

On a terminal a tqdm bar carries loss, the last evaluation loss, aux loss, tokens/s, TFLOP/s per GPU, MFU, the
worst layer's expert imbalance and, on a GPU, rank 0's peak memory; without one (a log file, CI) the same fields go
to one plain line every ``--log-every`` steps and after every evaluation.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

from tqdm import tqdm

from disagmoe_ds.checkpoint.resume import ResumePoint
from disagmoe_ds.fp8.shapes import harmonic_width
from disagmoe_ds.models.aux_loss import balance_per_layer
from disagmoe_ds.models.lora_settings import GROUPS
from disagmoe_ds.models.model_facts import expert_widths
from disagmoe_ds.models.parts import experts_in_fp8
from disagmoe_ds.models.split import aux_loss_enabled
from disagmoe_ds.planner.lora import LoRA, adapter_params
from disagmoe_ds.planner.model import ModelSpec
from disagmoe_ds.train.args import TrainArgs
from disagmoe_ds.train.data import TrainData, epoch_text
from disagmoe_ds.train.evaluation import describe, weights_of
from disagmoe_ds.train.metrics import ModelFacts, StepRecord
from disagmoe_ds.train.resources import planned_state


def banner(
    args: TrainArgs,
    config,
    *,
    layout_lines: list[str],
    facts: ModelFacts,
    data: TrainData,
    bias_rate: float,
    resume: ResumePoint | None,
) -> list[str]:
    """The run's derived facts, printed before anything heavy starts (nanoGPT prints tokens per iteration).

    ``layout_lines`` are the mode's own (``RankBuilder.describe``): layout, split, pipeline.
    """
    init = f"weights from {args.model}" if args.pretrained else f"fresh init (seed {args.seed})"
    aux = "no aux loss"
    if aux_loss_enabled(config):
        scope = "each MoE layer's own, averaged" if balance_per_layer(config) else "HF's, all layers' rows pooled"
        aux = f"aux loss x {config.router_aux_loss_coef} ({scope})"
    bias = f"aux-loss-free bias rate {bias_rate:g}" if bias_rate else "no aux-loss-free bias updates"
    frozen = [name for name, on in (("router", args.freeze_router), ("self-attention", args.freeze_attention)) if on]
    return [
        f"model: {config.model_type} {args.model}, {init}, {args.dtype}; {facts.total_params / 1e6:.2f}M params, "
        f"{facts.active_params / 1e6:.2f}M active per token" + (f"; frozen: {', '.join(frozen)}" if frozen else ""),
        *layout_lines,
        f"tokens per step: {args.tokens_per_step:,} = {_lanes_text(args)} x {args.cfg.micro_batches} micro-batches x "
        f"{args.micro_batch_size} sequences x {args.seq_len} tokens; "
        f"{facts.flops_per_token * args.tokens_per_step / 1e9:,.2f} model GFLOP per step",
        *([f"data: {data.summary}; {epoch_text(data, args)}"] if not args.eval_only else []),
        *([describe(args, data)] if args.evaluates else []),
        f"tokenizer: {data.tokenizer}",
        f"balancing: {aux}; {bias}; imb = the busiest expert's load over the mean, worst MoE layer (1.0 is even; "
        "healthy below about 1.5; experts / top-k when every token picks the same experts)",
        *_short_run_note(args),
        *_fp8_lines(args, config),
        checkpoint_line(args, resume),
    ]


def _fp8_lines(args: TrainArgs, config) -> list[str]:
    """What the FP8 lever computes in FP8 on this model (the shape rules, ``fp8.shapes``), said before launch."""
    cfg = args.cfg
    if not getattr(cfg, "fp8", False):
        return []
    width = f"harmonic width H*I/(H+I) = {harmonic_width(*expert_widths(config)):,.0f}"
    experts = (
        f"in FP8 ({width} > {cfg.fp8_expert_bf16_width:,})"
        if experts_in_fp8(config, cfg.fp8_expert_bf16_width)
        else f'in bf16 ({width} <= "fp8_expert_bf16_width" {cfg.fp8_expert_bf16_width:,}: FP8 measured slower there)'
    )
    return [
        f"fp8: the routed experts' GEMMs {experts}; the attention side's projections in FP8 where both widths exceed "
        f'"fp8_bf16_width" {cfg.fp8_bf16_width:,}; the routed tokens travel in FP8; router and LM head in {args.dtype}'
    ]


def _short_run_note(args: TrainArgs) -> list[str]:
    """Said once here, instead of DeepSpeed's warning from every rank: a warm-up longer than the run."""
    warmup = args.ds_config.get("scheduler", {}).get("params", {}).get("warmup_num_steps", 0)
    if not isinstance(warmup, int) or warmup <= args.steps:
        return []
    return [f"schedule: the warm-up ({warmup} steps) is longer than the run ({args.steps}): the learning rate never "
            f"reaches its peak (set scheduler.params.warmup_num_steps in the ds_config)"]  # fmt: skip


def checkpoint_line(args: TrainArgs, resume: ResumePoint | None) -> str:
    if args.eval_only:
        return f"checkpoints: none written (--eval-only); evaluating the weights of {weights_of(args, resume)}"
    if args.save_dir is None:
        saves = "checkpoints: off (--save-dir DIR saves at the end, on Ctrl-C and every --save-every steps)"
    else:
        every = f"every {args.save_every} steps, " if args.save_every else ""
        keep = f"keep the last {args.keep_last}" if args.keep_last else "keep all"
        saves = f"checkpoints: {args.save_dir}, {every}at the end and on Ctrl-C; {keep}"
    if args.export_hf is not None:
        saves += f"; HF export to {args.export_hf} with every save"
    if resume is None:
        return saves
    line = saves + f"; resuming from {resume.path} at step {resume.step}, {resume.describe_data()}"
    if resume.tokens_per_step not in (None, args.tokens_per_step):
        line += (
            f"; note: it trained on {resume.tokens_per_step:,} tokens per step and this layout takes "
            f"{args.tokens_per_step:,} (--micro-batches or --micro-batch-size set it)"
        )
    return line


def _fmt(value: float | None, spec: str) -> str:
    return "n/a" if value is None else format(value, spec)


def summary_fields(rec: StepRecord, eval_loss: float | None = None) -> dict[str, str]:
    """The bar's (or log line's) fields; ``eval_loss``: the last evaluation's, shown beside the loss."""
    return {
        "loss": _fmt(rec.loss, ".4f"),
        **({"eval": _fmt(eval_loss, ".4f")} if eval_loss is not None else {}),
        "aux": _fmt(rec.aux_loss, ".3f"),
        "tok/s": _fmt(rec.tokens_per_s, ",.0f"),
        "TFLOP/s/gpu": _fmt(rec.tflops_per_gpu, ".3g"),
        "MFU": "n/a" if rec.mfu is None else f"{rec.mfu:.1%}",
        "imb": _fmt(rec.max_imbalance, ".2f"),
        **({"mem": f"{rec.peak_gib:.1f}G"} if rec.peak_gib is not None else {}),  # rank 0's peak, on a GPU
    }


class Progress:
    """Rank 0's sinks for step records. ``close()`` flushes and closes everything."""

    def __init__(self, args: TrainArgs, *, start_step: int) -> None:
        self.log_every = args.log_every
        self.bar = tqdm(
            total=args.steps,
            initial=start_step,
            unit="step",
            dynamic_ncols=True,
            disable=args.eval_only or not sys.stderr.isatty(),
        )
        self.jsonl = None
        if args.metrics_file is not None:
            args.metrics_file.parent.mkdir(parents=True, exist_ok=True)
            if not args.eval_only:
                _drop_records_after(args.metrics_file, start_step)  # a resumed run logs those steps again
            self.jsonl = args.metrics_file.open("a")
        self.tensorboard = _tensorboard_writer(args.tensorboard)
        self.monitor = _monitor(args.ds_config)
        self.eval_loss: float | None = None  # the last evaluation's, shown on every later step

    def print(self, text: str) -> None:
        """A message that does not break the bar."""
        if self.bar.disable:
            print(text, flush=True)
        else:
            self.bar.write(text)

    def step(self, rec: StepRecord) -> None:
        self.eval_loss = rec.eval_loss if rec.eval_loss is not None else self.eval_loss
        fields = summary_fields(rec, self.eval_loss)
        if self.bar.disable:
            if rec.step % self.log_every == 0 or rec.step == self.bar.total or rec.eval_loss is not None:
                self.print(f"step {rec.step}/{self.bar.total} " + " ".join(f"{k} {v}" for k, v in fields.items()))
        else:
            self.bar.set_postfix(fields, refresh=False)
            self.bar.update(1)
        self._write(rec.to_json())
        values = {tag: value for tag, value in scalars(rec).items() if value is not None}
        if self.tensorboard is not None:
            for tag, value in values.items():
                self.tensorboard.add_scalar(tag, value, rec.step)
        if self.monitor is not None:
            self.monitor.write_events([(tag, value, rec.step) for tag, value in values.items()])

    def evaluation(self, step: int, eval_loss: float) -> None:
        """An evaluation outside training (``--eval-only``): its own JSON line and TensorBoard point."""
        self._write({"step": step, "eval_loss": eval_loss})
        if self.tensorboard is not None:
            self.tensorboard.add_scalar(_EVAL_TAG, eval_loss, step)
        if self.monitor is not None:
            self.monitor.write_events([(_EVAL_TAG, eval_loss, step)])

    def _write(self, record: dict[str, Any]) -> None:
        if self.jsonl is not None:
            self.jsonl.write(json.dumps(record) + "\n")
            self.jsonl.flush()  # a killed run keeps every finished step

    def close(self) -> None:
        self.bar.close()
        if self.jsonl is not None:
            self.jsonl.close()
        if self.tensorboard is not None:
            self.tensorboard.close()


def _monitor(ds_config: dict[str, Any]) -> Any:
    """DeepSpeed's ``MonitorMaster`` of the ds_config's monitor sections (tensorboard, wandb, csv_monitor, comet), or
    None when none is enabled: every step's scalars go there, by step (the role engines log nothing there)."""
    from deepspeed.monitor.config import get_monitor_config
    from deepspeed.monitor.monitor import MonitorMaster

    config = get_monitor_config(ds_config)
    return MonitorMaster(config) if config.enabled else None  # built only then: it asks DeepSpeed's process group


def _tensorboard_writer(log_dir: Path | None) -> Any:
    if log_dir is None:
        return None
    from torch.utils.tensorboard import SummaryWriter  # installed: checks.check_tensorboard refused the run otherwise

    return SummaryWriter(log_dir=str(log_dir))


def _drop_records_after(path: Path, step: int) -> None:
    """Keep the metrics file's records up to ``step`` (a run resumed there repeats the later ones)."""
    if not path.is_file():
        return
    lines = path.read_text().splitlines(keepends=True)
    kept = [line for line in lines if (_step_of(line) or step + 1) <= step]
    if len(kept) != len(lines):
        path.write_text("".join(kept))


def _step_of(line: str) -> int | None:
    """The step of a metrics record, or None for a line a killed run left half-written."""
    try:
        return json.loads(line)["step"]
    except (ValueError, KeyError, TypeError):
        return None


_EVAL_TAG = "eval/lm_loss"


def scalars(rec: StepRecord) -> dict[str, float | None]:
    """A step's values under the tags TensorBoard and DeepSpeed's monitors show them."""
    values = {
        "train/loss": rec.loss,
        "train/lm_loss": rec.lm_loss,
        "train/aux_loss": rec.aux_loss,
        "train/grad_norm": rec.grad_norm,
        "train/lr": rec.lr,
        "perf/tokens_per_s": rec.tokens_per_s,
        "perf/tflops_per_gpu": rec.tflops_per_gpu,
        "perf/mfu": rec.mfu,
        "balance/max_imbalance": rec.max_imbalance,
        _EVAL_TAG: rec.eval_loss,
    }
    values.update({f"balance/imbalance_layer{i}": v for i, v in enumerate(rec.expert_imbalance)})
    return values


def _lanes_text(args: TrainArgs) -> str:
    """The lanes that read distinct data (with sequence or tensor parallelism, each holds its micro-batches in
    slices)."""
    s = getattr(args.cfg, "lane_slices", 1)
    return (
        f"{args.lanes} lanes"
        if s == 1
        else f"{args.lanes} lanes (each {s} ranks holding {args.seq_len // s}-token slices)"
    )


def training_state_line(args: TrainArgs, config, layout) -> str:
    """What the run trains and the training state per rank the planner's memory model gives it (parameters,
    gradients, optimizer state; activations come on top), beside full fine-tuning's for a LoRA run."""
    lora = args.cfg.lora
    full = planned_state(args, config, layout, full=True)
    if lora is None:
        frozen = [
            name for name, on in (("routers", args.freeze_router), ("self-attention", args.freeze_attention)) if on
        ]
        trains = f"every weight but the frozen {' and '.join(frozen)} trains" if frozen else "every weight trains"
        return "training state per rank (planner): " + _gib(full) + "; " + trains
    what = f"LoRA r={lora.rank}, alpha {lora.rank if lora.alpha is None else lora.alpha:g} on {', '.join(lora.targets)}"
    what += " + routers" if lora.train_router else ""
    if not set(lora.targets) <= set(GROUPS):  # projection names: the planner counts groups only
        return f"{what}; every base weight frozen"
    spec = ModelSpec.from_config(config.to_dict())
    adapters = adapter_params(spec, LoRA(lora.rank, lora.targets, lora.train_router))
    return (
        f"{what}: {adapters / 1e6:.2f}M adapter parameters train ({adapters / spec.total_params():.2%}), the base "
        f"weights are frozen; training state per rank (planner): {_gib(planned_state(args, config, layout))} (full "
        f"fine-tuning: {_gib(full)})"
    )


def _gib(state: dict[str, float]) -> str:
    names = {"attention": "attention", "ffn": "experts", "colocated": "each"}
    return ", ".join(f"{names[k]} {_bytes(v)}" for k, v in state.items())


def _bytes(n: float) -> str:
    return f"{n / 2**30:.2f} GiB" if n >= 2**30 else f"{n / 2**20:.1f} MiB"
