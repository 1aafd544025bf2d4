"""The process groups of co-located mode, created in one function, and the adapter that shows them to DeepSpeed.

Groups (every rank creates all of them, in this order, because ``new_group`` is collective over the world):

    data_parallel        all W ranks        attention gradients (DeepSpeed's data-parallel group)
    expert_parallel      ep_size ranks      the dispatch/combine all-to-alls (one group per expert replica)
    expert_data_parallel W / ep_size ranks  the expert gradients and their ZeRO partitions (one per slice)

DeepSpeed finds expert groups in module globals of ``deepspeed.utils.groups`` keyed by the expert group name
(``ep_size_N``). ``register_with_deepspeed`` is the one place that fills them; it must run before
``deepspeed.initialize`` so that the engine and ZeRO pick our groups (with our timeout) instead of creating their
own. The ranks are exactly those of DeepSpeed's ``_create_expert_and_data_parallel(ep_size)`` (E + D order).
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import timedelta

import torch.distributed as dist

from disagmoe_ds.colocated.layout import ColocatedLayout


@dataclass(frozen=True)
class ColocatedGroups:
    """This rank's groups and their ranks (global ranks, increasing)."""

    data_parallel: dist.ProcessGroup
    expert_parallel: dist.ProcessGroup
    expert_data_parallel: dist.ProcessGroup
    expert_parallel_ranks: tuple[int, ...]
    expert_data_parallel_ranks: tuple[int, ...]


def build_colocated_groups(layout: ColocatedLayout, rank: int, timeout: timedelta | None = None) -> ColocatedGroups:
    """Create every group of the layout on every rank (same order everywhere) and keep this rank's."""
    layout.check_world_size(dist.get_world_size())
    data_parallel = dist.new_group(list(range(layout.world_size)), timeout=timeout)
    ep_ranks = [layout.ep_group_ranks(r) for r in range(layout.expert_data_parallel)]
    edp_ranks = [layout.edp_group_ranks(e) for e in range(layout.ep_size)]
    ep = _mine(ep_ranks, rank, timeout)
    edp = _mine(edp_ranks, rank, timeout)
    return ColocatedGroups(data_parallel, ep[0], edp[0], ep[1], edp[1])


def _mine(
    candidates: list[tuple[int, ...]], rank: int, timeout: timedelta | None
) -> tuple[dist.ProcessGroup, tuple[int, ...]]:
    mine = None
    for ranks in candidates:
        group = dist.new_group(list(ranks), timeout=timeout)
        if rank in ranks:
            mine = (group, ranks)
    assert mine is not None, f"rank {rank} is in none of {candidates}"
    return mine


def register_with_deepspeed(groups: ColocatedGroups, layout: ColocatedLayout) -> None:
    """Fill DeepSpeed's expert-group registry with ours under ``layout.expert_group_name``."""
    from deepspeed.utils import groups as ds_groups

    name = layout.expert_group_name
    _register(
        ds_groups._EXPERT_PARALLEL_GROUP,
        ds_groups._EXPERT_PARALLEL_GROUP_RANKS,
        name,
        groups.expert_parallel,
        groups.expert_parallel_ranks,
    )
    _register(
        ds_groups._EXPERT_DATA_PARALLEL_GROUP,
        ds_groups._EXPERT_DATA_PARALLEL_GROUP_RANKS,
        name,
        groups.expert_data_parallel,
        groups.expert_data_parallel_ranks,
    )


def _register(registry: dict, ranks_registry: dict, name: str, group: dist.ProcessGroup, ranks: tuple[int, ...]):
    # A name already registered (an earlier engine in this process) is replaced only if it covers the same ranks;
    # anything else would pair our expert parameters with another layout's groups.
    if name in ranks_registry and tuple(ranks_registry[name]) != ranks:
        raise RuntimeError(
            f"DeepSpeed already has expert group {name} over ranks {list(ranks_registry[name])}, this layout "
            f"needs {list(ranks)}; one process cannot hold two co-located layouts of one ep_size"
        )
    registry[name] = group
    ranks_registry[name] = list(ranks)
