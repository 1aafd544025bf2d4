"""Local pack and unpack of one lane's micro-batch for its expert-parallel ranks (pure torch, no communication).

Legend (this file): T tokens of the micro-batch, H hidden, K top-k, R rows for one ep rank (tokens with at
least one chosen expert there), S rows summed over all ep ranks, P ep ranks.

A token goes to an ep rank once even if several of its K experts live there. Its K expert ids are rewritten
to local ids on that rank, and entries whose expert lives elsewhere get the sentinel ``experts_per_rank``
with weight 0: the convention of Hugging Face transformers 5.x experts modules, which skip index ==
num_experts, so an F rank can feed the rows straight into its slice of the HF experts.

>>> plan = plan_dispatch(torch.tensor([[0, 3], [1, 0], [2, 3]]), ep_size=2, experts_per_rank=2)
>>> plan.counts, plan.pairs, [t.tolist() for t in plan.token_idx_R], [t.tolist() for t in plan.local_idx_RK]
((2, 2), (3, 3), [[0, 1], [0, 2]], [[[0, 2], [1, 0]], [[2, 1], [0, 1]]])
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True, eq=False)
class DispatchPlan:
    """Where each token of one micro-batch goes; the reverse path (combine) takes it back as a value.

    ``token_idx_R[r]`` are the tokens sent to ep rank r (increasing), ``local_idx_RK[r]`` their K expert ids
    local to r (sentinel ``experts_per_rank`` where the expert lives elsewhere). Both are views of the
    concatenations ``token_idx_S`` / ``local_idx_SK`` in ep-rank order.
    """

    num_tokens: int
    experts_per_rank: int
    counts: tuple[int, ...]  # R per ep rank, on the host
    pairs: tuple[int, ...]  # routed (token, expert) pairs per ep rank, on the host: the expert side's work
    token_idx_S: torch.Tensor
    local_idx_SK: torch.Tensor

    @property
    def ep_size(self) -> int:
        return len(self.counts)

    @property
    def sentinel(self) -> int:
        return self.experts_per_rank

    @property
    def token_idx_R(self) -> tuple[torch.Tensor, ...]:
        return self.token_idx_S.split(self.counts)

    @property
    def local_idx_RK(self) -> tuple[torch.Tensor, ...]:
        return self.local_idx_SK.split(self.counts)


@dataclass(frozen=True, eq=False)
class RoutedTokens:
    """The rows an expert shard computes, in both modes: from every ep peer (co-located) or every lane it serves
    (disaggregated), grouped by source."""

    x_RH: torch.Tensor
    local_idx_RK: torch.Tensor  # ids local to the shard; ``experts_per_rank`` where the expert is elsewhere
    w_RK: torch.Tensor  # 0 at those sentinel entries
    num_pairs: int  # ids in local_idx_RK that are not the sentinel: the expert work, known on the host


@dataclass(frozen=True, eq=False)
class CombinePlan:
    """What ``combine`` needs of a dispatch plan; A_next rebuilds it from the resid message without a host sync."""

    num_tokens: int
    counts: tuple[int, ...]
    token_idx_S: torch.Tensor

    @property
    def ep_size(self) -> int:
        return len(self.counts)


def count_ids(ids: torch.Tensor, n: int) -> torch.Tensor:
    """How often each id in [0, n) occurs in ``ids`` (int64 [n]), without the host sync of CUDA's ``bincount``,
    which reads its output size from the device.

    >>> count_ids(torch.tensor([[0, 3], [3, 1]]), 5).tolist()
    [1, 1, 0, 2, 0]
    """
    flat = ids.reshape(-1).long()
    return torch.zeros(n, dtype=torch.int64, device=ids.device).scatter_add_(0, flat, torch.ones_like(flat))


def plan_dispatch(topk_idx_TK: torch.Tensor, ep_size: int, experts_per_rank: int) -> DispatchPlan:
    """Compute where every token goes, from the router's global expert ids.

    Args:
        topk_idx_TK: global expert ids in [0, ep_size * experts_per_rank), any integer dtype.
        ep_size: expert-parallel ranks of the F-group (``Layout.ep_size``).
        experts_per_rank: routed experts held by each ep rank (``Layout.experts_per_rank``).

    Returns:
        The plan; one host sync (the per-rank row and pair counts), none when ``ep_size`` is 1.
    """
    num_tokens = topk_idx_TK.shape[0]
    topk_idx_TK = topk_idx_TK.long()
    if ep_size == 1:  # every token goes to the one rank, every id is local: the sizes are known on the host
        token_idx_S = torch.arange(num_tokens, device=topk_idx_TK.device)
        return DispatchPlan(
            num_tokens, experts_per_rank, (num_tokens,), (topk_idx_TK.numel(),), token_idx_S, topk_idx_TK
        )
    rank_TK = topk_idx_TK // experts_per_rank
    hit_PT = torch.zeros(ep_size, num_tokens, dtype=torch.bool, device=topk_idx_TK.device)
    hit_PT[rank_TK, torch.arange(num_tokens, device=topk_idx_TK.device).unsqueeze(1)] = True
    # nonzero() walks row-major: rows grouped by ep rank, tokens increasing inside each rank.
    rank_S, token_idx_S = hit_PT.nonzero(as_tuple=True)
    sizes_2P = torch.stack([hit_PT.sum(dim=1), count_ids(rank_TK, ep_size)])
    counts, pairs = (tuple(c) for c in sizes_2P.tolist())  # host sync: the message sizes
    idx_SK = topk_idx_TK.index_select(0, token_idx_S)
    here_SK = rank_TK.index_select(0, token_idx_S) == rank_S.unsqueeze(1)
    local_idx_SK = torch.where(here_SK, idx_SK - rank_S.unsqueeze(1) * experts_per_rank, experts_per_rank)
    return DispatchPlan(
        num_tokens=num_tokens,
        experts_per_rank=experts_per_rank,
        counts=counts,
        pairs=pairs,
        token_idx_S=token_idx_S,
        local_idx_SK=local_idx_SK,
    )


def gather_rows(x_TH: torch.Tensor, topk_w_TK: torch.Tensor, plan: DispatchPlan) -> tuple[torch.Tensor, torch.Tensor]:
    """Every ep rank's rows and weights, in ep-rank order (differentiable in x and w; weights keep their dtype).

    Returns:
        ``(x_SH, w_SK)``, ``w_SK`` 0 at sentinel entries; the inputs themselves when one ep rank takes every
        token, in order (no copy).
    """
    if plan.ep_size == 1:
        return x_TH, topk_w_TK  # no sentinels either
    x_SH = x_TH.index_select(0, plan.token_idx_S)
    w_SK = topk_w_TK.index_select(0, plan.token_idx_S)
    return x_SH, w_SK.masked_fill(plan.local_idx_SK == plan.sentinel, 0)


def pack(x_TH: torch.Tensor, topk_w_TK: torch.Tensor, plan: DispatchPlan) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """``gather_rows`` split per ep rank: ``[(x_RH, w_RK) for each ep rank]``, views of the gathered rows."""
    x_SH, w_SK = gather_rows(x_TH, topk_w_TK, plan)
    return list(zip(x_SH.split(plan.counts), w_SK.split(plan.counts), strict=True))


def combine(y_RH_list: list[torch.Tensor], plan: DispatchPlan | CombinePlan) -> torch.Tensor:
    """Sum the ep ranks' partial outputs back into token order (differentiable in every ``y_RH``).

    Returns:
        out_TH in the dtype of the partial outputs; tokens no rank received stay 0.
    """
    rows = tuple(y_RH.shape[0] for y_RH in y_RH_list)
    if rows != plan.counts:
        raise ValueError(f"combine got rows {rows} per ep rank, the plan sent {plan.counts}")
    if plan.ep_size == 1:
        return y_RH_list[0]  # one rank took every token (each has K >= 1 experts), in token order
    y_SH = torch.cat(y_RH_list)
    out_TH = y_SH.new_zeros(plan.num_tokens, y_SH.shape[1])
    return out_TH.index_add(0, plan.token_idx_S, y_SH)
