"""The job's plan: what the preflight derives once, before any rank starts, and every rank then reads."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from disagmoe_ds.checkpoint.resume import ResumePoint
from disagmoe_ds.layout import JobLayout
from disagmoe_ds.schedule import Costs
from disagmoe_ds.train.args import TrainArgs


@dataclass(frozen=True)
class JobPlan:
    """What the preflight derived, once: the ranks receive it (forked ones inherit it; under a launcher each rank
    made it before starting) instead of deriving it again."""

    args: TrainArgs  # with the freezing the resumed checkpoint records
    config: Any  # the model's HF config
    layout: JobLayout
    schedule_costs: Costs | None  # the task costs the AF-Pipe schedule is generated from (None: co-located)
    resume: ResumePoint | None
