"""The AF-Pipe exchange protocol under rendezvous, over many layouts: real schedules, real mailboxes, fake compute.

Each rank walks its worker's generated instruction stream with the real ``Mailbox`` on the ``RendezvousTransport``
(a send completes only once its receive has started; each communicator's operations complete in order). Compute is
replaced by payloads that are pure functions of (layer, micro-batch, lane, ep rank), row counts included (zero rows
too), so every receiver checks every message exactly. A deadlock fails as a transport timeout naming the operation.
"""

from __future__ import annotations

from datetime import timedelta

import pytest
import torch

from disagmoe_ds.afpipe.mailbox import Mailbox
from disagmoe_ds.comm import (
    ExpertOut,
    ExpertOutGrad,
    RendezvousTransport,
    Residual,
    ResidualGrad,
    TokenGrads,
    Tokens,
    build_exchange_comms,
)
from disagmoe_ds.comm.exchange import ffn_lanes
from disagmoe_ds.comm.routing import Capacity
from disagmoe_ds.launch.testing import run_ranks
from disagmoe_ds.layout import Layout
from disagmoe_ds.schedule import ComputeInstruction, PipeShape, PostRecv, Send, WaitRecv, Worker, generate, size_sources

H, K, E = 4, 2, 6
CPU = torch.device("cpu")
T = 5  # tokens per micro-batch


_STATIC = False  # set per rank process: m2n without headers, every lane sends its whole micro-batch (one ep rank)


def rows(layer: int, mb: int, lane: int, e: int) -> int:
    if _STATIC:
        return T
    return (3 * layer + 5 * mb + 7 * lane + 11 * e) % 4  # 0 .. 3, zero-row messages included


def tokens(layer: int, mb: int, lane: int, e: int) -> torch.Tensor:
    base = 1000 * layer + 100 * mb + 10 * lane + e
    return base + torch.arange(rows(layer, mb, lane, e) * H, dtype=torch.float32).view(-1, H) / 64


def residual(layer: int, mb: int, lane: int) -> torch.Tensor:
    return 1000 * layer + 100 * mb + 10 * lane + torch.arange(T * H, dtype=torch.float32).view(T, H) / 64


class FakeRank:
    """Produces each message's payload and checks each received one, by the pure functions above."""

    def __init__(self, layout: Layout, rank: int, moe: tuple[bool, ...]) -> None:
        self.layout, self.role, self.moe, self.checked = layout, layout.role_of(rank), moe, 0
        self.lanes = ffn_lanes(layout, rank) if not self.role.is_attention else (self.role.index,)
        self.P = layout.ep_size

    def payload(self, kind: str, layer: int, mb: int):
        lane = self.role.index
        if kind == "m2n":
            return [
                Tokens.of(
                    tokens(layer, mb, lane, e),
                    torch.zeros(rows(layer, mb, lane, e), K, dtype=torch.int64),
                    torch.ones(rows(layer, mb, lane, e), K),
                    rows(layer, mb, lane, e) * K,  # pairs: every id is local
                    fp8=False,
                )
                for e in range(self.P)
            ]
        if kind == "resid":
            sizes = tuple(rows(layer, mb, lane, e) for e in range(self.P)) if self.moe[layer] else (-1,) * self.P
            idx = torch.arange(sum(max(s, 0) for s in sizes), dtype=torch.int64)
            zeros_e = torch.zeros(E)
            none_T0 = torch.zeros(T, 0)  # no routed-sum weights, no token ids (no hyper-connections, no hash layers)
            return Residual(
                residual(layer, mb, lane), idx, torch.arange(T), none_T0, none_T0.long(), zeros_e, zeros_e, sizes
            )
        if kind == "resid_grad":  # sent by A_bwd(layer): the grad of resid (layer - 1)
            return ResidualGrad(residual(layer - 1, mb, lane) * 7, torch.zeros(T, 0), torch.ones(E))
        if kind == "n2m_grad":  # sent by A_bwd(layer) for MoE layer - 1
            return [ExpertOutGrad(tokens(layer - 1, mb, lane, e) * 6) for e in range(self.P)]
        e = self.role.ep_rank  # F side: rows of every lane it serves, in lane order
        x = torch.cat([tokens(layer, mb, j, e) for j in self.lanes])
        counts = [rows(layer, mb, j, e) for j in self.lanes]
        if kind == "n2m":
            return ExpertOut(x * 2).split(counts)
        return TokenGrads(x * 5, torch.ones(x.shape[0], K) * 5).split(counts)  # m2n_grad

    def check(self, kind: str, layer: int, mb: int, received) -> None:
        lane, e = self.role.index, self.role.ep_rank
        messages = received.messages  # the A side: one per peer; the F side: every lane's in one, with their rows
        got = (messages[0], received.lanes) if received.lanes is not None else messages
        got = got[0] if kind in ("resid", "resid_grad") else got
        if kind == "m2n":
            routed, lane_rows = got
            want = torch.cat([tokens(layer, mb, j, e) for j in self.lanes])
            assert torch.equal(routed.x_RH, want) and routed.pairs == K * sum(lane_rows.counts), (kind, layer, mb)
        elif kind == "n2m_grad":  # src layer is layer + 1
            grad, _ = got
            want = torch.cat([tokens(layer - 1, mb, j, e) * 6 for j in self.lanes])
            assert torch.equal(grad.dy_RH, want), (kind, layer, mb)
        elif kind == "n2m":
            assert all(torch.equal(out.y_RH, tokens(layer, mb, lane, p) * 2) for p, out in enumerate(got)), kind
        elif kind == "m2n_grad":
            assert all(torch.equal(g.dx_RH, tokens(layer, mb, lane, p) * 5) for p, g in enumerate(got)), kind
        elif kind == "resid":
            want = tuple(rows(layer, mb, lane, p) for p in range(self.P)) if self.moe[layer] else (-1,) * self.P
            assert torch.equal(got.residual_TH, residual(layer, mb, lane)) and got.rows_P == want
            assert got.token_idx_S.numel() == sum(max(s, 0) for s in want)
        else:  # resid_grad, sent by A_bwd(layer)
            assert torch.equal(got.d_residual_TH, residual(layer - 1, mb, lane) * 7), (kind, layer, mb)
        self.checked += 1


