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

import math
from collections.abc import Callable
from dataclasses import dataclass, replace
from functools import cached_property
from typing import TypeGuard

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
        return torch.split(self.token_idx_S, list(self.counts))

    @property
    def local_idx_RK(self) -> tuple[torch.Tensor, ...]:
        return torch.split(self.local_idx_SK, list(self.counts))


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


@dataclass(frozen=True)
class Capacity:
    """Fixed sizes of every m2n message (one lane to one ep rank, one micro-batch), so that no receiver waits for a
    header: at most ``rows`` rows and ``pairs`` routed pairs; a lane pads a smaller message with rows whose ids are
    all the sentinel (token 0, weight 0), which the expert side computes nothing for and which combine to zero.

    ``exact``: every message has exactly these sizes (one ep rank: a lane sends its whole micro-batch with all K
    pairs), so nothing is padded and nothing can overflow. Otherwise a message the router fills beyond the capacity
    loses its excess rows or pairs; the lane records it (``PendingDispatch.need_2``), and the step is discarded and
    run again at a larger capacity (``grown``), so the result is always the dropless one.

    >>> Capacity.initial(tokens=64, top_k=2, ep_size=4, experts_per_rank=2, factor=1.25).sizes
    (35, 40)
    """

    tokens: int  # T, the lane's micro-batch
    rows: int
    pairs: int
    pairs_per_row: int = 1  # the most a row can carry: min(K, experts per ep rank)
    factor: float = 1.0  # headroom over what routing needs
    exact: bool = False

    @classmethod
    def initial(cls, *, tokens: int, top_k: int, ep_size: int, experts_per_rank: int, factor: float) -> Capacity:
        """The capacity of balanced routing times ``factor``: a token reaches an ep rank with probability
        1 - (1 - 1/P)^K, and each ep rank gets T K / P of the pairs (``ep_size`` 1: exact)."""
        if ep_size == 1:
            return cls(tokens, tokens, tokens * top_k, top_k, factor, exact=True)
        empty = cls(tokens, 0, 0, min(top_k, experts_per_rank), factor)
        return empty.grown(tokens * (1 - (1 - 1 / ep_size) ** top_k), tokens * top_k / ep_size)

    @property
    def sizes(self) -> tuple[int, int]:
        return self.rows, self.pairs

    def grown(self, rows: float, pairs: float) -> Capacity:
        """A capacity holding ``rows`` rows and ``pairs`` pairs with ``factor`` of headroom (at least none; never
        smaller than this one, never beyond what a message can hold: T rows of ``pairs_per_row`` pairs each)."""
        headroom = max(self.factor, 1.0)
        most_rows = min(self.tokens, max(self.rows, _round_up(rows * headroom)))
        most_pairs = min(most_rows * self.pairs_per_row, max(self.pairs, _round_up(pairs * headroom)))
        return replace(self, rows=most_rows, pairs=most_pairs)

    def holds(self, rows: int, pairs: int) -> bool:
        return rows <= self.rows and pairs <= self.pairs


def pads(capacity: Capacity | None) -> TypeGuard[Capacity]:
    """Whether messages are padded to ``capacity`` and may outgrow it (None: exact sizes, sent with headers; an
    ``exact`` capacity: one ep rank, nothing to pad)."""
    return capacity is not None and not capacity.exact


def _round_up(n: float) -> int:
    return max(1, math.ceil(n - 1e-9))  # (the epsilon: 0.1 * 30 is 3.0000000000000004)


