"""M2N and N2M token exchanges between A-groups and F-groups: who talks to whom, on which communicator.

Legend (this file): T tokens of a lane's micro-batch, H hidden, K top-k, E experts, R rows of one message,
S rows of the token-to-rank assignment of one micro-batch.

Kinds of exchange (lane j of A-group g; F_g holds the experts of A_g's layers; ``next`` = (g + 1) % p):

    m2n         lane j of A_g     -> its ep peers in F_g        tokens, local expert ids, weights
    n2m         those ep peers    -> lane j of A_next           partial expert outputs
    resid       lane j of A_g     -> lane j of A_next           residual stream and combine plan (p > 1 only)
    m2n_grad    reverse of m2n (F_g -> lane j of A_g)           grads of tokens and weights
    n2m_grad    reverse of n2m (lane j of A_next -> F_g)        grads of the partial outputs
    resid_grad  reverse of resid                                grad of the residual stream

Communicators: one per (kind, g), over the ranks of its two sides, so each is one-way and carries one kind:

    count  = 4p  (+ 2p when p > 1)                  e.g. M = N = 64, p = 2: 12 in the whole job
    per rank: an attention rank is in 4 (+4), an FFN rank in 4

Only two kinds carry headers (gloo groups over the same ranks): m2n, whose receiver cannot know how many tokens
a lane routed to it, and resid, which tells A_next the combine plan's sizes. Every other receiver knows its sizes
already: the A side from its own dispatch plan, the F side from the m2n headers. At a fixed capacity
(``routing.Capacity``: with one ep rank, where every token of a lane's micro-batch goes to its one peer with all K
pairs, or with ``capacity_factor``, where every lane pads its messages to the capacity) neither needs a header:
both ends know every size from the capacity and whether the layer routes (``static_sizes``); every message is then
one grouped operation, and no receive waits for anything host to host.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from types import MappingProxyType

import torch
import torch.distributed as dist

from disagmoe_ds.comm.channel import CommStream, FanIn, FanOut, Headers, MessageSpec
from disagmoe_ds.comm.messages import (
    Dims,
    ExpertOut,
    ExpertOutGrad,
    Message,
    Residual,
    ResidualGrad,
    TokenGrads,
    Tokens,
)
from disagmoe_ds.comm.routing import Capacity
from disagmoe_ds.comm.transport import Comm, Transport, new_host_group
from disagmoe_ds.layout import Layout
from disagmoe_ds.schedule import Kind  # the schedule's transfer kinds are the exchange's

A_TO_F = (Kind.M2N, Kind.N2M_GRAD)
A_TO_A = (Kind.RESID, Kind.RESID_GRAD)
# The F-group an A lane of group g talks to is g + offset; the A-group an F rank of group g talks to is g - offset.
_F_OFFSET = {Kind.M2N: 0, Kind.M2N_GRAD: 0, Kind.N2M: -1, Kind.N2M_GRAD: -1}


# ----- who talks to whom (pure) -----
def lane_peers(layout: Layout, kind: Kind, group: int, lane: int) -> tuple[int, ...]:
    """The F ranks lane ``lane`` of A-group ``group`` exchanges ``kind`` with, indexed by ep rank (with
    ``node_dedup``: by node, each its gateway rank for the lane)."""
    ffn_group = (group + _F_OFFSET[kind]) % layout.depth
    return tuple(layout.ffn_peer_of_lane(ffn_group, lane, e) for e in range(layout.exchange_peers))


def ffn_lanes(layout: Layout, rank: int) -> tuple[int, ...]:
    """The lanes whose tokens FFN rank ``rank`` takes (lane indices, increasing; all lanes without EDP and without
    ``node_dedup``)."""
    role = layout.role_of(rank)
    node = role.ep_rank // layout.node_dedup
    return tuple(lane for lane in range(layout.lanes) if layout.ffn_peer_of_lane(role.group, lane, node) == rank)


def lane_ranks(layout: Layout, kind: Kind, rank: int) -> tuple[int, ...]:
    """The A ranks FFN rank ``rank`` exchanges ``kind`` with, in lane order."""
    attention_group = (layout.role_of(rank).group - _F_OFFSET[kind]) % layout.depth
    return tuple(layout.attention_ranks(attention_group)[lane] for lane in ffn_lanes(layout, rank))


def comm_ranks(layout: Layout, kind: Kind, group: int) -> tuple[int, ...]:
    """The ranks of communicator (kind, g): the two sides of the messages of group g's layers.

    m2n, m2n_grad: A_g and F_g; n2m, n2m_grad: F_g and A_next; resid, resid_grad: A_g and A_next.
    """
    nxt = (group + 1) % layout.depth
    if kind in A_TO_A:
        sides = (layout.attention_ranks(group), layout.attention_ranks(nxt))
    elif kind in (Kind.M2N, Kind.M2N_GRAD):
        sides = (layout.attention_ranks(group), layout.ffn_ranks(group))
    else:
        sides = (layout.ffn_ranks(group), layout.attention_ranks(nxt))
    return tuple(sorted({*sides[0], *sides[1]}))


def comm_keys(layout: Layout) -> tuple[tuple[Kind, int], ...]:
    """Every (kind, g) communicator of the job, in creation order (the same on every rank).

    >>> len(comm_keys(Layout(attention_gpus=4, ffn_gpus=4, num_layers=2, num_experts=4, depth=2)))
    12
    """
    kinds = [k for k in Kind if layout.depth > 1 or k not in A_TO_A]
    return tuple((kind, g) for kind in kinds for g in range(layout.depth))


def endpoint(layout: Layout, kind: Kind, rank: int, *, sending: bool) -> tuple[tuple[Kind, int], tuple[int, ...]]:
    """The communicator key on which ``rank`` sends (or receives) ``kind``, and its peers in message order."""
    role = layout.role_of(rank)
    g, prev = role.group, (role.group - 1) % layout.depth
    if not role.is_attention:  # F_g: every kind on its own group's communicators
        return (kind, g), lane_ranks(layout, kind, rank)
    if kind in A_TO_A:  # resid goes up (A_g -> A_next), resid_grad down
        up = (kind == Kind.RESID) == sending
        other = layout.attention_ranks((g + 1) % layout.depth if up else prev)[role.index]
        return (kind, g if up else prev), (other,)
    key_group = g if kind in (Kind.M2N, Kind.M2N_GRAD) else prev
    return (kind, key_group), lane_peers(layout, kind, g, role.index)


def comm_pairs(layout: Layout, kind: Kind, group: int) -> tuple[tuple[int, int], ...]:
    """Every (src, dst) that sends on communicator (kind, g), in rank order."""
    pairs = []
    for src in comm_ranks(layout, kind, group):
        role = layout.role_of(src)
        sends = (kind in A_TO_A or kind in A_TO_F) == role.is_attention
        if sends:
            key, peers = endpoint(layout, kind, src, sending=True)
            pairs += [(src, dst) for dst in peers] if key == (kind, group) else []
    return tuple(pairs)


# ----- communicators -----
@dataclass(frozen=True)
class ExchangeComms:
    """The job's exchange communicators and header groups, keyed by (kind, g), as seen by this rank."""

    layout: Layout
    rank: int
    transport: Transport
    comms: Mapping[tuple[Kind, int], Comm]
    headers: Mapping[tuple[Kind, int], Headers]
    headerless: bool = False  # m2n and resid go without headers: their sizes come from a ``Capacity``

    def fan_out(self, kind: Kind, spec: MessageSpec) -> FanOut:
        key, peers = endpoint(self.layout, kind, self.rank, sending=True)
        return FanOut(self.transport, self.comms[key], peers, spec, self.headers.get(key))

    def fan_in(self, kind: Kind, spec: MessageSpec, device: torch.device, comm_stream: CommStream) -> FanIn:
        key, peers = endpoint(self.layout, kind, self.rank, sending=False)
        return FanIn(self.transport, self.comms[key], peers, spec, self.headers.get(key), device, comm_stream)