def _body(rank: int, shape: tuple[int, int, int, int], micro_batches: int, moe: tuple[bool, ...], static: bool) -> int:
    global _STATIC
    _STATIC = static
    m, n, p, edp = shape
    layout = Layout(attention_gpus=m, ffn_gpus=n, depth=p, num_layers=len(moe), num_experts=E, expert_data_parallel=edp)
    transport = RendezvousTransport(timedelta(seconds=8))
    comms = build_exchange_comms(layout, transport, device=CPU, headerless=static)
    assert comms.headerless == static == (not comms.headers)  # one ep rank: none
    capacity = Capacity.initial(tokens=T, top_k=K, ep_size=1, experts_per_rank=E, factor=1.0) if static else None
    role, fake = layout.role_of(rank), FakeRank(layout, rank, moe)
    schedule = generate(PipeShape(p, len(moe), moe), micro_batches)
    worker = Worker("A" if role.is_attention else "F", role.group)
    mailbox = Mailbox(
        comms,
        worker=worker,
        size_sources=size_sources(schedule.graph),
        hidden=H,
        top_k=K,
        dtype=torch.float32,
        weight_dtype=torch.float32,
        device=CPU,
        moe_layers=moe,
        capacity=capacity,
    )
    for _ in range(2):  # a second step reuses every communicator and starts clean
        for ins in schedule.streams[worker]:
            if isinstance(ins, PostRecv):
                mailbox.post(ins.transfer)
            elif isinstance(ins, WaitRecv):
                msg = ins.transfer
                fake.check(msg.kind, msg.src.layer, msg.src.micro_batch, mailbox.wait(msg))
            elif isinstance(ins, Send):
                msg = ins.transfer
                mailbox.send(msg, fake.payload(msg.kind, msg.src.layer, msg.src.micro_batch))
            elif isinstance(ins, ComputeInstruction):
                mailbox.pump()
        mailbox.flush()
    return fake.checked


CASES = [  # (M, N, p, edp), micro-batches, MoE pattern, m2n without headers (one ep rank per F-group only)
    ((1, 1, 1, 1), 1, (True,), False),
    ((1, 1, 1, 1), 16, (True, True), False),
    ((1, 1, 1, 1), 16, (True, True), True),
    ((2, 2, 1, 1), 4, (False, True), False),
    ((2, 3, 1, 1), 5, (True, True), False),
    ((2, 4, 1, 2), 3, (True, True), False),
    ((2, 2, 1, 2), 3, (True, True), True),
    ((2, 2, 2, 1), 16, (True, True, True, True), False),
    ((2, 2, 2, 1), 16, (True, True, True, True), True),
    ((4, 2, 2, 1), 6, (False, True, True, True), False),
    ((4, 2, 2, 1), 6, (False, True, True, True), True),
    ((3, 3, 3, 1), 7, (True,) * 6, False),
    ((4, 4, 4, 1), 9, (True,) * 4, False),
]


@pytest.mark.parametrize(("shape", "micro_batches", "moe", "static"), CASES, ids=lambda c: str(c).replace(" ", ""))
def test_every_message_arrives_exactly_under_rendezvous(shape, micro_batches, moe, static) -> None:
    checked = run_ranks(_body, shape[0] + shape[1], args=(shape, micro_batches, moe, static), timeout_s=120)
    p, moe_layers = shape[2], sum(moe)
    # per micro-batch and step: A lanes receive n2m + m2n_grad per MoE layer, resid + resid_grad per layer (p = 1:
    # hand-offs, through the mailbox as every transfer)
    lanes = shape[0] // p
    per_lane = 2 * moe_layers + 2 * len(moe)
    assert sum(checked[: shape[0]]) == 2 * micro_batches * lanes * per_lane
    # each F rank of group g: m2n and n2m_grad per micro-batch and step for each of g's MoE layers
    ffn_per_group = shape[1] // p
    for f, got in enumerate(checked[shape[0] :]):
        group_moe = sum(moe[layer] for layer in range(f // ffn_per_group, len(moe), p))
        assert got == 2 * micro_batches * 2 * group_moe, (f, got)
