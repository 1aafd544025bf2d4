"""FP8 building blocks against float64: the e4m3 rounding of ``quantize``, the FP8 GEMMs, and both projections'
forward and backward (each GEMM of the rowwise recipe recomputed in float64 from the same FP8 operands)."""

from __future__ import annotations

import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from disagmoe_ds.fp8 import group_columns
from disagmoe_ds.fp8.gemm import scaled_grouped_mm, scaled_mm, tile_split
from disagmoe_ds.fp8.group_columns import quantize_group_columns
from disagmoe_ds.fp8.projections import fp8_grouped_mm, fp8_linear
from disagmoe_ds.fp8.quantize import E4M3, dequantize, quantize, round_trip


def _e4m3_round(v: float) -> float:
    """``v`` rounded to the nearest e4m3 value (ties to even), in float64: 3 mantissa bits, normals from 2^-6,
    subnormals spaced 2^-9, saturating at 448."""
    if v == 0:
        return 0.0
    exponent = max(math.floor(math.log2(abs(v))), -6)
    step = 2.0 ** (exponent - 3)
    steps = v / step
    nearest = math.floor(steps + 0.5)
    if nearest - steps == 0.5 and nearest % 2:  # a tie: to even
        nearest -= 1
    return max(-448.0, min(448.0, nearest * step))


@pytest.mark.parametrize("dim", [0, -1])
def test_quantize_rounds_to_the_nearest_e4m3_value_at_a_power_of_two_scale(dim: int) -> None:
    torch.manual_seed(0)
    x = torch.randn(16, 24, dtype=torch.float64) * torch.logspace(-3, 3, 24, dtype=torch.float64)
    x[3] = 0.0
    q = quantize(x, dim)
    amax = x.abs().amax(dim=dim, keepdim=True)
    assert q.scale.shape == amax.shape and torch.all(torch.log2(q.scale) == torch.log2(q.scale).round())
    fills = amax / q.scale.double()
    assert torch.all((fills > 224) & (fills <= 448) | (amax == 0))  # the range used, nothing saturates
    expected = [[_e4m3_round(v) for v in row] for row in (x / q.scale.double()).tolist()]
    assert q.data.double().tolist() == expected
    assert torch.equal(dequantize(q).double(), q.data.double() * q.scale.double())  # exact: power-of-two scales
    assert torch.all((dequantize(q).double() - x).abs() <= amax / 448 * 2**-3 + x.abs() * 2**-4)


def test_a_slice_of_denormal_values_quantizes_to_zeros_not_nan() -> None:
    """A gradient row whose largest value is a float32 denormal (skewed routing gives such rows): ``amax / 448``
    underflows to 0, and a scale of 0 would make the row NaN and the step's gradients with it."""
    x = torch.tensor([[1.4e-45, -0.0, 3e-42], [1.0, -2.0, 0.5], [0.0, 0.0, 0.0]])
    q = quantize(x, -1)
    assert torch.isfinite(q.data.float()).all() and torch.equal(q.data[0].float(), torch.zeros(3))
    assert q.scale[0].item() == torch.finfo(torch.float32).tiny and q.scale[2].item() == 1.0
    assert torch.equal(dequantize(q)[1], x[1])


def test_the_fp8_values_of_rows_quantize_to_themselves_and_pass_the_gradient_straight_through() -> None:
    torch.manual_seed(0)
    x = torch.randn(64, 32) * torch.logspace(-4, 4, 64)[:, None]
    x[0] = torch.linspace(-3, 3, 32)
    x[0, 0] = 230.0  # scale 1, and 230 rounds down to 224: quantized again, the row takes scale 1/2
    x[1] = 0.0
    x.requires_grad_(True)
    y = round_trip(x)
    assert torch.equal(y, dequantize(quantize(x.detach(), -1)))
    assert y[0, 0] == 224 and quantize(y.detach(), -1).scale[0] == 0.5
    assert torch.equal(dequantize(quantize(y.detach(), -1)), y)  # what the experts' own quantization makes of it
    assert torch.equal(round_trip(y.detach().bfloat16()).float(), y)  # exact in bf16 too
    grad = torch.randn_like(x)
    y.backward(grad)
    assert torch.equal(x.grad, grad)