def plan_dispatch(topk_idx_TK: torch.Tensor, ep_size: int, experts_per_rank: int) -> DispatchPlan:
    """Compute where every token goes, from the router's global expert ids.

    Args:
        topk_idx_TK: global expert ids in [0, ep_size * experts_per_rank], any integer dtype; the last value, one
            past the experts, reaches no rank (the sentinel of a node's message, ``Layout.node_dedup``).
        ep_size: expert-parallel ranks of the F-group (``Layout.ep_size``).
        experts_per_rank: routed experts held by each ep rank (``Layout.experts_per_rank``).

    Returns:
        The plan; one host sync (the per-rank row and pair counts), none when ``ep_size`` is 1. ``start_dispatch``
        does the same work without the sync.
    """
    num_tokens = topk_idx_TK.shape[0]
    topk_idx_TK = topk_idx_TK.long()
    if ep_size == 1:  # every token goes to the one rank, every id is local: the sizes are known on the host
        token_idx_S = torch.arange(num_tokens, device=topk_idx_TK.device)
        return DispatchPlan(
            num_tokens, experts_per_rank, (num_tokens,), (topk_idx_TK.numel(),), token_idx_S, topk_idx_TK
        )
    token_idx_C, local_idx_CK, sizes_2P = _plan_on_device(topk_idx_TK, ep_size, experts_per_rank)
    counts, pairs = (tuple(c) for c in sizes_2P.tolist())  # host sync: the message sizes
    return _sliced_plan(num_tokens, experts_per_rank, counts, pairs, token_idx_C, local_idx_CK)


