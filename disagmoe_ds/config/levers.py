"""The levers a job turns on, as the capabilities table reads them (``capabilities.rules.Job``), from either mode's
config and its ds_config."""

from __future__ import annotations

from typing import Any, Protocol

from disagmoe_ds.capabilities.rules import Job
from disagmoe_ds.config.sections import SIDES


class LeverConfig(Protocol):
    """What ``job_of`` needs of either mode's config: its ZeRO stage and optimizer offload per side (its levers are
    read by name)."""

    def zero_stage_of(self, side: str, ds_config: dict[str, Any]) -> int: ...

    def offload_optimizer_of(self, side: str, ds_config: dict[str, Any]) -> bool: ...


def job_of(
    model_type: str | None, cfg: LeverConfig, ds_config: dict[str, Any] | None = None, **more: float | None
) -> Job:
    """The job of ``cfg`` (a ``DisagMoEConfig`` or a ``ColocatedConfig``: a lever its mode has no key for is off) on
    the family ``model_type`` (None: not known where it is checked); with ``ds_config``, its ZeRO stages (each side's
    checked on the way) and DeepSpeed's offloads; ``more``: levers of the command line (an evaluation, a rate)."""
    offload_share = getattr(cfg, "offload_share", lambda side: 0.0)
    levers: dict[str, float | None] = {
        "activation_checkpointing": getattr(cfg, "activation_checkpointing", False),
        "selective_recompute": getattr(cfg, "selective_recompute", False),
        "recompute": bool(getattr(cfg, "recompute", {})),
        "offload": any(offload_share(side) > 0 for side in SIDES),
        "offload_ffn": offload_share("ffn") > 0,
        "split_backward": getattr(cfg, "split_backward", False),
        "sequence_parallel": getattr(cfg, "sequence_parallel", 1),
        "tensor_parallel": getattr(cfg, "tensor_parallel", 1),
        "cuda_graphs": getattr(cfg, "cuda_graphs", False),
        "compile": getattr(cfg, "compile", False),
        "fp8": getattr(cfg, "fp8", False),
        "lora": getattr(cfg, "lora", None) is not None,
        "capacity_factor": getattr(cfg, "capacity_factor", None) is not None,
    }
    if ds_config is not None:
        stages = {side: cfg.zero_stage_of(side, ds_config) for side in SIDES}
        zero = ds_config.get("zero_optimization", {})
        levers |= {
            "zero3_attention": stages["attention"] == 3,
            "zero3_ffn": stages["ffn"] == 3,
            "offload_optimizer": any(cfg.offload_optimizer_of(side, ds_config) for side in SIDES),
            "offload_optimizer_attention": cfg.offload_optimizer_of("attention", ds_config),
            "offload_param": bool(zero.get("offload_param")),
        }
    return Job.of(model_type, **levers, **more)