def test_the_fp8_gemms_multiply_the_fp8_values_exactly() -> None:
    torch.manual_seed(0)
    a, b = quantize(torch.randn(32, 64), -1), quantize(torch.randn(48, 64), -1)
    exact = dequantize(a).double() @ dequantize(b).double().t()
    torch.testing.assert_close(scaled_mm(a, b, torch.float32).double(), exact, rtol=1e-6, atol=1e-5)
    offsets = torch.tensor([10, 10, 30], dtype=torch.int32)  # an empty group, and rows past the last
    w = quantize(torch.randn(3, 48, 64), -1)
    out = scaled_grouped_mm(a, w, offsets, torch.float32).double()
    for g, (start, end) in enumerate([(0, 10), (10, 10), (10, 30)]):
        exact = dequantize(a).double()[start:end] @ dequantize(w).double()[g].t()
        torch.testing.assert_close(out[start:end], exact, rtol=1e-6, atol=1e-5)


@pytest.mark.parametrize(
    ("rows", "experts", "n", "k", "split"),
    [
        (32768, 128, 1536, 2048, 2),  # Qwen3-30B-A3B's gate_up at 4,096 tokens: 256 rows a group, torch's slow tile
        (32768, 128, 2048, 768, 2),  # its down projection
        (65536, 128, 1536, 2048, 4),  # twice the tokens: 4 groups an expert bring the mean to 128 rows
        (32768, 256, 4096, 7168, 1),  # DeepSeek-V3's: 128 rows a group, already the small tile
        (32768, 16, 1536, 2048, 1),  # 16 experts of a rank: 2,048 rows a group, torch's large tile
        (32768, 128, 3072, 4096, 1),  # N and K past 2,048: the large tile
        (4096, 1, 1536, 2048, 1),  # one expert: groups cannot lower its rows
    ],
)
def test_the_grouped_gemm_shows_torch_split_groups_only_where_its_tile_is_the_slow_one(rows, experts, n, k, split):
    assert tile_split(rows, experts, n, k) == split


def _q64(x: torch.Tensor, dim: int) -> torch.Tensor:
    return dequantize(quantize(x, dim)).double()


def test_fp8_linear_runs_the_rowwise_recipe_forward_and_backward() -> None:
    torch.manual_seed(0)
    x = torch.randn(4, 8, 64, requires_grad=True)
    w = torch.randn(48, 64, requires_grad=True)
    bias = torch.randn(48, requires_grad=True)
    y = fp8_linear(x, w, bias)
    dy = torch.randn_like(y)
    y.backward(dy)
    x2, dy2 = x.detach().reshape(-1, 64), dy.reshape(-1, 48)
    torch.testing.assert_close(y.detach().double().reshape(-1, 48), _q64(x2, -1) @ _q64(w.detach(), -1).t()
                               + bias.detach().double(), rtol=1e-5, atol=1e-4)  # fmt: skip
    dx = _q64(dy2, -1) @ _q64(w.detach().t(), -1).t()  # dy per token, W per input channel
    dw = _q64(dy2.t(), -1) @ _q64(x2.t(), -1).t()  # both per channel, over the tokens
    torch.testing.assert_close(x.grad.double().reshape(-1, 64), dx, rtol=1e-5, atol=1e-4)
    torch.testing.assert_close(w.grad.double(), dw, rtol=1e-5, atol=1e-4)
    torch.testing.assert_close(bias.grad, dy2.sum(0))
    exact = F.linear(x.detach(), w.detach(), bias.detach())
    assert (y - exact).norm() / exact.norm() < 0.06  # e4m3's rounding of both operands


