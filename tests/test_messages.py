"""The typed exchange messages: wire specs derived from their fields, and the round trip through the wire."""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch

from disagmoe_ds.comm import ChannelError, Dims, ExpertOutGrad, Residual, TokenGrads, Tokens
from disagmoe_ds.comm.exchange import MESSAGE_TYPES, Kind, exchange_specs
from disagmoe_ds.fp8.quantize import round_trip

H, K, E, P = 8, 2, 6, 3
DIMS = Dims(H, K, E, P, torch.bfloat16, torch.float32)


def _tokens(rows: int, seed: int = 0) -> Tokens:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, H, generator=g).bfloat16()
    return Tokens.of(
        x, torch.randint(0, 4, (rows, K), generator=g), torch.rand(rows, K, generator=g), rows * K, fp8=False
    )


def _residual(rows_P: tuple[int, ...], *, routed: bool) -> Residual:
    T, S = 5, sum(max(r, 0) for r in rows_P)
    return Residual(
        torch.randn(T, H).bfloat16(),
        torch.arange(S),
        torch.arange(T),
        torch.zeros(T, 0).bfloat16(),  # no routed-sum weights (no hyper-connections)
        torch.zeros(T, 0, dtype=torch.int64),  # no token ids (no hash-routed layer)
        torch.ones(E),
        torch.rand(E),
        rows_P,
        Tokens.cat([_tokens(max(r, 0), seed=i) for i, r in enumerate(rows_P)]) if routed else None,
    )


def test_every_kind_has_a_type_and_the_specs_follow_the_fields() -> None:
    specs = exchange_specs(DIMS)
    assert set(MESSAGE_TYPES) == set(Kind) and set(specs) == set(Kind)
    m2n = specs[Kind.M2N]
    assert [t.dtype for t in m2n.tensors] == [torch.bfloat16, torch.int64, torch.float32, torch.float32]
    assert [t.shape for t in m2n.tensors] == [(H,), (K,), (K,), (0,)] and m2n.metas == 1 and m2n.coalesced
    resid = specs[Kind.RESID]
    assert [t.size for t in resid.tensors] == [0, 1, 0, 0, 0, None, None] and resid.metas == P and not resid.coalesced
    assert specs[Kind.N2M].metas == 0 and not specs[Kind.N2M].coalesced  # one tensor: nothing to coalesce


def test_resend_adds_the_variants_after_the_own_tensors() -> None:
    plain, resend = exchange_specs(DIMS), exchange_specs(DIMS, resend=True)
    for kind in (Kind.M2N, Kind.N2M, Kind.M2N_GRAD, Kind.RESID_GRAD):
        assert plain[kind] == resend[kind]
    assert resend[Kind.N2M_GRAD].tensors == plain[Kind.N2M_GRAD].tensors + plain[Kind.M2N].tensors
    routed = resend[Kind.RESID].tensors[7:]
    assert [t.size for t in routed] == [1, 1, 1, 1]  # the tokens' R rows counted as the residual's S
    assert resend[Kind.N2M_GRAD].fingerprint != plain[Kind.N2M_GRAD].fingerprint  # a mismatch fails loudly


@pytest.mark.parametrize("routed", [False, True])
@pytest.mark.parametrize("rows_P", [(2, 0, 3), (-1, -1, -1)], ids=["moe", "dense"])
def test_a_message_survives_the_wire(rows_P, routed) -> None:
    sent = _residual(rows_P, routed=routed)
    spec = Residual.spec(DIMS, resend=routed)
    assert spec.sizes_of(sent.tensors()) == (5, sum(max(r, 0) for r in rows_P))
    got = Residual.from_wire(
        spec.from_wire(spec.to_wire(sent.tensors()), spec.sizes_of(sent.tensors())), sent.host_ints()
    )
    assert got.rows_P == rows_P and got.is_moe == (rows_P[0] >= 0)
    assert all(torch.equal(a, b) for a, b in zip(got.tensors(), sent.tensors(), strict=True))
    assert (got.routed is None) == (not routed)
    if routed and got.is_moe:
        parts = got.routed.split(got.rows_P)
        assert [p.x_RH.shape[0] for p in parts] == list(rows_P)
        assert torch.equal(parts[2].x_RH, _tokens(3, seed=2).x_RH)


def test_split_and_cat_are_inverse_and_sum_the_host_ints() -> None:
    parts = [_tokens(r, seed=r) for r in (3, 0, 2)]
    whole = Tokens.cat(parts)
    assert whole.pairs == 5 * K and whole.x_RH.shape == (5, H)
    again = whole.split([3, 0, 2])
    assert all(torch.equal(a.w_RK, b.w_RK) for a, b in zip(again, parts, strict=True))
    grads = TokenGrads(torch.zeros(5, H), torch.ones(5, K)).split([4, 1])
    assert [g.dx_RH.shape[0] for g in grads] == [4, 1]


def test_a_variant_rides_along_and_detaches() -> None:
    x = torch.randn(3, H, requires_grad=True)
    resent = Tokens.of(x * 2, torch.zeros(3, K, dtype=torch.int64), torch.ones(3, K), 6, fp8=False)
    grad = ExpertOutGrad(torch.randn(3, H), resent.detached())
    assert len(grad.tensors()) == 5 and not grad.resent.x_RH.requires_grad and grad.resent.pairs == 6
    spec = ExpertOutGrad.spec(Dims(H, K, E, P, torch.float32, torch.float32), resend=True)
    assert spec.sizes_of(grad.tensors()) == (3,)
    with pytest.raises(ChannelError, match="expected 1 tensors"):  # sent with resend, declared without
        ExpertOutGrad.spec(Dims(H, K, E, P, torch.float32, torch.float32)).sizes_of(grad.tensors())


def test_detached_keeps_the_host_and_local_fields():
    x = torch.randn(2, H, requires_grad=True) * 1
    tokens = Tokens(x, torch.zeros(2, K, dtype=torch.int64), torch.ones(2, K), torch.ones(2, 0), 3, bounded=True)
    copy = tokens.detached()
    assert not copy.x_RH.requires_grad and copy.pairs == 3 and copy.bounded
    assert torch.equal(copy.x_RH, tokens.x_RH)


def test_fp8_tokens_travel_in_half_the_bytes_and_arrive_as_the_fp8_values() -> None:
    fp8 = dataclasses.replace(DIMS, fp8=True)
    plain, quantized = exchange_specs(DIMS)[Kind.M2N], exchange_specs(fp8)[Kind.M2N]
    assert [t.dtype for t in quantized.tensors] == [torch.float8_e4m3fn, torch.int64, torch.float32, torch.float32]
    assert quantized.tensors[3].shape == (1,)  # a rowwise scale beside each row
    assert _row_bytes(quantized.tensors[:1]) * 2 == _row_bytes(plain.tensors[:1])  # x: 1 byte per value, not 2
    x = torch.randn(5, H, requires_grad=True) * 3
    sent = Tokens.of(x, torch.zeros(5, K, dtype=torch.int64), torch.rand(5, K), 10, fp8=True)
    got = Tokens.from_wire(quantized.from_wire(quantized.to_wire(sent.tensors()), (5,)), sent.host_ints())
    assert got.pairs == 10 and torch.equal(got.rows(torch.bfloat16), round_trip(x.detach()).bfloat16())
    assert torch.equal(got.rows(torch.float32), round_trip(x.detach()))  # dequantizing is exact in either dtype
    assert not torch.equal(got.rows(torch.float32), x.detach())  # ... and FP8 rounded them


def _row_bytes(specs) -> int:
    return sum(t.dtype.itemsize * math.prod(t.shape) for t in specs)
