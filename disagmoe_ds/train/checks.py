"""Values of the command line and the ds_config that no later layer checks, refused before any rank starts.

Each refusal is a ``ConfigError`` naming the flag or ds_config key, the value and what to change; what DeepSpeed
itself would refuse inside every rank is refused here too (``check_engine_config``).
"""

from __future__ import annotations

import argparse
import difflib
import importlib.util
import inspect
import tempfile
import warnings
from collections.abc import Callable
from functools import cache
from pathlib import Path
from typing import Any

from disagmoe_ds.capabilities.rules import Job, check
from disagmoe_ds.colocated.layout import ColocatedConfig
from disagmoe_ds.config import SECTION, SIDES, DisagMoEConfig
from disagmoe_ds.errors import ConfigError
from disagmoe_ds.runtime.deepspeed_role import role_ds_config


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
        "--pp-size": ns.pp_size,
        "--virtual-stages": ns.virtual_stages,
    }
    for flag, value in positive.items():
        if value is not None and value < 1:
            raise ConfigError(f"{flag} must be a positive integer, got {value}")
    for flag, value in {"--save-every": ns.save_every, "--keep-last": ns.keep_last}.items():
        if value < 0:
            raise ConfigError(f"{flag} must be >= 0, got {value}")
    if ns.bias_update_rate is not None and ns.bias_update_rate < 0:
        raise ConfigError(f"--bias-update-rate must be >= 0, got {ns.bias_update_rate}")


def check_eval_flags(ns: argparse.Namespace, cfg: DisagMoEConfig | ColocatedConfig) -> None:
    """The evaluation flags: held-out data for what is asked, --eval-only's weights and what it would write."""
    if ns.eval_split is not None and not 0 < ns.eval_split < 1:
        raise ConfigError(f"--eval-split must be a fraction between 0 and 1, got {ns.eval_split}")
    for flag, value in {"--eval-every": ns.eval_every, "--eval-steps": ns.eval_steps}.items():
        if value is not None and value < 1:
            raise ConfigError(f"{flag} must be a positive integer, got {value}")
    if ns.eval_data is not None and ns.eval_split is not None:
        raise ConfigError("--eval-data and --eval-split both give the held-out data; pass one of them")
    held_out = ns.eval_data is not None or ns.eval_split is not None
    asked = [flag for flag, value in (("--eval-every", ns.eval_every), ("--eval-steps", ns.eval_steps),
                                      ("--eval-only", ns.eval_only)) if value]  # fmt: skip
    if asked and not held_out:
        raise ConfigError(
            f"{asked[0]} needs held-out data: pass --eval-data PATH, or --eval-split F to hold out that fraction of "
            f"--data's samples"
        )
    check(Job.of(None, evaluation=held_out, cuda_graphs=cfg.cuda_graphs))  # what an evaluation runs beside
    if ns.eval_only:
        if ns.init_from is None and ns.resume is None:
            raise ConfigError("--eval-only evaluates the weights of --init-from HF_DIR or --resume CKPT; pass one")
        outputs = {"--export-hf": ns.export_hf, "--export-hf-merged": ns.export_hf_merged, "--timeline": ns.timeline,
                   "--save-every": ns.save_every}  # fmt: skip
        written = [flag for flag, value in outputs.items() if value]
        if written:
            raise ConfigError(f"--eval-only writes nothing but --metrics-file and --tensorboard; drop {written[0]}")


def check_resume_flags(resume: str | None, save_dir: Path | None) -> None:
    if resume == "" and save_dir is None:
        raise ConfigError("--resume without a checkpoint path needs --save-dir (the run's checkpoint root)")


def check_outputs(ns: argparse.Namespace) -> None:
    """Every place the run writes to can be written, checked before any rank starts: a read-only mount or a path
    through a file would otherwise end the run at its first save, losing the steps before it."""
    for flag, path, directory in (
        ("--save-dir", ns.save_dir, True),
        ("--export-hf", ns.export_hf, True),
        ("--export-hf-merged", ns.export_hf_merged, True),
        ("--tensorboard", ns.tensorboard, True),
        ("--metrics-file", ns.metrics_file, False),
        ("--timeline", ns.timeline, False),
    ):
        if path is not None:
            _check_writable(flag, Path(path), directory=directory)


def _check_writable(flag: str, path: Path, *, directory: bool) -> None:
    """``path`` (a directory, or a file) exists as that kind and is writable, or can be made where its nearest
    existing parent is. Nothing is left behind: the probe is a temporary file."""
    kind = "a directory" if directory else "a file"
    if path.exists() and path.is_dir() != directory:
        raise ConfigError(f"{flag} {path} is {'a file' if directory else 'a directory'}; it must be {kind}")
    folder = path if directory and path.exists() else path.parent
    while not folder.exists():
        folder = folder.parent
    if not folder.is_dir():
        raise ConfigError(f"{flag} {path} cannot be made: {folder} is a file, not a directory; pick another path")
    try:
        _probe(folder)
    except OSError as error:
        raise ConfigError(
            f"{flag} {path} cannot be written ({error.strerror or error} in {folder}); pick a path you can write to"
        ) from None


