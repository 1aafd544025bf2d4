"""The two ways a job places the model on its ranks, behind the one interface the training loop uses.

disaggregated  attention and experts on disjoint ranks, the AF-Pipe schedule (``afpipe.build.build_rank``)
colocated      every rank holds the whole attention side and a slice of the experts: EP+DP with all-to-all
               dispatch (``colocated.build_colocated_rank``); the one-GPU path and the baseline

``--mode`` picks one ``TrainMode`` once (``mode_of``); before any rank starts it validates the layout and costs
the tasks of its schedule (the job plan holds both), then it gives the banner its layout lines and builds a rank.
What it builds is a ``runtime.rank.RankRuntime``: the loop, the checkpoints and the expert balancing read nothing
else, and never ask which mode built it.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any, ClassVar, Protocol

import torch
from torch import nn
from transformers import PretrainedConfig

from disagmoe_ds.afpipe.build import build_rank, job_schedule
from disagmoe_ds.colocated.build import build_colocated_rank
from disagmoe_ds.colocated.layout import ColocatedLayout
from disagmoe_ds.layout import JobLayout, Layout
from disagmoe_ds.models.tensor_parallel import check_lane
from disagmoe_ds.planner.runtime_costs import job_costs
from disagmoe_ds.runtime.rank import RankRuntime
from disagmoe_ds.schedule import Costs
from disagmoe_ds.train.args import TrainArgs


class TrainMode(Protocol):
    """How the training loop drives one mode from the command line's ``TrainArgs``; the mode's own rank-building
    steps are its ``runtime.rank.RankMode`` (``afpipe.build.Disaggregated``, ``colocated.build.Colocated``)."""

    name: ClassVar[str]

    def preflight(self, args: TrainArgs, config: PretrainedConfig, world_size: int) -> JobLayout:
        """Validate the layout against the model's ``config``, the world size and the ds_config; return it."""
        ...

    def schedule_costs(self, args: TrainArgs, config: PretrainedConfig, layout: Any) -> Costs | None:
        """The task costs the mode's schedule is generated from, for ``layout`` (this mode's ``preflight``): computed
        once, before any rank starts, and handed to the ranks as data; None: the mode has no schedule to cost."""
        ...

    def describe(
        self, args: TrainArgs, layout: Any, config: PretrainedConfig, schedule_costs: Costs | None
    ) -> list[str]:
        """The start banner's lines about ``layout`` (this mode's) and the pipeline; ``config``: the model's;
        ``schedule_costs``: this mode's ``schedule_costs``."""
        ...

    def build(
        self,
        args: TrainArgs,
        layout: Any,
        *,
        schedule_costs: Costs | None,
        model: nn.Module,
        device: torch.device,
        weights: Path | None = None,
    ) -> RankRuntime:
        """This rank's part of the job (collective: every rank calls it) in ``layout`` (this mode's ``preflight``),
        its schedule generated from ``schedule_costs`` (this mode's), cut from ``model``; ``weights``: the HF
        directory whose safetensors fill the parts of a meta ``model`` (``train.model.TrainModel``)."""
        ...


