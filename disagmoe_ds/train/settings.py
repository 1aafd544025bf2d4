"""What the flags derive from the ds_config: the layout of ``--mode``, and the ds_config with the flags applied.

The layout flags replace keys of the ds_config's ``"disagmoe"`` section (validated by ``DisagMoEConfig`` wherever a
value came from); ``--lr``, ``--dtype``, ``--zero`` and ``--steps`` edit its optimizer, scheduler, ``bf16`` and
``zero_optimization`` sections.

``--mode colocated`` (or a section holding ``"colocated"``, ``run_mode``) replaces the disaggregated layout by a
``ColocatedConfig``: ``--world-size`` ranks (else the section's ``colocated.world_size``, the launcher's world size
under a launcher, 1) and ``--ep-size`` (else ``colocated.ep_size``); the keys of the sections both modes share
(micro-batches, the communication timeout, ``compile``, ``cuda_graphs``, LoRA) still come from the section (or
``--micro-batches``), its attention/FFN layout keys are not used.
"""

from __future__ import annotations

import argparse
import copy
import warnings
from collections.abc import Iterable
from dataclasses import fields
from typing import Any

from disagmoe_ds.colocated.layout import ColocatedConfig
from disagmoe_ds.config import SECTION, DisagMoEConfig, flag_of, section_values
from disagmoe_ds.errors import ConfigError
from disagmoe_ds.models.lora_settings import lora_of
from disagmoe_ds.train.flags import (
    BOTH_MODES_KEYS,
    COLOCATED_FLAGS,
    DEFAULT_MICRO_BATCH_SIZE,
    LANE_KEYS,
    LAYOUT_FLAGS,
    SECTION_KEYS,
)

# Schedulers whose peak learning rate is a scheduler parameter, not the optimizer's lr.
_PEAK_LR_PARAM = {"WarmupLR": "warmup_max_lr", "WarmupDecayLR": "warmup_max_lr"}
# Schedulers that need the run length.
_NEEDS_TOTAL_STEPS = ("WarmupDecayLR", "WarmupCosineLR")


def micro_batch_size(flag: int | None, ds_config: dict[str, Any]) -> int:
    return flag or ds_config.get("train_micro_batch_size_per_gpu", DEFAULT_MICRO_BATCH_SIZE)


def dtype_name(flag: str | None, ds_config: dict[str, Any]) -> str:
    return flag or ("bf16" if ds_config.get("bf16", {}).get("enabled") else "fp32")


def run_mode(flag: str | None, ds_config: dict[str, Any]) -> str:
    """``--mode``, else the ds_config's: co-located where its section holds ``"colocated"`` (as the planner writes
    for a co-located plan), else disaggregated."""
    colocated = ds_config.get(SECTION, {}).get("colocated") is not None
    if flag == "disaggregated" and colocated:
        raise ConfigError(
            f'--mode disaggregated, but the ds_config\'s "{SECTION}.colocated" is for a co-located run; drop the flag '
            "or use a ds_config with a disaggregated layout"
        )
    return flag or ("colocated" if colocated else "disaggregated")


def mode_config(
    ns: argparse.Namespace, mode: str, ds_config: dict[str, Any], launched_world_size: int | None
) -> DisagMoEConfig | ColocatedConfig:
    """The layout of ``mode`` (``run_mode``); each mode's flags are refused in the other mode."""
    if mode == "disaggregated":
        _refuse_flags(ns, COLOCATED_FLAGS, "is a --mode colocated flag; the disaggregated layout is set by the "
                      "layout flags (--attention-gpus, --ffn-gpus, --depth ...)")  # fmt: skip
        flags = section_values(ns, SECTION_KEYS)
        return DisagMoEConfig.from_ds_config(ds_config, {**flags, "lora": lora_of(ns, verify=False)})
    _refuse_flags(
        ns,
        [name for name in LAYOUT_FLAGS if name not in LANE_KEYS],
        "sets the disaggregated layout; --mode colocated takes --world-size, --ep-size, --pp-size and the lanes' "
        "--sequence-parallel and --tensor-parallel",
    )
    section = DisagMoEConfig.from_ds_config(
        ds_config, {**section_values(ns, BOTH_MODES_KEYS), "lora": lora_of(ns, verify=False)}
    )
    ignored = {
        "max_in_flight": section.max_in_flight is not None,
        "offload": any(section.offload.values()),
        "resend": section.resend,
        "split_backward": section.split_backward,
        "capacity_factor": section.capacity_factor is not None,
    }
    named = [f'"{SECTION}.{key}"' for key, on in ignored.items() if on]
    if named:
        warnings.warn(
            f"{', '.join(named)} {'is' if len(named) == 1 else 'are'} ignored in co-located mode (they are AF-Pipe's "
            "levers)",
            stacklevel=2,
        )
    # both modes' section keys; the lanes' are the co-located layout's own (the section's are the attention side's)
    shared = ({f.name for f in fields(ColocatedConfig)} & {f.name for f in fields(DisagMoEConfig)}) - set(LANE_KEYS)
    placed = section.colocated or {}
    return ColocatedConfig(
        world_size=_first(ns.world_size, placed.get("world_size"), launched_world_size, 1),
        ep_size=_first(ns.ep_size, placed.get("ep_size")),
        pp_size=_first(ns.pp_size, placed.get("pp_size"), 1),
        virtual_stages=_first(ns.virtual_stages, placed.get("virtual_stages"), 1),
        stage_layers=_layer_counts(_first(ns.stage_layers, placed.get("stage_layers"))),
        **{key: _first(getattr(ns, key), placed.get(key), 1) for key in LANE_KEYS},
        **{key: getattr(section, key) for key in shared},
    )


def _layer_counts(counts: Any) -> tuple[int, ...] | None:
    """A list of layer counts (from the ds_config's JSON, or the flag's tuple), as the config holds it."""
    return None if counts is None else tuple(counts)


def _first(*values: Any) -> Any:
    """The first value given (not None): a flag, then the ds_config's, then a default."""
    return next((v for v in values if v is not None), None)


def _refuse_flags(ns: argparse.Namespace, names: Iterable[str], why: str) -> None:
    wrong = [name for name in names if getattr(ns, name) is not None]
    if wrong:
        raise ConfigError(f"{flag_of(wrong[0])} {why}")


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