def static_sizes(
    kind: Kind, capacity: Capacity, *, peers: int, ep_size: int, moe_layer: bool
) -> tuple[list[tuple[int, ...]], tuple[tuple[int, ...], ...]]:
    """The sizes and header metas every message of a header-less ``kind`` has at ``capacity``, per peer: m2n, each
    of ``peers`` lanes' message at the capacity's rows and pairs; resid, T rows and, when the sending layer routes
    (``moe_layer``), a combine plan of the capacity's rows per ep rank (-1 per ep rank: dense).

    >>> static_sizes(Kind.RESID, Capacity(8, 8, 16, exact=True), peers=1, ep_size=1, moe_layer=True)
    ([(8, 8)], ((8,),))
    """
    if kind == Kind.M2N:
        return [(capacity.rows,)] * peers, ((capacity.pairs,),) * peers
    if kind == Kind.RESID:
        rows = capacity.rows if moe_layer else -1
        return [(capacity.tokens, max(rows, 0) * ep_size)], ((rows,) * ep_size,)
    raise ValueError(f"{kind.value} messages carry no header: their receivers know their sizes from other messages")


def build_exchange_comms(
    layout: Layout, transport: Transport, *, device: torch.device, headerless: bool = False
) -> ExchangeComms:
    """Create every exchange communicator (and header group) on every rank in the same order, then warm them up.

    ``headerless``: every lane's micro-batch has the same known size and the messages have a fixed capacity (one ep
    rank, or ``capacity_factor``): m2n and resid then go without headers (``static_sizes``).
    """
    layout.check_world_size(dist.get_world_size())
    rank = dist.get_rank()
    with_headers = () if headerless else (Kind.M2N, Kind.RESID)
    comms: dict[tuple[Kind, int], Comm] = {}
    headers: dict[tuple[Kind, int], Headers] = {}
    for kind, group in comm_keys(layout):
        ranks = comm_ranks(layout, kind, group)
        pairs = comm_pairs(layout, kind, group)
        comms[kind, group] = transport.new_comm(f"{kind.value}[{group}]", ranks, pairs)
        if kind in with_headers:
            header_group = new_host_group(ranks, transport.timeout)
            if header_group is not None:  # a member
                headers[kind, group] = Headers(header_group)
    transport.warm_up(list(comms.values()), device)
    mine = {key: comm for key, comm in comms.items() if comm.group is not None}
    return ExchangeComms(layout, rank, transport, MappingProxyType(mine), MappingProxyType(headers), headerless)


# ----- message types -----
MESSAGE_TYPES: Mapping[Kind, type[Message]] = MappingProxyType(
    {
        Kind.M2N: Tokens,
        Kind.N2M: ExpertOut,
        Kind.RESID: Residual,
        Kind.M2N_GRAD: TokenGrads,
        Kind.N2M_GRAD: ExpertOutGrad,
        Kind.RESID_GRAD: ResidualGrad,
    }
)


def exchange_specs(dims: Dims, *, resend: bool = False) -> dict[Kind, MessageSpec]:
    """The wire spec of each kind, derived from its message type (``comm.messages``); ``resend`` adds the variants
    that carry the tokens again (n2m_grad, and resid with p > 1)."""
    return {kind: message.spec(dims, resend=resend) for kind, message in MESSAGE_TYPES.items()}


@dataclass(frozen=True)
class LaneRows:
    """Rows an F rank received from each of its lanes for one micro-batch (the split of the reverse path)."""

    lanes: tuple[int, ...]  # the lanes' ranks
    counts: tuple[int, ...]