def test_fp8_grouped_mm_runs_the_rowwise_recipe_per_expert_group() -> None:
    torch.manual_seed(0)
    x = torch.randn(40, 64, requires_grad=True)
    w = torch.randn(3, 48, 64, requires_grad=True)  # [e, N, K]: HF's fused expert layout
    offsets = torch.tensor([12, 12, 32], dtype=torch.int32)  # an empty expert; rows 32.. in none (unread)
    y = fp8_grouped_mm(x, w, offsets)
    dy = torch.randn_like(y)
    y[:32].backward(dy[:32])
    for g, (start, end) in enumerate([(0, 12), (12, 12), (12, 32)]):
        xg, dyg, wg = x.detach()[start:end], dy[start:end], w.detach()[g]
        torch.testing.assert_close(y.detach()[start:end].double(), _q64(xg, -1) @ _q64(wg, -1).t(), rtol=1e-5,
                                   atol=1e-4)  # fmt: skip
        torch.testing.assert_close(x.grad[start:end].double(), _q64(dyg, -1) @ _q64(wg.t(), -1).t(), rtol=1e-5,
                                   atol=1e-4)  # fmt: skip
        dw = dyg.double().t() @ xg.double()  # the experts' dW in high precision
        torch.testing.assert_close(w.grad[g].double(), dw, rtol=1e-5, atol=1e-4)


def test_the_measured_fp8_expert_weight_grad_scales_both_operands_per_expert_and_channel() -> None:
    """``group_columns.grouped_weight_grad`` (benchmarked, not trained with): both operands per channel over each
    expert's own tokens; an expert without tokens gets zeros."""
    torch.manual_seed(0)
    dy, x = torch.randn(40, 48), torch.randn(40, 64)
    offsets = torch.tensor([12, 12, 32], dtype=torch.int32)
    got = group_columns.grouped_weight_grad(dy, x, offsets)
    for g, (start, end) in enumerate([(0, 12), (12, 12), (12, 32)]):
        dyg, xg = dy[start:end], x[start:end]
        dw = _q64(dyg.t(), -1) @ _q64(xg.t(), -1).t() if end > start else torch.zeros(48, 64, dtype=torch.float64)
        torch.testing.assert_close(got[g].double(), dw, rtol=1e-5, atol=1e-4)


GROUPS = [(0, 5), (5, 5), (5, 30), (30, 47)]  # ragged, an empty one, rows after the last (47..49: in none)


def test_an_expert_gradient_operand_is_each_group_s_columns_quantized_transposed_and_16_aligned() -> None:
    """``quantize_group_columns``: group g's rows are ``quantize(x_g, 0)`` (one scale per column over the group's
    rows), transposed, starting at a multiple of 16, zeros up to the next group."""
    torch.manual_seed(0)
    x = torch.randn(50, 24) * torch.logspace(-3, 3, 24)
    x[30:47, 3] = 0.0  # a column of zeros in one group: scale 1
    offsets = torch.tensor([end for _, end in GROUPS], dtype=torch.int32)
    q = quantize_group_columns(x, offsets)
    assert q.data.dtype == E4M3 and q.offsets.tolist() == [16, 16, 48, 80] and q.data.shape[1] >= 80
    values, start = q.dequantize(), 0
    for g, (first, end) in enumerate(GROUPS):
        rows = end - first
        if rows:
            want = quantize(x[first:end], 0)
            assert torch.equal(q.scale[g], want.scale[0])
            assert torch.equal(values[:, start : start + rows], dequantize(want).t())
        assert not values[:, start + rows : int(q.offsets[g])].any()  # the padding
        start = int(q.offsets[g])
    assert q.scale[3, 3] == 1.0


GROUP_KERNEL_SCRIPT = r"""
import torch
from disagmoe_ds.fp8 import group_columns
torch.manual_seed(0)
for dtype in (torch.float32, torch.bfloat16):
    x = (torch.randn(50, 40) * torch.logspace(-30, 30, 40)).to(dtype)
    x[0, 0], x[6, 1], x[7, 2] = float("nan"), float("inf"), -0.0  # a NaN column, an infinite one
    x[30:47, 3] = 0.0
    offsets = torch.tensor([5, 5, 30, 47], dtype=torch.int32)
    want = group_columns.quantize_group_columns(x, offsets)
    group_columns.runs_on = lambda t: True
    got = group_columns.quantize_group_columns(x, offsets)
    group_columns.runs_on = lambda t: False
    end = int(want.offsets[-1])
    assert torch.equal(got.data.view(torch.uint8)[:, :end], want.data.view(torch.uint8)[:, :end]), dtype
    assert torch.equal(got.scale, want.scale) and torch.equal(got.offsets, want.offsets)
print("ok")
"""