class DisaggregatedTraining:
    name: ClassVar[str] = "disaggregated"

    def preflight(self, args: TrainArgs, config: PretrainedConfig, world_size: int) -> Layout:
        layout = build_rank.layout_for(config, args.cfg, args.ds_config, world_size)
        check_lane(config, layout.sequence_parallel, layout.tensor_parallel, args.seq_len)
        return layout

    def schedule_costs(self, args: TrainArgs, config: PretrainedConfig, layout: Layout) -> Costs:
        return job_costs(
            config.to_dict(), layout, args.cfg, seq_len=args.seq_len, micro_batch_size=args.micro_batch_size
        )

    def describe(
        self, args: TrainArgs, layout: Layout, config: PretrainedConfig, schedule_costs: Costs | None
    ) -> list[str]:
        schedule = job_schedule(config.to_dict(), layout, args.cfg, schedule_costs)
        bubble = sum(schedule.bubble_fraction.values()) / len(schedule.bubble_fraction)
        return [
            f"layout: {layout.describe()}",
            f"A:F split: {layout.attention_gpus}:{layout.ffn_gpus} of {layout.world_size} ranks",
            f"pipeline: {args.cfg.micro_batches} micro-batches per lane per step, at most {schedule.max_in_flight} "
            f"in flight per worker; predicted bubble {bubble:.0%} {_costed_on(args.cfg.cluster)}",
        ]

    def build(
        self,
        args: TrainArgs,
        layout: Layout,
        *,
        schedule_costs: Costs | None,
        model: nn.Module,
        device: torch.device,
        weights: Path | None = None,
    ) -> RankRuntime:
        runtime = _build(
            build_rank,
            args,
            layout,
            model=model,
            device=device,
            weights=weights,
            seq_len=args.seq_len,
            schedule_costs=schedule_costs,
        )
        if args.cfg.compile or args.cfg.cuda_graphs:  # compiled kernels loaded, graphs captured before any exchange
            runtime.executor.warm_up(args.seq_len, packed=True, evaluates=args.evaluates)  # packed data: positions
        return runtime


def _costed_on(cluster: str) -> str:
    """What the predicted bubble assumes: the schedule is simulated with the task costs of ``cluster``'s GPUs."""
    if torch.cuda.is_available():
        return f"(schedule simulation with {cluster} task costs)"
    return f"on {cluster} GPUs (schedule simulation; these CPU ranks run the same order at other speeds)"


class ColocatedTraining:
    name: ClassVar[str] = "colocated"

    def preflight(self, args: TrainArgs, config: PretrainedConfig, world_size: int) -> ColocatedLayout:
        return build_colocated_rank.layout_for(config, args.cfg, args.ds_config, world_size)

    def schedule_costs(self, args: TrainArgs, config: PretrainedConfig, layout: ColocatedLayout) -> None:
        return None  # one micro-batch at a time, forward then backward: nothing to schedule

    def describe(
        self, args: TrainArgs, layout: ColocatedLayout, config: PretrainedConfig, schedule_costs: Costs | None
    ) -> list[str]:
        del config, schedule_costs
        if layout.ep_size > 1:
            exchange = f"dispatch and combine all-to-alls over {layout.ep_size} ranks on the critical path"
        else:
            exchange = "no token exchange (every rank holds every expert)"
        return [
            f"layout: {layout.describe()}",
            f"pipeline: {args.cfg.micro_batches} micro-batches per rank per step, one at a time (forward, "
            f"backward); {exchange}",
        ]

    def build(
        self,
        args: TrainArgs,
        layout: ColocatedLayout,
        *,
        schedule_costs: Costs | None,
        model: nn.Module,
        device: torch.device,
        weights: Path | None = None,
    ) -> RankRuntime:
        del schedule_costs  # none: no schedule
        runtime = _build(build_colocated_rank, args, layout, model=model, device=device, weights=weights)
        if args.cfg.cuda_graphs:
            runtime.executor.warm_up(args.seq_len, packed=True)
        return runtime


def _build(
    builder: Callable[..., RankRuntime],
    args: TrainArgs,
    layout: JobLayout,
    *,
    model: nn.Module,
    device: torch.device,
    weights: Path | None,
    **extra: Any,
) -> RankRuntime:
    """Both modes' builders take the same arguments from the command line (``extra``: one mode's own)."""
    return builder(
        args.model,
        args.ds_config,
        args.cfg,
        micro_batch_size=args.micro_batch_size,
        dtype=args.torch_dtype,
        device=device,
        model=model,
        weights=weights,
        seed=args.seed,
        layout=layout,
        **extra,
    )


_MODES: dict[str, TrainMode] = {mode.name: mode for mode in (DisaggregatedTraining(), ColocatedTraining())}


def mode_of(args: TrainArgs) -> TrainMode:
    return _MODES[args.mode]
