"""Token exchange: routing against a per-token loop, who talks to whom, the transports and the fan-out/fan-in protocol.

Legend: T tokens, H hidden, K top-k, E experts, R rows for one ep rank.
"""

from __future__ import annotations

from datetime import timedelta

import pytest
import torch
import torch.distributed as dist

from disagmoe_ds.comm import (
    ChannelError,
    CommStream,
    DispatchPlan,
    FanIn,
    FanOut,
    Kind,
    MessageSpec,
    Op,
    RendezvousTransport,
    TensorSpec,
    TorchTransport,
    TransportError,
    combine,
    comm_keys,
    comm_pairs,
    comm_ranks,
    endpoint,
    pack,
    plan_dispatch,
)
from disagmoe_ds.comm.channel import Headers
from disagmoe_ds.comm.transport import new_host_group
from disagmoe_ds.launch.testing import run_ranks
from disagmoe_ds.layout import Layout

H, K, E = 8, 2, 6
# fp64 routing math against an fp64 loop: only summation order differs.
TOL_FP64 = 1e-12
CPU = torch.device("cpu")
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="a CUDA device (0 here)")


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


@pytest.mark.parametrize("case", ["random", "skewed", "same_rank"])
@pytest.mark.parametrize("ep_size", [1, 2, 3, 6])
def test_start_dispatch_equals_plan_and_pack_without_a_sync(case: str, ep_size: int) -> None:
    """``start_dispatch`` (rows gathered at capacity, sizes read later) gives ``plan_dispatch`` + ``pack``'s plan,
    rows and gradients exactly, ep_size above top-k included (capacity K x T)."""
    from disagmoe_ds.comm.routing import start_dispatch

    gen = torch.Generator().manual_seed(5)
    x_TH = torch.randn(13, H, dtype=torch.float64, generator=gen, requires_grad=True)
    w_TK = torch.rand(13, K, dtype=torch.float64, generator=gen, requires_grad=True)
    idx_TK = routing_case(case, 13, seed=6)
    epr = E // ep_size
    plan = plan_dispatch(idx_TK, ep_size, epr)
    pieces = pack(x_TH, w_TK, plan)
    pending = start_dispatch(x_TH, w_TK, idx_TK, ep_size, epr)
    assert pending.ready() and pending.landed is None  # CPU: the sizes are on the host at once
    got_plan, got_pieces = pending.resolved
    assert (got_plan.counts, got_plan.pairs) == (plan.counts, plan.pairs)
    assert torch.equal(got_plan.token_idx_S, plan.token_idx_S) and torch.equal(got_plan.local_idx_SK, plan.local_idx_SK)
    g = [torch.randn_like(x) for x, _ in pieces]
    want = torch.autograd.grad(sum((x * gx).sum() + w.sum() for (x, w), gx in zip(pieces, g)), (x_TH, w_TK))
    got = torch.autograd.grad(sum((x * gx).sum() + w.sum() for (x, w), gx in zip(got_pieces, g)), (x_TH, w_TK))
    for (x, w), (gx_, gw_) in zip(pieces, got_pieces, strict=True):
        assert torch.equal(x, gx_) and torch.equal(w, gw_)
    for a, b in zip(got, want, strict=True):
        assert torch.equal(a, b)


