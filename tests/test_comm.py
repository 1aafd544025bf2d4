"""Token exchange: routing against a per-token loop, the channel protocol, M2N/N2M round trips over layouts.

Legend: T tokens, H hidden, K top-k, E experts, R rows for one ep rank.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from disagmoe_ds.comm import (
    ChannelError,
    DispatchPlan,
    ExchangeGroups,
    Kind,
    Link,
    M2NReceiver,
    M2NSender,
    MessageSpec,
    N2MReceiver,
    N2MSender,
    Receiver,
    Sender,
    TensorSpec,
    build_exchange_groups,
    combine,
    dispatch_messages,
    exchange_pairs,
    exchange_specs,
    pack,
    plan_dispatch,
)
from disagmoe_ds.comm.exchange import ffn_lanes, lane_peers
from disagmoe_ds.launch.testing import run_ranks
from disagmoe_ds.layout import Layout

H, K, E = 8, 2, 6
# fp64 routing math against an fp64 loop: only summation order differs.
TOL_FP64 = 1e-12
CPU = torch.device("cpu")


# ----- helpers: the "experts" and the references -----
def fake_experts(x_RH: torch.Tensor, idx_RK: torch.Tensor, w_RK: torch.Tensor, ep_rank: int, epr: int) -> torch.Tensor:
    """y = sum_k x * (global expert id + 1) * w_k; sentinel entries have w = 0. Depends on the rank's expert range,
    so a message delivered to the wrong ep rank changes the result."""
    global_RK = idx_RK + ep_rank * epr
    scale_R1 = ((global_RK + 1).to(w_RK.dtype) * w_RK).sum(dim=1, keepdim=True)
    return x_RH * scale_R1.to(x_RH.dtype)


def routed_reference(x_TH: torch.Tensor, idx_TK: torch.Tensor, w_TK: torch.Tensor, ep_size: int) -> torch.Tensor:
    """Single-process pack -> fake experts per ep rank -> combine (the exact result the exchange must give)."""
    epr = E // ep_size
    plan = plan_dispatch(idx_TK, ep_size, epr)
    pieces = pack(x_TH, w_TK, plan)
    ys = [fake_experts(x, i, w, r, epr) for r, ((x, w), i) in enumerate(zip(pieces, plan.local_idx_RK, strict=True))]
    return combine(ys, plan)


def dense_reference(x_TH: torch.Tensor, idx_TK: torch.Tensor, w_TK: torch.Tensor) -> torch.Tensor:
    """Per-token loop: out[t] = sum_k x[t] * (idx[t, k] + 1) * w[t, k]."""
    rows = [sum(x_TH[t] * (idx_TK[t, k] + 1) * w_TK[t, k] for k in range(K)) for t in range(x_TH.shape[0])]
    return torch.stack(rows) if rows else x_TH.new_zeros(0, H)


def routing_case(name: str, num_tokens: int, seed: int = 0) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    if name == "random":
        return torch.rand(num_tokens, E, generator=gen).topk(K).indices
    if name == "skewed":  # every token picks experts 0 and 1, which live on ep rank 0 for experts_per_rank >= 2
        return torch.tensor([[0, 1]]).expand(num_tokens, K).clone()
    if name == "same_rank":  # both experts of a token on one rank, alternating between ranks 0 and 2 of ep 3
        pairs = torch.tensor([[0, 1], [5, 4]])
        return pairs[torch.arange(num_tokens) % 2]
    raise ValueError(name)


# ----- routing (single process) -----
@pytest.mark.parametrize("case", ["random", "skewed", "same_rank"])
@pytest.mark.parametrize("ep_size", [1, 2, 3])
def test_plan_matches_per_token_loop(case: str, ep_size: int) -> None:
    epr = E // ep_size
    idx_TK = routing_case(case, 11)
    plan = plan_dispatch(idx_TK, ep_size, epr)
    for r in range(ep_size):
        tokens = [t for t in range(11) if any(int(e) // epr == r for e in idx_TK[t])]
        local = [[int(e) - r * epr if int(e) // epr == r else epr for e in idx_TK[t]] for t in tokens]
        assert plan.token_idx_R[r].tolist() == tokens
        assert plan.local_idx_RK[r].tolist() == local
        assert plan.counts[r] == len(tokens)


@pytest.mark.parametrize("case", ["random", "skewed", "same_rank"])
@pytest.mark.parametrize("ep_size", [1, 2, 3])
def test_pack_combine_match_dense_reference(case: str, ep_size: int) -> None:
    gen = torch.Generator().manual_seed(1)
    x_TH = torch.randn(13, H, dtype=torch.float64, generator=gen)
    w_TK = torch.rand(13, K, dtype=torch.float64, generator=gen)
    idx_TK = routing_case(case, 13, seed=2)
    out_TH = routed_reference(x_TH, idx_TK, w_TK, ep_size)
    torch.testing.assert_close(out_TH, dense_reference(x_TH, idx_TK, w_TK), rtol=TOL_FP64, atol=TOL_FP64)


def test_pack_zeroes_sentinel_weights_and_keeps_dtypes() -> None:
    x_TH = torch.randn(4, H).bfloat16()
    w_TK = torch.rand(4, K)  # fp32 weights beside bf16 activations, as HF routers produce
    plan = plan_dispatch(torch.tensor([[0, 5], [1, 2], [4, 5], [0, 1]]), 3, 2)
    (x0, w0), (x1, w1), (x2, w2) = pack(x_TH, w_TK, plan)
    assert (x0.dtype, w0.dtype, plan.local_idx_SK.dtype) == (torch.bfloat16, torch.float32, torch.int64)
    assert plan.counts == (3, 1, 2)
    assert plan.local_idx_RK[2].tolist() == [[2, 1], [0, 1]]
    assert w2[0, 0] == 0 and w2[0, 1] == w_TK[0, 1] and torch.equal(w2[1], w_TK[2])


def test_autograd_matches_dense_reference() -> None:
    gen = torch.Generator().manual_seed(3)
    x_TH = torch.randn(9, H, dtype=torch.float64, generator=gen, requires_grad=True)
    w_TK = torch.rand(9, K, dtype=torch.float64, generator=gen, requires_grad=True)
    idx_TK = routing_case("random", 9, seed=4)
    g_TH = torch.randn(9, H, dtype=torch.float64, generator=gen)
    grads = torch.autograd.grad((routed_reference(x_TH, idx_TK, w_TK, 3) * g_TH).sum(), (x_TH, w_TK))
    ref = torch.autograd.grad((dense_reference(x_TH, idx_TK, w_TK) * g_TH).sum(), (x_TH, w_TK))
    for got, want in zip(grads, ref, strict=True):
        torch.testing.assert_close(got, want, rtol=TOL_FP64, atol=TOL_FP64)


def test_empty_micro_batch() -> None:
    plan = plan_dispatch(torch.zeros(0, K, dtype=torch.int64), 2, 3)
    pieces = pack(torch.zeros(0, H), torch.zeros(0, K), plan)
    assert plan.counts == (0, 0) and combine([x for x, _ in pieces], plan).shape == (0, H)


# ----- who talks to whom (pure) -----
LAYOUTS = [  # (M, N, p, expert_data_parallel)
    (1, 1, 1, 1),
    (2, 2, 1, 1),
    (2, 1, 1, 1),
    (1, 2, 1, 1),
    (2, 2, 2, 1),
    (2, 3, 1, 1),
    (2, 2, 1, 2),
    (1, 2, 1, 2),  # one lane, two replicas: replica 1 serves no lane
    (2, 4, 1, 2),
]


def make_layout(m: int, n: int, p: int, edp: int) -> Layout:
    return Layout(attention_gpus=m, ffn_gpus=n, depth=p, num_layers=2 * p, num_experts=E, expert_data_parallel=edp)


@pytest.mark.parametrize("shape", LAYOUTS)
def test_pair_count_and_peer_maps(shape: tuple[int, int, int, int]) -> None:
    layout = make_layout(*shape)
    pairs = exchange_pairs(layout)
    m, p, ep = layout.attention_gpus, layout.depth, layout.ep_size
    assert len(pairs) == len(set(pairs)) == 4 * m * ep + 2 * m * (p > 1)
    for g in range(p):
        for lane in range(layout.lanes):
            for f in lane_peers(layout, Kind.M2N, g, lane):
                assert lane in ffn_lanes(layout, f)
                assert (Kind.M2N, layout.attention_ranks(g)[lane], f) in pairs
                assert (Kind.N2M, f, layout.attention_ranks((g + 1) % p)[lane]) in pairs


# ----- channel protocol (2 ranks) -----
MESSAGE = MessageSpec(
    (TensorSpec(torch.bfloat16, (H,)), TensorSpec(torch.int64, (K,)), TensorSpec(torch.float32, (K,))), name="tokens"
)
FIXED = MessageSpec((TensorSpec(torch.float32, (3,), per_row=False), TensorSpec(torch.int64, (2,))), name="fixed")
ROWS = [3, 0, 7, 1]


def _message(rows: int, seed: int) -> tuple[torch.Tensor, ...]:
    gen = torch.Generator().manual_seed(seed)
    x_RH = torch.randn(rows, H, generator=gen).bfloat16()
    idx_RK = torch.randint(0, 1 << 40, (rows, K), generator=gen)  # needs all 64 bits
    return x_RH, idx_RK, torch.rand(rows, K, generator=gen)


def _link() -> Link:
    return Link(0, 1, dist.new_group([0, 1]), dist.new_group([0, 1]))


def _channel_body(rank: int) -> dict[str, object]:
    ordered, fixed, mismatch = _link(), _link(), _link()
    if rank == 0:
        sender = Sender(ordered, MESSAGE, CPU)
        for i, rows in enumerate(ROWS):  # all in flight at once
            sender.send(_message(rows, i), tag=10 + i)
        sender.wait_all()
        Sender(fixed, FIXED, CPU).send((torch.arange(3.0), torch.arange(10).view(5, 2)), tag=1).wait()
        other = MessageSpec(MESSAGE.tensors[:2], name="tokens")  # the receiver declares three tensors
        Sender(mismatch, other, CPU).send(_message(0, 0)[:2], tag=0).wait()
        Sender(mismatch, MESSAGE, CPU).send(_message(0, 0), tag=5).wait()
        return {}
    receiver = Receiver(ordered, MESSAGE, CPU)
    for _ in ROWS:
        receiver.post()  # headers posted before any size is known
    got = [receiver.wait(tag=10 + i) for i in range(len(ROWS))]
    exact = all(
        all(torch.equal(a, b) for a, b in zip(msg, _message(rows, i), strict=True))
        for i, (msg, rows) in enumerate(zip(got, ROWS, strict=True))
    )
    fixed_msg = Receiver(fixed, FIXED, CPU).wait(tag=1)
    errors = []
    for tag in (0, 4):  # spec mismatch, then tag mismatch (zero-row messages: nothing left in flight)
        try:
            Receiver(mismatch, MESSAGE, CPU).wait(tag=tag)
        except ChannelError as err:
            errors.append(str(err))
    return {"exact": exact, "rows": [m[0].shape[0] for m in got], "fixed": fixed_msg, "errors": errors}


def test_channel_fifo_sizes_dtypes_and_checks() -> None:
    _, result = run_ranks(_channel_body, 2)
    assert result["exact"] and result["rows"] == ROWS
    values, rows = result["fixed"]
    assert values.tolist() == [0.0, 1.0, 2.0] and rows.tolist() == [[0, 1], [2, 3], [4, 5], [6, 7], [8, 9]]
    spec_error, tag_error = result["errors"]
    assert "spec differs" in spec_error and "expected tag 4, the oldest message has tag 5" in tag_error


def test_sender_checks_the_spec_locally() -> None:
    x_RH, idx_RK, w_RK = _message(2, 0)
    with pytest.raises(ChannelError, match=r"tensor 2 is torch.float64\[2, 2\], the spec wants torch.float32"):
        MESSAGE.check((x_RH, idx_RK, w_RK.double()))
    with pytest.raises(ChannelError, match=r"tensor 1 is torch.int64\[3, 2\], the spec wants torch.int64\[2, 2\]"):
        MESSAGE.check((x_RH, _message(3, 0)[1], w_RK))


# ----- M2N / N2M round trip over layouts: forward and backward exchanges -----
NUM_MICRO = 3
SPECS = exchange_specs(H, K, dtype=torch.bfloat16, weight_dtype=torch.float32)


def lane_inputs(group: int, lane: int, micro: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """One lane's micro-batch: bf16 tokens, int64 global ids, fp32 weights, bf16 output grad; some empty, some
    skewed (all tokens to experts 0 and 1: every other ep rank gets zero-row messages)."""
    gen = torch.Generator().manual_seed(100 * group + 10 * lane + micro)
    num_tokens = 0 if (group, lane, micro) == (0, 0, 1) else 4 + 3 * lane + 2 * group + micro
    x_TH = torch.randn(num_tokens, H, generator=gen).bfloat16()
    w_TK = torch.rand(num_tokens, K, generator=gen)
    idx_TK = torch.rand(num_tokens, E, generator=gen).topk(K).indices
    grad_TH = torch.randn(num_tokens, H, generator=gen).bfloat16()
    return x_TH, routing_case("skewed", num_tokens) if micro == 2 else idx_TK, w_TK, grad_TH


def single_process_reference(group: int, lane: int, micro: int, ep_size: int) -> list[torch.Tensor]:
    """out_TH, dx_TH, dw_TK of one lane's micro-batch, computed without any exchange."""
    x_TH, idx_TK, w_TK, grad_TH = lane_inputs(group, lane, micro)
    x_TH.requires_grad_()
    w_TK.requires_grad_()
    out_TH = routed_reference(x_TH, idx_TK, w_TK, ep_size)
    out_TH.backward(grad_TH)
    return [out_TH.detach(), x_TH.grad, w_TK.grad]


