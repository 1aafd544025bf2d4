"""Co-located token exchange: the classic dispatch and combine all-to-all over an expert-parallel group.

Legend (this file): T tokens of this rank's micro-batch, H hidden, K top-k, P ep ranks, S rows this rank sends
(summed over its ep peers, grouped by destination), R rows it receives (summed over its ep peers, grouped by source).

A dispatcher is a strategy with Megatron's split, each direction local -> communicate -> local:

    dispatch  plan + gather_rows (``routing``)  ->  counts, then x / local ids / weights (all-to-all)  ->  (as received)
    combine   (nothing)                         ->  expert outputs back (the reverse all-to-all)        ->  ``combine``

``dispatch`` returns the routed rows and a frozen metadata value that ``combine`` takes back (torchtitan). Only
the middle steps communicate. ``LocalDispatcher`` (ep_size 1, one rank holds every expert) is the base and the
reference; ``AllToAllDispatcher`` replaces its communication step. Dispatchers are not ``nn.Module``s.

Rows arrive grouped by source ep rank, each source's rows in its token order: exactly what ``ExpertShard``
takes (any row order works for it), so no unpack is needed on the expert side.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from disagmoe_ds.comm.messages import Tokens
from disagmoe_ds.comm.routing import DispatchPlan, combine, gather_rows, plan_dispatch
from disagmoe_ds.errors import LayoutError


@dataclass(frozen=True, eq=False)
class DispatchMetadata:
    """What ``combine`` needs: the local plan and the rows received from each ep peer (on the host)."""

    plan: DispatchPlan
    recv_counts: tuple[int, ...]


class _AllToAll(torch.autograd.Function):
    """``all_to_all_single`` of several row tensors with uneven splits; backward is the reverse all-to-all.

    The tensors share one autograd node, so whenever a rank runs the reverse all-to-all of one it runs all of them
    (unused outputs get zero gradients): every rank posts the same collectives in backward, in the same order.
    Integer tensors (expert ids) are moved forward only.
    """

    @staticmethod
    def forward(ctx, group, send_counts, recv_counts, *tensors_S):
        ctx.group, ctx.send_counts, ctx.recv_counts = group, send_counts, recv_counts
        ctx.floating = tuple(t.is_floating_point() for t in tensors_S)
        tensors_R = tuple(_all_to_all(t, send_counts, recv_counts, group) for t in tensors_S)
        ctx.mark_non_differentiable(*(t for t, fp in zip(tensors_R, ctx.floating, strict=True) if not fp))
        return tensors_R

    @staticmethod
    def backward(ctx, *grads_R):
        grads_S = tuple(
            _all_to_all(g, ctx.recv_counts, ctx.send_counts, ctx.group) if fp else None
            for g, fp in zip(grads_R, ctx.floating, strict=True)
        )
        return (None, None, None, *grads_S)


def _all_to_all(t_S: torch.Tensor, send_counts: tuple[int, ...], recv_counts: tuple[int, ...], group) -> torch.Tensor:
    out_R = t_S.new_empty((sum(recv_counts), *t_S.shape[1:]))
    dist.all_to_all_single(out_R, t_S.contiguous(), list(recv_counts), list(send_counts), group=group)
    return out_R


class LocalDispatcher:
    """ep_size 1: this rank holds every expert; pack and unpack with no communication (the reference)."""

    def __init__(self, *, experts_per_rank: int):
        self.ep_size = 1
        self.experts_per_rank = experts_per_rank

    def dispatch(
        self, x_TH: torch.Tensor, topk_w_TK: torch.Tensor, topk_idx_TK: torch.Tensor
    ) -> tuple[Tokens, DispatchMetadata]:
        """Route this rank's tokens to the ep ranks holding their experts; returns the rows this rank computes."""
        plan = plan_dispatch(topk_idx_TK, self.ep_size, self.experts_per_rank)
        x_SH, w_SK = gather_rows(x_TH, topk_w_TK, plan)
        recv_counts, recv_pairs = self._exchange_counts(plan.counts, plan.pairs, x_TH.device)
        sent = Tokens(x_SH, plan.local_idx_SK, w_SK)
        received = Tokens.from_wire(self._exchange(plan.counts, recv_counts, *sent.tensors()), [sum(recv_pairs)])
        return received, DispatchMetadata(plan, recv_counts)

    def combine(self, y_RH: torch.Tensor, meta: DispatchMetadata) -> torch.Tensor:
        """Return each received row's expert output to its source rank and sum them per token: out_TH."""
        (y_SH,) = self._exchange(meta.recv_counts, meta.plan.counts, y_RH)
        return combine(list(y_SH.split(meta.plan.counts)), meta.plan)

    # ----- the communication steps (the only part a subclass replaces) -----
    def _exchange_counts(
        self, send_counts: tuple[int, ...], send_pairs: tuple[int, ...], device: torch.device
    ) -> tuple[tuple[int, ...], tuple[int, ...]]:
        """Rows and (row, expert) pairs this rank receives from each ep peer, from what each peer sends it."""
        del device
        return send_counts, send_pairs

    def _exchange(
        self, send_counts: tuple[int, ...], recv_counts: tuple[int, ...], *tensors_S: torch.Tensor
    ) -> tuple[torch.Tensor, ...]:
        del send_counts, recv_counts
        return tensors_S


class AllToAllDispatcher(LocalDispatcher):
    """ep_size > 1: all-to-alls over the rank's expert-parallel group (counts first, then the rows)."""

    def __init__(self, group: dist.ProcessGroup, *, ep_size: int, experts_per_rank: int):
        super().__init__(experts_per_rank=experts_per_rank)
        self.ep_size = ep_size
        if dist.get_world_size(group) != ep_size:
            raise LayoutError(f"an expert-parallel group of {dist.get_world_size(group)} ranks for ep_size {ep_size}")
        self.group = group

    def _exchange_counts(
        self, send_counts: tuple[int, ...], send_pairs: tuple[int, ...], device: torch.device
    ) -> tuple[tuple[int, ...], tuple[int, ...]]:
        send_P2 = torch.tensor(list(zip(send_counts, send_pairs, strict=True)), dtype=torch.int64, device=device)
        recv_P2 = torch.empty_like(send_P2)
        dist.all_to_all_single(recv_P2, send_P2, group=self.group)
        counts, pairs = zip(*recv_P2.tolist(), strict=True)  # host sync: the receive sizes
        return counts, pairs

    def _exchange(
        self, send_counts: tuple[int, ...], recv_counts: tuple[int, ...], *tensors_S: torch.Tensor
    ) -> tuple[torch.Tensor, ...]:
        return _AllToAll.apply(self.group, send_counts, recv_counts, *tensors_S)
