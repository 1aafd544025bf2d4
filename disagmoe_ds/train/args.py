"""The command line of ``run_pretrain.py``, parsed once into ``TrainArgs``.

The flags are defined in ``train.flags``; they override the ds_config (``train.settings``) and are checked before
any rank starts (``train.checks``). The result is one frozen value that every rank receives; no other module
reads the command line or the JSON file.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any

import torch

from disagmoe_ds.colocated.layout import ColocatedConfig
from disagmoe_ds.config import DisagMoEConfig, load_ds_config
from disagmoe_ds.errors import ConfigError
from disagmoe_ds.launch import detect_launcher
from disagmoe_ds.train.checks import (
    check_batch_keys,
    check_ds_config_keys,
    check_engine_config,
    check_eval_flags,
    check_flag_values,
    check_monitors,
    check_outputs,
    check_resume_flags,
    check_tensorboard,
)
from disagmoe_ds.train.flags import default_model, read_command_line
from disagmoe_ds.train.job import launched_rank_and_world
from disagmoe_ds.train.settings import apply_overrides, dtype_name, micro_batch_size, mode_config, run_mode

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


@dataclass(frozen=True, kw_only=True)
class TrainArgs:
    """Everything a rank needs to know about the run; built by ``parse_args``.

    Paths are absolute or relative to the working directory. ``ds_config`` already holds every override.
    """

    model: Path  # HF directory: config.json, and the weights with --init-from
    pretrained: bool  # load the weights of ``model`` (--init-from) instead of a fresh initialisation
    ds_config: dict[str, Any]
    mode: str  # one of flags.MODES
    cfg: DisagMoEConfig | ColocatedConfig  # the layout of ``mode``
    data: str
    text_field: str
    txt_documents: str  # "block" or "file": what one document of a .txt file is
    sft: bool
    sft_fields: tuple[str, str, str]  # the prompt, response and messages fields of SFT rows
    sft_truncate: bool  # cut over-long SFT examples to seq_len instead of refusing them
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
    export_hf: Path | None  # save_pretrained directory with the tokenizer, written with every checkpoint and at the end
    export_hf_merged: Path | None  # LoRA: the model with the adapters merged, written with --export-hf
    save_every: int
    keep_last: int
    resume: str | None  # None: fresh start; "": the newest checkpoint in save_dir; else a checkpoint path
    eval_data: str | None  # held-out data, prepared as ``data`` is
    eval_split: float  # the fraction of ``data``'s samples held out instead (0: none)
    eval_every: int  # evaluate every N steps and after the last (0: after the last only, when there is held-out data)
    eval_steps: int | None  # evaluation batches per evaluation (None: the whole held-out set)
    eval_only: bool  # evaluate the initial (--init-from) or resumed weights once, train nothing
    metrics_file: Path | None
    tensorboard: Path | None
    timeline: Path | None
    log_every: int
    peak_tflops: float | None

    @property
    def torch_dtype(self) -> torch.dtype:
        return DTYPES[self.dtype]

    @property
    def evaluates(self) -> bool:
        """The run has held-out data, so it evaluates (``train.evaluation``)."""
        return self.eval_data is not None or self.eval_split > 0

    @property
    def lanes(self) -> int:
        """Lanes that read their own share of the data: those of A-group 0 (s of them share one with sequence
        parallelism, ``sequence_parallel``), or every co-located rank."""
        return self.cfg.batch_lanes

    @property
    def sequences_per_step(self) -> int:
        return self.lanes * self.cfg.micro_batches * self.micro_batch_size

    @property
    def tokens_per_step(self) -> int:
        return self.sequences_per_step * self.seq_len


def parse_args(argv: list[str], *, root: Path, description: str) -> tuple[TrainArgs, argparse.Namespace]:
    """The run's settings; the namespace keeps the launch flags (hostfile checks).

    ``root``: the directory whose hf_models/, ds_configs/ and .cache/ hold the defaults.
    """
    ns = read_command_line(argv, root=root, description=description)
    return resolve_command_line(ns, root=root), ns


def resolve_command_line(ns: argparse.Namespace, *, root: Path) -> TrainArgs:
    """The run's settings from the flags ``read_command_line`` read (under a launcher, its world size)."""
    launched_world_size = launched_rank_and_world()[1] if detect_launcher() is not None else None
    return resolve(ns, default_model=default_model(root), launched_world_size=launched_world_size)


def resolve(ns: argparse.Namespace, *, default_model: Path, launched_world_size: int | None = None) -> TrainArgs:
    """Apply the flags to the ds_config and check the values no other layer checks."""
    check_flag_values(ns)
    ds_config = load_ds_config(ns.deepspeed_config)
    mode = run_mode(ns.mode, ds_config)
    cfg = mode_config(ns, mode, ds_config, launched_world_size)
    batch = micro_batch_size(ns.micro_batch_size, ds_config)
    dtype = dtype_name(ns.dtype, ds_config)
    ds_config = apply_overrides(ds_config, lr=ns.lr, dtype=dtype, steps=ns.steps, zero=ns.zero)
    check_batch_keys(ds_config, cfg, batch)
    check_engine_config(ds_config, cfg, batch, lr_flag=ns.lr is not None)
    check_ds_config_keys(ds_config)
    check_resume_flags(ns.resume, ns.save_dir)
    check_tensorboard(ns.tensorboard)
    check_monitors(ds_config)
    check_outputs(ns)
    check_eval_flags(ns, cfg)
    if ns.export_hf_merged is not None and cfg.lora is None:
        raise ConfigError(
            "--export-hf-merged writes a LoRA run's model with its adapters merged; pass --lora-rank (or set "
            '"disagmoe": {"lora": ...}), or use --export-hf for a full fine-tune'
        )
    derived = (
        "model", "pretrained", "ds_config", "mode", "cfg", "data", "sft_fields", "micro_batch_size", "dtype",
        "eval_split", "eval_every",
    )  # fmt: skip
    # Every other field is the value of the flag of the same name.
    as_given = {f.name: getattr(ns, f.name) for f in fields(TrainArgs) if f.name not in derived}
    return TrainArgs(
        model=ns.init_from or ns.model or default_model,
        pretrained=ns.init_from is not None,
        ds_config=ds_config,
        mode=mode,
        cfg=cfg,
        data=ns.data or "",
        sft_fields=(ns.prompt_field, ns.response_field, ns.messages_field),
        micro_batch_size=batch,
        dtype=dtype,
        eval_split=ns.eval_split or 0.0,
        eval_every=ns.eval_every or 0,
        **as_given,
    )