def _probe(folder: Path) -> None:
    with tempfile.TemporaryFile(dir=folder):
        pass


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


# DeepSpeed's monitor sections and the package each one imports on rank 0 when its engine is built.
_MONITOR_PACKAGES = {"tensorboard": "tensorboard", "wandb": "wandb", "comet": "comet_ml", "csv_monitor": None}


def check_monitors(ds_config: dict[str, Any]) -> None:
    """Every monitor the ds_config enables can start: its package imports (DeepSpeed would fail inside the ranks,
    after their start-up) and its output folder can be written."""
    for section, package in _MONITOR_PACKAGES.items():
        settings = ds_config.get(section)
        if not isinstance(settings, dict) or not settings.get("enabled", False):
            continue
        if package is not None and importlib.util.find_spec(package) is None:
            raise ConfigError(
                f'ds_config "{section}" is enabled but the {package} package is not installed: pip install '
                f'{package.replace("_", "-")}, or set "{section}": {{"enabled": false}}'
            )
        if settings.get("output_path"):
            _check_writable(f'ds_config "{section}.output_path"', Path(settings["output_path"]), directory=True)


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
    for stage in sorted({cfg.zero_stage_of(side, ds_config) for side in SIDES}):  # each side's, checked there
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


def check_ds_config_keys(ds_config: dict[str, Any]) -> None:
    """What DeepSpeed would ignore or fail on late, refused (or, for a key unlike any it knows, warned) here.

    A top-level key DeepSpeed does not read is silently ignored by it: a misspelt ``zero_optimization`` trains at
    ZeRO-0. The keys it reads are the ones its own config parser asks for (``_deepspeed_keys``), plus ours.
    """
    known = _deepspeed_keys()
    for key in sorted(set(ds_config) - known - {SECTION}):
        close = difflib.get_close_matches(key, sorted(known | {SECTION}), n=1, cutoff=0.75)
        if close:
            raise ConfigError(f'ds_config key "{key}" is not one DeepSpeed reads (it would be ignored); did you mean '
                              f'"{close[0]}"?')  # fmt: skip
        warnings.warn(f'ds_config key "{key}" is not one DeepSpeed {_ds_version()} reads; it is ignored', stacklevel=2)
    for section in ("optimizer", "scheduler"):
        block = ds_config.get(section)
        if block is not None and not (isinstance(block, dict) and block.get("type")):
            raise ConfigError(
                f'ds_config "{section}" has no "type"; name one (e.g. {_EXAMPLE_TYPE[section]}) or remove the block'
            )
    scheduler = ds_config.get("scheduler")
    if scheduler is not None:
        _check_scheduler(scheduler["type"], scheduler.get("params") or {})


_EXAMPLE_TYPE = {"optimizer": '"type": "AdamW"', "scheduler": '"type": "WarmupLR"'}
# Read by DeepSpeed outside its config parser (engine, profiler, autotuner, monitor set-up).
_READ_ELSEWHERE = {"scheduler", "activation_checkpointing", "flops_profiler", "aio", "autotuning"}


@cache
def _deepspeed_keys() -> frozenset[str]:
    """The top-level keys DeepSpeed's config parser reads (recorded while it parses a minimal config)."""
    from deepspeed.runtime.config import DeepSpeedConfig

    class Recorded(dict):
        seen: set[str] = set()

        def get(self, key, default=None):
            self.seen.add(key)
            return super().get(key, default)

        def __contains__(self, key) -> bool:
            self.seen.add(key)
            return super().__contains__(key)

        def __getitem__(self, key):
            self.seen.add(key)
            return super().__getitem__(key)

        def keys(self):  # ``KEY in config.keys()``, as DeepSpeed often asks, is a question about KEY too
            return self

    DeepSpeedConfig(Recorded(train_batch_size=1, train_micro_batch_size_per_gpu=1, gradient_accumulation_steps=1))
    return frozenset(Recorded.seen | _READ_ELSEWHERE)


def _ds_version() -> str:
    import deepspeed

    return deepspeed.__version__


def _check_scheduler(name: str, params: dict[str, Any]) -> None:
    """A scheduler DeepSpeed knows, with every parameter its constructor requires."""
    from deepspeed.runtime import lr_schedules

    if name not in lr_schedules.VALID_LR_SCHEDULES:
        raise ConfigError(
            f'ds_config "scheduler.type" {name!r} is not a DeepSpeed scheduler; one of '
            f"{', '.join(lr_schedules.VALID_LR_SCHEDULES)}"
        )
    signature = inspect.signature(getattr(lr_schedules, name).__init__)
    required = [
        p.name
        for p in list(signature.parameters.values())[2:]  # self, optimizer
        if p.default is inspect.Parameter.empty and p.kind is p.POSITIONAL_OR_KEYWORD
    ]
    missing = [p for p in required if p not in params]
    if missing:
        raise ConfigError(f'ds_config "scheduler.params" lacks {", ".join(missing)}, which {name} requires')


def _check_range(where: str, value: Any, ok: Callable[[float], bool], rule: str) -> None:
    if value is None:
        return
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not ok(value):
        raise ConfigError(f"{where} must be {rule}, got {value!r}")