class AttentionLane:
    """Lane j of A_g: dispatches its micro-batches, combines those of lane j of A_{g-1}, runs both backwards."""

    def __init__(self, layout: Layout, groups: ExchangeGroups, rank: int) -> None:
        role = layout.role_of(rank)
        self.layout, self.group, self.lane = layout, role.group, role.index
        self.m2n = M2NSender.build(groups, Kind.M2N, spec=SPECS[Kind.M2N], device=CPU)
        self.n2m = N2MReceiver.build(groups, Kind.N2M, spec=SPECS[Kind.N2M], device=CPU)
        self.n2m_grad = M2NSender.build(groups, Kind.N2M_GRAD, spec=SPECS[Kind.N2M_GRAD], device=CPU)
        self.m2n_grad = N2MReceiver.build(groups, Kind.M2N_GRAD, spec=SPECS[Kind.M2N_GRAD], device=CPU)
        p = layout.depth
        prev, nxt = (
            layout.attention_ranks((self.group - 1) % p)[self.lane],
            layout.attention_ranks((self.group + 1) % p)[self.lane],
        )
        self.resid_out = Sender(groups.link(Kind.RESID, rank, nxt), SPECS[Kind.RESID], CPU) if p > 1 else None
        self.resid_in = Receiver(groups.link(Kind.RESID, prev, rank), SPECS[Kind.RESID], CPU) if p > 1 else None

    def plan(self, idx_TK: torch.Tensor) -> DispatchPlan:
        return plan_dispatch(idx_TK, self.layout.ep_size, self.layout.experts_per_rank)

    def dispatch(self, micro: int) -> tuple[torch.Tensor, torch.Tensor, list]:
        x_TH, idx_TK, w_TK, _ = lane_inputs(self.group, self.lane, micro)
        x_TH.requires_grad_()
        w_TK.requires_grad_()
        plan = self.plan(idx_TK)
        pieces = pack(x_TH, w_TK, plan)  # keeps the autograd graph for the m2n_grad answer
        self.m2n.send(*dispatch_messages(pieces, plan), tag=micro)
        if self.resid_out:
            self.resid_out.send((x_TH, idx_TK), tag=micro)
        return x_TH, w_TK, pieces

    def combine_and_return_grads(self, micro: int) -> torch.Tensor:
        """The tokens arriving here are lane j of A_{g-1}'s: its resid carries the ids to re-plan with."""
        source = lane_inputs((self.group - 1) % self.layout.depth, self.lane, micro)
        idx_TK = self.resid_in.wait(tag=micro)[1] if self.resid_in else source[1]
        plan = self.plan(idx_TK)
        y_list = [y_RH.requires_grad_() for (y_RH,) in self.n2m.wait(plan=plan, tag=micro)]
        out_TH = combine(y_list, plan)
        out_TH.backward(source[3])  # the "loss" gradient of this lane's output
        self.n2m_grad.send([(y_RH.grad,) for y_RH in y_list], tag=micro)
        return out_TH.detach()

    def backward(self, micro: int, dispatched: tuple[torch.Tensor, torch.Tensor, list]) -> list[torch.Tensor]:
        x_TH, w_TK, pieces = dispatched
        grads = self.m2n_grad.wait(plan=self.plan(lane_inputs(self.group, self.lane, micro)[1]), tag=micro)
        tensors = [t for piece in pieces for t in piece]
        torch.autograd.backward(tensors, [g for grad in grads for g in grad])
        return [x_TH.grad, w_TK.grad]

    def run(self) -> dict[tuple[int, int, int, str], list[torch.Tensor]]:
        receivers = [self.n2m, self.m2n_grad, *([self.resid_in] if self.resid_in else [])]
        for receiver in receivers:
            for _ in range(NUM_MICRO):
                receiver.post()  # everything posted ahead, before any size is known
        dispatched = [self.dispatch(micro) for micro in range(NUM_MICRO)]
        outs = [self.combine_and_return_grads(micro) for micro in range(NUM_MICRO)]
        results = {}
        for micro in range(NUM_MICRO):
            results[((self.group - 1) % self.layout.depth, self.lane, micro, "out")] = [outs[micro]]
            results[(self.group, self.lane, micro, "grad")] = self.backward(micro, dispatched[micro])
        self.m2n.wait_all()
        self.n2m_grad.wait_all()
        return results


