"""The command line of ``run_pretrain.py``, parsed once into ``TrainArgs``.

DeepSpeed's conventions come first: ``--deepspeed_config`` (from ``deepspeed.add_config_arguments``) names the
ds_config and ``--local_rank`` (appended by the ``deepspeed`` launcher) is accepted. Our flags then override the
ds_config: the layout flags replace keys of its ``"disagmoe"`` section (validated by ``DisagMoEConfig`` wherever
a value came from), ``--lr`` and ``--dtype`` edit its optimizer, scheduler and ``bf16`` sections. The result is
one frozen value that every rank receives; no other module reads the command line or the JSON file.

``--mode colocated`` replaces the disaggregated layout by a ``ColocatedConfig``: ``--world-size`` ranks (the
launcher's world size under a launcher, else 1) and ``--ep-size``; micro-batches, the communication timeout and
``compile`` still come from the section (or ``--micro-batches``), its attention/FFN layout keys are not used.
"""

from __future__ import annotations

import argparse
import copy
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from disagmoe_ds.colocated.layout import ColocatedConfig
from disagmoe_ds.config import SECTION, DisagMoEConfig, load_ds_config
from disagmoe_ds.errors import ConfigError
from disagmoe_ds.launch import detect_launcher
from disagmoe_ds.train.job import launched_rank_and_world

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
# Schedulers whose peak learning rate is a scheduler parameter, not the optimizer's lr.
_PEAK_LR_PARAM = {"WarmupLR": "warmup_max_lr", "WarmupDecayLR": "warmup_max_lr"}
# Schedulers that need the run length.
_NEEDS_TOTAL_STEPS = ("WarmupDecayLR", "WarmupCosineLR")
_DEFAULT_MICRO_BATCH_SIZE = 4
MODES = ("disaggregated", "colocated")
_LAYOUT_FLAGS = ("attention_gpus", "ffn_gpus", "depth", "expert_data_parallel")  # disaggregated only
_COLOCATED_FLAGS = ("world_size", "ep_size")


@dataclass(frozen=True, kw_only=True)
class TrainArgs:
    """Everything a rank needs to know about the run; built by ``parse_args``.

    Paths are absolute or relative to the working directory. ``ds_config`` already holds every override.
    """

    model: Path  # HF directory: config.json, and the weights with --init-from
    pretrained: bool  # load the weights of ``model`` (--init-from) instead of a fresh initialisation
    ds_config: dict[str, Any]
    mode: str  # one of MODES
    cfg: DisagMoEConfig | ColocatedConfig  # the layout of ``mode``
    data: str
    text_field: str
    sft: bool
    sft_fields: tuple[str, str, str]  # the prompt, response and messages fields of SFT rows
    tokenizer: str  # "auto", "sentencepiece", or a path (HF tokenizer directory or SentencePiece .model)
    vocab_size: int | None  # SentencePiece vocabulary to train; None: the model's vocab_size
    tokenizer_cache: Path
    seq_len: int
    micro_batch_size: int
    steps: int
    seed: int
    dtype: str
    freeze_router: bool
    freeze_attention: bool
    bias_update_rate: float | None  # None: DeepSeek-V3's 1e-3 where the router has a bias, else off
    save_dir: Path | None
    export_hf: (
        Path | None
    )  # save_pretrained directory (with the tokenizer), written with every checkpoint and at the end
    save_every: int
    keep_last: int
    resume: str | None  # None: fresh start; "": the newest checkpoint in save_dir; else a checkpoint path
    metrics_file: Path | None
    tensorboard: Path | None
    timeline: Path | None
    log_every: int
    peak_tflops: float | None

    @property
    def torch_dtype(self) -> torch.dtype:
        return DTYPES[self.dtype]

    @property
    def lanes(self) -> int:
        """Data-parallel lanes that read their own share of the data: those of A-group 0, or every co-located rank."""
        return self.cfg.lanes

    @property
    def sequences_per_step(self) -> int:
        return self.lanes * self.cfg.micro_batches * self.micro_batch_size

    @property
    def tokens_per_step(self) -> int:
        return self.sequences_per_step * self.seq_len


class _HelpFormatter(argparse.RawDescriptionHelpFormatter):
    """Keeps the description's layout (the launch lines) and shows defaults that are not None/False."""

    def _get_help_string(self, action: argparse.Action) -> str:
        if action.default in (None, False, "", argparse.SUPPRESS) or "%(default)" in (action.help or ""):
            return action.help or ""
        return f"{action.help} (default: %(default)s)"


