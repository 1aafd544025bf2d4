"""The classic dispatch and combine all-to-all over an expert-parallel group: the co-located mode's token exchange,
and the fan-out inside a node of the node-deduplicated exchange (``afpipe.node_fanout``).

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

With the FP8 lever (``fp8``) the dispatched rows travel in e4m3, each row's scale in 4 bytes beside it (one byte
buffer of H + 4 columns), and arrive dequantized: the routed experts see the FP8 values in every layout, ep_size 1
included (``fp8.quantize.round_trip``), as the single-process reference does. Their gradients and the combine travel
in the activation dtype.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, cast

import torch
import torch.distributed as dist

from disagmoe_ds.comm.messages import Tokens
from disagmoe_ds.comm.routing import DispatchPlan, combine, gather_rows, plan_dispatch
from disagmoe_ds.errors import LayoutError
from disagmoe_ds.fp8.quantize import E4M3, Quantized, dequantize, quantize, round_trip


@dataclass(frozen=True, eq=False)
class DispatchMetadata:
    """What ``combine`` needs: the local plan and the rows received from each ep peer (on the host)."""

    plan: DispatchPlan
    recv_counts: tuple[int, ...]


class _AllToAll(torch.autograd.Function):
    """``all_to_all_single`` of several row tensors with uneven splits; backward is the reverse all-to-all.

    The tensors share one autograd node, so whenever a rank runs the reverse all-to-all of one it runs all of them
    (unused outputs get zero gradients): every rank posts the same collectives in backward, in the same order.
    Integer tensors (expert ids) are moved forward only. ``fp8``: the first tensor's rows travel in FP8 (its
    gradient, straight through, in its dtype).
    """

    @staticmethod
    def forward(
        ctx: Any,
        group: dist.ProcessGroup,
        send_counts: tuple[int, ...],
        recv_counts: tuple[int, ...],
        fp8: bool,
        *tensors_S: torch.Tensor,
    ) -> tuple[torch.Tensor, ...]:
        ctx.group, ctx.send_counts, ctx.recv_counts = group, send_counts, recv_counts
        ctx.floating = tuple(t.is_floating_point() for t in tensors_S)
        exchange = [_all_to_all_fp8 if fp8 and i == 0 else _all_to_all for i in range(len(tensors_S))]
        tensors_R = tuple(move(t, send_counts, recv_counts, group) for move, t in zip(exchange, tensors_S, strict=True))
        ctx.mark_non_differentiable(*(t for t, fp in zip(tensors_R, ctx.floating, strict=True) if not fp))
        return tensors_R

    @staticmethod
    def backward(ctx: Any, *grads_R: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        grads_S = tuple(
            _all_to_all(g, ctx.recv_counts, ctx.send_counts, ctx.group) if fp else None
            for g, fp in zip(grads_R, ctx.floating, strict=True)
        )
        return (None, None, None, None, *grads_S)


def _all_to_all(
    t_S: torch.Tensor, send_counts: tuple[int, ...], recv_counts: tuple[int, ...], group: dist.ProcessGroup
) -> torch.Tensor:
    out_R = t_S.new_empty((sum(recv_counts), *t_S.shape[1:]))
    dist.all_to_all_single(out_R, t_S.contiguous(), list(recv_counts), list(send_counts), group=group)
    return out_R


def _all_to_all_fp8(
    x_S: torch.Tensor, send_counts: tuple[int, ...], recv_counts: tuple[int, ...], group: dist.ProcessGroup
) -> torch.Tensor:
    """``_all_to_all`` of rows [S, H] sent in e4m3 with their scales (one byte buffer [S, H + 4]), dequantized."""
    q = quantize(x_S, -1)
    bytes_S = torch.cat([q.data.view(torch.uint8), q.scale.view(torch.uint8)], dim=1)
    bytes_R = _all_to_all(bytes_S, send_counts, recv_counts, group)
    hidden = x_S.shape[1]
    data_R = bytes_R[:, :hidden].view(E4M3)
    scale_R = bytes_R[:, hidden:].contiguous().view(torch.float32)
    return dequantize(Quantized(data_R, scale_R), x_S.dtype)


class LocalDispatcher:
    """ep_size 1: this rank holds every expert; pack and unpack with no communication (the reference)."""

    def __init__(self, *, experts_per_rank: int, fp8: bool = False):
        self.ep_size = 1
        self.experts_per_rank = experts_per_rank
        self.fp8 = fp8  # the routed rows travel (here: are rounded) in FP8

    def dispatch(
        self, x_TH: torch.Tensor, topk_w_TK: torch.Tensor, topk_idx_TK: torch.Tensor
    ) -> tuple[Tokens, DispatchMetadata]:
        """Route this rank's tokens to the ep ranks holding their experts; returns the rows this rank computes."""
        plan = plan_dispatch(topk_idx_TK, self.ep_size, self.experts_per_rank)
        x_SH, w_SK = gather_rows(x_TH, topk_w_TK, plan)
        recv_counts, recv_pairs = self._exchange_counts(plan.counts, plan.pairs, x_TH.device)
        x_RH, local_idx_RK, w_RK = self._exchange(plan.counts, recv_counts, x_SH, plan.local_idx_SK, w_SK, fp8=self.fp8)
        received = Tokens.of(x_RH, local_idx_RK, w_RK, sum(recv_pairs), fp8=False)  # FP8 rows arrive dequantized
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
        self, send_counts: tuple[int, ...], recv_counts: tuple[int, ...], *tensors_S: torch.Tensor, fp8: bool = False
    ) -> tuple[torch.Tensor, ...]:
        """``tensors_S`` sent to their ep ranks (row counts ``send_counts``), received (``recv_counts``); ``fp8``:
        the first one's rows in FP8."""
        del send_counts, recv_counts
        return (round_trip(tensors_S[0]), *tensors_S[1:]) if fp8 else tensors_S


class AllToAllDispatcher(LocalDispatcher):
    """ep_size > 1: all-to-alls over the rank's expert-parallel group (counts first, then the rows)."""

    def __init__(self, group: dist.ProcessGroup, *, ep_size: int, experts_per_rank: int, fp8: bool = False):
        super().__init__(experts_per_rank=experts_per_rank, fp8=fp8)
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
        self, send_counts: tuple[int, ...], recv_counts: tuple[int, ...], *tensors_S: torch.Tensor, fp8: bool = False
    ) -> tuple[torch.Tensor, ...]:
        moved = _AllToAll.apply(self.group, send_counts, recv_counts, fp8, *tensors_S)  # type: ignore[no-untyped-call]
        return cast(tuple[torch.Tensor, ...], moved)
