"""Values of the command line and the ds_config that no later layer checks, refused before any rank starts.

Each refusal is a ``ConfigError`` naming the flag or ds_config key, the value and what to change; what DeepSpeed
itself would refuse inside every rank is refused here too (``check_engine_config``).
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
from pathlib import Path
from typing import Any

from disagmoe_ds.colocated.layout import ColocatedConfig
from disagmoe_ds.config import ZERO_STAGES, DisagMoEConfig
from disagmoe_ds.engine.deepspeed_role import ds_stage, role_ds_config
from disagmoe_ds.errors import ConfigError


def check_flag_values(ns: argparse.Namespace) -> None:
    """Counts in range, and flags that contradict each other."""
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


def check_resume_flags(resume: str | None, save_dir: Path | None) -> None:
    if resume == "" and save_dir is None:
        raise ConfigError("--resume without a checkpoint path needs --save-dir (the run's checkpoint root)")


def check_tensorboard(log_dir: Path | None) -> None:
    """``--tensorboard DIR`` needs the tensorboard package: refused here, not found missing mid-run."""
    if log_dir is None:
        return
    try:
        import tensorboard  # noqa: F401  (optional dependency; what torch.utils.tensorboard needs)
    except ImportError:
        raise ConfigError(
            f"--tensorboard {log_dir} needs the tensorboard package, which is not installed; "
            f"pip install tensorboard (or drop --tensorboard; --metrics-file writes the same records as JSON lines)"
        ) from None


def check_batch_keys(ds_config: dict[str, Any], cfg: DisagMoEConfig | ColocatedConfig, micro_batch_size: int) -> None:
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


def check_engine_config(
    ds_config: dict[str, Any], cfg: DisagMoEConfig | ColocatedConfig, micro_batch_size: int, *, lr_flag: bool
) -> None:
    """What DeepSpeed would refuse inside every rank, refused here: precision and ZeRO rules (``role_ds_config``)
    and optimizer hyper-parameters out of range."""
    sides = getattr(cfg, "zero_stage", None)  # a disaggregated job's per-side stages replace the ds_config's
    for stage in [cfg.zero_stage_of(side, ds_stage(ds_config)) for side in ZERO_STAGES] if sides else [None]:
        role_ds_config(
            ds_config, micro_batches=cfg.micro_batches, micro_batch_size=micro_batch_size, dp_size=1, stage=stage
        )
    params = ds_config.get("optimizer", {}).get("params", {})
    where = "--lr" if lr_flag else 'ds_config "optimizer.params.lr"'
    _check_range(where, params.get("lr"), lambda v: v > 0, "a positive number")
    _check_range('ds_config "optimizer.params.eps"', params.get("eps"), lambda v: v > 0, "a positive number")
    _check_range('ds_config "optimizer.params.weight_decay"', params.get("weight_decay"), lambda v: v >= 0, ">= 0")
    for beta in params.get("betas") or ():
        _check_range('ds_config "optimizer.params.betas"', beta, lambda v: 0 <= v < 1, "in [0, 1)")


def _check_range(where: str, value: Any, ok: Callable[[float], bool], rule: str) -> None:
    if value is None:
        return
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not ok(value):
        raise ConfigError(f"{where} must be {rule}, got {value!r}")