def build_parser(
    *, description: str, default_model: Path, default_ds_config: Path, default_cache: Path
) -> argparse.ArgumentParser:
    import deepspeed

    p = argparse.ArgumentParser(prog="run_pretrain.py", description=description, formatter_class=_HelpFormatter)
    _model_and_data(p, default_model, default_cache)
    _layout(p)
    _optimisation(p)
    _fine_tuning(p)
    _checkpoints(p)
    _output(p)
    _launch(p)
    deepspeed.add_config_arguments(p)
    p.set_defaults(deepspeed_config=str(default_ds_config))
    return p


def _model_and_data(p: argparse.ArgumentParser, default_model: Path, default_cache: Path) -> None:
    g = p.add_argument_group("model and data")
    g.add_argument(
        "--model", type=Path, help=f"HF model directory (config.json; weights are not read) [{default_model}]"
    )
    g.add_argument(
        "--init-from",
        type=Path,
        metavar="HF_DIR",
        help="start from the pretrained weights in HF_DIR (written by save_pretrained; from safetensors each rank "
        "reads only the tensors it holds); its config is the model, --model is then not needed",
    )
    g.add_argument(
        "--data",
        help="training data: .txt/.jsonl/.parquet file or directory (.gz ok), or a hub "
        "dataset 'hf:owner/name' [the bundled Jane Austen corpus]",
    )
    g.add_argument("--text-field", default="text", help="field holding the document in .jsonl/.parquet/hub rows")
    g.add_argument(
        "--tokenizer",
        default="auto",
        help="'auto': the model directory's HF tokenizer when it has "
        "one, else a SentencePiece model trained on --data and cached; 'sentencepiece': always the "
        "latter; or a path to an HF tokenizer directory or a SentencePiece .model file",
    )
    g.add_argument(
        "--vocab-size",
        type=int,
        help="vocabulary of a trained SentencePiece tokenizer (at most the "
        "model's vocab_size) [the model's vocab_size]",
    )
    g.add_argument("--tokenizer-cache", type=Path, default=default_cache, help="where trained tokenizers are kept")
    g.add_argument("--seq-len", type=int, default=128, help="tokens per packed sample (<= max_position_embeddings)")