@pytest.mark.parametrize("case", ["random", "skewed", "same_rank"])
@pytest.mark.parametrize("ep_size", [2, 3, 6])
@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=needs_cuda)])
def test_dispatch_at_a_capacity_combines_as_the_exact_plan_and_says_what_it_needed(case, ep_size, device) -> None:
    """At a ``Capacity`` every ep rank's message has its fixed rows (padding: every id the sentinel, weight 0), made
    without a host sync (CUDA: sync debug mode raises on one); combining outputs that are zero on padding rows gives
    the exact plan's result and gradients bit for bit when the capacity holds, and ``need_2`` is the most rows and
    pairs one message wanted, also when it does not hold."""
    from disagmoe_ds.comm.routing import Capacity, start_dispatch

    gen = torch.Generator().manual_seed(7)
    x_TH = torch.randn(13, H, dtype=torch.float64, generator=gen).to(device).requires_grad_()
    w_TK = torch.rand(13, K, dtype=torch.float64, generator=gen).to(device).requires_grad_()
    idx_TK = routing_case(case, 13, seed=8).to(device)
    epr = E // ep_size
    plan = plan_dispatch(idx_TK, ep_size, epr)
    need = (max(plan.counts), max(plan.pairs))

    def expert(x_RH, w_RK, idx_RK):  # any per-row function that is 0 on rows with no local pair
        return x_RH * (w_RK * (idx_RK < epr)).sum(1, keepdim=True)

    want_y = combine([expert(x, w, i) for (x, w), i in zip(pack(x_TH, w_TK, plan), plan.local_idx_RK)], plan)
    want = torch.autograd.grad(want_y.square().sum(), (x_TH, w_TK))
    for rows, pairs in (need, (need[0] + 3, need[1] + 5), (need[0] - 1, need[1])):
        capacity = Capacity(13, rows, pairs, K)
        if device == "cuda":
            torch.cuda.set_sync_debug_mode("error")
        try:
            pending = start_dispatch(x_TH, w_TK, idx_TK, ep_size, epr, capacity)
            got_plan, pieces = pending.resolved
        finally:
            torch.cuda.set_sync_debug_mode("default") if device == "cuda" else None
        assert got_plan.counts == (rows,) * ep_size and [x.shape[0] for x, _ in pieces] == [rows] * ep_size
        assert tuple(pending.need_2.tolist()) == need
        if capacity.holds(*need):
            y = combine([expert(x, w, i) for (x, w), i in zip(pieces, got_plan.local_idx_RK)], got_plan)
            assert torch.equal(y, want_y)
            for a, b in zip(torch.autograd.grad(y.square().sum(), (x_TH, w_TK)), want, strict=True):
                assert torch.equal(a, b)


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
    (4, 4, 4, 1),
    (6, 6, 3, 1),
]


def make_layout(m: int, n: int, p: int, edp: int) -> Layout:
    return Layout(attention_gpus=m, ffn_gpus=n, depth=p, num_layers=2 * p, num_experts=E, expert_data_parallel=edp)


@pytest.mark.parametrize("shape", LAYOUTS)
def test_communicators_are_few_one_way_and_agree_at_both_ends(shape: tuple[int, int, int, int]) -> None:
    layout = make_layout(*shape)
    p = layout.depth
    keys = comm_keys(layout)
    assert len(keys) == len(set(keys)) == 4 * p + 2 * p * (p > 1)
    sends = {}  # (comm key, src, dst) -> kind
    for rank in range(layout.world_size):
        role = layout.role_of(rank)
        kinds = [Kind.M2N, Kind.N2M_GRAD, *([Kind.RESID, Kind.RESID_GRAD] if p > 1 else [])]
        out = kinds if role.is_attention else [Kind.N2M, Kind.M2N_GRAD]
        member_of = {key for key in keys if rank in comm_ranks(layout, *key)}
        assert len(member_of) <= (8 if role.is_attention else 4)  # O(1) per rank, whatever M, N and p
        for kind in out:
            key, peers = endpoint(layout, kind, rank, sending=True)
            assert key[0] == kind and key in member_of and {rank, *peers} <= set(comm_ranks(layout, *key))
            sends.update({(key, rank, peer): kind for peer in peers})
    # Every send has a receiver that expects it on the same communicator, and nothing else is expected.
    expected = set()
    for rank in range(layout.world_size):
        role = layout.role_of(rank)
        kinds = [Kind.N2M, Kind.M2N_GRAD, *([Kind.RESID, Kind.RESID_GRAD] if p > 1 else [])]
        for kind in kinds if role.is_attention else [Kind.M2N, Kind.N2M_GRAD]:
            key, peers = endpoint(layout, kind, rank, sending=False)
            expected |= {(key, peer, rank) for peer in peers}
    assert expected == set(sends)
    # The pairs each communicator connects up front are exactly those that send on it.
    assert {(key, s, d) for key in keys for s, d in comm_pairs(layout, *key)} == set(sends)


