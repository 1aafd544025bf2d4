"""The FP8 SwiGLU middle (``triton_swiglu.swiglu_fp8_forward`` / ``_backward``, ``models.fp8_experts``) in Triton's
interpreter on the CPU: its e4m3 rows and scales are ``fp8.quantize``'s bit for bit and e4m3's nearest values (a
float64 reference), and the experts through it compute exactly what the unfused FP8 path computes, forward and every
gradient (the device runs them compiled: ``bench/check_fp8_cuda.py``)."""

import os
import subprocess
import sys

import pytest

from tests.conftest import ROOT

pytest.importorskip("triton")

KERNELS = r"""
import torch, triton, triton.language as tl
from disagmoe_ds.fp8 import triton_e4m3 as e4m3
from disagmoe_ds.fp8.quantize import E4M3_MAX, quantize
from disagmoe_ds.models import triton_swiglu as ts
from tests.test_fp8 import _e4m3_round

def same(a, b):  # bit for bit: e4m3 as bytes (-0.0 is not 0.0), float32 scales exactly; NaN where the other has NaN
    nan = a.float().isnan()  # (a NaN's own bits are the platform's: x86's default NaN is negative, CUDA's is not)
    bits = lambda t: t.view(torch.uint8) if t.dtype.itemsize == 1 else t
    return torch.equal(nan, b.float().isnan()) and torch.equal(bits(a)[~nan], bits(b)[~nan])

@triton.jit
def quantize_rows(x_ptr, q_ptr, scale_ptr, cols, BLOCK: tl.constexpr):
    row = tl.program_id(0)
    offs = tl.arange(0, BLOCK)
    x = tl.load(x_ptr + row * cols + offs[None, :], mask=offs[None, :] < cols, other=0.0)  # one row: [1, BLOCK]
    amax, nan = e4m3.amax_stats(tl.zeros((1,), dtype=tl.float32), tl.zeros((1,), dtype=tl.int32), 1, x)
    exponent = e4m3.scale_exponent(amax, nan)
    tl.store(scale_ptr + row + tl.arange(0, 1), e4m3.pow2(exponent))
    q = e4m3.e4m3_bits(x, e4m3.inverse_scale(exponent)[:, None])
    tl.store(q_ptr + row * cols + offs[None, :], q, mask=offs[None, :] < cols)

# the quantization helpers on rows that probe them: ties, scales on their boundaries, e4m3 subnormals, signed zeros
torch.manual_seed(0)
x = torch.randn(48, 24) * torch.logspace(-40, 30, 48)[:, None]
x[0, :8] = torch.tensor([448.0, 1.0625, 17.0, 19.0, -0.0, 3 * 2**-10, 2**-10, -(2**-10)])  # ties to even, at scale 1
x[1, 0] = E4M3_MAX * (1 + 2**-23)  # just past a power of two: scale 2
x[2, 0], x[3, 0] = E4M3_MAX * 2.0**-20, E4M3_MAX * 2.0**7  # exactly on one
x[4, 0] = 1.75 * 2**-126  # a row of float32's smallest normals: scale 2^-126
x[5], x[6, :3] = 0.0, torch.tensor([1.4e-45, -0.0, 3e-42])  # all zero (scale 1); denormal (zeros, the smallest scale)
x[7, :2], x[8, :2] = torch.tensor([float("inf"), -2.0]), torch.tensor([float("nan"), float("-inf")])  # as torch's:
# an infinite amax: an infinite scale, NaN for the infinite value and 0 for the others; a NaN: scale 1, NaN stays NaN
q = torch.empty(48, 24, dtype=torch.float8_e4m3fn)
scale = torch.empty(48, 1)
quantize_rows[(48,)](x, q.view(torch.uint8), scale, 24, BLOCK=32)
ref = quantize(x, -1)
assert same(scale, ref.scale) and same(q, ref.data), (scale - ref.scale).abs().max()
expected = [[_e4m3_round(v) for v in row] for row in (x[:7].double() / scale[:7].double()).tolist()]
assert q[:7].double().tolist() == expected

# the kernels: their rows as the unfused kernels write them, quantized as fp8.quantize does
tiles = {"BLOCK_P": 4, "BLOCK_I": 32, "num_warps": 1}  # several column blocks and a partial pair block
for dtype in (torch.float32, torch.bfloat16):
    for pairs, inter in [(37, 48), (5, 300), (1, 16)]:
        gate_up = (torch.randn(pairs, 2 * inter) * torch.logspace(-3, 3, pairs)[:, None]).to(dtype)
        gate_up[0] = 0.0
        ones = torch.ones(pairs, dtype=dtype)
        hidden, hidden_q = ts.swiglu_fp8_forward(gate_up, tiles)
        assert same(hidden, ts.swiglu_forward(gate_up, ones, tiles))
        assert same(hidden_q.data, quantize(hidden, -1).data) and same(hidden_q.scale, quantize(hidden, -1).scale)
        d_hidden = torch.randn(pairs, inter).to(dtype)
        d_gate_up, d_q = ts.swiglu_fp8_backward(gate_up, d_hidden, True, tiles)
        assert same(d_gate_up, ts.swiglu_backward(gate_up, ones, d_hidden, tiles)[0])
        assert same(d_q.data, quantize(d_gate_up, -1).data) and same(d_q.scale, quantize(d_gate_up, -1).scale)
        unquantized, none = ts.swiglu_fp8_backward(gate_up, d_hidden, False, tiles)
        assert none is None and same(unquantized, d_gate_up)
print("ok")
"""

