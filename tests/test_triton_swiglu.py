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


def test_kernels_equal_autograd_through_the_eager_middle():
    env = {**os.environ, "TRITON_INTERPRET": "1"}  # read when the kernels are decorated: a fresh process
    done = subprocess.run([sys.executable, "-c", SCRIPT], env=env, capture_output=True, text=True, timeout=300)
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
