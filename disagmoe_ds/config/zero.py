"""Each side's effective ZeRO stage (``effective_zero_stage``): the one rule every engine's stage is read through."""

from __future__ import annotations

from typing import Any

from disagmoe_ds.errors import ConfigError

SECTION = "disagmoe"  # the ds_config section this package reads
# ZeRO-3 (parameters sharded) on the expert side only, and only by its per-side stage: "zero_optimization.stage" is
# every side's default and the stage of one engine over both kinds of parameters (co-located, DeepSpeed-MoE).
ZERO_STAGES = {"attention": (0, 1, 2), "ffn": (0, 1, 2, 3)}
DS_STAGES = (0, 1, 2)


def ds_stage(ds_config: dict[str, Any]) -> int:
    """The ds_config's own ``zero_optimization.stage`` (each side's default)."""
    return int(ds_config.get("zero_optimization", {}).get("stage", 0))


def effective_zero_stage(ds_config: dict[str, Any], side: str | None = None, side_stage: int | None = None) -> int:
    """The ZeRO stage an engine runs at, refused with the fix where it cannot: ``side_stage`` (the section's stage
    for ``side``, checked with the section), else ``zero_optimization.stage``, which is 0-2 (``side`` None: one
    engine over both kinds of parameters). bf16 needs stage >= 1 (DeepSpeed's BF16 optimizer or ZeRO's)."""
    bf16 = bool(ds_config.get("bf16", {}).get("enabled"))
    on_side = "" if side is None else f" on the {'expert' if side == 'ffn' else 'attention'} side"
    if side_stage is not None:
        if bf16 and side_stage == 0:
            raise ConfigError(
                f'bf16 needs ZeRO stage >= 1{on_side} in DisagMoE-DS ("{SECTION}.zero_stage.{side}" is 0: set it to '
                "1 or more, or use fp32)"
            )
        return side_stage
    stage = ds_stage(ds_config)
    if stage not in DS_STAGES:
        if side is None:
            hint = "ZeRO-3 shards a disaggregated job's expert side only, and one engine holds both kinds here"
        else:
            hint = f'ZeRO-3 shards the expert side only: "{SECTION}": {{"zero_stage": {{"attention": 2, "ffn": 3}}}}'
        raise ConfigError(f'"zero_optimization.stage" {stage} is not supported; use 0, 1 or 2 (--zero 1); {hint}')
    if bf16 and stage == 0:
        raise ConfigError(
            f'bf16 needs "zero_optimization.stage" 1 or 2{on_side} in DisagMoE-DS (--zero 1, or --dtype fp32)'
        )
    return stage