def _ffn_rank(layout: Layout, groups: ExchangeGroups, rank: int) -> list[tuple[int, ...]]:
    """F rank: fake experts forward for every micro-batch, then their backward, as the grads come back."""
    ep_rank, epr = layout.role_of(rank).ep_rank, layout.experts_per_rank
    m2n = M2NReceiver.build(groups, Kind.M2N, spec=SPECS[Kind.M2N], device=CPU)
    n2m = N2MSender.build(groups, Kind.N2M, spec=SPECS[Kind.N2M], device=CPU)
    n2m_grad = M2NReceiver.build(groups, Kind.N2M_GRAD, spec=SPECS[Kind.N2M_GRAD], device=CPU)
    m2n_grad = N2MSender.build(groups, Kind.M2N_GRAD, spec=SPECS[Kind.M2N_GRAD], device=CPU)
    for _ in range(NUM_MICRO):
        m2n.post()
        n2m_grad.post()
    saved = []
    for micro in range(NUM_MICRO):
        (x_RH, idx_RK, w_RK), rows = m2n.wait(tag=micro)
        assert rows.meta == int((idx_RK < epr).sum()), "the header meta carries the routed pairs"
        x_RH.requires_grad_()
        w_RK.requires_grad_()
        y_RH = fake_experts(x_RH, idx_RK, w_RK, ep_rank, epr)
        n2m.send((y_RH,), rows, tag=micro)
        saved.append((x_RH, w_RK, y_RH, rows))
    for micro, (x_RH, w_RK, y_RH, rows) in enumerate(saved):
        (dy_RH,), grad_rows = n2m_grad.wait(tag=micro)
        assert grad_rows.counts == rows.counts, (grad_rows, rows)
        y_RH.backward(dy_RH)
        m2n_grad.send((x_RH.grad, w_RK.grad), rows, tag=micro)
    n2m.wait_all()
    m2n_grad.wait_all()
    return [rows.counts for *_, rows in saved]


