"""M2N and N2M token exchanges between A-groups and F-groups: who talks to whom, their groups, fan-out/fan-in.

Legend (this file): T tokens of a lane's micro-batch, H hidden, K top-k, R rows of one message, S rows
summed over the messages of one fan-in or fan-out.

Kinds of exchange (lane j of A-group g; F_g holds the experts of A_g's layers; ``next`` = (g + 1) % p):

    m2n         lane j of A_g     -> its ep peers in F_g        tokens, local expert ids, weights
    n2m         those ep peers    -> lane j of A_next           partial expert outputs
    resid       lane j of A_g     -> lane j of A_next           residual stream and top-k ids (p > 1 only)
    m2n_grad    reverse of m2n (F_g -> lane j of A_g)           grads of tokens and weights
    n2m_grad    reverse of n2m (lane j of A_next -> F_g)        grads of the partial outputs
    resid_grad  reverse of resid                                grad of the residual stream

The ep peer of lane j for ep rank e is ``Layout.ffn_peer_of_lane(g, j, e)``: with expert-data-parallel,
lanes are spread over the replicas, and only the replica that received lane j's tokens returns them.

Every (kind, src, dst) pair gets its own two 2-rank process groups (header, payload), so a forward send
never waits behind a backward one and no two pairs share an NCCL stream. Count, with M attention ranks,
P = ep_size:

    pairs  = 4 * M * P  +  2 * M * [p > 1]
    groups = 2 * pairs                              e.g. M=2, N=3, p=1: 48 groups

Each attention rank is in 8P (+8 if p > 1) of them, each FFN rank in 8 * lanes / expert_data_parallel.
This is fine up to a few hundred ranks. For large worlds, use one group per (kind, A_g, F_g) over A_g + F_g
(12p groups in total, still FIFO per peer), created with ``use_local_synchronization=True``, and initialise
NCCL eagerly (``device_id`` in init_process_group) so that p2p ops reuse the group's communicator instead
of building one per peer pair; what is lost is that messages to different peers share one stream.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from datetime import timedelta
from enum import Enum
from types import MappingProxyType

import torch
import torch.distributed as dist

from disagmoe_ds.comm.channel import CommStream, Link, MessageSpec, Receiver, Sender, SendHandle, TensorSpec
from disagmoe_ds.comm.routing import DispatchPlan
from disagmoe_ds.layout import Layout


class Kind(str, Enum):
    """Direction kind of an exchange (see the module docstring)."""

    M2N = "m2n"
    N2M = "n2m"
    RESID = "resid"
    M2N_GRAD = "m2n_grad"
    N2M_GRAD = "n2m_grad"
    RESID_GRAD = "resid_grad"


A_TO_F = (Kind.M2N, Kind.N2M_GRAD)
F_TO_A = (Kind.N2M, Kind.M2N_GRAD)
# The F-group an A lane of group g talks to is g + offset; the A-group an F rank of group g talks to is g - offset.
_F_OFFSET = {Kind.M2N: 0, Kind.M2N_GRAD: 0, Kind.N2M: -1, Kind.N2M_GRAD: -1}

Pair = tuple[Kind, int, int]  # (kind, src rank, dst rank)


# ----- who talks to whom (pure) -----
def lane_peers(layout: Layout, kind: Kind, group: int, lane: int) -> tuple[int, ...]:
    """The F ranks lane ``lane`` of A-group ``group`` exchanges ``kind`` with, indexed by ep rank."""
    ffn_group = (group + _F_OFFSET[kind]) % layout.depth
    return tuple(layout.ffn_peer_of_lane(ffn_group, lane, e) for e in range(layout.ep_size))


def ffn_lanes(layout: Layout, rank: int) -> tuple[int, ...]:
    """The lanes whose tokens FFN rank ``rank`` serves (lane indices, increasing; all lanes without EDP)."""
    role = layout.role_of(rank)
    lanes = range(layout.lanes)
    return tuple(lane for lane in lanes if layout.ffn_peer_of_lane(role.group, lane, role.ep_rank) == rank)


def lane_ranks(layout: Layout, kind: Kind, rank: int) -> tuple[int, ...]:
    """The A ranks FFN rank ``rank`` exchanges ``kind`` with, in lane order."""
    attention_group = (layout.role_of(rank).group - _F_OFFSET[kind]) % layout.depth
    return tuple(layout.attention_ranks(attention_group)[lane] for lane in ffn_lanes(layout, rank))


def exchange_pairs(layout: Layout) -> tuple[Pair, ...]:
    """Every (kind, src, dst) that ever communicates, in one fixed order (the group-creation order).

    >>> len(exchange_pairs(Layout(attention_gpus=2, ffn_gpus=3, num_layers=2, num_experts=6)))
    24
    """
    pairs: list[Pair] = []
    for kind in Kind:
        pairs += _pairs_of(layout, kind)
    return tuple(pairs)


def _pairs_of(layout: Layout, kind: Kind) -> list[Pair]:
    pairs: list[Pair] = []
    for group in range(layout.depth):
        for lane in range(layout.lanes):
            pairs += _lane_pairs(layout, kind, group, lane)
    return pairs


def _lane_pairs(layout: Layout, kind: Kind, group: int, lane: int) -> list[Pair]:
    """The pairs of ``kind`` that lane ``lane`` of A_g (g = ``group``) starts, in the roles of the module table."""
    a = layout.attention_ranks(group)[lane]
    a_next = layout.attention_ranks((group + 1) % layout.depth)[lane]
    if kind in (Kind.RESID, Kind.RESID_GRAD):
        if layout.depth == 1:  # A_next is A_g: the residual stays on the rank
            return []
        return [(kind, a, a_next) if kind == Kind.RESID else (kind, a_next, a)]
    peers = lane_peers(layout, Kind.M2N, group, lane)  # F_g, seen from A_g
    lane_rank = a if kind in (Kind.M2N, Kind.M2N_GRAD) else a_next
    return [(kind, lane_rank, f) if kind in A_TO_F else (kind, f, lane_rank) for f in peers]


# ----- process groups -----
@dataclass(frozen=True)
class ExchangeGroups:
    """The exchange links of this rank, keyed by (kind, src, dst); built once by ``build_exchange_groups``."""

    layout: Layout
    rank: int
    links: Mapping[Pair, Link]
    num_groups: int  # over the whole world, this rank's or not

    def link(self, kind: Kind, src: int, dst: int) -> Link:
        key = (kind, src, dst)
        if key not in self.links:
            mine = ", ".join(f"{k.value} {s}->{d}" for k, s, d in self.links)
            raise KeyError(f"rank {self.rank} has no {kind.value} link {src}->{dst}; its links: {mine}")
        return self.links[key]


def build_exchange_groups(layout: Layout, *, device: torch.device, timeout: timedelta | None = None) -> ExchangeGroups:
    """Create the header and payload groups of every exchange pair, on every rank, in the same order.

    ``new_group`` is collective over the world, so every rank calls it for every pair, and keeps the links
    it is a member of. Each link then passes one tiny message on both groups, in the same global order on
    every rank: with NCCL this creates the lazily built communicators now, in an order that cannot deadlock
    (the lowest unfinished pair always has both members waiting on it), instead of inside the first
    exchange, where two ranks blocked in each other's communicator set-up would hang.

    Args:
        layout: the validated layout; its world size must match torch.distributed's.
        device: where headers live (the current CUDA device with NCCL, CPU with gloo).
        timeout: how long a send or receive may wait for its peer before it fails (None: torch's default).
    """
    layout.check_world_size(dist.get_world_size())
    rank = dist.get_rank()
    pairs = exchange_pairs(layout)
    links: dict[Pair, Link] = {}
    for kind, src, dst in pairs:
        header_group = dist.new_group([src, dst], timeout=timeout)
        payload_group = dist.new_group([src, dst], timeout=timeout)
        if rank in (src, dst):
            links[(kind, src, dst)] = Link(src, dst, header_group, payload_group)
    for link in links.values():
        _warm_up(link, rank, device)
    return ExchangeGroups(layout=layout, rank=rank, links=MappingProxyType(links), num_groups=2 * len(pairs))


def _warm_up(link: Link, rank: int, device: torch.device) -> None:
    probe = torch.zeros(1, dtype=torch.int64, device=device)
    for group in (link.header_group, link.payload_group):
        if rank == link.src:
            dist.isend(probe, link.dst, group=group).wait()
        else:
            dist.irecv(probe, link.src, group=group).wait()


# ----- message specs -----
def exchange_specs(
    hidden: int, top_k: int, *, dtype: torch.dtype, weight_dtype: torch.dtype
) -> dict[Kind, MessageSpec]:
    """The message of each kind; rows are routed tokens (M2N/N2M kinds) or all T tokens (resid kinds).

    Args:
        hidden: H.
        top_k: K.
        dtype: activations (bf16 in training).
        weight_dtype: router weights (often fp32 while activations are bf16).
    """
    rows_h = TensorSpec(dtype, (hidden,))
    rows_w = TensorSpec(weight_dtype, (top_k,))
    rows_idx = TensorSpec(torch.int64, (top_k,))
    specs = {
        Kind.M2N: (rows_h, rows_idx, rows_w),  # x_RH, local_idx_RK, w_RK
        Kind.N2M: (rows_h,),  # y_RH
        Kind.RESID: (rows_h, rows_idx),  # residual_TH, topk_idx_TK (global ids: the next group re-plans)
        Kind.M2N_GRAD: (rows_h, rows_w),  # dx_RH, dw_RK
        Kind.N2M_GRAD: (rows_h,),  # dy_RH
        Kind.RESID_GRAD: (rows_h,),  # d residual_TH
    }
    return {kind: MessageSpec(tensors, name=kind.value) for kind, tensors in specs.items()}


def dispatch_messages(
    pieces: Sequence[tuple[torch.Tensor, torch.Tensor]], plan: DispatchPlan
) -> tuple[list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]], tuple[int, ...]]:
    """M2N messages from ``routing.pack``'s pieces, ``(x_RH, local_idx_RK, w_RK)`` per ep rank, and the routed
    pairs of each (their header meta: the F rank sizes its expert buffers from it without a device read)."""
    messages = [(x_RH, idx_RK, w_RK) for (x_RH, w_RK), idx_RK in zip(pieces, plan.local_idx_RK, strict=True)]
    return messages, plan.pairs


# ----- fan-out and fan-in for one micro-batch -----
@dataclass(frozen=True)
class LaneRows:
    """Rows an F rank received from each of its lanes for one micro-batch (value for the reverse path)."""

    lanes: tuple[int, ...]
    counts: tuple[int, ...]
    meta: int = 0  # the messages' header metas summed (M2N: routed pairs in the S rows)


class M2NSender:
    """On an A lane: one message to each ep rank of an F-group (kinds m2n, n2m_grad)."""

    def __init__(self, senders: tuple[Sender, ...]) -> None:
        self.senders = senders  # indexed by ep rank

    @classmethod
    def build(cls, groups: ExchangeGroups, kind: Kind, *, spec: MessageSpec, device: torch.device) -> M2NSender:
        _check_kind(kind, A_TO_F, cls.__name__)
        role = groups.layout.role_of(groups.rank)
        peers = lane_peers(groups.layout, kind, role.group, role.index)
        return cls(tuple(Sender(groups.link(kind, groups.rank, f), spec, device) for f in peers))

    def send(
        self, messages: Sequence[Sequence[torch.Tensor]], metas: Sequence[int] | None = None, *, tag: int = 0
    ) -> list[SendHandle]:
        """Send ``messages[e]`` (header meta ``metas[e]``, default 0) to ep rank e; zero-row messages too: every
        link sees one message per micro-batch."""
        if len(messages) != len(self.senders):
            raise ValueError(f"got {len(messages)} messages for {len(self.senders)} ep ranks")
        metas = metas or (0,) * len(messages)
        return [
            sender.send(message, tag=tag, meta=meta)
            for sender, message, meta in zip(self.senders, messages, metas, strict=True)
        ]

    def wait_all(self) -> None:
        for sender in self.senders:
            sender.wait_all()


class M2NReceiver:
    """On an F rank: one message from each of its lanes, concatenated in lane order (kinds m2n, n2m_grad)."""

    def __init__(
        self, lanes: tuple[int, ...], receivers: tuple[Receiver, ...], spec: MessageSpec, device: torch.device
    ) -> None:
        self.lanes = lanes
        self.receivers = receivers  # in lane order
        self.spec = spec
        self.device = device

    @classmethod
    def build(
        cls,
        groups: ExchangeGroups,
        kind: Kind,
        *,
        spec: MessageSpec,
        device: torch.device,
        comm: CommStream | None = None,
    ) -> M2NReceiver:
        _check_kind(kind, A_TO_F, cls.__name__)
        _check_rows_only(spec, cls.__name__)
        layout, rank = groups.layout, groups.rank
        srcs = lane_ranks(layout, kind, rank)
        receivers = tuple(Receiver(groups.link(kind, src, rank), spec, device, comm) for src in srcs)
        return cls(ffn_lanes(layout, rank), receivers, spec, device)

    def post(self) -> None:
        for receiver in self.receivers:
            receiver.post()

    def wait(self, *, tag: int | None = None) -> tuple[tuple[torch.Tensor, ...], LaneRows]:
        """Complete one micro-batch: returns its tensors (S rows, lanes in order) and the rows per lane."""
        tensors, counts, metas = _gather(self.receivers, self.spec, self.device, tag)
        return tensors, LaneRows(self.lanes, counts, sum(metas))


class N2MSender:
    """On an F rank: each lane's rows back to that lane (kinds n2m to A_next, m2n_grad to A_g)."""

    def __init__(self, lanes: tuple[int, ...], senders: tuple[Sender, ...]) -> None:
        self.lanes = lanes
        self.senders = senders

    @classmethod
    def build(cls, groups: ExchangeGroups, kind: Kind, *, spec: MessageSpec, device: torch.device) -> N2MSender:
        _check_kind(kind, F_TO_A, cls.__name__)
        layout, rank = groups.layout, groups.rank
        dsts = lane_ranks(layout, kind, rank)
        senders = tuple(Sender(groups.link(kind, rank, dst), spec, device) for dst in dsts)
        return cls(ffn_lanes(layout, rank), senders)

    def send(self, tensors_S: Sequence[torch.Tensor], rows: LaneRows, *, tag: int = 0) -> list[SendHandle]:
        """Split S-row tensors by ``rows`` (from the matching M2NReceiver.wait) and send each lane its part."""
        if rows.lanes != self.lanes:
            raise ValueError(f"rows are for lanes {rows.lanes}, this sender serves lanes {self.lanes}")
        parts = [t.split(rows.counts) for t in tensors_S]
        return [sender.send(message, tag=tag) for sender, message in zip(self.senders, zip(*parts), strict=True)]

    def wait_all(self) -> None:
        for sender in self.senders:
            sender.wait_all()


class N2MReceiver:
    """On an A lane: one message from each ep rank of an F-group (kinds n2m from F_prev, m2n_grad from F_g)."""

    def __init__(self, receivers: tuple[Receiver, ...], spec: MessageSpec, device: torch.device) -> None:
        self.receivers = receivers  # indexed by ep rank
        self.spec = spec
        self.device = device

    @classmethod
    def build(
        cls,
        groups: ExchangeGroups,
        kind: Kind,
        *,
        spec: MessageSpec,
        device: torch.device,
        comm: CommStream | None = None,
    ) -> N2MReceiver:
        _check_kind(kind, F_TO_A, cls.__name__)
        _check_rows_only(spec, cls.__name__)
        role = groups.layout.role_of(groups.rank)
        peers = lane_peers(groups.layout, kind, role.group, role.index)
        receivers = tuple(Receiver(groups.link(kind, f, groups.rank), spec, device, comm) for f in peers)
        return cls(receivers, spec, device)

    def post(self) -> None:
        for receiver in self.receivers:
            receiver.post()

    def wait(self, *, plan: DispatchPlan | None = None, tag: int | None = None) -> list[tuple[torch.Tensor, ...]]:
        """Complete one micro-batch: the message of each ep rank; checks the row counts against ``plan``."""
        tensors, counts, _ = _gather(self.receivers, self.spec, self.device, tag)
        if plan is not None and counts != plan.counts:
            raise ValueError(f"received rows {counts} per ep rank, the plan sent {plan.counts}")
        return list(zip(*(t.split(counts) for t in tensors), strict=True))


def _gather(
    receivers: Sequence[Receiver], spec: MessageSpec, device: torch.device, tag: int | None
) -> tuple[tuple[torch.Tensor, ...], tuple[int, ...], tuple[int, ...]]:
    """Receive one message per receiver into one buffer per tensor (no concatenation copy): the buffers, and
    each message's rows and header meta."""
    headers = [receiver.wait_header(tag=tag) for receiver in receivers]
    counts, metas = tuple(rows for rows, _ in headers), tuple(meta for _, meta in headers)
    comm = receivers[0].comm if receivers else CommStream(device, enabled=False)  # a rank's receivers share one
    with comm.scope():
        buffers = spec.empty(sum(counts), device)
    works = []
    for receiver, slices in zip(receivers, zip(*(b.split(counts) for b in buffers)), strict=True):
        works += receiver.irecv_payload(slices)
    comm.hand_over(works, buffers)
    return buffers, counts, metas


def _check_kind(kind: Kind, allowed: tuple[Kind, ...], who: str) -> None:
    if kind not in allowed:
        raise ValueError(f"{who} carries kinds {[k.value for k in allowed]}, not {kind.value}")


def _check_rows_only(spec: MessageSpec, who: str) -> None:
    if not all(t.per_row for t in spec.tensors):
        raise ValueError(f"{who} concatenates messages by rows; spec {spec.name} has fixed-shape tensors")
