"""What the run needs of this machine, checked before any rank starts: host memory for CPU ranks, disk space for a
checkpoint. Both come from the planner's training-state model (parameters, gradients, optimizer state per rank;
activations come on top), so a run that cannot fit is one line instead of a rank killed by the kernel or a save
that fails after the steps it was meant to keep."""

from __future__ import annotations

import shutil
from pathlib import Path

import psutil

from disagmoe_ds.config import SIDES
from disagmoe_ds.errors import ConfigError
from disagmoe_ds.layout import JobLayout, Layout
from disagmoe_ds.models.lora_settings import GROUPS
from disagmoe_ds.planner.lora import TARGETS
from disagmoe_ds.planner.memory import rank_state_bytes
from disagmoe_ds.planner.rank_state import ColocatedShape
from disagmoe_ds.train.args import TrainArgs

# A checkpoint holds the weights and optimizer state but not the gradients: at least this share of the training state.
CHECKPOINT_SHARE = 0.7


def planned_state(args: TrainArgs, config, layout: JobLayout, *, full: bool = False) -> dict[str, float]:
    """The planner's training-state bytes of the worst rank of each kind (``attention``/``ffn``, or ``colocated``);
    a LoRA run's own unless ``full`` (or its targets name projections, which the planner does not count)."""
    stages = {side: args.cfg.zero_stage_of(side, args.ds_config) for side in SIDES}
    shape = _planner_shape(layout)
    lora = args.cfg.lora
    if full or lora is None or not set(lora.targets) <= set(GROUPS):
        lora = None
    return rank_state_bytes(
        config.to_dict(),
        shape,
        precision=args.dtype,
        zero_stage_a=stages["attention"],
        zero_stage_f=stages["ffn"],
        lora_rank=0 if lora is None else lora.rank,
        lora_targets=TARGETS if lora is None else lora.targets,
        lora_train_router=lora is not None and lora.train_router,
    )


def _planner_shape(layout: JobLayout) -> Layout | ColocatedShape:
    """``layout`` as the planner reads it: a disaggregated ``Layout``, or what it reads of a co-located one."""
    if isinstance(layout, Layout | ColocatedShape):
        return layout
    raise TypeError(f"the planner prices no {type(layout).__name__} (neither mode's layout)")


def job_state_bytes(args: TrainArgs, config, layout: JobLayout) -> float:
    """The training state of every rank of the job together."""
    state = planned_state(args, config, layout)
    if "colocated" in state:
        return state["colocated"] * layout.world_size
    roles = (layout.role_of(rank) for rank in range(layout.world_size))
    return sum(state["attention" if role.is_attention else "ffn"] for role in roles)


def check_resources(args: TrainArgs, config, layout: JobLayout, *, cpu_ranks_here: bool) -> None:
    """Refuse a run whose training state cannot fit this host's memory (``cpu_ranks_here``: every rank is a CPU
    process of this machine) or whose first checkpoint cannot fit the free space under ``--save-dir``."""
    total = job_state_bytes(args, config, layout)
    if cpu_ranks_here:
        available = psutil.virtual_memory().available
        if total > available:
            raise ConfigError(
                f"the {layout.world_size} CPU ranks' training state alone is {_gib(total)} (planner) and this machine "
                f"has {_gib(available)} of memory available: use a smaller model or run on GPUs"
            )
    if args.save_dir is not None:
        free = shutil.disk_usage(_existing(args.save_dir)).free
        if CHECKPOINT_SHARE * total > free:
            raise ConfigError(
                f"--save-dir {args.save_dir}: a checkpoint of this run takes about {_gib(CHECKPOINT_SHARE * total)} "
                f"(planner) and its disk has {_gib(free)} free; free space or pick another --save-dir"
            )


def _existing(path: Path) -> Path:
    while not path.exists():
        path = path.parent
    return path


def _gib(n: float) -> str:
    return f"{n / 2**30:.1f} GiB"