def _layout(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group('layout (override the ds_config\'s "disagmoe" section)')
    g.add_argument(
        "--mode",
        choices=MODES,
        default="disaggregated",
        help="disaggregated: attention and experts on disjoint ranks (AF-Pipe); colocated: every rank holds the "
        "attention side and a slice of the experts (EP+DP, all-to-all dispatch): one GPU, or the baseline",
    )
    g.add_argument("--world-size", type=int, help="colocated: ranks in the job [the launcher's world size, else 1]")
    g.add_argument(
        "--ep-size",
        type=int,
        help="colocated: expert-parallel ranks per copy of the experts; divides --world-size and the expert count "
        "[the largest that does]",
    )
    g.add_argument("--attention-gpus", type=int, help="M: attention ranks in total")
    g.add_argument("--ffn-gpus", type=int, help="N: FFN (expert) ranks in total")
    g.add_argument("--depth", type=int, help="p: A-groups = F-groups; must divide the layer count")
    g.add_argument("--micro-batches", type=int, help="micro-batches per step per lane (DeepSpeed's GAS)")
    g.add_argument("--expert-data-parallel", type=int, help="replicas of each expert shard in an F-group")


def _optimisation(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("optimisation")
    g.add_argument(
        "--steps",
        type=int,
        default=200,
        help="optimizer steps of the whole run (a resumed run "
        "continues to this step); also fills the scheduler's total_num_steps when it has none",
    )
    g.add_argument(
        "--micro-batch-size",
        type=int,
        help=f"sequences per micro-batch [ds_config train_micro_batch_size_per_gpu, else {_DEFAULT_MICRO_BATCH_SIZE}]",
    )
    g.add_argument(
        "--lr",
        type=float,
        help="peak learning rate: sets the ds_config optimizer's lr (and "
        "warmup_max_lr of WarmupLR/WarmupDecayLR) [the ds_config's]",
    )
    g.add_argument(
        "--zero",
        type=int,
        choices=(0, 1, 2),
        help="ZeRO stage of every role engine: sets zero_optimization.stage [the ds_config's]",
    )
    g.add_argument(
        "--dtype",
        choices=sorted(DTYPES),
        help="parameter dtype; bf16 sets bf16.enabled [bf16 when the ds_config enables it, else fp32]",
    )
    g.add_argument("--seed", type=int, default=0, help="model initialisation, data order and per-step RNG")
    g.add_argument(
        "--bias-update-rate",
        type=float,
        help="DeepSeek-V3 auxiliary-loss-free balancing: after "
        "every step each router's e_score_correction_bias moves by rate * sign(mean load - load); "
        "0 disables [1e-3 for routers with that bias, else 0]",
    )


def _fine_tuning(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("fine-tuning")
    g.add_argument(
        "--sft",
        action="store_true",
        help="--data holds prompt/response (or messages) JSONL rows; "
        "the loss covers the responses only (chat template of the tokenizer when it has one)",
    )
    g.add_argument("--prompt-field", default="prompt", help="--sft: field of the prompt in prompt/response rows")
    g.add_argument("--response-field", default="response", help="--sft: field of the response")
    g.add_argument("--messages-field", default="messages", help="--sft: field of the chat list in messages rows")
    g.add_argument(
        "--freeze-router",
        action="store_true",
        help="keep every MoE router's weights fixed (recorded in checkpoints: a resume keeps it)",
    )
    g.add_argument(
        "--freeze-attention",
        action="store_true",
        help="keep every layer's self-attention (q/k/v/o projections and their norms) fixed (recorded in "
        "checkpoints: a resume keeps it)",
    )


def _checkpoints(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("checkpoints")
    g.add_argument("--save-dir", type=Path, help="checkpoint root; none: the run saves nothing, not even on Ctrl-C")
    g.add_argument("--save-every", type=int, default=0, help="save every N steps (0: only at the end)")
    g.add_argument(
        "--export-hf",
        type=Path,
        metavar="DIR",
        help="also write the model as a save_pretrained directory with its tokenizer (AutoModelForCausalLM and "
        "AutoTokenizer.from_pretrained load it): at the end and with every --save-every checkpoint, replacing DIR",
    )
    g.add_argument("--keep-last", type=int, default=3, help="keep the N newest checkpoints (0: keep all)")
    g.add_argument(
        "--resume",
        nargs="?",
        const="",
        metavar="CKPT",
        help="continue a run exactly: alone, from "
        "the newest complete checkpoint in --save-dir; or from CKPT (a checkpoint root or ROOT/TAG)",
    )


def _output(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("output")
    g.add_argument("--metrics-file", type=Path, help="append one JSON line per step")
    g.add_argument("--tensorboard", type=Path, metavar="DIR", help="TensorBoard event directory (needs tensorboard)")
    g.add_argument(
        "--timeline",
        type=Path,
        metavar="PATH",
        help="Chrome/Perfetto trace of every rank for the second step of the run",
    )
    g.add_argument("--log-every", type=int, default=10, help="steps between log lines when stderr is no terminal")
    g.add_argument("--peak-tflops", type=float, help="peak dense bf16 TFLOP/s of one device, for MFU [known GPUs]")


def _launch(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("launch")
    g.add_argument(
        "--hostfile",
        type=Path,
        help="validate this DeepSpeed hostfile, then re-run this command under 'deepspeed --hostfile HOSTFILE'",
    )
    g.add_argument(
        "--launcher-args",
        default="",
        help="extra 'deepspeed' launcher arguments with --hostfile, e.g. "
        "'--no_ssh_check --master_addr 127.0.0.1' on one host without ssh",
    )
    g.add_argument(
        "--check-hostfile",
        type=Path,
        metavar="HOSTFILE",
        help="validate a hostfile against the layout's world size and exit",
    )
    g.add_argument("--local_rank", type=int, help="set by the deepspeed launcher; the rank is read from the env")


def parse_args(argv: list[str] | None, *, root: Path, description: str) -> tuple[TrainArgs, argparse.Namespace]:
    """The run's settings; the namespace keeps the launch flags (hostfile checks) for ``run_pretrain.main``."""
    parser = build_parser(
        description=description,
        default_model=root / "hf_models" / "tiny-qwen3-moe-lm",
        default_ds_config=root / "ds_configs" / "tiny-cpu.json",
        default_cache=root / ".cache" / "tokenizers",
    )
    ns = parser.parse_args(argv)
    launched_world_size = launched_rank_and_world()[1] if detect_launcher() is not None else None
    args = resolve(ns, default_model=root / "hf_models" / "tiny-qwen3-moe-lm", launched_world_size=launched_world_size)
    return args, ns


def resolve(ns: argparse.Namespace, *, default_model: Path, launched_world_size: int | None = None) -> TrainArgs:
    """Apply the flags to the ds_config and check the values no other layer checks."""
    _check_counts(ns)
    ds_config = load_ds_config(ns.deepspeed_config)
    cfg = _mode_config(ns, ds_config, launched_world_size)
    micro_batch_size = ns.micro_batch_size or ds_config.get("train_micro_batch_size_per_gpu", _DEFAULT_MICRO_BATCH_SIZE)
    dtype = ns.dtype or ("bf16" if ds_config.get("bf16", {}).get("enabled") else "fp32")
    ds_config = apply_overrides(ds_config, lr=ns.lr, dtype=dtype, steps=ns.steps, zero=ns.zero)
    _check_batch_keys(ds_config, cfg, micro_batch_size)
    check_engine_config(ds_config, cfg, micro_batch_size, lr_flag=ns.lr is not None)
    if ns.resume == "" and ns.save_dir is None:
        raise ConfigError("--resume without a checkpoint path needs --save-dir (the run's checkpoint root)")
    check_tensorboard(ns.tensorboard)
    return TrainArgs(
        model=ns.init_from or ns.model or default_model,
        pretrained=ns.init_from is not None,
        ds_config=ds_config,
        mode=ns.mode,
        cfg=cfg,
        data=ns.data or "",
        text_field=ns.text_field,
        sft=ns.sft,
        sft_fields=(ns.prompt_field, ns.response_field, ns.messages_field),
        tokenizer=ns.tokenizer,
        vocab_size=ns.vocab_size,
        tokenizer_cache=ns.tokenizer_cache,
        seq_len=ns.seq_len,
        micro_batch_size=micro_batch_size,
        steps=ns.steps,
        seed=ns.seed,
        dtype=dtype,
        freeze_router=ns.freeze_router,
        freeze_attention=ns.freeze_attention,
        bias_update_rate=ns.bias_update_rate,
        save_dir=ns.save_dir,
        export_hf=ns.export_hf,
        save_every=ns.save_every,
        keep_last=ns.keep_last,
        resume=ns.resume,
        metrics_file=ns.metrics_file,
        tensorboard=ns.tensorboard,
        timeline=ns.timeline,
        log_every=ns.log_every,
        peak_tflops=ns.peak_tflops,
    )


def check_tensorboard(log_dir: Path | None) -> None:
    """``--tensorboard DIR`` needs the tensorboard package: refused here, not found missing mid-run."""
    if log_dir is None:
        return
    try:
        import tensorboard  # noqa: F401  (what torch.utils.tensorboard needs)
    except ImportError:
        raise ConfigError(
            f"--tensorboard {log_dir} needs the tensorboard package, which is not installed; "
            f"pip install tensorboard (or drop --tensorboard; --metrics-file writes the same records as JSON lines)"
        ) from None


def _check_counts(ns: argparse.Namespace) -> None:
    if ns.init_from is not None and ns.model is not None and ns.model.resolve() != ns.init_from.resolve():
        raise ConfigError(
            f"--model {ns.model} and --init-from {ns.init_from} disagree; --init-from is the model, drop --model"
        )
    positive = {
        "--steps": ns.steps,
        "--seq-len": ns.seq_len,
        "--log-every": ns.log_every,
        "--micro-batch-size": ns.micro_batch_size,
        "--vocab-size": ns.vocab_size,
        "--world-size": ns.world_size,
        "--ep-size": ns.ep_size,
    }
    for flag, value in positive.items():
        if value is not None and value < 1:
            raise ConfigError(f"{flag} must be a positive integer, got {value}")
    for flag, value in {"--save-every": ns.save_every, "--keep-last": ns.keep_last}.items():
        if value < 0:
            raise ConfigError(f"{flag} must be >= 0, got {value}")
    if ns.bias_update_rate is not None and ns.bias_update_rate < 0:
        raise ConfigError(f"--bias-update-rate must be >= 0, got {ns.bias_update_rate}")


def _mode_config(
    ns: argparse.Namespace, ds_config: dict[str, Any], launched_world_size: int | None
) -> DisagMoEConfig | ColocatedConfig:
    """The layout of ``--mode``; each mode's flags are refused in the other mode."""
    if ns.mode == "disaggregated":
        wrong = [k for k in _COLOCATED_FLAGS if getattr(ns, k) is not None]
        if wrong:
            raise ConfigError(
                f"--{wrong[0].replace('_', '-')} is a --mode colocated flag; the disaggregated layout is set by "
                f"--attention-gpus, --ffn-gpus, --depth and --expert-data-parallel"
            )
        return DisagMoEConfig.from_ds_config(ds_config, {k: getattr(ns, k) for k in (*_LAYOUT_FLAGS, "micro_batches")})
    wrong = [k for k in _LAYOUT_FLAGS if getattr(ns, k) is not None]
    if wrong:
        raise ConfigError(
            f"--{wrong[0].replace('_', '-')} sets the disaggregated layout; --mode colocated takes --world-size "
            f"and --ep-size"
        )
    section = DisagMoEConfig.from_ds_config(ds_config, {"micro_batches": ns.micro_batches})
    if section.activation_checkpointing or section.max_in_flight is not None:
        warnings.warn(
            f'"{SECTION}.activation_checkpointing" and "{SECTION}.max_in_flight" are ignored in co-located mode: '
            "each rank runs one micro-batch at a time and keeps its activations",
            stacklevel=2,
        )
    return ColocatedConfig(
        world_size=ns.world_size or launched_world_size or 1,
        ep_size=ns.ep_size,
        micro_batches=section.micro_batches,
        comm_timeout_s=section.comm_timeout_s,
        compile=section.compile,
    )


def apply_overrides(
    ds_config: dict[str, Any], *, lr: float | None, dtype: str, steps: int, zero: int | None = None
) -> dict[str, Any]:
    """A copy of ``ds_config`` with the learning rate, precision, ZeRO stage and run length of the command line.

    >>> cfg = apply_overrides({"scheduler": {"type": "WarmupLR", "params": {}}}, lr=0.1, dtype="fp32", steps=5)
    >>> cfg["optimizer"]["params"]["lr"], cfg["scheduler"]["params"]["warmup_max_lr"], cfg["bf16"]["enabled"]
    (0.1, 0.1, False)
    """
    config = copy.deepcopy(ds_config)
    scheduler = config.get("scheduler")
    if lr is not None:
        config.setdefault("optimizer", {"type": "AdamW"}).setdefault("params", {})["lr"] = lr
        if scheduler and scheduler.get("type") in _PEAK_LR_PARAM:
            scheduler.setdefault("params", {})[_PEAK_LR_PARAM[scheduler["type"]]] = lr
    if scheduler and scheduler.get("type") in _NEEDS_TOTAL_STEPS:
        scheduler.setdefault("params", {}).setdefault("total_num_steps", steps)
    config.setdefault("bf16", {})["enabled"] = dtype == "bf16"
    if zero is not None:
        config.setdefault("zero_optimization", {})["stage"] = zero
    return config


def check_engine_config(
    ds_config: dict[str, Any], cfg: DisagMoEConfig | ColocatedConfig, micro_batch_size: int, *, lr_flag: bool
) -> None:
    """What DeepSpeed would refuse inside every rank, refused here: precision and ZeRO rules (``role_ds_config``)
    and optimizer hyper-parameters out of range."""
    from disagmoe_ds.engine.deepspeed_role import role_ds_config

    role_ds_config(ds_config, micro_batches=cfg.micro_batches, micro_batch_size=micro_batch_size, dp_size=1)
    params = ds_config.get("optimizer", {}).get("params", {})
    where = "--lr" if lr_flag else 'ds_config "optimizer.params.lr"'
    _check_range(where, params.get("lr"), lambda v: v > 0, "a positive number")
    _check_range('ds_config "optimizer.params.eps"', params.get("eps"), lambda v: v > 0, "a positive number")
    _check_range('ds_config "optimizer.params.weight_decay"', params.get("weight_decay"), lambda v: v >= 0, ">= 0")
    for beta in params.get("betas") or ():
        _check_range('ds_config "optimizer.params.betas"', beta, lambda v: 0 <= v < 1, "in [0, 1)")


def _check_range(where: str, value: Any, ok, rule: str) -> None:
    if value is None:
        return
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not ok(value):
        raise ConfigError(f"{where} must be {rule}, got {value!r}")


def _check_batch_keys(ds_config: dict[str, Any], cfg: DisagMoEConfig | ColocatedConfig, micro_batch_size: int) -> None:
    """DeepSpeed's batch keys are derived from the layout; a ds_config value that disagrees is a mistake."""
    lanes = cfg.lanes
    derived = {  # train_micro_batch_size_per_gpu is --micro-batch-size's default, so it cannot disagree
        "gradient_accumulation_steps": cfg.micro_batches,
        "train_batch_size": micro_batch_size * cfg.micro_batches * lanes,
    }
    for key, value in derived.items():
        if key in ds_config and ds_config[key] != value:
            raise ConfigError(
                f'ds_config "{key}" is {ds_config[key]} but this run has {value} (micro-batch size '
                f"{micro_batch_size} x micro_batches {cfg.micro_batches} x {lanes} lanes); DisagMoE-DS derives it: "
                f"remove the key or change the flags"
            )
