"""The two ways a job places the model on its ranks; ``--mode`` picks one (``mode_of``).

disaggregated  attention and experts on disjoint ranks, the AF-Pipe schedule (``afpipe.build.build_rank``)
colocated      every rank holds the whole attention side and a slice of the experts: EP+DP with all-to-all
               dispatch (``colocated.build.build_colocated_rank``); the one-GPU path and the baseline

A mode is one ``runtime.rank.RankBuilder``: its ``preflight`` validates the layout before any rank starts, its
``describe`` gives the banner its lines, and every rank builds with it (``build``). What a rank builds is a
``runtime.rank.RankRuntime``: the loop, the checkpoints and the expert balancing read nothing else, and never ask
which mode built it.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from torch import nn
from transformers import PretrainedConfig

from disagmoe_ds.afpipe.build import build_rank
from disagmoe_ds.colocated.build import build_colocated_rank
from disagmoe_ds.config import DisagMoEConfig
from disagmoe_ds.layout import JobLayout, Layout
from disagmoe_ds.planner.runtime_costs import job_costs
from disagmoe_ds.runtime.rank import RankBuilder, RankRuntime
from disagmoe_ds.schedule import Costs
from disagmoe_ds.train.args import TrainArgs

# Each mode's layout and config types are its own (``Layout`` and ``DisagMoEConfig``, ``ColocatedLayout`` and
# ``ColocatedConfig``); ``TrainArgs`` pairs ``cfg`` with ``mode``, and the mode's preflight made the layout.
MODES: dict[str, RankBuilder[Any, Any]] = {"disaggregated": build_rank, "colocated": build_colocated_rank}


def mode_of(args: TrainArgs) -> RankBuilder[Any, Any]:
    return MODES[args.mode]


def schedule_costs(args: TrainArgs, config: PretrainedConfig, layout: JobLayout) -> Costs | None:
    """The task costs the AF-Pipe schedule is generated from (a disaggregated ``layout``'s; a co-located one runs one
    micro-batch at a time and has none): computed once, before any rank starts, and handed to the ranks as data."""
    cfg = args.cfg
    if not isinstance(layout, Layout) or not isinstance(cfg, DisagMoEConfig):  # the two go together (``MODES``)
        return None
    return job_costs(config.to_dict(), layout, cfg, seq_len=args.seq_len, micro_batch_size=args.micro_batch_size)


def build(
    args: TrainArgs,
    layout: JobLayout,
    *,
    schedule_costs: Costs | None,
    model: nn.Module,
    device: torch.device,
    weights: Path | None = None,
) -> RankRuntime:
    """This rank's part of the job (collective: every rank calls it) in ``layout`` (the mode's ``preflight``), its
    schedule generated from ``schedule_costs``, cut from ``model``; ``weights``: the HF directory whose safetensors
    fill the parts of a meta ``model`` (``train.model.TrainModel``). Warmed up for the first step."""
    mode = mode_of(args)
    runtime = mode(
        args.model,
        args.ds_config,
        args.cfg,
        micro_batch_size=args.micro_batch_size,
        dtype=args.torch_dtype,
        device=device,
        model=model,
        weights=weights,
        seed=args.seed,
        seq_len=args.seq_len,
        layout=layout,
        schedule_costs=schedule_costs,
    )
    mode.warm_up(runtime, args.cfg, args.seq_len, evaluates=args.evaluates)
    return runtime