def _round_trip_body(rank: int, layout: Layout) -> object:
    groups = build_exchange_groups(layout, device=CPU)
    assert groups.num_groups == 2 * len(exchange_pairs(layout))
    if layout.role_of(rank).is_attention:
        return AttentionLane(layout, groups, rank).run()
    return _ffn_rank(layout, groups, rank)


@pytest.mark.parametrize("shape", LAYOUTS, ids=lambda s: "M{}N{}p{}edp{}".format(*s))
def test_m2n_n2m_round_trip_is_exact(shape: tuple[int, int, int, int]) -> None:
    layout = make_layout(*shape)
    results = run_ranks(_round_trip_body, layout.world_size, args=(layout,))
    got = {key: value for result in results[: layout.attention_gpus] for key, value in result.items()}
    assert len(got) == 2 * layout.attention_gpus * NUM_MICRO
    for g in range(layout.depth):
        for lane in range(layout.lanes):
            for micro in range(NUM_MICRO):
                out_TH, dx_TH, dw_TK = single_process_reference(g, lane, micro, layout.ep_size)
                # Same ops on the same rows in the same order: bit-identical, bf16 and fp32 alike.
                assert torch.equal(got[(g, lane, micro, "out")][0], out_TH), (g, lane, micro)
                assert torch.equal(got[(g, lane, micro, "grad")][0], dx_TH), (g, lane, micro)
                assert torch.equal(got[(g, lane, micro, "grad")][1], dw_TK), (g, lane, micro)
    # Every F rank saw one message per micro-batch from each lane it serves, zero-row ones included.
    for rank, seen in enumerate(results[layout.attention_gpus :], start=layout.attention_gpus):
        assert all(len(counts) == len(ffn_lanes(layout, rank)) for counts in seen)


def test_helpers_reject_wrong_direction() -> None:
    with pytest.raises(ValueError, match=r"M2NSender carries kinds \['m2n', 'n2m_grad'\], not n2m"):
        M2NSender.build(None, Kind.N2M, spec=SPECS[Kind.N2M], device=CPU)


def test_plan_is_a_value() -> None:
    plan = plan_dispatch(torch.tensor([[0, 1]]), 1, E)
    assert isinstance(plan, DispatchPlan)
    with pytest.raises(AttributeError):
        plan.counts = (0,)  # frozen: the reverse path can rely on it


def test_routing_doctests():
    import doctest

    from disagmoe_ds.comm import routing

    result = doctest.testmod(routing)
    assert result.attempted >= 3 and result.failed == 0
