"""The expert side of the node-deduplicated exchange (``Layout.node_dedup``): a node's rows fanned out to the
node's expert ranks, and their outputs summed back per row.

A lane sends a token once per node of an expert-parallel group, to one rank of that node (the lane's gateway
there), with expert ids local to the node (sentinel: the node's expert count). The gateway passes its lanes' rows
on to the node's ranks that hold their experts and sums what comes back: the co-located dispatcher
(``comm.dispatch.AllToAllDispatcher``) over the node's group, NVLink on GPUs. Autograd runs the reverse
all-to-alls in the chunk's backward; a split backward's W starts below them (``afpipe.split_backward``), so they run
once. The rows go on in the activation dtype: with the FP8 exchange they arrived dequantized, FP8 values already.

All ranks of a node run the same stream (their F-group's), so they reach each chunk's all-to-alls together. A rank
waits there for the lanes its node peers take, which an F rank without the dedup waits for itself: the dependencies
are those of the plain exchange, whose order the schedule checker proves deadlock-free.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.distributed as dist

from disagmoe_ds.comm.dispatch import AllToAllDispatcher

# (rows, local ids, weights, routed pairs, pairs is a bound) -> rows' outputs: an expert shard's call
ShardCall = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, int | None, bool], torch.Tensor]


class NodeFanOut:
    """The all-to-alls of one node of an expert-parallel group around an expert shard's call."""

    def __init__(self, group: dist.ProcessGroup, *, ranks_per_node: int, experts_per_rank: int) -> None:
        self.dispatcher = AllToAllDispatcher(group, ep_size=ranks_per_node, experts_per_rank=experts_per_rank)

    def __call__(
        self, shard: ShardCall, x_SH: torch.Tensor, node_idx_SK: torch.Tensor, w_SK: torch.Tensor
    ) -> torch.Tensor:
        """``shard`` on the node's rows that this rank holds experts of; returns every row of ``x_SH`` with the sum of
        the node's outputs for it (differentiable in ``x_SH`` and ``w_SK``)."""
        tokens, meta = self.dispatcher.dispatch(x_SH, w_SK, node_idx_SK)
        y_RH = shard(tokens.x_RH, tokens.local_idx_RK, tokens.w_RK, tokens.pairs, False)
        return self.dispatcher.combine(y_RH, meta)