def test_the_group_column_kernel_writes_torch_s_bytes() -> None:
    """The Triton kernel (CUDA) in Triton's interpreter: the bytes, scales and offsets of the torch path, NaN,
    infinities, zeros, float32 and bf16 inputs included."""
    pytest.importorskip("triton")
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": str(Path(__file__).resolve().parents[1])}
    done = subprocess.run([sys.executable, "-c", GROUP_KERNEL_SCRIPT], env=env, capture_output=True, text=True,
                          timeout=300)  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.strip().endswith("ok")


def test_the_quantizations_compile_to_the_same_bits() -> None:
    """What CUDA runs (``fused_on_cuda``: the rowwise quantization compiled) equals the eager code,
    scales on their boundaries included (here compiled for the CPU: the same graph, another code generator)."""
    from disagmoe_ds.fp8.quantize import E4M3_MAX, rowwise

    torch.manual_seed(0)
    x = torch.randn(40, 32) * torch.logspace(-5, 5, 40)[:, None]
    x[:4, 0] = E4M3_MAX * torch.tensor([1.0, 2.0**-3, 2.0**7, 2.0**-20])  # amax exactly on a power of two
    x[4, 0] = E4M3_MAX * (1 + 2**-23)  # just past one
    x[5] = 0.0
    eager, fused = rowwise.__wrapped__, torch.compile(rowwise.__wrapped__, dynamic=True)
    for got, want in zip(fused(x), eager(x), strict=True):
        assert torch.equal(got.float(), want.float())
    assert torch.equal(eager(x)[1][:5, 0], torch.tensor([1.0, 2.0**-3, 2.0**7, 2.0**-20, 2.0]))
    data, _ = fused(x.t())  # a transposed operand: its FP8 copy comes out row-major
    assert data.is_contiguous() and torch.equal(data.float(), eager(x.t().contiguous())[0].float())


def test_a_step_casts_each_expert_weight_once_until_the_weights_change(monkeypatch) -> None:
    """Inside ``cast_once_per_step`` an expert weight's two FP8 copies are made at its first use and reused by every
    later micro-batch and pass, the result bit for bit the per-call cast's; ``weights_changed`` (the optimizer step)
    makes the next use cast the new values; a weight made in the call (here a slice) is cast every time, and so is a
    linear layer's (small, and cast inside compiled parts)."""
    from disagmoe_ds.fp8 import projections, weight_cache

    cached, per_call = [], []
    monkeypatch.setattr(weight_cache, "quantize", lambda x, dim: cached.append(x.shape) or quantize(x, dim))
    monkeypatch.setattr(projections, "quantize", lambda x, dim: per_call.append(x.shape) or quantize(x, dim))
    torch.manual_seed(0)
    w_e, w = nn.Parameter(torch.randn(3, 48, 64)), nn.Parameter(torch.randn(64, 32))
    x, offsets = torch.randn(40, 32, requires_grad=True), torch.tensor([10, 20, 40], dtype=torch.int32)

    def step() -> list[torch.Tensor]:
        fp8_grouped_mm(fp8_linear(x, w), w_e, offsets).square().sum().backward()
        grads = [w.grad.clone(), w_e.grad.clone()]
        w.grad = w_e.grad = None
        return grads

    first = step()
    assert len(cached) == 2 and (64, 32) in per_call and (32, 64) in per_call  # w_e and its transpose; w, w^T
    with weight_cache.cast_once_per_step():
        for _ in range(3):
            linear_casts = len(per_call)
            assert all(torch.equal(a, b) for a, b in zip(step(), first, strict=True))
            assert (64, 32) in per_call[linear_casts:]  # the linear's weight again
        assert len(cached) == 4  # the expert weight's two copies, made once in the scope
        with torch.no_grad():
            w_e.mul_(2)
        weight_cache.weights_changed()
        y = fp8_grouped_mm(x @ w.t(), w_e, offsets)
        torch.testing.assert_close(y, 2 * fp8_grouped_mm(x @ w.t(), w_e.detach() / 2, offsets))
        fp8_grouped_mm(x @ w.t(), w_e[:2], offsets[:2])
        fp8_grouped_mm(x @ w.t(), w_e[:2], offsets[:2])
    assert len(cached) == 4 + 1 + 1 + 2  # w_e again, the reference's w_e / 2, each slice
    fp8_grouped_mm(x @ w.t(), w_e, offsets)
    assert len(cached) == 9  # outside the scope nothing is kept


