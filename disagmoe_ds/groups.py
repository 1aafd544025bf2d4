"""Every process group of a job, made in one function and held in one frozen value that is passed explicitly.

``torch.distributed.new_group`` is collective over the world, so every rank creates every group of the layout in
the same order: the axes of ``layout.group_ranks()`` (data parallel, expert parallel, expert data parallel), then,
for a disaggregated layout, the exchange communicators and their header groups
(``comm.exchange.build_exchange_comms``, which also warms them up). Each rank keeps its own group of every axis.
No other code creates a group; DeepSpeed is shown the co-located expert groups by one adapter
(``colocated.groups.register_with_deepspeed``).

    axis                  disaggregated                        co-located
    data_parallel         lanes of an A-group (of one TP       all W ranks (attention side)
                          rank), or the replicas of an
                          expert shard
    expert_parallel       -                                    ep_size ranks: one copy of the experts, all-to-all
    expert_data_parallel  -                                    W / ep_size ranks: replicas of an expert slice
    sequence_parallel     s lanes (one sequence; with TP the   -
                          lanes of one TP rank)
    tensor_parallel       t consecutive lanes (one sequence,   -
                          the attention heads in shards)
    lane_slices           with SP and TP: the s x t lanes of   -
                          one micro-batch
    exchange_node         with node_dedup: the expert ranks    -
                          of one node (the fan-out inside it)
    exchange              one communicator per (kind, group)   -
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

from disagmoe_ds.comm.exchange import ExchangeComms, build_exchange_comms
from disagmoe_ds.comm.transport import Transport
from disagmoe_ds.layout import JobLayout, Layout


@dataclass(frozen=True)
class ProcessGroups:
    """This rank's group of every axis and its global ranks (increasing); None and no ranks where the layout has no
    such axis (see the module docstring)."""

    data_parallel: dist.ProcessGroup
    data_parallel_ranks: tuple[int, ...]
    expert_parallel: dist.ProcessGroup | None = None
    expert_parallel_ranks: tuple[int, ...] = ()
    expert_data_parallel: dist.ProcessGroup | None = None
    expert_data_parallel_ranks: tuple[int, ...] = ()
    exchange: ExchangeComms | None = None
    sequence_parallel: dist.ProcessGroup | None = None
    sequence_parallel_ranks: tuple[int, ...] = ()
    tensor_parallel: dist.ProcessGroup | None = None
    tensor_parallel_ranks: tuple[int, ...] = ()
    lane_slices: dist.ProcessGroup | None = None
    lane_slices_ranks: tuple[int, ...] = ()
    exchange_node: dist.ProcessGroup | None = None
    exchange_node_ranks: tuple[int, ...] = ()

    @property
    def data_parallel_size(self) -> int:
        """Replicas of this rank's parameters (what DeepSpeed averages the gradients over)."""
        return len(self.data_parallel_ranks)


def build_process_groups(
    layout: JobLayout,
    rank: int,
    *,
    timeout: timedelta | None = None,
    transport: Transport | None = None,
    device: torch.device | None = None,
    headerless: bool = False,
) -> ProcessGroups:
    """Create every group of ``layout`` on every rank (same order everywhere) and keep ``rank``'s.

    ``transport`` (disaggregated layouts): the exchange communicators are created over it and warmed up on ``device``;
    ``headerless``: m2n and resid go without headers (``comm.exchange.build_exchange_comms``).
    ``timeout``: a rank waiting longer than this on a collective fails instead of hanging (the transport has its own).
    """
    layout.check_world_size(dist.get_world_size())
    plan = layout.group_ranks()
    data_parallel, data_parallel_ranks = _create(plan.data_parallel, rank, timeout)
    if data_parallel is None:
        raise ValueError(f"rank {rank} is in no data-parallel group of {layout.describe()}")
    expert_parallel = _create(plan.expert_parallel, rank, timeout)
    expert_data_parallel = _create(plan.expert_data_parallel, rank, timeout)
    sequence_parallel = _create(plan.sequence_parallel, rank, timeout)
    tensor_parallel = _create(plan.tensor_parallel, rank, timeout)
    lane_slices = _create(plan.lane_slices, rank, timeout)
    exchange_node = _create(plan.exchange_nodes, rank, timeout)
    exchange = _exchange(layout, transport, device, headerless)
    return ProcessGroups(
        data_parallel,
        data_parallel_ranks,
        *expert_parallel,
        *expert_data_parallel,
        exchange,
        *sequence_parallel,
        *tensor_parallel,
        *lane_slices,
        *exchange_node,
    )


def _exchange(
    layout: JobLayout, transport: Transport | None, device: torch.device | None, headerless: bool
) -> ExchangeComms | None:
    """The exchange communicators over ``transport`` (none without one); only a disaggregated layout has them."""
    if transport is None:
        return None
    if not isinstance(layout, Layout) or device is None:
        raise ValueError(
            f"exchange communicators need a disaggregated Layout and a device, got {type(layout).__name__} and "
            f"{device}; pass no transport for a co-located layout"
        )
    return build_exchange_comms(layout, transport, device=device, headerless=headerless)


def _create(
    axis: tuple[tuple[int, ...], ...], rank: int, timeout: timedelta | None
) -> tuple[dist.ProcessGroup | None, tuple[int, ...]]:
    """Every group of one axis, created in order; ``rank``'s group and ranks (None, () if it is in none)."""
    mine: tuple[dist.ProcessGroup | None, tuple[int, ...]] = (None, ())
    for ranks in axis:
        group = dist.new_group(list(ranks), timeout=timeout)
        if rank in ranks:
            mine = (group, ranks)
    return mine