# ----- transports (2 ranks) -----
def _crossed_sends_body(rank: int, transport_name: str, comms: int) -> str:
    """Both ranks send first, then receive. On one communicator, under rendezvous, each send waits for a receive
    queued behind the other rank's send: a cycle. On two one-way communicators nothing waits behind anything."""
    transport = {"rendezvous": RendezvousTransport, "torch": TorchTransport}[transport_name](timedelta(seconds=3))
    first = transport.new_comm("first", [0, 1])
    second = transport.new_comm("second", [0, 1]) if comms == 2 else first
    mine, theirs = (first, second) if rank == 0 else (second, first)
    data, got = torch.full((4,), float(rank)), torch.empty(4)
    try:
        sent = transport.start(mine, [Op("send", data, 1 - rank)])
        received = transport.start(theirs, [Op("recv", got, 1 - rank)])
        received.wait()
        sent.wait()
    except TransportError as err:
        return str(err)
    return f"got {got[0].item():g}"


@pytest.mark.parametrize(
    ("transport", "comms", "outcome"),
    [("torch", 1, "got"), ("rendezvous", 1, "rendezvous transport:"), ("rendezvous", 2, "got")],
)
def test_rendezvous_transport_exposes_what_gloo_hides(transport: str, comms: int, outcome: str) -> None:
    results = run_ranks(_crossed_sends_body, 2, args=(transport, comms), timeout_s=60)
    assert all(outcome in r for r in results), results
    if outcome != "got":  # the first rank to time out names the deadlock; its peer may see it close instead
        assert any("did not complete within 3 s" in r for r in results), results
    if outcome == "got":
        assert results == ["got 1", "got 0"]


def _host_groups_body(rank: int) -> dict[str, object]:
    # A bound device on the default group (DeepSpeed binds the GPU) sends a rank outside a new gloo group down
    # torch's communicator-split path (on NCCL: a split its members never join, so new_group hangs); gloo's CPU
    # device shows the same path as an error.
    default = dist.distributed_c10d._get_default_group()
    default.bound_device_id = torch.device("cpu", 0)
    try:
        dist.new_group([0, 2], backend="gloo")
        plain = "created"
    except (RuntimeError, ValueError) as err:
        plain = type(err).__name__
    groups = [new_host_group(ranks) for ranks in ([0, 2], [1, 3], [0, 1, 2, 3])]
    mine = groups[rank % 2]
    total = torch.tensor([float(rank)])
    dist.all_reduce(total, group=mine)
    return {"plain": plain, "sum": total.item(), "bound": str(default.bound_device_id)}


def test_host_groups_with_ranks_left_out_on_a_device_bound_job() -> None:
    results = run_ranks(_host_groups_body, 4, timeout_s=60)
    assert [r["sum"] for r in results] == [2.0, 4.0, 2.0, 4.0]
    assert all(r["bound"] == "cpu:0" for r in results)  # restored
    assert results[1]["plain"] != "created"  # what new_host_group avoids


# ----- fan-out / fan-in (2 ranks) -----
MESSAGE = MessageSpec(
    (TensorSpec(torch.bfloat16, (H,)), TensorSpec(torch.int64, (K,)), TensorSpec(torch.float32, (K,))), name="tokens"
)
FIXED = MessageSpec((TensorSpec(torch.float32, (3,), size=None), TensorSpec(torch.int64, (2,), size=1)), name="fixed")
ROWS = [3, 0, 7, 1]


def _message(rows: int, seed: int) -> tuple[torch.Tensor, ...]:
    gen = torch.Generator().manual_seed(seed)
    x_RH = torch.randn(rows, H, generator=gen).bfloat16()
    idx_RK = torch.randint(0, 1 << 40, (rows, K), generator=gen)  # needs all 64 bits
    return x_RH, idx_RK, torch.rand(rows, K, generator=gen)


def _ends(transport, spec: MessageSpec, rank: int, *, headers: bool, sender_spec: MessageSpec | None = None):
    comm = transport.new_comm(spec.name, [0, 1])
    header = Headers(dist.new_group([0, 1], backend="gloo")) if headers else None
    if rank == 0:
        return FanOut(transport, comm, [1], sender_spec or spec, header)
    return FanIn(transport, comm, [0], spec, header, CPU, CommStream(CPU))