def test_a_weight_handed_over_transposed_is_cast_once_too(monkeypatch) -> None:
    """HF hands GPT-OSS's experts (stored ``[e, in, out]``) to the grouped GEMM transposed: that view is the parameter
    with its last two dimensions swapped, so its copies are kept for the step like any whole parameter's (they were
    cast in every call: twice the bf16 layer's time on an H100), bit for bit the per-call cast's, and one orientation
    of the parameter is one copy whichever way it is asked for."""
    from disagmoe_ds.fp8 import weight_cache

    cached = []
    monkeypatch.setattr(weight_cache, "quantize", lambda x, dim: cached.append(x.shape) or quantize(x, dim))
    torch.manual_seed(0)
    w_in_out = nn.Parameter(torch.randn(3, 32, 48))
    x, offsets = torch.randn(40, 32, requires_grad=True), torch.tensor([10, 20, 40], dtype=torch.int32)

    def step() -> tuple[torch.Tensor, torch.Tensor]:
        fp8_grouped_mm(x, w_in_out.transpose(1, 2), offsets).square().sum().backward()
        grads = (x.grad.clone(), w_in_out.grad.clone())
        x.grad = w_in_out.grad = None
        return grads

    per_call = step()
    with weight_cache.cast_once_per_step():
        for _ in range(3):
            assert all(torch.equal(a, b) for a, b in zip(step(), per_call, strict=True))
        assert len(cached) == 2 + 2  # the per-call step's two casts, then the scope's two
        kept = weight_cache.quantized_weight(w_in_out, transposed=True)
        assert kept is weight_cache.quantized_weight(w_in_out.transpose(1, 2)) and len(cached) == 4
        weight_cache.quantized_weight(w_in_out[:, :16].transpose(1, 2))  # a slice: cast, not kept
        assert len(cached) == 5


def test_routed_rows_in_fp8_are_kept_in_fp8_for_the_weight_gradient() -> None:
    """Rows that are FP8 values already (the routed tokens, as the lever sends them) are kept for dW as their e4m3
    bytes and scales, not as the [P, K] input, and give bit for bit the gradients of keeping the input."""
    torch.manual_seed(0)
    x = round_trip(torch.randn(40, 64, dtype=torch.bfloat16)).requires_grad_()
    w = torch.randn(3, 48, 64, dtype=torch.bfloat16, requires_grad=True)
    offsets, dy = torch.tensor([12, 12, 40], dtype=torch.int32), torch.randn(40, 48, dtype=torch.bfloat16)
    grads, kept = [], {}
    for fp8_rows in (False, True):
        saved: list[tuple[torch.dtype, tuple[int, ...]]] = []
        with torch.autograd.graph.saved_tensors_hooks(
            lambda t, s=saved: s.append((t.dtype, tuple(t.shape))) or t, lambda t: t
        ):
            y = fp8_grouped_mm(x, w, offsets, fp8_rows=fp8_rows)
        kept[fp8_rows] = [dtype for dtype, shape in saved if shape == (40, 64)]
        grads.append(torch.autograd.grad(y, [x, w], dy))
    assert kept == {False: [torch.bfloat16], True: [E4M3]}
    assert all(torch.equal(a, b) for a, b in zip(*grads, strict=True))
