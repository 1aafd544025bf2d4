"""The Triton SwiGLU kernels against autograd through the eager middle, in Triton's interpreter on the CPU (the
device runs them compiled: ``python -m disagmoe_ds.models.check --device cuda --dtype bf16 --compile``)."""

import json
import os
import subprocess
import sys

import pytest

from tests.conftest import ROOT

pytest.importorskip("triton")

SCRIPT = r"""
import torch, torch.nn.functional as F
from disagmoe_ds.models import grouped_experts, triton_swiglu
torch.manual_seed(0)
for pairs, inter, w_dtype in [(37, 48, torch.float32), (5, 300, torch.float64), (1, 16, torch.float32)]:
    gate_up = torch.randn(pairs, 2 * inter, requires_grad=True)
    w = torch.rand(pairs, dtype=w_dtype, requires_grad=True)
    d_hidden = torch.randn(pairs, inter)
    ref = grouped_experts._gated_eager(gate_up, w, F.silu)
    ref.backward(d_hidden)
    # tiles smaller than the shapes: several column blocks and a partial pair block
    tiles = {"BLOCK_P": 4, "BLOCK_I": 32, "num_warps": 1}
    hidden = triton_swiglu.swiglu_forward(gate_up.detach(), w.detach(), tiles)
    d_gate_up, d_w = triton_swiglu.swiglu_backward(gate_up.detach(), w.detach(), d_hidden, tiles)
    assert hidden.dtype == gate_up.dtype and d_w.dtype == w_dtype
    torch.testing.assert_close(hidden, ref.detach(), rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(d_gate_up, gate_up.grad, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(d_w, w.grad, rtol=1e-5, atol=1e-5)
print("ok")
"""

CLAMPED = r"""
import torch, torch.nn.functional as F
from disagmoe_ds.models import grouped_experts as ge, triton_swiglu

torch.manual_seed(0)
limit, tiles = 0.75, {"BLOCK_P": 4, "BLOCK_I": 32, "num_warps": 1}
for pairs, inter in [(37, 48), (5, 300)]:
    gate_up = torch.randn(pairs, 2 * inter)
    gate_up[0, :4] = torch.tensor([limit, -limit, 2 * limit, -2 * limit])  # on the bounds (gradient kept) and past
    gate_up[0, inter : inter + 4] = torch.tensor([limit, -limit, 2 * limit, -2 * limit])
    gate_up.requires_grad_()
    w = torch.rand(pairs, requires_grad=True)
    d_hidden = torch.randn(pairs, inter)
    ref = ge.ClampedGate(ge._gated_eager, limit)(gate_up, w, F.silu)  # the eager clamp, as DeepSeek-V4's experts
    ref.backward(d_hidden)
    assert (gate_up.grad == 0).float().mean() > 0.2  # the clamp cut a share of the gradients
    hidden = triton_swiglu.swiglu_forward(gate_up.detach(), w.detach(), tiles, limit=limit)
    d_gate_up, d_w = triton_swiglu.swiglu_backward(gate_up.detach(), w.detach(), d_hidden, tiles, limit=limit)
    torch.testing.assert_close(hidden, ref.detach(), rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(d_gate_up, gate_up.grad, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(d_w, w.grad, rtol=1e-5, atol=1e-5)

# through the experts: the Triton middle clamps in its kernels, the same as the eager clamp before the eager middle
triton_swiglu.runs_on = lambda t: True
rows, hidden_size, experts = 19, 32, 3
x = torch.randn(rows, hidden_size, requires_grad=True)
idx, w = torch.randint(0, experts + 1, (rows, 2)), torch.rand(rows, 2, requires_grad=True)
gate_up_w = torch.randn(experts, 2 * 48, hidden_size, requires_grad=True)
down_w = torch.randn(experts, hidden_size, 48, requires_grad=True)
outs = []
for gated in (ge.TritonSwiGLUOr(ge._gated_eager), ge._gated_eager):
    middle = ge.Elementwise(gated, ge._sum_slots_eager)
    y = ge.grouped_gated_experts(x, idx, w, gate_up_w, down_w, F.silu, elementwise=middle, limit=limit)
    outs.append([y, *torch.autograd.grad(y, [x, w, gate_up_w, down_w], torch.ones_like(y))])
assert isinstance(ge.clamped(ge.TritonSwiGLUOr(ge._gated_eager), limit), ge.TritonSwiGLUOr)
for a, b in zip(*outs, strict=True):
    torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
print("ok")
"""


@pytest.mark.parametrize("script", [SCRIPT, CLAMPED], ids=["plain", "clamped"])
def test_kernels_equal_autograd_through_the_eager_middle(script):
    """``clamped``: DeepSeek-V4's ``swiglu_limit`` inside the kernels against the eager clamp (``ClampedGate``),
    values on the bounds included, and through ``grouped_gated_experts``."""
    env = {**os.environ, "TRITON_INTERPRET": "1"}  # read when the kernels are decorated: a fresh process
    done = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.strip().endswith("ok")


def test_bench_times_both_middles_on_the_same_inputs(tmp_path):
    """bench/bench_swiglu.py, on CPU through the interpreter: one row per size, the kernels agreeing with inductor's
    middle (aot_eager here), a sweep that names its best tiles."""
    out = tmp_path / "swiglu.json"
    argv = ["bench/bench_swiglu.py", "--device", "cpu", "--sizes", "6x40", "--warmup", "0", "--iters", "1"]
    argv += ["--compile-backend", "aot_eager", "--w-dtype", "fp32", "--sweep", "--json", str(out)]
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": str(ROOT)}
    done = subprocess.run([sys.executable, *argv], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    (row,) = json.loads(out.read_text())
    assert (row["pairs"], row["inter"]) == (6, 40) and row["error"] < 1e-5
    assert row["triton_fwd_bwd_ms"] == row["triton_fwd_ms"] + row["triton_bwd_ms"] > 0
    assert [len(row[f"best_{k}"]) for k in ("fwd", "bwd")] == [3, 3]
    assert "best bwd tiles" in done.stdout
