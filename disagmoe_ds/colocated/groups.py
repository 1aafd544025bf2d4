"""The adapter that shows co-located mode's expert process groups to DeepSpeed.

The groups themselves are made with every other group of the job (``groups.build_process_groups`` over
``ColocatedLayout.group_ranks``): data parallel (all W ranks), expert parallel (``ep_size`` ranks, one group per
expert replica), expert data parallel (``W / ep_size`` ranks, one per expert slice).

DeepSpeed finds expert groups in module globals of ``deepspeed.utils.groups`` keyed by the expert group name
(``ep_size_N``). ``register_with_deepspeed`` is the one place that fills them; it must run before
``deepspeed.initialize`` so that the engine and ZeRO pick our groups (with our timeout) instead of creating their
own. The ranks are exactly those of DeepSpeed's ``_create_expert_and_data_parallel(ep_size)`` (E + D order).
"""

from __future__ import annotations

import torch.distributed as dist
from deepspeed.utils import groups as ds_groups

from disagmoe_ds.colocated.layout import ColocatedLayout
from disagmoe_ds.errors import LayoutError
from disagmoe_ds.groups import ProcessGroups


def register_with_deepspeed(groups: ProcessGroups, layout: ColocatedLayout) -> None:
    """Fill DeepSpeed's expert-group registry with ours under ``layout.expert_group_name``."""
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


def _register(
    registry: dict, ranks_registry: dict, name: str, group: dist.ProcessGroup | None, ranks: tuple[int, ...]
) -> None:
    assert group is not None, "a co-located layout makes both expert groups"
    # A name already registered (an earlier engine in this process) is replaced only if it covers the same ranks;
    # anything else would pair our expert parameters with another layout's groups.
    if name in ranks_registry and tuple(ranks_registry[name]) != ranks:
        raise LayoutError(
            f"DeepSpeed already has expert group {name} over ranks {list(ranks_registry[name])}, this layout "
            f"needs {list(ranks)}; one process cannot hold two co-located layouts of one ep_size"
        )
    registry[name] = group
    ranks_registry[name] = list(ranks)