def _fan_body(rank: int) -> dict[str, object]:
    transport = RendezvousTransport(timedelta(seconds=30))
    ordered = _ends(transport, MESSAGE, rank, headers=True)
    known = _ends(transport, FIXED, rank, headers=False)
    two_tensors = MessageSpec(MESSAGE.tensors[:2], name="tokens")  # the receiver declares three
    mismatch = _ends(transport, MESSAGE, rank, headers=True, sender_spec=two_tensors)
    if rank == 0:
        for i, rows in enumerate(ROWS):  # all in flight at once: the host never waits for a receive
            ordered.send([_message(rows, i)], tag=10 + i, metas=[(rows * 2,)])
        known.send([(torch.arange(3.0), torch.arange(10).view(5, 2))], tag=1)
        mismatch.send([_message(0, 0)[:2]], tag=0)
        for end in (ordered, known, mismatch):
            end.wait_all()
        return {}
    arrivals = [ordered.expect(10 + i) for i in range(len(ROWS))]  # header receives posted before any size is known
    for arrival in arrivals:
        ordered.read_headers(arrival)
        ordered.post(arrival)
    got = [ordered.complete(arrival)[1][0] for arrival in arrivals]
    exact = all(
        all(torch.equal(a, b) for a, b in zip(msg, _message(rows, i), strict=True))
        for i, (msg, rows) in enumerate(zip(got, ROWS, strict=True))
    )
    fixed = known.expect(1)
    fixed.sizes = [(0, 5)]  # the receiver knows the sizes itself: no header
    known.post(fixed)
    errors = []
    try:
        mismatch.read_headers(mismatch.expect(0))
    except ChannelError as err:
        errors.append(str(err))
    metas = [a.metas[0][0] for a in arrivals]
    rows = [m[0].shape[0] for m in got]
    return {"exact": exact, "rows": rows, "metas": metas, "fixed": known.complete(fixed)[1][0], "errors": errors}


def test_fan_in_fifo_sizes_dtypes_and_checks() -> None:
    _, result = run_ranks(_fan_body, 2)
    assert result["exact"] and result["rows"] == ROWS and result["metas"] == [2 * r for r in ROWS]
    values, rows = result["fixed"]
    assert values.tolist() == [0.0, 1.0, 2.0] and rows.tolist() == [[0, 1], [2, 3], [4, 5], [6, 7], [8, 9]]
    assert "spec differs" in result["errors"][0]


def test_coalesced_message_round_trips_through_one_byte_buffer() -> None:
    """Odd widths (bf16 x 3 = 6 bytes a row) need the padding; zero rows give an empty buffer."""
    spec = MessageSpec(
        (TensorSpec(torch.bfloat16, (3,)), TensorSpec(torch.int64, (K,)), TensorSpec(torch.float32, (K,))),
        coalesced=True,
    )
    for rows in (0, 1, 5):
        gen = torch.Generator().manual_seed(rows)
        message = (
            torch.randn(rows, 3, generator=gen).bfloat16(),
            torch.randint(0, 1 << 40, (rows, K), generator=gen),
            torch.rand(rows, K, generator=gen),
        )
        wire = spec.to_wire(message)
        assert wire.dtype == torch.uint8 and wire.numel() == spec.wire_bytes((rows,))
        assert all(torch.equal(a, b) for a, b in zip(spec.from_wire(wire.clone(), (rows,)), message, strict=True))
    with pytest.raises(ChannelError, match="only messages of row tensors"):
        MessageSpec(FIXED.tensors, coalesced=True)


def test_fan_out_checks_the_spec_locally() -> None:
    x_RH, idx_RK, w_RK = _message(2, 0)
    with pytest.raises(ChannelError, match=r"tensor 2 is torch.float64\[2, 2\], the spec wants torch.float32"):
        MESSAGE.sizes_of((x_RH, idx_RK, w_RK.double()))
    with pytest.raises(ChannelError, match=r"tensor 1 is torch.int64\[3, 2\], the spec wants torch.int64\[2, 2\]"):
        MESSAGE.sizes_of((x_RH, _message(3, 0)[1], w_RK))


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