EXPERTS = r"""
import torch, torch.nn.functional as F
from disagmoe_ds.fp8.quantize import round_trip
from disagmoe_ds.models import fp8_experts, grouped_experts as ge, triton_swiglu

triton_swiglu.runs_on = lambda t: True  # the Triton middle on CPU rows, through the interpreter
middle = ge.Elementwise(ge.TritonSwiGLUOr(ge._gated_eager), ge._sum_slots_eager)
fused_calls = []
original = fp8_experts.fp8_routed_experts
ge.fp8_routed_experts = lambda *a: fused_calls.append(1) or original(*a)
unfused = lambda *a: False

def run(dtype, recompute, fused, split):
    torch.manual_seed(0)
    rows, hidden, inter, experts = 21, 64, 272, 4  # 272: two of the kernels' 256-wide column blocks
    x = round_trip(torch.randn(rows, hidden).to(dtype)).requires_grad_()  # the routed rows, FP8 values
    idx = torch.randint(0, experts + 1, (rows, 2))  # id 4: another rank's expert (a sentinel)
    w = torch.rand(rows, 2, dtype=dtype, requires_grad=True)
    gate_up = (torch.randn(experts, 2 * inter, hidden) / 8).to(dtype).requires_grad_()
    down = (torch.randn(experts, hidden, inter) / 16).to(dtype).requires_grad_()
    ge.fused_fp8_middle, saved = (fused_fp8_middle if fused else unfused), ge.fused_fp8_middle
    try:
        y = ge.grouped_gated_experts(x, idx, w, gate_up, down, F.silu, elementwise=middle, recompute=recompute,
                                     fp8=True)
        dy = torch.randn_like(y)
        if split:  # a split backward: B (the input gradients), then W (the parameters)
            grads = torch.autograd.grad(y, [x, w], dy, retain_graph=True)
            grads += torch.autograd.grad(y, [gate_up, down], dy)
        else:
            grads = torch.autograd.grad(y, [x, w, gate_up, down], dy)
    finally:
        ge.fused_fp8_middle = saved
    return [y.detach(), *grads]

fused_fp8_middle = ge.fused_fp8_middle
for dtype in (torch.float32, torch.bfloat16):
    for recompute in (False, True):
        for split in (False, True):
            calls = len(fused_calls)
            want, got = run(dtype, recompute, False, split), run(dtype, recompute, True, split)
            assert len(fused_calls) == calls + 1  # the fused node ran, once
            for name, a, b in zip(["y", "dx", "dw", "d_gate_up", "d_down"], got, want, strict=True):
                assert torch.equal(a, b), (dtype, recompute, split, name, (a - b).abs().max())
print("ok")
"""


def _interpreted(script: str) -> None:
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": str(ROOT)}  # read at decoration: a fresh process
    done = subprocess.run(
        [sys.executable, "-c", script], cwd=ROOT, env=env, capture_output=True, text=True, timeout=600
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.strip().endswith("ok")


def test_the_fp8_middle_writes_what_fp8_quantize_makes_of_its_rows() -> None:
    _interpreted(KERNELS)


def test_the_fused_fp8_experts_equal_the_unfused_fp8_path_bit_for_bit() -> None:
    _interpreted(EXPERTS)