def _plan_on_device(
    topk_idx_TK: torch.Tensor, ep_size: int, experts_per_rank: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The plan's tensors at capacity C = min(ep_size, K) x T rows (no token reaches more ranks), with no host
    sync: the hits in (ep rank, token) order first, then padding rows (token 0) that the plan slices off once the
    sizes are known. Returns ``(token_idx_C, local_idx_CK, sizes_2P)``, sizes_2P = rows and pairs per ep rank."""
    num_tokens, top_k = topk_idx_TK.shape
    rank_TK, hit_PT = _rank_hits(topk_idx_TK, ep_size, experts_per_rank)
    # Row-major: rows grouped by ep rank, tokens increasing inside each rank; a fixed size needs no host sync.
    capacity = min(ep_size, top_k) * num_tokens
    rank_C, token_idx_C = torch.nonzero_static(hit_PT, size=capacity, fill_value=0).unbind(1)
    local_idx_CK = _local_ids(topk_idx_TK, rank_TK, token_idx_C, rank_C, experts_per_rank)
    # An id one past the last expert (a node's message: that expert lives on another node) reaches no rank.
    sizes_2P = torch.stack([hit_PT.sum(dim=1), count_ids(rank_TK, ep_size + 1)[:ep_size]])
    return token_idx_C, local_idx_CK, sizes_2P


def _rank_hits(topk_idx_TK: torch.Tensor, ep_size: int, experts_per_rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The ep rank of every choice (``rank_TK``) and whether token t reaches ep rank r (``hit_PT``), no host sync."""
    rank_TK = topk_idx_TK // experts_per_rank
    # A comparison, not ``hit[rank, token] = True``: CUDA's index_put waits for the device (16 ms on an H200 behind
    # queued GEMMs).
    ranks_P11 = torch.arange(ep_size, device=topk_idx_TK.device).view(-1, 1, 1)
    return rank_TK, (rank_TK.unsqueeze(0) == ranks_P11).any(dim=2)


def _local_ids(
    topk_idx_TK: torch.Tensor,
    rank_TK: torch.Tensor,
    token_idx_C: torch.Tensor,
    rank_C: torch.Tensor,
    experts_per_rank: int,
    filled_C: torch.Tensor | None = None,
) -> torch.Tensor:
    """Row c's K expert ids local to its ep rank ``rank_C[c]``, the sentinel where the expert lives elsewhere (and
    on every id of a row that ``filled_C`` marks as padding)."""
    here_CK = rank_TK.index_select(0, token_idx_C) == rank_C.unsqueeze(1)
    if filled_C is not None:
        here_CK &= filled_C.unsqueeze(1)
    idx_CK = topk_idx_TK.index_select(0, token_idx_C) - rank_C.unsqueeze(1) * experts_per_rank
    return torch.where(here_CK, idx_CK, experts_per_rank)


def _gathered(
    x_TH: torch.Tensor, topk_w_TK: torch.Tensor, token_idx_C: torch.Tensor, local_idx_CK: torch.Tensor, sentinel: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """The rows' activations and weights (weights 0 at sentinel ids)."""
    w_CK = topk_w_TK.index_select(0, token_idx_C).masked_fill(local_idx_CK == sentinel, 0)
    return x_TH.index_select(0, token_idx_C), w_CK


def _sliced_plan(
    num_tokens: int,
    experts_per_rank: int,
    counts: tuple[int, ...],
    pairs: tuple[int, ...],
    token_idx_C: torch.Tensor,
    local_idx_CK: torch.Tensor,
) -> DispatchPlan:
    rows = sum(counts)
    return DispatchPlan(num_tokens, experts_per_rank, counts, pairs, token_idx_C[:rows], local_idx_CK[:rows])


@dataclass(eq=False)
class PendingDispatch:
    """``plan_dispatch`` + ``pack`` of one micro-batch, queued on the device without a host sync
    (``start_dispatch``): the rows are gathered at capacity while the sizes (rows and routed pairs per ep rank)
    travel to the host by a non-blocking copy. ``ready`` says whether they have landed; ``resolved`` waits for
    them if not and gives the plan and each ep rank's ``(x_RH, w_RK)``, views of the gathered rows."""

    num_tokens: int
    experts_per_rank: int
    token_idx_C: torch.Tensor
    local_idx_CK: torch.Tensor
    x_CH: torch.Tensor
    w_CK: torch.Tensor
    sizes_2P: torch.Tensor  # on the host (pinned on CUDA), filled by the copy
    landed: torch.cuda.Event | None  # after the gathers and the copy on the compute stream; None: already there
    need_2: torch.Tensor | None = None  # at a ``Capacity``: the most rows and pairs of one message (device)

    def ready(self) -> bool:
        return self.landed is None or self.landed.query()

    @property
    def is_resolved(self) -> bool:
        return "resolved" in self.__dict__  # ``resolved`` has run (a cached property)

    @cached_property
    def resolved(self) -> tuple[DispatchPlan, list[tuple[torch.Tensor, torch.Tensor]]]:
        if self.landed is not None:
            self.landed.synchronize()  # a no-op once ``ready``
        counts, pairs = (tuple(c) for c in self.sizes_2P.tolist())
        plan = _sliced_plan(self.num_tokens, self.experts_per_rank, counts, pairs, self.token_idx_C, self.local_idx_CK)
        rows = sum(counts)
        return plan, list(zip(self.x_CH[:rows].split(counts), self.w_CK[:rows].split(counts), strict=True))


def sizes_landing_late(landing: str) -> Callable[[PendingDispatch], bool]:
    """A ``PendingDispatch.ready`` for tests and GPU checks (``bench/verify_late_sends.py``): the sizes land on the
    second poll (``"second-poll"``) or never (``"never"``; only the blocking calls then send), so the mailbox's
    late-send path runs whatever the ep size."""
    if landing not in ("second-poll", "never"):
        raise ValueError(f"landing must be 'second-poll' or 'never', got {landing!r}")

    def ready(self: PendingDispatch) -> bool:
        polls = self.__dict__["_polls"] = self.__dict__.get("_polls", 0) + 1
        return landing == "second-poll" and polls > 1

    return ready


def start_dispatch(
    x_TH: torch.Tensor,
    topk_w_TK: torch.Tensor,
    topk_idx_TK: torch.Tensor,
    ep_size: int,
    experts_per_rank: int,
    capacity: Capacity | None = None,
) -> PendingDispatch:
    """Start ``plan_dispatch`` and ``pack`` without blocking the host (differentiable in x and w, as ``pack``).

    With several ep ranks the message sizes come from the device; ``plan_dispatch`` waits for them, which stops
    the host from queueing more work until the GPU has caught up. Here they land in pinned host memory while the
    host goes on (CUDA); the caller sends once ``ready``. The gathers run at capacity (``_plan_on_device``).
    At a ``capacity`` the sizes are the capacity's, ready at once, and each message is padded to them.
    """
    num_tokens = topk_idx_TK.shape[0]
    topk_idx_TK = topk_idx_TK.long()
    if pads(capacity):
        return _dispatch_at_capacity(x_TH, topk_w_TK, topk_idx_TK, ep_size, experts_per_rank, capacity)
    if ep_size == 1:  # sizes known on the host, no gather (``gather_rows``)
        plan = plan_dispatch(topk_idx_TK, 1, experts_per_rank)
        sizes_2P = torch.tensor([plan.counts, plan.pairs])
        return PendingDispatch(
            num_tokens, experts_per_rank, plan.token_idx_S, plan.local_idx_SK, x_TH, topk_w_TK, sizes_2P, None
        )
    token_idx_C, local_idx_CK, sizes_2P = _plan_on_device(topk_idx_TK, ep_size, experts_per_rank)
    x_CH, w_CK = _gathered(x_TH, topk_w_TK, token_idx_C, local_idx_CK, experts_per_rank)
    landed = None
    if sizes_2P.device.type == "cuda":
        host = torch.empty(sizes_2P.shape, dtype=sizes_2P.dtype, pin_memory=True)
        sizes_2P = host.copy_(sizes_2P, non_blocking=True)
        landed = torch.cuda.Event()
        landed.record()
    return PendingDispatch(num_tokens, experts_per_rank, token_idx_C, local_idx_CK, x_CH, w_CK, sizes_2P, landed)


def _dispatch_at_capacity(
    x_TH: torch.Tensor,
    topk_w_TK: torch.Tensor,
    topk_idx_TK: torch.Tensor,
    ep_size: int,
    experts_per_rank: int,
    capacity: Capacity,
) -> PendingDispatch:
    """Every ep rank's message at ``capacity.rows`` rows (C), built on the device with no host sync: rank r's hits
    in token order at rows [r C, r C + hits), the rest padding (token 0, every id the sentinel, weight 0); hits
    beyond C are dropped, and ``need_2`` records the most rows and pairs any message wanted."""
    num_tokens, rows = topk_idx_TK.shape[0], capacity.rows
    device = topk_idx_TK.device
    rank_TK, hit_PT = _rank_hits(topk_idx_TK, ep_size, experts_per_rank)
    ranks_P = torch.arange(ep_size, device=device)
    slot_PT = hit_PT.long().cumsum(dim=1) - 1  # the token's row in rank r's message
    kept_PT = hit_PT & (slot_PT < rows)
    dump = ep_size * rows  # one slot past the messages, for the hits that do not fit (and every non-hit)
    dest_PT = torch.where(kept_PT, slot_PT + ranks_P.unsqueeze(1) * rows, dump)
    tokens_PT = torch.arange(num_tokens, device=device).expand(ep_size, -1)
    token_idx_C = torch.zeros(dump + 1, dtype=torch.int64, device=device)
    token_idx_C = token_idx_C.scatter_(0, dest_PT.reshape(-1), tokens_PT.reshape(-1))[:dump]
    rows_P, pairs_P = hit_PT.sum(dim=1), count_ids(rank_TK, ep_size)
    filled_C = (torch.arange(rows, device=device) < rows_P.clamp(max=rows).unsqueeze(1)).reshape(-1)
    rank_C = ranks_P.repeat_interleave(rows)
    local_idx_CK = _local_ids(topk_idx_TK, rank_TK, token_idx_C, rank_C, experts_per_rank, filled_C)
    x_CH, w_CK = _gathered(x_TH, topk_w_TK, token_idx_C, local_idx_CK, experts_per_rank)
    sizes_2P = torch.tensor([[rows] * ep_size, [capacity.pairs] * ep_size])
    need_2 = torch.stack([rows_P.max(), pairs_P.max()])
    return PendingDispatch(num_tokens, experts_per_rank, token_idx_C, local_idx_CK, x_CH, w_CK, sizes_2P, None, need_2)


def gather_rows(x_TH: torch.Tensor, topk_w_TK: torch.Tensor, plan: DispatchPlan) -> tuple[torch.Tensor, torch.Tensor]:
    """Every ep rank's rows and weights, in ep-rank order (differentiable in x and w; weights keep their dtype).

    Returns:
        ``(x_SH, w_SK)``, ``w_SK`` 0 at sentinel entries; the inputs themselves when one ep rank takes every
        token, in order (no copy).
    """
    if plan.ep_size == 1:
        return x_TH, topk_w_TK  # no sentinels either
    return _gathered(x_TH, topk_w_TK, plan.token_idx_S, plan.local_idx_SK, plan.sentinel)


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
