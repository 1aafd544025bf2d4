"""The job's AF-Pipe schedule, generated the same way on every rank and before launch: every rank's streams, and
the start banner's lines about the pipeline."""

from __future__ import annotations

import torch

from disagmoe_ds.config import DisagMoEConfig
from disagmoe_ds.jsonfile import JsonObject
from disagmoe_ds.layout import Layout
from disagmoe_ds.models.moe_pattern import moe_layer_pattern
from disagmoe_ds.schedule import Costs, PipeShape, Schedule, generate, unit_costs


def job_schedule(config: JsonObject, layout: Layout, cfg: DisagMoEConfig, costs: Costs | None) -> Schedule:
    """The job's AF-Pipe schedule, the same on every rank: the start banner's bubble and every rank's streams.
    ``costs``: its task costs, computed before the ranks start (``planner.runtime_costs.job_costs``), so every rank
    generates it from the same data; without them every task costs one unit (split as ``cfg``'s backward is)."""
    if costs is None:
        costs = unit_costs(split_backward=cfg.split_backward, compiled=cfg.compile, ffn_zero3=cfg.experts_sharded)
    shape = PipeShape(layout.depth, layout.num_layers, moe_layer_pattern(config))
    return generate(shape, cfg.micro_batches, costs=costs, max_in_flight=cfg.max_in_flight)


def schedule_lines(config: JsonObject, layout: Layout, cfg: DisagMoEConfig, costs: Costs | None) -> list[str]:
    """The start banner's lines: the layout, the A:F split, and the pipeline with its predicted bubble."""
    schedule = job_schedule(config, layout, cfg, costs)
    bubble = sum(schedule.bubble_fraction.values()) / len(schedule.bubble_fraction)
    return [
        f"layout: {layout.describe()}",
        f"A:F split: {layout.attention_gpus}:{layout.ffn_gpus} of {layout.world_size} ranks",
        f"pipeline: {cfg.micro_batches} micro-batches per lane per step, at most {schedule.max_in_flight} "
        f"in flight per worker; predicted bubble {bubble:.0%} {_costed_on(cfg.cluster)}",
    ]


def _costed_on(cluster: str) -> str:
    """What the predicted bubble assumes: the schedule is simulated with the task costs of ``cluster``'s GPUs."""
    if torch.cuda.is_available():
        return f"(schedule simulation with {cluster} task costs)"
    return f"on {cluster} GPUs (schedule simulation; these CPU ranks run the same order at other speeds)"
